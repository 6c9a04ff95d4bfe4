"""Child process of tests/test_sharding.py: the drafter, refiner and compressor trainers over a mesh.

    python tests/sharded_recipes.py JOB.pkl OUT_DIR MESH

JOB.pkl holds the tiny target and drafter (configs and numpy params) and the folder of a
distillation set. Each trainer (`train_drafter`, `train_refiner`, `train_compressor`, the functions
the train-* recipes call) runs 3 steps on one device and 3 on MESH, from the same start. Prints one
JSON line: the losses of each run, and one device's slice of the trained drafter's q_proj on MESH.
"""

from __future__ import annotations

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"  # the forced host devices, even where a GPU is present
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import json  # noqa: E402
import pickle  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from specjax.io.dflash import LoadedDrafter  # noqa: E402
from specjax.models.drafter import DrafterWindow  # noqa: E402
from specjax.models.refiner import RefinerConfig  # noqa: E402
from specjax.sharding import MeshConfig  # noqa: E402
from specjax.train.compressor import train_compressor  # noqa: E402
from specjax.train.drafter import DistillationSet, DrafterTrainConfig, train_drafter  # noqa: E402
from specjax.train.loop import LoopConfig, OptimizerConfig, read_metrics  # noqa: E402
from specjax.train.refiner import RefinerTrainConfig, train_refiner  # noqa: E402

STEPS = 3


def main(job_path: str, out_dir: str, mesh_text: str) -> None:
    with open(job_path, "rb") as f:
        job = pickle.load(f)
    target_config, target_params = job["target"]
    drafter_config, drafter_params, num_layers = job["drafter"]
    drafter = LoadedDrafter("tiny-drafter", drafter_config, drafter_params, num_layers)
    data = DistillationSet.open(job["data"])
    optimizer = OptimizerConfig(learning_rate=1e-2, warmup_steps=1, total_steps=STEPS)
    # 4 sequences per batch: split over data x fsdp on the mesh.
    batches = dict(sequences_per_batch=4, anchors_per_sequence=8)
    refiner = RefinerConfig(hidden_size=drafter_config.hidden_size, block_size=drafter_config.block_size, kind="gru",
                            width=16, rank=8)
    trainers = {
        "drafter": lambda out, loop: train_drafter(target_params, target_config, drafter_config, data, out, optimizer,
                                                   loop, DrafterTrainConfig(**batches)),
        "refiner": lambda out, loop: train_refiner(target_params, target_config, drafter, refiner, data, out,
                                                   optimizer, loop, RefinerTrainConfig(**batches)),
        "compressor": lambda out, loop: train_compressor(target_params, target_config, drafter_config, drafter_params,
                                                         DrafterWindow(window=6, segment=4, summaries=2), data, out,
                                                         optimizer, loop, DrafterTrainConfig(**batches)),
    }
    results = {}
    for name, run in trainers.items():
        losses = {}
        for label, mesh in (("one", ""), ("mesh", mesh_text)):
            out = Path(out_dir) / name / label
            trained = run(out, LoopConfig(steps=STEPS, log_every=1, eval_every=0, checkpoint_every=STEPS,
                                          progress=False, mesh=MeshConfig.parse(mesh)))
            losses[label] = [m["loss"] for m in read_metrics(out) if "loss" in m]
            if name == "drafter" and label == "mesh":
                q_proj = trained["layers_0"]["q_proj"]["kernel"]
                results["drafter_q_proj"] = {"shape": list(q_proj.shape),
                                             "shard": list(q_proj.addressable_shards[0].data.shape)}
        results[name] = losses
    print(json.dumps({"devices": jax.device_count(), **results}))


if __name__ == "__main__":
    main(*sys.argv[1:])
