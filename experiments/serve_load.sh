#!/usr/bin/env bash
# Serving under load (issue 15): start `specjax serve` for one method, sweep request rates with
# `specjax bench-serve` (held-out chat prompts, loopback only), hold 64 concurrent clients, and stop
# the server with SIGTERM; batch-1 AR is measured first on the same prompts, for the ratio. Results go to $OUT (default runs/serve_load).
#
#   bash experiments/serve_load.sh METHOD [RATES] [REQUESTS] [MAX_TOKENS] [SLOTS]
#   bash experiments/serve_load.sh chain 0.1,0.3,1,3 12 64 8
#   SERVE_ARGS="--insert-rows 8" bash experiments/serve_load.sh ar 1,8 64 64 32
#   SERVE_ARGS="--insert-rows 8 --dtype bfloat16 --query-rows 0" bash experiments/serve_load.sh ar 1,8 64 64 32
set -euo pipefail
METHOD=${1:-chain}
RATES=${2:-0.1,0.3,1,3}
REQUESTS=${3:-12}
MAX_TOKENS=${4:-64}
SLOTS=${5:-8}
OUT=${OUT:-runs/serve_load}
PORT=${PORT:-8137}
mkdir -p "$OUT"
URL="http://127.0.0.1:$PORT"

# Batch-1 AR on the same prompts and token count, in the same run, at both precisions (bf16 single
# rows unpadded): the faster is the baseline of the 5x goal.
for PRECISION in float32 bfloat16; do
  specjax bench --methods ar --max-new-tokens "$MAX_TOKENS" --dtype "$PRECISION" --query-rows 0 --json \
    | tail -1 > "$OUT/batch1_ar_$PRECISION.json"
  python -c "import json,sys; r=json.load(open(sys.argv[1])); print('batch-1 AR', sys.argv[2], round(r['methods']['ar']['tokens_per_s'], 1), 'tok/s')" \
    "$OUT/batch1_ar_$PRECISION.json" "$PRECISION"
done

# shellcheck disable=SC2086  # SERVE_ARGS: extra serve options, word-split on purpose
specjax serve --method "$METHOD" --slots "$SLOTS" --context-length 512 --max-new-tokens 256 --port "$PORT" ${SERVE_ARGS:-} \
  --metrics-log "$OUT/$METHOD.requests.jsonl" > "$OUT/$METHOD.server.log" 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 600); do
  curl -sf "$URL/ready" > /dev/null && break
  sleep 1
done

specjax bench-serve --url "$URL" --rates "$RATES" --num-requests "$REQUESTS" --max-tokens "$MAX_TOKENS" \
  --plot "$OUT/$METHOD.load.png" --json | tee "$OUT/$METHOD.sweep.txt"
# 64 clients at once: every one must be answered (completed, or 429 if the queue were full).
specjax bench-serve --url "$URL" --max-concurrency 64 --num-requests 64 --max-tokens 16 --json \
  | tee "$OUT/$METHOD.concurrency64.txt"
curl -s "$URL/metrics" > "$OUT/$METHOD.metrics.txt"
kill -TERM $SERVER
wait $SERVER || true
trap - EXIT
echo "results in $OUT"
