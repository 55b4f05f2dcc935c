"""Exact softmax attention: the oracle every approximation is measured against."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
from flax import nnx

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


def flax_attention(
    mech, q, k, v, rng=None, *, bias, mask, causal, module, force_fp32_for_softmax, einsums,
    broadcast_dropout, dropout_rng, dropout_rate, deterministic, dtype, precision,
):  # fmt: skip
    """Softmax under flax's conventions: flax's own ``dot_product_attention`` (linen's, or
    nnx's for an nnx `module`), so any mask, bias, dropout (flax's rng semantics) and
    ``sow_weights``; `causal` ANDs the causal mask into `mask`. `mech` and `rng` are unused
    (the record's `Mechanism.flax_fn`)."""
    del mech, rng
    if causal:
        tril = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool))[None, None]
        mask = nn.combine_masks(mask, tril)
    kw = dict(
        broadcast_dropout=broadcast_dropout, dropout_rng=dropout_rng, dropout_rate=dropout_rate,
        deterministic=deterministic, dtype=dtype, precision=precision,
    )  # fmt: skip
    if isinstance(module, nnx.Module):
        if force_fp32_for_softmax or any(einsums):
            raise ValueError(
                "softmax: force_fp32_for_softmax / qk_attn_weights_einsum are linen-only"
            )
        return nnx.dot_product_attention(q, k, v, bias, mask, module=module, **kw)
    q_e, v_e = einsums
    return nn.dot_product_attention(
        q, k, v, bias, mask, module=module, force_fp32_for_softmax=force_fp32_for_softmax,
        qk_attn_weights_einsum=q_e, attn_weights_value_einsum=v_e, **kw,
    )  # fmt: skip


MECHANISM = register(
    Mechanism(
        name="softmax",
        init_fn=init,
        attention_fn=attention,
        supports_causal=True,
        stochastic=False,
        description="exact softmax attention, O(T^2)",
        flax_fn=flax_attention,
        attention_dropout=True,
    )
)
