"""RA / LARA's claims (seed 004): RA is unbiased; LARA's error falls with samples and beats
performer's at an equal budget (LARA against performer in training is in `train.claims.table`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import linattn_jax as la
from train.claims import (
    NOT_REPRODUCED,
    PARTLY,
    REPRODUCED,
    Finding,
    Settings,
    claim,
    fit_slope,
    grade,
)

_T, _D = 32, 8


def _inputs(seed: int, clustered: bool = False):
    """q, k, v ``[1, T, 1, d]``; clustered: 4 cluster centres of norm ~2 plus noise 0.3."""
    kq, kk, kv, kc, ka = jax.random.split(jax.random.key(seed), 5)
    if clustered:
        centres = 2.0 * jax.random.normal(kc, (4, _D)) / np.sqrt(_D)  # norm ~2
        assign = jax.random.randint(ka, (2, _T), 0, 4)
        q = centres[assign[0]] + 0.3 * jax.random.normal(kq, (_T, _D))
        k = centres[assign[1]] + 0.3 * jax.random.normal(kk, (_T, _D))
        q, k = q[None, :, None], k[None, :, None]
    else:
        q = jax.random.normal(kq, (1, _T, 1, _D))
        k = jax.random.normal(kk, (1, _T, 1, _D))
    return q, k, jax.random.normal(kv, (1, _T, 1, _D))


def _softmax(q, k, v):
    logits = jnp.einsum("bihd,bjhd->bhij", q, k) / jnp.sqrt(q.shape[-1])
    return jnp.einsum("bhij,bjhd->bihd", jax.nn.softmax(logits, -1), v)


def _rel(out, want):
    return float(jnp.linalg.norm(out - want) / jnp.linalg.norm(want))


@claim(
    "ra.unbiased",
    paper="RA / LARA",
    statement="Randomized attention (RA) is an unbiased estimator of the whole softmax attention.",
    experiment="`ra` (num_samples = 1) on q, k, v ~ N(0, I), T = 32, d = 8: the mean of N "
    "independent draws against exact softmax attention, as z-scores per output entry, and "
    "the error of the mean for N = 16, 256, 4096 (the MC rate is a slope of -0.5).",
)
def ra_unbiased(settings: Settings) -> Finding:
    n = 1024 if settings.quick else 4096
    q, k, v = _inputs(0)
    mech = la.get("ra").bind(num_samples=1)
    params = mech.init(jax.random.key(0), num_heads=1, head_dim=_D)
    draw = jax.jit(jax.vmap(lambda r: mech.attention(q, k, v, params, r)[0, :, 0]))
    outs = np.asarray(draw(jax.random.split(jax.random.key(1), n)), np.float64)
    want = np.asarray(_softmax(q, k, v)[0, :, 0], np.float64)
    z = (outs.mean(0) - want) / (outs.std(0, ddof=1) / np.sqrt(n))
    sizes = [16, 64, 256, 1024] if settings.quick else [16, 256, 4096]
    errs = {s: float(np.sqrt(np.mean((outs[:s].mean(0) - want) ** 2))) for s in sizes}
    slope = fit_slope(errs, errs.values())
    unbiased = float(np.max(np.abs(z))) < 4.5
    rate = -0.65 < slope < -0.35
    verdict = grade(unbiased, rate)
    numbers = (
        f"max |z| {np.max(np.abs(z)):.2f} over {z.size} entries ({n} draws); RMS error of the "
        "mean at N = "
        + ", ".join(f"{s}: {e:.4f}" for s, e in errs.items())
        + f"; slope {slope:.2f}"
    )
    why = (
        "Unbiased when no entry of the mean is more than 4.5 standard errors from softmax "
        "attention (256 entries: an unbiased estimator exceeds that with probability ~2e-3), "
        "and the error of the mean falls at the Monte-Carlo rate (slope within [-0.65, -0.35]). "
        "This is our RA, which samples the paper's proposal exactly; the official code's added "
        "noise makes it biased (see the ra docstring)."
    )
    return Finding(numbers, verdict, why, {"z_max": float(np.max(np.abs(z))), "errors": errs})


@claim(
    "lara.error_vs_samples",
    paper="RA / LARA",
    statement="LARA's approximation improves with more samples and is more accurate than "
    "performer's random features at an equal budget.",
    experiment="Attention error against softmax (T = 32, d = 8, Gaussian and clustered "
    "inputs, mean over seeds): lara with C = 4 proposals and S = 1, 4, 16 samples each "
    "(noise_scale = 1, the paper's sampler; and the default d^-1/4) against performer with "
    "M = C S features.",
)
def lara_error_vs_samples(settings: Settings) -> Finding:
    samples = (1, 4, 16)
    runs = 2 if settings.quick else 8
    res = {}
    for clustered in (False, True):
        for label, name, cfg in (
            ("lara", "lara", {"noise_scale": 1.0}),
            ("lara (default noise)", "lara", {}),
            ("performer", "performer", {}),
        ):
            errs = {}
            for s in samples:
                budget = (
                    {"num_samples": s, "num_landmarks": 4}
                    if name == "lara"
                    else {"num_features": 4 * s}
                )
                mech = la.get(name).bind(**cfg, **budget)
                e = []
                for seed in range(settings.seeds):
                    q, k, v = _inputs(seed, clustered)
                    params = mech.init(jax.random.key(seed), num_heads=1, head_dim=_D)
                    want = _softmax(q, k, v)
                    e += [
                        _rel(mech.attention(q, k, v, params, r), want)
                        for r in jax.random.split(jax.random.key(100 + seed), runs)
                    ]
                errs[s] = float(np.mean(e))
            res[("clustered" if clustered else "gaussian", label)] = errs
    falls = all(res[(inp, "lara")][16] < res[(inp, "lara")][1] for inp in ("gaussian", "clustered"))
    beats = {
        inp: sum(res[(inp, "lara")][s] < res[(inp, "performer")][s] for s in samples)
        for inp in ("gaussian", "clustered")
    }
    beats_all = all(b == len(samples) for b in beats.values())
    verdict = (
        REPRODUCED
        if falls and beats_all
        else PARTLY
        if falls or any(beats.values())
        else (NOT_REPRODUCED)
    )
    numbers = (
        "; ".join(
            f"{inp} {label}: " + "/".join(f"{e:.3f}" for e in errs.values())
            for (inp, label), errs in res.items()
        )
        + f" (S = {'/'.join(map(str, samples))}, performer M = 4 S)"
    )
    why = (
        "Falls: lara's error at S = 16 is below its error at S = 1 on both inputs. Beats: "
        f"lara below performer at equal budget at {beats} of {len(samples)} budgets (gaussian, "
        "clustered). With the official noise d^-1/4 (our default, chosen by accuracy) the error "
        "stops falling with S: that sampler is not consistent."
    )
    return Finding(numbers, verdict, why, {"errors": {f"{a}|{b}": e for (a, b), e in res.items()}})
