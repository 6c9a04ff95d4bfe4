#!/usr/bin/env bash
# Every GPU check owed, in one short run on a lent GPU machine (about 10 minutes in all on an H200, most of it compiling):
#   bash experiments/gpu_checks.sh [OUT_DIR]
# 1. the tree-attention kernel (issue 5): correctness and timing against XLA;
# 2. the windowed-attention kernels, forward and backward (issue 6): correctness, timing against
#    XLA, achieved TFLOP/s against the chip's peak.
# Tables go to stdout and OUT_DIR/*.json (default: $OUT, else runs/gpu). Copy them into BENCHMARKS.md.
set -u
out="${1:-${OUT:-runs/gpu}}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>/dev/null || true
python experiments/gpu_tree_attention_check.py --budget-s 170 --json "$out/tree_attention.json"
tree_status=$?
python experiments/gpu_window_attention_check.py --budget-s 380 --json "$out/window_attention.json"
window_status=$?
echo "tree check exit $tree_status, window check exit $window_status"
exit $(( tree_status || window_status ))
