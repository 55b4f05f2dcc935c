"""Linear attention with the elu+1 feature map (Katharopoulos et al. 2020).

Every feature gets `FEATURE_EPS` times its token's largest feature added (as FAVOR+
does): for a large negative coordinate ``elu(x) + 1 = exp(x)`` underflows, and a query
and a key whose positive coordinates do not overlap would otherwise have
``phi(q) . phi(k)`` below what float32 (or the gradient of the ratio) can hold. With
the eps the attention ratio stays exact at any input scale (every key identical gives
the mean of v).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from linattn_jax import _checks, core
from linattn_jax.registry import Mechanism, register

#: Added to every feature, relative to the token's largest feature (see above).
FEATURE_EPS = 1e-6


def init(rng, *, num_heads: int, head_dim: int):
    """linear_elu has no params."""
    del rng, num_heads, head_dim
    return {}


def feature_map(x, params=None):
    """``phi(x) = elu(x) + 1 + FEATURE_EPS max(elu(x) + 1)`` (positive), ``[..., D] -> [..., D]``
    float32; the max (over the token's D features, detached) is ``elu(max x) + 1``."""
    del params
    x = x.astype(jnp.float32)
    top = lax.stop_gradient(jax.nn.elu(jnp.max(x, axis=-1, keepdims=True)))
    return jax.nn.elu(x) + (1.0 + FEATURE_EPS * (top + 1.0))


FEATURE_MAP = core.FeatureMap(
    query_fn=feature_map,
    key_fn=lambda k, params: core.KeyFeatures(feature_map(k)),
    token_wise=True,
)


def _attend(q, k, v, mask, causal, chunk_size, quadratic):
    _checks.check_inputs("linear_elu", q, k, v, mask, causal=causal)
    _checks.check_positive("linear_elu", chunk_size=chunk_size)
    return core.attend_features(
        FEATURE_MAP,
        q,
        k,
        v,
        {},
        mask=mask,
        causal=causal,
        chunk_size=chunk_size,
        quadratic=quadratic,
    )


def attention(
    q, k, v, params, rng=None, *, mask=None, causal=False, deterministic=False, chunk_size=64
):
    """``out_i = phi(q_i)^T S / phi(q_i)^T z`` with phi = elu + 1; ``[B, Tq, H, Dv]``."""
    del params, rng, deterministic
    return _attend(q, k, v, mask, causal, chunk_size, quadratic=False)


def reference(
    q, k, v, params, rng=None, *, mask=None, causal=False, deterministic=False, chunk_size=64
):
    """The naive quadratic form of `attention` (same features)."""
    del params, rng, deterministic
    return _attend(q, k, v, mask, causal, chunk_size, quadratic=True)


MECHANISM = register(
    Mechanism(
        name="linear_elu",
        init_fn=init,
        attention_fn=attention,
        reference_fn=reference,
        supports_causal=True,
        stochastic=False,
        feature_map_spec=FEATURE_MAP,
        description="linear attention, phi = elu + 1 (Katharopoulos et al. 2020), O(T)",
    )
)
