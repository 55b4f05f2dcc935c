"""The run cache of the training claims: a run is reused only under the same key.

A run's key (``run_key.json`` in its directory) is the digest of its full config and the
code version (`code_version`) of the mechanism and training modules. `prepare` moves a
run whose key differs (or that has none: written before keys were kept) aside to
``<run>.stale`` and starts it afresh; a run with the right key and no finished summary is
resumed from its checkpoints by `train.loop.train_and_evaluate` (an interrupted claim
loses at most the steps since the last checkpoint).

The code version hashes every ``*.py`` under `CODE_DIRS` except `EXCLUDED`:
``linattn_jax/`` (the mechanisms), ``kernels/`` (their kernels) and ``train/`` (models,
data generators, optimiser, loop, distillation); left out are ``train/claims`` (this
package: the verdicts and the report read runs, they do not make them, so editing a rule
must not retrain hours of runs), ``train/bench`` and ``train/bench_activations``
(benchmarks, which no training module imports). Comments and docstrings are hashed too:
a conservative choice (a docstring edit reruns the runs), since telling them apart from
code would itself be code that can be wrong.
"""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
from pathlib import Path

CODE_DIRS = ("linattn_jax", "kernels", "train")
EXCLUDED = ("train/claims", "train/bench", "train/bench_activations")
#: config fields that do not change what a run computes
VOLATILE = ("progress_bar",)
RUN_KEY = "run_key.json"
ROOT = Path(__file__).resolve().parents[2]


@functools.lru_cache(maxsize=8)
def code_version(root: Path = ROOT) -> str:
    """16 hex digits of the sha256 of the source files (path and bytes, in path order)."""
    h = hashlib.sha256()
    for top in CODE_DIRS:
        for path in sorted((Path(root) / top).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if any(rel == e or rel.startswith(e + "/") for e in EXCLUDED):
                continue
            h.update(rel.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def config_digest(config) -> str:
    """16 hex digits of the sha256 of `config` (a ConfigDict or a dict) as sorted JSON,
    without the `VOLATILE` fields."""
    d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    d = {k: v for k, v in d.items() if k not in VOLATILE}
    text = json.dumps(d, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def run_key(config, **extra) -> dict:
    """``{"config": digest, "code": version, **extra}``: what a cached run must match
    (`extra`: settings outside the config, e.g. a distillation's stage steps)."""
    return {"config": config_digest(config), "code": code_version(), **extra}


def read_key(run_dir: Path) -> dict | None:
    path = Path(run_dir) / RUN_KEY
    return json.loads(path.read_text()) if path.exists() else None


def prepare(run_dir: Path, key: dict, log=print) -> bool:
    """Makes `run_dir` a run of `key`: a directory holding another key (or none) is moved
    to ``<run_dir>.stale`` (replacing an older one); returns True when it was stale."""
    run_dir = Path(run_dir)
    stale = run_dir.exists() and read_key(run_dir) != key
    if stale:
        aside = run_dir.with_name(run_dir.name + ".stale")
        if aside.exists():
            shutil.rmtree(aside)
        run_dir.rename(aside)
        log(f"[claims] stale run moved to {aside} (its config or code changed)")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / RUN_KEY).write_text(json.dumps(key, indent=1) + "\n")
    return stale


def finished(
    run_dir: Path, key: dict, steps: int | None, name: str = "summary.json"
) -> dict | None:
    """The summary of a run of `key` that reached `steps` (read, not restored), else None."""
    path = Path(run_dir) / name
    if read_key(run_dir) != key or not path.exists():
        return None
    summary = json.loads(path.read_text())
    return summary if steps is None or summary.get("steps", steps) == steps else None
