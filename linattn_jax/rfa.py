"""RFA: random feature attention with trigonometric features (Peng et al. 2021).

Queries and keys are unit-normalised; ``W = sigma * W~`` with ``W~ ~ N(0, I)``
fixed (``params["features"]``; redrawn from `rng` at every sampling call only with
``redraw="call"``, see `core.REDRAW`: by default every call uses the kept draw) and
``sigma [H, d]`` learnable (init 1); ``phi(x) = M^(-1/2) [sin(W x); cos(W x)]``,
so ``E[phi(q) . phi(k)] = exp(-|sigma * (q - k)|^2 / 2)``, a Gaussian kernel on
the unit sphere (``exp(q.k - 1)`` at init). The features can be negative: the
denominator is guarded (`core.guard_denominator`).

Causal with ``gate=True``: ``g_t = sigmoid(w_g . k_t + b_g)`` per head and
``S_t = g_t S_{t-1} + (1 - g_t) phi(k_t) v_t^T`` (likewise z), the gated
recurrence of the RFA paper, computed by the chunked core as a decay.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from linattn_jax import _checks, core
from linattn_jax.registry import Mechanism, register

#: Initial gate bias: sigmoid(2) ~ 0.88, a memory of roughly 8 tokens at init.
GATE_BIAS_INIT = 2.0


def init(rng, *, num_heads: int, head_dim: int, num_features: int = 128, gate: bool = False):
    """``features [H, M, d]`` (fixed draw), ``sigma [H, d]``; with `gate` also
    ``gate_w [H, d]`` (init 0) and ``gate_b [H]`` (init `GATE_BIAS_INIT`)."""
    _checks.check_positive("rfa", num_features=num_features)
    params = {
        "features": jax.random.normal(rng, (num_heads, num_features, head_dim), jnp.float32),
        "sigma": jnp.ones((num_heads, head_dim), jnp.float32),
    }
    if gate:
        params["gate_w"] = jnp.zeros((num_heads, head_dim), jnp.float32)
        params["gate_b"] = jnp.full((num_heads,), GATE_BIAS_INIT, jnp.float32)
    return params


#: Added under the square root of `_unit`'s norm: below float32's resolution of any squared
#: norm >= 1e-12 (so those norms are unchanged bit for bit), it keeps the square root's
#: derivative at an all-zero vector finite, so the zero gradient that reaches it through
#: the maximum stays 0 (the bare norm inside the maximum gave 0 * inf = NaN).
_TINY_SQ = 1e-30


def _unit(x):
    """``x / max(|x|, 1e-6)`` along the last axis (float32); an all-zero x gives zeros, with
    finite (zero) gradients."""
    x = x.astype(jnp.float32)
    return core.divide_rows(x, jnp.maximum(jnp.sqrt(core.rowdot(x, x) + _TINY_SQ), 1e-6))


def feature_map(x, params, features=None):
    """``[B, T, H, d] -> [B, T, H, 2M]`` trig features of the unit-normalised x."""
    w = params["features"] if features is None else features
    w = lax.stop_gradient(w.astype(jnp.float32)) * params["sigma"][:, None, :]
    # heads first (the d-wide input is transposed, not the 2M-wide features; see
    # `core.heads_last`), one shared range reduction for sin and cos (`core.sincos`)
    wx = jnp.einsum("bhtd,hmd->bhtm", jnp.swapaxes(_unit(x), 1, 2), w)
    sin, cos = core.sincos(wx)
    return core.heads_last(jnp.concatenate([sin, cos], axis=-1) * w.shape[1] ** -0.5)


def _key(k, params, *, gate=False):
    """Key features; with `gate`, ``(1 - g_t) phi(k_t)`` and the log decay ``log g_t``."""
    phi = feature_map(k, params)
    if not gate:
        return core.KeyFeatures(phi)
    a = jnp.einsum("bthd,hd->bth", _unit(k), params["gate_w"]) + params["gate_b"][None, None, :]
    return core.KeyFeatures(
        core.scale_rows(phi, jax.nn.sigmoid(-a)), log_decay=jax.nn.log_sigmoid(a)
    )


def _draw(params, rng, *, redraw="never"):
    """Fresh ``W~ ~ N(0, I)`` of the same size under ``redraw="call"``, else `params`."""
    if redraw != "call":
        return params
    return {**params, "features": jax.random.normal(rng, params["features"].shape, jnp.float32)}


FEATURE_MAP = core.FeatureMap(query_fn=feature_map, key_fn=_key, draw_fn=_draw, token_wise=True)


def _attend(q, k, v, params, rng, mask, causal, deterministic, chunk_size, gate, redraw, quadratic):
    _checks.check_inputs("rfa", q, k, v, mask, causal=causal)
    _checks.check_positive("rfa", chunk_size=chunk_size)
    core.check_redraw("rfa", redraw)
    _checks.check_rng("rfa", rng, not core.redraws(redraw, deterministic))
    h, d = q.shape[2], q.shape[3]
    _checks.require_params("rfa", params, "features")
    m = params["features"].shape[1] if params["features"].ndim == 3 else -1
    expected = {"features": (h, m, d), "sigma": (h, d)}
    if gate:
        expected.update(gate_w=(h, d), gate_b=(h,))
    _checks.check_params("rfa", params, expected)
    if gate and not causal:
        raise ValueError("rfa: gate=True is the causal recurrence; it needs causal=True")
    return core.attend_features(
        FEATURE_MAP,
        q,
        k,
        v,
        params,
        rng,
        mask=mask,
        causal=causal,
        deterministic=deterministic,
        chunk_size=chunk_size,
        quadratic=quadratic,
        gate=gate,
        redraw=redraw,
    )


def attention(
    q,
    k,
    v,
    params,
    rng=None,
    *,
    mask=None,
    causal=False,
    deterministic=False,
    chunk_size=64,
    gate=False,
    redraw="never",
):
    """RFA attention ``[B, Tq, H, Dv]``; see the module docstring. Uses
    ``params["features"]``, unless ``redraw="call"`` and ``deterministic=False``: then a
    fresh ``W~`` is drawn from `rng` (required then)."""
    return _attend(
        q, k, v, params, rng, mask, causal, deterministic, chunk_size, gate, redraw, False
    )


def reference(
    q,
    k,
    v,
    params,
    rng=None,
    *,
    mask=None,
    causal=False,
    deterministic=False,
    chunk_size=64,
    gate=False,
    redraw="never",
):
    """The naive quadratic form of `attention` (same features, gates as explicit decays)."""
    return _attend(
        q, k, v, params, rng, mask, causal, deterministic, chunk_size, gate, redraw, True
    )


MECHANISM = register(
    Mechanism(
        name="rfa",
        init_fn=init,
        attention_fn=attention,
        reference_fn=reference,
        supports_causal=True,
        stochastic=False,
        stochastic_fn=lambda *, redraw="never": redraw == "call",
        fixed_fn=lambda: frozenset({"features"}),
        feature_map_spec=FEATURE_MAP,
        params_config_fn=lambda params: {"num_features": params["features"].shape[1]},
        description="random feature attention, trig features, learnable sigma, gate (Peng et al. "
        "2021), O(T)",
    )
)
