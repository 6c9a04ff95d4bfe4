#!/usr/bin/env bash
# The adaptive controller against fixed policies across a load sweep (issue 16): for each server
# method, start `specjax serve`, wait until every policy is compiled, then sweep request rates from
# idle to past saturation with `specjax bench-serve --rates` on the held-out chat prompts (loopback
# only, the same prompts and arrival times for every method), scrape /metrics, and stop the server.
# One server at a time, so timings never overlap. A table goes to stdout and $OUT/summary.md, a plot
# of throughput and p50/p99 TPOT against rate to $OUT/sweep.png, and the monitoring report of each
# run log to $OUT/<method>.report.png (default OUT: runs/adaptive_sweep).
#
#   bash experiments/adaptive_sweep.sh [METHODS] [RATES] [REQUESTS] [MAX_TOKENS] [SLOTS]
#   bash experiments/adaptive_sweep.sh adaptive,ar,chain,tree,tree@16 0.1,0.4,0.8,1.6 16 64 8
#   SERVE_ARGS="--dtype bfloat16 --query-rows 0" bash experiments/adaptive_sweep.sh
# A method written M@N is method M with a fixed tree of N nodes (--tree-budget N).
set -euo pipefail
METHODS=${1:-adaptive,ar,chain,tree,tree@16}
RATES=${2:-0.1,0.4,0.8,1.6}
REQUESTS=${3:-16}
MAX_TOKENS=${4:-64}
SLOTS=${5:-8}
OUT=${OUT:-runs/adaptive_sweep}
PORT=${PORT:-8139}
mkdir -p "$OUT"
URL="http://127.0.0.1:$PORT"

for ENTRY in ${METHODS//,/ }; do
  METHOD=${ENTRY%@*}
  EXTRA=()
  [ "$ENTRY" = "$METHOD" ] || EXTRA=(--tree-budget "${ENTRY#*@}")
  NAME=${ENTRY//[:@]/_}
  rm -f "$OUT/$NAME.run.jsonl"
  # shellcheck disable=SC2086  # SERVE_ARGS: extra serve options, word-split on purpose
  specjax serve --method "$METHOD" "${EXTRA[@]}" --slots "$SLOTS" --context-length 512 --max-new-tokens 256 \
    --port "$PORT" ${SERVE_ARGS:-} --metrics-log "$OUT/$NAME.run.jsonl" > "$OUT/$NAME.server.log" 2>&1 &
  SERVER=$!
  trap 'kill -TERM $SERVER 2>/dev/null || true' EXIT
  for _ in $(seq 900); do
    if curl -sf "$URL/health" > /dev/null; then
      # An adaptive server answers while its other policies compile: wait for all of them.
      [ "$METHOD" != adaptive ] || grep -q "policies ready" "$OUT/$NAME.server.log" && break
    fi
    sleep 1
  done
  specjax bench-serve --url "$URL" --rates "$RATES" --num-requests "$REQUESTS" --max-tokens "$MAX_TOKENS" \
    --json | tee "$OUT/$NAME.bench.txt" | tail -1 > "$OUT/$NAME.sweep.json"
  grep "^rate" "$OUT/$NAME.bench.txt" | sed "s/^/$ENTRY /"
  curl -s "$URL/metrics" > "$OUT/$NAME.metrics.txt"
  kill -TERM $SERVER
  wait $SERVER || true
  trap - EXIT
  specjax report "$OUT/$NAME.run.jsonl" --out "$OUT/$NAME.report.png" --title "$ENTRY, rates $RATES" \
    > "$OUT/$NAME.report.txt"
done
python experiments/adaptive_report.py "$OUT" "$METHODS" | tee "$OUT/summary.md"
