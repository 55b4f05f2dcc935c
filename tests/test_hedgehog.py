"""hedgehog: features and the identity init."""

import jax
import jax.numpy as jnp
import numpy as np
from _helpers import init, qkv

import linattn_jax as la


def test_hedgehog_features_and_identity_init():
    mech = la.get("hedgehog")
    params = init(mech, d=8)
    np.testing.assert_array_equal(params["w"][0], jnp.eye(8))
    q, _, _ = qkv()
    phi = la.hedgehog.feature_map(q, params)
    assert phi.shape == (2, 12, 2, 16) and jnp.all(phi > 0)
    np.testing.assert_allclose(phi[..., :8].sum(-1), 1.0, rtol=1e-5)
    # the softmax plus FEATURE_EPS times its largest entry
    sm = jax.nn.softmax(q, axis=-1)
    want = sm + la.hedgehog.FEATURE_EPS * jnp.max(sm, axis=-1, keepdims=True)
    np.testing.assert_allclose(phi[..., :8], want, rtol=1e-5)
