"""Where a self-distillation generator step goes (issue 14, item 5): one `decode_steps` call of the
refill generator (specjax.train.selfdistill) at a given row count, timed, then profiled, with the
device time grouped by compiled operation kind and output shape.

    python experiments/generator_step_profile.py [--rows 128] [--dtype bfloat16] [--fill 120]

Every row decodes from slot `--fill` of a `row_length`-slot cache (the recipe's 128 + 128), so the
timing is one steady-state step, inserts excluded. The profile comes from jax.profiler's trace of
one call; on XLA:CPU each compiled operation (a fusion, a dot) is one event.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--fill", type=int, default=120, help="slots already filled in every row")
    parser.add_argument("--steps-per-sync", type=int, default=16)
    parser.add_argument("--top", type=int, default=16, help="operation groups to list")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from specjax.io.registry import at_compute_dtype, load_model
    from specjax.train.selfdistill import GeneratorConfig, decode_steps, empty_state

    model = at_compute_dtype(load_model("smollm2"), args.dtype)
    gen = GeneratorConfig(batch_size=args.rows, steps_per_sync=args.steps_per_sync)
    statics = dict(config=model.config, gen=gen, eos_token_ids=())
    rows = args.rows

    def fresh(state):
        return state.replace(lengths=jnp.full((rows,), args.fill, jnp.int32), done=jnp.zeros((rows,), bool),
                             num_generated=jnp.zeros((rows,), jnp.int32))

    state = decode_steps(model.params, fresh(empty_state(model.config, gen)), **statics)
    seconds = []
    for _ in range(3):
        state = jax.block_until_ready(fresh(state))
        start = time.perf_counter()
        state = jax.block_until_ready(decode_steps(model.params, state, **statics))
        seconds.append((time.perf_counter() - start) / gen.steps_per_sync)
    step = float(np.median(seconds))
    print(f"{rows} rows, {args.dtype}, {gen.row_length}-slot cache from slot {args.fill}: {step * 1e3:.1f} ms a step, "
          f"{rows / step:.0f} new tokens/s (median of 3 calls of {gen.steps_per_sync} steps)")

    hlo = decode_steps.lower(model.params, state, **statics).compile().as_text()
    with tempfile.TemporaryDirectory() as trace_dir:
        state = jax.block_until_ready(fresh(state))
        jax.profiler.start_trace(trace_dir)
        jax.block_until_ready(decode_steps(model.params, state, **statics))
        jax.profiler.stop_trace()
        events = json.load(gzip.open(next(Path(trace_dir).rglob("*.trace.json.gz"))))["traceEvents"]
    shapes = {m.group(1): m.group(2) for m in re.finditer(r"%([\w.\-]+) = (\S+) (?:fusion|dot|copy)\(", hlo)}
    per_group, counts = collections.Counter(), collections.Counter()
    for event in events:
        name = event.get("name", "")
        if event.get("ph") == "X" and name in shapes:
            group = (re.sub(r"\.\d+$", "", name), shapes[name].split("{")[0])
            per_group[group] += event["dur"] / 1e3 / gen.steps_per_sync
            counts[group] += 1 / gen.steps_per_sync
    total = sum(per_group.values())
    print(f"\nprofiled operations: {total:.1f} ms a step\n\n| ms a step | per step | operation | output |\n|---|---|---|---|")
    for (kind, shape), ms in per_group.most_common(args.top):
        print(f"| {ms:.1f} | {counts[kind, shape]:.0f} | {kind} | {shape} |")


if __name__ == "__main__":
    main()
