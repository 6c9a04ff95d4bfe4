"""KV and drafter-state memory accounting, and measured peak memory.

Every generate call reports `stats["memory"]` (see `decode_memory`):
- target_kv_bytes: the target's KV cache as allocated for the call (batch x cache slots), and
  target_kv_bytes_per_token: what one token of one row adds (all per-token and per-window figures
  are for one row). Sliding layers decode with KV rings (TransformerConfig.kv_ring_step): their
  constant part is target_kv_window_bytes, and they add nothing per token.
- drafter_state_bytes: the drafter's context state. With full attention it grows by
  drafter_bytes_per_token per token; windowed it is a fixed ring of drafter_window_bytes plus
  summaries that grow by drafter_summary_bytes_per_segment per finished segment.
- peak_bytes: the compiled decode program's own buffers (arguments + outputs + temporaries, as XLA
  assigned them), which belong to this call alone; when no compiled program is at hand (streaming),
  the device's peak bytes in use, if the backend reports it. peak_source says which.
- device_peak_bytes: where the backend reports it (GPU, TPU), the device's peak bytes in use since
  the process started. It covers every earlier call too, so it is an upper bound for this one.

Shapes only, except the measured peaks, which compile (never run) the decode programs they measure.
The figures go to the caller's stats and to the serving monitor (specjax/monitor), which imports
nothing from decoding.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from specjax.decode.context import append_context, context_state_bytes, empty_context_cache
from specjax.decode.speculative import draft_block_states
from specjax.models.cache import KVCache, tree_bytes
from specjax.models.config import TransformerConfig

logger = logging.getLogger("specjax.memory")


def target_kv_bytes(config: TransformerConfig, batch: int, cache_length: int) -> int:
    return tree_bytes(jax.eval_shape(lambda: KVCache.zeros(config, batch, cache_length)))


def drafter_state_breakdown(drafter_config, batch: int, cache_length: int) -> dict:
    """The drafter's context state for contexts of cache_length positions, and how it grows."""
    layer = drafter_config.layer_config
    per_token = layer.kv_bytes_per_token(jnp.dtype(layer.dtype).itemsize)  # one row
    out = {"drafter_state_bytes": context_state_bytes(drafter_config, batch, cache_length),
           "drafter_attention": "full" if drafter_config.window is None else "windowed"}
    if drafter_config.window is None:
        out["drafter_bytes_per_token"] = per_token
    else:
        window = drafter_config.window
        out["drafter_window_bytes"] = per_token * window.ring_slots(drafter_config.block_size)
        out["drafter_summary_bytes_per_segment"] = per_token * window.summaries
    return out


def device_peak_bytes() -> int | None:
    """The device's peak bytes in use since the process started, where the backend reports it."""
    stats = jax.local_devices()[0].memory_stats()
    return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None


def measured_peak_bytes(compiled=None) -> tuple[int | None, str]:
    """(peak bytes, source): the compiled program's own buffers (arguments + outputs + temporaries -
    aliased) when given, which are this call's alone; else the device's lifetime peak_bytes_in_use;
    else (None, "unavailable")."""
    if compiled is not None:
        return measured_peak_bytes_of(compiled)
    device_peak = device_peak_bytes()
    if device_peak is not None:
        return device_peak, "device peak_bytes_in_use (since the process started)"
    return None, "unavailable"


def decode_memory(target_config: TransformerConfig, drafter_config, batch: int, cache_length: int,
                  compiled=None) -> dict:
    """The memory part of a generate call's stats (see the module docstring); also logged at INFO."""
    layer_bytes = jnp.dtype(target_config.cache_dtype).itemsize
    out = {"cache_length": cache_length,
           "target_kv_bytes": target_kv_bytes(target_config, batch, cache_length),
           "target_kv_bytes_per_token": target_config.kv_bytes_per_token(layer_bytes),
           "target_kv_window_bytes": target_config.kv_window_bytes(cache_length, layer_bytes)}
    if drafter_config is not None:
        out.update(drafter_state_breakdown(drafter_config, batch, cache_length))
    out["peak_bytes"], out["peak_source"] = measured_peak_bytes(compiled)
    out["device_peak_bytes"] = device_peak_bytes()
    logger.info("memory: %s", out)
    return out


def drafting_step_peak(target_params, target_config: TransformerConfig, drafter_params, drafter_config,
                       context_length: int, batch: int = 1) -> tuple[int | None, str, int]:
    """Peak memory of one drafting step at a context of context_length positions: the drafter pass
    over its context state plus writing the next block's context, compiled for this backend.
    Returns the compiled program's buffers as XLA assigned them for this backend (state,
    temporaries and outputs, with the drafter params and the token embedding), on every backend:
    a per-program figure, which a process-wide device peak counter cannot give. Returns (peak
    bytes, source, bytes of the weights among them: the constant part)."""
    block = drafter_config.block_size
    # Only the token embedding of the target is used (block inputs); the rest would only add a constant.
    embedding = {"embed_tokens": target_params["embed_tokens"]}
    context = jax.eval_shape(lambda: empty_context_cache(drafter_config, batch, context_length + block))
    features = jax.ShapeDtypeStruct((batch, block, drafter_config.num_taps, drafter_config.hidden_size),
                                    jnp.dtype(drafter_config.dtype))
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)

    def step(embedding, drafter_params, context, lengths, features):
        states = draft_block_states(embedding, target_config, drafter_params, drafter_config,
                                    jnp.zeros((batch,), jnp.int32), lengths, context)
        positions = lengths[:, None] + jnp.arange(block, dtype=jnp.int32)
        context = append_context(drafter_params, drafter_config, context, features, positions, lengths,
                                 lengths + block)
        return states, context

    compiled = jax.jit(step, donate_argnums=(2,)).lower(embedding, drafter_params, context, lengths, features).compile()
    peak, source = measured_peak_bytes_of(compiled)
    return peak, source, tree_bytes(embedding) + tree_bytes(drafter_params)


def measured_peak_bytes_of(compiled) -> tuple[int | None, str]:
    """The compiled program's buffers (arguments + outputs + temporaries - aliased)."""
    analysis = compiled.memory_analysis()
    if analysis is None:
        return None, "unavailable"
    total = (analysis.argument_size_in_bytes + analysis.output_size_in_bytes + analysis.temp_size_in_bytes
             - analysis.alias_size_in_bytes)
    return int(total), "compiled program buffers"


def memory_report(target_config: TransformerConfig, target_params, drafter_config, drafter_params, window,
                  contexts, batch: int = 1, progress: bool = True) -> dict:
    """For each context length: target KV bytes, drafter state bytes with full and windowed
    attention, and the measured peak of one drafting step with each. `window` is the DrafterWindow
    of the windowed variant and drafter_params must hold its compressor under "compressor"."""
    import dataclasses

    from tqdm.auto import tqdm

    full = dataclasses.replace(drafter_config, window=None)
    windowed = dataclasses.replace(drafter_config, window=window)
    full_params = {k: v for k, v in drafter_params.items() if k != "compressor"}
    report = {"contexts": list(contexts), "target_kv_bytes": [], "drafter_kv_bytes": {"full": [], "windowed": []},
              "peak_bytes": {"full": [], "windowed": []}, "batch": batch,
              "window": dataclasses.asdict(window), "peak_source": None,
              "weights_bytes": {"full": None, "windowed": None}}
    # As chain decoding allocates it: sliding layers (if any) keep rings sized for one block.
    decode_target = target_config.with_kv_rings(drafter_config.block_size)
    for n in tqdm(contexts, desc="contexts", disable=not progress):
        report["target_kv_bytes"].append(target_kv_bytes(decode_target, batch, n))
        for name, config, params in (("full", full, full_params), ("windowed", windowed, drafter_params)):
            report["drafter_kv_bytes"][name].append(context_state_bytes(config, batch, n))
            peak, source, weights = drafting_step_peak(target_params, target_config, params, config, n, batch)
            report["peak_bytes"][name].append(peak)
            report["peak_source"], report["weights_bytes"][name] = source, weights
    return report
