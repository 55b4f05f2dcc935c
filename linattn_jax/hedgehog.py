"""Hedgehog: a learnable feature map that mimics softmax (Zhang et al. 2024).

As the paper's listing computes it (``HedgehogFeatureMap``, ``HedgehogAttention``):
``phi_q(x) = [exp(Wq x + bq); exp(-(Wq x + bq))]`` for the queries and ``phi_k`` with the keys'
own ``Wk, bk`` (``"w"``, ``"b"``, ``"wk"``, ``"bk"``: ``[H, d, d]`` per head, initialised to
the identity, biases to zero); 2d positive features, then the shared linear-attention core.

Stable as performer is: a query's features are divided by their largest entry (it cancels in
the ratio), a key's largest logit becomes its log-scale (`core.KeyFeatures`, stabilised by
the core), and every feature gets `FEATURE_EPS` (times the token's largest, 1) added, so no
feature underflows to 0 at large ``|W x + b|``: a query and a key whose large features sit
on different axes keep a dot product of at least that share of their scale, and the ratio
stays exact (every key identical gives the mean of v at any input scale) instead of meeting
the core's denominator guard.

Options: ``features="softmax"`` is the form of this project's specification, ``[softmax(W x
+ b); softmax(-(W x + b))]`` over the feature axis, which divides each key's features by
their sum and so changes the kernel (a query's cancels); ``separate_maps=False`` (an init
option) shares one map between queries and keys. Both defaults follow the paper: trained in
the same model and seeds, the specification's form lagged the paper's algorithm on
Pathfinder mini (docs/baselines.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linattn_jax import _checks, core
from linattn_jax.registry import Mechanism, register

#: Added to every feature, relative to the token's largest (softmax: of its half; see above).
FEATURE_EPS = 1e-6
#: The feature forms (module docstring): the specification's softmax and the paper's exp.
FEATURES = ("softmax", "exp")


def init(rng, *, num_heads: int, head_dim: int, separate_maps: bool = True):
    """``{"w": [H, d, d] identity, "b": [H, d] zeros}`` and, with `separate_maps` (default),
    the keys' own ``"wk"``, ``"bk"`` (the same init)."""
    del rng
    _checks.check_bool("hedgehog", "separate_maps", separate_maps)
    eye = jnp.eye(head_dim, dtype=jnp.float32)
    w = jnp.broadcast_to(eye, (num_heads, head_dim, head_dim))
    b = jnp.zeros((num_heads, head_dim), jnp.float32)
    return {"w": w, "b": b, **({"wk": w, "bk": b} if separate_maps else {})}


def _softmax(a):
    """``softmax(a) + FEATURE_EPS max(softmax(a))`` over the last axis (jax's softmax, one
    more max: its hand-rolled ``(e + eps) / sum e`` form was not faster on CPU)."""
    p = jax.nn.softmax(a, axis=-1)
    return p + FEATURE_EPS * jnp.max(p, axis=-1, keepdims=True)


def _logits(x, params, is_key):
    """``[W x + b; -(W x + b)]`` heads first ``[B, H, T, 2d]`` float32 (the keys' own map
    when the params have one)."""
    w, b = ("wk", "bk") if is_key and "wk" in params else ("w", "b")
    # heads first, as the per-head product writes it (`core.heads_last`)
    a = jnp.einsum("bthd,hed->bhte", x.astype(jnp.float32), params[w])
    a = a + params[b][None, :, None]
    return jnp.concatenate([a, -a], axis=-1)


def feature_map(x, params, *, features="exp", is_key=False):
    """``[B, T, H, d] -> [B, T, H, 2d]`` float32, positive. ``"softmax"``: each half sums to 1
    (to ``1 + d FEATURE_EPS`` of its largest entry); ``"exp"``: ``exp(a - max a) +
    FEATURE_EPS``, the paper's features over their largest, whose log (``max a``, ``[B, T,
    H]``) a key carries as its log-scale (`key_features`)."""
    return _features(x, params, features, is_key)[0]


def _features(x, params, features, is_key):
    """`feature_map`'s features and, for ``"exp"``, the largest logit ``[B, H, T, 1]`` (else
    None)."""
    _checks.check_choice("hedgehog", "features", features, FEATURES)
    a = _logits(x, params, is_key)
    if features == "exp":
        top = jax.lax.stop_gradient(jnp.max(a, axis=-1, keepdims=True))
        return core.heads_last(jnp.exp(a - top) + FEATURE_EPS), top
    d = a.shape[-1] // 2
    phi = jnp.concatenate([_softmax(a[..., :d]), _softmax(a[..., d:])], -1)
    return core.heads_last(phi), None


def key_features(k, params, *, features="exp"):
    """`core.KeyFeatures` of the keys: `feature_map`'s, with ``"exp"`` the largest logit of
    each key as its log-scale (the exact paper features, stabilised by the core)."""
    phi, top = _features(k, params, features, True)
    if top is None:
        return core.KeyFeatures(phi)
    return core.KeyFeatures(phi, jnp.swapaxes(top[..., 0], 1, 2))


FEATURE_MAP = core.FeatureMap(
    query_fn=feature_map,
    key_fn=key_features,
    token_wise=True,
)


def _attend(q, k, v, params, mask, causal, chunk_size, quadratic, features):
    _checks.check_inputs("hedgehog", q, k, v, mask, causal=causal)
    _checks.check_positive("hedgehog", chunk_size=chunk_size)
    _checks.check_choice("hedgehog", "features", features, FEATURES)
    h, d = q.shape[2], q.shape[3]
    expected = {"w": (h, d, d), "b": (h, d)}
    if isinstance(params, dict) and ("wk" in params or "bk" in params):
        expected.update(wk=(h, d, d), bk=(h, d))  # the keys' own map (separate_maps)
    _checks.check_params("hedgehog", params, expected)
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
        features=features,
    )


def attention(
    q, k, v, params, rng=None, *, mask=None, causal=False, deterministic=False, chunk_size=64,
    features="exp",
):  # fmt: skip
    """Hedgehog attention ``[B, Tq, H, Dv]``: ``phi(q_i)^T S / phi(q_i)^T z`` over the keys'
    features (`feature_map`; ``features="exp"``: the paper's exp form; the keys' own map when
    `params` has ``"wk"``, ``"bk"``). `rng` and `deterministic` are unused."""
    del rng, deterministic
    return _attend(q, k, v, params, mask, causal, chunk_size, False, features)


def reference(
    q, k, v, params, rng=None, *, mask=None, causal=False, deterministic=False, chunk_size=64,
    features="exp",
):  # fmt: skip
    """The naive quadratic form of `attention` (same features)."""
    del rng, deterministic
    return _attend(q, k, v, params, mask, causal, chunk_size, True, features)


MECHANISM = register(
    Mechanism(
        name="hedgehog",
        init_fn=init,
        attention_fn=attention,
        reference_fn=reference,
        supports_causal=True,
        stochastic=False,
        feature_map_spec=FEATURE_MAP,
        description="learnable exp feature maps for q and k, W init identity (Zhang et al. "
        "2024), O(T)",
    )
)
