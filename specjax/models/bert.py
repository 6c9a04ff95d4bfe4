"""A BERT encoder with sentence-transformers' mean pooling: the embedding model of retrieval.

Written for MiniLM-L6 (all-MiniLM-L6-v2: 6 layers, d=384, 12 heads, 384-d sentence embeddings),
and for any BERT checkpoint in Hugging Face's layout: post-norm layers, learned absolute positions,
token types, exact (erf) GELU. Functional use, as the target's: `encode(params, config, ids, mask)`
is pure and sits under `jit`. The params pytree mirrors the checkpoint's names, so loading is a
rename-free walk (see `specjax/io/encoder.py`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import linen as nn

from specjax.errors import SpecjaxError


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """Shapes of a BERT encoder (the names of Hugging Face's config.json)."""

    vocab_size: int = 30522
    """WordPiece vocabulary size."""
    hidden_size: int = 384
    """Width of every layer, and of the sentence embedding."""
    num_hidden_layers: int = 6
    """Encoder layers."""
    num_attention_heads: int = 12
    """Heads per attention layer (hidden_size / heads = head width)."""
    intermediate_size: int = 1536
    """Width of each layer's feed-forward block."""
    max_position_embeddings: int = 512
    """Longest input in WordPiece tokens."""
    type_vocab_size: int = 2
    """Token types (segment A/B)."""
    layer_norm_eps: float = 1e-12
    """LayerNorm epsilon."""

    def __post_init__(self):
        if self.hidden_size % self.num_attention_heads:
            raise SpecjaxError(f"hidden_size {self.hidden_size} is not divisible by "
                               f"{self.num_attention_heads} attention heads")

    @classmethod
    def from_hf(cls, hf: dict) -> "BertConfig":
        if hf.get("model_type", "bert") != "bert" or hf.get("position_embedding_type", "absolute") != "absolute":
            raise SpecjaxError(f"not a BERT config with absolute positions: model_type={hf.get('model_type')!r}")
        if hf.get("hidden_act", "gelu") != "gelu":
            raise SpecjaxError(f"only the exact GELU of BERT is implemented, not {hf.get('hidden_act')!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in hf.items() if k in names})


class _Dense(nn.Module):
    """A linear layer named and laid out as the checkpoint stores it: weight [out, in], bias [out]."""

    features: int

    @nn.compact
    def __call__(self, x):
        weight = self.param("weight", nn.initializers.normal(0.02), (self.features, x.shape[-1]))
        bias = self.param("bias", nn.initializers.zeros, (self.features,))
        return jnp.einsum("...i,oi->...o", x, weight) + bias


class _LayerNorm(nn.Module):
    eps: float

    @nn.compact
    def __call__(self, x):
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],))
        bias = self.param("bias", nn.initializers.zeros, (x.shape[-1],))
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + self.eps) * weight + bias


class _Layer(nn.Module):
    config: BertConfig

    @nn.compact
    def __call__(self, x, key_mask):
        """x [B, T, d]; key_mask [B, T] bool (padding keys are never attended to)."""
        cfg = self.config
        heads, width = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
        split = lambda t: t.reshape(t.shape[:2] + (heads, width))  # noqa: E731  [B, T, H, D]
        q = split(_Dense(cfg.hidden_size, name="query")(x))
        k = split(_Dense(cfg.hidden_size, name="key")(x))
        v = split(_Dense(cfg.hidden_size, name="value")(x))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.float32(width))  # [B, H, T, T]
        scores = jnp.where(key_mask[:, None, None, :], scores, jnp.finfo(scores.dtype).min)
        context = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v).reshape(x.shape)
        x = _LayerNorm(cfg.layer_norm_eps, name="attention_norm")(x + _Dense(cfg.hidden_size, name="attention_out")(
            context))
        inner = jax.nn.gelu(_Dense(cfg.intermediate_size, name="intermediate")(x), approximate=False)
        return _LayerNorm(cfg.layer_norm_eps, name="output_norm")(x + _Dense(cfg.hidden_size, name="output")(inner))


class BertEncoder(nn.Module):
    config: BertConfig

    @nn.compact
    def __call__(self, ids, mask):
        """ids, mask [B, T] (mask 1 for real tokens) -> the last layer's states [B, T, d]."""
        cfg = self.config
        positions = jnp.arange(ids.shape[1])
        embed = lambda n, name: self.param(name, nn.initializers.normal(0.02), (n, cfg.hidden_size))  # noqa: E731
        x = (embed(cfg.vocab_size, "word_embeddings")[ids] + embed(cfg.max_position_embeddings,
                                                                   "position_embeddings")[positions]
             + embed(cfg.type_vocab_size, "token_type_embeddings")[0])  # one segment: type 0 throughout
        x = _LayerNorm(cfg.layer_norm_eps, name="embeddings_norm")(x)
        key_mask = mask.astype(bool)
        for i in range(cfg.num_hidden_layers):
            x = _Layer(cfg, name=f"layer_{i}")(x, key_mask)
        return x


def encode_states(params, config: BertConfig, ids: jax.Array, mask: jax.Array) -> jax.Array:
    """ids, mask [B, T] -> token states [B, T, d] (what transformers' BertModel calls last_hidden_state)."""
    if ids.shape[1] > config.max_position_embeddings:
        raise SpecjaxError(f"{ids.shape[1]} tokens exceed the encoder's {config.max_position_embeddings} positions")
    return BertEncoder(config).apply({"params": params}, ids, mask)


def sentence_embeddings(params, config: BertConfig, ids: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean of the real tokens' states, L2-normalised (sentence-transformers' Pooling + Normalize):
    ids, mask [B, T] -> [B, d] unit vectors, so a dot product is the cosine."""
    states = encode_states(params, config, ids, mask)  # [B, T, d]
    weights = mask.astype(states.dtype)[..., None]  # [B, T, 1]
    pooled = (states * weights).sum(1) / jnp.maximum(weights.sum(1), 1e-9)
    return pooled / jnp.maximum(jnp.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)
