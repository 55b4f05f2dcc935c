"""flexformer's compiled program: the trigonometric features of each projection
in one XLA fusion, forward and backward (`core.cos_sin`)."""

from __future__ import annotations

import jax
import pytest

import linattn_jax as la
from train.bench import fusions


def _polynomial_fusions(hlo: str) -> int:
    return fusions.counts(hlo, set())["polynomial"]


@pytest.mark.parametrize("name", ["flexformer_s", "flexformer_n"])
@pytest.mark.parametrize("causal", [False, True])
def test_each_projection_computes_its_sin_cos_pair_in_one_fusion(name, causal, optimised_xla):
    # query and key features: one fusion each; forward+backward: one more each, the backward
    # recomputing cos and sin from the projection (two fusions per projection before: the
    # cos half and the sin half each redoing the range reduction)
    b, t, h, d = 1, 24, 2, 4
    mech = la.get(name).bind(features="trig")
    params = mech.init(jax.random.key(0), num_heads=h, head_dim=d, num_features=10)
    q, k, v = jax.random.normal(jax.random.key(1), (3, b, t, h, d))

    def loss(q, k, v, params):
        return mech.attention(q, k, v, params, causal=causal).sum()

    fwd = jax.jit(loss).lower(q, k, v, params).compile().as_text()
    bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 3))).lower(q, k, v, params).compile().as_text()
    assert _polynomial_fusions(fwd) == 2
    assert _polynomial_fusions(bwd) == 4
