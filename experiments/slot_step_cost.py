"""Cost of one slot-level decode step (specjax.decode.slots.step) against the number of slots, on
SmolLM2 with a 512-slot cache and the step reading the first 128 (attend_slots), greedy rows, at
each compute precision given (float32 and/or bfloat16: bf16 weights and KV, float32 accumulation).

    python experiments/slot_step_cost.py [float32,bfloat16] [ar,chain]
"""
import sys, time, jax, jax.numpy as jnp, numpy as np
from specjax.io.registry import at_compute_dtype, load_model, resolve_drafter
from specjax.decode import slots
DTYPES = (sys.argv[1] if len(sys.argv) > 1 else "float32").split(",")
METHODS = (sys.argv[2] if len(sys.argv) > 2 else "ar").split(",")
base_m = load_model("smollm2"); base_d = resolve_drafter("default", "smollm2")
def bench(method, S, cache=512, sps=4, L=None):
    dc = d.config if method != "ar" else None
    st = slots.SlotStatics(m.config.with_kv_rings(16), slots.SlotConfig(slots=S, cache_length=cache, max_new_tokens=256, steps_per_sync=sps), tuple(m.eos_token_ids), dc)
    state = slots.empty_slots(st)
    req = slots.InsertRequest(rows=jnp.arange(S, dtype=jnp.int32), prompts=jnp.ones((S, 32), jnp.int32), prompt_lengths=jnp.full((S,), 20, jnp.int32), max_new_tokens=jnp.full((S,), 200, jnp.int32), seeds=jnp.arange(S, dtype=jnp.uint32), sampling=slots.RowSampling.greedy(S))
    parts = slots.slot_parts(st, m.params, d.params if dc else None, d.draft_vocab if dc else None)
    state = slots.insert(parts, state, req, statics=st)
    f = lambda s: slots.step(parts, s, method=method, statics=st, attend_slots=L)
    state = f(state); jax.block_until_ready(state.tokens)
    ts=[]
    for _ in range(3):
        t=time.perf_counter(); state=f(state); jax.block_until_ready(state.tokens); ts.append(time.perf_counter()-t)
    print(m.config.dtype, method, S, L, f"{np.median(ts)/sps*1000:.0f} ms per step", flush=True)
for dtype in DTYPES:
    m, d = at_compute_dtype(base_m, dtype), at_compute_dtype(base_d, dtype)
    for method in METHODS:
        for S in (1, 8, 16, 32):
            bench(method, S, L=128)
