"""Pathfinder (LRA ``pathfinder32``): numpy generator, connectivity check, release reader.

Task: a grayscale image holds two marked endpoints (small disks) and several curved,
dashed contours; the label is 1 when one contour joins the two markers, 0 when they sit
on two different contours. Sequence models read the image flattened row-major, pixel
values 0..255 as tokens (``vocab_size = 256``, ``seq_len = H * W``).

Our generator (numpy only, vectorised across images) follows the shape of Linsley et
al.'s generator as LRA configured it for pathfinder32 (marker radius 1.5, one-pixel
paddle margins, distractors a third of the contour length, 20 // that many of them) but
is our own, simpler construction:

* A contour is a chain of ``contour_length`` **dashes**; the dash is the unit of contour
  length, like Linsley's paddles (LRA: 6 = easy, 9 = intermediate, 14 = hard; our full
  default is 14). Each dash is a straight segment of ``dash_length`` pixels (1.0) followed
  by a gap of ``gap`` pixels (1.5) in the same direction, so a dash advances 2.5 px and a
  14-dash contour is 35 px of arc; the direction turns by a uniform angle in
  ``[-max_turn, max_turn]`` (45 degrees) between dashes. Pixels are the dash points
  rounded to the grid (1 pixel thick, value 255). (LRA's paddles are 2 px; shorter dashes
  let two 14-dash contours and the distractors fit in 32x32 with the spacing below.) A
  contour is drawn first and then moved to a uniformly random position where it fits.
  The ``mini`` variant: 16x16 images (256 tokens), 5-dash contours, 2 distractors of 2.
* Every image has two main contours of ``contour_length`` dashes and up to
  ``num_distractors`` distractor contours of ``distractor_length`` dashes. Positive: the
  markers (disks of radius 1.5 px, a 3x3 block) sit on both ends of main contour A.
  Negative: one on an end of A, one on an end of B. Both classes draw the same contours,
  so only the connection tells them apart. Labels are exactly balanced per split.
* Guarantee that makes the label checkable from pixels alone: two pixels are *linked*
  when their Chebyshev distance is at most ``LINK_RADIUS`` (2). Consecutive dashes of a
  contour are linked (a gap below 2 px moves a rounded point at most 2 px per axis), and
  different contours (with their marker disks) are placed at least ``LINK_RADIUS + 1``
  pixels apart (rejection sampling of whole contours). So the markers are connected by
  linked "on" pixels exactly when label = 1; ``endpoints_connected`` checks it by flood
  fill.

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
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from . import _config
from .errors import DatasetNotFoundError
from .pipeline import ArraySource, LazySource, Task

VOCAB_SIZE = 256
NUM_CLASSES = 2
LINK_RADIUS = 2
_BLOCK = 4096  # images generated together
SPLITS = ("train", "val", "test")
DIFFICULTY_DIRS = {
    "easy": "curv_baseline",
    "intermediate": "curv_contour_length_9",
    "hard": "curv_contour_length_14",
}
_MARKER = np.array([(dy, dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1)])  # radius-1.5 disk
_LINK = np.array(
    [
        (dy, dx)
        for dy in range(-LINK_RADIUS, LINK_RADIUS + 1)
        for dx in range(-LINK_RADIUS, LINK_RADIUS + 1)
    ]
)


@dataclasses.dataclass(frozen=True)
class PathfinderSpec:
    """Generation parameters (defaults: LRA pathfinder32 hard, full size)."""

    image_size: int = 32
    contour_length: int = 14  # dashes per main contour (the difficulty knob)
    distractor_length: int = 4  # dashes per distractor (LRA: contour_length // 3)
    num_distractors: int = 5  # LRA: 20 // distractor_length
    dash_length: float = 1.0  # pixels
    gap: float = 1.5  # pixels between dashes (< 2 keeps dashes linked)
    max_turn_degrees: float = 45.0
    num_train: int = 160_000  # LRA: 80/10/10 of 200k images
    num_val: int = 20_000
    num_test: int = 20_000
    seed: int = 0
    tries: int = 40  # candidate contours tried per slot before an image is redrawn

    def __post_init__(self):
        if self.image_size < 8:
            raise ValueError(f"image_size must be >= 8, got {self.image_size}")
        if min(self.contour_length, self.dash_length) <= 0 or self.distractor_length < 0:
            raise ValueError("contour_length and dash_length must be positive")
        if not 0.0 <= self.gap < 2.0:
            raise ValueError(f"gap must be in [0, 2) pixels so dashes stay linked, got {self.gap}")
        for name in ("num_train", "num_val", "num_test"):
            if getattr(self, name) % 2:
                raise ValueError(f"{name} must be even (balanced), got {getattr(self, name)}")

    def cache_name(self) -> str:
        return (
            f"s{self.image_size}_len{self.contour_length}_d{self.num_distractors}x"
            f"{self.distractor_length}_dash{self.dash_length:g}_gap{self.gap:g}"
            f"_turn{self.max_turn_degrees:g}_n{self.num_train}-{self.num_val}-{self.num_test}"
            f"_seed{self.seed}"
        )


FULL = PathfinderSpec()
MINI = PathfinderSpec(
    image_size=16,
    contour_length=5,
    distractor_length=2,
    num_distractors=2,
    num_train=4_000,
    num_val=500,
    num_test=500,
)


# ----------------------------------------------------------------------------- generator
def _contours(
    rng: np.random.Generator, shape: tuple[int, ...], length: int, spec, markers: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random dashed contours placed uniformly where they fit.

    Returns (pixels int32 ``[*shape, P, 2]`` (y, x) in path order, footprint
    ``[*shape, F, 2]`` (pixels plus marker disks at both ends if ``markers``), fits bool
    ``[*shape]``). ``P = length * points_per_dash``; points along a dash are <= 0.5 px
    apart so the rounded pixels of one dash are 8-connected. The shape is drawn first and
    then shifted by a uniform integer offset among those that keep its footprint inside
    the image (``fits`` is False when no offset does).
    """
    size = spec.image_size
    per_dash = int(math.ceil(spec.dash_length / 0.5)) + 1
    turn = math.radians(spec.max_turn_degrees)
    angle = rng.uniform(0.0, 2 * math.pi, size=(*shape, 1)) + np.cumsum(
        rng.uniform(-turn, turn, size=(*shape, length)), axis=-1
    )
    step = np.stack([np.sin(angle), np.cos(angle)], axis=-1)  # [..., L, 2]
    advance = (spec.dash_length + spec.gap) * step
    start = rng.uniform(0.0, 1.0, size=(*shape, 1, 2))  # sub-pixel phase of the rounding
    dash_start = start + np.cumsum(advance, axis=-2) - advance
    t = np.linspace(0.0, spec.dash_length, per_dash)  # [m]
    pts = np.expand_dims(dash_start, -2) + t[:, None] * np.expand_dims(step, -2)  # [...,L,m,2]
    pix = np.rint(pts).astype(np.int32).reshape(*shape, length * per_dash, 2)
    foot = _with_markers(pix) if markers else pix
    low, high = foot.min(axis=-2), foot.max(axis=-2)  # [..., 2]
    room = (size - 1 - high) - (-low)  # number of valid offsets minus one, per axis
    fits = (room >= 0).all(axis=-1)
    offset = -low + np.floor(rng.uniform(size=room.shape) * (np.maximum(room, 0) + 1))
    offset = offset.astype(np.int32)[..., None, :]
    return pix + offset, foot + offset, fits


def _with_markers(pix: np.ndarray) -> np.ndarray:
    """Append the marker disks at both ends of each contour: ``[..., P + 18, 2]``."""
    ends = [pix[..., :1, :] + _MARKER, pix[..., -1:, :] + _MARKER]
    return np.concatenate([pix, *ends], axis=-2)


def _place(
    rng: np.random.Generator,
    blocked: np.ndarray,
    need: np.ndarray,
    length: int,
    spec: PathfinderSpec,
    markers: bool,
) -> tuple[np.ndarray, np.ndarray]:
    """Try to place one contour per image where ``need``; returns (placed mask, pixels).

    ``blocked`` ([N, S, S] bool, updated in place) marks pixels within LINK_RADIUS of
    everything already drawn; a candidate is accepted if it fits in the image and touches
    no blocked pixel, then its LINK_RADIUS neighbourhood is blocked in turn. Up to
    ``spec.tries`` candidates per image, drawn a few at a time for the images still
    waiting.
    """
    n, size = blocked.shape[0], spec.image_size
    per_dash = int(math.ceil(spec.dash_length / 0.5)) + 1
    placed = np.zeros((n,), dtype=bool)
    chosen = np.zeros((n, length * per_dash, 2), dtype=np.int32)
    tries = 0
    while tries < spec.tries:
        waiting = np.flatnonzero(need & ~placed)
        if not len(waiting):
            break
        chunk = min(4, spec.tries - tries)
        tries += chunk
        cand, foot, fits = _contours(rng, (chunk, len(waiting)), length, spec, markers)
        for r in range(chunk):
            sel = fits[r] & ~placed[waiting]  # positions in ``waiting`` to try
            rows = waiting[sel]
            if not len(rows):
                continue
            f = foot[r, sel]  # [k, F, 2]
            free = ~blocked[rows[:, None], f[..., 0], f[..., 1]].any(axis=1)
            rows, f = rows[free], f[free]
            if not len(rows):
                continue
            placed[rows] = True
            chosen[rows] = cand[r, sel][free]
            near = np.clip(f[:, :, None, :] + _LINK, 0, size - 1).reshape(len(rows), -1, 2)
            blocked[rows[:, None], near[..., 0], near[..., 1]] = True
    return placed, chosen


def _draw(images: np.ndarray, rows: np.ndarray, pix: np.ndarray) -> None:
    """Set the pixels ``pix`` ([k, P, 2]) of images ``rows`` to 255."""
    images[rows[:, None], pix[..., 0], pix[..., 1]] = 255


def generate_images(
    spec: PathfinderSpec, labels: np.ndarray, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Images for the given labels: (uint8 ``[N, S, S]``, marker centres int32 ``[N, 2, 2]``)."""
    labels = np.asarray(labels)
    n, size = len(labels), spec.image_size
    images = np.zeros((n, size, size), dtype=np.uint8)
    markers = np.zeros((n, 2, 2), dtype=np.int32)
    todo = np.arange(n)
    while len(todo):
        k = len(todo)
        blocked = np.zeros((k, size, size), dtype=bool)
        everyone = np.ones((k,), dtype=bool)
        ok_a, a = _place(rng, blocked, everyone, spec.contour_length, spec, markers=True)
        ok_b, b = _place(rng, blocked, ok_a, spec.contour_length, spec, markers=True)
        good = ok_a & ok_b  # images without both main contours are redrawn
        canvas = np.zeros((k, size, size), dtype=np.uint8)
        rows = np.arange(k)
        _draw(canvas, rows, a)
        _draw(canvas, rows, b)
        for _ in range(spec.num_distractors):
            ok_d, d = _place(rng, blocked, good, spec.distractor_length, spec, markers=False)
            _draw(canvas, rows[ok_d], d[ok_d])
        # marker 1 on a random end of A; marker 2 on A's other end (label 1) or on a
        # random end of B (label 0)
        end_a = rng.integers(0, 2, size=k)
        end_b = rng.integers(0, 2, size=k)
        ends_a = np.stack([a[:, 0], a[:, -1]], axis=1)  # [k, 2, 2]
        ends_b = np.stack([b[:, 0], b[:, -1]], axis=1)
        first = ends_a[rows, end_a]
        positive = labels[todo] == 1
        second = np.where(positive[:, None], ends_a[rows, 1 - end_a], ends_b[rows, end_b])
        for centre in (first, second):
            disk = centre[:, None, :] + _MARKER  # [k, 9, 2]
            _draw(canvas, rows, disk)
        images[todo[good]] = canvas[good]
        markers[todo[good]] = np.stack([first, second], axis=1)[good]
        todo = todo[~good]
    return images, markers


def generate(spec: PathfinderSpec) -> dict[str, dict[str, np.ndarray]]:
    """The three splits: split -> {"images" uint8 [N,S,S], "labels" uint8 [N], "markers"}.

    Split ``i`` uses the random stream ``SeedSequence([spec.seed, i])``, so its content
    does not depend on the sizes of the other splits. Labels: exactly half are 1, shuffled.
    """
    out = {}
    sizes = (spec.num_train, spec.num_val, spec.num_test)
    for i, (split, n) in enumerate(zip(SPLITS, sizes, strict=True)):
        rng = np.random.default_rng(np.random.SeedSequence([spec.seed, i]))
        labels = rng.permutation(np.arange(n) % 2).astype(np.uint8)
        # blocks of _BLOCK images bound the memory of the vectorised placement
        parts = [generate_images(spec, labels[i : i + _BLOCK], rng) for i in range(0, n, _BLOCK)]
        size = spec.image_size
        images = np.concatenate([p[0] for p in parts]) if parts else np.zeros((0, size, size))
        markers = np.concatenate([p[1] for p in parts]) if parts else np.zeros((0, 2, 2))
        out[split] = {
            "images": images.astype(np.uint8),
            "labels": labels,
            "markers": markers.astype(np.int32),
        }
    return out


# ----------------------------------------------------------------------------- checking
def endpoints_connected(
    image: np.ndarray,
    a: tuple[int, int],
    b: tuple[int, int],
    *,
    link_radius: int = LINK_RADIUS,
    threshold: int = 0,
) -> bool:
    """Whether pixels ``a`` and ``b`` (y, x) are joined by "on" pixels (``> threshold``).

    Flood fill from ``a`` over on-pixels, stepping to any on-pixel within Chebyshev
    distance ``link_radius`` (so dashes separated by small gaps count as one path).
    """
    image = np.asarray(image)
    if image.ndim != 2:
        raise ValueError(f"image must be [H, W], got shape {image.shape}")
    on = image > threshold
    h, w = on.shape
    if not (on[tuple(a)] and on[tuple(b)]):
        return False
    seen = np.zeros_like(on)
    seen[tuple(a)] = True
    queue = deque([tuple(a)])
    while queue:
        y, x = queue.popleft()
        if (y, x) == tuple(b):
            return True
        y0, y1 = max(0, y - link_radius), min(h, y + link_radius + 1)
        x0, x1 = max(0, x - link_radius), min(w, x + link_radius + 1)
        fresh = on[y0:y1, x0:x1] & ~seen[y0:y1, x0:x1]
        for dy, dx in zip(*np.nonzero(fresh), strict=True):
            seen[y0 + dy, x0 + dx] = True
            queue.append((y0 + int(dy), x0 + int(dx)))
    return False


def save_grid(
    path: str | os.PathLike,
    images: np.ndarray,
    labels: np.ndarray,
    *,
    cols: int = 8,
    scale: int = 1,
) -> np.ndarray:
    """Save images ([N, H, W] uint8) as one PNG grid with a label bar; returns the array.

    Each tile gets a 1-pixel border and a 2-pixel bar under it: white for label 1
    (connected), dark grey for label 0. ``scale`` enlarges every pixel to a
    ``scale x scale`` block (for display); the saved grid is ``[rows * (H + 4) * scale,
    cols * (W + 2) * scale]``.
    """
    from PIL import Image

    images = np.asarray(images, dtype=np.uint8)
    n, h, w = images.shape
    rows = math.ceil(n / cols)
    th, tw = h + 4, w + 2
    grid = np.full((rows * th, cols * tw), 96, dtype=np.uint8)
    for i in range(n):
        r, c = divmod(i, cols)
        grid[r * th + 1 : r * th + 1 + h, c * tw + 1 : c * tw + 1 + w] = images[i]
        grid[r * th + h + 2 : r * th + h + 4, c * tw + 1 : c * tw + 1 + w] = (
            255 if labels[i] else 40
        )
    grid = np.repeat(np.repeat(grid, scale, axis=0), scale, axis=1)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(grid, mode="L").save(path)
    return grid


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
    start = time.perf_counter()
    splits = generate(spec)
    seconds = time.perf_counter() - start
    for split, arrays in splits.items():
        tmp = out / f".{split}.{os.getpid()}.tmp.npz"
        np.savez_compressed(tmp, **arrays)
        os.replace(tmp, out / f"{split}.npz")
    meta = {
        "spec": dataclasses.asdict(spec),
        "generation_seconds": round(seconds, 3),
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
    base = MINI if _config.variant(cfg) == "mini" else FULL
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
