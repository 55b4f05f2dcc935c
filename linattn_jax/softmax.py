"""Exact softmax attention: the oracle every approximation is measured against."""

from __future__ import annotations

import jax.numpy as jnp

from linattn_jax import _checks
from linattn_jax.registry import Mechanism, register


def init(rng, *, num_heads: int, head_dim: int):
    """Softmax attention has no params."""
    del rng, num_heads, head_dim
    return {}


def attention_weights(q, k, *, mask=None, causal: bool = False):
    """Softmax weights ``softmax(q k^T / sqrt(d))`` as ``[B, H, Tq, Tk]`` float32.

    Masked keys get weight 0; a row whose keys are all masked is all zeros.
    """
    q32, k32 = q.astype(jnp.float32), k.astype(jnp.float32)
    logits = jnp.einsum("bihd,bjhd->bhij", q32, k32) * q.shape[-1] ** -0.5
    valid = jnp.ones(logits.shape[-2:], bool)[None, None]
    if mask is not None:
        valid = valid & mask[:, None, None, :]
    if causal:
        valid = valid & jnp.tril(jnp.ones(logits.shape[-2:], bool))[None, None]
    logits = jnp.where(valid, logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.where(valid, jnp.exp(logits - m), 0.0)
    den = jnp.sum(e, axis=-1, keepdims=True)
    return e / jnp.where(den > 0, den, 1.0)


def attention(q, k, v, params, rng=None, *, mask=None, causal=False, deterministic=False):
    """Exact scaled dot-product attention, ``[B, Tq, H, Dv]`` in q's dtype.

    Computed in float32 with the quadratic ``[B, H, Tq, Tk]`` weights (see
    `attention_weights`); `params`, `rng` and `deterministic` are unused.
    """
    del params, rng, deterministic
    _checks.check_inputs("softmax", q, k, v, mask, causal=causal)
    w = attention_weights(q, k, mask=mask, causal=causal)
    return jnp.einsum("bhij,bjhd->bihd", w, v.astype(jnp.float32)).astype(q.dtype)


MECHANISM = register(
    Mechanism(
        name="softmax",
        init_fn=init,
        attention_fn=attention,
        supports_causal=True,
        stochastic=False,
        description="exact softmax attention, O(T^2)",
    )
)
