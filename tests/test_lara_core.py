"""`linattn_jax.lara_core`: LARA's two T-long parts against naive formulas of the same math
(``jax.nn.softmax`` / ``logsumexp`` on the full arrays), values and gradients through the
hand-written VJPs, with and without masks, one and several terms per proposal, opt and bh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linattn_jax import lara_core
from linattn_jax.lara_core import ALPHA_FLOOR, QuerySpec

B, H, L, T, D = 2, 2, 3, 7, 4


def _normal(seed, *shape, scale=1.0):
    return scale * jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _naive_keys(omega, kh, v, mask):
    a = jnp.einsum("bhnd,bhmd->bhnm", omega, kh) - 0.5 * jnp.sum(kh * kh, -1)[:, :, None, :]
    if mask is not None:
        a = jnp.where(mask, a, -jnp.inf)
    return jnp.einsum("bhnm,bhmd->bhnd", jax.nn.softmax(a, -1), v), jax.nn.logsumexp(a, -1)


def _naive_queries(omega, q_bar, qh, c, bh, f, masks, spec):
    alpha = bh[..., None]
    if spec.opt:
        logits = jnp.einsum("bhcd,bhqd->bhcq", q_bar, qh)
        valid = True if masks is None else masks[1] & masks[2]
        r = jnp.where(valid, jax.nn.softmax(jnp.where(valid, logits, -jnp.inf), -1), 0.0)
        cv = jnp.ones_like(r, bool) if masks is None else masks[2]
        r_mean = jnp.sum(jnp.where(cv, r, 0.0), 2, keepdims=True) / jnp.sum(cv, 2, keepdims=True)
        alpha = alpha + spec.gamma * jnp.repeat(r - r_mean, spec.per, axis=2)
    s = jnp.einsum("bhnd,bhqd->bhnq", omega, qh) + c[..., None]
    log_w = jnp.log(jnp.maximum(alpha, ALPHA_FLOOR)) + s
    if masks is not None:
        log_w = jnp.where(masks[0], log_w, -jnp.inf)
    return jnp.einsum("bhnq,bhnd->bqhd", jax.nn.softmax(log_w, 2), f)


def _check(fast, naive, args, diff_args):
    """Same value and the same gradient (for a random cotangent) of every float argument."""
    # jitted (the arguments closed over: the spec is static): one program per form
    out, out_ref = jax.jit(lambda: fast(*args))(), jax.jit(lambda: naive(*args))()
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(out_ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    cts = [_normal(9 + i, *x.shape) for i, x in enumerate(jax.tree.leaves(out))]

    def loss(fn):
        def f(*xs):
            full = list(args)
            for i, x in zip(diff_args, xs, strict=True):
                full[i] = x
            leaves = jax.tree.leaves(fn(*full))
            return sum(jnp.sum(x * ct) for x, ct in zip(leaves, cts, strict=True))

        grad = jax.jit(jax.grad(f, argnums=tuple(range(len(diff_args)))))
        return grad(*(args[i] for i in diff_args))

    for g, g_ref in zip(loss(fast), loss(naive), strict=True):
        np.testing.assert_allclose(g, g_ref, rtol=2e-4, atol=1e-5)


@pytest.mark.parametrize("masked", [False, True])
def test_key_stats_vjp_is_the_softmax_gradient(masked):
    omega, kh, v = _normal(0, B, H, 5, D), _normal(1, B, H, T, D), _normal(2, B, H, T, D)
    mask = (jnp.arange(T)[None] < jnp.array([[T], [4]]))[:, None, None, :] if masked else None
    _check(lara_core.key_stats, _naive_keys, (omega, kh, v, mask), (0, 1, 2))


@pytest.mark.parametrize(
    "spec, masked",
    [
        (QuerySpec(True, 1.0, 1), False),
        (QuerySpec(True, 4.0, 2), True),  # the floor binds for some weights
        (QuerySpec(False, 0.0, 2), True),
    ],
    ids=["opt", "opt-S2-masked", "bh-masked"],
)
def test_query_weights_vjp_is_the_gradient_of_the_estimate(spec, masked):
    n = L * spec.per
    omega, q_bar, qh = _normal(0, B, H, n, D), _normal(1, B, H, L, D), _normal(2, B, H, T, D)
    c, f = _normal(3, B, H, n), _normal(5, B, H, n, D)
    bh = jax.nn.sigmoid(_normal(4, B, H, n))
    masks = None
    if masked:  # the last slot of row 1 and its terms are invalid; row 1 has 5 valid queries
        cv = jnp.ones((B, L), bool).at[1, -1].set(False)
        masks = (
            jnp.repeat(cv, spec.per, axis=1)[:, None, :, None],
            (jnp.arange(T)[None] < jnp.array([[T], [5]]))[:, None, None, :],
            cv[:, None, :, None],
        )
    args = (omega, q_bar, qh, c, bh, f, masks, spec)
    _check(lara_core.query_weights, _naive_queries, args, (0, 1, 2, 3, 4, 5))


def test_forward_mode_is_refused_by_the_custom_vjp():
    """The VJPs are reverse mode only (as the module says): ``jax.jvp`` raises, not silently
    differentiating something else."""
    omega, kh, v = _normal(0, 1, 1, 2, D), _normal(1, 1, 1, T, D), _normal(2, 1, 1, T, D)
    with pytest.raises(TypeError, match="forward-mode"):
        jax.jvp(lambda o: lara_core.key_stats(o, kh, v)[0], (omega,), (omega,))
