"""Self-distilled answers made on another machine (train/answers.py): the answers that come back
are the ones the target makes here, a time limit leaves a resumable file, and the data step takes
exported-then-answered prompts in place of answering them itself, refusing answers to other prompts."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest

from specjax.errors import SpecjaxError
from specjax.io.registry import LoadedModel
from specjax.train.answers import (answer_prompt_sets, compress_answers, export_set, merge_answers, read_prompt_set,
                                   target_of)
from specjax.train.selfdistill import GeneratorConfig, generate_continuations, read_continuations

from conftest import recorded_build_data
from test_decode import TINY

GEN = GeneratorConfig(batch_size=4, max_prompt_tokens=8, max_new_tokens=10, refill_rows=1)


def _prompts(count: int) -> list[list[int]]:
    rng = np.random.default_rng(5)
    return [rng.integers(4, TINY.vocab_size, size=int(rng.integers(1, 9))).tolist() for _ in range(count)] + [[5] * 9]


def test_answers_made_elsewhere_equal_the_targets_own_and_a_time_limit_resumes(target, tmp_path):
    model = LoadedModel("tiny", TINY, target.params, None, (3,))
    prompts = _prompts(9)  # the last is too long for the generator, here and there
    export_set(tmp_path / "prompts", "everyday", prompts, GEN, (3,), "tiny", "float32")
    exported = read_prompt_set(tmp_path / "prompts" / "everyday.prompts.npz")
    assert [list(p) for p in exported.prompts] == prompts and exported.max_new_tokens == 10
    assert target_of([tmp_path / "prompts" / "everyday.prompts.npz"]) == ("tiny", "float32")

    # A limit already past when the set starts: nothing is started, and the call says so.
    [cut] = answer_prompt_sets(model, tmp_path / "prompts", tmp_path / "out", batch_size=4, time_limit_s=1e-9,
                               progress=False)
    assert (cut.prompts, cut.answered) == (9, 0)
    [whole] = answer_prompt_sets(model, tmp_path / "prompts", tmp_path / "out", batch_size=4, progress=False)
    assert (whole.prompts, whole.answered) == (9, 9) and whole.new_tokens > 0
    here = tmp_path / "here.jsonl"
    generate_continuations(model.params, TINY, prompts, here, GEN, (3,), progress=False)
    assert read_continuations(tmp_path / "out" / "everyday.continuations.jsonl") == read_continuations(here)

    # Compressed for the trip back, a rerun still finds every answer and starts nothing.
    [packed] = compress_answers(tmp_path / "out")
    assert packed.name == "everyday.continuations.jsonl.gz"
    [again] = answer_prompt_sets(model, tmp_path / "prompts", tmp_path / "out", batch_size=4, progress=False)
    assert (again.answered, again.new_tokens) == (9, 0)


def test_answers_to_other_prompts_are_refused_before_anything_is_written(tmp_path):
    answers = tmp_path / "a.continuations.jsonl"
    answers.write_text("".join(json.dumps({"index": i, "prompt": [i, 1], "generated": [2]}) + "\n" for i in range(3))
                       + '{"index": 3, "prom')  # cut off where the answering machine stopped
    target = tmp_path / "run" / "a.continuations.jsonl"
    target.parent.mkdir()
    target.write_text(json.dumps({"index": 1, "prompt": [1, 1], "generated": [9]}) + "\n")
    with pytest.raises(SpecjaxError, match="1 of 3 answers are to other prompts"):
        merge_answers(answers, target, [[0, 1], [1, 1], [7, 7]])
    assert len(target.read_text().splitlines()) == 1
    assert merge_answers(answers, target, [[0, 1], [1, 1], [2, 1], [3, 1]]) == 2
    found = read_continuations(target)
    assert sorted(found) == [0, 1, 2] and found[1][1] == [9]  # an answer the run held is kept


def test_a_recipe_exported_then_answered_elsewhere_needs_no_answer_here(tmp_path, monkeypatch):
    """build_data with export_to writes every set's prompts and builds nothing; with the answers back
    (answers_from) the target answers nothing here. Generation and features are recorders."""
    from specjax.train.recipe import DistillRecipe, build_data

    left_to_answer: dict[str, int] = {}

    def generate(params, config, ids, path, gen, eos):
        left_to_answer[path.name] = sum(i not in read_continuations(path) for i in range(len(ids)))
        with open(path, "a") as f:
            for i, prompt in enumerate(ids):
                if i not in read_continuations(path):
                    f.write(json.dumps({"index": i, "prompt": list(prompt), "generated": [7]}) + "\n")
        return types.SimpleNamespace(sequences=0, new_tokens=0, tokens_per_s=0.0, skipped_long_prompts=0)

    model, built = recorded_build_data(monkeypatch, generate)
    recipe = DistillRecipe(chat_prompts=0, corpus_sequences=0, everyday_prompts=40, seed=0)

    assert build_data(model, recipe, tmp_path / "run", taps=(1,), export_to=tmp_path / "prompts") == ([], None)
    assert built == [] and left_to_answer == {}
    names = sorted(p.name for p in (tmp_path / "prompts").iterdir())
    assert names == ["everyday.prompts.npz", "heldout_chat.prompts.npz"]

    # "Elsewhere": the real generator's file format, written from the exported sets alone.
    (tmp_path / "answers").mkdir()
    for name in ("everyday", "heldout_chat"):
        exported = read_prompt_set(tmp_path / "prompts" / f"{name}.prompts.npz")
        assert exported.model == "toy" and exported.eos_token_ids == (3,)
        with open(tmp_path / "answers" / f"{name}.continuations.jsonl", "w") as f:
            for i, prompt in enumerate(exported.prompts):
                f.write(json.dumps({"index": i, "prompt": list(prompt), "generated": [8, 3]}) + "\n")
    compress_answers(tmp_path / "answers")
    build_data(model, recipe, tmp_path / "run", taps=(1,), answers_from=tmp_path / "answers")
    assert left_to_answer == {"everyday.continuations.jsonl": 0, "heldout_chat.continuations.jsonl": 0}
    assert sorted(built) == ["everyday", "heldout_chat"]
    answers = read_continuations(tmp_path / "run" / "everyday.continuations.jsonl")
    assert len(answers) == 40 and all(g == [8, 3] for _, g in answers.values())

    # Answers exported by another seed's recipe are refused.
    with pytest.raises(SpecjaxError, match="exported from another recipe"):
        build_data(model, DistillRecipe(chat_prompts=0, corpus_sequences=0, everyday_prompts=40, seed=1),
                   tmp_path / "other", taps=(1,), answers_from=tmp_path / "answers")


def test_answered_only_trains_on_the_answers_there_are_and_rebuilds_when_more_come(tmp_path, monkeypatch):
    """--answered-only: the set holds the prompts answered so far and the target answers none; a
    later run with more answers builds the set again from all of them."""
    from specjax.train.recipe import DistillRecipe, build_data

    def generate(*_, **__):
        raise AssertionError("answered_only must not answer anything")

    model, built = recorded_build_data(monkeypatch, generate)
    recipe = DistillRecipe(chat_prompts=0, corpus_sequences=0, everyday_prompts=30, seed=0)
    build_data(model, recipe, tmp_path / "run", taps=(1,), export_to=tmp_path / "prompts")
    (tmp_path / "answers").mkdir()

    def answer(name: str, count: int) -> None:
        exported = read_prompt_set(tmp_path / "prompts" / f"{name}.prompts.npz")
        with open(tmp_path / "answers" / f"{name}.continuations.jsonl", "w") as f:
            for i, prompt in enumerate(exported.prompts[:count]):
                f.write(json.dumps({"index": i, "prompt": list(prompt), "generated": [8, 3]}) + "\n")

    answer("everyday", 10)
    answer("heldout_chat", 42)
    build_data(model, recipe, tmp_path / "run", taps=(1,), answers_from=tmp_path / "answers", answered_only=True)
    assert sorted(built) == ["everyday", "heldout_chat"]
    assert json.loads((tmp_path / "run" / "everyday" / "answers_used.json").read_text()) == 10
    build_data(model, recipe, tmp_path / "run", taps=(1,), answers_from=tmp_path / "answers", answered_only=True)
    assert sorted(built) == ["everyday", "heldout_chat"]  # nothing new: nothing built again
    answer("everyday", 25)
    build_data(model, recipe, tmp_path / "run", taps=(1,), answers_from=tmp_path / "answers", answered_only=True)
    assert sorted(built) == ["everyday", "everyday", "heldout_chat"]
    assert json.loads((tmp_path / "run" / "everyday" / "answers_used.json").read_text()) == 25
    with pytest.raises(SpecjaxError, match="no answers to build from"):
        build_data(model, DistillRecipe(chat_prompts=0, corpus_sequences=0, everyday_prompts=30, seed=2),
                   tmp_path / "empty", taps=(1,), answered_only=True)
