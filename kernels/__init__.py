"""kernels: low-level ops for linattn_jax, with no knowledge of attention mechanisms.

Each op has a Pallas kernel (GPU; ``interpret=True`` runs it on CPU for tests), a pure
``jax.numpy`` path, a ``jax.custom_vjp`` and one dispatcher argument
``impl="auto" | "xla" | "pallas"`` (auto = pallas on a GPU backend, xla elsewhere):

* `l1_distance` (x [B,H,N,D], y [B,H,M,D]) -> [B,H,N,M] float32 pairwise L1 distances.
* `laplace_kernel` (x, y, lam) -> exp(-l1 / lam), lam of shape [], [H], [B,H] or [B,H,1,1].
* `newton_schulz_inverse` (a [B,H,m,m]) -> approximate (a + eps I)^-1 (SPEC section 4).

``*_reference`` are the naive jnp oracles. Never imports jax_triton (Pallas ships with jax).
"""

from kernels.l1_distance import (
    BlockSizes,
    l1_distance,
    l1_distance_reference,
    laplace_kernel,
    laplace_kernel_reference,
)
from kernels.newton_schulz import (
    MAX_PALLAS_SIZE,
    newton_schulz_inverse,
    newton_schulz_inverse_reference,
)

__all__ = [
    "MAX_PALLAS_SIZE",
    "BlockSizes",
    "l1_distance",
    "l1_distance_reference",
    "laplace_kernel",
    "laplace_kernel_reference",
    "newton_schulz_inverse",
    "newton_schulz_inverse_reference",
]
