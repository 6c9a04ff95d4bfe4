"""How a server is shaped (`ServeConfig`); all of it is fixed at start-up."""

from __future__ import annotations

import dataclasses

from specjax.data.retrieval import RetrievalConfig
from specjax.decode.ngram import NgramConfig
from specjax.decode.rapid import RapidConfig
from specjax.decode.refine import RefineConfig
from specjax.decode.tree import TreeConfig
from specjax.errors import SpecjaxError, check_at_least
from specjax.serve.controller import ControllerConfig


ADAPTIVE = "adaptive"
"""The serving mode in which the controller picks a policy at every device call (not a slot method)."""


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """How the serving engine is shaped; all of it is fixed at start-up."""

    method: str = ADAPTIVE
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
    compile_rest: str = "before_ready"
    """When an adaptive server compiles the policies besides the one it starts on: "before_ready"
    (the server answers /ready only once every policy is compiled and timed, so no compile ever
    shares the cores with a request), "while_idle" (ready once the start policy is compiled; the
    rest compile one program at a time, each only while no request is running or waiting, and the
    controller takes each policy up once it is ready) or "auto": "while_idle" where the start policy
    was chosen from the last run's measured costs on this machine, else "before_ready" (a first
    start, whose start policy is only the longest chain). Measured on the 2-core EPYC, float32, 8
    slots, warm: "auto" is ready in 19-21 s against 42-47 s, but one client's closed-loop requests
    then ran at 0.90x fixed AR (the rest load in the gaps between them), against 1.09x with
    "before_ready"; 16 clients 1.05x and 1.03x. So the default stays "before_ready"."""
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
    max_request_bytes: int | None = None
    """Most bytes an HTTP request body may hold, refused (413) before it is read; None: 64 per
    context position, at least 1 MiB (`serve.http.body_limit`)."""

    @property
    def adaptive(self) -> bool:
        """Whether the controller chooses the policy (method ADAPTIVE) rather than one fixed method."""
        return self.method == ADAPTIVE

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
        if self.max_request_bytes is not None:
            check_at_least(1, max_request_bytes=self.max_request_bytes)
        if self.compile_rest not in ("auto", "before_ready", "while_idle"):
            raise SpecjaxError(f"compile_rest must be 'auto', 'before_ready' or 'while_idle', got {self.compile_rest!r}")
        if self.preemption not in ("park", "recompute"):
            raise SpecjaxError(f"preemption must be 'park' or 'recompute', got {self.preemption!r}")
        check_at_least(0, prefill_chunk=self.prefill_chunk)
        if not self.snapshot_every > 0:
            raise SpecjaxError(f"snapshot_every must be positive seconds, got {self.snapshot_every}")

