"""Hedgehog: a learnable softmax feature map (Zhang et al. 2024).

``phi(x) = [softmax(W x + b); softmax(-(W x + b))]`` over the feature axis, W
``[H, d, d]`` per head initialised to the identity and b ``[H, d]`` to zero;
2d positive features, then the shared linear-attention core.

Each softmax gets `FEATURE_EPS` times its own largest entry added to every entry (as
FAVOR+ does), so no feature underflows to 0 at large ``|W x + b|``: a query and a key
whose large features sit on different axes still have ``phi(q) . phi(k) >= FEATURE_EPS /
d`` of their scale, and the attention ratio stays exact (with every key identical it is
the mean of v at any input scale) instead of meeting the core's denominator guard.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linattn_jax import _checks, core
from linattn_jax.registry import Mechanism, register

#: Added to every softmax feature, relative to the largest one of its half (see above).
FEATURE_EPS = 1e-6


def init(rng, *, num_heads: int, head_dim: int):
    """``{"w": [H, d, d] identity, "b": [H, d] zeros}``."""
    del rng
    eye = jnp.eye(head_dim, dtype=jnp.float32)
    return {
        "w": jnp.broadcast_to(eye, (num_heads, head_dim, head_dim)),
        "b": jnp.zeros((num_heads, head_dim), jnp.float32),
    }


def _softmax(a):
    """``softmax(a) + FEATURE_EPS max(softmax(a))`` over the last axis (jax's softmax, one
    more max: its hand-rolled ``(e + eps) / sum e`` form was not faster on CPU)."""
    p = jax.nn.softmax(a, axis=-1)
    return p + FEATURE_EPS * jnp.max(p, axis=-1, keepdims=True)


def feature_map(x, params):
    """``[B, T, H, d] -> [B, T, H, 2d]`` float32, positive, each half summing to 1 (to
    ``1 + d FEATURE_EPS`` of its largest entry)."""
    # heads first, as the per-head product writes it (`core.heads_last`)
    a = jnp.einsum("bthd,hed->bhte", x.astype(jnp.float32), params["w"])
    a = a + params["b"][None, :, None]
    return core.heads_last(jnp.concatenate([_softmax(a), _softmax(-a)], axis=-1))


FEATURE_MAP = core.FeatureMap(
    query_fn=feature_map,
    key_fn=lambda k, params: core.KeyFeatures(feature_map(k, params)),
    token_wise=True,
)


def _attend(q, k, v, params, mask, causal, chunk_size, quadratic):
    _checks.check_inputs("hedgehog", q, k, v, mask, causal=causal)
    _checks.check_positive("hedgehog", chunk_size=chunk_size)
    h, d = q.shape[2], q.shape[3]
    _checks.check_params("hedgehog", params, {"w": (h, d, d), "b": (h, d)})
    return core.attend_features(
        FEATURE_MAP,
        q,
        k,
        v,
        params,
        mask=mask,
        causal=causal,
        chunk_size=chunk_size,
        quadratic=quadratic,
    )


def attention(
    q, k, v, params, rng=None, *, mask=None, causal=False, deterministic=False, chunk_size=64
):
    """Hedgehog attention ``[B, Tq, H, Dv]``; `rng` and `deterministic` are unused."""
    del rng, deterministic
    return _attend(q, k, v, params, mask, causal, chunk_size, False)


def reference(
    q, k, v, params, rng=None, *, mask=None, causal=False, deterministic=False, chunk_size=64
):
    """The naive quadratic form of `attention` (same features)."""
    del rng, deterministic
    return _attend(q, k, v, params, mask, causal, chunk_size, True)


MECHANISM = register(
    Mechanism(
        name="hedgehog",
        init_fn=init,
        attention_fn=attention,
        reference_fn=reference,
        supports_causal=True,
        stochastic=False,
        feature_map_spec=FEATURE_MAP,
        description="learnable softmax feature map, W init identity (Zhang et al. 2024), O(T)",
    )
)
