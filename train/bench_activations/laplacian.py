"""The ``laplacian`` section of `train.bench_activations` (real activations)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

import kernels
import linattn_jax as la
from train.bench_activations.common import (
    NS_ITERS,
    Capture,
    capture,
    example_inputs,
    mock_image_task,
    workload_config,
)

_LAP_WORKLOADS = (("listops", "mini"), ("vit", "mini"), ("vit", "deit_tiny"))
#: c of laplacian's ``kernel="gaussian"``, ``exp(-|q - k|_2^2 / (c lambda))`` (its docstring).
GAUSS_C = math.sqrt(math.pi)


# ---------------------------------------------------------------------------- laplacian
def _l1(x, y):
    """``sum_d |x_i - y_j|`` as ``[B, H, N, M]`` from ``[B, N, H, d]``, ``[B, M, H, d]``."""
    return jnp.sum(jnp.abs(x[:, :, None] - y[:, None, :]), axis=-1).transpose(0, 3, 1, 2)


def _sq_l2(x, y):
    """``sum_d (x_i - y_j)^2`` as ``[B, H, N, M]`` from ``[B, N, H, d]``, ``[B, M, H, d]``."""
    return jnp.sum(jnp.square(x[:, :, None] - y[:, None, :]), axis=-1).transpose(0, 3, 1, 2)


def _valid_rows(cap):
    b, t = cap.q.shape[:2]
    return np.ones((b, t), bool) if cap.mask is None else np.asarray(cap.mask)


def _on_valid_pairs(cap, values):
    """The entries of ``values [B, H, T, T]`` (one per (q_i, k_j)) on valid pairs, flat."""
    valid = _valid_rows(cap)
    pairs = valid[:, None, :, None] & valid[:, None, None, :]
    return values[np.broadcast_to(pairs, values.shape)]


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
    k_lm, valid = la.landmarks.landmarks(cap.k, num_landmarks, mask=cap.mask, grid=grid)
    left = k_lm
    if not shared:
        left, valid_q = la.landmarks.landmarks(cap.q, num_landmarks, mask=cap.mask, grid=grid)
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


def _std_ratio(out, v, mask, query_dependent=False):
    """``std(out) / std(v)`` over the valid rows; with `query_dependent`, of ``out`` less its
    mean over each sequence's valid rows (the part that differs between queries)."""
    rows = np.ones(v.shape[:2], bool) if mask is None else np.asarray(mask)
    out = np.asarray(out, np.float64)
    if query_dependent:
        w = rows[:, :, None, None]
        out = out - (out * w).sum(1, keepdims=True) / w.sum(1, keepdims=True)
    return float(np.std(out[rows]) / np.std(np.asarray(v)[rows]))


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
        dists.append(_on_valid_pairs(cap, np.asarray(_l1(cap.q, cap.k))))
        valid = _valid_rows(cap)
        k_lm, lvalid = la.landmarks.landmarks(cap.k, cfg["num_landmarks"], mask=cap.mask,
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
            for key, dep in (("scale", False), ("query_scale", True)):
                ratio = _std_ratio(outs["base"], cap.v, cap.mask, query_dependent=dep)
                agg[key] = max(agg.get(key, 0.0), ratio)
        res["landmarks"]["shared" if shared else "separate"] = agg
    res["ns_iters"] = cfg["ns_iters"]
    res["soft"] = soft_iteration_change(captures, cfg)
    return res


def kernel_stats(captures):
    """laplacian's two kernels at lambda = d / 2 (the init) on the valid (q_i, k_j) pairs of
    `captures`: ``{"d", "median_l1_over_d", "median_l2sq_over_d", "laplace", "gaussian"}``,
    the last two the entry quantiles (q10, q50, q90) of ``exp(-|q - k|_1 / lambda)`` and of
    ``kernel="gaussian"``'s ``exp(-|q - k|_2^2 / (sqrt(pi) lambda))``."""
    d = captures[0].q.shape[-1]
    lam = d / 2
    out = {"d": d}
    for name, dist_fn, scale in (("laplace", _l1, lam), ("gaussian", _sq_l2, GAUSS_C * lam)):
        dist = np.concatenate([_on_valid_pairs(c, np.asarray(dist_fn(c.q, c.k))) for c in captures])
        out["median_l1_over_d" if name == "laplace" else "median_l2sq_over_d"] = float(
            np.median(dist) / d
        )
        far, mid, near = np.quantile(dist, [0.9, 0.5, 0.1])  # large distance = small kernel
        out[name] = tuple(math.exp(-x / scale) for x in (far, mid, near))
    return out


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
    inputs = example_inputs(data, data.input_keys, examples)
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
        + " | output x3 iters | output vs exact | std(out) / std(v) | query-dependent |",
        "|---" * (8 + len(NS_ITERS)) + "|",
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
                f"{agg['triple']:.1e} | {agg['exact']:.1e} | {agg['scale']:.1f} | "
                f"{agg['query_scale']:.1f} |"
            )
        soft = r["soft"]
        dash = " | ".join("-" for _ in range(2 + len(NS_ITERS)))
        cond.append(
            f"| {name} | soft (ns_iters {soft['ns_iters']}) | {dash} | {soft['triple']:.1e} | "
            f"{soft['exact']:.1e} | - | - |"
        )
        print(f"  {name}: done", flush=True)
    tail = ["", f"(default ns_iters = {r['ns_iters']}; x3 = {3 * r['ns_iters']} iterations)"]
    return "\n".join(head + cond + tail)


def kernels_section(examples: int) -> str:
    lines = [
        "laplacian's two kernels on real activations at init, lambda = d/2 (entry quantiles "
        "q10 / q50 / q90 over the valid (q_i, k_j) pairs)",
        "",
        "| model | d | T | median L1 / d | median L2^2 / d | Laplace exp(-L1 / lambda) | "
        "Gaussian exp(-L2^2 / (sqrt(pi) lambda)) |",
        "|---|---|---|---|---|---|---|",
    ]
    for task, preset in _LAP_WORKLOADS:
        caps, _ = laplacian_model_captures(task, preset, examples)
        r = kernel_stats(caps)
        quant = " | ".join(" / ".join(f"{x:.2g}" for x in r[n]) for n in ("laplace", "gaussian"))
        lines.append(
            f"| {task} {preset} | {r['d']} | {caps[0].q.shape[1]} | "
            f"{r['median_l1_over_d']:.2f} | {r['median_l2sq_over_d']:.2f} | {quant} |"
        )
        print(f"  {task} {preset}: done", flush=True)
    return "\n".join(lines)
