"""The errors a training run raises before it trains, and the sentence they end with.

A leaf module: `train.guard` (config and workdir checks) and `train.checkpoint` (a workdir
whose checkpoints do not restore) raise them; `train.cli.run` prints them as one line.
"""

from __future__ import annotations

#: how a refused run goes on: the end of every `WorkdirError` message
WAY_ON = "train it in a new --workdir, or rerun with --restart to delete this run and start over"


class ConfigError(ValueError):
    """A setting no run can start with (named with its value and what is accepted)."""


class WorkdirError(RuntimeError):
    """The workdir holds something the run must not silently replace or restart over."""


__all__ = ["WAY_ON", "ConfigError", "WorkdirError"]
