"""Continuous batching: a request queue feeding a fixed set of decode slots.

One scheduler thread owns the device state. Each turn it (1) prefills waiting requests into free
slots (`slots.insert`, one prompt bucket per call shape), (2) runs `steps_per_sync` verify steps for
every occupied slot in one device call (`slots.step`), and (3) syncs once: new tokens go to each
request's handle, finished rows (EOS, token limit, a stop string, cancellation) free their slot at
once. Callers talk to it through `submit`, from any thread or event loop.

Every shape is fixed at start-up (slot count, cache length, prompt buckets), and every executable is
compiled then, so nothing recompiles under load.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import hashlib
import itertools
import json
import logging
import sys
import threading
import time
from pathlib import Path
from functools import partial
from typing import Any, Iterator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from specjax.data.repetition import distinct_n
from specjax.decode import slots as slot_api
from specjax.data.retrieval import NEEDS_ENCODER, IndexCache, RetrievalConfig, long_context_prompt
from specjax.decode.budget import LatencyModel
from specjax.decode.engine import lossless_agreement
from specjax.decode.ngram import NgramConfig
from specjax.decode.rapid import RapidConfig
from specjax.decode.refine import RefineConfig
from specjax.decode.sampling import SamplingConfig
from specjax.decode.tree import TreeConfig, measure_tree_latency, tree_latency_key
from specjax.errors import SpecjaxError, check_at_least
from specjax.io.dflash import LoadedDrafter, check_pair
from specjax.io.encoder import load_sentence_encoder
from specjax.io.refiner import LoadedRefiner, check_refiner
from specjax.io.registry import LoadedModel, cache_dir
from specjax.models.cache import tree_bytes
from specjax.decode.memory import target_kv_bytes
from specjax.decode.roofline import StepShape, measure_peaks, step_work
from specjax.monitor.serving import ServingMetrics
from specjax.serve.controller import Controller, ControllerConfig, Decision, HeldRow, relieve_memory
from specjax.sharding import build_state, place_params, shard_state

log = logging.getLogger("specjax.serve")

DECISION_HISTORY = 4096
"""Controller decisions a scheduler keeps (`Scheduler.decisions`): about ten minutes of device calls
on a CPU; older ones are dropped."""


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """How the serving engine is shaped; all of it is fixed at start-up."""

    method: str = "adaptive"
    """"adaptive": the controller chooses among precompiled policies (`controller`) at every device
    call; or one fixed method of `specjax.decode.slots.slot_method` ("ar", "chain", "chain:3", "tree",
    ...) for comparison."""
    controller: ControllerConfig = ControllerConfig()
    """The adaptive controller's policies, hysteresis and KV budget (the budget also gates admission
    and preemption under a fixed method)."""
    slots: int = 8
    """Requests decoding at once."""
    context_length: int = 1024
    """Cache slots per request: its prompt, its generated tokens and one verify step must fit."""
    max_new_tokens: int = 512
    """Most tokens any request may ask for."""
    steps_per_sync: int = 4
    """Verify steps per device call; more means fewer host syncs, coarser streaming."""
    prompt_bucket: int = 32
    """Prompts are padded to a power-of-two multiple of this (one compiled insert per bucket)."""
    max_queue: int = 256
    """Requests waiting for a slot beyond which submit refuses (the server answers 429)."""
    tree: TreeConfig = TreeConfig()
    """Tree shape and sizes for the tree methods. Auto-sized trees weigh verify costs measured at
    this slot count and cache length (once per machine and model, then cached on disk)."""
    refine: RefineConfig = RefineConfig()
    """Refinement passes per block for the +refiner methods."""
    insert_rows: int = 4
    """Most waiting requests prefilled together in one device call. Inserts are compiled for 1 row
    and for this many (fewer requests than that are padded to it)."""
    row_buckets: tuple[int, ...] | None = None
    """Live-row counts the step is compiled for: with fewer live requests, only that many slots are
    computed (live rows are kept packed in the lowest slots). None: the powers of four below `slots`
    (1, 4, 16, ...) and `slots` itself. Each bucket adds a compiled step per attention
    length."""
    preemption: str = "park"
    """How a request preempted under the KV budget comes back: "park" copies its slot's whole state
    (KV caches included) to host memory and back into a free slot, so it goes on bit for bit where it
    stopped; "recompute" re-prefills its prompt and its tokens so far, as vLLM's default does, which
    needs no host memory, but in bf16 the recomputed K/V round differently from those the decode
    steps wrote, and can change the tokens that follow."""
    prefill_chunk: int = 256
    """Prompts longer than this are prefilled this many tokens per scheduler turn, while the other
    slots keep decoding between chunks (0: prefill every prompt whole). Windowed drafters prefill
    whole prompts."""
    snapshot_every: float = 1.0
    """Seconds between the live-signal snapshots written to the run log (`metrics_log`), which
    `specjax report` plots."""
    rapid: RapidConfig = RapidConfig()
    """How the rapid method drafts (its drafts per step, and eta: knowledge transfer, lossy)."""
    ngram: NgramConfig = NgramConfig()
    """How the ngram method (prompt lookup) drafts, when it is served or among the policies."""
    retrieval: RetrievalConfig = RetrievalConfig()
    """How a document request's drafting prompt is retrieved (`document_request`; a request may
    override it)."""
    drafting_length: int | None = None
    """rapid and rapid+block: cache slots of each request's drafting context, which holds its
    drafting prompt (the chunks retrieved from its document and its question, `Request.drafting_prompt`),
    its generated tokens and one step's writes. Allocated per slot beside the full context. None:
    the retrieval budget + max_new_tokens + 256 (the question and the chat template)."""

    @property
    def drafting_slots(self) -> int:
        """Slots of each drafting context (`drafting_length`, or its default)."""
        if self.drafting_length is not None:
            return self.drafting_length
        return self.retrieval.budget_tokens + self.max_new_tokens + 256

    def __post_init__(self):
        check_at_least(1, slots=self.slots, context_length=self.context_length, max_new_tokens=self.max_new_tokens,
                       steps_per_sync=self.steps_per_sync, prompt_bucket=self.prompt_bucket, max_queue=self.max_queue,
                       insert_rows=self.insert_rows)
        if self.drafting_length is not None:
            check_at_least(1, drafting_length=self.drafting_length)
        if self.preemption not in ("park", "recompute"):
            raise SpecjaxError(f"preemption must be 'park' or 'recompute', got {self.preemption!r}")
        check_at_least(0, prefill_chunk=self.prefill_chunk)
        if not self.snapshot_every > 0:
            raise SpecjaxError(f"snapshot_every must be positive seconds, got {self.snapshot_every}")


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
        """Parked on the host by a preemption: (its slot's state row, its _Live bookkeeping)."""

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
class _Live:
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


_PROGRAMS: dict[tuple, Any] = {}
"""Scheduler._program's jitted slot programs, by kind, static arguments and state layout."""


class _Synced(NamedTuple):
    """What one host sync reads from the slot state, as numpy, one row per slot."""

    tokens: Any
    """[S, N + block] committed generated tokens."""
    counts: Any
    """[S] committed generated tokens per row."""
    done: Any
    """[S] finished or empty."""
    steps: Any
    """[S] verify steps the row took part in."""
    histogram: Any
    """[S, block] verify steps by drafts accepted."""
    lengths: Any
    """[S] filled target cache slots."""
    drafted: Any
    """[S] draft tokens checked."""
    drafting_lengths: Any
    """[S] drafting-context slots (rapid, rapid+block), or None."""
    lossless_diverged_at: Any = None
    """[S] where lossy rows left the lossless run (SlotState.lossless_diverged_at), or None."""


class Scheduler:
    """Continuous batching over `config.slots` slots for one model (and drafter)."""

    def __init__(self, model: LoadedModel, drafter: LoadedDrafter | None = None, config: ServeConfig = ServeConfig(),
                 metrics_log: str | None = None, compile_now: bool = True, refiner: LoadedRefiner | None = None,
                 latency_cache: Path | None = None, mesh: Mesh | None = None):
        """refiner: for the +refiner methods. latency_cache: where measured tree costs are kept
        between processes (default $SPECJAX_CACHE/latency). mesh: serve over these devices
        (specjax/sharding.py): the weights placed by the sharding rules, the slots split over `data`
        and `fsdp` and each slot's KV heads over `model`; every program keeps that layout."""
        self.adaptive = config.method == "adaptive"
        if self.adaptive:
            if drafter is None:
                log.warning("adaptive serving without a drafter: the only policy is ar")
                self.policies = ("ar",)
            else:
                self.policies = config.controller.policy_set(drafter.config.block_size,
                                                             query_rows=model.config.query_rows)
        else:
            self.policies = (config.method,)
        if drafter is not None:  # under padded query rows a chain verifies at most that many rows
            self.policies = tuple(dict.fromkeys(
                slot_api.method_within_query_rows(p, drafter.config.block_size, model.config.query_rows)
                for p in self.policies))
        methods = [slot_api.slot_method(p) for p in self.policies]
        needs = lambda what: any(getattr(m, what) for m in methods)  # noqa: E731
        for m in methods:
            if m.needs_drafter and drafter is None:
                raise SpecjaxError(f"method {m.name!r} needs a drafter")
            if m.needs_refiner and refiner is None:
                raise SpecjaxError(f"method {m.name!r} needs a refiner")
        if drafter is not None and needs("needs_drafter"):
            check_pair(drafter, model.config)
        else:
            drafter = None
        if refiner is not None and needs("needs_refiner"):
            check_refiner(refiner, drafter)
        else:
            refiner = None
        model, drafter, refiner = (place_params(x, mesh) for x in (model, drafter, refiner))
        self.model, self.drafter, self.refiner, self.config, self.mesh = model, drafter, refiner, config, mesh
        # rapid and rapid+block keep a drafting context per slot that only their own steps advance
        # (an AR or chain step would leave it behind, or write it at full-prompt positions), so
        # they are served as a fixed method, never in the adaptive set.
        self.drafts_from_retrieval = needs("needs_retrieval")
        if self.drafts_from_retrieval and len(self.policies) > 1:
            raise SpecjaxError("rapid and rapid+block are served as a fixed --method, not among adaptive policies")
        cache_length = -(-config.context_length // 64) * 64
        slot_config = slot_api.SlotConfig(slots=config.slots, cache_length=cache_length,
                                          max_new_tokens=config.max_new_tokens, steps_per_sync=config.steps_per_sync,
                                          insert_rows=min(config.insert_rows, config.slots))
        self.insert_rows = slot_config.insert_rows
        self.insert_sizes = tuple(sorted({1, self.insert_rows}))
        buckets = config.row_buckets or tuple(4**i for i in range(8) if 4**i < config.slots)
        self.row_buckets = tuple(sorted({b for b in buckets if 1 <= b < config.slots} | {config.slots}))
        statics = slot_api.SlotStatics(
            target_config=model.config, slot=slot_config, eos_token_ids=tuple(model.eos_token_ids),
            drafter_config=None if drafter is None else drafter.config,
            refiner_config=None if refiner is None else refiner.config, refine=config.refine,
            tree=(None if not needs("needs_tree") else config.tree if drafter is None
                  else config.tree.within_query_rows(drafter.config.block_size - 1, model.config.query_rows)),
            rapid=config.rapid.within_query_rows(model.config.query_rows) if "rapid" in self.policies else None,
            drafting_length=-(-config.drafting_slots // 64) * 64 if self.drafts_from_retrieval else 0,
            drafter_on_retrieval=self.drafts_from_retrieval and drafter is not None,
            ngram=config.ngram if needs("needs_ngram") else None)
        # A verify step writes up to one block or tree (or the padded query rows) past a row's
        # committed tokens; sliding layers keep KV rings that hold that much past their window.
        self.step_slack = max(statics.step_writes, model.config.query_rows or 1)
        # What each policy writes per step: an AR step over a cache sized for chains still attends
        # to the short length its own steps need.
        self.policy_slack = {p: max(self._writes(p, statics), model.config.query_rows or 1) for p in self.policies}
        if config.max_new_tokens + self.step_slack + 1 > config.context_length:
            raise SpecjaxError(f"context_length {config.context_length} leaves no room for a prompt with "
                               f"max_new_tokens {config.max_new_tokens}")
        self.statics = dataclasses.replace(statics, target_config=model.config.with_kv_rings(self.step_slack))
        self.max_prompt = config.context_length - self.step_slack - 1
        self.prompt_buckets = self._buckets()
        # Drafting prompts are padded to these (one compiled drafting-context fill per bucket).
        drafting_length = self.statics.drafting_length
        self.drafting_buckets = tuple(b for b in self.prompt_buckets if b < drafting_length) + (
            (drafting_length,) if drafting_length else ())
        # The first rapid draft pass writes one slot before the row's last token (decode/rapid.py).
        self.max_drafting_prompt = config.drafting_slots - self.step_slack - 2
        if self.drafts_from_retrieval and config.max_new_tokens + self.step_slack + 2 > config.drafting_slots:
            raise SpecjaxError(f"drafting_length {config.drafting_slots} leaves no room for a drafting prompt with "
                               f"max_new_tokens {config.max_new_tokens}")
        windowed = drafter is not None and drafter.config.window is not None
        # Drafting contexts are prefilled with their whole drafting prompt, so the prompt is too.
        whole = windowed or self.drafts_from_retrieval
        self.prefill_chunk = 0 if whole or config.prefill_chunk >= self.max_prompt else config.prefill_chunk
        # Steps compiled per attention length: a batch of short contexts reads only what it needs.
        self.attend_buckets = tuple(sorted({min(128 * 2**i, cache_length) for i in range(16)
                                            if i == 0 or 128 * 2**(i - 1) < cache_length}))
        self._lengths = np.zeros(config.slots, np.int64)  # each slot's cache length at the last sync
        self._drafting_lengths = np.zeros(config.slots, np.int64)  # and its drafting context's (rapid)
        self.parts = slot_api.slot_parts(self.statics, model.params, None if drafter is None else drafter.params,
                                         None if drafter is None else drafter.draft_vocab,
                                         None if refiner is None else refiner.params)
        self.latency: LatencyModel | None = None
        if needs("needs_tree") and config.tree.auto:
            self.latency = self._tree_latency(latency_cache)
            self.parts = self.parts.replace(tree_costs=self.latency.costs())
        for policy in self.policies:
            slot_api.check_method(policy, self.statics, self.parts)
        self.metrics = ServingMetrics(config.method, metrics_log, config.snapshot_every)
        self._work_shape = StepShape(
            model.config, tree_bytes(model.params), config.slots,
            None if drafter is None else drafter.config, 0 if drafter is None else tree_bytes(drafter.params),
            0 if self.parts.head is None else self.parts.head.shape[1])
        self.peaks = measure_peaks(cache_dir() / "peaks", dtype=model.config.dtype)
        self.phase_seconds: dict[str, float] = {}  # chains: measured at compile(); splits each step's time
        self._bytes_per_token = {"target": target_kv_bytes(self.statics.target_config, 1, 1)}
        if self.statics.rapid is not None:  # the drafting context is a second target cache
            self._bytes_per_token["drafter"] = self._bytes_per_token["target"]
        if drafter is not None:
            from specjax.decode.memory import drafter_state_breakdown
            per_token = drafter_state_breakdown(drafter.config, 1, 64).get("drafter_bytes_per_token")
            if per_token:
                self._bytes_per_token["drafter"] = per_token
        # Windowing relief needs a drafter that reads a full-attention context cache: not a windowed
        # drafter's ring (bounded already), nor rapid's drafting context (the target's own cache).
        full_context = drafter is not None and drafter.config.window is None and self.statics.rapid is None
        self._relief_window = config.controller.relief_window if full_context else None
        self.controller = Controller(self.policies, self.statics.block, config.controller, config.steps_per_sync)
        self._priors_path = (self._controller_priors_path(drafter) if self.adaptive and config.controller.remember
                             else None)
        if self._priors_path is not None and self._priors_path.exists():
            with contextlib.suppress(ValueError, OSError):  # a damaged file is only a lost prior
                self.controller.load_priors(json.loads(self._priors_path.read_text()))
        self.decisions: collections.deque[tuple[float, Decision]] = collections.deque(maxlen=DECISION_HISTORY)
        """(wall time, the controller's Decision) for the most recent device calls, oldest first."""
        self.policy = self.controller.current
        self._last_ran = self.policy
        self._pins: dict[int, str] = {}  # slot -> policy its request pinned
        self._arrivals: collections.deque[float] = collections.deque(maxlen=64)
        self._device_lock = threading.Lock()  # device calls of the scheduler and of background measuring
        self.memory_state = None
        self._compiler: threading.Thread | None = None

        self._state = self._fresh_state()
        # Over a mesh every program hands the state back in the layout it was given, so one
        # compiled executable per shape serves every call (GSPMD would otherwise choose each output's).
        self._pinned = {} if mesh is None else {"out_shardings": jax.tree.map(lambda a: a.sharding, self._state)}
        # The layout as a hashable key of _PROGRAMS, flattened once rather than at every lookup.
        self._layout = None if mesh is None else (jax.tree.structure(self._pinned["out_shardings"]),
                                                  tuple(jax.tree.leaves(self._pinned["out_shardings"])))
        self._waiting: collections.deque[tuple[RequestHandle, float]] = collections.deque()
        self._live: dict[int, _Live] = {}  # slot -> request
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._ids = itertools.count()
        self._stopping = False
        self._accepting = True
        self._compiled: dict[str, Any] = {}
        self.indexes = IndexCache()  # document indexes, by content, shared by requests (document_request)
        self._encoder = None  # the sentence encoder: loaded now for the server's retriever, or on first use
        self._encoder_lock = threading.Lock()
        if self.drafts_from_retrieval and config.retrieval.retriever in NEEDS_ENCODER:
            self._encoder = load_sentence_encoder()
        self.compile_seconds = 0.0
        self.metrics.policy(self.policy, None)
        if compile_now:
            self.compile()
        else:  # jit compiles on first use; the controller still needs every policy's measured cost
            for policy in self.policies:
                self._make_ready(policy, compile_steps=False)
        self._thread = threading.Thread(target=self._run, name="specjax-scheduler", daemon=True)
        self._thread.start()

    # ---- shapes and compilation ----

    def _tree_latency(self, folder: Path | None) -> LatencyModel:
        """Verify costs at this slot count and cache length: from the on-disk cache, or measured now."""
        if folder is None:
            folder = cache_dir() / "latency"
        statics = self.statics
        key = tree_latency_key(self.model.name, statics.target_config, statics.slot.slots, statics.slot.cache_length,
                               statics.tree, statics.block, self.refiner is not None)
        latency = LatencyModel.load(key, folder)
        if latency is None:
            from specjax.decode.speculative import RefinerInputs
            refiner = None if self.refiner is None else RefinerInputs(
                self.parts.refiner, self.parts.refiner_head, statics.refiner_config, statics.refine)
            # Measured with every slot about half full: the middle of what a busy server holds.
            lengths = jnp.full((statics.slot.slots,), statics.slot.cache_length // 2, jnp.int32)
            latency = measure_tree_latency(self.parts.target, statics.target_config, self.parts.drafter,
                                           statics.drafter_config, self.parts.draft_vocab, refiner, statics.tree,
                                           SamplingConfig(), lengths, statics.slot.cache_length)
            latency.save(key, folder)
        return latency

    def _controller_priors_path(self, drafter) -> Path:
        """Where the adaptive controller's measured acceptance is kept between starts: per machine,
        model, drafter shape, slot count and policy set."""
        from specjax.decode.budget import machine_id

        key = repr((machine_id(), self.model.name, self.statics.target_config, drafter.config if drafter else None,
                    self.config.slots, self.policies))
        return cache_dir() / "serve" / (hashlib.sha256(key.encode()).hexdigest()[:20] + ".json")

    def _save_controller_priors(self) -> None:
        if self._priors_path is None or not self.controller.calls:
            return
        try:
            self._priors_path.parent.mkdir(parents=True, exist_ok=True)
            partial = self._priors_path.with_suffix(".partial")
            partial.write_text(json.dumps(self.controller.priors()))
            partial.replace(self._priors_path)
        except OSError:
            log.warning("could not keep the controller's acceptance in %s", self._priors_path, exc_info=True)

    def _fresh_state(self) -> slot_api.SlotState:
        """Every slot free, built on the mesh's devices when there is one."""
        return build_state(self.mesh, slot_api.empty_slots, self.statics)

    def _placed(self, batch_major):
        """A slot state or insert request (every leaf batch-major) in the mesh's layout."""
        return batch_major if self.mesh is None else shard_state(batch_major, self.mesh)

    def _program(self, kind: str, **static):
        """The jitted step, insert, move_row, put_row or take_row with these static arguments, the
        state donated (take_row only reads it) and, over a mesh, its layout pinned. Kept per process
        (_PROGRAMS), so schedulers of the same shapes and layout share jit's cache and compile each
        shape once, as the module's jits do."""
        key = (kind, self._layout, *sorted(static.items()))
        if key not in _PROGRAMS:
            function = {"step": slot_api.step, "insert": slot_api.insert, "move_row": slot_api.move_row,
                        "put_row": slot_api.put_row, "take_row": slot_api.take_row,
                        "refresh_drafting": slot_api.refresh_drafting}[kind]
            # move_row(state, source, target) and put_row(state, row, target); take_row(state, slot) reads
            # only; the others (parts, state, ...)
            donated = {"move_row": 0, "put_row": 0, "take_row": ()}.get(kind, 1)
            pinned = {} if kind == "take_row" else self._pinned  # its output is one row, not the state
            _PROGRAMS[key] = jax.jit(partial(function, **static), donate_argnums=donated, **pinned)
        return _PROGRAMS[key]

    def _buckets(self) -> tuple[int, ...]:
        buckets, size = [], self.config.prompt_bucket
        while size < self.max_prompt:
            buckets.append(size)
            size *= 2
        return tuple(buckets) + (self.max_prompt,)

    def _bucket_for(self, length: int) -> int:
        return next(b for b in self.prompt_buckets if b >= length)

    def _drafting_fill(self, rows, prompts, width: int) -> tuple:
        """refresh_drafting's arguments after (state): rows [R], drafting prompts padded to width
        [R, W] and their lengths [R], placed on the server's devices."""
        padded = slot_api.token_rows(prompts, width)
        return self._placed((jnp.asarray(rows, jnp.int32), jnp.asarray(padded, jnp.int32),
                             jnp.asarray([len(p) for p in prompts], jnp.int32)))

    def _insert_request(self, rows, prompts, lengths, max_new, seeds, temperature, top_k, top_p, final=(True,),
                        offsets=None, limits=None):
        limits = [self.statics.block - 1] * len(rows) if limits is None else limits
        return self._placed(slot_api.InsertRequest(
            draft_limit=jnp.asarray(limits, jnp.int32),
            final=jnp.asarray(final, bool), offsets=None if offsets is None else jnp.asarray(offsets, jnp.int32),
            rows=jnp.asarray(rows, jnp.int32), prompts=jnp.asarray(prompts, jnp.int32),
            prompt_lengths=jnp.asarray(lengths, jnp.int32), max_new_tokens=jnp.asarray(max_new, jnp.int32),
            seeds=jnp.asarray(seeds, jnp.uint32),
            sampling=slot_api.RowSampling(jnp.asarray(temperature, jnp.float32), jnp.asarray(top_k, jnp.int32),
                                          jnp.asarray(top_p, jnp.float32))))

    def _compile_steps(self, policy: str, progress: "CompileProgress | None" = None) -> None:
        progress = progress or CompileProgress(len(self.attend_buckets) * len(self.row_buckets), f"the {policy} step")
        for length in self.attend_buckets:
            for rows in self.row_buckets:
                self._compiled["step", policy, length, rows] = self._program(
                    "step", method=policy, statics=self.statics, attend_slots=length, rows=rows,
                ).lower(self.parts, self._state).compile()
                progress.done(f"{policy} step, attention {length}, {rows} rows")

    def _make_ready(self, policy: str, compile_steps: bool = True, progress: "CompileProgress | None" = None) -> None:
        """Compile the policy's steps, time one call of it per live-row bucket (at the shortest
        attention length, with every row live), and hand both to the controller."""
        if compile_steps:
            self._compile_steps(policy, progress)
        if len(self.policies) == 1:  # a fixed method: nothing to choose, so nothing to time
            self.controller.mark_ready(policy, {})
            return
        attend = self.attend_buckets[0]
        filled = max(1, min(attend // 2, attend - self.config.steps_per_sync * self.step_slack - 1))
        costs = {}
        with self._device_lock:
            scratch = self._fresh_state()
            scratch = self._placed(scratch.replace(
                lengths=jnp.full_like(scratch.lengths, filled), done=jnp.zeros_like(scratch.done),
                max_new_tokens=jnp.full_like(scratch.max_new_tokens, self.config.max_new_tokens)))
            reset = lambda st: self._placed(st.replace(  # noqa: E731
                lengths=jnp.full_like(st.lengths, filled), done=jnp.zeros_like(st.done),
                num_generated=jnp.zeros_like(st.num_generated)))
            if compile_steps:  # a compiled program's first run is slower: run every shape once now
                for length in self.attend_buckets[1:]:
                    for rows in self.row_buckets:
                        scratch = reset(self._compiled_step(policy, length, rows)(self.parts, scratch))
            for rows in self.row_buckets:
                run = self._compiled_step(policy, attend, rows)
                scratch = reset(run(self.parts, scratch))  # warm (and, without compile_steps, compile)
                jax.block_until_ready(scratch.lengths)
                started = time.perf_counter()
                scratch = run(self.parts, scratch)
                jax.block_until_ready(scratch.lengths)
                costs[rows] = time.perf_counter() - started
                scratch = reset(scratch)
            del scratch
        self.controller.mark_ready(policy, costs)
        log.info("policy %s ready: %s s per call by live-row bucket", policy,
                 ", ".join(f"{r}: {c:.3f}" for r, c in costs.items()))

    def _compile_rest(self, policies: tuple[str, ...]) -> None:
        started = time.perf_counter()
        for policy in policies:
            if self._stopping:
                return
            try:
                self._make_ready(policy)
            except Exception:  # noqa: BLE001 - a policy that fails to compile is left out, not fatal
                log.exception("policy %s failed to compile; the controller will not use it", policy)
        # Timings taken while other policies compiled shared the cores with XLA: time every policy
        # again now, with only serving running (which the device lock holds off meanwhile).
        for policy in sorted(self.controller.ready):
            if self._stopping:
                return
            self._make_ready(policy, compile_steps=False)
        # The first requests arrive one at a time: start on what is fastest for one live row.
        start = self.controller.choose_start(self.row_buckets[0], self.attend_buckets[0])
        print(f"[specjax] adaptive: {len(self.controller.ready)} policies ready "
              f"({', '.join(sorted(self.controller.ready))}); the rest compiled in the background in "
              f"{time.perf_counter() - started:.1f} s; starting on {start} (measured costs, "
              f"{'acceptance from the last run' if self._priors_path and self._priors_path.exists() else 'no acceptance measured yet'})",
              file=sys.stderr, flush=True)

    def _compile_drafting_fills(self) -> None:
        """One drafting-context fill per (drafting bucket, insert size): a rapid server fills that
        context apart from the insert. A prefill whose fill is not compiled yet compiles it then."""
        started = time.perf_counter()
        for rows in self.insert_sizes:
            for bucket in self.drafting_buckets:
                if self._stopping:
                    return
                fill = self._program("refresh_drafting", statics=self.statics)
                arguments = self._drafting_fill([self.config.slots] * rows, [(0,)] * rows, bucket)
                self._compiled["drafting", bucket, rows] = fill.lower(self.parts, self._state, *arguments).compile()
        print(f"[specjax] drafting-context fills ready: {len(self.drafting_buckets)} drafting buckets x "
              f"{len(self.insert_sizes)} insert sizes in {time.perf_counter() - started:.1f} s", file=sys.stderr,
              flush=True)

    def _compile_later(self, rest: tuple[str, ...]) -> None:
        """The background compiler: drafting-context fills first (the next requests' prefills need
        them), then the adaptive controller's other policies."""
        try:
            if self.drafting_buckets:
                self._compile_drafting_fills()
        except Exception:  # noqa: BLE001 - prefills compile a missing fill on first use instead
            log.exception("compiling the drafting-context fills failed; prefills will compile them on first use")
        if rest:
            self._compile_rest(rest)

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Block until the background compiler is done (True), or timeout seconds pass (False)."""
        if self._compiler is not None:
            self._compiler.join(timeout)
            return not self._compiler.is_alive()
        return True

    def compile(self, background: bool = True) -> None:
        """Compile the steps and one insert per prompt bucket now, so no request waits for XLA. An
        adaptive server compiles its start policy here and the others on a background thread
        (background=False: here too); the controller uses a policy only once it is compiled. A
        rapid server's drafting-context fills go to that thread too, ahead of any other policy: the
        server answers sooner, and a prefill that comes before its fill compiles it then."""
        started = time.perf_counter()
        progress = CompileProgress(len(self.attend_buckets) * len(self.row_buckets)
                                   + len(self.insert_sizes) * len(self.prompt_buckets) + bool(self.prefill_chunk),
                                   "the server's programs")
        self._make_ready(self.policy, progress=progress)
        for rows in self.insert_sizes:
            for bucket in self.prompt_buckets:
                request = self._insert_request([self.config.slots] * rows, np.zeros((rows, bucket)), [1] * rows,
                                               [1] * rows, [0] * rows, [0.0] * rows, [0] * rows, [1.0] * rows,
                                               final=[True] * rows)
                self._compiled[bucket, rows] = self._program("insert", statics=self.statics).lower(
                    self.parts, self._state, request).compile()
                progress.done(f"insert, prompts up to {bucket} tokens, {rows} at once")
        if self.prefill_chunk:
            request = self._insert_request([self.config.slots], np.zeros((1, self.prefill_chunk)), [1], [1], [0],
                                           [0.0], [0], [1.0], offsets=[0])
            self._compiled["extend"] = self._program("insert", statics=self.statics).lower(
                self.parts, self._state, request).compile()
            progress.done(f"chunked prefill, {self.prefill_chunk} tokens")
        chains = [slot_api.slot_method(p) for p in self.policies]
        chains = [m for m in chains if m.needs_drafter and not m.needs_tree]
        if chains:  # trees split by their latency model
            self.phase_seconds = slot_api.measure_phase_seconds(self.parts, self.statics,
                                                                any(m.needs_refiner for m in chains))
        self.compile_seconds = time.perf_counter() - started
        print(f"[specjax] serving {self.config.method} on {self.config.slots} slots: compiled the {self.policy} step "
              f"for {len(self.attend_buckets)} attention lengths ({', '.join(map(str, self.attend_buckets))}) and "
              f"{len(self.prompt_buckets)} prompt buckets ({', '.join(map(str, self.prompt_buckets))}) in "
              f"{self.compile_seconds:.1f} s", file=sys.stderr, flush=True)
        rest = tuple(p for p in self.policies if p != self.policy)
        if (rest or self.drafting_buckets) and background:
            self._compiler = threading.Thread(target=self._compile_later, args=(rest,), name="specjax-compile",
                                              daemon=True)
            self._compiler.start()
        else:
            self._compile_later(rest)
        if self.model.config.dtype != "float32":
            # Measured: 3 of 12 held-out prompts (BENCHMARKS.md, "32 slots in bf16").
            print(f"[specjax] {self.model.config.dtype} compute: a row's rounding depends on the rows sharing its "
                  "step, so a greedy request can differ from the same prompt decoded alone (float32's differences "
                  "are ulps, which no measured prompt's tokens showed)", file=sys.stderr, flush=True)

    # ---- the public API ----

    def validate(self, request: Request) -> None:
        """Refuse a request the engine cannot serve, with a message saying why."""
        if not request.prompt:
            raise SpecjaxError("the prompt is empty; give at least one token")
        vocab = self.model.config.vocab_size
        bad = [t for t in request.prompt if not 0 <= int(t) < vocab]
        if bad:
            raise SpecjaxError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if not 1 <= request.max_tokens <= self.config.max_new_tokens:
            raise SpecjaxError(f"max_tokens must be in [1, {self.config.max_new_tokens}], got {request.max_tokens}")
        if len(request.prompt) > self.max_prompt:
            raise SpecjaxError(f"the prompt has {len(request.prompt)} tokens; this server takes at most "
                               f"{self.max_prompt}")
        if len(request.prompt) + request.max_tokens + self.step_slack > self.config.context_length:
            raise SpecjaxError(f"prompt ({len(request.prompt)} tokens) + max_tokens ({request.max_tokens}) exceeds "
                               f"the context of {self.config.context_length - self.step_slack} tokens")
        SamplingConfig(request.temperature, request.top_k, request.top_p)  # refuses bad values, naming them
        if self.drafts_from_retrieval:
            drafting = self._with_drafting_prompt(request).drafting_prompt
            bad = [t for t in drafting if not 0 <= int(t) < vocab]
            if not drafting or bad:
                raise SpecjaxError("the drafting prompt is empty" if not drafting else
                                   f"drafting prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
            if len(drafting) + request.max_tokens > self.max_drafting_prompt:
                raise SpecjaxError(f"drafting prompt ({len(drafting)} tokens) + max_tokens ({request.max_tokens}) "
                                   f"exceeds the drafting context of {self.max_drafting_prompt} tokens "
                                   f"(ServeConfig.drafting_length, serve --drafting-length)")
        if request.stop and self.model.tokenizer is None:
            raise SpecjaxError("stop strings need a tokenizer; this model has none")
        if any(not s for s in request.stop):
            raise SpecjaxError("a stop string is empty")
        self._row_limit(request)  # refuses a method this server cannot run

    def _served_name(self, method: str | None) -> str | None:
        """A request's method as this server runs it: with a block-16 drafter, "chain" is "chain:7"
        on a target padded to 8 query rows (slots.method_within_query_rows)."""
        if method is None or self.drafter is None or method == "ar":
            return method
        return slot_api.method_within_query_rows(method, self.statics.block, self.model.config.query_rows)

    def _row_limit(self, request: Request) -> int:
        """The request's draft limit: 0 without speculation, K for a "chain:K" override, else none."""
        no_limit = self.statics.block - 1
        method = self._served_name(request.method)
        if method is not None:
            allowed = set(self.policies) | {"ar"}
            for chain in {p.split(":")[0] for p in self.policies if p.startswith("chain")}:
                allowed |= {f"{chain}:{k}" for k in range(1, self.statics.block)}  # per-row draft limits
            if method not in allowed:
                raise SpecjaxError(f"method {method!r} is not served here; this server runs "
                                   f"{', '.join(sorted(allowed))}")
        if not request.speculation or method == "ar":
            return 0
        drafts = None if method is None else slot_api.slot_method(method).drafts
        return no_limit if drafts is None else min(drafts, no_limit)

    def _pin_for(self, request: Request) -> str | None:
        """The batch policy a request's override pins on an adaptive server: the method itself, or for
        "chain:K" the shortest compiled chain verifying at least K drafts (the row is limited to K).
        "ar" pins nothing: the row's limit of 0 makes it AR inside any step."""
        method = self._served_name(request.method)
        if not self.adaptive or method is None or method == "ar":
            return None
        if method in self.policies:
            return method
        base, drafts = method.split(":")[0], self._row_limit(request)
        length = lambda p: self.controller.drafts[p] or 0  # noqa: E731
        chains = [p for p in self.policies if p.split(":")[0] == base]
        covering = [p for p in chains if length(p) >= drafts]
        return min(covering, key=length) if covering else max(chains, key=length)

    def _with_drafting_prompt(self, request: Request) -> Request:
        """On a rapid or rapid+block server, a request without a drafting prompt drafts from its
        prompt's most recent tokens, as many as the drafting context holds beside its answer."""
        if not self.drafts_from_retrieval or request.drafting_prompt is not None:
            return request
        room = max(self.max_drafting_prompt - request.max_tokens, 1)
        return dataclasses.replace(request, drafting_prompt=tuple(request.prompt[-room:]))

    def submit(self, request: Request) -> RequestHandle:
        """Queue a request; returns at once. Raises SpecjaxError for a bad request and QueueFull when
        max_queue requests already wait."""
        request = self._with_drafting_prompt(request)
        self.validate(request)
        with self._lock:
            if not self._accepting:
                raise SpecjaxError("the server is shutting down")
            if len(self._waiting) >= self.config.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting (max_queue {self.config.max_queue})")
            handle = RequestHandle(next(self._ids), request, self)
            now = time.perf_counter()
            self._waiting.append((handle, now))
            self._arrivals.append(now)
            self.metrics.queue_depth(len(self._live), len(self._waiting))
        self._wake()
        return handle

    def generate(self, request: Request) -> RequestResult:
        return self.submit(request).result()

    def document_request(self, document: str, question: str | list[dict], retrieval: RetrievalConfig | None = None,
                         chat: bool = True, **fields) -> tuple[Request, dict]:
        """A request about a long document: the prompt holds the document and the question (a string,
        or chat messages whose last user message it goes before), and on a rapid or rapid+block server
        the drafting prompt holds the chunks retrieved from it for the question. Indexes are cached by
        the document's content, so requests about one document share its index. fields: the other
        Request fields. Returns (request, what retrieval did: `LongContextPrompt.summary`)."""
        if self.model.tokenizer is None:
            raise SpecjaxError("a document request needs the model's tokenizer; this model has none")
        # The cheap refusals first: indexing a document costs an encoder pass over all of it.
        if len(self._waiting) >= self.config.max_queue:
            raise QueueFull(f"{len(self._waiting)} requests are waiting (max_queue {self.config.max_queue})")
        if not isinstance(document, str) or not document.strip():
            raise SpecjaxError("the document is empty")
        length = len(self.model.tokenizer.encode(document, add_special_tokens=False))
        if length > self.max_prompt:
            raise SpecjaxError(f"the document has {length} tokens; this server takes prompts of at most "
                               f"{self.max_prompt} (serve --context-length)")
        config = (retrieval or self.config.retrieval) if self.drafts_from_retrieval else None
        encoder = None
        if config is not None and config.retriever in NEEDS_ENCODER:
            with self._encoder_lock:
                if self._encoder is None:
                    self._encoder = load_sentence_encoder()
                encoder = self._encoder
        built = long_context_prompt(self.model.tokenizer, document, question, config, self.indexes, encoder, chat)
        request = Request(prompt=tuple(built.full),
                          drafting_prompt=None if built.drafting is None else tuple(built.drafting), **fields)
        return request, built.summary(config or self.config.retrieval)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._live)

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop accepting requests; with drain, finish those in flight (and queued) first, else cancel them."""
        with self._lock:
            self._accepting = False
            if not drain:
                for handle, _ in self._waiting:
                    handle.cancelled = True
                for live in self._live.values():
                    live.handle.cancelled = True
        deadline = None if timeout is None else time.perf_counter() + timeout
        while drain and (self._waiting or self._live) and self._thread.is_alive():
            if deadline is not None and time.perf_counter() > deadline:
                return self.shutdown(drain=False)
            time.sleep(0.05)
        self._stopping = True
        self._wake()
        self._thread.join(timeout=60)
        self._save_controller_priors()
        self.metrics.close()

    # ---- the scheduler thread ----

    def _wake(self) -> None:
        self._wakeup.set()

    def _run(self) -> None:
        while not self._stopping:
            try:
                self._drop_cancelled_waiting()
                self._admit()
                self._continue_prefills()
                if not self._live:
                    self.metrics.tick()  # an idle server's snapshots show the load falling to zero
                    self._wakeup.wait(timeout=0.5)
                    self._wakeup.clear()
                    continue
                if all(live.prefilling for live in self._live.values()):
                    continue
                self._pack()
                rows = self._step_rows()
                policy = self._choose_policy(rows)
                attend = self._attend_length(policy)
                with self._device_lock:
                    started = time.perf_counter()
                    self._state = self._compiled_step(policy, attend, rows)(self.parts, self._state)
                    self._collect((started, attend, rows, policy))
            except Exception as error:  # noqa: BLE001 - a failed device call fails the requests in it, not the server
                log.exception("decode step failed")
                self._fail_all(f"{type(error).__name__}: {error}")
                self._state = self._fresh_state()

    @staticmethod
    def _writes(policy: str, statics) -> int:
        method = slot_api.slot_method(policy)
        if method.needs_retrieval and not method.needs_drafter:  # rapid verifies its drafts + 1 tokens
            return statics.rapid.drafts + 1
        if method.needs_ngram:
            return statics.ngram.drafts + 1
        if not method.needs_drafter:
            return 1
        if method.needs_tree:
            return max(statics.tree_buckets)
        return statics.block if method.drafts is None else method.drafts + 1

    def _attend_length(self, policy: str | None = None) -> int:
        """The smallest compiled attention length that holds every live row through the next call
        of `policy` (None: of the policy that writes the most)."""
        longest = max(int(self._lengths[slot]) for slot in self._live)
        slack = self.step_slack if policy is None else self.policy_slack[policy]
        need = longest + self.config.steps_per_sync * slack + 1
        return next((b for b in self.attend_buckets if b >= need), self.attend_buckets[-1])

    def _row_bucket(self, rows: int) -> int:
        """The smallest compiled row count that covers `rows` slots."""
        return next(b for b in self.row_buckets if b >= rows)

    def _step_rows(self) -> int:
        return self._row_bucket(max(self._live) + 1)

    def _pack(self) -> None:
        """Move the highest live rows into free lower slots, so a step over the first rows covers
        them all (a row's whole state moves, so its request goes on unchanged)."""
        while self._live:
            highest = max(self._live)
            free = [s for s in range(highest) if s not in self._live]
            # Only when it lets the step compute fewer rows: moving costs a copy of the row's caches.
            if not free or self._row_bucket(len(self._live)) == self._row_bucket(highest + 1):
                return
            target = free[0]
            self._state = self._program("move_row")(self._state, highest, target)
            self._live[target] = self._live.pop(highest)
            self._lengths[target] = self._lengths[highest]
            self._drafting_lengths[target] = self._drafting_lengths[highest]

    def _compiled_step(self, policy: str, length: int, rows: int):
        return self._compiled.get(("step", policy, length, rows)) or self._program(
            "step", method=policy, statics=self.statics, attend_slots=length, rows=rows)

    def _choose_policy(self, rows: int) -> str:
        """The controller's choice for the next call (a fixed method's server always has one)."""
        attend = {policy: self._attend_length(policy) for policy in self.policies}
        decoding = [live for live in self._live.values() if not live.prefilling]
        pinned = sorted((slot for slot in self._pins if slot in self._live), key=lambda s: self._live[s].admitted)
        self.controller.pin(self._pins[pinned[0]] if pinned else None)  # the oldest pinning request wins
        decision = self.controller.decide(rows, attend, [live.draft_limit for live in decoding])
        self.decisions.append((time.time(), decision))
        if decision.policy != self._last_ran:  # a return from a probe is no switch of its own
            self.metrics.policy(decision.policy, None if decision.reason == "hold" else decision.reason)
        self._last_ran = decision.policy
        self.policy = self.controller.current
        self.metrics.controller(decision.predicted_tokens_per_step, decision.predicted_tokens_per_s,
                                self._arrival_rate())
        return decision.policy

    def _arrival_rate(self) -> float:
        """Requests per second over the last 64 arrivals (0 with fewer than two)."""
        times = list(self._arrivals)
        return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else 0.0

    def _drop_cancelled_waiting(self) -> None:
        with self._lock:
            kept = collections.deque()
            for handle, arrived in self._waiting:
                if handle.cancelled:
                    self._finish_unstarted(handle, arrived, "cancelled")
                else:
                    kept.append((handle, arrived))
            self._waiting = kept

    def _finish_unstarted(self, handle: RequestHandle, arrived: float, reason: str, error: str | None = None):
        e2e = time.perf_counter() - arrived
        handle._push(result=RequestResult([], "", reason, error, {"e2e_s": e2e, "queue_s": e2e}))
        self.metrics.finished(reason, e2e)

    def _memory_allows(self, batch: list[_Live], request: Request, resumed: int) -> bool:
        """Under a KV budget, admit only while no alarm is raised and the request's tokens fit below
        the high water mark beside what the running requests and this admission's batch hold (a
        request alone is always admitted, so nothing waits forever)."""
        budget = self.controller.kv_budget
        if not budget or not (batch or self._live):
            return True
        if self.memory_state is not None and self.memory_state.alarm:
            return False
        target, drafter = self._bytes_per_token["target"], self._bytes_per_token.get("drafter", 0)
        # A drafting context (rapid, rapid+block) holds the drafting prompt, not the full one.
        drafting = self._drafting_lengths if self.drafts_from_retrieval else self._lengths
        # A row still prefilling its prompt in chunks holds only the chunks so far; it will hold all of it.
        held = sum(max(int(self._lengths[slot]), len(row.prompt)) * target
                   + row.drafting_held(max(int(drafting[slot]), len(row.drafting_prompt if self.drafts_from_retrieval
                                                                   else row.prompt))) * drafter
                   for slot, row in self._live.items())
        own = request.prompt if request.drafting_prompt is None or not self.drafts_from_retrieval \
            else request.drafting_prompt
        held += sum(len(x.prompt) * target + len(x.drafting_prompt if self.drafts_from_retrieval else x.prompt) * drafter
                    for x in batch)
        held += (len(request.prompt) + resumed) * target + (len(own) + resumed) * drafter
        return held <= self.config.controller.kv_high_water * budget

    def _admit(self) -> None:
        """Prefill waiting requests into free slots, up to insert_rows of them per device call.
        Requests parked by a preemption (at the head of the queue) are written back first."""
        free = [s for s in range(self.config.slots) if s not in self._live]
        admitted = False
        while free and self._waiting:
            with self._lock:
                handle, _ = self._waiting[0]
                row = None if handle._parked is None else handle._parked[0]
                if row is None or not self._memory_allows([], handle.request, int(row.num_generated)):
                    break
                self._waiting.popleft()
            self._restore(free.pop(0), handle)
            admitted = True
        while free:
            batch: list[tuple[int, _Live]] = []
            with self._lock:
                while self._waiting and len(batch) < min(len(free), self.insert_rows):
                    handle, arrived = self._waiting[0]
                    request = handle.request
                    # A parked request waits at the head until it can be written back (above): it holds
                    # tokens it must not prefill again, and nothing behind it goes first.
                    if handle._parked is not None or not self._memory_allows([x for _, x in batch], request,
                                                                             len(handle._resume)):
                        break
                    self._waiting.popleft()
                    seed = handle._carry.get("seed")
                    if seed is None:
                        seed = request.seed if request.seed is not None else int(np.random.default_rng().integers(2**32))
                        handle._carry["seed"] = seed
                    resumed = list(handle._resume)
                    text = "" if not resumed or self.model.tokenizer is None else self.model.tokenizer.decode(resumed)
                    # A resumed request draws from a stream of its own, so it does not replay its first draws.
                    live = _Live(handle, arrived, admitted=0.0, seed=(seed + len(resumed)) % 2**32,
                                 reached_reported=np.zeros(max(self.statics.block - 1, 0), np.int64),
                                 emitted=len(resumed), text=text, resumed=resumed,
                                 draft_limit=self._row_limit(request),
                                 histogram_reported=np.zeros(self.statics.block, np.int64),
                                 policy_steps=dict(handle._carry.get("policy_steps", {})))
                    batch.append((free[len(batch)], live))
            if not batch:
                break
            try:
                self._prefill(batch)
            except Exception as error:  # noqa: BLE001 - a failed prefill fails the requests in it only
                log.exception("prefill failed")
                for _, live in batch:
                    self._finish_unstarted(live.handle, live.arrived, "error", f"{type(error).__name__}: {error}")
                continue
            now = time.perf_counter()
            for slot, live in batch:
                free.remove(slot)
                live.admitted = now
                pin = self._pin_for(live.handle.request)
                if pin is not None:
                    self._pins[slot] = pin
                self.metrics.admitted(now - live.arrived, len(live.handle.request.prompt))
                self._live[slot] = live
            self.metrics.queue_depth(len(self._live), len(self._waiting))
            admitted = True
        # The first tokens came from the prefills: stream them now rather than after a step.
        if admitted:
            self._collect(None)

    def _prefill(self, batch: list[tuple[int, _Live]]) -> None:
        """One insert call: fresh rows get their whole prompt (or its first chunk, when longer than
        prefill_chunk), up to insert_rows of them; a row already holding part of its prompt gets its
        next chunk (one row per call).

        A chunked prompt's first chunk is the remainder (len mod chunk, or a whole chunk), so every
        later chunk is exactly prefill_chunk real tokens ending at most at the prompt's end: no
        padding is written past the prompt, where a padded chunk could run off the cache.

        On a rapid or rapid+block server every prompt goes in whole, with its drafting prompt."""
        chunk = self.prefill_chunk
        starts = [live.prefilled for _, live in batch]
        if any(starts):  # the next chunk, after what the row holds
            if len(batch) != 1:
                raise RuntimeError("continued prompt chunks are prefilled one row per call")
            prompt = batch[0][1].prompt
            takes, key, width, offsets, rows = [prompt[starts[0]: starts[0] + chunk]], "extend", chunk, starts, 1
        else:  # whole prompts, or first chunks, into fresh rows, padded to a compiled row count
            takes = [live.prompt for _, live in batch]
            takes = [p if not chunk or len(p) <= chunk else p[: len(p) % chunk or chunk] for p in takes]
            width = max(self._bucket_for(len(t)) for t in takes)
            rows = next(size for size in self.insert_sizes if size >= len(batch))
            key, offsets = (width, rows), None
        tokens = slot_api.token_rows(takes, width, rows)
        requests = [live.handle.request for _, live in batch]
        lives = [live for _, live in batch]
        pad = rows - len(batch)
        insert = self._insert_request(
            [slot for slot, _ in batch] + [self.config.slots] * pad, tokens, [len(t) for t in takes] + [1] * pad,
            [r.max_tokens - len(x.resumed) for r, x in zip(requests, lives)] + [1] * pad,
            [live.seed for _, live in batch] + [0] * pad,
            [r.temperature for r in requests] + [0.0] * pad, [r.top_k for r in requests] + [0] * pad,
            [r.top_p for r in requests] + [1.0] * pad,
            final=[start + len(t) == len(x.prompt) for start, t, x in zip(starts, takes, lives)] + [True] * pad,
            offsets=offsets, limits=[x.draft_limit for x in lives] + [self.statics.block - 1] * pad)
        started = time.perf_counter()
        run = self._compiled.get(key) or self._program("insert", statics=self.statics)
        self._state = run(self.parts, self._state, insert)
        if self.drafts_from_retrieval:  # whole prompts only (prefill_chunk is 0); then the rows' drafting contexts
            drafts_from = [live.drafting_prompt for _, live in batch] + [(0,)] * pad
            width = next(b for b in self.drafting_buckets if b >= max(map(len, drafts_from)))
            fill = self._compiled.get(("drafting", width, rows)) or self._program("refresh_drafting", statics=self.statics)
            self._state = fill(self.parts, self._state, *self._drafting_fill(insert.rows, drafts_from, width))
        jax.block_until_ready(self._state.lengths)  # so the prefill's time is its own
        self.metrics.timing("prefill", time.perf_counter() - started)
        for (slot, live), start, take in zip(batch, starts, takes):
            live.prefilled = start + len(take)
            self._lengths[slot] = live.prefilled
            if self.drafts_from_retrieval:
                self._drafting_lengths[slot] = len(live.drafting_prompt)
            live.generated_reported = 0 if live.prefilling else 1  # the prefill's token is no step's

    def _continue_prefills(self) -> None:
        """The next chunk of every slot whose prompt is still being prefilled (one per turn, so the
        slots that decode wait for at most one chunk per row between their steps)."""
        completed = False
        for slot, live in list(self._live.items()):
            if not live.prefilling:
                continue
            now = time.perf_counter()
            if live.handle.cancelled:
                self._finish(slot, live, "cancelled", now, 0, np.zeros(self.statics.block, np.int64))
                continue
            try:
                self._prefill([(slot, live)])
            except Exception as error:  # noqa: BLE001 - one bad prefill fails its own request only
                log.exception("prefill failed")
                self._finish(slot, live, "error", now, 0, np.zeros(self.statics.block, np.int64),
                             error=f"{type(error).__name__}: {error}")
                continue
            completed = completed or not live.prefilling
        if completed:
            self._collect(None)

    def _collect(self, step: tuple[float, int, int] | None) -> None:
        """One host sync: stream new tokens, finish rows that ended, report metrics. step: (start
        time, attention length, rows) of the device call being synced, None after prefills alone."""
        state = self._state
        # One transfer for everything the sync reads (the drafting contexts' lengths too, when kept).
        synced = jax.device_get(_Synced(
            state.tokens, state.num_generated, state.done, state.steps, state.accepted_histogram, state.lengths,
            state.drafted, state.drafting_lengths if self.drafts_from_retrieval else None,
            state.lossless_diverged_at))
        now = time.perf_counter()
        if step is not None:
            self._report_step(now - step[0], step[1], step[2], synced.steps, synced.drafted, step[3])
            self._observe_call(now - step[0], step[1], step[2], step[3], synced)
        self._lengths[:] = synced.lengths
        if self.drafts_from_retrieval:
            self._drafting_lengths[:] = synced.drafting_lengths
        for slot, live in list(self._live.items()):
            if live.prefilling:
                continue
            try:
                self._sync_slot(slot, live, synced, now)
            except Exception as error:  # noqa: BLE001 - one request's failure (say, its detokenizing) is its own
                log.exception("request %d failed", live.handle.id)
                self._finish(slot, live, "error", now, synced.steps[slot], synced.histogram[slot],
                             error=f"{type(error).__name__}: {error}")
        self._report_memory(synced.lengths)
        self.metrics.tick()

    def _observe_call(self, seconds: float, attend: int, rows: int, policy: str, synced) -> None:
        """Tell the controller what the call did: committed tokens, row steps and, for chains, how
        often each draft position was verified and accepted (within each row's draft limit)."""
        counts, steps, histogram = synced.counts, synced.steps, synced.histogram
        drafts = self.controller.drafts.get(policy)
        width = max(self.statics.block - 1, 0)
        reached, verified = np.zeros(width), np.zeros(width)
        row_steps = committed = decoding = 0
        for slot, live in self._live.items():
            if live.prefilling:
                continue
            decoding += 1
            stepped = int(steps[slot]) - live.steps_reported
            row_steps += stepped
            committed += int(counts[slot]) - live.generated_reported
            live.generated_reported = int(counts[slot])
            if stepped:
                live.policy_steps[policy] = live.policy_steps.get(policy, 0) + stepped
            if drafts and stepped:
                delta = np.asarray(histogram[slot], np.int64) - live.histogram_reported
                tail = delta[::-1].cumsum()[::-1]  # tail[n]: steps that accepted at least n drafts
                k = min(drafts, live.draft_limit)
                verified[:k] += tail[:k]
                reached[:k] += tail[1 : k + 1]
            live.histogram_reported = np.asarray(histogram[slot], np.int64)
        self.controller.observe_call(policy, rows, attend, seconds, row_steps, committed, reached, verified)
        if row_steps:  # committed per step over the rows, comparable with the prediction
            self.metrics.measured_tokens_per_step(committed * decoding / row_steps)

    def _sync_slot(self, slot: int, live: _Live, synced, now: float) -> None:
        tokens, counts, done, steps, histogram, drafted = (synced.tokens, synced.counts, synced.done, synced.steps,
                                                           synced.histogram, synced.drafted)
        request = live.handle.request
        tokenizer = self.model.tokenizer
        block = self.statics.block
        ids = live.resumed + tokens[slot, : int(counts[slot])].tolist()  # every token of the request so far
        count = len(ids)
        carry = live.handle._carry
        if synced.lossless_diverged_at is not None and int(synced.lossless_diverged_at[slot]) >= 0:
            # Counted from the request's first token: a resumed row's tokens so far are in its prompt.
            carry.setdefault("lossless_diverged_at", len(live.resumed) + int(synced.lossless_diverged_at[slot]))
        new = ids[live.emitted:]
        reason = None
        text_delta = ""
        if tokenizer is not None and new:
            text = tokenizer.decode(ids)
            if text.endswith("\ufffd") and not done[slot]:
                text = live.text  # an incomplete UTF-8 sequence: wait for the rest of its bytes
            cut = _find_stop(text, request.stop, len(live.text))
            if cut is not None:
                text, reason = text[:cut], "stop"
                new = _ids_within(tokenizer, ids, live.emitted, text)
            text_delta, live.text = text[len(live.text):], text
        if new or text_delta:
            if live.first_token_at is None:
                live.first_token_at = now
                self.metrics.first_token(now - live.arrived)
            self.metrics.tokens_streamed(len(new), None if live.last_chunk_at is None else now - live.last_chunk_at)
            live.last_chunk_at = now
            live.emitted += len(new)
            live.handle._push(Chunk(new, text_delta))
        # Speculative counters: verify steps and draft positions reached since the last sync.
        if block > 1:
            reached = histogram[slot][::-1].cumsum()[::-1][1:]  # steps whose run reached draft slot k
            self.metrics.verify_steps(int(steps[slot]) - live.steps_reported, int(drafted[slot]) - live.drafted_reported,
                                      (reached - live.reached_reported).tolist())
            live.reached_reported = reached
        live.steps_reported, live.drafted_reported = int(steps[slot]), int(drafted[slot])
        if reason is None and done[slot]:
            at_limit = count >= request.max_tokens and not self._ends_with_eos(ids)
            reason = "length" if at_limit else "stop"
        if reason is None and live.handle.cancelled:
            reason = "cancelled"
        if reason is not None:
            self._finish(slot, live, reason, now, steps[slot], histogram[slot])

    def _ends_with_eos(self, ids) -> bool:
        return len(ids) > 0 and int(ids[-1]) in self.model.eos_token_ids

    def _finish(self, slot: int, live: _Live, reason: str, now: float, steps, histogram,
                error: str | None = None) -> None:
        del self._live[slot]  # the slot is free now; the next insert overwrites its row
        self._pins.pop(slot, None)
        carry = live.handle._carry
        ids = [t for chunk in live.handle._chunks for t in chunk.token_ids]
        steps = int(steps) + carry.get("steps", 0)
        histogram = np.asarray(histogram) + carry.get("histogram", 0)
        live.drafted_reported += carry.get("drafted", 0)
        metrics = self._request_metrics(live, now, steps, histogram, ids)
        result = RequestResult(ids, live.text, reason, error, metrics)
        live.handle._push(result=result)
        self.metrics.finished(reason, now - live.arrived, {"id": live.handle.id, "finish_reason": reason, **metrics})
        self.metrics.queue_depth(len(self._live), len(self._waiting))

    def _request_metrics(self, live: _Live, now: float, steps: int, histogram: np.ndarray, ids=()) -> dict:
        """Per-request metrics, named as vLLM's and SGLang's responses name them."""
        request = live.handle.request
        out = {
            "queue_s": live.admitted - live.arrived,
            "ttft_s": None if live.first_token_at is None else live.first_token_at - live.arrived,
            "e2e_s": now - live.arrived,
            "prompt_tokens": len(live.handle.request.prompt),
            **({"drafting_prompt_tokens": len(live.drafting_prompt) - len(live.resumed)}
               if self.drafts_from_retrieval else {}),
            "completion_tokens": live.emitted,
            "method": self.config.method,
            "precision": self.model.config.precision,
            # Per-request control and what the batch ran while the request decoded.
            "speculation": request.speculation,
            "method_requested": request.method,
            "draft_limit": live.draft_limit,
            "policy_steps": dict(live.policy_steps),
            "preemptions": live.handle._carry.get("preemptions", 0),
            "drafter_state_dropped": not live.holds_drafter,
            "drafter_windowed": live.drafter_window > 0,
            **({"lossy": self.statics.rapid.lossy_label, "lossless_agreement": self._lossless_agreement(live, ids)}
               if self.statics.rapid is not None and self.statics.rapid.lossy else {}),
            # Quality beside speed: high acceptance from degenerate repetition shows as low distinct-n.
            "distinct_2": distinct_n(ids, 2),
            "distinct_3": distinct_n(ids, 3),
        }
        if self.statics.block > 1:
            committed = float((histogram * (np.arange(len(histogram)) + 1)).sum())
            reached = histogram[::-1].cumsum()[::-1][1:]
            out["speculative_decoding"] = {
                "mean_acceptance_length": committed / steps if steps else 0.0,
                # Accepted over checked draft tokens (a tree checks all its nodes, a chain its block).
                "acceptance_rate": float(reached.sum() / live.drafted_reported) if live.drafted_reported else 0.0,
                "per_position_acceptance": (reached / steps).tolist() if steps else [],
                "acceptance_histogram": histogram.tolist(),
                "verify_steps": steps,
                "draft_tokens": live.drafted_reported,
            }
        return out

    def _lossless_agreement(self, live: _Live, ids) -> dict | None:
        """A lossy greedy request against the lossless run: the tokens before the first that differs
        (SlotState.lossless_diverged_at) and whether the whole output is the lossless one; None for a
        sampled request, whose lossless run is a draw of its own."""
        if live.handle.request.temperature > 0:
            return None
        agreement = lossless_agreement([live.handle._carry.get("lossless_diverged_at", -1)], [len(ids)])
        self.metrics.lossy_agreement(agreement["identical"][0])
        return {"identical": agreement["identical"][0], "prefix_tokens": agreement["prefix_tokens"][0]}

    def _report_step(self, seconds: float, attend: int, rows: int, steps, drafted, policy: str) -> None:
        """The device call's time, its estimated phase split, and its work against the machine's peaks."""
        self.metrics.timing("step", seconds)
        # Called before the rows sync, so each request's *_reported counts are those of the last sync.
        steps_done = sum(int(steps[slot]) - live.steps_reported for slot, live in self._live.items())
        drafted_done = sum(int(drafted[slot]) - live.drafted_reported for slot, live in self._live.items())
        # Tokens each row verified per step (1 + drafts checked), from the rows that stepped.
        verify_tokens = 1.0 + (drafted_done / steps_done if steps_done else self.statics.block - 1)
        method = slot_api.slot_method(policy)
        phases = self.phase_seconds if method.needs_drafter else {"verify": 1.0}
        if method.needs_tree and self.latency is not None:  # the latency model's drafting and verify costs
            phases = {"draft": self.latency.fixed_s,
                      "verify": float(np.interp(verify_tokens, self.latency.sizes, self.latency.verify_s))}
        total = sum(phases.values())
        for phase, cost in phases.items():
            self.metrics.timing(phase, seconds * cost / total)
        flops, bytes_read = step_work(dataclasses.replace(self._work_shape, rows=rows), verify_tokens, attend)
        calls = self.config.steps_per_sync
        self.metrics.roofline(calls * flops / seconds, calls * bytes_read / seconds, self.peaks.flops_per_s,
                              self.peaks.bytes_per_s)

    def _report_memory(self, lengths) -> None:
        used = {slot: int(lengths[slot]) for slot in self._live}
        tokens_held = sum(used.values())
        capacity = self.config.slots * self.statics.slot.cache_length
        # Bytes holding tokens, as a paged allocator would count its pages: the slot arrays are
        # allocated once, and the budget bounds what live requests occupy of them.
        bytes_in_use = {"target": tokens_held * self._bytes_per_token["target"]}
        if "drafter" in self._bytes_per_token:
            # A drafting context (rapid, rapid+block) holds the drafting prompt, not the full one.
            held = self._drafting_lengths if self.drafts_from_retrieval else lengths
            drafting = sum(self._live[slot].drafting_held(int(held[slot])) for slot in used
                           if self._live[slot].holds_drafter)
            bytes_in_use["drafter"] = drafting * self._bytes_per_token["drafter"]
        self.metrics.memory(tokens_held / capacity, bytes_in_use, self._bytes_per_token)
        state = self.memory_state = self.controller.observe_memory(sum(bytes_in_use.values()), time.perf_counter())
        self.metrics.memory_budget(state.budget, state.seconds_to_budget, state.alarm)
        # Past the high water mark, free the excess: drafter states first (speculation is lost, no
        # work), then the newest requests are preempted: their tokens so far become part of their
        # prompt when they are admitted again (recomputed, as vLLM does), and they stream on from there.
        high_water = int(self.config.controller.kv_high_water * state.budget)
        if not state.budget or state.bytes_in_use < high_water:
            return
        rows = [HeldRow(slot, live.admitted, used[slot], live.holds_drafter and "drafter" in self._bytes_per_token,
                        speculating=live.draft_limit > 0,
                        drafter_tokens=int(self._drafting_lengths[slot]) if self.drafts_from_retrieval else None,
                        drafter_window=live.drafter_window)
                for slot, live in self._live.items() if not live.prefilling]
        relief = relieve_memory(rows, self._bytes_per_token, state.bytes_in_use - high_water, self._relief_window)
        for slot in relief.preempt:
            self._preempt(slot)
        for slot in relief.drop_drafter:
            self._drop_drafter_state(slot)
        for slot in relief.window_drafter:
            self._window_drafter(slot)

    def _drop_drafter_state(self, slot: int) -> None:
        """The row decodes on without drafts (a draft limit of 0 is exact under every policy), and its
        drafter context no longer counts against the budget."""
        live = self._live[slot]
        live.holds_drafter = False
        live.draft_limit = 0
        self._pins.pop(slot, None)
        self._state = self._state.replace(draft_limit=self._state.draft_limit.at[slot].set(0))
        self.metrics.drafter_state_dropped()
        log.info("dropped the drafter state of request %d: KV bytes past the high water mark", live.handle.id)

    def _window_drafter(self, slot: int) -> None:
        """The row's drafter reads only its last `_relief_window` context positions from now on; the
        row keeps speculating (drafts only, so output is unchanged) and its older drafter K/V no
        longer count against the budget."""
        live = self._live[slot]
        live.drafter_window = self._relief_window
        self._state = self._state.replace(drafter_window=self._state.drafter_window.at[slot].set(live.drafter_window))
        self.metrics.drafter_state_windowed()
        log.info("windowed the drafter of request %d to its last %d positions: KV bytes past the high water mark",
                 live.handle.id, live.drafter_window)

    def _restore(self, slot: int, handle: RequestHandle) -> None:
        """Write a parked request's state row back into a free slot; it decodes on where it stopped."""
        row, live = handle._parked
        handle._parked = None
        self._state = self._program("put_row")(self._state, jax.device_put(row), slot)
        self._lengths[slot] = int(row.lengths)
        if self.drafts_from_retrieval:
            self._drafting_lengths[slot] = int(row.drafting_lengths)
        live.admitted = time.perf_counter()
        pin = self._pin_for(handle.request)
        if pin is not None:
            self._pins[slot] = pin
        self._live[slot] = live
        self.metrics.queue_depth(len(self._live), len(self._waiting))
        log.info("restored request %d from the host at %d tokens", handle.id, int(row.num_generated))

    def _preempt(self, slot: int) -> None:
        live = self._live.pop(slot)
        self._pins.pop(slot, None)
        handle = live.handle
        if self.config.preemption == "park":
            # The row's whole state goes to the host as it is: restored, the request goes on bit for bit.
            handle._parked = (jax.device_get(self._program("take_row")(self._state, slot)), live)
            handle._carry["preemptions"] = handle._carry.get("preemptions", 0) + 1
            with self._lock:
                self._waiting.appendleft((handle, live.arrived))
            self.metrics.preempted()
            self.metrics.queue_depth(len(self._live), len(self._waiting))
            log.info("preempted request %d at %d tokens, parked on the host: KV bytes past the high water mark",
                     handle.id, live.emitted)
            return
        handle._resume = [t for chunk in handle._chunks for t in chunk.token_ids]
        histogram = live.histogram_reported if live.histogram_reported is not None else 0
        carry = handle._carry
        carry.update(steps=carry.get("steps", 0) + live.steps_reported,
                     histogram=carry.get("histogram", 0) + histogram,
                     drafted=carry.get("drafted", 0) + live.drafted_reported,
                     policy_steps=dict(live.policy_steps), preemptions=carry.get("preemptions", 0) + 1)
        with self._lock:
            self._waiting.appendleft((handle, live.arrived))
        self.metrics.preempted()
        self.metrics.queue_depth(len(self._live), len(self._waiting))
        log.info("preempted request %d at %d tokens: KV bytes past the high water mark", handle.id,
                 len(handle._resume))

    def _fail_all(self, message: str) -> None:
        now = time.perf_counter()
        self._pins.clear()
        for slot, live in list(self._live.items()):
            del self._live[slot]
            live.handle._push(result=RequestResult([], live.text, "error", message, {"e2e_s": now - live.arrived}))
            self.metrics.finished("error", now - live.arrived)


class CompileProgress:
    """One stderr line per compiled program (which one, k of n, seconds so far), flushed at once so
    a log file shows a long compile as progress rather than a hang."""

    def __init__(self, total: int, what: str):
        self.total, self.what, self.count, self.started = total, what, 0, time.perf_counter()

    def done(self, program: str) -> None:
        self.count += 1
        print(f"[specjax] compiling {self.what}: {self.count}/{self.total} ({program}), "
              f"{time.perf_counter() - self.started:.1f} s", file=sys.stderr, flush=True)


def _find_stop(text: str, stops: tuple[str, ...], already: int) -> int | None:
    """Where the first stop string begins in text, looking only where it could newly complete."""
    best = None
    for stop in stops:
        at = text.find(stop, max(0, already - len(stop) + 1))
        if at >= 0 and (best is None or at < best):
            best = at
    return best


def _ids_within(tokenizer, ids: list[int], emitted: int, text: str) -> list[int]:
    """The new token ids (past `emitted`) whose decoded text fits within `text` (a stop string cut it)."""
    kept = emitted
    while kept < len(ids) and len(tokenizer.decode(ids[: kept + 1])) <= len(text):
        kept += 1
    return ids[emitted:kept]
