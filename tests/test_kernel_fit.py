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


def test_subspace_command_runs_every_seed_and_tabulates(tmp_path, monkeypatch, capsys):
    """``python -m train.bench kernel_fit --target subspace``: one fit per mechanism and seed
    with the given steps and lr, the references beside each row, the table and the JSON.
    The fit and the references are stand-ins here (the real ones: the tests above)."""
    import json

    from train.bench.__main__ import build_parser

    fits = []

    def fake_fit(name, *, references, steps, seed, lr):
        fits.append((name, steps, seed, lr, references))
        return {"mechanism": name, "seed": seed, "kl_init": 0.09, "kl_end": 0.01 * (seed + 1),
                "neg_end": 0.0, "var_on": 3.0, "var_off": 0.3, "var_ratio": 10.0}  # fmt: skip

    refs = {"kl_temperature": 0.05, "best_t": 2.5, "kl_gaussian": 0.018,
            "gaussian_on": 2.4, "gaussian_off": 0.25}  # fmt: skip
    monkeypatch.setattr(kernel_fit, "fit_subspace", fake_fit)
    monkeypatch.setattr(kernel_fit, "subspace_references", lambda **kw: refs)
    out = tmp_path / "fit.json"
    args = build_parser().parse_args(
        ["kernel_fit", "--target", "subspace", "--steps", "7", "--seeds", "2", "--lr", "0.02",
         "--out", str(out), "--quiet"]
    )  # fmt: skip
    result = kernel_fit.main_from_args(args)
    names = kernel_fit.SUBSPACE_MECHANISMS
    assert fits == [(n, 7, s, 0.02, False) for s in (0, 1) for n in names]
    assert [r["seed"] for r in result["rows"]] == [s for s in (0, 1) for _ in names]
    assert all(r["kl_gaussian"] == 0.018 for r in result["rows"])
    assert result["config"]["steps"] == 7 and result["config"]["seeds"] == 2
    assert result["config"]["lr"] == 0.02
    assert json.loads(out.read_text()) == result
    table = capsys.readouterr().out
    assert "7 Adam steps (lr 0.02)" in table
    assert f"| {names[0]} | 1 | 0.0900 | 0.0200 | 4.5 | 0.000% | 3 | 0.3 | 10 |" in table
    assert "0.0500 (t = 2.50) | 0.0180 (2.40, 0.250) |" in table
