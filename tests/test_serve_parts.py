"""The scheduler's parts on their own, without a serving thread: the shapes a server fixes
(serve/shapes.py), the request rules (serve/rules.py), a request's detokenizing with stop strings
(serve/requests.py) and the KV ledger's accounting (serve/kv_ledger.py)."""

from __future__ import annotations

import numpy as np
import pytest

from specjax.errors import SpecjaxError
from specjax.serve.config import ServeConfig
from specjax.serve.controller import ControllerConfig
from specjax.serve.kv_ledger import KvLedger
from specjax.serve.requests import LiveRequest, Request, RequestHandle
from specjax.serve.rules import RequestRules
from specjax.serve.shapes import needed_parts, plan_shapes, served_policies


def _plan(target, drafter, **fields):
    config = ServeConfig(**{"method": "chain", "slots": 5, "context_length": 200, "max_new_tokens": 32,
                            "prompt_bucket": 16, **fields})
    policies = served_policies(target, drafter, config)
    drafter, refiner = needed_parts(policies, drafter, None, target)
    return plan_shapes(policies, target, drafter, None, config), config


def test_the_shapes_a_server_fixes(target, drafter):
    shapes, _ = _plan(target, drafter)
    block = drafter.config.block_size
    assert shapes.policies == ("chain",) and shapes.step_slack == block
    assert shapes.max_prompt == 200 - block - 1
    assert shapes.prompt_buckets == (16, 32, 64, 128, shapes.max_prompt)  # doublings, then the longest prompt
    assert shapes.row_buckets == (1, 4, 5) and shapes.insert_sizes == (1, 4)
    assert shapes.attend_buckets == (128, 256)  # the cache is 200 rounded up to 256 slots
    assert shapes.bucket_for(17) == 32 and shapes.row_bucket(2) == 4 and shapes.attend_bucket(999) == 256
    assert shapes.policy_slack == {"chain": block} and shapes.prefill_chunk == 0  # 256 >= max_prompt: whole
    ar, _ = _plan(target, drafter, method="ar")
    assert ar.policy_slack == {"ar": 1} and ar.statics.drafter_config is None  # an AR server needs no drafter
    adaptive, _ = _plan(target, drafter, method="adaptive", controller=ControllerConfig(policies=("ar", "chain:2")))
    assert adaptive.policy_slack == {"ar": 1, "chain:2": 3}  # chain:K writes its K drafts and one token
    with pytest.raises(SpecjaxError, match="leaves no room"):
        _plan(target, drafter, context_length=30)
    with pytest.raises(SpecjaxError, match="needs a drafter"):
        _plan(target, None)


def test_request_rules_refuse_what_the_server_cannot_run_and_limit_drafts(target, drafter):
    shapes, config = _plan(target, drafter)
    rules = RequestRules(shapes, target, config, has_drafter=True)
    block = drafter.config.block_size
    rules.validate(Request((1, 2, 3), max_tokens=8))
    for bad, message in [(Request(()), "empty"), (Request((1, 999)), "outside the vocabulary"),
                         (Request((1,), max_tokens=33), "max_tokens must be in"),
                         (Request((1,) * 190, max_tokens=32), "exceeds the context"),
                         (Request((1,), 8, stop=("x",)), "need a tokenizer"),
                         (Request((1,), 8, method="tree"), "not served here"),
                         (Request((1,), 8, temperature=-1.0), "temperature")]:
        with pytest.raises(SpecjaxError, match=message):
            rules.validate(bad)
    assert rules.row_limit(Request((1,))) == block - 1
    assert rules.row_limit(Request((1,), method="chain:2")) == 2  # per-row draft limits of the served chain
    assert rules.row_limit(Request((1,), speculation=False)) == 0
    assert rules.row_limit(Request((1,), method="ar")) == 0
    assert rules.pin_for(Request((1,), method="chain:2"), adaptive=False, drafts_of={}) is None
    adaptive, config = _plan(target, drafter, method="adaptive",
                             controller=ControllerConfig(policies=("ar", "chain:1", "chain")))
    rules = RequestRules(adaptive, target, config, has_drafter=True)
    drafts = {"ar": 0, "chain:1": 1, "chain": block - 1}
    assert rules.pin_for(Request((1,), method="chain:2"), True, drafts) == "chain"  # the shortest covering chain
    assert rules.pin_for(Request((1,), method="chain:1"), True, drafts) == "chain:1"
    assert rules.pin_for(Request((1,), method="ar"), True, drafts) is None  # its limit of 0 is AR in any step


class _Characters:
    """A tokenizer whose ids are characters; id 9 is half of a two-byte character."""

    def decode(self, ids):
        return "".join("\ufffd" if i == 9 else chr(ord("a") + i) for i in ids)


def _live(stop=()):
    return LiveRequest(RequestHandle(0, Request((1,), stop=stop), scheduler=None), arrived=0.0, admitted=0.0)


def test_detokenize_holds_back_half_a_character_and_cuts_at_a_stop_string():
    live = _live(stop=("cd",))
    assert live.detokenize([0, 1], _Characters(), done=False) == ([0, 1], "ab", None)
    live.emitted = 2
    assert live.detokenize([0, 1, 9], _Characters(), done=False) == ([9], "", None)  # text waits for its bytes
    new, text, reason = live.detokenize([0, 1, 2, 3, 4], _Characters(), done=False)
    assert (text, reason, new) == ("", "stop", []) and live.text == "ab"  # "cd" ends it; neither id is emitted
    plain = _live()
    assert plain.detokenize([0, 9], _Characters(), done=True) == ([0, 9], "a\ufffd", None)  # done: nothing to wait for
    assert _live().detokenize([4, 5], None, done=False) == ([4, 5], "", None)  # no tokenizer: ids only


def test_the_kv_ledger_counts_prompts_in_full_and_drafter_contexts_until_dropped(target, drafter):
    shapes, _ = _plan(target, drafter)
    ledger = KvLedger(shapes.statics, shapes.drafts_from_retrieval)
    target_bytes, drafter_bytes = ledger.bytes_per_token["target"], ledger.bytes_per_token["drafter"]
    assert target_bytes > 0 and drafter_bytes > 0
    prefilling, decoding = _live(), _live()
    prefilling.handle.request = Request((1,) * 40)
    decoding.handle.request = Request((1,) * 10)
    decoding.prefilled = 10
    ledger.lengths[:2] = (8, 30)  # 8 of the first prompt's 40 tokens are in so far
    live = {0: prefilling, 1: decoding}
    assert ledger.bytes_after_admitting(live, [], Request((1,) * 5), resumed=2) == \
        (40 + 30 + 7) * (target_bytes + drafter_bytes)
    filled, in_use = ledger.in_use(live)
    assert filled == pytest.approx(38 / (5 * 256))
    assert in_use == {"target": 38 * target_bytes, "drafter": 38 * drafter_bytes}
    decoding.holds_drafter = False
    assert ledger.in_use(live)[1]["drafter"] == 8 * drafter_bytes
    ledger.move(1, 4)
    assert ledger.lengths[4] == 30
    rows = ledger.held_rows(live)
    assert [r.slot for r in rows] == [1] and not rows[0].holds_drafter  # rows still prefilling are not relief
    assert np.all(ledger.drafting_lengths == 0)
