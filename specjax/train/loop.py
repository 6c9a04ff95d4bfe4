"""A generic training loop: one jitted step with donated state, optax, orbax checkpoints, exact resume.

Resume is exact because nothing the loop consumes depends on history: the batch for step i and the
step's dropout/noise key are pure functions of (seed, i), and the optimizer state is checkpointed
with the params. A run killed after a checkpoint and resumed therefore replays the same losses.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import Mesh

from specjax.errors import SpecjaxError, check_at_least, check_positive_finite
from specjax.sharding import MeshConfig, barrier, is_writer, shard_parameters, shard_state, to_host


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with linear warmup, cosine decay and global-norm clipping."""

    learning_rate: float = 3e-3
    """Peak learning rate, reached at the end of warmup."""
    warmup_steps: int = 100
    """Steps of linear warmup from 0."""
    total_steps: int = 2000
    """Length of the cosine schedule; the rate ends at min_lr_ratio * learning_rate."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay (not applied to norms and biases)."""
    b1: float = 0.9
    """Adam first-moment decay."""
    b2: float = 0.95
    """Adam second-moment decay."""
    clip_norm: float = 1.0
    """Global gradient-norm clip."""

    def __post_init__(self):
        check_positive_finite(learning_rate=self.learning_rate)
        check_at_least(0, warmup_steps=self.warmup_steps, min_lr_ratio=self.min_lr_ratio,
                       weight_decay=self.weight_decay)
        check_at_least(1, total_steps=self.total_steps)

def _tree_norm(tree) -> jax.Array:
    # optax.tree.norm is the current name; older optax (as on some accelerator images) has global_norm.
    tree_api = getattr(optax, "tree", None)
    return tree_api.norm(tree) if hasattr(tree_api, "norm") else optax.global_norm(tree)


def make_schedule(cfg: OptimizerConfig) -> optax.Schedule:
    # optax needs at least one warmup step and one decay step after it; a 1-step run gets both.
    warmup_steps = max(cfg.warmup_steps, 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.learning_rate,
        warmup_steps=warmup_steps,
        decay_steps=max(cfg.total_steps, warmup_steps + 1),
        end_value=cfg.learning_rate * cfg.min_lr_ratio,
    )


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
    def decay_mask(params):
        # Norm scales and biases are 1-D; decaying them towards 0 only hurts.
        return jax.tree.map(lambda p: p.ndim > 1, params)

    return optax.chain(
        optax.clip_by_global_norm(cfg.clip_norm),
        optax.adamw(make_schedule(cfg), b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=decay_mask),
    )


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """How long to train and how often to log, evaluate and checkpoint."""

    steps: int = 2000
    """Train until this global step (a resumed run continues up to it)."""
    seed: int = 0
    """Seeds the data order and every per-step random key."""
    log_every: int = 10
    """Write train metrics every this many steps."""
    eval_every: int = 200
    """Run the evaluation function every this many steps, and once before the first (0: never)."""
    checkpoint_every: int = 200
    """Save an orbax checkpoint every this many steps (and always at the end)."""
    checkpoint_seconds: float = 600.0
    """Also save once this many seconds have passed since the last save, so a slow run (online
    features, a big model) killed at any moment loses at most that much work. One process only: a
    clock-driven save could reach the processes of a multi-host run at different steps."""
    keep_checkpoints: int = 2
    """How many recent checkpoints orbax keeps."""
    progress: bool = True
    """Show a tqdm progress bar."""
    mesh: MeshConfig = MeshConfig()
    """Devices to train over (`--mesh`; specjax/sharding.py): one device by default."""

    def __post_init__(self):
        check_at_least(1, steps=self.steps, log_every=self.log_every, checkpoint_every=self.checkpoint_every,
                       keep_checkpoints=self.keep_checkpoints)
        check_at_least(0, eval_every=self.eval_every)
        check_positive_finite(checkpoint_seconds=self.checkpoint_seconds)


@struct.dataclass
class TrainState:
    step: jax.Array
    """[] int32: optimizer steps taken."""
    params: Any
    opt_state: Any


class MetricsWriter:
    """Metrics to `metrics.jsonl` (one object per line) and TensorBoard event files side by side."""

    def __init__(self, out_dir: Path, resume_step: int = 0):
        from tensorboardX import SummaryWriter

        self.path = out_dir / "metrics.jsonl"
        if self.path.exists():
            # A resumed run replays the steps after its checkpoint; drop their old lines so each step
            # appears once (a run with no checkpoint yet starts over, its step-0 evaluation too).
            kept = [line for line in self.path.read_text().splitlines()
                    if line and resume_step and json.loads(line)["step"] <= resume_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        self.file = open(self.path, "a")
        self.tb = SummaryWriter(str(out_dir / "tensorboard"), purge_step=resume_step + 1 if resume_step else None)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": int(step), **{k: float(v) for k, v in metrics.items()}}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        for key, value in metrics.items():
            self.tb.add_scalar(key, float(value), int(step))

    def close(self) -> None:
        self.file.close()
        self.tb.close()


def read_metrics(out_dir: str | Path) -> list[dict]:
    path = Path(out_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def train(
    loss_fn: Callable[[Any, Any, jax.Array], tuple[jax.Array, dict]],
    init_params: Any,
    batch_fn: Callable[[int], Any],
    out_dir: str | Path,
    optimizer: OptimizerConfig = OptimizerConfig(),
    loop: LoopConfig = LoopConfig(),
    eval_fn: Callable[[Any], dict[str, float]] | None = None,
) -> tuple[Any, list[float]]:
    """Train `init_params` to minimise loss_fn(params, batch, rng) -> (loss, aux metrics).

    batch_fn(step) must be a pure function of the step so that resuming is exact. Resumes
    automatically from the latest checkpoint in out_dir/checkpoints. Returns (params, losses of the
    steps run in this call).

    On a mesh of more than one device (loop.mesh): parameters and optimizer moments are
    placed by the sharding rules (FSDP slices over `fsdp`, tensor-parallel splits over `model`),
    each batch is split over `data` and `fsdp`, and checkpoints are written and read sharded, so a
    run resumes on a mesh of another shape.

    With several processes (jax.distributed), every process runs this with the same arguments and
    out_dir on a filesystem they share; process 0 alone writes the metrics, and the params come
    back whole, as numpy, on every process."""
    # Kept whole (over 80 lines, a sixth of them this docstring): the resume, the step loop and the
    # checkpoint and evaluation cadence share one checkpoint manager, one optimizer state and one
    # step counter; split, they would pass those back and forth at every step.
    import orbax.checkpoint as ocp
    from tqdm.auto import tqdm

    out_dir = Path(out_dir).absolute()
    out_dir.mkdir(parents=True, exist_ok=True)
    tx = make_optimizer(optimizer)
    schedule = make_schedule(optimizer)
    mesh = loop.mesh.build() if loop.mesh.size > 1 else None
    state = _initial_state(init_params, tx, mesh)
    manager = ocp.CheckpointManager(
        out_dir / "checkpoints",
        options=ocp.CheckpointManagerOptions(max_to_keep=loop.keep_checkpoints, create=True),
    )
    state, start = _resumed(manager, state, out_dir)
    train_step = _compiled_train_step(loss_fn, tx, state, mesh)
    if mesh is not None:
        batch_fn = _placed_batches(batch_fn, mesh)

    # Process 0 alone writes metrics and draws the progress bar; every process computes them.
    writer = MetricsWriter(out_dir, resume_step=start) if is_writer() else None
    base_key = jax.random.key(loop.seed)
    losses: list[float] = []
    bar = tqdm(total=loop.steps, initial=start, desc="train", disable=not (loop.progress and is_writer()),
               dynamic_ncols=True)
    started = last_save = time.perf_counter()
    by_clock = jax.process_count() == 1
    try:
        if eval_fn is not None and loop.eval_every and start == 0:  # a learning curve starts where training does
            evaluated = eval_fn(state.params)
            if writer is not None:
                writer.write(0, {f"eval/{k}": v for k, v in evaluated.items()})
        for step in range(start, loop.steps):
            batch = batch_fn(step)
            state, metrics = train_step(state, batch, jax.random.fold_in(base_key, step))
            done = step + 1
            loss = float(metrics["loss"])
            if not math.isfinite(loss):
                raise SpecjaxError(f"loss became {loss} at step {done}; lower the learning rate")
            losses.append(loss)
            bar.update(1)
            if done % loop.log_every == 0 or done == loop.steps:
                if writer is not None:
                    writer.write(done, {**{k: float(v) for k, v in metrics.items()},
                                        "learning_rate": float(schedule(step)),
                                        "elapsed_s": time.perf_counter() - started})
                bar.set_postfix(loss=f"{loss:.4f}")
            if eval_fn is not None and loop.eval_every and (done % loop.eval_every == 0 or done == loop.steps):
                evaluated = eval_fn(state.params)
                if writer is not None:
                    writer.write(done, {f"eval/{k}": v for k, v in evaluated.items()})
            overdue = by_clock and time.perf_counter() - last_save >= loop.checkpoint_seconds
            if done % loop.checkpoint_every == 0 or done == loop.steps or overdue:
                manager.save(done, args=ocp.args.StandardSave(_as_dict(state)))
                last_save = time.perf_counter()
        manager.wait_until_finished()
    finally:
        bar.close()
        if writer is not None:
            writer.close()
        manager.close()
    return _whole_params(state, out_dir), losses


def _whole_params(state: TrainState, out_dir: Path):
    """The trained params; over several processes, whole on every host, once process 0 has closed
    the metrics file (no process can read another's slices)."""
    if jax.process_count() == 1:
        return state.params
    params = to_host(state.params)
    barrier(f"specjax/trained/{out_dir}")
    return params


def _initial_state(init_params, tx, mesh: Mesh | None) -> TrainState:
    """Step 0: the parameters and fresh optimizer moments, placed by the sharding rules on a mesh."""
    if mesh is None:
        return TrainState(step=jnp.int32(0), params=init_params, opt_state=tx.init(init_params))
    # Moments follow their parameters' rules (same paths) and are made on their devices, never
    # whole on one (they are twice the weights); the step counter is replicated.
    params = shard_parameters(init_params, mesh)
    moments = shard_parameters(jax.eval_shape(tx.init, params), mesh)
    opt_state = jax.jit(tx.init, out_shardings=jax.tree.map(lambda a: a.sharding, moments))(params)
    return shard_parameters(TrainState(step=jnp.int32(0), params=params, opt_state=opt_state), mesh)


def _resumed(manager, state: TrainState, out_dir: Path) -> tuple[TrainState, int]:
    """(the latest checkpoint's state, its step), or (state, 0) when there is none."""
    import orbax.checkpoint as ocp

    if manager.latest_step() is None:
        return state, 0
    start = int(manager.latest_step())
    # The abstract state carries this run's shardings, so orbax reads each array onto the
    # current mesh whatever mesh wrote it.
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, _as_dict(state))
    try:
        restored = manager.restore(start, args=ocp.args.StandardRestore(abstract))
    except Exception as e:
        raise SpecjaxError(
            f"cannot resume from {out_dir / 'checkpoints'} step {start}: {e}. "
            "Was it written by a run with a different model or optimizer config?"
        ) from None
    return TrainState(step=restored["step"], params=restored["params"], opt_state=restored["opt_state"]), start


def _compiled_train_step(loss_fn, tx, state: TrainState, mesh: Mesh | None):
    """(state, batch, rng) -> (state, metrics): one optimizer step, jitted with the old state donated
    (XLA updates params and moments in place) and, on a mesh, kept where it is placed."""

    def train_step(state: TrainState, batch, rng):
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, batch, rng)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, "grad_norm": _tree_norm(grads), **aux}
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    if mesh is None:
        return jax.jit(train_step, donate_argnums=(0,))
    placed = jax.tree.map(lambda a: a.sharding, state)
    return jax.jit(train_step, donate_argnums=(0,), out_shardings=(placed, None))


def _placed_batches(batch_fn: Callable[[int], Any], mesh: Mesh) -> Callable[[int], Any]:
    """batch_fn with every (batch-major) array split over the mesh's data axes."""
    return lambda step: shard_state(batch_fn(step), mesh)


def _as_dict(state: TrainState) -> dict:
    return {"step": state.step, "params": state.params, "opt_state": state.opt_state}

