"""Training configs: ``get_config(task, preset)`` and command-line overrides.

One module per task (``listops``, ``text``, ``retrieval``, ``image``, ``pathfinder``), each
with ``get_config(preset="full")``; ``default.py`` holds every field with its meaning.
A later task registers its module in ``CONFIGS`` (or passes its own ConfigDict to
``train.loop.train_and_evaluate``).
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Iterable

import ml_collections

CONFIGS = {
    "listops": "train.configs.listops",
    "text": "train.configs.text",
    "retrieval": "train.configs.retrieval",
    "image": "train.configs.image",
    "pathfinder": "train.configs.pathfinder",
    "vit": "train.configs.vit",
    "lm": "train.configs.lm",
}


def get_config(task: str = "listops", preset: str = "mini") -> ml_collections.ConfigDict:
    """The config of ``task`` at ``preset`` (``"mini"``, ``"full"``, or a task's extra preset)."""
    if task not in CONFIGS:
        raise ValueError(f"unknown task {task!r}; known: {sorted(CONFIGS)}")
    config = importlib.import_module(CONFIGS[task]).get_config(preset)
    return set_attention(config, config.attention)


# Mechanism settings of the CPU-sized ``mini`` presets (head_dim 16, T ~ 128-512): fewer
# random features / landmarks than the library defaults (which target full LRA), so a mini
# run takes minutes. Applied by ``set_attention`` unless the user sets the key.
MINI_ATTENTION_CONFIG = {
    "performer": {"num_features": 64},
    "rfa": {"num_features": 64},
    "flexformer_s": {"num_features": 32},
    "flexformer_n": {"num_features": 32},
    "nystromformer": {"num_landmarks": 16},
    "soft": {"num_landmarks": 16},
    "laplacian": {"num_landmarks": 16},
}


def set_attention(
    config: ml_collections.ConfigDict, name: str, *, like: str | None = None
) -> ml_collections.ConfigDict:
    """Set ``config.attention = name``; mini presets get ``MINI_ATTENTION_CONFIG[like]``, then a
    task module's ``attention_defaults(preset, like)`` (if it has one) on top.

    Replaces ``config.attention_config`` (its keys belong to the previous mechanism).

    Args:
      like: the registry name whose preset settings apply (default `name`). For a renamed
        copy of a registered record, its original, ``linattn_jax.origin(name)``: the configs
        import no library, so the entry points (`train.cli.build_config`) resolve it.
    """
    like = name if like is None else like
    config.attention = name
    values = dict(MINI_ATTENTION_CONFIG.get(like, {})) if config.preset == "mini" else {}
    task_module = importlib.import_module(CONFIGS[config.task]) if config.task in CONFIGS else None
    if hasattr(task_module, "attention_defaults"):  # a task's own settings (vit: LARA's)
        values.update(task_module.attention_defaults(config.preset, like))
    config.attention_config = ml_collections.ConfigDict(values)
    return config


def parse_value(text: str):
    """A command-line value: a Python literal (int, float, bool, tuple, None) or a string."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def apply_overrides(config: ml_collections.ConfigDict, items: Iterable[str]):
    """Apply ``key.sub=value`` overrides in place (values parsed by ``parse_value``).

    Raises:
      ValueError: a malformed item, an unknown key, or a value of the wrong type.
    """
    for item in items:
        if "=" not in item:
            raise ValueError(
                f"override {item!r} must look like key=value (e.g. model.num_layers=2)"
            )
        key, text = item.split("=", 1)
        key = key.strip()
        value = parse_value(text)
        *parents, leaf = key.split(".")
        node = config
        for p in parents:
            if p not in node:
                raise ValueError(f"override {item!r}: unknown config key {key!r}")
            node = node[p]
        if leaf not in node and not (parents and parents[-1] == "attention_config"):
            raise ValueError(f"override {item!r}: unknown config key {key!r}")
        old = node.get(leaf)
        if isinstance(old, float) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if isinstance(old, tuple) and isinstance(value, list):
            value = tuple(value)
        if isinstance(old, str) and not isinstance(value, str) and value is not None:
            value = text  # e.g. a name that happens to parse as a number
        try:
            node[leaf] = value
        except TypeError as e:
            raise ValueError(f"override {item!r}: {e}") from None
    return config


__all__ = [
    "CONFIGS",
    "MINI_ATTENTION_CONFIG",
    "apply_overrides",
    "get_config",
    "parse_value",
    "set_attention",
]
