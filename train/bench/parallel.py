"""``python -m train.bench parallel``: per-device memory of sequence-parallel attention
(`linattn_jax.parallel`).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m train.bench parallel

For each mechanism `la.parallel` supports (the feature maps, the Nystrom family and LARA),
causal and not where it has a causal form, and each pass of ``--passes`` (``fwd``: the
output; ``fwd_bwd``: the gradient w.r.t. q, k, v of the summed output; default both),
compiles ``B=1, H=4, d=64`` at ``T`` (default 64k) on one device and split along T over 4
and 8 devices of a ``("data", "seq")`` mesh, and prints XLA's compiled per-device memory
(``memory_analysis()``: arguments + outputs + temporaries) and its ratio to one device's.
Nothing is executed, so fake CPU devices measure the same programs a pod would run.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import linattn_jax as la
from train.bench import common, timing

_CONFIG = {"performer": {"num_features": 256}, "rfa": {"num_features": 128}}
PASSES = ("fwd", "fwd_bwd")


def per_device_memory(
    name: str, t: int, shards: int, *, causal: bool, b=1, h=4, d=64, backward: bool = True
):
    """Compiled per-device MiB of forward+backward (``backward=False``: the forward pass
    alone) at length `t` over `shards` devices (1: the plain mechanism on one device)."""
    mech = la.get(name).bind(**_CONFIG.get(name, {}))
    params = mech.init(jax.random.key(0), num_heads=h, head_dim=d)
    if shards == 1:
        attend, sharding = mech.attention, None
    else:
        mesh = Mesh(np.array(jax.devices()[:shards]).reshape(1, shards), ("data", "seq"))
        attend = la.parallel.sequence_parallel(mech, mesh, "seq")
        sharding = NamedSharding(mesh, PartitionSpec("data", "seq"))
    x = jax.ShapeDtypeStruct((b, t, h, d), jnp.float32, sharding=sharding)

    def forward(q, k, v, p):
        return attend(q, k, v, p, causal=causal, deterministic=True)

    def loss(q, k, v, p):
        return jnp.sum(forward(q, k, v, p))

    fn = jax.grad(loss, argnums=(0, 1, 2)) if backward else forward
    _, fields = timing.compile_memory(fn, (x, x, x, params))
    return fields["memory"]["total"] / common.MIB


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--attentions", default=",".join(la.parallel.supported_names()))
    p.add_argument("--seq_len", type=int, default=65536)
    p.add_argument("--shards", default="4,8", help="devices on the seq axis")
    p.add_argument(
        "--passes",
        default=",".join(PASSES),
        help="fwd (forward), fwd_bwd (forward+backward), or both comma-separated",
    )


def main_from_args(args: argparse.Namespace, p: argparse.ArgumentParser) -> list[dict]:
    """Prints the table of the parsed `add_arguments` flags; returns its rows."""
    shards = [int(s) for s in args.shards.split(",")]
    if max(shards) > jax.device_count():
        p.error(
            f"{max(shards)} shards need as many devices; on CPU set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={max(shards)}"
        )
    passes = args.passes.split(",")
    if not passes or any(x not in PASSES for x in passes):
        p.error(f"--passes {args.passes!r}: a comma-separated subset of {','.join(PASSES)}")
    rows = []
    head = " | ".join(f"{n} devices (ratio)" for n in shards)
    print(f"T = {args.seq_len}, B = 1, H = 4, d = 64, MiB per device\n")
    print(f"| mechanism | causal | pass | 1 device | {head} |")
    print("|---|---|---|---|" + "---|" * len(shards))
    for name in args.attentions.split(","):
        for causal in (False, True) if la.get(name).supports_causal else (False,):
            for pass_ in passes:
                kw = dict(causal=causal, backward=pass_ == "fwd_bwd")
                one = per_device_memory(name, args.seq_len, 1, **kw)
                row = {"attention": name, "causal": causal, "pass": pass_, "one": one}
                cells = []
                for n in shards:
                    mib = per_device_memory(name, args.seq_len, n, **kw)
                    row[n] = mib
                    cells.append(f"{mib:.0f} ({mib / one:.3f})")
                rows.append(row)
                cells = " | ".join(cells)
                print(f"| {name} | {causal} | {pass_} | {one:.0f} | {cells} |", flush=True)
    return rows
