"""`landmarks.landmarks` (no assignment matrix) against the dense reference
``segment_means(x, assignment(...))``: values, validity and gradients, on every path
(reshape-and-mean, static gather, segment sum; 1-D and 2-D; with and without a mask)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linattn_jax import landmarks as lm

CASES = [  # (T, m, grid, masked)
    (12, 4, None, False),  # divisible: reshape-and-mean
    (10, 4, None, False),  # unequal segments: static gather
    (3, 8, None, False),  # T < m: the tokens are the landmarks
    (10, 4, None, True),  # 1-D mask: segment sum
    (17, 4, (4, 4), False),  # 2-D, divisible, one prefix (CLS) token
    (16, 9, (4, 4), False),  # 2-D, unequal cells (4 rows into 3)
    (17, 4, (4, 4), True),  # 2-D with a mask
]


def _inputs(t, masked):
    kx, km = jax.random.split(jax.random.key(t))
    x = jax.random.normal(kx, (2, t, 3, 5))
    mask = None
    if masked:
        mask = jax.random.bernoulli(km, 0.6, (2, t)).at[1].set(False).at[1, 2].set(True)
    return x, mask


def _dense(x, m, mask, grid):
    w, valid = lm.assignment(x.shape[1], m, mask=mask, batch=x.shape[0], grid=grid)
    return lm.segment_means(x, w), valid


@pytest.mark.parametrize("t,m,grid,masked", CASES)
def test_landmarks_match_dense_assignment(t, m, grid, masked):
    x, mask = _inputs(t, masked)
    got, valid = lm.landmarks(x, m, mask=mask, grid=grid)
    want, want_valid = _dense(x, m, mask, grid)
    assert got.shape == want.shape == (2, lm.num_landmarks(t, m, grid), 3, 5)
    np.testing.assert_array_equal(valid, want_valid)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    ct = jax.random.normal(jax.random.key(1), got.shape)
    # jitted: one program per form, not one per eager op
    g = jax.jit(jax.grad(lambda x: jnp.sum(lm.landmarks(x, m, mask=mask, grid=grid)[0] * ct)))(x)
    g_ref = jax.jit(jax.grad(lambda x: jnp.sum(_dense(x, m, mask, grid)[0] * ct)))(x)
    np.testing.assert_allclose(g, g_ref, rtol=1e-5, atol=1e-6)


def test_landmarks_build_no_assignment_matrix():
    """No [T, L]-sized intermediate on the mask-free paths (jaxpr shapes)."""
    for t, m, grid in ((64, 8, None), (66, 8, None), (65, 16, (8, 8)), (64, 9, (8, 8))):
        x = jnp.zeros((1, t, 1, 2))
        jaxpr = jax.make_jaxpr(lambda x, m=m, grid=grid: lm.landmarks(x, m, grid=grid))(x)
        sizes = [int(np.prod(v.aval.shape)) for e in jaxpr.eqns for v in e.outvars if v.aval.shape]
        assert max(sizes) <= 2 * t * 2, (t, m, grid, max(sizes))


def test_landmarks_bad_input():
    x = jnp.zeros((2, 6, 1, 2))
    with pytest.raises(ValueError, match="num_landmarks"):
        lm.landmarks(x, 0)
    with pytest.raises(ValueError, match="mask shape"):
        lm.landmarks(x, 2, mask=jnp.ones((2, 5), bool))
    with pytest.raises(ValueError, match="grid"):
        lm.landmarks(x, 2, grid=(3, 3))
