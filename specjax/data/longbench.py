"""Long-context tasks with exact answers, built from the public-domain corpora (`data/corpora.py`).

Each task is a long document, a question about one place in it, and the answer, at a chosen context
length in target tokens:
- `verse`: consecutive verses of a book of the King James Bible, each line prefixed by its
  reference ("Ge24:17 And the servant ran ..."); asked for the text of one reference.
- `speaker`: a stretch of a Shakespeare play; asked who speaks one line (the speaker's name as
  the text writes it, "Hor." for Horatio).
- `needle`: a stretch of an Austen novel with one sentence inserted at a random depth ("The secret
  passphrase is <word>."); asked for the passphrase.

Tasks are drawn with a seed, so a benchmark's set is the same on every run. `is_correct` scores an
output by the answer's words at its start (verse: the verse's first eight words), after lower-casing
and dropping punctuation.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Sequence

import numpy as np

from specjax.errors import SpecjaxError

TASKS = ("verse", "speaker", "needle")
NEEDLE_WORDS = ("marmalade", "lighthouse", "saffron", "harpsichord", "quicksilver", "tamarind", "zeppelin",
                "periwinkle", "obsidian", "calliope", "bergamot", "kestrel")


@dataclasses.dataclass(frozen=True)
class LongTask:
    """One long-context question with its exact answer."""

    task: str
    context: str
    question: str
    answer: str
    context_tokens: int
    """Target tokens of `context` (the prompt adds the question and the chat template)."""
    source: str
    """Where the context comes from: a book or play, and the place asked about."""

    def answered_by(self, output: str) -> bool:
        """Whether `output` answers this task (`is_correct`)."""
        return is_correct(self, output)


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def is_correct(task: LongTask, output: str) -> bool:
    """Whether output answers the task: its first words are the answer's (verse: the first eight of
    the verse; speaker: the name, a prefix of it or it a prefix of the output's first word)."""
    said, wanted = _words(output), _words(task.answer)
    if not said or not wanted:
        return False
    if task.task == "speaker":
        name = "".join(wanted)
        return said[0].startswith(name) or name.startswith(said[0]) and len(said[0]) >= 3
    wanted = wanted[:8]
    start = next((i for i, w in enumerate(said[:12]) if w == wanted[0]), None)  # "The text is: ..." is fine
    return start is not None and said[start : start + len(wanted)] == wanted


def _window(units: Sequence[str], count_tokens: Callable[[str], int], tokens: int, rng, joiner: str):
    """A run of consecutive units (lines, paragraphs) of about `tokens` target tokens, starting at a
    random unit. Returns (first index, last index + 1)."""
    sizes = np.array([count_tokens(u + joiner) for u in units])
    total = sizes.sum()
    if total < tokens:
        raise SpecjaxError(f"the source has {total} tokens, fewer than the {tokens} asked for")
    ends = np.cumsum(sizes)
    latest = int(np.searchsorted(ends, total - tokens, side="right"))  # a start that still fits `tokens`
    start = int(rng.integers(0, latest + 1))
    offset = ends[start - 1] if start else 0
    stop = int(np.searchsorted(ends, offset + tokens, side="right"))  # the units after start that fit
    return start, max(stop, start + 1)


def verse_task(books, count_tokens, tokens: int, rng) -> LongTask:
    """books: the kjv corpus's Documents."""
    _enough(books, tokens, "kjv")
    big = [b for b in books if len(b.text) > tokens * 6]  # about 4 characters a token, with room to spare
    book = big[int(rng.integers(len(big)))]
    lines = book.text.split("\n")
    start, stop = _window(lines, count_tokens, tokens, rng, "\n")
    inside = lines[start:stop]
    # Ask about a verse away from the edges, whose reference is unambiguous.
    pick = inside[int(rng.integers(len(inside) // 10, max(len(inside) * 9 // 10, len(inside) // 10 + 1)))]
    reference, _, text = pick.partition(" ")
    return LongTask("verse", "\n".join(inside), f"What is the text of the verse {reference} above? Answer with "
                    "the verse text only.", text, count_tokens("\n".join(inside)), f"{book.title} {reference}")


_SPEAKER = re.compile(r"^([A-Z][A-Za-z' ]{0,24}\.)$")


def speaker_task(plays, count_tokens, tokens: int, rng) -> LongTask:
    """plays: Shakespeare documents (speeches are paragraphs whose first line is the speaker)."""
    _enough(plays, tokens, "shakespeare")
    big = [p for p in plays if len(p.text) > tokens * 6 and len(_speeches(p.text)) > 50]
    play = big[int(rng.integers(len(big)))]
    paragraphs = play.text.split("\n\n")
    start, stop = _window(paragraphs, count_tokens, tokens, rng, "\n\n")
    inside = paragraphs[start:stop]
    context = "\n\n".join(inside)
    candidates = []
    for speaker, line in _speeches(context):
        if len(_words(line)) >= 6 and context.count(line) == 1:
            candidates.append((speaker, line))
    if not candidates:
        raise SpecjaxError(f"no unambiguous speech in the chosen stretch of {play.title}")
    speaker, line = candidates[int(rng.integers(len(candidates)))]
    return LongTask("speaker", context, f'In the play above, who says "{line.strip()}"? Answer with the '
                    "speaker's name as the text writes it.", speaker.rstrip("."), count_tokens(context),
                    f"{play.title}: {line.strip()[:40]}")


def _enough(documents, tokens: int, corpus: str) -> None:
    if not any(len(d.text) > tokens * 6 for d in documents):
        raise SpecjaxError(f"no {corpus} document is long enough for {tokens} tokens of context")


def _speeches(text: str) -> list[tuple[str, str]]:
    """(speaker, one line of the speech) for every line of every speech in text."""
    out = []
    for paragraph in text.split("\n\n"):
        lines = paragraph.split("\n")
        if len(lines) > 1 and _SPEAKER.match(lines[0].strip()):
            out += [(lines[0].strip(), line) for line in lines[1:] if line.strip()]
    return out


def needle_task(novels, count_tokens, tokens: int, rng) -> LongTask:
    """novels: Austen's documents; the needle sentence goes between two paragraphs."""
    _enough(novels, tokens, "austen")
    big = [n for n in novels if len(n.text) > tokens * 6]
    novel = big[int(rng.integers(len(big)))]
    word = NEEDLE_WORDS[int(rng.integers(len(NEEDLE_WORDS)))]
    needle = f"The secret passphrase is {word}."
    paragraphs = novel.text.split("\n\n")
    start, stop = _window(paragraphs, count_tokens, tokens - count_tokens(needle) - 2, rng, "\n\n")
    inside = paragraphs[start:stop]
    depth = int(rng.integers(0, len(inside) + 1))
    context = "\n\n".join(inside[:depth] + [needle] + inside[depth:])
    return LongTask("needle", context, "What is the secret passphrase mentioned in the text above? Answer with "
                    "the passphrase only.", word, count_tokens(context),
                    f"{novel.title}, needle at {depth / max(len(inside), 1):.0%} depth")


def build_tasks(tokenizer, context_tokens: int, per_task: int = 3, seed: int = 0, tasks: Sequence[str] = TASKS,
                corpora: dict | None = None) -> list[LongTask]:
    """per_task tasks of each kind at about context_tokens target tokens (tokenizer: the target's).
    corpora: {"kjv": [...], "shakespeare": [...], "austen": [...]} Documents (default: loaded, and
    fetched on first use)."""
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise SpecjaxError(f"unknown long-context task {unknown[0]!r}; choose from {', '.join(TASKS)}")
    if corpora is None:
        from specjax.data.corpora import load_corpus

        corpora = {name: load_corpus(name) for name in ("kjv", "shakespeare", "austen")}
    count = lambda text: len(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    makers = {"verse": (verse_task, "kjv"), "speaker": (speaker_task, "shakespeare"), "needle": (needle_task, "austen")}
    rng = np.random.default_rng(seed)
    out = []
    for task in tasks:
        make, corpus = makers[task]
        out += [make(corpora[corpus], count, context_tokens, rng) for _ in range(per_task)]
    return out
