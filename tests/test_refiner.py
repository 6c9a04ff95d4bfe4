"""The causal refiner: Jacobi refinement reaches the refiner's own left-to-right chain, decoding with
it stays exact (greedy and sampled), training improves it, and checkpoints are checked on load."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.decode import refine as refine_module
from specjax.decode import slots
from specjax.decode.engine import Engine
from specjax.decode.refine import RefineConfig, refine_drafts
from specjax.decode.sampling import SamplingConfig
from specjax.errors import SpecjaxError
from specjax.io.dflash import LoadedDrafter
from specjax.io.refiner import LoadedRefiner, check_refiner, load_refiner, save_refiner
from specjax.models.drafter import DrafterConfig, init_drafter_params
from specjax.models.refiner import (RefinerConfig, draft_confidence, drafter_fingerprint, init_refiner_params,
                                    refiner_corrections, refiner_low_rank_head)
from specjax.models.transformer import embed_tokens, head_matrix
from specjax.train.loop import LoopConfig, OptimizerConfig, read_metrics
from specjax.train.refiner import RefinerTrainConfig, train_refiner

from conftest import SPEC_BLOCK, tiny_distillation_set
from rounding import assert_rounding_close
from stats import chi_square_pvalue
from test_decode import TINY
from test_speculative import PROMPTS, SAMPLINGS, _exact_marginals

KINDS = ["transformer", "gru"]


def _config(kind: str) -> RefinerConfig:
    return RefinerConfig(hidden_size=TINY.hidden_size, block_size=SPEC_BLOCK, kind=kind, width=16, rank=8,
                         num_heads=2, mlp_size=32)


def _perturbed(kind: str, drafter, scale: float = 3.0, seed: int = 0) -> LoadedRefiner:
    """A random refiner whose corrections are large enough to change drafts (a fresh one is the
    identity, since its last projection starts at zero)."""
    config = _config(kind)
    params = init_refiner_params(config, jax.random.key(seed))
    kernel = params["correction"]["kernel"]
    params["correction"]["kernel"] = scale * jax.random.normal(jax.random.key(seed + 1), kernel.shape)
    return LoadedRefiner("perturbed", config, params, drafter_fingerprint(drafter.params, drafter.draft_vocab))


@pytest.mark.parametrize("kind", KINDS)
def test_corrections_are_causal_over_slots(kind):
    """Changing the token left of slot k changes corrections at slots >= k only."""
    config = _config(kind)
    params = init_refiner_params(config, jax.random.key(0))
    params["correction"]["kernel"] = jax.random.normal(jax.random.key(1), params["correction"]["kernel"].shape)
    hidden = jax.random.normal(jax.random.key(2), (1, 3, TINY.hidden_size))
    left = jax.random.normal(jax.random.key(3), (1, 3, TINY.hidden_size))
    low_rank = refiner_low_rank_head(params, config, jax.random.normal(jax.random.key(4), (TINY.hidden_size, 12)))
    confidence = jax.random.normal(jax.random.key(5), (1, 3, 2))
    base = refiner_corrections(params, config, hidden, left, confidence, low_rank)
    changed = refiner_corrections(params, config, hidden, left.at[:, 1].add(1.0), confidence, low_rank)
    differs = np.abs(np.asarray(changed - base)).max(axis=-1)[0]  # per slot
    assert differs[0] == 0 and differs[1] > 1e-4 and differs[2] > 1e-4


@pytest.mark.parametrize("kind", KINDS)
def test_jacobi_refinement_reaches_the_left_to_right_chain(kind, target, drafter):
    refiner = _perturbed(kind, drafter)
    batch, num_draft, vocab = 5, SPEC_BLOCK - 1, TINY.vocab_size
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.normal(size=(batch, num_draft, TINY.hidden_size)), jnp.float32)
    logits = jnp.asarray(rng.normal(size=(batch, num_draft, vocab)), jnp.float32)
    anchor = jnp.asarray(rng.integers(0, vocab, batch), jnp.int32)
    embed = lambda i: embed_tokens(target.params, TINY, i)
    head = head_matrix(target.params, TINY)
    low_rank = refiner_low_rank_head(refiner.params, refiner.config, head)
    run = lambda cfg, sampling=SamplingConfig(), key=0: refine_drafts(
        refiner.params, refiner.config, cfg, hidden, logits, embed(anchor[:, None])[:, 0],
        jnp.argmax(logits, -1).astype(jnp.int32), embed, low_rank, sampling, jax.random.key(key))

    # Left to right, one slot at a time: what the fixed point must be.
    chain = np.zeros((batch, num_draft), np.int32)
    for k in range(num_draft):
        left = np.concatenate([np.asarray(anchor)[:, None], chain[:, :-1]], axis=1)
        corr = refiner_corrections(refiner.params, refiner.config, hidden, embed(jnp.asarray(left)),
                                   draft_confidence(logits), low_rank)
        chain[:, k] = np.asarray(jnp.argmax(logits + corr, -1))[:, k]

    draft, _, passes = run(RefineConfig(max_passes=num_draft + 1, adaptive=True))
    assert np.array_equal(np.asarray(draft), chain)
    assert 1 <= int(passes) <= num_draft + 1
    full, _, full_passes = run(RefineConfig(max_passes=num_draft + 1, adaptive=False))
    assert np.array_equal(np.asarray(full), chain) and int(full_passes) == num_draft + 1
    # After one pass, slot 1 already agrees with the chain.
    one, _, _ = run(RefineConfig(max_passes=1))
    assert np.array_equal(np.asarray(one)[:, 0], chain[:, 0])
    # Slots where the drafter is confident enough keep its logits exactly; the others are refined.
    _, kept_logits, _ = run(RefineConfig(max_passes=2, keep_confident=0.3))
    confident = np.asarray(jax.nn.softmax(logits).max(-1)) >= 0.3
    assert confident.any() and (~confident).any()
    np.testing.assert_array_equal(np.asarray(kept_logits)[confident], np.asarray(logits)[confident])
    assert np.abs(np.asarray(kept_logits)[~confident] - np.asarray(logits)[~confident]).max() > 1e-3
    # Refining the first two slots only: they get exactly a whole pass's logits (the mixer is
    # causal), the later slots keep the drafter's logits and greedy draft.
    _, whole_logits, _ = run(RefineConfig(max_passes=1, adaptive=False))
    first_two, first_two_logits, _ = run(RefineConfig(max_passes=1, adaptive=False, slots=2))
    assert_rounding_close(np.asarray(first_two_logits)[:, :2], np.asarray(whole_logits)[:, :2])
    assert np.abs(np.asarray(whole_logits)[:, 2:] - np.asarray(logits)[:, 2:]).max() > 1e-3
    np.testing.assert_array_equal(np.asarray(first_two_logits)[:, 2:], np.asarray(logits)[:, 2:])
    assert np.array_equal(np.asarray(first_two)[:, 2:], np.asarray(jnp.argmax(logits, -1))[:, 2:])
    unrefined, unrefined_logits, none = run(RefineConfig(max_passes=0))
    assert int(none) == 0 and np.array_equal(np.asarray(unrefined_logits), np.asarray(logits))
    # Sampling: adaptive stopping returns exactly what running every pass returns.
    sampling = SamplingConfig(temperature=1.0)
    a = run(RefineConfig(max_passes=num_draft + 1, adaptive=True), sampling, key=7)
    b = run(RefineConfig(max_passes=num_draft + 1, adaptive=False), sampling, key=7)
    assert np.array_equal(np.asarray(a[0]), np.asarray(b[0]))
    np.testing.assert_allclose(np.asarray(a[1]), np.asarray(b[1]), rtol=0, atol=0)


@pytest.mark.slow  # suite time budget; greedy refiner exactness stays in the default suite
def test_an_untrained_refiner_changes_nothing(target, drafter):
    config = _config("transformer")
    fresh = LoadedRefiner("fresh", config, init_refiner_params(config, jax.random.key(0)),
                          drafter_fingerprint(drafter.params))
    engine = Engine(target, drafter, refiner=fresh)
    chain = engine.generate(PROMPTS, 20, ignore_eos=True, method="chain")
    refined = engine.generate(PROMPTS, 20, ignore_eos=True, method="chain+refiner")
    assert refined.tokens == chain.tokens
    assert refined.stats["per_position_acceptance"] == chain.stats["per_position_acceptance"]
    assert refined.stats["refine_passes"] == 1.0  # one pass, which changed nothing


_REFINES = [RefineConfig(1), RefineConfig(3), RefineConfig(2, adaptive=False), RefineConfig(2, keep_confident=0.5),
            RefineConfig(2, slots=2)]


# Every refinement setting runs once by default, alternating the refiner kinds; the rest of the
# product is slow, for the default suite's time budget.
@pytest.mark.parametrize("kind, refine", [
    pytest.param(kind, refine, marks=() if (i + j) % 2 == 0 else pytest.mark.slow)
    for j, kind in enumerate(KINDS) for i, refine in enumerate(_REFINES)])
def test_greedy_chain_with_refiner_equals_autoregressive(target, drafter, kind, refine):
    engine = Engine(target, drafter, refiner=_perturbed(kind, drafter))
    ar = engine.generate(PROMPTS, 25, ignore_eos=True)
    refined = engine.generate(PROMPTS, 25, ignore_eos=True, method="chain+refiner", refine=refine)
    assert refined.tokens == ar.tokens
    stats = refined.stats
    assert 1.0 <= stats["refine_passes"] <= refine.max_passes
    if not refine.adaptive:
        assert stats["refine_passes"] == refine.max_passes
    assert stats["refine_s"] > 0 and stats["draft_s"] > 0 and stats["verify_s"] > 0
    assert stats["method"] == "chain+refiner"


@pytest.mark.slow
def test_perturbed_refiner_really_changes_the_drafts(target, drafter):
    """Otherwise the exactness tests above would prove nothing about refined drafts."""
    engine = Engine(target, drafter, refiner=_perturbed("transformer", drafter))
    chain = engine.generate(PROMPTS, 25, ignore_eos=True, method="chain")
    refined = engine.generate(PROMPTS, 25, ignore_eos=True, method="chain+refiner")
    assert refined.stats["per_position_acceptance"] != chain.stats["per_position_acceptance"]


@pytest.mark.slow  # the chain's and the tree's chi-square tests stay in the default suite
@pytest.mark.parametrize("sampling,refine", [(SAMPLINGS[0], RefineConfig(2)),
                                             pytest.param(SAMPLINGS[1], RefineConfig(2, keep_confident=0.5),
                                                          marks=pytest.mark.slow),
                                             pytest.param(SAMPLINGS[0], RefineConfig(2, slots=1),
                                                          marks=pytest.mark.slow)])
def test_sampled_chain_with_refiner_matches_the_exact_target_distribution(target, drafter, sampling, refine):
    prompt = [1, 5, 2]
    exact = _exact_marginals(target.params, np.asarray(prompt), sampling, depth=3)
    engine = Engine(target, drafter, refiner=_perturbed("gru", drafter, scale=1.5))
    result = engine.generate([prompt] * 20_000, 3, sampling, seed=5, ignore_eos=True, method="chain+refiner",
                             refine=refine)
    out = np.asarray(result.tokens)
    assert 0.1 < result.stats["per_position_acceptance"][0] < 0.99  # both branches exercised
    for position in range(3):
        counts = np.bincount(out[:, position], minlength=TINY.vocab_size)
        assert chi_square_pvalue(counts, exact[position]) > 1e-3, f"token {position + 1}"


def test_verifying_against_the_unrefined_distribution_fails(target, drafter, broken_rule):
    """Drafting from the refined q but testing acceptance with the drafter's q biases the output;
    the same statistical test must catch it."""
    sampling = SAMPLINGS[0]
    prompt = [1, 5, 2]
    exact = _exact_marginals(target.params, np.asarray(prompt), sampling, depth=2)
    real = refine_module.refine_drafts

    def broken(*args, **kwargs):
        draft, _, passes = real(*args, **kwargs)
        return draft, args[4], passes  # args[4]: the drafter's own logits

    broken_rule(slots, "refine_drafts", broken)
    refiner = _perturbed("gru", drafter, scale=1.5)
    # 4,000 rows: the p-value is below 1e-300 at seeds 5-7 (1e-6 is the line).
    tokens = Engine(target, drafter, refiner=refiner).generate([prompt] * 4_000, 2, sampling, seed=5, ignore_eos=True,
                                                               method="chain+refiner", refine=RefineConfig(2)).tokens
    failures = [chi_square_pvalue(np.bincount(np.asarray(tokens)[:, i], minlength=TINY.vocab_size), exact[i])
                for i in range(2)]
    assert min(failures) < 1e-6


def test_requests_that_cannot_work_are_refused(target, drafter):
    refiner = _perturbed("gru", drafter)
    with pytest.raises(SpecjaxError, match="needs a refiner"):
        Engine(target, drafter).generate(PROMPTS, 4, method="chain+refiner")
    with pytest.raises(SpecjaxError, match="needs the drafter"):
        Engine(target, None, refiner=refiner)
    with pytest.raises(SpecjaxError, match=">= 0"):
        RefineConfig(max_passes=-1)
    with pytest.raises(SpecjaxError, match="refine slots"):
        RefineConfig(slots=-1)
    with pytest.raises(SpecjaxError, match="kind"):
        RefinerConfig(hidden_size=32, block_size=4, kind="lstm")
    other_block = LoadedRefiner("b8", dataclasses.replace(refiner.config, block_size=8), refiner.params, None)
    with pytest.raises(SpecjaxError, match="blocks of 8"):
        check_refiner(other_block, drafter)
    wrong_drafter = LoadedRefiner("fp", refiner.config, refiner.params, "0123456789abcdef")
    with pytest.raises(SpecjaxError, match="trained for drafter 0123456789abcdef"):
        Engine(target, drafter, refiner=wrong_drafter)


def test_checkpoint_round_trip_and_bad_files(drafter, tmp_path):
    refiner = _perturbed("transformer", drafter)
    save_refiner(tmp_path / "r", refiner.config, refiner.params, refiner.drafter_fingerprint)
    loaded = load_refiner(tmp_path / "r")
    assert loaded.config == refiner.config and loaded.drafter_fingerprint == refiner.drafter_fingerprint
    for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(refiner.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(SpecjaxError, match="not a refiner folder"):
        load_refiner(tmp_path / "missing")
    cfg = json.loads((tmp_path / "r" / "config.json").read_text())
    (tmp_path / "r" / "config.json").write_text(json.dumps({**cfg, "kind": "gru"}))
    with pytest.raises(SpecjaxError, match="unexpected refiner tensor"):
        load_refiner(tmp_path / "r")
    (tmp_path / "r" / "config.json").write_text(json.dumps({**cfg, "architectures": ["DFlashDraftModel"]}))
    with pytest.raises(SpecjaxError, match="not a specjax refiner"):
        load_refiner(tmp_path / "r")
    (tmp_path / "r" / "config.json").write_text(json.dumps(cfg))
    weights = tmp_path / "r" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:64])
    with pytest.raises(SpecjaxError, match="truncated or corrupt"):
        load_refiner(tmp_path / "r")


@pytest.mark.slow  # 20 s; moved out of the default suite to make room for the serving tests
def test_training_improves_the_held_out_acceptance_estimate(target, tmp_path):
    """On a weak (untrained) drafter the refiner has plenty to add: the token to the left alone
    predicts much of the tiny target's next choice."""
    drafter_config = DrafterConfig.for_target(TINY, num_layers=1, block_size=SPEC_BLOCK, num_taps=2)
    drafter = LoadedDrafter("weak", drafter_config, init_drafter_params(drafter_config, jax.random.key(0)),
                            TINY.num_layers)
    train_set = tiny_distillation_set(target, tmp_path / "train", 10)
    heldout = tiny_distillation_set(target, tmp_path / "heldout", 11, 8)
    config = _config("transformer")
    params = train_refiner(target.params, TINY, drafter, config, train_set, tmp_path / "run",
                           OptimizerConfig(learning_rate=5e-3, warmup_steps=10, total_steps=150),
                           LoopConfig(steps=150, eval_every=75, checkpoint_every=150, progress=False),
                           RefinerTrainConfig(sequences_per_batch=4, anchors_per_sequence=16, ramp_steps=50),
                           heldout=heldout)
    metrics = read_metrics(tmp_path / "run")
    losses = [m["loss"] for m in metrics if "loss" in m]
    assert np.mean(losses[-3:]) < 0.9 * np.mean(losses[:3])
    final = [m for m in metrics if "eval/tau_fixed_point" in m][-1]
    assert final["eval/tau_fixed_point"] > final["eval/tau_drafter"]
    # The trained refiner decodes exactly and records which drafter it belongs to.
    refiner = LoadedRefiner("trained", config, params, drafter_fingerprint(drafter.params))
    engine = Engine(target, drafter, refiner=refiner)
    assert engine.generate(PROMPTS, 20, ignore_eos=True, method="chain+refiner").tokens == \
        engine.generate(PROMPTS, 20, ignore_eos=True).tokens


def test_refiner_and_compressor_train_at_bf16_compute_with_float32_weights(target, drafter, tmp_path):
    """`--dtype bfloat16` on train-refiner and train-compressor: the target and the frozen drafter
    compute in bf16 (so the first loss moves, but only by rounding), while the trained weights and
    their updates stay float32."""
    from specjax.io.registry import at_compute_dtype
    from specjax.models.drafter import DrafterWindow
    from specjax.train.compressor import train_compressor
    from specjax.train.drafter import DrafterTrainConfig

    data = tiny_distillation_set(target, tmp_path / "data", 3, n=16)  # 48-token sequences
    batches = dict(sequences_per_batch=4, anchors_per_sequence=8)
    optimizer = OptimizerConfig(learning_rate=1e-2, warmup_steps=1, total_steps=2)
    loop = LoopConfig(steps=2, log_every=1, eval_every=0, checkpoint_every=2, progress=False)
    first_losses = {}
    for dtype in ("float32", "bfloat16"):
        t, d = at_compute_dtype(target, dtype), at_compute_dtype(drafter, dtype)
        assert {a.dtype for a in jax.tree.leaves(d.params)} == {jnp.dtype(dtype)}
        refiner = train_refiner(t.params, t.config, d, _config("gru"), data, tmp_path / dtype / "refiner", optimizer,
                                loop, RefinerTrainConfig(**batches))
        compressor = train_compressor(t.params, t.config, d.config, d.params, DrafterWindow(window=6, segment=4,
                                                                                            summaries=2),
                                      data, tmp_path / dtype / "compressor", optimizer, loop,
                                      DrafterTrainConfig(**batches))
        for name, params in (("refiner", refiner), ("compressor", compressor)):
            assert {a.dtype for a in jax.tree.leaves(params)} == {jnp.dtype("float32")}, (dtype, name)
            losses = [m["loss"] for m in read_metrics(tmp_path / dtype / name) if "loss" in m]
            assert len(losses) == 2 and np.all(np.isfinite(losses)), (dtype, name)
            first_losses[dtype, name] = losses[0]
    for name in ("refiner", "compressor"):
        ours, reference = first_losses["bfloat16", name], first_losses["float32", name]
        assert ours != reference, f"{name}: the bf16 run computed exactly what float32 did"
        np.testing.assert_allclose(ours, reference, rtol=0.05, err_msg=name)
