"""Micro-benchmark of the kernels: ``python -m kernels.bench [--flags]``.

Times the naive reference, the xla path and the Pallas path (compiled on GPU, interpreted on
CPU, where the numbers only show that it runs) of `l1_distance` / `laplace_kernel` and
`newton_schulz_inverse`, forward and forward+backward, and prints a markdown table (each
group's rows also on stderr as soon as they are timed, so that a run cut short keeps them);
then the Newton-Schulz residual ``max |P V - I|`` against the iteration count on landmark
matrices like the Nystrom mechanisms build (segment means; ``--residual-only`` prints just
that).

GPU defaults follow the design card: L1 with N = M = 4096, D = 64 (B*H = 1: the reference
materialises [B*H, N, M, D]) and Newton-Schulz with m in {64, 128, 256} over B*H = 64. CPU
defaults are much smaller; every size is a flag.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

import kernels


def _time(fn: Callable, *args, repeats: int) -> float:
    """Median wall time in ms of the jitted fn (after one compile + warm-up call)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _l1_rows(bh: int, n: int, m: int, d: int, repeats: int, interpret: bool, skip_ref: bool):
    kx, ky, kw = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (1, bh, n, d), jnp.float32)
    y = jax.random.normal(ky, (1, bh, m, d), jnp.float32)
    lam = jnp.float32(d**0.5)
    w = jax.random.normal(kw, (1, bh, n, m), jnp.float32)
    impls: dict[str, Callable] = {
        "xla": lambda x, y, lam: kernels.laplace_kernel(x, y, lam, impl="xla"),
        "pallas": lambda x, y, lam: kernels.laplace_kernel(
            x, y, lam, impl="pallas", interpret=interpret
        ),
    }
    if not skip_ref:
        impls = {"reference": kernels.laplace_kernel_reference, **impls}
    rows = []
    for name, f in impls.items():
        fwd = jax.jit(f)
        bwd = jax.jit(jax.grad(lambda x, y, lam, f=f: jnp.sum(w * f(x, y, lam)), argnums=(0, 1, 2)))
        rows.append(
            (
                "laplace_kernel",
                f"B*H={bh} N={n} M={m} D={d}",
                name,
                _time(fwd, x, y, lam, repeats=repeats),
                _time(bwd, x, y, lam, repeats=repeats),
            )
        )
    return rows


def _ns_rows(bh: int, m: int, iters: int, repeats: int, interpret: bool):
    kx, kw = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (1, bh, m, 16), jnp.float32)
    a = kernels.laplace_kernel_reference(x, x, 4.0)  # [1, BH, m, m]
    w = jax.random.normal(kw, a.shape, jnp.float32)
    impls: dict[str, Callable] = {
        "reference": lambda a: kernels.newton_schulz_inverse_reference(a, iters=iters),
        "xla": lambda a: kernels.newton_schulz_inverse(a, iters=iters, impl="xla"),
    }
    if m <= kernels.MAX_PALLAS_SIZE:
        impls["pallas"] = lambda a: kernels.newton_schulz_inverse(
            a, iters=iters, impl="pallas", interpret=interpret
        )
    rows = []
    for name, f in impls.items():
        fwd = jax.jit(f)
        bwd = jax.jit(jax.grad(lambda a, f=f: jnp.sum(w * f(a))))
        rows.append(
            (
                "newton_schulz_inverse",
                f"B*H={bh} m={m} iters={iters}",
                name,
                _time(fwd, a, repeats=repeats),
                _time(bwd, a, repeats=repeats),
            )
        )
    return rows


def _landmark_matrices(m: int, t: int, d: int):
    """Landmark matrices like the Nystrom mechanisms build: segment means of T unit-Gaussian
    tokens (m segments of T / m tokens), Laplace kernel at lambda = d / 2."""
    kq, kk = jax.random.split(jax.random.key(2))
    seg = lambda x: x.reshape(1, 1, m, t // m, d).mean(3)  # noqa: E731  [1, 1, m, d]
    q_lm = seg(jax.random.normal(kq, (t, d), jnp.float32))
    k_lm = seg(jax.random.normal(kk, (t, d), jnp.float32))
    lam = d / 2.0
    return {
        f"shared K~ (T={t}, d={d})": kernels.laplace_kernel_reference(k_lm, k_lm, lam),
        f"separate Q~, K~ (T={t}, d={d})": kernels.laplace_kernel_reference(q_lm, k_lm, lam),
        "random tokens (d=16, lambda=4)": kernels.laplace_kernel_reference(
            jax.random.normal(kq, (1, 1, m, 16)), jax.random.normal(kq, (1, 1, m, 16)), 4.0
        ),
    }


def residual_table(m: int, iters: Sequence[int], eps: float = 0.01, t: int = 1024, d: int = 64):
    """Markdown table of ``max |P V_k - I|`` (P = A + eps I) against the iteration count k."""
    lines = [
        f"| landmark matrix A (m={m}, eps={eps:g}) | sigma_min(P) | sigma_max(P) | "
        + " | ".join(f"{k} it" for k in iters)
        + " |",
        "|---|---:|---:|" + "---:|" * len(iters),
    ]
    for name, a in _landmark_matrices(m, t, d).items():
        p = a[0, 0] + eps * jnp.eye(m)
        sv = jnp.linalg.svd(p, compute_uv=False)
        res = []
        for k in iters:
            v = kernels.newton_schulz_inverse(a, iters=k, eps=eps, impl="xla")[0, 0]
            res.append(float(jnp.max(jnp.abs(p @ v - jnp.eye(m)))))
        cells = " | ".join(f"{r:.1e}" for r in res)
        lines.append(f"| {name} | {float(sv[-1]):.1e} | {float(sv[0]):.1f} | {cells} |")
    return "\n".join(lines)


def format_table(rows) -> str:
    lines = [
        "| op | shape | impl | forward (ms) | forward+backward (ms) |",
        "|---|---|---|---:|---:|",
    ]
    for op, shape, impl, t_fwd, t_bwd in rows:
        lines.append(f"| {op} | {shape} | {impl} | {t_fwd:.3f} | {t_bwd:.3f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> str:
    on_gpu = jax.default_backend() == "gpu"
    p = argparse.ArgumentParser(prog="python -m kernels.bench", description=__doc__)
    p.add_argument("--l1-bh", type=int, default=1, help="B*H for the L1 / Laplace kernel")
    p.add_argument("--n", type=int, default=4096 if on_gpu else 128, help="rows of x")
    p.add_argument("--m", type=int, default=4096 if on_gpu else 128, help="rows of y")
    p.add_argument("--d", type=int, default=64, help="feature dimension")
    p.add_argument("--skip-l1-reference", action="store_true", help="skip the naive L1 oracle")
    p.add_argument("--ns-bh", type=int, default=64 if on_gpu else 4, help="B*H for NS")
    p.add_argument(
        "--ns-sizes",
        type=int,
        nargs="+",
        default=[64, 128, 256] if on_gpu else [16, 64],
        help="matrix sizes m for Newton-Schulz",
    )
    p.add_argument("--iters", type=int, default=20, help="Newton-Schulz iterations")
    p.add_argument("--repeats", type=int, default=10 if on_gpu else 3, help="timed calls")
    p.add_argument(
        "--residual-iters",
        type=int,
        nargs="+",
        default=[10, 20, 30, 40, 60],
        help="iteration counts of the Newton-Schulz residual table",
    )
    p.add_argument("--residual-m", type=int, default=64, help="m of the residual table")
    p.add_argument("--residual-only", action="store_true", help="print only the residual table")
    args = p.parse_args(argv)
    interpret = not on_gpu
    if args.residual_only:
        residuals = residual_table(args.residual_m, args.residual_iters)
        print(residuals)
        return residuals
    groups = [
        lambda: _l1_rows(
            args.l1_bh, args.n, args.m, args.d, args.repeats, interpret, args.skip_l1_reference
        )
    ]
    groups += [
        functools.partial(_ns_rows, args.ns_bh, m, args.iters, args.repeats, interpret)
        for m in args.ns_sizes
    ]
    rows = []
    for group in groups:
        timed = group()
        rows += timed
        # each group as soon as it is timed, on stderr: a run cut short keeps what it timed
        print(format_table(timed), file=sys.stderr, flush=True)
    residuals = residual_table(args.residual_m, args.residual_iters)
    mode = "compiled" if on_gpu else "interpret mode (CPU: not a speed measurement)"
    table = f"backend: {jax.default_backend()}; Pallas {mode}\n\n" + format_table(rows)
    table += "\n\nNewton-Schulz residual max|PV - I| against iterations:\n\n" + residuals
    print(table)
    return table


if __name__ == "__main__":
    main()
