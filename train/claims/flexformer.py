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
    mean_std,
)
from train.claims.stats import Rule

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
    rule="Not a comparison: unbiased when no weight's mean is more than 4.5 standard errors "
    "from the exact value (4096 weights: an unbiased estimator exceeds that somewhere with "
    "probability ~3%); the rate holds when the fitted log-log slope is within [-0.65, "
    "-0.35]. Reproduced when both hold, partly when one does, not reproduced otherwise.",
    compute="about 15 s",
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


#: fitted attention error: flexformer_n's below flexformer_s's
FITS_BETTER = Rule("less", margin=0.005, unit="relative error")


@claim(
    "flexformer.n_more_expressive",
    paper="Flexformer",
    statement="flexformer_n (non-stationary, Yaglom) is strictly more expressive than "
    "flexformer_s (stationary, Bochner), which contains the fixed softmax estimator.",
    experiment="`train.bench.kernel_fit`: fit each mechanism's kernel parameters to a target "
    "attention from a non-stationary kernel exp(q^ . W k^) at an equal feature budget (d = "
    "8, 16 features, 300 Adam steps); attention error on fresh draws, per seed. performer "
    "is shown beside as the fixed estimator (its projection is a fixed param, not fitted, "
    "so it takes no part in the verdict).",
    rule=FITS_BETTER.text("flexformer_n's fitted error", "flexformer_s's"),
    compute="about 1 min",
)
def n_more_expressive(settings: Settings) -> Finding:
    from train.bench import kernel_fit

    steps = 30 if settings.quick else 300
    d = 8  # kernel_fit.run's defaults: d = 8, budget 2 d, T = 32, batch 8, scale 0.5, warp 1
    r = jax.random.normal(jax.random.key(12345), (d, d))  # kernel_fit.run's target W
    w = jnp.eye(d) + r / jnp.sqrt(d)
    c = dict(budget=2 * d, w=w, batch=8, seq_len=32, head_dim=d, scale=0.5, steps=steps, lr=1e-2)
    errs = {}
    for name in ("flexformer_n", "flexformer_s", "performer"):
        errs[name] = [kernel_fit.fit_one(name, seed=s, **c)[1] for s in range(settings.seeds)]
    verdict, st = FITS_BETTER.decide(errs["flexformer_n"], errs["flexformer_s"])
    numbers = (
        "; ".join(f"{m} {mean_std(e)[0]:.3f} +- {mean_std(e)[1]:.3f}" for m, e in errs.items())
        + f"; n - s {FITS_BETTER.summary(st)}"
    )
    why = (
        "Per seed: "
        + "; ".join(f"{m} " + " / ".join(f"{x:.3f}" for x in e) for m, e in errs.items())
        + (
            " (a fit over 3x its family's median diverged under Adam at lr 1e-2). "
            if any(max(e) > 3 * float(np.median(e)) for e in errs.values())
            else ". "
        )
        + "Only the two learnable families are compared (v1 also counted s < performer, "
        "which held by construction: performer is never fitted). A larger budget, more "
        "steps or a target further from stationary could separate them."
    )
    return Finding(numbers, verdict, why, {"errors": errs, "stats": st})


#: sequence lengths of the efficiency claim (the last is Retrieval's 4000 bytes)
LENGTHS = (1000, 2000, 4000)


@claim(
    "flexformer.efficiency",
    paper="Flexformer",
    statement="On document retrieval, Flexformer trains 2.6x faster than the vanilla "
    "Transformer with 84% less memory, with linear time and memory.",
    experiment="One AdamW step of LRA's Retrieval model (dual encoder, embedding 128, 4 heads, "
    "MLP 512, 4 layers, batch 2; `train.bench.model`) at T = 1000, 2000, 4000 bytes per "
    "document, flexformer_n (128 frequencies) and softmax in the same run: step time (median "
    "of the calls after a warm-up) and XLA's compiled memory (temp + arguments + outputs); "
    "fitted exponents in T, and the ratios at T = 4000.",
    rule="Four checks, each a threshold on the measured values (timings are one run's "
    "medians, so no interval): speed-up at T = 4000 >= 2.6x; memory saved at T = 4000 >= "
    "84%; fitted exponent of flexformer_n's step time in T < 1.2; of its memory < 1.2. "
    "Reproduced when all hold, partly when some do, not reproduced when none does.",
    kind="train",
    compute="about 10 min (softmax's step at T = 4000 takes about 35 s here)",
)
def efficiency(settings: Settings) -> Finding:
    from train.bench import common
    from train.bench import model as bench_model

    shape = (
        dict(dim=32, heads=2, mlp=64, layers=1)
        if settings.quick
        else dict(dim=128, heads=4, mlp=512, layers=4)
    )
    lengths = (64, 128, 256) if settings.quick else LENGTHS
    names = ("softmax", "flexformer_n")
    time_ms = {n: {} for n in names}
    memory = {n: {} for n in names}
    for t in lengths:
        points = [
            bench_model.model_point(n, batch=2, repeats=2, min_total_s=60, seq_len=t, **shape)
            for n in names
        ]
        for p in points:
            time_ms[p["mechanism"]][t] = p["time_ms"]
            memory[p["mechanism"]][t] = common.total_memory(p)
        print(f"[flexformer.efficiency] T = {t}: " + ", ".join(
            f"{n} {time_ms[n][t]:.0f} ms" for n in names), flush=True)  # fmt: skip
    last = lengths[-1]
    speed = time_ms["softmax"][last] / time_ms["flexformer_n"][last]
    saved = 1.0 - memory["flexformer_n"][last] / memory["softmax"][last]
    exps = {
        f"{kind} {n}": fit_slope(list(v[n]), list(v[n].values()))
        for kind, v in (("time", time_ms), ("memory", memory))
        for n in names
    }
    checks = {
        "speed": speed >= 2.6,
        "memory": saved >= 0.84,
        "linear time": exps["time flexformer_n"] < 1.2,
        "linear memory": exps["memory flexformer_n"] < 1.2,
    }
    numbers = (
        f"at T = {last}: flexformer_n {speed:.2f}x faster, {100 * saved:.1f}% less memory; "
        "exponents in T: " + ", ".join(f"{k} {v:.2f}" for k, v in exps.items())
    )
    why = (
        f"Checks: {checks}. Step times (ms): {time_ms}; one run on a shared 2-core CPU (v1's "
        "single timing at T = 4000 gave 2.47x in one run and 5.01x in another); the seed's "
        "figures come from a GPU at batch 32."
    )
    data = {"time_ms": time_ms, "memory": memory, "exponents": exps, "checks": checks}
    return Finding(numbers, grade(*checks.values()), why, data)
