"""experiments/gpu_checks.sh, the prepared GPU run, works before a GPU is lent: its dry run on the CPU."""

import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def dry_run(out: Path, *sections: str) -> dict:
    command = ["bash", "experiments/gpu_checks.sh", "--dry-run", str(out)]
    if sections:
        command += ["--sections", ",".join(sections)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


def test_the_dry_run_smoke_path_writes_each_section_as_it_goes(tmp_path):
    """The section driver, its time limits and its JSON, through the cheapest section (a toy shape)."""
    summary = dry_run(tmp_path, "verify_curve")
    assert summary["dry_run"] and summary["sections"]["verify_curve"]["status"] == "ok"
    curve = json.loads((tmp_path / "verify_curve.json").read_text())["toy"]
    for dtype in ("float32", "bfloat16"):
        assert sorted(curve["ms"][dtype], key=int) == ["1", "8", "16", "64"]
        assert all(ms > 0 for ms in curve["ms"][dtype].values())


def test_an_unknown_section_is_refused(tmp_path):
    done = subprocess.run(["bash", "experiments/gpu_checks.sh", "--dry-run", str(tmp_path), "--sections", "decod"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "unknown section 'decod'" in done.stderr


@pytest.mark.slow
def test_the_whole_dry_run_passes(tmp_path):
    summary = dry_run(tmp_path)
    assert all(s["status"] == "ok" for s in summary["sections"].values()), summary
    decode = json.loads((tmp_path / "decode.json").read_text())
    for method in ("chain", "tree"):  # bf16 with padded query rows: speculation rounds as AR does on a CPU
        assert decode["bfloat16"][method]["identical_to_bf16_ar"] == 1.0
    serve = json.loads((tmp_path / "serve.json").read_text())
    for method in ("ar", "adaptive"):
        assert serve[method]["seconds_to_health"] <= serve[method]["seconds_to_ready"]
        assert serve[method]["load"]["completed"] == 4
    assert "Speculative output is identical to" in json.loads((tmp_path / "demo.json").read_text())["output"]


@pytest.mark.slow
def test_the_answer_dry_run_trains_on_answers_made_elsewhere(tmp_path):
    """Issue 45's GPU path on the CPU: export a recipe's ShareGPT prompts, answer them in another
    process, and build the data from what came back without the target answering anything here."""
    done = subprocess.run(["bash", "experiments/gpu_checks.sh", "answer-dry-run", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    answers = [json.loads(line) for line in (tmp_path / "first" / "answers.json").read_text().splitlines()]
    assert {a["name"] for a in answers} == {"sharegpt", "heldout_sharegpt"}
    assert all(a["answered"] == a["prompts"] > 0 and a["new_tokens"] > 0 for a in answers)
    seeded = [json.loads(line) for line in (tmp_path / "answers" / "answers.json").read_text().splitlines()]
    assert all(a["answered"] == a["prompts"] and a["new_tokens"] == 0 for a in seeded)  # nothing made twice
    assert sorted(p.name for p in (tmp_path / "answers").glob("*.gz")) == [
        "heldout_sharegpt.continuations.jsonl.gz", "sharegpt.continuations.jsonl.gz"]
    data = json.loads((tmp_path / "data.json").read_text())
    assert data["train_tokens"] == next(a["new_tokens"] for a in answers if a["name"] == "sharegpt")
    assert "greedy continuations of 0 prompts" in done.stderr and "greedy continuations of 1" not in done.stderr
