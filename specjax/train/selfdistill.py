"""Self-distillation data at scale: the target's greedy continuations of many prompts, decoded by a
batch that never runs half empty.

A fixed number of rows decode together. Between host syncs the device runs `steps_per_sync` greedy
steps in one `lax.fori_loop`; at each sync the host collects the rows that finished (EOS or the
token limit) and prefills queued prompts into them, several rows in one jitted call, while the
other rows keep their caches. A batch decoded to completion instead idles every row that stops
early until the longest one ends.

Prompts are queued shortest first, and the cache starts only as wide as the first prompts need
(their length, rounded up to `prompt_bucket`, plus max_new_tokens); it grows when a longer prompt
comes up. Every step's attention reads every slot of the cache, so on a CPU a batch of short
prompts decodes faster over a narrower cache.

Finished sequences are appended to a JSONL file as they complete, so an interrupted run resumes
where it stopped, and the file is what `build_distillation_set` reads afterwards.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import shutil
import time
from functools import partial
from pathlib import Path
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.decode.autoregressive import _eos_array, prefill
from specjax.errors import SpecjaxError, check_at_least
from specjax.models.cache import KVCache
from specjax.models.config import TransformerConfig
from specjax.models.transformer import forward


@dataclasses.dataclass(frozen=True)
class GeneratorConfig:
    """Shape of the self-distillation generator; one compilation per distinct value."""

    batch_size: int = 64
    """Rows decoding at once."""
    max_prompt_tokens: int = 128
    """Longest prompt accepted (the prefill bucket); longer ones are skipped and counted."""
    max_new_tokens: int = 128
    """Most tokens generated per prompt (EOS ends a row earlier)."""
    steps_per_sync: int = 16
    """Greedy steps the device runs between two host syncs."""
    refill_rows: int = 16
    """Rows prefilled per insert call (a fixed shape; a partly used call pads)."""
    prompt_bucket: int = 32
    """Insert calls pad their prompts to the next multiple of this (at most max_prompt_tokens), so a
    batch of short prompts is not prefilled at full width; one compilation per width."""
    grow_cache: bool = True
    """Start the cache as wide as the shortest prompts need and widen it by prompt_bucket as longer
    ones come up (one compilation per width); False keeps max_prompt_tokens + max_new_tokens slots
    from the start."""

    def __post_init__(self):
        check_at_least(1, batch_size=self.batch_size, max_prompt_tokens=self.max_prompt_tokens,
                       max_new_tokens=self.max_new_tokens, steps_per_sync=self.steps_per_sync,
                       refill_rows=self.refill_rows, prompt_bucket=self.prompt_bucket)
        if self.refill_rows > self.batch_size:
            raise SpecjaxError(f"refill_rows ({self.refill_rows}) cannot exceed batch_size ({self.batch_size})")

    @property
    def row_length(self) -> int:
        """Cache slots and token slots per row: prompt plus continuation."""
        return self.max_prompt_tokens + self.max_new_tokens


@struct.dataclass
class GeneratorState:
    """The rows being decoded, carried between syncs."""

    tokens: jax.Array
    """[B, L] int32: prompt then generated tokens of each row."""
    lengths: jax.Array
    """[B] int32: cache slots filled; last_token sits at this slot, and at tokens[:, lengths]."""
    num_generated: jax.Array
    """[B] int32: tokens generated so far (the EOS included)."""
    done: jax.Array
    """[B] bool: the row is finished (or empty) and may be collected and refilled."""
    cache: KVCache


def empty_state(config: TransformerConfig, gen: GeneratorConfig) -> GeneratorState:
    batch = gen.batch_size
    return GeneratorState(
        tokens=jnp.zeros((batch, gen.row_length), jnp.int32),
        lengths=jnp.zeros((batch,), jnp.int32),
        num_generated=jnp.zeros((batch,), jnp.int32),
        done=jnp.ones((batch,), bool),
        cache=KVCache.zeros(config, batch, gen.row_length),
    )


@partial(jax.jit, static_argnames=("config", "gen", "eos_token_ids"), donate_argnames=("state",))
def insert_prompts(params, state: GeneratorState, rows, prompts, prompt_lengths, *, config: TransformerConfig,
                   gen: GeneratorConfig, eos_token_ids: tuple[int, ...]) -> GeneratorState:
    """Prefill prompts [R, P] (right-padded; prompt_lengths [R]) into batch rows `rows` [R]; a row
    index of batch_size marks a padding entry, which is dropped. The first token is the prefill's argmax."""
    count, width = prompts.shape
    logits, cache, _ = prefill(params, config, prompts, prompt_lengths, gen.row_length)
    first = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [R]
    row_tokens = jnp.zeros((count, gen.row_length), jnp.int32).at[:, :width].set(prompts)
    row_tokens = row_tokens.at[jnp.arange(count), prompt_lengths].set(first)
    put = lambda whole, part: whole.at[rows].set(part.astype(whole.dtype), mode="drop")  # noqa: E731
    return GeneratorState(
        tokens=put(state.tokens, row_tokens),
        lengths=put(state.lengths, prompt_lengths),
        num_generated=put(state.num_generated, jnp.ones((count,), jnp.int32)),
        done=put(state.done, jnp.isin(first, _eos_array(eos_token_ids)) | (gen.max_new_tokens == 1)),
        cache=KVCache(tuple(put(a, b) for a, b in zip(state.cache.keys, cache.keys)),
                      tuple(put(a, b) for a, b in zip(state.cache.values, cache.values))),
    )


@partial(jax.jit, static_argnames=("config", "gen", "eos_token_ids"), donate_argnames=("state",))
def decode_steps(params, state: GeneratorState, *, config: TransformerConfig, gen: GeneratorConfig,
                 eos_token_ids: tuple[int, ...]) -> GeneratorState:
    """steps_per_sync greedy steps for every live row; finished rows stand still."""
    eos = _eos_array(eos_token_ids)
    rows = jnp.arange(gen.batch_size)

    def one_step(_, s: GeneratorState):
        last = s.tokens[rows, s.lengths]  # [B]
        out = forward(params, config, last[:, None], s.lengths[:, None], s.cache, s.lengths)
        token = jnp.argmax(out.logits[:, 0], axis=-1).astype(jnp.int32)  # [B]
        live = ~s.done
        # A finished row writes nothing and stays put, so it never runs past its slots.
        slot = jnp.where(live, s.lengths + 1, gen.row_length)
        generated = s.num_generated + live
        return GeneratorState(
            tokens=s.tokens.at[rows, slot].set(token, mode="drop"),
            lengths=s.lengths + live,
            num_generated=generated,
            done=s.done | (live & (jnp.isin(token, eos) | (generated >= gen.max_new_tokens))),
            cache=out.cache,
        )

    return jax.lax.fori_loop(0, gen.steps_per_sync, one_step, state)


@dataclasses.dataclass
class GenerationReport:
    sequences: int
    """Prompts answered in this call (resumed ones not counted)."""
    new_tokens: int
    """Tokens generated in this call."""
    seconds: float
    """Wall time of this call, compilation included."""
    skipped_long_prompts: int
    """Prompts longer than max_prompt_tokens, not answered."""
    cache_slots: tuple[int, ...] = ()
    """The cache widths the batch decoded with, in order (it grows as longer prompts come up)."""

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0


def read_continuations(path: str | Path) -> dict[int, tuple[list[int], list[int]]]:
    """prompt index -> (prompt ids, generated ids) from a generator's JSONL file. A line cut short by
    an interruption is ignored (its prompt is generated again)."""
    path = Path(path)
    found = {}
    if not path.exists():
        return found
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        found[int(record["index"])] = (record["prompt"], record["generated"])
    return found


def _drop_cut_line(path: Path) -> None:
    """Truncate a line an interruption cut short, so appending starts on a line of its own."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with path.open("r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)


def _cache_can_grow(config: TransformerConfig, gen: GeneratorConfig) -> bool:
    """Whether every layer's cache is one slot per position up to the full row length: a ring
    (a sliding-window layer) would lay its slots out anew when it widened."""
    return all(config.layer_cache_slots(i, n) == n for i in range(config.num_layers)
               for n in (gen.max_new_tokens + 1, gen.row_length))


@partial(jax.jit, static_argnames=("gen",))  # a wider result cannot reuse the donated buffers
def grow_state(state: GeneratorState, *, gen: GeneratorConfig) -> GeneratorState:
    """The same rows over a cache of gen.row_length slots: new slots are empty, at the end of each
    row, so rows in flight keep their positions and their attention masks them out."""
    def widen(a):  # [B, S, ...] -> [B, row_length, ...]
        return jnp.pad(a, [(0, 0), (0, gen.row_length - a.shape[1])] + [(0, 0)] * (a.ndim - 2))

    return dataclasses.replace(state, tokens=widen(state.tokens),
                               cache=KVCache(tuple(map(widen, state.cache.keys)), tuple(map(widen, state.cache.values))))


def _check_disk(folder: Path, prompts: int, gen: GeneratorConfig) -> None:
    # About 8 bytes per token id in JSON, prompt plus continuation.
    need = prompts * gen.row_length * 8
    free = shutil.disk_usage(folder).free
    if free < need:
        raise SpecjaxError(f"{folder}: {free / 2**20:.0f} MiB free, the continuations need about "
                           f"{need / 2**20:.0f} MiB; free space or choose another --out")


def generate_continuations(params, config: TransformerConfig, prompts: Sequence[Sequence[int]], out_path: str | Path,
                           gen: GeneratorConfig = GeneratorConfig(), eos_token_ids: tuple[int, ...] = (),
                           progress: bool = True, deadline: float | None = None) -> GenerationReport:
    """Greedy continuations of token-id prompts, appended to out_path (JSONL: index, prompt,
    generated) as each finishes. Prompts already in the file are skipped, so rerunning resumes.

    deadline: a `time.monotonic()` value after which no further prompt is started; the rows in
    flight finish, and a rerun answers the rest (for a machine lent for minutes)."""
    from tqdm.auto import tqdm

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    ordered, too_long = _prompts_to_answer(out_path, prompts, gen)
    queue: Iterator[int] = iter(ordered)
    pending = len(ordered)
    _check_disk(out_path.parent, pending, gen)

    def bucket(length: int) -> int:
        return min(-(-length // gen.prompt_bucket) * gen.prompt_bucket, gen.max_prompt_tokens)

    started = time.perf_counter()
    growable = gen.grow_cache and _cache_can_grow(config, gen)
    current = gen  # the shape decoding runs at: as wide as the prompts inserted so far need
    if growable and ordered:
        current = dataclasses.replace(gen, max_prompt_tokens=bucket(len(prompts[ordered[0]])))
    state = empty_state(config, current)
    widths = [current.row_length]
    owner = np.full(gen.batch_size, -1)  # prompt index decoding in each row, -1 for an empty row
    new_tokens = answered = 0
    statics = dict(config=config, gen=current, eos_token_ids=tuple(eos_token_ids))
    bar = tqdm(total=pending, desc="self-distillation", unit="prompt", disable=not progress)
    with out_path.open("a") as sink:
        exhausted = False
        while True:
            done, lengths, generated = jax.device_get((state.done, state.lengths, state.num_generated))
            ready = np.flatnonzero(done & (owner >= 0))
            if len(ready):
                new_tokens += _write_answers(sink, state, ready, owner, lengths, generated)
                answered += len(ready)
                bar.update(len(ready))
                bar.set_postfix(tok_s=f"{new_tokens / (time.perf_counter() - started):.0f}")
            free = np.flatnonzero(owner < 0)
            if deadline is not None and time.monotonic() > deadline:
                exhausted = True
            # Refill in whole insert calls while prompts remain.
            while not exhausted and len(free):
                batch = list(itertools.islice(queue, min(gen.refill_rows, len(free))))
                if not batch:
                    exhausted = True
                    break
                rows = np.full(gen.refill_rows, gen.batch_size, np.int32)
                rows[: len(batch)] = free[: len(batch)]
                width = bucket(max(len(prompts[i]) for i in batch))
                if width > current.max_prompt_tokens:
                    current = dataclasses.replace(gen, max_prompt_tokens=width)
                    state = grow_state(state, gen=current)
                    statics["gen"] = current
                    widths.append(current.row_length)
                ids = np.zeros((gen.refill_rows, width), np.int32)
                lens = np.ones(gen.refill_rows, np.int32)
                for j, i in enumerate(batch):
                    ids[j, : len(prompts[i])] = prompts[i]
                    lens[j] = len(prompts[i])
                state = insert_prompts(params, state, jnp.asarray(rows), jnp.asarray(ids), jnp.asarray(lens), **statics)
                owner[free[: len(batch)]] = batch
                free = free[len(batch):]
            if (owner < 0).all():
                break
            state = decode_steps(params, state, **statics)
    bar.close()
    return GenerationReport(answered, new_tokens, time.perf_counter() - started, len(too_long), tuple(widths))


def _prompts_to_answer(out_path: Path, prompts: Sequence[Sequence[int]], gen: GeneratorConfig):
    """(indices of the prompts still to answer, shortest first; indices of those too long to fit),
    after the answers already in out_path, which must be to these same prompts."""
    _drop_cut_line(out_path)
    finished = read_continuations(out_path)
    # A resumed run must be answering the same prompt list: indices are positions in it.
    strangers = [i for i, (prompt, _) in finished.items() if i >= len(prompts) or list(prompts[i]) != prompt]
    if strangers:
        raise SpecjaxError(f"{out_path} holds answers to other prompts than these ({len(strangers)} of {len(finished)}, "
                           f"first at index {min(strangers)}): it was made with another prompt list (another seed, "
                           "count or --avoid-prompts-from); write to a new folder")
    todo = [i for i in range(len(prompts)) if i not in finished]
    too_long = [i for i in todo if not 0 < len(prompts[i]) <= gen.max_prompt_tokens]
    # Prompts of similar length are inserted together, so an insert call pads little, and shortest
    # first, so the cache can start narrow and grow.
    ordered = sorted((i for i in todo if i not in set(too_long)), key=lambda i: len(prompts[i]))
    return ordered, too_long


def _write_answers(sink, state, ready: np.ndarray, owner: np.ndarray, lengths, generated) -> int:
    """Append the finished rows' answers to sink and free their rows; the tokens they generated."""
    new_tokens = 0
    tokens = np.asarray(jax.device_get(state.tokens[jnp.asarray(ready)]))
    for row, ids in zip(ready, tokens):
        start = int(lengths[row]) + 1 - int(generated[row])
        sink.write(json.dumps({"index": int(owner[row]), "prompt": ids[:start].tolist(),
                               "generated": ids[start : lengths[row] + 1].tolist()}) + "\n")
        new_tokens += int(generated[row])
        owner[row] = -1
    sink.flush()
    return new_tokens


def self_instruct_prompts(params, config: TransformerConfig, tokenizer, count: int, out_path: str | Path,
                          gen: GeneratorConfig, eos_token_ids: tuple[int, ...] = (), seed: int = 0,
                          progress: bool = True) -> list[str]:
    """Requests the target writes itself (self-instruct): it answers `count` distinct instructions
    ("write a question that a nurse might ask about sleep...") greedily, through the same refilled
    batch, into out_path (so a rerun resumes); each answer's first line, cleaned, becomes a prompt.
    Answers that hold no request, repeat an earlier one, or touch a held-out prompt or its topic are
    dropped, so fewer than `count` prompts come back."""
    from specjax.data.prompts import clean_self_instruct, self_instruct_requests

    instructions = self_instruct_requests(count, seed)
    generate_continuations(params, config, [tokenizer.encode_chat(t) for t in instructions], out_path, gen,
                           eos_token_ids, progress)
    prompts, seen = [], set()
    found = read_continuations(out_path)
    for index in sorted(found):
        prompt = clean_self_instruct(tokenizer.decode(found[index][1]))
        if prompt is not None and prompt.lower() not in seen:
            seen.add(prompt.lower())
            prompts.append(prompt)
    return prompts
