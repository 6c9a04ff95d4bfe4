"""Shared fixtures: tiny random HF models built offline with transformers, and the real SmolLM2."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# The CLI turns JAX's persistent compilation cache on; tests that call it would otherwise fill the
# user's cache with test programs. tests/test_compile_cache.py turns it on in its own processes.
os.environ.setdefault("SPECJAX_COMPILE_CACHE", "0")
# The suite compiles hundreds of small programs, and on CPU most of their time is LLVM optimising
# machine code that then runs for milliseconds: without it the suite takes about a quarter less
# (tests/test_tree.py: 75 s against 99 s). XLA's own graph passes, which decide fusion and the
# order of sums, still run. Every exactness test compares programs compiled alike in one process.
# Set SPECJAX_TEST_FULL_XLA_OPT=1 to test at the optimisation users run at; child processes
# (notebook kernels, multi-device runs) inherit the flag.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", "") and \
        not os.environ.get("SPECJAX_TEST_FULL_XLA_OPT"):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

# The reference is full float32; on GPUs JAX would otherwise use TF32 matmuls.
jax.config.update("jax_default_matmul_precision", "highest")

# Seconds each test file's default-suite tests took on the 2-core EPYC (AVX2), summed from
# `python -m pytest -m "not slow" -n auto --dist loadfile --durations 0 tests`, 2026-12-07 (535 tests,
# 22:06 on two workers). Only the order matters: stale figures cost balance, never correctness.
SUITE_SECONDS: dict[str, float] = {
    "test_serve.py": 317, "test_adaptive.py": 221, "test_rapid.py": 203, "test_refiner.py": 177, "test_api.py": 177,
    "test_speculative.py": 168, "test_tree.py": 145, "test_train.py": 134, "test_sliding_window.py": 118,
    "test_precision.py": 97, "test_cli.py": 93, "test_notebooks.py": 81, "test_decode.py": 81, "test_ngram.py": 68,
    "test_smollm2.py": 63, "test_auto.py": 61, "test_window_attention.py": 55, "test_hf_models.py": 53,
    "test_tree_attention.py": 53, "test_compile_cache.py": 43, "test_prefill.py": 43, "test_gemma.py": 35,
    "test_sharding.py": 32, "test_selfdistill.py": 27, "test_retrieval.py": 20, "test_gpu_checks.py": 15,
    "test_windowed_drafter.py": 14, "test_gguf.py": 7, "test_cli_errors.py": 3, "test_architecture.py": 1,
}


def pytest_collection_modifyitems(config, items):
    """The longest test files first (a file's own order kept): each xdist worker takes the next
    file as it frees, so starting with the long ones lets both finish together instead of one
    running a long file alone at the end. .ci/run passes --no-loadscope-reorder, without which
    xdist orders files by their number of tests instead. Files not measured yet go last."""
    # Within a file, the negative controls last: each clears every compiled program on its way out
    # (broken_rule), so a test after it would compile its programs again.
    items.sort(key=lambda item: (-SUITE_SECONDS.get(item.path.name, 0.0), item.path.name,
                                 "broken_rule" in getattr(item, "fixturenames", ())))


def _memory_maps() -> int:
    try:
        with open("/proc/self/maps") as maps:
            return sum(1 for _ in maps)
    except OSError:  # not Linux: no such limit to keep under
        return 0


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drop the compiled programs after a module once the process holds many memory maps. XLA:CPU
    maps memory for each executable, and the whole suite's programs together passed Linux's default
    limit of 65,530 maps per process (vm.max_map_count), which aborts the process inside a compile.
    Clearing only past half the limit keeps programs that later modules share."""
    yield
    if _memory_maps() > 30_000:
        import gc

        jax.clear_caches()
        gc.collect()


@pytest.fixture
def broken_rule(monkeypatch):
    """patch(module, name, replacement): a deliberately broken rule inside the product's own slot
    step, for negative controls. jit's caches are cleared on the way in, so the step is traced anew
    with the broken rule, and on the way out, so no later test meets the broken trace."""
    patched = []

    def patch(module, name, replacement):
        monkeypatch.setattr(module, name, replacement)
        jax.clear_caches()
        patched.append(name)

    yield patch
    monkeypatch.undo()
    if patched:  # a control's unbroken twin keeps what it compiled
        jax.clear_caches()


TINY_SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def build_tiny_hf(arch: str, seed: int = 0, **overrides):
    """A tiny random transformers model. Weights are scaled up from HF's 0.02 init so logits differ
    clearly between tokens: with near-zero logits a wrong layout could still pass a tolerance check."""
    import torch
    from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, GemmaConfig,
                              GemmaForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                              Qwen3Config, Qwen3ForCausalLM)

    torch.manual_seed(seed)
    shape = {**TINY_SHAPE, **overrides}
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(rope_theta=500.0, **shape))
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **shape))
    elif arch == "mistral":  # every layer slides
        model = MistralForCausalLM(MistralConfig(**{"sliding_window": 5, **shape}))
    elif arch == "qwen3-sliding":  # full and sliding layers alternate, Gemma-style
        layers = shape["num_hidden_layers"]
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, use_sliding_window=True, sliding_window=4,
                                             layer_types=["full_attention", "sliding_attention"] * (layers // 2),
                                             **shape))
    elif arch == "gemma":
        model = GemmaForCausalLM(GemmaConfig(head_dim=16, **shape))
    elif arch == "gemma2":  # sliding/full alternate; both soft caps small enough to bite
        model = Gemma2ForCausalLM(Gemma2Config(head_dim=16, sliding_window=4, query_pre_attn_scalar=24,
                                               attn_logit_softcapping=3.0, final_logit_softcapping=4.0, **shape))
    elif arch == "gemma3":  # a sliding layer (local RoPE base) then a full one (global base, linear scaling)
        layers = shape["num_hidden_layers"]
        model = Gemma3ForCausalLM(Gemma3TextConfig(
            head_dim=16, sliding_window=4, query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention"] * (layers // 2),
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                             "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0}},
            **shape))
    else:
        raise ValueError(arch)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (1.5 / p.shape[-1] ** 0.5))
    return model.eval()


def transformers_greedy(model, prompt, new_tokens):
    """transformers' greedy continuation of `prompt`, exactly new_tokens long (EOS ignored)."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                             min_new_tokens=new_tokens, pad_token_id=0)
    return out[0, len(prompt):].tolist()


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


def assert_histogram_accounts_for_the_tokens(histogram, outputs, block: int) -> None:
    """The accepted-length histogram (steps that committed k + 1 tokens, summed over rows) must account
    for the tokens generated: each row's first token comes from the prefill and every later one from a
    verify step, and a row's last step may run past max_new_tokens or an EOS by at most one block.
    Fails when steps go uncounted (a histogram from one call of several, steps of finished rows) or
    when n is off by one."""
    committed = sum((k + 1) * count for k, count in enumerate(histogram))
    needed = sum(max(len(row) - 1, 0) for row in outputs)
    assert len(histogram) == block
    assert needed <= committed <= needed + len(outputs) * block, (committed, needed, histogram)


# ---- a tiny target and a drafter trained on it, shared by the speculative and refiner tests ----

SPEC_BLOCK = 4


@pytest.fixture(scope="session")
def target():
    from specjax.io.registry import LoadedModel
    from test_decode import TINY, _scaled_params

    return LoadedModel("tiny", TINY, _scaled_params(), tokenizer=None, eos_token_ids=(3,))


def tiny_distillation_set(target, folder, seed, n=48):
    from specjax.decode.engine import Engine
    from specjax.decode.sampling import SamplingConfig
    from specjax.models.drafter import DrafterConfig
    from specjax.train.drafter import build_distillation_set

    config = target.config
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, config.vocab_size, size=rng.integers(2, 6)).tolist() for _ in range(n)]
    out = Engine(target).generate(prompts, 40, SamplingConfig(temperature=1.0), seed=seed, ignore_eos=True).tokens
    taps = DrafterConfig.for_target(config, num_taps=2).target_layer_ids
    return build_distillation_set(target.params, config, [(p + o, len(p)) for p, o in zip(prompts, out)], folder,
                                  taps, seq_len=48, teacher_labels=True, progress=False)


def train_tiny_drafter(target, root, steps=150):
    """A drafter for a tiny target, trained for a few seconds so that drafts are accepted often
    enough to exercise every branch of the acceptance rules."""
    from specjax.io.dflash import LoadedDrafter
    from specjax.models.drafter import DrafterConfig
    from specjax.train.drafter import DrafterTrainConfig, train_drafter
    from specjax.train.loop import LoopConfig, OptimizerConfig

    config = target.config
    train_set, heldout = tiny_distillation_set(target, root / "train", 0), tiny_distillation_set(target, root / "heldout", 1, 8)
    drafter_config = DrafterConfig.for_target(config, num_layers=1, block_size=SPEC_BLOCK, num_taps=2)
    params = train_drafter(target.params, config, drafter_config, train_set, root / "run",
                           OptimizerConfig(learning_rate=3e-3, warmup_steps=10, total_steps=steps),
                           LoopConfig(steps=steps, eval_every=steps, checkpoint_every=steps, progress=False),
                           DrafterTrainConfig(sequences_per_batch=4, anchors_per_sequence=16), heldout=heldout)
    return LoadedDrafter("tiny-drafter", drafter_config, params, config.num_layers)


@pytest.fixture(scope="session")
def drafter(target, tmp_path_factory):
    """A drafter for the tiny target (see train_tiny_drafter)."""
    return train_tiny_drafter(target, tmp_path_factory.mktemp("drafter"))


def recorded_build_data(monkeypatch, generate):
    """build_data's steps without a model: `generate` stands in for the generator, and the features
    pass only records the folders it would build. Returns (a toy model whose tokenizer encodes each
    character as its code point, the list of folders built)."""
    import types

    import specjax.data.corpora
    import specjax.train.drafter
    import specjax.train.selfdistill

    built: list[str] = []

    def features(params, config, sequences, folder, taps, seq_len, teacher_labels, topk, **_):
        built.append(folder.name)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "meta.json").write_text("{}")

    monkeypatch.setattr(specjax.train.selfdistill, "generate_continuations", generate)
    monkeypatch.setattr(specjax.train.drafter, "build_distillation_set", features)
    monkeypatch.setattr(specjax.train.drafter.DistillationSet, "open", staticmethod(lambda folder: folder))
    monkeypatch.setattr(specjax.train.drafter, "without_looping", lambda s: (s, 0))
    monkeypatch.setattr(specjax.data.corpora, "load_split", lambda corpora: ([], []))
    tokenizer = types.SimpleNamespace(encode_chat=lambda text: [ord(c) for c in text], chat_template="{{ messages }}")
    model = types.SimpleNamespace(name="toy", tokenizer=tokenizer, params=None, config=None, eos_token_ids=(3,))
    return model, built
