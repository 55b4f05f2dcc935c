"""Properties every registered mechanism keeps (SPEC section 3)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import init, mech, qkv, rel_err

import linattn_jax as la

# The suite compiles with XLA's optimisation passes off (tests/conftest.py). The tests marked
# `optimised` turn them on (every mechanism's forward in both dtypes, and its gradients at
# large norms), and `test_the_suites_compile_flags_give_the_users_results` compiles every
# mechanism's value and gradients in a process with XLA's default flags, as users do.
optimised = pytest.mark.usefixtures("optimised_xla")

NAMES = la.names()
CAUSAL = la.causal_names()
RNG = jax.random.key(7)


def _run(m, q, k, v, params, **kw):
    kw.setdefault("deterministic", True)
    return m.attention(q, k, v, params, RNG, **kw)


@optimised
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_shape_dtype_and_jit(name, dtype):
    m = mech(name)
    q, k, v = qkv(tq=9, tk=12, dv=6, dtype=dtype)
    params = init(m)
    out = _run(m, q, k, v, params, deterministic=False)
    assert out.shape == (2, 9, 2, 6) and out.dtype == dtype
    jitted = jax.jit(lambda q, k, v, p, r: m.attention(q, k, v, p, r))(q, k, v, params, RNG)
    np.testing.assert_allclose(
        jitted.astype(jnp.float32), out.astype(jnp.float32), rtol=1e-2, atol=1e-2
    )
    if dtype == jnp.float32:
        # relative to the output's norm: an iterative inverse (soft, nystromformer) carries
        # eager-vs-jit rounding of ~1e-5 into outputs near zero, elementwise ~1% of them
        assert rel_err(jitted, out) < 1e-5


@pytest.mark.parametrize("name", NAMES)
def test_bf16_close_to_f32(name):
    m = mech(name)
    q, k, v = qkv(tk=12)
    params = init(m)
    q16, k16, v16 = (x.astype(jnp.bfloat16) for x in (q, k, v))
    out16 = _run(m, q16, k16, v16, params)
    out32 = _run(m, *(x.astype(jnp.float32) for x in (q16, k16, v16)), params)
    assert jnp.all(jnp.isfinite(out16.astype(jnp.float32)))
    # bf16 keeps 8 bits of mantissa: the output rounding alone is ~4e-3 relative.
    assert rel_err(out16, out32) < 2e-2


@pytest.mark.parametrize("name", NAMES)
def test_vmap_over_leading_axis(name):
    m = mech(name)
    q, k, v = qkv(b=1)
    qs, ks, vs = (jnp.stack([x, 0.5 * x, -x]) for x in (q, k, v))
    params = init(m)
    # jitted: one compile each instead of eager op-by-op dispatch (2-3x slower)
    run = jax.jit(lambda q, k, v: _run(m, q, k, v, params))
    batched = jax.jit(jax.vmap(run))(qs, ks, vs)
    for i in range(3):
        np.testing.assert_allclose(batched[i], run(qs[i], ks[i], vs[i]), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_grads_finite_and_checkpoint(name):
    m = mech(name)
    q, k, v = qkv()
    params = init(m)

    def loss(q, k, v, p):
        return jnp.sum(jnp.sin(m.attention(q, k, v, p, RNG)))

    # jitted, as in training: eager op-by-op dispatch compiles each primitive on its own
    # (2-3x slower)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, params)
    for g in jax.tree_util.tree_leaves(grads):
        assert jnp.all(jnp.isfinite(g))
    trainable = set(params) - m.fixed_params()
    for key in trainable:  # every learnable param receives gradient
        assert jnp.any(grads[3][key] != 0), key
    remat = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2, 3)))(q, k, v, params)
    for a, b in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(remat)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_padded_keys_change_nothing(name):
    m = mech(name)
    q, k, v = qkv(b=1, tq=10, tk=10)
    params = init(m)
    pad = 5
    kp = jnp.concatenate([k, 30.0 * jnp.ones((1, pad, 2, 8))], axis=1)
    vp = jnp.concatenate([v, 100.0 * jnp.ones((1, pad, 2, 8))], axis=1)
    mask = jnp.arange(10 + pad)[None] < 10
    qp = q
    if name in ("soft", "lara", "nystromformer", "laplacian", "ra"):
        # Self-attention padding: these use the mask on the query side too (landmarks,
        # tied q/k), so pad q like k and compare the valid positions.
        qp = jnp.concatenate([q, 30.0 * jnp.ones((1, pad, 2, 8))], axis=1)
    # jitted: one compile each instead of eager op-by-op dispatch
    padded = jax.jit(lambda *a: _run(m, *a, params, mask=mask))(qp, kp, vp)[:, :10]
    plain = jax.jit(lambda *a: _run(m, *a, params))(q, k, v)
    np.testing.assert_allclose(padded, plain, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", NAMES)
def test_fully_masked_rows_are_zero(name):
    m = mech(name)
    q, k, v = qkv()
    mask = jnp.array([[False] * 12, [True] * 12])
    out = jax.jit(lambda *a: _run(m, *a, init(m), mask=mask, deterministic=False))(q, k, v)
    assert jnp.all(out[0] == 0.0)
    assert jnp.all(jnp.isfinite(out))


@pytest.mark.parametrize("name", CAUSAL)
def test_causal_ignores_the_future(name):
    m = mech(name, chunk_size=4) if "chunk_size" in la.get(name).defaults else mech(name)
    q, k, v = qkv(tq=11, tk=11)
    params = init(m)
    run = jax.jit(lambda q, k, v: _run(m, q, k, v, params, causal=True))  # one compile, 2 calls
    out = run(q, k, v)
    t0 = 6  # change every key/value after position t0: outputs up to t0 must not move
    k2, v2 = k.at[:, t0 + 1 :].mul(-3.0), v.at[:, t0 + 1 :].add(5.0)
    out2 = run(q, k2, v2)
    np.testing.assert_allclose(out2[:, : t0 + 1], out[:, : t0 + 1], rtol=1e-5, atol=1e-5)
    assert not np.allclose(out2[:, t0 + 1 :], out[:, t0 + 1 :])


@pytest.mark.parametrize("name", [n for n in CAUSAL if la.get(n).reference_fn is not None])
@pytest.mark.parametrize("t,chunk", [(11, 4), (12, 4), (1, 4)])
def test_causal_chunked_equals_reference(name, t, chunk):
    m = mech(name)
    if "chunk_size" not in m.defaults:
        pytest.skip(f"{name} has no chunked path")
    q, k, v = qkv(tq=t, tk=t)
    params = init(m)
    mask = jnp.ones((2, t), bool).at[1, t // 2 :].set(t == 1)

    def f(fn, q, k, v, p):
        return fn(q, k, v, p, RNG, mask=mask, causal=True, deterministic=True)

    # jitted, as in training: eager op-by-op dispatch compiles each primitive on its own
    # (2-3x slower)
    fast_fn = lambda *a, **kw: m.attention(*a, chunk_size=chunk, **kw)  # noqa: E731
    fast = jax.jit(lambda *a: f(fast_fn, *a))(q, k, v, params)
    ref = jax.jit(lambda *a: f(m.reference, *a))(q, k, v, params)
    np.testing.assert_allclose(fast, ref, rtol=1e-4, atol=1e-5)

    def loss(fn):
        return lambda *a: jnp.sum(jnp.sin(f(fn, *a)))

    g_fast = jax.jit(jax.grad(loss(fast_fn), argnums=(0, 1, 2, 3)))(q, k, v, params)
    g_ref = jax.jit(jax.grad(loss(m.reference), argnums=(0, 1, 2, 3)))(q, k, v, params)
    for a, b in zip(jax.tree_util.tree_leaves(g_fast), jax.tree_util.tree_leaves(g_ref)):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("name", [n for n in NAMES if la.get(n).stochastic])
def test_stochastic_rng_semantics(name):
    m = mech(name)
    q, k, v = qkv()
    params = init(m)
    with pytest.raises(ValueError, match="rng"):
        m.attention(q, k, v, params, None, deterministic=False)
    # jitted: one compile per mode instead of eager op-by-op dispatch
    det = jax.jit(lambda rng: m.attention(q, k, v, params, rng, deterministic=True))
    sample = jax.jit(lambda rng: m.attention(q, k, v, params, rng))
    det1, det2 = det(None), det(jax.random.key(3))
    np.testing.assert_array_equal(det1, det2)
    s1, s1b, s2 = (sample(jax.random.key(i)) for i in (1, 1, 2))
    np.testing.assert_array_equal(s1, s1b)
    assert not np.allclose(s1, s2)


@optimised
@pytest.mark.parametrize("name", NAMES)
def test_large_norms_finite(name):
    m = mech(name)
    q, k, v = qkv()
    # Rescale every token to norm 100.
    q = 100.0 * q / jnp.linalg.norm(q, axis=-1, keepdims=True)
    k = 100.0 * k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    params = init(m)
    out, grads = jax.jit(  # jitted, as in training (eager dispatch: 2-3x slower)
        jax.value_and_grad(
            lambda q, k, v, p: jnp.sum(m.attention(q, k, v, p, RNG) ** 2), argnums=(0, 1, 2, 3)
        )
    )(q, k, v, params)
    assert jnp.isfinite(out)
    for g in jax.tree_util.tree_leaves(grads):
        assert jnp.all(jnp.isfinite(g))


def _values_and_grads(names):
    """``{name: [out, dq, dk, dv, *dparams]}`` of every mechanism in `names` (numpy)."""
    result = {}
    for name in names:
        m = mech(name)
        q, k, v = qkv()
        params = init(m)
        out, grads = jax.jit(
            jax.value_and_grad(lambda *a, m=m: jnp.sum(jnp.sin(m.attention(*a, RNG))), (0, 1, 2, 3))
        )(q, k, v, params)
        result[name] = [np.asarray(x) for x in (out, *jax.tree_util.tree_leaves(grads))]
    return result


_USERS_BUILD = """
import pickle, sys
sys.path.insert(0, {tests!r})
import test_mechanisms as t
pickle.dump(t._values_and_grads(t.NAMES), open({out!r}, "wb"))
"""


def test_the_suites_compile_flags_give_the_users_results(tmp_path):
    """The suite compiles with XLA's optimisations off and its legacy CPU fusion emitters
    (tests/conftest.py: the cost at these shapes is compiling). Every mechanism's value and
    gradients, compiled the way users compile them (a fresh process with XLA's defaults),
    equal the suite's to float32 rounding."""
    import os
    import pickle
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "users.pkl"
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env.update(XLA_FLAGS="", JAX_DISABLE_MOST_OPTIMIZATIONS="0")  # the platform: inherited
    script = _USERS_BUILD.format(tests=str(Path(__file__).parent), out=str(out))
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=600)
    users = pickle.loads(out.read_bytes())
    ours = _values_and_grads(NAMES)
    assert set(users) == set(ours) == set(NAMES)
    for name in NAMES:
        for i, (a, b) in enumerate(zip(ours[name], users[name], strict=True)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=f"{name} leaf {i}")
