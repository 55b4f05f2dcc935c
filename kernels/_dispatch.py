"""Private helpers shared by the kernels: implementation choice, input checks, padding."""

from __future__ import annotations

import jax
import jax.numpy as jnp

IMPLS = ("auto", "xla", "pallas")


def resolve_impl(name: str, impl: str) -> str:
    """Map ``impl`` to ``"xla"`` or ``"pallas"``.

    ``"auto"`` picks ``"pallas"`` on a GPU backend and ``"xla"`` everywhere else (on CPU the
    Pallas kernels only run through the slow interpreter, which is for tests).
    """
    if impl not in IMPLS:
        raise ValueError(f"{name}: impl must be one of {IMPLS}, got {impl=!r}")
    if impl == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    return impl


def check_rank(name: str, arg: str, x: jax.Array, rank: int) -> None:
    if getattr(x, "ndim", None) != rank:
        raise ValueError(
            f"{name}: {arg} must have rank {rank}, got {arg}.shape={getattr(x, 'shape', None)}"
        )


def check_float(name: str, arg: str, x: jax.Array) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name}: {arg} must be a floating array, got {arg}.dtype={x.dtype}")


def is_power_of_2(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def pad_axis(x: jax.Array, axis: int, size: int) -> jax.Array:
    """Zero-pad ``x`` along ``axis`` up to ``size``."""
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)
