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

from specjax.models.cache import KVCache, write_rows
from specjax.models.config import TransformerConfig
from specjax.models.layers import RMSNorm, SwiGLU, apply_rope, grouped_query_attention, rope_tables


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

    def __post_init__(self):
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
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
                   num_taps: int = 4, mask_token_id: int | None = None) -> "DrafterConfig":
        """A drafter shaped like one target layer, tapping num_taps layers spread evenly from layer 1
        to layer n-3, as DFlash does (the very last layers are too specialised to the next token)."""
        first, last = 1, max(target.num_layers - 3, 1)
        taps = tuple(sorted({round(first + i * (last - first) / max(num_taps - 1, 1)) for i in range(num_taps)}))
        return cls(
            hidden_size=target.hidden_size, vocab_size=target.vocab_size, target_layer_ids=taps,
            num_layers=num_layers, num_heads=target.num_heads, num_kv_heads=target.num_kv_heads,
            head_dim=target.head_dim, intermediate_size=target.intermediate_size, block_size=block_size,
            mask_token_id=mask_token_id, rope_theta=target.rope_theta, rms_norm_eps=target.rms_norm_eps,
            qk_norm=target.qk_norm, dtype=target.dtype,
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


class DrafterLayer(nn.Module):
    config: TransformerConfig

    def setup(self):
        cfg = self.config
        dtype = jnp.dtype(cfg.dtype)
        proj = lambda n: nn.Dense(n, use_bias=False, dtype=dtype)
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
        return apply_rope(k, cos, sin), v

    def __call__(self, x, cos, sin, context_k, context_v, mask, write_index=None):
        """x: [B, Q, d] block states. context_k/v: [B, S, K, D].

        With write_index ([B]), the block's K/V are written into the context arrays at that slot
        (decode: a cache whose slots >= write_index are free); without it they are appended after
        the S context entries (training). mask: [B, Q, S] or [B, Q, S + Q] accordingly.
        """
        cfg = self.config
        batch, num_q, _ = x.shape
        h = self.input_layernorm(x)
        q = self.q_proj(h).reshape(batch, num_q, cfg.num_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = self.q_norm(q)
        q = apply_rope(q, cos, sin)
        k, v = self.keys_values(h, cos, sin)
        if write_index is None:
            keys, values = jnp.concatenate([context_k, k], axis=1), jnp.concatenate([context_v, v], axis=1)
        else:
            keys, values = write_rows(context_k, k, write_index), write_rows(context_v, v, write_index)
        out = grouped_query_attention(q, keys, values, mask)  # [B, Q, H, D]
        x = x + self.o_proj(out.reshape(batch, num_q, cfg.num_heads * cfg.head_dim))
        return x + self.mlp(self.post_attention_layernorm(x))


class Drafter(nn.Module):
    config: DrafterConfig

    def setup(self):
        cfg = self.config
        dtype = jnp.dtype(cfg.dtype)
        self.fc = nn.Dense(cfg.hidden_size, use_bias=False, dtype=dtype)
        self.hidden_norm = RMSNorm(cfg.rms_norm_eps, dtype)
        self.layers = [DrafterLayer(cfg.layer_config, name=f"layers_{i}") for i in range(cfg.num_layers)]
        self.norm = RMSNorm(cfg.rms_norm_eps, dtype)
        if cfg.mask_token_id is None:
            self.mask_embedding = self.param("mask_embedding", nn.initializers.normal(0.02), (cfg.hidden_size,))

    def context_keys_values(self, features, positions):
        """features: [B, C, n_taps, d] target hidden states; positions: [B, C].

        Returns ((k, v) per layer), each [B, C, K, D]: what the cache stores per committed token.
        """
        batch, length = features.shape[:2]
        h = self.hidden_norm(self.fc(features.reshape(batch, length, -1).astype(jnp.dtype(self.config.dtype))))
        cos, sin = rope_tables(self.config.layer_config, positions)
        return tuple(layer.keys_values(h, cos, sin) for layer in self.layers)

    def block_inputs(self, token_embeds, is_mask):
        """token_embeds: [B, Q, d]; is_mask: [B, Q] bool -> [B, Q, d] with mask slots replaced."""
        if self.config.mask_token_id is not None:
            return token_embeds  # the caller embedded mask_token_id already
        return jnp.where(is_mask[..., None], self.mask_embedding.astype(token_embeds.dtype), token_embeds)

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

    return Drafter(config).init(rng, method=touch_everything)["params"]


def context_keys_values(params, config: DrafterConfig, features, positions):
    return Drafter(config).apply({"params": params}, features, positions, method=Drafter.context_keys_values)


def empty_context_cache(config: DrafterConfig, batch: int, length: int) -> KVCache:
    return KVCache.zeros(config.layer_config, batch, length)
