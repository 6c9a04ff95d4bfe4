"""Target KV-cache bytes against context length for public sliding-window models, with the sliding
layers' KV rings (how the Engine decodes) against one slot per position.

    python experiments/sliding_kv_memory.py [--json runs/sliding_kv.json] [--plot docs/sliding_kv.png]

The shapes are those of the models' published config.json files, read through specjax's own HF
config parser. Bytes are exact: the arrays `KVCache.zeros` allocates (through jax.eval_shape, so
nothing is allocated), batch 1, bfloat16, rings sized for speculative steps of --step tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys


sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from specjax.io.hf import config_from_hf  # noqa: E402
from specjax.decode.memory import target_kv_bytes  # noqa: E402

# The attention-shape keys of each model's config.json (huggingface.co/<name>/blob/main/config.json).
MODELS = {
    "Mistral-7B-v0.1": dict(architectures=["MistralForCausalLM"], vocab_size=32000, hidden_size=4096,
                            intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                            num_key_value_heads=8, sliding_window=4096, max_position_embeddings=32768),
    "gemma-2-2b": dict(architectures=["Gemma2ForCausalLM"], vocab_size=256000, hidden_size=2304,
                       intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                       head_dim=256, sliding_window=4096, max_position_embeddings=8192),
    "gemma-3-1b": dict(architectures=["Gemma3ForCausalLM"], vocab_size=262144, hidden_size=1152,
                       intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
                       head_dim=256, sliding_window=512, sliding_window_pattern=6, max_position_embeddings=32768),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="1024,2048,4096,8192,16384,32768")
    parser.add_argument("--step", type=int, default=16, help="tokens per verify step (the drafter's block)")
    parser.add_argument("--json", type=pathlib.Path)
    parser.add_argument("--plot", type=pathlib.Path)
    args = parser.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    report = {"contexts": contexts, "step": args.step, "dtype": "bfloat16", "models": {}}
    mib = lambda n: n / 2**20  # noqa: E731
    print("| model | sliding layers | window | " + " | ".join(f"{n} full / ring (MiB)" for n in contexts) + " |")
    print("|---|---|---|" + "---|" * len(contexts))
    for name, hf in MODELS.items():
        config = dataclasses.replace(config_from_hf(hf, name), dtype="bfloat16")
        rings = config.with_kv_rings(args.step)
        full = [target_kv_bytes(config, 1, n) for n in contexts]
        ring = [target_kv_bytes(rings, 1, n) for n in contexts]
        sliding = sum(1 for i in range(config.num_layers) if config.layer_window(i))
        report["models"][name] = {"full": full, "ring": ring, "sliding_layers": sliding,
                                  "layers": config.num_layers, "window": config.sliding_window}
        cells = " | ".join(f"{mib(f):.0f} / {mib(r):.0f}" for f, r in zip(full, ring))
        print(f"| {name} | {sliding} of {config.num_layers} | {config.sliding_window} | {cells} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.5))
        for (name, row), color in zip(report["models"].items(), ("C0", "C1", "C2")):
            ax.plot(contexts, [mib(b) for b in row["full"]], "--o", color=color, label=f"{name}, one slot per position")
            ax.plot(contexts, [mib(b) for b in row["ring"]], "-o", color=color, label=f"{name}, sliding-layer rings")
        ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="target KV cache (MiB, batch 1, bf16)",
               title=f"Target KV cache against context (rings sized for {args.step}-token steps)")
        ax.set_xticks(contexts, [str(c) for c in contexts])
        ax.legend(fontsize=7)
        fig.tight_layout()
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
