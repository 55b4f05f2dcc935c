"""The ``stability`` section of `train.bench_activations` (loss spread over seeds and meshes)."""

from __future__ import annotations

import math

import jax
import numpy as np

from train import configs
from train.bench_activations.common import MESHES, SEEDS, run_steps
from train.trainer import Trainer


# ---------------------------------------------------------------------------- stability
def stability(config, mechanisms, *, steps: int, seeds=SEEDS, meshes=MESHES, data=None):
    """``{mechanism: {"seeds": [loss per seed], "meshes": [loss per mesh]}}``: the train loss
    after `steps` steps, seeds on the first mesh, meshes with the first seed."""
    out = {}
    for name in mechanisms:
        cfg = config.copy_and_resolve_references()
        configs.set_attention(cfg, name)
        res = {"seeds": [], "meshes": []}
        for i, mesh in enumerate(meshes):
            cfg.mesh_shape = tuple(mesh)
            trainer = Trainer(cfg, data, devices=jax.devices()[: math.prod(mesh)])
            data = trainer.data  # built once, shared by every run
            for seed in seeds if i == 0 else seeds[:1]:
                # The seed's init key, as Trainer derives it; the step key is unused here.
                trainer.init_key = jax.random.split(jax.random.key(seed))[0]
                loss = run_steps(trainer, trainer.init_state(), steps)[1][-1]
                res["seeds" if i == 0 else "meshes"].append(loss)
                if i == 0 and seed == seeds[0]:
                    res["meshes"].append(loss)
        out[name] = res
    return out


def spread(losses):
    """``(std, max - min)`` of a list of losses."""
    a = np.asarray(losses, np.float64)
    return float(np.std(a)), float(np.max(a) - np.min(a))


def stability_section(steps: int, mechanisms=("flexformer_n", "softmax")) -> str:
    config = configs.get_config("listops", "mini")
    res = stability(config, mechanisms, steps=steps)
    mesh_names = ", ".join(str(m) for m in MESHES)
    lines = [
        f"Main job (ListOps mini) train loss after {steps} steps: seeds {SEEDS} on 1 device; "
        f"meshes {mesh_names} with seed {SEEDS[0]}",
        "",
        "| mechanism | losses (seeds) | seed std | seed max-min | losses (meshes) | "
        "mesh std | mesh max-min |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in res.items():
        s_std, s_rng = spread(r["seeds"])
        m_std, m_rng = spread(r["meshes"])
        lines.append(
            f"| {name} | {', '.join(f'{x:.4f}' for x in r['seeds'])} | {s_std:.2e} | "
            f"{s_rng:.2e} | {', '.join(f'{x:.5f}' for x in r['meshes'])} | {m_std:.2e} | "
            f"{m_rng:.2e} |"
        )
    return "\n".join(lines)
