"""``python -m train.bench report``: the markdown summary (ratios at one T, crossing points,
growth per doubling, fidelity and model tables) from the JSON files of the other subcommands."""

from __future__ import annotations

import argparse
import json
import math

import numpy as np

from train.bench import common
from train.bench import fidelity as fidelity_lib
from train.bench import model as model_lib
from train.bench import scaling as scaling_lib
from train.bench.common import SOFTMAX


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
        return f"< {series[0][0]} (already {common.fmt_x(series[0][1])})"
    for (t0, r0, _), (t1, r1, ext) in zip(series, series[1:]):
        if r1 < 1 <= r0:
            # log r is ~linear in log T between two doublings
            f = math.log(r0) / (math.log(r0) - math.log(r1))
            t = math.exp(math.log(t0) + f * (math.log(t1) - math.log(t0)))
            return f"~{t:.0f}{' (vs extrapolated softmax)' if ext else ''}"
    return f"> {series[-1][0]} (still {common.fmt_x(series[-1][1])})"


def _time_series(points: list[dict], name: str, mode: str, pass_: str) -> list[tuple[int, float]]:
    """``(T, time_ms)`` of `name`'s measured points of one mode and pass, T ascending."""
    return sorted(
        (p["seq_len"], p["time_ms"])
        for p in points
        if p.get("mechanism") == name
        and p.get("mode") == mode
        and p.get("pass") == pass_
        and p.get("time_ms")
    )


def growth_per_doubling(points: list[dict], name: str, mode: str, pass_: str = "fwd_bwd"):
    """Time factor per doubling of T: the per-doubling factors over the measured series."""
    series = _time_series(points, name, mode, pass_)
    factors = [(b[1] / a[1]) ** (1 / math.log2(b[0] / a[0])) for a, b in zip(series, series[1:])]
    return [(series[i + 1][0], f) for i, f in enumerate(factors)]


def fitted_exponent(points: list[dict], name: str, mode: str, pass_: str = "fwd_bwd"):
    """Least-squares slope b of log time against log T over every measured point (time ~ T^b),
    less sensitive to one noisy point than the per-doubling factors; None below 2 points."""
    series = _time_series(points, name, mode, pass_)
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
        scaling = scaling_lib.merge_scaling(scaling)
    if isinstance(model, (list, tuple)):
        model = model_lib.merge_model(model)
    if scaling:
        out.append(_scaling_summary(scaling, at_seq_len, growth_from or 0))
        out.append("\n### All scaling points\n")
        out.append(scaling_lib.scaling_table(scaling))
    if fidelity:
        out.append("\n### Fidelity\n")
        out.append(fidelity_lib.fidelity_table(fidelity))
    if model:
        out.append("\n### Training step\n")
        out.append(model_lib.model_table(model))
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
            time_cell = common.fmt_ms(p["time_ms"]) if p.get("time_ms") else f"{p['status']}"
            b = fitted_exponent(grown, name, mode, main_pass)
            fit = "-" if b is None else f"{b:.2f} ({2**b:.2f}x)"
            cross = "-" if name == SOFTMAX else crossing(pts, name, mode, main_pass)
            out.append(
                f"| {name} | {time_cell}"
                f" | {_ratio_cell(p, 'ratio_time')} | {_ratio_cell(p, 'ratio_time_xla')}"
                f" | {common.fmt_ms(pf.get('time_ms')) if pf and pf.get('time_ms') else '-'}"
                f" | {_ratio_cell(pf, 'ratio_time') if pf else '-'}"
                f" | {common.fmt_bytes(common.total_memory(p))}"
                f" | {common.fmt_ratio(p.get('ratio_memory'))}"
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
    return ("~" if p.get(f"{field}_extrapolated") else "") + common.fmt_x(p[field])


def _load(env):
    load = env.get("loadavg")
    return "n/a" if not load else f"{load[0]:.1f}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scaling", nargs="+", default=None, help="one or more scaling JSONs")
    p.add_argument("--fidelity", default=None)
    p.add_argument("--model", nargs="+", default=None, help="one or more model JSONs")
    p.add_argument("--at-seq-len", type=int, default=None, help="T of the summary tables")
    p.add_argument("--growth-from", type=int, default=None, help="growth uses T >= this")


def main_from_args(args: argparse.Namespace) -> str:
    """Reads the JSON files named by the `add_arguments` flags, prints the report."""
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
