#!/bin/bash
# Serving speed before and after a change: `specjax serve` from two source trees, back to back, twice
# (ABAB), each loaded at one request rate by this tree's `specjax bench-serve` (the same client).
#   git worktree add /tmp/before <commit>; bash experiments/serve_before_after.sh [OUT_DIR]
# writes OUT_DIR/{before,main}-{1,2}.json (bench-serve's JSON line) and prints the medians side by side.
# BEFORE / AFTER: the source trees; SERVE_ARGS (default "--method chain --slots 8"); RATE (requests per
# second, default 1); REQUESTS (default 24); MAX_TOKENS (default 64).
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-runs/serve-ab}")
mkdir -p "$out"
after=${AFTER:-$PWD}
cd /tmp  # not a source tree: PYTHONPATH alone picks the specjax that runs
port=18437
ready() {  # a newer server answers /ready once compiled; an older one listens only then (/health, no /ready)
  curl -sf localhost:$port/ready > /dev/null && return 0
  [ "$(curl -s -o /dev/null -w '%{http_code}' localhost:$port/ready)" = 404 ] && curl -sf localhost:$port/health > /dev/null
}
for round in 1 2; do
  for tree in before main; do
    root=${BEFORE:-/tmp/before}; [ $tree = main ] && root=$after
    PYTHONPATH=$root python -c "import specjax, sys; print('serving from', specjax.__file__, file=sys.stderr)"
    PYTHONPATH=$root python -m specjax.cli serve --port $port ${SERVE_ARGS:---method chain --slots 8} \
      > "$out/serve-$tree-$round.log" 2>&1 &
    pid=$!
    until ready; do kill -0 $pid || { echo "the $tree server exited; see $out/serve-$tree-$round.log"; exit 1; }; sleep 1; done
    PYTHONPATH=$after python -m specjax.cli bench-serve --url http://127.0.0.1:$port --request-rate ${RATE:-1} \
      --num-requests ${REQUESTS:-24} --max-tokens ${MAX_TOKENS:-64} --json 2>/dev/null | tail -1 > "$out/$tree-$round.json"
    kill -TERM $pid; wait $pid || true
  done
done
python - "$out" <<'PY'
import json, statistics, sys
from pathlib import Path

runs = {tree: [json.loads((Path(sys.argv[1]) / f"{tree}-{r}.json").read_text()) for r in (1, 2)] for tree in ("before", "main")}
def figure(tree, key, sub=None):
    return statistics.median(r[key] if sub is None else r[key][sub] for r in runs[tree])
for key, sub in (("output_token_throughput", None), ("tpot_ms", "p50"), ("ttft_ms", "p50")):
    before, main = figure("before", key, sub), figure("main", key, sub)
    print(f"{key}{'.' + sub if sub else ''}: before {before:.2f}, after {main:.2f}, after/before {main / before:.3f}")
PY
