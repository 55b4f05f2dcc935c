"""Parameter trees of distillation: where the attention layers are, their mechanism params,
the teacher-to-student weight transplant, and feature-map files."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import serialization


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
    """Paths (in ``params``) of every attention module: the subtrees with flax's
    ``query``/``key``/``value``/``out`` projections (a mechanism without params has no
    ``mechanism`` entry)."""
    out = []

    def walk(tree, path):
        if isinstance(tree, Mapping):
            if {"query", "key", "value", "out"} <= set(tree):
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
                params.update(_get(variables["fixed"], p).get("mechanism", {}))
            except KeyError:
                pass
        out[p] = params
    return out


def trainable_mechanism_params(variables) -> dict[tuple, Any]:
    """``{path: params["mechanism"]}`` (the learnable feature-map params only)."""
    variables = nn.meta.unbox(variables)
    return {
        p: dict(_get(variables["params"], p).get("mechanism", {}))
        for p in attention_paths(variables)
    }


def with_mechanism_params(variables, trainable: Mapping[tuple, Any]):
    """A copy of `variables` whose ``params[path]["mechanism"]`` are replaced by `trainable`."""
    variables = dict(nn.meta.unbox(variables))
    params = variables["params"]
    for p, value in trainable.items():
        if value:  # no empty ``mechanism`` dicts
            params = _set(params, (*p, "mechanism"), value)
    variables["params"] = params
    return variables


def transplant(teacher_variables, student_variables, *, skip=("mechanism",)):
    """Student variables with every leaf the teacher has at the same path and shape copied
    from the teacher (projections, embeddings, MLPs, norms, head); the student's own
    mechanism params (`skip`) and collections the teacher lacks (``fixed``) are kept.

    Returns ``(variables, copied, kept)`` with the lists of copied / kept leaf paths.
    """
    teacher = nn.meta.unbox(teacher_variables)
    student = nn.meta.unbox(student_variables)
    copied, kept = [], []

    def merge(s_tree, t_tree, path):
        if isinstance(s_tree, Mapping):
            out = {}
            for key, value in s_tree.items():
                sub = (*path, key)
                if key in skip or not isinstance(t_tree, Mapping) or key not in t_tree:
                    out[key] = value
                    kept.extend(_leaf_paths(value, sub))
                else:
                    out[key] = merge(value, t_tree[key], sub)
            return out
        if getattr(t_tree, "shape", None) == getattr(s_tree, "shape", None):
            copied.append(path)
            return jnp.asarray(t_tree, dtype=s_tree.dtype)
        kept.append(path)
        return s_tree

    merged = {c: merge(v, teacher.get(c, {}), (c,)) for c, v in student.items()}
    return merged, copied, kept


def _leaf_paths(tree, path):
    if isinstance(tree, Mapping):
        return [q for k, v in tree.items() for q in _leaf_paths(v, (*path, k))]
    return [path]


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
