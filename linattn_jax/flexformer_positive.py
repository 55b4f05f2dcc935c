"""Positive spectral features of flexformer's learned frequencies (``features="positive"``).

FAVOR+'s positive form ``exp(omega . y - |y|^2 / 2)`` with the learned frequencies in place of
performer's fixed draws, for both variants; `linattn_jax.flexformer` prepares the input
``y`` (normalised, bandwidth- and temperature-scaled) and the frequencies ``omega = c
omega_tilde`` and calls `features`. With ``y^ = y d^(-1/4)``:

- flexformer_s, one set ``Omega [H, M, d]``: ``phi+(y) = M^(-1/2) exp(Omega y^ - |y^|^2 / 2)``;
- flexformer_n, the pair ``Omega1, Omega2``, summed as its trigonometric map sums its cos and
  sin terms (the sum-of-pairs layout)::

      phi+_n(y) = (4M)^(-1/2) [exp(Omega1 y^ - |y^|^2 / 2) + exp(Omega2 y^ - |y^|^2 / 2)]  [M]

  ``phi+_n(q) . phi+_n(k) = (4M)^-1 sum_m sum_{a,b in {1,2}} exp(omega_a . q^ + omega_b . k^ -
  |q^|^2 / 2 - |k^|^2 / 2)``: the trigonometric map's four pair terms, FAVOR+'s positive
  estimate in place of ``cos(omega_a . q^ - omega_b . k^)``.

Why this layout for the pair: it is the trigonometric flexformer_n's Yaglom construction
(one map for queries and keys, an explicit inner product, so a symmetric positive-definite
kernel, the family the paper learns), every weight is positive, and at ``Omega1 = Omega2`` it
is FAVOR+ exactly (unbiased for ``exp(q^ . k^)``; flexformer_s's positive map to rounding).
Queries on ``Omega1`` and keys on ``Omega2`` (``exp(omega_1 . q^ + omega_2 . k^)``) would be
FAVOR+ at the tie too, but its kernel is neither symmetric nor positive definite. As the
trigonometric pair, the map is symmetric under ``Omega1 <-> Omega2``, so a tied init stays
tied under gradient training: flexformer_n's default jittered init applies unchanged, and
its expectation is `init_expectation`, 0.25-0.76% above the softmax kernel at ``|y^| = 1``.

Stabiliser (`linattn_jax.performer.feature_map`, its relative eps included): the detached
per-token max over all the exponents of both sets; it cancels for queries and is the keys'
log scale in the core (a running max when causal). No denominator floor: every weight is
positive. Cost: one product with the stacked ``[H, pM, d]`` frequencies and ``pM``
exponentials (p = 1, 2) for M features (the trigonometric map gives 2M features from ``pM``
cos / sin pairs).
"""

from __future__ import annotations

import jax.numpy as jnp

from linattn_jax import core, performer


def features(x, omegas, *, stabilize: bool = True):
    """``(phi [B, T, H, M], n [B, T, H])`` float32, ``exp(n) phi = (p^2 M)^(-1/2) sum_p
    exp(Omega_p x^ - |x^|^2 / 2)`` over the p frequency sets `omegas` (``[H, M, d]`` each;
    flexformer_s: one, flexformer_n: the pair) plus performer's relative eps, ``x^ = x
    d^(-1/4)``; `x` ``[B, T, H, d]`` as given to the map (unscaled). ``n``: the detached
    per-token max of the exponents (0 without `stabilize`, the raw estimator's features)."""
    p = len(omegas)
    phi, n = performer.feature_map(x, jnp.concatenate(omegas, axis=1), stabilize=stabilize)
    if p > 1:  # performer's (p M)^(-1/2) per feature: the sum over the sets, then p^(-1/2)
        phi = jnp.sum(phi.reshape(*phi.shape[:-1], p, -1), axis=-2) * p**-0.5
    return phi, n


def init_expectation(q, k, pair_jitter):
    """The expectation ``[B, H, Tq, Tk]`` of flexformer_n's positive kernel on `q`, `k`
    (``[B, T, H, d]``, the map's input: the raw map, ``qk_radius=None``) over its init
    ``Omega1 ~ N(0, I)``, ``Omega2 = Omega1 + pair_jitter N(0, I)``: the pair term ``(a, b)``
    has mean ``exp(q^ . k^ + j^2 |[a=2] q^ + [b=2] k^|^2 / 2)``, so::

        exp(q^ . k^) (1 + exp(j^2 |k^|^2 / 2) + exp(j^2 |q^|^2 / 2) + exp(j^2 |q^ + k^|^2 / 2)) / 4

    (``pair_jitter=0``: ``exp(q^ . k^)``, the softmax kernel)."""
    qh = jnp.swapaxes(core.scale_inputs(q), 1, 2)[:, :, :, None]  # [B, H, Tq, 1, d]
    kh = jnp.swapaxes(core.scale_inputs(k), 1, 2)[:, :, None]  # [B, H, 1, Tk, d]
    half = 0.5 * pair_jitter**2

    def sq(x):
        return jnp.sum(x * x, axis=-1)

    pairs = 1.0 + jnp.exp(half * sq(kh)) + jnp.exp(half * sq(qh)) + jnp.exp(half * sq(qh + kh))
    return jnp.exp(jnp.sum(qh * kh, axis=-1)) * pairs / 4.0
