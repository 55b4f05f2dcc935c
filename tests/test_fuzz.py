"""Property-based fuzzing (hypothesis) over mechanisms x shapes x masks x input scales
(1e-3 .. 1e2) x dtypes (float32, bfloat16) x causal.

Properties:

* finite outputs and gradients (q, k, v, params), and zeros for a query with no visible key;
* non-causal outputs are permutation-equivariant over keys (keys, values and mask permuted
  together), for the mechanisms that treat keys as a set (`SET_MECHANISMS`);
* masking a key equals dropping it (same set);
* bfloat16 inputs stay within `BF16_TOL` of the float32 computation on the same inputs.

The first two share one compiled call per example: its batch holds the random inputs and
the same inputs with the keys permuted (the batch rows are independent for every mechanism
used there). Identical keys (the mean of v over the visible keys) are pinned at every input
scale, with masks and gradients, in test_numerics.py.

Profiles (tests/conftest.py): by default ``repeatable``, the same few examples on every run
(10 for the first test, `CI_EXAMPLES` for the others), so CI cannot fail by chance and the
file stays well under a minute; ``HYPOTHESIS_PROFILE=explore python -m pytest
tests/test_fuzz.py`` draws 200 new examples per test to look for bugs (pin what it finds
with ``@example``).
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
from _helpers import SMALL_CONFIG
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import linattn_jax as la

#: Mechanisms whose output is a function of the set of (key, value) pairs: the feature maps
#: (with the same rng, the random features do not depend on the keys' order or count),
#: softmax, and ra when deterministic. Not the landmark methods (nystromformer, soft,
#: laplacian, lara: landmarks are means of contiguous segments of keys; laplacian also adds
#: a local window over positions) nor a sampling ra (its draws follow the keys' order).
SET_MECHANISMS = frozenset(
    [n for n in la.names() if la.get(n).feature_map is not None] + ["softmax", "ra"]
)
#: Largest ``max |out_bf16 - out_f32| / max |out_f32|`` (same bf16-rounded inputs, same
#: rng), per mechanism. Every mechanism computes in float32 inside, so what is left is the
#: output's rounding to bfloat16 (2^-8 relative, one ulp, at the largest output) plus the
#: features' and weights' float32 rounding: 1e-2 everywhere, 2.5 ulps. Also the tolerance of
#: the other properties when the inputs are bfloat16.
BF16_TOL = {name: 1e-2 for name in la.names()}
#: Float32 tolerance, relative to max |out|.
F32_TOL = 1e-4
SCALES = (1e-3, 1e-1, 1.0, 10.0, 100.0)
_EXPLORE = os.environ.get("HYPOTHESIS_PROFILE", "repeatable") != "repeatable"
#: Examples per test under the default profile (the first test takes the profile's 10).
CI_EXAMPLES = 5


def _examples(n):
    """`n` examples under the default profile; the profile's own count when exploring."""
    return {} if _EXPLORE else {"max_examples": n}


@st.composite
def cases(draw, dtypes=(jnp.float32, jnp.bfloat16), min_t=1):
    name = draw(st.sampled_from(la.names()))
    mech = la.get(name)
    b = draw(st.integers(1, 2))
    t = draw(st.integers(min_t, 9))
    h = draw(st.integers(1, 2))
    d = draw(st.sampled_from([2, 4, 8]))
    causal = mech.supports_causal and draw(st.booleans())
    dtype = draw(st.sampled_from(dtypes))
    norm = draw(st.sampled_from(SCALES))
    n_valid = draw(st.lists(st.integers(0, t), min_size=b, max_size=b))
    seed = draw(st.integers(0, 2**16))
    return name, b, t, h, d, causal, dtype, norm, n_valid, seed


def _tokens(key, shape, norm):
    x = jax.random.normal(key, shape)
    return norm * x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-6)


def _inputs(case):
    name, b, t, h, d, causal, dtype, norm, n_valid, seed = case
    kq, kk, kv, kp, kr, kperm = jax.random.split(jax.random.key(seed), 6)
    q, k = _tokens(kq, (b, t, h, d), norm), _tokens(kk, (b, t, h, d), norm)
    v = jax.random.normal(kv, (b, t, h, d))
    mask = jnp.arange(t)[None, :] < jnp.array(n_valid)[:, None]
    # the valid keys of each row scattered, not a prefix
    mask = jax.random.permutation(kperm, mask, axis=1, independent=True)
    mech = la.get(name).bind(**SMALL_CONFIG.get(name, {}))
    return mech, q, k, v, mask, mech.init(kp, num_heads=h, head_dim=d), kr


def _deterministic(name):
    """ra samples along the keys' order; the set properties use its deterministic form."""
    return name == "ra"


def _visible(mask, causal):
    """``[B, Tq, Tk]`` bool: the keys each query sees."""
    t = mask.shape[1]
    vis = jnp.broadcast_to(mask[:, None, :], (mask.shape[0], t, t))
    return vis & jnp.tril(jnp.ones((t, t), bool))[None] if causal else vis


def _f32(x):
    return np.asarray(jnp.asarray(x, jnp.float32))


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
# found by exploration: one valid key of two at norm 10 overflowed an unused LARA term's
# exp(log alpha), and exp's backward (0 * inf) made the q/k gradients NaN
@example(("lara", 1, 2, 1, 2, False, jnp.float32, 10.0, [1], 2))
def test_finite_grads_and_key_permutation(case):
    """One call on two groups of batch rows: the random inputs (finite outputs and
    gradients; zeros for a query without visible keys) and the inputs with keys, values and
    mask permuted (the same outputs when non-causal)."""
    name, b, t, h, d, causal, dtype, norm, n_valid, seed = case
    mech, q, k, v, mask, params, rng = _inputs(case)
    perm = jax.random.permutation(jax.random.key(seed + 1), t)
    qs = jnp.concatenate([q, q])
    ks = jnp.concatenate([k, k[:, perm]])
    vs = jnp.concatenate([v, v[:, perm]])
    masks = jnp.concatenate([mask, mask[:, perm]])
    det = _deterministic(name) and not causal

    def loss(q, k, v, p):
        out = mech.attention(
            q.astype(dtype),
            k.astype(dtype),
            v.astype(dtype),
            p,
            rng,
            mask=masks,
            causal=causal,
            deterministic=det,
        )
        return jnp.sum(out.astype(jnp.float32) ** 2), out

    # jitted, as in training (one compile per example; op-by-op eager dispatch recompiled each
    # of hundreds of primitives for every new shape: ~5x slower on CPU)
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
        qs, ks, vs, params
    )
    assert out.shape == (2 * b, t, h, d) and out.dtype == dtype
    out = _f32(out)
    assert np.all(np.isfinite(out)), (name, case)
    for g in jax.tree_util.tree_leaves(grads):
        assert np.all(np.isfinite(g)), (name, case)
    rand, permuted = out[:b], out[b:]
    empty = ~np.asarray(jnp.any(_visible(mask, causal), axis=-1))  # [B, Tq]
    assert np.all(rand[empty] == 0.0), (name, case)

    tol = F32_TOL if dtype == jnp.float32 else BF16_TOL[name]
    if name in SET_MECHANISMS and not causal:
        err = np.max(np.abs(permuted - rand)) / max(np.max(np.abs(rand)), 1e-6)
        assert err <= tol, ("key permutation", err, case)


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow], **_examples(CI_EXAMPLES))
@given(
    cases(min_t=2).filter(lambda c: c[0] in SET_MECHANISMS),
    st.integers(0, 8),
)
def test_masking_a_key_equals_dropping_it(case, drop):
    """Key `drop` masked out gives the outputs of the call without it (causal: without its
    query either; the other queries compared)."""
    name, b, t, h, d, causal, dtype, norm, n_valid, seed = case
    mech, q, k, v, mask, params, rng = _inputs(case)
    p = drop % t
    keep = np.arange(t) != p
    kw = dict(causal=causal, deterministic=_deterministic(name))

    def run(q, k, v, mask):
        return mech.attention(
            q.astype(dtype), k.astype(dtype), v.astype(dtype), params, rng, mask=mask, **kw
        )

    masked = _f32(jax.jit(run)(q, k, v, mask.at[:, p].set(False)))
    qd = q[:, keep] if causal else q
    dropped = _f32(jax.jit(run)(qd, k[:, keep], v[:, keep], mask[:, keep]))
    if causal:
        masked = masked[:, keep]
    tol = F32_TOL if dtype == jnp.float32 else BF16_TOL[name]
    err = np.max(np.abs(masked - dropped)) / max(np.max(np.abs(dropped)), 1e-6)
    assert err <= tol, ("mask vs drop", err, case)


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow], **_examples(CI_EXAMPLES))
@given(cases(dtypes=(jnp.bfloat16,)))
def test_bfloat16_within_the_tolerance_table(case):
    """bfloat16 inputs against float32 on the same (bf16-rounded) inputs and rng."""
    name, b, t, h, d, causal, dtype, norm, n_valid, seed = case
    mech, q, k, v, mask, params, rng = _inputs(case)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))

    def run(q, k, v):
        return mech.attention(q, k, v, params, rng, mask=mask, causal=causal)

    out16 = _f32(jax.jit(run)(q, k, v))
    out32 = _f32(jax.jit(run)(*(x.astype(jnp.float32) for x in (q, k, v))))
    err = np.max(np.abs(out16 - out32)) / max(np.max(np.abs(out32)), 1e-6)
    assert err <= BF16_TOL[name], ("bfloat16", err, case)
