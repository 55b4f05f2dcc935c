"""Attention matching: the student's feature map (from the library's protocol) and the
blockwise KL between the teacher's softmax weights and the student's kernel weights.

For one layer, with the teacher's queries and keys,

    KL(p_i || s_i),  p_i = softmax_j(q_i . k_j / sqrt d),
                     s_ij = phi(q_i) . phi(k_j) / sum_j' phi(q_i) . phi(k_j')

averaged over heads and (unpadded) query rows: the cross-entropy of the teacher's weights
against the student's normalised kernel weights, minus the teacher's (constant) entropy, so 0
means a perfect match (Hedgehog, Zhang et al. 2024). Masked keys take no part, causal models
use causal weights. Trigonometric features (flexformer, rfa) can give negative kernel values
``a_ij = phi(q_i) . phi(k_j)``, for which the cross-entropy is undefined; the paper is silent
(its features are positive), so we chose: the student distribution is
``relu(a_ij) / sum_j relu(a_ij)`` and the loss adds the fraction of ``sum_j |a_ij|`` that is
negative, so it is 0 exactly when every ``a_ij > 0`` and ``a_ij / sum_j a_ij = p_ij`` (for
positive feature maps -- hedgehog, performer, linear_elu -- the penalty is 0 and this is the
plain KL); the log uses ``max(s_ij, WEIGHT_FLOOR)``. The loss is computed in blocks of
``block_size`` query rows (``lax.map`` over blocks, each block rematerialised in the backward
pass), so memory is ``O(block_size * T)`` per layer, never ``T x T``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

import linattn_jax as la
from linattn_jax import core

_f32 = jnp.float32
#: Floor of the student's weights inside the log (trigonometric features can go negative).
WEIGHT_FLOOR = 1e-6

# ---------------------------------------------------------------------------- feature maps
FeatureMap = Callable[..., Any]  # (x [B, T, H, d], params, *, is_query, mask) -> [B, T, H, M]


def _key_scale(n, mask):
    """``exp(n - max_valid n)`` for per-key log-scales ``n [B, T, H]`` (detached max)."""
    valid = core.key_mask(mask, n.shape[1], n.shape[0])[:, :, None]
    c = lax.stop_gradient(core.masked_max(n, valid, axis=1))
    return jnp.exp(jnp.where(valid, n - c, -jnp.inf))


def distillable_names() -> list[str]:
    """The mechanisms with a feature map (``la.get(name).feature_map``)."""
    return [n for n in la.names() if la.get(n).feature_map is not None]


def student_feature_map(name: str, config: Mapping[str, Any] | None = None) -> FeatureMap:
    """The student's feature map as attention matching uses it, from the library's protocol
    (``la.get(name).feature_map``, its deterministic features): ``(x, params, *, is_query,
    mask) -> [B, T, H, M]``, the key features times ``exp(log scale)`` relative to its max
    over the valid keys (a constant per row, so the normalised weights are unchanged).

    Raises:
      ValueError: `name` is not a feature-map mechanism, or its keys carry a decay (a gated
        recurrence such as rfa with ``gate=True``: not a kernel to match).
    """
    mech = la.get(name).bind(**dict(config or {}))
    fm = mech.feature_map
    if fm is None:
        raise ValueError(
            f"cannot distill into {name!r}: attention matching needs a feature-map mechanism, "
            f"one of {distillable_names()}"
        )
    shapes = jax.eval_shape(
        lambda r: fm.key(jnp.zeros((1, 1, 1, 4)), mech.init(r, num_heads=1, head_dim=4)),
        jax.random.key(0),
    )
    if shapes.log_decay is not None:
        raise ValueError(
            f"{name!r} with config {dict(mech.config)} is a decayed recurrence (its keys carry "
            "a log decay, e.g. rfa's gate); distill it without the decay"
        )

    def fmap(x, params, *, is_query, mask):
        if is_query:
            return fm.query(x, params)
        keys = fm.key(x, params)
        if keys.log_scale is None:
            return keys.phi
        return keys.phi * _key_scale(keys.log_scale, mask)[..., None]

    return fmap


def attention_kl(
    q, k, params, feature_map: FeatureMap, *, mask=None, causal=False, block_size: int = 128
):
    """``(sum of KL(p_i || s_i) (+ negative-mass penalty), number of query rows)`` over
    batch, heads and rows (see the module docstring).

    Args:
      q: ``[B, T, H, d]`` teacher queries (gradients are not taken through them).
      k: ``[B, T, H, d]`` teacher keys (gradients are not taken through them).
      params: the student mechanism's params for this layer.
      feature_map: `student_feature_map` of the student.
      mask: ``[B, T]`` key-padding mask (also drops padded query rows), or None.
      causal: causal weights (``j <= i``) for both teacher and student.
      block_size: query rows per block (memory ``O(B H block_size T)``).
    """
    q = lax.stop_gradient(q).astype(_f32)
    k = lax.stop_gradient(k).astype(_f32)
    b, t, h, d = q.shape
    tk = k.shape[1]
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    valid_k = core.key_mask(mask, tk, b)  # [B, Tk]
    valid_q = valid_k if mask is not None and t == tk else jnp.ones((b, t), bool)
    phi_k = feature_map(k, params, is_query=False, mask=mask).astype(_f32)  # [B, Tk, H, M]
    phi_k = phi_k * valid_k[:, :, None, None].astype(_f32)
    c = min(block_size, t)
    n = -(-t // c)
    pad = n * c - t
    qp = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
    vq = jnp.pad(valid_q, ((0, 0), (0, pad)))
    q_blocks = jnp.moveaxis(qp.reshape(b, n, c, h, d), 1, 0)  # [n, B, c, H, d]
    v_blocks = jnp.moveaxis(vq.reshape(b, n, c), 1, 0)  # [n, B, c]
    starts = jnp.arange(n) * c
    key_pos = jnp.arange(tk)

    @jax.checkpoint
    def block(args):
        qb, vb, start = args
        allowed = jnp.broadcast_to(valid_k[:, None, None, :], (b, 1, c, tk))  # [B, 1, c, Tk]
        if causal:
            rows = start + jnp.arange(c)
            allowed = allowed & (key_pos[None, :] <= rows[:, None])[None, None]
        logits = jnp.einsum("bihd,bjhd->bhij", qb, k) * d**-0.5  # [B, H, c, Tk]
        logits = jnp.where(allowed, logits, -jnp.inf)
        row_max = jnp.max(logits, axis=-1, keepdims=True)
        row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
        log_p = logits - row_max
        log_p = log_p - jnp.log(jnp.sum(jnp.where(allowed, jnp.exp(log_p), 0.0), -1, keepdims=True))
        p = jnp.where(allowed, jnp.exp(log_p), 0.0)
        phi_q = feature_map(qb, params, is_query=True, mask=None).astype(_f32)  # [B, c, H, M]
        a = jnp.einsum("bihm,bjhm->bhij", phi_q, phi_k)
        # Negative kernel values (trigonometric features) carry no probability: the student
        # distribution is relu(a) / sum relu(a), and the fraction of |a| that is negative is
        # added as a penalty; the sum is 0 only where every a_ij > 0 and a / sum a = p.
        a = jnp.where(allowed, a, 0.0)
        pos, neg = jnp.maximum(a, 0.0), jnp.maximum(-a, 0.0)
        pos_sum = jnp.sum(pos, axis=-1, keepdims=True)
        s = pos / core.guard_denominator(pos_sum)
        log_s = jnp.log(jnp.maximum(s, WEIGHT_FLOOR))
        kl = jnp.sum(jnp.where(allowed, p * (jnp.where(allowed, log_p, 0.0) - log_s), 0.0), -1)
        neg_sum = jnp.sum(neg, axis=-1)
        kl = kl + neg_sum / core.guard_denominator(pos_sum[..., 0] + neg_sum)
        rows_ok = vb[:, None, :].astype(_f32)  # [B, 1, c]
        return jnp.sum(kl * rows_ok), jnp.sum(rows_ok) * h

    sums, counts = lax.map(block, (q_blocks, v_blocks, starts))
    return jnp.sum(sums), jnp.sum(counts)


def matching_loss(calls, mech_params: Mapping[tuple, Any], name: str, *, block_size: int = 128):
    """Mean KL over every captured attention call; returns ``(loss, [per-call KL])``.

    ``mech_params[path]`` holds the student's mechanism params of the layer at ``path``.
    """
    fmap = student_feature_map(name)
    per_call, total, count = [], 0.0, 0.0
    for call in calls:
        s, c = attention_kl(
            call.q,
            call.k,
            mech_params[call.path],
            fmap,
            mask=call.mask,
            causal=call.causal,
            block_size=block_size,
        )
        per_call.append(s / jnp.maximum(c, 1.0))
        total, count = total + s, count + c
    if not per_call:
        raise ValueError("the model made no MultiHeadAttention calls: nothing to distill")
    return total / jnp.maximum(count, 1.0), per_call
