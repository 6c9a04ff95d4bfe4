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
import threading
import time
from pathlib import Path

import jax.numpy as jnp
from jax.sharding import Mesh

from specjax.data.retrieval import NEEDS_ENCODER, IndexCache, RetrievalConfig, long_context_prompt
from specjax.decode import slots as slot_api
from specjax.decode.budget import LatencyModel
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
from specjax.serve.controller import Controller, Decision
from specjax.serve.admission import Admission
from specjax.serve.host_sync import HostSync
from specjax.serve.kv_ledger import KvLedger
from specjax.serve.kv_relief import KvRelief
from specjax.serve.programs import Programs
from specjax.serve.reporting import StepReporter
from specjax.serve.requests import Chunk, QueueFull, Request, RequestHandle, RequestResult
from specjax.serve.rules import RequestRules
from specjax.serve.shapes import needed_parts, plan_shapes, served_policies
from specjax.serve.slot_table import SlotTable
from specjax.serve.warmup import Warmup
from specjax.sharding import place_params

__all__ = ["Chunk", "QueueFull", "Request", "RequestHandle", "RequestResult", "Scheduler", "ServeConfig"]

log = logging.getLogger("specjax.serve")

DECISION_HISTORY = 4096
"""Controller decisions a scheduler keeps (`Scheduler.decisions`): about ten minutes of device calls
on a CPU; older ones are dropped."""


class Scheduler:
    """Continuous batching over `config.slots` slots for one model (and drafter): the public API and
    the thread that owns the device state, which each turn admits (serve/admission.py), steps and
    syncs (serve/host_sync.py)."""

    def __init__(self, model: LoadedModel, drafter: LoadedDrafter | None = None, config: ServeConfig = ServeConfig(),
                 metrics_log: str | None = None, compile_now: bool = True, refiner: LoadedRefiner | None = None,
                 latency_cache: Path | None = None, mesh: Mesh | None = None):
        """refiner: for the +refiner methods. latency_cache: where measured tree costs are kept
        between processes (default $SPECJAX_CACHE/latency). mesh: serve over these devices
        (specjax/sharding.py): the weights placed by the sharding rules, the slots split over `data`
        and `fsdp` and each slot's KV heads over `model`; every program keeps that layout."""
        self.adaptive = config.adaptive
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
        self.table = SlotTable(self.programs.fresh_state(), KvLedger(self.statics, self.drafts_from_retrieval))
        self.metrics = ServingMetrics(config.method, metrics_log, config.snapshot_every)
        work_shape = StepShape(
            model.config, tree_bytes(model.params), config.slots,
            None if drafter is None else drafter.config, 0 if drafter is None else tree_bytes(drafter.params),
            0 if self.parts.head is None else self.parts.head.shape[1])
        peaks = measure_peaks(cache_dir() / "peaks", dtype=model.config.dtype)
        self.reporter = StepReporter(self.metrics, work_shape, peaks, self.statics.block, config.steps_per_sync,
                                     self.latency)
        self.controller = Controller(self.policies, self.statics.block, config.controller, config.steps_per_sync)
        self._priors_path = (self._controller_priors_path(drafter) if self.adaptive and config.controller.remember
                             else None)
        priors_loaded = self._priors_path is not None and self.controller.load_priors_file(self._priors_path)
        # Start (and compile first) the policy the last run's costs favour here, not always the chain.
        self.started_from_cache = priors_loaded and self.controller.choose_cached_start(shapes.row_buckets,
                                                                                      shapes.attend_buckets[0])
        self.compile_rest = config.compile_rest if config.compile_rest != "auto" else (
            "while_idle" if self.started_from_cache else "before_ready")
        """config.compile_rest, with "auto" decided for this start."""
        # Windowing relief needs a drafter that reads a full-attention context cache: not a windowed
        # drafter's ring (bounded already), nor rapid's drafting context (the target's own cache).
        full_context = drafter is not None and drafter.config.window is None and self.statics.rapid is None
        self.relief = KvRelief(self.table, self.programs, self.controller, self.metrics, config,
                               config.controller.relief_window if full_context else None)
        self.sync = HostSync(self.table, shapes, model, self.controller, self.metrics, self.reporter,
                             self.relief, config)
        self.admission = Admission(self.table, self.programs, self.rules, self.controller, self.metrics, config,
                                   model.tokenizer, self.sync.finish, self._pin_for)
        self.decisions: collections.deque[tuple[float, Decision]] = collections.deque(maxlen=DECISION_HISTORY)
        """(wall time, the controller's Decision) for the most recent device calls, oldest first."""
        self.policy = self.controller.current
        self._last_ran = self.policy
        self._arrivals: collections.deque[float] = collections.deque(maxlen=64)
        self._device_lock = threading.Lock()  # device calls of the scheduler and of background measuring
        self._wakeup = threading.Event()
        self._ids = itertools.count()
        self._stopping = False
        self._accepting = True
        self.indexes = IndexCache()  # document indexes, by content, shared by requests (document_request)
        self._encoder = None  # the sentence encoder: loaded now for the server's retriever, or on first use
        self._encoder_lock = threading.Lock()
        if self.drafts_from_retrieval and config.retrieval.retriever in NEEDS_ENCODER:
            self._encoder = load_sentence_encoder()
        self.warmup = Warmup(self.programs, self.controller, self.reporter, config, self._device_lock,
                             lambda: self._stopping, priors_loaded,
                             idle=lambda: not self.table.live and not self.table.waiting,
                             rest_while_idle=self.compile_rest == "while_idle")
        self.metrics.policy(self.policy, None)
        if compile_now:
            self.warmup.compile()
        else:  # jit compiles on first use; the controller still needs every policy's measured cost
            for policy in self.policies:
                self.warmup.make_ready(policy, compile_steps=False,
                                       costs=self.controller.cached_costs(policy, self.shapes.row_buckets))
        self._thread = threading.Thread(target=self._run, name="specjax-scheduler", daemon=True)
        self._thread.start()

    # ---- start-up ----

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

    def compile(self, background: bool = True) -> None:
        """Compile every program now (Warmup.compile); the constructor does unless compile_now=False."""
        self.warmup.compile(background)

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Block until the background compiler is done (True), or timeout seconds pass (False)."""
        return self.warmup.wait_compiled(timeout)

    @property
    def compile_seconds(self) -> float:
        return self.warmup.compile_seconds

    @property
    def memory_state(self):
        """The controller's last view of KV memory (None before the first sync)."""
        return self.table.memory_state

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
        with self.table.lock:
            if not self._accepting:
                raise SpecjaxError("the server is shutting down")
            if len(self.table.waiting) >= self.config.max_queue:
                raise QueueFull(f"{len(self.table.waiting)} requests are waiting (max_queue {self.config.max_queue})")
            handle = RequestHandle(next(self._ids), request, self)
            now = time.perf_counter()
            self.table.waiting.append((handle, now))
            self._arrivals.append(now)
            self.metrics.queue_depth(len(self.table.live), len(self.table.waiting))
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
        if len(self.table.waiting) >= self.config.max_queue:
            raise QueueFull(f"{len(self.table.waiting)} requests are waiting (max_queue {self.config.max_queue})")
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
        return len(self.table.waiting)

    @property
    def num_running(self) -> int:
        return len(self.table.live)

    def live_view(self) -> dict:
        """What `specjax top` shows, read from this server's own metrics registry: the policy, tau,
        acceptance, throughput and latency percentiles, counted since start-up."""
        from specjax.serve.top import parse_metrics, summarize

        return summarize(parse_metrics(self.metrics.prometheus_text()), None)

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop accepting requests; with drain, finish those in flight (and queued) first, else cancel them."""
        with self.table.lock:
            self._accepting = False
            if not drain:
                for handle, _ in self.table.waiting:
                    handle.cancelled = True
                for live in self.table.live.values():
                    live.handle.cancelled = True
        deadline = None if timeout is None else time.perf_counter() + timeout
        while drain and (self.table.waiting or self.table.live) and self._thread.is_alive():
            if deadline is not None and time.perf_counter() > deadline:
                return self.shutdown(drain=False)
            time.sleep(0.05)
        self._stopping = True
        self._wake()
        self._thread.join(timeout=60)
        self.warmup.wait_compiled(timeout=120)  # the background compiler leaves after its current program
        if self._priors_path is not None:
            self.controller.save_priors_file(self._priors_path)
        self.metrics.close()

    # ---- the scheduler thread ----

    def _wake(self) -> None:
        self._wakeup.set()

    def _run(self) -> None:
        """One turn: admit and prefill, then one device call of the chosen policy over the live rows,
        then one host sync. A failed call fails the requests in it, not the server."""
        admission, sync = self.admission, self.sync
        while not self._stopping:
            try:
                admission.drop_cancelled()
                # The first tokens came from the prefills: stream them now rather than after a step.
                if admission.admit() | admission.continue_prefills():
                    sync.collect(None)
                live = self.table.live
                if not live:
                    self.metrics.tick()  # an idle server's snapshots show the load falling to zero
                    self._wakeup.wait(timeout=0.5)
                    self._wakeup.clear()
                    continue
                if all(row.prefilling for row in live.values()):
                    continue
                self._pack()
                rows = self._step_rows()
                policy = self._choose_policy(rows)
                attend = self._attend_length(policy)
                with self._device_lock:
                    started = time.perf_counter()
                    self.table.state = self.programs.step(policy, attend, rows)(self.parts, self.table.state)
                    sync.collect((started, attend, rows, policy))
            except Exception as error:  # noqa: BLE001
                log.exception("decode step failed")
                sync.fail_all(f"{type(error).__name__}: {error}")
                self.table.state = self.programs.fresh_state()

    def _attend_length(self, policy: str | None = None) -> int:
        """The smallest compiled attention length that holds every live row through the next call
        of `policy` (None: of the policy that writes the most)."""
        longest = max(int(self.table.kv.lengths[slot]) for slot in self.table.live)
        slack = self.shapes.step_slack if policy is None else self.shapes.policy_slack[policy]
        return self.shapes.attend_bucket(longest + self.config.steps_per_sync * slack + 1)

    def _step_rows(self) -> int:
        return self.shapes.row_bucket(max(self.table.live) + 1)

    def _pack(self) -> None:
        """Move the highest live rows into free lower slots, so a step over the first rows covers
        them all (a row's whole state moves, so its request goes on unchanged)."""
        while self.table.live:
            highest = max(self.table.live)
            free = [s for s in range(highest) if s not in self.table.live]
            # Only when it lets the step compute fewer rows: moving costs a copy of the row's caches.
            if not free or self.shapes.row_bucket(len(self.table.live)) == self.shapes.row_bucket(highest + 1):
                return
            target = free[0]
            self.table.state = self.programs.program("move_row")(self.table.state, highest, target)
            self.table.live[target] = self.table.live.pop(highest)
            self.table.kv.move(highest, target)

    def _choose_policy(self, rows: int) -> str:
        """The controller's choice for the next call (a fixed method's server always has one)."""
        attend = {policy: self._attend_length(policy) for policy in self.policies}
        decoding = [live for live in self.table.live.values() if not live.prefilling]
        pinned = sorted((slot for slot in self.table.pins if slot in self.table.live), key=lambda s: self.table.live[s].admitted)
        self.controller.pin(self.table.pins[pinned[0]] if pinned else None)  # the oldest pinning request wins
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
