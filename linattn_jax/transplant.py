"""Carrying trained weights into a tree of another shape: `transplant`.

    variables = layer.init(rng, x)                              # la.linen.MultiHeadAttention
    variables = la.transplant(flax_mhdpa_variables, variables)  # the trained q/k/v/out

Trees are nested mappings: linen variables (``dict`` or ``FrozenDict``, leaves plain or boxed
with axis metadata such as ``nn.Partitioned``) or an ``nnx.State`` (leaves ``nnx.Variable``).
A path is the tuple of keys from the root to a leaf.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import numpy as np
from flax import nnx
from flax.core import FrozenDict

Path = tuple[Any, ...]


def _leaves(tree, path: Path = ()) -> dict[Path, Any]:
    """``{path: leaf}`` of a nested mapping (an empty mapping has no leaves)."""
    if isinstance(tree, Mapping):
        out = {}
        for key, value in tree.items():
            out.update(_leaves(value, (*path, key)))
        return out
    return {path: tree}


def _value(leaf):
    """The array inside a leaf (unboxed from axis metadata or an nnx Variable)."""
    if isinstance(leaf, nnx.Variable):
        return leaf.get_value()
    if isinstance(leaf, nn.meta.AxisMetadata):
        return leaf.unbox()
    return leaf


def _with_value(leaf, value):
    """`leaf` holding `value`, its box (metadata, Variable type) kept."""
    if isinstance(leaf, nnx.Variable):
        return leaf.replace(value)
    if isinstance(leaf, nn.meta.AxisMetadata):
        return leaf.replace_boxed(value)
    return value


def _rebuild(tree, new_leaves: Mapping[Path, Any], path: Path = ()):
    """`tree` with the leaves at the paths of `new_leaves` replaced, containers of the same
    types (``dict``, ``FrozenDict``, ``nnx.State``)."""
    if not isinstance(tree, Mapping):
        return new_leaves.get(path, tree)
    items = {k: _rebuild(v, new_leaves, (*path, k)) for k, v in tree.items()}
    if isinstance(tree, nnx.State):
        return nnx.State(items)
    if isinstance(tree, FrozenDict):
        return FrozenDict(items)
    return items


def _spec(x) -> tuple[tuple[int, ...], Any]:
    dtype = getattr(x, "dtype", None)
    return tuple(np.shape(x)), np.asarray(x).dtype if dtype is None else dtype


def _name(path: Path) -> str:
    return "/".join(str(p) for p in path)


def transplant(source, target, *, skip: tuple[str, ...] = (), return_kept: bool = False):
    """`target` with every leaf of `source` copied in at the same path.

    Every source leaf must land: a source path the target does not have, or a leaf whose
    shape or dtype differ from the target's, is an error (all of them are listed at once), so
    a checkpoint of another architecture, other names or another width is never half-loaded.
    Leaves only the target has (e.g. a linattn mechanism's own params next to the
    projections taken from a softmax checkpoint) keep their target values. The target's
    containers and leaf boxes (logical-axis metadata, ``nnx.Param``) are kept; the values
    are the source's arrays, unchanged.

    Args:
      source: the trained tree (linen variables, a params dict, or an ``nnx.State``).
      target: the tree to fill, of the structure the new model has (e.g. its fresh
        ``init`` variables, or ``nnx.state(model)``).
      skip: keys (at any depth) whose source subtrees are not copied.
      return_kept: also return the sorted paths of the target leaves that were not
        overwritten (the ones still at their target values, e.g. freshly initialised).

    Returns:
      The new tree (the target's container types); with `return_kept`, ``(tree, kept)``.

    Raises:
      ValueError: a source leaf has no destination in `target`, or a different shape or
        dtype there; the message lists every one.
    """
    skip = tuple(skip)
    src = {p: v for p, v in _leaves(source).items() if not any(k in skip for k in p)}
    dst = _leaves(target)
    missing = [p for p in src if p not in dst]
    mismatched = []
    new = {}
    for p, leaf in src.items():
        if p not in dst:
            continue
        value = _value(leaf)
        have, want = _spec(value), _spec(_value(dst[p]))
        if have != want:
            mismatched.append(f"{_name(p)}: source {have[0]} {have[1]}, target {want[0]} {want[1]}")
        else:
            new[p] = _with_value(dst[p], value)
    if missing or mismatched:
        lines = []
        if missing:
            lines.append(f"{len(missing)} source leaves have no destination in the target:")
            lines += [f"  {_name(p)}" for p in missing]
        if mismatched:
            lines.append(f"{len(mismatched)} source leaves differ from the target's:")
            lines += [f"  {m}" for m in mismatched]
        names = sorted(_name(p) for p in dst)
        lines.append(f"the target's {len(names)} leaves: {names if len(names) <= 40 else '...'}")
        raise ValueError("transplant(source, target): " + "\n".join(lines))
    tree = _rebuild(target, new)
    if return_kept:
        return tree, sorted((p for p in dst if p not in new), key=_name)
    return tree


__all__ = ["transplant"]
