"""linattn_jax: efficient attention mechanisms as pure JAX functions and Flax modules.

    import linattn_jax as la
    mech = la.get("performer").bind(num_features=256)
    params = mech.init(rng, num_heads=H, head_dim=D)
    out = mech.attention(q, k, v, params, rng, mask=None, causal=False, deterministic=False)

Layout ``[B, T, H, D]`` everywhere. See `linattn_jax.registry.Mechanism`.
"""

from linattn_jax import core
from linattn_jax.registry import Mechanism, causal_names, get, names, origin, register

# Importing a mechanism module registers it; the order is the order of `names()`.
# isort: off
from linattn_jax import softmax  # noqa: F401
from linattn_jax import linear_elu  # noqa: F401
from linattn_jax import performer  # noqa: F401
from linattn_jax import rfa  # noqa: F401
from linattn_jax import hedgehog  # noqa: F401
from linattn_jax import flexformer  # noqa: F401  (flexformer_s, flexformer_n)

from linattn_jax import nystromformer  # noqa: F401
from linattn_jax import soft  # noqa: F401
from linattn_jax import laplacian  # noqa: F401
from linattn_jax import ra  # noqa: F401
from linattn_jax import lara  # noqa: F401

# isort: on
from linattn_jax import hf, landmarks, linen, nn, parallel  # noqa: E402  (hf: no transformers)
from linattn_jax.transplant import transplant  # noqa: E402

__all__ = [
    "Mechanism",
    "causal_names",
    "core",
    "get",
    "hf",
    "landmarks",
    "linen",
    "names",
    "nn",
    "origin",
    "parallel",
    "register",
    "transplant",
]
__version__ = "0.1.0"
