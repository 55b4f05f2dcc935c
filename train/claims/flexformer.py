"""Flexformer's claims (seed 000): the softmax estimator at init, flexformer_n's expressivity,
equal-budget accuracy (in `train.claims.table`), and the training cost at Retrieval's shape."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import linattn_jax as la
from train.claims import (
    Finding,
    Settings,
    claim,
    fit_slope,
    grade,
)

_D, _T, _SCALE = 16, 64, 0.5


def _qkv(seed: int, t: int = _T, d: int = _D, scale: float = _SCALE):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (
        scale * jax.random.normal(kq, (1, t, 1, d)),
        scale * jax.random.normal(kk, (1, t, 1, d)),
        jax.random.normal(kv, (1, t, 1, d)),
    )


def _softmax(q, k, v):
    logits = jnp.einsum("bihd,bjhd->bhij", q, k) / jnp.sqrt(q.shape[-1])
    return jnp.einsum("bhij,bjhd->bihd", jax.nn.softmax(logits, -1), v)


@claim(
    "flexformer.init_rate",
    paper="Flexformer",
    statement="The learnable family strictly contains the unbiased softmax estimator: at init "
    "flexformer_s is the random-Fourier-feature estimate of softmax attention (error ~ "
    "1/sqrt(M)).",
    experiment="flexformer_s at init (omega ~ N(0, I); qk_radius=None, the seed's map of the "
    "raw inputs), T = 64, d = 16, q, k ~ N(0, 0.5^2 I). (a) Bias: the mean over 400 draws of "
    "the unnormalised weight phi(q_i) . phi~(k_j) against exp(q.k / sqrt d - |q|^2 / (2 sqrt "
    "d)), as z-scores. (b) Rate: attention error against softmax for M = 16 ... 1024, "
    "log-log slope (the MC rate is -0.5).",
)
def init_rate(settings: Settings) -> Finding:
    draws = 40 if settings.quick else 400
    q, k, v = _qkv(0)
    mech = la.get("flexformer_s").bind(qk_radius=None, den_floor=0.0)
    fm = mech.feature_map
    qh, kh = q[0, :, 0] * _D**-0.25, k[0, :, 0] * _D**-0.25
    target = np.exp(qh @ kh.T - 0.5 * np.sum(qh * qh, -1, keepdims=True))

    @jax.jit
    def weights(rng):
        p = mech.bind(num_features=64).init(rng, num_heads=1, head_dim=_D)
        phi_q = fm.query(q, p)[0, :, 0]
        key = fm.key(k, p)
        return phi_q @ (key.phi[0, :, 0] * jnp.exp(key.log_scale[0, :, 0])[:, None]).T

    w = np.stack([np.asarray(weights(r)) for r in jax.random.split(jax.random.key(1), draws)])
    z = (w.mean(0) - target) / (w.std(0, ddof=1) / np.sqrt(draws))
    # 4096 z-scores of an unbiased estimator: |z| > 4.5 has probability ~3e-2 somewhere.
    unbiased = float(np.max(np.abs(z))) < 4.5

    sizes = [16, 64, 256] if settings.quick else [16, 64, 256, 1024]
    want = _softmax(q, k, v)
    errs = {}
    for m in sizes:
        e = []
        for s in range(settings.seeds):
            p = mech.bind(num_features=m).init(jax.random.key(100 + s), num_heads=1, head_dim=_D)
            out = mech.bind(num_features=m).attention(q, k, v, p)
            e.append(float(jnp.linalg.norm(out - want) / jnp.linalg.norm(want)))
        errs[m] = float(np.mean(e))
    slope = fit_slope(errs, errs.values())
    rate = -0.65 < slope < -0.35
    verdict = grade(unbiased, rate)
    numbers = (
        f"bias: max |z| {np.max(np.abs(z)):.2f} over {z.size} weights ({draws} draws), mean z "
        f"{z.mean():+.3f}; error at M = "
        + ", ".join(f"{m}: {e:.3f}" for m, e in errs.items())
        + f"; slope {slope:.2f}"
    )
    why = (
        "Unbiased when no weight's mean is more than 4.5 standard errors from the exact value "
        "(4096 weights: an unbiased estimator exceeds that somewhere with probability ~3%); "
        "the rate is reproduced when the fitted log-log slope of the attention error is "
        "within [-0.65, -0.35] around the Monte-Carlo -0.5 (mean over the seeds' draws). "
        "The library's default (qk_radius=1) estimates the "
        "softmax kernel of the normalised q, k instead; this claim is about the seed's raw map."
    )
    return Finding(numbers, verdict, why, {"z_max": float(np.max(np.abs(z))), "errors": errs})


@claim(
    "flexformer.n_more_expressive",
    paper="Flexformer",
    statement="flexformer_n (non-stationary, Yaglom) is strictly more expressive than "
    "flexformer_s (stationary, Bochner), which contains the fixed softmax estimator.",
    experiment="`python -m train.bench kernel_fit`: fit each mechanism's kernel parameters "
    "to a target attention from a non-stationary kernel exp(q^ . W k^) at an equal feature "
    "budget (d = 8, 16 features, 300 Adam steps); attention error on fresh draws, mean +- std "
    "over seeds. Predicted order: n < s < performer.",
)
def n_more_expressive(settings: Settings) -> Finding:
    from train.bench import kernel_fit

    steps = 30 if settings.quick else 300
    result = kernel_fit.run(seeds=settings.seeds, steps=steps)
    rows = {r["mechanism"]: r for r in result["rows"]}
    n, s, p = (rows[m] for m in ("flexformer_n", "flexformer_s", "performer"))

    def apart(a, b):  # a below b by more than their spreads combined
        return a["fitted"] + a["fitted_std"] < b["fitted"] - b["fitted_std"]

    n_lt_s, s_lt_p = apart(n, s), apart(s, p)
    verdict = grade(n_lt_s, s_lt_p)
    numbers = "; ".join(f"{m} {r['fitted']:.3f} +- {r['fitted_std']:.3f}" for m, r in rows.items())
    why = (
        "An order counts when the means differ by more than the two standard deviations "
        f"combined over {settings.seeds} seeds. n < s: {n_lt_s}; s < performer: {s_lt_p}. "
        "At this budget both flexformers fit the target about equally: the pair's extra "
        "freedom is not used by 300 steps of Adam from the near-tied init. A larger budget, "
        "more steps or a target further from stationary could separate them."
        if not n_lt_s
        else "Both orders hold at this budget."
    )
    return Finding(numbers, verdict, why, {"rows": result["rows"]})


@claim(
    "flexformer.efficiency",
    paper="Flexformer",
    statement="On document retrieval, Flexformer trains 2.6x faster than the vanilla "
    "Transformer with 84% less memory, with linear time and memory.",
    experiment="One AdamW step of LRA's Retrieval model (dual encoder, embedding 128, 4 heads, "
    "MLP 512, 4 layers, 4000 bytes per document, batch 2; `train.bench.model`), every O(T) "
    "mechanism at its defaults (flexformer: 128 frequencies) against softmax in the same run: "
    "step-time speed-up and XLA's compiled memory (temp + arguments + outputs).",
    kind="train",
)
def efficiency(settings: Settings) -> Finding:
    from train.bench import common
    from train.bench import model as bench_model

    shape = (
        dict(seq_len=128, dim=32, heads=2, mlp=64, layers=1)
        if settings.quick
        else dict(seq_len=4000, dim=128, heads=4, mlp=512, layers=4)
    )
    names = ["softmax"] + [n for n in la.names() if not common.is_quadratic(n)]
    points = []
    for n in names:
        try:
            # min_total_s=60: every step (softmax's takes about a minute here) is timed after
            # its warm-up call, which pays the first touch of its memory.
            points.append(bench_model.model_point(n, batch=2, repeats=2, min_total_s=60, **shape))
        except Exception as e:  # noqa: BLE001 -- one failing mechanism must not end the run
            points.append({"mechanism": n, "status": "error", "note": f"{type(e).__name__}: {e}"})
        print(
            f"[flexformer.efficiency] {n}: {points[-1].get('time_ms') or points[-1]['status']}",
            flush=True,
        )
    points = {p["mechanism"]: p for p in bench_model.model_ratios(points)}
    rows = {
        n: (1.0 / p["ratio_time"], 1.0 - p["ratio_memory"])
        for n, p in points.items()
        if n != "softmax" and p.get("ratio_time") and p.get("ratio_memory")
    }
    speed, saved = rows["flexformer_n"]
    fast, lean = speed >= 2.6, saved >= 0.84
    verdict = grade(fast, lean)
    numbers = "; ".join(
        f"{n} {s:.2f}x faster, {100 * m:.0f}% less memory" for n, (s, m) in rows.items()
    )
    ref, flex = points["softmax"], points["flexformer_n"]
    gib = 2**30
    why = (
        f"flexformer_n: {speed:.2f}x softmax's speed (claim 2.6x) and {100 * saved:.1f}% less "
        f"memory (claim 84%): step {flex['time_ms'] / 1e3:.1f} s against "
        f"{ref['time_ms'] / 1e3:.1f} s (median of the calls after a warm-up call), XLA's "
        f"compiled total {common.total_memory(flex) / gib:.2f} against "
        f"{common.total_memory(ref) / gib:.2f} GiB. Almost all of it is temp (activations "
        f"kept for the backward pass): {ref['memory']['temp'] / gib:.2f} GiB for softmax, whose "
        f"arguments (weights, AdamW state, inputs) are {ref['memory']['argument'] / gib:.3f} "
        f"GiB; temp alone, flexformer_n uses "
        f"{100 * (1 - flex['memory']['temp'] / ref['memory']['temp']):.1f}% less. It is the "
        "slowest O(T) mechanism here: its 128 frequencies give each head 256 cos/sin features "
        "(from two projections, Omega1 and Omega2) where linear_elu has the head dimension, "
        "32. One run on a shared 2-core CPU; the seed's figures come from a GPU at batch 32."
    )
    return Finding(numbers, verdict, why, {"points": list(points.values())})
