"""Our LARA against the official PyTorch code, side by side at equal cores:
``python -m train.bench official --repo PATH``.

`PATH` is a checkout of HKUNLP/efficient-attention (``git clone
https://github.com/HKUNLP/efficient-attention``); its ``LinearRA`` is loaded from there, not
copied. It needs ``torch`` and ``einops`` (``pip install torch==2.13.0 einops``), which the
project does not depend on. The package's ``__init__`` imports every attention of the
repository (and timm); only ``abstract_attention``, ``attn_utils`` and ``lara`` are loaded,
with timm's ``trunc_normal_`` (used at init only) taken from torch.

What is timed: the attention from q, k, v to the heads' outputs, forward (no autograd state
on the torch side) and forward+backward (gradients of q, k, v for a fixed cotangent), each
side in its own layout: ours ``[B, T, H, d]`` (what flax's projections give), theirs two
ways, ``[B, H, T, d]`` contiguous tensors and the heads-first views of one ``[B, T, 3, H,
d]`` tensor that the official module's own projection gives (``torch_inputs``), in
training mode (one noisy draw per landmark proposal, ``mis-opt``, ``proposal_gen="pool"``,
which on a sequence is our ``proposal="mean"``). The module's input and output projections
are bypassed (``proj_and_split_heads`` returns the given q, k, v; ``proj`` is the
identity). Calls alternate (one of ours, one of theirs) and each side's minimum over
`repeats` calls is reported, so both see the same machine state. torch gets as many
threads as the cores XLA uses (`cpu_cores`), and the thread count is part of every row.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
import types
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import linattn_jax as la
from train.bench import common

_FILES = ("abstract_attention", "attn_utils", "lara")


def cpu_cores() -> int:
    """The cores this process may run on (what XLA's CPU thread pool uses)."""
    return len(os.sched_getaffinity(0))


def load_linear_ra(repo: str):
    """The official ``LinearRA`` class from the checkout `repo` (see the module docstring).

    Raises FileNotFoundError naming the missing file, or ImportError saying what to install.
    """
    pkg_dir = os.path.join(repo, "efficient-attention", "efficient_attention")
    for name in _FILES:
        path = os.path.join(pkg_dir, name + ".py")
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"official: {path} not found; --repo must be a checkout of "
                "https://github.com/HKUNLP/efficient-attention"
            )
    try:
        import einops  # noqa: F401  (attn_utils imports it)
        import torch
    except ImportError as e:
        raise ImportError(
            f"official: the official code needs torch and einops ({e}); "
            "pip install torch==2.13.0 einops"
        ) from e
    layers = types.ModuleType("timm.models.layers")
    layers.trunc_normal_ = torch.nn.init.trunc_normal_
    pkg = types.ModuleType("efficient_attention")
    pkg.__path__ = [pkg_dir]
    pkg.add_nested_argument = lambda *args, **kwargs: None  # argparse helper, unused
    sys.modules["efficient_attention"] = pkg
    timm = {
        "timm": types.ModuleType("timm"),
        "timm.models": types.ModuleType("timm.models"),
        "timm.models.layers": layers,
    }
    modules = {}
    with common.modules_in_place(timm):
        for name in _FILES:
            spec = importlib.util.spec_from_file_location(
                f"efficient_attention.{name}", os.path.join(pkg_dir, name + ".py")
            )
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
            modules[name] = module
            if name == "abstract_attention":
                pkg.MultiheadAttention = module.MultiheadAttention
    return modules["lara"].LinearRA


def official_lara(linear_ra, *, heads: int, head_dim: int, num_landmarks: int, train: bool):
    """``attend(q, k, v) -> [B, T, H * d]``: the official module's attention on the given
    heads-first torch tensors (projections bypassed)."""
    import torch

    module = linear_ra(
        num_landmarks=num_landmarks, proposal_gen="pool", dim=heads * head_dim, num_heads=heads
    )
    module.proj = torch.nn.Identity()
    module.train(train)

    def attend(q, k, v):
        module.proj_and_split_heads = lambda x: (q, k, v)
        return module(torch.empty(q.shape[0], q.shape[2], heads * head_dim))

    return attend


def interleaved_min(a: Callable[[], object], b: Callable[[], object], repeats: int):
    """``(min ms of a, min ms of b)`` over `repeats` alternating calls, after two warm-ups each."""
    for _ in range(2):
        a()
        b()
    ta, tb = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a()
        ta.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        b()
        tb.append(time.perf_counter() - t0)
    return min(ta) * 1e3, min(tb) * 1e3


def _pair(linear_ra, seq_len, args):
    """Our and the official callables at one length: ``{(mode, torch_inputs): (ours,
    theirs)}``. ``torch_inputs``: ``"contiguous"`` (q, k, v as contiguous ``[B, H, T, d]``
    tensors) or ``"module"`` (the heads-first views of one ``[B, T, 3, H, d]`` tensor, as the
    official module's ``proj_and_split_heads`` makes them; gradients land in that tensor)."""
    import torch

    b, h, d = args.batch, args.heads, args.head_dim
    q, k, v, g = common.random_qkv(b, seq_len, h, d, seed=0)
    key = jax.random.key(0)
    config = {"num_landmarks": args.num_landmarks}

    def ours(q, k, v):
        return la.get("lara").attention_fn(q, k, v, {}, key, **config)

    fwd = jax.jit(ours)
    fb = jax.jit(jax.grad(lambda q, k, v: jnp.sum(ours(q, k, v) * g), argnums=(0, 1, 2)))
    calls = {
        "forward": lambda: jax.block_until_ready(fwd(q, k, v)),
        "forward+backward": lambda: jax.block_until_ready(fb(q, k, v)),
    }
    tg = torch.from_numpy(np.array(g).reshape(b, seq_len, h * d))
    attend = official_lara(
        linear_ra, heads=h, head_dim=d, num_landmarks=args.num_landmarks, train=True
    )
    contiguous = [
        torch.from_numpy(np.asarray(x).transpose(0, 2, 1, 3).copy()).requires_grad_()
        for x in (q, k, v)
    ]
    qkv = torch.from_numpy(np.stack([np.asarray(x) for x in (q, k, v)], axis=2))
    qkv.requires_grad_()
    leaves = {"contiguous": contiguous, "module": [qkv]}
    views = {
        "contiguous": lambda: contiguous,
        "module": lambda: qkv.permute(2, 0, 3, 1, 4).unbind(0),
    }

    def theirs(inputs, backward):
        def call():
            if not backward:
                with torch.no_grad():
                    return attend(*views[inputs]())
            for leaf in leaves[inputs]:
                leaf.grad = None
            attend(*views[inputs]()).backward(tg)
            return [leaf.grad for leaf in leaves[inputs]]

        return call

    return {
        (mode, inputs): (calls[mode], theirs(inputs, mode != "forward"))
        for mode in calls
        for inputs in ("contiguous", "module")
    }


def _over_t_halves(e, x):
    half = e.shape[-1] // 2
    first = jnp.einsum("hct,htd->hcd", e[..., :half], x[:, :half])
    return first + jnp.einsum("hct,htd->hcd", e[..., half:], x[:, half:])


def _over_t_per_head(e, x):
    return jnp.stack([e[i] @ x[i] for i in range(e.shape[0])])


def gemm_rates(seq_len, args, repeats):
    """GFLOP/s of LARA's two product shapes per head, XLA against torch (same threads):
    ``"scores"`` (``[C, d] x [d, T]``: the key and query logits) and ``"over_T"`` (``[C, T] x
    [T, d]``: f and the gradients that sum over tokens), interleaved as the attention is; and
    two other XLA forms of ``"over_T"`` that hand it independent products (torch computes the
    plain one beside them): ``"over_T_halves"`` (two halves of T, summed) and
    ``"over_T_per_head"`` (one product per head)."""
    import torch

    h, d, c = args.heads, args.head_dim, args.num_landmarks
    keys = jax.random.split(jax.random.key(2), 3)
    w = jax.random.normal(keys[0], (h, c, d), jnp.float32)
    x = jax.random.normal(keys[1], (h, seq_len, d), jnp.float32)
    e = jax.random.normal(keys[2], (h, c, seq_len), jnp.float32)
    tw, tx, te = (torch.from_numpy(np.array(a)) for a in (w, x, e))
    flops = 2 * h * c * seq_len * d
    shapes = {
        "scores": (jax.jit(lambda w, x: jnp.einsum("hcd,htd->hct", w, x)), (w, x), "hcd,htd->hct"),
        "over_T": (jax.jit(lambda e, x: jnp.einsum("hct,htd->hcd", e, x)), (e, x), "hct,htd->hcd"),
        "over_T_halves": (jax.jit(_over_t_halves), (e, x), "hct,htd->hcd"),
        "over_T_per_head": (jax.jit(_over_t_per_head), (e, x), "hct,htd->hcd"),
    }
    torch_args = {"scores": (tw, tx)}
    out = {}
    for name, (fn, xla_args, spec) in shapes.items():
        their_args = torch_args.get(name, (te, tx))
        ms_xla, ms_torch = interleaved_min(
            lambda fn=fn, a=xla_args: jax.block_until_ready(fn(*a)),
            lambda spec=spec, a=their_args: torch.einsum(spec, *a),
            repeats,
        )
        out[name] = {"xla_gflops": flops / ms_xla / 1e6, "torch_gflops": flops / ms_torch / 1e6}
    return out


def run(args) -> dict:
    """The table: one row per (length, mode) with both minima, their ratio and torch's threads."""
    import torch

    linear_ra = load_linear_ra(args.repo)
    threads = args.threads or cpu_cores()
    torch.set_num_threads(threads)
    rows = []
    for seq_len in args.seq_lens:
        for (mode, inputs), (ours, theirs) in _pair(linear_ra, seq_len, args).items():
            ms_ours, ms_theirs = interleaved_min(ours, theirs, args.repeats)
            rows.append(
                {
                    "seq_len": seq_len,
                    "mode": mode,
                    "torch_inputs": inputs,
                    "ours_ms": ms_ours,
                    "official_ms": ms_theirs,
                    "speedup": ms_theirs / ms_ours,
                    "torch_threads": torch.get_num_threads(),
                    "xla_cores": cpu_cores(),
                }
            )
            print(
                f"T={seq_len:>6} {mode:>16} (torch {inputs:>10}): ours {ms_ours:8.1f} ms, "
                f"official {ms_theirs:8.1f} ms"
                f" ({ms_theirs / ms_ours:.2f}x), torch on {rows[-1]['torch_threads']} threads,"
                f" XLA on {cpu_cores()} cores",
                flush=True,
            )
    gemm = {}
    for seq_len in args.seq_lens:
        gemm[seq_len] = gemm_rates(seq_len, args, args.repeats)
        print(
            f"T={seq_len:>6} GFLOP/s per product shape, XLA / torch: "
            + ", ".join(
                f"{k} {v['xla_gflops']:.0f} / {v['torch_gflops']:.0f}"
                for k, v in gemm[seq_len].items()
            ),
            flush=True,
        )
    return {
        "kind": "official",
        "gemm": gemm,
        "environment": {**common.environment(), "torch": torch.__version__},
        "config": {
            "batch": args.batch,
            "heads": args.heads,
            "head_dim": args.head_dim,
            "num_landmarks": args.num_landmarks,
            "repeats": args.repeats,
        },
        "rows": rows,
    }


def add_arguments(p) -> None:
    p.add_argument("--repo", required=True, help="a checkout of HKUNLP/efficient-attention")
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--num-landmarks", type=int, default=64)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: the cores XLA uses)"
    )
    p.add_argument("--out", default=None, help="write the JSON result here")


def main_from_args(args) -> dict:
    if args.threads is not None and args.threads != cpu_cores():
        print(
            f"official: torch on {args.threads} threads, XLA on {cpu_cores()} cores: "
            "the sides do not have equal cores",
            file=sys.stderr,
        )
    result = run(args)
    common.write_json(result, args.out)
    return result
