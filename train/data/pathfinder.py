"""Pathfinder (LRA ``pathfinder32``): the task on our generated images or on LRA's release.

Task: a grayscale image holds two round markers and several curved contours made of short
antialiased line segments ("paddles"); the label is 1 when both markers sit on the same
contour, 0 when they sit on two different ones. Sequence models read the image flattened
row-major, pixel values 0..255 as tokens (``vocab_size = 256``, ``seq_len = H * W``).

The images are drawn by ``train.data.snakes`` (a snakes generator built like LRA's: its
docstring lists each rule and where we differ); this module caches them, measures them
(``python -m train.data.pathfinder``), reads LRA's released PNGs and builds the ``Task``.
The generator's public names (``PathfinderSpec``, the presets, ``generate``, ...) are
re-exported here.

Released data (LRA ``lra_release/pathfinder32/<difficulty>/``, difficulty folder
``curv_baseline`` (easy), ``curv_contour_length_9`` (intermediate) or
``curv_contour_length_14`` (hard)): ``metadata/<i>.npy`` are *text* files, one image per
line, space separated; we use column 0 (image folder relative to the difficulty folder,
e.g. ``imgs/0``), column 1 (file name, e.g. ``sample_0.png``) and column 3 (label 0/1), as
LRA's TFDS builder does. Empty PNG files (present in the release) are skipped, as LRA
skips them. LRA splits each difficulty 80/10/10 into train/val/test; we do the same after
a fixed (seed 0) permutation of the sorted metadata rows.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from . import config_keys as _config
from .errors import DatasetNotFoundError
from .pipeline import ArraySource, LazySource, Task
from .snakes import (
    DIFFICULTY_LENGTHS,
    FULL,
    MINI,
    PATHX,
    SPLITS,
    PathfinderSpec,
    difficulty_spec,
    generate,
    generate_images,
    markers_connected,
    save_grid,
)

VOCAB_SIZE = 256
NUM_CLASSES = 2
DIFFICULTY_DIRS = {
    "easy": "curv_baseline",
    "intermediate": "curv_contour_length_9",
    "hard": "curv_contour_length_14",
}

__all__ = [
    "DIFFICULTY_DIRS",
    "DIFFICULTY_LENGTHS",
    "FULL",
    "MINI",
    "NUM_CLASSES",
    "PATHX",
    "PathfinderSpec",
    "SPLITS",
    "VOCAB_SIZE",
    "auc",
    "build_task",
    "cache_dir",
    "difficulty_spec",
    "generate",
    "generate_images",
    "load_generated",
    "main",
    "markers_connected",
    "measure",
    "prepare",
    "read_metadata",
    "release_dirs",
    "release_splits",
    "save_grid",
    "spec_from_config",
]


# ----------------------------------------------------------------------------- cache
def cache_dir(data_dir: str | os.PathLike, spec: PathfinderSpec) -> Path:
    return Path(data_dir) / "pathfinder" / spec.cache_name()


def prepare(data_dir: str | os.PathLike, spec: PathfinderSpec, *, overwrite: bool = False) -> Path:
    """Generate ``spec`` into ``data_dir/pathfinder/<params>/{train,val,test}.npz``."""
    out = cache_dir(data_dir, spec)
    done = out / "spec.json"
    if done.exists() and not overwrite:
        return out
    out.mkdir(parents=True, exist_ok=True)
    start, cpu = time.perf_counter(), time.process_time()
    splits = generate(spec)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    for split, arrays in splits.items():
        tmp = out / f".{split}.{os.getpid()}.tmp.npz"
        np.savez_compressed(tmp, **arrays)
        os.replace(tmp, out / f"{split}.npz")
    meta = {
        "spec": dataclasses.asdict(spec),
        "generation_seconds": round(seconds, 3),
        "generation_cpu_seconds": round(cpu, 3),  # this process's CPU time (wall: load)
        "label_counts": {
            s: np.bincount(a["labels"], minlength=2).tolist() for s, a in splits.items()
        },
    }
    tmp = out / f".spec.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, done)  # written last: marks the cache complete
    return out


def load_generated(directory: str | os.PathLike) -> dict[str, dict[str, np.ndarray]]:
    """Read a generated cache: split -> {"images", "labels", "markers"}."""
    out = {}
    for split in SPLITS:
        with np.load(Path(directory) / f"{split}.npz") as f:
            out[split] = {k: f[k] for k in f.files}
    return out


def measure(spec: PathfinderSpec, n: int = 2000, seed: int = 11) -> dict[str, float]:
    """What ``python -m train.data.pathfinder`` prints for ``n`` images of ``spec``.

    ``images_per_cpu_second`` (this process's CPU time), ``label_visible`` (share of images
    where ``markers_connected`` equals the label), ``connected_if_1`` / ``apart_if_0``, the
    ROC AUC of the marker distance and of the amount of ink for the label (0.5: no
    shortcut), and ``distractors`` (mean number drawn).
    """
    labels = np.arange(n) % 2
    cpu = time.process_time()
    out = generate_images(spec, labels, np.random.default_rng(seed))
    cpu = time.process_time() - cpu
    seen = markers_connected(out["images"], out["markers"])
    distance = np.linalg.norm(out["markers"][:, 0] - out["markers"][:, 1], axis=-1)
    ink = out["images"].reshape(n, -1).astype(np.int64).sum(-1)
    return {
        "images_per_cpu_second": n / max(cpu, 1e-9),
        "label_visible": float((seen == labels).mean()),
        "connected_if_1": float(seen[labels == 1].mean()),
        "apart_if_0": float(1 - seen[labels == 0].mean()),
        "auc_marker_distance": auc(distance, labels),
        "auc_ink": auc(ink, labels),
        "distractors": float(out["distractors"].mean()),
    }


def auc(feature: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve of ``feature`` for 0/1 ``labels`` (Mann-Whitney, ties halved)."""
    feature, labels = np.asarray(feature), np.asarray(labels)
    pos, neg = feature[labels == 1], feature[labels == 0]
    greater = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return float(greater / (len(pos) * len(neg)))


# ----------------------------------------------------------------------------- release
def read_metadata(directory: str | os.PathLike) -> list[tuple[str, int]]:
    """Rows of a released difficulty folder: (image path, label), in file/row order."""
    directory = Path(directory)
    files = sorted(
        (directory / "metadata").glob("*.npy"),
        key=lambda p: (int(m.group()) if (m := re.search(r"\d+", p.stem)) else -1, p.name),
    )
    rows = []
    for meta in files:
        for lineno, line in enumerate(meta.read_text().splitlines(), 1):
            cols = line.split()
            if not cols:
                continue
            if len(cols) < 4:
                raise ValueError(f"{meta}:{lineno}: expected >= 4 columns, got {line!r}")
            rows.append((str(directory / cols[0] / cols[1]), int(cols[3])))
    return rows


def _decode_png(row: tuple[str, int]) -> dict[str, np.ndarray]:
    from PIL import Image

    path, label = row
    with Image.open(path) as im:
        pixels = np.asarray(im.convert("L"), dtype=np.int32)
    return {"inputs": pixels.reshape(-1), "targets": np.int32(label)}


def release_splits(directory: str | os.PathLike, image_size: int = 32) -> dict[str, LazySource]:
    """Released images as lazy sources, split 80/10/10 after a seed-0 permutation."""
    rows = [r for r in read_metadata(directory) if os.path.getsize(r[0]) > 0]
    if not rows:
        raise ValueError(f"no non-empty images listed under {directory}/metadata")
    order = np.random.default_rng(0).permutation(len(rows))
    a, b = int(0.8 * len(rows)), int(0.9 * len(rows))
    parts = {"train": order[:a], "val": order[a:b], "test": order[b:]}
    return {s: LazySource(rows, _decode_png, np.sort(idx)) for s, idx in parts.items()}


# ----------------------------------------------------------------------------- task
def spec_from_config(cfg: Mapping[str, Any]) -> PathfinderSpec:
    """``MINI`` or ``FULL`` (``cfg["difficulty"]``: LRA's easy/intermediate/hard lengths for
    ``full``), then any ``PathfinderSpec`` field set in ``cfg``; ``data_seed`` -> seed."""
    if _config.variant(cfg) == "mini":
        base = MINI
    else:
        base = difficulty_spec(_config.choice(cfg, "difficulty", "hard", tuple(DIFFICULTY_DIRS)))
    fields = {f.name for f in dataclasses.fields(PathfinderSpec)} - {"seed"}
    overrides = {k: cfg[k] for k in fields if cfg.get(k) is not None}
    return dataclasses.replace(base, seed=int(cfg.get("data_seed") or 0), **overrides)


def release_dirs(cfg: Mapping[str, Any], difficulty: str) -> list[Path]:
    sub = DIFFICULTY_DIRS[difficulty]
    root = _config.data_dir(cfg)
    dirs = []
    if cfg.get("pathfinder_dir"):
        dirs.append(Path(os.path.expanduser(str(cfg["pathfinder_dir"]))) / sub)
    if cfg.get("lra_dir"):
        dirs.append(Path(os.path.expanduser(str(cfg["lra_dir"]))) / "pathfinder32" / sub)
    return dirs + [root / "lra_release" / "pathfinder32" / sub, root / "pathfinder32" / sub]


def build_task(cfg: Mapping[str, Any]) -> Task:
    """Pathfinder ``Task`` from a config dict (see ``train.data.get_task`` for the keys)."""
    source = _config.choice(cfg, "source", "generated", ("generated", "lra"))
    if source == "lra":
        difficulty = _config.choice(cfg, "difficulty", "hard", tuple(DIFFICULTY_DIRS))
        candidates = release_dirs(cfg, difficulty)
        found = next((d for d in candidates if (d / "metadata").is_dir()), None)
        if found is None:
            raise DatasetNotFoundError(
                f"pathfinder32 {difficulty} (LRA release)",
                [d / "metadata" for d in candidates],
                "  Download the LRA release (lra_release.gz from the google-research/"
                "long-range-arena README) on a machine with internet, extract it and set "
                "config.lra_dir to its lra_release/ folder (or config.pathfinder_dir to the "
                "folder holding curv_baseline/, curv_contour_length_9/, "
                "curv_contour_length_14/).\n"
                "  Or use the generated data: config.source='generated' (the default), made by: "
                "python -m train.data.prepare pathfinder --data_dir DIR [--variant mini]",
            )
        splits = release_splits(found)
        image_size = int(math.isqrt(len(splits["train"][0]["inputs"])))
        info = {"source": "lra", "directory": str(found), "difficulty": difficulty}
    else:
        spec = spec_from_config(cfg)
        directory = cache_dir(_config.data_dir(cfg), spec)
        if not (directory / "spec.json").exists():
            if cfg.get("generate", True) is False:
                raise DatasetNotFoundError(
                    "pathfinder (generated)",
                    [directory],
                    f"  python -m train.data.prepare pathfinder --data_dir {_config.data_dir(cfg)}"
                    f" --variant {_config.variant(cfg)}   (or leave config.generate unset)",
                )
            prepare(_config.data_dir(cfg), spec)
        data = load_generated(directory)
        image_size = spec.image_size
        splits = {
            s: ArraySource(
                {"inputs": d["images"].reshape(len(d["images"]), -1), "targets": d["labels"]}
            )
            for s, d in data.items()
        }
        info = {
            "source": "generated",
            "directory": str(directory),
            "spec": dataclasses.asdict(spec),
            "label_counts": {
                s: np.bincount(d["labels"], minlength=2).tolist() for s, d in data.items()
            },
        }
    seq_len = image_size * image_size
    if cfg.get("seq_len") not in (None, seq_len):
        raise ValueError(
            f"pathfinder images are {image_size}x{image_size}, so seq_len must be {seq_len}, "
            f"got {cfg['seq_len']}"
        )
    info["image_shape"] = (image_size, image_size)
    return Task(
        name="pathfinder",
        splits=splits,
        vocab_size=VOCAB_SIZE,
        num_classes=NUM_CLASSES,
        seq_len=seq_len,
        is_pair=False,
        batch_size=_config.positive_int(cfg, "batch_size", 32),
        seed=int(cfg.get("seed") or 0),
        info=info,
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m train.data.pathfinder [--variant mini|full] [--difficulty D] [--n N]``:
    generation rate, label visibility and shortcut AUCs of a setting (see ``measure``)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m train.data.pathfinder")
    parser.add_argument("--variant", choices=("mini", "full", "pathx"), default="full")
    parser.add_argument("--difficulty", choices=tuple(DIFFICULTY_DIRS), default="hard")
    parser.add_argument("--n", type=int, default=2000, help="images to draw (even)")
    args = parser.parse_args(argv)
    if args.variant == "pathx":
        spec = PATHX
    else:
        spec = spec_from_config({"variant": args.variant, "difficulty": args.difficulty})
    print(
        f"{args.variant} ({args.difficulty if args.variant == 'full' else 'preset'}), "
        f"{args.n} images: {spec}"
    )
    for key, value in measure(spec, args.n).items():
        print(f"  {key}: {value:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
