"""kernels.l1_distance: the L1-distance and Laplace kernels (xla, Pallas in interpret mode on
CPU, compiled on GPU) against the naive references, forward and gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _kernel_inputs import (
    ON_GPU,
    SMALL_BLOCKS,
    _assert_close,
    _xy,
)

import kernels

L1_CASES = [
    ((1, 2, 37, 21, 33), SMALL_BLOCKS),
    ((2, 1, 16, 16, 16), None),
    ((1, 1, 70, 45, 64), None),
    ((1, 1, 19, 24, 128), kernels.BlockSizes(block_n=16, block_m=16, block_d=16)),
]


class _L1Base:
    """L1 distance / Laplace kernel of one implementation vs the references."""

    IMPL = "xla"
    INTERPRET = False

    def _kw(self, block_sizes=None):
        return dict(impl=self.IMPL, interpret=self.INTERPRET, block_sizes=block_sizes)

    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
    @pytest.mark.parametrize("shape,block_sizes", L1_CASES)
    def test_l1_forward_and_grad(self, shape, block_sizes, dtype):
        x, y, w, _ = _xy(shape, dtype)
        out = kernels.l1_distance(x, y, **self._kw(block_sizes))
        assert out.dtype == jnp.float32 and out.shape == shape[:3] + (shape[3],)
        _assert_close(out, kernels.l1_distance_reference(x, y), dtype, "l1 forward")

        def loss(f):
            return lambda x, y: jnp.sum(w * f(x, y))

        # jitted: one program per form, not one per eager op
        g = jax.jit(
            jax.grad(loss(lambda x, y: kernels.l1_distance(x, y, **self._kw(block_sizes))), (0, 1))
        )
        g_ref = jax.jit(jax.grad(loss(kernels.l1_distance_reference), (0, 1)))
        for name, a, b in zip(("dx", "dy"), g(x, y), g_ref(x, y)):
            assert a.dtype == dtype
            _assert_close(a, b, dtype, f"l1 {name}")

    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
    @pytest.mark.parametrize("shape,block_sizes", L1_CASES[:3])
    def test_laplace_forward_and_grad(self, shape, block_sizes, dtype):
        x, y, w, lam = _xy(shape, dtype, seed=1)
        f = lambda x, y, lam: kernels.laplace_kernel(x, y, lam, **self._kw(block_sizes))
        out = f(x, y, lam)
        assert out.dtype == jnp.float32
        _assert_close(out, kernels.laplace_kernel_reference(x, y, lam), dtype, "laplace forward")

        def loss(f):
            return lambda x, y, lam: jnp.sum(w * f(x, y, lam))

        g = jax.jit(jax.grad(loss(f), (0, 1, 2)))(x, y, lam)  # one program, not one per op
        g_ref = jax.jit(jax.grad(loss(kernels.laplace_kernel_reference), (0, 1, 2)))(x, y, lam)
        for name, a, b in zip(("dx", "dy"), g[:2], g_ref[:2]):
            _assert_close(a, b, dtype, f"laplace {name}")
        # dlam = sum_ij w_ij K_ij d_ij / lam^2 is a sum with cancellations: compare relative to
        # the sum of the absolute terms (the float32 rounding error of either computation).
        k = kernels.laplace_kernel_reference(x, y, lam)
        d = kernels.l1_distance_reference(x, y)
        terms = jnp.sum(jnp.abs(w) * k * d, axis=(0, 2, 3)) / lam**2  # [H]
        _assert_close(g[2], g_ref[2], dtype, "laplace dlam", scale=float(jnp.max(terms)))

    def test_laplace_lam_shapes_and_transforms(self):
        """lam as [], [H], [B, H], [B, H, 1, 1] agree; works under jit and vmap."""
        b, h = 2, 3
        x, y, _, lam_h = _xy((b, h, 9, 12, 16), jnp.float32, seed=2)
        lam_bh = jnp.broadcast_to(lam_h[None, :], (b, h)) * jnp.array([[1.0], [1.5]])
        f = lambda x, y, lam: kernels.laplace_kernel(x, y, lam, **self._kw(SMALL_BLOCKS))
        ref = kernels.laplace_kernel_reference
        _assert_close(f(x, y, 2.5), ref(x, y, jnp.full((b, h), 2.5)), jnp.float32, "lam []")
        _assert_close(f(x, y, lam_h), ref(x, y, lam_h[None, :]), jnp.float32, "lam [H]")
        _assert_close(f(x, y, lam_bh[:, :, None, None]), ref(x, y, lam_bh), jnp.float32, "4d")
        out = jax.jit(f)(x, y, lam_bh)
        _assert_close(out, ref(x, y, lam_bh), jnp.float32, "lam [B, H] jit")
        # vmap over an extra leading axis (the batching rule of pallas_call / custom_vjp)
        xs = jnp.stack([x, 2.0 * x])
        out_v = jax.vmap(lambda x: f(x, y, lam_h))(xs)
        _assert_close(out_v[1], ref(2.0 * x, y, lam_h), jnp.float32, "vmap")
        # The gradient w.r.t. a shared scalar lam sums over (B, H).
        g = jax.grad(lambda lam: jnp.sum(f(x, y, lam)))(2.5)
        g_ref = jax.grad(lambda lam: jnp.sum(ref(x, y, lam)))(2.5)
        _assert_close(g, g_ref, jnp.float32, "dlam scalar")

    def test_exact_ties_use_zero_subgradient(self):
        """x == y exactly (tied landmarks): distance 0 on the diagonal, finite sign-form grads."""
        x, _, w, lam = _xy((1, 2, 20, 20, 16), jnp.float32, seed=3)
        f = lambda x, y: jnp.sum(w * kernels.laplace_kernel(x, y, lam, **self._kw()))
        d = kernels.l1_distance(x, x, **self._kw())
        np.testing.assert_array_equal(np.diagonal(np.asarray(d), axis1=2, axis2=3), 0.0)
        gx, gy = jax.grad(f, (0, 1))(x, x)
        rx, ry = jax.grad(lambda x, y: jnp.sum(w * kernels.laplace_kernel_reference(x, y, lam)),
                          (0, 1))(x, x)  # fmt: skip
        _assert_close(gx, rx, jnp.float32, "tied dx")
        _assert_close(gy, ry, jnp.float32, "tied dy")


class TestL1Xla(_L1Base):
    IMPL = "xla"


class TestL1PallasInterpret(_L1Base):
    IMPL = "pallas"
    INTERPRET = True


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU backend (compiled Triton kernels)")
class TestL1PallasGpu(_L1Base):
    IMPL = "pallas"
    INTERPRET = False
