"""Long-context tasks built from the corpora: each context holds its answer at about the asked
length, answers are scored by their first words, and a seed fixes the set."""

from __future__ import annotations

import pytest

from specjax.data.corpora import Document
from specjax.data.longbench import LongTask, build_tasks, is_correct
from specjax.errors import SpecjaxError


class WordTokenizer:
    """One token per whitespace-separated word (the tasks only count tokens)."""

    def encode(self, text, add_special_tokens=True):
        return text.split()


def _corpora():
    books = [Document("kjv", f"Book{b}", "\n".join(f"Bk{b}{c}:{v} verse words {b} {c} {v} and more words here"
                                                   for c in range(1, 30) for v in range(1, 20)))
             for b in range(3)]
    speeches = []
    for i in range(400):
        speaker = ("Ham.", "Hor.", "First Clown.")[i % 3]
        speeches.append(f"{speaker}\nthis is line number {i} of the play spoken here\nand a second line {i} too")
    plays = [Document("shakespeare", "Play", "\n\n".join(speeches))]
    novels = [Document("austen", "Novel", "\n\n".join(f"Paragraph {i} of the novel with some words in it."
                                                         for i in range(3000)))]
    return {"kjv": books, "shakespeare": plays, "austen": novels}


def test_tasks_hold_their_answers_at_the_asked_length():
    tasks = build_tasks(WordTokenizer(), 600, per_task=3, seed=1, corpora=_corpora())
    assert [t.task for t in tasks] == ["verse"] * 3 + ["speaker"] * 3 + ["needle"] * 3
    for task in tasks:
        assert 540 <= task.context_tokens <= 640, (task.task, task.context_tokens)
        assert task.answer and task.question
    for task in tasks[:3]:  # the verse's reference and text are in the context, on one line
        reference = task.source.split()[-1]
        assert f"{reference} {task.answer}" in task.context and reference in task.question
    for task in tasks[3:6]:
        line = task.question.split('"')[1]
        assert f"{task.answer}.\n" in task.context and line in task.context
        paragraph = next(p for p in task.context.split("\n\n") if line in p)
        assert paragraph.startswith(task.answer + ".")
    for task in tasks[6:]:
        assert f"The secret passphrase is {task.answer}." in task.context
    again = build_tasks(WordTokenizer(), 600, per_task=3, seed=1, corpora=_corpora())
    assert [(t.question, t.answer) for t in again] == [(t.question, t.answer) for t in tasks]
    with pytest.raises(SpecjaxError, match="unknown long-context task"):
        build_tasks(WordTokenizer(), 600, tasks=("trivia",), corpora=_corpora())
    with pytest.raises(SpecjaxError, match="long enough"):
        build_tasks(WordTokenizer(), 10**6, tasks=("needle",), corpora=_corpora())


def test_answers_are_scored_by_their_first_words():
    verse = LongTask("verse", "", "", "And the servant ran to meet her, and said, Let me", 0, "")
    assert is_correct(verse, "And the servant ran to meet her, and said")
    assert is_correct(verse, "The verse says: And the servant ran to meet her and said, let me drink")
    assert not is_correct(verse, "And the servant walked to meet her")
    speaker = LongTask("speaker", "", "", "Hor", 0, "")
    assert is_correct(speaker, "Hor.") and is_correct(speaker, "Horatio says it")
    assert not is_correct(speaker, "Hamlet") and not is_correct(speaker, "")
    needle = LongTask("needle", "", "", "saffron", 0, "")
    assert is_correct(needle, "Saffron.") and not is_correct(needle, "The passphrase is unknown")
