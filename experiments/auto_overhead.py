"""Where auto's time goes when it settles on AR: plain AR steps, AR steps that also keep the drafter's
context up to date, and auto's own step (the per-step choice, lax.switch over AR/chain/tree, the
probes), measured side by side on the same prompts in one process.

    python experiments/auto_overhead.py --prompts 6 --max-new-tokens 96 [--probe-every 0]

Prints per-token milliseconds (median over prompts) and ratios against plain AR, and which policy
auto's steps took. Run it alone: the two cores are shared.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--probe-every", type=int, default=32, help="auto's probe interval (0: never probe)")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()

    import specjax
    from specjax.decode import slots as slot_api
    from specjax.decode.auto import AUTO_POLICIES, AutoConfig

    llm = specjax.LLM(args.model, dtype=args.dtype, refiner=None)
    engine, model, drafter = llm.engine, llm.model, llm.drafter
    prompts = [llm.encode(t) for t in specjax.HELDOUT_CHAT_PROMPTS[: args.prompts]]
    auto = AutoConfig(probe_every=args.probe_every)

    # AR that keeps a drafter context: the slot statics of a chain server, stepped with "ar".
    def ar_with_context(prompt):
        bucket = -(-len(prompt) // 32) * 32
        cache = -(-(bucket + args.max_new_tokens + drafter.config.block_size) // 64) * 64
        statics = slot_api.SlotStatics(
            target_config=model.config, slot=slot_api.SlotConfig(slots=1, cache_length=cache,
                                                                 max_new_tokens=args.max_new_tokens,
                                                                 steps_per_sync=1, insert_rows=1),
            eos_token_ids=(), drafter_config=drafter.config)
        draft_vocab = None if drafter.draft_vocab is None else jnp.asarray(drafter.draft_vocab)
        parts = slot_api.slot_parts(statics, model.params, drafter.params, draft_vocab)
        request = slot_api.InsertRequest(
            rows=jnp.zeros((1,), jnp.int32), prompts=jnp.asarray(slot_api.token_rows([prompt], bucket)),
            prompt_lengths=jnp.asarray([len(prompt)], jnp.int32),
            max_new_tokens=jnp.asarray([args.max_new_tokens], jnp.int32), seeds=jnp.zeros((1,), jnp.uint32),
            sampling=slot_api.RowSampling(jnp.zeros((1,), jnp.float32), jnp.zeros((1,), jnp.int32),
                                          jnp.ones((1,), jnp.float32)))
        insert = jax.jit(partial(slot_api.insert, statics=statics), donate_argnums=1)
        run = jax.jit(partial(slot_api.run_to_end, method="ar", statics=statics), donate_argnums=1)
        return lambda: jax.block_until_ready(run(parts, insert(parts, slot_api.empty_slots(statics), request)).tokens)

    results: dict[str, list[float]] = {"ar": [], "ar + drafter context": [], "auto": []}
    auto_steps = np.zeros(len(AUTO_POLICIES), np.int64)
    for prompt in prompts:
        def timed(call):
            call()  # compile and warm
            started = time.perf_counter()
            call()
            return 1e3 * (time.perf_counter() - started) / args.max_new_tokens

        results["ar"].append(timed(lambda: engine.generate([prompt], args.max_new_tokens, method="ar",
                                                           ignore_eos=True)))
        results["ar + drafter context"].append(timed(ar_with_context(prompt)))
        out = {}

        def run_auto():
            out["r"] = engine.generate([prompt], args.max_new_tokens, method="auto", ignore_eos=True, auto=auto)
        results["auto"].append(timed(run_auto))
        steps = out["r"].stats["auto"]["policy_steps"]  # of the timed call
        auto_steps += np.asarray([steps.get(p, 0) for p in AUTO_POLICIES])
    base = statistics.median(results["ar"])
    table = {name: {"ms_per_token": statistics.median(v), "vs_ar": statistics.median(v) / base}
             for name, v in results.items()}
    for name, row in table.items():
        print(f"{name:>22}: {row['ms_per_token']:.2f} ms/token, {row['vs_ar']:.3f}x AR's time")
    print("auto's steps by policy:", dict(zip(AUTO_POLICIES, auto_steps.tolist())))
    print(json.dumps({"table": table, "auto_steps": dict(zip(AUTO_POLICIES, auto_steps.tolist())),
                      "device": jax.devices()[0].device_kind, "dtype": model.config.dtype}))


if __name__ == "__main__":
    main()
