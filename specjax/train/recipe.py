"""The end-to-end recipe behind `specjax train-drafter`: distillation data for a real target, then
drafter training, then a DFlash-format checkpoint. Every stage reuses what an earlier (possibly
interrupted) run left in the output folder, so rerunning the same command resumes."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import numpy as np

from specjax.errors import SpecjaxError, check_at_least, check_compute_dtype, check_positive_finite
from specjax.sharding import MeshConfig, built_once, is_writer


@dataclasses.dataclass(frozen=True)
class DistillRecipe:
    """What data to make and how to train on it."""

    chat_prompts: int = 512
    """Self-distillation prompts built from the training corpora (the target answers them greedily)."""
    corpus_sequences: int = 512
    """Teacher-forced windows of corpus text."""
    everyday_prompts: int = 0
    """Self-distillation prompts of the held-out prompts' kind (everyday requests on other topics)."""
    math_prompts: int = 0
    """Self-distillation prompts: templated arithmetic word problems."""
    code_prompts: int = 0
    """Self-distillation prompts: templated small programming requests."""
    self_instruct_prompts: int = 0
    """Instructions that have the target write requests itself (self-instruct); the distinct requests
    it writes that touch no held-out prompt become self-distillation prompts (fewer than this)."""
    sharegpt_prompts: int = 0
    """Self-distillation prompts from ShareGPT's training split: real human requests (with the
    conversation before them, see sharegpt_turns) that the target answers greedily."""
    sharegpt_replies: int = 0
    """ShareGPT training-split requests whose recorded assistant replies are teacher-forced through the
    target, labelled with its argmax (EAGLE-style: one forward pass per sequence, no generation)."""
    sharegpt_turns: str = "all"
    """Which human turns ShareGPT requests come from: "first" (each conversation's opening request) or
    "all" (later turns too, after the conversation so far)."""
    text_prompts: int = 0
    """Self-distillation prompts that are plain text: windows of text_prompt_tokens tokens from the
    training corpora, which the target continues greedily. The data for a base model without a chat
    template, such as one trained by `specjax.train_lm`."""
    text_prompt_tokens: int = 32
    """Tokens per text prompt (text_prompts, heldout_text_prompts); the target continues each to seq_len."""
    heldout_text_prompts: int = 0
    """Windows of the corpora's held-out split that the target continues, for the in-training
    acceptance estimate instead of the held-out chat prompts. A target without a chat template needs it."""
    heldout_sharegpt: int = 0
    """Requests from ShareGPT's held-out split that the target answers for the in-training acceptance
    estimate; 0 estimates on the built-in held-out chat prompts instead."""
    features: str = "stored"
    """"stored": the target's tap features of every training token are computed once and kept on disk
    (about 4.6 kB a token at 4 taps), so training reuses them; "online": only token ids are kept and
    every training step reruns the target over its batch, for data larger than the disk. The
    held-out set is stored either way."""
    seq_len: int = 256
    """Tokens per stored sequence (prompt + continuation, or a corpus window)."""
    generate_batch: int = 32
    """Rows decoded together while generating continuations (finished rows are refilled)."""
    corpora: tuple[str, ...] = ("austen", "shakespeare", "kjv", "gutenberg_novels", "python_stdlib")
    """Training-split corpora for prompts and windows."""
    num_layers: int = 1
    """Drafter depth."""
    block_size: int = 16
    """Drafter block size."""
    num_taps: int = 4
    """Target layers tapped."""
    target_topk: int = 8
    """The target's k most likely tokens stored with their log-probabilities at every position, the
    soft targets of topk_weight; 0 stores none."""
    topk_weight: float = 0.0
    """Share of the loss that is cross-entropy against the target's renormalised top-k distribution
    (DrafterTrainConfig.topk_weight); the rest is cross-entropy against its argmax token."""
    draft_vocab_size: int = 16384
    """Tokens the drafter's head covers (the most frequent labels); 0 for the whole vocabulary. The
    LM head dominates a small drafter's cost, so this cuts training and drafting time about 3x."""
    init_from_target: bool = True
    """Start the drafter's layers as copies of the target's top layers."""
    anchor_path: bool = True
    """Give every draft slot the projected anchor embedding (DrafterConfig.anchor_path)."""
    init_drafter: str | None = None
    """Start from this trained drafter ("default" or a DFlash folder) instead of the target's top
    layers: a warm start that keeps what it learned and adds what it lacks (the anchor path)."""
    steps: int = 3000
    """Optimizer steps."""
    learning_rate: float = 1e-3
    """Peak AdamW learning rate."""
    sequences_per_batch: int = 4
    """Sequences per step."""
    anchors_per_sequence: int = 32
    """Blocks per sequence per step."""
    seed: int = 0
    """Seeds prompts, windows, batches and init."""
    avoid_prompts_from: tuple[str, ...] = ()
    """Data folders of earlier runs (their `*.continuations.jsonl`): a prompt one of them already
    answered is not answered again. Greedy answers repeat, so growing a data set over several runs
    with other seeds would otherwise store some answers twice."""
    dtype: str = "float32"
    """Compute precision of the target (data generation, features, head) and of the drafter's
    forward and backward: bfloat16 feeds bf16 into every dot with float32 accumulation. The drafter's
    master weights and optimizer state stay float32 either way."""

    mesh: MeshConfig = MeshConfig()
    """Devices to train over (`--mesh`); one device by default."""

    def __post_init__(self):
        check_compute_dtype(self.dtype)
        check_at_least(0, chat_prompts=self.chat_prompts, corpus_sequences=self.corpus_sequences,
                       sharegpt_prompts=self.sharegpt_prompts, sharegpt_replies=self.sharegpt_replies,
                       heldout_sharegpt=self.heldout_sharegpt, text_prompts=self.text_prompts,
                       heldout_text_prompts=self.heldout_text_prompts,
                       everyday_prompts=self.everyday_prompts, math_prompts=self.math_prompts,
                       code_prompts=self.code_prompts, self_instruct_prompts=self.self_instruct_prompts,
                       draft_vocab_size=self.draft_vocab_size)
        check_at_least(1, seq_len=self.seq_len, generate_batch=self.generate_batch, layers=self.num_layers,
                       taps=self.num_taps, steps=self.steps, sequences_per_batch=self.sequences_per_batch,
                       anchors_per_sequence=self.anchors_per_sequence)
        check_at_least(2, block_size=self.block_size)
        if not 1 <= self.text_prompt_tokens < self.seq_len:
            raise SpecjaxError(f"text_prompt_tokens must be in [1, seq_len {self.seq_len}), got {self.text_prompt_tokens}")
        if self.heldout_text_prompts and self.heldout_sharegpt:
            raise SpecjaxError("the acceptance estimate replays one held-out set: give heldout_text_prompts or "
                               "heldout_sharegpt, not both")
        check_positive_finite(learning_rate=self.learning_rate)
        check_at_least(0, target_topk=self.target_topk)
        if not 0.0 <= self.topk_weight <= 1.0:
            raise SpecjaxError(f"topk_weight must be in [0, 1], got {self.topk_weight}")
        if self.topk_weight and not self.target_topk:
            raise SpecjaxError("topk_weight needs the target's top-k stored: target_topk is 0")
        from specjax.data.prompts import everyday_capacity, self_instruct_capacity

        if self.self_instruct_prompts > self_instruct_capacity():
            raise SpecjaxError(f"self_instruct_prompts is {self.self_instruct_prompts}, but only "
                               f"{self_instruct_capacity()} distinct self-instruct instructions exist")
        if self.everyday_prompts > everyday_capacity():
            raise SpecjaxError(f"everyday_prompts is {self.everyday_prompts}, but only {everyday_capacity()} "
                               "distinct everyday requests exist")
        if self.features not in ("stored", "online"):
            raise SpecjaxError(f"features must be 'stored' or 'online', got {self.features!r}")
        if self.features == "online" and self.topk_weight:
            raise SpecjaxError("topk_weight needs the target's top-k stored, which online features do not keep")
        if self.sharegpt_turns not in ("first", "all"):
            raise SpecjaxError(f"sharegpt_turns must be 'first' or 'all', got {self.sharegpt_turns!r}")
        if self.corpus_sequences + self.text_prompts + sum(self.chat_data().values()) == 0:
            raise SpecjaxError("the recipe has no training data: chat_prompts, corpus_sequences, text_prompts, "
                               "everyday_prompts, math_prompts, code_prompts, self_instruct_prompts, "
                               "sharegpt_prompts and sharegpt_replies are all 0")

    def chat_data(self) -> dict[str, int]:
        """The recipe's data that goes through the target's chat template, by field."""
        return {name: getattr(self, name) for name in ("chat_prompts", "everyday_prompts", "math_prompts",
                                                       "code_prompts", "self_instruct_prompts", "sharegpt_prompts",
                                                       "sharegpt_replies")}


def _log(message: str) -> None:
    print(f"[specjax] {message}", file=sys.stderr, flush=True)


def write_recipe(out_dir: Path, recipe) -> None:
    """out_dir/recipe.json: the recipe a run was started with (written by process 0 alone)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if is_writer():
        (out_dir / "recipe.json").write_text(json.dumps(dataclasses.asdict(recipe), indent=2))


def _coverage(data, draft_vocab) -> float:
    labels = np.asarray(data.labels)[np.asarray(data.valid)]
    return float(np.isin(labels, draft_vocab).mean()) if len(labels) else 0.0


def _answered_prompts(folders) -> set[tuple[int, ...]]:
    """Every prompt (token ids) that the continuation files in these data folders answered."""
    from specjax.train.selfdistill import read_continuations

    answered = set()
    for folder in folders:
        files = sorted(Path(folder).glob("*.continuations.jsonl"))
        if not files:
            raise SpecjaxError(f"{folder} holds no *.continuations.jsonl: not a train-drafter data folder")
        for path in files:
            answered.update(tuple(prompt) for prompt, _ in read_continuations(path).values())
    return answered


def fit_chat_prompt(tok, messages, limit: int) -> list[int] | None:
    """The chat ids of a request within `limit` tokens, dropping its earliest messages first; None when
    the last message alone does not fit (a cut message would lose the template's assistant turn)."""
    messages = list(messages)
    for first in range(len(messages)):
        ids = tok.encode_chat(messages[first:])
        if len(ids) <= limit:
            return ids
    return None


def text_windows(tok, docs: list, count: int, tokens: int, rng: np.random.Generator) -> list[list[int]]:
    """`count` windows of `tokens` token ids, each from a random place in a random document (by
    characters, long documents weighted by length), starting at a whole token."""
    chars = 8 * tokens + 64  # comfortably more text than `tokens` tokens
    docs = [d for d in docs if len(d.text) > chars]
    if not docs:
        raise SpecjaxError(f"no document is longer than {chars} characters: too little text for "
                           f"{tokens}-token windows")
    weights = np.asarray([len(d.text) for d in docs], np.float64)
    windows = []
    for _ in range(count):
        doc = docs[rng.choice(len(docs), p=weights / weights.sum())]
        start = int(rng.integers(0, len(doc.text) - chars))
        ids = tok.encode(doc.text[start : start + chars], add_special_tokens=False)
        windows.append(ids[1 : 1 + tokens])  # the first may be cut mid-word
    return windows


def sharegpt_training_requests(recipe: DistillRecipe) -> tuple[list, list]:
    """(requests the target answers, requests whose recorded replies are teacher-forced): disjoint
    draws from ShareGPT's training split, in an order fixed by the recipe's seed."""
    from specjax.data.sharegpt import sharegpt_requests

    requests = sharegpt_requests("train", recipe.sharegpt_turns)
    wanted = recipe.sharegpt_prompts + recipe.sharegpt_replies
    if wanted > len(requests):
        raise SpecjaxError(f"the recipe asks for {wanted} ShareGPT requests, but the training split has "
                           f"{len(requests)} ({recipe.sharegpt_turns} turns)")
    order = np.random.default_rng([recipe.seed, 45]).permutation(len(requests))
    picked = [requests[i] for i in order[:wanted]]
    return picked[: recipe.sharegpt_prompts], picked[recipe.sharegpt_prompts:]


def build_data(model, recipe: DistillRecipe, out_dir: Path, taps: tuple[int, ...], export_to: Path | None = None,
               answers_from: Path | None = None, answered_only: bool = False):
    """(train sets, held-out set); each stage is skipped when its folder is complete.

    export_to: write the prompts of every set the target still has to answer there (train/answers.py)
    and build nothing; the held-out set comes back as None. answers_from: a folder of answers made
    elsewhere, merged into each set's answers before the target answers what is left. answered_only:
    the self-distilled sets hold the prompts answered so far and the target answers none; a later run
    with more answers builds them again."""
    from specjax.data.corpora import load_split
    from specjax.data.prompts import code_task_prompts, everyday_chat_prompts, math_word_prompts, training_chat_prompts
    from specjax.train.drafter import without_looping

    if model.tokenizer is None:
        raise SpecjaxError("the target has no tokenizer; distillation needs text prompts")
    if not model.tokenizer.chat_template:
        chat = [name for name, count in recipe.chat_data().items() if count]
        if chat or not recipe.heldout_text_prompts:
            raise SpecjaxError(f"{model.name} has no chat template: train it on text_prompts or corpus_sequences, "
                               f"with heldout_text_prompts for the acceptance estimate"
                               + (f" (the recipe asks for {', '.join(chat)})" if chat else ""))
    if export_to is not None and recipe.self_instruct_prompts:
        raise SpecjaxError("self-instruct requests are written by the target itself before they are answered, "
                           "so they cannot be exported: leave self_instruct_prompts at 0 with --export-prompts")
    data = _DataBuilder(model, recipe, out_dir, taps, export_to, answers_from, answered_only)
    train_docs, heldout_docs = load_split(recipe.corpora)
    sets = []
    if recipe.chat_prompts:
        sets.append(data.continuations(training_chat_prompts(train_docs, recipe.chat_prompts, recipe.seed),
                                       out_dir / "chat", "chat"))
    if recipe.everyday_prompts:
        sets.append(data.continuations(everyday_chat_prompts(recipe.everyday_prompts, recipe.seed),
                                       out_dir / "everyday", "everyday chat"))
    for count, make, name in ((recipe.math_prompts, math_word_prompts, "math"),
                              (recipe.code_prompts, code_task_prompts, "code")):
        if count:
            sets.append(data.continuations(make(count, recipe.seed), out_dir / name, f"{name} tasks"))
    if recipe.self_instruct_prompts:
        sets.append(data.self_instruct())
    if recipe.sharegpt_prompts or recipe.sharegpt_replies:
        asked, replied = sharegpt_training_requests(recipe)
        if asked:
            sets.append(data.continuations([list(r.messages) for r in asked], out_dir / "sharegpt",
                                           "ShareGPT requests"))
        if replied:
            sets.append(data.sharegpt_replies(replied))
    if recipe.text_prompts:
        sets.append(data.text_continuations(train_docs, recipe.text_prompts, "text", seed=recipe.seed))
    if export_to is not None:
        if recipe.heldout_text_prompts:
            data.text_continuations(heldout_docs, recipe.heldout_text_prompts, "heldout_text", seed=-1)
        else:
            data.heldout_set()
        return [], None
    heldout, looping = without_looping(data.text_continuations(heldout_docs, recipe.heldout_text_prompts,
                                                               "heldout_text", seed=-1)
                                       if recipe.heldout_text_prompts else data.heldout_set())
    if looping:
        held = "ShareGPT" if recipe.heldout_sharegpt else "text" if recipe.heldout_text_prompts else "chat"
        _log(f"held-out {held}: {looping} of "
             f"{heldout.num_sequences + looping} answers are stuck in a loop "
             "(distinct-3 under 0.5) and are left out of the acceptance estimate")
    if recipe.corpus_sequences:
        sets.append(data.corpus(train_docs))
    return sets, heldout


class _DataBuilder:
    """Builds a recipe's distillation sets in out_dir, each once: a complete folder is reused."""

    def __init__(self, model, recipe: DistillRecipe, out_dir: Path, taps: tuple[int, ...],
                 export_to: Path | None = None, answers_from: Path | None = None, answered_only: bool = False):
        from specjax.train.selfdistill import GeneratorConfig

        self.model, self.recipe, self.out_dir, self.taps = model, recipe, out_dir, taps
        self.export_to, self.answers_from, self.answered_only = export_to, answers_from, answered_only
        self._ids: dict[Path, list[list[int]]] = {}  # each set's prompt ids, tokenized once a run
        self.tok = model.tokenizer
        # Prompts longer than half a sequence are skipped, not cut: a cut prompt loses the chat
        # template's closing "assistant" turn.
        self.generator = GeneratorConfig(batch_size=recipe.generate_batch, max_prompt_tokens=recipe.seq_len // 2,
                                         max_new_tokens=recipe.seq_len - recipe.seq_len // 2,
                                         refill_rows=max(1, recipe.generate_batch // 4))
        self.answered_before = _answered_prompts(recipe.avoid_prompts_from)

    @staticmethod
    def _done(folder: Path) -> bool:
        return (folder / "meta.json").exists()

    def _stores(self, folder: Path) -> bool:
        """Whether the set keeps the target's features (held-out sets always do: they are scored often)."""
        return self.recipe.features == "stored" or folder.name.startswith("heldout")

    def _set(self, folder: Path, rows: list, teacher_labels: bool) -> None:
        from specjax.train.drafter import build_distillation_set

        stored = self._stores(folder)
        build_distillation_set(self.model.params, self.model.config, rows, folder, self.taps, self.recipe.seq_len,
                               teacher_labels=teacher_labels, topk=self.recipe.target_topk if stored else 0,
                               store_features=stored)

    def _open(self, folder: Path, build, what: str):
        from specjax.train.drafter import DistillationSet

        if self.export_to is not None:
            return None  # exporting builds nothing: sets without prompts to answer are built on return
        built_once(lambda: self._done(folder), build, f"{what} in {folder}")
        return DistillationSet.open(folder)

    def continuations(self, prompts: list, folder: Path, what: str, generator=None):
        """The set of the target's greedy answers to `prompts`: chat requests (text or messages), or
        token ids continued as they are (generator: the GeneratorConfig, if not the recipe's own).
        When exporting, its prompts are written instead and None comes back."""
        generator = generator or self.generator
        if self.export_to is not None:
            if not self._done(folder):
                self._export(self._prompt_ids(prompts, folder, what, generator), folder, what, generator)
            return None
        if self.answered_only and is_writer():
            self._drop_if_more_answers(prompts, folder, what, generator)
        return self._open(folder, lambda: self._build_continuations(prompts, folder, what, generator),
                          f"{what} data")

    def _export(self, ids: list, folder: Path, what: str, generator) -> None:
        from specjax.train.answers import export_set

        path = export_set(self.export_to, folder.name, ids, generator, self.model.eos_token_ids, self.model.name,
                          self.recipe.dtype)
        _log(f"{what}: {len(ids)} prompts written to {path}")

    def text_continuations(self, docs: list, count: int, name: str, seed: int):
        """The target's greedy continuations of `count` windows of the documents' text (seed -1: a
        draw that no recipe seed changes, for a held-out set)."""
        recipe = self.recipe
        rng = np.random.default_rng([45] if seed < 0 else [seed, 45])
        windows = text_windows(self.tok, docs, count, recipe.text_prompt_tokens, rng)
        generator = dataclasses.replace(self.generator, max_prompt_tokens=recipe.text_prompt_tokens,
                                        max_new_tokens=recipe.seq_len - recipe.text_prompt_tokens)
        return self.continuations(windows, self.out_dir / name, f"{name.replace('_', ' ')} windows", generator)

    @staticmethod
    def _answers_path(folder: Path) -> Path:
        return folder.with_name(folder.name + ".continuations.jsonl")  # beside the set: survives a failed features pass

    def _merge_answers_from(self, ids: list, folder: Path, what: str) -> None:
        from specjax.train.answers import answers_file_in, merge_answers

        made_elsewhere = answers_file_in(self.answers_from, folder.name) if self.answers_from else None
        if made_elsewhere is not None:
            added = merge_answers(made_elsewhere, self._answers_path(folder), ids)
            if added:
                _log(f"{what}: {added} answers added from {made_elsewhere}")

    def _drop_if_more_answers(self, prompts: list, folder: Path, what: str, generator) -> None:
        """answered_only: a set built from fewer answers than there are now is built again."""
        from specjax.train.selfdistill import read_continuations

        self._merge_answers_from(self._prompt_ids(prompts, folder, what, generator), folder, what)
        used = folder / "answers_used.json"
        if self._done(folder) and used.exists():
            have = len(read_continuations(self._answers_path(folder)))
            if json.loads(used.read_text()) < have:
                _log(f"{what}: built from {json.loads(used.read_text())} answers, {have} now; building it again")
                shutil.rmtree(folder)

    def _prompt_ids(self, prompts: list, folder: Path, what: str, generator) -> list[list[int]]:
        """The token ids the generator answers for `prompts`, in order (the answers' indices)."""
        if folder in self._ids:
            return self._ids[folder]
        tok = self.tok
        # A prompt is a chat request (text or messages) or token ids; a conversation that does not fit
        # loses its earliest turns (a text prompt that does not fit is skipped by the generator, which
        # counts it).
        ids = [tok.encode_chat(p) if isinstance(p, str) else
               p if all(isinstance(t, int) for t in p) else fit_chat_prompt(tok, p, generator.max_prompt_tokens)
               for p in prompts]
        ids = [i for i in ids if i is not None]
        if self.answered_before and not folder.name.startswith("heldout"):
            fresh = [i for i in ids if tuple(i) not in self.answered_before]
            if len(fresh) < len(ids):
                _log(f"{what}: {len(ids) - len(fresh)} of {len(ids)} prompts were answered in an earlier run "
                     f"({', '.join(self.recipe.avoid_prompts_from)}); left out")
            ids = fresh
        self._ids[folder] = ids
        return ids

    def _build_continuations(self, prompts: list, folder: Path, what: str, generator) -> None:
        from specjax.train.selfdistill import generate_continuations, read_continuations

        ids = self._prompt_ids(prompts, folder, what, generator)
        path = self._answers_path(folder)
        if not self.answered_only:  # answered_only merged them already (_drop_if_more_answers)
            self._merge_answers_from(ids, folder, what)
        answered = len(read_continuations(path))
        if self.answered_only:
            _log(f"{what}: built from the {answered} of {len(ids)} prompts answered so far (answered only)")
        else:
            _log(f"{what}: greedy continuations of {len(ids) - answered} prompts"
                 + (f" ({answered} of {len(ids)} answered before)" if answered else "")
                 + f" ({generator.batch_size} rows, refilled as they finish)")
            report = generate_continuations(self.model.params, self.model.config, ids, path, generator,
                                            self.model.eos_token_ids)
            if report.sequences:
                _log(f"{what}: {report.new_tokens:,} new tokens at {report.tokens_per_s:.0f} tokens/s"
                     + (f"; {report.skipped_long_prompts} prompts too long, skipped"
                        if report.skipped_long_prompts else ""))
        found = read_continuations(path)
        if not found:
            raise SpecjaxError(f"{what}: no answers to build from (answer the exported prompts first)"
                               if self.answered_only else
                               f"{what}: none of the {len(ids)} prompts fits in {generator.max_prompt_tokens} tokens "
                               f"(half of the sequence length {self.recipe.seq_len}); raise --seq-len")
        self._set(folder, [(found[i][0] + found[i][1], len(found[i][0])) for i in sorted(found)], teacher_labels=False)
        if self.answered_only:
            (folder / "answers_used.json").write_text(json.dumps(len(found)))

    def self_instruct(self):
        """Requests the target writes itself from instructions, then answers."""
        from specjax.train.selfdistill import self_instruct_prompts

        recipe, written = self.recipe, self.out_dir / "self_instruct.prompts.json"

        def write_requests() -> None:
            _log(f"self-instruct: the target writes requests for {recipe.self_instruct_prompts} instructions")
            writer = dataclasses.replace(self.generator, max_new_tokens=48, max_prompt_tokens=128)
            requests = self_instruct_prompts(self.model.params, self.model.config, self.tok,
                                             recipe.self_instruct_prompts, self.out_dir / "self_instruct.requests.jsonl",
                                             writer, self.model.eos_token_ids, recipe.seed)
            _log(f"self-instruct: {len(requests)} distinct requests kept")
            written.write_text(json.dumps(requests, indent=0))

        built_once(written.exists, write_requests, f"self-instruct requests in {written}")
        return self.continuations(json.loads(written.read_text()), self.out_dir / "self_instruct", "self-instruct")

    def sharegpt_replies(self, replied: list):
        """ShareGPT's recorded replies teacher-forced through the target (its argmax as labels)."""
        folder, tok = self.out_dir / "sharegpt_replies", self.tok

        def build() -> None:
            rows = []
            for r in replied:
                prompt = fit_chat_prompt(tok, r.messages, self.recipe.seq_len // 2)
                if prompt is not None:
                    reply = tok.encode(r.reply, add_special_tokens=False) + list(self.model.eos_token_ids[:1])
                    rows.append((prompt + reply, len(prompt)))
            _log(f"ShareGPT replies: {len(rows)} of {len(replied)} requests fit; teacher-forcing their replies")
            self._set(folder, rows, teacher_labels=True)

        return self._open(folder, build, "ShareGPT reply data")

    def heldout_set(self):
        """The target's answers to the held-out requests the in-training tau estimate replays."""
        from specjax.data.prompts import HELDOUT_CHAT_PROMPTS, heldout_prompts

        if self.recipe.heldout_sharegpt:
            from specjax.data.sharegpt import sharegpt_requests

            held = sharegpt_requests("heldout", "first")[: self.recipe.heldout_sharegpt]
            return self.continuations([list(r.messages) for r in held], self.out_dir / "heldout_sharegpt",
                                      "held-out ShareGPT")
        # The demo prompts and the held-out set's chat prompts: 42 answers, so that no single answer
        # dominates the acceptance estimate; answers stuck in a loop are left out of it.
        return self.continuations(list(HELDOUT_CHAT_PROMPTS) + heldout_prompts("chat"),
                                  self.out_dir / "heldout_chat", "held-out chat")

    def corpus(self, train_docs: list):
        """Teacher-forced windows of the training corpora."""
        recipe, folder = self.recipe, self.out_dir / "corpus"

        def build() -> None:
            rng = np.random.default_rng(recipe.seed)
            windows = []
            stream_docs = [d for d in train_docs if len(d.text) > 4 * recipe.seq_len * 4]
            for _ in range(recipe.corpus_sequences):
                doc = stream_docs[rng.integers(len(stream_docs))]
                start = int(rng.integers(0, len(doc.text) - 4 * recipe.seq_len * 4))
                ids = self.tok.encode(doc.text[start : start + 6 * recipe.seq_len], add_special_tokens=False)
                windows.append((ids[: recipe.seq_len], 1))
            self._set(folder, windows, teacher_labels=True)

        return self._open(folder, build, "corpus data")


def check_answer_options(export_prompts, answers_from, answered_only: bool) -> None:
    """Refuse train_drafter_recipe's answer options in combinations that cannot work, before any work."""
    if export_prompts is not None and (answers_from or answered_only):
        raise SpecjaxError("--export-prompts writes the prompts to answer; --answers-from and --answered-only "
                           "belong to the run after they are answered")
    if answers_from is not None and not Path(answers_from).is_dir():
        raise SpecjaxError(f"--answers-from {answers_from}: no such folder")


def train_drafter_recipe(model_name: str, out_dir: str | Path, recipe: DistillRecipe = DistillRecipe(),
                         data_only: bool = False, export_prompts: str | Path | None = None,
                         answers_from: str | Path | None = None, answered_only: bool = False) -> dict:
    """Distil, then train a drafter; a rerun resumes. export_prompts: only write the prompts the target
    has to answer there, to be answered elsewhere (`answer-prompts`); answers_from: the answers that
    came back, used before the target answers what is left (train/answers.py); answered_only: train on
    the answers there are, answering nothing more."""
    import jax

    from specjax.io.dflash import save_drafter
    from specjax.io.registry import load_model, resolve_drafter
    from specjax.models.drafter import DrafterConfig, init_drafter_params
    from specjax.train.drafter import (DrafterTrainConfig, choose_draft_vocab, init_from_drafter, init_from_target_layers,
                                       train_drafter)
    from specjax.train.loop import LoopConfig, OptimizerConfig, read_metrics

    check_answer_options(export_prompts, answers_from, answered_only)
    out_dir = Path(out_dir)
    model = load_model(model_name, recipe.dtype)
    config = DrafterConfig.for_target(model.config, num_layers=recipe.num_layers, block_size=recipe.block_size,
                                      num_taps=recipe.num_taps, anchor_path=recipe.anchor_path)
    write_recipe(out_dir, recipe)
    if export_prompts is not None:
        build_data(model, recipe, out_dir / "data", config.target_layer_ids, export_to=Path(export_prompts))
        exported = sorted(p.name for p in Path(export_prompts).glob("*.prompts.npz"))
        return {"exported": exported, "folder": str(export_prompts)}
    sets, heldout = build_data(model, recipe, out_dir / "data", config.target_layer_ids,
                               answers_from=Path(answers_from) if answers_from else None, answered_only=answered_only)
    if data_only:
        return {"train_tokens": sum(s.num_tokens for s in sets), "heldout_tokens": heldout.num_tokens}
    _log(f"training on {sum(s.num_tokens for s in sets):,} labelled tokens "
         f"({', '.join(f'{s.num_sequences} seqs' for s in sets)}); held out {heldout.num_tokens:,}")
    draft_vocab = None
    if recipe.draft_vocab_size and recipe.draft_vocab_size < model.config.vocab_size:
        draft_vocab = choose_draft_vocab(sets, recipe.draft_vocab_size, always=model.eos_token_ids)
        coverage = _coverage(heldout, draft_vocab)
        _log(f"draft vocabulary: {len(draft_vocab)} tokens, covering {coverage:.1%} of held-out labels")
    params = init_drafter_params(config, jax.random.key(recipe.seed))
    if recipe.init_from_target:
        top = list(range(model.config.num_layers - recipe.num_layers, model.config.num_layers))
        params = init_from_target_layers(params, model.params, top)
    if recipe.init_drafter:  # its layers replace the first ones; any further layers grow from the above
        start = resolve_drafter(recipe.init_drafter, model_name)
        params = init_from_drafter(params, config, start)
        _log(f"starting from the drafter in {start.source}"
             + (f", grown from {start.config.num_layers} to {config.num_layers} layers"
                if start.config.num_layers < config.num_layers else ""))
    params = train_drafter(
        model.params, model.config, config, sets, out_dir / "run",
        OptimizerConfig(learning_rate=recipe.learning_rate, warmup_steps=min(200, recipe.steps // 10),
                        total_steps=recipe.steps),
        LoopConfig(steps=recipe.steps, seed=recipe.seed, mesh=recipe.mesh, eval_every=max(recipe.steps // 10, 1),
                   checkpoint_every=max(recipe.steps // 10, 1)),
        DrafterTrainConfig(sequences_per_batch=recipe.sequences_per_batch,
                           anchors_per_sequence=recipe.anchors_per_sequence, topk_weight=recipe.topk_weight),
        heldout=heldout,
        init_params=params,
        draft_vocab=draft_vocab,
    )
    if is_writer():
        save_drafter(out_dir / "drafter", config, params, model.config, dtype="bfloat16", draft_vocab=draft_vocab)
    evals = [m for m in read_metrics(out_dir / "run") if "eval/tau_estimate" in m]
    return {"drafter": str(out_dir / "drafter"), "run": str(out_dir / "run"),
            "tau_estimate": evals[-1]["eval/tau_estimate"] if evals else None,
            "train_tokens": sum(s.num_tokens for s in sets), "train_sequences": sum(s.num_sequences for s in sets),
            "heldout_tokens": heldout.num_tokens}
