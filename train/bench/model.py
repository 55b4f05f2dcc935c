"""``python -m train.bench model``: one training step (AdamW) of a small dual encoder shaped
like LRA Retrieval (two documents of T = 4k bytes, B = 2) per mechanism: step time and memory
as ratios to softmax.

The model is the training stack's own (`train.models.DualEncoderClassifier` over an
`train.models.Encoder` with mean pooling and learned positions, so the benchmark times the
blocks that are trained); each document keeps a random prefix of at least half its length,
the rest is padding (token 0), as in LRA.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from train.bench import common, isolation, timing
from train.bench.common import SOFTMAX
from train.models import DualEncoderClassifier, Encoder

VOCAB = 256  # bytes


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
    attention_config: dict | None = None,
) -> dict:
    """Compiles and times one AdamW training step of the dual encoder with mechanism `name`
    (`attention_config`: its options, e.g. ``{"num_features": 32}``; default its own)."""
    encoder = Encoder(
        vocab_size=VOCAB,
        max_len=seq_len,
        num_layers=layers,
        emb_dim=dim,
        num_heads=heads,
        qkv_dim=dim,
        mlp_dim=mlp,
        attention=name,
        attention_config=tuple((attention_config or {}).items()),
        pooling="mean",
    )
    model = DualEncoderClassifier(encoder=encoder, num_classes=2)
    k = jax.random.split(jax.random.key(0), 6)
    # Padding as in LRA: each document keeps a random prefix of at least half its length.
    lens = jax.random.randint(k[2], (2, batch), seq_len // 2, seq_len + 1)
    tok1, tok2 = (
        jnp.where(
            jnp.arange(seq_len)[None, :] < lens[i][:, None],
            jax.random.randint(key, (batch, seq_len), 1, VOCAB),
            0,
        )
        for i, key in enumerate(k[:2])
    )
    labels = jax.random.randint(k[3], (batch,), 0, 2)
    # jitted: eager init dispatches (and compiles) op by op, slower than one compile
    init = jax.jit(model.init)
    variables = nn.meta.unbox(init({"params": k[4], "attention": k[5]}, tok1, tok2))
    params, rest = variables["params"], {c: v for c, v in variables.items() if c != "params"}
    opt = optax.adamw(1e-4)
    opt_state = opt.init(params)

    def step(params, opt_state, rng, tok1, tok2, labels):
        def loss_fn(p):
            logits = model.apply(
                {"params": p, **rest}, tok1, tok2, deterministic=False, rngs={"attention": rng}
            )
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    args = (params, opt_state, jax.random.key(1), tok1, tok2, labels)
    point = {"mechanism": name, "status": "ok", "note": ""}
    point["num_params"] = int(sum(x.size for x in jax.tree_util.tree_leaves(params)))
    point.update(
        timing.measure(
            step,
            args,
            repeats=repeats,
            min_total_s=min_total_s,
            skip=lambda fields: timing.over_budget(fields["memory"], memory_budget_gib),
        )
    )
    return point


def run_model(
    mechanisms: Sequence[str] | None = None,
    options: isolation.RunOptions = isolation.IN_PROCESS,
    **kwargs,
) -> dict:
    """`model_point` (settings `kwargs`) for every registry mechanism, with ratios to softmax;
    `options`: in this process (default) or one subprocess per mechanism."""
    names = common.bench_names(mechanisms, with_xla=False)

    def measure_one(name, emit):
        try:
            point = model_point(name, **kwargs)
        except Exception as e:  # noqa: BLE001 -- one failing mechanism must not end the run
            point = {"mechanism": name, "status": "error", "note": f"{type(e).__name__}: {e}"}
        emit(point)
        return [point]

    def describe(p):
        return f"{p['mechanism']}: " + (
            f"{p['time_ms']:.0f} ms" if p.get("time_ms") else f"{p['status']} {p.get('note', '')}"
        )

    points = isolation.run_mechanisms(names, measure_one, options, label="model", describe=describe)
    return {
        "kind": "model",
        "environment": common.environment(),
        "config": {"task": "LRA Retrieval shape (dual encoder, AdamW step)", **kwargs},
        "mechanisms": names,
        "points": model_ratios(points),
    }


def model_ratios(points: list[dict]) -> list[dict]:
    """Adds ``ratio_time`` / ``ratio_memory`` to softmax (where softmax has the figure)."""
    ref = next((p for p in points if p["mechanism"] == SOFTMAX and p.get("time_ms")), None)
    mem = common.total_memory
    ref_mem = next((mem(p) for p in points if p["mechanism"] == SOFTMAX and mem(p)), None)
    for p in points:
        if ref and p.get("time_ms"):
            p["ratio_time"] = p["time_ms"] / ref["time_ms"]
        if ref_mem and mem(p):
            p["ratio_memory"] = mem(p) / ref_mem
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
    names = sorted(by_name, key=common.registry_order)
    return {
        **results[0],
        "environments": [r["environment"] for r in results],
        "mechanisms": names,
        "points": model_ratios([by_name[n] for n in names]),
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
        mem = common.total_memory(p)
        step = common.fmt_ms(p["time_ms"]) if p.get("time_ms") else p["status"]
        out.append(
            f"| {p['mechanism']} | {step}"
            f" | {common.fmt_ratio(p.get('ratio_time'))} | {common.fmt_bytes(mem)}"
            f" | {common.fmt_ratio(p.get('ratio_memory'))} | {p.get('note', '')} |"
        )
    return "\n".join(out) + "\n"


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
    common.save_figure(fig, path)


def add_arguments(p: argparse.ArgumentParser) -> None:
    common.add_common_arguments(p)
    isolation.add_isolation_arguments(p)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--mlp", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--min-total-s", type=float, default=2.0)
    p.add_argument("--memory-budget-gib", type=float, default=None, help="default 0.3 x RAM")


def run_from_args(args: argparse.Namespace, child_argv: Sequence[str], log) -> tuple[dict, str]:
    """``(result, markdown)`` of the parsed `add_arguments` flags."""
    budget = args.memory_budget_gib
    result = run_model(
        args.mechanisms,
        isolation.RunOptions.from_args(args, child_argv, log),
        seq_len=args.seq_len,
        batch=args.batch,
        dim=args.dim,
        heads=args.heads,
        mlp=args.mlp,
        layers=args.layers,
        repeats=args.repeats,
        min_total_s=args.min_total_s,
        memory_budget_gib=common.default_memory_budget_gib() if budget is None else budget,
    )
    return result, model_table(result)


plot = plot_model
