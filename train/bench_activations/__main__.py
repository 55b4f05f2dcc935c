from __future__ import annotations

import argparse
import os
import sys
import time

import jax

from train import bench_activations
from train.bench_activations.common import FAKE_DEVICES, SECTIONS
from train.bench_activations.denominators import denominator_section
from train.bench_activations.laplacian import kernels_section, laplacian_section
from train.bench_activations.stability import stability_section


# ---------------------------------------------------------------------------- command line
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m train.bench_activations",
        description=bench_activations.__doc__.split("\n\n")[0],
    )
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset")
    p.add_argument("--steps", type=int, default=200, help="training steps (denominators)")
    p.add_argument("--stability-steps", type=int, default=30, help="steps (stability)")
    p.add_argument("--examples", type=int, default=4, help="examples captured per model")
    p.add_argument(
        "--train-den-floor",
        type=float,
        default=None,
        help="den_floor of the flexformer_n models trained in the denominators section "
        "(default: the library default; 0 trains without the floor)",
    )
    p.add_argument("--out", default=None, help="also write the tables to this file")
    return p


def _ensure_devices(argv) -> None:
    """Re-execute with fake CPU devices when the stability section needs more."""
    if jax.device_count() >= FAKE_DEVICES or os.environ.get("_BENCH_ACT_REEXEC"):
        return
    env = dict(os.environ, _BENCH_ACT_REEXEC="1")
    flag = f"--xla_force_host_platform_device_count={FAKE_DEVICES}"
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flag).strip()
    os.execve(sys.executable, [sys.executable, "-m", "train.bench_activations", *argv], env)


def main(argv=None) -> str:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser().parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = sorted(set(sections) - set(SECTIONS))
    if bad:
        raise SystemExit(f"--sections: unknown {bad}; choose from {list(SECTIONS)}")
    if "stability" in sections:
        _ensure_devices(argv)
    start = time.time()
    shown = " ".join(a for a in argv if a != "--out" and a != args.out)  # --out: a copy only
    parts = [f"`python -m train.bench_activations {shown}`".replace(" `", "`")]
    for section in sections:
        print(f"[{section}] ...", flush=True)
        if section == "denominators":
            parts.append(denominator_section(args.steps, args.examples, args.train_den_floor)[0])
        elif section == "stability":
            parts.append(stability_section(args.stability_steps))
        elif section == "laplacian":
            parts.append(laplacian_section(args.examples))
        else:
            parts.append(kernels_section(args.examples))
        print(parts[-1], flush=True)  # each table as soon as it is done
    parts.append(f"({time.time() - start:.0f} s on {jax.device_count()} x "
                 f"{jax.devices()[0].platform})")  # fmt: skip
    text = "\n\n".join(parts)
    print("\n" + text, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return text


if __name__ == "__main__":
    main()
