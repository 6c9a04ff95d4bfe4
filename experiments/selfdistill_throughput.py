"""Self-distillation throughput (issue 14, item 5): new tokens per second of the target's greedy
continuations, with the batch decoded to completion (Engine.generate, what the recipe used before)
against the continuous-refill generator (specjax.train.selfdistill), at each precision asked for,
on the same prompts, in one process. Compilation is excluded: each configuration first runs once
on a few prompts of the same shapes.

    python experiments/selfdistill_throughput.py [--prompts 96] [--batch 32,64] [--dtypes float32,bfloat16]
        [--generators whole,refill,refill-full] [--attention auto,per-head] [--kinds mix,chat,everyday]
        [--features-pass]

`refill` starts the cache as wide as the shortest prompts need and widens it as longer ones come up
(`GeneratorConfig.grow_cache`); `refill-full` keeps the full width (prompt limit + new tokens) from
the start, as before 2026-12-06. `--kinds` runs each prompt kind on its own, as the recipe does
(one generator call per kind), or all four mixed in one call (`mix`).

`--attention per-head` turns off the stacked-heads attention form that many-row steps take on CPU
(models/layers.py:stacked_heads_pays), so both forms can be timed in one run. The refill generator's
generators first run over the same prompts once, untimed, which compiles every program the timed
run meets (insert calls, decode steps at each cache width), so the timed run excludes compilation.

`--features-pass` also times the next stage of the recipe on each kind's continuations: the target
run over each sequence (256 slots) to store its tap features and top-8 (`build_distillation_set`),
with batches at their own width (`width_bucket` 32, the default) against always the full 256.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=96)
    parser.add_argument("--batch", default="32,64", help="comma-separated row counts")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--steps-per-sync", type=int, default=16)
    parser.add_argument("--generators", default="whole,refill",
                        help="comma-separated: whole (Engine.generate), refill, refill-full")
    parser.add_argument("--kinds", default="mix", help="comma-separated: mix, chat, everyday, math, code")
    parser.add_argument("--features-pass", action="store_true",
                        help="also time the features pass over the continuations, per-batch width against full width")
    parser.add_argument("--attention", default="auto", help="auto, per-head, or both (comma-separated)")
    args = parser.parse_args()

    import jax

    from specjax.models import layers

    from specjax.data.corpora import load_split
    from specjax.data.prompts import code_task_prompts, everyday_chat_prompts, math_word_prompts, training_chat_prompts
    from specjax.decode.engine import Engine
    from specjax.io.registry import at_compute_dtype, load_model
    from specjax.models.drafter import DrafterConfig
    from specjax.train.drafter import build_distillation_set
    from specjax.train.selfdistill import GeneratorConfig, generate_continuations, read_continuations

    base = load_model("smollm2")
    docs, _ = load_split(("austen", "shakespeare", "kjv", "python_stdlib"))
    quarter = args.prompts // 4
    texts_by_kind = {"chat": training_chat_prompts(docs, quarter, 1), "everyday": everyday_chat_prompts(quarter, 1),
                     "math": math_word_prompts(quarter, 1), "code": code_task_prompts(args.prompts - 3 * quarter, 1)}
    texts_by_kind["mix"] = [t for kind in ("chat", "everyday", "math", "code") for t in texts_by_kind[kind]]
    prompts_by_kind = {}
    for kind in args.kinds.split(","):
        if kind not in texts_by_kind:
            parser.error(f"--kinds: unknown kind {kind!r}; available: {', '.join(texts_by_kind)}")
        texts = texts_by_kind[kind]
        prompts_by_kind[kind] = [ids for ids in (base.tokenizer.encode_chat(t) for t in texts) if len(ids) <= 128]
        print(f"{kind}: {len(prompts_by_kind[kind])} prompts (of {len(texts)}; longer than 128 tokens dropped), "
              f"up to {args.new_tokens} new tokens")
    generators = args.generators.split(",")
    unknown = set(generators) - {"whole", "refill", "refill-full"}
    if unknown:
        parser.error(f"--generators: unknown {', '.join(sorted(unknown))}; available: whole, refill, refill-full")
    rows = []
    for attention in args.attention.split(","):
        # The rule is read while tracing, so every program is traced anew under each setting.
        layers.STACKED_HEADS_MIN_BATCH = 16 if attention == "auto" else 10**9
        jax.clear_caches()
        for dtype in args.dtypes.split(","):
            model = at_compute_dtype(base, dtype)
            for batch in (int(b) for b in args.batch.split(",")):
                for kind, prompts in prompts_by_kind.items():
                    label = lambda how: f"{kind}: {how}, attention {attention}"  # noqa: E731
                    if "whole" in generators:
                        engine = Engine(model)
                        engine.generate(prompts[:batch], args.new_tokens)  # compile
                        started, new = time.perf_counter(), 0
                        for begin in range(0, len(prompts), batch):
                            out = engine.generate(prompts[begin : begin + batch], args.new_tokens)
                            new += sum(len(t) for t in out.tokens)
                        rows.append((dtype, batch, label("whole batches (Engine.generate)"), new,
                                     time.perf_counter() - started))
                    for how, grow in (("refill", True), ("refill-full", False)):
                        if how not in generators:
                            continue
                        gen = GeneratorConfig(batch_size=batch, max_prompt_tokens=128, max_new_tokens=args.new_tokens,
                                              steps_per_sync=args.steps_per_sync, refill_rows=max(1, batch // 4),
                                              grow_cache=grow)
                        with tempfile.TemporaryDirectory() as tmp:
                            # The same prompts once untimed: it compiles every program the timed run calls
                            # (an insert per prompt width, decode steps at each cache width).
                            generate_continuations(model.params, model.config, prompts, Path(tmp) / "warm.jsonl", gen,
                                                   model.eos_token_ids, progress=False)
                            report = generate_continuations(model.params, model.config, prompts,
                                                            Path(tmp) / "c.jsonl", gen, model.eos_token_ids,
                                                            progress=False)
                            found = read_continuations(Path(tmp) / "c.jsonl")
                        slots = "/".join(map(str, report.cache_slots))
                        rows.append((dtype, batch, label(f"continuous refill, cache slots {slots}"),
                                     report.new_tokens, report.seconds))
                    timed = len(generators)
                    if args.features_pass and "refill" in generators:
                        sequences = [(found[i][0] + found[i][1], len(found[i][0])) for i in sorted(found)]
                        new = sum(len(found[i][1]) for i in found)
                        taps = DrafterConfig.for_target(model.config, num_taps=4).target_layer_ids
                        for bucket in (32, 256):
                            with tempfile.TemporaryDirectory() as tmp:
                                build = lambda folder, n: build_distillation_set(  # noqa: E731
                                    model.params, model.config, sequences[:n], folder, taps, 256,
                                    teacher_labels=False, progress=False, topk=8, width_bucket=bucket)
                                build(Path(tmp) / "warm", len(sequences))  # compiles every width
                                started = time.perf_counter()
                                build(Path(tmp) / "set", len(sequences))
                                rows.append((dtype, 8, label(f"features pass, width bucket {bucket}"), new,
                                             time.perf_counter() - started))
                        timed += 2
                    for row in rows[-timed:]:
                        print(f"  {row[0]} batch {row[1]} {row[2]}: {row[3]} tokens in {row[4]:.1f} s", flush=True)
    print("\n| dtype | rows | generator | new tokens | seconds | new tokens/s |")
    print("|---|---|---|---|---|---|")
    for dtype, batch, how, new, seconds in rows:
        print(f"| {dtype} | {batch} | {how} | {new} | {seconds:.1f} | {new / seconds:.0f} |")


if __name__ == "__main__":
    main()
