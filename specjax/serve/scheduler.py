"""Continuous batching: a request queue feeding a fixed set of decode slots.

One scheduler thread owns the device state. Each turn it (1) prefills waiting requests into free
slots (`slots.insert`, one prompt bucket per call shape), (2) runs `steps_per_sync` verify steps for
every occupied slot in one device call (`slots.step`), and (3) syncs once: new tokens go to each
request's handle, finished rows (EOS, token limit, a stop string, cancellation) free their slot at
once. Callers talk to it through `submit`, from any thread or event loop.

Every shape is fixed at start-up (serve/shapes.py) and every executable compiled then
(serve/programs.py), so nothing recompiles under load. What slots hold is counted against the KV
budget in serve/kv_ledger.py; requests and their handles are in serve/requests.py.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import logging
import sys
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from specjax.data.retrieval import NEEDS_ENCODER, IndexCache, RetrievalConfig, long_context_prompt
from specjax.decode import slots as slot_api
from specjax.decode.budget import LatencyModel
from specjax.decode.engine import lossless_agreement
from specjax.decode.roofline import StepShape, measure_peaks
from specjax.decode.sampling import SamplingConfig
from specjax.decode.tree import measure_tree_latency, tree_latency_key
from specjax.errors import SpecjaxError
from specjax.io.dflash import LoadedDrafter
from specjax.io.encoder import load_sentence_encoder
from specjax.io.refiner import LoadedRefiner
from specjax.io.registry import LoadedModel, cache_dir
from specjax.models.cache import tree_bytes
from specjax.monitor.serving import ServingMetrics
from specjax.serve.config import ServeConfig
from specjax.serve.controller import Controller, Decision, relieve_memory
from specjax.serve.kv_ledger import KvLedger
from specjax.serve.programs import CompileProgress, Programs
from specjax.serve.reporting import StepReporter, request_metrics
from specjax.serve.requests import Chunk, LiveRequest, QueueFull, Request, RequestHandle, RequestResult
from specjax.serve.rules import RequestRules
from specjax.serve.shapes import needed_parts, plan_shapes, served_policies
from specjax.sharding import place_params

__all__ = ["Chunk", "QueueFull", "Request", "RequestHandle", "RequestResult", "Scheduler", "ServeConfig"]

log = logging.getLogger("specjax.serve")

DECISION_HISTORY = 4096
"""Controller decisions a scheduler keeps (`Scheduler.decisions`): about ten minutes of device calls
on a CPU; older ones are dropped."""


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
        policies = served_policies(model, drafter, config)
        drafter, refiner = needed_parts(policies, drafter, refiner, model)
        self.shapes = shapes = plan_shapes(policies, model, drafter, refiner, config)
        self.policies, self.statics = shapes.policies, shapes.statics
        self.drafts_from_retrieval = shapes.drafts_from_retrieval
        model, drafter, refiner = (place_params(x, mesh) for x in (model, drafter, refiner))
        self.model, self.drafter, self.refiner, self.config, self.mesh = model, drafter, refiner, config, mesh
        self.parts = slot_api.slot_parts(self.statics, model.params, None if drafter is None else drafter.params,
                                         None if drafter is None else drafter.draft_vocab,
                                         None if refiner is None else refiner.params)
        self.latency: LatencyModel | None = None
        if any(slot_api.slot_method(p).needs_tree for p in self.policies) and config.tree.auto:
            self.latency = self._tree_latency(latency_cache)
            self.parts = self.parts.replace(tree_costs=self.latency.costs())
        for policy in self.policies:
            slot_api.check_method(policy, self.statics, self.parts)
        self.programs = Programs(shapes, self.parts, mesh)
        self.rules = RequestRules(shapes, model, config, drafter is not None)
        self.kv = KvLedger(self.statics, self.drafts_from_retrieval)
        self.metrics = ServingMetrics(config.method, metrics_log, config.snapshot_every)
        work_shape = StepShape(
            model.config, tree_bytes(model.params), config.slots,
            None if drafter is None else drafter.config, 0 if drafter is None else tree_bytes(drafter.params),
            0 if self.parts.head is None else self.parts.head.shape[1])
        self.reporter = StepReporter(self.metrics, work_shape, measure_peaks(cache_dir() / "peaks", dtype=model.config.dtype),
                                     self.statics.block, config.steps_per_sync, self.latency)
        # Windowing relief needs a drafter that reads a full-attention context cache: not a windowed
        # drafter's ring (bounded already), nor rapid's drafting context (the target's own cache).
        full_context = drafter is not None and drafter.config.window is None and self.statics.rapid is None
        self._relief_window = config.controller.relief_window if full_context else None
        self.controller = Controller(self.policies, self.statics.block, config.controller, config.steps_per_sync)
        self._priors_path = (self._controller_priors_path(drafter) if self.adaptive and config.controller.remember
                             else None)
        self._priors_loaded = self._priors_path is not None and self.controller.load_priors_file(self._priors_path)
        self.decisions: collections.deque[tuple[float, Decision]] = collections.deque(maxlen=DECISION_HISTORY)
        """(wall time, the controller's Decision) for the most recent device calls, oldest first."""
        self.policy = self.controller.current
        self._last_ran = self.policy
        self._pins: dict[int, str] = {}  # slot -> policy its request pinned
        self._arrivals: collections.deque[float] = collections.deque(maxlen=64)
        self._device_lock = threading.Lock()  # device calls of the scheduler and of background measuring
        self.memory_state = None
        self._compiler: threading.Thread | None = None

        self._state = self.programs.fresh_state()
        self._waiting: collections.deque[tuple[RequestHandle, float]] = collections.deque()
        self._live: dict[int, LiveRequest] = {}  # slot -> request
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._ids = itertools.count()
        self._stopping = False
        self._accepting = True
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

    def _make_ready(self, policy: str, compile_steps: bool = True, progress: CompileProgress | None = None) -> None:
        """Compile the policy's steps, time one call of it per live-row bucket (at the shortest
        attention length, with every row live), and hand both to the controller."""
        if compile_steps:
            self.programs.compile_steps(policy, progress)
        if len(self.policies) == 1:  # a fixed method: nothing to choose, so nothing to time
            self.controller.mark_ready(policy, {})
            return
        with self._device_lock:
            costs = self.programs.time_policy(policy, self.config.max_new_tokens, first_runs=compile_steps)
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
        start = self.controller.choose_start(self.shapes.row_buckets[0], self.shapes.attend_buckets[0])
        print(f"[specjax] adaptive: {len(self.controller.ready)} policies ready "
              f"({', '.join(sorted(self.controller.ready))}); the rest compiled in the background in "
              f"{time.perf_counter() - started:.1f} s; starting on {start} (measured costs, "
              f"{'acceptance from the last run' if self._priors_loaded else 'no acceptance measured yet'})",
              file=sys.stderr, flush=True)

    def _compile_later(self, rest: tuple[str, ...]) -> None:
        """The background compiler: drafting-context fills first (the next requests' prefills need
        them), then the adaptive controller's other policies."""
        try:
            if self.shapes.drafting_buckets:
                self.programs.compile_drafting_fills(lambda: self._stopping)
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
        shapes = self.shapes
        progress = CompileProgress(len(shapes.attend_buckets) * len(shapes.row_buckets)
                                   + self.programs.inserts_to_compile(), "the server's programs")
        self._make_ready(self.policy, progress=progress)
        self.programs.compile_inserts(progress)
        chains = [slot_api.slot_method(p) for p in self.policies]
        chains = [m for m in chains if m.needs_drafter and not m.needs_tree]
        if chains:  # trees split by their latency model
            self.reporter.phase_seconds = slot_api.measure_phase_seconds(self.parts, self.statics,
                                                                         any(m.needs_refiner for m in chains))
        self.compile_seconds = time.perf_counter() - started
        print(f"[specjax] serving {self.config.method} on {self.config.slots} slots: compiled the {self.policy} step "
              f"for {len(shapes.attend_buckets)} attention lengths ({', '.join(map(str, shapes.attend_buckets))}) and "
              f"{len(shapes.prompt_buckets)} prompt buckets ({', '.join(map(str, shapes.prompt_buckets))}) in "
              f"{self.compile_seconds:.1f} s", file=sys.stderr, flush=True)
        rest = tuple(p for p in self.policies if p != self.policy)
        if (rest or shapes.drafting_buckets) and background:
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
        self.rules.validate(request)

    def _pin_for(self, request: Request) -> str | None:
        return self.rules.pin_for(request, self.adaptive, self.controller.drafts)

    def submit(self, request: Request) -> RequestHandle:
        """Queue a request; returns at once. Raises SpecjaxError for a bad request and QueueFull when
        max_queue requests already wait."""
        request = self.rules.with_drafting_prompt(request)
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
        if length > self.shapes.max_prompt:
            raise SpecjaxError(f"the document has {length} tokens; this server takes prompts of at most "
                               f"{self.shapes.max_prompt} (serve --context-length)")
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
        if self._priors_path is not None:
            self.controller.save_priors_file(self._priors_path)
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
                    self._state = self.programs.step(policy, attend, rows)(self.parts, self._state)
                    self._collect((started, attend, rows, policy))
            except Exception as error:  # noqa: BLE001 - a failed device call fails the requests in it, not the server
                log.exception("decode step failed")
                self._fail_all(f"{type(error).__name__}: {error}")
                self._state = self.programs.fresh_state()

    def _attend_length(self, policy: str | None = None) -> int:
        """The smallest compiled attention length that holds every live row through the next call
        of `policy` (None: of the policy that writes the most)."""
        longest = max(int(self.kv.lengths[slot]) for slot in self._live)
        slack = self.shapes.step_slack if policy is None else self.shapes.policy_slack[policy]
        return self.shapes.attend_bucket(longest + self.config.steps_per_sync * slack + 1)

    def _step_rows(self) -> int:
        return self.shapes.row_bucket(max(self._live) + 1)

    def _pack(self) -> None:
        """Move the highest live rows into free lower slots, so a step over the first rows covers
        them all (a row's whole state moves, so its request goes on unchanged)."""
        while self._live:
            highest = max(self._live)
            free = [s for s in range(highest) if s not in self._live]
            # Only when it lets the step compute fewer rows: moving costs a copy of the row's caches.
            if not free or self.shapes.row_bucket(len(self._live)) == self.shapes.row_bucket(highest + 1):
                return
            target = free[0]
            self._state = self.programs.program("move_row")(self._state, highest, target)
            self._live[target] = self._live.pop(highest)
            self.kv.move(highest, target)

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

    def _memory_allows(self, batch: list[LiveRequest], request: Request, resumed: int) -> bool:
        """Under a KV budget, admit only while no alarm is raised and the request's tokens fit below
        the high water mark beside what the running requests and this admission's batch hold (a
        request alone is always admitted, so nothing waits forever)."""
        budget = self.controller.kv_budget
        if not budget or not (batch or self._live):
            return True
        if self.memory_state is not None and self.memory_state.alarm:
            return False
        held = self.kv.bytes_after_admitting(self._live, batch, request, resumed)
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
            batch: list[tuple[int, LiveRequest]] = []
            with self._lock:
                while self._waiting and len(batch) < min(len(free), self.statics.slot.insert_rows):
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
                    live = LiveRequest(handle, arrived, admitted=0.0, seed=(seed + len(resumed)) % 2**32,
                                 reached_reported=np.zeros(max(self.statics.block - 1, 0), np.int64),
                                 emitted=len(resumed), text=text, resumed=resumed,
                                 draft_limit=self.rules.row_limit(request),
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

    def _prefill(self, batch: list[tuple[int, LiveRequest]]) -> None:
        """One insert call: fresh rows get their whole prompt (or its first chunk, when longer than
        prefill_chunk), up to insert_rows of them; a row already holding part of its prompt gets its
        next chunk (one row per call).

        A chunked prompt's first chunk is the remainder (len mod chunk, or a whole chunk), so every
        later chunk is exactly prefill_chunk real tokens ending at most at the prompt's end: no
        padding is written past the prompt, where a padded chunk could run off the cache.

        On a rapid or rapid+block server every prompt goes in whole, with its drafting prompt."""
        chunk, shapes = self.shapes.prefill_chunk, self.shapes
        starts = [live.prefilled for _, live in batch]
        if any(starts):  # the next chunk, after what the row holds
            if len(batch) != 1:
                raise RuntimeError("continued prompt chunks are prefilled one row per call")
            prompt = batch[0][1].prompt
            takes, key, width, offsets, rows = [prompt[starts[0]: starts[0] + chunk]], ("extend",), chunk, starts, 1
        else:  # whole prompts, or first chunks, into fresh rows, padded to a compiled row count
            takes = [live.prompt for _, live in batch]
            takes = [p if not chunk or len(p) <= chunk else p[: len(p) % chunk or chunk] for p in takes]
            width = max(shapes.bucket_for(len(t)) for t in takes)
            rows = next(size for size in shapes.insert_sizes if size >= len(batch))
            key, offsets = ("insert", width, rows), None
        tokens = slot_api.token_rows(takes, width, rows)
        requests = [live.handle.request for _, live in batch]
        lives = [live for _, live in batch]
        pad = rows - len(batch)
        insert = self.programs.insert_request(
            [slot for slot, _ in batch] + [self.config.slots] * pad, tokens, [len(t) for t in takes] + [1] * pad,
            [r.max_tokens - len(x.resumed) for r, x in zip(requests, lives)] + [1] * pad,
            [live.seed for _, live in batch] + [0] * pad,
            [r.temperature for r in requests] + [0.0] * pad, [r.top_k for r in requests] + [0] * pad,
            [r.top_p for r in requests] + [1.0] * pad,
            final=[start + len(t) == len(x.prompt) for start, t, x in zip(starts, takes, lives)] + [True] * pad,
            offsets=offsets, limits=[x.draft_limit for x in lives] + [self.statics.block - 1] * pad)
        started = time.perf_counter()
        self._state = self.programs.insert(key)(self.parts, self._state, insert)
        if self.drafts_from_retrieval:  # whole prompts only (prefill_chunk is 0); then the rows' drafting contexts
            drafts_from = [live.drafting_prompt for _, live in batch] + [(0,)] * pad
            width = next(b for b in shapes.drafting_buckets if b >= max(map(len, drafts_from)))
            fill = self.programs.drafting_fill(width, rows)
            self._state = fill(self.parts, self._state, *self.programs.drafting_fill_arguments(insert.rows, drafts_from,
                                                                                               width))
        jax.block_until_ready(self._state.lengths)  # so the prefill's time is its own
        self.metrics.timing("prefill", time.perf_counter() - started)
        for (slot, live), start, take in zip(batch, starts, takes):
            live.prefilled = start + len(take)
            self.kv.lengths[slot] = live.prefilled
            if self.drafts_from_retrieval:
                self.kv.drafting_lengths[slot] = len(live.drafting_prompt)
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
        self.kv.lengths[:] = synced.lengths
        if self.drafts_from_retrieval:
            self.kv.drafting_lengths[:] = synced.drafting_lengths
        for slot, live in list(self._live.items()):
            if live.prefilling:
                continue
            try:
                self._sync_slot(slot, live, synced, now)
            except Exception as error:  # noqa: BLE001 - one request's failure (say, its detokenizing) is its own
                log.exception("request %d failed", live.handle.id)
                self._finish(slot, live, "error", now, synced.steps[slot], synced.histogram[slot],
                             error=f"{type(error).__name__}: {error}")
        self._report_memory()
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

    def _sync_slot(self, slot: int, live: LiveRequest, synced, now: float) -> None:
        tokens, counts, done, steps, histogram, drafted = (synced.tokens, synced.counts, synced.done, synced.steps,
                                                           synced.histogram, synced.drafted)
        request = live.handle.request
        block = self.statics.block
        ids = live.resumed + tokens[slot, : int(counts[slot])].tolist()  # every token of the request so far
        count = len(ids)
        carry = live.handle._carry
        if synced.lossless_diverged_at is not None and int(synced.lossless_diverged_at[slot]) >= 0:
            # Counted from the request's first token: a resumed row's tokens so far are in its prompt.
            carry.setdefault("lossless_diverged_at", len(live.resumed) + int(synced.lossless_diverged_at[slot]))
        new, text_delta, reason = live.detokenize(ids, self.model.tokenizer, bool(done[slot]))
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

    def _finish(self, slot: int, live: LiveRequest, reason: str, now: float, steps, histogram,
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

    def _request_metrics(self, live: LiveRequest, now: float, steps: int, histogram: np.ndarray, ids=()) -> dict:
        """Per-request metrics (reporting.request_metrics), with a lossy method's label and agreement."""
        lossy = None
        if self.statics.rapid is not None and self.statics.rapid.lossy:
            lossy = {"lossy": self.statics.rapid.lossy_label, "lossless_agreement": self._lossless_agreement(live, ids)}
        return request_metrics(live, now, steps, histogram, ids, method=self.config.method,
                               precision=self.model.config.precision, block=self.statics.block,
                               drafts_from_retrieval=self.drafts_from_retrieval, lossy=lossy)

    def _lossless_agreement(self, live: LiveRequest, ids) -> dict | None:
        """A lossy greedy request against the lossless run: the tokens before the first that differs
        (SlotState.lossless_diverged_at) and whether the whole output is the lossless one; None for a
        sampled request, whose lossless run is a draw of its own."""
        if live.handle.request.temperature > 0:
            return None
        agreement = lossless_agreement([live.handle._carry.get("lossless_diverged_at", -1)], [len(ids)])
        self.metrics.lossy_agreement(agreement["identical"][0])
        return {"identical": agreement["identical"][0], "prefix_tokens": agreement["prefix_tokens"][0]}

    def _report_step(self, seconds: float, attend: int, rows: int, steps, drafted, policy: str) -> None:
        # Called before the rows sync, so each request's *_reported counts are those of the last sync.
        steps_done = sum(int(steps[slot]) - live.steps_reported for slot, live in self._live.items())
        drafted_done = sum(int(drafted[slot]) - live.drafted_reported for slot, live in self._live.items())
        self.reporter.report(seconds, attend, rows, steps_done, drafted_done, policy)

    def _report_memory(self) -> None:
        """Report what live requests hold; past the KV budget's high water mark, free the excess:
        drafter states first (speculation is lost, no work), then the newest requests are preempted
        (parked on the host, or their tokens so far recomputed as part of their prompt)."""
        filled, bytes_in_use = self.kv.in_use(self._live)
        self.metrics.memory(filled, bytes_in_use, self.kv.bytes_per_token)
        state = self.memory_state = self.controller.observe_memory(sum(bytes_in_use.values()), time.perf_counter())
        self.metrics.memory_budget(state.budget, state.seconds_to_budget, state.alarm)
        high_water = int(self.config.controller.kv_high_water * state.budget)
        if not state.budget or state.bytes_in_use < high_water:
            return
        relief = relieve_memory(self.kv.held_rows(self._live), self.kv.bytes_per_token,
                                state.bytes_in_use - high_water, self._relief_window)
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
        self._state = self.programs.program("put_row")(self._state, jax.device_put(row), slot)
        self.kv.lengths[slot] = int(row.lengths)
        if self.drafts_from_retrieval:
            self.kv.drafting_lengths[slot] = int(row.drafting_lengths)
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
            handle._parked = (jax.device_get(self.programs.program("take_row")(self._state, slot)), live)
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
