"""Training a small target LM from scratch on the project's corpora (for tests and experiments).

The result is written as an ordinary HF folder (config.json, model.safetensors, tokenizer.json), so
every tool that takes `--model PATH` can use it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from specjax.errors import SpecjaxError, check_at_least, check_compute_dtype, check_positive_finite
from specjax.io.hf import save_hf_model
from specjax.io.tokenizer import TextTokenizer
from specjax.models.cache import KVCache
from specjax.models.config import TransformerConfig
from specjax.models.transformer import forward, init_params
from specjax.train.loop import LoopConfig, OptimizerConfig, train
from specjax.sharding import MeshConfig, built_once, is_writer

END_OF_TEXT = "<|endoftext|>"


MIN_VOCAB_SIZE = 260
"""The 256 byte tokens of byte-level BPE, the special tokens and room for merges."""


@dataclasses.dataclass(frozen=True)
class LMDataConfig:
    """How text becomes training batches."""

    vocab_size: int = 1024
    """Size of the byte-level BPE vocabulary trained on the training texts."""
    seq_len: int = 128
    """Tokens per training sequence."""
    batch_size: int = 16
    """Sequences per step."""
    eval_batches: int = 8
    """Held-out batches averaged for the evaluation loss."""

    def __post_init__(self):
        check_at_least(1, seq_len=self.seq_len, batch_size=self.batch_size, eval_batches=self.eval_batches)
        check_at_least(MIN_VOCAB_SIZE, vocab_size=self.vocab_size)

def tiny_lm_config(vocab_size: int, max_positions: int = 1024) -> TransformerConfig:
    """A ~1M-parameter Llama-style model that trains in minutes on 2 CPU cores."""
    return TransformerConfig(
        vocab_size=vocab_size, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
        intermediate_size=384, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
        max_position_embeddings=max_positions,
    )


def train_bpe_tokenizer(texts: Sequence[str], vocab_size: int) -> TextTokenizer:
    """A byte-level BPE tokenizer trained on texts, with <|endoftext|> (id 0) as EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    check_at_least(MIN_VOCAB_SIZE, vocab_size=vocab_size)
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[END_OF_TEXT], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(texts, trainer=trainer)
    eos = backend.token_to_id(END_OF_TEXT)
    return TextTokenizer(backend=backend, eos_token_ids=(eos,), eos_token=END_OF_TEXT, bos_token=None)


def token_stream(tokenizer: TextTokenizer, texts: Sequence[str]) -> np.ndarray:
    """All texts tokenized and joined with EOS between documents. -> [N] int32."""
    eos = tokenizer.eos_token_ids[0]
    pieces = []
    for encoding in tokenizer.backend.encode_batch(list(texts), add_special_tokens=False):
        pieces.append(np.asarray(encoding.ids, np.int32))
        pieces.append(np.asarray([eos], np.int32))
    return np.concatenate(pieces) if pieces else np.zeros((0,), np.int32)


def sample_windows(stream: np.ndarray, seed: int, step: int, batch_size: int, seq_len: int) -> np.ndarray:
    """batch_size random windows of seq_len + 1 tokens; a pure function of (seed, step). -> [B, T+1]."""
    if len(stream) < seq_len + 2:
        raise SpecjaxError(f"only {len(stream)} tokens of text, fewer than one sequence of {seq_len + 1}")
    starts = np.random.default_rng([seed, step]).integers(0, len(stream) - seq_len - 1, size=batch_size)
    return np.stack([stream[s : s + seq_len + 1] for s in starts])


def next_token_loss(params, config: TransformerConfig, batch: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy. batch: [B, T+1] int32."""
    inputs, labels = batch[:, :-1], batch[:, 1:]  # [B, T]
    batch_size, seq_len = inputs.shape
    positions = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), inputs.shape)
    cache = KVCache.zeros(config, batch_size, seq_len)
    logits = forward(params, config, inputs, positions, cache, jnp.zeros((batch_size,), jnp.int32),
                     empty_cache=True).logits
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def train_language_model(
    train_texts: Sequence[str],
    heldout_texts: Sequence[str],
    out_dir: str | Path,
    data: LMDataConfig = LMDataConfig(),
    optimizer: OptimizerConfig = OptimizerConfig(),
    loop: LoopConfig = LoopConfig(),
    model_config: TransformerConfig | None = None,
    dtype: str | None = None,
) -> dict:
    """Train a tokenizer and a small LM; write out_dir/model as an HF folder. Resumes from out_dir.

    dtype, when given, is the compute precision of the forward and backward passes (bfloat16: bf16
    inputs to every dot, float32 accumulation); the weights, their updates and the saved model stay
    float32. Returns a summary with the held-out loss and perplexity of the final model.
    """
    if dtype is not None:
        check_compute_dtype(dtype)
    out_dir = Path(out_dir)
    if not train_texts or not heldout_texts:
        raise SpecjaxError("need at least one training and one held-out document")
    tokenizer_dir = out_dir / "model"
    # Trained once and read back by every process (and by a resumed run), so all see the same ids.
    built_once(lambda: (tokenizer_dir / "tokenizer.json").exists(),
               lambda: train_bpe_tokenizer(train_texts, data.vocab_size).save(tokenizer_dir),
               f"the tokenizer in {tokenizer_dir}")
    tokenizer = TextTokenizer.from_hf_folder(tokenizer_dir)
    config = model_config or tiny_lm_config(tokenizer.vocab_size, max_positions=max(1024, data.seq_len))
    config = config if dtype is None else dataclasses.replace(config, dtype=dtype)
    train_stream = token_stream(tokenizer, train_texts)
    heldout_stream = token_stream(tokenizer, heldout_texts)
    eval_batches = [sample_windows(heldout_stream, 10_000 + loop.seed, i, data.batch_size, data.seq_len)
                    for i in range(data.eval_batches)]

    loss_fn = lambda params, batch, rng: (next_token_loss(params, config, batch), {})
    eval_loss = jax.jit(lambda params, batch: next_token_loss(params, config, batch))

    def evaluate(params) -> dict[str, float]:
        loss = float(np.mean([eval_loss(params, jnp.asarray(b)) for b in eval_batches]))
        return {"heldout_loss": loss, "heldout_perplexity": float(np.exp(loss))}

    params, _ = train(
        loss_fn,
        init_params(config, jax.random.key(loop.seed)),
        lambda step: jnp.asarray(sample_windows(train_stream, loop.seed, step, data.batch_size, data.seq_len)),
        out_dir,
        optimizer,
        loop,
        eval_fn=evaluate,
    )
    if is_writer():
        save_hf_model(tokenizer_dir, config, params)
    summary = {"train_tokens": int(len(train_stream)), "heldout_tokens": int(len(heldout_stream)), **evaluate(params)}
    return summary


@dataclasses.dataclass(frozen=True)
class LMRecipe:
    """A small target LM trained from scratch on the project's corpora (`specjax train-lm`)."""

    corpora: tuple[str, ...] = ("shakespeare",)
    """Corpora (specjax.data.corpora) whose training split the model reads; their held-out split scores it."""
    corpus_chars: int = 0
    """Characters of training text, whole documents in order and the last one cut (0: all of it); the
    held-out text is a tenth as much."""
    vocab_size: int = 1024
    """Size of the byte-level BPE vocabulary trained on the training text."""
    seq_len: int = 128
    """Tokens per training sequence."""
    batch_size: int = 16
    """Sequences per step."""
    steps: int = 2000
    """Optimizer steps."""
    learning_rate: float = 3e-3
    """Peak AdamW learning rate (warmup over a tenth of the run, at most 100 steps, then cosine decay)."""
    eval_every: int = 200
    """Steps between held-out evaluations (and one before the first step)."""
    eval_batches: int = 8
    """Held-out batches averaged for each evaluation."""
    checkpoint_every: int = 200
    """Steps between orbax checkpoints; a rerun resumes from the latest."""
    seed: int = 0
    """Seeds the initial weights and the order of the training windows."""
    dtype: str | None = None
    """Compute precision of the forward and backward passes (None: the model's float32)."""
    mesh: MeshConfig = MeshConfig()
    """Devices to train over; one by default."""
    progress: bool = True
    """Draw a progress bar."""

    def __post_init__(self):
        from specjax.data.corpora import check_corpus_names

        check_corpus_names(list(self.corpora))
        check_at_least(0, corpus_chars=self.corpus_chars)
        check_at_least(1, steps=self.steps)
        check_positive_finite(learning_rate=self.learning_rate)
        if self.dtype is not None:
            check_compute_dtype(self.dtype)
        LMDataConfig(self.vocab_size, self.seq_len, self.batch_size, self.eval_batches)  # checks those


def text_slice(docs, chars: int) -> list[str]:
    """Whole documents' texts in order, the last one cut, up to `chars` characters (0: all)."""
    if not chars:
        return [doc.text for doc in docs]
    texts, left = [], chars
    for doc in docs:
        if left <= 0:
            break
        texts.append(doc.text[:left])
        left -= len(texts[-1])
    return texts


def train_lm_recipe(out_dir: str | Path, recipe: LMRecipe = LMRecipe()) -> dict:
    """Train a tokenizer and a small LM on the recipe's corpora; the model is written to
    out_dir/model as an HF folder that `specjax.LLM(path)` and `--model PATH` read. Rerunning with
    the same out_dir resumes. Returns the held-out loss and perplexity, the tokens read, and the
    model's folder."""
    from specjax.data.corpora import load_split

    train_docs, heldout_docs = load_split(tuple(recipe.corpora))
    summary = train_language_model(
        text_slice(train_docs, recipe.corpus_chars), text_slice(heldout_docs, recipe.corpus_chars // 10), out_dir,
        LMDataConfig(recipe.vocab_size, recipe.seq_len, recipe.batch_size, recipe.eval_batches),
        OptimizerConfig(learning_rate=recipe.learning_rate, warmup_steps=min(100, recipe.steps // 10),
                        total_steps=recipe.steps),
        LoopConfig(steps=recipe.steps, seed=recipe.seed, eval_every=recipe.eval_every,
                   checkpoint_every=recipe.checkpoint_every, mesh=recipe.mesh, progress=recipe.progress),
        dtype=recipe.dtype)
    return {**summary, "model": str(Path(out_dir) / "model")}
