"""Kernel recovery (`train.bench.kernel_fit.fit_subspace`): the learnable kernels of
flexformer_s and flexformer_n fitted to ``exp(3 cos)`` restricted to a 4-dimensional
subspace of ``d = 16``, i.e. the stationary ``exp(-3 |P(q - k)|^2 / 2)`` (unit q, k, M = 32,
Adam lr 1e-2 cosine-decayed, fresh draws every step, one ``lax.scan``; seed 0, 1500 steps;
docs/flexformer.md, "Kernel recovery", has seeds 0-2).

With the default (trigonometric) map each passes when the KL falls at least 10x from init
and ends below the best temperature-only exact kernel ``exp(t cos(q, k))``, with under 1%
negative weights, and the learned spectral variance is at least 100x larger on the subspace
than off it and near the target's ``beta = 3`` there. The positive map estimates another
kernel family (FAVOR+'s ``exp(x^T S y)`` with per-token factors the map fixes, of the wrong
sign for this target), so its fits are held to the same question in its own family
(``family="positive"``, the kernel it estimates at ``S = beta P``): the same bounds, no
negative weight at all, with the on / off variance ratio of the pair's mean frequencies for
flexformer_n (its kernel's frequencies: `kernel_fit.spectral_variance`; measured, seeds 0-2:
137-159, and 55-74 over both matrices of the pair; flexformer_s 133-177).
"""

from __future__ import annotations

import functools

import pytest

from train.bench import kernel_fit

# compiled with XLA's optimisations on (tests/conftest.py turns them off for the suite):
# the 1500-step scans run 2x faster optimised (measured: 7.8 s -> 3.1 s for flexformer_s).
pytestmark = pytest.mark.usefixtures("optimised_xla")

STEPS = 1500
BETA = 3.0  # fit_subspace's default target sharpness


@functools.cache
def _fit(name, features="trig", family="stationary"):
    row = kernel_fit.fit_subspace(
        name, steps=STEPS, seed=0, references=False, features=features, family=family
    )
    return {**row, **_references(family)}


@functools.cache
def _references(family="stationary"):  # a 41 x 41 grid: steps 0.2 on, 0.05 off ((3, 0) on it)
    return kernel_fit.subspace_references(num=41, family=family)


@pytest.mark.parametrize("family", kernel_fit.FAMILIES)
def test_references_find_the_target_kernel(family):
    r = _references(family)
    assert r["kl_gaussian"] < 1e-6 and (r["gaussian_on"], r["gaussian_off"]) == (BETA, 0.0)
    assert r["kl_temperature"] > 0.03  # no temperature of the full-space kernel gets there
    with pytest.raises(ValueError, match="family must be one of"):
        kernel_fit.subspace_target(None, None, family=family[:3])


@pytest.mark.parametrize("name", kernel_fit.SUBSPACE_MECHANISMS)
def test_fit_recovers_subspace_kernel(name):
    r = _fit(name)
    print(r)
    assert r["kl_end"] <= r["kl_init"] / 10
    assert r["kl_end"] < r["kl_temperature"] < r["kl_init"]  # beyond any temperature
    assert r["neg_end"] < 0.01
    assert r["var_ratio"] >= 100
    assert 0.5 * BETA < r["var_on"] < 1.5 * BETA  # the target's bandwidth (init: ~1)


@pytest.mark.parametrize("name", kernel_fit.SUBSPACE_MECHANISMS)
def test_positive_features_recover_their_familys_kernel(name):
    r = _fit(name, "positive", "positive")
    print(r)
    assert r["kl_end"] <= r["kl_init"] / 10
    assert r["kl_end"] < r["kl_temperature"] < r["kl_init"]
    assert r["neg_end"] == 0.0
    assert r["var_ratio_mean"] >= 100 and r["var_ratio"] >= 40
    assert 0.5 * BETA < r["var_on"] < 1.5 * BETA


def test_subspace_command_runs_every_seed_and_tabulates(tmp_path, monkeypatch, capsys):
    """``python -m train.bench kernel_fit --target subspace``: one fit per mechanism and seed
    with the given steps and lr, the references beside each row, the table and the JSON.
    The fit and the references are stand-ins here (the real ones: the tests above)."""
    import json

    from train.bench.__main__ import build_parser

    fits = []

    def fake_fit(name, *, references, steps, seed, lr, features, family):
        fits.append((name, steps, seed, lr, references, features, family))
        return {"mechanism": name, "seed": seed, "kl_init": 0.09, "kl_end": 0.01 * (seed + 1),
                "neg_end": 0.0, "var_on": 3.0, "var_off": 0.3, "var_ratio": 10.0,
                "var_ratio_mean": 12.0}  # fmt: skip

    refs = {"kl_temperature": 0.05, "best_t": 2.5, "kl_gaussian": 0.018,
            "gaussian_on": 2.4, "gaussian_off": 0.25}  # fmt: skip
    monkeypatch.setattr(kernel_fit, "fit_subspace", fake_fit)
    monkeypatch.setattr(kernel_fit, "subspace_references", lambda **kw: refs)
    out = tmp_path / "fit.json"
    args = build_parser().parse_args(
        ["kernel_fit", "--target", "subspace", "--steps", "7", "--seeds", "2", "--lr", "0.02",
         "--features", "positive", "--family", "positive", "--out", str(out), "--quiet"]
    )  # fmt: skip
    result = kernel_fit.main_from_args(args)
    names = kernel_fit.SUBSPACE_MECHANISMS
    assert fits == [(n, 7, s, 0.02, False, "positive", "positive") for s in (0, 1) for n in names]
    assert [r["seed"] for r in result["rows"]] == [s for s in (0, 1) for _ in names]
    assert all(r["kl_gaussian"] == 0.018 for r in result["rows"])
    assert result["config"]["steps"] == 7 and result["config"]["seeds"] == 2
    assert result["config"]["lr"] == 0.02 and result["config"]["features"] == "positive"
    assert result["config"]["batch"] == 8 and result["config"]["beta"] == 3.0  # the defaults
    assert json.loads(out.read_text()) == result
    table = capsys.readouterr().out
    assert "positive features, M = 32, 7 Adam steps (lr 0.02, cosine-decayed)" in table
    assert "target exp(3.0 (Pq . Pk + |Pk|^2 / 2)) (the positive family)" in table
    assert f"| {names[0]} | 1 | 0.0900 | 0.0200 | 4.5 | 0.000% | 3 | 0.3 | 10 |" in table
    assert "0.0500 (t = 2.50) | 0.0180 (2.40, 0.250) | 12 |" in table
