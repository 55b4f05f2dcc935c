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
"""

from __future__ import annotations

import math

import jax.numpy as jnp


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
    """Averaging weights from tokens to landmarks.

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
    """Landmarks ``[B, L, H, D]`` from tokens ``x [B, T, H, D]`` and `assignment` weights."""
    return jnp.einsum("btl,bthd->blhd", weights, x.astype(jnp.float32))


def landmarks(x, m: int, *, mask=None, grid=None):
    """Convenience: ``(landmarks [B, L, H, D], landmark_mask [B, L])`` of `x` ``[B, T, H, D]``."""
    w, lmask = assignment(x.shape[1], m, mask=mask, batch=x.shape[0], grid=grid)
    return segment_means(x, w), lmask


__all__ = ["assignment", "landmarks", "num_landmarks", "segment_means"]
