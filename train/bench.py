"""Benchmarks of every registered mechanism: ``python -m train.bench <subcommand> [flags]``.

Subcommands (each prints a markdown table, writes JSON with ``--out`` and a PNG with ``--plot``):

* ``scaling``: forward and forward+backward wall time (median of timed calls after a warm-up,
  compiled once ahead of time, ``block_until_ready``) and XLA's compiled memory figures
  (``jit(f).lower(...).compile().memory_analysis()``: temp + argument + output bytes) for every
  mechanism in the registry, plus ``jax.nn.dot_product_attention`` as ``softmax_xla``, over a
  range of T, causal and non-causal where supported; ratios to ``softmax`` (and to
  ``softmax_xla``) measured in the same run.
* ``fidelity``: relative error ``|out - softmax|_F / |softmax|_F`` of each mechanism as its
  budget (``num_features`` / ``num_landmarks`` / ``num_samples``) grows, on Gaussian and on
  clustered inputs, mean and std over seeds.
* ``kernels``: the Pallas kernels against their XLA references (`kernels.bench`).
* ``model``: one training step (AdamW) of a small 2-layer dual encoder shaped like LRA
  Retrieval (two documents of T = 4k bytes, B = 2) per mechanism: step time and memory as
  ratios to softmax.
* ``kernel_fit``: fits each learnable kernel to a non-stationary target attention at an
  equal feature budget (`train.bench_kernel_fit`).
* ``report``: the markdown summary (ratios at one T, crossing points, growth per doubling,
  fidelity and model tables) from the JSON files of the other subcommands.

Everything is read off the registry (`linattn_jax.names`), so a new mechanism is benchmarked
without touching this file. A point whose compiled memory exceeds ``--memory-budget-gib``, or
whose predicted time (extrapolated from the smaller T of the same series) exceeds
``--time-limit-s``, is compiled (so its memory is still reported) but not run, with a note.
With ``--isolate`` (the default on the command line) each mechanism runs in its own
subprocess under a hard ``--mechanism-timeout-s``, so a hang or an out-of-memory kill costs
one mechanism's remaining points, not the run.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import linattn_jax as la
from train import bench_peers

#: Name under which ``jax.nn.dot_product_attention`` is benchmarked beside the registry.
SOFTMAX_XLA = "softmax_xla"
#: The exact reference every ratio and error is measured against.
SOFTMAX = "softmax"
#: Config keys that set a mechanism's approximation budget (swept by ``fidelity``).
BUDGET_KEYS = ("num_features", "num_landmarks", "num_samples")
PASSES = ("fwd", "fwd_bwd")
_GIB = 2**30
_MIB = 2**20


# ----------------------------------------------------------------------------- registry views


def bench_names(mechanisms: Sequence[str] | None = None, *, with_xla: bool = True) -> list[str]:
    """Registry names (plus ``softmax_xla``), filtered to `mechanisms` when given.

    Raises:
      KeyError: an unknown name in `mechanisms`.
    """
    known = la.names() + ([SOFTMAX_XLA] if with_xla else [])
    if not mechanisms:
        return known
    unknown = [m for m in mechanisms if m not in known]
    if unknown:
        raise KeyError(f"unknown mechanism(s) {unknown}; known: {known}")
    return [m for m in known if m in mechanisms]


def is_quadratic(name: str) -> bool:
    """Whether the mechanism costs O(T^2) (read off its registry description)."""
    return name == SOFTMAX_XLA or "O(T^2)" in la.get(name).description


def supports_causal(name: str) -> bool:
    return name == SOFTMAX_XLA or la.get(name).supports_causal


def budget_keys(name: str) -> list[str]:
    """The budget config keys a mechanism has (empty for softmax, linear_elu, ...)."""
    if name == SOFTMAX_XLA:
        return []
    return [k for k in BUDGET_KEYS if k in la.get(name).defaults]


# ----------------------------------------------------------------------------- environment


def environment() -> dict[str, Any]:
    """Machine facts recorded beside every result (the numbers mean little without them)."""
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()[:1]],
        "device_count": jax.device_count(),
        "cpu_count": os.cpu_count(),
        "ram_gib": round(total_ram_bytes() / _GIB, 1) if total_ram_bytes() else None,
        "loadavg": load,
        "jax": jax.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }


def total_ram_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def default_memory_budget_gib(fraction: float = 0.3) -> float:
    """`fraction` of this machine's RAM (8 GiB if unknown): the largest point that is run."""
    ram = total_ram_bytes()
    return fraction * ram / _GIB if ram else 8.0


# ----------------------------------------------------------------------------- timing, memory


def memory_figures(compiled) -> dict[str, int | None]:
    """XLA's compiled memory figures in bytes; every value None when the backend gives none."""
    keys = ("temp", "argument", "output", "alias", "total")
    try:
        m = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 -- some backends raise instead of returning None
        m = None
    if m is None:
        return dict.fromkeys(keys)
    out = {
        "temp": int(m.temp_size_in_bytes),
        "argument": int(m.argument_size_in_bytes),
        "output": int(m.output_size_in_bytes),
        "alias": int(getattr(m, "alias_size_in_bytes", 0)),
    }
    out["total"] = out["temp"] + out["argument"] + out["output"]
    return out


def time_compiled(
    fn: Callable, args: Sequence[Any], *, repeats: int, min_total_s: float = 2.0
) -> dict[str, Any]:
    """Times an already compiled `fn(*args)`: one warm-up call, then up to `repeats` timed calls.

    Fewer calls (at least 1) when one call takes longer than ``min_total_s / repeats``, so slow
    points do not dominate the run; when the warm-up alone took ``repeats * min_total_s`` it is
    the only measurement (``n_timed = 0``). Returns the median and min in ms and the count.
    """
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    warm = time.perf_counter() - t0
    if warm >= repeats * min_total_s:
        # One call is longer than the whole budget: it is the measurement (compiled ahead
        # of time, so the first call carries no compilation).
        return {"time_ms": warm * 1e3, "time_ms_min": warm * 1e3, "n_timed": 0}
    n = max(1, min(repeats, int(min_total_s / max(warm, 1e-9))))
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return {
        "time_ms": statistics.median(times),
        "time_ms_min": min(times),
        "n_timed": n,
        "warmup_ms": warm * 1e3,
    }


# ----------------------------------------------------------------------------- attention calls


def attention_callable(name: str, *, causal: bool, config: dict | None = None):
    """``f(q, k, v, trainable, fixed, rng) -> out`` for a registry name or ``softmax_xla``.

    Stochastic mechanisms sample (``deterministic=False``), as in training.
    """
    if name == SOFTMAX_XLA:

        def xla(q, k, v, trainable, fixed, rng):
            del trainable, fixed, rng
            return jax.nn.dot_product_attention(q, k, v, is_causal=causal)

        return xla
    mech = la.get(name).bind(**(config or {}))

    def f(q, k, v, trainable, fixed, rng):
        return mech.attention(q, k, v, {**trainable, **fixed}, rng, causal=causal)

    return f


def mechanism_state(name: str, *, heads: int, head_dim: int, seed: int = 0, config=None):
    """``(trainable, fixed, rng)`` for `name`: its params split as the modules do, and a key
    when it samples (None otherwise)."""
    if name == SOFTMAX_XLA:
        return {}, {}, None
    mech = la.get(name).bind(**(config or {}))
    params = mech.init(jax.random.key(seed), num_heads=heads, head_dim=head_dim)
    fixed_names = mech.fixed_params()
    trainable = {k: v for k, v in params.items() if k not in fixed_names}
    fixed = {k: v for k, v in params.items() if k in fixed_names}
    rng = jax.random.key(seed + 1) if mech.stochastic else None
    return trainable, fixed, rng


def _fwd_bwd(f: Callable) -> Callable:
    """Loss ``<f(...), ct>`` and its gradient w.r.t. q, k, v and the trainable params."""

    def loss(q, k, v, trainable, fixed, rng, ct):
        out = f(q, k, v, trainable, fixed, rng)
        return jnp.sum(out.astype(jnp.float32) * ct)

    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))


def _inputs(batch: int, seq_len: int, heads: int, head_dim: int, seed: int = 0):
    kq, kk, kv, kc = jax.random.split(jax.random.key(seed), 4)
    shape = (batch, seq_len, heads, head_dim)
    q, k, v, ct = (jax.random.normal(key, shape, jnp.float32) for key in (kq, kk, kv, kc))
    return q, k, v, ct


# ----------------------------------------------------------------------------- scaling


@dataclasses.dataclass(frozen=True)
class ScalingConfig:
    seq_lens: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384, 32768)
    batch: int = 1
    heads: int = 4
    head_dim: int = 64
    modes: tuple[str, ...] = ("noncausal", "causal")
    passes: tuple[str, ...] = PASSES
    repeats: int = 3
    min_total_s: float = 2.0
    memory_budget_gib: float = dataclasses.field(default_factory=default_memory_budget_gib)
    time_limit_s: float = 60.0


def _predict_s(series: list[tuple[int, float]], seq_len: int, quadratic: bool) -> float | None:
    """Time of one call at `seq_len` extrapolated from the measured (T, seconds) of the series.

    The local log-log slope of the last two points (clamped to [1, 2.5]); with one point the
    slope is 2 for quadratic mechanisms and 1 otherwise.
    """
    if not series:
        return None
    t1, s1 = series[-1]
    if len(series) >= 2:
        t0, s0 = series[-2]
        slope = math.log(max(s1, 1e-9) / max(s0, 1e-9)) / math.log(t1 / t0)
        slope = min(max(slope, 1.0), 2.5)
    else:
        slope = 2.0 if quadratic else 1.0
    return s1 * (seq_len / t1) ** slope


def scaling_points(
    name: str, cfg: ScalingConfig, emit: Callable[[dict], None] | None = None
) -> list[dict]:
    """Every (T, mode, pass) point of one mechanism, T ascending; `emit` sees each as it lands."""
    points = []
    quadratic = is_quadratic(name)
    modes = [m for m in cfg.modes if m == "noncausal" or supports_causal(name)]
    trainable, fixed, rng = mechanism_state(name, heads=cfg.heads, head_dim=cfg.head_dim)
    series: dict[tuple[str, str], list[tuple[int, float]]] = {}
    stopped: dict[tuple[str, str], str] = {}
    for seq_len in cfg.seq_lens:
        q, k, v, ct = _inputs(cfg.batch, seq_len, cfg.heads, cfg.head_dim)
        for mode in modes:
            f = attention_callable(name, causal=mode == "causal")
            for pass_ in cfg.passes:
                key = (mode, pass_)
                fn, args = (f, (q, k, v, trainable, fixed, rng))
                if pass_ == "fwd_bwd":
                    fn, args = _fwd_bwd(f), (*args, ct)
                point = {
                    "mechanism": name,
                    "seq_len": seq_len,
                    "mode": mode,
                    "pass": pass_,
                    "quadratic": quadratic,
                    "status": "ok",
                    "note": "",
                }
                try:
                    t0 = time.perf_counter()
                    compiled = jax.jit(fn).lower(*args).compile()
                    point["compile_s"] = time.perf_counter() - t0
                    point["memory"] = memory_figures(compiled)
                    total = point["memory"]["total"]
                    predicted = _predict_s(series.get(key, []), seq_len, quadratic)
                    if key in stopped:
                        point.update(status="skipped", note=stopped[key])
                    elif total is not None and total > cfg.memory_budget_gib * _GIB:
                        point.update(
                            status="skipped",
                            note=f"memory {total / _GIB:.2f} GiB > budget "
                            f"{cfg.memory_budget_gib:.2f} GiB",
                        )
                    elif predicted is not None and predicted > cfg.time_limit_s:
                        point.update(
                            status="skipped",
                            note=f"predicted {predicted:.0f} s/call > limit "
                            f"{cfg.time_limit_s:.0f} s",
                        )
                    else:
                        point.update(
                            time_compiled(
                                compiled, args, repeats=cfg.repeats, min_total_s=cfg.min_total_s
                            )
                        )
                        series.setdefault(key, []).append((seq_len, point["time_ms"] / 1e3))
                    if point["status"] == "skipped" and key not in stopped:
                        stopped[key] = f"skipped at T={seq_len}: {point['note']}"
                        if "memory" in point["note"]:
                            # Larger T only needs more memory; later points still report theirs.
                            stopped[key] = point["note"].replace(
                                "memory", f"memory at T={seq_len}:", 1
                            )
                except Exception as e:  # noqa: BLE001 -- one failing point must not end the run
                    point.update(status="error", note=f"{type(e).__name__}: {str(e)[:300]}")
                points.append(point)
                if emit is not None:
                    emit(point)
    return points + bench_peers.peer_points(name, cfg, emit)  # its peer, if any, beside it


def _run_isolated(name: str, argv: Sequence[str], timeout_s: float) -> list[dict]:
    """Runs ``python -m train.bench`` for one mechanism in a subprocess with a hard timeout.

    The child writes each result as it lands (JSON lines in a temp file), so a timeout or an
    out-of-memory kill keeps the points finished before it.
    """
    with tempfile.TemporaryDirectory() as tmp:
        lines = os.path.join(tmp, "points.jsonl")
        cmd = [sys.executable, "-m", "train.bench", *argv, "--mechanisms", name]
        cmd += ["--no-isolate", "--jsonl", lines, "--quiet"]
        note = ""
        try:
            proc = subprocess.run(cmd, timeout=timeout_s, capture_output=True, text=True)
            if proc.returncode != 0:
                note = f"subprocess exited {proc.returncode}: {proc.stderr.strip()[-300:]}"
        except subprocess.TimeoutExpired:
            note = f"subprocess timed out after {timeout_s:.0f} s"
        points = []
        if os.path.exists(lines):
            with open(lines) as fh:
                points = [json.loads(line) for line in fh if line.strip()]
    if note:
        points.append({"mechanism": name, "status": "error", "note": note})
    return points


def add_ratios(points: list[dict]) -> list[dict]:
    """Adds ``ratio_time`` / ``ratio_memory`` (to softmax) and ``ratio_time_xla`` (to
    softmax_xla) to every point whose reference point exists in the same run.

    Where the reference was skipped (memory or time), its time is extrapolated quadratically
    from its largest measured T of the same mode and pass, and ``ratio_time_extrapolated``
    is set. Memory figures come from compilation, so memory ratios are never extrapolated.
    """
    index = {
        (p["mechanism"], p["seq_len"], p["mode"], p["pass"]): p for p in points if "seq_len" in p
    }

    def ref_time(ref, seq_len, mode, pass_):
        p = index.get((ref, seq_len, mode, pass_))
        if p is not None and p.get("time_ms"):
            return p["time_ms"], False
        measured = [
            (t, q["time_ms"])
            for (n, t, m, s), q in index.items()
            if n == ref and m == mode and s == pass_ and q.get("time_ms") and t < seq_len
        ]
        if not measured:
            return None, False
        t0, ms = max(measured)
        return ms * (seq_len / t0) ** 2, True

    for p in points:
        if "seq_len" not in p:
            continue
        key = (p["seq_len"], p["mode"], p["pass"])
        for ref, field in ((SOFTMAX, "ratio_time"), (SOFTMAX_XLA, "ratio_time_xla")):
            ref_ms, extrapolated = ref_time(ref, *key)
            if p.get("time_ms") and ref_ms:
                p[field] = p["time_ms"] / ref_ms
                p[f"{field}_extrapolated"] = extrapolated
        ref = index.get((SOFTMAX, *key))
        mem, ref_mem = p.get("memory", {}).get("total"), None
        if ref is not None:
            ref_mem = ref.get("memory", {}).get("total")
        if mem and ref_mem:
            p["ratio_memory"] = mem / ref_mem
    return points


def run_scaling(
    cfg: ScalingConfig,
    mechanisms: Sequence[str] | None = None,
    *,
    isolate: bool = False,
    mechanism_timeout_s: float = 900.0,
    argv: Sequence[str] = (),
    jsonl: str | None = None,
    log: Callable[[str], None] | None = None,
) -> dict:
    """All scaling points of `mechanisms` (default: the registry plus softmax_xla) with ratios."""
    names = bench_names(mechanisms)
    points: list[dict] = []

    def emit(p):
        if jsonl and not isolate:
            with open(jsonl, "a") as fh:
                fh.write(json.dumps(p) + "\n")
        if log:
            shown = f"{p['time_ms']:.1f} ms" if p.get("time_ms") else p["status"]
            log(f"  {p['mechanism']} T={p['seq_len']} {p['mode']} {p['pass']}: {shown}")

    for name in names:
        if log:
            log(f"scaling: {name}")
        if isolate:
            new = _run_isolated(name, argv, mechanism_timeout_s)
            for p in new:
                if "seq_len" in p:
                    emit(p)
                elif log:
                    log(f"  {name}: {p['note']}")
            points += new
        else:
            points += scaling_points(name, cfg, emit)
    return {
        "kind": "scaling",
        "environment": environment(),
        "config": dataclasses.asdict(cfg),
        "mechanisms": bench_peers.peer_names(names),
        "points": bench_peers.add_peer_ratios(add_ratios(points)),
    }


def _fmt_ms(ms: float | None) -> str:
    if ms is None:
        return "-"
    return f"{ms / 1e3:.2f} s" if ms >= 1e4 else f"{ms:.1f} ms" if ms >= 10 else f"{ms:.2f} ms"


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    if n >= _GIB:
        return f"{n / _GIB:.2f} GiB"
    return f"{n / _MIB:.1f} MiB" if n >= 10 * _MIB else f"{n / _MIB:.2f} MiB"


def _fmt_ratio(r: float | None, extrapolated: bool = False) -> str:
    if r is None:
        return ""
    return f" ({'~' if extrapolated else ''}{_x(r)})"


def scaling_table(result: dict) -> str:
    """Markdown tables: time (ratio to softmax) and memory (ratio) per mode and pass."""
    pts = [p for p in result["points"] if "seq_len" in p]
    seq_lens = sorted({p["seq_len"] for p in pts})
    out = []
    for mode in result["config"]["modes"]:
        for pass_ in result["config"]["passes"]:
            rows = [p for p in pts if p["mode"] == mode and p["pass"] == pass_]
            if not rows:
                continue
            label = "forward+backward" if pass_ == "fwd_bwd" else "forward"
            for what in ("time", "memory"):
                unit = "median wall time" if what == "time" else "XLA memory (temp+arg+out)"
                out.append(f"\n#### {label}, {mode}: {unit} (ratio to softmax)\n")
                out.append("| mechanism | " + " | ".join(f"T={t}" for t in seq_lens) + " |")
                out.append("|---|" + "---:|" * len(seq_lens))
                for name in result["mechanisms"]:
                    cells = []
                    for t in seq_lens:
                        p = next(
                            (r for r in rows if r["mechanism"] == name and r["seq_len"] == t), None
                        )
                        cells.append(_cell(p, what))
                    if any(c != "" for c in cells):
                        out.append(f"| {name} | " + " | ".join(cells) + " |")
    notes = sorted({f"{p['mechanism']}: {p['note']}" for p in pts if p.get("note")})
    notes += [f"{p['mechanism']}: {p['note']}" for p in result["points"] if "seq_len" not in p]
    if notes:
        out.append("\nNotes:\n")
        out += [f"- {n}" for n in dict.fromkeys(notes)]
    return "\n".join(out).strip() + "\n"


def _cell(p: dict | None, what: str) -> str:
    if p is None:
        return ""
    if what == "memory":
        total = p.get("memory", {}).get("total")
        if total is None:
            return "n/a"
        return _fmt_bytes(total) + _fmt_ratio(p.get("ratio_memory"))
    if p.get("time_ms"):
        return _fmt_ms(p["time_ms"]) + _fmt_ratio(
            p.get("ratio_time"), p.get("ratio_time_extrapolated", False)
        )
    return "skip" if p["status"] == "skipped" else p["status"]


def plot_scaling(result: dict, path: str) -> None:
    """Log-log time and memory vs T (rows), non-causal and causal (columns), per mechanism."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [p for p in result["points"] if "seq_len" in p]
    pass_ = "fwd_bwd" if any(p["pass"] == "fwd_bwd" for p in pts) else "fwd"
    label = "forward+backward" if pass_ == "fwd_bwd" else "forward"
    modes = [m for m in result["config"]["modes"] if any(p["mode"] == m for p in pts)]
    fig, axes = plt.subplots(2, len(modes), figsize=(6.5 * len(modes), 9), squeeze=False)
    cmap = plt.get_cmap("tab20")
    for j, mode in enumerate(modes):
        for i, what in enumerate(("time", "memory")):
            ax = axes[i, j]
            for c, name in enumerate(result["mechanisms"]):
                rows = sorted(
                    (
                        p
                        for p in pts
                        if p["mechanism"] == name and p["mode"] == mode and p["pass"] == pass_
                    ),
                    key=lambda p: p["seq_len"],
                )
                if what == "time":
                    xy = [(p["seq_len"], p["time_ms"]) for p in rows if p.get("time_ms")]
                else:
                    xy = [(p["seq_len"], p["memory"]["total"] / _MIB) for p in rows if _mem(p)]
                if not xy:
                    continue
                # The JSON says which are quadratic (its mechanisms may not be registered here).
                style = "--" if any(p.get("quadratic") for p in rows) else "-"
                ax.plot(*zip(*xy), style, marker="o", ms=3, color=_color(cmap, c), label=name)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequence length T")
            ax.set_ylabel(f"{label} time (ms)" if what == "time" else "XLA memory (MiB)")
            ax.set_title(f"{mode}: {label} {what}")
            ax.grid(True, which="both", alpha=0.3)
    axes[0, 0].legend(fontsize=7, ncol=2)  # the non-causal panel has every mechanism
    env = result.get("environment", {})
    fig.suptitle(
        f"B={result['config']['batch']}, H={result['config']['heads']}, "
        f"d={result['config']['head_dim']}; backend {env.get('backend')}, "
        f"{env.get('cpu_count')} cores"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _color(cmap, i: int):
    """tab20: the ten saturated hues first, then their light twins."""
    return cmap((2 * i) % 20 + (i // 10) % 2)


def _mem(p):
    return p.get("memory", {}).get("total")


# ----------------------------------------------------------------------------- fidelity


def make_inputs(
    kind: str,
    rng,
    *,
    batch: int,
    seq_len: int,
    heads: int,
    head_dim: int,
    clusters: int = 4,
    center_scale: float = 1.0,
    noise: float = 0.5,
    return_clusters: bool = False,
):
    """``(q, k, v)`` of shape ``[B, T, H, d]`` (and, with `return_clusters`, the clusters
    ``[B, T, H]`` of the queries and of the keys; None for Gaussian inputs).

    ``gaussian``: i.i.d. N(0, 1), so the logits ``q.k / sqrt(d)`` are ~N(0, 1) (diffuse
    attention). ``clustered``: q and k are ``mu_c + noise * N(0, I)`` with each token's cluster
    c drawn from `clusters` shared centres ``mu ~ N(0, center_scale^2 I)`` per head, so a query
    attends sharply to its own cluster's keys. v is N(0, 1) in both.
    """
    kq, kk, kv, kc, ka, kb = jax.random.split(rng, 6)
    shape = (batch, seq_len, heads, head_dim)
    v = jax.random.normal(kv, shape, jnp.float32)
    if kind == "gaussian":
        q, k = jax.random.normal(kq, shape), jax.random.normal(kk, shape)
        return (q, k, v, None, None) if return_clusters else (q, k, v)
    if kind != "clustered":
        raise ValueError(f"inputs kind must be 'gaussian' or 'clustered', got {kind!r}")
    mu = center_scale * jax.random.normal(kc, (clusters, heads, head_dim))
    heads_idx = jnp.arange(heads)[None, None, :]
    cq, ck = (jax.random.randint(key, (batch, seq_len, heads), 0, clusters) for key in (ka, kb))
    q = mu[cq, heads_idx] + noise * jax.random.normal(kq, shape)
    k = mu[ck, heads_idx] + noise * jax.random.normal(kk, shape)
    return (q, k, v, cq, ck) if return_clusters else (q, k, v)


def relative_error(out, ref) -> float:
    """``|out - ref|_F / |ref|_F`` in float32."""
    out, ref = out.astype(jnp.float32), ref.astype(jnp.float32)
    return float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))


def fidelity_configs(
    name: str, budgets: Sequence[int], max_quadratic_budget: int | None = None
) -> list[tuple[str | None, int | None]]:
    """``(budget_key, budget)`` pairs swept for `name`: one per budget key and value, or one
    ``(None, None)`` for mechanisms with no budget. Quadratic mechanisms' budgets are capped
    at `max_quadratic_budget` (RA costs ``num_samples`` softmax attentions)."""
    keys = budget_keys(name)
    if not keys:
        return [(None, None)]
    out = []
    for key in keys:
        for b in budgets:
            if max_quadratic_budget and is_quadratic(name) and b > max_quadratic_budget:
                continue
            out.append((key, b))
    return out


def fidelity_sweep(
    mechanisms: Sequence[str] | None = None,
    *,
    budgets: Sequence[int] = (16, 64, 256, 1024),
    seeds: int = 3,
    seq_len: int = 1024,
    batch: int = 1,
    heads: int = 4,
    head_dim: int = 64,
    inputs: Sequence[str] = ("gaussian", "clustered"),
    max_quadratic_budget: int | None = 256,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Relative error to exact softmax per (mechanism, budget key, budget, inputs): every seed,
    mean and std. Seed s draws the inputs, the params (random features) and the samples."""
    names = [n for n in bench_names(mechanisms, with_xla=False) if n != SOFTMAX]
    data = {
        (kind, s): make_inputs(
            kind,
            jax.random.key(10_000 + s),
            batch=batch,
            seq_len=seq_len,
            heads=heads,
            head_dim=head_dim,
        )
        for kind in inputs
        for s in range(seeds)
    }
    exact_fn = jax.jit(lambda q, k, v: la.get(SOFTMAX).attention(q, k, v, {}))
    exact = {key: exact_fn(*qkv) for key, qkv in data.items()}
    rows = []
    for name in names:
        for key, budget in fidelity_configs(name, budgets, max_quadratic_budget):
            config = {} if key is None else {key: budget}
            f = jax.jit(attention_callable(name, causal=False, config=config))
            t0 = time.perf_counter()
            for kind in inputs:
                errors = []
                for s in range(seeds):
                    trainable, fixed, rng = mechanism_state(
                        name, heads=heads, head_dim=head_dim, seed=s, config=config
                    )
                    q, k, v = data[(kind, s)]
                    try:
                        errors.append(
                            relative_error(f(q, k, v, trainable, fixed, rng), exact[(kind, s)])
                        )
                    except Exception as e:  # noqa: BLE001 -- report, keep sweeping
                        errors.append(float("nan"))
                        if log:
                            log(f"  {name} {config}: {type(e).__name__}: {e}")
                arr = np.asarray(errors)
                rows.append(
                    {
                        "mechanism": name,
                        "budget_key": key,
                        "budget": budget,
                        "inputs": kind,
                        "errors": errors,
                        "mean": float(np.mean(arr)),
                        "std": float(np.std(arr, ddof=1)) if len(arr) > 1 else 0.0,
                    }
                )
            if log:
                log(f"fidelity: {name} {config} ({time.perf_counter() - t0:.1f} s)")
    return {
        "kind": "fidelity",
        "environment": environment(),
        "config": {
            "budgets": list(budgets),
            "seeds": seeds,
            "seq_len": seq_len,
            "batch": batch,
            "heads": heads,
            "head_dim": head_dim,
            "inputs": list(inputs),
            "max_quadratic_budget": max_quadratic_budget,
        },
        "mechanisms": names,
        "rows": rows,
    }


def _series_label(row: dict, rows: list[dict]) -> str:
    keys = {r["budget_key"] for r in rows if r["mechanism"] == row["mechanism"]}
    multi = len(keys) > 1
    return f"{row['mechanism']} ({row['budget_key']})" if multi else row["mechanism"]


def fidelity_table(result: dict) -> str:
    """Markdown: rows = mechanism (budget key), columns = budget, cells mean +- std."""
    budgets = result["config"]["budgets"]
    out = []
    for kind in result["config"]["inputs"]:
        out.append(
            f"\n#### relative error to softmax, {kind} inputs "
            f"(T={result['config']['seq_len']}, mean +- std over "
            f"{result['config']['seeds']} seeds)\n"
        )
        out.append("| mechanism | budget key | " + " | ".join(str(b) for b in budgets) + " |")
        out.append("|---|---|" + "---:|" * len(budgets))
        rows = [r for r in result["rows"] if r["inputs"] == kind]
        series = dict.fromkeys((r["mechanism"], r["budget_key"]) for r in rows)
        for name, key in series:
            these = [r for r in rows if r["mechanism"] == name and r["budget_key"] == key]
            if key is None:
                cells = [f"{these[0]['mean']:.3f} +- {these[0]['std']:.3f}"] + [
                    "(same)" for _ in budgets[1:]
                ]
            else:
                by_b = {r["budget"]: r for r in these}
                cells = [
                    f"{by_b[b]['mean']:.3f} +- {by_b[b]['std']:.3f}" if b in by_b else "-"
                    for b in budgets
                ]
            out.append(f"| {name} | {key or '(none)'} | " + " | ".join(cells) + " |")
    return "\n".join(out).strip() + "\n"


def plot_fidelity(result: dict, path: str | None = None, axes=None):
    """Error vs budget (log-log, error bars = std over seeds), one panel per input kind.

    Mechanisms without a budget are horizontal lines. Saves to `path` when given; returns
    the figure.
    """
    import matplotlib

    if path is not None:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = result["config"]["inputs"]
    if axes is None:
        fig, axes = plt.subplots(1, len(kinds), figsize=(6.5 * len(kinds), 4.8), squeeze=False)
        axes = axes[0]
    fig = axes[0].figure
    budgets = result["config"]["budgets"]
    cmap = plt.get_cmap("tab20")
    for ax, kind in zip(axes, kinds):
        rows = [r for r in result["rows"] if r["inputs"] == kind]
        series = dict.fromkeys((r["mechanism"], r["budget_key"]) for r in rows)
        for c, (name, key) in enumerate(series):
            these = [r for r in rows if r["mechanism"] == name and r["budget_key"] == key]
            label = _series_label(these[0], rows)
            if key is None:
                ax.axhline(these[0]["mean"], ls=":", color=_color(cmap, c), label=label)
                continue
            these.sort(key=lambda r: r["budget"])
            ax.errorbar(
                [r["budget"] for r in these],
                [r["mean"] for r in these],
                yerr=[r["std"] for r in these],
                marker="o",
                ms=3,
                capsize=2,
                color=_color(cmap, c),
                label=label,
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.set_xlabel("budget (features / landmarks / samples)")
        ax.set_ylabel("relative error to softmax")
        ax.set_title(f"{kind} inputs, T={result['config']['seq_len']}")
        ax.grid(True, which="both", alpha=0.3)
    axes[-1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
        plt.close(fig)
    return fig


# ----------------------------------------------------------------------------- model


def _model_classes():
    """The tiny LRA-Retrieval dual encoder (built lazily: flax only when ``model`` runs)."""
    import flax.linen as nn

    class Block(nn.Module):
        dim: int
        heads: int
        mlp: int
        attention: str
        attention_config: Any = ()

        @nn.compact
        def __call__(self, x, mask):
            y = nn.LayerNorm()(x)
            y = la.linen.MultiHeadAttention(
                num_heads=self.heads,
                attention=self.attention,
                attention_config=self.attention_config,
            )(y, mask=mask)
            x = x + y
            y = nn.Dense(self.mlp)(nn.LayerNorm()(x))
            return x + nn.Dense(self.dim)(nn.gelu(y))

    class Encoder(nn.Module):
        vocab: int
        max_len: int
        dim: int
        heads: int
        mlp: int
        layers: int
        attention: str
        attention_config: Any = ()

        @nn.compact
        def __call__(self, tokens, mask):
            x = nn.Embed(self.vocab, self.dim)(tokens)
            pos = self.param("pos", nn.initializers.normal(0.02), (self.max_len, self.dim))
            x = x + pos[None, : tokens.shape[1]]
            for _ in range(self.layers):
                x = Block(self.dim, self.heads, self.mlp, self.attention, self.attention_config)(
                    x, mask
                )
            x = nn.LayerNorm()(x)
            w = mask[..., None].astype(x.dtype)
            return jnp.sum(x * w, axis=1) / jnp.maximum(jnp.sum(w, axis=1), 1.0)  # [B, dim]

    class DualEncoder(nn.Module):
        """LRA Retrieval: encode both documents (shared weights), classify [u, v, u*v, u-v]."""

        encoder: Encoder
        classes: int = 2

        @nn.compact
        def __call__(self, tok1, mask1, tok2, mask2):
            u, v = self.encoder(tok1, mask1), self.encoder(tok2, mask2)
            h = jnp.concatenate([u, v, u * v, u - v], axis=-1)
            return nn.Dense(self.classes)(nn.gelu(nn.Dense(self.encoder.dim)(h)))

    return Encoder, DualEncoder


def model_point(
    name: str,
    *,
    seq_len: int = 4096,
    batch: int = 2,
    dim: int = 64,
    heads: int = 4,
    mlp: int = 128,
    layers: int = 2,
    repeats: int = 3,
    min_total_s: float = 2.0,
    memory_budget_gib: float | None = None,
) -> dict:
    """Compiles and times one AdamW training step of the dual encoder with mechanism `name`."""
    import optax

    Encoder, DualEncoder = _model_classes()
    model = DualEncoder(Encoder(256, seq_len, dim, heads, mlp, layers, name))
    k = jax.random.split(jax.random.key(0), 6)
    tok1, tok2 = (jax.random.randint(key, (batch, seq_len), 0, 256) for key in k[:2])
    # Padding as in LRA: each document keeps a random prefix of at least half its length.
    lens = jax.random.randint(k[2], (2, batch), seq_len // 2, seq_len + 1)
    mask1, mask2 = (jnp.arange(seq_len)[None, :] < lens[i][:, None] for i in range(2))
    labels = jax.random.randint(k[3], (batch,), 0, 2)
    variables = model.init({"params": k[4], "attention": k[5]}, tok1, mask1, tok2, mask2)
    params, rest = variables["params"], {c: v for c, v in variables.items() if c != "params"}
    opt = optax.adamw(1e-4)
    opt_state = opt.init(params)

    def step(params, opt_state, rng, tok1, mask1, tok2, mask2, labels):
        def loss_fn(p):
            logits = model.apply(
                {"params": p, **rest}, tok1, mask1, tok2, mask2, rngs={"attention": rng}
            )
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    args = (params, opt_state, jax.random.key(1), tok1, mask1, tok2, mask2, labels)
    point = {"mechanism": name, "status": "ok", "note": ""}
    point["num_params"] = int(sum(x.size for x in jax.tree_util.tree_leaves(params)))
    t0 = time.perf_counter()
    compiled = jax.jit(step).lower(*args).compile()
    point["compile_s"] = time.perf_counter() - t0
    point["memory"] = memory_figures(compiled)
    total = point["memory"]["total"]
    if memory_budget_gib and total and total > memory_budget_gib * _GIB:
        point.update(
            status="skipped",
            note=f"memory {total / _GIB:.2f} GiB > budget {memory_budget_gib:.2f} GiB",
        )
        return point
    point.update(time_compiled(compiled, args, repeats=repeats, min_total_s=min_total_s))
    return point


def run_model(
    mechanisms: Sequence[str] | None = None,
    *,
    isolate: bool = False,
    mechanism_timeout_s: float = 900.0,
    argv: Sequence[str] = (),
    jsonl: str | None = None,
    log: Callable[[str], None] | None = None,
    **kwargs,
) -> dict:
    """`model_point` for every registry mechanism, with ratios to softmax."""
    names = bench_names(mechanisms, with_xla=False)
    points = []
    for name in names:
        if isolate:
            new = _run_isolated(name, argv, mechanism_timeout_s)
        else:
            try:
                new = [model_point(name, **kwargs)]
            except Exception as e:  # noqa: BLE001
                new = [{"mechanism": name, "status": "error", "note": f"{type(e).__name__}: {e}"}]
            if jsonl:
                with open(jsonl, "a") as fh:
                    fh.write(json.dumps(new[0]) + "\n")
        if log:
            shown = f"{new[-1]['time_ms']:.0f} ms" if new and new[-1].get("time_ms") else new[-1]
            log(f"model: {name}: {shown}")
        points += new
    return {
        "kind": "model",
        "environment": environment(),
        "config": {"task": "LRA Retrieval shape (dual encoder, AdamW step)", **kwargs},
        "mechanisms": names,
        "points": _model_ratios(points),
    }


def _model_ratios(points: list[dict]) -> list[dict]:
    """Adds ``ratio_time`` / ``ratio_memory`` to softmax (where softmax has the figure)."""
    ref = next((p for p in points if p["mechanism"] == SOFTMAX and p.get("time_ms")), None)
    ref_mem = next((_mem(p) for p in points if p["mechanism"] == SOFTMAX and _mem(p)), None)
    for p in points:
        if ref and p.get("time_ms"):
            p["ratio_time"] = p["time_ms"] / ref["time_ms"]
        if ref_mem and _mem(p):
            p["ratio_memory"] = _mem(p) / ref_mem
    return points


def merge_model(results: Sequence[dict]) -> dict:
    """One model result from several runs of the same config (e.g. softmax rerun alone under a
    larger memory budget): one point per mechanism, a later run's point replacing an earlier
    one only where that has no time (skipped, error); ratios recomputed."""
    if len(results) == 1:
        return results[0]
    by_name: dict = {}
    for r in results:
        for p in r["points"]:
            if by_name.get(p["mechanism"], {}).get("time_ms"):
                continue
            by_name[p["mechanism"]] = {k: v for k, v in p.items() if not k.startswith("ratio_")}
    names = sorted(by_name, key=_registry_order)
    return {
        **results[0],
        "environments": [r["environment"] for r in results],
        "mechanisms": names,
        "points": _model_ratios([by_name[n] for n in names]),
    }


def model_table(result: dict) -> str:
    c = result["config"]
    out = [
        f"#### training step, dual encoder: T={c.get('seq_len')}, B={c.get('batch')}, "
        f"{c.get('layers')} layers, dim {c.get('dim')}, {c.get('heads')} heads\n",
        "| mechanism | step time | ratio to softmax | XLA memory | ratio to softmax | note |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for p in result["points"]:
        mem = _mem(p)
        out.append(
            f"| {p['mechanism']} | {_fmt_ms(p.get('time_ms')) if p.get('time_ms') else p['status']}"
            f" | {_num(p.get('ratio_time'))} | {_fmt_bytes(mem)}"
            f" | {_num(p.get('ratio_memory'))} | {p.get('note', '')} |"
        )
    return "\n".join(out) + "\n"


def _x(r: float) -> str:
    """A ratio with two decimals, or two significant digits below 0.1."""
    return f"{r:.2f}x" if r >= 0.1 else f"{r:.2g}x"


def _num(x):
    return "-" if x is None else _x(x)


def plot_model(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [p for p in result["points"] if p.get("ratio_time") or p.get("ratio_memory")]
    fig, ax = plt.subplots(figsize=(9, 4))
    x = np.arange(len(pts))
    ax.bar(x - 0.2, [p.get("ratio_time") or 0 for p in pts], 0.4, label="step time")
    ax.bar(x + 0.2, [p.get("ratio_memory") or 0 for p in pts], 0.4, label="XLA memory")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(x, [p["mechanism"] for p in pts], rotation=45, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel("ratio to softmax")
    c = result["config"]
    ax.set_title(f"training step, dual encoder T={c.get('seq_len')}, B={c.get('batch')}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- report


def _at(points, name, seq_len, mode, pass_="fwd_bwd"):
    return next(
        (
            p
            for p in points
            if p.get("mechanism") == name
            and p.get("seq_len") == seq_len
            and p.get("mode") == mode
            and p.get("pass") == pass_
        ),
        None,
    )


def crossing(points: list[dict], name: str, mode: str, pass_: str = "fwd_bwd") -> str:
    """Where `name`'s time ratio to softmax first drops below 1, log-interpolated in T."""
    series = sorted(
        (p["seq_len"], p["ratio_time"], p.get("ratio_time_extrapolated", False))
        for p in points
        if p.get("mechanism") == name
        and p.get("mode") == mode
        and p.get("pass") == pass_
        and p.get("ratio_time")
    )
    if not series:
        return "-"
    if series[0][1] < 1:
        return f"< {series[0][0]} (already {_x(series[0][1])})"
    for (t0, r0, _), (t1, r1, ext) in zip(series, series[1:]):
        if r1 < 1 <= r0:
            # log r is ~linear in log T between two doublings
            f = math.log(r0) / (math.log(r0) - math.log(r1))
            t = math.exp(math.log(t0) + f * (math.log(t1) - math.log(t0)))
            return f"~{t:.0f}{' (vs extrapolated softmax)' if ext else ''}"
    return f"> {series[-1][0]} (still {_x(series[-1][1])})"


def growth_per_doubling(points: list[dict], name: str, mode: str, pass_: str = "fwd_bwd"):
    """Time factor per doubling of T: the per-doubling factors over the measured series."""
    series = sorted(
        (p["seq_len"], p["time_ms"])
        for p in points
        if p.get("mechanism") == name
        and p.get("mode") == mode
        and p.get("pass") == pass_
        and p.get("time_ms")
    )
    factors = [(b[1] / a[1]) ** (1 / math.log2(b[0] / a[0])) for a, b in zip(series, series[1:])]
    return [(series[i + 1][0], f) for i, f in enumerate(factors)]


def merge_scaling(results: Sequence[dict]) -> dict:
    """One scaling result from several runs (e.g. a forward-only run at fewer T beside the
    forward+backward run, or softmax rerun at the T it was skipped at): points concatenated;
    a later run's point replaces an earlier one only where the earlier has no time (skipped,
    error), so measured points keep their same-run ratios. Ratios are recomputed; they compare
    points of different runs only where a gap was filled."""
    if len(results) == 1:
        return results[0]
    index: dict = {}
    for r in results:
        for p in r["points"]:
            key = (
                p.get("mechanism"),
                p.get("seq_len"),
                p.get("mode"),
                p.get("pass"),
                p.get("note"),
            )
            if "seq_len" in p:
                key = key[:4]
            if key in index and index[key].get("time_ms"):
                continue
            index[key] = {k: v for k, v in p.items() if not k.startswith("ratio_")}
    config = dict(results[0]["config"])
    for field in ("modes", "passes", "seq_lens"):
        config[field] = list(dict.fromkeys(x for r in results for x in r["config"][field]))
    return {
        "kind": "scaling",
        "environment": results[0]["environment"],
        "environments": [r["environment"] for r in results],
        "config": config,
        "mechanisms": sorted(
            dict.fromkeys(n for r in results for n in r["mechanisms"]), key=_registry_order
        ),
        "points": add_ratios(list(index.values())),
    }


def _registry_order(name: str) -> int:
    known = bench_names()
    return known.index(name) if name in known else len(known)


def fitted_exponent(points: list[dict], name: str, mode: str, pass_: str = "fwd_bwd"):
    """Least-squares slope b of log time against log T over every measured point (time ~ T^b),
    less sensitive to one noisy point than the per-doubling factors; None below 2 points."""
    series = [
        (p["seq_len"], p["time_ms"])
        for p in points
        if p.get("mechanism") == name
        and p.get("mode") == mode
        and p.get("pass") == pass_
        and p.get("time_ms")
    ]
    if len({t for t, _ in series}) < 2:
        return None
    x, y = np.log2([t for t, _ in series]), np.log2([ms for _, ms in series])
    return float(np.polyfit(x, y, 1)[0])


def report(
    scaling=None,
    fidelity=None,
    model=None,
    *,
    at_seq_len: int | None = None,
    growth_from: int | None = None,
) -> str:
    """The markdown summary of the JSON results (any may be None; `scaling` and `model` may be
    lists of results, merged with `merge_scaling` / `merge_model`). Growth per doubling and the
    fitted exponent use the points with ``T >= growth_from`` (all by default)."""
    out = []
    if isinstance(scaling, (list, tuple)):
        scaling = merge_scaling(scaling)
    if isinstance(model, (list, tuple)):
        model = merge_model(model)
    if scaling:
        out.append(_scaling_summary(scaling, at_seq_len, growth_from or 0))
        out.append("\n### All scaling points\n")
        out.append(scaling_table(scaling))
    if fidelity:
        out.append("\n### Fidelity\n")
        out.append(fidelity_table(fidelity))
    if model:
        out.append("\n### Training step\n")
        out.append(model_table(model))
    return "\n".join(out).strip() + "\n"


def _scaling_summary(scaling: dict, at_seq_len: int | None, growth_from: int) -> str:
    pts = [p for p in scaling["points"] if "seq_len" in p]
    grown = [p for p in pts if p["seq_len"] >= growth_from]
    main_pass = "fwd_bwd" if any(p["pass"] == "fwd_bwd" for p in pts) else "fwd"
    label = "fwd+bwd" if main_pass == "fwd_bwd" else "fwd"
    linear_times = [
        p["seq_len"]
        for p in pts
        if p.get("time_ms") and p["pass"] == main_pass and not p.get("quadratic")
    ]
    at = at_seq_len or max(linear_times or [p["seq_len"] for p in pts])
    env, c = scaling["environment"], scaling["config"]
    out = [
        f"### Scaling: B={c['batch']}, H={c['heads']}, d={c['head_dim']}, backend "
        f"{env['backend']} ({env['cpu_count']} cores; 1-min load average when the run ended: "
        f"{_load(env)})\n"
    ]
    for mode in c["modes"]:
        if not any(p["mode"] == mode for p in pts):
            continue
        out.append(f"\n#### {label} at T={at}, {mode} (ratios to softmax)\n")
        out.append(
            f"| mechanism | {label} time | / softmax | / softmax_xla | fwd time | / softmax"
            f" | XLA memory ({label}) | / softmax | crosses softmax at T"
            f" | time ~ T^b: b (x per doubling) | {label} time growth per doubling of T |"
        )
        out.append("|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---|")
        for name in scaling["mechanisms"]:
            p = _at(pts, name, at, mode, main_pass)
            if p is None:
                continue
            pf = _at(pts, name, at, mode, "fwd") if main_pass != "fwd" else None
            growth = ", ".join(
                f"->{t // 1024}k: {f:.2f}x" if t >= 1024 else f"->{t}: {f:.2f}x"
                for t, f in growth_per_doubling(grown, name, mode, main_pass)
            )
            time_cell = _fmt_ms(p["time_ms"]) if p.get("time_ms") else f"{p['status']}"
            b = fitted_exponent(grown, name, mode, main_pass)
            fit = "-" if b is None else f"{b:.2f} ({2**b:.2f}x)"
            cross = "-" if name == SOFTMAX else crossing(pts, name, mode, main_pass)
            out.append(
                f"| {name} | {time_cell}"
                f" | {_ratio_cell(p, 'ratio_time')} | {_ratio_cell(p, 'ratio_time_xla')}"
                f" | {_fmt_ms(pf.get('time_ms')) if pf and pf.get('time_ms') else '-'}"
                f" | {_ratio_cell(pf, 'ratio_time') if pf else '-'}"
                f" | {_fmt_bytes(_mem(p))} | {_num(p.get('ratio_memory'))}"
                f" | {cross} | {fit} | {growth or '-'} |"
            )
    if any(p.get("ratio_time_extrapolated") or p.get("ratio_time_xla_extrapolated") for p in pts):
        out.append(
            "\n`~`: the reference (softmax / softmax_xla) was not run at this T (memory or time "
            "limit); its time is extrapolated as T^2 from its largest measured T. Memory is "
            "XLA's static figure from compilation, so memory ratios are exact at every T."
        )
    return "\n".join(out)


def _ratio_cell(p: dict | None, field: str) -> str:
    if p is None or p.get(field) is None:
        return "-"
    return ("~" if p.get(f"{field}_extrapolated") else "") + _x(p[field])


def _load(env):
    load = env.get("loadavg")
    return "n/a" if not load else f"{load[0]:.1f}"


# ----------------------------------------------------------------------------- command line


def _write_json(result: dict, path: str | None) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as fh:
            json.dump(result, fh, indent=1)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mechanisms", nargs="+", default=None, help="default: every registered one")
    p.add_argument("--out", default=None, help="JSON results path")
    p.add_argument("--plot", default=None, help="PNG plot path")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--jsonl", default=None, help=argparse.SUPPRESS)  # child -> parent results
    p.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE first (it registers more mechanisms); repeatable",
    )


def _isolation(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--isolate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one subprocess per mechanism under a hard timeout (default on)",
    )
    p.add_argument("--mechanism-timeout-s", type=float, default=900.0)


def _strip(argv: Sequence[str], flags: Sequence[str]) -> list[str]:
    """argv without `flags` (and their values): what the parent passes to its children."""
    out, skip = [], False
    for a in argv:
        if skip:
            if a.startswith("--"):
                skip = False
            else:
                continue
        name = a.split("=", 1)[0]
        if name in flags:
            skip = "=" not in a and name not in _BOOLEAN_FLAGS
            continue
        out.append(a)
    return out


_BOOLEAN_FLAGS = ("--quiet", "--isolate", "--no-isolate")
_PARENT_ONLY = (
    "--mechanisms",
    "--out",
    "--plot",
    "--quiet",
    "--isolate",
    "--no-isolate",
    "--jsonl",
)


def main(argv: Sequence[str] | None = None) -> dict | str:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m train.bench", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("scaling", help="time and memory vs T")
    _common(s)
    _isolation(s)
    s.add_argument("--seq-lens", type=int, nargs="+", default=list(ScalingConfig.seq_lens))
    s.add_argument("--batch", type=int, default=1)
    s.add_argument("--heads", type=int, default=4)
    s.add_argument("--head-dim", type=int, default=64)
    s.add_argument(
        "--modes", nargs="+", default=["noncausal", "causal"], choices=["noncausal", "causal"]
    )
    s.add_argument("--passes", nargs="+", default=list(PASSES), choices=list(PASSES))
    s.add_argument("--repeats", type=int, default=3, help="max timed calls after the warm-up")
    s.add_argument("--min-total-s", type=float, default=2.0, help="fewer repeats past this")
    s.add_argument("--memory-budget-gib", type=float, default=None, help="default 0.3 x RAM")
    s.add_argument("--time-limit-s", type=float, default=60.0, help="max predicted s per call")

    f = sub.add_parser("fidelity", help="error vs softmax as the budget grows")
    _common(f)
    f.add_argument("--budgets", type=int, nargs="+", default=[16, 64, 256, 1024])
    f.add_argument("--seeds", type=int, default=3)
    f.add_argument("--seq-len", type=int, default=1024)
    f.add_argument("--batch", type=int, default=1)
    f.add_argument("--heads", type=int, default=4)
    f.add_argument("--head-dim", type=int, default=64)
    f.add_argument("--inputs", nargs="+", default=["gaussian", "clustered"])
    f.add_argument("--max-quadratic-budget", type=int, default=256)

    k = sub.add_parser(
        "kernels", help="Pallas kernels vs XLA: every other flag goes to python -m kernels.bench"
    )
    k.add_argument("--out", default=None)

    m = sub.add_parser("model", help="LRA-Retrieval-shaped training step per mechanism")
    _common(m)
    _isolation(m)
    m.add_argument("--seq-len", type=int, default=4096)
    m.add_argument("--batch", type=int, default=2)
    m.add_argument("--dim", type=int, default=64)
    m.add_argument("--heads", type=int, default=4)
    m.add_argument("--mlp", type=int, default=128)
    m.add_argument("--layers", type=int, default=2)
    m.add_argument("--repeats", type=int, default=3)
    m.add_argument("--min-total-s", type=float, default=2.0)
    m.add_argument("--memory-budget-gib", type=float, default=None, help="default 0.3 x RAM")

    from train import bench_kernel_fit

    kf = sub.add_parser("kernel_fit", help="fit learnable kernels to a non-stationary target")
    bench_kernel_fit.add_arguments(kf)

    r = sub.add_parser("report", help="markdown summary from the JSON results")
    r.add_argument("--scaling", nargs="+", default=None, help="one or more scaling JSONs")
    r.add_argument("--fidelity", default=None)
    r.add_argument("--model", nargs="+", default=None, help="one or more model JSONs")
    r.add_argument("--at-seq-len", type=int, default=None, help="T of the summary tables")
    r.add_argument("--growth-from", type=int, default=None, help="growth uses T >= this")

    if argv and argv[0] == "kernels":
        args, rest = parser.parse_known_args(argv)
    else:
        args, rest = parser.parse_args(argv), []

    def log(msg):
        if not getattr(args, "quiet", False):
            print(msg, file=sys.stderr, flush=True)

    if args.command == "kernels":
        from kernels import bench as kbench

        table = kbench.main(rest)
        _write_json({"kind": "kernels", "environment": environment(), "table": table}, args.out)
        return table

    if args.command == "kernel_fit":
        return bench_kernel_fit.main_from_args(args)

    if args.command == "report":
        loaded = {}
        for key in ("scaling", "fidelity", "model"):
            paths = getattr(args, key)
            if isinstance(paths, str):
                paths = [paths]
            if paths:
                results = []
                for path in paths:
                    with open(path) as fh:
                        results.append(json.load(fh))
                loaded[key] = results[0] if key == "fidelity" else results
        text = report(**loaded, at_seq_len=args.at_seq_len, growth_from=args.growth_from)
        print(text)
        return text

    for module in args.imports:
        importlib.import_module(module)
    child_argv = _strip(argv, _PARENT_ONLY)
    if args.command == "scaling":
        budget = args.memory_budget_gib
        cfg = ScalingConfig(
            seq_lens=tuple(args.seq_lens),
            batch=args.batch,
            heads=args.heads,
            head_dim=args.head_dim,
            modes=tuple(args.modes),
            passes=tuple(args.passes),
            repeats=args.repeats,
            min_total_s=args.min_total_s,
            memory_budget_gib=default_memory_budget_gib() if budget is None else budget,
            time_limit_s=args.time_limit_s,
        )
        result = run_scaling(
            cfg,
            args.mechanisms,
            isolate=args.isolate,
            mechanism_timeout_s=args.mechanism_timeout_s,
            argv=child_argv,
            jsonl=args.jsonl,
            log=log,
        )
        table = scaling_table(result) + bench_peers.peer_table(result)
        plot = plot_scaling
    elif args.command == "fidelity":
        result = fidelity_sweep(
            args.mechanisms,
            budgets=args.budgets,
            seeds=args.seeds,
            seq_len=args.seq_len,
            batch=args.batch,
            heads=args.heads,
            head_dim=args.head_dim,
            inputs=args.inputs,
            max_quadratic_budget=args.max_quadratic_budget,
            log=log,
        )
        table = fidelity_table(result)
        plot = plot_fidelity
    else:
        budget = args.memory_budget_gib
        result = run_model(
            args.mechanisms,
            isolate=args.isolate,
            mechanism_timeout_s=args.mechanism_timeout_s,
            argv=child_argv,
            jsonl=args.jsonl,
            log=log,
            seq_len=args.seq_len,
            batch=args.batch,
            dim=args.dim,
            heads=args.heads,
            mlp=args.mlp,
            layers=args.layers,
            repeats=args.repeats,
            min_total_s=args.min_total_s,
            memory_budget_gib=default_memory_budget_gib() if budget is None else budget,
        )
        table = model_table(result)
        plot = plot_model
    if not args.jsonl:  # a child only reports through its JSON lines
        print(table)
        _write_json(result, args.out)
        if args.plot:
            plot(result, args.plot)
    return result


if __name__ == "__main__":
    main()
