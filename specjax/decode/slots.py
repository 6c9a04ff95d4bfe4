"""Step-level decoding over a fixed set of slots: the API continuous batching stands on.

After JetStream's engine API: a fixed batch of S slots whose target KV cache and drafter context
are allocated once; `insert` prefills prompts into chosen slots while the other slots keep their
state; `step` advances every occupied slot by `steps_per_sync` verify steps inside one device call;
freeing a slot is the host forgetting it (the next insert overwrites the whole row).

Each slot carries its own sampling parameters and its own PRNG key, so a request samples the same
tokens whatever else shares the batch, and greedy and sampled requests share one step. A greedy row
is the sampled path with a one-hot distribution on the argmax (see `row_processed_logits`): the
acceptance rule then accepts exactly the drafts that match the argmax, and resamples the argmax.

Methods live in one registry, `SLOT_METHODS`: ar, chain, chain+refiner, tree and tree+refiner
(each windowed when its drafter is), rapid, ngram (prompt lookup, no drafter), and auto (AR, chain
or tree at each step, whichever is predicted to commit the most tokens per second; decode/auto.py).
Every method advances the same `SlotState`, so the host side (specjax/serve) never branches on
method names, and a caller may change the method
between two steps (the state holds every part any of them reads), except into rapid: only rapid
steps keep its retrieval cache current.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.decode.auto import AUTO_POLICIES, AutoConfig, AutoState, choose_policy, observe, policy_seconds
from specjax.decode.autoregressive import _eos_array, prefill
from specjax.decode.budget import TreeCosts, chosen_bucket, median_seconds
from specjax.decode.context import DrafterContext, append_context, empty_context_cache, prefill_context
from specjax.decode.ngram import NgramConfig, propose_ngram
from specjax.decode.rapid import RapidConfig, draft_on_retrieved
from specjax.decode.refine import RefineConfig, refine_drafts
from specjax.decode.sampling import SamplingConfig
from specjax.decode.speculative import RefinerInputs, to_full_vocabulary, commit_tokens, draft_block_states
from specjax.decode.tree import TreeConfig, build_tree, draft_marginals, verify_tree
from specjax.decode.verify import accept_greedy, accept_sampled, accept_transfer, transfer_target
from specjax.errors import SpecjaxError, check_at_least
from specjax.models.cache import KVCache
from specjax.models.config import TransformerConfig
from specjax.models.drafter import DrafterConfig
from specjax.models.refiner import RefinerConfig, refiner_low_rank_head
from specjax.models.transformer import apply_head, forward, head_matrix, token_embedder, with_float32_embedding


@struct.dataclass
class RowSampling:
    """Per-slot sampling parameters (arrays, so requests with different settings share a step)."""

    temperature: jax.Array
    """[S] float32; 0 = greedy."""
    top_k: jax.Array
    """[S] int32; 0 = no top-k filter."""
    top_p: jax.Array
    """[S] float32; 1 = no nucleus filter."""

    @classmethod
    def greedy(cls, rows: int) -> "RowSampling":
        return cls(jnp.zeros((rows,), jnp.float32), jnp.zeros((rows,), jnp.int32), jnp.ones((rows,), jnp.float32))


def row_processed_logits(logits: jax.Array, sampling: RowSampling) -> jax.Array:
    """Per-row temperature, top-k and top-p; removed tokens get -inf. logits: [S, ..., V].

    A greedy row keeps only its argmax (the first, on ties, as jnp.argmax and accept_greedy pick),
    so sampling it returns the argmax and speculative acceptance on it is greedy acceptance. The
    filters match `sampling.processed_logits` (tokens tied with the k-th are kept); the sort they
    need runs only when some row asks for a filter."""
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]
    per_row = lambda x: x.reshape(x.shape + (1,) * (logits.ndim - 1))  # noqa: E731  [S] -> [S, 1, ..., 1]
    temperature = per_row(sampling.temperature)
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)

    def filtered(scaled):
        ordered = jnp.sort(scaled, axis=-1)[..., ::-1]  # [S, ..., V] descending
        top_k = per_row(sampling.top_k)
        rank = jnp.arange(vocab, dtype=jnp.int32)
        ordered = jnp.where((top_k > 0) & (rank >= top_k), -jnp.inf, ordered)
        kth = jnp.take_along_axis(ordered, jnp.clip(top_k - 1, 0, vocab - 1) + jnp.zeros_like(ordered[..., :1],
                                                                                             jnp.int32), axis=-1)
        scaled = jnp.where((top_k > 0) & (scaled < kth), -jnp.inf, scaled)
        probs = jax.nn.softmax(ordered, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        cutoff = jnp.min(jnp.where(mass_before < per_row(sampling.top_p), ordered, jnp.inf), axis=-1, keepdims=True)
        return jnp.where((per_row(sampling.top_p) < 1.0) & (scaled < cutoff), -jnp.inf, scaled)

    needs_filter = jnp.any(((sampling.top_k > 0) & (sampling.top_k < vocab)) | (sampling.top_p < 1.0))
    scaled = jax.lax.cond(needs_filter, filtered, lambda s: s, scaled)
    argmax_only = jnp.where(jnp.arange(vocab) == jnp.argmax(logits, axis=-1)[..., None], 0.0, -jnp.inf)
    return jnp.where(temperature > 0, scaled, argmax_only)


def split_row_keys(keys: jax.Array, count: int) -> tuple[jax.Array, ...]:
    """keys [S, 2] uint32 (raw key data, one key per row) -> count arrays of fresh row keys."""
    parts = jax.vmap(lambda k: jax.random.key_data(jax.random.split(jax.random.wrap_key_data(k), count)))(keys)
    return tuple(parts[:, i] for i in range(count))  # each [S, 2]


def row_categorical(keys: jax.Array, logits: jax.Array) -> jax.Array:
    """One draw per row from its own key: keys [S, 2], logits [S, ..., V] -> [S, ...] int32."""
    draw = lambda k, lg: jax.random.categorical(jax.random.wrap_key_data(k), lg, axis=-1)  # noqa: E731
    return jax.vmap(draw)(keys, logits).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class SlotConfig:
    """Shapes of a slot batch; one compilation per distinct value (and prompt bucket)."""

    slots: int = 8
    """Requests decoding at once."""
    cache_length: int = 1024
    """Target KV slots per row: prompt + generated tokens + one verify step's writes must fit."""
    max_new_tokens: int = 512
    """Most tokens any request may generate (the token buffer's width); requests ask for fewer."""
    steps_per_sync: int = 4
    """Verify steps the device runs between two host syncs."""
    insert_rows: int = 1
    """Prompts prefilled per insert call (a fixed shape; a partly used call pads)."""

    def __post_init__(self):
        check_at_least(1, slots=self.slots, cache_length=self.cache_length, max_new_tokens=self.max_new_tokens,
                       steps_per_sync=self.steps_per_sync, insert_rows=self.insert_rows)
        if self.insert_rows > self.slots:
            raise SpecjaxError(f"insert_rows ({self.insert_rows}) cannot exceed slots ({self.slots})")


@struct.dataclass
class SlotState:
    """Every slot's decoding state, carried from step to step."""

    tokens: jax.Array
    """[S, N + block] int32: committed generated tokens (slack of one block for the last write)."""
    num_generated: jax.Array
    """[S] int32: committed generated tokens per row."""
    max_new_tokens: jax.Array
    """[S] int32: the row's own token limit (at most N)."""
    last_token: jax.Array
    """[S] int32: newest committed token, not yet in either cache."""
    lengths: jax.Array
    """[S] int32: filled target cache slots (= drafter context entries)."""
    done: jax.Array
    """[S] bool: finished (EOS or limit) or empty; a done row stands still."""
    keys: jax.Array
    """[S, 2] uint32: each row's PRNG key (raw key data), split at every use."""
    sampling: RowSampling
    steps: jax.Array
    """[S] int32: verify steps the row took part in."""
    accepted_histogram: jax.Array
    """[S, block] int32: verify steps that accepted n drafts, n = 0..block-1 (AR: all at n = 0)."""
    drafted: jax.Array
    """[S] int32: draft tokens the row's verify steps checked (K per chain step, nodes - 1 per tree)."""
    refine_passes: jax.Array
    """[S] int32: refinement passes run in the row's steps (+refiner methods; a pass refines every row)."""
    tree_sizes: jax.Array
    """[S, max(1, buckets)] int32: the row's tree steps per verified tree size (statics.tree_buckets)."""
    tree_chosen: jax.Array
    """[S] int32: the budget rule's chosen tree sizes, summed over the row's tree steps."""
    draft_limit: jax.Array
    """[S] int32: most drafts a step may commit for the row (0: the row decodes one token per step
    whatever the batch's method; block - 1: no limit). A per-row choice inside a batch-wide step."""
    drafter_window: jax.Array
    """[S] int32: a full-attention drafter reads only the row's last this many context positions
    (0: all of them). Set under memory pressure: the older positions' drafter K/V are then not
    needed, so a paged allocator could free them. Drafts only, so any value is exact."""
    target_cache: KVCache
    context_cache: DrafterContext | None
    """The drafter's context per row, or None for autoregressive decoding."""
    drafting_cache: KVCache | None = None
    """The rapid method's second target cache per row: retrieved chunks + question + generated
    tokens (decode/rapid.py); None when no rapid step will run. Only rapid steps write it, so a
    row that another method advanced must not step with rapid again."""
    drafting_lengths: jax.Array | None = None
    """[S] int32: the drafting-context slot of last_token (filled slots before it): in rapid's
    retrieval cache, or rapid+block's drafter context."""
    drafting_previous: jax.Array | None = None
    """[S] int32: the token before last_token, which a rapid step rewrites first."""
    lossless_diverged_at: jax.Array | None = None
    """[S] int32, under lossy knowledge transfer (RapidConfig.eta > 0) only: on a greedy row, the
    generated tokens before the first one that is not the target's own greedy choice, i.e. where the
    output leaves the lossless run's (-1: not yet). Up to that token both runs read the same prefix,
    so this is the exact agreement with a lossless run, measured at no extra cost."""
    history: jax.Array | None = None
    """[S, cache_length] int32, when an ngram step may run: the token at each of the row's target
    cache slots (prompt and committed tokens), which prompt lookup copies its drafts from. Every
    step keeps it current, so a server may switch into ngram at any step."""
    auto: AutoState | None = None
    """What the auto method has measured (its policies' yields and costs), when it may step."""


@dataclasses.dataclass(frozen=True)
class SlotStatics:
    """The static arguments every slot function takes (hashable, so jit keys on them)."""

    target_config: TransformerConfig
    slot: SlotConfig
    eos_token_ids: tuple[int, ...]
    drafter_config: DrafterConfig | None = None
    refiner_config: RefinerConfig | None = None
    refine: RefineConfig = RefineConfig()
    """Refinement passes per block for the +refiner methods."""
    tree: TreeConfig | None = None
    """Tree shape and sizes for the tree methods; None when no tree method will step."""
    rapid: RapidConfig | None = None
    """How the rapid method drafts; None when no rapid step will run."""
    drafting_length: int = 0
    """Slots of each row's drafting context (rapid, rapid+block): its drafting prompt, its generated
    tokens and one step's writes must fit."""
    drafter_on_retrieval: bool = False
    """rapid+block: the drafter's context holds the target's features of the drafting prompt
    (retrieved chunks and question) and of the generated tokens, at drafting-prompt positions,
    rather than the full prompt's, so it grows with the retrieval budget, not the document."""
    ngram: NgramConfig | None = None
    """How the ngram method drafts; None when no ngram step will run (the slots then keep no token
    history)."""
    auto: AutoConfig | None = None
    """How the auto method chooses its policy; None when no auto step will run."""

    @property
    def block(self) -> int:
        """Most tokens one verify step commits: the drafter's block (1 for AR), or rapid's or ngram's
        drafts + 1."""
        drafter = 1 if self.drafter_config is None else self.drafter_config.block_size
        return max(drafter, 0 if self.rapid is None else self.rapid.drafts + 1,
                   0 if self.ngram is None else self.ngram.drafts + 1)

    @property
    def tree_buckets(self) -> tuple[int, ...]:
        """Node counts a tree step verifies (each compiled into the step, one chosen per step)."""
        return () if self.tree is None else self.tree.node_buckets(self.block - 1)

    @property
    def step_writes(self) -> int:
        """Most cache slots one step of any method writes past a row's length (the block, or the
        largest tree): the registry's one rule, `policy_writes`, at its largest."""
        return max(self.policy_writes(name) for name in SLOT_METHODS)

    def policy_writes(self, policy: str) -> int:
        """Most cache slots one step of `policy` writes past a row's length (SlotMethod.writes)."""
        return slot_method(policy).writes(self.block, max(self.tree_buckets, default=0),
                                          0 if self.rapid is None else self.rapid.drafts,
                                          0 if self.ngram is None else self.ngram.drafts)


def token_rows(rows: Sequence[Sequence[int]], width: int, count: int | None = None) -> np.ndarray:
    """[count, width] int32: each row's tokens from the left, zeros after them and in the rows past
    len(rows) (count defaults to len(rows)); the batch-major input of an insert or refresh."""
    out = np.zeros((len(rows) if count is None else count, width), np.int32)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


def empty_slots(statics: SlotStatics) -> SlotState:
    """Every slot free (done), caches allocated once."""
    s, n = statics.slot.slots, statics.slot.max_new_tokens
    return SlotState(
        tokens=jnp.zeros((s, n + statics.block), jnp.int32),
        num_generated=jnp.zeros((s,), jnp.int32),
        max_new_tokens=jnp.ones((s,), jnp.int32),
        last_token=jnp.zeros((s,), jnp.int32),
        lengths=jnp.zeros((s,), jnp.int32),
        done=jnp.ones((s,), bool),
        keys=jnp.zeros((s, 2), jnp.uint32),
        sampling=RowSampling.greedy(s),
        steps=jnp.zeros((s,), jnp.int32),
        accepted_histogram=jnp.zeros((s, statics.block), jnp.int32),
        drafted=jnp.zeros((s,), jnp.int32),
        refine_passes=jnp.zeros((s,), jnp.int32),
        tree_sizes=jnp.zeros((s, max(1, len(statics.tree_buckets))), jnp.int32),
        tree_chosen=jnp.zeros((s,), jnp.int32),
        draft_limit=jnp.full((s,), statics.block - 1, jnp.int32),
        drafter_window=jnp.zeros((s,), jnp.int32),
        target_cache=KVCache.zeros(statics.target_config, s, statics.slot.cache_length),
        context_cache=(None if statics.drafter_config is None else empty_context_cache(
            statics.drafter_config, s,
            statics.drafting_length if statics.drafter_on_retrieval else statics.slot.cache_length)),
        **({} if not statics.drafting_length else dict(
            drafting_lengths=jnp.zeros((s,), jnp.int32), drafting_previous=jnp.zeros((s,), jnp.int32))),
        **({} if not statics.drafting_length or statics.rapid is None else dict(
            drafting_cache=KVCache.zeros(statics.target_config, s, statics.drafting_length))),
        **({} if statics.rapid is None or not statics.rapid.lossy else dict(
            lossless_diverged_at=jnp.full((s,), -1, jnp.int32))),
        **({} if statics.ngram is None else dict(history=jnp.zeros((s, statics.slot.cache_length), jnp.int32))),
        **({} if statics.auto is None else dict(auto=AutoState.fresh())),
    )


@struct.dataclass
class SlotParts:
    """The arrays a slot step reads besides its state: the weights, and what is derived from them
    once per server rather than once per step."""

    target: dict
    drafter: dict | None = None
    draft_vocab: jax.Array | None = None
    """[V'] token ids of the drafter's head, or None for the full vocabulary."""
    head: jax.Array | None = None
    """[d, V'] the target's LM head over the draft vocabulary (the drafter's output matrix)."""
    refiner: dict | None = None
    refiner_head: jax.Array | None = None
    """[rank, V'] the refiner's projection of `head`."""
    tree_costs: TreeCosts | None = None
    """The budget rule's latency model for auto-sized trees; dynamic, so refitting never recompiles."""


def slot_parts(statics: SlotStatics, target_params, drafter_params=None, draft_vocab=None, refiner_params=None,
               tree_costs: TreeCosts | None = None) -> SlotParts:
    """Gather a slot batch's parts, computing the draft head (and the refiner's low-rank head) once."""
    if drafter_params is None:
        return SlotParts(target_params)
    draft_vocab = None if draft_vocab is None else jnp.asarray(draft_vocab)
    head = jax.jit(head_matrix, static_argnums=1)(target_params, statics.target_config, draft_vocab)
    refiner_head = None
    if refiner_params is not None:
        refiner_head = jax.jit(refiner_low_rank_head, static_argnums=1)(refiner_params, statics.refiner_config, head)
    return SlotParts(target_params, drafter_params, draft_vocab, head, refiner_params, refiner_head, tree_costs)


@struct.dataclass
class InsertRequest:
    """R prompts to prefill into slots (a fixed-shape batch; unused entries have row = S)."""

    rows: jax.Array
    """[R] int32: slot of each prompt; S (out of range) marks a padding entry, which is dropped."""
    prompts: jax.Array
    """[R, P] int32, right-padded to the prompt bucket P."""
    prompt_lengths: jax.Array
    """[R] int32."""
    max_new_tokens: jax.Array
    """[R] int32."""
    seeds: jax.Array
    """[R] uint32: each request's sampling seed."""
    sampling: RowSampling
    offsets: jax.Array | None = None
    """[R] int32: prompt tokens of each row prefilled by earlier calls (chunked prefill), the chunk
    being `prompts`; None: the prompts start here, in fresh rows."""
    draft_limit: jax.Array | None = None
    """[R] int32: each row's SlotState.draft_limit (None: no limit)."""
    drafting_prompts: jax.Array | None = None
    """[R, Q] int32, right-padded: each row's drafting prompt for rapid and rapid+block (retrieved
    chunks and the question); needed when the slots have a drafting context (drafting_length)."""
    drafting_prompt_lengths: jax.Array | None = None
    """[R] int32."""
    final: jax.Array | None = None
    """[R] bool: the call holds each prompt's last tokens (None: every prompt ends here). A row whose
    prompt goes on gets no first token and stays done, so steps pass it by, with its length at the
    tokens prefilled so far (a step's writes there are overwritten by the next chunk)."""


def _put_rows(whole, part, rows):
    """Scatter part [R, ...] into whole [S, ...] at rows [R]; an out-of-range row is dropped."""
    return jax.tree.map(lambda w, p: w.at[rows].set(p.astype(w.dtype), mode="drop"), whole, part)


@partial(jax.jit, static_argnames=("statics",), donate_argnames=("state",))
def insert(parts: SlotParts, state: SlotState, request: InsertRequest, *, statics: SlotStatics) -> SlotState:
    """Prefill R prompts (or the next chunk of each) and place them, with their first token once a
    prompt is whole, into their slots; other slots are untouched. Slots with a drafting context
    (rapid, rapid+block) take whole prompts, and fill that context from request.drafting_prompts
    or, when those are None, in a refresh_drafting call that must follow before the next step."""
    count = request.rows.shape[0]
    dcfg = statics.drafter_config
    on_retrieval = dcfg is not None and statics.drafter_on_retrieval
    rows = request.rows
    offsets, logits, cache, context = _prefill_rows(parts, state, request, statics)
    final = jnp.ones((count,), bool) if request.final is None else request.final
    keys = jax.vmap(lambda seed: jax.random.key_data(jax.random.key(seed)))(request.seeds)  # [R, 2]
    keys, first_keys = split_row_keys(keys, 2)
    first = row_categorical(first_keys, row_processed_logits(logits, request.sampling))  # [R]
    limit = jnp.minimum(request.max_new_tokens, statics.slot.max_new_tokens)
    put = lambda whole, part: _put_rows(whole, part, rows)  # noqa: E731
    fresh = dict(
        tokens=put(state.tokens, jnp.zeros((count, state.tokens.shape[1]), jnp.int32).at[:, 0].set(first)),
        num_generated=put(state.num_generated, final.astype(jnp.int32)),
        max_new_tokens=put(state.max_new_tokens, limit),
        last_token=put(state.last_token, first),
        lengths=put(state.lengths, offsets + request.prompt_lengths),
        done=put(state.done, ~final | jnp.isin(first, _eos_array(statics.eos_token_ids)) | (limit <= 1)),
        keys=put(state.keys, keys),
        sampling=put(state.sampling, request.sampling),
        steps=put(state.steps, jnp.zeros((count,), jnp.int32)),
        accepted_histogram=put(state.accepted_histogram, jnp.zeros((count, statics.block), jnp.int32)),
        drafted=put(state.drafted, jnp.zeros((count,), jnp.int32)),
        refine_passes=put(state.refine_passes, jnp.zeros((count,), jnp.int32)),
        tree_sizes=put(state.tree_sizes, jnp.zeros((count,) + state.tree_sizes.shape[1:], jnp.int32)),
        tree_chosen=put(state.tree_chosen, jnp.zeros((count,), jnp.int32)),
        draft_limit=put(state.draft_limit, jnp.full((count,), statics.block - 1, jnp.int32)
                        if request.draft_limit is None else request.draft_limit),
        drafter_window=put(state.drafter_window, jnp.zeros((count,), jnp.int32)),
        target_cache=put(state.target_cache, cache),
    )
    if state.history is not None:  # the prompt (or this chunk of it) at its cache slots
        fresh["history"] = put(state.history, _history_rows(state, request, offsets, statics))
    if state.lossless_diverged_at is not None:  # the first token is the target's own (no transfer at prefill)
        fresh["lossless_diverged_at"] = put(state.lossless_diverged_at, jnp.full((count,), -1, jnp.int32))
    # Without drafting prompts, a drafting-context row's context is left for refresh_drafting, which
    # must fill it before the row's next step: a server compiles the two apart, one program per
    # prompt bucket plus one per drafting bucket, rather than one per pair of them.
    drafting_later = statics.drafting_length and request.drafting_prompts is None
    if statics.drafting_length:
        if request.offsets is not None:
            raise SpecjaxError("slots with a drafting context (rapid, rapid+block) insert whole prompts")
        if not drafting_later:
            drafting = _drafting_context(parts, statics, request.drafting_prompts, request.drafting_prompt_lengths)
            if on_retrieval:
                context = drafting.pop("context_cache")
            fresh.update({name: put(getattr(state, name), value) for name, value in drafting.items()})
    if dcfg is not None and not (on_retrieval and drafting_later):
        fresh["context_cache"] = put(state.context_cache, context)
    return state.replace(**fresh)


def _prefill_rows(parts: SlotParts, state: SlotState, request: InsertRequest, statics: SlotStatics):
    """(offsets, last-position logits, target cache rows, drafter context rows or None) of the
    request's prompts: a whole prefill, or the next chunk of each prompt after what its slot holds."""
    count = request.rows.shape[0]
    dcfg = statics.drafter_config
    on_retrieval = dcfg is not None and statics.drafter_on_retrieval
    taps = () if dcfg is None or on_retrieval else dcfg.target_layer_ids
    context = None
    if request.offsets is None:
        offsets = jnp.zeros((count,), jnp.int32)
        logits, cache, features = prefill(parts.target, statics.target_config, request.prompts,
                                          request.prompt_lengths, statics.slot.cache_length, hidden_layers=taps)
        if dcfg is not None and not on_retrieval:
            context = prefill_context(parts.drafter, dcfg, count, statics.slot.cache_length, features,
                                      request.prompt_lengths)
        return offsets, logits, cache, context
    if dcfg is not None and dcfg.window is not None:
        raise SpecjaxError("chunked prefill needs a full-attention drafter context; prefill windowed "
                           "drafters' prompts whole")
    offsets = request.offsets
    held = jnp.minimum(request.rows, statics.slot.slots - 1)  # padding entries read any row; their writes drop
    row_cache = jax.tree.map(lambda c: c[held], state.target_cache)
    positions = offsets[:, None] + jnp.arange(request.prompts.shape[1], dtype=jnp.int32)  # [R, C]
    out = forward(parts.target, statics.target_config, request.prompts, positions, row_cache, offsets,
                  hidden_layers=taps, logit_positions=(request.prompt_lengths - 1)[:, None],
                  valid_lengths=request.prompt_lengths)
    if dcfg is not None:
        context = append_context(parts.drafter, dcfg, jax.tree.map(lambda c: c[held], state.context_cache),
                                 out.hidden, positions, offsets, offsets + request.prompt_lengths)
    return offsets, out.logits[:, 0], out.cache, context


def _history_rows(state: SlotState, request: InsertRequest, offsets, statics: SlotStatics):
    """[R, L] the inserted rows' token histories with the prompt (or this chunk of it) at its cache slots."""
    count = request.rows.shape[0]
    width = statics.slot.cache_length
    held = jnp.minimum(request.rows, statics.slot.slots - 1)
    base = jnp.zeros((count, width), jnp.int32) if request.offsets is None else state.history[held]  # [R, L]
    at = jnp.arange(request.prompts.shape[1], dtype=jnp.int32)[None, :]  # [1, P]
    columns = jnp.where(at < request.prompt_lengths[:, None], offsets[:, None] + at, width)  # padding: dropped
    return base.at[jnp.arange(count)[:, None], columns].set(request.prompts, mode="drop")


def _drafting_context(parts: SlotParts, statics: SlotStatics, prompts, lengths) -> dict:
    """Rows' drafting contexts (rapid, rapid+block) filled with prompts [R, Q] (right-padded, lengths
    [R]): the SlotState fields for those rows. The drafting prompt's last token is the one before the
    row's last_token, and last_token goes at slot `lengths`."""
    dcfg = statics.drafter_config
    on_retrieval = dcfg is not None and statics.drafter_on_retrieval
    _, drafting_cache, features = prefill(parts.target, statics.target_config, prompts, lengths,
                                           statics.drafting_length,
                                           hidden_layers=dcfg.target_layer_ids if on_retrieval else ())
    last = jnp.take_along_axis(prompts, (lengths - 1)[:, None], axis=1)[:, 0]  # [R]
    out = {"drafting_lengths": lengths, "drafting_previous": last}
    if on_retrieval:  # the drafter reads the drafting prompt's features, at its positions
        out["context_cache"] = prefill_context(parts.drafter, dcfg, prompts.shape[0], statics.drafting_length,
                                               features, lengths)
    if statics.rapid is not None:
        out["drafting_cache"] = drafting_cache
    return out


@partial(jax.jit, static_argnames=("statics",), donate_argnames=("state",))
def refresh_drafting(parts: SlotParts, state: SlotState, rows, prompts, lengths, starts=None, *,
                     statics: SlotStatics) -> SlotState:
    """Replace the drafting contexts of `rows` [R] (re-retrieval, decode/rapid.py): each is refilled
    with the new drafting prompt followed by the row's generated tokens before its last_token,
    `lengths` [R] tokens in all. The full cache and every other field stay; rows out of range are
    dropped (padding).

    starts None: prompts [R, Q] hold the whole sequences, right-padded, and are prefilled anew.
    starts [R] (rapid only, whose drafting cache is the target's own K/V): each row keeps its
    drafting cache before starts[row], which the caller promises holds the new sequence's tokens
    there (a shared prefix), and prompts [R, Q] hold the tokens from starts on; only those are
    prefilled, after the kept ones. The caller also keeps starts + Q <= drafting_length."""
    if not statics.drafting_length:
        raise SpecjaxError("only slots with a drafting context (rapid, rapid+block) refresh it")
    if starts is None:
        drafting = _drafting_context(parts, statics, prompts, lengths)
    else:
        drafting = _extended_drafting_cache(parts, statics, state, rows, prompts, lengths, starts)
    return state.replace(**{name: _put_rows(getattr(state, name), value, rows) for name, value in drafting.items()})


def _extended_drafting_cache(parts: SlotParts, statics: SlotStatics, state: SlotState, rows, suffixes, lengths,
                             starts) -> dict:
    """refresh_drafting's fields for rows whose drafting caches are kept before starts [R] and
    extended with suffixes [R, Q] (right-padded, lengths - starts real tokens each)."""
    if statics.rapid is None or statics.drafter_on_retrieval:
        raise SpecjaxError("only rapid keeps the target's K/V of its drafting context, so only rapid extends "
                           "it; refill rapid+block's drafting context whole (starts=None)")
    held = jnp.minimum(rows, statics.slot.slots - 1)  # padding entries read any row; their writes drop
    real = lengths - starts  # [R]
    out = forward(parts.target, statics.target_config, suffixes,
                  starts[:, None] + jnp.arange(suffixes.shape[1], dtype=jnp.int32),
                  jax.tree.map(lambda c: c[held], state.drafting_cache), starts,
                  logit_positions=jnp.maximum(real - 1, 0)[:, None], valid_lengths=real)
    last = jnp.take_along_axis(suffixes, jnp.maximum(real - 1, 0)[:, None], axis=1)[:, 0]  # [R]
    return {"drafting_lengths": lengths, "drafting_previous": last, "drafting_cache": out.cache}


def _any_sampled(sampling: RowSampling) -> jax.Array:
    """[] bool: some row samples. When none does, steps take argmax paths and draw no random numbers,
    which is most of a batched step's cost beyond the forward passes on CPU."""
    return jnp.any(sampling.temperature > 0)


def _ar_step(parts: SlotParts, state: SlotState, statics: SlotStatics, attend_slots: int | None) -> SlotState:
    """One token for every live row. When the slots carry a drafter context (a server that switches
    methods between steps), the step's tap features go into it, so a later speculative step drafts
    from a context without holes."""
    dcfg = statics.drafter_config
    keep_context = dcfg is not None  # empty_slots gives the slots a drafter context exactly then
    keys, draw_keys = split_row_keys(state.keys, 2)
    out = forward(parts.target, statics.target_config, state.last_token[:, None], state.lengths[:, None],
                  state.target_cache, state.lengths, attend_slots=attend_slots,
                  hidden_layers=dcfg.target_layer_ids if keep_context else ())
    logits = out.logits[:, 0]  # [S, V]
    token = jax.lax.cond(_any_sampled(state.sampling),
                         lambda: row_categorical(draw_keys, row_processed_logits(logits, state.sampling)),
                         lambda: jnp.argmax(logits, axis=-1).astype(jnp.int32))  # [S]
    context = state.context_cache
    if keep_context:
        context = append_context(parts.drafter, dcfg, context, out.hidden, state.lengths[:, None], state.lengths,
                                 state.lengths + ~state.done)
    no_drafts = jnp.zeros((state.lengths.shape[0], 0), jnp.int32)
    return _commit(state, no_drafts, jnp.zeros_like(token), token, keys, out.cache, context, statics, drafted=0)


def _rapid_step(parts: SlotParts, state: SlotState, statics: SlotStatics, attend_slots: int | None) -> SlotState:
    """RAPID self-speculation (decode/rapid.py): the target drafts on each row's retrieval cache,
    verifies on its full cache in one pass, and accepts per row: speculative sampling, greedy on
    greedy rows, lossless; with RapidConfig.eta > 0 against the target shifted toward the drafts'
    distribution (knowledge transfer, lossy and opt-in)."""
    tcfg, drafts = statics.target_config, statics.rapid.drafts
    keys, draft_keys, accept_keys = split_row_keys(state.keys, 3)
    sampled = _any_sampled(state.sampling)

    transfer = statics.rapid.eta > 0

    def draw(logits, row_keys):
        processed = row_processed_logits(logits, state.sampling)  # [S, V]; greedy rows: argmax only
        token = jax.lax.cond(sampled, lambda: row_categorical(row_keys, processed),
                             lambda: jnp.argmax(logits, axis=-1).astype(jnp.int32))
        return token, ((processed, logits) if transfer else processed)

    draw_keys = jnp.stack(split_row_keys(draft_keys, drafts))  # [K, S, 2]
    draft, kept, drafting_cache = draft_on_retrieved(
        parts.target, tcfg, state.drafting_cache, state.drafting_lengths, state.drafting_previous,
        state.last_token, draw_keys, draw)  # [S, K], [S, K, V] (and the raw logits with transfer)
    draft_logits = kept[0] if transfer else kept
    verify_tokens = jnp.concatenate([state.last_token[:, None], draft], axis=1)  # [S, K + 1]
    positions = state.lengths[:, None] + jnp.arange(drafts + 1, dtype=jnp.int32)
    out = forward(parts.target, tcfg, verify_tokens, positions, state.target_cache, state.lengths,
                  attend_slots=attend_slots)  # logits [S, K + 1, V]
    verify_logits = out.logits
    if transfer:  # lossy, opt-in: greedy rows follow the argmax of the shifted target
        raw = out.logits[:, :-1]
        shifted = jnp.log(transfer_target(raw, jax.nn.softmax(raw, axis=-1), jax.nn.softmax(kept[1], axis=-1),
                                          statics.rapid.eta))
        greedy_row = (state.sampling.temperature <= 0)[:, None, None]
        verify_logits = out.logits.at[:, :-1].set(jnp.where(greedy_row, shifted, raw))

    def sampled_acceptance():
        q = jax.nn.softmax(draft_logits, axis=-1)  # the distributions the drafts were drawn from
        processed = row_processed_logits(verify_logits, state.sampling)
        if transfer:
            rule = lambda d, qq, zz, k: accept_transfer(d[None], qq[None], zz[None], statics.rapid.eta,  # noqa: E731
                                                        jax.random.wrap_key_data(k))
            n, next_token = jax.vmap(rule)(draft, q, processed, accept_keys)
        else:
            p = jax.nn.softmax(processed, axis=-1)
            one_row = lambda d, qq, pp, k: accept_sampled(d[None], qq[None], pp[None], jax.random.wrap_key_data(k))  # noqa
            n, next_token = jax.vmap(one_row)(draft, q, p, accept_keys)
        return n[:, 0], next_token[:, 0]

    n, next_token = jax.lax.cond(sampled, sampled_acceptance, lambda: accept_greedy(draft, verify_logits))
    n, next_token = _within_limit(n, next_token, draft, state.draft_limit)
    live = ~state.done
    if transfer:
        state = state.replace(lossless_diverged_at=_lossless_divergence(state, draft, n, next_token, out.logits))
    previous = jnp.where(n > 0, jnp.take_along_axis(draft, jnp.maximum(n - 1, 0)[:, None], axis=1)[:, 0],
                         state.last_token)
    state = state.replace(drafting_cache=drafting_cache,
                          drafting_lengths=state.drafting_lengths + live * (n + 1),
                          drafting_previous=jnp.where(live, previous, state.drafting_previous))
    return _commit(state, draft, n, next_token, keys, out.cache, state.context_cache, statics, drafted=drafts)


def _lossless_divergence(state: SlotState, draft, n, next_token, target_logits) -> jax.Array:
    """SlotState.lossless_diverged_at after a lossy step: greedy rows compare the tokens the step
    commits (draft [S, K] up to n [S], then next_token) with the target's own argmax at each of
    those positions (target_logits [S, K + 1, V], unshifted)."""
    width = draft.shape[1] + 1
    at = jnp.arange(width, dtype=jnp.int32)[None, :]  # [1, K + 1]
    committed = jnp.where(at < n[:, None], jnp.pad(draft, ((0, 0), (0, 1))), next_token[:, None])  # [S, K + 1]
    own = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [S, K + 1]
    differs = (committed != own) & (at <= n[:, None])
    checked = ~state.done & (state.sampling.temperature <= 0) & (state.lossless_diverged_at < 0)
    first = jnp.argmax(differs, axis=1).astype(jnp.int32)  # [S] first differing token of the step
    return jnp.where(checked & differs.any(axis=1), state.num_generated + first, state.lossless_diverged_at)


def _within_limit(n, next_token, drafts, limit):
    """Cut each row's accepted run at its draft limit. Drafts d_1..d_n passed the acceptance rule and
    next_token follows them; when n > limit, d_(limit+1) is itself a token the rule emitted at that
    position (greedy: the target's argmax; sampled: an exact draw from p), so it becomes the row's
    next token and the rest is dropped. Exact for every limit.
    n, next_token, limit [S]; drafts [S, K] (the accepted path for trees) -> (n, next_token)."""
    cut = n > limit
    at_limit = jnp.take_along_axis(drafts, jnp.clip(limit, 0, drafts.shape[1] - 1)[:, None], axis=1)[:, 0]
    return jnp.minimum(n, limit), jnp.where(cut, at_limit, next_token)


def _context_from(state: SlotState, draft_lengths) -> jax.Array:
    """[S] int32: the first context position each row's drafter reads (its drafter_window)."""
    return jnp.where(state.drafter_window > 0, jnp.maximum(draft_lengths - state.drafter_window, 0), 0)


def _refiner_inputs(parts: SlotParts, statics: SlotStatics) -> RefinerInputs:
    return RefinerInputs(parts.refiner, parts.refiner_head, statics.refiner_config, statics.refine)


def _chain_step(parts: SlotParts, state: SlotState, statics: SlotStatics, attend_slots: int | None,
                refined: bool = False, drafts: int | None = None) -> SlotState:
    """Draft a block (and refine it), verify its first `drafts` tokens (None: all block - 1) in one
    target pass, accept per row (speculative sampling, which is greedy acceptance on greedy rows).
    A shorter verify is a cheaper step at a full batch; the draft pass is the same. With
    statics.drafter_on_retrieval (rapid+block) the drafter works at drafting-prompt positions
    (drafting_lengths) while the target verifies at its own."""
    tcfg, dcfg = statics.target_config, statics.drafter_config
    block = dcfg.block_size if drafts is None else drafts + 1
    keys, draft_keys, accept_keys = split_row_keys(state.keys, 3)
    draft_lengths = state.drafting_lengths if statics.drafter_on_retrieval else state.lengths  # [S]
    hidden = draft_block_states(parts.target, tcfg, parts.drafter, dcfg, state.last_token, draft_lengths,
                                state.context_cache, context_from=_context_from(state, draft_lengths))  # [S, K, d]
    logits = apply_head(hidden, parts.head)  # [S, K, V']
    sampled = _any_sampled(state.sampling)
    greedy_draft = lambda lg: jnp.argmax(lg, axis=-1).astype(jnp.int32)  # noqa: E731
    draft_index = jax.lax.cond(
        sampled, lambda: row_categorical(draft_keys, row_processed_logits(logits, state.sampling)),
        lambda: greedy_draft(logits))  # [S, K]
    passes = jnp.int32(0)
    if refined:
        logits, draft_index, passes = _refine(parts, state, statics, hidden, logits, draft_index, draft_keys, sampled)
    logits, draft_index = logits[:, : block - 1], draft_index[:, : block - 1]
    draft, _ = to_full_vocabulary(draft_index, None, parts.draft_vocab, tcfg.vocab_size)

    verify_tokens = jnp.concatenate([state.last_token[:, None], draft], axis=1)  # [S, Bk]
    positions = state.lengths[:, None] + jnp.arange(block, dtype=jnp.int32)
    out = forward(parts.target, tcfg, verify_tokens, positions, state.target_cache, state.lengths,
                  hidden_layers=dcfg.target_layer_ids, attend_slots=attend_slots)  # logits [S, Bk, V], hidden

    def sampled_acceptance():
        # q is recomputed from the logits the drafts were drawn from (the refined ones with a
        # refiner), so it is their q.
        q = jax.nn.softmax(row_processed_logits(logits, state.sampling), axis=-1)
        _, q = to_full_vocabulary(draft_index, q, parts.draft_vocab, tcfg.vocab_size)
        p = jax.nn.softmax(row_processed_logits(out.logits, state.sampling), axis=-1)
        one_row = lambda d, qq, pp, k: accept_sampled(d[None], qq[None], pp[None], jax.random.wrap_key_data(k))  # noqa
        n, next_token = jax.vmap(one_row)(draft, q, p, accept_keys)
        return n[:, 0], next_token[:, 0]

    n, next_token = jax.lax.cond(sampled, sampled_acceptance, lambda: accept_greedy(draft, out.logits))
    n, next_token = _within_limit(n, next_token, draft, state.draft_limit)
    advance = jnp.where(state.done, 0, n + 1)
    draft_positions = draft_lengths[:, None] + jnp.arange(block, dtype=jnp.int32)
    context = append_context(parts.drafter, dcfg, state.context_cache, out.hidden, draft_positions, draft_lengths,
                             draft_lengths + advance)
    state = state.replace(refine_passes=state.refine_passes + ~state.done * passes)
    if statics.drafter_on_retrieval:
        state = state.replace(drafting_lengths=state.drafting_lengths + advance)
    return _commit(state, draft, n, next_token, keys, out.cache, context, statics, drafted=block - 1)


def _refine(parts: SlotParts, state: SlotState, statics: SlotStatics, hidden, logits, draft_index, draft_keys,
            sampled):
    """Jacobi refinement of every row's draft (decode/refine.py) with per-row choices: greedy rows
    take the argmax; sampled rows a Gumbel-max draw whose noise is drawn once per block from the
    row's key, which keeps the refined draft an exact sample of the refined q.
    Returns (refined logits, refined draft indices, passes run [])."""
    tcfg = statics.target_config
    to_token = (lambda i: i) if parts.draft_vocab is None else (lambda i: jnp.take(parts.draft_vocab, i))
    embed = token_embedder(parts.target, tcfg)  # outside the branches below (see token_embedder)
    embed_index = lambda i: embed(to_token(i))  # noqa: E731
    anchor_embed = embed(state.last_token)  # [S, d]
    refiner = _refiner_inputs(parts, statics)

    def run(choose):
        draft, refined_logits, passes = refine_drafts(refiner.params, refiner.config, refiner.refine, hidden, logits,
                                                      anchor_embed, draft_index, embed_index, refiner.low_rank_head,
                                                      SamplingConfig(), None, choose=choose)
        return refined_logits, draft, jnp.asarray(passes, jnp.int32)

    def with_sampling():
        # The refinement noise comes from a key split off the draft key, so it is independent of the
        # first draft; one Gumbel draw per row, slot and token, reused by every pass.
        noise_keys = split_row_keys(draft_keys, 1)[0]
        noise = jax.vmap(lambda k: jax.random.gumbel(jax.random.wrap_key_data(k), logits.shape[1:]))(noise_keys)
        return run(lambda lg: jnp.argmax(row_processed_logits(lg, state.sampling) + noise, axis=-1).astype(jnp.int32))

    return jax.lax.cond(sampled, with_sampling, lambda: run(lambda lg: jnp.argmax(lg, axis=-1).astype(jnp.int32)))


def _tree_step(parts: SlotParts, state: SlotState, statics: SlotStatics, attend_slots: int | None,
               refined: bool = False) -> SlotState:
    """Build a draft tree per row from the drafter's marginals (refined ones with a refiner), size
    it for the batch by the budget rule (or the fixed budget), verify every node in one target pass
    and accept by the target-first traversal, drawing each row's y_v with its own key."""
    tcfg, dcfg, tree = statics.target_config, statics.drafter_config, statics.tree
    block, num_draft = dcfg.block_size, dcfg.block_size - 1
    buckets = statics.tree_buckets
    max_nodes = buckets[-1]
    keys, accept_keys = split_row_keys(state.keys, 2)
    live = ~state.done
    sampled = _any_sampled(state.sampling)
    refiner = _refiner_inputs(parts, statics) if refined else None
    logits, passes = draft_marginals(parts.target, tcfg, parts.drafter, dcfg, state.last_token, state.lengths,
                                     state.context_cache, parts.head, parts.draft_vocab, refiner,
                                     context_from=_context_from(state, state.lengths))  # [S, K, V']
    # Sampled rows grow their trees on the processed marginals, the distribution the target samples;
    # greedy rows on the raw ones (their one-hot processed form would leave one candidate per depth).
    is_sampled = (state.sampling.temperature > 0)[:, None, None]
    logits = jax.lax.cond(sampled, lambda: jnp.where(is_sampled, row_processed_logits(logits, state.sampling), logits),
                          lambda: logits.astype(jnp.float32))
    nodes = build_tree(state.last_token, logits, parts.draft_vocab, tree, SamplingConfig(), max_nodes)
    if tree.auto:
        bucket, chosen = chosen_bucket(nodes.log_prob, nodes.valid, live, parts.tree_costs, buckets)  # [], []
    else:
        chosen, bucket = jnp.int32(buckets[0]), jnp.int32(0)

    def draw(target_logits):  # [S, N, V] -> [S, N]: y_v at every node
        return jax.lax.cond(sampled,
                            lambda: row_categorical(accept_keys, row_processed_logits(target_logits, state.sampling)),
                            lambda: jnp.argmax(target_logits, axis=-1).astype(jnp.int32))

    def verify_at(size):
        def verify(nodes):
            return verify_tree(parts.target, tcfg, nodes.take(size), state.lengths, state.target_cache,
                               dcfg.target_layer_ids, SamplingConfig(), None, num_draft, draw=draw,
                               attend_slots=attend_slots) + (jnp.int32(size - 1),)
        return verify

    n, next_token, accepted, cache, features, drafted = jax.lax.switch(
        bucket, [verify_at(size) for size in buckets], nodes)
    n, next_token = _within_limit(n, next_token, accepted, state.draft_limit)
    advance = jnp.where(state.done, 0, n + 1)
    path_positions = state.lengths[:, None] + jnp.arange(block, dtype=jnp.int32)  # [S, K+1]
    context = append_context(parts.drafter, dcfg, state.context_cache, features, path_positions, state.lengths,
                             state.lengths + advance)
    state = state.replace(tree_sizes=state.tree_sizes + live[:, None] * (jnp.arange(len(buckets)) == bucket),
                          tree_chosen=state.tree_chosen + live * chosen.astype(jnp.int32),
                          refine_passes=state.refine_passes + live * jnp.asarray(passes, jnp.int32))
    return _commit(state, accepted, n, next_token, keys, cache, context, statics, drafted=drafted)


def _commit(state: SlotState, draft, n, next_token, keys, target_cache, context_cache, statics: SlotStatics,
            drafted):
    """Write d_1..d_n and next_token to each live row; rows already done keep everything but caches.
    drafted: draft tokens the step checked per live row."""
    eos = _eos_array(statics.eos_token_ids)
    live = ~state.done
    tokens, num_generated, done, advance = commit_tokens(state.tokens, state.num_generated, state.done, draft, n,
                                                         next_token, eos, state.max_new_tokens)
    slot = jnp.arange(statics.block, dtype=jnp.int32)[None, :]
    if state.history is not None:  # last_token and the drafts after it go to their cache slots
        written = jnp.concatenate([state.last_token[:, None], draft], axis=1)  # [S, 1 + K]
        columns = state.lengths[:, None] + jnp.arange(written.shape[1], dtype=jnp.int32)
        columns = jnp.where(live[:, None], columns, state.history.shape[1])  # done rows: dropped
        # Slots past the accepted run hold rejected drafts until the next step overwrites them; the
        # proposer reads only below the row's length.
        state = state.replace(history=state.history.at[jnp.arange(columns.shape[0])[:, None], columns].set(
            written, mode="drop"))
    return state.replace(
        tokens=tokens,
        num_generated=num_generated,
        last_token=jnp.where(live, next_token, state.last_token),
        lengths=state.lengths + advance,
        done=done,
        keys=keys,
        steps=state.steps + live,
        accepted_histogram=state.accepted_histogram + live[:, None] * (slot == n[:, None]),
        drafted=state.drafted + live * drafted,
        target_cache=target_cache,
        context_cache=context_cache,
    )


def _ngram_step(parts: SlotParts, state: SlotState, statics: SlotStatics, attend_slots: int | None) -> SlotState:
    """Prompt lookup (decode/ngram.py): copy each row's drafts from its own context, verify them in
    one target pass and accept per row. The drafts are one-hot draws, so speculative sampling with
    q = their one-hot keeps the target's distribution exactly. A row with no match verifies filler
    that it never commits (its limit is 0), taking the target's one token."""
    tcfg, dcfg = statics.target_config, statics.drafter_config
    drafts = statics.ngram.drafts
    keys, accept_keys = split_row_keys(state.keys, 2)
    draft, available = propose_ngram(state.history, state.lengths, state.last_token, statics.ngram)  # [S, K], [S]
    verify_tokens = jnp.concatenate([state.last_token[:, None], draft], axis=1)  # [S, K + 1]
    positions = state.lengths[:, None] + jnp.arange(drafts + 1, dtype=jnp.int32)
    taps = () if dcfg is None else dcfg.target_layer_ids  # slots with a drafter keep its context current
    out = forward(parts.target, tcfg, verify_tokens, positions, state.target_cache, state.lengths,
                  hidden_layers=taps, attend_slots=attend_slots)  # logits [S, K + 1, V]

    def sampled_acceptance():
        q = jax.nn.one_hot(draft, tcfg.vocab_size, dtype=jnp.float32)  # [S, K, V]
        p = jax.nn.softmax(row_processed_logits(out.logits, state.sampling), axis=-1)
        one_row = lambda d, qq, pp, k: accept_sampled(d[None], qq[None], pp[None], jax.random.wrap_key_data(k))  # noqa
        n, next_token = jax.vmap(one_row)(draft, q, p, accept_keys)
        return n[:, 0], next_token[:, 0]

    n, next_token = jax.lax.cond(_any_sampled(state.sampling), sampled_acceptance,
                                 lambda: accept_greedy(draft, out.logits))
    n, next_token = _within_limit(n, next_token, draft, jnp.minimum(state.draft_limit, available))
    context = state.context_cache
    if dcfg is not None:
        advance = jnp.where(state.done, 0, n + 1)
        context = append_context(parts.drafter, dcfg, context, out.hidden, positions, state.lengths,
                                 state.lengths + advance)
    return _commit(state, draft, n, next_token, keys, out.cache, context, statics, drafted=available)


def _auto_step(parts: SlotParts, state: SlotState, statics: SlotStatics, attend_slots: int | None) -> SlotState:
    """One step of AR, chain or tree for the whole batch, whichever decode/auto.py predicts commits
    the most tokens per second from the latency model (parts.tree_costs) and what each policy
    committed when it last ran; then the estimates are updated from what this step committed."""
    auto, costs = state.auto, parts.tree_costs
    block = statics.drafter_config.block_size
    seconds = policy_seconds(auto, costs, block)
    choice = choose_policy(auto, seconds, statics.auto)
    branches = [lambda st, m=SLOT_METHODS[name]: m.one_step(parts, st, statics, attend_slots)
                for name in AUTO_POLICIES]
    stepped = jax.lax.switch(choice, branches, state)
    # What each live row committed, from its accepted-length histogram (a step that accepted n
    # drafts commits n + 1 tokens, whatever an EOS or the token limit then keeps).
    counts = (stepped.accepted_histogram - state.accepted_histogram).sum(axis=0)  # [block]
    steps = counts.sum()
    committed = jnp.where(steps > 0, (counts * jnp.arange(1, block + 1)).sum() / jnp.maximum(steps, 1), jnp.nan)
    live = ~state.done
    chosen = jnp.max(jnp.where(live, stepped.tree_chosen - state.tree_chosen, 0))  # the tree's size, batch-wide
    tree_seconds = costs.fixed_s + costs.verify_cost(jnp.maximum(chosen, 1))
    return stepped.replace(auto=observe(auto, choice, committed, tree_seconds, statics.auto, seconds))


@dataclasses.dataclass(frozen=True)
class SlotMethod:
    """One decoding method at slot level."""

    name: str
    one_step: Callable
    """(parts, state, statics, attend_slots) -> state: one verify step for every live row."""
    needs_drafter: bool = True
    needs_refiner: bool = False
    needs_tree: bool = False
    drafts: int | None = None
    """Drafts a chain step verifies (None: the drafter's whole block)."""
    needs_retrieval: bool = False
    """Drafts from each row's drafting prompt (rapid, rapid+block): inserts need one per row."""
    needs_ngram: bool = False
    """Drafts by prompt lookup from each row's token history (SlotStatics.ngram)."""
    needs_auto: bool = False
    """Chooses its policy at each step from measured costs and yields (SlotStatics.auto)."""

    @property
    def family(self) -> str:
        """The registry method this one is a draft-limited tier of ("chain" for "chain:3"), or its name."""
        return self.name.partition(":")[0]

    @property
    def speculates(self) -> bool:
        """Drafts and verifies (every method but ar): a row limited to 0 drafts decodes as ar does."""
        return self.needs_drafter or self.needs_retrieval or self.needs_ngram

    @property
    def target_drafts(self) -> bool:
        """The target itself drafts, from each row's retrieved passages (rapid; SlotStatics.rapid)."""
        return self.needs_retrieval and not self.needs_drafter

    @property
    def takes_draft_limit(self) -> bool:
        """A block method: "family:K" verifies K drafts of its block (BLOCK_METHODS)."""
        return self.family in BLOCK_METHODS

    def writes(self, block: int, largest_tree: int = 0, rapid_drafts: int = 0, ngram_drafts: int = 0) -> int:
        """Most cache slots one step writes past a row's committed tokens, with a drafter of this
        block (1 without one), trees of at most largest_tree nodes, and rapid's or ngram's drafts.
        Sliding layers keep KV rings this much past their window; a cache must hold it past the
        longest answer."""
        if self.target_drafts:  # rapid verifies its drafts and the last token
            return rapid_drafts + 1
        if self.needs_ngram:
            return ngram_drafts + 1
        if not self.needs_drafter:
            return 1
        chain = block if self.drafts is None else self.drafts + 1
        if self.needs_auto:  # either a chain or a tree, chosen per step
            return max(chain, largest_tree)
        return largest_tree if self.needs_tree else chain

    def limited_to(self, drafts: int) -> str:
        """The name of this method's tier verifying `drafts` drafts ("chain:3")."""
        if not self.takes_draft_limit:
            raise SpecjaxError(f"method {self.name!r} takes no draft limit; block methods: {', '.join(BLOCK_METHODS)}")
        return f"{self.family}:{drafts}"


SLOT_METHODS: dict[str, SlotMethod] = {
    "ar": SlotMethod("ar", _ar_step, needs_drafter=False),
    "chain": SlotMethod("chain", _chain_step),
    "chain+refiner": SlotMethod("chain+refiner", partial(_chain_step, refined=True), needs_refiner=True),
    "tree": SlotMethod("tree", _tree_step, needs_tree=True),
    "tree+refiner": SlotMethod("tree+refiner", partial(_tree_step, refined=True), needs_refiner=True, needs_tree=True),
    "rapid": SlotMethod("rapid", _rapid_step, needs_drafter=False, needs_retrieval=True),
    "rapid+block": SlotMethod("rapid+block", _chain_step, needs_retrieval=True),
    "ngram": SlotMethod("ngram", _ngram_step, needs_drafter=False, needs_ngram=True),
    "auto": SlotMethod("auto", _auto_step, needs_tree=True, needs_auto=True),
}


BLOCK_METHODS = ("chain", "chain+refiner", "rapid+block")
"""Methods that verify a drafter's block, and so take a draft limit: "chain:K" verifies K drafts."""


@dataclasses.dataclass(frozen=True)
class MethodPart:
    """A part some methods use (a drafter, trees, retrieval ...), and the settings only it reads."""

    describes: str
    """How an error names the methods that use it ("methods with a drafter")."""
    used_by: Callable[[SlotMethod], bool]
    settings: tuple[str, ...]
    """The option names (config fields, as the CLI spells them with "_") that only this part reads,
    so a front end can refuse one given to methods that would silently ignore it."""

    def users(self) -> list[str]:
        return [name for name, method in SLOT_METHODS.items() if self.used_by(method)]


METHOD_PARTS: tuple[MethodPart, ...] = (
    MethodPart("a drafter", lambda m: m.needs_drafter, ("drafter", "block_size", "drafter_window")),
    MethodPart("a refiner", lambda m: m.needs_refiner,
               ("refiner", "refine_passes", "no_adaptive_refine", "refine_keep_confident", "refine_slots")),
    MethodPart("trees", lambda m: m.needs_tree,
               ("tree_budget", "tree_shape", "tree_buckets", "tree_top_k", "tree_width")),
    MethodPart("the target drafting from retrieved passages", lambda m: m.target_drafts,
               ("rapid_drafts", "rapid_eta")),
    MethodPart("prompt lookup", lambda m: m.needs_ngram, ("ngram_drafts", "ngram_max", "ngram_min")),
    MethodPart("retrieval", lambda m: m.needs_retrieval,
               ("retriever", "chunk_tokens", "retrieval_budget", "retrieval_top_k", "retrieval_min_score",
                "redraft_every", "drafting_length")),
)
"""Every per-method part, for the front ends' checks of which options a choice of methods reads."""


def slot_method(name: str) -> SlotMethod:
    """A method of SLOT_METHODS, or a block method verifying fewer drafts than its block: "chain:K",
    "chain+refiner:K" or "rapid+block:K" (K >= 1), the draft-length tiers an adaptive server
    switches between and what a target padded to fewer query rows than the block verifies."""
    if name in SLOT_METHODS:
        return SLOT_METHODS[name]
    base, sep, drafts = name.partition(":")
    if sep and base in BLOCK_METHODS and drafts.isdigit() and int(drafts) >= 1:
        chain = SLOT_METHODS[base]
        return dataclasses.replace(chain, name=name, one_step=partial(chain.one_step, drafts=int(drafts)),
                                   drafts=int(drafts))
    raise SpecjaxError(f"unknown method {name!r}; methods: {', '.join(SLOT_METHODS)}, or "
                       f"{', '.join(b + ':K' for b in BLOCK_METHODS)} for a block method verifying K drafts")


def method_within_query_rows(name: str, block: int, query_rows: int | None) -> str:
    """The method a target padded to query_rows = W rows runs for `name`, verifying at most W rows.
    A verify pass is the same computation as W-row AR steps only when it has their W rows, so a
    block method whose block is larger than W verifies its first W - 1 drafts ("chain" -> "chain:3"
    at W = 4); one that names more drafts than that is refused. Trees are fitted by
    TreeConfig.within_query_rows; rapid by RapidConfig.within_query_rows. A draft limit longer than
    the block is refused, padded or not."""
    method = slot_method(name)
    if method.drafts is not None and method.drafts > block - 1:
        raise SpecjaxError(f"method {name!r} verifies {method.drafts} drafts; the drafter's block holds {block - 1}")
    if query_rows is None or not method.takes_draft_limit:
        return method.name
    drafts = block - 1 if method.drafts is None else method.drafts
    if drafts + 1 <= query_rows:
        return method.name
    if method.drafts is not None:
        raise SpecjaxError(f"method {name!r} verifies {drafts + 1} rows, more than the target's query_rows "
                           f"({query_rows}); use at most {query_rows - 1} drafts or raise --query-rows")
    return method.limited_to(query_rows - 1)


def check_method(name: str, statics: SlotStatics, parts: SlotParts | None = None) -> SlotMethod:
    """The method, after checking that the statics (and parts) hold what it reads."""
    method = slot_method(name)
    missing = [what for what, needed, there in (
        ("a drafter", method.needs_drafter, statics.drafter_config is not None),
        ("a refiner", method.needs_refiner, statics.refiner_config is not None),
        ("a tree config", method.needs_tree, statics.tree is not None),
        ("an n-gram config (SlotStatics.ngram)", method.needs_ngram, statics.ngram is not None),
        ("an auto config (SlotStatics.auto)", method.needs_auto, statics.auto is not None),
        ("a drafting context (SlotStatics.drafting_length)", method.needs_retrieval, statics.drafting_length > 0),
        # rapid drafts with the target on its retrieval cache; rapid+block with the drafter on
        # drafting-prompt features.
        ("SlotStatics.rapid", method.target_drafts, statics.rapid is not None),
        ("SlotStatics.drafter_on_retrieval", method.needs_retrieval and method.needs_drafter,
         statics.drafter_on_retrieval),
        ("a drafter context at full-prompt positions (not drafter_on_retrieval)",
         method.needs_drafter and not method.needs_retrieval, not statics.drafter_on_retrieval)) if needed and not there]
    if missing:
        raise SpecjaxError(f"method {name!r} needs {' and '.join(missing)}")
    if method.drafts is not None and method.drafts > statics.block - 1:
        raise SpecjaxError(f"method {name!r} verifies {method.drafts} drafts; the drafter's block holds "
                           f"{statics.block - 1}")
    if method.needs_auto and not statics.tree.auto:
        raise SpecjaxError(f"method {name!r} sizes its trees by the budget rule; give no fixed tree budget")
    if method.needs_tree and statics.tree.auto and parts is not None and parts.tree_costs is None:
        raise SpecjaxError(f"method {name!r} sizes trees by measured costs; give SlotParts.tree_costs "
                           f"(or a fixed tree budget)")
    return method


@partial(jax.jit, static_argnames=("method", "statics", "attend_slots", "rows"), donate_argnames=("state",))
def step(parts: SlotParts, state: SlotState, *, method: str, statics: SlotStatics,
         attend_slots: int | None = None, rows: int | None = None) -> SlotState:
    """steps_per_sync verify steps for every live slot, in one device call.

    attend_slots (static): the target attends to the first attend_slots cache slots only. The caller
    guarantees every live row's length + steps_per_sync * statics.step_writes fits in it; one
    compiled step per bucket of it lets short contexts skip reading the rest of the cache.
    rows (static): step only the first `rows` slots, where the caller keeps every live row
    (`move_row` packs them); the rest are not computed. None: every slot."""
    one_step = check_method(method, statics, parts).one_step
    run = lambda s: jax.lax.fori_loop(0, statics.slot.steps_per_sync,  # noqa: E731
                                      lambda _, x: one_step(parts, x, statics, attend_slots), s)
    if rows is None or rows >= statics.slot.slots:
        return run(state)
    stepped = run(jax.tree.map(lambda whole: whole[:rows], state))
    return jax.tree.map(lambda whole, part: whole.at[:rows].set(part), state, stepped)


@partial(jax.jit, static_argnames=("method", "statics"), donate_argnames=("state",))
def run_to_end(parts: SlotParts, state: SlotState, *, method: str, statics: SlotStatics) -> SlotState:
    """Verify steps until every row is done, in one device call: batch generation without a host
    sync, on the same step the server and streaming drive."""
    one_step = check_method(method, statics, parts).one_step
    return jax.lax.while_loop(lambda s: ~jnp.all(s.done), lambda s: one_step(parts, s, statics, None), state)


def take_row(state: SlotState, slot) -> SlotState:
    """Slot `slot`'s whole state (caches included), every array without its slot axis: what a
    preempted request parks on the host and `put_row` writes back."""
    return jax.tree.map(lambda whole: whole[slot], state)


def put_row(state: SlotState, row: SlotState, target) -> SlotState:
    """Write a row taken by `take_row` into slot `target`: its request goes on exactly where it was."""
    return jax.tree.map(lambda whole, part: whole.at[target].set(part), state, row)


@partial(jax.jit, donate_argnames=("state",))
def move_row(state: SlotState, source, target) -> SlotState:
    """Copy slot `source`'s whole state (caches included) to slot `target`; source is then free."""
    return jax.tree.map(lambda whole: whole.at[target].set(whole[source]), state)


def measure_phase_seconds(parts: SlotParts, statics: SlotStatics, refined: bool, repeats: int = 3) -> dict:
    """Median seconds of one draft (a drafter pass; rapid: its K target passes on the drafting
    context), one refinement pass (refined methods only) and one verify pass over a block per row
    (rapid: K + 1 tokens), at this slot batch with every cache half full. A step is one fused
    device call; these proportions are how its wall time is split between the phases."""
    tcfg, dcfg = statics.target_config, statics.drafter_config
    rows = statics.slot.slots
    half = lambda length: jnp.full((rows,), length // 2, jnp.int32)  # noqa: E731
    state = empty_slots(statics).replace(lengths=half(statics.slot.cache_length))
    if statics.rapid is not None:  # the target drafts on its retrieval cache, K passes of one token
        block, taps = statics.rapid.drafts + 1, ()
        state = state.replace(drafting_lengths=half(statics.drafting_length))
        greedy = lambda logits, keys: (jnp.argmax(logits, axis=-1).astype(jnp.int32), ())  # noqa: E731

        def draft(parts, state):
            keys = jnp.zeros((statics.rapid.drafts, rows, 2), jnp.uint32)
            return draft_on_retrieved(parts.target, tcfg, state.drafting_cache, state.drafting_lengths,
                                      state.drafting_previous, state.last_token, keys, greedy)[0]
    else:
        block, taps = dcfg.block_size, dcfg.target_layer_ids
        if statics.drafter_on_retrieval:  # rapid+block drafts at drafting-context positions
            state = state.replace(drafting_lengths=half(statics.drafting_length))

        def draft(parts, state):
            at = state.drafting_lengths if statics.drafter_on_retrieval else state.lengths
            hidden = draft_block_states(parts.target, tcfg, parts.drafter, dcfg, state.last_token, at,
                                        state.context_cache)
            return hidden, apply_head(hidden, parts.head)

    def verify(parts, state):
        tokens = jnp.zeros((rows, block), jnp.int32)
        positions = state.lengths[:, None] + jnp.arange(block, dtype=jnp.int32)
        return forward(parts.target, tcfg, tokens, positions, state.target_cache, state.lengths,
                       hidden_layers=taps).logits

    draft_fn, verify_fn = jax.jit(draft), jax.jit(verify)
    out = {"draft": median_seconds(repeats, lambda: draft_fn(parts, state))}
    if refined:
        hidden, logits = draft_fn(parts, state)
        index = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        one_pass = dataclasses.replace(statics, refine=RefineConfig(max_passes=1, adaptive=False))
        refine_fn = jax.jit(lambda p, s, h, lg: _refine(p, s, one_pass, h, lg, index, s.keys, jnp.bool_(False)))
        # The loop casts the embedding table once per call, outside its steps (token_embedder); so
        # does this measurement, or a pass would count a copy of the whole table.
        cast_parts = parts.replace(target=jax.jit(with_float32_embedding)(parts.target))
        out["refine"] = median_seconds(repeats, lambda: refine_fn(cast_parts, state, hidden, logits))
    out["verify"] = median_seconds(repeats, lambda: verify_fn(parts, state))
    return out
