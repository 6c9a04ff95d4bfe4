"""Chain speculative decoding keeps the target's output exactly: token for token when greedy, in
distribution when sampling. The drafter here is trained for a few seconds on the tiny target so
that drafts are accepted often enough to exercise every branch of the acceptance rules."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.decode import slots
from specjax.decode.engine import Engine
from specjax.decode.sampling import SamplingConfig, target_probs
from specjax.decode.verify import accept_greedy, accept_sampled, leading_true
from specjax.errors import SpecjaxError
from specjax.io.dflash import LoadedDrafter, check_pair, load_drafter, save_drafter
from specjax.io.registry import LoadedModel
from specjax.models.cache import KVCache
from specjax.models.drafter import DrafterConfig, init_drafter_params
from specjax.models.transformer import forward
from specjax.train.drafter import DrafterTrainConfig, train_drafter
from specjax.train.loop import LoopConfig, OptimizerConfig

from stats import chi_square_pvalue
from conftest import SPEC_BLOCK as BLOCK, assert_histogram_accounts_for_the_tokens, tiny_distillation_set
from test_decode import TINY


PROMPTS = [[1, 5, 2], [7], [4, 4, 9, 10, 11, 0, 2]]


def test_greedy_chain_equals_autoregressive(target, drafter):
    engine = Engine(target, drafter)
    ar = engine.generate(PROMPTS, 30, ignore_eos=True)
    chain = engine.generate(PROMPTS, 30, ignore_eos=True, method="chain")
    assert chain.tokens == ar.tokens
    stats = chain.stats
    assert stats["tau"] > 1.5, "the trained drafter should be accepted often"
    assert len(stats["per_position_acceptance"]) == BLOCK - 1
    assert_histogram_accounts_for_the_tokens(stats["accepted_length_histogram"], chain.tokens, BLOCK)


def test_greedy_chain_stops_at_eos_like_autoregressive(target, drafter):
    engine = Engine(target, drafter)
    free = engine.generate([PROMPTS[0]], 30, ignore_eos=True).tokens[0]
    eos = free[7]
    with_eos = LoadedModel("tiny", TINY, target.params, None, (eos,))
    engine = Engine(with_eos, drafter)
    assert engine.generate(PROMPTS, 30, method="chain").tokens == engine.generate(PROMPTS, 30).tokens


@pytest.mark.slow  # suite time budget; the default block's exactness tests stay in the default suite
@pytest.mark.parametrize("block", [2, 3])
def test_greedy_equality_holds_for_other_block_sizes(target, drafter, block):
    """A random drafter of another block size: rarely accepted, still exact."""
    config = DrafterConfig.for_target(TINY, num_layers=1, block_size=block, num_taps=2)
    other = LoadedDrafter("random", config, init_drafter_params(config, jax.random.key(block)), TINY.num_layers)
    engine = Engine(target, other)
    assert engine.generate(PROMPTS, 17, ignore_eos=True, method="chain").tokens == \
        engine.generate(PROMPTS, 17, ignore_eos=True).tokens


_MARGINALS: dict = {}


def _exact_marginals(params, prompt, sampling, depth, config=TINY):
    """Exact distributions of generated tokens 1..depth, by enumerating every prefix (memoised per
    params object: several test modules ask for the same ones, and each costs seconds)."""
    key = (id(params), tuple(np.asarray(prompt).tolist()), sampling, config)
    known = _MARGINALS.get(key)
    if known is not None and len(known[1]) >= depth and known[0] is params:
        return known[1][:depth]
    marginals = _enumerate_marginals(params, prompt, sampling, depth, config)
    _MARGINALS[key] = (params, marginals)
    return marginals


def _enumerate_marginals(params, prompt, sampling, depth, config):
    vocab = TINY.vocab_size
    prefixes = np.zeros((1, 0), np.int32)
    weights = np.ones(1)
    marginals = []
    for _ in range(depth):
        seqs = np.concatenate([np.tile(prompt, (len(prefixes), 1)), prefixes], axis=1)
        cache = KVCache.zeros(config, len(seqs), 16)
        out = forward(params, config, jnp.asarray(seqs), jnp.broadcast_to(jnp.arange(seqs.shape[1]), seqs.shape),
                      cache, jnp.zeros((len(seqs),), jnp.int32))
        probs = np.asarray(target_probs(out.logits[:, -1], sampling), np.float64)  # [P, V]
        joint = weights[:, None] * probs
        marginals.append(joint.sum(0))
        prefixes = np.concatenate([np.repeat(prefixes, vocab, axis=0), np.tile(np.arange(vocab), len(prefixes))[:, None]], 1)
        weights = joint.reshape(-1)
    return marginals


SAMPLINGS = [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.8, top_k=6, top_p=0.9)]


@pytest.mark.parametrize("sampling", [SAMPLINGS[0], pytest.param(SAMPLINGS[1], marks=pytest.mark.slow)])
def test_sampled_chain_matches_the_exact_target_distribution(target, drafter, sampling):
    prompt = [1, 5, 2]
    exact = _exact_marginals(target.params, np.asarray(prompt), sampling, depth=3)
    engine = Engine(target, drafter)
    result = engine.generate([prompt] * 20_000, 3, sampling, seed=3, ignore_eos=True, method="chain")
    out = np.asarray(result.tokens)
    assert 0.1 < result.stats["per_position_acceptance"][0] < 0.99  # both branches exercised
    for position in range(3):
        counts = np.bincount(out[:, position], minlength=TINY.vocab_size)
        assert chi_square_pvalue(counts, exact[position]) > 1e-3, f"token {position + 1}"


@pytest.mark.slow
@pytest.mark.parametrize("broken", [False, True])
def test_sampled_chain_in_bf16_matches_the_exact_target_distribution(target, drafter, broken, broken_rule):
    """The same test with bf16 compute and steps padded to the verify width (what --dtype bfloat16
    does): the bf16 target's enumerated distribution is matched, and the broken rule still fails."""
    import dataclasses

    from specjax.io.registry import at_compute_dtype, with_query_rows

    bf16 = with_query_rows(at_compute_dtype(target, "bfloat16"), "auto")
    assert bf16.config.query_rows is not None
    prompt, depth = [1, 5, 2], 2
    exact = _exact_marginals(bf16.params, np.asarray(prompt), SAMPLINGS[0], depth,
                             dataclasses.replace(bf16.config, query_rows=None))
    drafter16 = at_compute_dtype(drafter, "bfloat16")
    if broken:
        broken_rule(slots, "accept_sampled", _broken_impl)
    out = np.asarray(Engine(bf16, drafter16).generate([prompt] * 20_000, depth, SAMPLINGS[0], seed=4,
                                                      ignore_eos=True, method="chain").tokens)
    pvalues = [chi_square_pvalue(np.bincount(out[:, i], minlength=TINY.vocab_size), exact[i]) for i in range(depth)]
    if broken:
        assert pvalues[1] < 1e-6
    else:
        assert min(pvalues) > 1e-3, pvalues


def _broken_impl(draft, draft_probs, target_probs_, rng):
    """Resamples from p instead of the residual max(p - q, 0), so drafts are counted twice."""
    n, _ = accept_sampled(draft, draft_probs, target_probs_, rng)
    p_next = jnp.take_along_axis(target_probs_, n[:, None, None], axis=1)[:, 0]
    return n, jax.random.categorical(jax.random.fold_in(rng, 1), jnp.log(p_next), axis=-1).astype(jnp.int32)


def test_a_broken_acceptance_rule_fails_the_same_test(target, drafter, broken_rule):
    """The residual rule broken inside the slot step that every chain runs on fails the test above."""
    sampling = SAMPLINGS[0]
    prompt = [1, 5, 2]
    exact = _exact_marginals(target.params, np.asarray(prompt), sampling, depth=2)
    broken_rule(slots, "accept_sampled", _broken_impl)
    # 10,000 rows: p-values of 1e-36 or less at seeds 3-5 (5,000 gave 3e-13; 1e-6 is the line).
    tokens = Engine(target, drafter).generate([prompt] * 10_000, 2, sampling, seed=3, ignore_eos=True,
                                              method="chain").tokens
    counts = np.bincount(np.asarray(tokens)[:, 1], minlength=TINY.vocab_size)
    assert chi_square_pvalue(counts, exact[1]) < 1e-6


def test_acceptance_rules_on_hand_made_cases():
    assert leading_true(jnp.asarray([[True, True, False, True], [False, True, True, True]])).tolist() == [2, 0]
    logits = jnp.log(jnp.asarray([[[0.1, 0.9], [0.8, 0.2], [0.5, 0.5]]]))  # argmax 1, 0, then tie -> 0
    n, nxt = accept_greedy(jnp.asarray([[1, 0]]), logits)
    assert n.tolist() == [2] and nxt.tolist() == [0]
    n, nxt = accept_greedy(jnp.asarray([[1, 1]]), logits)
    assert n.tolist() == [1] and nxt.tolist() == [0]
    # q == p everywhere: every draft is accepted.
    p = jnp.asarray([[[0.3, 0.7], [0.6, 0.4], [0.5, 0.5]]])
    n, _ = accept_sampled(jnp.asarray([[1, 0]]), p[:, :2], p, jax.random.key(0))
    assert n.tolist() == [2]
    # q puts all mass on a token p never produces: always rejected, correction drawn from p.
    q = jnp.asarray([[[1.0, 0.0], [1.0, 0.0]]])
    p0 = jnp.asarray([[[0.0, 1.0], [0.5, 0.5], [0.5, 0.5]]])
    n, nxt = accept_sampled(jnp.asarray([[0, 0]]), q, p0, jax.random.key(1))
    assert n.tolist() == [0] and nxt.tolist() == [1]


def test_dflash_format_round_trip_and_checks(target, drafter, tmp_path):
    save_drafter(tmp_path / "d", drafter.config, drafter.params, TINY)
    loaded = load_drafter(tmp_path / "d")
    assert loaded.config == drafter.config and loaded.num_target_layers == TINY.num_layers
    engine = Engine(target, loaded)
    assert engine.generate(PROMPTS, 12, ignore_eos=True, method="chain").tokens == \
        engine.generate(PROMPTS, 12, ignore_eos=True).tokens
    with pytest.raises(SpecjaxError, match="block size 4, not 8"):
        check_pair(loaded, TINY, block_size=8)
    import dataclasses
    with pytest.raises(SpecjaxError, match="hidden size"):
        check_pair(loaded, dataclasses.replace(TINY, hidden_size=64, head_dim=32))
    with pytest.raises(SpecjaxError, match="taps target layer"):
        check_pair(loaded, dataclasses.replace(TINY, num_layers=1))
    with pytest.raises(SpecjaxError, match="vocabulary"):
        check_pair(loaded, dataclasses.replace(TINY, vocab_size=50))
    weights = tmp_path / "d" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(SpecjaxError, match="truncated or corrupt"):
        load_drafter(tmp_path / "d")


@pytest.mark.slow  # the committed SmolLM2 drafter's draft vocabulary is checked in test_smollm2
def test_restricted_draft_vocabulary_stays_exact(target, drafter, tmp_path):
    """A drafter whose head covers only part of the vocabulary proposes only those tokens; greedy
    output is unchanged and sampling still matches the exact distribution."""
    vocab = np.array([0, 2, 4, 5, 7, 9, 11], np.int32)
    save_drafter(tmp_path / "d", drafter.config, drafter.params, TINY, draft_vocab=vocab)
    restricted = load_drafter(tmp_path / "d")
    assert restricted.draft_vocab.tolist() == vocab.tolist()
    engine = Engine(target, restricted)
    assert engine.generate(PROMPTS, 16, ignore_eos=True, method="chain").tokens == \
        engine.generate(PROMPTS, 16, ignore_eos=True).tokens
    sampling = SAMPLINGS[0]
    exact = _exact_marginals(target.params, np.asarray([1, 5, 2]), sampling, depth=2)
    out = np.asarray(engine.generate([[1, 5, 2]] * 20_000, 2, sampling, seed=4, ignore_eos=True,
                                     method="chain").tokens)
    assert chi_square_pvalue(np.bincount(out[:, 1], minlength=TINY.vocab_size), exact[1]) > 1e-3


def test_chain_without_drafter_is_refused(target):
    with pytest.raises(SpecjaxError, match="needs a drafter"):
        Engine(target).generate(PROMPTS, 4, method="chain")


def test_training_with_a_draft_vocabulary(target, tmp_path):
    from specjax.train.drafter import choose_draft_vocab
    from specjax.train.loop import read_metrics

    data = tiny_distillation_set(target, tmp_path / "data", 2, n=16)
    vocab = choose_draft_vocab([data], 6, always=[3])
    counts = np.bincount(np.asarray(data.labels)[np.asarray(data.valid)], minlength=TINY.vocab_size)
    assert 3 in vocab and len(vocab) == 6
    assert set(np.argsort(-counts)[:5]) <= set(vocab.tolist())  # the most frequent labels are in
    config = DrafterConfig.for_target(TINY, num_layers=1, block_size=BLOCK, num_taps=2)
    train_drafter(target.params, TINY, config, data, tmp_path / "run",
                  OptimizerConfig(learning_rate=3e-3, warmup_steps=2, total_steps=30),
                  LoopConfig(steps=30, log_every=1, eval_every=30, checkpoint_every=30, progress=False),
                  DrafterTrainConfig(sequences_per_batch=2, anchors_per_sequence=8), draft_vocab=vocab)
    losses = [m["loss"] for m in read_metrics(tmp_path / "run") if "loss" in m]
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.3


@pytest.mark.slow
def test_bf16_training_keeps_float32_master_weights(target, tmp_path):
    """train-drafter --dtype bfloat16: the drafter computes in bf16 (bf16 dot inputs, float32
    accumulation) against a bf16 target, while its parameters and optimizer stay float32, and it
    still learns. Copies from the bf16 target's layers come in as float32 too."""
    from specjax.io.registry import at_compute_dtype
    from specjax.train.drafter import init_from_target_layers
    from specjax.train.loop import read_metrics

    bf16 = at_compute_dtype(target, "bfloat16")
    data = tiny_distillation_set(target, tmp_path / "data", 2, n=16)
    config = DrafterConfig.for_target(bf16.config, num_layers=1, block_size=BLOCK, num_taps=2)
    assert config.dtype == "bfloat16"
    start = init_from_target_layers(init_drafter_params(config, jax.random.key(0)), bf16.params,
                                    [TINY.num_layers - 1])
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(start))
    params = train_drafter(bf16.params, bf16.config, config, data, tmp_path / "run",
                           OptimizerConfig(learning_rate=3e-3, warmup_steps=2, total_steps=30),
                           LoopConfig(steps=30, log_every=1, eval_every=30, checkpoint_every=30, progress=False),
                           DrafterTrainConfig(sequences_per_batch=2, anchors_per_sequence=8), init_params=start)
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(params))
    losses = [m["loss"] for m in read_metrics(tmp_path / "run") if "loss" in m]
    assert np.isfinite(losses).all() and np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.3


def test_qwen3_style_dflash_checkpoint_with_mask_token(target, tmp_path):
    """DFlash's released drafters use q/k-norms and a real mask token id; both load and decode exactly."""
    import dataclasses

    config = dataclasses.replace(DrafterConfig.for_target(TINY, num_layers=2, block_size=BLOCK, num_taps=2),
                                 qk_norm=True, mask_token_id=TINY.vocab_size - 1)
    params = init_drafter_params(config, jax.random.key(9))
    assert "mask_embedding" not in params and "q_norm" in params["layers_0"]
    save_drafter(tmp_path / "d", config, params, TINY, dtype="bfloat16")
    import json
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["dflash_config"]["mask_token_id"] == TINY.vocab_size - 1
    loaded = load_drafter(tmp_path / "d")
    assert loaded.config.qk_norm and loaded.config.mask_token_id == TINY.vocab_size - 1
    engine = Engine(target, loaded)
    assert engine.generate(PROMPTS, 10, ignore_eos=True, method="chain").tokens == \
        engine.generate(PROMPTS, 10, ignore_eos=True).tokens


def test_training_and_decoding_compute_the_same_draft(target, drafter, tmp_path):
    """The block-sparse training pass and the cached decode pass give the same logits for a block,
    so what training optimises is what decoding uses."""
    from specjax.decode.context import append_context, empty_context_cache
    from specjax.decode.speculative import draft_block
    from specjax.models.transformer import head_matrix
    from specjax.train.drafter import drafter_block_logits

    data = tiny_distillation_set(target, tmp_path / "data", 3, n=2)
    tokens, features = jnp.asarray(data.tokens[:1]), jnp.asarray(data.features[:1].astype(np.float32))
    head = head_matrix(target.params, TINY, None)
    for anchor in (3, 17):
        trained = drafter_block_logits(drafter.params, drafter.config, target.params, TINY, tokens, features,
                                       jnp.asarray([[anchor]]), head)[0, 0]
        cache = append_context(drafter.params, drafter.config, empty_context_cache(drafter.config, 1, 64),
                               features[:, :anchor], jnp.arange(anchor)[None], jnp.zeros((1,), jnp.int32))
        decoded = draft_block(target.params, TINY, drafter.params, drafter.config, tokens[:, anchor],
                              jnp.asarray([anchor]), cache, head)[0]
        np.testing.assert_allclose(np.asarray(trained), np.asarray(decoded), atol=1e-4, rtol=1e-4)


def test_the_anchor_path_puts_the_anchor_into_every_draft_slot(target, tmp_path):
    """With DrafterConfig.anchor_path every draft slot's input carries the anchor token, so slot 1 can
    use it without attending to slot 0; DFlash's layout (no anchor path) gives all draft slots the
    same input whatever the anchor. Both layouts round-trip through DFlash's format."""
    import dataclasses
    import json

    from specjax.models.drafter import Drafter
    from specjax.models.transformer import embed_tokens

    with_path = DrafterConfig.for_target(TINY, num_layers=1, block_size=BLOCK, num_taps=2)
    without = dataclasses.replace(with_path, anchor_path=False)
    assert with_path.anchor_path, "new drafters get the anchor path"
    is_mask = jnp.arange(BLOCK)[None] > 0

    def draft_slot_inputs(config, params, anchor):
        tokens = jnp.asarray([[anchor] + [0] * (BLOCK - 1)])
        x = Drafter(config).apply({"params": params}, embed_tokens(target.params, TINY, tokens), is_mask,
                                  method=Drafter.block_inputs)
        return np.asarray(x[0, 1:])  # [K, d]

    for config, sees in ((with_path, True), (without, False)):
        params = init_drafter_params(config, jax.random.key(3))
        a, b = draft_slot_inputs(config, params, 5), draft_slot_inputs(config, params, 9)
        assert (np.abs(a - b).max(axis=-1) > 1e-3).all() == sees
        save_drafter(tmp_path / str(sees), config, params, TINY)
        flags = json.loads((tmp_path / str(sees) / "config.json").read_text())["dflash_config"]
        assert flags.get("anchor_path", False) == sees
        loaded = load_drafter(tmp_path / str(sees))
        assert loaded.config.anchor_path == sees
        np.testing.assert_allclose(draft_slot_inputs(loaded.config, loaded.params, 5), a, atol=1e-6)
    # A checkpoint that claims the anchor path but lacks its tensors is refused by name.
    (tmp_path / "False" / "config.json").write_text(json.dumps({**json.loads((tmp_path / "False" / "config.json")
        .read_text()), "dflash_config": {**flags, "anchor_path": True}}))
    with pytest.raises(SpecjaxError, match="missing drafter weights.*anchor_proj"):
        load_drafter(tmp_path / "False")


def test_a_warm_start_keeps_a_drafters_weights_and_adds_the_anchor_path(target):
    """init_from_drafter (train-drafter --init-drafter): a DFlash-layout drafter's weights carry over
    unchanged and the anchor path it lacks starts closed, so the warm start computes what the old
    drafter did; a drafter of another shape is refused."""
    import dataclasses

    from flax import traverse_util

    from specjax.train.drafter import init_from_drafter

    new = DrafterConfig.for_target(TINY, num_layers=1, block_size=BLOCK, num_taps=2)
    old = dataclasses.replace(new, anchor_path=False)
    start = LoadedDrafter("old", old, init_drafter_params(old, jax.random.key(1)), TINY.num_layers)
    warm = traverse_util.flatten_dict(init_from_drafter(init_drafter_params(new, jax.random.key(2)), new, start))
    for path, value in traverse_util.flatten_dict(start.params).items():
        np.testing.assert_array_equal(np.asarray(warm[path]), np.asarray(value))
    assert not np.asarray(warm[("anchor_proj", "kernel")]).any() and not np.asarray(warm[("slot_embedding",)]).any()
    from specjax.models.drafter import Drafter
    from specjax.models.transformer import embed_tokens

    x = embed_tokens(target.params, TINY, jnp.asarray([[5] + [0] * (BLOCK - 1)]))
    is_mask = jnp.arange(BLOCK)[None] > 0
    inputs = [Drafter(c).apply({"params": p}, x, is_mask, method=Drafter.block_inputs)
              for c, p in ((old, start.params), (new, traverse_util.unflatten_dict(warm)))]
    np.testing.assert_array_equal(np.asarray(inputs[0]), np.asarray(inputs[1]))
    with pytest.raises(SpecjaxError, match="block_size"):
        init_from_drafter(init_drafter_params(new, jax.random.key(2)), dataclasses.replace(new, block_size=BLOCK * 2),
                          start)
