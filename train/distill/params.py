"""Parameter trees of distillation: where the attention layers are, their mechanism params,
the teacher-to-student weight transplant, and feature-map files."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
from flax import serialization
from flax.traverse_util import flatten_dict

import linattn_jax as la


def _get(tree, path):
    for p in path:
        tree = tree[p]
    return tree


def _set(tree: dict, path, value) -> dict:
    """A copy of nested dict `tree` with ``tree[path] = value``."""
    if not path:
        return value
    out = dict(tree)
    out[path[0]] = _set(tree.get(path[0], {}), path[1:], value)
    return out


def attention_paths(variables) -> list[tuple[str, ...]]:
    """Paths (in ``params``) of every attention module: the subtrees holding ``query``,
    ``key`` and ``value`` projections (ours, flax's, an HF self-attention), whose mechanism
    params, if the mechanism has any, are their ``mechanism`` entry."""
    out = []

    def walk(tree, path):
        if isinstance(tree, Mapping):
            if {"query", "key", "value"} <= set(tree):
                out.append(path)
            for k, v in tree.items():
                walk(v, (*path, k))

    walk(nn.meta.unbox(variables["params"]), ())
    return out


def mechanism_params(variables, paths=None) -> dict[tuple, Any]:
    """``{path: trainable mechanism params ∪ fixed features}`` of every attention module."""
    variables = nn.meta.unbox(variables)
    paths = attention_paths(variables) if paths is None else paths
    out = {}
    for p in paths:
        params = dict(_get(variables["params"], p).get("mechanism", {}))
        if "fixed" in variables:
            try:
                params.update(_get(variables["fixed"], p)["mechanism"])
            except KeyError:
                pass
        out[p] = params
    return out


def trainable_mechanism_params(variables) -> dict[tuple, Any]:
    """``{path: params["mechanism"]}`` (the learnable feature-map params only; ``{}`` for a
    layer without any)."""
    variables = nn.meta.unbox(variables)
    params = variables["params"]
    return {p: dict(_get(params, p).get("mechanism", {})) for p in attention_paths(variables)}


def with_mechanism_params(variables, trainable: Mapping[tuple, Any]):
    """A copy of `variables` whose ``params[path]["mechanism"]`` are replaced by `trainable`
    (an empty entry is not created)."""
    variables = dict(nn.meta.unbox(variables))
    params = variables["params"]
    for p, value in trainable.items():
        if value or "mechanism" in _get(params, p):
            params = _set(params, (*p, "mechanism"), value)
    variables["params"] = params
    return variables


def transplant(teacher_variables, student_variables, *, skip=("mechanism",)):
    """Student variables with every leaf of the teacher copied in at its path (projections,
    embeddings, MLPs, norms, head), by `linattn_jax.transplant`; the student's own leaves
    (its mechanism params, collections the teacher lacks such as ``fixed``) keep theirs, and
    the teacher's subtrees under a key in `skip` (a teacher mechanism's params) are not
    copied. Both trees are unboxed (logical-axis metadata dropped).

    Returns ``(variables, copied, kept)`` with the sorted lists of copied / kept leaf paths.

    Raises:
      ValueError: a teacher leaf has no place in the student, or another shape or dtype
        there: teacher and student are not the same architecture (every such leaf listed).
    """
    teacher = nn.meta.unbox(teacher_variables)
    student = nn.meta.unbox(student_variables)
    merged, kept = la.transplant(teacher, student, skip=tuple(skip), return_kept=True)
    kept_set = set(kept)
    copied = [p for p in flatten_dict(merged) if p not in kept_set]
    return merged, sorted(copied), kept


def save_feature_maps(path, feature_maps: Mapping[tuple, Any], info: Mapping[str, Any]) -> None:
    """Feature maps ``{path: params}`` (+ JSON-able `info`) to a msgpack file."""
    tree = {
        "maps": {"/".join(p): jax.device_get(v) for p, v in feature_maps.items()},
        "info": json.dumps(dict(info)),
    }
    Path(path).write_bytes(serialization.msgpack_serialize(tree))


def load_feature_maps(path) -> tuple[dict[tuple, Any], dict]:
    """``(feature maps {path: params}, info)`` written by `save_feature_maps`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no feature-map file {path} (written by a distillation run)")
    tree = serialization.msgpack_restore(path.read_bytes())
    maps = {tuple(k.split("/")): v for k, v in tree["maps"].items()}
    return maps, json.loads(tree["info"])
