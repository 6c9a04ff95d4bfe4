"""The host-side entry point: validate a request, pad it to a static shape, compile once, run, time.

Compilation is done ahead of time (`lower().compile()`) so its cost is reported apart from the
decode time, and compiled executables are cached per shape bucket so repeated calls do not
recompile.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.decode.autoregressive import generate_autoregressive
from specjax.decode.sampling import SamplingConfig
from specjax.errors import SpecjaxError
from specjax.io.registry import LoadedModel

METHODS = ("ar",)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclasses.dataclass
class GenerationResult:
    tokens: list[list[int]]
    """Generated token ids per prompt (EOS included when it was produced)."""
    stats: dict[str, Any]
    """tokens_per_s, compile_s, wall_s, new_tokens, plus method-specific keys."""


@dataclasses.dataclass(frozen=True)
class DecodeRequestShape:
    """The static part of a request; one compiled executable per distinct value."""

    method: str
    batch: int
    prompt_bucket: int
    cache_length: int
    max_new_tokens: int
    sampling: SamplingConfig
    eos_token_ids: tuple[int, ...]


class Engine:
    """Decodes with one model; keeps compiled executables between calls."""

    def __init__(self, model: LoadedModel, prompt_bucket: int = 32):
        self.model = model
        self.prompt_bucket = prompt_bucket
        self._compiled: dict[DecodeRequestShape, Any] = {}

    def validate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
        cfg = self.model.config
        if not prompts:
            raise SpecjaxError("no prompts given")
        if max_new_tokens < 1:
            raise SpecjaxError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise SpecjaxError(f"prompt {i} is empty; give at least one token")
            bad = [t for t in prompt if not 0 <= int(t) < cfg.vocab_size]
            if bad:
                raise SpecjaxError(
                    f"prompt {i} has token id {bad[0]} outside the vocabulary [0, {cfg.vocab_size})"
                )
            if len(prompt) + max_new_tokens > cfg.max_position_embeddings:
                raise SpecjaxError(
                    f"prompt {i} has {len(prompt)} tokens; with max_new_tokens={max_new_tokens} that is "
                    f"{len(prompt) + max_new_tokens}, beyond the model's context of {cfg.max_position_embeddings}"
                )

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 64,
                 sampling: SamplingConfig = SamplingConfig(), seed: int = 0, ignore_eos: bool = False,
                 method: str = "ar") -> GenerationResult:
        if method not in METHODS:
            raise SpecjaxError(f"unknown method {method!r}; available: {', '.join(METHODS)}")
        self.validate(prompts, max_new_tokens)
        longest = max(len(p) for p in prompts)
        bucket = _round_up(longest, self.prompt_bucket)
        shape = DecodeRequestShape(
            method=method,
            batch=len(prompts),
            prompt_bucket=bucket,
            # Rows stop advancing once done, so prompt + max_new slots always suffice.
            cache_length=_round_up(bucket + max_new_tokens, 64),
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            eos_token_ids=() if ignore_eos else tuple(self.model.eos_token_ids),
        )
        tokens = np.zeros((len(prompts), bucket), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = p
        lengths = np.array([len(p) for p in prompts], np.int32)
        args = (self.model.params, jnp.asarray(tokens), jnp.asarray(lengths), jax.random.key(seed))

        compile_s = 0.0
        if shape not in self._compiled:
            start = time.perf_counter()
            self._compiled[shape] = generate_autoregressive.lower(
                *args, config=self.model.config, sampling=sampling, max_new_tokens=max_new_tokens,
                eos_token_ids=shape.eos_token_ids, cache_length=shape.cache_length,
            ).compile()
            compile_s = time.perf_counter() - start
        start = time.perf_counter()
        out_tokens, num_generated = jax.block_until_ready(self._compiled[shape](*args))
        wall_s = time.perf_counter() - start

        out_tokens, num_generated = np.asarray(out_tokens), np.asarray(num_generated)
        rows = [out_tokens[i, : num_generated[i]].tolist() for i in range(len(prompts))]
        new_tokens = int(num_generated.sum())
        stats = {
            "method": method,
            "tokens_per_s": new_tokens / wall_s,
            "compile_s": compile_s,
            "wall_s": wall_s,
            "new_tokens": new_tokens,
        }
        return GenerationResult(rows, stats)
