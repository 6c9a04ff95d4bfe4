#!/usr/bin/env bash
# The adaptive controller against fixed policies across a load sweep (issue 16). Every server method
# runs as its own `specjax serve` (loopback only), all up at once; each compiles while the others
# idle, and an adaptive server also waits until every policy is compiled. Then the load is
# interleaved: for each repetition and request rate, every server in turn (the order rotated each
# time) gets the same held-out chat prompts at the same arrival times through `specjax bench-serve`.
# This host's speed drifts by up to 1.4x within minutes, which a sweep running one server after
# another turns into differences between methods; interleaved, the drift falls on every method alike.
# Idle servers only wait. Afterwards /metrics is scraped and every server stopped. A table (each
# figure the mean over repetitions) goes to stdout and $OUT/summary.md, a plot of throughput and
# p50/p99 TPOT against rate to $OUT/sweep.png, and the monitoring report of each run log to
# $OUT/<method>.report.png (default OUT: runs/adaptive_sweep).
#
#   bash experiments/adaptive_sweep.sh [METHODS] [RATES] [REQUESTS] [MAX_TOKENS] [SLOTS]
#   bash experiments/adaptive_sweep.sh adaptive,ar,chain,tree,tree@16 0.1,0.4,0.8,1.6 16 64 8
#   REPS=3 SERVE_ARGS="--dtype bfloat16" bash experiments/adaptive_sweep.sh
# A method written M@N is method M with a fixed tree of N nodes (--tree-budget N). REPS (default 2):
# repetitions of the whole rate sweep.
set -euo pipefail
METHODS=${1:-adaptive,ar,chain,tree,tree@16}
RATES=${2:-0.1,0.4,0.8,1.6}
REQUESTS=${3:-16}
MAX_TOKENS=${4:-64}
SLOTS=${5:-8}
REPS=${REPS:-2}
OUT=${OUT:-runs/adaptive_sweep}
PORT=${PORT:-8139}
mkdir -p "$OUT"
ENTRIES=(${METHODS//,/ })
SERVERS=()
trap 'for pid in "${SERVERS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done' EXIT

url() { echo "http://127.0.0.1:$((PORT + $1))"; }
name() { local entry=$1; echo "${entry//[:@]/_}"; }

for I in "${!ENTRIES[@]}"; do
  ENTRY=${ENTRIES[$I]}
  METHOD=${ENTRY%@*}
  EXTRA=()
  [ "$ENTRY" = "$METHOD" ] || EXTRA=(--tree-budget "${ENTRY#*@}")
  NAME=$(name "$ENTRY")
  rm -f "$OUT/$NAME.run.jsonl" "$OUT/$NAME".rep*.json
  # shellcheck disable=SC2086  # SERVE_ARGS: extra serve options, word-split on purpose
  specjax serve --method "$METHOD" "${EXTRA[@]}" --slots "$SLOTS" --context-length 512 --max-new-tokens 256 \
    --port "$((PORT + I))" ${SERVE_ARGS:-} --metrics-log "$OUT/$NAME.run.jsonl" > "$OUT/$NAME.server.log" 2>&1 &
  SERVERS+=($!)
  READY=
  for _ in $(seq 900); do  # one at a time, so compiles never overlap
    # /ready answers 200 once every policy is compiled (an adaptive server's included).
    if curl -sf "$(url "$I")/ready" > /dev/null; then READY=1; break; fi
    kill -0 "${SERVERS[$I]}" 2>/dev/null || break
    sleep 1
  done
  [ -n "$READY" ] || { echo "server $ENTRY did not come up; see $OUT/$NAME.server.log" >&2; exit 1; }
done

RATE_LIST=(${RATES//,/ })
N=${#ENTRIES[@]}
for REP in $(seq "$REPS"); do
  for R in "${!RATE_LIST[@]}"; do
    RATE=${RATE_LIST[$R]}
    for K in $(seq 0 $((N - 1))); do
      I=$(( (K + REP + R) % N ))  # rotate who goes first
      ENTRY=${ENTRIES[$I]}
      NAME=$(name "$ENTRY")
      specjax bench-serve --url "$(url "$I")" --rates "$RATE" --num-requests "$REQUESTS" --max-tokens "$MAX_TOKENS" \
        --json > "$OUT/$NAME.rep$REP.rate$R.txt"
      tail -1 "$OUT/$NAME.rep$REP.rate$R.txt" > "$OUT/$NAME.rep$REP.rate$R.json"
      grep "^rate" "$OUT/$NAME.rep$REP.rate$R.txt" | sed "s/^/rep $REP $ENTRY /"
    done
  done
done

for I in "${!ENTRIES[@]}"; do
  ENTRY=${ENTRIES[$I]}
  NAME=$(name "$ENTRY")
  curl -s "$(url "$I")/metrics" > "$OUT/$NAME.metrics.txt"
  kill -TERM "${SERVERS[$I]}"
  wait "${SERVERS[$I]}" || true
done
trap - EXIT
for ENTRY in "${ENTRIES[@]}"; do
  NAME=$(name "$ENTRY")
  specjax report "$OUT/$NAME.run.jsonl" --out "$OUT/$NAME.report.png" --title "$ENTRY, rates $RATES" \
    > "$OUT/$NAME.report.txt"
done
python experiments/adaptive_report.py "$OUT" "$METHODS" | tee "$OUT/summary.md"
