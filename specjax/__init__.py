"""specjax: speculative decoding with block-diffusion drafters, in JAX.

    import specjax
    llm = specjax.LLM("smollm2")
    [out] = llm.generate("Why is the sky blue?", method="chain")

The public API (each name is imported on first use, so `import specjax` stays cheap):

- decoding: `LLM` (generate, stream, bench, server), `Completion`, `methods()`, and the configs
  `SamplingConfig`, `TreeConfig`, `RefineConfig`, `NgramConfig`, `AutoConfig`, and for requests
  about a long document (`generate(question, document=...)`) `RapidConfig` and `RetrievalConfig`;
- serving without HTTP: `Scheduler` (`submit`, `live_view`, `shutdown`), `ServeConfig`,
  `ControllerConfig`, `Request`; a server's run log: `read_run_log`, `request_latencies`,
  `summarize_run`;
- text to try long contexts on: `load_corpus(name)` (public-domain corpora, fetched on first use),
  `long_context_tasks(...)` (`LongTask`s with exact answers: verse, speaker, needle), and
  `LLM.retrieve` (a `RetrievalView`: what rapid drafts from);
- training: `train_lm(out_dir, LMRecipe(...))` (a small target from scratch), `train_drafter(model,
  out_dir, DistillRecipe(...))`, `train_refiner(model, drafter, out_dir, RefinerRecipe(...))`,
  `train_compressor(model, drafter, out_dir, CompressorRecipe(...))`, and `read_metrics(run_dir)` for
  a run's learning curves.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "specjax.api", "Completion": "specjax.api", "BenchReport": "specjax.api", "methods": "specjax.api",
    "SamplingConfig": "specjax.decode.sampling", "TreeConfig": "specjax.decode.tree",
    "RefineConfig": "specjax.decode.refine", "NgramConfig": "specjax.decode.ngram", "AutoConfig": "specjax.decode.auto",
    "RapidConfig": "specjax.decode.rapid", "RetrievalConfig": "specjax.data.retrieval",
    "Scheduler": "specjax.serve.scheduler", "ServeConfig": "specjax.serve.config",
    "Request": "specjax.serve.requests", "ControllerConfig": "specjax.serve.controller",
    "DistillRecipe": "specjax.train.recipe", "RefinerRecipe": "specjax.train.refiner",
    "CompressorRecipe": "specjax.train.compressor", "LMRecipe": "specjax.train.lm",
    "read_metrics": "specjax.train.loop", "SpecjaxError": "specjax.errors",
    "read_run_log": "specjax.monitor.report", "request_latencies": "specjax.monitor.report",
    "load_corpus": "specjax.data.corpora", "LongTask": "specjax.data.longbench",
    "RetrievalView": "specjax.data.retrieval",
    "HELDOUT_CHAT_PROMPTS": "specjax.data.prompts",
}
# Public name -> (module, name there), for the recipes whose functions carry longer names.
_RENAMED = {
    "train_lm": ("specjax.train.lm", "train_lm_recipe"),
    "summarize_run": ("specjax.monitor.report", "summarize"),
    "long_context_tasks": ("specjax.data.longbench", "build_tasks"),
    "train_drafter": ("specjax.train.recipe", "train_drafter_recipe"),
    "train_refiner": ("specjax.train.refiner", "train_refiner_recipe"),
    "train_compressor": ("specjax.train.compressor", "train_compressor_recipe"),
}

__all__ = sorted([*_EXPORTS, *_RENAMED])


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _RENAMED:
        module, attribute = _RENAMED[name]
        value = getattr(importlib.import_module(module), attribute)
    else:
        raise AttributeError(f"module 'specjax' has no attribute {name!r}")
    globals()[name] = value  # once imported, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
