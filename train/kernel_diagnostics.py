"""Kernel diagnostics while training: is the learnable attention kernel learning?

For a mechanism with learnable params (the ``mechanism`` subtree of every attention layer:
the flexformers, rfa, hedgehog, laplacian, lara with learned proposals), `KernelDiagnostics`
computes, every ``log_every`` steps, on a small fixed probe batch (the first
``PROBE_ROWS`` rows of the first training batch) and outside the jitted train step
(its own jitted function, compiled once), these ``kernel/...`` entries of the train rows of
``metrics.jsonl`` (and TensorBoard):

- ``kernel/freq_norm_ratio``: the learned frequencies' mean row norm over its init (leaves
  named ``omega*``: the flexformers);
- ``kernel/freq_move``: how far the frequencies moved, ``|omega - omega_0|_F / |omega_0|_F``
  over all of a layer's ``omega*`` leaves together (Frobenius), averaged over layers: 0 at
  init. Unlike the norm ratio it sees a kernel that rotates (frequencies that turn without
  growing); both are invariant to a constant storage scale (``omega = c omega_tilde``);
- ``kernel/scale_ratio``: the learned temperature scale ``a`` over its init, per head then
  averaged (flexformer_s: ``exp(log_scale)``; flexformer_n: ``exp(-tau / 2)``, the tie of
  ``linattn_jax.flexformer``; rfa: ``mean |sigma|``);
- ``kernel/bandwidth_ratio`` (flexformers with ``learn_bandwidth``): the typical factor by
  which a dimension's learned bandwidth moved, ``exp(mean |log b - log b_init|)`` over heads
  and dimensions (1 unmoved; 1.1 a 10% move either way);
- ``kernel/attn_tv``: how far the attention moved because the kernel did: the mean total
  variation ``1/2 sum_j |w_ij - w0_ij|`` between each attention row under the current
  mechanism params (``w``) and under their init values (``w0``), everything else (the
  model's q, k, v) current, over the probe's visible pairs; averaged over the rows with a
  visible key, heads and layers (`attention_tv`). 0 at init (to rounding), 1 for rows of
  disjoint supports (rows with negative weights: half their l1 distance, which can exceed 1);
- ``kernel/neg_weight_frac``: the share of negative normalised attention weights over the
  probe's visible (query, key) pairs, every layer;
- ``kernel/entropy_ratio``: the attention rows' entropy over the uniform row's ``log n``
  (``n`` visible keys; rows of ``|w| / sum |w|``), averaged over rows and layers: 1 is a
  flat kernel, softmax-like sharp rows are well below;
- ``kernel/shift_gap`` (flexformer_n: params with its frequency pair): the shift-invariance
  gap of its trigonometric kernel, the frequency pairs' Yaglom kernel whatever the feature
  kind (`linattn_jax.flexformer.shift_invariance_gap`'s definition, computed through the
  feature map), on the probe's first 16 queries and keys rescaled to ``|x d^(-1/4)| = 1``,
  under 8 fixed Gaussian shifts: 0 stationary, growing as the pairs separate.

The weights are read generically: every mechanism's output is linear in ``v``, so calling
it with ``v`` = the identity over keys returns its normalised weights ``[B, Tq, H, Tk]``.
The queries and keys are the model's own (`train.distill.capture.capture_attention`).
`plot_kernel` draws the entries against the step (``kernel.png`` beside ``curves.png``).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import linattn_jax as la
from train import metrics as metrics_lib
from train.distill.capture import capture_attention

log = logging.getLogger(__name__)

#: flexformer_n's stored frequency pair (its params' names): the shift gap is computed where
#: a call's params hold it (decided by the params, not the mechanism's name, so a renamed
#: copy logs it too)
NONSTATIONARY_KEYS = ("omega1_tilde", "omega2_tilde")

PROBE_ROWS = 2  # examples in the probe batch
GAP_TOKENS = 16  # queries / keys the shift gap uses
GAP_SHIFTS = 8
PREFIX = "kernel/"


def _mechanism_params(tree, path):
    node = tree
    for name in (*path, "mechanism"):
        if not isinstance(node, dict) or name not in node:
            return {}
        node = node[name]
    return dict(node)


def _weights(mech, call, params):
    """Normalised weights ``[B, H, Tq, Tk]`` float32 of one attention call."""
    t_k = call.k.shape[1]
    b, h = call.k.shape[0], call.k.shape[2]
    eye = jnp.broadcast_to(jnp.eye(t_k, dtype=call.q.dtype)[None, :, None, :], (b, t_k, h, t_k))
    out = mech.attention(
        call.q, call.k, eye, params, None, mask=call.mask, causal=call.causal, deterministic=True
    )
    return jnp.transpose(out.astype(jnp.float32), (0, 2, 1, 3))


def _visible(call, shape):
    """Bool ``[B, 1, Tq, Tk]``: the (query, key) pairs attention may use."""
    b, _, tq, tk = shape
    vis = jnp.ones((b, 1, tq, tk), bool)
    if call.mask is not None:
        m = jnp.asarray(call.mask, bool)
        vis = vis & m[:, None, None, :tk] & m[:, None, :tq, None]
    if call.causal:
        vis = vis & jnp.tril(jnp.ones((tq, tk), bool))[None, None]
    return vis


def weight_stats(w, visible):
    """``(neg_weight_frac, entropy_ratio)`` of weights `w` ``[B, H, Tq, Tk]`` over the
    `visible` pairs (rows with fewer than 2 visible keys are left out of the entropy)."""
    vis = jnp.broadcast_to(visible, w.shape)
    neg = jnp.sum((w < 0) & vis) / jnp.maximum(jnp.sum(vis), 1)
    a = jnp.where(vis, jnp.abs(w), 0.0)
    p = a / jnp.maximum(jnp.sum(a, -1, keepdims=True), 1e-30)
    ent = -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0), -1)
    n = jnp.sum(vis, -1)
    rows = n > 1
    ratio = jnp.where(rows, ent / jnp.log(jnp.maximum(n, 2)), 0.0)
    return neg, jnp.sum(ratio) / jnp.maximum(jnp.sum(rows), 1)


def attention_tv(w, w0, visible):
    """The mean total variation ``1/2 sum_j |w_ij - w0_ij|`` between the rows of `w` and `w0`
    ``[B, H, Tq, Tk]`` over the `visible` pairs, averaged over the rows with a visible key."""
    vis = jnp.broadcast_to(visible, w.shape)
    tv = 0.5 * jnp.sum(jnp.where(vis, jnp.abs(w - w0), 0.0), -1)
    rows = jnp.any(vis, -1)
    return jnp.sum(jnp.where(rows, tv, 0.0)) / jnp.maximum(jnp.sum(rows), 1)


def _shift_gap(fmap, params, call, shifts):
    """`linattn_jax.flexformer.shift_invariance_gap` through the feature map (the query
    features of the raw map are the trigonometric features)."""

    def unit(x):
        x = x[:1, :GAP_TOKENS].astype(jnp.float32)
        return x / jnp.linalg.norm(x, axis=-1, keepdims=True) * x.shape[-1] ** 0.25

    x, y = unit(call.q), unit(call.k)

    def trig(z):  # the frequencies' trigonometric kernel, whatever the feature kind
        return fmap.query(z, params, qk_radius=None, den_floor=0.0, features="trig")

    ks = jnp.stack([jnp.einsum("bihm,bjhm->bhij", trig(x + s), trig(y + s)) for s in shifts])
    return jnp.sum(jnp.var(ks, axis=0)) / jnp.sum(jnp.mean(ks * ks, axis=0))


def _freq_norm(mparams):
    norms = [
        jnp.mean(jnp.linalg.norm(x.astype(jnp.float32), axis=-1))
        for k, x in sorted(mparams.items())
        if k.startswith("omega")
    ]
    return jnp.mean(jnp.stack(norms)) if norms else None


def _freq_move(mparams, mparams0):
    """``|omega - omega_0|_F / |omega_0|_F`` over all ``omega*`` leaves of one layer, or
    None when it has none."""
    keys = sorted(k for k in mparams if k.startswith("omega"))
    if not keys:
        return None
    diff = sum(jnp.sum(jnp.square((mparams[k] - mparams0[k]).astype(jnp.float32))) for k in keys)
    ref = sum(jnp.sum(jnp.square(mparams0[k].astype(jnp.float32))) for k in keys)
    return jnp.sqrt(diff / jnp.maximum(ref, 1e-30))


def _scale(mparams):
    """The per-head temperature scale ``a`` (up to a constant: ratios only), or None."""
    if "log_scale" in mparams:
        return jnp.exp(mparams["log_scale"].astype(jnp.float32))
    if "tau" in mparams:
        return jnp.exp(-0.5 * mparams["tau"].astype(jnp.float32))
    if "sigma" in mparams:
        return jnp.abs(mparams["sigma"].astype(jnp.float32))
    return None


def has_learnable_kernel(params) -> bool:
    """Whether any leaf of `params` sits under a path component named ``mechanism``."""
    flat = jax.tree_util.tree_leaves_with_path(params)
    return any(
        "mechanism" in [str(getattr(p, "key", getattr(p, "name", ""))) for p in path]
        for path, _ in flat
    )


class KernelDiagnostics:
    """The ``kernel/...`` entries of one run (module docstring); call it on a `TrainState`.

    ``start`` holds the entries at the init params (the same on a resume: the init is a
    function of ``config.seed``), ``end`` the latest computed.
    """

    def __init__(self, trainer, config, init_state=None):
        self.name = str(config.attention)
        self.mech = la.get(self.name).bind(**dict(config.attention_config))
        self.fmap = self.mech.feature_map
        self.model = trainer.init_model
        self.probe = [jnp.asarray(trainer.example[k][:PROBE_ROWS]) for k in trainer.input_keys]
        self._fn = jax.jit(self._compute)
        init = trainer.init_state() if init_state is None else init_state
        self._init_params = jax.device_get(init.params)
        self.start = self(init)
        self.end = dict(self.start)

    def _compute(self, params, extra, init_params, probe):
        calls = capture_attention(
            self.model, {"params": params, **extra}, *probe, deterministic=True
        )
        fixed = extra.get("fixed", {})
        negs, ents, tvs, gaps, freq, freq0, move, scale, bw = ([] for _ in range(9))
        for call in calls:
            mp = _mechanism_params(params, call.path)
            mp0 = _mechanism_params(init_params, call.path)
            fixed_mp = _mechanism_params(fixed, call.path)
            full = {**mp, **fixed_mp}
            w = _weights(self.mech, call, full)
            visible = _visible(call, w.shape)
            neg, ent = weight_stats(w, visible)
            negs.append(neg)
            ents.append(ent)
            # the init kernel on the same (current) q, k
            w0 = _weights(self.mech, call, {**mp0, **fixed_mp})
            tvs.append(attention_tv(w, w0, visible))
            if _freq_norm(mp) is not None:
                freq.append(_freq_norm(mp))
                freq0.append(_freq_norm(mp0))
                move.append(_freq_move(mp, mp0))
            if _scale(mp) is not None:
                scale.append(jnp.mean(_scale(mp) / _scale(mp0)))
            if "log_bandwidth" in mp:
                bw.append(jnp.mean(jnp.abs(mp["log_bandwidth"] - mp0["log_bandwidth"])))
            if any(key in mp for key in NONSTATIONARY_KEYS):
                d = call.q.shape[-1]
                shifts = jax.random.normal(jax.random.key(0), (GAP_SHIFTS, d)) / math.sqrt(
                    math.sqrt(d)
                )
                gaps.append(_shift_gap(self.fmap, full, call, shifts[:, None, None, None, :]))
        out = {
            "neg_weight_frac": jnp.mean(jnp.stack(negs)),
            "entropy_ratio": jnp.mean(jnp.stack(ents)),
            "attn_tv": jnp.mean(jnp.stack(tvs)),
        }
        if freq:
            out["freq_norm_ratio"] = jnp.mean(jnp.stack(freq)) / jnp.mean(jnp.stack(freq0))
            out["freq_move"] = jnp.mean(jnp.stack(move))
        if scale:
            out["scale_ratio"] = jnp.mean(jnp.stack(scale))
        if bw:
            out["bandwidth_ratio"] = jnp.exp(jnp.mean(jnp.stack(bw)))
        if gaps:
            out["shift_gap"] = jnp.mean(jnp.stack(gaps))
        return out

    def __call__(self, state) -> dict[str, float]:
        """The ``kernel/...`` entries of `state`'s params (host floats)."""
        out = self._fn(state.params, state.extra, self._init_params, self.probe)
        self.end = {PREFIX + k: float(v) for k, v in sorted(jax.device_get(out).items())}
        return dict(self.end)

    def summary(self) -> dict[str, dict[str, float]]:
        """``{"start": {...}, "end": {...}}`` for the run's summary."""
        return {"start": dict(self.start), "end": dict(self.end)}


def for_run(trainer, config, init_state=None) -> KernelDiagnostics | None:
    """The diagnostics of `trainer`'s run, or None when its mechanism learns no kernel (no
    ``mechanism`` params), when the run spans several processes (the probe is one process's
    rows: not computed there), or when no attention call can be captured (logged).
    `init_state`: the run's state at step 0 when the caller holds it (a fresh run), so that
    the init values are not computed by a second ``trainer.init_state()``."""
    if not has_learnable_kernel(trainer.abstract_state.params) or jax.process_count() > 1:
        return None
    try:
        return KernelDiagnostics(trainer, config, init_state)
    except Exception as e:  # diagnostics must never stop a run
        log.warning("kernel diagnostics disabled: %s", e)
        return None


def format_line(summary) -> str | None:
    """``kernel: name start -> end, ...`` (the run summary's line), or None."""
    kernel = summary.get("kernel")
    if not kernel:
        return None
    start, end = kernel.get("start", {}), kernel.get("end", {})

    def fmt(v):
        return f"{v:.4f}" if abs(v) >= 0.01 else f"{v:.3g}"

    parts = [
        f"{k[len(PREFIX) :]} {fmt(start[k])} -> {fmt(end[k])}" for k in sorted(start) if k in end
    ]
    return "kernel (init -> end): " + ", ".join(parts)


def plot_kernel(jsonl: str | Path, png: str | Path, *, title: str = "") -> Path | None:
    """Every ``kernel/...`` entry of the train rows against the step, one panel each; None
    when the file has none."""
    records = [r for r in metrics_lib.read_jsonl(jsonl) if r.get("split") == "train"]
    keys = sorted({k for r in records for k in r if k.startswith(PREFIX)})
    if not keys:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(keys), figsize=(3.2 * len(keys), 3.0), squeeze=False)
    for ax, key in zip(axes[0], keys):
        pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, np.asarray(ys, float))
        ax.set_title(key[len(PREFIX) :])
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    png = Path(png)
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


__all__ = [
    "KernelDiagnostics",
    "attention_tv",
    "for_run",
    "format_line",
    "has_learnable_kernel",
    "plot_kernel",
    "weight_stats",
]
