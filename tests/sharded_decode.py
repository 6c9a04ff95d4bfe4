"""Child process of tests/test_sharding.py: decode on a mesh of forced CPU devices.

    python tests/sharded_decode.py JOB.pkl

JOB.pkl holds the target and drafter (configs and numpy params), the prompts, the meshes and the
methods. The process makes 8 CPU devices (XLA_FLAGS must be set before jax starts, which is why this
runs apart from the suite) and prints one JSON line: outputs per mesh and method."""

from __future__ import annotations

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"  # the forced host devices, even where a GPU is present
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import json  # noqa: E402
import pickle  # noqa: E402

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from specjax.decode.engine import Engine  # noqa: E402
from specjax.decode.tree import TreeConfig  # noqa: E402
from specjax.io.dflash import LoadedDrafter  # noqa: E402
from specjax.io.registry import LoadedModel  # noqa: E402
from specjax.sharding import MeshConfig  # noqa: E402


def main(job_path: str) -> None:
    with open(job_path, "rb") as f:
        job = pickle.load(f)
    target_config, target_params = job["target"]
    drafter_config, drafter_params, num_layers = job["drafter"]
    model = LoadedModel("tiny", target_config, target_params, None, tuple(job["eos"]))
    drafter = LoadedDrafter("tiny-drafter", drafter_config, drafter_params, num_layers)
    results = {}
    for mesh_text in job["meshes"]:
        mesh = MeshConfig.parse(mesh_text).build()
        engine = Engine(model, drafter, latency_cache=False, mesh=mesh)
        q_proj = engine.model.params["layers_0"]["self_attn"]["q_proj"]["kernel"]
        results[mesh_text] = {"q_proj_shard": list(q_proj.addressable_shards[0].data.shape)}
        for method in job["methods"]:
            options = {"tree": TreeConfig(budget=job["tree_budget"])} if method == "tree" else {}
            out = engine.generate(job["prompts"], job["max_new_tokens"], method=method, **options)
            results[mesh_text][method] = out.tokens
    print(json.dumps({"devices": jax.device_count(), "outputs": results}))


if __name__ == "__main__":
    main(sys.argv[1])
