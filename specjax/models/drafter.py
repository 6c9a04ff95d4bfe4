"""Block-diffusion drafter (DFlash-style).

The drafter never sees context token embeddings. It sees the target's own hidden states from a few
tap layers, concatenated, projected k·d -> d by `fc` and RMS-normalised. In every drafter layer
those context features become extra keys and values, made with the same K/V projections as the
block's tokens. Queries come only from the block: [last committed token, MASK × (B-1)]. The block
attends bidirectionally to itself and to all context. One forward pass therefore drafts B-1 tokens.
Token embedding and LM head are the target's, shared and frozen.

Context K/V depend only on committed tokens, so decoding keeps them in a cache (`KVCache`, one
entry per committed token, as the target does) and computes each token's K/V once.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import struct

from specjax.models.cache import write_rows
from specjax.models.config import TransformerConfig
from specjax.models.layers import RMSNorm, SwiGLU, apply_rope, dense, grouped_query_attention, rope_tables
from specjax.pallas_kernels.window_attention import masked_attention, merge_attention, window_attention_op


@dataclasses.dataclass(frozen=True)
class DrafterWindow:
    """Sliding-window drafting with summary tokens (SW-SpeedDLM-style): the drafter attends to the
    last `window` context positions raw, plus `summaries` tokens for every finished segment of
    `segment` positions, so its state is O(window + summaries * n / segment) instead of O(n)."""

    window: int = 256
    """Most recent context positions attended raw. Free to change at decode time."""
    segment: int = 128
    """Positions per segment; a segment is summarised once the committed length passes its end.
    Fixed by the trained compressor; at least the drafter's block size."""
    summaries: int = 2
    """Summary tokens per finished segment. Fixed by the trained compressor."""

    def __post_init__(self):
        for name in ("window", "segment", "summaries"):
            if getattr(self, name) < 1:
                raise ValueError(f"DrafterWindow.{name} must be positive, got {getattr(self, name)}")
        if self.window < self.segment:
            # Otherwise the unfinished segment's oldest positions would be neither in the window nor summarised.
            raise ValueError(f"DrafterWindow.window={self.window} must be at least the segment {self.segment}")

    def ring_slots(self, block_size: int) -> int:
        """Slots of the raw-context ring: the window plus one block, so writing a block's features
        never overwrites positions the window still needs."""
        return self.window + block_size

    def summary_slots(self, cache_length: int) -> int:
        """Summary slots for a context of cache_length positions (at least one segment's worth, so
        no array has a zero-length axis)."""
        return self.summaries * max(1, cache_length // self.segment)


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """Shape of a block-diffusion drafter. Width and vocabulary match its target."""

    hidden_size: int
    """Width d; equals the target's."""
    vocab_size: int
    """The target's vocabulary (the drafter uses the target's embedding and LM head)."""
    target_layer_ids: tuple[int, ...]
    """Target decoder layers whose outputs condition the drafter (0-based; layer i = HF hidden_states[i+1])."""
    num_layers: int = 1
    """Drafter decoder layers (DFlash uses 5 for Qwen3-8B; 1-2 suit SmolLM2)."""
    num_heads: int = 9
    """Query heads."""
    num_kv_heads: int = 3
    """Key/value heads."""
    head_dim: int = 64
    """Width of one head."""
    intermediate_size: int = 1536
    """SwiGLU hidden width."""
    block_size: int = 16
    """Slots per block: the last committed token plus block_size - 1 masks."""
    mask_token_id: int | None = None
    """Token id whose embedding fills the mask slots; None uses a learned mask vector (for
    vocabularies with no spare id)."""
    rope_theta: float = 10000.0
    """RoPE base (positions are absolute, as in the target)."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    qk_norm: bool = False
    """RMSNorm on queries and keys per head (Qwen3-style drafters)."""
    dtype: str = "float32"
    """Compute dtype."""
    window: DrafterWindow | None = None
    """Sliding-window drafting with summary tokens (needs trained compressor params under
    params["compressor"]); None attends to the whole context."""
    anchor_path: bool = False
    """Add a learned projection of the anchor token's embedding (identity at init) and a learned
    per-slot vector to every draft slot's input. Without it the anchor reaches the draft slots only
    through attention, as one key among the whole context: a start from the target's top layer gives
    it 0.4% of slot 1's attention, and training drove that to zero (experiments/anchor_attention.py).
    False reads DFlash checkpoints, which have no such tensors."""

    def __post_init__(self):
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if self.window is not None and self.window.segment < self.block_size:
            raise ValueError(f"DrafterWindow.segment={self.window.segment} must be at least the block size "
                             f"{self.block_size} (a block's writes may not reach a segment still being summarised)")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids must name at least one target layer")

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def layer_config(self) -> TransformerConfig:
        """The per-layer shape, expressed as a TransformerConfig for the shared building blocks."""
        return TransformerConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_layers=self.num_layers,
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            intermediate_size=self.intermediate_size, rope_theta=self.rope_theta,
            rms_norm_eps=self.rms_norm_eps, qk_norm=self.qk_norm, dtype=self.dtype,
        )

    @classmethod
    def for_target(cls, target: TransformerConfig, num_layers: int = 1, block_size: int = 16,
                   num_taps: int = 4, mask_token_id: int | None = None, anchor_path: bool = True) -> "DrafterConfig":
        """A drafter shaped like one target layer, tapping num_taps layers spread evenly from layer 1
        to layer n-3, as DFlash does (the very last layers are too specialised to the next token).
        New drafters get the anchor path."""
        first, last = 1, max(target.num_layers - 3, 1)
        taps = tuple(sorted({round(first + i * (last - first) / max(num_taps - 1, 1)) for i in range(num_taps)}))
        return cls(
            hidden_size=target.hidden_size, vocab_size=target.vocab_size, target_layer_ids=taps,
            num_layers=num_layers, num_heads=target.num_heads, num_kv_heads=target.num_kv_heads,
            head_dim=target.head_dim, intermediate_size=target.intermediate_size, block_size=block_size,
            mask_token_id=mask_token_id, rope_theta=target.rope_theta, rms_norm_eps=target.rms_norm_eps,
            qk_norm=target.qk_norm, dtype=target.dtype, anchor_path=anchor_path,
        )

    def check_target(self, target: TransformerConfig) -> None:
        """Refuse a target this drafter cannot serve, naming the mismatch."""
        from specjax.errors import SpecjaxError

        if self.hidden_size != target.hidden_size:
            raise SpecjaxError(f"drafter hidden size {self.hidden_size} != target hidden size {target.hidden_size}")
        if self.vocab_size != target.vocab_size:
            raise SpecjaxError(f"drafter vocabulary {self.vocab_size} != target vocabulary {target.vocab_size}")
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_layers]
        if bad:
            raise SpecjaxError(f"drafter taps target layer {bad[0]}, but the target has {target.num_layers} layers")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < target.vocab_size:
            raise SpecjaxError(f"mask token id {self.mask_token_id} is outside the target vocabulary")


def identity_init(key, shape, dtype=jnp.float32):
    """A square kernel that starts as the identity map."""
    return jnp.eye(shape[0], shape[1], dtype=dtype)


class DrafterLayer(nn.Module):
    config: TransformerConfig

    def setup(self):
        cfg = self.config
        dtype = jnp.dtype(cfg.dtype)
        proj = lambda n: dense(n, False, dtype)
        self.q_proj = proj(cfg.num_heads * cfg.head_dim)
        self.k_proj = proj(cfg.num_kv_heads * cfg.head_dim)
        self.v_proj = proj(cfg.num_kv_heads * cfg.head_dim)
        self.o_proj = proj(cfg.hidden_size)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(cfg.rms_norm_eps, dtype)
        self.input_layernorm = RMSNorm(cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.rms_norm_eps, dtype)
        self.mlp = SwiGLU(cfg.intermediate_size, False, dtype)

    def keys_values(self, h, cos, sin):
        """K (with RoPE) and V for already-normalised inputs h: [B, T, d] -> two [B, T, K, D]."""
        cfg = self.config
        batch, length, _ = h.shape
        k = self.k_proj(h).reshape(batch, length, cfg.num_kv_heads, cfg.head_dim)
        v = self.v_proj(h).reshape(batch, length, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            k = self.k_norm(k)
        # Projections accumulate in float32; attention and caches take the compute dtype again.
        dtype = jnp.dtype(cfg.dtype)
        return apply_rope(k, cos, sin).astype(dtype), v.astype(dtype)

    def block_qkv(self, x, cos, sin):
        """Queries, keys and values of the block states x [B, Q, d]: [B, Q, H, D], two [B, Q, K, D]."""
        cfg = self.config
        batch, num_q, _ = x.shape
        h = self.input_layernorm(x)
        q = self.q_proj(h).reshape(batch, num_q, cfg.num_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = self.q_norm(q)
        k, v = self.keys_values(h, cos, sin)
        return apply_rope(q, cos, sin).astype(jnp.dtype(cfg.dtype)), k, v

    def finish(self, x, attention_out):
        """Residual attention output and MLP. attention_out: [B, Q, H, D]."""
        cfg = self.config
        batch, num_q = x.shape[:2]
        x = x + self.o_proj(attention_out.reshape(batch, num_q, cfg.num_heads * cfg.head_dim))
        return x + self.mlp(self.post_attention_layernorm(x))

    def windowed(self, x, cos, sin, key_sets, own_visible, implementation: str):
        """Attention over the block's own keys (own_visible [B, Q, Q]) and over each ContextKeys of
        key_sets (this layer's entries), merged by log-sum-exp. Ranged sets go through the windowed-
        attention kernel when implementation == "pallas"."""
        q, k, v = self.block_qkv(x, cos, sin)
        parts = [masked_attention(q, k, v, own_visible)]
        for keys, values, visible, starts, ends in key_sets:
            if visible is not None:
                parts.append(masked_attention(q, keys, values, visible))
            else:
                parts.append(window_attention_op(q, keys, values, starts, ends, implementation=implementation))
        out, _ = merge_attention(parts)
        return self.finish(x, out)

    def __call__(self, x, cos, sin, context_k, context_v, mask, write_index=None):
        """x: [B, Q, d] block states. context_k/v: [B, S, K, D].

        With write_index ([B]), the block's K/V are written into the context arrays at that slot
        (decode: a cache whose slots >= write_index are free); without it they are appended after
        the S context entries (training). mask: [B, Q, S] or [B, Q, S + Q] accordingly.
        """
        q, k, v = self.block_qkv(x, cos, sin)
        if write_index is None:
            keys, values = jnp.concatenate([context_k, k], axis=1), jnp.concatenate([context_v, v], axis=1)
        else:
            keys, values = write_rows(context_k, k, write_index), write_rows(context_v, v, write_index)
        return self.finish(x, grouped_query_attention(q, keys, values, mask))  # attention: [B, Q, H, D]


class SegmentCompressor(nn.Module):
    """Attention pooling of a segment's context states into a few summary states.

    Each of the C learned queries scores the segment's S states through a key projection, and its
    summary is the softmax-weighted mean of the states through an output projection. Queries start at
    zero and the output projection at the identity, so an untrained compressor gives the segment's
    mean state: a summary that already looks like context to the drafter."""

    summaries: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, states):
        """states: [B, N, S, d] pre-norm context states of N segments -> [B, N, C, d]."""
        width = states.shape[-1]
        queries = self.param("queries", nn.initializers.zeros, (self.summaries, width))
        keys = dense(width, False, self.dtype, "key_proj")(states)  # [B, N, S, d]
        scores = jnp.einsum("cd,bnsd->bncs", queries.astype(keys.dtype), keys,
                            preferred_element_type=jnp.float32) * width**-0.5
        weights = jax.nn.softmax(scores, axis=-1).astype(states.dtype)  # [B, N, C, S]
        pooled = jnp.einsum("bncs,bnsd->bncd", weights, states, preferred_element_type=jnp.float32)
        return dense(width, False, self.dtype, "out_proj", kernel_init=identity_init)(pooled)


@struct.dataclass
class ContextKeys:
    """One set of context keys the windowed drafter attends to, for every drafter layer, with its
    visibility either as a dense mask (small sets: the ring, the summaries) or as one key range per
    query (long sets in training, through the windowed-attention kernel)."""

    keys: tuple[jax.Array, ...]
    """Per layer [B, S, K, D]."""
    values: tuple[jax.Array, ...]
    """Per layer [B, S, K, D]."""
    visible: jax.Array | None = None
    """[B, Q, S] bool, or None when starts/ends are given."""
    starts: jax.Array | None = None
    """[B, Q] int32: first visible key per query."""
    ends: jax.Array | None = None
    """[B, Q] int32: one past the last visible key per query."""

    def layer(self, i: int):
        return self.keys[i], self.values[i], self.visible, self.starts, self.ends


class Drafter(nn.Module):
    config: DrafterConfig

    def setup(self):
        cfg = self.config
        dtype = jnp.dtype(cfg.dtype)
        self.fc = dense(cfg.hidden_size, False, dtype)
        self.hidden_norm = RMSNorm(cfg.rms_norm_eps, dtype)
        self.layers = [DrafterLayer(cfg.layer_config, name=f"layers_{i}") for i in range(cfg.num_layers)]
        self.norm = RMSNorm(cfg.rms_norm_eps, dtype)
        if cfg.mask_token_id is None:
            self.mask_embedding = self.param("mask_embedding", nn.initializers.normal(0.02), (cfg.hidden_size,))
        if cfg.window is not None:
            self.compressor = SegmentCompressor(cfg.window.summaries, dtype)
        if cfg.anchor_path:
            self.anchor_proj = dense(cfg.hidden_size, False, dtype, kernel_init=identity_init)
            self.slot_embedding = self.param("slot_embedding", nn.initializers.zeros,
                                             (cfg.block_size, cfg.hidden_size))

    def context_states(self, features):
        """features: [B, C, n_taps, d] target hidden states -> [B, C, d] pre-norm context states
        (what the windowed drafter keeps for segments not yet summarised)."""
        batch, length = features.shape[:2]
        return self.fc(features.reshape(batch, length, -1).astype(jnp.dtype(self.config.dtype)))

    def states_keys_values(self, states, positions):
        """Pre-norm context states [B, C, d] at positions [B, C] -> ((k, v) per layer), each [B, C, K, D]."""
        cos, sin = rope_tables(self.config.layer_config, positions)
        h = self.hidden_norm(states)
        return tuple(layer.keys_values(h, cos, sin) for layer in self.layers)

    def context_keys_values(self, features, positions):
        """features: [B, C, n_taps, d] target hidden states; positions: [B, C].

        Returns ((k, v) per layer), each [B, C, K, D]: what the cache stores per committed token.
        """
        return self.states_keys_values(self.context_states(features), positions)

    def summary_keys_values(self, segment_states, positions):
        """Summaries of N segments: segment_states [B, N, S, d] pre-norm states; positions [B, N] the
        position each segment's summaries sit at (its middle). Returns ((k, v) per layer), each
        [B, N*C, K, D], summary c of segment n at index n*C + c."""
        summary = self.compressor(segment_states)  # [B, N, C, d]
        batch, count, per_segment, width = summary.shape
        return self.states_keys_values(summary.reshape(batch, count * per_segment, width),
                                       jnp.repeat(positions, per_segment, axis=1))

    def windowed(self, x, positions, key_sets, own_visible, implementation: str = "xla"):
        """The windowed drafter pass: x [B, Q, d] block inputs at positions [B, Q]; key_sets a
        sequence of ContextKeys; own_visible [B, Q, Q] among the block slots. Returns [B, Q, d]."""
        cos, sin = rope_tables(self.config.layer_config, positions)
        for i, layer in enumerate(self.layers):
            x = layer.windowed(x, cos, sin, [ks.layer(i) for ks in key_sets], own_visible, implementation)
        return self.norm(x)

    def block_inputs(self, token_embeds, is_mask):
        """token_embeds: [B, Q, d], Q a whole number of blocks, each starting with its anchor's
        embedding; is_mask: [B, Q] bool -> [B, Q, d] with mask slots replaced and, with the anchor
        path, every draft slot given its block's projected anchor and its slot vector."""
        cfg = self.config
        x = token_embeds  # with mask_token_id the caller embedded the mask token already
        if cfg.mask_token_id is None:
            x = jnp.where(is_mask[..., None], self.mask_embedding.astype(x.dtype), x)
        if not cfg.anchor_path:
            return x
        batch, length, width = x.shape
        blocks = x.reshape(batch, length // cfg.block_size, cfg.block_size, width)  # [B, N, Bk, d]
        anchor = self.anchor_proj(blocks[:, :, :1])  # [B, N, 1, d]
        is_draft_slot = (jnp.arange(cfg.block_size) > 0)[:, None]  # [Bk, 1]
        extra = jnp.where(is_draft_slot, anchor + self.slot_embedding, 0).astype(x.dtype)
        return (blocks + extra).reshape(batch, length, width)

    def __call__(self, x, positions, context_k, context_v, mask, write_index=None):
        """x: [B, Q, d] block inputs; returns final-normalised states [B, Q, d] for the LM head."""
        cos, sin = rope_tables(self.config.layer_config, positions)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, context_k[i], context_v[i], mask, write_index)
        return self.norm(x)


def init_drafter_params(config: DrafterConfig, rng: jax.Array):
    """Random drafter parameters (fc, hidden_norm, layers, norm, and mask_embedding when needed)."""
    batch, ctx, q = 1, 2, config.block_size

    def touch_everything(module: Drafter):
        kv = module.context_keys_values(jnp.zeros((batch, ctx, config.num_taps, config.hidden_size)),
                                        jnp.zeros((batch, ctx), jnp.int32))
        x = module.block_inputs(jnp.zeros((batch, q, config.hidden_size)), jnp.ones((batch, q), bool))
        return module(x, jnp.zeros((batch, q), jnp.int32), tuple(k for k, _ in kv), tuple(v for _, v in kv),
                      jnp.ones((batch, q, ctx + q), bool))

    params = Drafter(config).init(rng, method=touch_everything)["params"]
    if config.window is not None:
        params = {**params, "compressor": init_compressor_params(config, jax.random.fold_in(rng, 1))}
    return params


def init_compressor_params(config: DrafterConfig, rng: jax.Array):
    """Fresh compressor params for a windowed drafter config (zero queries, identity output)."""
    if config.window is None:
        raise ValueError("the drafter config has no window; set DrafterConfig.window first")
    states = jnp.zeros((1, 1, config.window.segment, config.hidden_size))
    return SegmentCompressor(config.window.summaries, jnp.dtype(config.dtype)).init(rng, states)["params"]


def context_keys_values(params, config: DrafterConfig, features, positions):
    return Drafter(config).apply({"params": params}, features, positions, method=Drafter.context_keys_values)
