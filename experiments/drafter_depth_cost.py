"""What a deeper drafter costs every step (issue 45, item 3): the serving slot step of a greedy chain
on SmolLM2 with drafters of 1, 2, 3 and 5 layers at the target's width (random weights: timing
needs no training), against the AR step, at 1 and 8 slots, each step reading 128 cache slots.

    python experiments/drafter_depth_cost.py [--depths 1,2,3,5] [--slots 1,8] [--dtype float32] [--rounds 15] [--json OUT]

A chain step is one drafting pass plus one verify pass over the block; the drafter's share is what
depth adds. The break-even tau of a policy is its step cost over the AR step's (a chain commits tau
tokens per step where AR commits one), so the table also says how much tau each extra layer must buy.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax.decode import slots
from specjax.io.dflash import LoadedDrafter
from specjax.io.registry import at_compute_dtype, load_model, resolve_drafter
from specjax.models.drafter import init_drafter_params

STEPS_PER_SYNC = 4


def compiled_step(model, drafter, method: str, num_slots: int):
    """A zero-argument function that runs one call of the slot step (STEPS_PER_SYNC steps), compiled."""
    statics = slots.SlotStatics(model.config, slots.SlotConfig(slots=num_slots, cache_length=512, max_new_tokens=256,
                                                               steps_per_sync=STEPS_PER_SYNC),
                                tuple(model.eos_token_ids), drafter.config if drafter else None)
    request = slots.InsertRequest(rows=jnp.arange(num_slots, dtype=jnp.int32),
                                  prompts=jnp.ones((num_slots, 32), jnp.int32),
                                  prompt_lengths=jnp.full((num_slots,), 20, jnp.int32),
                                  max_new_tokens=jnp.full((num_slots,), 200, jnp.int32),
                                  seeds=jnp.arange(num_slots, dtype=jnp.uint32),
                                  sampling=slots.RowSampling.greedy(num_slots))
    parts = slots.slot_parts(statics, model.params, drafter.params if drafter else None,
                             drafter.draft_vocab if drafter else None)
    # Every call restarts from the same state, so each times the same 4 steps at the same lengths.
    start = slots.insert(parts, slots.empty_slots(statics), request, statics=statics)
    run = jax.jit(lambda s: slots.step(parts, s, method=method, statics=statics, attend_slots=128))
    jax.block_until_ready(run(start).tokens)
    return lambda: jax.block_until_ready(run(start).tokens)


def interleaved_ms(steps: dict, rounds: int) -> dict:
    """Median milliseconds per step of each compiled step, timed in turn, round after round, so a
    slow spell of the host falls on all of them alike."""
    times = {name: [] for name in steps}
    for _ in range(rounds):
        for name, call in steps.items():
            started = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - started)
    return {name: float(np.median(t)) / STEPS_PER_SYNC * 1000 for name, t in times.items()}


def drafter_of_depth(model, committed: LoadedDrafter, depth: int) -> LoadedDrafter:
    """The committed drafter's shape (block, taps, draft vocabulary) with `depth` random layers."""
    config = dataclasses.replace(committed.config, num_layers=depth)
    params = init_drafter_params(config, jax.random.key(depth))
    loaded = dataclasses.replace(committed, config=config, params=params, source=f"random, {depth} layers")
    return at_compute_dtype(loaded, model.config.dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", default="1,2,3,5")
    parser.add_argument("--slots", default="1,8")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--rounds", type=int, default=15, help="timed calls of each step, interleaved")
    parser.add_argument("--json", help="also write the table here")
    args = parser.parse_args()
    model = at_compute_dtype(load_model("smollm2"), args.dtype)
    committed = resolve_drafter("default", "smollm2")
    results = {"dtype": args.dtype, "device": jax.devices()[0].device_kind, "block": committed.config.block_size,
               "ar_ms": {}, "chain_ms": {}}
    depths = [int(d) for d in args.depths.split(",")]
    for num_slots in map(int, args.slots.split(",")):
        steps = {"ar": compiled_step(model, None, "ar", num_slots)}
        for depth in depths:
            steps[depth] = compiled_step(model, drafter_of_depth(model, committed, depth), "chain", num_slots)
        ms = interleaved_ms(steps, args.rounds)
        results["ar_ms"][num_slots] = round(ms["ar"], 2)
        print(f"{num_slots} slots: AR step {ms['ar']:.1f} ms", flush=True)
        for depth in depths:
            results["chain_ms"].setdefault(depth, {})[num_slots] = round(ms[depth], 2)
            print(f"{num_slots} slots: chain step with a {depth}-layer drafter {ms[depth]:.1f} ms "
                  f"({ms[depth] / ms['ar']:.2f}x AR: the tau it needs to break even)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
