#!/bin/bash
# Decode speed before and after a change: the same `specjax bench` from two source trees, back to
# back, twice (ABAB), on the first 4 built-in held-out chat prompts.
#   git worktree add /tmp/before <commit>; bash experiments/bench_before_after.sh
# writes /tmp/ab_{before,main}_{1,2}.json (the bench's JSON line). BEFORE=... and AFTER=... override the trees.
set -euo pipefail
python - <<'PY'
from specjax.data.prompts import HELDOUT_CHAT_PROMPTS
open("/tmp/ab_prompts.txt", "w").write("\n".join(p.replace("\n", " ") for p in HELDOUT_CHAT_PROMPTS[:4]) + "\n")
PY
cd /tmp
for round in 1 2; do
  for tree in before main; do
    root=${BEFORE:-/tmp/before}; [ $tree = main ] && root=${AFTER:-/work/main}
    PYTHONPATH=$root python -c "import specjax,sys; print(specjax.__file__, file=sys.stderr)" 
    PYTHONPATH=$root python -m specjax.cli bench --methods ar,chain,tree --max-new-tokens 64 --json \
      --prompts-file /tmp/ab_prompts.txt 2>/dev/null | tail -1 > /tmp/ab_${tree}_${round}.json
  done
done
