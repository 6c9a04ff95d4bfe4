"""The decode loop end to end on a lent GPU, in one prepared run of at most 8 minutes (issue 46).

    python experiments/gpu_checks.py OUT_DIR [--dry-run] [--sections decode,verify_curve,serve,demo]

Sections run in priority order, each in its own process under its own time limit, and each writes
OUT_DIR/<section>.json as it goes, so a run cut short still brings back what it measured.
OUT_DIR/summary.json says how each section ended (ok, failed, timed out) and how long it took.

1. decode: `specjax bench --methods ar,chain,tree` on the held-out chat prompts in bf16, then AR in
   float32; per method tokens/s, tau, and the share of prompts whose output is identical to bf16 AR
   and to float32 AR (cuBLAS picks its algorithms by shape, so bf16 exactness is measured, not assumed).
2. verify_curve: the forward's cost at T = 1, 8, 16, 64 new tokens for SmolLM2 and for random
   weights of Llama-3.2-1B and Llama-3.1-8B shape (experiments/verify_cost_curve.py).
3. serve: `specjax serve` with AR, then adaptive, each loaded by `bench-serve` at one request rate
   once /ready answers; start-up time to /health and to /ready.
4. demo: `specjax demo`.

--dry-run runs the same sections on the CPU at toy sizes (2 prompts, 4 tokens, a toy random shape),
so the script is known to work before a GPU is lent. The Pallas kernel checks run on their own
(experiments/gpu_tree_attention_check.py, gpu_window_attention_check.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

# Seconds each section may take on the GPU, in the order they run: 8 minutes in all.
SECTION_LIMITS = {"decode": 170, "verify_curve": 140, "serve": 110, "demo": 60}
# On the CPU a dry run compiles for most of its time.
DRY_RUN_LIMITS = {"decode": 600, "verify_curve": 120, "serve": 900, "demo": 900}


def write_json(path: Path, payload) -> None:
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(payload, indent=1))
    partial.replace(path)  # a reader never sees half a file, even when the section is killed mid-write


def specjax(*args: str, timeout: float | None = None) -> str:
    """stdout of `python -m specjax.cli ARGS`; stderr goes through to the log."""
    done = subprocess.run([sys.executable, "-m", "specjax.cli", *args], stdout=subprocess.PIPE, text=True,
                          timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"specjax {' '.join(args)} exited {done.returncode}")
    return done.stdout


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def prompts_file(out: Path, dry_run: bool) -> Path:
    from specjax.data.prompts import HELDOUT_CHAT_PROMPTS

    prompts = list(HELDOUT_CHAT_PROMPTS)[: 2 if dry_run else None]
    path = out / "prompts.json"
    path.write_text(json.dumps(prompts))
    return path


def identical_share(outputs: list, reference: list) -> float:
    return sum(a == b for a, b in zip(outputs, reference, strict=True)) / len(reference)


def section_decode(out: Path, dry_run: bool) -> None:
    tokens = "4" if dry_run else "64"
    common = ["bench", "--prompts-file", str(prompts_file(out, dry_run)), "--max-new-tokens", tokens, "--json"]
    result: dict = {"max_new_tokens": int(tokens)}
    bf16 = last_json(specjax(*common, "--methods", "ar,chain,tree", "--dtype", "bfloat16"))
    result["bfloat16"] = {m: {k: e.get(k) for k in ("tokens_per_s", "tau", "speedup_vs_ar", "tree_nodes_verified")}
                          for m, e in bf16["methods"].items()}
    reference = bf16["methods"]["ar"]["outputs"]
    for method, entry in bf16["methods"].items():
        result["bfloat16"][method]["identical_to_bf16_ar"] = identical_share(entry["outputs"], reference)
    write_json(out / "decode.json", result)
    f32 = last_json(specjax(*common, "--methods", "ar", "--dtype", "float32"))
    result["float32_ar_tokens_per_s"] = f32["methods"]["ar"]["tokens_per_s"]
    for method, entry in bf16["methods"].items():
        result["bfloat16"][method]["identical_to_float32_ar"] = identical_share(entry["outputs"],
                                                                                f32["methods"]["ar"]["outputs"])
    write_json(out / "decode.json", result)


def section_verify_curve(out: Path, dry_run: bool) -> None:
    runs = ([("toy", "float32,bfloat16")] if dry_run else
            [("smollm2", "float32,bfloat16"), ("llama-3.2-1b", "bfloat16"), ("llama-3.1-8b", "bfloat16")])
    result = {}
    for shape, dtypes in runs:
        path = out / f"verify_curve_{shape}.json"
        subprocess.run([sys.executable, "experiments/verify_cost_curve.py", "--shape", shape, "--dtypes", dtypes,
                        "--sizes", "1,8,16,64", "--repeats", "3" if dry_run else "10", "--json", str(path)],
                       check=True)
        result[shape] = json.loads(path.read_text())
        path.unlink()
        write_json(out / "verify_curve.json", result)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(url: str, process: subprocess.Popen, timeout: float) -> float | None:
    """Seconds until url answers 200, or None if the process died or time ran out."""
    import httpx

    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if process.poll() is not None:
            return None
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return None


def section_serve(out: Path, dry_run: bool) -> None:
    result = {}
    for method in ("ar", "adaptive"):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        slots, context, requests, tokens = ("1", "256", "4", "4") if dry_run else ("16", "512", "64", "64")
        server = subprocess.Popen([sys.executable, "-m", "specjax.cli", "serve", "--method", method, "--slots", slots,
                                   "--context-length", context, "--max-new-tokens", "128", "--port", str(port)]
                                  + (["--policies", "ar,chain"] if dry_run and method == "adaptive" else []),
                                  stdout=sys.stderr, stderr=sys.stderr)
        launched = time.monotonic()
        try:
            health_s = wait_for(f"{url}/health", server, 120)
            if wait_for(f"{url}/ready", server, 600) is None:
                raise RuntimeError(f"the {method} server never became ready")
            ready_s = time.monotonic() - launched
            load = last_json(specjax("bench-serve", "--url", url, "--request-rate", "4", "--num-requests", requests,
                                     "--max-tokens", tokens, "--json"))
            result[method] = {"seconds_to_health": health_s, "seconds_to_ready": ready_s, "load": load}
            write_json(out / "serve.json", result)
        finally:
            server.terminate()
            server.wait(60)


def section_demo(out: Path, dry_run: bool) -> None:
    started = time.monotonic()
    text = specjax("demo", "--max-new-tokens", "4" if dry_run else "128")
    write_json(out / "demo.json", {"seconds": time.monotonic() - started, "output": text})


SECTIONS = {"decode": section_decode, "verify_curve": section_verify_curve, "serve": section_serve,
            "demo": section_demo}


def run_sections(out: Path, names: list[str], dry_run: bool) -> dict:
    """Each section in a process of its own under its time limit; summary.json after every one."""
    limits = DRY_RUN_LIMITS if dry_run else SECTION_LIMITS
    summary = {"dry_run": dry_run, "sections": {}}
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if dry_run:
        env["JAX_PLATFORMS"] = "cpu"
    for name in names:
        started = time.monotonic()
        command = [sys.executable, __file__, str(out), "--section", name] + (["--dry-run"] if dry_run else [])
        # A process group of its own: a section cut short takes its servers and benches down with it.
        section = subprocess.Popen(command, env=env, start_new_session=True)
        try:
            code = section.wait(timeout=limits[name])
            status = "ok" if code == 0 else f"failed (exit {code})"
        except subprocess.TimeoutExpired:
            status = f"timed out after {limits[name]} s"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(section.pid, signal.SIGKILL)
            section.wait()
        summary["sections"][name] = {"status": status, "seconds": round(time.monotonic() - started, 1)}
        print(f"[gpu_checks] {name}: {status} in {summary['sections'][name]['seconds']} s", flush=True)
        write_json(out / "summary.json", summary)
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--dry-run", action="store_true", help="on the CPU, at toy sizes")
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated, run in the order given")
    parser.add_argument("--section", help=argparse.SUPPRESS)  # one section, in this process (the driver's child)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.section:
        SECTIONS[args.section](args.out, args.dry_run)
        return 0
    names = [n.strip() for n in args.sections.split(",") if n.strip()]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        parser.error(f"unknown section {unknown[0]!r}; the sections are {', '.join(SECTIONS)}")
    summary = run_sections(args.out, names, args.dry_run)
    return 0 if all(s["status"] == "ok" for s in summary["sections"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
