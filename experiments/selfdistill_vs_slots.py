"""The self-distillation generator against the serving slot step with continuous refill (issue 47).

Both answer the same everyday requests greedily, with rows refilled as they finish: the generator
(`train/selfdistill.py:generate_continuations`, its own insert/decode programs and a cache grown to
the prompts' bucket) and an AR `Scheduler` (the product's slot step, `decode/slots.py`, the same
continuous batching a server runs). Each runs once untimed over the same prompts (compiling every
program it needs), then once timed; the answers must be the same tokens.

    python experiments/selfdistill_vs_slots.py --prompts 64 --rows 32 --new-tokens 128 --dtype float32
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--rows", type=int, default=32, help="rows decoding at once (generator batch, server slots)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", default=None, help="also write the JSON report here")
    args = parser.parse_args()

    from specjax.data.prompts import everyday_chat_prompts
    from specjax.io.registry import at_compute_dtype, load_model
    from specjax.serve.config import ServeConfig
    from specjax.serve.requests import Request
    from specjax.serve.scheduler import Scheduler
    from specjax.train.selfdistill import GeneratorConfig, generate_continuations, read_continuations

    model = at_compute_dtype(load_model("smollm2"), args.dtype)
    prompts = [ids for ids in (model.tokenizer.encode_chat(t) for t in everyday_chat_prompts(args.prompts, 3))
               if len(ids) <= 128]
    eos = tuple(model.eos_token_ids)
    gen = GeneratorConfig(batch_size=args.rows, max_prompt_tokens=128, max_new_tokens=args.new_tokens,
                          refill_rows=max(1, args.rows // 4))

    def run_generator() -> tuple[float, dict]:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "answers.jsonl"
            started = time.perf_counter()
            generate_continuations(model.params, model.config, prompts, path, gen, eos, progress=False)
            seconds = time.perf_counter() - started
            return seconds, {i: generated for i, (_, generated) in read_continuations(path).items()}

    config = ServeConfig(method="ar", slots=args.rows, context_length=128 + args.new_tokens + 64,
                         max_new_tokens=args.new_tokens, steps_per_sync=16, insert_rows=max(1, args.rows // 4),
                         max_queue=len(prompts) + 1)
    server = Scheduler(model, None, config)

    def run_server() -> tuple[float, dict]:
        started = time.perf_counter()
        handles = [server.submit(Request(tuple(p), max_tokens=args.new_tokens)) for p in prompts]
        answers = {i: list(h.result(timeout=3600).token_ids) for i, h in enumerate(handles)}
        return time.perf_counter() - started, answers

    try:
        run_generator(), run_server()  # untimed: compiles (the server's programs compiled at start)
        generator_s, by_generator = run_generator()
        server_s, by_server = run_server()
    finally:
        server.shutdown(drain=False)
    tokens = lambda answers: sum(len(a) for a in answers.values())  # noqa: E731
    strip = lambda ids: list(ids)[:-1] if ids and ids[-1] in eos else list(ids)  # noqa: E731 - EOS kept or not
    same = sum(strip(by_generator.get(i, [])) == strip(by_server[i]) for i in by_server)
    report = {"prompts": len(prompts), "rows": args.rows, "new_tokens": args.new_tokens, "dtype": args.dtype,
              "generator": {"seconds": generator_s, "tokens": tokens(by_generator),
                            "tokens_per_s": tokens(by_generator) / generator_s},
              "slot_step_server": {"seconds": server_s, "tokens": tokens(by_server),
                                   "tokens_per_s": tokens(by_server) / server_s},
              "identical_answers": same}
    report["server_over_generator"] = report["slot_step_server"]["tokens_per_s"] / report["generator"]["tokens_per_s"]
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
