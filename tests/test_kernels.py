"""The kernels package as a whole: dispatch (impl="auto") and input validation, Triton
lowering for CUDA, the benchmark script. Each kernel has its own test file
(tests/test_l1_distance.py, tests/test_newton_schulz.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _kernel_inputs import (
    ON_GPU,
    _assert_close,
    _kernel_matrix,
    _residual_stats,
    _tokens,
    _xy,
)

import kernels
from kernels import _dispatch

# ---------------------------------------------------------------------------------------------
# Newton-Schulz
# ---------------------------------------------------------------------------------------------


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
