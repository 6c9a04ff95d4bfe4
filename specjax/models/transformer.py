"""The target model: one decoder for the Llama, Mistral, Qwen3 and Gemma (1, 2, 3 text) families.

Functional use: `params = init_params(config, rng)` and `forward(params, config, ...)` are pure, so
they sit inside `jit` and `lax.while_loop`. The layers are unrolled in Python rather than scanned:
on a 2-core CPU an unrolled 30-layer SmolLM2 decode step measured about 1.7x faster than a
`lax.scan` over stacked layers (see docs/notes/2026-12-02-ar-decoding.md), and every layer keeps its own params subtree,
which also mirrors the HF checkpoint layout one to one.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import struct

from specjax.models.cache import KVCache, read_cache, ring_index, write_ring, write_rows
from specjax.models.config import TransformerConfig
from specjax.models.layers import (PackedSlots, RMSNorm, SwiGLU, apply_rope, attention_mask, causal_block_mask, dense,
                                   dot_general_for, grouped_query_attention, packed_attention, packed_slots,
                                   rope_tables, sliding_masks)
from specjax.pallas_kernels.tree_attention import tree_attention_op
from specjax.pallas_kernels.window_attention import masked_attention, merge_attention, window_attention_op


class Attention(nn.Module):
    config: TransformerConfig
    window: int | None = None
    """This layer's sliding window (None: full attention)."""

    @nn.compact
    def __call__(self, x, cos, sin, cached_k, cached_v, write_index, mask, block_mask, positions, valid_lengths=None,
                 empty_cache: bool = False):
        """mask: for a full layer, [B, T, S] over the cache after this step's write, or its PackedSlots
        form (XLA path); for a sliding layer, the pair (committed [B, T, R], own [B, T, T]) of
        `sliding_masks`.
        block_mask: [B, T, T] among the new tokens (causal when None), the structured form the
        kernels take instead of a dense mask; positions: [B, T] the new tokens' positions;
        valid_lengths: [B] new tokens per row worth keeping in a ring (default all); empty_cache:
        the cache holds nothing yet, so a sliding layer attends to the new tokens alone."""
        cfg = self.config
        dtype = jnp.dtype(cfg.dtype)
        batch, num_new, _ = x.shape
        proj = lambda n, name: dense(n, cfg.attention_bias, dtype, name)
        q = proj(cfg.num_heads * cfg.head_dim, "q_proj")(x).reshape(batch, num_new, cfg.num_heads, cfg.head_dim)
        k = proj(cfg.num_kv_heads * cfg.head_dim, "k_proj")(x).reshape(batch, num_new, cfg.num_kv_heads, cfg.head_dim)
        v = proj(cfg.num_kv_heads * cfg.head_dim, "v_proj")(x).reshape(batch, num_new, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = RMSNorm(cfg.rms_norm_eps, dtype, cfg.norm_unit_offset, name="q_norm")(q)
            k = RMSNorm(cfg.rms_norm_eps, dtype, cfg.norm_unit_offset, name="k_norm")(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # [B, T, H, D], [B, T, K, D]
        # Projections accumulate in float32; attention takes the compute dtype again. K/V are first
        # rounded to the cache's dtype, so new tokens see each other as later steps will see them.
        kv_dtype = jnp.dtype(cfg.cache_dtype)
        q, k, v = q.astype(dtype), k.astype(kv_dtype).astype(dtype), v.astype(kv_dtype).astype(dtype)
        scores = cfg.attention_scores()
        if self.window is not None:
            out = self._sliding(q, k, v, read_cache(cached_k, dtype), read_cache(cached_v, dtype), write_index, mask, positions,
                                empty_cache)
            # Written after reading: the ring may hold fewer slots than the new tokens reach back.
            cached_k = write_ring(cached_k, k, write_index, valid_lengths)  # [B, R, K, D]
            cached_v = write_ring(cached_v, v, write_index, valid_lengths)
        else:
            cached_k = write_rows(cached_k, k, write_index)  # [B, S, K, D]
            cached_v = write_rows(cached_v, v, write_index)
            if cfg.attention == "pallas":
                if block_mask is None:
                    block_mask = causal_block_mask(batch, num_new)
                # Slots before write_index are the committed prefix; the new tokens' own K/V come directly.
                out = tree_attention_op(q, read_cache(cached_k, dtype), read_cache(cached_v, dtype), write_index, k, v,
                                        block_mask, implementation="pallas", scores=scores)  # [B, T, H, D]
            else:
                # A mask shorter than the cache (forward's attend_slots) reads only that many slots:
                # attention then costs what the rows' contexts need, not the whole cache.
                packed = isinstance(mask, PackedSlots)
                read = (mask.visible if packed else mask).shape[-1]
                attend = packed_attention if packed else grouped_query_attention
                out = attend(q, read_cache(cached_k[:, :read], dtype), read_cache(cached_v[:, :read], dtype), mask,
                             scores)  # [B, T, H, D]
        out = dense(cfg.hidden_size, cfg.attention_bias, dtype, "o_proj")(
            out.reshape(batch, num_new, cfg.num_heads * cfg.head_dim)
        )
        return out, cached_k, cached_v

    def _sliding(self, q, k, v, cached_k, cached_v, write_index, masks, positions, empty_cache):
        """A sliding layer: the committed tokens in the cache (a ring of R slots, read before this
        step's write) and the new tokens' own K/V under their block mask, each windowed, merged by
        log-sum-exp. [B, T, H, D]

        On the Pallas path the committed part goes through the windowed-attention kernel: a query at
        position p sees slots [max(p - W + 1, write_index - R), write_index), which in the ring are
        at most two contiguous index ranges (the second when the range wraps past index R - 1)."""
        committed_mask, own_mask = masks
        scores = self.config.attention_scores()
        own = masked_attention(q, k, v, own_mask, scores)
        if empty_cache:  # a prefill or a training forward: nothing committed to attend to
            return own[0]
        if self.config.attention != "pallas":
            return merge_attention([masked_attention(q, cached_k, cached_v, committed_mask, scores), own])[0]
        ring = cached_k.shape[1]
        w = write_index.astype(jnp.int32)[:, None]  # [B, 1]
        lowest = jnp.maximum(jnp.maximum(positions - self.window + 1, 0), w - ring)  # [B, T] first visible slot
        count = jnp.maximum(w - lowest, 0)  # [B, T]
        first = ring_index(lowest, ring)  # [B, T]
        wrapped = jnp.maximum(first + count - ring, 0)  # [B, T] indices 0 .. wrapped-1 continue the range
        parts = [window_attention_op(q, cached_k, cached_v, first, first + count - wrapped, implementation="pallas",
                                     scores=scores),
                 window_attention_op(q, cached_k, cached_v, jnp.zeros_like(first), wrapped, implementation="pallas",
                                     scores=scores),
                 own]
        return merge_attention(parts)[0]


class DecoderLayer(nn.Module):
    config: TransformerConfig
    window: int | None = None
    """This layer's sliding window (None: full attention)."""

    @nn.compact
    def __call__(self, x, cos, sin, cached_k, cached_v, write_index, mask, block_mask=None, positions=None,
                 valid_lengths=None, empty_cache: bool = False):
        cfg = self.config
        dtype = jnp.dtype(cfg.dtype)
        norm = lambda name: RMSNorm(cfg.rms_norm_eps, dtype, cfg.norm_unit_offset, name=name)
        attn_out, cached_k, cached_v = Attention(cfg, self.window, name="self_attn")(
            norm("input_layernorm")(x), cos, sin, cached_k, cached_v, write_index, mask, block_mask, positions,
            valid_lengths, empty_cache
        )
        mlp = SwiGLU(cfg.intermediate_size, cfg.mlp_bias, dtype, cfg.hidden_act, name="mlp")
        if cfg.sandwich_norms:  # Gemma 2/3: HF's post_attention_layernorm normalises the attention output
            x = x + norm("post_attention_layernorm")(attn_out)
            x = x + norm("post_feedforward_layernorm")(mlp(norm("pre_feedforward_layernorm")(x)))
        else:
            x = x + attn_out
            x = x + mlp(norm("post_attention_layernorm")(x))
        return x, cached_k, cached_v


@struct.dataclass
class ForwardOutput:
    logits: jax.Array
    """[B, T, V] float32, or [B, N, V] when logit_positions picked N positions."""
    cache: KVCache
    """The cache with the T new tokens written at write_index."""
    hidden: jax.Array | None
    """[B, T, len(hidden_layers), d]: outputs of the requested decoder layers, or None."""


class Transformer(nn.Module):
    config: TransformerConfig

    def setup(self):
        cfg = self.config
        dtype = jnp.dtype(cfg.dtype)
        self.embed_tokens = nn.Embed(
            cfg.vocab_size, cfg.hidden_size, dtype=dtype, embedding_init=nn.initializers.normal(0.02)
        )
        self.layers = [DecoderLayer(cfg, cfg.layer_window(i), name=f"layers_{i}") for i in range(cfg.num_layers)]
        self.norm = RMSNorm(cfg.rms_norm_eps, dtype, cfg.norm_unit_offset)
        if not cfg.tie_word_embeddings:
            self.lm_head = dense(cfg.vocab_size, False, dtype)

    def embed(self, tokens):
        # Gather, then cast: the rows come out as nn.Embed gives them, without casting the whole
        # table first (a float32 table, as token_embedder passes it, stays float32 until gathered).
        table = self.embed_tokens.embedding  # [V, d]
        x = jnp.take(table, tokens, axis=0).astype(self.config.dtype)  # [B, T, d]
        if self.config.scale_embeddings:  # Gemma; HF rounds sqrt(d) to the weights' dtype first
            x = x * jnp.asarray(self.config.hidden_size**0.5, x.dtype)
        return x

    def project_logits(self, hidden):
        """Final norm + LM head. hidden: [B, N, d] (pre-norm) -> [B, N, V] float32."""
        return self.head_only(self.norm(hidden))

    def head_only(self, normed):
        """LM head without the final norm (drafters bring their own norm). [B, N, d] -> [B, N, V]."""
        if self.config.tie_word_embeddings:  # Embed.attend would return the compute dtype
            dtype = jnp.dtype(self.config.dtype)
            logits = dot_general_for(dtype)(normed.astype(dtype), self.embed_tokens.embedding.astype(dtype),
                                            (((normed.ndim - 1,), (1,)), ((), ())))  # [B, N, V]
        else:
            logits = self.lm_head(normed)
        return softcap_logits(logits.astype(jnp.float32), self.config.final_logit_softcapping)

    def __call__(self, tokens, positions, cache: KVCache, write_index, block_mask=None,
                 hidden_layers: Sequence[int] = (), logit_positions=None, valid_lengths=None,
                 empty_cache: bool = False, attend_slots: int | None = None, pack_visible: bool = False):
        cfg = self.config
        x = self.embed(tokens)  # [B, T, d]
        # One (cos, sin) pair per distinct RoPE base: Gemma 3's sliding layers use their own.
        rope = {}
        for i in range(cfg.num_layers):
            if cfg.layer_rope(i) not in rope:
                rope[cfg.layer_rope(i)] = rope_tables(cfg, positions, i)  # [B, T, D/2] each
        full_mask = None  # [B, T, S] for the full layers, shared
        if any(cfg.layer_window(i) is None for i in range(cfg.num_layers)) and cfg.attention != "pallas":
            full_length = max(cache.keys[i].shape[1] for i in range(cfg.num_layers) if cfg.layer_window(i) is None)
            # Full layers read only the first attend_slots slots (the mask's length; see Attention).
            read = min(full_length, attend_slots or full_length)
            if pack_visible and block_mask is not None:
                full_mask = packed_slots(write_index, tokens.shape[1], read, block_mask)
            else:
                full_mask = attention_mask(write_index, tokens.shape[1], read, block_mask)
        sliding = {}  # (window, ring slots) -> (committed [B, T, R], own [B, T, T]), shared by such layers
        keys, values, taps = [], [], {}
        for i, layer in enumerate(self.layers):
            window = cfg.layer_window(i)
            if window is None:
                layer_mask = full_mask
            else:
                ring = cache.keys[i].shape[1]
                if (window, ring) not in sliding:
                    sliding[window, ring] = sliding_masks(write_index, positions, block_mask, window, ring)
                layer_mask = sliding[window, ring]
            cos, sin = rope[cfg.layer_rope(i)]
            x, k, v = layer(x, cos, sin, cache.keys[i], cache.values[i], write_index, layer_mask, block_mask, positions,
                            valid_lengths, empty_cache)
            keys.append(k)
            values.append(v)
            if i in hidden_layers:
                taps[i] = x
        hidden = jnp.stack([taps[i] for i in hidden_layers], axis=2) if hidden_layers else None
        if logit_positions is not None:  # only the rows the caller needs: the LM head is the costliest matmul
            x = jnp.take_along_axis(x, logit_positions[:, :, None], axis=1)  # [B, N, d]
        return ForwardOutput(self.project_logits(x), KVCache(tuple(keys), tuple(values)), hidden)


def init_params(config: TransformerConfig, rng: jax.Array):
    """Random parameters of the right shapes (for tests and training from scratch)."""
    cache = KVCache.zeros(config, 1, 2)
    tokens = jnp.zeros((1, 1), jnp.int32)
    return Transformer(config).init(rng, tokens, tokens, cache, jnp.zeros((1,), jnp.int32))["params"]


def forward(params, config: TransformerConfig, tokens, positions, cache: KVCache, write_index,
            block_mask=None, hidden_layers: Sequence[int] = (), logit_positions=None,
            valid_lengths=None, empty_cache: bool = False, attend_slots: int | None = None,
            pack_visible: bool = False) -> ForwardOutput:
    """Run T new tokens through the model at any cache position.

    tokens, positions: [B, T] int32 (RoPE positions; need not equal cache slots).
    cache: KVCache with S slots; write_index: [B] int32, the slot where token 0 of each row is written.
      The caller guarantees write_index + T <= S: XLA clamps an out-of-range write start, which
      would overwrite committed slots (the Engine sizes caches so this cannot happen).
    block_mask: optional [B, T, T] bool, query x key among the new tokens (default: causal).
    hidden_layers: static decoder-layer indices whose outputs to return (layer i = HF hidden_states[i+1]).
    logit_positions: optional [B, N] int32 indices into T; logits are computed only there.
    valid_lengths: optional [B] int32, how many of the T new tokens of each row are real (a
      right-padded prefill); rings of sliding layers then keep each row's last real tokens.
    empty_cache: static; the caller promises the cache holds nothing yet (a prefill at write_index
      0, a training forward), so sliding layers skip attending to it.
    With config.query_rows = W and T < W (not a prefill), the pass runs W rows and returns the T real
    ones; the caller then guarantees write_index + W <= S.
    attend_slots: static; full-attention layers (XLA path) attend to the first attend_slots cache slots
      only. The caller guarantees every row's write_index + T (padded) <= attend_slots, so no visible
      slot is cut; a batched step then costs what its longest context needs.
    pack_visible: static; full-attention layers (XLA path) read each query's visible new tokens packed
      right after the committed prefix (layers.packed_slots), so a tree node's attention sums its
      ancestors at the slots AR decoding has them at and rounds as AR does. Sliding layers and the
      Pallas path keep the block's own layout.
    """
    hidden_layers = tuple(hidden_layers)
    for i in hidden_layers:
        if not 0 <= i < config.num_layers:
            raise ValueError(f"hidden layer {i} is outside the model's {config.num_layers} layers")
    num_new = tokens.shape[1]
    pad = 0 if empty_cache or config.query_rows is None else max(config.query_rows - num_new, 0)
    logit_positions_in = None if logit_positions is None else logit_positions.shape[1]
    if pad:  # config.query_rows: every decode-time forward has the same shapes, so the same rounding
        tokens, positions, block_mask, logit_positions = _pad_query_rows(tokens, positions, block_mask,
                                                                          logit_positions, pad)
    out = Transformer(config).apply(
        {"params": params}, tokens, positions, cache, write_index, block_mask, hidden_layers, logit_positions,
        valid_lengths, empty_cache, attend_slots, pack_visible
    )
    if not pad:
        return out
    real_logits = num_new if logit_positions is None else logit_positions_in
    return ForwardOutput(out.logits[:, :real_logits], out.cache,
                         None if out.hidden is None else out.hidden[:, :num_new])


def _pad_query_rows(tokens, positions, block_mask, logit_positions, pad: int):
    """Append `pad` query rows after the T real ones: copies of the last token at the next positions,
    each seeing the cache, the real rows and itself, never seen by a real row (their K/V land in slots
    past the real ones, which the next write overwrites). Logits are computed for them too, so the LM
    head also runs at (at least) the padded row count."""
    batch, num_new = tokens.shape
    tokens = jnp.concatenate([tokens, jnp.repeat(tokens[:, -1:], pad, axis=1)], axis=1)  # [B, T+pad]
    positions = jnp.concatenate([positions, positions[:, -1:] + 1 + jnp.arange(pad, dtype=positions.dtype)], axis=1)
    if block_mask is not None:
        width = num_new + pad
        real = jnp.pad(block_mask, ((0, 0), (0, pad), (0, pad)))  # [B, W, W]: the real rows see no padding
        padding_row = (jnp.arange(width)[:, None] >= num_new) & (
            (jnp.arange(width)[None, :] < num_new) | (jnp.arange(width)[:, None] == jnp.arange(width)[None, :]))
        block_mask = real | padding_row[None]
    if logit_positions is not None and logit_positions.shape[1] < num_new + pad:
        extra = num_new + pad - logit_positions.shape[1]  # the head runs at the padded row count too
        logit_positions = jnp.concatenate(
            [logit_positions, jnp.full((batch, extra), num_new + pad - 1, logit_positions.dtype)], axis=1)
    return tokens, positions, block_mask, logit_positions


def embed_tokens(params, config: TransformerConfig, tokens):
    """The frozen token embedding, for drafters that share it. tokens: [B, T] -> [B, T, d]."""
    return Transformer(config).apply({"params": params}, tokens, method=Transformer.embed)


def token_embedder(params, config: TransformerConfig):
    """A function ids [..] -> embeddings [.., d], equal to embed_tokens, for use inside loops and
    branches. XLA:CPU has no bf16 gather: it gathers from a float32 copy of the whole table, and
    hoists that copy out of a loop but not out of a conditional branch, so an embedding taken in
    a branch of the decode step (the refiner's) copied SmolLM2's 28M-element table every step.
    Cast here, before the branches, the copy is loop-invariant and shared with the target's own."""
    cast_params = with_float32_embedding(params)
    return lambda ids: embed_tokens(cast_params, config, ids)


def with_float32_embedding(params):
    """params with the embedding table already cast as token_embedder casts it: a refinement pass
    timed alone then pays no cast, as in the decode loop, which casts once per call."""
    embed = params["embed_tokens"]
    return {**params, "embed_tokens": {**embed, "embedding": embed["embedding"].astype(jnp.float32)}}


def head_matrix(params, config: TransformerConfig, vocab_ids=None):
    """The LM head as a [d, V'] matrix, optionally only the columns of vocab_ids [V']."""
    full = params["embed_tokens"]["embedding"].T if config.tie_word_embeddings else params["lm_head"]["kernel"]
    return full if vocab_ids is None else jnp.take(full, vocab_ids, axis=1)


def softcap_logits(logits, softcap: float | None):
    """Gemma 2's final soft cap, softcap * tanh(logits / softcap); the identity when softcap is None."""
    return logits if softcap is None else softcap * jnp.tanh(logits / softcap)


def apply_head(normed_hidden, head):
    """Logits of final-normalised states [..., d] through a head matrix [d, V'] (see head_matrix),
    accumulated in float32: [..., V']. The drafters' head: unlike the target's (`lm_head`), it has
    no final soft cap (Gemma 2). The cap is monotonic, so greedy drafts are the same, and sampled
    drafts stay exact because verification uses the drafter's own distribution."""
    dtype = normed_hidden.dtype
    return dot_general_for(dtype)(normed_hidden, head.astype(dtype), (((normed_hidden.ndim - 1,), (0,)), ((), ())),
                                  preferred_element_type=jnp.float32)


def lm_head(params, config: TransformerConfig, normed_hidden):
    """The target's LM head alone, for drafters that share it. [B, N, d] -> [B, N, V] float32."""
    return Transformer(config).apply({"params": params}, normed_hidden, method=Transformer.head_only)
