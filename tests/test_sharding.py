"""Meshes and sharding rules (specjax/sharding.py): placement on abstract shapes in-process, and
decoding on 8 forced CPU devices in a child process against the one-device output."""

from __future__ import annotations

import json
import re
import pickle
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from specjax.errors import SpecjaxError
from specjax.sharding import MeshConfig, logical_axes, spec_for

HERE = Path(__file__).resolve().parent


def test_mesh_flag_parses_and_rejects_bad_input():
    assert MeshConfig.parse("data=2,fsdp=2,model=2") == MeshConfig(2, 2, 2)
    assert MeshConfig.parse("model=4") == MeshConfig(model=4)
    assert MeshConfig.parse("") == MeshConfig() and MeshConfig().size == 1
    assert str(MeshConfig.parse("model=4,data=2")) == "data=2,fsdp=1,model=4"
    for bad, message in [("tensor=2", "axis=size"), ("model=two", "integer"), ("model=0", "positive"),
                         ("model=2,model=2", "twice"), ("model", "axis=size")]:
        with pytest.raises(SpecjaxError, match=message):
            MeshConfig.parse(bad)
    with pytest.raises(SpecjaxError, match="needs 4 devices"):
        MeshConfig(model=4).build(jax.devices()[:1])


def test_rules_follow_the_megatron_layout_and_keep_indivisible_dimensions_whole():
    mesh = {"data": 2, "fsdp": 2, "model": 2}
    rule = lambda path, shape: spec_for(shape, logical_axes(path, len(shape)), mesh)  # noqa: E731
    assert rule("layers_0/self_attn/q_proj/kernel", (576, 576)) == P("fsdp", "model")  # column split in
    assert rule("layers_0/self_attn/o_proj/kernel", (576, 576)) == P("model", "fsdp")  # row split out
    assert rule("layers_0/mlp/down_proj/kernel", (1536, 576)) == P("model", "fsdp")
    assert rule("embed_tokens/embedding", (49152, 576)) == P("model", "fsdp")
    assert rule("layers_0/input_layernorm/scale", (576,)) == P(None)
    assert rule("layers_0/self_attn/k_proj/kernel", (576, 3)) == P("fsdp", None)  # 3 features: not over 2
    # With the head size known, projections split between whole heads only: 3 KV heads of 64 stay
    # whole on model=2 (as the KV cache's heads do), though 192 features would divide.
    k_proj = logical_axes("layers_0/self_attn/k_proj/kernel", 2)
    assert spec_for((576, 192), k_proj, mesh) == P("fsdp", "model")
    assert spec_for((576, 192), k_proj, mesh, head_dim=64) == P("fsdp", None)
    assert spec_for((576, 256), k_proj, mesh, head_dim=64) == P("fsdp", "model")  # 4 heads
    assert rule("mixer/GRUCell_0/hn/kernel", (128, 128)) == P(None, None)  # unlisted: replicated
    # The batch takes data and fsdp together, data alone when only it divides, or neither.
    assert spec_for((8, 16), ("batch", None), mesh) == P(("data", "fsdp"), None)
    assert spec_for((6, 16), ("batch", None), mesh) == P("data", None)
    assert spec_for((5, 16), ("batch", None), mesh) == P(None, None)


@pytest.fixture(scope="module")
def job(target, drafter, tmp_path_factory):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, target.config.vocab_size, size=n).tolist() for n in (3, 5, 7, 4)]
    path = tmp_path_factory.mktemp("sharded") / "job.pkl"
    job = {"target": (target.config, jax.device_get(target.params)),
           "drafter": (drafter.config, jax.device_get(drafter.params), drafter.num_target_layers),
           "eos": list(target.eos_token_ids), "prompts": prompts, "max_new_tokens": 16, "tree_budget": 4}
    return path, job


def _run_child(path: Path, job: dict, meshes, methods, serve=(), redraft=False) -> dict:
    with open(path, "wb") as f:
        pickle.dump({**job, "meshes": list(meshes), "methods": list(methods), "serve": list(serve),
                     "redraft": redraft}, f)
    done = subprocess.run([sys.executable, str(HERE / "sharded_decode.py"), str(path)], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["devices"] == 8
    assert result["smaller_mesh"] == [0, 1, 2, 3]
    return result["outputs"]


def _one_device(target, drafter, job, methods) -> dict:
    from specjax.decode.engine import Engine
    from specjax.decode.tree import TreeConfig

    engine = Engine(target, drafter, latency_cache=False)
    return {m: engine.generate(job["prompts"], job["max_new_tokens"], method=m,
                               **({"tree": TreeConfig(budget=job["tree_budget"])} if m == "tree" else {})).tokens
            for m in methods}


@pytest.mark.parametrize("meshes", [pytest.param(("data=2,fsdp=2,model=2",), marks=pytest.mark.slow),
                                    pytest.param(("model=8", "data=4,model=2", "fsdp=8"), marks=pytest.mark.slow)],
                         ids=["dp-fsdp-tp", "more-meshes"])
def test_greedy_output_on_a_mesh_is_the_one_device_output(target, drafter, job, meshes):
    """Engine decoding (ar, chain, tree, and rapid re-retrieving its drafting context) and the
    serving scheduler (chain, 4 slots) over a mesh give the one-device tokens, with weights, slots
    and KV heads really split."""
    methods = ("ar", "chain", "tree")
    reference = _one_device(target, drafter, job[1], methods)
    assert reference["chain"] == reference["ar"] == reference["tree"]
    outputs = _run_child(*job, meshes, methods, serve=("chain",), redraft=True)
    rows, cols = target.params["layers_0"]["self_attn"]["q_proj"]["kernel"].shape
    for mesh in meshes:
        config = MeshConfig.parse(mesh)  # q_proj is [embed / fsdp, heads / model] on each device
        heads_split = config.model if target.config.num_heads % config.model == 0 else 1  # whole heads only
        assert outputs[mesh]["q_proj_shard"] == [rows // config.fsdp, cols // heads_split], mesh
        for method in methods:
            assert outputs[mesh][method] == reference[method], (mesh, method)
        # rapid with re-retrieval: refreshed drafting contexts keep the mesh's layout; output is AR's.
        assert outputs[mesh]["rapid+redraft"] == reference["ar"] and outputs[mesh]["redrafts"] >= 1, mesh
        # The server's 4 slots split over data and fsdp (as far as they divide 4), KV heads over model.
        assert outputs[mesh]["serve:chain"] == reference["chain"], mesh
        slots, length, heads, dim = outputs[mesh]["serve:chain:kv_shape"]
        split = next(n for n in (config.data * config.fsdp, config.data, 1) if slots % n == 0)
        kv_model = config.model if heads % config.model == 0 else 1
        assert outputs[mesh]["serve:chain:kv_shard"] == [slots // split, length, heads // kv_model, dim], mesh


def test_training_on_a_mesh_matches_one_device_and_resumes_on_another_mesh(tmp_path):
    """6 steps on one device against 3 steps on data=2,fsdp=2,model=2 resumed (from orbax's sharded
    checkpoint) to step 6 on fsdp=4,model=2: the same losses within 1e-5, and the weights really
    split under the second mesh."""
    done = subprocess.run([sys.executable, str(HERE / "sharded_train.py"), str(tmp_path), "data=2,fsdp=2,model=2",
                           "fsdp=4,model=2"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["devices"] == 8
    assert len(result["sharded"]) == len(result["single"]) == 6
    np.testing.assert_allclose(result["sharded"], result["single"], rtol=0, atol=1e-5)
    rows, cols = result["q_proj_shape"]
    assert result["q_proj_shard"] == [rows // 4, cols // 2]


@pytest.mark.slow  # about a minute: three trainers, each compiled on one device and on the mesh
def test_drafter_refiner_and_compressor_training_on_a_mesh_match_one_device(target, drafter, tmp_path):
    """The trainers the train-drafter, train-refiner and train-compressor recipes call: 3 steps on
    data=2,fsdp=2,model=2 give the one-device losses within 1e-5, with the drafter really split."""
    from conftest import tiny_distillation_set

    tiny_distillation_set(target, tmp_path / "data", 3, n=16)  # 48-token sequences, written to disk
    with open(tmp_path / "job.pkl", "wb") as f:
        pickle.dump({"target": (target.config, jax.device_get(target.params)),
                     "drafter": (drafter.config, jax.device_get(drafter.params), drafter.num_target_layers),
                     "data": str(tmp_path / "data")}, f)
    done = subprocess.run([sys.executable, str(HERE / "sharded_recipes.py"), str(tmp_path / "job.pkl"),
                           str(tmp_path / "runs"), "data=2,fsdp=2,model=2"], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["devices"] == 8
    for trainer in ("drafter", "refiner", "compressor"):
        assert len(result[trainer]["one"]) == len(result[trainer]["mesh"]) == 3, trainer
        np.testing.assert_allclose(result[trainer]["mesh"], result[trainer]["one"], rtol=0, atol=1e-5,
                                   err_msg=trainer)
    rows, cols = result["drafter_q_proj"]["shape"]
    assert result["drafter_q_proj"]["shard"] == [rows // 2, cols // 2]


def test_cli_mesh_and_multi_host_flags_fail_clearly(capsys, tmp_path):
    from specjax.cli import main

    cases = [(["generate", "--prompt", "hi", "--mesh", "tensor=2"], "axis=size pairs"),
             (["generate", "--prompt", "hi", "--mesh", "model=3"], "needs 3 devices"),
             (["train-lm", "--out", str(tmp_path), "--num-processes", "2"], "need --coordinator"),
             (["train-lm", "--out", str(tmp_path), "--coordinator", "127.0.0.1:1", "--num-processes", "2"],
              "needs --num-processes and --process-id"),
             (["bench", "--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "2"],
              r"--process-id must be in \[0, 2\)"),
             (["generate", "--prompt", "hi", "--coordinator", "auto"], "found no cluster")]
    for argv, message in cases:
        assert main(argv) == 2, argv
        assert re.search(message, capsys.readouterr().err), argv


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_processes(command: list[str], tmp_path: Path, timeout: int) -> list[tuple[int, str, str]]:
    """(return code, stdout, stderr) of each of two processes running `command` + [PORT, ID, 2, ...]."""
    port = _free_port()
    # Files rather than pipes: a process blocked on a full pipe would stall the other in a collective.
    logs = [(open(tmp_path / f"out{i}.txt", "w+"), open(tmp_path / f"err{i}.txt", "w+")) for i in range(2)]
    procs = [subprocess.Popen([sys.executable, command[0], str(port), str(i), "2", *command[1:]],
                              stdout=out, stderr=err, text=True) for i, (out, err) in enumerate(logs)]
    try:
        for p in procs:
            p.wait(timeout=timeout)
    finally:
        for p in procs:
            p.kill()
    results = []
    for p, (out, err) in zip(procs, logs):
        out.seek(0), err.seek(0)
        results.append((p.returncode, out.read(), err.read()))
        out.close(), err.close()
    return results


def _printed(results) -> list[list[str]]:
    """Each process's own stdout lines. gloo's connection messages ("[Gloo] Rank 0 is connected to 1
    peer ranks ...") go to every process's C stdout unbuffered, so they can split a line, and leave
    their pieces (a bare "1") on lines of their own: dropped."""
    return [[line for line in out.splitlines()
             if line.strip() and "peer ranks" not in line and "[Gloo]" not in line and not line.strip().isdigit()]
            for _, out, _ in results]


@pytest.mark.slow  # about 2 minutes: the language model run twice, then a drafter for it, then a decode
def test_two_processes_run_the_training_commands_as_one(tmp_path, capsys):
    """`specjax train-lm` and then `specjax train-drafter` on that model, each as two processes of 4
    CPU devices on one 8-device mesh: the same losses as one process on one device, one set of
    files (written by process 0), results printed once. Then the pair decodes with auto-sized trees
    over the two processes."""
    from specjax.cli import main
    from specjax.train.loop import read_metrics

    # float32, not --dtype auto: the check is that the mesh computes what one device does, to 1e-5;
    # in bf16 the partial sums split over devices round apart by about that much (1.1e-5 measured).
    lm = ["train-lm", "--steps", "3", "--vocab-size", "300", "--seq-len", "32", "--batch-size", "8",
          "--eval-every", "3", "--checkpoint-every", "3", "--dtype", "float32", "--json"]
    drafter = ["train-drafter", "--chat-prompts", "0", "--everyday-prompts", "8", "--corpus-sequences", "8", "--seq-len", "128", "--steps", "3",
               "--block-size", "4", "--taps", "2", "--dtype", "float32", "--json"]
    # Self-distillation renders chat prompts: give the tiny model a plain chat template.
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    summaries = {}
    assert main(lm + ["--out", str(tmp_path / "one" / "lm")]) == 0
    summaries["lm"] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    (tmp_path / "one" / "lm" / "model" / "chat_template.jinja").write_text(template)
    assert main(drafter + ["--model", str(tmp_path / "one" / "lm" / "model"), "--out",
                           str(tmp_path / "one" / "drafter")]) == 0
    summaries["drafter"] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    both = tmp_path / "two"
    for argv, name in ((lm, "lm"), (drafter + ["--model", str(both / "lm" / "model")], "drafter")):
        (tmp_path / name).mkdir()
        results = _run_processes([str(HERE / "multihost_cli.py"), *argv, "--mesh", "data=2,fsdp=2,model=2",
                                  "--out", str(both / name)], tmp_path / name, timeout=550)
        for code, _, err in results:
            assert code == 0, err[-3000:]
        printed = _printed(results)
        assert len(printed[0]) == 1  # the summary, printed by process 0
        assert printed[1] == [], printed[1][-5:]  # and by no other
        summary = json.loads(printed[0][0])
        for key, value in summaries[name].items():  # held-out loss, tau estimate, token counts
            if isinstance(value, (int, float)):
                np.testing.assert_allclose(summary[key], value, rtol=1e-5, err_msg=f"{name}: {key}")
        run = both / name / ("run" if name == "drafter" else "")
        one = tmp_path / "one" / name / ("run" if name == "drafter" else "")
        losses = [[m["loss"] for m in read_metrics(folder) if "loss" in m] for folder in (one, run)]
        assert len(losses[0]) == len(losses[1]) >= 1, name
        np.testing.assert_allclose(losses[1], losses[0], rtol=0, atol=1e-5, err_msg=name)
        if name == "lm":
            (both / "lm" / "model" / "chat_template.jinja").write_text(template)
    assert (both / "lm" / "model" / "model.safetensors").exists()
    assert (both / "drafter" / "drafter").is_dir()
    # The trained pair decodes with auto-sized trees over the two processes (each times its own
    # verify passes; all use process 0's costs) and prints AR's tokens once.
    generate = ["generate", "--model", str(both / "lm" / "model"), "--prompt-ids", "5,6,7,8", "--max-new-tokens", "12",
                "--ignore-eos", "--json"]
    assert main(generate + ["--method", "ar"]) == 0
    expected = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    (tmp_path / "generate").mkdir()
    results = _run_processes([str(HERE / "multihost_cli.py"), *generate, "--method", "tree", "--drafter",
                              str(both / "drafter" / "drafter"), "--mesh", "data=2,model=4"], tmp_path / "generate",
                             timeout=550)
    for code, _, err in results:
        assert code == 0, err[-3000:]
    printed = _printed(results)
    assert printed[1] == [] and len(printed[0]) == 1
    assert json.loads(printed[0][0])["tokens"] == expected["tokens"]


@pytest.mark.slow  # 40-60 s; the default suite keeps the one-process mesh tests
def test_two_processes_on_loopback_train_and_decode_as_one(target, drafter, job, tmp_path):
    """Two processes with 4 CPU devices each join one 8-device mesh through jax.distributed (gloo
    collectives, coordinator on 127.0.0.1): one training step and one greedy decode equal one process."""
    from sharded_train import run

    path, payload = job
    with open(tmp_path / "job.pkl", "wb") as f:
        pickle.dump(payload, f)
    # Each child also ends itself after 400 s (faulthandler).
    results = _run_processes([str(HERE / "multihost_run.py"), str(tmp_path)], tmp_path, timeout=450)
    for code, _, err in results:
        assert code == 0, err[-3000:]
    result = json.loads(results[0][1].strip().splitlines()[-1])
    assert (result["devices"], result["local_devices"]) == (8, 4)
    _, reference_losses = run(tmp_path / "one-process", 1, None)
    np.testing.assert_allclose(result["losses"], reference_losses, rtol=0, atol=1e-5)
    reference = _one_device(target, drafter, payload, ("ar", "chain"))
    assert result["outputs"] == reference


def test_weights_loaded_to_the_host_are_cast_there_and_placed_straight_onto_devices(target):
    """at_compute_dtype casts host weights on the host (bit for bit XLA's rounding), so that
    place_params sends each device only its slices; device weights stay on their device."""
    import dataclasses

    import jax.numpy as jnp

    from specjax.io.registry import at_compute_dtype
    from specjax.sharding import place_params

    host = dataclasses.replace(target, params=jax.device_get(target.params))
    cast = at_compute_dtype(host, "bfloat16")
    for before, after in zip(jax.tree.leaves(host.params), jax.tree.leaves(cast.params)):
        assert isinstance(after, np.ndarray) and after.dtype == jnp.bfloat16
        np.testing.assert_array_equal(after.view(np.uint16), np.asarray(jnp.asarray(before, jnp.bfloat16)).view(np.uint16))
    placed = place_params(cast, None)
    assert all(isinstance(a, jax.Array) for a in jax.tree.leaves(placed.params))
    on_device = at_compute_dtype(placed, "float32")
    assert all(isinstance(a, jax.Array) for a in jax.tree.leaves(on_device.params))
    assert place_params(None, None) is None
