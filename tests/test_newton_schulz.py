"""kernels.newton_schulz: Newton-Schulz inverses (xla, Pallas) against the exact inverse,
convergence on well- and ill-conditioned kernel matrices, the custom gradient."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _kernel_inputs import (
    D_TOKENS,
    ON_GPU,
    _assert_close,
    _kernel_matrix,
    _residual_stats,
    _tokens,
)

import kernels

NS_IMPLS = [("xla", False), ("pallas", True)]


class TestNewtonSchulz:
    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
    @pytest.mark.parametrize("m", [16, 24, 64, 100])
    def test_pallas_matches_reference(self, m, dtype):
        """Interpret-mode kernel == jnp reference. m = 24 exercises the zero padding to 32;
        m = 100 (padded to 128) the tiled kernel with 2 x 2 tiles of 64."""
        a = _kernel_matrix("gauss", _tokens("random", 2, 2, m, seed=m)).astype(dtype)
        ref = kernels.newton_schulz_inverse_reference(a)
        for impl, interpret in NS_IMPLS:
            v = kernels.newton_schulz_inverse(a, impl=impl, interpret=interpret)
            assert v.dtype == jnp.float32 and v.shape == a.shape
            _assert_close(v, ref, dtype, f"NS {impl}")

    @pytest.mark.parametrize("kernel", ["laplace", "gauss"])
    @pytest.mark.parametrize("m", [16, 64, 256])
    def test_converges_well_conditioned(self, kernel, m):
        """Random tokens (cond(P) <= ~55 up to m = 256): max|PV - I| < 1e-5 after 20 steps
        (measured <= 2.6e-6), and V == inv(P) to 1e-5 relative (measured <= 1.4e-6)."""
        a = _kernel_matrix(kernel, _tokens("random", 1, 2, m, seed=m))
        p = a + 0.01 * jnp.eye(m)[None, None]
        inv = jnp.linalg.inv(p)
        impls = NS_IMPLS if m <= 64 else NS_IMPLS[:1]
        for impl, interpret in impls:
            v = kernels.newton_schulz_inverse(a, impl=impl, interpret=interpret)
            for max_abs, _, _, _ in _residual_stats(a, v):
                assert max_abs < 1e-5, (impl, max_abs)
            _assert_close(v, inv, jnp.float32, f"V vs inv(P) {impl}")

    def test_pallas_m256_interpret(self):
        """m = 256: the tiled kernel with 4 x 4 tiles."""
        a = _kernel_matrix("laplace", _tokens("random", 1, 1, 256, seed=7))
        v = kernels.newton_schulz_inverse(a, impl="pallas", interpret=True)
        _assert_close(v, kernels.newton_schulz_inverse_reference(a), jnp.float32, "m=256")
        assert _residual_stats(a, v)[0][0] < 1e-5

    @pytest.mark.parametrize("kernel", ["laplace", "gauss"])
    @pytest.mark.parametrize(
        "kind,m", [("dup4", 16), ("dup4", 64), ("dup4", 256), ("dup16", 64), ("collapsed", 64)]
    )
    def test_ill_conditioned_follows_theory(self, kernel, kind, m):
        """Near-duplicate landmarks (cond(P) up to ~6e3, capped by the +0.01 I ridge).

        The measured spectral residual |PV - I|_2 equals the exact-arithmetic prediction
        max |1 - alpha mu^2|^(2^20) up to float32 rounding, bounded by 2e-5 * cond(P) (measured
        <= 7.1e-6 * cond(P)); it always stays < 1 (the iteration never diverges). So 20 steps
        converge iff max_row_sum(P)^2 <~ 1.8e-4 * 2^20 / 14 ~ 13 (e.g. clusters of 4 at m <= 64:
        residual <= 4.2e-3), and otherwise leave the directions of the smallest eigenvalues
        under-inverted (e.g. 0.14 for Laplace dup4 m = 256, 0.95 for Gaussian collapsed m = 64).
        """
        a = _kernel_matrix(kernel, _tokens(kind, 1, 2, m, seed=m + len(kind)))
        v = kernels.newton_schulz_inverse(a, impl="xla")
        for max_abs, spec, pred, cond in _residual_stats(a, v):
            assert abs(spec - pred) <= 2e-5 * cond, (spec, pred, cond)
            assert spec < 1.0 and max_abs < 1.0
            if pred < 1e-6:  # converged in exact arithmetic: only rounding is left
                assert spec <= 2e-5 * cond

    def test_segment_mean_landmarks(self):
        """Landmark matrices as laplacian builds them: segment means (m = 16 segments of 16
        unit-Gaussian tokens, d = 16), Laplace kernel at lambda = d / 2. The symmetric
        A = kappa(K~, K~) converges in 20 steps on both paths (kernel entries ~0.5, so the
        max row sum is ~m / 2 yet sigma_min(P) stays well above eps); the non-symmetric
        A = kappa(Q~, K~) has a far smaller sigma_min(P) and has not converged at 20 steps."""
        kq, kk = jax.random.split(jax.random.key(3))
        seg = lambda x: x.reshape(1, 2, 16, 16, D_TOKENS).mean(3)  # noqa: E731
        q_lm = seg(jax.random.normal(kq, (1, 2, 256, D_TOKENS)))
        k_lm = seg(jax.random.normal(kk, (1, 2, 256, D_TOKENS)))
        shared = kernels.laplace_kernel_reference(k_lm, k_lm, D_TOKENS / 2)
        for impl, interpret in NS_IMPLS:
            v = kernels.newton_schulz_inverse(shared, impl=impl, interpret=interpret)
            for max_abs, _, _, _ in _residual_stats(shared, v):
                assert max_abs < 1e-4, (impl, max_abs)
        separate = kernels.laplace_kernel_reference(q_lm, k_lm, D_TOKENS / 2)
        p = np.asarray(separate, np.float64) + 0.01 * np.eye(16)
        v = np.asarray(kernels.newton_schulz_inverse(separate, impl="xla"), np.float64)
        sig_sep = np.linalg.svd(p, compute_uv=False)[..., -1]
        sig_shared = np.linalg.svd(np.asarray(shared) + 0.01 * np.eye(16), compute_uv=False)
        assert sig_sep.max() < 0.1 * sig_shared[..., -1].min()
        assert np.abs(p @ v - np.eye(16)).max() > 1e-2

    def test_more_iterations_converge_ill_conditioned(self):
        """The worst case above (Gaussian, collapsed, m = 64) converges with 32 steps."""
        a = _kernel_matrix("gauss", _tokens("collapsed", 1, 1, 64, seed=5))
        p = a + 0.01 * jnp.eye(64)[None, None]
        v = kernels.newton_schulz_inverse(a, iters=32, impl="pallas", interpret=True)
        cond = _residual_stats(a, v)[0][3]
        inv = np.linalg.inv(np.asarray(p, np.float64))
        err = np.abs(np.asarray(v, np.float64) - inv).max() / np.abs(inv).max()
        assert err < 1e-7 * cond, (err, cond)

    @pytest.mark.parametrize("impl,interpret", NS_IMPLS)
    def test_custom_grad_matches_exact_inverse_grad(self, impl, interpret):
        """dL/dA = -V^T G V^T equals jax.grad through jnp.linalg.inv(A + eps I) (non-symmetric
        A too: A = Laplace kernel between distinct query and key landmarks)."""
        kq, kk, kw = jax.random.split(jax.random.key(11), 3)
        q = jax.random.normal(kq, (2, 2, 32, D_TOKENS))
        k = q + 0.5 * jax.random.normal(kk, q.shape)
        a = kernels.laplace_kernel_reference(q, k, D_TOKENS**0.5)  # [2, 2, 32, 32], asymmetric
        w = jax.random.normal(kw, a.shape)
        eye = jnp.eye(32)[None, None]
        loss = lambda a: jnp.sum(
            w * kernels.newton_schulz_inverse(a, impl=impl, interpret=interpret)
        )
        loss_inv = lambda a: jnp.sum(w * jnp.linalg.inv(a + 0.01 * eye))
        _assert_close(jax.grad(loss)(a), jax.grad(loss_inv)(a), jnp.float32, "dA")
        # bf16 input: gradient in bf16, same rule.
        g16 = jax.grad(loss)(a.astype(jnp.bfloat16))
        assert g16.dtype == jnp.bfloat16
        _assert_close(g16, jax.grad(loss_inv)(a.astype(jnp.bfloat16).astype(jnp.float32)),
                      jnp.bfloat16, "dA bf16")  # fmt: skip

    @pytest.mark.parametrize("impl,interpret", NS_IMPLS)
    def test_jit_and_vmap(self, impl, interpret):
        a = _kernel_matrix("gauss", _tokens("random", 2, 1, 20, seed=8))
        f = jax.jit(lambda a: kernels.newton_schulz_inverse(a, impl=impl, interpret=interpret))
        stacked = jnp.stack([a, a[::-1]])  # extra leading axis
        out = jax.vmap(f)(stacked)
        _assert_close(out[1], kernels.newton_schulz_inverse_reference(a[::-1]), jnp.float32)

    def test_reference_grad_converges_to_inverse_grad(self):
        """The plain reference differentiates the 20 steps; once converged, same gradient."""
        a = _kernel_matrix("laplace", _tokens("random", 1, 2, 16, seed=3))
        w = jax.random.normal(jax.random.key(4), a.shape)
        g_ref = jax.grad(lambda a: jnp.sum(w * kernels.newton_schulz_inverse_reference(a)))(a)
        g = jax.grad(lambda a: jnp.sum(w * kernels.newton_schulz_inverse(a, impl="xla")))(a)
        _assert_close(g, g_ref, jnp.float32, "custom vs unrolled grad")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU backend (compiled Triton kernels)")
class TestNewtonSchulzGpu:
    @pytest.mark.parametrize("m", [16, 48, 64, 128, 256])
    def test_compiled_matches_reference(self, m):
        a = _kernel_matrix("laplace", _tokens("random", 2, 4, m, seed=m))
        v = kernels.newton_schulz_inverse(a, impl="pallas")
        _assert_close(v, kernels.newton_schulz_inverse_reference(a), jnp.float32, "NS gpu")
        w = jax.random.normal(jax.random.key(0), a.shape)
        g = jax.grad(lambda a: jnp.sum(w * kernels.newton_schulz_inverse(a, impl="pallas")))(a)
        g_x = jax.grad(lambda a: jnp.sum(w * kernels.newton_schulz_inverse(a, impl="xla")))(a)
        _assert_close(g, g_x, jnp.float32, "NS gpu grad")
