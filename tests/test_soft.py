"""soft (SOFT): the full Gaussian kernel at m = T."""

from __future__ import annotations

from _nystrom import (
    _apply,
    _close,
    _gauss_np,
    _inputs,
    _np,
)

from linattn_jax import soft as sf


def test_soft_m_equals_t_is_full_gaussian_kernel():
    """soft with landmarks = tokens: C_q A^+ C_k = K (tied: K = Gaussian(q^, q^)), so
    out = K V ("none") and K V / K 1 ("row"); k is unused when tied."""
    q, k, v = _inputs(2, tq=8)
    kmat = _gauss_np(_np(q), _np(q))
    errs = {}
    for norm, want in (
        ("none", _apply(kmat, _np(v))),
        ("row", _apply(kmat / kmat.sum(-1, keepdims=True), _np(v))),
    ):
        for inverse, iters in (("exact", 20), ("iterative", 60)):
            out = sf.soft_attention(
                q, k * 7.0, v, {}, num_landmarks=8, eps=0.0, normalize=norm, inverse=inverse,
                ns_iters=iters,
            )  # fmt: skip
            errs[norm, inverse] = _close(out, want, 2e-4, f"{norm} {inverse}")
    # Untied: the key side is k, and with m = T the estimate is the full K(q^, k^).
    kmat = _gauss_np(_np(q), _np(k))
    out = sf.soft_attention(q, k, v, {}, num_landmarks=8, eps=0.0, inverse="exact", tie_qk=False)
    errs["untied"] = _close(out, _apply(kmat, _np(v)), 2e-4, "untied")
    print("soft m=T max abs err:", errs)
