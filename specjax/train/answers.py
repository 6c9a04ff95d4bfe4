"""Self-distilled answers made on another machine: export a recipe's prompts, answer them where a
GPU is lent, bring the answers back.

On a 2-core CPU the target answers about 60 tokens a second, so a million self-distilled tokens
take hours; a lent GPU answers them in minutes. The three steps:

    specjax train-drafter --out runs/x <recipe> --export-prompts runs/x/prompts    # here
    specjax answer-prompts runs/x/prompts --out answers --time-limit 400           # on the GPU
    specjax train-drafter --out runs/x <recipe> --answers-from answers             # here again

A prompt set holds the exact token ids the recipe's generator would answer, in its order, with the
generator's prompt and answer limits, so an answer can be checked against its prompt on import (an
answer to another prompt list is refused) and the data step finds every prompt answered. Answers
are the target's greedy output on the machine that made them: another device or batch size can
round differently and so, rarely, pick another token; the answers stay the target's own.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import shutil
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from specjax.errors import SpecjaxError

PROMPTS_SUFFIX = ".prompts.npz"
ANSWERS_SUFFIX = ".continuations.jsonl"


@dataclasses.dataclass(frozen=True)
class PromptSet:
    """One distillation set's prompts, as exported for answering elsewhere."""

    name: str
    """The set (its folder's name in the run's data folder, e.g. "sharegpt")."""
    prompts: tuple[tuple[int, ...], ...]
    """Token ids of each prompt, in the order the answers' indices refer to."""
    max_prompt_tokens: int
    """Longest prompt the recipe's generator accepts; longer ones are skipped there and here."""
    max_new_tokens: int
    """Most tokens answered per prompt."""
    eos_token_ids: tuple[int, ...]
    """Ids that end an answer."""
    model: str
    """The target that must answer (a registry name or path, as the recipe's run named it)."""
    dtype: str
    """Its compute precision, the recipe's ("float32" or "bfloat16")."""

    @property
    def answers_file(self) -> str:
        return self.name + ANSWERS_SUFFIX


def write_prompt_set(path: str | Path, prompt_set: PromptSet) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lengths = np.asarray([len(p) for p in prompt_set.prompts], np.int64)
    flat = np.asarray([t for p in prompt_set.prompts for t in p], np.int32)
    meta = {f.name: getattr(prompt_set, f.name) for f in dataclasses.fields(PromptSet) if f.name != "prompts"}
    np.savez_compressed(path, ids=flat, offsets=np.concatenate([[0], np.cumsum(lengths)]), meta=json.dumps(meta))
    return path


def read_prompt_set(path: str | Path) -> PromptSet:
    path = Path(path)
    try:
        with np.load(path) as z:
            ids, offsets, meta = z["ids"], z["offsets"], json.loads(str(z["meta"]))
    except (OSError, KeyError, ValueError) as err:
        raise SpecjaxError(f"{path}: not a prompt set written by --export-prompts ({err})") from None
    prompts = tuple(tuple(int(t) for t in ids[a:b]) for a, b in zip(offsets[:-1], offsets[1:]))
    meta["eos_token_ids"] = tuple(meta["eos_token_ids"])
    return PromptSet(prompts=prompts, **meta)


def prompt_sets_in(folder: str | Path) -> list[Path]:
    folder = Path(folder)
    found = sorted(folder.glob("*" + PROMPTS_SUFFIX))
    if not found:
        raise SpecjaxError(f"{folder}: no *{PROMPTS_SUFFIX} (write them with train-drafter --export-prompts)")
    return found


@dataclasses.dataclass(frozen=True)
class AnswerReport:
    """What one call of `answer_prompt_sets` did for one set."""

    name: str
    """The set."""
    prompts: int
    """Prompts in the set that fit the generator."""
    answered: int
    """Of those, answered in the answers file (earlier calls included)."""
    new_tokens: int
    """Tokens generated in this call."""
    seconds: float
    """Wall time of this call for the set, compilation included."""
    tokens_per_s: float
    """new_tokens over seconds."""


def answer_prompt_sets(model, folder: str | Path, out: str | Path, batch_size: int = 256,
                       time_limit_s: float | None = None, progress: bool = True) -> list[AnswerReport]:
    """The target's greedy answers to every exported set in `folder`, appended to
    `out/<set>.continuations.jsonl` (a rerun continues). Sets are answered held-out first (they are
    small and every estimate needs them); no prompt is started after `time_limit_s`."""
    from specjax.train.selfdistill import GeneratorConfig, generate_continuations, read_continuations

    out = Path(out)
    deadline = time.monotonic() + time_limit_s if time_limit_s else None
    paths = sorted(prompt_sets_in(folder), key=lambda p: (not p.name.startswith("heldout"), p.name))
    reports = []
    for path in paths:
        prompt_set = read_prompt_set(path)
        gen = GeneratorConfig(batch_size=batch_size, max_prompt_tokens=prompt_set.max_prompt_tokens,
                              max_new_tokens=prompt_set.max_new_tokens, refill_rows=max(1, batch_size // 4))
        fits = sum(0 < len(p) <= gen.max_prompt_tokens for p in prompt_set.prompts)
        _uncompress(out / prompt_set.answers_file)  # a rerun after --compress continues from the answers so far
        report = generate_continuations(model.params, model.config, prompt_set.prompts, out / prompt_set.answers_file,
                                        gen, prompt_set.eos_token_ids, progress=progress, deadline=deadline)
        answered = len(read_continuations(out / prompt_set.answers_file))
        reports.append(AnswerReport(prompt_set.name, fits, answered, report.new_tokens, round(report.seconds, 1),
                                    round(report.tokens_per_s, 1)))
    return reports


def answers_file_in(source: str | Path, name: str) -> Path | None:
    """`source/<name>.continuations.jsonl`, or its .gz, whichever exists."""
    for path in (Path(source) / (name + ANSWERS_SUFFIX), Path(source) / (name + ANSWERS_SUFFIX + ".gz")):
        if path.exists():
            return path
    return None


def merge_answers(source: Path, target: Path, prompts: Sequence[Sequence[int]]) -> int:
    """Append the answers in `source` (plain or .gz) to the answers file `target`, after checking each
    against `prompts`, the list its indices refer to: answers to another prompt list are refused
    before anything is written. An index `target` already holds is kept as it is; a line cut short
    where the answering machine stopped is skipped. Returns the answers added."""
    from specjax.train.selfdistill import _drop_cut_line, read_continuations

    opener = gzip.open if source.suffix == ".gz" else open
    with opener(source, "rt") as f:
        records = []
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    strangers = [r["index"] for r in records
                 if not 0 <= r["index"] < len(prompts) or list(prompts[r["index"]]) != r["prompt"]]
    if strangers:
        raise SpecjaxError(f"{source}: {len(strangers)} of {len(records)} answers are to other prompts than this "
                           f"recipe's (first at index {min(strangers)}): they were exported from another recipe, "
                           "seed or model")
    target.parent.mkdir(parents=True, exist_ok=True)
    _drop_cut_line(target)
    have = set(read_continuations(target))
    fresh = [r for r in records if r["index"] not in have and not have.add(r["index"])]
    with target.open("a") as sink:
        sink.writelines(json.dumps(r) + "\n" for r in fresh)
    return len(fresh)


def _uncompress(path: Path) -> None:
    packed = Path(str(path) + ".gz")
    if packed.exists() and not path.exists():
        with gzip.open(packed, "rb") as src, path.open("wb") as dst:
            shutil.copyfileobj(src, dst)
        packed.unlink()


def compress_answers(folder: str | Path) -> list[Path]:
    """Gzip every answers file in `folder` in place (about a fifth the size: what a lent machine
    sends back is limited)."""
    written = []
    for path in sorted(Path(folder).glob("*" + ANSWERS_SUFFIX)):
        with path.open("rb") as src, gzip.open(str(path) + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        path.unlink()
        written.append(Path(str(path) + ".gz"))
    return written


def export_set(folder: Path, name: str, prompts: Sequence[Sequence[int]], gen, eos_token_ids, model: str,
               dtype: str) -> Path:
    """Write one set's prompts as `folder/<name>.prompts.npz` (train-drafter --export-prompts)."""
    return write_prompt_set(folder / (name + PROMPTS_SUFFIX),
                            PromptSet(name, tuple(tuple(int(t) for t in p) for p in prompts), gen.max_prompt_tokens,
                                      gen.max_new_tokens, tuple(int(e) for e in eos_token_ids), model, dtype))


def target_of(paths: Sequence[Path]) -> tuple[str, str]:
    """(model, dtype) that every prompt set in `paths` asks for; sets of different targets are refused."""
    wanted = {(s.model, s.dtype) for s in map(read_prompt_set, paths)}
    if len(wanted) > 1:
        raise SpecjaxError(f"the prompt sets ask for different targets {sorted(wanted)}: answer each run's in its own call")
    return wanted.pop()
