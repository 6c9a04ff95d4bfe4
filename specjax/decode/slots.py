"""Step-level decoding over a fixed set of slots: the API continuous batching stands on.

After JetStream's engine API: a fixed batch of S slots whose target KV cache and drafter context
are allocated once; `insert` prefills prompts into chosen slots while the other slots keep their
state; `step` advances every occupied slot by `steps_per_sync` verify steps inside one device call;
freeing a slot is the host forgetting it (the next insert overwrites the whole row).

Each slot carries its own sampling parameters and its own PRNG key, so a request samples the same
tokens whatever else shares the batch, and greedy and sampled requests share one step. A greedy row
is the sampled path with a one-hot distribution on the argmax (see `row_processed_logits`): the
acceptance rule then accepts exactly the drafts that match the argmax, and resamples the argmax.

Methods live in one registry, `SLOT_METHODS`; a method is a pair of pure functions (insert, step)
over the same `SlotState`, and the host side (specjax/serve) never branches on method names.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
from flax import struct

from specjax.decode.autoregressive import _eos_array, prefill
from specjax.decode.context import DrafterContext, append_context, empty_context_cache, prefill_context
from specjax.decode.speculative import _to_full_vocabulary, commit_tokens, draft_block
from specjax.decode.verify import accept_greedy, accept_sampled
from specjax.errors import SpecjaxError, check_at_least
from specjax.models.cache import KVCache
from specjax.models.config import TransformerConfig
from specjax.models.drafter import DrafterConfig
from specjax.models.transformer import forward, head_matrix


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
    target_cache: KVCache
    context_cache: DrafterContext | None
    """The drafter's context per row, or None for autoregressive decoding."""


@dataclasses.dataclass(frozen=True)
class SlotStatics:
    """The static arguments every slot function takes (hashable, so jit keys on them)."""

    target_config: TransformerConfig
    slot: SlotConfig
    eos_token_ids: tuple[int, ...]
    drafter_config: DrafterConfig | None = None

    @property
    def block(self) -> int:
        """Tokens one verify step may write: the drafter's block, or 1 for AR."""
        return 1 if self.drafter_config is None else self.drafter_config.block_size


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
        target_cache=KVCache.zeros(statics.target_config, s, statics.slot.cache_length),
        context_cache=(None if statics.drafter_config is None
                       else empty_context_cache(statics.drafter_config, s, statics.slot.cache_length)),
    )


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


def _put_rows(whole, part, rows):
    """Scatter part [R, ...] into whole [S, ...] at rows [R]; an out-of-range row is dropped."""
    return jax.tree.map(lambda w, p: w.at[rows].set(p.astype(w.dtype), mode="drop"), whole, part)


@partial(jax.jit, static_argnames=("statics",), donate_argnames=("state",))
def insert(params, drafter_params, state: SlotState, request: InsertRequest, *, statics: SlotStatics) -> SlotState:
    """Prefill R prompts and place them, with their first token, into their slots; others untouched."""
    count = request.rows.shape[0]
    dcfg = statics.drafter_config
    taps = () if dcfg is None else dcfg.target_layer_ids
    logits, cache, features = prefill(params, statics.target_config, request.prompts, request.prompt_lengths,
                                      statics.slot.cache_length, hidden_layers=taps)
    keys = jax.vmap(lambda seed: jax.random.key_data(jax.random.key(seed)))(request.seeds)  # [R, 2]
    keys, first_keys = split_row_keys(keys, 2)
    first = row_categorical(first_keys, row_processed_logits(logits, request.sampling))  # [R]
    limit = jnp.minimum(request.max_new_tokens, statics.slot.max_new_tokens)
    rows = request.rows
    put = lambda whole, part: _put_rows(whole, part, rows)  # noqa: E731
    fresh = dict(
        tokens=put(state.tokens, jnp.zeros((count, state.tokens.shape[1]), jnp.int32).at[:, 0].set(first)),
        num_generated=put(state.num_generated, jnp.ones((count,), jnp.int32)),
        max_new_tokens=put(state.max_new_tokens, limit),
        last_token=put(state.last_token, first),
        lengths=put(state.lengths, request.prompt_lengths),
        done=put(state.done, jnp.isin(first, _eos_array(statics.eos_token_ids)) | (limit <= 1)),
        keys=put(state.keys, keys),
        sampling=put(state.sampling, request.sampling),
        steps=put(state.steps, jnp.zeros((count,), jnp.int32)),
        accepted_histogram=put(state.accepted_histogram, jnp.zeros((count, statics.block), jnp.int32)),
        target_cache=put(state.target_cache, cache),
    )
    if dcfg is not None:
        context = prefill_context(drafter_params, dcfg, count, statics.slot.cache_length, features,
                                  request.prompt_lengths)
        fresh["context_cache"] = put(state.context_cache, context)
    return state.replace(**fresh)


def _any_sampled(sampling: RowSampling) -> jax.Array:
    """[] bool: some row samples. When none does, steps take argmax paths and draw no random numbers,
    which is most of a batched step's cost beyond the forward passes on CPU."""
    return jnp.any(sampling.temperature > 0)


def _ar_step(params, drafter_params, head, draft_vocab, state: SlotState, statics: SlotStatics,
             attend_slots: int | None) -> SlotState:
    """One token for every live row."""
    keys, draw_keys = split_row_keys(state.keys, 2)
    out = forward(params, statics.target_config, state.last_token[:, None], state.lengths[:, None],
                  state.target_cache, state.lengths, attend_slots=attend_slots)
    logits = out.logits[:, 0]  # [S, V]
    token = jax.lax.cond(_any_sampled(state.sampling),
                         lambda: row_categorical(draw_keys, row_processed_logits(logits, state.sampling)),
                         lambda: jnp.argmax(logits, axis=-1).astype(jnp.int32))  # [S]
    return _commit(state, jnp.zeros((state.lengths.shape[0], 0), jnp.int32), jnp.zeros_like(token), token, keys,
                   out.cache, state.context_cache, statics)


def _chain_step(params, drafter_params, head, draft_vocab, state: SlotState, statics: SlotStatics,
                attend_slots: int | None) -> SlotState:
    """Draft a block, verify it in one target pass, accept per row (speculative sampling, which is
    greedy acceptance on greedy rows)."""
    tcfg, dcfg = statics.target_config, statics.drafter_config
    block = dcfg.block_size
    keys, draft_keys, accept_keys = split_row_keys(state.keys, 3)
    logits = draft_block(params, tcfg, drafter_params, dcfg, state.last_token, state.lengths, state.context_cache,
                         head)  # [S, K, V']
    sampled = _any_sampled(state.sampling)
    draft_index = jax.lax.cond(
        sampled, lambda: row_categorical(draft_keys, row_processed_logits(logits, state.sampling)),
        lambda: jnp.argmax(logits, axis=-1).astype(jnp.int32))  # [S, K]
    draft, _ = _to_full_vocabulary(draft_index, None, draft_vocab, tcfg.vocab_size)

    verify_tokens = jnp.concatenate([state.last_token[:, None], draft], axis=1)  # [S, Bk]
    positions = state.lengths[:, None] + jnp.arange(block, dtype=jnp.int32)
    out = forward(params, tcfg, verify_tokens, positions, state.target_cache, state.lengths,
                  hidden_layers=dcfg.target_layer_ids, attend_slots=attend_slots)  # logits [S, Bk, V], hidden

    def sampled_acceptance():
        # q is recomputed from the same drafter logits the drafts were drawn from, so it is their q.
        q = jax.nn.softmax(row_processed_logits(logits, state.sampling), axis=-1)
        _, q = _to_full_vocabulary(draft_index, q, draft_vocab, tcfg.vocab_size)
        p = jax.nn.softmax(row_processed_logits(out.logits, state.sampling), axis=-1)
        one_row = lambda d, qq, pp, k: accept_sampled(d[None], qq[None], pp[None], jax.random.wrap_key_data(k))  # noqa
        n, next_token = jax.vmap(one_row)(draft, q, p, accept_keys)
        return n[:, 0], next_token[:, 0]

    n, next_token = jax.lax.cond(sampled, sampled_acceptance, lambda: accept_greedy(draft, out.logits))
    advance = jnp.where(state.done, 0, n + 1)
    context = append_context(drafter_params, dcfg, state.context_cache, out.hidden, positions, state.lengths,
                             state.lengths + advance)
    return _commit(state, draft, n, next_token, keys, out.cache, context, statics)


def _commit(state: SlotState, draft, n, next_token, keys, target_cache, context_cache, statics: SlotStatics):
    """Write d_1..d_n and next_token to each live row; rows already done keep everything but caches."""
    eos = _eos_array(statics.eos_token_ids)
    live = ~state.done
    tokens, num_generated, done, advance = commit_tokens(state.tokens, state.num_generated, state.done, draft, n,
                                                         next_token, eos, state.max_new_tokens)
    slot = jnp.arange(statics.block, dtype=jnp.int32)[None, :]
    return state.replace(
        tokens=tokens,
        num_generated=num_generated,
        last_token=jnp.where(live, next_token, state.last_token),
        lengths=state.lengths + advance,
        done=done,
        keys=keys,
        steps=state.steps + live,
        accepted_histogram=state.accepted_histogram + live[:, None] * (slot == n[:, None]),
        target_cache=target_cache,
        context_cache=context_cache,
    )


@dataclasses.dataclass(frozen=True)
class SlotMethod:
    """One decoding method at slot level."""

    name: str
    needs_drafter: bool
    one_step: Callable
    """(params, drafter_params, head, draft_vocab, state, statics, attend_slots) -> state: one verify step."""


SLOT_METHODS: dict[str, SlotMethod] = {
    "ar": SlotMethod("ar", needs_drafter=False, one_step=_ar_step),
    "chain": SlotMethod("chain", needs_drafter=True, one_step=_chain_step),
}


def slot_method(name: str) -> SlotMethod:
    if name not in SLOT_METHODS:
        raise SpecjaxError(f"method {name!r} cannot serve yet; serving methods: {', '.join(SLOT_METHODS)}")
    return SLOT_METHODS[name]


@partial(jax.jit, static_argnames=("method", "statics", "attend_slots"), donate_argnames=("state",))
def step(params, drafter_params, draft_vocab, state: SlotState, *, method: str, statics: SlotStatics,
         attend_slots: int | None = None) -> SlotState:
    """steps_per_sync verify steps for every live slot, in one device call.

    attend_slots (static): the target attends to the first attend_slots cache slots only. The caller
    guarantees every live row's length + steps_per_sync * (verify writes) fits in it; one compiled
    step per bucket of it lets short contexts skip reading the rest of the cache."""
    one_step = SLOT_METHODS[method].one_step
    head = None if statics.drafter_config is None else head_matrix(params, statics.target_config, draft_vocab)
    return jax.lax.fori_loop(
        0, statics.slot.steps_per_sync,
        lambda _, s: one_step(params, drafter_params, head, draft_vocab, s, statics, attend_slots), state)
