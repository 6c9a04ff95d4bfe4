"""Causal refiner for block drafts (xPress-style).

A block drafter picks every slot of its block independently, so a draft can be likely slot by slot
and unlikely as a whole. The refiner puts back the dependence between slots: for draft slot k it
sees the drafter's final state h_k and the embedding of the token to its left (the anchor for
k = 1, draft k-1 otherwise), mixes them causally over slots 1..k, and adds a correction to the
drafter's logits:

    refined_k = drafter_logits_k + c(z_k) . (P^T H)        z_k = mixer(u_1..u_k)
    u_k = W_h h_k + W_e emb(x_{k-1}) + W_c conf_k (+ slot embedding)

conf_k is the drafter's confidence at slot k (its top log-probability and entropy): with it the
refiner learns to leave confident drafts alone, which a first version without it did not, and
which matters most on text unlike its training data.

H is the drafter's (frozen, shared) LM head restricted to the draft vocabulary and P a learned
[d, rank] projection, so the correction is low-rank over the vocabulary and similar tokens move
together. P^T H is computed once per decode call, which keeps one refinement pass to a few
percent of a drafter pass. The last projection c starts at zero: an untrained refiner is exactly
the drafter.

Two mixers are provided (`RefinerConfig.kind`): a one-layer causal transformer and a GRU.
"""

from __future__ import annotations

import dataclasses
import hashlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import traverse_util

from specjax.errors import SpecjaxError
from specjax.models.layers import RMSNorm

REFINER_KINDS = ("transformer", "gru")


@dataclasses.dataclass(frozen=True)
class RefinerConfig:
    """Shape of a causal refiner. Its inputs are as wide as the drafter it refines."""

    hidden_size: int
    """Width d of the drafter's states and of the token embeddings."""
    block_size: int
    """The drafter's block size; the refiner covers draft slots 1..block_size-1."""
    kind: str = "transformer"
    """Causal mixer over draft slots: "transformer" (one causal self-attention layer) or "gru"."""
    width: int = 128
    """The mixer's width; small next to d so a refinement pass stays cheap."""
    rank: int = 64
    """Rank of the logit correction over the draft vocabulary."""
    num_heads: int = 4
    """Attention heads of the transformer mixer (unused by the GRU)."""
    mlp_size: int = 256
    """Hidden width of the transformer mixer's MLP (unused by the GRU)."""
    rms_norm_eps: float = 1e-6
    """Epsilon of the refiner's RMSNorms."""

    def __post_init__(self):
        if self.kind not in REFINER_KINDS:
            raise SpecjaxError(f"refiner kind must be one of {', '.join(REFINER_KINDS)}, got {self.kind!r}")
        if self.block_size < 2:
            raise SpecjaxError(f"block_size must be >= 2, got {self.block_size}")
        for name in ("hidden_size", "width", "rank", "num_heads", "mlp_size"):
            if getattr(self, name) < 1:
                raise SpecjaxError(f"refiner {name} must be >= 1, got {getattr(self, name)}")
        if self.kind == "transformer" and self.width % self.num_heads:
            raise SpecjaxError(f"refiner width {self.width} is not divisible by num_heads {self.num_heads}")

    @property
    def num_slots(self) -> int:
        return self.block_size - 1


class _CausalTransformerMixer(nn.Module):
    config: RefinerConfig

    @nn.compact
    def __call__(self, u):  # u: [B, K, w]
        cfg = self.config
        num_slots = u.shape[1]
        u = u + self.param("slot_embedding", nn.initializers.normal(0.02), (cfg.num_slots, cfg.width))[:num_slots]
        causal = nn.make_causal_mask(jnp.ones(u.shape[:2], bool))  # [B, 1, K, K]
        attn = nn.MultiHeadDotProductAttention(num_heads=cfg.num_heads, qkv_features=cfg.width, out_features=cfg.width,
                                               name="attention")
        u = u + attn(RMSNorm(cfg.rms_norm_eps, name="attention_norm")(u), mask=causal)
        hidden = nn.gelu(nn.Dense(cfg.mlp_size, name="mlp_in")(RMSNorm(cfg.rms_norm_eps, name="mlp_norm")(u)))
        return u + nn.Dense(cfg.width, name="mlp_out")(hidden)


class _GRUMixer(nn.Module):
    config: RefinerConfig

    @nn.compact
    def __call__(self, u):  # u: [B, K, w]
        return nn.RNN(nn.GRUCell(features=self.config.width), name="gru")(u)


class Refiner(nn.Module):
    config: RefinerConfig

    def setup(self):
        cfg = self.config
        self.state_proj = nn.Dense(cfg.width, use_bias=False)
        self.token_proj = nn.Dense(cfg.width, use_bias=False)
        self.confidence_proj = nn.Dense(cfg.width)
        self.input_norm = RMSNorm(cfg.rms_norm_eps)
        self.mixer = _CausalTransformerMixer(cfg) if cfg.kind == "transformer" else _GRUMixer(cfg)
        self.output_norm = RMSNorm(cfg.rms_norm_eps)
        self.correction = nn.Dense(cfg.rank, use_bias=False, kernel_init=nn.initializers.zeros)
        self.vocab_projection = nn.Dense(cfg.rank, use_bias=False)

    def low_rank_head(self, head):
        """head: [d, V'] the drafter's LM head columns -> [rank, V'] (once per decode call)."""
        return self.vocab_projection(head.T.astype(jnp.float32)).T

    def __call__(self, hidden, previous_embeds, confidence, low_rank_head):
        """hidden: [B, K, d] drafter states of slots 1..K; previous_embeds: [B, K, d] embeddings of the
        token left of each slot; confidence: [B, K, 2] (draft_confidence of the drafter's logits);
        low_rank_head: [rank, V']. Returns logit corrections [B, K, V']."""
        u = (self.state_proj(hidden.astype(jnp.float32)) + self.token_proj(previous_embeds.astype(jnp.float32))
             + self.confidence_proj(confidence))
        z = self.output_norm(self.mixer(self.input_norm(u)))  # [B, K, w]
        return jnp.einsum("BKr,rV->BKV", self.correction(z), low_rank_head)


def init_refiner_params(config: RefinerConfig, rng: jax.Array):
    k, d = config.num_slots, config.hidden_size

    def touch_everything(module: Refiner):
        head = module.low_rank_head(jnp.zeros((d, 3)))
        return module(jnp.zeros((1, k, d)), jnp.zeros((1, k, d)), jnp.zeros((1, k, 2)), head)

    return Refiner(config).init(rng, method=touch_everything)["params"]


def refiner_low_rank_head(params, config: RefinerConfig, head):
    return Refiner(config).apply({"params": params}, head, method=Refiner.low_rank_head)


def refiner_corrections(params, config: RefinerConfig, hidden, previous_embeds, confidence, low_rank_head):
    return Refiner(config).apply({"params": params}, hidden, previous_embeds, confidence, low_rank_head)


def draft_confidence(drafter_logits):
    """[..., V'] drafter logits -> [..., 2]: top log-probability and entropy (nats) per slot."""
    log_probs = jax.nn.log_softmax(drafter_logits.astype(jnp.float32), axis=-1)
    entropy = -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)
    return jnp.stack([jnp.max(log_probs, axis=-1), entropy], axis=-1)


def drafter_fingerprint(drafter_params, draft_vocab=None) -> str:
    """A short hash of a drafter's weights (rounded to bf16, as checkpoints store them) and draft
    vocabulary. A refiner records the fingerprint of the drafter it was trained on, so it is never
    silently paired with another one."""
    import ml_dtypes

    digest = hashlib.sha256()
    # A windowed drafter's segment compressor is an add-on, not part of the drafter's identity.
    drafter_params = {k: v for k, v in drafter_params.items() if k != "compressor"}
    for path, leaf in sorted(traverse_util.flatten_dict(drafter_params, sep="/").items()):
        digest.update(path.encode())
        digest.update(np.asarray(leaf, np.float32).astype(ml_dtypes.bfloat16).tobytes())
    if draft_vocab is not None:
        digest.update(np.asarray(draft_vocab, np.int32).tobytes())
    return digest.hexdigest()[:16]
