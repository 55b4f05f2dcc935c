"""``python -m train.bench.fusions [mechanisms]``: what XLA's optimised CPU program of each
mechanism's attention does with the features, forward and forward+backward,
causal and not, at a small T:

- ``polynomial``: fused computations that evaluate the sine polynomial of `core.sincos` /
  `core.cos_sin` (the trigonometric maps' range reduction; 0 for the others);
- ``transposes``: fused computations holding a physical transpose of a feature-wide array
  (a ``transpose``, or a ``copy`` between layouts that differ in more than unit axes).

B = 1, H = 4, d = 64, T = 192 (so no other axis has the features' width), default configs.
Run it with XLA's optimisations on (``JAX_DISABLE_MOST_OPTIMIZATIONS`` unset).
"""

from __future__ import annotations

import re
import sys

import jax
import numpy as np

from train.bench import common

#: The sine polynomial's leading coefficient (Cephes' sinf), as `core.sincos` uses it.
SIN_C0 = np.float32(-1.6666654611e-1)
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = \w+\[([\d,]*)\](\{[\d,]*\})? (\w+)\(%?([^ ,)]*)")


def compiled_text(name: str, causal: bool, backward: bool, seq_len: int = 192) -> str:
    """The optimised HLO of `name`'s attention (or its value and gradients)."""
    trainable, fixed, rng = common.mechanism_state(name, heads=4, head_dim=64)
    q, k, v, ct = common.random_qkv(1, seq_len, 4, 64)
    f = common.attention_callable(name, causal=causal)
    args = (q, k, v, trainable, fixed, rng)
    if backward:
        f, args = common.fwd_bwd(f), (*args, ct)
    return jax.jit(f).lower(*args).compile().as_text()


def counts(hlo: str, widths: set[int]) -> dict[str, int]:
    """``polynomial`` and ``transposes`` (module docstring) of `hlo`; `widths`: the feature
    widths (M, 2M, 2M + 1, ...)."""
    poly = transposes = 0
    for body in re.split(r"\n(?=\S)", hlo):  # one computation per block
        constants = re.findall(r"constant\((-?[0-9.]+(?:e-?[0-9]+)?)\)", body)
        poly += any(np.float32(c) == SIN_C0 for c in constants)
        layouts, moved = {}, False
        for line in body.splitlines():
            m = _INSTRUCTION.match(line)
            if not m:
                continue
            name, dims, layout, op, operand = m.groups()
            shape = [int(x) for x in dims.split(",") if x]
            layouts[name] = layout
            if op not in ("transpose", "copy") or not widths & set(shape) or len(shape) < 3:
                continue

            def physical(lay, shape=shape):
                return [i for i in map(int, re.findall(r"\d+", lay or "")) if shape[i] != 1]

            if op == "transpose" or physical(layouts.get(operand, layout)) != physical(layout):
                moved = True
        transposes += moved
    return {"polynomial": poly, "transposes": transposes}


def main(names: list[str]) -> None:
    print("| mechanism | mode | pass | polynomial fusions | feature-wide transposes |")
    print("|---|---|---|---:|---:|")
    for name in names:
        trainable, fixed, _ = common.mechanism_state(name, heads=4, head_dim=64)
        arrays = [a for a in {**trainable, **fixed}.values() if a.ndim == 3]
        width = arrays[0].shape[1]  # M: the [H, M, d] frequencies / random features
        widths = {width, 2 * width, 2 * width + 1, 4 * width}
        for causal in (False, True):
            for backward in (False, True):
                c = counts(compiled_text(name, causal, backward), widths)
                mode = "causal" if causal else "noncausal"
                pass_ = "fwd+bwd" if backward else "fwd"
                print(f"| {name} | {mode} | {pass_} | {c['polynomial']} | {c['transposes']} |")


if __name__ == "__main__":
    main(sys.argv[1:] or ["performer", "flexformer_s", "flexformer_n"])
