"""softmax: the exact oracle, equal to flax / jax attention."""

import jax
import jax.numpy as jnp
import numpy as np
from _helpers import qkv

import linattn_jax as la


def test_softmax_matches_jax_dot_product_attention():
    q, k, v = qkv(tq=7, tk=9)
    mask = jnp.ones((2, 9), bool).at[1, 5:].set(False)
    out = la.get("softmax").attention(q, k, v, {}, mask=mask)
    ref = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None, None, :])
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    out_c = la.get("softmax").attention(q[:, :7], k[:, :7], v[:, :7], {}, causal=True)
    ref_c = jax.nn.dot_product_attention(q[:, :7], k[:, :7], v[:, :7], is_causal=True)
    np.testing.assert_allclose(out_c, ref_c, rtol=1e-5, atol=1e-6)
