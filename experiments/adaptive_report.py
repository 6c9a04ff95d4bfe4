"""Summarise `experiments/adaptive_sweep.sh`: output tok/s and TPOT per method and concurrency, the
adaptive server's ratio to the best fixed policy at each load, and what its controller did.

    python experiments/adaptive_report.py OUT_DIR METHODS CONCURRENCIES
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from specjax.serve.top import parse_metrics


def main(out: str, methods: str, concurrencies: str) -> None:
    folder = Path(out)
    methods, loads = methods.split(","), [int(c) for c in concurrencies.split(",")]
    rows = {(m, c): json.loads((folder / f"{m.replace(':', '_')}.c{c}.json").read_text()) for m in methods for c in loads}
    print("| method | " + " | ".join(f"{c} clients: tok/s (TPOT p50)" for c in loads) + " |")
    print("|---|" + "---|" * len(loads))
    for m in methods:
        cells = [f"{rows[m, c]['output_token_throughput']:.1f} ({rows[m, c]['tpot_ms']['p50']:.0f} ms)" for c in loads]
        print(f"| {m} | " + " | ".join(cells) + " |")
    fixed = [m for m in methods if m != "adaptive"]
    if "adaptive" in methods and fixed:
        print()
        for c in loads:
            best = max(fixed, key=lambda m: rows[m, c]["output_token_throughput"])
            ratio = rows["adaptive", c]["output_token_throughput"] / rows[best, c]["output_token_throughput"]
            print(f"- {c} clients: adaptive / best fixed ({best}) = {ratio:.2f}")
        print()
        for c in loads:  # the counters are cumulative: each run's switches are the difference
            snap = parse_metrics((folder / f"adaptive.c{c}.metrics.txt").read_text())
            switches = {k.removeprefix("switches_"): int(v) for k, v in snap.counters.items()
                        if k.startswith("switches_")}
            print(f"- adaptive, switches by reason after the {c}-client run (cumulative): {switches}")
        records = [json.loads(line) for line in (folder / "adaptive.requests.jsonl").read_text().splitlines()]
        steps: dict[str, int] = {}
        for record in records:
            for policy, count in record.get("policy_steps", {}).items():
                steps[policy] = steps.get(policy, 0) + count
        print(f"- adaptive, request steps by policy over the whole sweep: {steps}")


if __name__ == "__main__":
    main(*sys.argv[1:4])
