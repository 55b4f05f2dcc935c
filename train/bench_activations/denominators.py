"""The ``denominators`` section of `train.bench_activations` (stable features)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import linattn_jax as la
from train.bench_activations.common import TINY, train_and_capture, workload_config, workload_data

#: flexformer's default relative denominator floor (the remedy this section checks)
DEN_FLOOR = la.get("flexformer_n").defaults["den_floor"]
_DENOM_WORKLOADS = (("listops", "mini"), ("vit", "mini"), ("lm", "mini"))


# ---------------------------------------------------------------------------- denominators
def weight_rows(name: str, params, q, k, *, mask=None, causal=False, config=()):
    """``(den, l1, bound)``, each ``[B, H, T]`` float32, of mechanism `name` on q, k.

    ``den_i = sum_j a_ij`` with ``a_ij = phi(q_i) . phi(k_j) exp(s_j - c_i)`` over the unmasked
    keys (``j <= i`` when causal), the features and key log-scales s from ``la.get(name)
    .feature_map`` (without its mass channel), c the core's stabiliser (the max of s over the
    visible keys); ``l1_i = sum_j |a_ij|`` (``l1 / |den|`` is the l1 norm of the normalised
    weight row: 1 for positive features); ``bound_i = |phi(q_i)| sum_j |phi(k_j)| exp(s_j -
    c_i) >= l1_i``, the quantity the core's relative floor scales (`linattn_jax.core`).
    Deterministic features; `config`: ``(key, value)`` pairs for the feature map.
    """
    config = dict(config)
    fm = la.get(name).feature_map
    params = fm.resolve(params, deterministic=True, **config)
    phi_q = fm.query(q, params, **config).astype(jnp.float32)
    keys = fm.key(k, params, **config)
    phi_k = keys.phi.astype(jnp.float32)
    if fm.den_floor(**config):  # drop the mass channel: the bound is recomputed below
        phi_q, phi_k = phi_q[..., :-1], phi_k[..., :-1]
    a = jnp.einsum("bihm,bjhm->bhij", phi_q, phi_k)
    b, t = k.shape[:2]
    s = jnp.zeros((b, t, a.shape[1]), jnp.float32) if keys.log_scale is None else keys.log_scale
    s = jnp.swapaxes(s.astype(jnp.float32), 1, 2)[:, :, None, :]  # [B, H, 1, Tk]
    visible = jnp.ones((b, 1, a.shape[2], t), bool)
    if mask is not None:
        visible = visible & mask[:, None, None, :]
    if causal:
        visible = visible & jnp.tril(jnp.ones((a.shape[2], t), bool))[None, None]
    s = jnp.where(visible, s, -jnp.inf)
    c = jnp.max(s, axis=-1, keepdims=True)
    w = jnp.where(visible, jnp.exp(s - jnp.where(jnp.isfinite(c), c, 0.0)), 0.0)
    norm_q = jnp.linalg.norm(phi_q, axis=-1).transpose(0, 2, 1)  # [B, H, Tq]
    norm_k = jnp.linalg.norm(phi_k, axis=-1).transpose(0, 2, 1)[:, :, None, :]
    return (
        jnp.sum(a * w, axis=-1),
        jnp.sum(jnp.abs(a) * w, axis=-1),
        norm_q * jnp.sum(norm_k * w, axis=-1),
    )


def denominators(name: str, params, q, k, *, mask=None, causal=False, config=()):
    """The linear-attention denominators ``[B, H, T]`` float32 (`weight_rows`' ``den``)."""
    return weight_rows(name, params, q, k, mask=mask, causal=causal, config=config)[0]


def denominator_fractions(dens, row_masks):
    """``(fraction negative, fraction tiny)`` over the valid rows of every layer; tiny is
    ``|den| < TINY * median |den|`` of the layer."""
    neg = tiny = total = 0
    for den, rows in zip(dens, row_masks, strict=True):
        den = np.asarray(den)
        rows = np.broadcast_to(np.asarray(rows)[:, None, :], den.shape)
        vals = den[rows]
        med = np.median(np.abs(vals))
        neg += int(np.sum(vals < 0))
        tiny += int(np.sum(np.abs(vals) < TINY * med))
        total += vals.size
    return neg / total, tiny / total


def floor_stats(stats, row_masks, gamma: float):
    """``(fraction floored, max row l1 with the floor, max row l1 without)`` over the valid
    rows of every layer, from `weight_rows` triples: a row is floored when ``|den| < gamma
    bound``; its weights' l1 norm is ``l1 / max(|den|, gamma bound)`` (<= 1 / gamma)."""
    floored = total = 0
    worst, worst_raw = 0.0, 0.0
    for (den, l1, bound), rows in zip(stats, row_masks, strict=True):
        den, l1, bound = (np.asarray(x, np.float64) for x in (den, l1, bound))
        rows = np.broadcast_to(np.asarray(rows)[:, None, :], den.shape)
        den, l1, bound = den[rows], l1[rows], bound[rows]
        low = np.abs(den) < gamma * bound
        floored += int(np.sum(low))
        total += den.size
        worst = max(worst, float(np.max(l1 / np.maximum(np.abs(den), gamma * bound))))
        worst_raw = max(worst_raw, float(np.max(l1 / np.maximum(np.abs(den), 1e-30))))
    return floored / total, worst, worst_raw


#: the trigonometric map, whose denominators this section checks (flexformer_n's default
#: features are positive: positive denominators by construction)
TRIG = (("features", "trig"),)
_COLUMNS = {  # column: (mechanism, params: the layer's own or a fresh init, config)
    "flexformer_s": ("flexformer_s", None, TRIG),
    "flexformer_n": ("flexformer_n", "own", TRIG),
    "flexformer_n raw": ("flexformer_n", "own", (*TRIG, ("qk_radius", None), ("den_floor", 0.0))),
    "performer": ("performer", None, ()),
}


def denominator_rows(captures, *, flex_features: int, rng_seed: int = 0):
    """``{(mode, dtype): {column: (neg, tiny, floored, max l1, max l1 without floor)}}``
    for the comparison columns (`_COLUMNS`); floored and the l1 norms at flexformer's
    default ``den_floor`` (also for the columns that do not use it)."""
    h, d = captures[0].q.shape[2:]
    key = jax.random.key(rng_seed)
    fresh = {
        "flexformer_s": la.get("flexformer_s").init(
            key, num_heads=h, head_dim=d, num_features=flex_features
        ),
        "performer": la.get("performer").init(
            key, num_heads=h, head_dim=d, num_features=2 * flex_features
        ),
    }
    rows_fn = jax.jit(weight_rows, static_argnames=("name", "causal", "config"))
    out = {}
    for causal in (False, True):
        for dtype in (jnp.float32, jnp.bfloat16):
            row = {}
            for col, (name, which, cfg) in _COLUMNS.items():
                stats, masks = [], []
                for cap in captures:
                    p = cap.params if which == "own" else fresh[name]
                    q, k = cap.q.astype(dtype), cap.k.astype(dtype)
                    stats.append(rows_fn(name, p, q, k, mask=cap.mask, causal=causal, config=cfg))
                    b, t = q.shape[:2]
                    masks.append(np.ones((b, t), bool) if cap.mask is None else cap.mask)
                neg, tiny = denominator_fractions([x[0] for x in stats], masks)
                row[col] = (neg, tiny, *floor_stats(stats, masks, DEN_FLOOR))
            mode = "causal" if causal else "non-causal"
            out[(mode, jnp.dtype(dtype).name)] = row
    return out


def denominator_section(steps: int, examples: int, train_den_floor=None) -> tuple[str, bool]:
    """The markdown table and whether the default map kept every weight row's l1 norm
    within ``1 / den_floor`` with no row floored at init; `train_den_floor` overrides the
    ``den_floor`` of the trained models (the table always evaluates the default)."""
    trained = "" if train_den_floor is None else f" with den_floor={train_den_floor:g}"
    lines = [
        f"Denominators on real activations; model trained with flexformer_n{trained} (M = "
        "num_features). neg % / floored %: negative denominators / rows with |den| < "
        f"den_floor x bound (den_floor = {DEN_FLOOR:g}); l1: max over rows of the l1 norm of "
        "the normalised weight row (1 for positive features), with the floor / without it; "
        "flexformer_n raw = the seed's map (qk_radius=None, no floor); performer tiny % = "
        f"|den| < {TINY:g} x the layer's median",
        "",
        "| workload | stage | mode | inputs | flexformer_n neg % / floored % | flexformer_n "
        "max l1 (floor / none) | flexformer_s neg % / floored % | flexformer_n raw neg % | "
        "performer tiny % |",
        "|---" * 9 + "|",
    ]
    bounded, init_clean = True, True
    for task, preset in _DENOM_WORKLOADS:
        config = workload_config(task, preset, "flexformer_n")
        config.attention_config = {**config.attention_config, **dict(TRIG)}
        if train_den_floor is not None:
            config.attention_config = {**config.attention_config, "den_floor": train_den_floor}
        m = int(config.attention_config.get("num_features", 128))
        before, after, losses = train_and_capture(config, steps, examples, workload_data(config))
        for stage, caps in (("init", before), (f"step {steps}", after)):
            for (mode, dtype), row in denominator_rows(caps, flex_features=m).items():
                n_neg, _, n_fl, n_l1, n_raw = row["flexformer_n"]
                s_neg, _, s_fl, _, _ = row["flexformer_s"]
                bounded = bounded and n_l1 <= (1 + 1e-4) / DEN_FLOOR
                if stage == "init" and mode == "non-causal":
                    init_clean = init_clean and n_fl == 0.0
                lines.append(
                    f"| {task} {preset} | {stage} | {mode} | {dtype} | {100 * n_neg:.1f} / "
                    f"{100 * n_fl:.2f} | {n_l1:.3g} / {n_raw:.3g} | {100 * s_neg:.1f} / "
                    f"{100 * s_fl:.2f} | {100 * row['flexformer_n raw'][0]:.1f} | "
                    f"{100 * row['performer'][1]:.1f} |"
                )
        print(f"  {task} {preset}: train loss {losses[0]:.3f} -> {losses[-1]:.3f}", flush=True)
    lines += [
        "",
        f"flexformer_n's weight rows {'stay' if bounded else 'do NOT stay'} within l1 <= "
        f"1 / den_floor = {1 / DEN_FLOOR:g} everywhere; at init (non-causal) "
        + ("no row is floored." if init_clean else "SOME rows are floored."),
    ]
    return "\n".join(lines), bounded and init_clean
