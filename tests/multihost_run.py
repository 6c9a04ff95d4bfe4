"""One process of tests/test_sharding.py's two-process run, on loopback.

    python tests/multihost_run.py PORT PROCESS_ID NUM_PROCESSES OUT_DIR

Each process has 4 CPU devices; together they form one 8-device mesh (data=2 across the processes,
model=4 within each) joined through jax.distributed with gloo collectives. The run takes one
training step of a tiny language model and one greedy decode (AR and chain) on the global mesh and,
on process 0, prints one JSON line with the loss and the outputs."""

from __future__ import annotations

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"  # the forced host devices, even where a GPU is present
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import json  # noqa: E402
import pickle  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_cpu_collectives_implementation", "gloo")


def main(port: str, process_id: str, num_processes: str, out_dir: str) -> None:
    import faulthandler

    faulthandler.dump_traceback_later(400, exit=True)  # a hung collective ends the process, with its stack
    jax.distributed.initialize(f"127.0.0.1:{port}", int(num_processes), int(process_id))
    from specjax.decode.engine import Engine
    from specjax.io.dflash import LoadedDrafter
    from specjax.io.registry import LoadedModel
    from specjax.sharding import MeshConfig

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from sharded_train import run  # the one-step training of the sharding test, on this mesh

    mesh_config = MeshConfig(data=2, model=4)
    _, losses = run(Path(out_dir) / "train", 1, str(mesh_config))
    print(f"process {process_id}: trained", file=sys.stderr, flush=True)
    with open(Path(out_dir) / "job.pkl", "rb") as f:
        job = pickle.load(f)
    target_config, target_params = job["target"]
    drafter_config, drafter_params, num_layers = job["drafter"]
    model = LoadedModel("tiny", target_config, target_params, None, tuple(job["eos"]))
    drafter = LoadedDrafter("tiny-drafter", drafter_config, drafter_params, num_layers)
    engine = Engine(model, drafter, latency_cache=False, mesh=mesh_config.build())
    outputs = {}
    for method in ("ar", "chain"):
        outputs[method] = engine.generate(job["prompts"], job["max_new_tokens"], method=method).tokens
        print(f"process {process_id}: decoded with {method}", file=sys.stderr, flush=True)
    if jax.process_index() == 0:
        print(json.dumps({"devices": jax.device_count(), "local_devices": jax.local_device_count(),
                          "losses": losses, "outputs": outputs}))


if __name__ == "__main__":
    main(*sys.argv[1:])
