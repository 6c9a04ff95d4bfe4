"""The `specjax` command: the generate JSON contract and clear errors."""

from __future__ import annotations

import json

import pytest

from specjax.cli import main

from conftest import build_tiny_hf


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
    assert "cannot read prompts" in capsys.readouterr().err


@pytest.mark.network
def test_generate_with_real_model_text_output(capsys):
    assert main(["generate", "--prompt", "What is the capital of France?", "--max-new-tokens", "12"]) == 0
    captured = capsys.readouterr()
    assert "Paris" in captured.out
    assert "tokens/s" in captured.err
