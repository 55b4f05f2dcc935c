"""linear_elu (Katharopoulos et al. 2020): phi = elu + 1, written out by hand."""

import jax
import numpy as np
import pytest
from _helpers import qkv

import linattn_jax as la
from linattn_jax import linear_elu


def _phi(x):
    x = np.asarray(x, np.float64)
    phi = np.where(x > 0, x + 1.0, np.exp(x))  # elu(x) + 1
    return phi + linear_elu.FEATURE_EPS * phi.max(-1, keepdims=True)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_is_elu_plus_one_linear_attention_by_hand(causal):
    """``out_i = sum_j phi(q_i).phi(k_j) v_j / sum_j phi(q_i).phi(k_j)`` over the unmasked
    keys (j <= i when causal), in float64 numpy."""
    q, k, v = qkv(3, tq=6, tk=6)
    mask = np.ones((2, 6), bool)
    mask[1, 4:] = False
    got = la.get("linear_elu").attention(q, k, v, {}, mask=jax.numpy.asarray(mask), causal=causal)
    w = np.einsum("bihm,bjhm->bhij", _phi(q), _phi(k)) * mask[:, None, None, :]
    if causal:
        w = w * np.tril(np.ones((6, 6)))
    want = np.einsum("bhij,bjhd->bihd", w, np.asarray(v, np.float64))
    want /= w.sum(-1).transpose(0, 2, 1)[..., None]
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
