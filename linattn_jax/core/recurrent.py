"""The recurrent form of causal linear attention: the constant-size `RecurrentState`, one
token's `recurrent_step`, and the state of a block of keys (`block_state`,
`combine_states`) that the sequence-parallel causal path folds across devices."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import lax

from linattn_jax.core.common import (
    DENOMINATOR_EPS,
    NEG_LOG_SCALE,
    apply_key_mask,
    check_floor,
    masked_log_scale,
    read_out,
)
from linattn_jax.core.features import KeyFeatures

_f32 = jnp.float32


class RecurrentState(NamedTuple):
    """The constant-size state of causal linear attention after t tokens (per head).

    ``s = sum_j D_j exp(n_j - c) phi(k_j) v_j^T`` ``[B, H, M, Dv]`` and ``z`` likewise
    without v ``[B, H, M]``, with D_j the product of the decays after token j and ``c``
    ``[B, H]`` the running max of the key log-scales (the same stabiliser as the chunked
    causal form, so both agree to rounding).
    """

    s: Any
    z: Any
    c: Any


def recurrent_init(batch: int, num_heads: int, num_features: int, value_dim: int):
    """The empty `RecurrentState` (no token seen)."""
    return RecurrentState(
        jnp.zeros((batch, num_heads, num_features, value_dim), _f32),
        jnp.zeros((batch, num_heads, num_features), _f32),
        jnp.full((batch, num_heads), NEG_LOG_SCALE, _f32),
    )


def recurrent_step(
    state: RecurrentState, phi_q, keys: KeyFeatures, v, eps=DENOMINATOR_EPS, den_floor=0.0
):
    """One token of causal linear attention: ``(out [B, 1, H, Dv] float32, new state)``.

    Args:
      state: `RecurrentState` before this token.
      phi_q: ``[B, 1, H, M]`` the token's query features.
      keys: the token's `KeyFeatures` (``[B, 1, H, M]``, log scale / decay ``[B, 1, H]``).
      v: ``[B, 1, H, Dv]`` its value.
      eps: as in `linear_attention`.
      den_floor: as in `linear_attention`.
    """
    check_floor(den_floor, keys.phi)
    s, z, c = state
    b = keys.phi[:, 0].astype(_f32)  # [B, H, M]
    n = jnp.zeros_like(c) if keys.log_scale is None else keys.log_scale[:, 0].astype(_f32)
    g = jnp.ones_like(c) if keys.log_decay is None else jnp.exp(keys.log_decay[:, 0])
    c_new = jnp.maximum(c, n)  # [B, H]
    old = g * jnp.exp(c - c_new)  # rescale to the new stabiliser, then decay
    kf = jnp.exp(n - c_new)[..., None] * b  # [B, H, M]
    v = v[:, 0].astype(_f32)
    s = s * old[..., None, None] + kf[..., None] * v[:, :, None, :]
    z = z * old[..., None] + kf
    mass = z[..., -1] if den_floor else None  # the query's mass column is 0: dots unchanged
    out = read_out(phi_q.astype(_f32), s, z, mass, eps=eps, den_floor=den_floor)
    return out, RecurrentState(s, z, c_new)


def block_state(phi_k, v, *, mask=None, log_decay=None, key_log_scale=None):
    """The `RecurrentState` of one block of keys alone (from an empty state), in one pass:
    ``s = sum_j exp(G - G_j + n_j - c) phi(k_j) v_j^T`` with ``G_j`` the cumulative log decay
    up to j, ``G`` its total and ``c`` the max of the key log-scales (detached)."""
    phi_k, v = apply_key_mask(phi_k.astype(_f32), mask), v.astype(_f32)
    ns = masked_log_scale(key_log_scale, mask, phi_k.shape[:3])
    c = lax.stop_gradient(jnp.max(ns, axis=1))  # [B, H]
    logw = ns - c[:, None]
    if log_decay is not None:
        g = jnp.cumsum(log_decay.astype(_f32), axis=1)
        logw = logw + g[:, -1:] - g
    w = jnp.exp(logw)[..., None]
    return RecurrentState(
        jnp.einsum("bthm,bthd->bhmd", phi_k * w, v), jnp.sum(phi_k * w, axis=1), c
    )


def combine_states(first: RecurrentState, second: RecurrentState, second_log_decay=None):
    """The state of two consecutive blocks of keys from each block's own state
    (`block_state`): ``first`` decayed by the second block's total log decay
    ``[B, H]`` (None: no decay), then ``second``, under the larger stabiliser."""
    g = 0.0 if second_log_decay is None else second_log_decay
    c = jnp.maximum(first.c, second.c)
    a = jnp.exp(g + first.c - c)
    b = jnp.exp(second.c - c)
    return RecurrentState(
        first.s * a[..., None, None] + second.s * b[..., None, None],
        first.z * a[..., None] + second.z * b[..., None],
        c,
    )
