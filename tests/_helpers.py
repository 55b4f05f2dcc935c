"""Shared test utilities: small per-mechanism configs and input builders."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import linattn_jax as la

# Small budgets so every mechanism runs fast on CPU in generic tests.
SMALL_CONFIG = {
    "performer": {"num_features": 32},
    "rfa": {"num_features": 32},
    "flexformer_s": {"num_features": 32},
    "flexformer_n": {"num_features": 32},
    "nystromformer": {"num_landmarks": 4},
    "soft": {"num_landmarks": 4},
    "laplacian": {"num_landmarks": 4},
    "lara": {"num_landmarks": 4},
    "ra": {"num_samples": 2},
}

#: ``--set`` flags of a tiny model and batch for CLI tests (any task's config has these keys).
TINY_CLI = [
    "--no_progress",
    "--set=model.num_layers=1",
    "--set=model.emb_dim=16",
    "--set=model.qkv_dim=16",
    "--set=model.num_heads=2",
    "--set=model.mlp_dim=32",
    "--set=batch_size=8",
    "--set=eval_batch_size=8",
    "--set=compile_memory_analysis=False",
]

#: Tolerances keyed by dtype, for comparisons of the same computation.
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def mech(name, **config):
    return la.get(name).bind(**{**SMALL_CONFIG.get(name, {}), **config})


def qkv(seed=0, b=2, tq=12, tk=12, h=2, d=8, dv=8, scale=1.0, dtype=jnp.float32):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (b, tq, h, d)) * scale
    k = jax.random.normal(kk, (b, tk, h, d)) * scale
    v = jax.random.normal(kv, (b, tk, h, dv))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


def init(m, h=2, d=8, seed=1):
    return m.init(jax.random.key(seed), num_heads=h, head_dim=d)


def rel_err(a, b):
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-12))


def max_rel_err(got, want):
    """``max |got - want| / max |want|`` in float32 (error relative to the output's scale)."""
    got, want = jnp.asarray(got, jnp.float32), jnp.asarray(want, jnp.float32)
    return float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
