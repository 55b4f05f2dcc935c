"""Metrics: JSONL records, TensorBoard event files, a tqdm progress bar, learning-curve plots.

Every record is one JSON line in ``workdir/metrics.jsonl``::

    {"step": 100, "split": "train", "loss": 2.01, "accuracy": 0.21, "lr": 0.001, ...}
    {"step": 100, "split": "val", "loss": 1.95, "accuracy": 0.24, "count": 500}

A resumed run appends after dropping the records past the restored step (the steps it redoes;
``MetricsWriter(resume_step=...)``), so each step appears once; ``read_jsonl(latest_only=True)``
also keeps only the last record per (split, step) of files written before that rule.
TensorBoard scalars are written with ``tensorboardX`` (no TensorFlow needed) under
``workdir/tb`` as ``<split>/<name>``.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def _jsonable(v):
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


class MetricsWriter:
    """Appends records to ``metrics.jsonl`` and (optionally) TensorBoard; no-op if disabled.

    ``resume_step``: the step the run restarts from. Records of later steps (written before a
    crash, and about to be redone) are dropped from the file first, and TensorBoard purges
    its events past that step.
    """

    def __init__(
        self,
        workdir: str | Path,
        *,
        enabled: bool = True,
        tensorboard: bool = True,
        resume_step: int | None = None,
    ):
        self.enabled = enabled
        self.path = Path(workdir) / "metrics.jsonl"
        self._tb = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if resume_step is not None and self.path.exists():
                _drop_records_after(self.path, int(resume_step))
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (kept open)
            if tensorboard:
                from tensorboardX import SummaryWriter

                purge = None if resume_step is None else int(resume_step) + 1
                self._tb = SummaryWriter(str(Path(workdir) / "tb"), purge_step=purge)

    def write(self, step: int, split: str, values: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": int(step), "split": split, "time": time.time()}
        record.update({k: _jsonable(v) for k, v in values.items()})
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in values.items():
                v = _jsonable(v)
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(f"{split}/{k}", v, int(step))

    def flush(self) -> None:
        if self.enabled and self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def _drop_records_after(path: Path, step: int) -> None:
    """Rewrite ``path`` (atomically) without the records of steps after ``step``."""
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f if line.strip()]
    kept = [line for line in lines if int(json.loads(line).get("step", 0)) <= step]
    if len(kept) == len(lines):
        return
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    tmp.replace(path)


def read_jsonl(path: str | Path, *, latest_only: bool = True) -> list[dict[str, Any]]:
    """Records of a metrics file; ``latest_only`` keeps the last record per (split, step)."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line:
                records.append(json.loads(line))
    if not latest_only:
        return records
    last = {}
    for r in records:
        last[(r.get("split"), r.get("step"))] = r
    return sorted(last.values(), key=lambda r: (r["step"], str(r.get("split"))))


def plot_curves(jsonl: str | Path, png: str | Path, *, title: str = "") -> Path:
    """Learning curves (loss and accuracy per split vs step) from a metrics file to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_jsonl(jsonl)
    splits = sorted({r["split"] for r in records})
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, key in zip(axes, ("loss", "accuracy")):
        for split in splits:
            pts = [(r["step"], r[key]) for r in records if r["split"] == split and key in r]
            pts = [(s, v) for s, v in pts if isinstance(v, (int, float))]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o" if split != "train" else None, ms=3, label=split)
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    png = Path(png)
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


class Progress:
    """A tqdm bar over training steps showing steps/s, loss and accuracy (no-op if disabled)."""

    def __init__(self, total: int, initial: int = 0, *, enabled: bool = True, desc: str = ""):
        self._bar = None
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True
            )

    def update(self, n: int = 1, **postfix) -> None:
        if self._bar is None:
            return
        if postfix:
            self._bar.set_postfix(
                {k: f"{v:.4g}" if isinstance(v, float) else v for k, v in postfix.items()},
                refresh=False,
            )
        self._bar.update(n)

    def write(self, text: str) -> None:
        if self._bar is None:
            print(text, flush=True)
        else:
            self._bar.write(text)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


__all__ = ["MetricsWriter", "Progress", "plot_curves", "read_jsonl"]
