"""Retrieval (LRA AAN): reader for LRA's released TSV files, byte-level document pairs.

Files (LRA release, ``lra_release/lra_release/tsv_data/``): ``new_aan_pairs.train.tsv``,
``new_aan_pairs.eval.tsv``, ``new_aan_pairs.test.tsv``; no header; five tab-separated
columns ``label, id1, id2, text1, text2`` with ``label`` written as a float (``0.0`` or
``1.0``: whether paper 1 cites paper 2); quotes are not special (LRA reads them with
``use_quote_delim=False``). Splits: train, val (= the ``eval`` file), test.

Each document is byte-tokenised to its own ``seq_len`` row (full: 4000 as LRA's matching
config; mini: 512) with ``tokenizers.encode_bytes``: examples are
``{"inputs1": int32 [T], "inputs2": int32 [T], "targets": int32 []}`` for a dual encoder.
Only the first ``seq_len`` bytes of each text are kept in memory.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from . import config_keys
from .errors import DatasetNotFoundError
from .pipeline import LazySource, Task
from .tokenizers import BYTE_VOCAB_SIZE, encode_bytes

FILES = {
    "train": "new_aan_pairs.train.tsv",
    "val": "new_aan_pairs.eval.tsv",
    "test": "new_aan_pairs.test.tsv",
}
SEQ_LEN = {"mini": 512, "full": 4000}
MINI_SIZES = {"train": 2_000, "val": 500, "test": 500}

Row = tuple[int, bytes, bytes]

HOW_TO_PREPARE = (
    "  Download the LRA release (lra_release.gz from the google-research/long-range-arena "
    "README) on a machine with internet and extract it; the files "
    "new_aan_pairs.{train,eval,test}.tsv are in lra_release/lra_release/tsv_data/. Set "
    "config.lra_dir to the extracted lra_release/ folder (or config.aan_dir to the folder "
    "holding the three files)."
)


def read_tsv(path: str | os.PathLike, *, keep_bytes: int | None = None) -> list[Row]:
    """Read an AAN pairs TSV into ``(label, text1, text2)`` rows (texts as UTF-8 bytes).

    ``keep_bytes`` cuts each text to its first ``keep_bytes`` bytes (what a model of that
    length can see) to bound memory.
    """
    rows = []
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip(b"\r\n")
            if not line:
                continue
            cols = line.split(b"\t")
            if len(cols) != 5:
                raise ValueError(
                    f"{path}:{lineno}: expected 5 tab-separated columns "
                    f"(label, id1, id2, text1, text2), got {len(cols)}"
                )
            try:
                label = float(cols[0])
            except ValueError as e:
                raise ValueError(f"{path}:{lineno}: label {cols[0][:20]!r} is not a number") from e
            if label not in (0.0, 1.0):
                raise ValueError(f"{path}:{lineno}: label must be 0 or 1, got {label}")
            t1, t2 = cols[3], cols[4]
            if keep_bytes is not None:
                t1, t2 = t1[:keep_bytes], t2[:keep_bytes]
            rows.append((int(label), t1, t2))
    return rows


def write_tsv(path: str | os.PathLike, rows: list[tuple[int, str, str, str, str]]) -> None:
    """Write rows ``(label, id1, id2, text1, text2)`` in the released format (for fixtures)."""
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for label, id1, id2, t1, t2 in rows:
            f.write(f"{float(label)}\t{id1}\t{id2}\t{t1}\t{t2}\n")


def pair_example(seq_len: int, add_cls: bool, add_eos: bool):
    def fn(row: Row) -> dict[str, np.ndarray]:
        label, t1, t2 = row
        return {
            "inputs1": encode_bytes(t1, seq_len, add_cls=add_cls, add_eos=add_eos),
            "inputs2": encode_bytes(t2, seq_len, add_cls=add_cls, add_eos=add_eos),
            "targets": np.int32(label),
        }

    fn.__name__ = "aan_bytes"
    return fn


def search_dirs(cfg: Mapping[str, Any]) -> list[Path]:
    """Where the AAN TSVs are looked for, in order."""
    root = config_keys.data_dir(cfg)
    dirs = [Path(os.path.expanduser(str(cfg["aan_dir"])))] if cfg.get("aan_dir") else []
    if cfg.get("lra_dir"):
        lra = Path(os.path.expanduser(str(cfg["lra_dir"])))
        dirs += [lra / "lra_release" / "tsv_data", lra / "tsv_data"]
    return dirs + [
        root / "lra_release" / "lra_release" / "tsv_data",
        root / "lra_release" / "tsv_data",
        root / "tsv_data",
        root / "aan",
    ]


def build_task(cfg: Mapping[str, Any]) -> Task:
    """Retrieval (AAN) ``Task``; see the module docstring."""
    variant = config_keys.variant(cfg)
    seq_len = config_keys.positive_int(cfg, "seq_len", SEQ_LEN[variant])
    candidates = search_dirs(cfg)
    found = next((d for d in candidates if (d / FILES["train"]).is_file()), None)
    if found is None:
        raise DatasetNotFoundError(
            "retrieval (LRA AAN pairs)", [d / FILES["train"] for d in candidates], HOW_TO_PREPARE
        )
    fn = pair_example(seq_len, bool(cfg.get("add_cls", False)), bool(cfg.get("add_eos", False)))
    mini = variant == "mini"
    splits, counts = {}, {}
    for i, (split, name) in enumerate(FILES.items()):
        path = found / name
        if not path.is_file():
            raise DatasetNotFoundError(f"retrieval ({split} split)", [path], HOW_TO_PREPARE)
        rows = read_tsv(path, keep_bytes=seq_len)
        size = cfg.get(f"num_{split}") or (MINI_SIZES[split] if mini else None)
        idx = None
        if size is not None and size < len(rows):
            idx = np.sort(np.random.default_rng(i).choice(len(rows), size=size, replace=False))
        splits[split] = LazySource(rows, fn, idx)
        labels = np.array([r[0] for r in rows], dtype=np.int64)
        counts[split] = np.bincount(labels if idx is None else labels[idx], minlength=2).tolist()
    return Task(
        name="retrieval",
        splits=splits,
        vocab_size=BYTE_VOCAB_SIZE,
        num_classes=2,
        seq_len=seq_len,
        is_pair=True,
        batch_size=config_keys.positive_int(cfg, "batch_size", 32),
        seed=int(cfg.get("seed") or 0),
        info={"source": "lra aan", "directory": str(found), "label_counts": counts},
    )
