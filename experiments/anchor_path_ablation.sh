#!/usr/bin/env bash
# Issue 14, item 1: what the anchor path buys. Two SmolLM2 drafters trained on the same data, with
# the same seed, batches and steps, one with DrafterConfig.anchor_path and one without (DFlash's
# layout, where the anchor token reaches the draft slots only through attention). Then
# experiments/anchor_path_report.py compares their slot-1 anchor sensitivity, held-out
# teacher-forced accuracy and real greedy chain decoding.
#
#   bash experiments/anchor_path_ablation.sh [OUT]     (STEPS, PROMPTS, CORPUS override the sizes)
set -euo pipefail
OUT=${1:-runs/anchor-ablation}
STEPS=${STEPS:-500}
PROMPTS=${PROMPTS:-384}
CORPUS=${CORPUS:-256}
common=(--chat-prompts "$PROMPTS" --corpus-sequences "$CORPUS" --steps "$STEPS" --json)
specjax train-drafter --out "$OUT/with" "${common[@]}"
mkdir -p "$OUT/without"
ln -sfn ../with/data "$OUT/without/data"   # identical data: built once
specjax train-drafter --out "$OUT/without" --no-anchor-path "${common[@]}"
python experiments/anchor_path_report.py "$OUT/with" "$OUT/without"
