"""Linear attention with the elu+1 feature map (Katharopoulos et al. 2020)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linattn_jax import _checks, core
from linattn_jax.registry import Mechanism, register


def init(rng, *, num_heads: int, head_dim: int):
    """linear_elu has no params."""
    del rng, num_heads, head_dim
    return {}


def feature_map(x, params=None):
    """``phi(x) = elu(x) + 1`` (positive), ``[..., D] -> [..., D]`` float32."""
    del params
    return jax.nn.elu(x.astype(jnp.float32)) + 1.0


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
