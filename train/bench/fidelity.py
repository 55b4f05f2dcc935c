"""``python -m train.bench fidelity``: relative error ``|out - softmax|_F / |softmax|_F`` of
each mechanism as its budget (``num_features`` / ``num_landmarks`` / ``num_samples``) grows,
on Gaussian and on clustered inputs, mean and std over seeds."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import linattn_jax as la
from train.bench import common
from train.bench.common import SOFTMAX


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
    keys = common.budget_keys(name)
    if not keys:
        return [(None, None)]
    out = []
    for key in keys:
        for b in budgets:
            if max_quadratic_budget and common.is_quadratic(name) and b > max_quadratic_budget:
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
    names = [n for n in common.bench_names(mechanisms, with_xla=False) if n != SOFTMAX]
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
            f = jax.jit(common.attention_callable(name, causal=False, config=config))
            t0 = time.perf_counter()
            for kind in inputs:
                errors = []
                for s in range(seeds):
                    trainable, fixed, rng = common.mechanism_state(
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
        "environment": common.environment(),
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
                ax.axhline(these[0]["mean"], ls=":", color=common.plot_color(cmap, c), label=label)
                continue
            these.sort(key=lambda r: r["budget"])
            ax.errorbar(
                [r["budget"] for r in these],
                [r["mean"] for r in these],
                yerr=[r["std"] for r in these],
                marker="o",
                ms=3,
                capsize=2,
                color=common.plot_color(cmap, c),
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


def add_arguments(p: argparse.ArgumentParser) -> None:
    common.add_common_arguments(p)
    p.add_argument("--budgets", type=int, nargs="+", default=[16, 64, 256, 1024])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--inputs", nargs="+", default=["gaussian", "clustered"])
    p.add_argument("--max-quadratic-budget", type=int, default=256)


def run_from_args(args: argparse.Namespace, child_argv: Sequence[str], log) -> tuple[dict, str]:
    """``(result, markdown)`` of the parsed `add_arguments` flags (`child_argv` unused: the
    sweep runs in this process)."""
    del child_argv
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
    return result, fidelity_table(result)


plot = plot_fidelity
