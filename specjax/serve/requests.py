"""A request's life outside the device: what a caller submits (`Request`), what it gets back
(`RequestHandle`: streamed `Chunk`s, then a `RequestResult`), and the scheduler's bookkeeping of a
request while it holds a slot (`LiveRequest`)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

from specjax.errors import SpecjaxError

if TYPE_CHECKING:
    from specjax.serve.scheduler import Scheduler


@dataclasses.dataclass(frozen=True)
class Request:
    """One completion request, as token ids."""

    prompt: tuple[int, ...]
    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    """None: a fresh seed per request (sampled requests then differ run to run)."""
    stop: tuple[str, ...] = ()
    """Strings that end the output (not included in it); needs a tokenizer."""
    speculation: bool = True
    """False: the request commits one token per step whatever the batch runs (its draft limit is 0)."""
    method: str | None = None
    """A policy this server compiled, for experiments: "ar" limits the row to 0 drafts, "chain:K" to K,
    and any other pins the batch's policy while the request runs. None: the server's choice."""
    drafting_prompt: tuple[int, ...] | None = None
    """What a rapid or rapid+block server drafts from: the chunks retrieved from the request's
    document and its question (`Scheduler.document_request` builds both prompts). None: the
    prompt's most recent tokens that fit the drafting context. Other methods read `prompt` only,
    so every method answers the same input."""


@dataclasses.dataclass
class Chunk:
    """What one host sync brought a request."""

    token_ids: list[int]
    text: str


@dataclasses.dataclass
class RequestResult:
    token_ids: list[int]
    text: str
    finish_reason: str
    """"stop" (EOS or a stop string), "length", "cancelled" or "error"."""
    error: str | None
    metrics: dict[str, Any]
    """Timing and speculative metrics of this request (see Scheduler._request_metrics)."""


class QueueFull(SpecjaxError):
    """The request queue is at max_queue; try again later."""


class RequestHandle:
    """A submitted request: iterate it (sync or async) for streamed chunks, `cancel()` it, or wait
    for its `result()`."""

    def __init__(self, request_id: int, request: Request, scheduler: "Scheduler"):
        self.id = request_id
        self.request = request
        self._scheduler = scheduler
        self._chunks: list[Chunk] = []
        self._result: RequestResult | None = None
        self._cond = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self.cancelled = False
        # Carried across a preemption: the tokens streamed so far and the counters of earlier residencies.
        self._resume: list[int] = []
        self._carry: dict[str, Any] = {}
        self._parked: tuple[Any, Any] | None = None
        """Parked on the host by a preemption: (its slot's state row, its LiveRequest bookkeeping)."""

    # ---- called by the scheduler thread ----

    def _push(self, chunk: Chunk | None = None, result: RequestResult | None = None) -> None:
        with self._cond:
            if chunk is not None:
                self._chunks.append(chunk)
            if result is not None:
                self._result = result
            self._cond.notify_all()
            waiters = list(self._waiters)
        for loop, event in waiters:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # the caller's loop has closed; nobody is listening
                pass

    # ---- caller side ----

    def cancel(self) -> None:
        """Stop decoding this request and free its slot; its result says "cancelled"."""
        self.cancelled = True
        self._scheduler._wake()

    @property
    def done(self) -> bool:
        return self._result is not None

    def result(self, timeout: float | None = None) -> RequestResult:
        with self._cond:
            if not self._cond.wait_for(lambda: self._result is not None, timeout):
                raise TimeoutError(f"request {self.id} not finished after {timeout} s")
            return self._result

    def __iter__(self) -> Iterator[Chunk]:
        seen = 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda: len(self._chunks) > seen or self._result is not None)
                fresh, finished = self._chunks[seen:], self._result is not None and len(self._chunks) == seen
            if finished:
                return
            seen += len(fresh)
            yield from fresh

    async def stream(self):
        """Async iteration over chunks, for an event loop (the HTTP server)."""
        loop = asyncio.get_running_loop()
        event = asyncio.Event()
        with self._cond:
            self._waiters.append((loop, event))
        seen = 0
        try:
            while True:
                with self._cond:
                    fresh, finished = self._chunks[seen:], self._result is not None
                    event.clear()
                seen += len(fresh)
                for chunk in fresh:
                    yield chunk
                if finished and not fresh:
                    return
                if not fresh:
                    await event.wait()
        finally:
            with self._cond:
                self._waiters.remove((loop, event))

    async def wait(self) -> RequestResult:
        async for _ in self.stream():
            pass
        return self._result


@dataclasses.dataclass
class LiveRequest:
    """Host-side bookkeeping of a request holding a slot."""

    handle: RequestHandle
    arrived: float
    admitted: float
    emitted: int = 0
    text: str = ""
    first_token_at: float | None = None
    last_chunk_at: float | None = None
    steps_reported: int = 0
    drafted_reported: int = 0
    reached_reported: np.ndarray | None = None
    seed: int = 0
    prefilled: int = 0
    """Prompt tokens in the slot's cache so far (chunked prefill)."""
    generated_reported: int = 0
    """Committed tokens of this residency at the last sync (for the controller's count)."""
    resumed: list[int] = dataclasses.field(default_factory=list)
    """Tokens generated before a preemption; the slot's prompt is the request's prompt plus these."""
    draft_limit: int = 0
    """Most drafts a step commits for this request (SlotState.draft_limit; see _row_limit)."""
    histogram_reported: np.ndarray | None = None
    """The row's accepted-length histogram at the last sync (for the controller's count)."""
    policy_steps: dict[str, int] = dataclasses.field(default_factory=dict)
    """Verify steps this request took under each batch policy."""
    holds_drafter: bool = True
    """False once memory pressure dropped its drafter state (it then decodes without drafts)."""
    drafter_window: int = 0
    """Context positions its drafter reads once memory pressure windowed it (0: all; SlotState.drafter_window)."""

    def drafting_held(self, positions: int) -> int:
        """Drafter context positions it holds, of `positions` written: the window's once windowed."""
        return min(positions, self.drafter_window) if self.drafter_window else positions

    @property
    def prompt(self) -> tuple[int, ...]:
        return tuple(self.handle.request.prompt) + tuple(self.resumed)

    @property
    def drafting_prompt(self) -> tuple[int, ...]:
        """What the row drafts from (rapid, rapid+block): its drafting prompt, then what it generated
        before a preemption."""
        request = self.handle.request
        own = request.prompt if request.drafting_prompt is None else request.drafting_prompt
        return tuple(own) + tuple(self.resumed)

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.prompt)

    def detokenize(self, ids: list[int], tokenizer, done: bool) -> tuple[list[int], str, str | None]:
        """What a sync brings the caller, given every token of the request so far: (the new token
        ids, the new text, "stop" if a stop string ended it, else None). Text is held back while it
        ends in an incomplete UTF-8 sequence; a stop string cuts the text and the ids at it.
        Updates the text kept so far (the caller counts the ids as emitted)."""
        new = ids[self.emitted:]
        if tokenizer is None or not new:
            return new, "", None
        reason = None
        text = tokenizer.decode(ids)
        if text.endswith("\ufffd") and not done:
            text = self.text  # wait for the rest of its bytes
        cut = find_stop(text, self.handle.request.stop, len(self.text))
        if cut is not None:
            text, reason = text[:cut], "stop"
            new = ids_within(tokenizer, ids, self.emitted, text)
        delta, self.text = text[len(self.text):], text
        return new, delta, reason


def find_stop(text: str, stops: tuple[str, ...], already: int) -> int | None:
    """Where the first stop string begins in text, looking only where it could newly complete."""
    best = None
    for stop in stops:
        at = text.find(stop, max(0, already - len(stop) + 1))
        if at >= 0 and (best is None or at < best):
            best = at
    return best


def ids_within(tokenizer, ids: list[int], emitted: int, text: str) -> list[int]:
    """The new token ids (past `emitted`) whose decoded text fits within `text` (a stop string cut it)."""
    kept = emitted
    while kept < len(ids) and len(tokenizer.decode(ids[: kept + 1])) <= len(text):
        kept += 1
    return ids[emitted:kept]
