"""Before a server serves: its programs compiled (serve/programs.py) with progress lines, each
adaptive policy timed per live-row bucket and handed to the controller, the chains' phase split
measured, and the start policy chosen once every policy is timed. An adaptive server compiles its
start policy first and the others on a background thread; a rapid server's drafting-context fills
go to that thread too."""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Callable

from specjax.decode import slots as slot_api
from specjax.serve.config import ServeConfig
from specjax.serve.controller import Controller
from specjax.serve.programs import CompileProgress, Programs
from specjax.serve.reporting import StepReporter

log = logging.getLogger("specjax.serve")


class _Stopped(Exception):
    """The server is shutting down: the background compiler leaves between two programs."""


class Warmup:
    """Compiles and times a server's programs; `compile` at start-up, `wait_compiled` for readiness."""

    def __init__(self, programs: Programs, controller: Controller, reporter: StepReporter, config: ServeConfig,
                 device_lock: threading.Lock, stopping: Callable[[], bool], priors_loaded: bool,
                 idle: Callable[[], bool] = lambda: True, rest_while_idle: bool = False):
        """device_lock: held while timing, so serving and measuring do not share the cores;
        stopping: True once the server shuts down (the background compiler then stops);
        idle: True while no request is running or waiting; rest_while_idle: compile the other
        policies only then (the server's compile_rest, decided)."""
        self.programs, self.controller, self.reporter, self.config = programs, controller, reporter, config
        self.shapes, self.statics, self.parts = programs.shapes, programs.statics, programs.parts
        self.policies = programs.shapes.policies
        self._device_lock, self._stopping, self.priors_loaded = device_lock, stopping, priors_loaded
        self._idle, self.rest_while_idle = idle, rest_while_idle
        self.idle_waits = 0
        """Times the background compiler waited for the server to go idle (compile_rest "while_idle")."""
        self.compile_seconds = 0.0
        """Seconds the start-up compile took (the start policy's steps and every insert)."""
        self._compiler: threading.Thread | None = None
        self._timed: set[str] = set()
        """Policies timed by this start (the others took the last run's costs on this machine)."""

    def make_ready(self, policy: str, compile_steps: bool = True, progress: CompileProgress | None = None,
                   while_idle: bool = False, costs: dict[int, float] | None = None, in_background: bool = False) -> None:
        """Compile the policy's steps, time one call of it per live-row bucket (at the shortest
        attention length, with every row live), and hand both to the controller. while_idle: each
        compile and the timing wait until no request is running or waiting. costs: the last run's
        timings on this machine, used instead of timing now.
        in_background: on the background compiler, which leaves between programs at shut-down."""
        between = (lambda: self._between_programs(while_idle)) if in_background else None
        if compile_steps:
            self.programs.compile_steps(policy, progress, between)
        if between is not None:
            between()
        if len(self.policies) == 1:  # a fixed method: nothing to choose, so nothing to time
            self.controller.mark_ready(policy, {})
            return
        if costs is not None:
            self.controller.mark_ready(policy, costs)
            return
        with self._device_lock:
            costs = self.programs.time_policy(policy, self.config.max_new_tokens, first_runs=compile_steps)
        self._timed.add(policy)
        self.controller.mark_ready(policy, costs)
        log.info("policy %s ready: %s s per call by live-row bucket", policy,
                 ", ".join(f"{r}: {c:.3f}" for r, c in costs.items()))

    def _between_programs(self, while_idle: bool) -> None:
        """Where the background compiler may pause (for idleness) or leave (at shut-down): a process
        that exits while a thread is inside XLA aborts ('FATAL: exception not rethrown')."""
        if while_idle:
            self._wait_for_idle()
        if self._stopping():
            raise _Stopped

    def _wait_for_idle(self) -> None:
        """Return once the server has no request running or waiting (or is stopping)."""
        if self._idle() or self._stopping():
            return
        self.idle_waits += 1
        while not (self._idle() or self._stopping()):
            time.sleep(0.05)

    def _compile_rest(self, policies: tuple[str, ...]) -> None:
        started = time.perf_counter()
        while_idle = self.rest_while_idle
        for policy in policies:
            try:  # the last run's costs where this machine has them: a warm start then only loads
                self.make_ready(policy, while_idle=while_idle, in_background=True,
                                costs=self.controller.cached_costs(policy, self.shapes.row_buckets))
            except _Stopped:
                return
            except Exception:  # noqa: BLE001 - a policy that fails to compile is left out, not fatal
                log.exception("policy %s failed to compile; the controller will not use it", policy)
        # Timings taken while other policies compiled shared the cores with XLA: time those policies
        # again now, with only serving running (which the device lock holds off meanwhile).
        try:
            for policy in sorted(self._timed & self.controller.ready):
                self.make_ready(policy, compile_steps=False, while_idle=while_idle, in_background=True)
        except _Stopped:
            return
        # The first requests arrive one at a time: start on what is fastest for one live row.
        start = self.controller.choose_start(self.shapes.row_buckets[0], self.shapes.attend_buckets[0])
        print(f"[specjax] adaptive: {len(self.controller.ready)} policies ready "
              f"({', '.join(sorted(self.controller.ready))}); the rest compiled in the background in "
              f"{time.perf_counter() - started:.1f} s; starting on {start} (measured costs, "
              f"{'acceptance from the last run' if self.priors_loaded else 'no acceptance measured yet'})",
              file=sys.stderr, flush=True)

    def _compile_later(self, rest: tuple[str, ...]) -> None:
        """The background compiler: drafting-context fills first (the next requests' prefills need
        them), then the adaptive controller's other policies."""
        try:
            self._measure_phases()
        except _Stopped:
            return
        try:
            if self.shapes.drafting_buckets:
                self.programs.compile_drafting_fills(self._stopping)
        except Exception:  # noqa: BLE001 - prefills compile a missing fill on first use instead
            log.exception("compiling the drafting-context fills failed; prefills will compile them on first use")
        if rest:
            self._compile_rest(rest)

    def _measure_phases(self) -> None:
        """The chains' split of a step into drafting, refining and verifying, for the monitor. It
        compiles small programs of its own (seconds on a warm start, where the server's programs only
        load), so it runs on the background compiler, while idle where the rest compile so."""
        chains = [slot_api.slot_method(p) for p in self.policies]
        chains = [m for m in chains if m.needs_drafter and not m.needs_tree]
        if not chains:  # trees split by their latency model
            return
        self._between_programs(self.rest_while_idle)
        with self._device_lock:
            self.reporter.phase_seconds = slot_api.measure_phase_seconds(self.parts, self.statics,
                                                                         any(m.needs_refiner for m in chains))

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Block until the background compiler is done (True), or timeout seconds pass (False)."""
        if self._compiler is not None:
            self._compiler.join(timeout)
            return not self._compiler.is_alive()
        return True

    def compile(self, background: bool = True) -> None:
        """Compile the steps and one insert per prompt bucket now, so no request waits for XLA. An
        adaptive server compiles its start policy here and the others on a background thread
        (background=False: here too); the controller uses a policy only once it is compiled. A
        rapid server's drafting-context fills go to that thread too, ahead of any other policy: the
        server answers sooner, and a prefill that comes before its fill compiles it then."""
        started = time.perf_counter()
        shapes, start = self.shapes, self.controller.current
        progress = CompileProgress(len(shapes.attend_buckets) * len(shapes.row_buckets)
                                   + self.programs.inserts_to_compile(), "the server's programs")
        # The last run's timings of each policy, where this machine's cache has them: a warm start
        # loads its programs and times nothing (the controller's own per-call measurements and its
        # probes correct the costs as it serves); a policy timed now is timed again once the rest
        # are compiled.
        self.make_ready(start, progress=progress, costs=self.controller.cached_costs(start, shapes.row_buckets))
        self.programs.compile_inserts(progress)
        self.compile_seconds = time.perf_counter() - started
        print(f"[specjax] serving {self.config.method} on {self.config.slots} slots: compiled the {start} step "
              f"for {len(shapes.attend_buckets)} attention lengths ({', '.join(map(str, shapes.attend_buckets))}) and "
              f"{len(shapes.prompt_buckets)} prompt buckets ({', '.join(map(str, shapes.prompt_buckets))}) in "
              f"{self.compile_seconds:.1f} s", file=sys.stderr, flush=True)
        rest = tuple(p for p in self.policies if p != start)
        if (rest or shapes.drafting_buckets) and background:
            self._compiler = threading.Thread(target=self._compile_later, args=(rest,), name="specjax-compile",
                                              daemon=True)
            self._compiler.start()
        else:
            self._compile_later(rest)
        dtype = self.statics.target_config.dtype
        if dtype != "float32":
            # Measured: 3 of 12 held-out prompts (BENCHMARKS.md, "32 slots in bf16").
            print(f"[specjax] {dtype} compute: a row's rounding depends on the rows sharing its "
                  "step, so a greedy request can differ from the same prompt decoded alone (float32's differences "
                  "are ulps, which no measured prompt's tokens showed)", file=sys.stderr, flush=True)
