#!/bin/bash
# Issue 46: cold and warm start-up of `specjax serve` (to /health 200 and to /ready 200) and of `specjax demo`,
# on this host; the compilation cache is cleared before each cold start.
#   bash experiments/startup_times.sh [OUT_DIR]    (OUT_DIR/startup.jsonl, and each run's log)
# SERVE_ARGS adds serve flags (e.g. "--compile-rest while-idle"); STARTS picks the starts, in order, from
# serve-cold serve-warm demo-cold demo-warm (default: all four; a cold start clears the cache first).
cd "$(dirname "$0")/.."
out=${1:-runs/startup}
mkdir -p $out
port=18431
serve_once() {  # $1: label
  local start=$(date +%s.%N) health= ready=
  specjax serve --slots 8 --port $port $SERVE_ARGS > $out/serve-$1.log 2>&1 &
  local pid=$!
  while kill -0 $pid 2>/dev/null; do
    now=$(date +%s.%N)
    [ -z "$health" ] && curl -sf localhost:$port/health > /dev/null && health=$(echo "$now - $start" | bc)
    curl -sf localhost:$port/ready > /dev/null && { ready=$(echo "$now - $start" | bc); break; }
    sleep 0.5
  done
  kill -TERM $pid; wait $pid
  echo "{\"what\": \"serve $1\", \"serve_args\": \"$SERVE_ARGS\", \"seconds_to_health\": $health, \"seconds_to_ready\": $ready}" | tee -a $out/startup.jsonl
}
demo_once() {
  local start=$(date +%s.%N)
  specjax demo > $out/demo-$1.log 2>&1
  echo "{\"what\": \"demo $1\", \"seconds\": $(echo "$(date +%s.%N) - $start" | bc)}" | tee -a $out/startup.jsonl
}
rm -f $out/startup.jsonl
for start in ${STARTS:-serve-cold serve-warm demo-cold demo-warm}; do
  [ "${start#*-}" = cold ] && specjax cache clear
  ${start%-*}_once ${start#*-}
done
