"""A server's compiled programs: one step per (policy, attention length, live rows), one insert per
(prompt bucket, insert rows), one chunked-prefill extend and, for rapid servers, one drafting-context
fill per (drafting bucket, insert rows). Compiled at start-up, so nothing recompiles under load, with
a progress line per program; looked up by the scheduler at every device call.
"""

from __future__ import annotations

import sys
import time
from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from specjax.compile_cache import compile_or_load
from specjax.decode import slots as slot_api
from specjax.serve.shapes import ServingShapes
from specjax.sharding import build_state, shard_state

_JITTED: dict[tuple, Any] = {}
"""Programs.program's jitted slot programs, by kind, static arguments and state layout, kept per
process so servers of the same shapes share jit's cache and compile each shape once."""

_FUNCTIONS: dict[str, Callable] = {"step": slot_api.step, "insert": slot_api.insert, "move_row": slot_api.move_row,
                                   "put_row": slot_api.put_row, "take_row": slot_api.take_row,
                                   "refresh_drafting": slot_api.refresh_drafting}
# move_row(state, source, target) and put_row(state, row, target) donate the state, argument 0;
# take_row(state, slot) only reads it; the others take (parts, state, ...).
_DONATED = {"move_row": 0, "put_row": 0, "take_row": ()}


class CompileProgress:
    """One stderr line per compiled program (which one, k of n, seconds so far), flushed at once so
    a log file shows a long compile as progress rather than a hang."""

    def __init__(self, total: int, what: str):
        self.total, self.what, self.count, self.started = total, what, 0, time.perf_counter()

    def done(self, program: str) -> None:
        self.count += 1
        print(f"[specjax] compiling {self.what}: {self.count}/{self.total} ({program}), "
              f"{time.perf_counter() - self.started:.1f} s", file=sys.stderr, flush=True)


class Programs:
    """The slot programs of one server's shapes and device layout, compiled ahead or on first use."""

    def __init__(self, shapes: ServingShapes, parts: slot_api.SlotParts, mesh: Mesh | None):
        self.shapes, self.statics, self.parts, self.mesh = shapes, shapes.statics, parts, mesh
        self.compiled: dict[tuple, Any] = {}
        """Ahead-of-time compiled executables by ("step", policy, attend, rows), ("insert", bucket,
        rows), ("extend",) and ("drafting", bucket, rows)."""
        state = self.fresh_state()
        # Programs are lowered against the state's shapes and layout, not a second copy of its buffers.
        self.state_shape = jax.tree.map(lambda a: jax.ShapeDtypeStruct(
            a.shape, a.dtype, sharding=a.sharding, weak_type=a.weak_type), state)
        # Over a mesh every program hands the state back in the layout it was given, so one
        # compiled executable per shape serves every call (GSPMD would otherwise choose each output's).
        self._pinned = {} if mesh is None else {"out_shardings": jax.tree.map(lambda a: a.sharding, state)}
        # The layout as a hashable key of _JITTED, flattened once rather than at every lookup.
        self._layout = None if mesh is None else (jax.tree.structure(self._pinned["out_shardings"]),
                                                  tuple(jax.tree.leaves(self._pinned["out_shardings"])))
        del state

    # ---- states and arguments in the server's layout ----

    def fresh_state(self) -> slot_api.SlotState:
        """Every slot free, built on the mesh's devices when there is one."""
        return build_state(self.mesh, slot_api.empty_slots, self.statics)

    def placed(self, batch_major):
        """A slot state or insert request (every leaf batch-major) in the mesh's layout."""
        return batch_major if self.mesh is None else shard_state(batch_major, self.mesh)

    def insert_request(self, rows, prompts, lengths, max_new, seeds, temperature, top_k, top_p, final=(True,),
                       offsets=None, limits=None) -> slot_api.InsertRequest:
        """An insert's arguments, one entry per row: prompts [R, W] padded, the rest [R]."""
        limits = [self.statics.block - 1] * len(rows) if limits is None else limits
        return self.placed(slot_api.InsertRequest(
            draft_limit=jnp.asarray(limits, jnp.int32),
            final=jnp.asarray(final, bool), offsets=None if offsets is None else jnp.asarray(offsets, jnp.int32),
            rows=jnp.asarray(rows, jnp.int32), prompts=jnp.asarray(prompts, jnp.int32),
            prompt_lengths=jnp.asarray(lengths, jnp.int32), max_new_tokens=jnp.asarray(max_new, jnp.int32),
            seeds=jnp.asarray(seeds, jnp.uint32),
            sampling=slot_api.RowSampling(jnp.asarray(temperature, jnp.float32), jnp.asarray(top_k, jnp.int32),
                                          jnp.asarray(top_p, jnp.float32))))

    def drafting_fill_arguments(self, rows, prompts, width: int) -> tuple:
        """refresh_drafting's arguments after (state): rows [R], drafting prompts padded to width
        [R, W] and their lengths [R], placed on the server's devices."""
        padded = slot_api.token_rows(prompts, width)
        return self.placed((jnp.asarray(rows, jnp.int32), jnp.asarray(padded, jnp.int32),
                            jnp.asarray([len(p) for p in prompts], jnp.int32)))

    # ---- lookup ----

    def program(self, kind: str, **static):
        """The jitted step, insert, move_row, put_row, take_row or refresh_drafting with these static
        arguments, the state donated (take_row only reads it) and, over a mesh, its layout pinned."""
        key = (kind, self._layout, *sorted(static.items()))
        if key not in _JITTED:
            pinned = {} if kind == "take_row" else self._pinned  # its output is one row, not the state
            _JITTED[key] = jax.jit(partial(_FUNCTIONS[kind], **static), donate_argnums=_DONATED.get(kind, 1), **pinned)
        return _JITTED[key]

    def _compiled(self, kind: str, args: tuple, **static):
        """The program compiled for args, or on one device loaded from the executable store (a warm
        start then neither traces nor compiles it); every program here returns the slot state."""
        jitted = self.program(kind, **static)
        if self.mesh is not None:  # a layout over several devices: compiled (jax's cache still applies)
            return jitted.lower(*args).compile()
        return compile_or_load(jitted, kind, repr(sorted(static.items())), args, out_like=self.state_shape)

    def step(self, policy: str, attend: int, rows: int):
        """(parts, state) -> state: `steps_per_sync` steps of `policy` over the first `rows` slots."""
        return self.compiled.get(("step", policy, attend, rows)) or self.program(
            "step", method=policy, statics=self.statics, attend_slots=attend, rows=rows)

    def insert(self, key: tuple):
        """(parts, state, InsertRequest) -> state, for ("insert", bucket, rows) or ("extend",)."""
        return self.compiled.get(key) or self.program("insert", statics=self.statics)

    def drafting_fill(self, bucket: int, rows: int):
        """(parts, state, rows, prompts, lengths) -> state: fill drafting contexts (rapid servers)."""
        return self.compiled.get(("drafting", bucket, rows)) or self.program("refresh_drafting", statics=self.statics)

    # ---- ahead-of-time compilation ----

    def compile_steps(self, policy: str, progress: CompileProgress | None = None,
                      before_each: Callable[[], None] | None = None) -> None:
        """The policy's step at every (attention length, live-row bucket); before_each runs ahead
        of each compile (a background compiler waits there for the server to be idle)."""
        shapes = self.shapes
        progress = progress or CompileProgress(len(shapes.attend_buckets) * len(shapes.row_buckets),
                                               f"the {policy} step")
        for attend in shapes.attend_buckets:
            for rows in shapes.row_buckets:
                if before_each is not None:
                    before_each()
                self.compiled["step", policy, attend, rows] = self._compiled(
                    "step", (self.parts, self.state_shape), method=policy, statics=self.statics,
                    attend_slots=attend, rows=rows)
                progress.done(f"{policy} step, attention {attend}, {rows} rows")

    def compile_inserts(self, progress: CompileProgress) -> None:
        """One insert per (prompt bucket, insert rows), and the chunked prefill's extend."""
        slots = self.statics.slot.slots
        for rows in self.shapes.insert_sizes:
            for bucket in self.shapes.prompt_buckets:
                request = self.insert_request([slots] * rows, np.zeros((rows, bucket)), [1] * rows, [1] * rows,
                                              [0] * rows, [0.0] * rows, [0] * rows, [1.0] * rows, final=[True] * rows)
                self.compiled["insert", bucket, rows] = self._compiled(
                    "insert", (self.parts, self.state_shape, request), statics=self.statics)
                progress.done(f"insert, prompts up to {bucket} tokens, {rows} at once")
        chunk = self.shapes.prefill_chunk
        if chunk:
            request = self.insert_request([slots], np.zeros((1, chunk)), [1], [1], [0], [0.0], [0], [1.0], offsets=[0])
            self.compiled["extend",] = self._compiled("insert", (self.parts, self.state_shape, request),
                                                      statics=self.statics)
            progress.done(f"chunked prefill, {chunk} tokens")

    def inserts_to_compile(self) -> int:
        return len(self.shapes.insert_sizes) * len(self.shapes.prompt_buckets) + bool(self.shapes.prefill_chunk)

    def compile_drafting_fills(self, stopping: Callable[[], bool]) -> None:
        """One drafting-context fill per (drafting bucket, insert size): a rapid server fills that
        context apart from the insert. A prefill whose fill is not compiled yet compiles it then."""
        started = time.perf_counter()
        slots = self.statics.slot.slots
        for rows in self.shapes.insert_sizes:
            for bucket in self.shapes.drafting_buckets:
                if stopping():
                    return
                arguments = self.drafting_fill_arguments([slots] * rows, [(0,)] * rows, bucket)
                self.compiled["drafting", bucket, rows] = self._compiled(
                    "refresh_drafting", (self.parts, self.state_shape, *arguments), statics=self.statics)
        print(f"[specjax] drafting-context fills ready: {len(self.shapes.drafting_buckets)} drafting buckets x "
              f"{len(self.shapes.insert_sizes)} insert sizes in {time.perf_counter() - started:.1f} s",
              file=sys.stderr, flush=True)

    # ---- timing ----

    def time_policy(self, policy: str, max_new_tokens: int, first_runs: bool) -> dict[int, float]:
        """Seconds of one call of `policy` per live-row bucket, at the shortest attention length
        with every row live and half of it filled. first_runs: run every other compiled shape once
        first (a compiled program's first run is slower). Call it holding the device."""
        shapes = self.shapes
        attend = shapes.attend_buckets[0]
        calls = self.statics.slot.steps_per_sync
        filled = max(1, min(attend // 2, attend - calls * shapes.step_slack - 1))
        reset = lambda st: self.placed(st.replace(  # noqa: E731
            lengths=jnp.full_like(st.lengths, filled), done=jnp.zeros_like(st.done),
            num_generated=jnp.zeros_like(st.num_generated)))
        scratch = self.fresh_state()
        scratch = reset(scratch.replace(max_new_tokens=jnp.full_like(scratch.max_new_tokens, max_new_tokens)))
        if first_runs:
            for length in shapes.attend_buckets[1:]:
                for rows in shapes.row_buckets:
                    scratch = reset(self.step(policy, length, rows)(self.parts, scratch))
        costs = {}
        for rows in shapes.row_buckets:
            run = self.step(policy, attend, rows)
            scratch = reset(run(self.parts, scratch))  # warm (and, if not compiled ahead, compile)
            jax.block_until_ready(scratch.lengths)
            started = time.perf_counter()
            scratch = run(self.parts, scratch)
            jax.block_until_ready(scratch.lengths)
            costs[rows] = time.perf_counter() - started
            scratch = reset(scratch)
        return costs
