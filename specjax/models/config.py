"""Configuration of the target decoder (Llama, Mistral, Qwen3 and Gemma 1/2/3 text families)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM", "GemmaForCausalLM",
                           "Gemma2ForCausalLM", "Gemma3ForCausalLM")
GEMMA_ARCHITECTURES = ("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM")
LAYER_TYPES = ("full_attention", "sliding_attention")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
RING_ALIGNMENT = 64  # sliding-layer KV rings longer than this are rounded up to a multiple of it
MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen3ForCausalLM": "qwen3",
               "GemmaForCausalLM": "gemma", "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3_text"}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Frequency rescaling applied to RoPE's inverse frequencies (HF `rope_scaling`)."""

    kind: str
    """`"linear"` (divide every frequency by `factor`) or `"llama3"` (Llama-3.1's banded rescaling)."""
    factor: float
    """Context extension factor."""
    low_freq_factor: float = 1.0
    """llama3 only: wavelengths longer than original_max / low_freq_factor are fully rescaled."""
    high_freq_factor: float = 4.0
    """llama3 only: wavelengths shorter than original_max / high_freq_factor are left alone."""
    original_max_position_embeddings: int = 8192
    """llama3 only: the context length the model was pretrained at."""


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Shape and numerics of a decoder-only transformer. Hashable, so it can be a static jit argument."""

    vocab_size: int
    """Number of rows of the token embedding (and columns of the LM head)."""
    hidden_size: int
    """Model width d."""
    num_layers: int
    """Number of decoder layers."""
    num_heads: int
    """Query heads per layer."""
    num_kv_heads: int
    """Key/value heads per layer (grouped-query attention); must divide num_heads."""
    head_dim: int
    """Width of one attention head."""
    intermediate_size: int
    """Hidden width of the gated MLP."""
    hidden_act: str = "silu"
    """Activation of the gated MLP's gate: "silu" (SwiGLU) or "gelu_pytorch_tanh" (Gemma's GeGLU)."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rope_scaling: RopeScaling | None = None
    """Optional RoPE frequency rescaling."""
    rms_norm_eps: float = 1e-6
    """Epsilon inside every RMSNorm."""
    qk_norm: bool = False
    """Qwen3, Gemma 3: RMSNorm over head_dim applied to queries and keys before RoPE."""
    norm_unit_offset: bool = False
    """Gemma: every RMSNorm multiplies by (1 + weight), in float32 before the cast back, so a zero
    weight is the identity."""
    scale_embeddings: bool = False
    """Gemma: token embeddings are multiplied by sqrt(hidden_size), rounded to the compute dtype."""
    sandwich_norms: bool = False
    """Gemma 2/3: the attention and MLP outputs are normalised too (post_attention_layernorm on the
    attention output, pre_feedforward_layernorm and post_feedforward_layernorm around the MLP)."""
    query_pre_attn_scalar: float | None = None
    """Gemma 2/3: attention logits are q.k / sqrt(query_pre_attn_scalar) rather than / sqrt(head_dim)."""
    attn_logit_softcapping: float | None = None
    """Gemma 2: attention logits s become c * tanh(s / c) before the mask and softmax."""
    final_logit_softcapping: float | None = None
    """Gemma 2: output logits z become c * tanh(z / c). Monotonic, so greedy tokens are unchanged,
    but sampling sees the capped distribution."""
    local_rope_theta: float | None = None
    """Gemma 3: RoPE base of the sliding-attention layers, which also skip rope_scaling (that applies
    to the full-attention layers only). None: every layer uses rope_theta and rope_scaling."""
    attention_bias: bool = False
    """Bias on the q/k/v/o projections (Llama option)."""
    mlp_bias: bool = False
    """Bias on the MLP projections (Llama option)."""
    tie_word_embeddings: bool = True
    """LM head shares the token embedding matrix."""
    max_position_embeddings: int = 8192
    """Longest context the model supports; generation beyond it is refused."""
    architecture: str = "LlamaForCausalLM"
    """HF architecture name, kept for error messages and for saving."""
    dtype: str = "float32"
    """Compute dtype of activations. float32 is the fast choice on CPU."""
    kv_dtype: str | None = None
    """Storage dtype of the KV cache; None stores it in the compute dtype. bfloat16 under float32
    compute halves the cache: new keys and values are rounded to it before anyone attends to them,
    so a token's K/V are the same numbers in the step that makes it and in every later read."""
    query_rows: int | None = None
    """Decode-time forwards run at least this many query rows: a shorter one (a decode step of one
    token, a small tree) is padded with rows after its real ones that the real rows cannot see.
    XLA's kernels round differently for different row counts, so a one-token step and the same token
    inside a 16-token verify pass differ by an ulp, which bf16 compute grows to ~0.3 in the logits.
    With every step at the same row count, AR and speculative decoding compute the same numbers bit
    for bit (experiments/precision_consistency.py). None: no padding. Prefills are never padded."""
    attention: str = "xla"
    """Attention implementation: "xla" (dense masked attention over every cache slot) or "pallas"
    (the tree-attention kernel in specjax/pallas_kernels, which skips cache blocks past each row's
    length, and the windowed-attention kernel for sliding layers; they run interpreted, and slowly,
    on CPU). Both compute the same function."""
    sliding_window: int | None = None
    """Keys a query in a sliding-attention layer sees, itself included (HF semantics: key position
    j is visible from query position p iff p - W < j <= p). None: no sliding layers."""
    layer_types: tuple[str, ...] = ()
    """Per layer, "full_attention" or "sliding_attention" (HF `layer_types`). Empty: every layer
    slides when sliding_window is set (Mistral), otherwise every layer is full."""
    kv_ring_step: int | None = None
    """When set, each sliding layer's KV cache is a ring of sliding_window + kv_ring_step - 1 slots
    (slot s at index s mod R; rounded up to a multiple of 64 when longer than 64) instead of one
    slot per context position, so its memory stays flat as
    the context grows. It must be at least the number of tokens any forward after the prefill
    writes at once: 1 for autoregressive decoding, the block or the largest tree for speculative
    decoding (the Engine sets it per call). None: sliding layers keep every slot."""

    def __post_init__(self):
        if self.query_rows is not None and self.query_rows < 1:
            raise ValueError(f"query_rows must be a positive number of rows or None, got {self.query_rows}")
        if self.kv_ring_step is not None and self.kv_ring_step < 1:
            raise ValueError(f"kv_ring_step must be a positive number of tokens, got {self.kv_ring_step}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive number of keys, got {self.sliding_window}")
        if self.layer_types:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"layer_types names {len(self.layer_types)} layers, the model has {self.num_layers}")
            unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if unknown:
                raise ValueError(f"layer_types has {unknown[0]!r}; expected one of {LAYER_TYPES}")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ValueError("layer_types has sliding_attention layers but sliding_window is None")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act must be one of {ACTIVATIONS}, got {self.hidden_act!r}")
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "local_rope_theta"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive or None, got {value}")
        if self.attention not in ("xla", "pallas"):
            raise ValueError(f"attention must be 'xla' or 'pallas', got {self.attention!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim", "intermediate_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of decoder layer `layer`, or None for full attention."""
        if self.sliding_window is None:
            return None
        if not self.layer_types:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def attention_scores(self):
        """How q.k becomes an attention logit in this model (scale and optional soft cap)."""
        from specjax.pallas_kernels.scores import AttentionScores

        scale = None if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar**-0.5
        return AttentionScores(scale=scale, softcap=self.attn_logit_softcapping)

    def layer_cache_slots(self, layer: int, max_length: int) -> int:
        """Cache slots decoder layer `layer` keeps for a context of max_length positions: a ring of
        window + kv_ring_step - 1 for a sliding layer when kv_ring_step is set, else max_length."""
        window = self.layer_window(layer)
        if window is None or self.kv_ring_step is None:
            return max_length
        slots = window + self.kv_ring_step - 1  # the least that is safe; any larger ring is too
        if slots > RING_ALIGNMENT:  # a multiple of the kernels' key block spares them a padded copy
            slots = -(-slots // RING_ALIGNMENT) * RING_ALIGNMENT
        return min(max_length, slots)

    def layer_rope(self, layer: int) -> tuple[float, RopeScaling | None]:
        """(RoPE base, rope scaling) of decoder layer `layer`."""
        if self.local_rope_theta is not None and self.layer_window(layer) is not None:
            return self.local_rope_theta, None
        return self.rope_theta, self.rope_scaling

    def num_params(self) -> int:
        d, f = self.hidden_size, self.intermediate_size
        attn = d * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        norms = (4 if self.sandwich_norms else 2) * d
        per_layer = attn + 3 * d * f + norms + (2 * self.head_dim if self.qk_norm else 0)
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.num_layers * per_layer + d + head

    @property
    def cache_dtype(self) -> str:
        """The KV cache's storage dtype (kv_dtype, or the compute dtype)."""
        return self.kv_dtype or self.dtype

    @property
    def precision(self) -> dict:
        """What a decode's numbers depend on, reported with its output: compute dtype, KV-cache dtype
        and padded query rows. Speculative output is exact against AR at this same precision."""
        return {"dtype": self.dtype, "kv_dtype": self.cache_dtype, "query_rows": self.query_rows}

    def kv_bytes_per_token(self, bytes_per_element: int = 4) -> int:
        """Bytes of K and V cache one more token of context adds across all layers, once the context
        is longer than the rings (ring layers then add nothing; see kv_window_bytes)."""
        growing = sum(1 for i in range(self.num_layers)
                      if self.layer_window(i) is None or self.kv_ring_step is None)
        return 2 * growing * self.num_kv_heads * self.head_dim * bytes_per_element

    def kv_window_bytes(self, max_length: int, bytes_per_element: int = 4) -> int:
        """Bytes of the sliding layers' KV rings (one row) for a context of max_length positions:
        constant once max_length exceeds the rings; 0 without rings."""
        if self.kv_ring_step is None:
            return 0
        slots = sum(self.layer_cache_slots(i, max_length) for i in range(self.num_layers) if self.layer_window(i))
        return 2 * slots * self.num_kv_heads * self.head_dim * bytes_per_element

    def with_kv_rings(self, step_tokens: int) -> "TransformerConfig":
        """This config as decoding uses it: sliding layers (if any) keep KV rings for steps that
        write step_tokens tokens at once (1, the block, or the largest tree)."""
        if self.sliding_window is None:
            return self
        return dataclasses.replace(self, kv_ring_step=step_tokens)

    def check_ring_step(self, step_tokens: int, what: str) -> None:
        """Refuse rings too small for steps that write step_tokens tokens at once (stale entries
        would become visible)."""
        if self.kv_ring_step is not None and self.sliding_window is not None and self.kv_ring_step < step_tokens:
            raise ValueError(f"kv_ring_step={self.kv_ring_step} is smaller than the {step_tokens} tokens {what} "
                             f"writes per step; sliding layers' rings need kv_ring_step >= {step_tokens}")

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json an HF model of this shape would have."""
        out: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": MODEL_TYPES.get(self.architecture, "llama"),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "attention_bias": self.attention_bias,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": self.hidden_act,
        }
        if self.architecture in GEMMA_ARCHITECTURES:
            out["hidden_activation"] = self.hidden_act
            if self.architecture != "GemmaForCausalLM":
                scalar = self.query_pre_attn_scalar or self.head_dim
                # transformers 5 checks types: its config class declares an int.
                out["query_pre_attn_scalar"] = int(scalar) if float(scalar).is_integer() else scalar
                out["attn_logit_softcapping"] = self.attn_logit_softcapping
                out["final_logit_softcapping"] = self.final_logit_softcapping
                out["sliding_window"] = self.sliding_window
                out["layer_types"] = [
                    "sliding_attention" if self.layer_window(i) else "full_attention" for i in range(self.num_layers)]
        if self.architecture == "LlamaForCausalLM":
            out["mlp_bias"] = self.mlp_bias
        if self.architecture == "MistralForCausalLM":
            out["sliding_window"] = self.sliding_window  # null matters: Mistral's class defaults to 4096
        if self.sliding_window is not None:
            out["sliding_window"] = self.sliding_window
            if self.architecture == "Qwen3ForCausalLM":
                out["use_sliding_window"] = True
                out["layer_types"] = [
                    "sliding_attention" if self.layer_window(i) else "full_attention" for i in range(self.num_layers)]
                out["max_window_layers"] = 0
        if self.architecture == "Gemma3ForCausalLM":
            # Gemma 3 always gives sliding layers their own base (10000 when absent) and no scaling.
            if self.local_rope_theta is None and self.rope_scaling is not None:
                raise ValueError("a Gemma 3 config without local_rope_theta but with rope_scaling (on every layer) "
                                 "cannot be written as an HF config")
            out["rope_local_base_freq"] = self.local_rope_theta or self.rope_theta
        elif self.local_rope_theta is not None:
            out["rope_local_base_freq"] = self.local_rope_theta
        if self.rope_scaling is not None:
            rs = self.rope_scaling
            out["rope_scaling"] = {
                "rope_type": rs.kind,
                "factor": rs.factor,
                "low_freq_factor": rs.low_freq_factor,
                "high_freq_factor": rs.high_freq_factor,
                "original_max_position_embeddings": rs.original_max_position_embeddings,
            }
        return out


def rope_inverse_frequencies(config: TransformerConfig, layer: int | None = None) -> "list[float]":
    """RoPE inverse frequencies (length head_dim / 2), with rope_scaling applied, of decoder layer
    `layer` (None: the model-wide rope_theta and rope_scaling)."""
    theta, rs = (config.rope_theta, config.rope_scaling) if layer is None else config.layer_rope(layer)
    half = config.head_dim // 2
    inv = [1.0 / (theta ** (2 * i / config.head_dim)) for i in range(half)]
    if rs is None:
        return inv
    if rs.kind == "linear":
        return [f / rs.factor for f in inv]
    if rs.kind == "llama3":
        low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
        high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
        out = []
        for f in inv:
            wavelen = 2 * math.pi / f
            if wavelen < high_wavelen:
                out.append(f)
            elif wavelen > low_wavelen:
                out.append(f / rs.factor)
            else:
                smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
                    rs.high_freq_factor - rs.low_freq_factor
                )
                out.append((1 - smooth) * f / rs.factor + smooth * f)
        return out
    raise ValueError(f"unsupported rope_scaling kind {rs.kind!r}; supported: linear, llama3")
