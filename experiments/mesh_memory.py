"""Memory per device of each mesh placement for an 8B target, by the sharding rules' arithmetic and
by XLA: the compiled programs' `memory_analysis()` on abstract shapes (nothing is allocated).

    python experiments/mesh_memory.py [--json runs/mesh_memory.json]

Two programs, compiled for 8 forced CPU devices (the partitioned program is per device):
- a decode step of the target (Llama-3.1-8B shapes, bf16 weights and KV cache): one token for each of
  --slots rows over a cache of --context tokens, the cache donated and its layout pinned;
- the optimizer update of a drafter's training step (a 5-layer DFlash-style drafter at the target's
  width, float32 master weights and AdamW moments, gradients in), its state donated and pinned.

"rules" is what `describe_placement` and the state rules say a device holds: each weight's bytes
divided by the mesh axes its spec splits it over, and the KV cache's bytes divided by the slots'
and KV heads' splits. "XLA" is the compiled program's argument size. They must agree; the program's
temporaries (XLA's working buffers, gathered FSDP weights among them) are reported beside them.
"""

from __future__ import annotations

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from specjax.io.hf import config_from_hf  # noqa: E402
from specjax.models.cache import KVCache  # noqa: E402
from specjax.models.drafter import DrafterConfig, init_drafter_params  # noqa: E402
from specjax.models.transformer import forward, init_params  # noqa: E402
from specjax.sharding import MeshConfig, describe_placement, shard_parameters, state_spec  # noqa: E402
from specjax.train.loop import OptimizerConfig, make_optimizer  # noqa: E402

LLAMA_3_1_8B = dict(architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096,
                    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                    max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                    tie_word_embeddings=False)
"""The shape keys of meta-llama/Llama-3.1-8B-Instruct's config.json."""

DECODE_MESHES = ("model=8", "data=2,model=4", "data=4,model=2", "fsdp=8", "data=2,fsdp=2,model=2")
TRAIN_MESHES = ("fsdp=8", "data=2,fsdp=4", "fsdp=4,model=2", "data=8")
GIB = 2**30


def abstract(tree, dtype=None):
    """ShapeDtypeStructs of `tree`'s arrays (cast to dtype when given): nothing is allocated."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, dtype or a.dtype), tree)


def rules_bytes(params, mesh, head_dim=None) -> int:
    return sum(row["bytes_per_device"] for row in describe_placement(params, mesh, head_dim))


def split_of(spec, mesh) -> int:
    """How many pieces a PartitionSpec cuts an array into."""
    pieces = 1
    for entry in spec:
        for axis in (entry,) if isinstance(entry, str) else (entry or ()):
            pieces *= mesh.shape[axis]
    return pieces


def decode_check(config, mesh_text: str, slots: int, context: int) -> dict:
    mesh = MeshConfig.parse(mesh_text).build()
    params = abstract(jax.eval_shape(lambda: init_params(config, jax.random.key(0))), jnp.bfloat16)
    params = shard_parameters(params, mesh, config.head_dim)  # as the Engine places them (place_params)
    cache = jax.eval_shape(lambda: KVCache.zeros(config, slots, context))

    def placed(path, leaf):
        spec = state_spec(path, leaf.shape, mesh)
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, spec))

    cache = jax.tree_util.tree_map_with_path(lambda p, leaf: placed("target_cache/" + jax.tree_util.keystr(p), leaf),
                                             cache)
    rows = placed("tokens", jax.ShapeDtypeStruct((slots, 1), jnp.int32))
    lengths = placed("lengths", jax.ShapeDtypeStruct((slots,), jnp.int32))

    def step(params, cache, tokens, lengths):
        out = forward(params, config, tokens, lengths[:, None], cache, lengths)
        return jnp.argmax(out.logits[:, -1], axis=-1).astype(jnp.int32), out.cache

    pinned = (lengths.sharding, jax.tree.map(lambda a: a.sharding, cache))
    compiled = jax.jit(step, donate_argnums=1, out_shardings=pinned).lower(params, cache, rows, lengths).compile()
    analysis = compiled.memory_analysis()
    cache_spec = cache.keys[0].sharding.spec
    weights = rules_bytes(params, mesh, config.head_dim)
    kv = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(cache)) // split_of(cache_spec, mesh)
    small = sum(int(np.prod(a.sharding.shard_shape(a.shape))) * 4 for a in (rows, lengths))
    return {"mesh": mesh_text, "weights_gib": weights / GIB, "kv_gib": kv / GIB, "kv_spec": str(cache_spec),
            "rules_gib": (weights + kv + small) / GIB, "xla_argument_gib": analysis.argument_size_in_bytes / GIB,
            "xla_temp_gib": analysis.temp_size_in_bytes / GIB, "xla_output_gib": analysis.output_size_in_bytes / GIB,
            "xla_alias_gib": analysis.alias_size_in_bytes / GIB}


def train_check(drafter: DrafterConfig, mesh_text: str) -> dict:
    mesh = MeshConfig.parse(mesh_text).build()
    tx = make_optimizer(OptimizerConfig())
    params = abstract(jax.eval_shape(lambda: init_drafter_params(drafter, jax.random.key(0))), jnp.float32)
    opt_state = jax.eval_shape(tx.init, params)
    # The moments follow their parameters' rules (the same paths), as train() places them.
    state = shard_parameters({"params": params, "opt_state": opt_state}, mesh)
    grads = state["params"]

    def update(state, grads):
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return {"params": jax.tree.map(jnp.add, state["params"], updates), "opt_state": opt_state}

    compiled = jax.jit(update, donate_argnums=0, out_shardings=jax.tree.map(lambda a: a.sharding, state)).lower(
        state, grads).compile()
    analysis = compiled.memory_analysis()
    parameters = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params))
    rules = rules_bytes(state, mesh) + rules_bytes(grads, mesh)
    return {"mesh": mesh_text, "drafter_parameters": parameters, "rules_gib": rules / GIB,
            "whole_gib": 16 * parameters / GIB, "xla_argument_gib": analysis.argument_size_in_bytes / GIB,
            "xla_temp_gib": analysis.temp_size_in_bytes / GIB}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args(argv)
    config = dataclasses.replace(config_from_hf(LLAMA_3_1_8B, "Llama-3.1-8B"), dtype="bfloat16")
    drafter = DrafterConfig(hidden_size=4096, vocab_size=config.vocab_size, target_layer_ids=(1, 9, 17, 25, 31),
                            num_layers=5, num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336)
    report = {"devices": jax.device_count(), "slots": args.slots, "context": args.context, "decode": [], "train": []}
    print(f"Decode step, Llama-3.1-8B shapes, bf16, {args.slots} slots x {args.context} tokens "
          f"(GiB per device, {jax.device_count()} CPU devices)")
    print("| mesh | weights | KV cache (spec) | rules: all arguments | XLA: arguments | XLA: temporaries |")
    print("|---|---|---|---|---|---|")
    for mesh_text in DECODE_MESHES:
        row = decode_check(config, mesh_text, args.slots, args.context)
        report["decode"].append(row)
        print(f"| {mesh_text} | {row['weights_gib']:.2f} | {row['kv_gib']:.2f} ({row['kv_spec']}) | "
              f"{row['rules_gib']:.3f} | {row['xla_argument_gib']:.3f} | {row['xla_temp_gib']:.2f} |", flush=True)
    print()
    print("Drafter optimizer update (float32 weights, AdamW moments, gradients in; GiB per device)")
    print("| mesh | drafter parameters | unsharded | rules | XLA: arguments | XLA: temporaries |")
    print("|---|---|---|---|---|---|")
    for mesh_text in TRAIN_MESHES:
        row = train_check(drafter, mesh_text)
        report["train"].append(row)
        print(f"| {mesh_text} | {row['drafter_parameters'] / 1e9:.2f} B | {row['whole_gib']:.2f} | "
              f"{row['rules_gib']:.3f} | {row['xla_argument_gib']:.3f} | {row['xla_temp_gib']:.2f} |", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    mismatched = [r["mesh"] for r in report["decode"] + report["train"]
                  if abs(r["rules_gib"] - r["xla_argument_gib"]) > 1e-3 * max(r["rules_gib"], 1e-9)]
    if mismatched:
        print(f"rules and XLA disagree on: {', '.join(mismatched)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
