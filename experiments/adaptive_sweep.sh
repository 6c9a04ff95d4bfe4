#!/usr/bin/env bash
# The adaptive controller against fixed policies across a load sweep (issue 16): for each server
# method, start `specjax serve`, wait until every policy is compiled, then hold 1, 4 and 8 concurrent
# clients on the held-out chat prompts with `specjax bench-serve` (loopback only), scrape /metrics,
# and stop the server. One process per method, run one after another, so timings never overlap.
# A summary table goes to stdout and $OUT/summary.md (default runs/adaptive_sweep).
#
#   bash experiments/adaptive_sweep.sh [METHODS] [CONCURRENCIES] [MAX_TOKENS] [SLOTS]
#   bash experiments/adaptive_sweep.sh adaptive,ar,chain,chain:3 1,4,8 64 8
#   SERVE_ARGS="--dtype bfloat16 --query-rows 0" bash experiments/adaptive_sweep.sh
set -euo pipefail
METHODS=${1:-adaptive,ar,chain,chain:3}
CONCURRENCIES=${2:-1,4,8}
MAX_TOKENS=${3:-64}
SLOTS=${4:-8}
OUT=${OUT:-runs/adaptive_sweep}
PORT=${PORT:-8139}
mkdir -p "$OUT"
URL="http://127.0.0.1:$PORT"

for METHOD in ${METHODS//,/ }; do
  NAME=${METHOD//:/_}
  # shellcheck disable=SC2086  # SERVE_ARGS: extra serve options, word-split on purpose
  specjax serve --method "$METHOD" --slots "$SLOTS" --context-length 512 --max-new-tokens 256 --port "$PORT" \
    ${SERVE_ARGS:-} --metrics-log "$OUT/$NAME.requests.jsonl" > "$OUT/$NAME.server.log" 2>&1 &
  SERVER=$!
  trap 'kill -TERM $SERVER 2>/dev/null || true' EXIT
  for _ in $(seq 900); do
    if curl -sf "$URL/health" > /dev/null; then
      # An adaptive server answers while its other policies compile: wait for all of them.
      [ "$METHOD" != adaptive ] || grep -q "policies ready" "$OUT/$NAME.server.log" && break
    fi
    sleep 1
  done
  for C in ${CONCURRENCIES//,/ }; do
    specjax bench-serve --url "$URL" --max-concurrency "$C" --num-requests $((C < 2 ? 6 : 3 * C)) \
      --max-tokens "$MAX_TOKENS" --json | tail -1 > "$OUT/$NAME.c$C.json"
    curl -s "$URL/metrics" > "$OUT/$NAME.c$C.metrics.txt"
    python -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[2], sys.argv[3], 'clients:', round(r['output_token_throughput'], 1), 'tok/s')" "$OUT/$NAME.c$C.json" "$METHOD" "$C"
  done
  kill -TERM $SERVER
  wait $SERVER || true
  trap - EXIT
done
python experiments/adaptive_report.py "$OUT" "$METHODS" "$CONCURRENCIES" | tee "$OUT/summary.md"
