"""Our performer against the public Performer-JAX, side by side in one process:
``python -m train.bench performer_jax --repo PATH``.

`PATH` is a checkout of google-research/google-research (``git clone
https://github.com/google-research/google-research``) or the file itself; the public
``performer/fast_attention/jax/fast_attention.py`` is loaded from there, not copied. It
imports ``gin`` and ``absl.logging`` for its configuration and logging only; where they are
not installed, empty stand-ins are put in ``sys.modules`` while the file loads (and removed
after), so nothing but jax is needed.

What is timed: the attention from q, k, v ``[B, T, H, d]`` (both sides' layout) to the
heads' outputs, forward and forward+backward (gradients of q, k, v for a fixed cotangent),
non-causal and causal (the public ``unidirectional=True``), each side jitted. Ours is
``performer`` with ``M`` shared features (``shared_features=True``: one projection for every
head, as the public code draws), its kept draw (``redraw="never"``, the default) and
``chunk_size=64`` causal; the public side is ``make_fast_softmax_attention(qkv_dim=d,
nb_features=M, ...)`` at its other defaults, two ways: with its projection drawn once
(``redraw_features=False``) and redrawn per call from a key seeded by the query
(``redraw_features=True``, its default, which puts a QR decomposition in every call). Both
sides run under the same XLA, so they have the same cores. Calls alternate (one of ours,
one of theirs) and each side's minimum is reported.
"""

from __future__ import annotations

import importlib.util
import os
import types

import jax

import linattn_jax as la
from train.bench import common
from train.bench.official import interleaved_min

PUBLIC_PATH = os.path.join("performer", "fast_attention", "jax", "fast_attention.py")


def _stand_ins() -> dict[str, types.ModuleType]:
    """Empty ``gin`` and ``absl.logging`` modules for whichever of them is not installed."""
    out = {}
    if importlib.util.find_spec("gin") is None:
        gin = types.ModuleType("gin")
        gin.configurable = lambda f=None, **kw: f if f is not None else (lambda g: g)
        gin.external_configurable = lambda *a, **kw: None
        out["gin"] = gin
    if importlib.util.find_spec("absl") is None:
        logging = types.ModuleType("absl.logging")
        logging.info = logging.warning = logging.debug = lambda *a, **kw: None
        absl = types.ModuleType("absl")
        absl.logging = logging
        out.update({"absl": absl, "absl.logging": logging})
    return out


def load_public(repo: str) -> types.ModuleType:
    """The public ``fast_attention`` module from `repo` (a checkout or the file).

    Raises FileNotFoundError naming the path that was looked for.
    """
    path = repo if repo.endswith(".py") else os.path.join(repo, PUBLIC_PATH)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"performer_jax: {path} not found; --repo must be a checkout of "
            f"https://github.com/google-research/google-research (it holds {PUBLIC_PATH}) "
            "or that file"
        )
    with common.modules_in_place(_stand_ins()):
        spec = importlib.util.spec_from_file_location("performer_fast_attention", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module


def pairs(public, seq_len: int, args) -> list[tuple[dict, object, object]]:
    """``[(row keys, ours, theirs)]`` at one length: jitted callables of no arguments."""
    q, k, v, ct = common.random_qkv(args.batch, seq_len, args.heads, args.head_dim, seed=0)
    mech = la.get("performer").bind(
        num_features=args.num_features, shared_features=True, chunk_size=64, redraw="never"
    )
    params = mech.init(jax.random.key(0), num_heads=args.heads, head_dim=args.head_dim)

    def both_modes(f):
        fwd, fb = jax.jit(f), jax.jit(common.fwd_bwd(f, argnums=(0, 1, 2)))
        return {"forward": lambda: fwd(q, k, v), "forward+backward": lambda: fb(q, k, v, ct)}

    out = []
    for causal in (False, True):
        ours = both_modes(lambda q, k, v, c=causal: mech.attention(q, k, v, params, causal=c))
        for redraw in (False, True):
            public_fn = public.make_fast_softmax_attention(
                qkv_dim=args.head_dim,
                nb_features=args.num_features,
                redraw_features=redraw,
                unidirectional=causal,
            )
            theirs = both_modes(lambda q, k, v, f=public_fn: f(q, k, v))
            for mode in ("forward", "forward+backward"):
                keys = {"seq_len": seq_len, "causal": causal, "public_redraw": redraw, "mode": mode}
                out.append(
                    (
                        keys,
                        lambda f=ours[mode]: jax.block_until_ready(f()),
                        lambda f=theirs[mode]: jax.block_until_ready(f()),
                    )
                )
    return out


def run(args) -> dict:
    """One row per (length, causal, public redraw, mode): both minima and their ratio."""
    public = load_public(args.repo)
    rows = []
    for seq_len in args.seq_lens:
        repeats = args.repeats if seq_len <= 2048 else args.long_repeats
        for keys, ours, theirs in pairs(public, seq_len, args):
            ms_ours, ms_theirs = interleaved_min(ours, theirs, repeats)
            row = {
                **keys,
                "ours_ms": ms_ours,
                "public_ms": ms_theirs,
                "speedup": ms_theirs / ms_ours,
                "repeats": repeats,
            }
            rows.append(row)
            if not args.quiet:
                kind = "causal" if keys["causal"] else "non-causal"
                draw = "redrawn" if keys["public_redraw"] else "fixed"
                print(
                    f"T={seq_len:>6} {kind:>10} {keys['mode']:>16} (public {draw}): ours"
                    f" {ms_ours:8.2f} ms, public {ms_theirs:8.2f} ms ({row['speedup']:.2f}x)",
                    flush=True,
                )
    return {
        "kind": "performer_jax",
        "environment": common.environment(),
        "config": {
            "batch": args.batch,
            "heads": args.heads,
            "head_dim": args.head_dim,
            "num_features": args.num_features,
            "repeats": args.repeats,
            "long_repeats": args.long_repeats,
        },
        "rows": rows,
    }


def table(result: dict) -> str:
    """Markdown: ours over the public code's time, per mode and length, public projection
    fixed / redrawn per call."""
    lens = sorted({r["seq_len"] for r in result["rows"]})
    cell = {
        (r["seq_len"], r["causal"], r["mode"], r["public_redraw"]): r["speedup"]
        for r in result["rows"]
    }
    lines = [
        "| ours / public (public projection fixed / redrawn) | "
        + " | ".join(f"T = {t}" for t in lens)
        + " |",
        "|---|" + "---:|" * len(lens),
    ]
    for causal in (False, True):
        for mode in ("forward", "forward+backward"):
            name = f"{mode}, {'causal' if causal else 'non-causal'}"
            vals = [
                f"{cell[(t, causal, mode, False)]:.2f}x / {cell[(t, causal, mode, True)]:.2f}x"
                for t in lens
            ]
            lines.append(f"| {name} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def add_arguments(p) -> None:
    p.add_argument(
        "--repo",
        required=True,
        help="a checkout of google-research/google-research, or its " + PUBLIC_PATH,
    )
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--num-features", type=int, default=256)
    p.add_argument("--repeats", type=int, default=15, help="calls per side up to T = 2048")
    p.add_argument("--long-repeats", type=int, default=7, help="calls per side above T = 2048")
    p.add_argument("--out", default=None, help="write the JSON result here")
    p.add_argument("--quiet", action="store_true")


def main_from_args(args) -> dict:
    result = run(args)
    print(table(result))
    common.write_json(result, args.out)
    return result
