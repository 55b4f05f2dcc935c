"""The ``denominators`` section of `train.bench_activations` (issue 19, stable features)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import linattn_jax as la
from train.bench_activations.common import TINY, train_and_capture, workload_config, workload_data

#: flexformer's default q, k radius (the remedy this section checks)
QK_RADIUS = la.get("flexformer_n").defaults["qk_radius"]
_DENOM_WORKLOADS = (("listops", "mini"), ("vit", "mini"), ("lm", "mini"))


# ---------------------------------------------------------------------------- denominators
def denominators(name: str, params, q, k, *, mask=None, causal=False, config=()):
    """The linear-attention denominators ``[B, H, T]`` float32 of mechanism `name` on q, k.

    ``den_i = sum_j phi(q_i) . phi(k_j) exp(s_j - c_i)`` over the unmasked keys (``j <= i``
    when causal), the features and key log-scales s from ``la.get(name).feature_map``, c
    the core's stabiliser (the max of s over the visible keys). Deterministic features;
    `config`: ``(key, value)`` pairs for the feature map (e.g. ``(("qk_radius", None),)``).
    """
    config = dict(config)
    fm = la.get(name).feature_map
    params = fm.resolve(params, deterministic=True, **config)
    phi_q = fm.query(q, params, **config)
    keys = fm.key(k, params, **config)
    a = jnp.einsum("bihm,bjhm->bhij", phi_q, keys.phi.astype(jnp.float32))
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
    w = jnp.where(visible, a * jnp.exp(s - jnp.where(jnp.isfinite(c), c, 0.0)), 0.0)
    return jnp.sum(w, axis=-1)


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


def denominator_rows(captures, *, flex_features: int, rng_seed: int = 0):
    """``{(mode, dtype): {column: (neg, tiny)}}`` for the comparison columns."""
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
    columns = {
        "flexformer_s": ("flexformer_s", None, ()),
        "flexformer_n": ("flexformer_n", "own", ()),
        "flexformer_n raw": ("flexformer_n", "own", (("qk_radius", None),)),
        "performer": ("performer", None, ()),
    }
    den_fn = jax.jit(denominators, static_argnames=("name", "causal", "config"))
    out = {}
    for causal in (False, True):
        for dtype in (jnp.float32, jnp.bfloat16):
            row = {}
            for col, (name, which, cfg) in columns.items():
                dens, masks = [], []
                for cap in captures:
                    p = cap.params if which == "own" else fresh[name]
                    q, k = cap.q.astype(dtype), cap.k.astype(dtype)
                    dens.append(den_fn(name, p, q, k, mask=cap.mask, causal=causal, config=cfg))
                    b, t = q.shape[:2]
                    masks.append(np.ones((b, t), bool) if cap.mask is None else cap.mask)
                row[col] = denominator_fractions(dens, masks)
            mode = "causal" if causal else "non-causal"
            out[(mode, jnp.dtype(dtype).name)] = row
    return out


def denominator_section(steps: int, examples: int) -> tuple[str, bool]:
    """The markdown table and whether the default map had no negative or tiny denominator."""
    cols = ("flexformer_s", "flexformer_n", "flexformer_n raw", "performer")
    lines = [
        f"Denominators on real activations (negative % / tiny %, tiny = |den| < {TINY:g} x "
        "median); model trained with flexformer_n; flexformer_n raw = qk_radius=None",
        "",
        "| workload | stage | mode | inputs | " + " | ".join(cols) + " |",
        "|---" * (4 + len(cols)) + "|",
    ]
    holds = True
    for task, preset in _DENOM_WORKLOADS:
        config = workload_config(task, preset, "flexformer_n")
        m = int(config.attention_config.get("num_features", 128))
        before, after, losses = train_and_capture(config, steps, examples, workload_data(config))
        for stage, caps in (("init", before), (f"step {steps}", after)):
            for (mode, dtype), row in denominator_rows(caps, flex_features=m).items():
                for col in ("flexformer_s", "flexformer_n"):
                    holds = holds and row[col] == (0.0, 0.0)
                cells = " | ".join(f"{100 * n:.1f} / {100 * t:.1f}" for n, t in row.values())
                lines.append(f"| {task} {preset} | {stage} | {mode} | {dtype} | {cells} |")
        print(f"  {task} {preset}: train loss {losses[0]:.3f} -> {losses[-1]:.3f}", flush=True)
    verdict = "holds" if holds else "does NOT hold"
    lines += [
        "",
        f"The remedy (qk_radius={QK_RADIUS:g}) {verdict} on all of these: "
        + (
            "no negative and no tiny denominator for flexformer_s and flexformer_n."
            if holds
            else "some flexformer_s / flexformer_n denominator above is negative or tiny."
        ),
    ]
    return "\n".join(lines), holds
