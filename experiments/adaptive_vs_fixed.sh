#!/bin/bash
# Issue 46: the default adaptive server against each fixed policy, each from a fresh start, loaded
# from the first request after /ready: `specjax bench-serve` with 1 and then 16 concurrent clients
# (closed loop, held-out chat prompts), on a 16-slot server.
#   bash experiments/adaptive_vs_fixed.sh [OUT_DIR]   (OUT_DIR/{policy}-{clients}.json and a table)
# POLICIES (default "adaptive ar chain"), SLOTS (16), MAX_TOKENS (64), REQUESTS_1 (8), REQUESTS_16 (32),
# SERVE_ARGS: extra serve flags.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/adaptive-vs-fixed}
mkdir -p "$out"
port=18441
for policy in ${POLICIES:-adaptive ar chain}; do
  start=$(date +%s.%N)
  # shellcheck disable=SC2086
  specjax serve --method $policy --slots ${SLOTS:-16} --port $port ${SERVE_ARGS:-} > "$out/serve-$policy.log" 2>&1 &
  pid=$!
  until curl -sf localhost:$port/ready > /dev/null; do
    kill -0 $pid || { echo "the $policy server exited; see $out/serve-$policy.log"; exit 1; }; sleep 0.5
  done
  echo "$policy ready in $(echo "$(date +%s.%N) - $start" | bc) s"
  for clients in 1 16; do
    requests=$([ $clients = 1 ] && echo ${REQUESTS_1:-8} || echo ${REQUESTS_16:-32})
    specjax bench-serve --url http://127.0.0.1:$port --max-concurrency $clients --num-requests $requests \
      --max-tokens ${MAX_TOKENS:-64} --json 2>/dev/null | tail -1 > "$out/$policy-$clients.json"
  done
  kill -TERM $pid; wait $pid || true
done
python - "$out" ${POLICIES:-adaptive ar chain} <<'PY'
import json, sys
from pathlib import Path

out, policies = Path(sys.argv[1]), sys.argv[2:]
print("| clients | " + " | ".join(policies) + " | adaptive against the best fixed |")
print("|---" * (len(policies) + 2) + "|")
for clients in (1, 16):
    speed = {p: json.loads((out / f"{p}-{clients}.json").read_text())["output_token_throughput"] for p in policies}
    fixed = [s for p, s in speed.items() if p != "adaptive"]
    ratio = f"{speed['adaptive'] / max(fixed):.2f}x" if "adaptive" in speed and fixed else "-"
    print(f"| {clients} | " + " | ".join(f"{speed[p]:.1f} tok/s" for p in policies) + f" | {ratio} |")
PY
