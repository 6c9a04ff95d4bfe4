"""Training: loss goes down, a killed-and-resumed run replays the same losses, metrics are written."""

from __future__ import annotations

import random

import numpy as np
import pytest

from specjax.decode.engine import Engine
from specjax.io.registry import load_model
from specjax.train.lm import LMDataConfig, sample_windows, train_bpe_tokenizer, train_language_model
from specjax.train.loop import LoopConfig, OptimizerConfig, make_schedule, read_metrics
from specjax.errors import SpecjaxError


def _texts(n_docs=6, words=300, seed=0):
    rng = random.Random(seed)
    vocab = "the cat sat on a mat and the dog ran to the park with a big red ball".split()
    return [" ".join(rng.choice(vocab) for _ in range(words)) + "." for _ in range(n_docs)]


DATA = LMDataConfig(vocab_size=300, seq_len=32, batch_size=4, eval_batches=2)
OPT = OptimizerConfig(learning_rate=3e-3, warmup_steps=2, total_steps=10)


def _run(out, steps):
    texts = _texts()
    return train_language_model(texts[:5], texts[5:], out, DATA, OPT,
                                LoopConfig(steps=steps, log_every=1, eval_every=5, checkpoint_every=5, progress=False))


def test_resumed_run_replays_the_same_losses(tmp_path):
    _run(tmp_path / "straight", 10)
    _run(tmp_path / "resumed", 5)  # "killed" after the step-5 checkpoint
    summary = _run(tmp_path / "resumed", 10)
    straight = [m for m in read_metrics(tmp_path / "straight") if "loss" in m]
    resumed = [m for m in read_metrics(tmp_path / "resumed") if "loss" in m]
    assert [m["step"] for m in resumed] == list(range(1, 11))  # each step logged once
    assert [m["step"] for m in read_metrics(tmp_path / "resumed") if "eval/heldout_loss" in m] == [0, 5, 10]
    assert [m["loss"] for m in resumed] == [m["loss"] for m in straight]  # bit-identical
    losses = [m["loss"] for m in straight]
    assert losses[-1] < losses[0] - 0.5
    evals = [m for m in read_metrics(tmp_path / "straight") if "eval/heldout_loss" in m]
    assert [m["step"] for m in evals] == [0, 5, 10]  # from the untrained start on
    assert summary["heldout_perplexity"] < 300  # better than uniform over the vocabulary
    assert list((tmp_path / "straight" / "tensorboard").glob("events.out.tfevents.*"))


def test_a_slow_run_also_checkpoints_by_the_clock(tmp_path):
    """Between step checkpoints a run saves once checkpoint_seconds have passed, so a slow run killed
    at any moment loses at most that much; by steps alone it saves at the step multiples."""
    import jax.numpy as jnp

    from specjax.train.loop import train

    def saved(seconds: float) -> list[int]:
        out = tmp_path / str(seconds)
        train(lambda p, batch, rng: (jnp.sum((p["w"] - batch) ** 2), {}), {"w": jnp.zeros(3)},
              lambda step: jnp.full(3, float(step)), out, OPT,
              LoopConfig(steps=6, checkpoint_every=4, checkpoint_seconds=seconds, keep_checkpoints=10, progress=False))
        return sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())

    assert saved(3600.0) == [4, 6]
    assert saved(1e-9) == [1, 2, 3, 4, 5, 6]


def test_trained_model_loads_and_generates(tmp_path):
    """The HF folder written at the end holds the trained weights, not the initial ones."""
    import jax
    import jax.numpy as jnp

    from specjax.models.transformer import init_params
    from specjax.train.lm import next_token_loss, token_stream

    _run(tmp_path / "run", 10)
    model = load_model(str(tmp_path / "run" / "model"))
    assert model.tokenizer is not None and model.eos_token_ids == (0,)
    batch = jnp.asarray(sample_windows(token_stream(model.tokenizer, _texts()[:5]), 0, 0, 4, 32))
    trained = float(next_token_loss(model.params, model.config, batch))
    untrained = float(next_token_loss(init_params(model.config, jax.random.key(0)), model.config, batch))
    assert trained < untrained - 0.5
    out = Engine(model).generate([model.tokenizer.encode("the cat")], max_new_tokens=8, ignore_eos=True)
    assert len(out.tokens[0]) == 8


def test_schedule_warms_up_then_decays():
    schedule = make_schedule(OptimizerConfig(learning_rate=1.0, warmup_steps=10, total_steps=100, min_lr_ratio=0.1))
    assert float(schedule(0)) == 0.0
    assert float(schedule(10)) == pytest.approx(1.0)
    assert float(schedule(100)) == pytest.approx(0.1)
    assert float(schedule(50)) < 1.0


def test_batches_are_a_pure_function_of_seed_and_step():
    stream = np.arange(1000, dtype=np.int32)
    a = sample_windows(stream, 0, 7, 4, 16)
    assert a.shape == (4, 17)
    np.testing.assert_array_equal(a, sample_windows(stream, 0, 7, 4, 16))
    assert not np.array_equal(a, sample_windows(stream, 0, 8, 4, 16))
    np.testing.assert_array_equal(a[:, 1:] - a[:, :-1], 1)  # contiguous windows


def test_bpe_tokenizer_round_trips_text():
    tok = train_bpe_tokenizer(_texts(), 280)
    text = "the dog sat on the big mat."
    assert tok.decode(tok.encode(text)) == text
    with pytest.raises(SpecjaxError, match="vocab_size"):
        train_bpe_tokenizer(_texts(), 100)


def test_held_out_answers_stuck_in_a_loop_are_left_out_of_the_estimate():
    from specjax.data.repetition import distinct_n, is_looping
    from specjax.train.drafter import DistillationSet, without_looping

    rng = np.random.default_rng(0)
    fresh = rng.permutation(200)[:40].tolist()
    loop = [5, 6, 7, 8] * 10
    assert distinct_n(fresh, 3) == 1.0 and distinct_n(loop, 3) < 0.2 and distinct_n([1, 2], 3) is None
    assert is_looping(loop) and not is_looping(fresh) and not is_looping([1, 2])
    rows = [[9] * 8 + fresh, [9] * 8 + loop, [9] * 8 + fresh[::-1]]
    tokens = np.asarray(rows, np.int32)
    valid = np.zeros_like(tokens, bool)
    valid[:, 8:] = True  # the prompt (8 tokens of 9) is not labelled, so it cannot make a row look looping
    data = DistillationSet(tokens=tokens, labels=tokens, valid=valid,
                           features=np.arange(3, dtype=np.float16)[:, None, None, None] * np.ones((3, 48, 1, 2), np.float16),
                           target_layer_ids=(1,))
    kept, dropped = without_looping(data)
    assert dropped == 1 and kept.num_sequences == 2
    np.testing.assert_array_equal(kept.tokens, tokens[[0, 2]])
    np.testing.assert_array_equal(kept.features[:, 0, 0, 0], [0, 2])  # every array keeps the same rows
    all_looping = DistillationSet(tokens=tokens[[1]], labels=tokens[[1]], valid=valid[[1]],
                                  features=data.features[[1]], target_layer_ids=(1,))
    assert without_looping(all_looping) == (all_looping, 0)


def test_chain_walk_follows_the_anchors_decoding_visits():
    from specjax.train.drafter import chain_walk, chain_walk_tau

    runs = np.full((2, 12), -1, np.int32)
    runs[0, 2:11] = [3, 0, 0, 0, 0, 1, 0, 0, 0]  # a long run at the first anchor, then short ones
    runs[1, 4:11] = [0, 0, 0, 0, 0, 0, 0]
    valid = np.zeros((2, 12), bool)
    valid[0, 2:] = valid[1, 4:] = True
    # Row 0: anchor 2 accepts 3 (tokens 3..6), anchor 6 accepts 0, 7 accepts 1, 9 accepts 0, then 10.
    assert chain_walk(runs, valid) == [[3, 0, 1, 0, 0], [0, 0, 0, 0, 0, 0, 0]]
    # Five tokens: the prefill's, then 4 (row 0), or 1 four times (row 1).
    assert chain_walk(runs, valid, max_new_tokens=5) == [[3], [0, 0, 0, 0]]
    assert chain_walk_tau(runs[:1], valid[:1]) == (4 + 1 + 2 + 1 + 1) / 5
    # Averaging over every position would count the easy start once per position it covers.
    assert np.mean(runs[0, 2:11] + 1) != chain_walk_tau(runs[:1], valid[:1])


def test_chain_walk_on_greedy_answers_is_what_chain_decoding_measures(target, drafter, tmp_path):
    """Teacher forcing walked like decoding gives decoding's own accepted-length histogram."""
    from specjax.train.drafter import accepted_runs, build_distillation_set, chain_walk

    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, target.config.vocab_size, size=rng.integers(2, 6)).tolist() for _ in range(6)]
    engine = Engine(target, drafter, latency_cache=False)
    answers = engine.generate(prompts, 40, ignore_eos=True).tokens
    data = build_distillation_set(target.params, target.config, [(p + a, len(p)) for p, a in zip(prompts, answers)],
                                  tmp_path / "greedy", drafter.config.target_layer_ids, seq_len=48,
                                  teacher_labels=False, progress=False)
    runs = accepted_runs(drafter.params, drafter.config, target.params, target.config, data, anchors_per_call=16)
    walks = chain_walk(runs, np.asarray(data.valid), max_new_tokens=24)
    stats = engine.generate(prompts, 24, ignore_eos=True, method="chain").stats
    expected = np.bincount([n for walk in walks for n in walk], minlength=drafter.config.block_size)
    assert stats["accepted_length_histogram"] == expected.tolist()
    assert sum(len(w) for w in walks) > len(prompts)  # the drafter accepts something, so walks are not trivial


def test_distillation_sets_store_the_targets_top_k_next_token_distribution(target, tmp_path):
    """The stored top-k at position t is the target's distribution of token t (from the logits at t - 1,
    as the teacher labels are): its first entry is the label, log-probabilities fall and sum below 0."""
    from conftest import tiny_distillation_set
    from specjax.train.drafter import DistillationSet, build_distillation_set

    plain = tiny_distillation_set(target, tmp_path / "plain", 0, n=4)
    assert plain.topk_ids is None and plain.topk_logprobs is None
    data = build_distillation_set(target.params, target.config, [(np.asarray(plain.tokens[r]).tolist(), 1)
                                                                  for r in range(4)],
                                  tmp_path / "topk", plain.target_layer_ids, seq_len=48, teacher_labels=True,
                                  progress=False, topk=5)
    data = DistillationSet.open(tmp_path / "topk")  # reopened from disk
    valid = np.asarray(data.valid)
    ids, logprobs = np.asarray(data.topk_ids)[valid], np.asarray(data.topk_logprobs, np.float32)[valid]
    assert ids.shape[1] == 5 and (ids[:, 0] == np.asarray(data.labels)[valid]).all()
    assert (np.diff(logprobs, axis=1) <= 0).all() and (logprobs <= 0).all()
    assert (np.exp(logprobs).sum(axis=1) <= 1.001).all()
    assert all(len(set(row)) == 5 for row in ids.tolist())


@pytest.mark.parametrize("teacher_labels", [True, False])
def test_a_features_pass_at_each_batchs_own_width_stores_what_the_full_width_pass_did(target, tmp_path,
                                                                                        teacher_labels):
    """Sequences of mixed lengths, run in length order at their batch's width (rounded up to 8),
    are stored in their own order with the labels, top-k and validity of one pass at the full
    sequence length, and features equal to rounding."""
    from specjax.models.drafter import DrafterConfig
    from specjax.train.drafter import build_distillation_set

    rng = np.random.default_rng(5)
    sequences = [(rng.integers(0, target.config.vocab_size, size=int(rng.integers(4, 40))).tolist(),
                  int(rng.integers(0, 3))) for _ in range(11)]
    taps = DrafterConfig.for_target(target.config, num_taps=2).target_layer_ids
    built = {bucket: build_distillation_set(target.params, target.config, sequences, tmp_path / str(bucket), taps,
                                            seq_len=48, teacher_labels=teacher_labels, batch_size=3, progress=False,
                                            topk=3, width_bucket=bucket) for bucket in (8, 48)}
    narrow, full = built[8], built[48]
    valid = np.asarray(full.valid).astype(bool)
    for name in ("tokens", "valid"):
        np.testing.assert_array_equal(np.asarray(getattr(narrow, name)), np.asarray(getattr(full, name)), name)
    for name in ("labels", "topk_ids"):
        np.testing.assert_array_equal(np.asarray(getattr(narrow, name))[valid], np.asarray(getattr(full, name))[valid])
    np.testing.assert_allclose(np.asarray(narrow.features, np.float32)[valid], np.asarray(full.features, np.float32)[valid],
                               rtol=2e-3, atol=2e-3)
    assert [len(ids) for ids, _ in sequences] != sorted(len(ids) for ids, _ in sequences)  # rows were reordered


def test_a_killed_features_pass_resumes_where_it_stopped(target, tmp_path, monkeypatch):
    """A features pass that dies after some batches is taken up again by the same call: only the
    remaining batches run, and the set equals one built in a single pass."""
    import specjax.train.drafter as drafter_module
    from specjax.models.drafter import DrafterConfig

    rng = np.random.default_rng(3)
    sequences = [(rng.integers(0, target.config.vocab_size, size=int(rng.integers(4, 40))).tolist(), 1)
                 for _ in range(10)]
    taps = DrafterConfig.for_target(target.config, num_taps=2).target_layer_ids
    build = lambda folder: drafter_module.build_distillation_set(  # noqa: E731
        target.params, target.config, sequences, tmp_path / folder, taps, seq_len=48, teacher_labels=True,
        batch_size=2, progress=False, topk=2, save_every_s=0.0)
    whole = build("whole")
    real, calls = drafter_module._features_pass, []

    def dies_after_three(*args, **kwargs):
        if len(calls) == 3:
            raise KeyboardInterrupt
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(drafter_module, "_features_pass", dies_after_three)
    with pytest.raises(KeyboardInterrupt):
        build("killed")
    assert not (tmp_path / "killed" / "meta.json").exists()
    calls.clear()
    monkeypatch.setattr(drafter_module, "_features_pass", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    resumed = build("killed")
    assert len(calls) == 5 - 3 and not (tmp_path / "killed" / "progress.json").exists()
    for name in ("tokens", "labels", "valid", "features", "topk_ids", "topk_logprobs"):
        np.testing.assert_array_equal(np.asarray(getattr(resumed, name)), np.asarray(getattr(whole, name)), name)


@pytest.mark.parametrize("teacher_labels", [True, False])
def test_online_features_recompute_what_a_stored_set_holds(target, drafter, tmp_path, teacher_labels):
    """An online set keeps token ids only; the training step's target pass gives its batches the
    stored set's features (to float16 rounding) and labels, so both train alike; sets of the two
    kinds are not mixed."""
    from specjax.models.drafter import DrafterConfig
    from specjax.train.drafter import (DistillationSet, DrafterTrainConfig, build_distillation_set, drafter_loss,
                                       sample_drafter_batch, with_target_features)

    rng = np.random.default_rng(7)
    sequences = [(rng.integers(0, target.config.vocab_size, size=int(rng.integers(8, 40))).tolist(),
                  int(rng.integers(0, 3))) for _ in range(6)]
    taps = DrafterConfig.for_target(target.config, num_taps=2).target_layer_ids
    build = lambda folder, stored: build_distillation_set(  # noqa: E731
        target.params, target.config, sequences, tmp_path / folder, taps, seq_len=48, teacher_labels=teacher_labels,
        batch_size=3, progress=False, store_features=stored)
    stored, online = build("stored", True), build("online", False)
    online = DistillationSet.open(tmp_path / "online")  # reopened from disk
    assert online.online and not stored.online and not (tmp_path / "online" / "features.f16").exists()
    cfg = DrafterTrainConfig(sequences_per_batch=3, anchors_per_sequence=8)
    for step in range(3):
        want = sample_drafter_batch(stored, step, 0, cfg, drafter.config.block_size)
        got = sample_drafter_batch(online, step, 0, cfg, drafter.config.block_size)
        assert "features" not in got and got["teacher"].tolist() == [teacher_labels] * 3
        got = with_target_features(got, target.params, target.config, taps)
        valid = want["valid"].astype(bool)
        np.testing.assert_array_equal(np.asarray(got["labels"])[valid], want["labels"][valid])
        np.testing.assert_allclose(np.asarray(got["features"], np.float32)[valid],
                                   np.asarray(want["features"], np.float32)[valid], rtol=2e-3, atol=2e-3)
        loss = lambda b: float(drafter_loss(drafter.params, b, drafter_config=drafter.config,  # noqa: E731
                                            target_params=target.params, target_config=target.config, gamma=7.0)[0])
        assert np.isclose(loss(got), loss(want), rtol=1e-3)
    with pytest.raises(SpecjaxError, match="mix stored and online"):
        sample_drafter_batch([stored, online], 0, 0, cfg, drafter.config.block_size)
    with pytest.raises(SpecjaxError, match="no top-k"):
        build_distillation_set(target.params, target.config, sequences, tmp_path / "k", taps, seq_len=48,
                               teacher_labels=True, progress=False, topk=3, store_features=False)


def test_the_top_k_loss_is_cross_entropy_against_the_targets_distribution(target, drafter, tmp_path):
    """With all of the target's mass on its argmax the top-k loss is the argmax loss; mass moved to
    its second choice changes the loss, and sets without the top-k are refused by name."""
    from conftest import tiny_distillation_set
    from specjax.train.drafter import DrafterTrainConfig, drafter_loss, sample_drafter_batch

    data = tiny_distillation_set(target, tmp_path / "d", 3, n=4)
    cfg = DrafterTrainConfig(sequences_per_batch=2, anchors_per_sequence=8)
    batch = sample_drafter_batch(data, 0, 0, cfg, drafter.config.block_size)
    labels = batch["labels"]
    other = (labels + 1) % target.config.vocab_size
    one_hot = np.stack([labels, other], axis=-1), np.stack([np.zeros(labels.shape), np.full(labels.shape, -np.inf)],
                                                              axis=-1).astype(np.float16)
    split = one_hot[0], np.log(np.stack([np.full(labels.shape, 0.5)] * 2, axis=-1)).astype(np.float16)
    loss = lambda b, w: float(drafter_loss(drafter.params, b, drafter_config=drafter.config,  # noqa: E731
                                           target_params=target.params, target_config=target.config, gamma=7.0,
                                           topk_weight=w)[0])
    argmax_loss = loss(batch, 0.0)
    with_one_hot = dict(batch, topk_ids=one_hot[0], topk_logprobs=one_hot[1])
    assert np.isclose(loss(with_one_hot, 1.0), argmax_loss, rtol=1e-5)
    assert not np.isclose(loss(dict(batch, topk_ids=split[0], topk_logprobs=split[1]), 1.0), argmax_loss, rtol=1e-3)
    with pytest.raises(SpecjaxError, match="without the target's top-k"):
        sample_drafter_batch(data, 0, 0, DrafterTrainConfig(topk_weight=0.5), drafter.config.block_size)


@pytest.mark.slow  # 12 s; a training lever (--layers with --init-drafter), not the default recipe
def test_a_drafter_grown_by_a_layer_starts_as_the_drafter_it_grew_from(target, drafter):
    """init_from_drafter into a deeper drafter: the new layer's output projections start at zero, so
    the grown drafter's logits are the old one's until training moves them."""
    import dataclasses

    import jax

    from specjax.io.dflash import LoadedDrafter
    from specjax.models.drafter import init_drafter_params
    from specjax.train.drafter import anchor_probe_logits, init_from_drafter

    deeper = dataclasses.replace(drafter.config, num_layers=drafter.config.num_layers + 1)
    random = init_drafter_params(deeper, jax.random.key(3))
    grown = LoadedDrafter("grown", deeper, init_from_drafter(random, deeper, drafter), target.config.num_layers)
    probe = lambda d: np.asarray(anchor_probe_logits(target, d, [5, 9, 2, 7], (1, 3, 11)))  # noqa: E731
    np.testing.assert_allclose(probe(grown), probe(drafter), atol=1e-5)
    assert np.abs(np.asarray(grown.params["layers_1"]["q_proj"]["kernel"])).max() > 0  # the rest is kept
    with pytest.raises(SpecjaxError, match="can grow, not shrink"):
        init_from_drafter(init_drafter_params(drafter.config, jax.random.key(0)), drafter.config, grown)
    ungrown = LoadedDrafter("random", deeper, random, target.config.num_layers)
    assert np.abs(probe(ungrown) - probe(drafter)).max() > 1e-3  # without zeroed projections it differs


def test_bf16_compute_rounds_differently_and_still_learns(tmp_path):
    """train-lm --dtype bfloat16: bf16 inputs to every dot, so the first loss moves, by rounding only,
    and the run still learns; an unknown precision is refused."""
    texts = _texts()
    loop = LoopConfig(steps=10, log_every=1, eval_every=0, checkpoint_every=10, progress=False)
    for dtype in ("float32", "bfloat16"):
        train_language_model(texts[:5], texts[5:], tmp_path / dtype, DATA, OPT, loop, dtype=dtype)
    first = {d: [m["loss"] for m in read_metrics(tmp_path / d) if "loss" in m] for d in ("float32", "bfloat16")}
    assert first["bfloat16"][0] != first["float32"][0]
    np.testing.assert_allclose(first["bfloat16"][0], first["float32"][0], rtol=0.02)
    assert first["bfloat16"][-1] < first["bfloat16"][0] - 0.5
    with pytest.raises(SpecjaxError, match="unknown compute dtype"):
        train_language_model(texts[:5], texts[5:], tmp_path / "bad", DATA, OPT, loop, dtype="float16")
