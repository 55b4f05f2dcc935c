"""Tests of the kernels package: Pallas (interpret mode on CPU, compiled on GPU) and xla paths
against the naive references, forward and gradients; Newton-Schulz convergence; dispatch and
input validation; Triton lowering; the benchmark script.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels
from kernels import _dispatch

ON_GPU = jax.default_backend() == "gpu"
# Relative tolerances (of the largest reference magnitude) keyed by input dtype. Both paths
# compute in float32 after the cast, so bf16 only loosens the comparison of bf16 gradients.
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}

# ((B, H, N, M, D), block sizes): N, M not multiples of the blocks (default 64 x 64, or 16 x 32
# and 16 x 16 with more programs per (batch, head)); D in {16, 33, 64, 128}. Block sizes only
# matter to the Pallas path.
SMALL_BLOCKS = kernels.BlockSizes(block_n=16, block_m=32, block_d=8)
L1_CASES = [
    ((1, 2, 37, 21, 33), SMALL_BLOCKS),
    ((2, 1, 16, 16, 16), None),
    ((1, 1, 70, 45, 64), None),
    ((1, 1, 19, 24, 128), kernels.BlockSizes(block_n=16, block_m=16, block_d=16)),
]


def _assert_close(actual, expected, dtype, msg="", scale=None):
    """max|actual - expected| <= TOL[dtype] * scale; scale defaults to max|expected|."""
    actual = np.asarray(jnp.asarray(actual, jnp.float32))
    expected = np.asarray(jnp.asarray(expected, jnp.float32))
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert np.all(np.isfinite(actual)), msg
    if scale is None:
        scale = float(np.max(np.abs(expected)))
    scale = max(scale, 1e-30)
    err = float(np.max(np.abs(actual - expected))) / scale
    assert err <= TOL[dtype], f"{msg}: relative error {err:.3g} > {TOL[dtype]}"


def _xy(shape, dtype, seed=0):
    b, h, n, m, d = shape
    kx, ky, kw, kl = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(kx, (b, h, n, d), jnp.float32).astype(dtype)
    y = jax.random.normal(ky, (b, h, m, d), jnp.float32).astype(dtype)
    w = jax.random.normal(kw, (b, h, n, m), jnp.float32)  # random linear functional
    lam = jnp.sqrt(float(d)) * jnp.exp(0.3 * jax.random.normal(kl, (h,), jnp.float32))
    return x, y, w, lam


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

        g = jax.grad(loss(lambda x, y: kernels.l1_distance(x, y, **self._kw(block_sizes))), (0, 1))
        g_ref = jax.grad(loss(kernels.l1_distance_reference), (0, 1))
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

        g = jax.grad(loss(f), (0, 1, 2))(x, y, lam)
        g_ref = jax.grad(loss(kernels.laplace_kernel_reference), (0, 1, 2))(x, y, lam)
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


# ---------------------------------------------------------------------------------------------
# Newton-Schulz
# ---------------------------------------------------------------------------------------------

D_TOKENS = 16


def _tokens(kind: str, b: int, h: int, m: int, seed: int = 0):
    """Landmark-like tokens [B, H, m, 16]: random, near-duplicate clusters or collapsed."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    if kind == "random":
        return jax.random.normal(k1, (b, h, m, D_TOKENS))
    if kind.startswith("dup"):  # m / c distinct centres, each repeated c times + 1e-3 noise
        c = int(kind[3:])
        centres = jax.random.normal(k1, (b, h, m // c, D_TOKENS))
        noise = 1e-3 * jax.random.normal(k2, (b, h, m, D_TOKENS))
        return jnp.repeat(centres, c, axis=2) + noise
    if kind == "collapsed":  # all tokens within ~0.05 of each other: kernel matrix ~ all ones
        return 0.05 * jax.random.normal(k1, (b, h, m, D_TOKENS))
    raise AssertionError(kind)


def _kernel_matrix(kernel: str, x):
    """Laplace (lambda = sqrt(d)) or Gaussian (SOFT scaling x d^-1/4) kernel matrix [B,H,m,m]."""
    if kernel == "laplace":
        return kernels.laplace_kernel_reference(x, x, D_TOKENS**0.5)
    xs = x * D_TOKENS**-0.25
    sq = jnp.sum((xs[:, :, :, None, :] - xs[:, :, None, :, :]) ** 2, axis=-1)
    return jnp.exp(-0.5 * sq)


def _residual_stats(a, v, eps=0.01):
    """Per matrix: max|PV - I|, spectral |PV - I|, predicted spectral residual, cond(P).

    P symmetric => every V_k is a polynomial in P and I - P V_{k+1} = (I - P V_k)^2, so
    |I - P V_K|_2 = max_mu |1 - alpha mu^2|^(2^K) over the eigenvalues mu of P (float64 here).
    """
    a = np.asarray(a, np.float64).reshape(-1, a.shape[-2], a.shape[-1])
    v = np.asarray(v, np.float64).reshape(a.shape)
    eye = np.eye(a.shape[-1])
    out = []
    for ai, vi in zip(a, v):
        p = ai + eps * eye
        r = p @ vi - eye
        mu = np.linalg.eigvalsh(p)
        absp = np.abs(p)
        alpha = 1.8 / (absp.sum(1).max() * absp.sum(0).max())
        pred = float(np.max(np.abs(1.0 - alpha * mu**2)) ** (2**20))
        out.append((np.abs(r).max(), np.linalg.norm(r, 2), pred, mu.max() / mu.min()))
    return out


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


# ---------------------------------------------------------------------------------------------
# Dispatch, validation, lowering, bench
# ---------------------------------------------------------------------------------------------


class TestDispatchAndValidation:
    def test_auto_picks_xla_on_cpu_and_pallas_on_gpu(self):
        expected = "pallas" if ON_GPU else "xla"
        assert _dispatch.resolve_impl("op", "auto") == expected
        x, y, _, lam = _xy((1, 2, 8, 8, 16), jnp.float32)
        a = _kernel_matrix("laplace", _tokens("random", 1, 2, 16))
        calls = {
            "l1": lambda impl: kernels.l1_distance(x, y, impl=impl),
            "laplace": lambda impl: kernels.laplace_kernel(x, y, lam, impl=impl),
            "ns": lambda impl: kernels.newton_schulz_inverse(a, impl=impl),
        }
        for name, call in calls.items():
            jaxpr = str(jax.make_jaxpr(lambda call=call: call("auto"))())
            assert ("pallas_call" in jaxpr) == ON_GPU, name
            jaxpr_pallas = str(jax.make_jaxpr(lambda call=call: call("pallas"))())
            assert "pallas_call" in jaxpr_pallas, name

    def test_bad_impl_raises(self):
        x, y, _, _ = _xy((1, 1, 4, 4, 8), jnp.float32)
        with pytest.raises(ValueError, match="impl must be one of"):
            kernels.l1_distance(x, y, impl="triton")
        with pytest.raises(ValueError, match="impl must be one of"):
            kernels.newton_schulz_inverse(jnp.zeros((1, 1, 4, 4)), impl="cuda")

    @pytest.mark.parametrize(
        "xs,ys,pattern",
        [
            ((2, 8, 4), (1, 2, 8, 4), r"x must have rank 4, got x.shape=\(2, 8, 4\)"),
            ((1, 2, 8, 4), (1, 2, 8, 5), r"x.shape=\(1, 2, 8, 4\) and y.shape=\(1, 2, 8, 5\)"),
            ((1, 2, 8, 4), (2, 2, 8, 4), r"x.shape=\(1, 2, 8, 4\) and y.shape=\(2, 2, 8, 4\)"),
            ((1, 2, 8, 4), (1, 3, 8, 4), r"x.shape=\(1, 2, 8, 4\) and y.shape=\(1, 3, 8, 4\)"),
        ],
    )
    def test_bad_l1_shapes_raise(self, xs, ys, pattern):
        for f in (
            lambda: kernels.l1_distance(jnp.zeros(xs), jnp.zeros(ys)),
            lambda: kernels.laplace_kernel(jnp.zeros(xs), jnp.zeros(ys), 1.0),
            lambda: kernels.l1_distance_reference(jnp.zeros(xs), jnp.zeros(ys)),
        ):
            with pytest.raises(ValueError, match=pattern):
                f()

    def test_bad_lam_and_block_sizes_raise(self):
        x, y, _, _ = _xy((2, 3, 4, 4, 8), jnp.float32)
        for lam in (jnp.ones((2,)), jnp.ones((3, 2)), jnp.ones((2, 3, 4)), jnp.ones((2, 3, 1, 2))):
            with pytest.raises(ValueError, match=r"lam.shape=" + str(lam.shape).replace("(", r"\(")
                               .replace(")", r"\)")):  # fmt: skip
                kernels.laplace_kernel(x, y, lam)
        with pytest.raises(ValueError, match="block_n=48 must be a power of 2"):
            kernels.l1_distance(x, y, impl="pallas", block_sizes=kernels.BlockSizes(block_n=48))
        with pytest.raises(ValueError, match="x.dtype=int32"):
            kernels.l1_distance(jnp.zeros((1, 1, 2, 2), jnp.int32), jnp.zeros((1, 1, 2, 2)))

    def test_bad_ns_inputs_raise(self):
        with pytest.raises(ValueError, match=r"a.shape=\(1, 2, 4, 5\)"):
            kernels.newton_schulz_inverse(jnp.zeros((1, 2, 4, 5)))
        with pytest.raises(ValueError, match=r"a must have rank 4, got a.shape=\(4, 4\)"):
            kernels.newton_schulz_inverse(jnp.zeros((4, 4)))
        with pytest.raises(ValueError, match=r"m <= 256, got a.shape=\(1, 1, 257, 257\)"):
            kernels.newton_schulz_inverse(jnp.zeros((1, 1, 257, 257)), impl="pallas")
        for iters in (0, -3, 2.5, True):
            with pytest.raises(ValueError, match="iters must be an int >= 1"):
                kernels.newton_schulz_inverse(jnp.zeros((1, 1, 4, 4)), iters=iters)
        for eps in (-0.1, float("nan"), float("inf"), "0.01"):
            with pytest.raises(ValueError, match="eps must be a finite float >= 0"):
                kernels.newton_schulz_inverse(jnp.zeros((1, 1, 4, 4)), eps=eps)
        # numpy scalars are fine
        v = kernels.newton_schulz_inverse(jnp.eye(4)[None, None], iters=np.int64(30),
                                          eps=np.float32(0.0))  # fmt: skip
        _assert_close(v, jnp.eye(4)[None, None], jnp.float32, "inverse of I")
        # m > 256 is fine on the xla path.
        a = _kernel_matrix("laplace", _tokens("random", 1, 1, 260))
        v = kernels.newton_schulz_inverse(a, impl="xla")
        assert _residual_stats(a, v)[0][0] < 1e-5


def test_kernels_lower_to_triton_for_cuda():
    """Cross-lowering on CPU: every Pallas kernel (forward and backward) lowers to a Triton
    custom call for CUDA (block shapes are powers of 2, ops supported by the Triton lowering).
    This does not compile the Triton IR to PTX; the GPU test classes do."""
    x = jax.ShapeDtypeStruct((2, 3, 130, 33), jnp.float32)
    y = jax.ShapeDtypeStruct((2, 3, 70, 33), jnp.float32)
    lam = jax.ShapeDtypeStruct((3,), jnp.float32)
    a = jax.ShapeDtypeStruct((2, 3, 200, 200), jnp.float32)
    ns = lambda a: kernels.newton_schulz_inverse(a, impl="pallas")
    cases = {
        "l1_fwd_bwd": (
            jax.grad(lambda x, y: kernels.l1_distance(x, y, impl="pallas").sum(), (0, 1)),
            (x, y),
            3,
        ),  # fmt: skip
        "laplace_fwd_bwd": (
            jax.grad(
                lambda x, y, l: kernels.laplace_kernel(x, y, l, impl="pallas").sum(), (0, 1, 2)
            ),
            (x, y, lam),
            3,
        ),  # fmt: skip
        "ns_whole": (ns, (jax.ShapeDtypeStruct((2, 3, 48, 48), jnp.float32),), 1),
        "ns_tiled": (ns, (a,), 1),
    }
    for name, (f, args, n_kernels) in cases.items():
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("__gpu$xla.gpu.triton") == n_kernels, name


def test_bench_smoke():
    from kernels import bench

    table = bench.main(
        ["--n", "20", "--m", "12", "--d", "16", "--ns-bh", "2", "--ns-sizes", "16",
         "--repeats", "1", "--residual-m", "16", "--residual-iters", "10", "20"]
    )  # fmt: skip
    lines = table.splitlines()
    residual_rows = [line for line in lines if line.startswith(("| shared", "| separate"))]
    assert len(residual_rows) == 2
    rows = [line for line in lines if line.startswith("| laplace") or line.startswith("| newton")]
    assert len(rows) == 6
    for row in rows:
        t_fwd, t_bwd = (float(c) for c in row.strip("|").split("|")[-2:])
        assert t_fwd > 0 and t_bwd > 0
