"""``python -m train.bench scaling``: forward and forward+backward wall time and XLA's compiled
memory of every mechanism (plus ``softmax_xla``) over a range of T, causal and non-causal
where supported, with ratios to ``softmax`` (and ``softmax_xla``) measured in the same run.

A point whose compiled memory exceeds ``--memory-budget-gib``, or whose predicted time
(extrapolated from the smaller T of the same series) exceeds ``--time-limit-s``, is compiled
(so its memory is still reported) but not run, with a note.

Every point carries ``matmul_flops`` and, when run, ``gflops`` (`timing.measure`);
``--flop-rate`` also times a plain matmul at each T before and after the mechanisms
(`reference_matmul`, under ``"reference"``) and adds a table of each point's FLOP rate as a
share of the matmul's.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable, Sequence

import jax

from train.bench import common, isolation, peers, timing
from train.bench.common import PASSES, SOFTMAX, SOFTMAX_XLA


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
    memory_budget_gib: float = dataclasses.field(default_factory=common.default_memory_budget_gib)
    time_limit_s: float = 60.0
    flop_rate: bool = False


def predict_seconds(series: list[tuple[int, float]], seq_len: int, quadratic: bool) -> float | None:
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


class Series:
    """The measured ``(T, seconds)`` of one row's (mode, pass) series, and the rule that skips
    its next points: one whose compiled memory exceeds ``cfg.memory_budget_gib``, or whose
    time `predict_seconds` puts over ``cfg.time_limit_s``, is compiled (so its memory is still
    reported) but not run; the larger T of that series are then skipped too."""

    def __init__(self, cfg: ScalingConfig, quadratic: bool):
        self.cfg, self.quadratic = cfg, quadratic
        self.times: dict[tuple[str, str], list[tuple[int, float]]] = {}
        self.stopped: dict[tuple[str, str], str] = {}

    def reason(self, key: tuple[str, str], seq_len: int, fields: dict) -> str | None:
        if key in self.stopped:
            return self.stopped[key]
        reason = timing.over_budget(fields["memory"], self.cfg.memory_budget_gib)
        predicted = predict_seconds(self.times.get(key, []), seq_len, self.quadratic)
        if reason is None and predicted is not None and predicted > self.cfg.time_limit_s:
            reason = f"predicted {predicted:.0f} s/call > limit {self.cfg.time_limit_s:.0f} s"
        return reason

    def run(self, point: dict, fn: Callable, args, emit=None) -> dict:
        """Measures `fn(*args)` into `point` (its ``seq_len``, ``mode`` and ``pass`` set):
        status ``ok``, ``skipped`` (with the note) or ``error`` (one failing point must not
        end the run); `emit` sees it."""
        key, seq_len = (point["mode"], point["pass"]), point["seq_len"]
        point.update(status="ok", note="")
        cfg = self.cfg
        try:
            point.update(
                timing.measure(
                    fn,
                    args,
                    repeats=cfg.repeats,
                    min_total_s=cfg.min_total_s,
                    skip=lambda fields: self.reason(key, seq_len, fields),
                )
            )
            if point["status"] == "ok":
                self.times.setdefault(key, []).append((seq_len, point["time_ms"] / 1e3))
            elif key not in self.stopped:
                self.stopped[key] = f"skipped at T={seq_len}: {point['note']}"
                if "memory" in point["note"]:
                    # Larger T only needs more memory; later points still report theirs.
                    self.stopped[key] = point["note"].replace(
                        "memory", f"memory at T={seq_len}:", 1
                    )
        except Exception as e:  # noqa: BLE001 -- one failing point must not end the run
            point.update(status="error", note=f"{type(e).__name__}: {str(e)[:300]}")
        if emit is not None:
            emit(point)
        return point


def scaling_points(
    name: str, cfg: ScalingConfig, emit: Callable[[dict], None] | None = None
) -> list[dict]:
    """Every (T, mode, pass) point of one mechanism, T ascending; `emit` sees each as it lands."""
    points = []
    quadratic = common.is_quadratic(name)
    modes = [m for m in cfg.modes if m == "noncausal" or common.supports_causal(name)]
    trainable, fixed, rng = common.mechanism_state(name, heads=cfg.heads, head_dim=cfg.head_dim)
    series = Series(cfg, quadratic)
    for seq_len in cfg.seq_lens:
        q, k, v, ct = common.random_qkv(cfg.batch, seq_len, cfg.heads, cfg.head_dim)
        for mode in modes:
            f = common.attention_callable(name, causal=mode == "causal")
            for pass_ in cfg.passes:
                fn, args = (f, (q, k, v, trainable, fixed, rng))
                if pass_ == "fwd_bwd":
                    fn, args = common.fwd_bwd(f), (*args, ct)
                point = {
                    "mechanism": name,
                    "seq_len": seq_len,
                    "mode": mode,
                    "pass": pass_,
                    "quadratic": quadratic,
                }
                points.append(series.run(point, fn, args, emit))
    # its peer, if any, beside it
    return points + peers.peer_points(name, cfg, emit, Series(cfg, quadratic))


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
        mem, ref_mem = common.total_memory(p), None
        if ref is not None:
            ref_mem = common.total_memory(ref)
        if mem and ref_mem:
            p["ratio_memory"] = mem / ref_mem
    return points


def run_scaling(
    cfg: ScalingConfig,
    mechanisms: Sequence[str] | None = None,
    options: isolation.RunOptions = isolation.IN_PROCESS,
) -> dict:
    """All scaling points of `mechanisms` (default: the registry plus softmax_xla) with ratios;
    `options`: in this process (default) or one subprocess per mechanism."""
    names = common.bench_names(mechanisms)
    before = [reference_matmul(t, cfg) for t in cfg.seq_lens] if cfg.flop_rate else []
    points = isolation.run_mechanisms(
        names,
        lambda name, emit: scaling_points(name, cfg, emit),
        options,
        label="scaling",
        describe=_describe,
    )
    result = {
        "kind": "scaling",
        "environment": common.environment(),
        "config": dataclasses.asdict(cfg),
        "mechanisms": peers.peer_names(names),
        "points": peers.add_peer_ratios(add_ratios(points)),
    }
    if cfg.flop_rate:
        after = [reference_matmul(t, cfg) for t in cfg.seq_lens]
        result["reference"] = before + after
    return result


def reference_matmul(seq_len: int, cfg: ScalingConfig) -> dict:
    """This CPU's matmul rate at the size of one attention projection: ``[B * T, H * d] @
    [H * d, H * d]`` in float32, timed like the mechanisms."""
    n, c = cfg.batch * seq_len, cfg.heads * cfg.head_dim
    ka, kb = jax.random.split(jax.random.key(0))
    args = (jax.random.normal(ka, (n, c)), jax.random.normal(kb, (c, c)))

    def fn(a, b):
        return a @ b

    point = {"seq_len": seq_len, "shape": f"[{n}, {c}] @ [{c}, {c}]"}
    point.update(timing.measure(fn, args, repeats=cfg.repeats, min_total_s=cfg.min_total_s))
    return point


def flop_rate_table(result: dict) -> str:
    """Markdown: each point's matrix-product FLOP rate (`timing.matmul_flops` / median time)
    as a share of the reference matmul's (the faster of its two timings at that T)."""
    out = []
    for seq_len in sorted({r["seq_len"] for r in result.get("reference", [])}):
        refs = [r for r in result["reference"] if r["seq_len"] == seq_len]
        best = max(refs, key=lambda r: r["gflops"])
        rates = " and ".join(f"{r['gflops']:.1f}" for r in refs)
        cols = [(m, s) for m in result["config"]["modes"] for s in result["config"]["passes"]]
        out += [
            f"\n#### effective FLOP rate at T={seq_len}: GFLOP/s (share of the matmul's "
            f"{best['gflops']:.1f} GFLOP/s)\n",
            f"Reference: {best['shape']} float32, {rates} GFLOP/s before and after the "
            "mechanisms. FLOPs: the matrix products only (`train.bench.timing.matmul_flops`).\n",
            "| mechanism | " + " | ".join(f"{s.replace('_', '+')}, {m}" for m, s in cols) + " |",
            "|---|" + "---:|" * len(cols),
        ]
        for name in result["mechanisms"]:
            cells = []
            for mode, pass_ in cols:
                p = next(
                    (
                        p
                        for p in result["points"]
                        if (p["mechanism"], p.get("seq_len"), p.get("mode"), p.get("pass"))
                        == (name, seq_len, mode, pass_)
                    ),
                    None,
                )
                rate = p.get("gflops") if p else None
                cells.append(f"{rate:.1f} ({100 * rate / best['gflops']:.0f}%)" if rate else "")
            if any(cells):
                out.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(out).strip() + "\n" if out else ""


def _describe(p: dict) -> str:
    """A progress line of one point."""
    if "seq_len" not in p:
        return f"{p['mechanism']}: {p['note']}"
    shown = f"{p['time_ms']:.1f} ms" if p.get("time_ms") else p["status"]
    return f"{p['mechanism']} T={p['seq_len']} {p['mode']} {p['pass']}: {shown}"


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
            dict.fromkeys(n for r in results for n in r["mechanisms"]), key=common.registry_order
        ),
        "points": add_ratios(list(index.values())),
    }


# ----------------------------------------------------------------------------- tables, plot


def _ratio_suffix(r: float | None, extrapolated: bool = False) -> str:
    if r is None:
        return ""
    return f" ({'~' if extrapolated else ''}{common.fmt_x(r)})"


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
        total = common.total_memory(p)
        if total is None:
            return "n/a"
        return common.fmt_bytes(total) + _ratio_suffix(p.get("ratio_memory"))
    if p.get("time_ms"):
        return common.fmt_ms(p["time_ms"]) + _ratio_suffix(
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
                    xy = [
                        (p["seq_len"], common.total_memory(p) / common.MIB)
                        for p in rows
                        if common.total_memory(p)
                    ]
                if not xy:
                    continue
                # The JSON says which are quadratic (its mechanisms may not be registered here).
                style = "--" if any(p.get("quadratic") for p in rows) else "-"
                color = common.plot_color(cmap, c)
                ax.plot(*zip(*xy), style, marker="o", ms=3, color=color, label=name)
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
    common.save_figure(fig, path)


# ----------------------------------------------------------------------------- command line


def add_arguments(p: argparse.ArgumentParser) -> None:
    common.add_common_arguments(p)
    isolation.add_isolation_arguments(p)
    p.add_argument("--seq-lens", type=int, nargs="+", default=list(ScalingConfig.seq_lens))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument(
        "--modes", nargs="+", default=["noncausal", "causal"], choices=["noncausal", "causal"]
    )
    p.add_argument("--passes", nargs="+", default=list(PASSES), choices=list(PASSES))
    p.add_argument("--repeats", type=int, default=3, help="max timed calls after the warm-up")
    p.add_argument("--min-total-s", type=float, default=2.0, help="fewer repeats past this")
    p.add_argument("--memory-budget-gib", type=float, default=None, help="default 0.3 x RAM")
    p.add_argument("--time-limit-s", type=float, default=60.0, help="max predicted s per call")
    p.add_argument(
        "--flop-rate",
        action="store_true",
        help="time a plain matmul per T and report each point's FLOP rate as a share of it",
    )


def run_from_args(args: argparse.Namespace, child_argv: Sequence[str], log) -> tuple[dict, str]:
    """``(result, markdown)`` of the parsed `add_arguments` flags."""
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
        memory_budget_gib=common.default_memory_budget_gib() if budget is None else budget,
        time_limit_s=args.time_limit_s,
        flop_rate=args.flop_rate,
    )
    result = run_scaling(
        cfg, args.mechanisms, isolation.RunOptions.from_args(args, child_argv, log)
    )
    return result, scaling_table(result) + peers.peer_table(result) + flop_rate_table(result)


plot = plot_scaling
