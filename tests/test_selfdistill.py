"""The continuous-refill self-distillation generator: each continuation equals the target's own
greedy output for that prompt, rows are refilled as they finish, and an interrupted run resumes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from specjax.decode.engine import Engine
from specjax.errors import SpecjaxError
from specjax.io.registry import LoadedModel
from specjax.train.selfdistill import GeneratorConfig, generate_continuations, read_continuations

from conftest import recorded_build_data
from test_decode import TINY

GEN = GeneratorConfig(batch_size=4, max_prompt_tokens=8, max_new_tokens=12, steps_per_sync=3, refill_rows=2)


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, TINY.vocab_size, size=int(rng.integers(1, 9))).tolist() for _ in range(count)]


def _with_eos(target):
    """The tiny target with an EOS id that its greedy continuations hit at different steps."""
    return LoadedModel("tiny", TINY, target.params, None, (3,))


def test_each_continuation_is_the_targets_greedy_output(target, tmp_path):
    model = _with_eos(target)
    prompts = _prompts(11) + [[1] * 9]  # the last is longer than max_prompt_tokens
    report = generate_continuations(model.params, TINY, prompts, tmp_path / "c.jsonl", GEN, model.eos_token_ids,
                                    progress=False)
    found = read_continuations(tmp_path / "c.jsonl")
    assert sorted(found) == list(range(11)) and report.skipped_long_prompts == 1
    expected = Engine(model).generate(prompts[:11], GEN.max_new_tokens).tokens
    lengths = set()
    for i in range(11):
        prompt, generated = found[i]
        assert prompt == prompts[i]
        assert generated == expected[i], f"prompt {i}"
        lengths.add(len(generated))
    # EOS ended rows at different lengths, so rows were refilled while others decoded.
    assert len(lengths) > 1 and min(lengths) < GEN.max_new_tokens
    assert report.new_tokens == sum(len(g) for _, g in found.values()) and report.sequences == 11


def test_the_cache_starts_as_wide_as_the_shortest_prompts_need_and_grows(target, tmp_path):
    """Prompts run shortest first over a cache that widens by prompt buckets as longer prompts come
    up (rows in flight keep decoding across the widening); every continuation is still the target's
    greedy output."""
    import dataclasses

    model = _with_eos(target)
    gen = dataclasses.replace(GEN, prompt_bucket=3)
    prompts = _prompts(10, seed=2)
    report = generate_continuations(model.params, TINY, prompts, tmp_path / "c.jsonl", gen, model.eos_token_ids,
                                    progress=False)
    shortest, longest = min(map(len, prompts)), max(map(len, prompts))
    first = -(-shortest // 3) * 3 + gen.max_new_tokens
    assert report.cache_slots[0] == first and report.cache_slots[-1] == min(-(-longest // 3) * 3, 8) + gen.max_new_tokens
    assert len(report.cache_slots) >= 2 and list(report.cache_slots) == sorted(set(report.cache_slots))
    found = read_continuations(tmp_path / "c.jsonl")
    expected = Engine(model).generate(prompts, gen.max_new_tokens).tokens
    assert [found[i][1] for i in range(10)] == expected


def test_an_interrupted_run_resumes_without_redoing_finished_prompts(target, tmp_path):
    model = _with_eos(target)
    prompts = _prompts(7, seed=1)
    path = tmp_path / "c.jsonl"
    generate_continuations(model.params, TINY, prompts[:4], path, GEN, model.eos_token_ids, progress=False)
    with path.open("a") as f:
        f.write('{"index": 5, "prompt": [1, 2')  # a line cut short by the interruption
    report = generate_continuations(model.params, TINY, prompts, path, GEN, model.eos_token_ids, progress=False)
    assert report.sequences == 3
    found = read_continuations(path)
    assert sorted(found) == list(range(7))
    # Resuming with another prompt list (another seed, say) would mix answers: refused.
    with pytest.raises(SpecjaxError, match="other prompts"):
        generate_continuations(model.params, TINY, prompts[1:] + prompts[:1], path, GEN, model.eos_token_ids,
                               progress=False)
    expected = Engine(model).generate(prompts, GEN.max_new_tokens).tokens
    assert [found[i][1] for i in range(7)] == expected
    indices = [json.loads(line)["index"] for line in path.read_text().splitlines()]
    assert sorted(indices) == list(range(7)), "every prompt appears once, and the cut line is gone"


def test_bad_generator_shapes_are_refused():
    with pytest.raises(SpecjaxError, match="refill_rows"):
        GeneratorConfig(batch_size=2, refill_rows=4)
    with pytest.raises(SpecjaxError, match="steps_per_sync"):
        GeneratorConfig(steps_per_sync=0)


class _WordTokenizer:
    """A stand-in tokenizer over the tiny vocabulary: text hashes to a short prompt, and ids decode
    to a request. Ids starting with an even token decode to a held-out prompt, which must be dropped."""

    WORDS = [f"w{i}" for i in range(64)]

    def encode_chat(self, text: str) -> list[int]:
        rng = np.random.default_rng(list(text.encode()))
        return rng.integers(4, TINY.vocab_size, size=6).tolist()

    def decode(self, ids) -> str:
        from specjax.data.prompts import heldout_prompts

        ids = [int(i) for i in ids if int(i) != 3]
        if ids and ids[0] % 2 == 0:
            return heldout_prompts()[0]
        return "Question: Can you tell me about " + " ".join(self.WORDS[i % 64] for i in ids[:4]) + "?\nmore"


def test_self_instruct_keeps_the_distinct_clean_requests_the_target_wrote(target, tmp_path):
    from specjax.data.prompts import self_instruct_requests
    from specjax.train.selfdistill import self_instruct_prompts

    model, tok = _with_eos(target), _WordTokenizer()
    prompts = self_instruct_prompts(model.params, TINY, tok, 24, tmp_path / "r.jsonl", GEN, model.eos_token_ids,
                                    seed=1, progress=False)
    instructions = self_instruct_requests(24, 1)
    greedy = Engine(model).generate([tok.encode_chat(t) for t in instructions], GEN.max_new_tokens).tokens
    expected = []
    for ids in greedy:
        text = tok.decode(ids)
        if text.startswith("Question: ") and text.split("\n")[0][10:] not in expected:
            expected.append(text.split("\n")[0][10:])
    assert prompts == expected and 0 < len(prompts) < 24
    # The written requests are kept on disk: a rerun resumes and returns the same prompts.
    assert self_instruct_prompts(model.params, TINY, tok, 24, tmp_path / "r.jsonl", GEN, model.eos_token_ids,
                                 seed=1, progress=False) == prompts


def test_a_run_that_avoids_an_earlier_runs_data_answers_none_of_its_prompts(tmp_path, monkeypatch):
    """Growing a data set with a second seed (`--avoid-prompts-from`): prompts the first run answered
    are left out, since greedy answers would repeat; the held-out set is still answered in full.
    Generation and features are replaced by recorders: this checks which prompts reach them."""
    import dataclasses
    import types

    from specjax.data.prompts import everyday_chat_prompts
    from specjax.train.recipe import DistillRecipe, build_data

    answered: dict[str, list[tuple[int, ...]]] = {}

    def generate(params, config, ids, path, gen, eos):
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            for i, prompt in enumerate(ids):
                f.write(json.dumps({"index": i, "prompt": list(prompt), "generated": [7]}) + "\n")
        answered[str(path)] = [tuple(p) for p in ids]
        return types.SimpleNamespace(sequences=len(ids), new_tokens=len(ids), tokens_per_s=1.0, skipped_long_prompts=0)

    model, _ = recorded_build_data(monkeypatch, generate)
    tokenizer = model.tokenizer

    def everyday(run: str) -> set[tuple[int, ...]]:
        return set(answered[str(tmp_path / run / "everyday.continuations.jsonl")])

    first = DistillRecipe(chat_prompts=0, corpus_sequences=0, everyday_prompts=300, seed=0)
    build_data(model, first, tmp_path / "first", taps=(1,))
    second = DistillRecipe(chat_prompts=0, corpus_sequences=0, everyday_prompts=600, seed=1,
                           avoid_prompts_from=(str(tmp_path / "first"),))
    build_data(model, second, tmp_path / "second", taps=(1,))
    fresh = {tuple(ord(c) for c in p) for p in everyday_chat_prompts(600, seed=1)} - everyday("first")
    assert len(everyday("first")) == 300 and everyday("second") == fresh
    assert 0 < len(fresh) < 600  # the seeds' draws overlap, so some prompts were left out
    heldout = [answered[str(tmp_path / run / "heldout_chat.continuations.jsonl")] for run in ("first", "second")]
    assert heldout[0] == heldout[1] and len(heldout[0]) >= 42
    # A base model (no chat template) is refused chat data, and a held-out set of chat answers.
    base = types.SimpleNamespace(**{**vars(model), "name": "base-lm",
                                    "tokenizer": types.SimpleNamespace(**{**vars(tokenizer), "chat_template": None})})
    with pytest.raises(SpecjaxError, match="no chat template.*everyday_prompts"):
        build_data(base, first, tmp_path / "base", taps=(1,))
    with pytest.raises(SpecjaxError, match="heldout_text_prompts"):
        build_data(base, DistillRecipe(chat_prompts=0, corpus_sequences=0, text_prompts=4), tmp_path / "base", taps=(1,))
    with pytest.raises(SpecjaxError, match="no \\*.continuations.jsonl"):
        build_data(model, dataclasses.replace(second, avoid_prompts_from=(str(tmp_path / "nothing"),)),
                   tmp_path / "third", taps=(1,))
