"""One mesh description for a run, and where every parameter and batch lives on it.

A run names its device mesh once (`--mesh data=2,fsdp=2,model=2`): three named axes whose sizes
multiply to the device count. Parameters are placed by logical axis rules, in the style of
levanter's and maxtext's: every weight kind names its dimensions logically (vocab, embed, heads,
mlp), and one table maps each logical name to a mesh axis. GSPMD then partitions the jitted
programs from those placements, so the decode and training code stays the single-device code.

- `model` splits attention heads and MLP features (tensor parallelism, Megatron's layout: column
  split into a layer, row split out of it, one reduction per block).
- `fsdp` splits the embedding dimension of every weight (ZeRO-3 style: each device keeps a slice of
  the weights and of the optimizer state, gathered when used) and, with `data`, the batch.
- `data` replicates the weights and splits the batch.

A dimension the mesh axis does not divide stays whole on that axis (replicated), which is always
correct and only costs memory; `describe_placement` says where that happened.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from specjax.errors import SpecjaxError

MESH_AXES = ("data", "fsdp", "model")
"""The mesh's axis names, outermost first: `data` spans the slowest links (hosts), `model` the
fastest (the devices of one host), since tensor parallelism communicates in every layer."""


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the three mesh axes; their product is the number of devices used."""

    data: int = 1
    """Data parallelism: weights replicated, batch split."""
    fsdp: int = 1
    """Fully sharded data parallelism: weights and optimizer state split along the embedding
    dimension, batch split."""
    model: int = 1
    """Tensor parallelism: heads, MLP features and the vocabulary split."""

    def __post_init__(self):
        for axis in MESH_AXES:
            size = getattr(self, axis)
            if not isinstance(size, int) or size < 1:
                raise SpecjaxError(f"mesh axis {axis} must be a positive integer, got {size!r}")

    @classmethod
    def parse(cls, text: str | None) -> "MeshConfig":
        """`--mesh`: "data=2,fsdp=2,model=2" (axes left out are 1); empty or None: one device."""
        if not text:
            return cls()
        sizes = {}
        for part in text.split(","):
            name, sep, value = part.strip().partition("=")
            if not sep or name not in MESH_AXES:
                raise SpecjaxError(f"--mesh takes axis=size pairs over {', '.join(MESH_AXES)}, "
                                   f"e.g. data=2,model=4; got {part.strip()!r}")
            if name in sizes:
                raise SpecjaxError(f"--mesh names axis {name} twice")
            try:
                sizes[name] = int(value)
            except ValueError:
                raise SpecjaxError(f"--mesh axis {name} needs an integer size, got {value!r}") from None
        return cls(**sizes)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, axis) for axis in MESH_AXES)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    def __str__(self) -> str:
        return ",".join(f"{axis}={getattr(self, axis)}" for axis in MESH_AXES)

    def build(self, devices=None) -> Mesh:
        """The jax Mesh over the first `size` of `devices` (default: every device of every process,
        process by process, so `data`, the outermost axis, is the one that spans hosts). jax's
        mesh_utils lays the grid out so that on a TPU slice the innermost axis follows the fastest
        links. A run of several processes must use all of their devices."""
        devices = jax.devices() if devices is None else list(devices)
        if len(devices) < self.size:
            hint = ("; XLA_FLAGS=--xla_force_host_platform_device_count=N makes N CPU devices"
                    if devices[0].platform == "cpu" else "")
            raise SpecjaxError(f"mesh {self} needs {self.size} devices, but {len(devices)} are available "
                               f"({devices[0].platform}){hint}")
        if len(devices) > self.size and jax.process_count() > 1:
            raise SpecjaxError(f"mesh {self} covers {self.size} of the {len(devices)} devices; a run of "
                               f"{jax.process_count()} processes must use all of them")
        devices = devices[: self.size]
        try:
            grid = mesh_utils.create_device_mesh(self.shape, devices)
        except (ValueError, NotImplementedError, AssertionError):
            # Topology-aware layouts exist for whole TPU slices; any other subset keeps jax's order,
            # which only affects speed, never results.
            grid = np.asarray(devices, dtype=object).reshape(self.shape)
        return Mesh(grid, MESH_AXES)


LOGICAL_AXIS_RULES: dict[str, tuple[str, ...]] = {
    "batch": ("data", "fsdp"),
    "vocab": ("model",),
    "embed": ("fsdp",),
    "heads": ("model",),
    "mlp": ("model",),
}
"""Logical dimension -> the mesh axes that split it. Names not listed (and None) are replicated."""

PARAMETER_AXES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    # Target and drafter (the drafter's layers use the target's names).
    (r"embed_tokens/embedding$", ("vocab", "embed")),
    (r"lm_head/kernel$", ("embed", "vocab")),
    (r"(q_proj|k_proj|v_proj)/kernel$", ("embed", "heads")),
    (r"(q_proj|k_proj|v_proj)/bias$", ("heads",)),
    (r"o_proj/kernel$", ("heads", "embed")),
    (r"(gate_proj|up_proj)/kernel$", ("embed", "mlp")),
    (r"down_proj/kernel$", ("mlp", "embed")),
    # Drafter: fc mixes the tapped target layers into one hidden state; anchor_proj maps the anchor
    # token's embedding in. Both produce the embedding dimension.
    (r"(^|/)fc/kernel$", (None, "embed")),
    (r"anchor_proj/kernel$", (None, "embed")),
    (r"slot_embedding$", (None, "embed")),
    # Norms, biases and the mask embedding are vectors: kept whole on every device, as are the
    # refiner's and compressor's weights (about 1% of a drafter), which no rule above names.
    (r"(scale|bias|mask_embedding)$", (None,)),
)
"""Parameter path (keys joined by "/") -> logical names of its dimensions, first match wins.
A leaf no rule matches is replicated."""


def _path_string(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def logical_axes(path: str, ndim: int) -> tuple[str | None, ...]:
    """The logical names of a parameter's dimensions (None: replicated)."""
    for pattern, axes in PARAMETER_AXES:
        if re.search(pattern, path):
            return tuple(axes[:ndim]) + (None,) * max(0, ndim - len(axes))
    return (None,) * ndim


def spec_for(shape: tuple[int, ...], axes: tuple[str | None, ...], mesh_shape: dict[str, int],
             head_dim: int | None = None) -> PartitionSpec:
    """The PartitionSpec of an array with these logical axes. A dimension takes the longest leading
    run of its mesh axes whose sizes divide it (a batch of 6 on data=2,fsdp=2 splits over data
    alone), or stays whole; a mesh axis already used by an earlier dimension is skipped.
    head_dim: a `heads` dimension (heads x head_dim features) splits only between whole heads, so a
    device's slice of a projection matches its slice of the KV cache (3 KV heads stay whole on 2)."""
    used: set[str] = set()
    entries = []
    for size, name in zip(shape, axes):
        mesh_axes = tuple(a for a in LOGICAL_AXIS_RULES.get(name, ()) if a not in used and mesh_shape.get(a, 1) > 1)
        if name == "heads" and head_dim and size % head_dim == 0:
            size //= head_dim
        while mesh_axes and size % int(np.prod([mesh_shape[a] for a in mesh_axes])):
            mesh_axes = mesh_axes[:-1]
        if not mesh_axes:
            entries.append(None)
            continue
        used.update(mesh_axes)
        entries.append(mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    return PartitionSpec(*entries)


def parameter_specs(params, mesh: Mesh, head_dim: int | None = None) -> Any:
    """A PartitionSpec per parameter leaf, from PARAMETER_AXES and LOGICAL_AXIS_RULES (head_dim:
    see spec_for)."""
    mesh_shape = dict(mesh.shape)
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: spec_for(tuple(leaf.shape), logical_axes(_path_string(path), leaf.ndim), mesh_shape,
                                    head_dim),
        params)


def shard_parameters(params, mesh: Mesh, head_dim: int | None = None):
    """params placed on the mesh by the rules (works on abstract ShapeDtypeStructs too: it then
    returns them with their shardings attached). head_dim: attention projections split between
    whole heads only (see spec_for)."""
    specs = parameter_specs(params, mesh, head_dim)

    def place(leaf, spec):
        sharding = NamedSharding(mesh, spec)
        if isinstance(leaf, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
        return put(leaf, sharding)

    return jax.tree.map(place, params, specs)


def place_params(loaded, mesh: Mesh | None):
    """A loaded model, drafter or refiner (a dataclass with `params`) with its weights on the device,
    or on the mesh by the rules. Weights still on the host (as loaded) go straight to their devices'
    slices, so no device holds more than its share; None passes through."""
    if loaded is None:
        return loaded
    head_dim = getattr(loaded.config, "head_dim", None)
    params = jax.device_put(loaded.params) if mesh is None else shard_parameters(loaded.params, mesh, head_dim)
    return dataclasses.replace(loaded, params=params)


def put(value, sharding: NamedSharding) -> jax.Array:
    """value (the same on every process) as a global array with this sharding. With several
    processes each builds only its own devices' slices; one process simply copies."""
    if jax.process_count() == 1:
        return jax.device_put(value, sharding)
    if isinstance(value, jax.Array) and value.sharding == sharding:
        return value
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def to_host(tree):
    """Every array of `tree` as numpy on this process, gathered from every process's devices."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))


_BARRIERS_PASSED = itertools.count()


def is_writer() -> bool:
    """Whether this process writes the run's files and prints its results: process 0 of a
    multi-process run, or the only process."""
    return jax.process_index() == 0


def barrier(name: str, timeout_s: int = 24 * 3600) -> None:
    """Wait until every process reaches this barrier. It goes through the coordinator's key-value
    service, not a device collective, so a long wait (process 0 building a run's data for hours)
    trips no collective's timeout. With one process it returns at once."""
    if jax.process_count() == 1:
        return
    from orbax.checkpoint import multihost

    # Every process passes the same barriers in the same order, so a count makes each name unique
    # even where a name repeats (a run resumed in the same process).
    multihost.get_jax_distributed_client().wait_at_barrier(f"{name}#{next(_BARRIERS_PASSED)}",
                                                           timeout_in_ms=timeout_s * 1000)


def built_once(ready, build, what: str) -> None:
    """build() on process 0 unless ready(); every process then waits for it and must see the result.
    A multi-process run's output folder must be on a filesystem all processes share (orbax's
    checkpoints need that too), so the others read what process 0 wrote rather than redo it."""
    if is_writer() and not ready():
        build()
    barrier(f"specjax/built/{what}")
    if not ready():
        raise SpecjaxError(f"process {jax.process_index()} does not see {what}, which process 0 wrote: a run of "
                           "several processes needs its --out on a filesystem every process shares")


def same_on_every_process(tree):
    """tree (arrays) as process 0 has it, on every process: for inputs that must agree everywhere
    but come from each process's own measurements (timed costs). One process: tree itself."""
    if jax.process_count() == 1:
        return tree
    from jax.experimental import multihost_utils

    return multihost_utils.broadcast_one_to_all(tree)


def state_spec(path: str, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """A decode state leaf's spec: batch-major (slots or rows first) over data and fsdp; KV caches
    ([B, S, K, D], under a path naming a cache) also split their K heads over model, as the
    attention weights that write them are."""
    axes = ("batch",) + (None,) * (len(shape) - 1)
    if len(shape) == 4 and "cache" in path:
        axes = ("batch", None, "heads", None)
    return spec_for(tuple(shape), axes[: len(shape)], dict(mesh.shape))


def shard_state(tree, mesh: Mesh):
    """A decode state (every leaf batch-major, scalars replicated) placed on the mesh by state_spec."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: put(leaf, NamedSharding(mesh, state_spec(_path_string(path), np.shape(leaf), mesh))),
        tree)


def build_state(mesh: Mesh | None, make, *static_args):
    """make(*static_args) -> a decode state (batch-major leaves), built where it lives: over a mesh
    each device allocates only its own slices (by state_spec), so a state larger than one device
    still fits. make and its hashable arguments key jit's cache, so each shape compiles once."""
    if mesh is None:
        return make(*static_args)
    abstract = jax.eval_shape(lambda: make(*static_args))
    shardings = jax.tree_util.tree_map_with_path(
        lambda path, leaf: NamedSharding(mesh, state_spec(_path_string(path), leaf.shape, mesh)), abstract)
    return jax.jit(make, static_argnums=tuple(range(len(static_args))), out_shardings=shardings)(*static_args)


def describe_placement(params, mesh: Mesh, head_dim: int | None = None) -> list[dict]:
    """Per parameter: its path, shape, spec and bytes per device, with the dimensions a rule wanted
    split but the mesh axis did not divide (kept whole)."""
    mesh_shape = dict(mesh.shape)
    rows = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        name = _path_string(path)
        axes = logical_axes(name, leaf.ndim)
        spec = spec_for(tuple(leaf.shape), axes, mesh_shape, head_dim)
        split = 1
        for entry in spec:
            for axis in (entry,) if isinstance(entry, str) else (entry or ()):
                split *= mesh_shape[axis]
        wanted = [f"{name_}({size})" for size, name_, entry in zip(leaf.shape, axes, spec)
                  if entry is None and any(mesh_shape.get(a, 1) > 1 for a in LOGICAL_AXIS_RULES.get(name_, ()))]
        rows.append({"path": name, "shape": tuple(leaf.shape), "spec": spec,
                     "bytes_per_device": int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize // split,
                     "kept_whole": wanted})
    return rows
