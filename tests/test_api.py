"""The public Python API (specjax/__init__.py, specjax/api.py): a notebook's few lines."""

from __future__ import annotations

import numpy as np
import pytest

import specjax
from specjax.errors import SpecjaxError

from test_cli import tiny_with_tokenizer_and_drafter  # noqa: F401 - a fixture


@pytest.fixture(scope="module")
def llm(tiny_with_tokenizer_and_drafter):  # noqa: F811
    root = tiny_with_tokenizer_and_drafter
    return specjax.LLM(str(root / "model"), drafter=str(root / "drafter"), refiner=str(root / "refiner"))


def test_every_public_name_resolves_and_unknown_ones_fail():
    for name in specjax.__all__:
        assert getattr(specjax, name) is not None, name
    assert specjax.train_drafter is __import__("specjax.train.recipe", fromlist=["x"]).train_drafter_recipe
    assert "LLM" in dir(specjax)
    with pytest.raises(AttributeError, match="no attribute 'Engine'"):
        specjax.Engine  # noqa: B018 - internal, not exported
    assert set(specjax.methods()) >= {"ar", "chain", "tree", "ngram", "auto"}


def test_the_package_ships_its_type_marker():
    """PEP 561: type checkers read specjax's annotations only when py.typed is installed with it."""
    from importlib.resources import files

    assert files("specjax").joinpath("py.typed").is_file()
    import tomllib
    from pathlib import Path

    data = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert "py.typed" in data["tool"]["setuptools"]["package-data"]["specjax"]


def test_generate_takes_text_messages_and_ids_and_speculation_returns_ars_tokens(llm):
    prompts = ["the cat sat", "the dog ran to"]
    ar = llm.generate(prompts, 12, method="ar", ignore_eos=True)
    chain = llm.generate(prompts, 12, method="chain", ignore_eos=True)
    assert [c.token_ids for c in chain] == [a.token_ids for a in ar]
    for completion in chain:
        assert len(completion.token_ids) == 12 and completion.finish_reason == "length"
        assert completion.text == llm.tokenizer.decode(completion.token_ids)
        histogram = completion.metrics["accepted_length_histogram"]
        steps = sum(histogram)
        # Each step commits its accepted drafts plus one; the prefill commits the first token.
        assert sum((n + 1) * h for n, h in enumerate(histogram)) == 11
        assert completion.metrics["tau"] == pytest.approx(11 / steps)
        assert completion.metrics["method"] == "chain" and completion.metrics["batch"]["new_tokens"] == 24
    assert ar[0].prompt_token_ids == llm.tokenizer.encode("the cat sat")  # no chat template: the text as is
    with pytest.raises(SpecjaxError, match="no chat template"):
        llm.generate([{"role": "user", "content": "the cat sat"}], 4)
    [ids] = llm.generate(ar[0].prompt_token_ids, 12, method="ar", ignore_eos=True)
    assert ids.token_ids == ar[0].token_ids
    [array] = llm.generate(np.asarray(ar[0].prompt_token_ids), 12, method="ar", ignore_eos=True)
    assert array.token_ids == ar[0].token_ids
    assert "tau" not in ar[0].metrics  # AR has no acceptance to report


def test_bad_prompts_get_clear_errors(llm, monkeypatch):
    monkeypatch.setattr(llm.tokenizer, "chat_template", "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert llm.encode([{"role": "user", "content": "the cat"}]) == llm.tokenizer.encode("the cat")
    with pytest.raises(SpecjaxError, match="role"):
        llm.generate([{"role": "robot", "content": "hi"}], 4)
    with pytest.raises(SpecjaxError, match="a prompt is text"):
        llm.generate([3.5, 2.0], 4)
    with pytest.raises(SpecjaxError, match="unknown method"):
        llm.generate("the cat", 4, method="beam")


def test_a_document_request_drafts_from_retrieved_chunks_and_stays_exact(llm):
    """generate(question, document=...): every method reads the whole document; rapid drafts from
    what retrieval picked (re-retrieving as it goes), and its output is AR's on the same prompt."""
    document = " ".join(f"the cat number {i} sat on mat {i % 7} and the dog ran to the door." for i in range(4))
    retrieval = specjax.RetrievalConfig(retriever="bm25", chunk_tokens=24, budget_tokens=48, min_score=0.0)
    [ar] = llm.generate("where did the dog run", 10, method="ar", document=document, ignore_eos=True)
    [rapid] = llm.generate("where did the dog run", 10, method="rapid", document=document, retrieval=retrieval,
                           redraft_every=4, ignore_eos=True, rapid=specjax.RapidConfig(drafts=3))
    assert rapid.token_ids == ar.token_ids and rapid.prompt_token_ids == ar.prompt_token_ids
    picked = rapid.metrics["long_context"]
    assert picked["retriever"] == "bm25" and 0 < picked["selected_tokens"] <= 48
    assert picked["document_tokens"] > picked["drafting_prompt_tokens"] - 16  # the drafting prompt is the smaller
    assert "selected_tokens" not in ar.metrics["long_context"]  # AR retrieves nothing
    with pytest.raises(SpecjaxError, match="apply to a request with a document"):
        llm.generate("where", 4, retrieval=retrieval)
    with pytest.raises(SpecjaxError, match="apply to rapid and rapid\\+block"):
        llm.generate("where", 4, method="chain", document=document, retrieval=retrieval)
    with pytest.raises(SpecjaxError, match="give one prompt"):
        llm.generate(["where", "when"], 4, method="ar", document=document)


def test_windowing_needs_a_drafter_and_the_memory_comparison_needs_a_window(llm, tiny_with_tokenizer_and_drafter):  # noqa: F811
    with pytest.raises(SpecjaxError, match="make the LLM with drafter_window"):
        llm.drafter_memory([64])
    with pytest.raises(SpecjaxError, match="has none"):
        specjax.LLM(str(tiny_with_tokenizer_and_drafter / "model"), drafter=None, drafter_window=32)


def test_stream_joins_to_generates_text(llm):
    [whole] = llm.generate("the cat sat", 16, method="chain", ignore_eos=True)
    pieces = list(llm.stream("the cat sat", 16, method="chain", every=4, ignore_eos=True))
    assert len(pieces) > 1 and "".join(pieces) == whole.text


def test_bench_and_server(llm):
    report = llm.bench(["the cat sat"], methods=("ar", "chain"), max_tokens=8, progress=False)
    assert report["methods"]["chain"]["identical_to_ar"] is True
    assert "chain" in str(report) and "tokens/s" in str(report)
    labelled = llm.bench(["the cat sat"], {"ar": "ar", "refined x2": ("chain+refiner", {"refine": specjax.RefineConfig(2)})},
                         max_tokens=8, progress=False)
    assert list(labelled["methods"]) == ["ar", "refined x2"]
    assert labelled["methods"]["refined x2"]["identical_to_ar"] is True
    assert labelled["methods"]["refined x2"]["refine_passes"] > 1.0  # the option reached generate
    with pytest.raises(SpecjaxError, match="inside `methods`"):
        llm.bench(["the cat sat"], {"ar": "ar"}, chain={"refine": specjax.RefineConfig(2)})
    # Programs compiled on first use: this request needs one insert and one step, not every bucket
    # (the compile-ahead path is test_serve's chain_scheduler).
    server = llm.server(slots=2, method="chain", context_length=128, max_new_tokens=16, compile_now=False)
    try:
        [expected] = llm.generate("the dog ran to", 8, method="ar")
        handle = server.submit(specjax.Request(tuple(expected.prompt_token_ids), max_tokens=8))
        assert handle.result(timeout=300).token_ids == expected.token_ids
    finally:
        server.shutdown()


def test_the_default_method_is_auto_or_the_trees_a_padded_target_fits(llm, monkeypatch):
    import dataclasses

    assert llm._method(None) == "auto" and llm._method("chain") == "chain"
    padded = dataclasses.replace(llm.model, config=dataclasses.replace(llm.model.config, query_rows=2))
    monkeypatch.setattr(llm, "model", padded)
    assert llm._method(None) == "tree"  # auto verifies the whole block of 4, more than 2 rows


def test_without_a_drafter_the_default_method_is_ar(tiny_with_tokenizer_and_drafter):  # noqa: F811
    plain = specjax.LLM(str(tiny_with_tokenizer_and_drafter / "model"), drafter=None)
    assert plain.drafter is None and "no drafter" in repr(plain)
    [out] = plain.generate("the cat sat", 4)
    assert out.metrics["method"] == "ar"
    with pytest.raises(SpecjaxError, match="needs a drafter"):
        plain.generate("the cat sat", 4, method="chain")


def test_the_readmes_python_example_runs_on_a_tiny_model(llm, capsys, monkeypatch):
    """README.md's Python block, run as written except for the model it loads: this module's tiny
    one, already loaded (its engine keeps the programs the other tests compiled)."""
    import re
    from pathlib import Path

    import specjax.data.prompts

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    [example] = re.findall(r"```python\n(.*?)```", readme, re.S)
    assert 'specjax.LLM("smollm2")' in example
    example = example.replace('specjax.LLM("smollm2")', "TINY_LLM")
    monkeypatch.setattr(specjax.data.prompts, "HELDOUT_CHAT_PROMPTS", ("the cat sat", "the dog ran to"))
    # The trees' verify costs are measured once per machine, model and shape, and cached on disk
    # (test_tree's subject). This model's folder is new in every run, so the stream's shape and the
    # bench's would each measure again (8 s apiece): the bench reuses the stream's measurement.
    from specjax.decode.engine import Engine

    measured, measure = [], Engine._latency_model

    def measured_once(self, *args):
        if not measured:
            measured.append(measure(self, *args))
        return measured[0]

    monkeypatch.setattr(Engine, "_latency_model", measured_once)
    exec(compile(example, "README.md", "exec"), {"TINY_LLM": llm})
    printed = capsys.readouterr().out
    assert "tokens/s" in printed and "chain" in printed and "tree" in printed  # the bench table


def test_draft_blocks_are_what_a_greedy_chain_step_verifies(llm):
    """The first step of a greedy chain after a prompt verifies the drafter's block anchored at the
    prefill's token: its accepted length is the run of draft_blocks' drafts that match AR's tokens."""
    [ar] = llm.generate("the cat sat", 12, method="ar", ignore_eos=True)
    drafts, greedy_next = llm.draft_blocks([ar.prompt_token_ids])
    assert drafts.shape == (1, llm.drafter.config.block_size - 1) and greedy_next.tolist() == [ar.token_ids[0]]
    matched = int(np.cumprod(drafts[0] == np.asarray(ar.token_ids[1: 1 + drafts.shape[1]])).sum())
    # The prefill's token and one verify step's matched + 1: the whole answer is that one step.
    [chain] = llm.generate("the cat sat", matched + 2, method="chain", ignore_eos=True)
    histogram = chain.metrics["accepted_length_histogram"]
    assert sum(histogram) == 1 and histogram[matched] == 1, (matched, histogram)
    assert chain.token_ids == ar.token_ids[: matched + 2]
    with pytest.raises(SpecjaxError, match="one anchor per context"):
        llm.draft_blocks([ar.prompt_token_ids], anchors=[1, 2])
