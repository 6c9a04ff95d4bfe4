"""Child process of tests/test_sharding.py: training on meshes of forced CPU devices.

    python tests/sharded_train.py OUT_DIR MESH_A MESH_B

Trains a tiny language model with `specjax.train.loop.train` for 6 steps on one device, then for 3
steps on MESH_A and, resuming from MESH_A's checkpoint, to step 6 on MESH_B. Prints one JSON line:
the losses of each run, and one device's slice of a weight under MESH_B's placement."""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # importers (the two-process test) bring their own devices
    os.environ["JAX_PLATFORMS"] = "cpu"  # the forced host devices, even where a GPU is present
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from specjax.models.config import TransformerConfig  # noqa: E402
from specjax.models.transformer import init_params  # noqa: E402
from specjax.sharding import MeshConfig  # noqa: E402
from specjax.train.lm import next_token_loss  # noqa: E402
from specjax.train.loop import LoopConfig, OptimizerConfig, train  # noqa: E402

CONFIG = TransformerConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                           intermediate_size=64, max_position_embeddings=64)
STEPS = 6


def batch(step: int) -> np.ndarray:
    return np.random.default_rng([7, step]).integers(0, CONFIG.vocab_size, size=(8, 17)).astype(np.int32)  # [B, T+1]


def run(out: Path, steps: int, mesh_text: str | None):
    mesh = MeshConfig.parse(mesh_text or "")
    loss = lambda params, b, rng: (next_token_loss(params, CONFIG, b), {})  # noqa: E731
    return train(loss, init_params(CONFIG, jax.random.key(0)), batch, out,
                 OptimizerConfig(learning_rate=1e-2, warmup_steps=1, total_steps=STEPS),
                 LoopConfig(steps=steps, log_every=1, eval_every=0, checkpoint_every=1, progress=False, mesh=mesh))


def main(out_dir: str, mesh_a: str, mesh_b: str) -> None:
    root = Path(out_dir)
    _, single = run(root / "single", STEPS, None)
    _, first = run(root / "sharded", STEPS // 2, mesh_a)
    params, resumed = run(root / "sharded", STEPS, mesh_b)
    q_proj = params["layers_0"]["self_attn"]["q_proj"]["kernel"]
    print(json.dumps({"devices": jax.device_count(), "single": single, "sharded": first + resumed,
                      "q_proj_shard": list(q_proj.addressable_shards[0].data.shape),
                      "q_proj_shape": list(q_proj.shape)}))


if __name__ == "__main__":
    main(*sys.argv[1:])
