"""Byte-level text data for the causal LM (`TextData`, `load_text`).

Text: any UTF-8 (or binary) file, byte-level ids (`train.data.tokenizers`: byte b -> b + 1,
0 = pad, ``vocab_size = 259``). A directory holding WikiText-103's raw files
(``wiki.train.raw``, ``wiki.valid.raw``, ``wiki.test.raw``) is read split by split; a single
file is split 90 / 5 / 5; ``path="stdlib"`` uses the Python standard library's sources (an
offline corpus of several MB). Training windows are random crops of ``T + 1`` bytes drawn
from ``(seed, step)``, so the stream is resumable; evaluation is one ordered pass of
non-overlapping windows.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sysconfig
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .errors import DatasetNotFoundError
from .tokenizers import BYTE_OFFSET, BYTE_VOCAB_SIZE, decode_bytes

VOCAB_SIZE = BYTE_VOCAB_SIZE
WIKITEXT_FILES = {"train": "wiki.train.raw", "val": "wiki.valid.raw", "test": "wiki.test.raw"}


def stdlib_text(max_bytes: int | None = None) -> bytes:
    """The Python standard library's ``*.py`` sources, sorted by path, concatenated.

    An offline text corpus (several MB of English comments and code) for CPU runs and tests.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    out, size = [], 0
    for p in files:
        data = p.read_bytes()
        out.append(data)
        size += len(data)
        if max_bytes is not None and size >= max_bytes:
            break
    text = b"".join(out)
    return text if max_bytes is None else text[:max_bytes]


@dataclasses.dataclass(frozen=True, eq=False)
class TextData:
    """Byte splits of a text corpus, read as token ids ``byte + 1`` (0 = pad).

    Attributes:
      splits: split name -> uint8 byte array (a memory map for large files).
      seq_len: T, the model's context; windows hold ``T + 1`` bytes (inputs + shifted targets).
      info: provenance.
    """

    splits: Mapping[str, np.ndarray]
    seq_len: int
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    vocab_size: int = VOCAB_SIZE
    input_keys = ("inputs",)

    def source(self, split: str) -> np.ndarray:
        if split not in self.splits:
            raise KeyError(f"text data has no split {split!r}; has {list(self.splits)}")
        data = self.splits[split]
        if len(data) < self.seq_len + 1:
            raise ValueError(
                f"split {split!r} has {len(data)} bytes, fewer than seq_len + 1 = "
                f"{self.seq_len + 1}"
            )
        return data

    def train_batch(
        self,
        step: int,
        batch_size: int,
        *,
        seed: int = 0,
        split: str = "train",
        process_index: int = 0,
        process_count: int = 1,
    ) -> dict[str, np.ndarray]:
        """Random windows at ``step``: ``inputs``, ``targets`` int32 ``[B / P, T]``.

        A pure function of ``(seed, step, batch_size)``: row r starts at an offset drawn
        from ``default_rng([seed, step])``; process p takes rows ``p, p + P, ...``.
        """
        if batch_size % process_count:
            raise ValueError(f"{batch_size=} must be a multiple of {process_count=}")
        data = self.source(split)
        rng = np.random.default_rng([int(seed), int(step)])
        starts = rng.integers(0, len(data) - self.seq_len, size=batch_size)
        starts = starts[process_index::process_count]
        rows = np.stack([np.asarray(data[s : s + self.seq_len + 1]) for s in starts])
        ids = rows.astype(np.int32) + BYTE_OFFSET
        return {
            "inputs": np.ascontiguousarray(ids[:, :-1]),
            "targets": np.ascontiguousarray(ids[:, 1:]),
        }

    def train_batches(
        self, batch_size: int, *, seed: int = 0, start_step: int = 0, num_threads: int = 0, **kwargs
    ) -> Iterator[dict[str, np.ndarray]]:
        """Endless ``train_batch(start_step), train_batch(start_step + 1), ...``.

        (`num_threads` is accepted for the loop's data API; slicing a byte array needs none.)
        """
        del num_threads
        step = start_step
        while True:
            yield self.train_batch(step, batch_size, seed=seed, **kwargs)
            step += 1

    def num_eval_windows(self, split: str) -> int:
        return (len(self.source(split)) - 1) // self.seq_len

    def eval_batches(
        self,
        split: str,
        batch_size: int,
        *,
        max_batches: int | None = None,
        process_index: int = 0,
        process_count: int = 1,
    ) -> Iterator[dict[str, np.ndarray]]:
        """Ordered non-overlapping windows (every byte after the first is a target once).

        Adds ``mask`` bool ``[B]`` (False on rows that pad the last batch).
        """
        if batch_size % process_count:
            raise ValueError(f"{batch_size=} must be a multiple of {process_count=}")
        data = self.source(split)
        n = self.num_eval_windows(split)
        t = self.seq_len
        num_batches = math.ceil(n / batch_size)
        if max_batches is not None and max_batches >= 0:
            num_batches = min(num_batches, max_batches)
        for b in range(num_batches):
            pos = b * batch_size + np.arange(batch_size)[process_index::process_count]
            rows = np.zeros((len(pos), t + 1), np.int32)
            for r, p in enumerate(pos):
                if p < n:
                    rows[r] = np.asarray(data[p * t : p * t + t + 1]).astype(np.int32) + 1
            yield {
                "inputs": np.ascontiguousarray(rows[:, :-1]),
                "targets": np.ascontiguousarray(rows[:, 1:]),
                "mask": pos < n,
            }


def _read(path: Path) -> np.ndarray:
    return (
        np.memmap(path, dtype=np.uint8, mode="r") if path.stat().st_size else np.zeros(0, np.uint8)
    )


def load_text(cfg: Mapping[str, Any], seq_len: int) -> TextData:
    """`TextData` from ``cfg["path"]`` (see the module docstring).

    Keys: ``path`` (a file, a WikiText-style directory, or ``"stdlib"``), ``max_bytes``
    (``stdlib`` only: corpus size), ``val_fraction`` (single file: val and test fraction
    each, default 0.05).

    Raises:
      DatasetNotFoundError: the path does not exist (or a directory lacks the raw files).
    """
    path = cfg.get("path") or "stdlib"
    frac = float(cfg.get("val_fraction") or 0.05)
    if path == "stdlib":
        text = np.frombuffer(stdlib_text(cfg.get("max_bytes")), np.uint8)
        return _split_single(text, frac, seq_len, {"source": "python stdlib *.py"})
    p = Path(os.path.expanduser(str(path)))
    how = (
        "  Point data.path at any text file, or at the extracted WikiText-103 raw folder\n"
        "  (wikitext-103-raw/ with wiki.train.raw, wiki.valid.raw, wiki.test.raw; from\n"
        "  https://huggingface.co/datasets/Salesforce/wikitext, config wikitext-103-raw-v1,\n"
        "  saved as those three files), or use data.path=stdlib (offline)."
    )
    if p.is_dir():
        files = {s: p / f for s, f in WIKITEXT_FILES.items()}
        missing = [str(f) for f in files.values() if not f.is_file()]
        if missing:
            raise DatasetNotFoundError(f"text corpus {p}", missing, how)
        splits = {s: _read(f) for s, f in files.items()}
        return TextData(splits, seq_len, {"source": str(p)})
    if not p.is_file():
        raise DatasetNotFoundError(f"text corpus {p}", [str(p)], how)
    return _split_single(_read(p), frac, seq_len, {"source": str(p)})


def _split_single(data: np.ndarray, frac: float, seq_len: int, info) -> TextData:
    if not 0 < frac < 0.5:
        raise ValueError(f"val_fraction must be in (0, 0.5), got {frac}")
    n = len(data)
    held = max(int(n * frac), seq_len + 1)
    if n - 2 * held < seq_len + 1:
        raise ValueError(
            f"text of {n} bytes is too short for seq_len={seq_len} with val_fraction={frac}"
        )
    cut1, cut2 = n - 2 * held, n - held
    splits = {"train": data[:cut1], "val": data[cut1:cut2], "test": data[cut2:]}
    return TextData(splits, seq_len, {**info, "bytes": n})


def decode_text(ids) -> str:
    """Token ids -> text (bytes decoded as UTF-8 with replacement)."""
    return decode_bytes(np.asarray(ids)).decode("utf-8", errors="replace")


def encode_text(text: str) -> np.ndarray:
    """Text -> int32 ids ``byte + 1``."""
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32) + BYTE_OFFSET


def build_text_data(config) -> TextData:
    """`TextData` of a training config (``config.data``, ``config.data.seq_len``)."""
    return load_text(config.data.to_dict(), int(config.data.seq_len))


__all__ = [
    "VOCAB_SIZE",
    "WIKITEXT_FILES",
    "TextData",
    "build_text_data",
    "decode_text",
    "encode_text",
    "load_text",
    "stdlib_text",
]
