"""Landmarks: segment means over a (masked) sequence, or 2-D average pooling of an image.

Shared by the Nystrom family (nystromformer, soft, laplacian) and LARA.

1-D (default): the n unmasked tokens of a row, in order, are split into
``m_eff = min(m, n)`` contiguous segments whose sizes differ by at most one
(token of rank r goes to segment ``floor(r * m_eff / n)``), and each landmark is
its segment's mean. Masked tokens take no part, so a padded sequence gives the
landmarks of the unpadded one. When ``n < m`` the tokens themselves are the
landmarks and the remaining ``m - n`` slots are invalid (`landmark_mask` False).
The static landmark count is ``min(m, T)``.

2-D (``grid=(h, w)``): the last ``h * w`` tokens are an ``h x w`` image in row-major
order (any leading tokens, e.g. a CLS token, take no part in the landmarks); it
is average-pooled to a ``gh x gw`` grid with ``gh = min(isqrt(m), h)`` and
``gw = min(m // isqrt(m), w)`` (so ``gh * gw <= m``; 8 x 8 for m = 64), each
axis split into contiguous segments differing in size by at most one.

Two implementations of the same landmarks. `assignment` + `segment_means` build the dense
``[B, T, L]`` averaging matrix and multiply by it (``T L D`` multiply-adds per head: as
much as one of LARA's main products); they are kept as the reference. `landmarks` computes
the same means without it: a reshape-and-mean when there is no mask and the segments are
equal (``T`` divisible by ``L`` in 1-D, ``h, w`` divisible by ``gh, gw`` in 2-D), a static
gather of each segment's tokens (unequal segments, or a 2-D mask), and a segment sum with
the mask-dependent segment ids otherwise (1-D with a mask). No all-true mask is built when
`mask` is None.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def _segments(rank, n, m):
    """Segment id ``floor(rank * m / n)`` in exact integer arithmetic."""
    return (rank * m) // jnp.maximum(n, 1)


def num_landmarks(seq_len: int, m: int, grid: tuple[int, int] | None = None) -> int:
    """The static number of landmark slots for a sequence of `seq_len` tokens."""
    if grid is None:
        return min(m, seq_len)
    h, w = grid
    gh = min(math.isqrt(m), h)
    gw = min(m // max(math.isqrt(m), 1), w)
    return gh * gw


def assignment(seq_len: int, m: int, *, mask=None, batch: int = 1, grid=None):
    """Averaging weights from tokens to landmarks (dense; `landmarks` avoids this matrix).

    Args:
      seq_len: T.
      m: requested number of landmarks (``num_landmarks`` config).
      mask: optional ``[B, T]`` bool (True = a real token).
      batch: B when `mask` is None.
      grid: optional ``(h, w)`` with ``h * w <= T`` for 2-D pooling.

    Returns:
      ``(weights [B, T, L], landmark_mask [B, L])`` float32 / bool with
      ``L = num_landmarks(T, m, grid)``; each valid landmark's column of weights
      sums to 1, an invalid landmark's column is 0.
    """
    if m < 1:
        raise ValueError(f"num_landmarks must be >= 1, got {m}")
    if mask is None:
        mask = jnp.ones((batch, seq_len), bool)
    if mask.shape[-1] != seq_len:
        raise ValueError(f"mask shape {mask.shape} does not match sequence length {seq_len}")
    n_slots = num_landmarks(seq_len, m, grid)
    if grid is None:
        n = jnp.sum(mask, axis=-1, keepdims=True)  # [B, 1]
        rank = jnp.cumsum(mask, axis=-1) - 1  # rank among unmasked tokens
        m_eff = jnp.minimum(n_slots, n)
        seg = _segments(rank, n, m_eff)
    else:
        h, w = grid
        if h < 1 or w < 1 or h * w > seq_len:
            raise ValueError(f"grid={grid} must be positive with h * w <= T = {seq_len}")
        gh = min(math.isqrt(m), h)
        gw = n_slots // gh
        pos = jnp.arange(seq_len) - (seq_len - h * w)  # image positions; < 0: prefix tokens
        row, col = pos // w, pos % w
        seg = (row * gh) // h * gw + (col * gw) // w
        seg = jnp.where(pos >= 0, seg, -1)[None, :]
        mask = mask & (pos >= 0)[None, :]
    onehot = (seg[..., None] == jnp.arange(n_slots)[None, None, :]) & mask[..., None]  # [B, T, L]
    counts = jnp.sum(onehot, axis=1)  # [B, L]
    weights = onehot / jnp.maximum(counts, 1)[:, None, :]
    return weights.astype(jnp.float32), counts > 0


def segment_means(x, weights):
    """Landmarks ``[B, L, H, D]`` of ``x [B, T, H, D]`` from `assignment` weights (dense).

    The reference of `landmarks`, which computes the same means without the matrix.
    """
    return jnp.einsum("btl,bthd->blhd", weights, x.astype(jnp.float32))


def _static_segments(seq_len: int, m: int, grid):
    """Segment id per position (numpy int, -1: no segment) and the slot count, mask-free."""
    n_slots = num_landmarks(seq_len, m, grid)
    if grid is None:
        return (np.arange(seq_len) * n_slots) // seq_len, n_slots
    h, w = grid
    gh = min(math.isqrt(m), h)
    gw = n_slots // gh
    pos = np.arange(seq_len) - (seq_len - h * w)
    row, col = pos // w, pos % w
    seg = (row * gh) // h * gw + (col * gw) // w
    return np.where(pos >= 0, seg, -1), n_slots


def _gather_sum(x, seg, n_slots):
    """Per-slot sums of ``x [B, T, ...]`` over the positions with static id ``seg`` (numpy).

    Gathers each slot's tokens into ``[B, L, S_max, ...]`` (padded with a zero row), so no
    ``[T, L]`` matrix and no scatter: O(T D) work, exact sums.
    """
    members = [np.flatnonzero(seg == c) for c in range(n_slots)]
    width = max(len(ix) for ix in members)
    pad = x.shape[1]  # index of the appended zero row
    idx = np.full((n_slots, width), pad, np.int32)
    for c, ix in enumerate(members):
        idx[c, : len(ix)] = ix
    xz = jnp.concatenate([x, jnp.zeros_like(x[:, :1])], axis=1)
    return jnp.sum(jnp.take(xz, jnp.asarray(idx), axis=1), axis=2)  # [B, L, ...]


def landmarks(x, m: int, *, mask=None, grid=None):
    """``(landmarks [B, L, H, D] float32, landmark_mask [B, L])`` of `x` ``[B, T, H, D]``.

    The same values as ``segment_means(x, assignment(...)[0])`` (see the module docstring),
    without the dense assignment matrix. `mask`: optional ``[B, T]`` bool (True = a real
    token); `grid`: optional ``(h, w)`` for 2-D pooling.
    """
    b, t = x.shape[:2]
    if m < 1:
        raise ValueError(f"num_landmarks must be >= 1, got {m}")
    if mask is not None and mask.shape != (b, t):
        raise ValueError(f"mask shape {mask.shape} does not match x {x.shape} (want [B, T])")
    if grid is not None:
        h, w = grid
        if h < 1 or w < 1 or h * w > t:
            raise ValueError(f"grid={grid} must be positive with h * w <= T = {t}")
    x = x.astype(jnp.float32)
    seg, n_slots = _static_segments(t, m, grid)
    if mask is None or grid is not None:
        # Static segments: reshape-and-mean when they are equal, else a static gather.
        valid = jnp.ones((b, n_slots), bool)
        if mask is None and grid is None and t % n_slots == 0:
            return jnp.mean(x.reshape(b, n_slots, t // n_slots, *x.shape[2:]), axis=2), valid
        if mask is None and grid is not None:
            h, w = grid
            gh = min(math.isqrt(m), h)
            gw = n_slots // gh
            if h % gh == 0 and w % gw == 0:
                img = x[:, t - h * w :].reshape(b, gh, h // gh, gw, w // gw, *x.shape[2:])
                return jnp.mean(img, axis=(2, 4)).reshape(b, n_slots, *x.shape[2:]), valid
        if mask is None:
            counts = np.bincount(seg[seg >= 0], minlength=n_slots)
            sums = _gather_sum(x, seg, n_slots)
            return sums / jnp.asarray(counts, jnp.float32)[None, :, None, None], valid
        mf = mask.astype(jnp.float32)
        sums = _gather_sum(x * mf[..., None, None], seg, n_slots)
        counts = _gather_sum(mf, seg, n_slots)  # [B, L]
        means = sums / jnp.maximum(counts, 1.0)[..., None, None]
        return means, counts > 0
    # 1-D with a mask: segment ids depend on each row's unmasked count (as `assignment`).
    n = jnp.sum(mask, axis=-1, keepdims=True)  # [B, 1]
    rank = jnp.cumsum(mask, axis=-1) - 1
    seg_ids = jnp.where(mask, _segments(rank, n, jnp.minimum(n_slots, n)), n_slots)  # [B, T]

    def row(xb, ids):  # one batch row; masked tokens go to the dropped slot n_slots
        sums = jax.ops.segment_sum(xb, ids, num_segments=n_slots + 1)[:n_slots]
        cnt = jax.ops.segment_sum(jnp.ones_like(ids, jnp.float32), ids, n_slots + 1)[:n_slots]
        return sums, cnt

    sums, counts = jax.vmap(row)(x, seg_ids)
    return sums / jnp.maximum(counts, 1.0)[..., None, None], counts > 0


def partial_sums(
    x, m: int, seq_len: int, offset, *, mask=None, rank_offset=None, n_valid=None, grid=None
):
    """One shard's partial landmark sums: ``(sums [B, L, H, D] float32, counts [B, L])``.

    `x` ``[B, Ts, H, D]`` holds the positions ``offset .. offset + Ts - 1`` of a sequence of
    `seq_len` tokens (`offset` may be traced); ``L = num_landmarks(seq_len, m, grid)``. The
    tokens go to the segments of the whole sequence (module docstring), so summing `sums`
    and `counts` over the shards and dividing (`from_sums`) gives `landmarks` of the whole
    sequence. With a 1-D `mask` ``[B, Ts]`` the segment of a token depends on its rank among
    the unmasked tokens of the sequence: pass `rank_offset` ``[B]``, the unmasked tokens on
    the shards before this one, and `n_valid` ``[B]``, those of the whole sequence.
    """
    b, ts = x.shape[:2]
    n_slots = num_landmarks(seq_len, m, grid)
    pos = offset + jnp.arange(ts)
    if grid is not None:
        h, w = grid
        gh = min(math.isqrt(m), h)
        gw = n_slots // gh
        img = pos - (seq_len - h * w)
        seg = jnp.where(img >= 0, (img // w * gh) // h * gw + (img % w * gw) // w, n_slots)
        seg = jnp.broadcast_to(seg[None], (b, ts))
    elif mask is None:
        seg = jnp.broadcast_to(((pos * n_slots) // seq_len)[None], (b, ts))
    else:
        if rank_offset is None or n_valid is None:
            raise ValueError("partial_sums: a 1-D mask needs rank_offset and n_valid")
        rank = rank_offset[:, None] + jnp.cumsum(mask, axis=-1) - 1
        n = n_valid[:, None]
        seg = _segments(rank, n, jnp.minimum(n_slots, n))
    ones = jnp.ones((b, ts), jnp.float32)
    if mask is not None:
        seg = jnp.where(mask, seg, n_slots)  # masked tokens go to the dropped slot n_slots

    def row(xb, wb, ids):
        sums = jax.ops.segment_sum(xb, ids, num_segments=n_slots + 1)[:n_slots]
        return sums, jax.ops.segment_sum(wb, ids, num_segments=n_slots + 1)[:n_slots]

    return jax.vmap(row)(x.astype(jnp.float32), ones, seg)


def from_sums(sums, counts):
    """``(landmarks, landmark_mask)`` from (summed) `partial_sums`."""
    return sums / jnp.maximum(counts, 1.0)[..., None, None], counts > 0


def sharded_landmarks(x, m: int, axis: str, *, mask=None, grid=None):
    """`landmarks` of a sequence split along T over the mesh axis `axis` (inside
    ``shard_map``; `x` ``[B, T / n, H, D]`` is this device's contiguous part, in axis
    order). Each device sums its tokens into the global segments (`partial_sums`); only the
    ``[B, L, H, D]`` sums and ``[B, L]`` counts (and, with a mask, each device's count of
    unmasked tokens) cross devices. Returns the same ``(landmarks, landmark_mask)`` on every
    device."""
    ts = x.shape[1]
    n = lax.axis_size(axis)
    me = lax.axis_index(axis)
    rank_offset = n_valid = None
    if mask is not None and grid is None:
        per = lax.all_gather(jnp.sum(mask, axis=-1), axis)  # [n, B]
        n_valid = jnp.sum(per, axis=0)
        rank_offset = jnp.sum(jnp.where((jnp.arange(n) < me)[:, None], per, 0), axis=0)
    sums, counts = partial_sums(
        x, m, ts * n, me * ts, mask=mask, rank_offset=rank_offset, n_valid=n_valid, grid=grid
    )
    return from_sums(lax.psum(sums, axis), lax.psum(counts, axis))


__all__ = [
    "assignment",
    "from_sums",
    "landmarks",
    "num_landmarks",
    "partial_sums",
    "segment_means",
    "sharded_landmarks",
]
