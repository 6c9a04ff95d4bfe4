"""What an adaptive server's AR step pays for keeping the drafter's context current (issue 46).

An adaptive server's slots carry a drafter context, so its AR step also writes the step's tap
features into it (`decode/slots.py:_ar_step`), ready for a chain at any step; a fixed AR server's
step does not. Both steps run here on the same weights, slots and lengths, taking turns call by
call, each call `steps_per_sync` steps over every slot at the server's shortest attention length:

    python experiments/ar_upkeep.py --slots 8 --calls 30 --dtype float32 [--json runs/ar_upkeep.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--calls", type=int, default=30, help="timed calls of each step, taking turns")
    parser.add_argument("--attend", type=int, default=256, help="cache slots the step attends to")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--json", default=None, help="also write the report here")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp

    from specjax.decode import slots as slot_api
    from specjax.io.registry import at_compute_dtype, load_model, resolve_drafter
    from specjax.serve.config import ServeConfig
    from specjax.serve.shapes import plan_shapes

    model = at_compute_dtype(load_model("smollm2"), args.dtype)
    drafter = resolve_drafter("default", "smollm2")
    config = ServeConfig(slots=args.slots)
    plain = plan_shapes(("ar",), model, None, None, config).statics
    upkeep = dataclasses.replace(plain, drafter_config=dataclasses.replace(drafter.config, dtype=args.dtype))
    variants = {"plain AR step": (plain, slot_api.slot_parts(plain, model.params)),
                "AR step keeping the drafter context": (upkeep, slot_api.slot_parts(
                    upkeep, model.params, drafter.params, drafter.draft_vocab))}
    filled = args.attend // 2

    def fresh(statics):
        state = slot_api.empty_slots(statics)
        return state.replace(lengths=jnp.full_like(state.lengths, filled), done=jnp.zeros_like(state.done),
                             max_new_tokens=jnp.full_like(state.max_new_tokens, statics.slot.max_new_tokens))

    def reset(state):
        return state.replace(lengths=jnp.full_like(state.lengths, filled), done=jnp.zeros_like(state.done),
                             num_generated=jnp.zeros_like(state.num_generated))

    states, seconds = {}, {label: [] for label in variants}
    for label, (statics, parts) in variants.items():  # compile and run once, untimed
        states[label] = reset(slot_api.step(parts, fresh(statics), method="ar", statics=statics,
                                            attend_slots=args.attend))
        jax.block_until_ready(states[label].lengths)
    for _ in range(args.calls):
        for label, (statics, parts) in variants.items():
            started = time.perf_counter()
            state = slot_api.step(parts, states[label], method="ar", statics=statics, attend_slots=args.attend)
            jax.block_until_ready(state.lengths)
            seconds[label].append(time.perf_counter() - started)
            states[label] = reset(state)
    base = statistics.median(seconds["plain AR step"])
    report = {"slots": args.slots, "attend": args.attend, "steps_per_call": plain.slot.steps_per_sync,
              "dtype": args.dtype, "calls": args.calls,
              "median_ms": {label: 1e3 * statistics.median(s) for label, s in seconds.items()},
              "against_plain": {label: statistics.median(s) / base for label, s in seconds.items()}}
    for label in variants:
        print(f"{label}: {report['median_ms'][label]:.1f} ms a call of {report['steps_per_call']} steps "
              f"({report['against_plain'][label]:.3f}x the plain step)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
