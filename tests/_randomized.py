"""Inputs, jitted calls and tolerances shared by the tests of ra and lara.

Statistical tests use fixed seeds and bounds from the Monte-Carlo standard error;
each batch element of the statistical inputs is an independent problem, so one
call covers several "seeds".

Speed on CPU: everything but the explicit eager-vs-jit checks is jitted, through a
cache shared by tests with equal shapes and config; and where the key type is not
what is being tested, keys are ``impl="rbg"`` (the mechanisms accept any key;
threefry's unrolled hash costs ~1 s of XLA compile per draw site on this CPU, rbg
a fraction; but rbg keys are not vmap-invariant, so the test that compares vmapped
single draws with `num_samples` uses threefry). `test_deterministic_mode_and_rng`
also uses the default threefry keys, as do the shared tests (tests/test_mechanisms.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from linattn_jax import lara, ra, softmax

RA = ra.RA
LARA = lara.LARA

#: Tolerances for the same computation done two ways (fast path vs reference).
FWD_TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}
GRAD_TOL = 1e-4


def _key(seed):
    """A fast-compiling key (see the module docstring)."""
    return jax.random.key(seed, impl="rbg")


#: Default test sizes; B, H, Dk, Dv all differ so a wrong broadcast cannot pass silently.
H, D, DV = 3, 4, 5


def _normal(seed, *shape):
    # Inputs from numpy: eager jax.random calls would each compile a threefry kernel.
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _qkv(seed, b=2, tq=12, tk=12, h=H, d=D, dv=DV, dtype=jnp.float32):
    q = _normal(seed, b, tq, h, d)
    k = _normal(seed + 1000, b, tk, h, d)
    v = _normal(seed + 2000, b, tk, h, dv)
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def _lengths_mask(lengths, t):
    return jnp.arange(t)[None, :] < jnp.asarray(lengths)[:, None]


def _softmax(q, k, v, mask=None, causal=False):
    return softmax.attention(q, k, v, {}, mask=mask, causal=causal)


def _rms(a, b):
    return float(jnp.sqrt(jnp.mean(jnp.square(jnp.asarray(a, jnp.float32) - b))))


def _close(a, b, tol):
    np.testing.assert_allclose(
        np.asarray(a, np.float32), np.asarray(b, np.float32), atol=tol, rtol=tol
    )


def _finite(tree):
    return all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree_util.tree_leaves(tree))


#: Cached jitted callables, keyed by (function, static config): tests that share shapes and
#: config share one compilation.
_JIT_CACHE: dict = {}


def _jitted(kind, fn, cfg):
    key = (kind, fn, tuple(sorted(cfg.items())))
    if key not in _JIT_CACHE:

        def attn(q, k, v, p, r, m):
            return fn(q, k, v, p, r, mask=m, **cfg)

        if kind == "call":
            _JIT_CACHE[key] = jax.jit(attn)
        else:  # output and gradients of sum(out * w), w a fixed pattern

            def loss(q, k, v, p, r, m):
                out = attn(q, k, v, p, r, m).astype(jnp.float32)
                w = jnp.sin(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
                return jnp.sum(out * w), out

            _JIT_CACHE[key] = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    return _JIT_CACHE[key]


def _call(fn, q, k, v, params=None, rng=None, mask=None, **cfg):
    """Jitted ``fn(q, k, v, params, rng, mask=mask, **cfg)`` (cfg static)."""
    return _jitted("call", fn, cfg)(q, k, v, {} if params is None else params, rng, mask)


def _out_and_grads(fn, q, k, v, params=None, rng=None, mask=None, **cfg):
    """Jitted output and gradients of ``sum(out * w)`` (fixed w) w.r.t. q, k, v, params."""
    params = {} if params is None else params
    grads, out = _jitted("grad", fn, cfg)(q, k, v, params, rng, mask)
    return out, grads


def _assert_trees_close(a, b, tol):
    leaves_a, leaves_b = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(leaves_a) == len(leaves_b)
    for x, y in zip(leaves_a, leaves_b, strict=True):
        _close(x, y, tol)


# ----------------------------------------------------------------------------- registry
