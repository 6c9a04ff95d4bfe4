"""The adaptive server's controller: which precompiled decoding policy the next device call runs.

Objective: expected committed tokens per second at the current batch,

    value(policy) = sum over live rows of E[tokens per step | policy, row]  /  seconds per step(policy),

Bastion's tree-size rule generalised from one sequence to a batch and to a choice of methods.
With a TPOT SLO (`ControllerConfig.tpot_slo_s`) the sum runs over the rows predicted to meet it:
goodput, as SmartSpec chooses.

- E[tokens per step] of a chain verifying k drafts is 1 + sum_{i<=k} prod_{j<=i} c_j, with c_j the
  EMA of the conditional acceptance at draft position j (a step that reached position j-1 and
  verified position j accepted it). Every chain tier shares these estimates, so running one tier
  informs the others. AR commits 1. Other policies (trees, refined chains) use the EMA of their own
  observed tokens per row step, and the full chain's prediction until they have run.
- Seconds per step comes from one timed call of every (policy, live-row bucket) at start-up, times
  a drift factor per (row bucket, attention length) refitted online from every measured call: a
  step that runs slower than its start-up time slows every policy's prediction at that shape.
- Hysteresis: a challenger must be predicted `margin` faster at `patience` consecutive decisions
  before the controller switches (`margin_to_fewer`, smaller, for one that speculates less), so a
  policy that stops paying is dropped within patience x steps_per_sync steps, and noise near a
  tie never flips it (vLLM's threshold thrash).
- Policies not run lately are probed for one call every `probe_every` calls, so estimates of a
  policy that became good again are not stuck at old values.
- Memory: bytes in use and their growth give a projected time to the KV budget; crossing the high
  water mark or a projection inside the horizon raises the alarm, which pauses admission. Past the
  high water mark, `relieve_memory` plans what to free, least lost first: windowed drafting (a row's
  full-attention drafter reads only its recent context, and keeps speculating), then drafter states
  (the row goes on without speculation), and preemption of the newest requests only for what those
  cannot cover. Output is unchanged by all three.

Nothing here touches devices or HTTP: the scheduler feeds it numbers and asks for decisions.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from specjax.errors import SpecjaxError, check_at_least
from specjax.decode.slots import slot_method

log = logging.getLogger("specjax.serve")


@dataclasses.dataclass(frozen=True)
class ControllerConfig:
    """How the adaptive server chooses among its precompiled policies."""

    policies: tuple[str, ...] | None = None
    """Policies to compile and choose among (methods of `slots.slot_method`, e.g. "ar", "chain:3",
    "chain", "tree"). None: ar, chain:3, chain:7 (those shorter than the block) and chain; on a
    target padded to W query rows, ar, the chain and the tree within them (`policy_set`)."""
    start: str | None = None
    """The policy served while the others compile and before anything is measured (None: the
    longest chain)."""
    ema: float = 0.25
    """Weight of the newest observation in every moving average."""
    margin: float = 0.08
    """A challenger that drafts more than the current policy must be predicted this fraction faster."""
    margin_to_fewer: float = 0.0
    """A challenger that drafts fewer (AR among them) must be predicted this fraction faster. Below
    `margin`, so near a tie the controller settles on less speculation: the step timings it compares
    leave out costs only speculation pays (building the drafter's context at prefill, burstier
    token delivery), and in a bf16 sweep on 8 slots a chain chosen on a 3% predicted lead served 12%
    fewer tokens than AR (docs/notes/2026-12-06-adaptive-serving.md, "The rate sweep in bf16 with
    the v4 drafter")."""
    patience: int = 3
    """Consecutive decisions a challenger must win before the switch."""
    probe_every: int = 48
    """Device calls between probes of a policy not run for that long (0: never probe). Each probe
    that finds the policy still losing doubles its interval, up to 16x, so exploration costs less
    the longer a load holds; a change of live-row bucket resets every interval. A policy predicted
    below `probe_floor` of the current one waits the longest interval: a probe can only pay when
    the estimate is near enough to flip. A policy not yet run is probed at once only when nothing
    estimates it; with acceptance remembered from the last run it waits its interval like the rest
    (on the 2-core EPYC in float32 a chain's call costs about two AR calls at 16 clients).
    """
    probe_floor: float = 0.5
    """Predicted value, as a fraction of the current policy's, below which probes are rarest."""
    remember: bool = True
    """Keep the measured draft acceptance between starts, per machine, model, drafter shape, slot
    count and policy set (under $SPECJAX_CACHE/serve), and start from it: the first policy served is
    then the one predicted fastest here from measured costs and acceptance. False: every start
    begins at the 0.5 no-opinion prior."""
    kv_budget_bytes: int | None = None
    """Bytes of KV (target and drafter) the server may hold; None: the slots' whole capacity."""
    kv_high_water: float = 0.9
    """Fraction of the budget at which the alarm is raised whatever the growth."""
    kv_horizon_s: float = 3.0
    """Alarm when the bytes in use, growing at their recent rate, would reach the budget this soon."""
    tpot_slo_s: float | None = None
    """With a time-per-output-token SLO, the objective is goodput: committed tokens per second of
    the rows predicted to meet it (a row's predicted TPOT is the step's seconds over its expected
    tokens per step), as SmartSpec's goodput rule; when no policy lets any row meet it, plain
    throughput. None: throughput."""
    relief_window: int | None = 256
    """Under memory pressure, a full-attention drafter's rows are first windowed: the drafter reads
    only the row's last this many context positions (SW-SpeedDLM's window, without its summaries),
    so the drafter K/V before them can be freed while the row keeps speculating. None: never window
    (drafter states are dropped instead)."""

    def __post_init__(self):
        if not 0.0 < self.ema <= 1.0:
            raise SpecjaxError(f"ema must be in (0, 1], got {self.ema}")
        if not 0.0 <= self.margin < 1.0:
            raise SpecjaxError(f"margin must be in [0, 1), got {self.margin}")
        if not 0.0 <= self.margin_to_fewer <= self.margin:
            raise SpecjaxError(f"margin_to_fewer must be in [0, margin={self.margin}], got {self.margin_to_fewer}")
        if not 0.0 < self.kv_high_water <= 1.0:
            raise SpecjaxError(f"kv_high_water must be in (0, 1], got {self.kv_high_water}")
        check_at_least(1, patience=self.patience)
        check_at_least(0, probe_every=self.probe_every)
        if self.kv_budget_bytes is not None:
            check_at_least(1, kv_budget_bytes=self.kv_budget_bytes)
        if self.relief_window is not None:
            check_at_least(1, relief_window=self.relief_window)
        if self.tpot_slo_s is not None and not self.tpot_slo_s > 0:
            raise SpecjaxError(f"tpot_slo_s must be positive seconds, got {self.tpot_slo_s}")

    def policy_set(self, block: int, query_rows: int | None = None) -> tuple[str, ...]:
        """The policies to compile for a drafter of this block (a tree only under padding; `policies`
        adds one anywhere).
        query_rows: a target padded to that many rows runs every step at them, so a shorter chain
        costs what the longest chain within them costs and accepts no more, while a tree of that
        many nodes costs the same step too and accepts more: the default set then is ar, that chain
        and that tree. Measured on a bf16 server padded to 8 rows with the block-8 drafter
        (docs/notes/2026-12-06-adaptive-serving.md, "Adaptive serving on padded bf16"): chain:3 took
        1,584 of 3,428 adaptive steps while chain was the best fixed policy at three of four loads; in a later sweep the
        tree was the best fixed policy at every load, and adaptive without it reached 0.93-0.99x its
        throughput at 1.08-1.19x its p50 TPOT."""
        if self.policies is not None:
            return tuple(dict.fromkeys(self.policies))
        if query_rows is not None:
            return ("ar", "chain", "tree")
        tiers = tuple(slot_method("chain").limited_to(k) for k in (3, 7) if k < block - 1)
        return ("ar",) + tiers + ("chain",)


@dataclasses.dataclass(frozen=True)
class Decision:
    """The controller's answer for one device call."""

    policy: str
    """The policy the call runs."""
    reason: str
    """Why this policy: "start", "hold", "faster", "probe", "pinned" or "ready"."""
    predicted_tokens_per_step: float
    """Committed tokens the controller expects per step over the live rows."""
    predicted_tokens_per_s: dict[str, float]
    """Every ready policy's predicted committed tokens per second at this batch."""


@dataclasses.dataclass(frozen=True)
class MemoryState:
    """What the KV projection says after one report."""

    bytes_in_use: int
    """Target KV and drafter context bytes holding tokens now."""
    budget: int
    """The budget in bytes (0: none set, so never an alarm)."""
    growth_bytes_per_s: float
    """EMA of the bytes' growth between reports (negative while requests finish)."""
    seconds_to_budget: float
    """When the budget would be reached at that growth; inf when not growing."""
    alarm: bool
    """Past the high water mark, or the budget projected inside the horizon."""


@dataclasses.dataclass(frozen=True)
class HeldRow:
    """What one decoding request holds, for `relieve_memory`."""

    slot: int
    admitted: float
    """When it was admitted: the newest is preempted first (it has the least work to redo)."""
    tokens: int
    """Positions it holds in the target's KV cache (and in the drafter's context, if held)."""
    holds_drafter: bool
    """Whether its drafter context is still counted."""
    speculating: bool = True
    """False for a request limited to 0 drafts: dropping its drafter state loses nothing."""
    drafter_tokens: int | None = None
    """Positions its drafter context holds, when not `tokens` (a drafting context sized by the
    request's drafting prompt: rapid, rapid+block)."""
    drafter_window: int = 0
    """Its drafter reads only its last this many context positions (0: all of them)."""

    @property
    def drafting(self) -> int:
        """Drafter context positions it holds: the newest `drafter_window` of them once windowed."""
        held = self.tokens if self.drafter_tokens is None else self.drafter_tokens
        return min(held, self.drafter_window) if self.drafter_window else held


@dataclasses.dataclass(frozen=True)
class Relief:
    drop_drafter: tuple[int, ...]
    """Slots whose drafter state is dropped: they commit one token per step from now on."""
    preempt: tuple[int, ...]
    """Slots preempted: their requests go back to the queue with their tokens so far."""
    freed_bytes: int
    window_drafter: tuple[int, ...] = ()
    """Slots whose drafter is windowed: it reads only the row's last `drafter_window` context
    positions from now on, and the row keeps speculating."""


def relieve_memory(rows: Sequence[HeldRow], bytes_per_token: dict[str, int], excess_bytes: int,
                   drafter_window: int | None = None) -> Relief:
    """Free at least excess_bytes, losing as little as possible, in this order:
    1. with drafter_window, windowing: speculating rows whose drafter holds more context than the
       window keep only the window (longest first); speculation goes on at a shorter context;
    2. preemption of the newest requests, only for what the drafter states of the rows that stay
       cannot cover (a preempted request stops until the budget has room, and is parked on the host
       or recomputed);
    3. drafter states dropped, newest request first and non-speculating rows before all (the row
       loses speculation, no work).
    One request always stays, so the server makes progress (a request alone is never preempted)."""
    target, drafter = bytes_per_token.get("target", 0), bytes_per_token.get("drafter", 0)
    held = {r.slot: r.drafting if r.holds_drafter and drafter else 0 for r in rows}  # drafter positions
    windowed, freed = [], 0
    if drafter_window and drafter:
        for row in sorted(rows, key=lambda r: -held[r.slot]):
            if freed >= excess_bytes:
                break
            if row.speculating and held[row.slot] > drafter_window:
                windowed.append(row.slot)
                freed += (held[row.slot] - drafter_window) * drafter
                held[row.slot] = drafter_window
    staying = sorted(rows, key=lambda r: r.admitted)  # oldest first; the newest is popped first
    droppable = lambda: sum(held[r.slot] for r in staying) * drafter  # noqa: E731
    preempt = []
    while len(staying) > 1 and excess_bytes - freed > droppable():
        row = staying.pop()
        preempt.append(row.slot)
        freed += row.tokens * target + held[row.slot] * drafter
    drop = []
    for row in sorted(reversed(staying), key=lambda r: r.speculating):  # stable: newest first within each
        if freed >= excess_bytes:
            break
        if held[row.slot]:
            drop.append(row.slot)
            freed += held[row.slot] * drafter
    windowed = [slot for slot in windowed if slot not in preempt and slot not in drop]
    return Relief(tuple(drop), tuple(preempt), freed, tuple(windowed))


class Controller:
    """Chooses the next call's policy from measured step costs and acceptance."""

    def __init__(self, policies: Sequence[str], block: int, config: ControllerConfig = ControllerConfig(),
                 steps_per_call: int = 1):
        """steps_per_call: verify steps in one device call (the server's steps_per_sync), so that
        predictions are tokens per second rather than per call."""
        if not policies:
            raise SpecjaxError("the adaptive controller needs at least one policy")
        self.config, self.block = config, block
        self.policies = tuple(policies)
        self.drafts = {p: self._drafts(p) for p in self.policies}
        # The longest chain measures every draft position's acceptance; trees and refined chains
        # (drafts None) are estimated from their own runs, so they start only when alone.
        # Between a chain and its tier of as many drafts, the registry's own entry.
        start = config.start or max(self.policies, key=lambda p: (-1 if self.drafts[p] is None else self.drafts[p],
                                                                  slot_method(p).drafts is None))
        if start not in self.policies:
            raise SpecjaxError(f"start policy {start!r} is not among the policies {self.policies}")
        self.current = start
        self.cached_startup_s: dict[tuple[str, int], float] = {}
        """(policy, live-row bucket) -> start-up seconds per call, from the last run's priors."""
        self.ready: set[str] = set()
        self.pinned: str | None = None
        # c_j, j = 1..block-1: conditional acceptance at draft position j (prior 0.5: no opinion).
        self.acceptance = np.full(max(block - 1, 0), 0.5)
        self.acceptance_seen = np.zeros(max(block - 1, 0), bool)
        self.loaded_acceptance: list[float | None] = [None] * max(block - 1, 0)
        """Each position's acceptance as the loaded priors had it (None: no prior)."""
        self.observed_tau: dict[str, float] = {}
        self.steps_per_call = steps_per_call
        self.startup_s: dict[tuple[str, int], float] = {}
        self.drift: dict[tuple[int, int], float] = {}
        self.own_s: dict[tuple[str, int, int], float] = {}
        """EMA of each policy's own measured seconds per call at (rows, attend), once it has run there."""
        self.last_run: dict[str, int] = {}
        self.last_observed: dict[str, int] = {}
        self.probe_interval: dict[str, int] = {}
        self._last_rows: int | None = None
        self.calls = 0
        self._challenger: str | None = None
        self._wins = 0
        self.switches: dict[str, int] = {}
        self.kv_budget = config.kv_budget_bytes
        self._memory: tuple[float, int] | None = None
        self._growth = 0.0

    def _drafts(self, policy: str) -> int | None:
        """Drafts a chain policy verifies (0 for ar); None for policies estimated from their own runs."""
        method = slot_method(policy)
        if not method.needs_drafter:
            return 0
        if method.needs_tree or method.needs_refiner:
            return None
        return self.block - 1 if method.drafts is None else method.drafts

    def _estimated(self, policy: str) -> bool:
        """Whether the policy's value rests on acceptance measured by this run or remembered from
        the last (a never-run policy without either is probed at once, one with it waits its turn)."""
        drafts = self.drafts[policy]
        if drafts is None:
            return policy in self.observed_tau
        return all(seen or loaded is not None for seen, loaded in
                   zip(self.acceptance_seen[:drafts], self.loaded_acceptance[:drafts]))

    def _rank(self, policy: str) -> int:
        """How much a policy speculates: its chain drafts (AR 0); trees and refined chains above every chain."""
        drafts = self.drafts[policy]
        return self.block if drafts is None else drafts

    # ---- what the scheduler reports ----

    def mark_ready(self, policy: str, startup_seconds: dict[int, float]) -> None:
        """The policy's steps are compiled; startup_seconds: one timed call per live-row bucket."""
        self.ready.add(policy)
        for rows, seconds in startup_seconds.items():
            self.startup_s[policy, rows] = seconds

    def observe_call(self, policy: str, rows: int, attend: int, seconds: float, row_steps: int, committed: int,
                     reached: np.ndarray, verified: np.ndarray) -> None:
        """One device call: its wall seconds; row_steps = sum over rows of the steps they took;
        committed tokens; reached[j-1] = steps that accepted draft position j, verified[j-1] = steps
        that verified position j after accepting j-1 (chains)."""
        a = self.config.ema
        base = self.startup_s.get((policy, rows))
        if base:
            key = (rows, attend)
            self.drift[key] = (1 - a) * self.drift.get(key, seconds / base) + a * seconds / base
        own = (policy, rows, attend)
        # A policy back after a while (a probe) replaces its old cost outright: an estimate it kept
        # from long ago, or from one unlucky call, must not keep it from ever winning again.
        fresh = self.calls - self.last_observed.get(policy, -10**9) > max(self.config.probe_every, 1)
        self.own_s[own] = seconds if fresh or own not in self.own_s else (1 - a) * self.own_s[own] + a * seconds
        if row_steps:
            tau = committed / row_steps
            self.observed_tau[policy] = (1 - a) * self.observed_tau.get(policy, tau) + a * tau
        for j in range(len(self.acceptance)):
            if verified[j] > 0:
                rate = reached[j] / verified[j]
                # Weighted by how many steps verified the position, so a handful does not swing it.
                w = 1 - (1 - a) ** min(verified[j], 8)
                self.acceptance[j] = rate if not self.acceptance_seen[j] else (1 - w) * self.acceptance[j] + w * rate
                self.acceptance_seen[j] = True
        self.last_run[policy] = self.last_observed[policy] = self.calls
        self.calls += 1

    def observe_memory(self, bytes_in_use: int, now: float) -> MemoryState:
        a = self.config.ema
        if self._memory is not None and now > self._memory[0]:
            rate = (bytes_in_use - self._memory[1]) / (now - self._memory[0])
            self._growth = (1 - a) * self._growth + a * rate
        self._memory = (now, bytes_in_use)
        budget = self.kv_budget or 0
        if not budget:
            return MemoryState(bytes_in_use, 0, self._growth, math.inf, False)
        left = budget - bytes_in_use
        to_budget = left / self._growth if self._growth > 0 else math.inf
        alarm = bytes_in_use >= self.config.kv_high_water * budget or to_budget < self.config.kv_horizon_s
        return MemoryState(bytes_in_use, budget, self._growth, max(to_budget, 0.0), alarm)

    # ---- predictions ----

    def tokens_per_row_step(self, policy: str, limit: int | None = None) -> float:
        """Expected committed tokens of one row in one step of the policy (limit: the row's draft limit)."""
        drafts = self.drafts[policy]
        limit = self.block - 1 if limit is None else min(limit, self.block - 1)
        if drafts is None:  # until it has run: the full chain's prediction
            tau = self.observed_tau.get(policy, 1.0 + float(np.cumprod(self.acceptance).sum()))
            # A limited row keeps the share of the extra tokens its limit allows (a rough scale).
            return 1.0 + (tau - 1.0) * limit / max(self.block - 1, 1)
        return 1.0 + float(np.cumprod(self.acceptance[: min(drafts, limit)]).sum())

    def seconds_per_call(self, policy: str, rows: int, attend: int) -> float | None:
        """The policy's own measured cost at this shape once it ran there; before that its start-up
        time scaled by the drift every policy's calls measured at the shape."""
        own = self.own_s.get((policy, rows, attend))
        if own is not None:
            return own
        base = self.startup_s.get((policy, rows))
        if base is None:
            return None
        return base * self.drift.get((rows, attend), 1.0)

    def predicted(self, rows: int, attend, limits: Sequence[int]) -> dict[str, float]:
        """Committed tokens per second of every ready policy with a cost at this shape (under a TPOT
        SLO, goodput: those of the rows predicted to meet it). attend: the attention length, or a
        mapping from policy to the length it would run at (a policy that writes fewer slots per step
        fits a shorter one)."""
        throughput, goodput = {}, {}
        slo = self.config.tpot_slo_s
        for policy in sorted(self.ready):
            seconds = self.seconds_per_call(policy, rows, attend if isinstance(attend, int) else attend[policy])
            if seconds:
                rates = [self.tokens_per_row_step(policy, limit) * self.steps_per_call / seconds for limit in limits]
                throughput[policy] = sum(rates)
                goodput[policy] = sum(r for r in rates if slo is not None and 1.0 / r <= slo)
        return goodput if slo is not None and any(goodput.values()) else throughput

    # ---- what an earlier run learned ----

    def priors(self) -> dict:
        """What this run measured of acceptance and of each policy's start-up cost, for the next
        start on this machine and model. What it did not measure itself (a position no step
        reached, a policy it never compiled, as under `--compile-rest while-idle`) it passes on
        from the priors it loaded, so one short run does not erase what the runs before it learnt."""
        acceptance = [float(c) if seen else loaded
                      for c, seen, loaded in zip(self.acceptance, self.acceptance_seen, self.loaded_acceptance)]
        startup = {**self.cached_startup_s, **self.startup_s}
        return {"block": self.block, "acceptance": acceptance, "observed_tau": dict(self.observed_tau),
                "startup_s": [[policy, rows, seconds] for (policy, rows), seconds in sorted(startup.items())]}

    def load_priors(self, priors: dict) -> bool:
        """Start from an earlier run's acceptance in place of the 0.5 no-opinion prior. They stay
        priors: the first observation of each position replaces its value outright. False when
        they are for another block size, and so ignored."""
        if priors.get("block") != self.block:
            return False
        for j, value in enumerate(priors.get("acceptance", [])[: len(self.acceptance)]):
            if value is not None:
                self.acceptance[j] = self.loaded_acceptance[j] = value
        self.observed_tau.update({p: t for p, t in priors.get("observed_tau", {}).items() if p in self.policies})
        self.cached_startup_s = {(policy, int(rows)): float(seconds) for policy, rows, seconds in
                                 priors.get("startup_s", []) if policy in self.policies}
        return True

    def cached_costs(self, policy: str, row_buckets: Sequence[int]) -> dict[int, float] | None:
        """The policy's start-up cost per live-row bucket as the last run on this machine measured
        it, or None where any is missing."""
        cached = {rows: self.cached_startup_s.get((policy, rows)) for rows in row_buckets}
        return None if None in cached.values() else cached

    def choose_cached_start(self, row_buckets: Sequence[int], attend: int) -> bool:
        """Before anything is compiled: start on the policy the last run's measured costs and
        acceptance predict fastest for one live row (as choose_start does once every policy is
        timed). False, and the start unchanged, where the cache lacks a policy's costs."""
        cached = {p: self.cached_costs(p, row_buckets) for p in self.policies}
        if None in cached.values():
            return False
        startup, ready = self.startup_s, self.ready
        self.startup_s = {(p, rows): s for p, costs in cached.items() for rows, s in costs.items()}
        self.ready = set(self.policies)
        try:
            self.choose_start(row_buckets[0], attend)
        finally:
            self.startup_s, self.ready = startup, ready
        return True

    def load_priors_file(self, path: Path) -> bool:
        """load_priors from a file save_priors_file wrote; False if there is none, or it is damaged
        (a lost prior, not an error) or ignored."""
        try:
            return self.load_priors(json.loads(path.read_text()))
        except (OSError, ValueError, AttributeError):
            return False

    def save_priors_file(self, path: Path) -> None:
        """Keep this run's acceptance and start-up costs for the next start (nothing when it has
        neither); the file is replaced whole, so a crash mid-write leaves the last one."""
        if not self.calls and not self.startup_s:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(".partial")
            partial.write_text(json.dumps(self.priors()))
            partial.replace(path)
        except OSError:
            log.warning("could not keep the controller's acceptance in %s", path, exc_info=True)

    def choose_start(self, rows: int, attend: int) -> str:
        """Once every policy is ready and timed: serve first the one predicted fastest at this shape,
        by the measured start-up costs and the acceptance priors, instead of always the longest chain."""
        values = self.predicted(rows, attend, [self.block - 1] * rows)
        if values:
            self.current = max(values, key=values.get)
        return self.current

    # ---- the decision ----

    def pin(self, policy: str | None) -> None:
        """Serve this policy whatever the estimates (a request's method override), or unpin."""
        if policy is not None and policy not in self.policies:
            raise SpecjaxError(f"policy {policy!r} is not compiled on this server; compiled: {', '.join(self.policies)}")
        self.pinned = policy

    def decide(self, rows: int, attend, limits: Sequence[int]) -> Decision:
        """The policy for the next call. rows: the live-row bucket it runs at; attend: its attention
        length (or one per policy, as `predicted` takes); limits: each live row's draft limit (None
        for no limit)."""
        values = self.predicted(rows, attend, limits)
        per_step = lambda p: sum(self.tokens_per_row_step(p, l) for l in limits)  # noqa: E731
        if self.pinned is not None and self.pinned in self.ready:
            return self._switch(self.pinned, "pinned", per_step, values)
        if self.current not in self.ready:
            ready = [p for p in self.policies if p in self.ready]
            if not ready:
                return Decision(self.current, "start", per_step(self.current), values)
            return self._switch(max(ready, key=lambda p: values.get(p, 0.0)), "ready", per_step, values)
        # Probe: one call of a policy whose estimates have gone stale (or that never ran).
        every = self.config.probe_every
        if rows != self._last_rows:  # a new load: every estimate may have moved
            self.probe_interval.clear()
            self._last_rows = rows
        if every:
            current = values.get(self.current, 0.0)

            def interval(p):
                if p in values and values[p] < self.config.probe_floor * current:
                    return 16 * every
                return self.probe_interval.get(p, every)

            def last_run(p):  # a policy never run is due at once only when nothing estimates it
                return self.last_run.get(p, 0 if self._estimated(p) else -interval(p))

            stale = [p for p in sorted(self.ready) if p != self.current and self.calls - last_run(p) >= interval(p)]
            if stale:
                probe = min(stale, key=lambda p: self.last_run.get(p, -10**9))
                self.last_run[probe] = self.calls  # so the probe is not repeated before it reports
                if probe in values and values[probe] < current:
                    self.probe_interval[probe] = min(2 * interval(probe), 16 * every)  # it lost last time too
                return self._decided(probe, "probe", per_step, values, count=True, keep_current=True)
        best = max(values, key=values.get) if values else self.current
        current_value = values.get(self.current, 0.0)
        margin = self.config.margin_to_fewer if self._rank(best) < self._rank(self.current) else self.config.margin
        if best != self.current and values[best] > (1 + margin) * current_value:
            self._wins = self._wins + 1 if best == self._challenger else 1
            self._challenger = best
            if self._wins >= self.config.patience:
                self._wins, self._challenger = 0, None
                return self._switch(best, "faster", per_step, values)
        else:
            self._wins, self._challenger = 0, None
        return Decision(self.current, "hold", per_step(self.current), values)

    def _switch(self, policy, reason, per_step, values) -> Decision:
        return self._decided(policy, reason, per_step, values, count=policy != self.current)

    def _decided(self, policy, reason, per_step, values, count: bool, keep_current: bool = False) -> Decision:
        if count:
            self.switches[reason] = self.switches.get(reason, 0) + 1
        if not keep_current:
            self.current = policy
        return Decision(policy, reason, per_step(policy), values)
