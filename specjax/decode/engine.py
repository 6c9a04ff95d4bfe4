"""The host-side entry point: validate a request, pad it to a static shape, compile once, run, time.

Compilation is done ahead of time (`lower().compile()`) so its cost is reported apart from the
decode time, and compiled executables are cached per shape bucket so repeated calls do not
recompile.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.decode.autoregressive import continue_autoregressive, generate_autoregressive, start_autoregressive
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
    streaming: bool


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
                 method: str = "ar", on_tokens: Callable[[list[list[int]]], None] | None = None,
                 stream_every: int = 8) -> GenerationResult:
        """Decode a batch of token-id prompts.

        on_tokens, if given, is called with every row's tokens so far after each `stream_every`
        tokens: the loop then runs in chunks (one host sync per chunk, never per token) so a caller
        can show text as it appears. Without it the whole request is one device call.
        """
        if stream_every < 1:
            raise SpecjaxError(f"stream_every must be >= 1, got {stream_every}")
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
            streaming=on_tokens is not None,
        )
        tokens = np.zeros((len(prompts), bucket), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = p
        lengths = np.array([len(p) for p in prompts], np.int32)
        args = (self.model.params, jnp.asarray(tokens), jnp.asarray(lengths), jax.random.key(seed))

        statics = dict(config=self.model.config, sampling=sampling, eos_token_ids=shape.eos_token_ids)
        compile_s = 0.0
        if shape not in self._compiled:
            start = time.perf_counter()
            sized = dict(statics, max_new_tokens=max_new_tokens, cache_length=shape.cache_length)
            if shape.streaming:
                first = start_autoregressive.lower(*args, **sized).compile()
                state = jax.eval_shape(lambda: start_autoregressive(*args, **sized))
                rest = continue_autoregressive.lower(args[0], state, jnp.int32(0), **statics).compile()
                self._compiled[shape] = (first, rest)
            else:
                self._compiled[shape] = generate_autoregressive.lower(*args, **sized).compile()
            compile_s = time.perf_counter() - start
        start = time.perf_counter()
        if shape.streaming:
            first, rest = self._compiled[shape]
            state = first(*args)
            while True:
                state = rest(args[0], state, state.step + stream_every)
                counts = np.asarray(state.num_generated)
                on_tokens([np.asarray(state.tokens)[i, : counts[i]].tolist() for i in range(len(prompts))])
                if int(state.step) >= max_new_tokens or bool(np.all(np.asarray(state.done))):
                    break
            out_tokens, num_generated = state.tokens, state.num_generated
        else:
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
