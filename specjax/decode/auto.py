"""The auto method's choice: AR, chain or tree, step by step, by expected tokens per second.

Whether speculation pays depends on the machine as much as on the drafter: on a CPU without fast
small-row dots (AVX2 only) verifying 8 rows costs about 2.7 decode steps, so a drafter accepted at
tau 1.6 loses to plain decoding there, and wins where a verify costs about one step. So auto
weighs, before every step, the measured cost of each policy's step against its measured yield:

    value(policy) = tokens a live row commits per step / seconds per step

- Seconds per step come from the tree budget rule's latency model (decode/budget.py), measured on
  this machine for this model and shape: AR is one decode step, C(1); a chain pays the drafting pass
  and a verify of its block, T_fixed + C(block); a tree T_fixed + C(n) at the size it chose. AR
  pays no drafting cost, which is the budget rule's "no speculation" option.
- Tokens per step are moving averages of what each speculative policy committed when it ran (AR
  commits 1). The first steps run each speculative policy once, so both are measured on this run's
  own prompts, and while AR runs, the best speculative policy is probed every `probe_every` steps.
  A probe that still loses to AR doubles the interval (up to `max_probe_factor` times), so where
  speculation cannot pay, probing costs little; a probe that wins resets it.
- A policy that speculates more must be predicted `margin` faster to take over, so near a tie auto
  settles on less speculation (as the adaptive server does, serve/controller.py).

Every policy is exact, so switching at any step is too.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.errors import SpecjaxError, check_at_least

AUTO_POLICIES = ("ar", "chain", "tree")
"""The policies auto chooses among, in order of how much they speculate."""


@dataclasses.dataclass(frozen=True)
class AutoConfig:
    """How the auto method chooses its policy at each step."""

    ema: float = 0.25
    """Weight of the newest step in each policy's moving average of tokens per step."""
    margin: float = 0.08
    """A policy that speculates more than the current one must be predicted this much faster."""
    probe_every: int = 32
    """While AR runs, steps between two probes of the best speculative policy (0: never probe)."""
    max_probe_factor: int = 64
    """A probe that still loses to AR doubles the interval, up to this many times probe_every. A
    probe call costs about a third of a call more where speculation loses (`AutoMemory`), so the
    cap keeps that under a few percent of the time; a winning probe resets the interval at once."""

    def __post_init__(self):
        if not 0.0 < self.ema <= 1.0:
            raise SpecjaxError(f"auto ema must be in (0, 1], got {self.ema}")
        if not 0.0 <= self.margin < 1.0:
            raise SpecjaxError(f"auto margin must be in [0, 1), got {self.margin}")
        check_at_least(0, probe_every=self.probe_every)
        check_at_least(1, max_probe_factor=self.max_probe_factor)


@struct.dataclass
class AutoState:
    """What auto has measured in this batch so far (batch-wide, like the step it chooses)."""

    tokens_per_step: jax.Array
    """[P] float32: moving average of tokens a live row commits per step, per policy (AR: 1)."""
    tree_seconds: jax.Array
    """[] float32: moving average of the tree step's predicted seconds at the sizes it chose."""
    current: jax.Array
    """[] int32: the policy of the last step (an index into AUTO_POLICIES)."""
    idle: jax.Array
    """[] int32: steps since a speculative policy last ran."""
    steps: jax.Array
    """[P] int32: steps each policy ran."""
    probe_factor: jax.Array
    """[] int32: the probe interval is probe_every times this (1 after a winning probe)."""

    @classmethod
    def fresh(cls) -> "AutoState":
        count = len(AUTO_POLICIES)
        return cls(tokens_per_step=jnp.ones((count,), jnp.float32), tree_seconds=jnp.zeros((), jnp.float32),
                   current=jnp.zeros((), jnp.int32), idle=jnp.zeros((), jnp.int32),
                   steps=jnp.zeros((count,), jnp.int32), probe_factor=jnp.ones((), jnp.int32))


def policy_seconds(auto: AutoState, costs, block: int) -> jax.Array:
    """[P] predicted seconds of one step of each policy, from the latency model `costs` (TreeCosts)."""
    ar = costs.verify_cost(jnp.int32(1))
    chain = costs.fixed_s + costs.verify_cost(jnp.int32(block))
    tree = jnp.where(auto.tree_seconds > 0, auto.tree_seconds, chain)  # before it ran: a chain's cost
    return jnp.stack([ar, chain, tree]).astype(jnp.float32)


def choose_policy(auto: AutoState, seconds: jax.Array, config: AutoConfig) -> jax.Array:
    """[] int32: the policy of the next step (see the module docstring)."""
    value = auto.tokens_per_step / seconds  # [P]
    speculative = jnp.arange(len(AUTO_POLICIES)) > 0
    unexplored = speculative & (auto.steps == 0)
    best = jnp.argmax(value).astype(jnp.int32)
    # A challenger that speculates more needs the margin; one that speculates less needs only to win.
    needed = jnp.where(best > auto.current, 1.0 + config.margin, 1.0)
    held = jnp.where(value[best] > value[auto.current] * needed, best, auto.current)
    best_speculative = jnp.argmax(jnp.where(speculative, value, -jnp.inf)).astype(jnp.int32)
    probe = (held == 0) & (config.probe_every > 0) & (auto.idle >= config.probe_every * auto.probe_factor)
    chosen = jnp.where(probe, best_speculative, held)
    return jnp.where(unexplored.any(), jnp.argmax(unexplored).astype(jnp.int32), chosen)


def observe(auto: AutoState, policy, committed_per_row, tree_seconds, config: AutoConfig,
            seconds: jax.Array | None = None) -> AutoState:
    """auto after a step of `policy` in which each live row committed committed_per_row tokens on
    average (nan when no row was live), the tree step predicted at tree_seconds. seconds: [P] the
    predicted step costs the choice was made by; with them a probe (a speculative step taken while
    on AR) that still loses to AR doubles the probe interval, and one that wins resets it."""
    seen = jnp.isfinite(committed_per_row)
    first = auto.steps[policy] == 0
    old = auto.tokens_per_step[policy]
    updated = jnp.where(first, committed_per_row, (1 - config.ema) * old + config.ema * committed_per_row)
    tokens = auto.tokens_per_step.at[policy].set(jnp.where(seen & (policy > 0), updated, old))
    is_tree = policy == AUTO_POLICIES.index("tree")
    tree = jnp.where(is_tree & seen, jnp.where(auto.tree_seconds > 0,
                                               (1 - config.ema) * auto.tree_seconds + config.ema * tree_seconds,
                                               tree_seconds), auto.tree_seconds)
    factor = auto.probe_factor
    if seconds is not None:
        probed = (auto.current == 0) & (policy > 0) & (auto.steps[policy] > 0) & seen
        loses = tokens[policy] / seconds[policy] < tokens[0] / seconds[0]
        factor = jnp.where(probed, jnp.where(loses, jnp.minimum(2 * factor, config.max_probe_factor), 1), factor)
    return AutoState(tokens_per_step=tokens, tree_seconds=tree, current=jnp.asarray(policy, jnp.int32),
                     idle=jnp.where(policy > 0, 0, auto.idle + 1), steps=auto.steps.at[policy].add(1),
                     probe_factor=factor.astype(jnp.int32))


class AutoMemory:
    """What auto measured when its last greedy call of each batch size ended, kept on the host by an
    Engine, so that the next such call starts from it instead of exploring from scratch.

    It also decides when a call need not run auto's step at all. Auto's AR branch is dearer than
    plain AR: it keeps the drafter's context current at every step, so that a probe can draft from
    a whole context, and it dispatches between three policies (together 1.3x a plain AR step on the
    AVX2 host, BENCHMARKS.md). So while the measurements say no speculative policy pays and no probe
    falls due within the call, the call runs the plain AR program, and its steps count towards the
    next probe as auto's own AR steps would. A probe then runs in the first call it falls due in."""

    def __init__(self):
        self._states: dict[int, AutoState] = {}  # by batch size; host (numpy) arrays
        self._seconds: dict[int, np.ndarray] = {}  # [P] what the state's last step chose by

    def start(self, batch: int) -> AutoState | None:
        """The state a call of `batch` rows starts from (None: fresh)."""
        return self._states.get(batch)

    def remember(self, batch: int, state: AutoState, seconds: np.ndarray) -> None:
        self._states[batch], self._seconds[batch] = state, np.asarray(seconds, np.float64)

    def seconds(self, batch: int) -> np.ndarray:
        return self._seconds[batch]

    def stays_on_ar(self, batch: int, steps: int, config: AutoConfig) -> bool:
        """Whether a call of `batch` rows and at most `steps` decode steps would run AR throughout:
        `choose_policy` itself, asked as of the call's last step (idle only grows while AR holds),
        picks AR, so every speculative policy was measured, AR holds against the best of them and no
        probe falls due within the call."""
        state = self._states.get(batch)
        if state is None:
            return False
        last = jax.tree.map(jnp.asarray, state.replace(idle=np.asarray(int(state.idle) + steps - 1, np.int32)))
        return int(choose_policy(last, jnp.asarray(self._seconds[batch], jnp.float32), config)) == 0

    def ran_ar(self, batch: int, steps: int) -> AutoState:
        """Count `steps` plain AR steps of a call that stayed on AR as auto's own; the state after."""
        state = self._states[batch]
        counted = np.array(state.steps)
        counted[0] += steps
        self._states[batch] = state.replace(idle=np.asarray(int(state.idle) + steps, np.int32),
                                            steps=counted.astype(np.int32))
        return self._states[batch]
