"""hedgehog: features and the identity init."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import init, qkv

import linattn_jax as la


def test_hedgehog_features_and_identity_init():
    """The default init: identity maps for queries and keys; the specification's softmax
    form (``features="softmax"``): each half sums to 1, plus its relative eps."""
    mech = la.get("hedgehog")
    params = init(mech, d=8)
    assert sorted(params) == ["b", "bk", "w", "wk"]
    np.testing.assert_array_equal(params["w"][0], jnp.eye(8))
    np.testing.assert_array_equal(params["wk"], params["w"])
    q, _, _ = qkv()
    phi = la.hedgehog.feature_map(q, params, features="softmax")
    assert phi.shape == (2, 12, 2, 16) and jnp.all(phi > 0)
    np.testing.assert_allclose(phi[..., :8].sum(-1), 1.0, rtol=1e-5)
    # the softmax plus FEATURE_EPS times its largest entry
    sm = jax.nn.softmax(q, axis=-1)
    want = sm + la.hedgehog.FEATURE_EPS * jnp.max(sm, axis=-1, keepdims=True)
    np.testing.assert_allclose(phi[..., :8], want, rtol=1e-5)


def _paper_attention(q, k, v, params, mask, causal):
    """The paper's map, float64 loops: ``A_ij = phi_q(q_i) . phi_k(k_j)``, ``phi(x) = [exp(W x
    + b); exp(-(W x + b))]`` (the keys' own ``Wk, bk``), ``A v / A 1`` over the visible keys."""

    def phi(x, w, b):
        a = np.einsum("btd,ed->bte", x, w) + b
        return np.exp(np.concatenate([a, -a], -1))

    qn, kn, vn = (np.asarray(x, np.float64) for x in (q, k, v))
    pn = {n: np.asarray(x, np.float64) for n, x in params.items()}
    out = np.zeros_like(vn)
    t = q.shape[1]
    for h in range(q.shape[2]):
        pq = phi(qn[:, :, h], pn["w"][h], pn["b"][h])
        pk = phi(kn[:, :, h], pn["wk"][h], pn["bk"][h])
        a = np.einsum("bim,bjm->bij", pq, pk) * np.asarray(mask, np.float64)[:, None, :]
        if causal:
            a = a * np.tril(np.ones((t, t)))[None]
        out[:, :, h] = np.einsum("bij,bjd->bid", a / a.sum(-1, keepdims=True), vn[:, :, h])
    return out


@pytest.mark.parametrize("causal", [False, True])
def test_the_papers_exp_form_with_separate_maps(causal):
    """The default (``features="exp"``, ``separate_maps=True``) is the paper's attention
    (float64, masked keys, a ragged last chunk when causal); at logits past float32's exp
    range (inputs x30) it stays finite, fast path == reference (there `FEATURE_EPS` lifts
    features below 1e-6 of a token's largest, as in the softmax form); the fast path's
    gradients equal the reference's."""
    mech = la.get("hedgehog")  # the defaults: the paper's exp form, the keys' own map
    params = mech.init(jax.random.key(0), num_heads=2, head_dim=8)
    assert sorted(params) == ["b", "bk", "w", "wk"]
    rng = np.random.default_rng(1)
    params = {n: x + 0.3 * jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
              for n, x in params.items()}  # fmt: skip
    mask = jnp.arange(12)[None, :] < jnp.array([[12], [9]])
    q, k, v = qkv()
    # jitted: one program per form, not one per eager op
    attend = jax.jit(lambda q, k, v, p: mech.attention(q, k, v, p, mask=mask, causal=causal,
                                                       chunk_size=5))  # fmt: skip
    got = attend(q, k, v, params)
    want = _paper_attention(q, k, v, params, mask, causal)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-5)
    big = qkv(scale=30.0)  # logits past float32's exp range: stabilised, finite
    got = attend(*big, params)
    ref = jax.jit(lambda q, k, v, p: mech.reference(q, k, v, p, mask=mask, causal=causal))(
        *big, params
    )
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
    q, k, v = qkv()

    def loss(fn):
        return lambda q, k, p: jnp.sum(jnp.sin(fn(q, k, v, p, mask=mask, causal=causal,
                                                  chunk_size=5)))  # fmt: skip

    fast = jax.jit(jax.grad(loss(mech.attention), argnums=(0, 1, 2)))(q, k, params)
    ref = jax.jit(jax.grad(loss(mech.reference), argnums=(0, 1, 2)))(q, k, params)
    for a, b in zip(jax.tree.leaves(fast), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_hedgehog_options_are_checked():
    mech = la.get("hedgehog")
    params = init(mech, d=8)
    q, k, v = qkv()
    with pytest.raises(ValueError, match="features"):
        mech.attention(q, k, v, params, features="relu")
    with pytest.raises(ValueError, match="bk"):
        mech.attention(q, k, v, {"w": params["w"], "b": params["b"], "wk": params["w"]})
    with pytest.raises(ValueError, match="separate_maps"):
        mech.bind(separate_maps="yes").init(jax.random.key(0), num_heads=2, head_dim=8)
