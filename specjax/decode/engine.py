"""The host-side entry point: validate a request, pad it to a static shape, compile once, run, time.

Compilation is done ahead of time (`lower().compile()`) so its cost is reported apart from the
decode time, and compiled executables are cached per shape bucket so repeated calls do not
recompile.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from specjax.decode.sampling import SamplingConfig
from specjax.decode.refine import RefineConfig
from specjax.decode.budget import LatencyModel
from specjax.decode import slots as slot_api
from specjax.decode.slots import SLOT_METHODS
from specjax.decode.speculative import RefinerInputs
from specjax.decode.tree import TreeConfig, measure_tree_latency, tree_latency_key
from specjax.errors import SpecjaxError
from specjax.sharding import build_state, place_params, same_on_every_process, shard_state, to_host
from specjax.io.dflash import LoadedDrafter, check_pair
from specjax.io.refiner import LoadedRefiner, check_refiner
from specjax.io.registry import LoadedModel
from specjax.models.refiner import refiner_low_rank_head
from specjax.models.transformer import head_matrix
from specjax.decode.memory import decode_memory, drafter_state_breakdown, target_kv_bytes
from specjax.data.retrieval import Redraft
from specjax.decode.rapid import RapidConfig
from specjax.decode.auto import AUTO_POLICIES, AutoConfig, AutoMemory, policy_seconds
from specjax.decode.ngram import NgramConfig

# Every name and what each method needs come from the one registry of methods (decode/slots.py).
METHODS = tuple(SLOT_METHODS)

log = logging.getLogger("specjax.decode")


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclasses.dataclass
class GenerationResult:
    tokens: list[list[int]]
    """Generated token ids per prompt (EOS included when it was produced)."""
    stats: dict[str, Any]
    """tokens_per_s, compile_s, wall_s, new_tokens, plus method-specific keys."""


@dataclasses.dataclass(frozen=True)
class DecodeRequestShape:
    """The static part of a request; one compiled executable per distinct value."""

    method: str
    batch: int
    prompt_bucket: int
    cache_length: int
    max_new_tokens: int
    sampling: SamplingConfig
    eos_token_ids: tuple[int, ...]
    refine: RefineConfig | None
    """Refinement passes for the +refiner methods; None for the other methods."""
    tree: TreeConfig | None
    """Tree shape and budget for the tree methods; None for the other methods."""
    step_tokens: int = 1
    """Most tokens one forward after the prefill writes: 1, the block, or the largest tree. Sliding
    layers keep a KV ring of window + step_tokens - 1 slots."""
    rapid: RapidConfig | None = None
    """How rapid drafts; None for the other methods."""
    drafting_bucket: int = 0
    """Padded length of the drafting contexts (rapid), 0 for the other methods."""
    drafting_length: int = 0
    """Slots of each row's drafting context (rapid, rapid+block): the longest drafting prompt (first
    or re-retrieved), the new tokens and one step's writes."""
    steps_per_sync: int = 0
    """Steps per device call of a loop that syncs with the host (streaming, re-retrieval); 0 when
    one call runs to the end (`Engine._steps_per_sync`)."""
    ngram: NgramConfig | None = None
    """How ngram drafts; None for the other methods."""
    auto: AutoConfig | None = None
    """How auto chooses among AR, chain and tree; None for the other methods."""

    @property
    def streaming(self) -> bool:
        """The loop syncs with the host between calls (streaming or re-retrieval)."""
        return self.steps_per_sync > 0


def lossless_agreement(diverged_at, counts) -> dict:
    """How far lossy greedy rows agree with the lossless run (SlotState.lossless_diverged_at
    [B], generated counts [B]): per row the tokens before the first that differs, and whether the
    whole output is the lossless one."""
    prefix = [int(c) if d < 0 or d >= c else int(d) for d, c in zip(diverged_at, counts)]
    identical = [p == int(c) for p, c in zip(prefix, counts)]
    return {"identical": identical, "prefix_tokens": prefix, "identical_fraction": sum(identical) / len(identical)}


class Engine:
    """Decodes with one model; keeps compiled executables between calls."""

    def __init__(self, model: LoadedModel, drafter: LoadedDrafter | None = None, prompt_bucket: int = 32,
                 refiner: LoadedRefiner | None = None, latency_cache: Path | None | bool = True,
                 mesh: Mesh | None = None):
        """latency_cache: where measured tree-verification latencies are kept between processes
        (True: $SPECJAX_CACHE/latency; False: measure in every new Engine and keep in memory).
        mesh: decode over these devices (specjax/sharding.py): the weights are placed by the
        sharding rules (tensor-parallel over `model`, sliced over `fsdp`), the batch is split over
        `data` and `fsdp`, and GSPMD partitions the same programs; output is the one-device output."""
        self.mesh = mesh
        self.model = place_params(model, mesh)
        self.drafter = place_params(drafter, mesh)
        self.refiner = place_params(refiner, mesh)
        if drafter is not None:
            check_pair(drafter, model.config)
        if refiner is not None:
            if drafter is None:
                raise SpecjaxError("a refiner needs the drafter it refines")
            check_refiner(refiner, drafter)
        self.prompt_bucket = prompt_bucket
        self._compiled: dict[DecodeRequestShape, Any] = {}
        self._slot_phase_costs: dict[DecodeRequestShape, dict[str, float]] = {}
        # What auto measured when its last greedy call of a batch size ended (decode/auto.py): the next
        # such call starts from it, instead of exploring and probing from scratch every call.
        self._auto_memory = AutoMemory()
        if latency_cache is True:
            from specjax.io.registry import cache_dir
            latency_cache = cache_dir() / "latency"
        self.latency_cache = Path(latency_cache) if latency_cache else None
        self.latency_models: dict[str, LatencyModel] = {}
        self._verify_seconds: dict[tuple[int, int, int], float] = {}

    def decode_config(self, shape: DecodeRequestShape):
        """The target config a request decodes with: sliding layers keep KV rings sized for its steps."""
        return self.model.config.with_kv_rings(shape.step_tokens)

    def _trees_within_query_rows(self, tree: TreeConfig) -> TreeConfig:
        return tree.within_query_rows(self.drafter.config.block_size - 1, self.model.config.query_rows)

    def validate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
        cfg = self.model.config
        if not prompts:
            raise SpecjaxError("no prompts given")
        if max_new_tokens < 1:
            raise SpecjaxError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise SpecjaxError(f"prompt {i} is empty; give at least one token")
            bad = [t for t in prompt if not 0 <= int(t) < cfg.vocab_size]
            if bad:
                raise SpecjaxError(
                    f"prompt {i} has token id {bad[0]} outside the vocabulary [0, {cfg.vocab_size})"
                )
            if len(prompt) + max_new_tokens > cfg.max_position_embeddings:
                raise SpecjaxError(
                    f"prompt {i} has {len(prompt)} tokens; with max_new_tokens={max_new_tokens} that is "
                    f"{len(prompt) + max_new_tokens}, beyond the model's context of {cfg.max_position_embeddings}"
                )

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 64,
                 sampling: SamplingConfig = SamplingConfig(), seed: int = 0, ignore_eos: bool = False,
                 method: str = "ar", on_tokens: Callable[[list[list[int]]], None] | None = None,
                 stream_every: int = 8,
                 refine: RefineConfig = RefineConfig(), tree: TreeConfig = TreeConfig(),
                 drafting_prompts: Sequence[Sequence[int]] | None = None,
                 rapid: RapidConfig = RapidConfig(), redraft: Redraft | None = None,
                 ngram: NgramConfig = NgramConfig(), auto: AutoConfig = AutoConfig()) -> GenerationResult:
        """Decode a batch of token-id prompts.

        on_tokens, if given, is called with every row's tokens so far after each `stream_every`
        tokens: the loop then runs in chunks (one host sync per chunk, never per token) so a caller
        can show text as it appears. Without it the whole request is one device call. Every method
        decodes on the serving step (decode/slots.py), streamed or not (streamed: `stream_every`
        AR steps or `stream_every // 2` verify steps per chunk), with per-row keys derived from
        `seed`, so a streamed sampled output is the non-streamed call's draw.
        refine: refinement passes per block for the +refiner methods.
        tree: shape and budget of draft trees for the tree methods.
        drafting_prompts: for rapid, each prompt's drafting context (its retrieved chunks and the
        question, `data/retrieval.py`); the target verifies with the prompt itself.
        rapid: how rapid drafts.
        ngram: how ngram (prompt lookup) drafts.
        auto: how auto chooses among AR, chain and tree at each step (its trees follow `tree`).
        redraft: re-retrieval for rapid and rapid+block: every `redraft.every` generated tokens each
        row's drafting context is rebuilt from `redraft.prompt_for` (the loop then syncs with the host
        about that often, as streaming does).
        """
        if stream_every < 1:
            raise SpecjaxError(f"stream_every must be >= 1, got {stream_every}")
        spec = slot_api.slot_method(method)  # a registry name, or a block method with a draft limit
        self.validate(prompts, max_new_tokens)
        method, tree, rapid = self._fit_method(spec, method, tree, rapid, drafting_prompts, len(prompts), redraft)
        if spec.needs_retrieval:
            self.validate(drafting_prompts, max_new_tokens)
        options = (prompts, max_new_tokens, sampling, ignore_eos, on_tokens is not None, stream_every, refine, tree,
                   drafting_prompts, rapid, redraft, ngram, auto)
        shape = self._request_shape(spec, method, *options)
        stays_on_ar = self._auto_remembers(shape) and self._auto_memory.stays_on_ar(
            shape.batch, max_new_tokens - 1, shape.auto)  # the prefill gives each row its first token
        if stays_on_ar:
            auto_shape, shape = shape, self._request_shape(slot_api.slot_method("ar"), "ar", *options)
        tokens = slot_api.token_rows(prompts, shape.prompt_bucket)
        lengths = np.array([len(p) for p in prompts], np.int32)
        args = (self.model.params, self._placed(tokens), self._placed(lengths), jax.random.key(seed))
        if stays_on_ar:
            return self._with_precision(self._auto_on_plain_ar(auto_shape, self._generate_slots(shape, args,
                                                                                                on_tokens)))
        retrieval = None
        if spec.needs_retrieval:
            padded = slot_api.token_rows(drafting_prompts, shape.drafting_bucket)
            retrieval = (self._placed(padded), self._placed(np.asarray([len(p) for p in drafting_prompts], np.int32)))
        return self._with_precision(self._generate_slots(shape, args, on_tokens, retrieval, redraft))

    def _fit_method(self, spec: slot_api.SlotMethod, method: str, tree: TreeConfig, rapid: RapidConfig,
                    drafting_prompts, num_prompts: int, redraft: Redraft | None):
        """(method, tree, rapid) as this engine's parts and the target's query rows allow them, or
        a clear error where the method cannot run here."""
        if spec.needs_drafter and self.drafter is None:
            raise SpecjaxError(f"method {method!r} needs a drafter")
        if spec.needs_refiner and self.refiner is None:
            raise SpecjaxError(f"method {method!r} needs a refiner")
        if spec.needs_tree:
            tree = self._trees_within_query_rows(tree)
        query_rows = self.model.config.query_rows
        if spec.needs_drafter:  # also refuses a draft limit longer than the block
            method = slot_api.method_within_query_rows(method, self.drafter.config.block_size, query_rows)
        if spec.needs_auto and query_rows is not None and self.drafter.config.block_size > query_rows:
            raise SpecjaxError(f"auto's chain verifies the drafter's whole block of {self.drafter.config.block_size} "
                               f"rows, more than the target's query_rows ({query_rows}); raise --query-rows")
        if spec.target_drafts:
            rapid = rapid.within_query_rows(query_rows)  # stats report the drafts it ran (rapid_drafts)
        if spec.needs_retrieval and (drafting_prompts is None or len(drafting_prompts) != num_prompts):
            raise SpecjaxError(f"method {method!r} drafts from a retrieved context: give one drafting prompt "
                               f"per prompt (drafting_prompts)")
        if redraft is not None and not spec.needs_retrieval:
            raise SpecjaxError(f"re-retrieval (redraft) applies to rapid and rapid+block, not {method!r}")
        return method, tree, rapid

    def _request_shape(self, spec: slot_api.SlotMethod, method: str, prompts, max_new_tokens: int,
                       sampling: SamplingConfig, ignore_eos: bool, streaming: bool, stream_every: int,
                       refine: RefineConfig, tree: TreeConfig, drafting_prompts, rapid: RapidConfig,
                       redraft: Redraft | None, ngram: NgramConfig, auto: AutoConfig) -> DecodeRequestShape:
        """The compiled shape of a call: buckets, cache length and the configs its method reads."""
        longest = max(len(p) for p in prompts)
        bucket = _round_up(longest, self.prompt_bucket)
        # Speculative rows may write one block (or one tree) past their last committed token; that
        # is also the most tokens one verify step writes, which sizes the sliding layers' KV rings.
        block = 1 if self.drafter is None else self.drafter.config.block_size
        slack = spec.writes(block, tree.node_buckets(block - 1)[-1] if spec.needs_tree else 0,
                            rapid.drafts, ngram.drafts)
        # query_rows pads every decode-time forward to that many rows, all written to the cache.
        slack = max(slack, self.model.config.query_rows or 0)
        drafting_bucket = 0
        if spec.needs_retrieval:
            drafting_bucket = _round_up(max(len(p) for p in drafting_prompts), self.prompt_bucket)
        return DecodeRequestShape(
            method=method,
            batch=len(prompts),
            prompt_bucket=bucket,
            # Rows stop advancing once done, so prompt + max_new slots always suffice.
            cache_length=_round_up(bucket + max_new_tokens + slack, 64),
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            eos_token_ids=() if ignore_eos else tuple(self.model.eos_token_ids),
            steps_per_sync=self._steps_per_sync(spec, rapid, streaming, stream_every, redraft),
            refine=refine if spec.needs_refiner else None,
            tree=tree if spec.needs_tree else None,
            step_tokens=max(slack, 1),
            rapid=rapid if spec.target_drafts else None,
            ngram=ngram if spec.needs_ngram else None,
            auto=auto if spec.needs_auto else None,
            drafting_bucket=drafting_bucket,
            # The first draft pass writes from one slot before last_token (decode/rapid.py).
            drafting_length=(_round_up(max(drafting_bucket, redraft.max_prompt_tokens if redraft else 0)
                                        + max_new_tokens + slack + 1, 64) if drafting_bucket else 0),
        )


    def _steps_per_sync(self, spec, rapid: RapidConfig, streamed: bool, stream_every: int,
                        redraft: Redraft | None) -> int:
        """Steps per device call of a host-synced loop: about `stream_every` tokens when streaming (a
        speculative step is counted as two tokens), or, for re-retrieval alone, at most
        `redraft.every` tokens (one block per step). 0 when nothing syncs: one call runs to the end."""
        speculative = spec.needs_drafter or spec.needs_retrieval or spec.needs_ngram
        if streamed:
            return max(1, stream_every // 2) if speculative else stream_every
        if redraft is not None:
            block = self.drafter.config.block_size if spec.needs_drafter else rapid.drafts + 1
            return max(1, redraft.every // block)
        return 0

    def _placed(self, batch_major: np.ndarray) -> jax.Array:
        """A batch-major input on the device, split over the mesh's data axes when there is one."""
        return jnp.asarray(batch_major) if self.mesh is None else shard_state(jnp.asarray(batch_major), self.mesh)

    @property
    def precision(self) -> dict:
        """The target's precision: speculative output is exact against AR at this same precision."""
        return self.model.config.precision

    def _with_precision(self, result: GenerationResult) -> GenerationResult:
        result.stats["precision"] = self.precision
        return result

    def _auto_remembers(self, shape: DecodeRequestShape) -> bool:
        """Whether an auto call starts from (and leaves) what the last one measured. Greedy only: the
        policy sequence decides which keys a sampled row draws with, so a sampled call starts fresh
        and a seed gives the same draw whatever ran before it."""
        return shape.auto is not None and shape.sampling.greedy and self.mesh is None

    def _auto_on_plain_ar(self, shape: DecodeRequestShape, result: GenerationResult) -> GenerationResult:
        """An auto call that ran the plain AR program (AutoMemory.stays_on_ar), reported as auto: its
        steps all AR, tau 1, and its steps counted towards auto's next probe."""
        counts = np.array([len(row) for row in result.tokens])
        histogram = np.zeros((shape.batch, self.drafter.config.block_size), np.int64)  # [B, block]
        histogram[:, 0] = counts - 1  # every decode step committed one token, and drafted nothing
        stats = _speculative_stats(shape.method, counts, histogram, result.stats["wall_s"], result.stats["compile_s"])
        for key in ("prefill_s", "decode_tokens_per_s", "memory"):
            stats[key] = result.stats[key]
        stats.update(draft_tokens=0, streamed=shape.streaming)
        steps = int(histogram[:, 0].max())
        before = np.asarray(self._auto_memory.start(shape.batch).steps)
        stats["auto"] = _auto_stats(self._auto_memory.ran_ar(shape.batch, steps),
                                    self._auto_memory.seconds(shape.batch), before, plain_ar=True)
        return GenerationResult(result.tokens, stats)

    def _generate_slots(self, shape: DecodeRequestShape, args, on_tokens, retrieval=None,
                        redraft: Redraft | None = None) -> GenerationResult:
        """Decoding on the serving step (decode/slots.py), every method: the prompts fill a slot
        batch of their own. A shape that streams or re-retrieves runs `shape.steps_per_sync` steps
        per device call and syncs with the host between calls (its tokens go to on_tokens); any
        other runs every step in one call (`run_to_end`)."""
        target_params, prompt_tokens, prompt_lengths, rng = args
        statics, parts, latency = self._slot_setup(shape, target_params, prompt_lengths)
        request = self._insert_request(shape, prompt_tokens, prompt_lengths, rng, retrieval)
        state = build_state(self.mesh, slot_api.empty_slots, statics)
        if self.mesh is not None:
            request = shard_state(request, self.mesh)
        compile_s = self._compile_slots(shape, statics, parts, state, request)
        insert, run, refresh = self._compiled[shape]
        start = time.perf_counter()
        state = jax.block_until_ready(insert(parts, state, request))
        prefill_s = time.perf_counter() - start
        remembers = self._auto_remembers(shape)
        steps_before = 0  # the policy steps a remembered state had already counted
        remembered = self._auto_memory.start(shape.batch) if remembers else None
        if remembered is not None:
            state = state.replace(auto=jax.tree.map(jnp.asarray, remembered))
            steps_before = np.asarray(remembered.steps)
        if shape.streaming:
            state, redrafted = self._stream_slots(shape, run, refresh, parts, state, on_tokens, retrieval, redraft)
        else:
            state, redrafted = jax.block_until_ready(run(parts, state)), None
        wall_s = time.perf_counter() - start
        # What the stats read, in one transfer (the auto state in a second, as it may be None).
        host = _Finished(*to_host(tuple(getattr(state, name) for name in _Finished._fields)))
        auto = None if state.auto is None else to_host(state.auto)
        if remembers:
            self._auto_memory.remember(shape.batch, auto, _auto_seconds(auto, latency, self.drafter.config.block_size))
        counts = host.num_generated
        rows = [host.tokens[i, : counts[i]].tolist() for i in range(shape.batch)]
        # The prefill gives each row its first token; the decode loop the rest. At long context the
        # prefill dominates a short answer's wall time, so the decode rate is reported on its own.
        timing = {"compile_s": compile_s, "wall_s": wall_s, "prefill_s": prefill_s,
                  "decode_tokens_per_s": (int(counts.sum()) - shape.batch) / max(wall_s - prefill_s, 1e-9)}
        run_for_memory = None if shape.streaming else run
        if not slot_api.slot_method(shape.method).speculates:
            new_tokens = int(counts.sum())
            return GenerationResult(rows, {
                "method": shape.method, "tokens_per_s": new_tokens / wall_s, "new_tokens": new_tokens, **timing,
                "memory": decode_memory(statics.target_config, None, shape.batch, shape.cache_length, run_for_memory)})
        stats = self._speculative_slot_stats(shape, statics, parts, state, host, auto, timing, latency,
                                             run_for_memory, steps_before)
        stats["streamed"] = on_tokens is not None
        if retrieval is not None and shape.drafting_length > 0:
            stats["drafting_context_tokens"] = [int(n) for n in np.asarray(retrieval[1])]
        if redrafted is not None:
            stats.update(redrafted)
            if redrafted["redrafts"]:  # the drafting contexts were refilled: report them as they ended
                stats["drafting_context_tokens"] = [int(n) for n in to_host(state.drafting_lengths)]
        return GenerationResult(rows, stats)

    def _slot_setup(self, shape: DecodeRequestShape, target_params, prompt_lengths):
        """(statics, parts, tree latency model or None) of a slot batch decoding `shape`."""
        uses_drafter = slot_api.slot_method(shape.method).needs_drafter
        statics = slot_api.SlotStatics(
            target_config=self.decode_config(shape),
            slot=slot_api.SlotConfig(slots=shape.batch, cache_length=shape.cache_length,
                                     max_new_tokens=shape.max_new_tokens,
                                     steps_per_sync=max(shape.steps_per_sync, 1),
                                     insert_rows=shape.batch),
            eos_token_ids=shape.eos_token_ids, drafter_config=self.drafter.config if uses_drafter else None,
            refiner_config=None if shape.refine is None else self.refiner.config,
            refine=shape.refine or RefineConfig(), tree=shape.tree, rapid=shape.rapid,
            drafting_length=shape.drafting_length,
            drafter_on_retrieval=uses_drafter and shape.drafting_length > 0,  # rapid+block
            ngram=shape.ngram, auto=shape.auto)
        if not uses_drafter:
            return statics, slot_api.slot_parts(statics, target_params), None
        latency = None
        draft_vocab = None if self.drafter.draft_vocab is None else jnp.asarray(self.drafter.draft_vocab)
        if shape.tree is not None and shape.tree.auto:
            latency = self._latency_model(shape, target_params, draft_vocab, prompt_lengths)
        parts = slot_api.slot_parts(statics, target_params, self.drafter.params, draft_vocab,
                                    None if shape.refine is None else self.refiner.params,
                                    # Every process times its own passes: all size trees by process 0's.
                                    None if latency is None else same_on_every_process(latency.costs()))
        return statics, parts, latency

    def _insert_request(self, shape: DecodeRequestShape, prompt_tokens, prompt_lengths, rng, retrieval):
        """The insert of every prompt of the call, one to a slot, with the shape's sampling."""
        batch = shape.batch
        full = lambda value, dtype: jnp.full((batch,), value, dtype)  # noqa: E731
        seeds = jax.random.randint(rng, (batch,), 0, np.iinfo(np.int32).max).astype(jnp.uint32)
        return slot_api.InsertRequest(
            rows=jnp.arange(batch, dtype=jnp.int32), prompts=prompt_tokens, prompt_lengths=prompt_lengths,
            max_new_tokens=full(shape.max_new_tokens, jnp.int32), seeds=seeds,
            sampling=slot_api.RowSampling(full(shape.sampling.temperature, jnp.float32),
                                          full(shape.sampling.top_k, jnp.int32), full(shape.sampling.top_p, jnp.float32)),
            drafting_prompts=None if retrieval is None else retrieval[0],
            drafting_prompt_lengths=None if retrieval is None else retrieval[1])

    def _compile_slots(self, shape: DecodeRequestShape, statics, parts, state, request) -> float:
        """Compile the shape's insert, loop and refresh once (kept in self._compiled); the seconds it took."""
        if shape in self._compiled:
            return 0.0
        start = time.perf_counter()
        # Over a mesh every call leaves the state where it found it, so the compiled loop takes
        # the insert's output and its own (GSPMD would otherwise pick each output's layout).
        pinned = {} if self.mesh is None else {"out_shardings": jax.tree.map(lambda a: a.sharding, state)}
        loop = slot_api.step if shape.streaming else slot_api.run_to_end
        insert_fn = jax.jit(partial(slot_api.insert, statics=statics), donate_argnums=1, **pinned)
        run_fn = jax.jit(partial(loop, method=shape.method, statics=statics), donate_argnums=1, **pinned)
        # Re-retrieval's refresh: one trace per drafting-prompt width, on first use.
        refresh_fn = jax.jit(partial(slot_api.refresh_drafting, statics=statics), donate_argnums=1, **pinned)
        self._compiled[shape] = (insert_fn.lower(parts, state, request).compile(),
                                 run_fn.lower(parts, state).compile(), refresh_fn)
        return time.perf_counter() - start

    def _stream_slots(self, shape: DecodeRequestShape, run, refresh, parts, state, on_tokens, retrieval,
                      redraft: Redraft | None):
        """Run `shape.steps_per_sync` steps a call until every row is done, handing the tokens so far
        to on_tokens after each call and re-retrieving rows that are due. Returns (state, the
        re-retrieval figures or None)."""
        batch = shape.batch
        next_redraft = np.full(batch, redraft.every if redraft else 0)
        # Each row's drafting prompt as its drafting context holds it, so a refresh refills
        # only what follows the part the new prompt shares with it (rapid: see refresh_drafting).
        drafting_prompts = ([] if redraft is None else
                            [row[:n].tolist() for row, n in zip(*to_host((retrieval[0], retrieval[1])))])
        redrafts, redraft_s, redraft_tokens = 0, 0.0, 0
        while True:
            tokens, counts, done = to_host((state.tokens, state.num_generated, state.done))
            if on_tokens is not None:
                on_tokens([tokens[i, : counts[i]].tolist() for i in range(batch)])
            if done.all():
                break
            due = [] if redraft is None else [i for i in range(batch) if not done[i] and counts[i] >= next_redraft[i]]
            if due:
                started = time.perf_counter()
                state, refreshed, prefilled = self._redraft(shape, refresh, parts, state, redraft, due, tokens,
                                                            counts, drafting_prompts)
                redraft_s += time.perf_counter() - started
                redrafts += refreshed
                redraft_tokens += prefilled
                next_redraft[due] = (counts[due] // redraft.every + 1) * redraft.every
            state = run(parts, state)
        if redraft is None:
            return state, None
        return state, {"redraft_every": redraft.every, "redrafts": redrafts, "redraft_s": redraft_s,
                       "redraft_prefill_tokens": redraft_tokens}

    def _speculative_slot_stats(self, shape: DecodeRequestShape, statics, parts, state, host: "_Finished", auto,
                                timing: dict, latency: LatencyModel | None, run_for_memory, steps_before) -> dict:
        """A speculative call's figures: acceptance, where the time went, and memory, by method kind."""
        batch = shape.batch
        counts, histogram, drafted, steps, passes = (host.num_generated, host.accepted_histogram, host.drafted,
                                                     host.steps, host.refine_passes)
        stats = _speculative_stats(shape.method, counts, histogram, timing["wall_s"], timing["compile_s"])
        stats.update({key: timing[key] for key in ("prefill_s", "decode_tokens_per_s")})
        stats["draft_tokens"] = int(drafted.sum())
        loop_steps = stats["verify_steps"]
        if shape.ngram is not None:  # drafting is a few comparisons: the step is its verify pass
            stats["memory"] = decode_memory(statics.target_config, None, batch, shape.cache_length, run_for_memory)
            stats["ngram"] = dataclasses.asdict(shape.ngram)
            return stats
        # The steps are fused; the split is loop_steps x the draft and verify passes timed alone.
        phases = None if shape.tree is not None else self._phase_seconds(shape, statics, parts)
        if shape.rapid is not None:
            memory = decode_memory(statics.target_config, None, batch, shape.cache_length, run_for_memory)
            memory["drafting_kv_bytes"] = target_kv_bytes(statics.target_config, batch, shape.drafting_length)
            stats.update({"rapid_drafts": shape.rapid.drafts, "rapid_eta": shape.rapid.eta, "memory": memory,
                          "draft_s": loop_steps * phases["draft"], "verify_s": loop_steps * phases["verify"]})
            if shape.rapid.lossy:
                stats["lossy"] = shape.rapid.lossy_label
                stats["lossless_agreement"] = (lossless_agreement(to_host(state.lossless_diverged_at), counts)
                                               if shape.sampling.greedy else None)
            return stats
        # Every row drafts, refines and verifies together in each step until the last row is done,
        # so the longest-running row's counters are the batch's per-step counts.
        longest = int(np.argmax(steps))
        if phases is not None:
            stats.update({"draft_s": loop_steps * phases["draft"], "verify_s": loop_steps * phases["verify"]})
            if shape.refine is not None:
                stats["refine_s"] = int(passes[longest]) * phases["refine"]
        else:
            stats.update(self._tree_stats(shape, statics, host, auto, longest, loop_steps, latency, timing,
                                          steps_before))
        if shape.refine is not None:
            stats["refine_passes"] = int(passes[longest]) / loop_steps if loop_steps else 0.0
        stats["memory"] = decode_memory(self.decode_config(shape), self.drafter.config, batch, shape.cache_length,
                                        run_for_memory)
        if shape.drafting_length > 0:  # rapid+block: the drafter's context is sized by the drafting prompt
            stats["memory"].update(drafter_state_breakdown(self.drafter.config, batch, shape.drafting_length))
        return stats

    def _tree_stats(self, shape: DecodeRequestShape, statics, host: "_Finished", auto, longest: int,
                    loop_steps: int, latency: LatencyModel | None, timing: dict, steps_before) -> dict:
        """Tree sizes chosen and verified, auto's choices, and the latency model's split and refit."""
        sizes, chosen = host.tree_sizes, host.tree_chosen
        counts_by_size = {size: int(c) for size, c in zip(statics.tree_buckets, sizes[longest])}
        stats = {
            "tree_nodes_chosen": int(chosen[longest]) / loop_steps if loop_steps else 0.0,
            "tree_bucket_counts": counts_by_size,
            "tree_nodes_verified": (sum(size * c for size, c in counts_by_size.items()) / loop_steps
                                    if loop_steps else 0.0),
        }
        if auto is not None:
            stats["auto"] = _auto_stats(auto, _auto_seconds(auto, latency, self.drafter.config.block_size),
                                        steps_before)
        elif latency is not None:
            # Split of wall time by the latency model, which each run refits (Bastion's rule).
            stats.update({
                "draft_s": loop_steps * latency.fixed_s,
                "verify_s": sum(c * latency.verify_s[latency.sizes.index(size)] for size, c in counts_by_size.items()),
                "latency_model": {"sizes": list(latency.sizes), "verify_s": list(latency.verify_s),
                                  "fixed_s": latency.fixed_s},
            })
            # A program's first call pays one-off costs (allocation, first touches of its
            # buffers): observed, a 5-step warm-up at 16 nodes once set C(16) to 73 ms for a
            # 48 ms step. Only the calls after it refit the model.
            if loop_steps and not shape.streaming and not timing["compile_s"]:
                latency.observe(loop_steps, counts_by_size, timing["wall_s"])
                self._save_latency(shape, latency)
        return stats

    def _redraft(self, shape: DecodeRequestShape, refresh, parts, state, redraft: Redraft, rows: list[int],
                 tokens, counts, drafting_prompts: list[list[int]]):
        """Rebuild the drafting contexts of `rows`: each row's new drafting prompt, then its generated
        tokens before last_token (already in its caches). drafting_prompts[row] is the prompt its
        context holds now; it is updated. A prompt longer than redraft.max_prompt_tokens would not
        fit the drafting context: that row keeps its context (a warning says so), since the output
        does not depend on it. rapid refills a row only from where its new sequence first differs
        from the old one (rapid+block keeps no target K/V to extend, so it refills whole rows).
        Returns (state, rows refreshed, tokens prefilled)."""
        extend = shape.rapid is not None
        sequences, starts, refreshed = [], [], []
        for row in rows:
            generated = tokens[row, : counts[row]].tolist()
            prompt = list(redraft.prompt_for(row, generated))
            if not 1 <= len(prompt) <= redraft.max_prompt_tokens:
                log.warning("re-retrieval gave row %d a drafting prompt of %d tokens, outside 1..%d "
                            "(Redraft.max_prompt_tokens): it keeps its drafting context", row, len(prompt),
                            redraft.max_prompt_tokens)
                continue
            sequence, held = prompt + generated[:-1], drafting_prompts[row] + generated[:-1]
            drafting_prompts[row] = prompt
            refreshed.append(row)
            if sequence == held:  # the same context: nothing to refill
                continue
            # The last held token's K/V may never have been written (decode/rapid.py), so the kept
            # part ends before it, and before the new sequence's last token, which a refill recomputes.
            shared = next((i for i, (new, old) in enumerate(zip(sequence, held)) if new != old),
                          min(len(sequence), len(held)))
            sequences.append((row, sequence))
            starts.append(min(shared, len(held) - 1, len(sequence) - 1) if extend else 0)
        if not sequences:
            return state, len(refreshed), 0
        # One compiled refresh per width: the rows are padded to the batch (out-of-range rows drop).
        # A row whose suffix would run past the drafting context starts earlier (refills more).
        longest = max(len(seq) - start for (_, seq), start in zip(sequences, starts))
        width = min(_round_up(longest, self.prompt_bucket), shape.drafting_length)
        starts = [min(start, shape.drafting_length - width) for start in starts]
        padded = slot_api.token_rows([seq[start:] for (_, seq), start in zip(sequences, starts)], width, shape.batch)
        lengths = np.ones(shape.batch, np.int32)
        lengths[: len(sequences)] = [len(seq) for _, seq in sequences]
        row_ids = np.full(shape.batch, shape.batch, np.int32)
        row_ids[: len(sequences)] = [row for row, _ in sequences]
        row_starts = np.zeros(shape.batch, np.int32)
        row_starts[: len(sequences)] = starts
        arguments = (row_ids, padded, lengths) + ((row_starts,) if extend else ())
        state = refresh(parts, state, *map(self._placed, arguments))
        prefilled = sum(len(seq) - start for (_, seq), start in zip(sequences, starts))
        return jax.block_until_ready(state), len(refreshed), prefilled

    def _phase_seconds(self, shape: DecodeRequestShape, statics, parts) -> dict:
        """Seconds of one draft, refinement and verify pass at this request's shapes (measured once)."""
        if shape not in self._slot_phase_costs:
            self._slot_phase_costs[shape] = slot_api.measure_phase_seconds(parts, statics, shape.refine is not None)
        return self._slot_phase_costs[shape]

    def _latency_key(self, shape: DecodeRequestShape) -> str:
        return tree_latency_key(self.model.name, self.decode_config(shape), shape.batch, shape.cache_length,
                                shape.tree, self.drafter.config.block_size, shape.refine is not None)

    def _save_latency(self, shape: DecodeRequestShape, latency: LatencyModel) -> None:
        if self.latency_cache is not None and jax.process_count() == 1:  # see _latency_model
            latency.save(self._latency_key(shape), self.latency_cache)

    def _latency_model(self, shape: DecodeRequestShape, target_params, draft_vocab, prompt_lengths) -> LatencyModel:
        """The verify-cost curve and per-step fixed cost for this request's shapes: from memory, from
        the on-disk cache, or measured now (once per machine, model, batch and cache length)."""
        key = self._latency_key(shape)
        if key in self.latency_models:
            return self.latency_models[key]
        # Several processes all measure, in step (a fixed number of calls, each a collective), rather
        # than some finding a cached curve that others lack; their costs are then process 0's.
        cached = self.latency_cache is not None and jax.process_count() == 1
        latency = LatencyModel.load(key, self.latency_cache) if cached else None
        if latency is None:
            refiner = None
            if shape.refine is not None:
                head = jax.jit(head_matrix, static_argnums=1)(target_params, self.decode_config(shape), draft_vocab)
                refiner = RefinerInputs(self.refiner.params, jax.jit(refiner_low_rank_head, static_argnums=1)(
                    self.refiner.params, self.refiner.config, head), self.refiner.config, shape.refine)
            latency = measure_tree_latency(target_params, self.decode_config(shape), self.drafter.params,
                                           self.drafter.config, draft_vocab, refiner, shape.tree, shape.sampling,
                                           prompt_lengths, shape.cache_length, verify_seconds=self._verify_seconds)
            self._save_latency(shape, latency)
        self.latency_models[key] = latency
        return latency

class _Finished(NamedTuple):
    """The slot state's counters a finished call's stats read, on the host."""

    tokens: np.ndarray
    num_generated: np.ndarray
    accepted_histogram: np.ndarray
    drafted: np.ndarray
    steps: np.ndarray
    refine_passes: np.ndarray
    tree_sizes: np.ndarray
    tree_chosen: np.ndarray


def _auto_seconds(auto, latency: LatencyModel, block: int) -> np.ndarray:
    """[P] the predicted seconds per step of each policy that auto's last step chose by."""
    return np.asarray(policy_seconds(auto, latency.costs(), block), np.float64)


def _auto_stats(auto, seconds: np.ndarray, steps_before=0, plain_ar: bool = False) -> dict:
    """What the auto method chose, and the estimates it chose by, as it ended the run. plain_ar: the
    call ran the plain AR program throughout (AutoMemory.stays_on_ar)."""
    seconds = [float(x) for x in seconds]
    return {
        "policy_steps": {name: int(n) for name, n in zip(AUTO_POLICIES, np.asarray(auto.steps) - steps_before)},
        "tokens_per_step": {name: float(t) for name, t in zip(AUTO_POLICIES, auto.tokens_per_step)},
        "seconds_per_step": dict(zip(AUTO_POLICIES, seconds)),
        "chain_step_over_decode_step": seconds[1] / seconds[0],
        "plain_ar": plain_ar,
    }


def _speculative_stats(method: str, num_generated, histogram, wall_s: float, compile_s: float) -> dict:
    """Stats shared by chain and tree decoding, from the [B, block] accepted-length histogram."""
    new_tokens = int(num_generated.sum())
    steps = int(histogram.sum())  # verify steps summed over rows
    lengths = np.arange(histogram.shape[1])
    # tau: tokens committed per verify step (accepted drafts + the bonus/correction token).
    tau = float((histogram * (lengths + 1)).sum() / steps) if steps else 0.0
    # per_position_acceptance[k-1]: fraction of verify steps whose accepted run reached draft slot k.
    reached = histogram.sum(0)[::-1].cumsum()[::-1]  # steps with n >= k, k = 0..K
    return {
        "method": method,
        "tokens_per_s": new_tokens / wall_s,
        "compile_s": compile_s,
        "wall_s": wall_s,
        "new_tokens": new_tokens,
        "tau": tau,
        "per_position_acceptance": (reached[1:] / steps).tolist() if steps else [],
        "accepted_length_histogram": histogram.sum(0).tolist(),
        "row_accepted_length_histograms": histogram.tolist(),  # [B, block]: each request's own
        # Loop iterations: every row verifies in each one until the last row is done.
        "verify_steps": int(histogram.sum(1).max()) if steps else 0,
    }
