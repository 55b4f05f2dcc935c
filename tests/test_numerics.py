"""Exact at any input scale, pinned with fixed inputs.

With every key identical, every normalised mechanism's exact answer is the mean of v over
the visible keys (the prefix mean when causal; padding-masked keys left out) whatever the
scale of q and k: each query's weights over its visible keys are all equal. So the output
is independent of q and of the shared key, and the gradient with respect to v is the weight
matrix. The stabilisers are relative to the data (detached maxima in log space, feature eps
relative to each token's largest feature, a denominator guard only for rows without a
visible key), so this holds from 1e-3 to 1e3.

`soft` and `laplacian` are not normalised (``K V``, not ``K V / K 1``), so the identical-keys
answer is not a mean of v for them; they are left out.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import init, mech

import linattn_jax as la

NORMALISED = [n for n in la.names() if n not in ("soft", "laplacian")]
CASES = [
    (n, c) for n in NORMALISED for c in ((False, True) if la.get(n).supports_causal else (False,))
]
#: One batch row per input scale (the rows are independent), so one compile covers them all.
SCALES = (1e-3, 1.0, 10.0, 100.0, 1000.0)
#: Largest error of the output (and of the gradient with respect to v) over max |v|, per
#: scale. At 1e3 softmax's logits are about 3.5e5 (|q| = |k| = 1e3, d = 8), whose float32
#: rounding (0.03) moves its causal weights by up to ~2e-3: the limit float32 allows there.
TOL = {1e-3: 1e-5, 1.0: 1e-5, 10.0: 1e-5, 100.0: 1e-4, 1000.0: 1e-5}
TOL_SOFTMAX_1E3 = 1e-2


def _identical_keys(t=8, h=2, d=8):
    """Unit-norm q ``[S, t, h, d]`` and one key per row and head ``[S, 1, h, d]``, each row
    scaled by its entry of SCALES; v and a cotangent u ``[S, t, h, d]``; a key padding mask
    ``[S, t]`` with the last ``row % 3`` keys of each row masked."""
    kq, kk, kv, ku = jax.random.split(jax.random.key(0), 4)
    s = jnp.asarray(SCALES)[:, None, None, None]

    def unit(key, shape):
        x = jax.random.normal(key, shape)
        return x / jnp.linalg.norm(x, axis=-1, keepdims=True)

    q = unit(kq, (len(SCALES), t, h, d)) * s
    k1 = unit(kk, (len(SCALES), 1, h, d)) * s
    v, u = (jax.random.normal(key, (len(SCALES), t, h, d)) for key in (kv, ku))
    mask = jnp.arange(t)[None, :] < t - jnp.arange(len(SCALES))[:, None] % 3
    return q, k1, v, u, mask


@pytest.mark.parametrize("name,causal", CASES)
def test_identical_keys_give_the_mean_of_v_at_every_scale(name, causal):
    m = mech(name)
    q, k1, v, u, mask = _identical_keys()
    params = init(m, h=2, d=8)
    t = q.shape[1]

    def f(q, k1, v):
        k = jnp.broadcast_to(k1, q.shape)
        return m.attention(q, k, v, params, jax.random.key(1), mask=mask, causal=causal)

    out, vjp = jax.jit(lambda q, k1, v: jax.vjp(f, q, k1, v))(q, k1, v)
    gq, gk, gv = jax.jit(vjp)(u)
    w = jnp.tril(jnp.ones((t, t))) if causal else jnp.ones((t, t))
    w = w[None] * mask[:, None, :]  # [S, Tq, Tk]: every query sees key 0
    w = w / jnp.sum(w, axis=-1, keepdims=True)  # the exact weights
    want = jnp.einsum("sij,sjhd->sihd", w, v)
    gv_want = jnp.einsum("sij,sihd->sjhd", w, u)
    for row, s in enumerate(SCALES):
        tol = TOL_SOFTMAX_1E3 if (name, s) == ("softmax", 1000.0) else TOL[s]
        scale = float(jnp.max(jnp.abs(v[row])))
        err = float(jnp.max(jnp.abs(out[row] - want[row]))) / scale
        assert err <= tol, (name, causal, s, err)
        gerr = float(jnp.max(jnp.abs(gv[row] - gv_want[row]))) / float(jnp.max(jnp.abs(u[row])))
        assert gerr <= tol, (name, causal, s, "dv", gerr)
        # The output does not depend on q or on the shared key: their gradients vanish, to
        # the rounding of logits of size ~ s^2 / sqrt(d) (relative perturbations: s * g).
        bound = 1e-6 * (1 + s * s / 8**0.5) * scale * float(jnp.max(jnp.abs(u[row])))
        for arg, g in (("dq", gq), ("dk", gk)):
            assert np.all(np.isfinite(g[row])), (name, causal, s, arg)
            assert s * float(jnp.max(jnp.abs(g[row]))) <= bound, (name, causal, s, arg)


@pytest.mark.parametrize("causal", [False, True])
def test_rfa_zero_queries_or_keys_have_finite_gradients(causal):
    """rfa unit-normalises q and k; an all-zero one once gave NaN gradients (the norm's
    derivative at 0 inside a maximum); now its features are those of the zero vector.
    Batch rows: q zero, k zero, both zero."""
    m = mech("rfa", num_features=8)
    q, k, v = jax.random.normal(jax.random.key(0), (3, 3, 5, 2, 4))
    q = q.at[0].set(0.0).at[2].set(0.0)
    k = k.at[1].set(0.0).at[2].set(0.0)
    params = init(m, d=4)

    def loss(q, k, v, p):
        out = m.attention(q, k, v, p, jax.random.key(2), causal=causal)
        return jnp.sum(out**2), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
        q, k, v, params
    )
    assert np.all(np.isfinite(out))
    for g in jax.tree.leaves(grads):
        assert np.all(np.isfinite(g))


@pytest.mark.parametrize("name", ["linear_elu", "hedgehog"])
def test_features_carry_an_eps_relative_to_the_token(name):
    """At a large scale every feature is at least FEATURE_EPS times its token's largest (no
    underflow to 0), and at a small one the eps is that fraction of it, not a constant."""
    m = mech(name)
    params = init(m, d=8)
    fm = m.feature_map
    for s in (1e-3, 1e3):
        x = s * jax.random.normal(jax.random.key(0), (1, 6, 2, 8))
        phi = np.asarray(fm.query(x, params))
        top = phi.max(axis=-1, keepdims=True)
        eps = getattr(la, name).FEATURE_EPS
        assert np.all(phi >= eps * top * (1 - 1e-3) / (1 + eps)), (name, s)
        assert np.all(phi > 0), (name, s)
