"""specjax's front door: load a target with its drafter, then generate, stream, benchmark or serve.

    import specjax

    llm = specjax.LLM("smollm2")                      # the committed drafter (and refiner) come with it
    [out] = llm.generate("Why is the sky blue?", method="chain", max_tokens=64)
    print(out.text, out.metrics["tau"])
    for piece in llm.stream("Tell me a story.", method="tree"):
        print(piece, end="")
    print(llm.bench(methods=("ar", "chain", "tree")))  # tokens/s, speedup and tau, measured here

Prompts are text (through the chat template when the model has one, unless chat=False), chat messages
([{"role": "user", "content": ...}]) or token ids. Every method is lossless: greedy output is the
target's greedy output token for token, and sampled output follows the target's distribution.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Iterator, Sequence
from typing import Any, Union

import numpy as np

from specjax.decode.sampling import SamplingConfig
from specjax.errors import SpecjaxError

Message = dict
Prompt = Union[str, Sequence[Message], Sequence[int]]
"""Text, one conversation (a list of {"role", "content"} messages) or token ids."""


@dataclasses.dataclass(frozen=True)
class Completion:
    """One prompt's result."""

    prompt_token_ids: list[int]
    """The prompt as the target read it (after the chat template)."""
    token_ids: list[int]
    """The generated tokens."""
    text: str
    """The generated tokens decoded ("" for a target without a tokenizer)."""
    finish_reason: str
    """"stop" (an end-of-sequence token) or "length" (max_tokens reached)."""
    metrics: dict
    """This request's speculative metrics: method, tau (tokens committed per verify step), the
    accepted-length histogram of its steps, its new tokens; and under "batch" the call's tokens/s
    (and the decode loop's alone, without the prefill), prefill, wall and compile seconds, the
    target's precision, the memory the call allocated, and "lossy" where an opt-in lossy option ran."""


class BenchReport(dict):
    """decode/bench.py's report (per method: tokens/s, speedup against AR, tau, identical to AR);
    printed, it is the table `specjax bench` prints."""

    def __str__(self) -> str:
        from specjax.decode.bench import format_table

        return format_table(self)


class LLM:
    """A target model, its drafter (and refiner), and one Engine that keeps the compiled programs."""

    def __init__(self, model: str = "smollm2", *, drafter: str | None = "default", refiner: str | None = "default",
                 dtype: str = "auto", kv_dtype: str = "auto", query_rows: str | int = "auto",
                 latency_cache: bool = True, drafter_window: int = 0, compressor: str = "default",
                 prompt_bucket: int = 32):
        """model: a known name (`specjax models`), an HF folder or a .gguf file.
        drafter: "default" (the committed drafter of a known model), a DFlash-format folder, or None
        (AR and ngram only). refiner: "default", a refiner folder, or None (for the +refiner methods).
        dtype, kv_dtype, query_rows: as the CLI's --dtype, --kv-dtype and --query-rows ("auto":
        float32 on CPUs without native bf16, and bf16 steps padded so speculation stays exact).
        latency_cache: keep the tree budget rule's measured verify costs on disk per machine, model
        and shape (False: measure them afresh in this process).
        drafter_window: > 0 windows the drafter (SW-SpeedDLM): it attends to this many recent
        positions plus summary tokens from `compressor` ("default": the committed one, or a
        folder), so its memory stops growing with the context.
        prompt_bucket: prompts are padded to a multiple of this many tokens; one compiled program
        serves every prompt length in a bucket (long documents: use a few hundred)."""
        from specjax.decode.engine import Engine
        from specjax.decode.parts import PartsSpec, resolve_parts
        from specjax.io.registry import (DEFAULT_DRAFTERS, DEFAULT_REFINERS, compute_dtype, load_model, with_kv_dtype,
                                         with_query_rows)

        self.model = with_query_rows(with_kv_dtype(load_model(model, compute_dtype(dtype)), kv_dtype), query_rows)
        if drafter == "default" and model not in DEFAULT_DRAFTERS:
            drafter = None  # no committed drafter for this model: AR and ngram until one is given
        if refiner == "default" and not (model in DEFAULT_REFINERS and (DEFAULT_REFINERS[model] / "config.json").exists()):
            refiner = None
        # The CLI's one loading path: the drafter checked against the target and cast to its precision,
        # the refiner checked against that drafter.
        needs = ([] if drafter is None else ["chain"]) + ([] if drafter is None or refiner is None else ["chain+refiner"])
        if drafter_window and drafter is None:
            raise SpecjaxError("drafter_window windows a drafter; this LLM has none")
        parts = resolve_parts(needs, self.model, model, PartsSpec(drafter=drafter or "default",
                                                                  refiner=refiner or "default", compressor=compressor,
                                                                  drafter_window=drafter_window))
        self.drafter, self.refiner = parts.drafter, parts.refiner
        self.engine = Engine(self.model, self.drafter, prompt_bucket=prompt_bucket, refiner=self.refiner,
                             latency_cache=latency_cache)
        self._index_cache = None  # long documents' retrieval indexes, built on first use

    @property
    def tokenizer(self):
        return self.model.tokenizer

    @property
    def latency_models(self) -> dict:
        """The tree budget rule's latency models (decode/budget.py LatencyModel) by decode shape:
        verify costs measured at first use (`sizes`, `prior_verify_s`, `prior_fixed_s`) and refitted
        from each call's wall time (`verify_s`, `fixed_s`)."""
        return dict(self.engine.latency_models)

    def __repr__(self) -> str:
        drafter = "no drafter" if self.drafter is None else \
            f"drafter block {self.drafter.config.block_size}, {self.drafter.config.num_layers} layer(s)"
        return f"LLM({self.model.name!r}, {self.model.config.dtype}, {drafter}{', refiner' if self.refiner else ''})"

    # ---- prompts ----

    def encode(self, prompt: Prompt, chat: bool | None = None) -> list[int]:
        """A prompt's token ids: text through the chat template (chat=None: when the tokenizer has
        one; False: as is), chat messages through the template, token ids as given."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise SpecjaxError(f"{self.model.name} has no tokenizer: give token ids")
            if chat is None:
                chat = bool(self.tokenizer.chat_template)
            return self.tokenizer.encode_chat(prompt) if chat else self.tokenizer.encode(prompt)
        items = list(prompt)
        if items and all(isinstance(m, dict) for m in items):
            if self.tokenizer is None or not self.tokenizer.chat_template:
                raise SpecjaxError(f"{self.model.name} has no chat template: give text or token ids")
            for m in items:
                if not isinstance(m.get("content"), str) or m.get("role") not in ("system", "user", "assistant"):
                    raise SpecjaxError(f"a chat message is {{'role': 'system'|'user'|'assistant', 'content': str}}, "
                                       f"got {m!r}")
            return self.tokenizer.encode_chat(items)
        if items and all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in items):
            return [int(t) for t in items]
        raise SpecjaxError(f"a prompt is text, a list of chat messages or a list of token ids, got {prompt!r:.80}")

    def _batch(self, prompts, chat: bool | None) -> list[list[int]]:
        if isinstance(prompts, np.ndarray):
            prompts = prompts.tolist()
        single = isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and
                                              not isinstance(prompts[0], (str, list, tuple)))
        return [self.encode(p, chat) for p in ([prompts] if single else list(prompts))]

    def _method(self, method: str | None) -> str:
        if method is not None:
            return method
        if self.drafter is None:
            return "ar"
        rows = self.model.config.query_rows
        # auto verifies the whole block; a target padded to fewer rows (bf16) runs the trees that fit.
        return "tree" if rows is not None and rows < self.drafter.config.block_size else "auto"

    # ---- decoding ----

    def generate(self, prompts: Prompt | Sequence[Prompt], max_tokens: int = 128, *, method: str | None = None,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0, chat: bool | None = None,
                 ignore_eos: bool = False, document: str | None = None, retrieval=None, redraft_every: int = 0,
                 **options) -> list[Completion]:
        """Decode one prompt or a batch, all rows together on the serving step.

        method: a registry method (`specjax.methods()`): ar, chain, chain:K, chain+refiner, tree,
        tree+refiner, ngram, auto, rapid, rapid+block (default: auto with a drafter, which picks AR,
        chain or tree each step by this machine's measured costs; on a target padded to fewer rows
        than the block, tree; ar without a drafter).
        document: a long text the one prompt (the question) is about. Every method reads the whole
        document before the question; rapid and rapid+block also draft from the chunks `retrieval`
        (a RetrievalConfig; default RetrievalConfig()) picks for the question, re-retrieved every
        `redraft_every` generated tokens if > 0. The completion's metrics["long_context"] says
        what retrieval picked.
        options: the method's config, passed to Engine.generate: tree=TreeConfig(...),
        refine=RefineConfig(...), ngram=NgramConfig(...), auto=AutoConfig(...), rapid=RapidConfig(...)."""
        method = self._method(method)
        sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
        if document is None:
            if retrieval is not None or redraft_every:
                raise SpecjaxError("retrieval and redraft_every apply to a request with a document")
            ids = self._batch(prompts, chat)
            result = self.engine.generate(ids, max_tokens, sampling, seed=seed, ignore_eos=ignore_eos, method=method,
                                          **options)
            return self._completions(ids, result)
        long, config, redraft = self._document_prompt(document, prompts, method, retrieval, redraft_every, chat)
        result = self.engine.generate([long.full], max_tokens, sampling, seed=seed, ignore_eos=ignore_eos,
                                      method=method, redraft=redraft,
                                      drafting_prompts=None if long.drafting is None else [long.drafting], **options)
        [completion] = self._completions([long.full], result)
        completion.metrics["long_context"] = long.summary(config)
        return [completion]

    def _document_prompt(self, document: str, question, method: str, retrieval, redraft_every: int,
                         chat: bool | None):
        """(LongContextPrompt, the RetrievalConfig used or None, Redraft or None) of a document request."""
        from specjax.data.retrieval import IndexCache, RetrievalConfig, document_prompt
        from specjax.decode.slots import slot_method

        if self.tokenizer is None:
            raise SpecjaxError(f"{self.model.name} has no tokenizer, which a document request needs")
        if not (isinstance(question, str) or (isinstance(question, Sequence) and question
                                              and all(isinstance(m, dict) for m in question))):
            raise SpecjaxError("with a document, give one prompt: the question, as text or chat messages")
        if not isinstance(document, str):
            raise SpecjaxError(f"document must be text, got {type(document).__name__}")
        retrieves = slot_method(method).needs_retrieval
        if not retrieves and (retrieval is not None or redraft_every):
            raise SpecjaxError(f"retrieval and redraft_every apply to rapid and rapid+block, not {method!r}")
        config = (retrieval or RetrievalConfig()) if retrieves else None
        if self._index_cache is None:
            self._index_cache = IndexCache()
        chat = bool(self.tokenizer.chat_template) if chat is None else chat
        long, redraft = document_prompt(self.tokenizer, document, question if isinstance(question, str) else
                                        list(question), config, redraft_every, self._index_cache, chat=chat)
        return long, config, redraft

    def retrieve(self, question: Prompt, document: str, retrieval=None, chat: bool | None = None):
        """What rapid would draft from for `question` about `document`: a RetrievalView with every
        chunk, its score and the chunks picked (retrieval: a RetrievalConfig; default RetrievalConfig()).
        The index is the one `generate(..., document=...)` uses, so a later generate reuses it."""
        from specjax.data.retrieval import IndexCache, RetrievalConfig, retrieval_view

        if self.tokenizer is None:
            raise SpecjaxError(f"{self.model.name} has no tokenizer, which retrieval needs")
        if not isinstance(document, str):
            raise SpecjaxError(f"document must be text, got {type(document).__name__}")
        if self._index_cache is None:
            self._index_cache = IndexCache()
        chat = bool(self.tokenizer.chat_template) if chat is None else chat
        return retrieval_view(self.tokenizer, document, question if isinstance(question, str) else list(question),
                              retrieval or RetrievalConfig(), self._index_cache, chat=chat)

    def draft_blocks(self, contexts: Sequence[Sequence[int]], anchors: Sequence[int] | None = None):
        """The drafter's greedy block after each context (token ids), anchored at `anchors` (the
        token committed after each context; None: the target's greedy next token): what a greedy
        chain step would verify there. Returns (drafts [P, K] int, the target's greedy next token
        after each context [P]); K = block - 1. For looking inside a drafter, as notebook 01 does."""
        import jax.numpy as jnp

        from specjax.decode.sampling import SamplingConfig as Sampling
        from specjax.decode.speculative import draft_block, start_speculation
        from specjax.models.transformer import head_matrix

        if self.drafter is None:
            raise SpecjaxError("draft_blocks needs a drafter; this LLM has none")
        contexts = [self.encode(c) for c in contexts]
        if not contexts or not all(contexts):
            raise SpecjaxError("draft_blocks needs at least one non-empty context")
        if anchors is not None and len(anchors) != len(contexts):
            raise SpecjaxError(f"one anchor per context: {len(anchors)} anchors for {len(contexts)} contexts")
        longest = max(map(len, contexts))
        padded = jnp.asarray([c + [0] * (longest - len(c)) for c in contexts])  # [P, T]
        lengths = jnp.asarray([len(c) for c in contexts])  # [P]
        model, drafter = self.model, self.drafter
        greedy_next, _, context = start_speculation(model.params, model.config, drafter.params, drafter.config, padded,
                                                    lengths, longest + drafter.config.block_size, Sampling(), None)
        anchor = greedy_next if anchors is None else jnp.asarray(list(anchors), jnp.int32)  # [P]
        vocab = None if drafter.draft_vocab is None else jnp.asarray(drafter.draft_vocab)
        logits = draft_block(model.params, model.config, drafter.params, drafter.config, anchor, lengths, context,
                             head_matrix(model.params, model.config, vocab))  # [P, K, V']
        best = jnp.argmax(logits, -1)
        return np.asarray(best if vocab is None else vocab[best]), np.asarray(greedy_next)

    def drafter_memory(self, contexts: Sequence[int], batch: int = 1) -> dict:
        """For each context length (tokens): the target's KV bytes, the drafter's context state with
        full attention and windowed, and the peak of one compiled drafting step with each
        (decode/memory.py memory_report). Needs an LLM made with drafter_window."""
        from specjax.decode.memory import memory_report

        if self.drafter is None or self.drafter.config.window is None:
            raise SpecjaxError("drafter_memory compares full and windowed drafting: make the LLM with drafter_window")
        return memory_report(self.model.config, self.model.params, self.drafter.config, self.drafter.params,
                             self.drafter.config.window, list(contexts), batch=batch, progress=False)

    def stream(self, prompt: Prompt, max_tokens: int = 128, *, method: str | None = None, temperature: float = 0.0,
               top_k: int = 0, top_p: float = 1.0, seed: int = 0, chat: bool | None = None, every: int = 8,
               ignore_eos: bool = False, **options) -> Iterator[str]:
        """The text of one prompt's answer as it is decoded, a piece after about every `every`
        tokens (one host sync per piece, never per token). The pieces joined are generate's text."""
        [ids] = self._batch(prompt, chat)
        sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
        pieces: queue.Queue = queue.Queue()
        done = object()

        def decode():
            try:
                self.engine.generate([ids], max_tokens, sampling, seed=seed, ignore_eos=ignore_eos,
                                     method=self._method(method),
                                     on_tokens=lambda rows: pieces.put(list(rows[0])), stream_every=every, **options)
                pieces.put(done)
            except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
                pieces.put(exc)

        thread = threading.Thread(target=decode, name="specjax-stream", daemon=True)
        thread.start()
        shown = ""
        while (item := pieces.get()) is not done:
            if isinstance(item, BaseException):
                raise item
            text = self.tokenizer.decode(item) if self.tokenizer is not None else ""
            if len(text) > len(shown) and text.startswith(shown):
                yield text[len(shown):]
                shown = text
        thread.join()

    def bench(self, prompts: Sequence[Prompt] | None = None,
              methods: Sequence[str] | dict[str, str | tuple[str, dict]] = ("ar", "chain", "tree"),
              max_tokens: int = 64, *, temperature: float = 0.0, seed: int = 0, repeats: int = 1, chat: bool | None = None,
              progress: bool = True, **options) -> BenchReport:
        """Every method on the same prompts (default: the built-in held-out chat prompts), measured
        side by side on this machine: tokens/s, speedup against AR, tau, and whether the output is
        AR's. methods: method names, or labelled variants {label: method or (method, generate
        options)}, e.g. {"ar": "ar", "refined x2": ("chain+refiner", {"refine": RefineConfig(2)})};
        the one labelled "ar", if any, is the baseline. options: per-method generate options keyed by method
        name, for plain method names."""
        from specjax.data.prompts import HELDOUT_CHAT_PROMPTS
        from specjax.decode.bench import run_bench

        ids = self._batch(list(HELDOUT_CHAT_PROMPTS) if prompts is None else prompts, chat)
        report = run_bench(self.engine, ids, methods, max_tokens, SamplingConfig(temperature=temperature), seed=seed,
                           repeats=repeats, progress=progress, options=options or None)
        return BenchReport(report)

    def server(self, slots: int = 8, method: str = "adaptive", *, metrics_log: str | None = None,
               compile_now: bool = True, **config):
        """A continuous-batching Scheduler over this model (what `specjax serve` runs, without HTTP):
        `handle = server.submit(specjax.Request(ids, max_tokens=64))`, then `handle.result()` or
        iterate `handle` for its pieces. config: ServeConfig fields. metrics_log: the run log
        `specjax report` plots; compile_now=False: compile each program on first use. Call
        `server.shutdown()` after."""
        from specjax.serve.config import ServeConfig
        from specjax.serve.scheduler import Scheduler

        return Scheduler(self.model, self.drafter, ServeConfig(method=method, slots=slots, **config),
                         metrics_log=metrics_log, compile_now=compile_now, refiner=self.refiner)

    def _completions(self, ids: list[list[int]], result) -> list[Completion]:
        stats = result.stats
        eos = set(self.model.eos_token_ids)
        batch = {k: stats[k] for k in ("tokens_per_s", "decode_tokens_per_s", "prefill_s", "wall_s", "compile_s",
                                       "new_tokens", "precision", "memory", "lossy") if k in stats}
        rows = stats.get("row_accepted_length_histograms")
        out = []
        for i, (prompt, tokens) in enumerate(zip(ids, result.tokens)):
            metrics: dict[str, Any] = {"method": stats["method"], "new_tokens": len(tokens), "batch": batch}
            if rows is not None:
                histogram = np.asarray(rows[i])
                steps = int(histogram.sum())
                metrics["accepted_length_histogram"] = histogram.tolist()
                metrics["tau"] = float((histogram * np.arange(1, len(histogram) + 1)).sum() / steps) if steps else None
            text = self.tokenizer.decode(tokens) if self.tokenizer is not None else ""
            out.append(Completion(prompt, list(tokens), text, "stop" if tokens and tokens[-1] in eos else "length",
                                  metrics))
        return out


def methods() -> tuple[str, ...]:
    """Every decoding method in the registry (decode/slots.py); chain:K limits a chain to K drafts."""
    from specjax.decode.slots import SLOT_METHODS

    return tuple(SLOT_METHODS)
