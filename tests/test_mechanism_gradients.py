"""Every learnable parameter of every mechanism gets a gradient at the default config.

A parameter whose gradient is ~0 at the default config is dead weight: flexformer_n's
``tau`` was (its norm term cancels once q, k are normalised). The loss is a fixed
random projection of the output (not degenerate: its gradient reaches every output entry).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import linattn_jax as la

#: Smallest leaf gradient (max abs) over the largest, per mechanism and mode.
MIN_RATIO = 1e-3


def _trainable(name):
    mech = la.get(name)
    params = mech.init(jax.random.key(0), num_heads=2, head_dim=8)
    fixed = mech.fixed_params()
    trainable = {k: x for k, x in params.items() if k not in fixed}
    return mech, params, trainable


CASES = [
    (name, causal)
    for name in la.names()
    if jax.tree.leaves(_trainable(name)[2])
    for causal in ((False, True) if la.get(name).supports_causal else (False,))
]


@pytest.mark.parametrize(("name", "causal"), CASES)
def test_every_parameter_gets_a_gradient(name, causal):
    mech, params, trainable = _trainable(name)
    kq, kk, kv, kw = jax.random.split(jax.random.key(1), 4)
    shape = (2, 16, 2, 8)
    q, k, v, proj = (jax.random.normal(key, shape) for key in (kq, kk, kv, kw))

    @jax.jit
    def grads(tp):
        def loss(tp):
            out = mech.attention(
                q, k, v, {**params, **tp}, jax.random.key(2), causal=causal, deterministic=True
            )
            return jnp.sum(out * proj)

        return jax.grad(loss)(tp)

    g = jax.tree_util.tree_leaves_with_path(grads(trainable))
    size = {jax.tree_util.keystr(p): float(jnp.max(jnp.abs(x))) for p, x in g}
    largest = max(size.values())
    assert largest > 0, f"{name}: no gradient at all"
    dead = {p: s / largest for p, s in size.items() if s < MIN_RATIO * largest}
    assert not dead, f"{name} causal={causal}: leaves with gradient < {MIN_RATIO} x max: {dead}"


def test_cases_cover_the_learnable_mechanisms():
    """The flexformers, rfa, hedgehog and laplacian have learnable params at the default."""
    names = {n for n, _ in CASES}
    assert {"flexformer_s", "flexformer_n", "rfa", "hedgehog", "laplacian"} <= names
