"""``python -m train.bench_activations``: the attention mechanisms on the q, k, v that real
models produce, at init and after training steps (issues 19 and 13).

Three sections, each a markdown table on stdout (``--out FILE`` also writes them):

``denominators`` (Flexformer, "stable features"). A model with the default ``flexformer_n``
attention is built and trained for ``--steps`` steps on three workloads: the LRA encoder
on ListOps mini (`train.configs.listops`), the ViT mini preset on generated CIFAR-shaped
images (`mock_image_task`; nothing is downloaded) and the byte LM mini preset (the Python
standard library's sources). At init and at the end, the q and k every attention layer
receives on ``--examples`` training examples are captured (`capture`), in float32 and cast to
bfloat16, and the denominators ``den_i = sum_j phi(q_i) . phi~(k_j)`` of the linear
attention (all keys; ``j <= i`` when causal, with the running-max key stabiliser of the core)
are evaluated for ``flexformer_s`` (fresh init), ``flexformer_n`` (the layer's own params),
``flexformer_n`` with the raw map (``qk_radius=None``, the seed's form; same params) and
``performer`` (fresh init, the same feature count 2M), through each mechanism's
`linattn_jax.core.FeatureMap`. Reported: the fraction of negative denominators and of tiny
ones (``|den| < 1e-3 x`` the median ``|den|`` of the layer), over the unmasked query rows
of every layer, heads and examples, non-causal and causal.

``stability``. The main job (``python -m train``: ListOps mini, 2-layer width-64 encoder)
for ``flexformer_n`` and ``softmax``: the train loss after ``--stability-steps`` steps for
seeds 0, 1, 2 on one device, and for seed 0 on one device, an (8, 1) and a (2, 4) mesh of
fake CPU devices (the command re-executes itself with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` when fewer devices exist). Seeds
change the init key only (``Trainer.init_key``): ListOps mini has no dropout and both
mechanisms are deterministic, so the per-step key is never drawn from.

``laplacian`` (issue 13). Models with ``laplacian`` attention at init: the ListOps mini
encoder, the ViT mini preset and DeiT-tiny (d = 64; generated 224 x 224 images). Per
model: the median L1 distance / d between q_i and k_j (valid pairs); quantiles of the Laplace
kernel entries ``exp(-|q_i - k_j|_1 / lambda)`` at lambda = d / 2 (our init), sqrt(d) and 4
(the paper's); the median entry of ``C_q = kappa(Q, K~)`` at the init lambda; and with the
layer's own landmarks and lambda, for the shared (``A = kappa(K~, K~)``, the default) and the
separate (``A = kappa(Q~, K~)``) landmark matrix: sigma_min and sigma_max of A, the
Newton-Schulz residual ``max |P V_k - I|`` (``P = A + eps I``, valid block) after 10, 20,
30 and 60 steps, and the relative change of the attention output (valid rows) from the
default 30 steps to 90 and from 30 steps to the exact inverse.

The mechanism internals are read through the public API only: `linattn_jax.get`, each
mechanism's ``feature_map`` (`linattn_jax.core.FeatureMap`), `linattn_jax.landmarks` and
`kernels`. Nothing is cached or written except ``--out``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import kernels
import linattn_jax as la
from linattn_jax import landmarks as lm_lib
from linattn_jax.flexformer import QK_RADIUS
from train import configs
from train.data.images import ImageTask
from train.distill import capture_attention
from train.loop import Trainer

SECTIONS = ("denominators", "stability", "laplacian")
TINY = 1e-3  # a denominator is tiny when |den| < TINY * median |den| of its layer
SEEDS = (0, 1, 2)
MESHES = ((1, 1), (8, 1), (2, 4))
NS_ITERS = (10, 20, 30, 60)
FAKE_DEVICES = 8
_DENOM_WORKLOADS = (("listops", "mini"), ("vit", "mini"), ("lm", "mini"))
_LAP_WORKLOADS = (("listops", "mini"), ("vit", "mini"), ("vit", "deit_tiny"))


class Capture(NamedTuple):
    """What one attention call saw: ``q``, ``k``, ``v`` ``[B, T, H, d]``, the key mask
    ``[B, T]`` (or None), causal, and the layer's mechanism params."""

    path: tuple[str, ...]
    q: Any
    k: Any
    v: Any
    mask: Any
    causal: bool
    params: dict


# ---------------------------------------------------------------------------- data and models
def mock_image_task(num: int, size: int, *, classes: int = 10, seed: int = 0) -> ImageTask:
    """A generated CIFAR-shaped `ImageTask` (uint8 ``[size, size, 3]``, nothing downloaded):
    pixel noise around a per-class colour and brightness, so a ViT can learn it."""
    rng = np.random.default_rng(seed)
    labels = np.arange(num) % classes
    colour = rng.uniform(40, 215, (classes, 1, 1, 3))
    imgs = colour[labels] + rng.normal(0, 40, (num, size, size, 3))
    imgs = np.clip(imgs, 0, 255).astype(np.uint8)
    recs = [{"image": img, "label": int(lab)} for img, lab in zip(imgs, labels, strict=True)]
    splits = {"train": recs, "val": recs[: num // 4], "test": recs[: num // 4]}
    return ImageTask("mock_cifar", splits, classes, (size, size), augment="none")


def workload_config(task: str, preset: str, attention: str, **model):
    """The preset config of `task` with `attention` (and its mini settings) and `model` fields."""
    c = configs.get_config(task, preset)
    configs.set_attention(c, attention)
    c.model.update(model)
    c.mesh_shape = (1, 1)
    return c


def workload_data(config, num_images: int = 256):
    """None (the workload builds its own data) or, for ViT, a `mock_image_task`."""
    if config.task != "vit":
        return None
    return mock_image_task(num_images, int(config.data.image_size))


def _subtree(tree, path):
    for name in path:
        tree = tree.get(name, {}) if hasattr(tree, "get") else {}
    return dict(tree.get("mechanism", {})) if hasattr(tree, "get") else {}


def capture(model: nn.Module, variables, *inputs) -> list[Capture]:
    """Every attention call of ``model.apply(variables, *inputs, deterministic=True)``.

    q, k, mask and causal from `train.distill.capture_attention`; v from flax's
    ``capture_intermediates`` (the ``value`` projections, matched by path and call order);
    the mechanism params (trainable and fixed) from `variables` at the layer's path.
    """
    variables = nn.meta.unbox(variables)
    calls = capture_attention(model, variables, *inputs, deterministic=True)
    _, state = model.apply(
        variables,
        *inputs,
        deterministic=True,
        capture_intermediates=lambda mdl, _: (
            isinstance(mdl, nn.DenseGeneral) and mdl.name == "value"
        ),
        mutable=["intermediates"],
    )
    used: dict[tuple, int] = {}
    out = []
    for call in calls:
        values = state["intermediates"]
        for name in (*call.path, "value", "__call__"):
            values = values[name]
        i = used[call.path] = used.get(call.path, -1) + 1
        params = {**_subtree(variables["params"], call.path)}
        params.update(_subtree(variables.get("fixed", {}), call.path))
        out.append(Capture(call.path, call.q, call.k, values[i], call.mask, call.causal, params))
    return out


def _example_inputs(data, input_keys, n):
    batch = next(iter(data.train_batches(n, seed=0)))
    return [jnp.asarray(np.asarray(batch[k])[:n]) for k in input_keys]


def train_and_capture(config, steps: int, examples: int, data=None):
    """``(captures at init, captures after `steps`, losses)`` of one single-device run."""
    trainer = Trainer(config, data, devices=jax.devices()[:1])
    state = trainer.init_state()
    inputs = _example_inputs(trainer.data, trainer.input_keys, examples)

    def grab(st):  # on the host: the train step donates (deletes) the state's buffers
        return jax.device_get(capture(trainer.model, {"params": st.params, **st.extra}, *inputs))

    first = grab(state)
    state, losses = run_steps(trainer, state, steps)
    return first, grab(state), losses


def run_steps(trainer, state, steps: int):
    """``(state, train losses)`` after `steps` steps of the trainer's own batch stream."""
    cfg = trainer.config
    batches = trainer.data.train_batches(int(cfg.batch_size), seed=int(cfg.data_shuffle_seed))
    losses = []
    for _ in range(steps):
        state, m = trainer.train_step(state, trainer.to_global(next(batches), trainer.train_keys))
        losses.append(m["loss"])
    return state, [float(x) for x in jax.device_get(losses)]


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


# ---------------------------------------------------------------------------- stability
def stability(config, mechanisms, *, steps: int, seeds=SEEDS, meshes=MESHES, data=None):
    """``{mechanism: {"seeds": [loss per seed], "meshes": [loss per mesh]}}``: the train loss
    after `steps` steps, seeds on the first mesh, meshes with the first seed."""
    out = {}
    for name in mechanisms:
        cfg = config.copy_and_resolve_references()
        configs.set_attention(cfg, name)
        res = {"seeds": [], "meshes": []}
        for i, mesh in enumerate(meshes):
            cfg.mesh_shape = tuple(mesh)
            trainer = Trainer(cfg, data, devices=jax.devices()[: math.prod(mesh)])
            data = trainer.data  # built once, shared by every run
            for seed in seeds if i == 0 else seeds[:1]:
                # The seed's init key, as Trainer derives it; the step key is unused here.
                trainer.init_key = jax.random.split(jax.random.key(seed))[0]
                loss = run_steps(trainer, trainer.init_state(), steps)[1][-1]
                res["seeds" if i == 0 else "meshes"].append(loss)
                if i == 0 and seed == seeds[0]:
                    res["meshes"].append(loss)
        out[name] = res
    return out


def spread(losses):
    """``(std, max - min)`` of a list of losses."""
    a = np.asarray(losses, np.float64)
    return float(np.std(a)), float(np.max(a) - np.min(a))


def stability_section(steps: int, mechanisms=("flexformer_n", "softmax")) -> str:
    config = configs.get_config("listops", "mini")
    res = stability(config, mechanisms, steps=steps)
    mesh_names = ", ".join(str(m) for m in MESHES)
    lines = [
        f"Main job (ListOps mini) train loss after {steps} steps: seeds {SEEDS} on 1 device; "
        f"meshes {mesh_names} with seed {SEEDS[0]}",
        "",
        "| mechanism | losses (seeds) | seed std | seed max-min | losses (meshes) | "
        "mesh std | mesh max-min |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in res.items():
        s_std, s_rng = spread(r["seeds"])
        m_std, m_rng = spread(r["meshes"])
        lines.append(
            f"| {name} | {', '.join(f'{x:.4f}' for x in r['seeds'])} | {s_std:.2e} | "
            f"{s_rng:.2e} | {', '.join(f'{x:.5f}' for x in r['meshes'])} | {m_std:.2e} | "
            f"{m_rng:.2e} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------- laplacian
def _l1(x, y):
    """``sum_d |x_i - y_j|`` as ``[B, H, N, M]`` from ``[B, N, H, d]``, ``[B, M, H, d]``."""
    return jnp.sum(jnp.abs(x[:, :, None] - y[:, None, :]), axis=-1).transpose(0, 3, 1, 2)


def _inert(a, valid):
    """A with invalid slots' rows/columns zero and their diagonal the largest valid diagonal
    entry (what the mechanism builds), so the valid block is inverted on its own."""
    both = valid[:, None, :, None] & valid[:, None, None, :]
    eye = jnp.eye(a.shape[-1], dtype=bool)[None, None]
    diag = jnp.max(jnp.where(eye & both, a, 0.0), axis=(-2, -1), keepdims=True)
    return jnp.where(both, a, jnp.where(eye, diag, 0.0)), both


def landmark_stats(
    cap: Capture, *, num_landmarks: int, grid, eps: float, shared: bool, iters=NS_ITERS
):
    """``{"sigma_min", "sigma_max", "residual": {k: max|P V_k - I|}}`` of the layer's A."""
    lam = jnp.exp(cap.params["log_lam"])[None, :, None, None]
    k_lm, valid = lm_lib.landmarks(cap.k, num_landmarks, mask=cap.mask, grid=grid)
    left = k_lm
    if not shared:
        left, valid_q = lm_lib.landmarks(cap.q, num_landmarks, mask=cap.mask, grid=grid)
        valid = valid & valid_q
    a, both = _inert(jnp.exp(-_l1(left, k_lm) / lam), valid)
    sig_min, sig_max = np.inf, 0.0
    a_np, both_np = np.asarray(a), np.asarray(both)
    for b in range(a_np.shape[0]):
        n = int(both_np[b, 0].diagonal().sum())
        for h in range(a_np.shape[1]):
            s = np.linalg.svd(a_np[b, h, :n, :n], compute_uv=False)
            sig_min, sig_max = min(sig_min, s[-1]), max(sig_max, s[0])
    eye = jnp.eye(a.shape[-1])[None, None]
    p = a + eps * eye
    residual = {}
    for n in iters:
        v = kernels.newton_schulz_inverse(a, iters=n, eps=eps, impl="xla")
        r = jnp.abs(p @ v - eye)
        residual[n] = float(jnp.max(jnp.where(both, r, 0.0)))
    return {"sigma_min": float(sig_min), "sigma_max": float(sig_max), "residual": residual}


def _rel_change(a, b, mask):
    rows = jnp.ones(a.shape[:2], bool) if mask is None else mask
    diff = jnp.where(rows[..., None, None], a - b, 0.0)
    ref = jnp.where(rows[..., None, None], b, 0.0)
    return float(jnp.linalg.norm(diff) / jnp.linalg.norm(ref))


def _std_ratio(out, v, mask):
    """``std(out) / std(v)`` over the valid rows."""
    rows = np.ones(v.shape[:2], bool) if mask is None else np.asarray(mask)
    return float(np.std(np.asarray(out)[rows]) / np.std(np.asarray(v)[rows]))


def _jit_attention(mech, **static):
    """``(q, k, v, params, mask) -> out`` of `mech` with `static` config, jitted."""
    return jax.jit(lambda q, k, v, p, mask: mech.attention(q, k, v, p, mask=mask, **static))


def laplacian_stats(captures, mech_config: dict, *, iters=NS_ITERS, landmarks=(True, False)):
    """Per-model numbers of the laplacian section (see the module docstring); `landmarks`:
    which landmark matrices (True = shared), `iters`: the Newton-Schulz residual columns."""
    mech = la.get("laplacian")
    cfg = {**mech.defaults, **mech_config}
    d = captures[0].q.shape[-1]
    dists, cq = [], []
    lam0 = float(np.exp(np.asarray(captures[0].params["log_lam"])).mean())
    for cap in captures:
        dist = np.asarray(_l1(cap.q, cap.k))  # [B, H, T, T]
        b, t = cap.q.shape[:2]
        valid = np.ones((b, t), bool) if cap.mask is None else np.asarray(cap.mask)
        pairs = valid[:, None, :, None] & valid[:, None, None, :]
        dists.append(dist[np.broadcast_to(pairs, dist.shape)])
        k_lm, lvalid = lm_lib.landmarks(cap.k, cfg["num_landmarks"], mask=cap.mask,
                                        grid=cfg["grid"])  # fmt: skip
        c = np.asarray(jnp.exp(-_l1(cap.q, k_lm) / lam0))
        sel = valid[:, None, :, None] & np.asarray(lvalid)[:, None, None, :]
        cq.append(c[np.broadcast_to(sel, c.shape)])
    dist = np.concatenate(dists)
    q10, q50, q90 = np.quantile(dist, [0.9, 0.5, 0.1])  # large distance = small kernel
    kernel_q = {
        lam_name: tuple(math.exp(-x / lam) for x in (q10, q50, q90))
        for lam_name, lam in (("d/2", d / 2), ("sqrt(d)", math.sqrt(d)), ("4", 4.0))
    }
    res = {
        "d": d,
        "T": captures[0].q.shape[1],
        "median_l1_over_d": float(np.median(dist)) / d,
        "kernel_q": kernel_q,
        "cq_median": float(np.median(np.concatenate(cq))),
        "landmarks": {},
    }
    for shared in landmarks:
        static = dict(grid=cfg["grid"], num_landmarks=cfg["num_landmarks"],
                      local_window=cfg["local_window"], shared_landmarks=shared)  # fmt: skip
        runs = {
            "base": _jit_attention(mech, ns_iters=cfg["ns_iters"], **static),
            "triple": _jit_attention(mech, ns_iters=3 * cfg["ns_iters"], **static),
            "exact": _jit_attention(mech, inverse="exact", **static),
        }
        agg = {"sigma_min": np.inf, "sigma_max": 0.0, "residual": dict.fromkeys(iters, 0.0)}
        agg["triple"] = agg["exact"] = 0.0
        for cap in captures:
            st = landmark_stats(cap, num_landmarks=cfg["num_landmarks"], grid=cfg["grid"],
                                eps=cfg["eps"], shared=shared, iters=iters)  # fmt: skip
            agg["sigma_min"] = min(agg["sigma_min"], st["sigma_min"])
            agg["sigma_max"] = max(agg["sigma_max"], st["sigma_max"])
            for it, r in st["residual"].items():
                agg["residual"][it] = max(agg["residual"][it], r)
            outs = {n: f(cap.q, cap.k, cap.v, cap.params, cap.mask) for n, f in runs.items()}
            for n in ("triple", "exact"):
                agg[n] = max(agg[n], _rel_change(outs["base"], outs[n], cap.mask))
            agg["scale"] = max(agg.get("scale", 0.0), _std_ratio(outs["base"], cap.v, cap.mask))
        res["landmarks"]["shared" if shared else "separate"] = agg
    res["ns_iters"] = cfg["ns_iters"]
    res["soft"] = soft_iteration_change(captures, cfg)
    return res


def soft_iteration_change(captures, lap_cfg):
    """``{"triple", "exact"}``: SOFT's output change from its default Newton-Schulz count to
    three times as many and to the exact inverse, on the same q, k, v (same landmarks)."""
    mech = la.get("soft")
    iters = mech.defaults["ns_iters"]
    static = dict(grid=lap_cfg["grid"], num_landmarks=lap_cfg["num_landmarks"])
    runs = {
        "base": _jit_attention(mech, ns_iters=iters, **static),
        "triple": _jit_attention(mech, ns_iters=3 * iters, **static),
        "exact": _jit_attention(mech, inverse="exact", **static),
    }
    out = {"triple": 0.0, "exact": 0.0, "ns_iters": iters}
    for cap in captures:
        outs = {n: f(cap.q, cap.k, cap.v, {}, cap.mask) for n, f in runs.items()}
        for n in ("triple", "exact"):
            out[n] = max(out[n], _rel_change(outs["base"], outs[n], cap.mask))
    return out


def laplacian_model_captures(task: str, preset: str, examples: int):
    """``(captures at init, bound mechanism config)`` of a laplacian model of `task`."""
    config = workload_config(task, preset, "laplacian")
    if task == "vit":
        from train.models.vit import attention_config, build_vit, patch_grid

        size = int(config.data.image_size)
        data = mock_image_task(max(examples, 10), size)
        model = build_vit(config, num_classes=data.num_classes, image_size=(size, size))
        grid = patch_grid((size, size), int(config.model.patch_size))
        mech_config = dict(attention_config("laplacian", config.attention_config, grid))
    else:
        from train.workloads import get_workload

        data = get_workload(task).build_data(config)
        model = get_workload(task).build_model(config, data)
        mech_config = dict(config.attention_config)
    inputs = _example_inputs(data, data.input_keys, examples)
    k_params, k_drop = jax.random.split(jax.random.key(int(config.seed)))
    variables = jax.jit(
        lambda *x: model.init({"params": k_params, "dropout": k_drop}, *x, deterministic=True)
    )(*inputs)
    return capture(model, variables, *inputs), mech_config


def laplacian_section(examples: int) -> str:
    head = [
        "LaplacianFormer on real activations at init (kernel entry quantiles q10 / q50 / q90)",
        "",
        "| model | d | T | median L1 / d | kernel at lambda=d/2 | sqrt(d) | 4 | "
        "median C_q entry (d/2) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    cond = [
        "",
        "Landmark matrix A at lambda = d/2 (min / max over layers, heads, examples; NS "
        "residual max |P V_k - I|, P = A + eps I; output change: relative, valid rows)",
        "",
        "| model | landmarks | sigma_min(A) | sigma_max(A) | "
        + " | ".join(f"NS {k}" for k in NS_ITERS)
        + " | output x3 iters | output vs exact | std(out) / std(v) |",
        "|---" * (7 + len(NS_ITERS)) + "|",
    ]
    for task, preset in _LAP_WORKLOADS:
        caps, mech_config = laplacian_model_captures(task, preset, examples)
        r = laplacian_stats(caps, mech_config)
        name = f"{task} {preset}"
        kq = " | ".join(" / ".join(f"{x:.2g}" for x in r["kernel_q"][n]) for n in r["kernel_q"])
        head.append(
            f"| {name} | {r['d']} | {r['T']} | {r['median_l1_over_d']:.2f} | {kq} | "
            f"{r['cq_median']:.3f} |"
        )
        for kind, agg in r["landmarks"].items():
            res = " | ".join(f"{agg['residual'][k]:.1e}" for k in NS_ITERS)
            cond.append(
                f"| {name} | {kind} | {agg['sigma_min']:.1e} | {agg['sigma_max']:.1f} | {res} | "
                f"{agg['triple']:.1e} | {agg['exact']:.1e} | {agg['scale']:.1f} |"
            )
        soft = r["soft"]
        dash = " | ".join("-" for _ in range(2 + len(NS_ITERS)))
        cond.append(
            f"| {name} | soft (ns_iters {soft['ns_iters']}) | {dash} | {soft['triple']:.1e} | "
            f"{soft['exact']:.1e} | - |"
        )
        print(f"  {name}: done", flush=True)
    tail = ["", f"(default ns_iters = {r['ns_iters']}; x3 = {3 * r['ns_iters']} iterations)"]
    return "\n".join(head + cond + tail)


# ---------------------------------------------------------------------------- command line
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m train.bench_activations",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset")
    p.add_argument("--steps", type=int, default=200, help="training steps (denominators)")
    p.add_argument("--stability-steps", type=int, default=30, help="steps (stability)")
    p.add_argument("--examples", type=int, default=4, help="examples captured per model")
    p.add_argument("--out", default=None, help="also write the tables to this file")
    return p


def _ensure_devices(argv) -> None:
    """Re-execute with fake CPU devices when the stability section needs more."""
    if jax.device_count() >= FAKE_DEVICES or os.environ.get("_BENCH_ACT_REEXEC"):
        return
    env = dict(os.environ, _BENCH_ACT_REEXEC="1")
    flag = f"--xla_force_host_platform_device_count={FAKE_DEVICES}"
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flag).strip()
    os.execve(sys.executable, [sys.executable, "-m", "train.bench_activations", *argv], env)


def main(argv=None) -> str:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser().parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = sorted(set(sections) - set(SECTIONS))
    if bad:
        raise SystemExit(f"--sections: unknown {bad}; choose from {list(SECTIONS)}")
    if "stability" in sections:
        _ensure_devices(argv)
    start = time.time()
    shown = " ".join(a for a in argv if a != "--out" and a != args.out)  # --out: a copy only
    parts = [f"`python -m train.bench_activations {shown}`".replace(" `", "`")]
    for section in sections:
        print(f"[{section}] ...", flush=True)
        if section == "denominators":
            parts.append(denominator_section(args.steps, args.examples)[0])
        elif section == "stability":
            parts.append(stability_section(args.stability_steps))
        else:
            parts.append(laplacian_section(args.examples))
        print(parts[-1], flush=True)  # each table as soon as it is done
    parts.append(f"({time.time() - start:.0f} s on {jax.device_count()} x "
                 f"{jax.devices()[0].platform})")  # fmt: skip
    text = "\n\n".join(parts)
    print("\n" + text, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return text


if __name__ == "__main__":
    main()
