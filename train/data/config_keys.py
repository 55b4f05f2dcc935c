"""Reading the data keys out of a config (``ml_collections.ConfigDict``, a dict, or None)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

DEFAULT_DATA_DIR = "~/.cache/linattn_jax/data"
DATA_DIR_ENV = "LINATTN_DATA_DIR"
VARIANTS = ("mini", "full")


def as_dict(config: Any) -> dict[str, Any]:
    """A plain dict view of ``config``; keys a task does not use are ignored later."""
    if config is None:
        return {}
    if hasattr(config, "to_dict"):  # ml_collections.ConfigDict / FrozenConfigDict
        return dict(config.to_dict())
    if isinstance(config, Mapping):
        return dict(config)
    raise TypeError(f"config must be a ConfigDict, a mapping or None, got {type(config).__name__}")


def data_dir(cfg: Mapping[str, Any]) -> Path:
    """``cfg["data_dir"]``, else ``$LINATTN_DATA_DIR``, else ``~/.cache/linattn_jax/data``."""
    value = cfg.get("data_dir") or os.environ.get(DATA_DIR_ENV) or DEFAULT_DATA_DIR
    return Path(os.path.expanduser(str(value)))


def variant(cfg: Mapping[str, Any]) -> str:
    value = cfg.get("variant") or "full"
    if value not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {value!r}")
    return value


def positive_int(cfg: Mapping[str, Any], key: str, default: int) -> int:
    value = cfg.get(key)
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"config {key!r} must be a positive int, got {value!r}")
    return int(value)


def choice(cfg: Mapping[str, Any], key: str, default: str, options: tuple[str, ...]) -> str:
    value = cfg.get(key) or default
    if value not in options:
        raise ValueError(f"config {key!r} must be one of {options}, got {value!r}")
    return value
