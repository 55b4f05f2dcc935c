"""Mesh, logical-axis rules and shardings for data parallelism + FSDP-style parameters.

* The mesh: ``Mesh(np.array(jax.devices()).reshape(config.mesh_shape), config.mesh_axes)``
  (one ``-1`` in the shape takes the remaining devices; a shape of fewer devices than there
  are takes the first ones, in one process). No pmap anywhere.
* Batches: the leading (batch) dimension is split over ``config.data_axes`` (by default
  both mesh axes; axes the mesh lacks are skipped), everything else replicated.
* Long sequences: a mesh axis named ``"seq"`` (e.g. ``--set mesh_axes=data,seq --set
  mesh_shape=2,4``) also splits the token dimension of ``[B, T, ...]`` batch arrays, and the
  models run their attention sequence-parallel over it (`train.models.layers.Block`).
  Parameters stay replicated over ``seq`` (checkpoints are unchanged).
* Parameters: modules annotate parameters with logical axis names
  (``nn.with_logical_partitioning``); ``config.logical_axis_rules`` maps them to mesh axes,
  e.g. ``embed -> fsdp`` shards every ``[.., embed, ..]`` parameter (and its Adam moments)
  over the ``fsdp`` axis. Leaves without annotations (mechanism params, step counters) are
  replicated. A dimension that the mesh axes do not divide is left unsharded rather than
  failing (a warning-free fallback for tiny test models).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

#: the mesh axis that splits the sequence (token) dimension
SEQ_AXIS = "seq"


def mesh_shape(shape: Sequence[int], num_devices: int) -> tuple[int, ...]:
    """Resolve one ``-1`` in ``shape`` so the product is ``num_devices``."""
    shape = tuple(int(s) for s in shape)
    if shape.count(-1) > 1 or any(s == 0 or s < -1 for s in shape):
        raise ValueError(f"mesh_shape {shape} must have positive sizes and at most one -1")
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if num_devices % known:
            raise ValueError(f"mesh_shape {shape}: {num_devices} devices not divisible by {known}")
        shape = tuple(num_devices // known if s == -1 else s for s in shape)
    if math.prod(shape) != num_devices:
        raise ValueError(f"mesh_shape {shape} needs {math.prod(shape)} devices, have {num_devices}")
    return shape


def make_mesh(config, devices=None) -> Mesh:
    """The device mesh of ``config.mesh_shape`` / ``config.mesh_axes`` over ``devices``.

    A shape without ``-1`` that needs fewer devices than there are takes the first ones in
    a single process (``mesh_shape=(1, 1)``: one device); a multi-process mesh spans every
    process's devices, so there it must use them all.
    """
    devices = jax.devices() if devices is None else list(devices)
    need = math.prod(int(s) for s in config.mesh_shape)
    if need > 0 and -1 not in tuple(config.mesh_shape) and jax.process_count() == 1:
        devices = devices[:need]
    axes = tuple(config.mesh_axes)
    shape = mesh_shape(config.mesh_shape, len(devices))
    if len(shape) != len(axes):
        raise ValueError(
            f"mesh_shape {tuple(config.mesh_shape)} and mesh_axes {axes} differ in rank"
        )
    return Mesh(np.array(devices).reshape(shape), axes)


def rules(config) -> tuple[tuple[str, str | tuple[str, ...] | None], ...]:
    """``config.logical_axis_rules`` as a tuple of ``(logical, mesh axis or None)`` pairs."""
    out = []
    for logical, mesh_axis in config.logical_axis_rules:
        mesh_axis = tuple(mesh_axis) if isinstance(mesh_axis, list) else mesh_axis
        out.append((logical, mesh_axis))
    return tuple(out)


def data_axes(mesh: Mesh, config) -> tuple[str, ...]:
    """The axes of ``config.data_axes`` that `mesh` has (the batch is split over them).

    Raises:
      ValueError: ``data_axes`` names the sequence axis ``"seq"``.
    """
    if SEQ_AXIS in tuple(config.data_axes):
        raise ValueError(
            f"data_axes {tuple(config.data_axes)} must not contain the sequence axis "
            f"{SEQ_AXIS!r} (it splits the tokens, not the batch)"
        )
    return tuple(a for a in config.data_axes if a in mesh.axis_names)


def input_shardings(mesh: Mesh, config, example) -> dict[str, NamedSharding]:
    """Per key of the batch `example` (arrays or shapes): the batch dimension over the data
    axes and, when the mesh has a ``"seq"`` axis that divides it, the token dimension of
    ``[B, T, ...]`` arrays over ``seq``."""
    base = batch_sharding(mesh, config)
    if SEQ_AXIS not in mesh.axis_names:
        return {k: base for k in example}
    n = mesh.shape[SEQ_AXIS]
    split = NamedSharding(mesh, PartitionSpec(data_axes(mesh, config) or None, SEQ_AXIS))
    return {
        k: split if len(np.shape(v)) >= 2 and np.shape(v)[1] % n == 0 else base
        for k, v in example.items()
    }


def batch_sharding(mesh: Mesh, config) -> NamedSharding:
    """Batch dimension over ``config.data_axes``, the rest replicated.

    Raises:
      ValueError: ``batch_size`` or ``eval_batch_size`` is not a multiple of the number of
        devices the data axes span.
    """
    axes = data_axes(mesh, config)
    ways = int(np.prod([mesh.shape[a] for a in axes]))
    for key in ("batch_size", "eval_batch_size"):
        size = config.get(key)
        if size is not None and int(size) % ways:
            fix = ways * max(1, int(size) // ways)
            raise ValueError(
                f"{key}={size} must be a multiple of the {ways} devices of the data axes "
                f"{axes} (mesh {dict(mesh.shape)}); pass e.g. --set {key}={fix}"
            )
    return NamedSharding(mesh, PartitionSpec(axes))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def _fit(spec: PartitionSpec, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """Drop mesh axes from dimensions they do not divide (or that the array lacks)."""
    entries = list(spec) + [None] * (len(shape) - len(spec))
    out = []
    for dim, entry in zip(shape, entries[: len(shape)]):
        names = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
        if any(n not in mesh.shape for n in names):  # e.g. "fsdp" on a (data, seq) mesh
            out.append(None)
            continue
        size = math.prod(mesh.shape[n] for n in names)
        out.append(entry if names and dim % size == 0 else None)
    return PartitionSpec(*out)


def logical_shardings(abstract_tree, mesh: Mesh, axis_rules):
    """NamedShardings for a tree of (possibly ``nn.Partitioned``-boxed) abstract leaves.

    Returns a tree shaped like ``nn.meta.unbox(abstract_tree)``.
    """
    specs = nn.get_partition_spec(abstract_tree)
    mesh_specs = nn.logical_to_mesh(specs, axis_rules)
    shapes = nn.meta.unbox(abstract_tree)
    return jax.tree.map(
        lambda s, x: NamedSharding(mesh, _fit(s, tuple(x.shape), mesh)),
        mesh_specs,
        shapes,
        is_leaf=lambda s: isinstance(s, PartitionSpec),
    )


def global_batch(batch: dict[str, np.ndarray], sharding) -> dict[str, jax.Array]:
    """Process-local numpy rows -> global arrays sharded along the batch dimension
    (`sharding`: one NamedSharding, or a dict of them by key)."""
    return {
        k: jax.make_array_from_process_local_data(
            sharding[k] if isinstance(sharding, dict) else sharding, np.asarray(v)
        )
        for k, v in batch.items()
    }


__all__ = [
    "SEQ_AXIS",
    "batch_sharding",
    "data_axes",
    "global_batch",
    "input_shardings",
    "logical_shardings",
    "make_mesh",
    "mesh_shape",
    "replicated",
    "rules",
]
