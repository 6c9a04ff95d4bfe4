"""Shared fixtures: tiny random HF models built offline with transformers, and the real SmolLM2."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import jax  # noqa: E402
import pytest  # noqa: E402

# The reference is full float32; on GPUs JAX would otherwise use TF32 matmuls.
jax.config.update("jax_default_matmul_precision", "highest")

TINY_SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def build_tiny_hf(arch: str, seed: int = 0, **overrides):
    """A tiny random transformers model. Weights are scaled up from HF's 0.02 init so logits differ
    clearly between tokens: with near-zero logits a wrong layout could still pass a tolerance check."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    shape = {**TINY_SHAPE, **overrides}
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(rope_theta=500.0, **shape))
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **shape))
    else:
        raise ValueError(arch)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (1.5 / p.shape[-1] ** 0.5))
    return model.eval()


@pytest.fixture(scope="session", params=["llama", "qwen3"])
def tiny_hf(request, tmp_path_factory):
    """(arch, torch model, folder) for a tiny random Llama and Qwen3 saved as HF folders."""
    model = build_tiny_hf(request.param)
    folder = tmp_path_factory.mktemp(f"tiny_{request.param}")
    model.save_pretrained(folder)
    return request.param, model, folder


@pytest.fixture(scope="session")
def smollm2():
    """The real default model, fetched (sha256-checked) on first use."""
    from specjax.io.registry import load_model

    return load_model("smollm2")
