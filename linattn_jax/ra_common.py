"""What RA and LARA (Zheng et al. 2022, seed 004) share: the notation, the masked softmax
and the checks of the sampling arguments.

Notation per head: ``x^ = x d^(-1/4)`` (so ``exp(q^ . k^) = exp(q . k / sqrt(d))``) and

    log xi(x, omega) = omega . x - |x|^2 / 2,

the log of the positive random feature of x at frequency omega. Since
``N(omega; 0, I) xi(q, omega) xi(k, omega) = exp(q . k) N(omega; q + k, I)``, softmax
attention is an expectation over a query-specific mixture of Gaussians:

    softmax attention_n = E_{omega ~ p_n}[f(omega)],
    p_n(omega) = sum_m pi_nm N(omega; q^_n + k^_m, I),   pi_n = softmax_m(q^_n . k^_m),
    f(omega) = sum_j softmax_j(log xi(k^_j, omega)) v_j.

``ra`` (quadratic, unbiased; `linattn_jax.ra`) samples p_n exactly; ``lara`` (linear;
`linattn_jax.lara`) replaces the T query-specific proposals by C shared Gaussians centred
on landmarks and combines them by self-normalised multiple importance sampling (MIS).

Random draws and padding. Draws are indexed by position, not by array size:
RA's draws for query n (its eps and one uniform) come from ``fold_in(key, n)``
and the sampled key is found by inverse-CDF search of ``pi_n`` (one uniform per
query, not a Gumbel array over the keys); LARA's noise for proposal c comes
from ``fold_in(key, c)``. So padding a sequence (masked keys, and extra queries or
landmark slots at the end) does not change the draws of the real positions,
and a padded call reproduces the unpadded one with the same rng. (Inverse-CDF
and Gumbel-max sample the same categorical; the CDF form needs one uniform per
query and is what makes the draws independent of the key count.)

Gradients: omega is reparameterised (``omega = mean + eps``), so gradients flow
into q, k (and the learned proposal) through the sample itself; the discrete
choice of RA's key m* carries no gradient.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from linattn_jax import _checks, _seq, core


def masked_softmax(logits, valid, axis, seq_axis=None):
    """``softmax(logits)`` over `axis` restricted to `valid` (broadcasts); all-invalid -> 0.

    The max is detached (it cancels); invalid entries go through ``exp(-inf) = 0``
    so neither the value nor the gradient sees them. `seq_axis`: `axis` is split over
    that mesh axis (inside ``shard_map``); the max and the sum run over its devices too.
    Differentiated as a softmax (`_softmax_jvp`: ``dy = y (dx - sum(y dx))``, which is 0
    at invalid entries and on all-invalid rows), not through its masks: with it RA's
    forward+backward at T = 1k ran in 76 ms instead of 124 (docs/performance.md).
    """
    return _softmax_where(logits, jnp.asarray(valid), axis, seq_axis)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
def _softmax_where(logits, valid, axis, seq_axis):
    m = _seq.masked_max(logits, valid, axis, seq_axis)
    e = jnp.exp(jnp.where(valid, logits - m, -jnp.inf))
    den = _seq.psum(jnp.sum(e, axis=axis, keepdims=True), seq_axis)
    return e / jnp.where(den > 0, den, 1.0)


@_softmax_where.defjvp
def _softmax_jvp(axis, seq_axis, primals, tangents):
    logits, valid = primals
    y = _softmax_where(logits, valid, axis, seq_axis)
    t = tangents[0]
    return y, y * (t - _seq.psum(jnp.sum(y * t, axis=axis, keepdims=True), seq_axis))


def sq_half(x):
    """``|x|^2 / 2`` over the last axis."""
    return 0.5 * core.rowdot(x, x)


def check_samples(name, rng, deterministic, num_samples):
    """Raises ValueError unless `num_samples` >= 1 and `rng` is given when not `deterministic`
    (`name` the mechanism, in the message)."""
    _checks.check_positive(name, num_samples=num_samples)
    _checks.check_rng(name, rng, deterministic)
