"""Decode and training speed over meshes of this machine's CPU devices, side by side in one process
(information only: on a 2-core host the devices share the cores, so what matters is that every mesh
gives the one-device tokens and losses).

    python experiments/mesh_scaling.py [--devices 2] [--max-new-tokens 64] [--json runs/mesh_scaling.json]

Decoding: SmolLM2-135M with its committed drafter, 4 held-out chat prompts decoded as one batch
(ar and chain), the median of --repeats timed runs after a warm-up, per mesh. Training: a tiny
language model (4 layers, width 256, batch 16 x 128 tokens) through `train()`, the median step time
after the first (compiling) step.
"""

from __future__ import annotations

import os
import sys


def _devices_flag(argv: list[str]) -> int:
    """--devices N (or --devices=N), read before jax starts: XLA takes the device count only then."""
    for i, arg in enumerate(argv):
        if arg.startswith("--devices="):
            return int(arg.split("=", 1)[1])
        if arg == "--devices" and i + 1 < len(argv):
            return int(argv[i + 1])
    return 2


DEVICES = _devices_flag(sys.argv)
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICES}"

import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from specjax.data.prompts import HELDOUT_CHAT_PROMPTS  # noqa: E402
from specjax.decode.engine import Engine  # noqa: E402
from specjax.io.registry import load_model, resolve_drafter  # noqa: E402
from specjax.models.config import TransformerConfig  # noqa: E402
from specjax.models.transformer import init_params  # noqa: E402
from specjax.sharding import MeshConfig  # noqa: E402
from specjax.train.lm import next_token_loss  # noqa: E402
from specjax.train.loop import LoopConfig, OptimizerConfig, read_metrics, train  # noqa: E402

TINY_LM = TransformerConfig(vocab_size=512, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32,
                            intermediate_size=768, max_position_embeddings=256)


def meshes(devices: int) -> list[str]:
    return [""] + [f"{axis}={devices}" for axis in ("data", "fsdp", "model")]


def decode_rows(devices: int, max_new_tokens: int, repeats: int) -> list[dict]:
    model = load_model("smollm2", "float32")
    drafter = resolve_drafter("default", "smollm2")
    prompts = [model.tokenizer.encode_chat(text) for text in HELDOUT_CHAT_PROMPTS[:4]]
    rows, reference = [], {}
    for mesh_text in meshes(devices):
        config = MeshConfig.parse(mesh_text)
        engine = Engine(model, drafter, mesh=config.build() if config.size > 1 else None)
        for method in ("ar", "chain"):
            engine.generate(prompts, max_new_tokens, method=method)  # compile and warm
            runs = [engine.generate(prompts, max_new_tokens, method=method) for _ in range(repeats)]
            reference.setdefault(method, runs[0].tokens)
            rows.append({"mesh": mesh_text or "one device", "method": method,
                         "tokens_per_s": statistics.median(r.stats["tokens_per_s"] for r in runs),
                         "tau": runs[0].stats.get("tau"), "identical": runs[0].tokens == reference[method]})
            print(rows[-1], flush=True)
    return rows


def train_rows(devices: int, steps: int) -> list[dict]:
    def batch(step: int) -> np.ndarray:
        return np.random.default_rng([3, step]).integers(0, TINY_LM.vocab_size, (16, 129)).astype(np.int32)

    def loss(params, tokens, rng):
        return next_token_loss(params, TINY_LM, tokens), {}

    rows, reference = [], None
    for mesh_text in meshes(devices):
        with tempfile.TemporaryDirectory() as out:
            _, losses = train(loss, init_params(TINY_LM, jax.random.key(0)), batch, out,
                              OptimizerConfig(learning_rate=1e-3, warmup_steps=1, total_steps=steps),
                              LoopConfig(steps=steps, log_every=1, eval_every=0, checkpoint_every=steps,
                                         progress=False, mesh=MeshConfig.parse(mesh_text)))
            elapsed = [r["elapsed_s"] for r in read_metrics(out) if "elapsed_s" in r]
        reference = losses if reference is None else reference
        step_s = statistics.median(np.diff(elapsed)[1:])  # the first step compiles
        rows.append({"mesh": mesh_text or "one device", "step_ms": 1e3 * step_s,
                     "max_loss_difference": float(np.max(np.abs(np.subtract(losses, reference))))})
        print(rows[-1], flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=DEVICES, help="forced CPU devices (read before jax starts)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--train-steps", type=int, default=12)
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args(argv)
    decode = decode_rows(args.devices, args.max_new_tokens, args.repeats)
    training = train_rows(args.devices, args.train_steps)
    base = {row["method"]: row["tokens_per_s"] for row in decode if row["mesh"] == "one device"}
    print(f"\nDecoding, SmolLM2-135M, 4 prompts x {args.max_new_tokens} tokens, {args.devices} CPU devices "
          f"(median of {args.repeats})")
    print("| mesh | method | tokens/s | against one device | tau | identical to one device |")
    print("|---|---|---|---|---|---|")
    for row in decode:
        tau = "" if row["tau"] is None else f"{row['tau']:.2f}"
        print(f"| {row['mesh']} | {row['method']} | {row['tokens_per_s']:.1f} | "
              f"{row['tokens_per_s'] / base[row['method']]:.2f}x | {tau} | {row['identical']} |")
    print(f"\nTraining, tiny LM (4 x 256, batch 16 x 128), median step of {args.train_steps - 2}")
    print("| mesh | ms per step | against one device | largest loss difference |")
    print("|---|---|---|---|")
    for row in training:
        print(f"| {row['mesh']} | {row['step_ms']:.1f} | {training[0]['step_ms'] / row['step_ms']:.2f}x | "
              f"{row['max_loss_difference']:.1e} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"devices": args.devices, "decode": decode, "train": training}, indent=2))
    return 0 if all(row["identical"] for row in decode) else 1


if __name__ == "__main__":
    raise SystemExit(main())
