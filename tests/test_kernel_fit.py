"""Kernel recovery (`train.bench.kernel_fit.fit_subspace`): the learnable kernels of
flexformer_s and flexformer_n fitted to ``exp(3 Pq . Pk)`` on a 4-dimensional subspace of
``d = 16`` (unit q, k, M = 32, Adam lr 1e-2, fresh draws every step, one ``lax.scan``).

Seed 0, 1500 steps (docs/flexformer.md, "Kernel recovery", has seeds 0-2). What passes: the
fit beats the best temperature-only exact kernel ``exp(t cos(q, k))`` with almost no negative
weights, flexformer_s reaches the best exact stationary Gaussian-spectral kernel, and the
learned variance moves onto the subspace. What does not: a 10x KL fall
and an on / off variance ratio >= 100 (strict xfail below, with the measured numbers): on
the sphere the target is not stationary, and the best stationary kernel itself falls only
~5x and keeps a ratio of ~10.
"""

from __future__ import annotations

import functools

import pytest

from train.bench import kernel_fit

STEPS = 1500


@functools.cache
def _fit(name):
    row = kernel_fit.fit_subspace(name, steps=STEPS, seed=0, references=False)
    return {**row, **_references()}


@functools.cache
def _references():  # a 41 x 41 grid: steps 0.2 on, 0.05 off (the optimum 2.4, 0.25 is on it)
    return kernel_fit.subspace_references(num=41)


@pytest.mark.parametrize("name", kernel_fit.SUBSPACE_MECHANISMS)
def test_fit_recovers_subspace_kernel(name):
    r = _fit(name)
    print(r)
    assert r["kl_end"] < r["kl_temperature"] < r["kl_init"]  # beyond any temperature
    assert r["kl_end"] < r["kl_init"] / 4
    assert r["neg_end"] < 0.01
    # the variance moved onto the subspace (init: the same on and off, ~1)
    assert r["var_on"] > 1.5 * r["var_on_init"] and r["var_off"] < r["var_off_init"]
    assert r["var_ratio"] > 2
    if name == "flexformer_s":  # stationary: the best exact stationary kernel's KL, within 10%
        assert r["kl_end"] < 1.1 * r["kl_gaussian"]
        assert r["var_ratio"] > 8
    else:  # non-stationary pairs beat every stationary Gaussian-spectral kernel
        assert r["kl_end"] < r["kl_gaussian"]


@pytest.mark.xfail(
    strict=True,
    reason="the bounds asked for are out of reach on this target: measured (seed 0, 1500 "
    "steps) KL 0.089 -> 0.019 (4.7x) and variance ratio 15 for flexformer_s, 0.088 -> 0.014 "
    "(6.5x) and ratio 2.6 for flexformer_n; the best exact stationary kernel has KL 0.018 and "
    "ratio 2.4 / 0.25 = 10 (docs/flexformer.md, 'Kernel recovery')",
)
@pytest.mark.parametrize("name", kernel_fit.SUBSPACE_MECHANISMS)
def test_fit_reaches_a_tenfold_fall_and_variance_ratio_100(name):
    r = _fit(name)
    assert r["kl_end"] <= r["kl_init"] / 10
    assert r["var_ratio"] >= 100
