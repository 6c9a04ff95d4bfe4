"""The `specjax` command: the generate JSON contract and clear errors."""

from __future__ import annotations

import json

import numpy as np

import pytest

from specjax.cli import main

from conftest import assert_histogram_accounts_for_the_tokens, build_tiny_hf


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli_tiny")
    build_tiny_hf("llama", seed=4).save_pretrained(folder)
    return folder


def _last_json(capsys):
    out = capsys.readouterr().out.strip().splitlines()
    return json.loads(out[-1])


def test_generate_json_contract(tiny_folder, capsys):
    assert main(["generate", "--model", str(tiny_folder), "--prompt-ids", "1,2,3", "--max-new-tokens", "5",
                 "--ignore-eos", "--json"]) == 0
    out = _last_json(capsys)
    assert out["prompt_tokens"] == [1, 2, 3]
    assert len(out["tokens"]) == 5 and all(isinstance(t, int) for t in out["tokens"])
    assert out["text"] is None  # this folder has no tokenizer
    for key in ("tokens_per_s", "compile_s", "wall_s", "new_tokens"):
        assert key in out["stats"]
    assert out["stats"]["new_tokens"] == 5


def test_generate_is_deterministic_when_seeded(tiny_folder, capsys):
    args = ["generate", "--model", str(tiny_folder), "--prompt-ids", "4,5", "--max-new-tokens", "6",
            "--temperature", "1.0", "--top-k", "20", "--top-p", "0.9", "--seed", "3", "--ignore-eos", "--json"]
    main(args)
    first = _last_json(capsys)["tokens"]
    main(args)
    assert _last_json(capsys)["tokens"] == first
    main([a if a != "3" else "4" for a in args])
    assert _last_json(capsys)["tokens"] != first


@pytest.mark.parametrize("argv,message", [
    (["generate", "--model", "no-such-model", "--prompt-ids", "1"], "unknown model 'no-such-model'"),
    (["generate", "--prompt-ids", "1,x"], "comma-separated integers"),
    (["generate", "--prompt", "a", "--prompt-ids", "1"], "exactly one of"),
    (["generate", "--prompt-file", "/nonexistent.txt"], "file not found"),
    (["generate", "--prompt-ids", "1", "--method", "beam"], "unknown method 'beam'"),
])
def test_bad_arguments_exit_2_with_a_message(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_text_prompt_without_tokenizer_is_refused(tiny_folder, capsys):
    assert main(["generate", "--model", str(tiny_folder), "--prompt", "hello"]) == 2
    assert "no tokenizer" in capsys.readouterr().err


def test_bad_prompt_file_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"text": "no prompt key"}\n')
    assert main(["generate", "--prompt-file", str(bad)]) == 2
    assert 'line 1 must be {"prompt": "<text>"}' in capsys.readouterr().err


@pytest.mark.network
@pytest.mark.slow
def test_generate_with_real_model_text_output(capsys):
    assert main(["generate", "--prompt", "What is the capital of France?", "--max-new-tokens", "12"]) == 0
    captured = capsys.readouterr()
    assert "Paris" in captured.out
    assert "tokens/s" in captured.err


@pytest.fixture(scope="module")
def tiny_with_tokenizer_and_drafter(tmp_path_factory):
    """A tiny HF model with a trained BPE tokenizer, plus a random DFlash-format drafter for it."""
    import jax

    from specjax.io.dflash import save_drafter
    from specjax.io.hf import load_hf_config
    from specjax.models.drafter import DrafterConfig, init_drafter_params
    from specjax.io.refiner import save_refiner
    from specjax.models.refiner import RefinerConfig, drafter_fingerprint, init_refiner_params
    from specjax.train.lm import train_bpe_tokenizer

    root = tmp_path_factory.mktemp("cli_spec")
    texts = ["the cat sat on the mat and the dog ran to the park"] * 20
    tok = train_bpe_tokenizer(texts, 270)
    build_tiny_hf("llama", seed=6, vocab_size=tok.vocab_size).save_pretrained(root / "model")
    tok.save(root / "model")
    config = load_hf_config(root / "model")
    drafter_config = DrafterConfig.for_target(config, num_layers=1, block_size=4, num_taps=1)
    drafter_params = init_drafter_params(drafter_config, jax.random.key(0))
    save_drafter(root / "drafter", drafter_config, drafter_params, config)
    refiner_config = RefinerConfig(hidden_size=config.hidden_size, block_size=4, kind="gru", width=16, rank=8)
    refiner_params = init_refiner_params(refiner_config, jax.random.key(1))
    refiner_params["correction"]["kernel"] = jax.random.normal(jax.random.key(2), (16, 8))
    save_refiner(root / "refiner", refiner_config, refiner_params, drafter_fingerprint(drafter_params))
    save_refiner(root / "other_refiner", refiner_config, refiner_params, "0000000000000000")
    (root / "prompts.txt").write_text("the cat sat\nthe dog ran to\n")
    return root


def test_generate_chain_json_stats(tiny_with_tokenizer_and_drafter, capsys):
    root = tiny_with_tokenizer_and_drafter
    base = ["generate", "--model", str(root / "model"), "--prompt", "the cat", "--no-chat", "--max-new-tokens", "9",
            "--ignore-eos", "--json"]
    assert main(base) == 0
    ar = _last_json(capsys)
    assert main(base + ["--method", "chain", "--drafter", str(root / "drafter")]) == 0
    chain = _last_json(capsys)
    assert chain["tokens"] == ar["tokens"]
    for key in ("tau", "per_position_acceptance", "draft_s", "verify_s"):
        assert key in chain["stats"]
    assert len(chain["stats"]["per_position_acceptance"]) == 3


@pytest.mark.slow  # 11 s; refined chains' exactness is tested through Engine in test_refiner.py
def test_generate_with_refiner(tiny_with_tokenizer_and_drafter, capsys):
    root = tiny_with_tokenizer_and_drafter
    base = ["generate", "--model", str(root / "model"), "--prompt", "the cat", "--no-chat", "--max-new-tokens", "9",
            "--ignore-eos", "--json"]
    assert main(base) == 0
    ar = _last_json(capsys)
    base += ["--drafter", str(root / "drafter")]
    assert main(base + ["--method", "chain+refiner", "--refiner", str(root / "refiner"), "--refine-passes", "3"]) == 0
    refined = _last_json(capsys)
    assert refined["tokens"] == ar["tokens"]
    assert refined["stats"]["method"] == "chain+refiner"
    assert 1 <= refined["stats"]["refine_passes"] <= 3 and refined["stats"]["refine_s"] > 0
    assert main(base + ["--method", "chain+refiner", "--refiner", str(root / "other_refiner")]) == 2
    assert "retrain the refiner" in capsys.readouterr().err
    assert main(base + ["--method", "chain+refiner", "--refiner", str(root / "drafter")]) == 2
    assert "not a specjax refiner" in capsys.readouterr().err


def test_bench_json_contract(tiny_with_tokenizer_and_drafter, capsys):
    root = tiny_with_tokenizer_and_drafter
    assert main(["bench", "--model", str(root / "model"), "--drafter", str(root / "drafter"), "--methods",
                 "ar,chain,chain+refiner", "--refiner", str(root / "refiner"), "--prompts-file",
                 str(root / "prompts.txt"), "--max-new-tokens", "6", "--no-chat", "--json"]) == 0
    report = _last_json(capsys)
    assert set(report["methods"]) == {"ar", "chain", "chain+refiner"}
    refined = report["methods"]["chain+refiner"]
    assert refined["outputs"] == report["methods"]["ar"]["outputs"] and refined["identical_to_ar"]
    assert refined["refine_passes"] >= 1 and 0 < refined["refine_fraction"] < 1
    ar, chain = report["methods"]["ar"], report["methods"]["chain"]
    assert ar["tau"] is None
    # Aggregated over both prompts: a report that kept one call's histogram would undercount.
    assert_histogram_accounts_for_the_tokens(chain["accepted_length_histogram"], chain["outputs"], 4)
    assert len(chain["outputs"]) == 2 and chain["outputs"] == ar["outputs"]
    assert chain["tokens_per_s"] > 0 and len(chain["per_position_acceptance"]) == 3


@pytest.mark.slow  # 24 s; tests/test_auto.py and tests/test_ngram.py check both methods in the default suite
def test_bench_runs_auto_and_ngram_beside_ar(tiny_with_tokenizer_and_drafter, capsys, monkeypatch, tmp_path):
    """auto reports the policy steps it chose over every call; ngram needs no drafter; both equal AR."""
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))  # the latency model is measured, not read from the user's cache
    root = tiny_with_tokenizer_and_drafter
    assert main(["bench", "--model", str(root / "model"), "--drafter", str(root / "drafter"), "--methods",
                 "ar,auto,ngram", "--tree-buckets", "1,2,4", "--prompts-file", str(root / "prompts.txt"),
                 "--max-new-tokens", "6", "--no-chat", "--json"]) == 0
    report = _last_json(capsys)
    auto, ngram = report["methods"]["auto"], report["methods"]["ngram"]
    assert auto["identical_to_ar"] and ngram["identical_to_ar"]
    chose = auto["auto"]["policy_steps"]
    # The engine remembers auto's measurements between calls, so exploring each policy happened in
    # the untimed warm-up; the timed calls count at least one step each and at most one a token.
    assert set(chose) == {"ar", "chain", "tree"} and 2 <= sum(chose.values()) <= 2 * 6
    assert auto["auto"]["chain_step_over_decode_step"] > 0
    assert main(["bench", "--methods", "ar,chain", "--ngram-drafts", "3"]) == 2
    assert "--ngram-drafts applies to methods with prompt lookup (ngram)" in capsys.readouterr().err
    assert main(["bench", "--methods", "ar,chain", "--refine-slots", "2"]) == 2  # once silently ignored
    assert "--refine-slots applies to methods with a refiner (chain+refiner, tree+refiner)" in capsys.readouterr().err


def test_bench_reports_each_category_of_a_categorised_prompt_file(tiny_with_tokenizer_and_drafter, capsys, tmp_path):
    """A .jsonl prompt file whose lines carry a category (as the held-out set does) gets figures per
    category as well as over all; the groups' histograms add up to the whole one."""
    root = tiny_with_tokenizer_and_drafter
    prompts = tmp_path / "mixed.jsonl"
    prompts.write_text("\n".join(json.dumps(line) for line in [
        {"prompt": "the cat sat", "category": "chat"}, {"prompt": "one two three", "category": "math"},
        {"prompt": "the dog ran", "category": "chat"}]) + "\n")
    base = ["bench", "--model", str(root / "model"), "--drafter", str(root / "drafter"), "--methods", "ar,chain",
            "--prompts-file", str(prompts), "--max-new-tokens", "6", "--no-chat"]
    assert main(base + ["--json"]) == 0
    report = _last_json(capsys)
    groups = report["groups"]
    assert list(groups) == ["chat", "math"]
    assert groups["chat"]["chain"]["prompts"] == 2 and groups["math"]["ar"]["prompts"] == 1
    whole = np.asarray(report["methods"]["chain"]["accepted_length_histogram"])
    parts = [np.asarray(groups[g]["chain"]["accepted_length_histogram"]) for g in groups]
    assert (sum(parts) == whole).all()
    assert groups["math"]["chain"]["identical_to_ar"] and groups["chat"]["chain"]["speedup_vs_ar"] > 0
    assert main(base) == 0
    table = capsys.readouterr().out
    assert "chat (2 prompts):" in table and "math (1 prompt):" in table
    # A file without categories on every line is reported as a whole only.
    prompts.write_text(json.dumps({"prompt": "the cat sat", "category": "chat"}) + "\n"
                       + json.dumps({"prompt": "one two"}) + "\n")
    assert main(base + ["--json"]) == 0
    assert "groups" not in _last_json(capsys)


@pytest.mark.slow  # moved out of the default suite to keep it under 20 minutes with the serving tests
def test_generate_rapid_from_a_context_file(tiny_with_tokenizer_and_drafter, capsys, tmp_path):
    """rapid drafts from BM25-retrieved passages of --context-file and gives AR's tokens on the same
    prompt; AR reads the same whole document; rapid without a context is refused before loading."""
    root = tiny_with_tokenizer_and_drafter
    document = tmp_path / "doc.txt"
    document.write_text(" ".join(["the dog ran to the park"] * 6 + ["the cat sat on the mat"] * 2
                                 + ["the dog ran to the park"] * 6))  # within the tiny model's 256 positions
    base = ["generate", "--model", str(root / "model"), "--prompt", "where did the cat sit", "--no-chat",
            "--max-new-tokens", "8", "--ignore-eos", "--json", "--context-file", str(document)]
    assert main(base) == 0
    ar = _last_json(capsys)
    rapid_args = ["--method", "rapid", "--retriever", "bm25", "--chunk-tokens", "16", "--retrieval-budget", "40",
                  "--retrieval-min-score", "0", "--rapid-drafts", "3"]
    assert main(base + rapid_args) == 0
    rapid = _last_json(capsys)
    assert rapid["tokens"] == ar["tokens"] and rapid["prompt_tokens"] == ar["prompt_tokens"]
    context = rapid["stats"]["long_context"]
    assert ar["stats"]["long_context"]["document_tokens"] == context["document_tokens"] > 100
    assert 1 <= len(context["selected_chunks"]) <= 2 and context["selected_tokens"] <= 40
    assert context["drafting_prompt_tokens"] < context["full_prompt_tokens"]
    assert rapid["stats"]["rapid_drafts"] == 3 and "tau" in rapid["stats"]
    assert main([a for a in base if a != "--json"] + rapid_args) == 0  # the printed summary
    err = capsys.readouterr().err
    assert "bm25 retrieved" in err and "drafting cache" in err and "tau" in err
    assert main(base + rapid_args + ["--redraft-every", "3"]) == 0  # retrieval again, for the answer so far
    again = _last_json(capsys)
    assert again["tokens"] == ar["tokens"] and again["stats"]["redrafts"] >= 1
    assert main(base + ["--redraft-every", "3"]) == 2  # re-retrieval is for rapid and rapid+block only
    assert "applies to methods with retrieval (rapid, rapid+block)" in capsys.readouterr().err
    assert main(["bench", "--model", str(root / "model"), "--methods", "ar,rapid,rapid+block", "--context-file",
                 str(document), "--prompt", "where did the cat sit", "--no-chat", "--max-new-tokens", "6", "--json",
                 "--drafter", str(root / "drafter")] + rapid_args[2:]) == 0
    report = _last_json(capsys)
    assert report["methods"]["rapid"]["identical_to_ar"] and report["methods"]["rapid+block"]["identical_to_ar"]
    assert report["long_context"]["retriever"] == "bm25"
    assert main(["generate", "--model", str(root / "model"), "--prompt", "x", "--method", "rapid"]) == 2
    assert "--context-file" in capsys.readouterr().err
    assert main(base + ["--retriever", "bm25"]) == 2  # a rapid option for AR
    assert "applies to methods with retrieval (rapid, rapid+block)" in capsys.readouterr().err


@pytest.mark.slow  # 29 s; trees' exactness and budget rule are tested through Engine in test_tree.py
def test_generate_and_bench_with_trees(tiny_with_tokenizer_and_drafter, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))  # measured latencies go here, not to the user's cache
    root = tiny_with_tokenizer_and_drafter
    base = ["generate", "--model", str(root / "model"), "--prompt", "the cat", "--no-chat", "--max-new-tokens", "9",
            "--ignore-eos", "--json"]
    assert main(base) == 0
    ar = _last_json(capsys)
    base += ["--drafter", str(root / "drafter")]
    assert main(base + ["--method", "tree", "--tree-budget", "6"]) == 0
    tree = _last_json(capsys)
    assert tree["tokens"] == ar["tokens"]
    assert tree["stats"]["tree_bucket_counts"] == {"6": tree["stats"]["verify_steps"]}
    assert main(base + ["--method", "tree+refiner", "--refiner", str(root / "refiner"), "--tree-buckets", "2,4,8"]) == 0
    refined = _last_json(capsys)
    assert refined["tokens"] == ar["tokens"] and refined["stats"]["refine_passes"] >= 1
    assert 1 <= refined["stats"]["tree_nodes_chosen"] <= 8
    assert list((tmp_path / "latency").glob("*.json")), "the measured latency model is cached on disk"
    assert main(base + ["--method", "tree", "--tree-budget", "lots"]) == 2
    assert "--tree-budget must be 'auto' or a node count" in capsys.readouterr().err
    assert main(base + ["--method", "tree", "--tree-buckets", "8,4"]) == 2
    assert "increasing" in capsys.readouterr().err
    assert main(["bench", "--model", str(root / "model"), "--drafter", str(root / "drafter"), "--methods",
                 "ar,tree", "--tree-shape", "fixed", "--prompts-file", str(root / "prompts.txt"),
                 "--max-new-tokens", "6", "--no-chat", "--json"]) == 0
    report = _last_json(capsys)
    entry = report["methods"]["tree"]
    assert entry["identical_to_ar"] and entry["tree_nodes_verified"] == 1 + 3 * 2


def test_mismatched_drafter_is_refused(tiny_with_tokenizer_and_drafter, tiny_folder, capsys):
    root = tiny_with_tokenizer_and_drafter
    assert main(["generate", "--model", str(tiny_folder), "--prompt-ids", "1,2", "--method", "chain",
                 "--drafter", str(root / "drafter")]) == 2
    assert "vocabulary" in capsys.readouterr().err
    assert main(["generate", "--model", str(root / "model"), "--prompt-ids", "1,2", "--method", "chain",
                 "--drafter", str(root / "drafter"), "--block-size", "8"]) == 2
    assert "block size 4, not 8" in capsys.readouterr().err
    assert main(["generate", "--model", str(root / "model"), "--prompt-ids", "1,2", "--method", "chain",
                 "--drafter", str(root / "nope")]) == 2
    assert "not a drafter folder" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny_compressor(tiny_with_tokenizer_and_drafter):
    """A compressor (random queries) for the tiny CLI drafter, saved as a folder."""
    import dataclasses as dc

    import jax

    from specjax.io.compressor import save_compressor
    from specjax.io.dflash import load_drafter
    from specjax.models.drafter import DrafterWindow, init_compressor_params
    from specjax.models.refiner import drafter_fingerprint

    root = tiny_with_tokenizer_and_drafter
    drafter = load_drafter(root / "drafter")
    window = DrafterWindow(window=8, segment=4, summaries=2)
    params = init_compressor_params(dc.replace(drafter.config, window=window), jax.random.key(3))
    params["queries"] = jax.random.normal(jax.random.key(4), params["queries"].shape)
    save_compressor(root / "compressor", window, drafter.config.hidden_size, params,
                    drafter_fingerprint(drafter.params, drafter.draft_vocab))
    return root / "compressor"


@pytest.mark.slow
def test_windowed_drafting_from_the_cli(tiny_with_tokenizer_and_drafter, tiny_compressor, capsys):
    root = tiny_with_tokenizer_and_drafter
    base = ["generate", "--model", str(root / "model"), "--prompt", "the cat sat on the mat and the dog",
            "--no-chat", "--max-new-tokens", "20", "--ignore-eos", "--json"]
    assert main(base) == 0
    ar = _last_json(capsys)
    assert ar["stats"]["memory"]["target_kv_bytes"] > 0 and "drafter_state_bytes" not in ar["stats"]["memory"]
    for method in ("chain", "tree"):
        assert main(base + ["--method", method, "--drafter", str(root / "drafter"), "--drafter-window", "8",
                            "--compressor", str(tiny_compressor)]) == 0
        windowed = _last_json(capsys)
        assert windowed["tokens"] == ar["tokens"], method
        memory = windowed["stats"]["memory"]
        assert memory["drafter_attention"] == "windowed" and memory["drafter_window_bytes"] > 0
        assert memory["peak_bytes"] > memory["target_kv_bytes"]
    assert main(base + ["--method", "chain", "--drafter", str(root / "drafter"), "--drafter-window", "2",
                        "--compressor", str(tiny_compressor)]) == 2
    assert "at least the segment" in capsys.readouterr().err


@pytest.mark.slow  # moved out of the default suite to keep it under 20 minutes with the serving tests
def test_memory_command(tiny_with_tokenizer_and_drafter, tiny_compressor, capsys, tmp_path):
    root = tiny_with_tokenizer_and_drafter
    args = ["memory", "--model", str(root / "model"), "--drafter", str(root / "drafter"), "--compressor",
            str(tiny_compressor), "--contexts", "64,128,512"]
    assert main(args + ["--json"]) == 0
    report = _last_json(capsys)
    assert report["contexts"] == [64, 128, 512]
    assert set(report) >= {"target_kv_bytes", "drafter_kv_bytes", "peak_bytes"}
    full, windowed = report["drafter_kv_bytes"]["full"], report["drafter_kv_bytes"]["windowed"]
    assert full[2] == 8 * full[0]  # full attention grows with the context
    assert windowed[2] < full[2] and windowed[2] / windowed[0] < full[2] / full[0]
    assert report["target_kv_bytes"][2] == 8 * report["target_kv_bytes"][0]
    assert all(p > 0 for p in report["peak_bytes"]["full"] + report["peak_bytes"]["windowed"])
    plot = tmp_path / "memory.png"
    assert main(args + ["--plot", str(plot)]) == 0
    assert "| 512 |" in capsys.readouterr().out and plot.stat().st_size > 0
    assert main(args[:-1] + ["64,x"]) == 2


@pytest.mark.slow  # 8 s; test_sliding_window.py checks the ring sizes it reports
def test_memory_command_on_a_sliding_target_without_a_drafter(capsys, tmp_path):
    """A Gemma 2 target nobody trained a drafter for: `--drafter untrained` gives the sizes, and
    the sliding layer's KV ring stops its share of the target cache from growing."""
    from conftest import build_tiny_hf

    build_tiny_hf("gemma2").save_pretrained(tmp_path / "gemma2")
    assert main(["memory", "--model", str(tmp_path / "gemma2"), "--drafter", "untrained", "--contexts", "128,256",
                 "--window", "32", "--segment", "16", "--dtype", "float32", "--json"]) == 0
    report = _last_json(capsys)
    small, large = report["target_kv_bytes"]
    # float32 pinned: `auto` picks bf16 (2-byte entries) on a host with AMX, float32 elsewhere.
    slot = 2 * 2 * 16 * 4  # K and V of one position in one layer: 2 kv heads of 16 floats
    # Two layers: a full one (one slot per position) and a sliding one (window 4, ring 4 + 16 - 1).
    assert (small, large) == ((128 + 19) * slot, (256 + 19) * slot)
    assert report["drafter_kv_bytes"]["windowed"][1] < report["drafter_kv_bytes"]["full"][1]


@pytest.mark.parametrize("command,module,function", [
    ("train-refiner", "specjax.train.refiner", "train_refiner_recipe"),
    ("train-compressor", "specjax.train.compressor", "train_compressor_recipe"),
])
def test_training_commands_take_a_compute_precision(tmp_path, monkeypatch, command, module, function):
    """train-refiner and train-compressor run the target, so they take --dtype as train-drafter does
    (auto: the decoding default of this backend); train-refiner also sizes its generation batch."""
    import importlib

    from specjax.io.registry import compute_dtype

    recipes = []

    def record(model_name, drafter_spec, out_dir, recipe):
        recipes.append(recipe)
        return {"out": str(out_dir)}

    monkeypatch.setattr(importlib.import_module(module), function, record)
    extra = ["--generate-batch", "64"] if command == "train-refiner" else []
    assert main([command, "--out", str(tmp_path / "a"), "--dtype", "bfloat16", "--json", *extra]) == 0
    assert main([command, "--out", str(tmp_path / "b"), "--json"]) == 0
    assert [r.dtype for r in recipes] == ["bfloat16", compute_dtype("auto")]
    if command == "train-refiner":
        assert [r.generate_batch for r in recipes] == [64, 32]
