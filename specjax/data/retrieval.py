"""Retrieval over a request's long context, for retrieval-augmented drafting (RAPID).

A document (token ids of the target's tokenizer) is cut into chunks of `chunk_tokens` tokens with no
overlap. A retriever scores the chunks against a query: dense (MiniLM-L6 sentence embeddings,
cosine) or BM25 (`bm25s`, the lexical baseline). The selection takes the best chunks that fit a
token budget and pass a score threshold, and keeps them in document order, joined by a blank line,
so the drafter reads them as the text they were.

An index is built once per (document, chunking, retriever) and cached by content hash, so requests
that share a document share its index.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import threading
import time
from typing import Callable, Protocol, Sequence

import numpy as np

from specjax.errors import SpecjaxError, check_at_least


@dataclasses.dataclass(frozen=True)
class RetrievalConfig:
    """How a long context is cut, searched and selected."""

    retriever: str = "minilm"
    """A name in RETRIEVERS: "minilm" (dense, cosine) or "bm25"."""
    chunk_tokens: int = 256
    """Target tokens per chunk (RAPID uses 128-512), no overlap; the last chunk may be shorter."""
    budget_tokens: int = 1024
    """Most target tokens of retrieved text (chunks and the separators between them)."""
    top_k: int | None = None
    """At most this many chunks (None: as many as the budget holds)."""
    min_score: float = 0.1
    """Chunks scoring below this (or not above 0) are never selected: a cosine for "minilm" (RAPID
    uses 0.1-0.3), a BM25 score for "bm25" (0: any chunk sharing a term with the query)."""
    recent_tokens: int = 128
    """Without a question, the query is the last this many tokens of the text so far."""

    def __post_init__(self):
        check_at_least(1, chunk_tokens=self.chunk_tokens, budget_tokens=self.budget_tokens,
                       recent_tokens=self.recent_tokens)
        if self.top_k is not None:
            check_at_least(1, top_k=self.top_k)
        if self.retriever not in RETRIEVERS:
            raise SpecjaxError(f"unknown retriever {self.retriever!r}; choose from {', '.join(RETRIEVERS)}")


class ChunkScorer(Protocol):
    """Scores every chunk of one document against a query text (higher is more relevant)."""

    def scores(self, query: str) -> np.ndarray: ...


class DenseScorer:
    """Cosine between sentence embeddings (MiniLM-L6 by default; any `SentenceEncoder`)."""

    def __init__(self, texts: Sequence[str], encoder):
        self.encoder = encoder
        self.embeddings = encoder.encode(list(texts))  # [N, d] unit vectors

    def scores(self, query: str) -> np.ndarray:
        return self.embeddings @ self.encoder.encode([query])[0]


class Bm25Scorer:
    """BM25 (Lucene variant, English stop words) over the chunks' words, by `bm25s`."""

    def __init__(self, texts: Sequence[str], encoder=None):
        import bm25s

        self._bm25s = bm25s
        self.retriever = bm25s.BM25()
        self.retriever.index(bm25s.tokenize(list(texts), stopwords="en", show_progress=False), show_progress=False)
        self.size = len(texts)

    def scores(self, query: str) -> np.ndarray:
        words = self._bm25s.tokenize([query], stopwords="en", return_ids=False, show_progress=False)[0]
        if not words:
            return np.zeros(self.size, np.float32)
        return np.asarray(self.retriever.get_scores(words), np.float32)


RETRIEVERS: dict[str, Callable] = {"minilm": DenseScorer, "bm25": Bm25Scorer}
"""Retriever name -> scorer class(texts, encoder). Dense scorers need a sentence encoder."""
NEEDS_ENCODER = {"minilm"}


@dataclasses.dataclass(frozen=True)
class Selection:
    """What one retrieval picked, and what it cost."""

    token_ids: list[int]
    """The selected chunks' target tokens in document order, a blank line between neighbours."""
    chunks: list[int]
    """Indices of the selected chunks, ascending (document order)."""
    scores: list[float]
    """Each selected chunk's score, in the same order."""
    query: str
    seconds: float
    """Wall time of scoring and selection (the index was built before)."""


@dataclasses.dataclass
class DocumentIndex:
    """One document cut into chunks, with a scorer over them."""

    digest: str
    """sha256 of the document's tokens, the chunking and the retriever: the cache key."""
    document: np.ndarray
    """[L] int32: the document's target tokens."""
    bounds: list[tuple[int, int]]
    """Each chunk's [start, end) in the document."""
    texts: list[str]
    scorer: ChunkScorer
    build_seconds: float

    def chunk_ids(self, index: int) -> list[int]:
        start, end = self.bounds[index]
        return self.document[start:end].tolist()

    def select(self, query: str, config: RetrievalConfig, separator: Sequence[int] = ()) -> Selection:
        """The best chunks for `query` within config's budget, threshold and top_k, in document order
        (the index may be shared by requests that select differently)."""
        cfg = config
        started = time.perf_counter()
        scores = self.scorer.scores(query)
        order = np.argsort(-scores, kind="stable")  # best first; ties keep document order
        chosen, used = [], 0
        for index in order:
            if scores[index] < cfg.min_score or scores[index] <= 0 or (cfg.top_k is not None
                                                                          and len(chosen) == cfg.top_k):
                break
            start, end = self.bounds[index]
            cost = end - start + (len(separator) if chosen else 0)
            if used + cost <= cfg.budget_tokens:  # a chunk too long for what is left is skipped, not cut
                chosen.append(int(index))
                used += cost
        chosen.sort()
        ids: list[int] = []
        for n, index in enumerate(chosen):
            ids += (list(separator) if n else []) + self.chunk_ids(index)
        return Selection(ids, chosen, [float(scores[i]) for i in chosen], query, time.perf_counter() - started)


def chunk_bounds(length: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """[start, end) of consecutive chunks of chunk_tokens covering [0, length)."""
    return [(start, min(start + chunk_tokens, length)) for start in range(0, length, chunk_tokens)]


class IndexCache:
    """Indexes by content hash, least recently used dropped past `capacity` (thread-safe: the server
    builds indexes for concurrent requests)."""

    def __init__(self, capacity: int = 16):
        self.capacity = capacity
        self._indexes: collections.OrderedDict[str, DocumentIndex] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get_or_build(self, document: Sequence[int], decode: Callable[[list[int]], str], config: RetrievalConfig,
                     encoder=None) -> DocumentIndex:
        """The index of `document` (target token ids); decode turns a chunk's ids into the text the
        retriever reads (the target's tokenizer)."""
        document = np.asarray(document, np.int32)
        if document.ndim != 1 or not len(document):
            raise SpecjaxError("the document to retrieve from is empty")
        key = hashlib.sha256(document.tobytes() + f"|{config.chunk_tokens}|{config.retriever}|"
                             f"{getattr(encoder, 'name', '')}".encode()).hexdigest()
        with self._lock:
            if key in self._indexes:
                self.hits += 1
                self._indexes.move_to_end(key)
                return self._indexes[key]
            self.misses += 1
        if config.retriever in NEEDS_ENCODER and encoder is None:
            raise SpecjaxError(f"the {config.retriever} retriever needs a sentence encoder")
        started = time.perf_counter()
        bounds = chunk_bounds(len(document), config.chunk_tokens)
        texts = [decode(document[start:end].tolist()) for start, end in bounds]
        scorer = RETRIEVERS[config.retriever](texts, encoder)
        index = DocumentIndex(key, document, bounds, texts, scorer, time.perf_counter() - started)
        with self._lock:
            self._indexes[key] = index
            while len(self._indexes) > self.capacity:
                self._indexes.popitem(last=False)
        return index


@dataclasses.dataclass(frozen=True)
class LongContextPrompt:
    """One long-context request as token ids: what the target reads and what rapid drafts from."""

    full: list[int]
    """The whole document, then the question (the chat template around both, unless chat=False)."""
    drafting: list[int] | None
    """The selected chunks, then the same question: rapid's drafting context (None: no retrieval)."""
    selection: Selection | None
    document_tokens: int
    index_seconds: float
    """Time to build the document's index; 0 when it came from the cache (or without retrieval)."""

    def summary(self, config: RetrievalConfig) -> dict:
        """What retrieval did, for stats and the printed line."""
        out = {"document_tokens": self.document_tokens, "full_prompt_tokens": len(self.full)}
        if self.selection is not None:
            out.update(retriever=config.retriever, chunk_tokens=config.chunk_tokens,
                       chunks=-(-self.document_tokens // config.chunk_tokens), selected_chunks=self.selection.chunks,
                       selected_tokens=len(self.selection.token_ids), drafting_prompt_tokens=len(self.drafting),
                       retrieval_s=self.selection.seconds, index_build_s=self.index_seconds)
        return out


def describe_long_context(summary: dict) -> str:
    """One line for a `LongContextPrompt.summary`: the context, and what retrieval picked."""
    line = f"context {summary['document_tokens']} tokens (prompt {summary['full_prompt_tokens']})"
    if "selected_chunks" in summary:
        line += (f"; {summary['retriever']} retrieved {len(summary['selected_chunks'])} of {summary['chunks']} "
                 f"chunks ({summary['selected_tokens']} tokens; drafting prompt {summary['drafting_prompt_tokens']}) "
                 f"in {summary['retrieval_s'] * 1e3:.0f} ms, index built in {summary['index_build_s']:.2f} s")
    return line


def _question_parts(question: str | list[dict], chat: bool):
    """(the query text, a function placing a context before the question: a string, or the messages
    with the context before the last user message's content)."""
    if isinstance(question, str):
        return question, lambda context: f"{context}\n\n{question}" if question.strip() else context
    if not chat:
        raise SpecjaxError("chat messages need the chat template (chat=True)")
    users = [i for i, m in enumerate(question) if m.get("role") == "user"]
    if not users:
        raise SpecjaxError("a document goes before the last user message; these messages have none")
    last, query = users[-1], question[users[-1]]["content"]

    def joined(context):
        content = f"{context}\n\n{query}" if query.strip() else context
        return [*question[:last], {**question[last], "content": content}, *question[last + 1:]]
    return query, joined


def long_context_prompt(tokenizer, document: str, question: str | list[dict], config: RetrievalConfig | None = None,
                        cache: IndexCache | None = None, encoder=None, chat: bool = True) -> LongContextPrompt:
    """The target's prompt for `document` and `question` (tokenizer: the target's `TextTokenizer`)
    and, with a retrieval config, rapid's drafting prompt: the document cut into chunks of the
    target's tokens, retrieved for the question (or, when it is blank, for the document's last
    `recent_tokens` tokens). Methods other than rapid decode `full`, so every method is compared on
    the same input. question may be a chat's messages: the context then goes before the content of
    the last user message, which is the query."""
    if not document.strip():
        raise SpecjaxError("the context document is empty")
    query, joined = _question_parts(question, chat)
    encode = tokenizer.encode_chat if chat else tokenizer.encode
    ids = tokenizer.encode(document, add_special_tokens=False)
    if config is None:
        return LongContextPrompt(encode(joined(document)), None, None, len(ids), 0.0)
    cache = cache if cache is not None else IndexCache()
    misses = cache.misses
    index = cache.get_or_build(ids, tokenizer.decode, config, encoder)
    query = query if query.strip() else tokenizer.decode(ids[-config.recent_tokens:])
    selection = index.select(query, config, separator=tokenizer.encode("\n\n", add_special_tokens=False))
    return LongContextPrompt(encode(joined(document)), encode(joined(tokenizer.decode(selection.token_ids))),
                             selection, len(ids), index.build_seconds if cache.misses > misses else 0.0)


@dataclasses.dataclass(frozen=True)
class RetrievalView:
    """What retrieval saw and picked for one question about one document: every chunk with its
    score, for looking at (`LLM.retrieve`)."""

    chunks: list[str]
    """Every chunk of the document, in document order, as the retriever read it."""
    scores: np.ndarray
    """[C] float: each chunk's score against the query (cosine for minilm, BM25 for bm25)."""
    selected: list[int]
    """Indices of the chunks picked for rapid's drafting context, ascending."""
    min_score: float
    """The config's threshold: chunks scoring below it are never picked."""
    summary: str
    """One line: the context, what was picked and what it cost."""


def retrieval_view(tokenizer, document: str, question: str | list[dict], config: RetrievalConfig,
                   cache: IndexCache | None = None, chat: bool = True) -> RetrievalView:
    """The chunks, their scores and the selection rapid would draft from for `question`."""
    encoder = None
    if config.retriever in NEEDS_ENCODER:
        from specjax.io.encoder import load_sentence_encoder

        encoder = load_sentence_encoder()
    cache = cache if cache is not None else IndexCache()
    prompt = long_context_prompt(tokenizer, document, question, config, cache, encoder, chat=chat)
    index = cache.get_or_build(tokenizer.encode(document, add_special_tokens=False), tokenizer.decode, config,
                               encoder)  # a hit: the prompt above built it
    return RetrievalView(list(index.texts), np.asarray(index.scorer.scores(prompt.selection.query)),
                         list(prompt.selection.chunks), config.min_score,
                         describe_long_context(prompt.summary(config)))


@dataclasses.dataclass(frozen=True)
class Redraft:
    """Re-retrieval while decoding (rapid, rapid+block): every `every` generated tokens a row's
    drafting context is rebuilt from a new drafting prompt, typically chunks retrieved for the
    question and the text generated so far (`redrafting` below). Exact either way: only
    the drafts change. A refresh costs a host sync, the retrieval and a prefill of the drafting
    prompt (rapid's only from the first token where the new prompt differs from the one its context
    holds; none when they are the same); it buys drafts from passages about what the answer has
    reached."""

    every: int
    """Generated tokens between refreshes (a refresh happens at the first sync past each multiple)."""
    prompt_for: Callable[[int, list[int]], list[int]]
    """(row, the row's generated tokens so far) -> its new drafting prompt, without those tokens
    (the engine appends them)."""
    max_prompt_tokens: int
    """Most tokens prompt_for returns: with the generated tokens it sizes the drafting context."""

    def __post_init__(self):
        check_at_least(1, every=self.every, max_prompt_tokens=self.max_prompt_tokens)


def redrafting(tokenizer, document: str, question: str | list[dict], config: RetrievalConfig, every: int,
               cache: IndexCache | None = None, encoder=None, chat: bool = True):
    """Re-retrieval every `every` generated tokens for one long-context request: a
    `decode/rapid.py:Redraft` whose prompt_for retrieves for the question followed by the last
    `recent_tokens` generated tokens, as text, and returns the drafting prompt built from what it
    picked (as `long_context_prompt` builds it), without the generated tokens."""
    query, joined = _question_parts(question, chat)
    encode = tokenizer.encode_chat if chat else tokenizer.encode
    cache = cache if cache is not None else IndexCache()
    index = cache.get_or_build(tokenizer.encode(document, add_special_tokens=False), tokenizer.decode, config, encoder)
    separator = tokenizer.encode("\n\n", add_special_tokens=False)

    def prompt_for(row: int, generated: list[int]) -> list[int]:
        recent = tokenizer.decode(list(generated[-config.recent_tokens:]))
        selection = index.select(f"{query}\n{recent}".strip(), config, separator=separator)
        return encode(joined(tokenizer.decode(selection.token_ids)))

    # Chunks decoded and encoded again may tokenize a little differently: leave room for that.
    return Redraft(every, prompt_for, config.budget_tokens + len(encode(joined(""))) + 64)


def document_prompt(tokenizer, document: str, question: str | list[dict], config: RetrievalConfig | None,
                    redraft_every: int = 0, cache: IndexCache | None = None, chat: bool = True):
    """(`long_context_prompt`, `redrafting` or None) for one request about a long document, loading
    the sentence encoder where config's retriever needs one. config None: no retrieval (the
    methods that read the full prompt alone); redraft_every > 0 (with a config): re-retrieve that often."""
    encoder = None
    if config is not None and config.retriever in NEEDS_ENCODER:
        from specjax.io.encoder import load_sentence_encoder

        encoder = load_sentence_encoder()
    cache = cache if cache is not None else IndexCache()
    prompt = long_context_prompt(tokenizer, document, question, config, cache, encoder, chat=chat)
    redraft = None
    if config is not None and redraft_every:
        redraft = redrafting(tokenizer, document, question, config, redraft_every, cache, encoder, chat=chat)
    return prompt, redraft
