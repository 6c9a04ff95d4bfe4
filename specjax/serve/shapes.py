"""Every shape a server fixes at start-up: its policies, the slot programs' static arguments and the
buckets (prompt lengths, attention lengths, live rows, insert rows) that each get a compiled program.

`plan_shapes` derives them from the model, the drafter and the `ServeConfig`, and refuses a
configuration that cannot serve (a policy missing its drafter, a context too short for its answers),
so the scheduler starts only on shapes that fit.
"""

from __future__ import annotations

import dataclasses
import logging

from specjax.decode import slots as slot_api
from specjax.errors import SpecjaxError
from specjax.io.dflash import LoadedDrafter, check_pair
from specjax.io.refiner import LoadedRefiner, check_refiner
from specjax.io.registry import LoadedModel
from specjax.serve.config import ServeConfig

log = logging.getLogger("specjax.serve")


@dataclasses.dataclass(frozen=True)
class ServingShapes:
    """What `plan_shapes` fixed for one server."""

    policies: tuple[str, ...]
    """The policies compiled: the adaptive controller's set, or the one fixed method."""
    statics: slot_api.SlotStatics
    """The slot programs' static arguments (the target's KV rings sized for one step's writes)."""
    step_slack: int
    """Cache slots one verify step writes past a row's committed tokens, under the widest policy."""
    policy_slack: dict[str, int]
    """The same per policy: an AR step over a cache sized for chains attends to less."""
    max_prompt: int
    """The longest prompt a request may bring."""
    prompt_buckets: tuple[int, ...]
    """Prompt lengths an insert is compiled for (powers of two from `prompt_bucket`, then max_prompt)."""
    drafting_buckets: tuple[int, ...]
    """rapid, rapid+block: drafting-prompt lengths a drafting-context fill is compiled for (else empty)."""
    max_drafting_prompt: int
    """rapid, rapid+block: the longest drafting prompt plus answer a drafting context holds."""
    attend_buckets: tuple[int, ...]
    """Attention lengths each step is compiled for: a batch of short contexts reads only what it needs."""
    row_buckets: tuple[int, ...]
    """Live-row counts each step is compiled for (ServeConfig.row_buckets, always with `slots`)."""
    insert_sizes: tuple[int, ...]
    """Rows an insert is compiled for: 1 and ServeConfig.insert_rows."""
    prefill_chunk: int
    """Prompt tokens prefilled per scheduler turn (0: whole prompts, as windowed and retrieval
    drafters need)."""
    drafts_from_retrieval: bool
    """The server drafts from each request's drafting prompt (rapid, rapid+block)."""

    def bucket_for(self, length: int) -> int:
        """The smallest prompt bucket holding `length` tokens."""
        return next(b for b in self.prompt_buckets if b >= length)

    def row_bucket(self, rows: int) -> int:
        """The smallest compiled row count that covers `rows` slots."""
        return next(b for b in self.row_buckets if b >= rows)

    def attend_bucket(self, need: int) -> int:
        """The smallest compiled attention length of at least `need` slots (the longest, if none is)."""
        return next((b for b in self.attend_buckets if b >= need), self.attend_buckets[-1])


def served_policies(model: LoadedModel, drafter: LoadedDrafter | None, config: ServeConfig) -> tuple[str, ...]:
    """The policies a server compiles, each as a target padded to fewer query rows than the block
    runs it ("chain" verifies at most that many rows there)."""
    if not config.adaptive:
        policies = (config.method,)
    elif drafter is None:
        log.warning("adaptive serving without a drafter: the only policy is ar")
        policies = ("ar",)
    else:
        policies = config.controller.policy_set(drafter.config.block_size, query_rows=model.config.query_rows)
    if drafter is not None:
        policies = tuple(dict.fromkeys(
            slot_api.method_within_query_rows(p, drafter.config.block_size, model.config.query_rows)
            for p in policies))
    return policies


def needed_parts(policies: tuple[str, ...], drafter: LoadedDrafter | None, refiner: LoadedRefiner | None,
                 model: LoadedModel) -> tuple[LoadedDrafter | None, LoadedRefiner | None]:
    """The drafter and refiner the policies use (None where none uses it), each checked against
    what it pairs with; refuses a policy whose part is missing."""
    methods = [slot_api.slot_method(p) for p in policies]
    for method in methods:
        if method.needs_drafter and drafter is None:
            raise SpecjaxError(f"method {method.name!r} needs a drafter")
        if method.needs_refiner and refiner is None:
            raise SpecjaxError(f"method {method.name!r} needs a refiner")
    drafter = drafter if drafter is not None and any(m.needs_drafter for m in methods) else None
    if drafter is not None:
        check_pair(drafter, model.config)
    refiner = refiner if refiner is not None and any(m.needs_refiner for m in methods) else None
    if refiner is not None:
        check_refiner(refiner, drafter)
    return drafter, refiner


def plan_shapes(policies: tuple[str, ...], model: LoadedModel, drafter: LoadedDrafter | None,
                refiner: LoadedRefiner | None, config: ServeConfig) -> ServingShapes:
    """The shapes a server of `config` compiles `policies` (`served_policies`) for, with the
    drafter and refiner `needed_parts` returns."""
    methods = [slot_api.slot_method(p) for p in policies]
    needs = lambda what: any(getattr(m, what) for m in methods)  # noqa: E731
    # rapid and rapid+block keep a drafting context per slot that only their own steps advance
    # (an AR or chain step would leave it behind, or write it at full-prompt positions), so
    # they are served as a fixed method, never in the adaptive set.
    from_retrieval = needs("needs_retrieval")
    if from_retrieval and len(policies) > 1:
        raise SpecjaxError("rapid and rapid+block are served as a fixed --method, not among adaptive policies")
    cache_length = -(-config.context_length // 64) * 64
    slot_config = slot_api.SlotConfig(slots=config.slots, cache_length=cache_length,
                                      max_new_tokens=config.max_new_tokens, steps_per_sync=config.steps_per_sync,
                                      insert_rows=min(config.insert_rows, config.slots))
    query_rows = model.config.query_rows
    tree = None
    if needs("needs_tree"):
        tree = config.tree if drafter is None else config.tree.within_query_rows(drafter.config.block_size - 1,
                                                                                 query_rows)
    statics = slot_api.SlotStatics(
        target_config=model.config, slot=slot_config, eos_token_ids=tuple(model.eos_token_ids),
        drafter_config=None if drafter is None else drafter.config,
        refiner_config=None if refiner is None else refiner.config, refine=config.refine, tree=tree,
        rapid=config.rapid.within_query_rows(query_rows) if needs("target_drafts") else None,
        drafting_length=-(-config.drafting_slots // 64) * 64 if from_retrieval else 0,
        drafter_on_retrieval=from_retrieval and drafter is not None,
        ngram=config.ngram if needs("needs_ngram") else None)
    # A verify step writes up to one block or tree (or the padded query rows) past a row's
    # committed tokens; sliding layers keep KV rings that hold that much past their window.
    step_slack = max(statics.step_writes, query_rows or 1)
    if config.max_new_tokens + step_slack + 1 > config.context_length:
        raise SpecjaxError(f"context_length {config.context_length} leaves no room for a prompt with "
                           f"max_new_tokens {config.max_new_tokens}")
    # The first rapid draft pass writes one slot before the row's last token (decode/rapid.py).
    max_drafting_prompt = config.drafting_slots - step_slack - 2
    if from_retrieval and config.max_new_tokens + step_slack + 2 > config.drafting_slots:
        raise SpecjaxError(f"drafting_length {config.drafting_slots} leaves no room for a drafting prompt with "
                           f"max_new_tokens {config.max_new_tokens}")
    max_prompt = config.context_length - step_slack - 1
    prompt_buckets = _doublings(config.prompt_bucket, max_prompt)
    drafting_length = statics.drafting_length
    windowed = drafter is not None and drafter.config.window is not None
    # Drafting contexts are prefilled with their whole drafting prompt, so the prompt is too.
    whole = windowed or from_retrieval
    rows = config.row_buckets or tuple(4**i for i in range(8) if 4**i < config.slots)
    return ServingShapes(
        policies=policies,
        statics=dataclasses.replace(statics, target_config=model.config.with_kv_rings(step_slack)),
        step_slack=step_slack,
        policy_slack={p: max(statics.policy_writes(p), query_rows or 1) for p in policies},
        max_prompt=max_prompt,
        prompt_buckets=prompt_buckets,
        drafting_buckets=tuple(b for b in prompt_buckets if b < drafting_length) + (
            (drafting_length,) if drafting_length else ()),
        max_drafting_prompt=max_drafting_prompt,
        attend_buckets=tuple(sorted({min(128 * 2**i, cache_length) for i in range(16)
                                     if i == 0 or 128 * 2**(i - 1) < cache_length})),
        row_buckets=tuple(sorted({b for b in rows if 1 <= b < config.slots} | {config.slots})),
        insert_sizes=tuple(sorted({1, slot_config.insert_rows})),
        prefill_chunk=0 if whole or config.prefill_chunk >= max_prompt else config.prefill_chunk,
        drafts_from_retrieval=from_retrieval)


def _doublings(first: int, last: int) -> tuple[int, ...]:
    """first, 2 first, 4 first, ... below last, then last."""
    sizes, size = [], first
    while size < last:
        sizes.append(size)
        size *= 2
    return tuple(sizes) + (last,)
