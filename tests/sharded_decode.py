"""Child process of tests/test_sharding.py: decode on a mesh of forced CPU devices.

    python tests/sharded_decode.py JOB.pkl

JOB.pkl holds the target and drafter (configs and numpy params), the prompts, the meshes and the
methods; with "serve", also the methods to serve through the Scheduler (4 slots over the mesh).
The process makes 8 CPU devices (XLA_FLAGS must be set before jax starts, which is why this runs
apart from the suite) and prints one JSON line: outputs per mesh and method (served ones as
"serve:METHOD")."""

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
from specjax.data.retrieval import Redraft  # noqa: E402
from specjax.decode.rapid import RapidConfig  # noqa: E402
from specjax.decode.tree import TreeConfig  # noqa: E402
from specjax.io.dflash import LoadedDrafter  # noqa: E402
from specjax.io.registry import LoadedModel  # noqa: E402
from specjax.serve.scheduler import Request, Scheduler, ServeConfig  # noqa: E402
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
        if job.get("redraft"):
            # rapid from an unrelated drafting prompt, re-retrieving (here: the whole prompt) every 4 tokens.
            prompts = job["prompts"]
            redraft = Redraft(every=4, prompt_for=lambda row, generated: prompts[row],
                              max_prompt_tokens=max(map(len, prompts)))
            out = engine.generate(prompts, job["max_new_tokens"], method="rapid", rapid=RapidConfig(drafts=3),
                                  drafting_prompts=[[5]] * len(prompts), redraft=redraft)
            results[mesh_text]["rapid+redraft"] = out.tokens
            results[mesh_text]["redrafts"] = out.stats["redrafts"]
        for method in job.get("serve", ()):
            config = ServeConfig(method=method, slots=4, context_length=64, max_new_tokens=job["max_new_tokens"],
                                 steps_per_sync=3, prompt_bucket=16)
            scheduler = Scheduler(model, drafter, config, mesh=mesh)
            try:
                handles = [scheduler.submit(Request(tuple(p), max_tokens=job["max_new_tokens"], temperature=0.0))
                           for p in job["prompts"]]
                results[mesh_text][f"serve:{method}"] = [h.result(timeout=300).token_ids for h in handles]
                # Slots over data and fsdp, KV heads over model: one device's slice of the target's keys.
                keys = scheduler.table.state.target_cache.keys[0]
                results[mesh_text][f"serve:{method}:kv_shard"] = list(keys.addressable_shards[0].data.shape)
                results[mesh_text][f"serve:{method}:kv_shape"] = list(keys.shape)
            finally:
                scheduler.shutdown()
    # A mesh may use fewer devices than the process has: the first ones.
    smaller = [d.id for d in MeshConfig.parse("model=4").build().devices.flat]
    print(json.dumps({"devices": jax.device_count(), "outputs": results, "smaller_mesh": smaller}))


if __name__ == "__main__":
    main(sys.argv[1])
