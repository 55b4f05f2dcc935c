"""Pathfinder's snakes generator (LRA ``pathfinder32``), built like Linsley et al.'s.

Task (see ``train.data.pathfinder``): a grayscale image holds two round markers and several
curved contours made of short antialiased line segments ("paddles"); the label is 1 when
both markers sit on the same contour, 0 when they sit on two different ones.

The generator follows the construction of Linsley et al. 2018's "snakes" generator
(``snakes2.py`` in github.com/drewlinsley/pathfinder), which LRA used for pathfinder32
with: contour length 14 paddles for "hard" (6 and 9 for the easier splits), distractors
of ``contour_length // 3`` paddles, ``20 // that`` many of them (4 x 5 at length 14),
paddle length 2, paddle margin 1, seed distance 7, continuity 1.0, contrast 2 x 0.75,
marker radius 1.5, 32 x 32 images. It is our own numpy code, vectorised across images:

* **Paddles.** A paddle is a segment of ``paddle_length`` px drawn with thickness
  ``paddle_thickness`` and antialiased: a pixel's value is its approximate coverage
  ``clip(thickness / 2 + 0.5 - d, 0, 1)`` (``d`` = distance from the pixel centre to the
  segment), times the contour's contrast; overlapping ink takes the maximum.
* **Growth** (Linsley's ``extend_snake``). A contour keeps a pivot and an orientation;
  the next pivot is ``paddle_length + 2 * margin`` further along the orientation, and the
  next paddle runs from ``margin`` to ``margin + paddle_length`` px from it in a new
  direction ``phi``, so consecutive paddles are separated by a gap of about
  ``2 * margin``. ``phi`` is drawn among directions one pixel of arc apart on the circle
  of radius ``paddle_length + margin`` (ours start at a random phase per step: continuous
  orientations) with probability proportional to ``cos(min(continuity * |phi - theta|,
  pi / 2)) ** 2``, restricted to paddles inside the image whose head is free (below).
* **Two main contours** (Linsley's ``two_snakes``). The origin (the tail of the first
  paddle) of contour 0 is a pixel at least ``2 * seed_distance`` from the border (fewer
  in small images: see ``_origin_border``); the origin of contour 1 is that point moved
  ``seed_distance`` px in a uniformly random direction and rounded, so the origins are
  always ``seed_distance`` (+- rounding) apart. Each grows from the head of its first
  paddle, the two alternating one paddle at a time, for ``contour_length`` paddles.
  **Different contours never touch** (Linsley's mask: every paddle's body dilated by
  ``margin``; a new paddle whose dilated body overlaps the mask is rejected): every paddle
  keeps ``separation = paddle_thickness + 2 * margin`` px between its centre line and the
  other contour's paddles, and ``marker_separation`` (``separation`` plus what the marker
  disk adds beyond the paddle) from the other contour's tips, where markers go. A contour
  keeps ``paddle_thickness / 2 + margin`` from its own paddles but the last (Linsley's
  mask lags one paddle; our smaller radius keeps the marker distance at chance, see
  below). An image whose main contours get stuck is redrawn.
* **Distractors** (Linsley's ``make_many_snakes``): ``num_distractors`` contours of
  ``distractor_length`` paddles, seeded on a uniformly random free pixel and grown the
  same way, keeping ``separation`` from the main contours and ``marker_separation`` from
  their tips, as Linsley's shared mask does; unlike Linsley's, distractors may touch and
  cross each other (which never joins the two main contours). A distractor that gets stuck
  is retried ``tries`` times and then left out (Linsley: ``allow_incomplete``).
  An earlier version (commit 126729c) let distractors cross the main contours and checked
  the main contours only at a paddle's head and middle: the markers' ink connectivity
  then agreed with the label in only 55% (full) / 69% (mini) of the images, so the label
  was often not in the picture. Now it agrees in 100.0% of 2000 images for both
  (``markers_connected``: 4-connected ink > 0; ``python -m train.data.pathfinder``).
* **Contrast.** Main-contour paddles get ``snake_contrast * paddle_contrast`` (1 x 0.75:
  LRA's "2 x 0.75" is the one-entry snake contrast list [1.0] repeated for the two main
  contours, times the paddle contrast 0.75), distractors ``snake_contrast`` (Linsley
  passes only the snake contrast to ``make_many_snakes``), markers 1. Linsley's
  ``imsave`` byte-scaled each image to its own maximum; we divide by the largest
  possible value, ``max(snake_contrast, 1)``, so an image's grey levels do not depend on
  its content.
* **Markers and label** (Linsley's ``from_wrapper``). A disk of radius ``marker_radius``
  (antialiased like the paddles) goes on the origin of a random main contour ``o``, the
  other on the terminal tip (the head of the last paddle) of contour ``o`` for label 1 or
  of contour ``1 - o`` for label 0. The label comes from this construction, never from
  the pixels (which agree with it: see above). Both classes
  draw exactly the same things, and the two origins are a fixed distance apart, so
  neither the marker distance nor the amount of ink carries the label (measured in
  ``tests/test_data_pathfinder.py`` for ``FULL`` and ``MINI``; not checked for the easier
  settings, where shorter contours make the marker distance of label 1 smaller on
  average). Labels are exactly balanced per split.

What Linsley's code does that ours does not: integer pixel heads truncated from the
circle, a 4x supersampled PIL line resized with Lanczos (ours: analytic coverage), and
rejection tests on rasterised masks; we test exact distances between segments instead
(``_body_gap``). ``tries`` bounds our retries where Linsley's ``max_*_retrial`` do.

Presets: ``FULL`` (LRA pathfinder32 hard, 200k images as 160k/20k/20k), ``difficulty_spec``
for easy/intermediate/hard (contour length 6/9/14), ``PATHX`` (128 x 128; paddle length 5,
margin 2, seed distance 20, marker radius 3: our scaling, LRA's Path-X parameters are not
in its paper), and ``MINI`` (12 x 12 for CPU training, see its comment).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from train.configs.pathfinder_spec import (  # noqa: F401  (re-exported)
    DIFFICULTY_LENGTHS,
    FULL,
    MINI,
    PATHX,
    SPLITS,
    PathfinderSpec,
    difficulty_spec,
)

_BLOCK = 4096  # images generated together
_CANDIDATES = 16  # seed positions tried at once per image


# ----------------------------------------------------------------------------- drawing
_FAR = np.float32(1e4)  # position of paddles not drawn (yet): never near anything


def _unit(angle: np.ndarray) -> np.ndarray:
    """(y, x) unit vectors ``[..., 2]`` for angles in radians (y down, like Linsley's)."""
    return np.stack([np.sin(angle), np.cos(angle)], axis=-1)


def _point_segment_distance(p: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Distance from points ``p`` [..., 2] to segments ``a``-``b`` (broadcast) [...]."""
    aby, abx = b[..., 0] - a[..., 0], b[..., 1] - a[..., 1]
    apy, apx = p[..., 0] - a[..., 0], p[..., 1] - a[..., 1]
    len2 = np.maximum(aby * aby + abx * abx, 1e-12)
    t = np.clip((apy * aby + apx * abx) / len2, 0.0, 1.0)
    dy, dx = apy - t * aby, apx - t * abx
    return np.sqrt(dy * dy + dx * dx)


def _clearance(p: np.ndarray, segments: np.ndarray) -> np.ndarray:
    """Distance from points ``p`` [k, P, 2] to the nearest of ``segments`` [k, M, 2, 2]."""
    if segments.shape[1] == 0:
        return np.full(p.shape[:-1], np.inf, dtype=np.float32)
    segments = segments.astype(np.float32)
    a, b = segments[:, None, :, 0], segments[:, None, :, 1]  # [k, 1, M, 2]
    return _point_segment_distance(p[:, :, None].astype(np.float32), a, b).min(-1)


def _cross(o: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """z of (a - o) x (b - o) for (y, x) points (broadcast)."""
    return (a[..., 0] - o[..., 0]) * (b[..., 1] - o[..., 1]) - (a[..., 1] - o[..., 1]) * (
        b[..., 0] - o[..., 0]
    )


def _body_gap(tail: np.ndarray, head: np.ndarray, segments: np.ndarray) -> np.ndarray:
    """Distance from candidate paddles ``tail``-``head`` ([k, C, 2] each) to the nearest of
    ``segments`` ([k, M, 2, 2]; ``_FAR`` ones are never near): ``[k, C]``, 0 where they cross.

    Exact for segments in the plane: the smallest of the four endpoint-to-segment distances,
    or 0 when the two segments properly intersect.
    """
    if segments.shape[1] == 0:
        return np.full(tail.shape[:-1], np.inf, dtype=np.float32)
    segments = segments.astype(np.float32)
    a, b = tail[:, :, None].astype(np.float32), head[:, :, None].astype(np.float32)
    c, d = segments[:, None, :, 0], segments[:, None, :, 1]  # [k, 1, M, 2]
    gap = np.minimum(
        np.minimum(_point_segment_distance(a, c, d), _point_segment_distance(b, c, d)),
        np.minimum(_point_segment_distance(c, a, b), _point_segment_distance(d, a, b)),
    )
    crossing = (_cross(a, b, c) * _cross(a, b, d) < 0) & (_cross(c, d, a) * _cross(c, d, b) < 0)
    return np.where(crossing, 0.0, gap).min(-1)


def _inside(p: np.ndarray, size: int) -> np.ndarray:
    return ((p >= 0) & (p <= size - 1)).all(axis=-1)


def _render(spec: PathfinderSpec, segments: np.ndarray, values: np.ndarray) -> np.ndarray:
    """uint8 images ``[n, S, S]`` from segments ``[n, M, 2, 2]`` (tail, head; a marker is a
    segment of length 0) with half widths and contrasts ``values`` ``[M, 2]``.

    A pixel's ink is ``clip(half_width + 0.5 - d, 0, 1) * contrast`` (max over segments),
    divided by ``max(snake_contrast, 1)``; only a window around each segment is computed.
    """
    n, size = len(segments), spec.image_size
    reach = float(values[:, 0].max()) + 0.5
    longest = spec.paddle_length
    window = int(math.ceil(longest + 2 * reach)) + 2
    pad = window + 1
    side = size + 2 * pad
    ink = np.zeros((n, side, side), dtype=np.float32)
    rows = np.arange(n)[:, None, None]
    ar = np.arange(window)
    for m in range(segments.shape[1]):
        a, b = segments[:, m, 0], segments[:, m, 1]
        drawn = (a < _FAR / 2).all(-1)  # far-away filler: not drawn
        lo = np.floor(np.minimum(a, b) - reach).astype(np.int64)
        lo = np.where(drawn[:, None], lo, -pad)
        ys, xs = lo[:, :1] + ar, lo[:, 1:] + ar  # [n, W]
        p = np.stack(np.broadcast_arrays(ys[:, :, None], xs[:, None, :]), axis=-1)
        d = _point_segment_distance(p.astype(np.float32), a[:, None, None], b[:, None, None])
        cover = np.clip(values[m, 0] + 0.5 - d, 0.0, 1.0) * values[m, 1]
        cover *= drawn[:, None, None]
        idx = (rows, ys[:, :, None] + pad, xs[:, None, :] + pad)
        ink[idx] = np.maximum(ink[idx], cover)
    core = ink[:, pad : pad + size, pad : pad + size] / max(spec.snake_contrast, 1.0)
    return np.rint(np.clip(core, 0.0, 1.0) * 255).astype(np.uint8)


def _origin_border(spec: PathfinderSpec) -> int:
    """Linsley keeps the first origin ``2 * seed_distance`` from the border; in images too
    small for that (16 x 16 mini) we keep at least a 4 x 4 region in the middle."""
    return int(min(2 * spec.seed_distance, spec.image_size // 2 - 2))


def _turn(rng, spec, pivot, theta, blocked):
    """One growth step for ``k`` contours: (ok [k], new pivot, new angle, paddle [k, 2, 2]).

    Candidate directions are one pixel of arc apart on the circle of radius
    ``paddle_length + margin`` around the new pivot (random phase per step), limited to
    turns with a non-zero weight; ``blocked(tail, head)`` ([k, C, 2] each) says which
    candidate paddles are not free.
    """
    k = len(pivot)
    radius = spec.paddle_length + spec.margin
    step = 2 * math.pi / max(int(math.ceil(2 * math.pi * radius)), 8)
    max_turn = min(math.pi, math.pi / (2 * spec.continuity))
    half = int(math.ceil(max_turn / step))
    offsets = rng.uniform(0.0, step, size=(k, 1)) + step * np.arange(-half, half)
    turn = np.abs(offsets)
    weight = np.cos(np.minimum(turn * spec.continuity, math.pi / 2)) ** 2
    weight = np.where(turn < math.pi, weight, 0.0)
    new_pivot = pivot + (spec.paddle_length + 2 * spec.margin) * _unit(theta)
    phi = theta[:, None] + offsets
    u = _unit(phi)
    tail = new_pivot[:, None] + spec.margin * u
    head = new_pivot[:, None] + radius * u
    ok = _inside(head, spec.image_size) & _inside(tail, spec.image_size) & (weight > 1e-9)
    ok &= ~blocked(tail, head)
    weight = np.where(ok, weight, 0.0)
    total = weight.sum(-1)
    cdf = np.cumsum(weight, axis=-1) / np.maximum(total, 1e-300)[:, None]
    pick = (cdf < rng.uniform(size=(k, 1))).sum(-1).clip(0, weight.shape[1] - 1)
    r = np.arange(k)
    paddle = np.stack([tail[r, pick], head[r, pick]], axis=1)
    return total > 0, new_pivot, phi[r, pick], paddle


def _first_paddle(rng, spec, tail):
    """A first paddle from each tail [k, C, 2] in a random direction: (pivot, theta, head)."""
    theta = np.deg2rad(rng.integers(-180, 180, size=tail.shape[:-1]))
    u = _unit(theta)
    return tail - spec.margin * u, theta, tail + spec.paddle_length * u


def _main_contours(rng: np.random.Generator, spec: PathfinderSpec, n: int):
    """Two main contours per image: (ok [n], paddles [n, 2, L, 2, 2]).

    ``paddles[i, c, j] = (tail, head)`` of paddle ``j`` of contour ``c``; the origin of
    contour ``c`` is ``paddles[i, c, 0, 0]``, its terminal tip ``paddles[i, c, -1, 1]``.
    Every paddle keeps ``separation`` from the other contour's paddles and from its own
    (but the last: Linsley's mask lags one paddle), and ``marker_separation`` from the
    other contour's tips. Rows with ``ok`` False got stuck and must be redrawn; they are
    dropped from the remaining steps.
    """
    s, length = spec.image_size, spec.contour_length
    sep, msep = spec.separation, spec.marker_separation
    own_sep = spec.paddle_thickness / 2 + spec.margin
    border = _origin_border(spec)
    c_ = _CANDIDATES
    origin0 = rng.integers(border, s - border, size=(n, 1, 2)).astype(np.float64)
    tails = [np.broadcast_to(origin0, (n, c_, 2))]
    away = np.deg2rad(rng.integers(0, 360, size=(n, c_)))
    tails.append(np.rint(origin0 + spec.seed_distance * _unit(away)))
    paddles = np.full((n, 2, length, 2, 2), _FAR, dtype=np.float64)
    ok = np.ones(n, dtype=bool)
    pivots, thetas = [], []
    r = np.arange(n)
    for c in range(2):
        pivot, theta, head = _first_paddle(rng, spec, tails[c])
        good = _inside(head, s) & _inside(pivot, s)
        if c == 1:  # apart from contour 0's first paddle and its origin
            first = paddles[:, 0, :1]
            good &= _body_gap(tails[1], head, first) > sep
            good &= _body_gap(tails[1], head, _point_segments(origin0)) > msep
            good &= _clearance(tails[1], first) > msep
        pick = good.argmax(-1)
        ok &= good.any(-1)
        pivots.append(pivot[r, pick])
        thetas.append(theta[r, pick])
        paddles[:, c, 0] = np.stack([tails[c][r, pick], head[r, pick]], axis=1)
    alive = np.flatnonzero(ok)
    pivots = [p[alive] for p in pivots]
    thetas = [t[alive] for t in thetas]
    for j in range(1, length):
        for c in range(2):
            own = paddles[alive, c, : j - 1]
            other = paddles[alive, 1 - c, : j + c]  # contour 0 goes first at every step
            origin = _point_segments(paddles[alive, 1 - c, 0, 0][:, None])

            def blocked(tail, head, own=own, other=other, origin=origin):
                return (
                    (_body_gap(tail, head, own) <= own_sep)
                    | (_body_gap(tail, head, other) <= sep)
                    | (_body_gap(tail, head, origin) <= msep)
                )

            step_ok, pivot, theta, paddle = _turn(rng, spec, pivots[c], thetas[c], blocked)
            paddles[alive, c, j] = paddle
            ok[alive[~step_ok]] = False
            keep = step_ok
            alive = alive[keep]
            pivots = [p[keep] for p in pivots]
            thetas = [t[keep] for t in thetas]
            pivots[c], thetas[c] = pivot[keep], theta[keep]
    # the terminal tips (known only now) also keep marker_separation from the other contour
    for c in range(2):
        tip = paddles[alive, c, -1, 1][:, None]
        ok[alive[(_clearance(tip, paddles[alive, 1 - c]) <= msep)[:, 0]]] = False
    return ok, paddles


def _point_segments(points: np.ndarray) -> np.ndarray:
    """Points ``[k, P, 2]`` as zero-length segments ``[k, P, 2, 2]``."""
    return np.repeat(points[:, :, None], 2, axis=2)


def _distractors(rng, spec, mains: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distractor paddles ``[n, D, Ld, 2, 2]`` (``_FAR`` where left out) and counts ``[n]``.

    ``mains`` ([n, 2, L, 2, 2]) are the main contours. Every distractor paddle keeps
    ``separation`` from the main contours' paddles and ``marker_separation`` from their four
    tips, so no distractor touches a main contour or bridges the two; distractors may touch
    and cross each other.
    """
    n = len(mains)
    sep, msep = spec.separation, spec.marker_separation
    tips = _point_segments(np.concatenate([mains[:, :, 0, 0], mains[:, :, -1, 1]], axis=1))
    mains = mains.reshape(n, -1, 2, 2)
    ld = spec.distractor_length
    out = np.full((n, spec.num_distractors, ld, 2, 2), _FAR, dtype=np.float64)
    drawn = np.zeros(n, dtype=np.int64)
    s = spec.image_size
    for i in range(spec.num_distractors):
        todo = np.arange(n)
        for _attempt in range(spec.tries):
            if not len(todo):
                break
            fixed, ends = mains[todo], tips[todo]

            def blocked(tail, head, fixed=fixed, ends=ends):
                return (_body_gap(tail, head, fixed) <= sep) | (_body_gap(tail, head, ends) <= msep)

            tail = rng.integers(0, s, size=(len(todo), _CANDIDATES, 2)).astype(np.float64)
            pivot, theta, head = _first_paddle(rng, spec, tail)
            good = _inside(head, s) & _inside(pivot, s) & ~blocked(tail, head)
            pick = good.argmax(-1)
            r = np.arange(len(todo))
            ok = good.any(-1)
            pivot, theta = pivot[r, pick], theta[r, pick]
            paddles = [np.stack([tail[r, pick], head[r, pick]], axis=1)]
            for _j in range(1, ld):
                step_ok, pivot, theta, paddle = _turn(rng, spec, pivot, theta, blocked)
                ok &= step_ok
                paddles.append(paddle)
            done = todo[ok]
            out[done, i] = np.stack(paddles, axis=1)[ok]
            drawn[done] += 1
            todo = todo[~ok]
    return out, drawn


def generate_images(
    spec: PathfinderSpec,
    labels: np.ndarray,
    rng: np.random.Generator,
    *,
    keep_paddles: bool = False,
) -> dict[str, np.ndarray]:
    """Images for the given labels (see the module docstring).

    Returns ``images`` uint8 ``[N, S, S]``, ``markers`` float32 ``[N, 2, 2]`` (centres,
    (y, x); marker 0 on an origin), ``tips`` float32 ``[N, 2, 2, 2]`` (contour, origin /
    terminal, (y, x)), ``origin`` int8 ``[N]`` (the contour marker 0 sits on) and
    ``distractors`` int8 ``[N]`` (how many were drawn); with ``keep_paddles`` also
    ``main_paddles`` ``[N, 2, L, 2, 2]`` and ``distractor_paddles`` ``[N, D, Ld, 2, 2]``
    ((tail, head) per paddle; ``1e4`` where a distractor was left out).
    """
    labels = np.asarray(labels)
    if labels.ndim != 1 or not np.isin(labels, (0, 1)).all():
        raise ValueError(f"labels must be a 1-D array of 0/1, got shape {labels.shape}")
    n, length = len(labels), spec.contour_length
    mains = np.zeros((n, 2, length, 2, 2))
    todo = np.arange(n)
    rate = 1.0
    while len(todo):
        # attempts are i.i.d., so drawing more than needed and keeping the first successes
        # changes nothing but the number of (slow, small) rounds
        tries = min(int(math.ceil(1.2 * len(todo) / rate)) + 16, 4 * _BLOCK)
        ok, p = _main_contours(rng, spec, tries)
        rate = max(ok.mean(), 0.01)
        good = np.flatnonzero(ok)[: len(todo)]
        mains[todo[: len(good)]] = p[good]
        todo = todo[len(good) :]
    distract, drawn = _distractors(rng, spec, mains)
    mains = mains.reshape(n, 2 * length, 2, 2)
    tips = np.stack([mains[:, ::length, 0], mains[:, length - 1 :: length, 1]], axis=2)
    rows = np.arange(n)
    origin = rng.integers(0, 2, size=n)
    target = np.where(labels == 1, origin, 1 - origin)
    markers = np.stack([tips[rows, origin, 0], tips[rows, target, 1]], axis=1)
    segments = np.concatenate(
        [mains, distract.reshape(n, -1, 2, 2), np.repeat(markers[:, :, None], 2, axis=2)],
        axis=1,
    )
    half = spec.paddle_thickness / 2
    values = np.array(
        [(half, spec.snake_contrast * spec.paddle_contrast)] * mains.shape[1]
        + [(half, spec.snake_contrast)] * (distract.shape[1] * distract.shape[2])
        + [(spec.marker_radius, 1.0)] * 2
    )
    out = {
        "images": _render(spec, segments, values),
        "markers": markers.astype(np.float32),
        "tips": tips.astype(np.float32),
        "origin": origin.astype(np.int8),
        "distractors": drawn.astype(np.int8),
    }
    if keep_paddles:
        out["main_paddles"] = mains.reshape(n, 2, length, 2, 2)
        out["distractor_paddles"] = distract
    return out


def generate(spec: PathfinderSpec) -> dict[str, dict[str, np.ndarray]]:
    """The three splits: split -> {"images" uint8 [N,S,S], "labels" uint8 [N], ...}.

    Split ``i`` uses the random stream ``SeedSequence([spec.seed, i])``, so its content
    does not depend on the sizes of the other splits. Labels: exactly half are 1, shuffled.
    The other arrays are those of ``generate_images``.
    """
    out = {}
    sizes = (spec.num_train, spec.num_val, spec.num_test)
    for i, (split, n) in enumerate(zip(SPLITS, sizes, strict=True)):
        rng = np.random.default_rng(np.random.SeedSequence([spec.seed, i]))
        labels = rng.permutation(np.arange(n) % 2).astype(np.uint8)
        # blocks of _BLOCK images bound the memory of the vectorised drawing
        parts = [generate_images(spec, labels[i : i + _BLOCK], rng) for i in range(0, n, _BLOCK)]
        if not parts:
            parts = [generate_images(spec, labels, rng)]
        out[split] = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        out[split]["labels"] = labels
    return out


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


def markers_connected(images: np.ndarray, markers: np.ndarray, *, threshold: int = 1) -> np.ndarray:
    """Whether the two markers of each image are joined by ink in the picture: ``[N]`` bool.

    Pixels ``>= threshold`` are ink; the component of marker 0 (4-connected) is grown until
    it stops and checked for marker 1's centre pixel. This is what a reader of the image
    can see; the labels come from the construction, and ``visible_agreement`` measures how
    often the two agree.
    """
    images, markers = np.asarray(images), np.rint(np.asarray(markers)).astype(np.int64)
    ink = images >= threshold
    rows = np.arange(len(images))
    grown = np.zeros_like(ink)
    grown[rows, markers[:, 0, 0], markers[:, 0, 1]] = True
    grown &= ink
    while True:
        step = grown.copy()
        step[:, 1:] |= grown[:, :-1]
        step[:, :-1] |= grown[:, 1:]
        step[:, :, 1:] |= grown[:, :, :-1]
        step[:, :, :-1] |= grown[:, :, 1:]
        step &= ink
        if np.array_equal(step, grown):
            return grown[rows, markers[:, 1, 0], markers[:, 1, 1]]
        grown = step
