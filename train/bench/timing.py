"""The one place benchmark timing and memory are measured: compile ahead of time, read XLA's
memory figures, time with ``block_until_ready``."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend


def memory_figures(compiled) -> dict[str, int | None]:
    """XLA's compiled memory figures in bytes; every value None when the backend gives none.

    ``total`` = temp + argument + output (``alias`` is reported, not subtracted).
    """
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


def matmul_flops(fn: Callable, args: Sequence[Any]) -> int:
    """FLOPs of the matrix products in `fn(*args)`, counted on its jaxpr: ``2 * out * K`` per
    ``dot_general`` (K the contracted size), a ``scan`` body times its length.

    XLA's ``compiled.cost_analysis()`` counts a loop body once, whatever its trip count, so it
    misses most of a chunked causal scan; elementwise work (exp, cos, sin, sums) is left out on
    purpose: the count is the useful matrix work, against which a plain matmul's rate is the
    reference. A ``while_loop`` body (trip count unknown) is counted once, every branch of a
    ``cond`` is counted.
    """
    return _dot_flops(jax.make_jaxpr(fn)(*args).jaxpr)


def _dot_flops(jaxpr) -> int:
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            k = 1
            for i in contract:
                k *= lhs[i]
            total += 2 * eqn.outvars[0].aval.size * k
        times = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                sub = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
                if isinstance(sub, jax.extend.core.Jaxpr):
                    total += times * _dot_flops(sub)
    return total


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


def compile_memory(fn: Callable, args: Sequence[Any]):
    """``(compiled, {"compile_s", "memory"})``: `fn` compiled ahead of time for `args`."""
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled, {"compile_s": time.perf_counter() - t0, "memory": memory_figures(compiled)}


def measure(
    fn: Callable,
    args: Sequence[Any],
    *,
    repeats: int,
    min_total_s: float,
    skip: Callable[[dict], str | None] | None = None,
) -> dict[str, Any]:
    """Compiles `fn(*args)` ahead of time and times it: the fields a benchmark point gets.

    ``compile_s``, ``memory`` (`memory_figures`) and ``matmul_flops`` always; then, unless
    ``skip(fields)`` gives a reason (``status="skipped"``, ``note=reason``: the point is
    compiled, so its memory is reported, but not run), the `time_compiled` figures and
    ``gflops`` (``matmul_flops`` over the median time).
    """
    compiled, fields = compile_memory(fn, args)
    fields["matmul_flops"] = matmul_flops(fn, args)
    reason = skip(fields) if skip is not None else None
    if reason:
        return {**fields, "status": "skipped", "note": reason}
    fields.update(time_compiled(compiled, args, repeats=repeats, min_total_s=min_total_s))
    return {**fields, "gflops": fields["matmul_flops"] / fields["time_ms"] / 1e6}


def over_budget(memory: dict, budget_gib: float | None) -> str | None:
    """The skip note of a point whose compiled memory total exceeds `budget_gib` (else None)."""
    total = memory.get("total")
    if budget_gib and total is not None and total > budget_gib * 2**30:
        return f"memory {total / 2**30:.2f} GiB > budget {budget_gib:.2f} GiB"
    return None
