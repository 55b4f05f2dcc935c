"""What every benchmark shares: registry views, the machine's facts, mechanism calls and
inputs, markdown number formats and JSON output."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import jax
import jax.numpy as jnp

import linattn_jax as la

#: Name under which ``jax.nn.dot_product_attention`` is benchmarked beside the registry.
SOFTMAX_XLA = "softmax_xla"
#: The exact reference every ratio and error is measured against.
SOFTMAX = "softmax"
#: Config keys that set a mechanism's approximation budget (swept by ``fidelity``).
BUDGET_KEYS = ("num_features", "num_landmarks", "num_samples")
PASSES = ("fwd", "fwd_bwd")
GIB = 2**30
MIB = 2**20


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


def registry_order(name: str) -> int:
    """Sort key: `name`'s place in `bench_names` (unknown names last)."""
    known = bench_names()
    return known.index(name) if name in known else len(known)


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
        "causal_form": la.core.causal_form(),  # the chunked causal form's (CAUSAL_FORM)
        "devices": [str(d) for d in jax.devices()[:1]],
        "device_count": jax.device_count(),
        "cpu_count": os.cpu_count(),
        "ram_gib": round(total_ram_bytes() / GIB, 1) if total_ram_bytes() else None,
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
    return fraction * ram / GIB if ram else 8.0


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


def fwd_bwd(f: Callable, argnums: tuple[int, ...] = (0, 1, 2, 3)) -> Callable:
    """``(value, grads)`` of the loss ``<f(*args), ct>`` (``ct``: the last argument) w.r.t.
    the arguments `argnums` (default q, k, v and the trainable params)."""

    def loss(*args):
        *args, ct = args
        return jnp.sum(f(*args).astype(jnp.float32) * ct)

    return jax.value_and_grad(loss, argnums=argnums)


def random_qkv(batch: int, seq_len: int, heads: int, head_dim: int, seed: int = 0):
    """``(q, k, v, ct)``: i.i.d. N(0, 1) ``[B, T, H, d]`` float32 (``ct``: the cotangent)."""
    kq, kk, kv, kc = jax.random.split(jax.random.key(seed), 4)
    shape = (batch, seq_len, heads, head_dim)
    q, k, v, ct = (jax.random.normal(key, shape, jnp.float32) for key in (kq, kk, kv, kc))
    return q, k, v, ct


# ----------------------------------------------------------------------------- formats


def fmt_ms(ms: float | None) -> str:
    if ms is None:
        return "-"
    return f"{ms / 1e3:.2f} s" if ms >= 1e4 else f"{ms:.1f} ms" if ms >= 10 else f"{ms:.2f} ms"


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    if n >= GIB:
        return f"{n / GIB:.2f} GiB"
    return f"{n / MIB:.1f} MiB" if n >= 10 * MIB else f"{n / MIB:.2f} MiB"


def fmt_x(r: float) -> str:
    """A ratio with two decimals, or two significant digits below 0.1."""
    return f"{r:.2f}x" if r >= 0.1 else f"{r:.2g}x"


def fmt_ratio(r: float | None) -> str:
    """`fmt_x`, or ``-`` for a missing ratio."""
    return "-" if r is None else fmt_x(r)


def total_memory(point: dict) -> int | None:
    """A point's compiled memory total in bytes (None when absent)."""
    return point.get("memory", {}).get("total")


def plot_color(cmap, i: int):
    """tab20: the ten saturated hues first, then their light twins."""
    return cmap((2 * i) % 20 + (i // 10) % 2)


def save_figure(fig, path: str) -> None:
    """`fig`, laid out, to the PNG `path` (110 dpi), then closed."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_json(result: dict, path: str | None) -> None:
    """`result` to `path` (parent folders made); nothing when `path` is None."""
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as fh:
            json.dump(result, fh, indent=1)


def add_common_arguments(p) -> None:
    """The flags of ``scaling``, ``fidelity`` and ``model``."""
    import argparse

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


@contextmanager
def modules_in_place(modules: Mapping[str, object]) -> Iterator[None]:
    """`modules` in ``sys.modules`` for the block (stand-ins while a peer's file loads),
    each name put back as it was afterwards (removed where it was absent)."""
    saved = {name: sys.modules.get(name) for name in modules}
    sys.modules.update(modules)
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
