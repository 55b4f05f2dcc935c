"""Collectives over a sequence mesh axis that are no-ops without one (``axis=None``).

The non-causal mechanisms whose sums run over the whole sequence (the Nystrom family, LARA)
take an optional ``axis``: inside ``jax.shard_map`` (`linattn_jax.parallel`) each device holds
a contiguous part of T, and these reduce its partial sums over the devices of ``axis``; with
``axis=None`` they return their input, so the one-device code path is unchanged.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def psum(x, axis):
    """``x`` summed over the devices of `axis` (``x`` when `axis` is None)."""
    return x if axis is None else lax.psum(x, axis)


def masked_max(x, mask, dim, axis):
    """`core.masked_max` over array dim `dim` and the devices of `axis` (detached; 0 where
    everything is masked on every device)."""
    m = jnp.max(jnp.where(mask, x, -jnp.inf), axis=dim, keepdims=True)
    if axis is not None:
        m = lax.pmax(lax.stop_gradient(m), axis)
    return lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))


def halo(x, r: int, dim: int, axis):
    """`x` padded by `r` rows on both sides of `dim`: zeros at the ends of the sequence, the
    neighbouring devices' edge rows (``ppermute``) between devices. Needs ``x.shape[dim] >= r``.
    """
    pad = [(0, 0)] * x.ndim
    pad[dim] = (r, r)
    if axis is None or r == 0:
        return jnp.pad(x, pad)
    n = lax.axis_size(axis)
    if x.shape[dim] < r:
        raise ValueError(
            f"a halo of {r} rows needs at least {r} rows per device along the sequence, got "
            f"{x.shape[dim]}"
        )
    first = lax.slice_in_dim(x, 0, r, axis=dim)
    last = lax.slice_in_dim(x, x.shape[dim] - r, x.shape[dim], axis=dim)
    # A device that receives nothing (the ends of the sequence) gets zeros.
    from_left = lax.ppermute(last, axis, [(i, i + 1) for i in range(n - 1)])
    from_right = lax.ppermute(first, axis, [(i + 1, i) for i in range(n - 1)])
    return jnp.concatenate([from_left, x, from_right], axis=dim)


def pmax(x, axis):
    """``x`` maxed over the devices of `axis` (``x`` when `axis` is None)."""
    return x if axis is None else lax.pmax(x, axis)
