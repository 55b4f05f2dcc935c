"""The feature-map protocol (`FeatureMap`, `KeyFeatures`) and the helpers feature maps
share (`sincos`, `cos_sin`, `scale_inputs`, the random-feature redraw policy `REDRAW`)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

_f32 = jnp.float32


#: pi / 2 in three parts (Cody-Waite): ``k * _PIO2[0]`` and ``k * _PIO2[1]`` are exact in
#: float32 for |x| < ~1e4, so the reduced argument keeps its accuracy there.
_PIO2 = (2 * 0.78515625, 2 * 2.4187564849853515625e-4, 2 * 3.77489497744594108e-8)
#: Minimax polynomials of sin and cos on [-pi/4, pi/4] (Cephes' single-precision sinf/cosf).
_SIN_C = (-1.6666654611e-1, 8.3321608736e-3, -1.9515295891e-4)
_COS_C = (4.166664568298827e-2, -1.388731625493765e-3, 2.443315711809948e-5)


def _reduced(x, rounding=jnp.round):
    """``(k, s, c)``: the quadrant count ``k = round(x 2/pi)`` (int32) and ``sin r``, ``cos r``
    of the reduced argument ``r = x - k pi/2``, ``|r| <= pi/4`` (float32 `x`)."""
    k = rounding(x * (2 / math.pi))
    r = ((x - k * _PIO2[0]) - k * _PIO2[1]) - k * _PIO2[2]
    r2 = r * r
    s = r + r * r2 * (_SIN_C[0] + r2 * (_SIN_C[1] + r2 * _SIN_C[2]))
    c = 1.0 - 0.5 * r2 + r2 * r2 * (_COS_C[0] + r2 * (_COS_C[1] + r2 * _COS_C[2]))
    return k.astype(jnp.int32), s, c


#: The random-feature redraw policies of performer and rfa (config key ``redraw``):
#: ``"never"`` (the default): every call uses the features kept in the params (the init
#: draw, or whatever a trainer's periodic redraw put there); ``"call"``: a call with
#: ``deterministic=False`` draws fresh features from its rng. A fresh kernel at every
#: training step keeps these mechanisms from learning tasks where attention must be
#: sharp (Pathfinder: 55% against 98.5% with the kept draw, docs/random_features.md), so
#: the kept draw is the default; the public codes keep a draw too (Performer-JAX in effect,
#: performer-pytorch between redraws every 1000 steps, RFA's stored bank).
REDRAW = ("never", "call")


def check_redraw(name: str, redraw) -> None:
    """`redraw` is one of `REDRAW`.

    Raises:
      ValueError: naming the mechanism, the value and the accepted ones.
    """
    if redraw not in REDRAW:
        raise ValueError(f"{name}: redraw must be one of {REDRAW}, got {redraw!r}")


def redraws(redraw: str, deterministic: bool) -> bool:
    """Whether a call under policy `redraw` draws fresh features (and so needs an rng)."""
    return redraw == "call" and not deterministic


@jax.custom_jvp
def sincos(x):
    """``(sin x, cos x)`` of float32 `x` with one shared range reduction.

    ``x = k pi/2 + r`` with ``|r| <= pi/4``, both from polynomials in r, swapped and negated
    by the quadrant ``k mod 4``. The trigonometric feature maps (flexformer, rfa) need both
    of the same argument; XLA's CPU `cos` and `sin` reduce the argument twice and cost
    about 4x an `exp` together, this costs about one (measured on [1, 4096, 4, 128]).
    Absolute error <= 1e-7 against float64 for |x| < 1e4 (the reduction's exact range;
    beyond it the error grows with |x|: <= 1e-6 at 1e5). Its derivatives are
    ``(cos x, -sin x)`` from the same outputs (a custom JVP: the backward pass costs two
    products). `cos_sin` gives both stacked, from one elementwise pass.
    """
    return _sin_cos(x.astype(_f32))


def _sin_cos(x, rounding=jnp.round):
    k, s, c = _reduced(x, rounding)
    q = k & 3  # the quadrant
    odd = (q & 1) == 1
    sin, cos = jnp.where(odd, c, s), jnp.where(odd, s, c)
    return jnp.where(q >= 2, -sin, sin), jnp.where((q == 1) | (q == 2), -cos, cos)


@sincos.defjvp
def _sincos_jvp(primals, tangents):
    # the exact derivatives from the outputs themselves: d sin = cos dx, d cos = -sin dx
    sin, cos = sincos(primals[0])
    dx = tangents[0].astype(_f32)
    return (sin, cos), (cos * dx, -sin * dx)


def _cos_sin_sum(x, terms):
    """``sum_p [cos x_p; sin x_p]`` -> ``[..., 2, M]`` (`cos_sin`)."""
    sin, cos = sincos.fun(x)  # the primal function itself (`cos_sin` has its own rule)
    m = x.shape[-1] // terms
    # a sum of slices, not a reduction: XLA fuses it with the rest
    sin, cos = (sum(t[..., p * m : (p + 1) * m] for p in range(terms)) for t in (sin, cos))
    return jnp.stack([cos, sin], axis=-2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def cos_sin(x, terms=1):
    """``sum_p [cos x_p; sin x_p]``: float32 `x` ``[..., terms M] -> [..., 2, M]``.

    The trigonometric features of `terms` projections ``x_p = x[..., p M:(p + 1) M]`` (one
    term: ``[cos x; sin x]``), the values of `sincos`, written so that XLA computes them in
    one fusion from one range reduction per element of `x` (its stack ends the fusion; a
    reshape to ``[..., 2M]`` gives the features ``[cos | sin]``, free). The backward pass (a
    custom VJP) is one elementwise pass, ``dx_p = cos x_p g_sin - sin x_p g_cos``, recomputed
    from `x`: only `x` is kept (half the output's size), and the output, read by nothing but
    its consumers, stays one fusion (a backward reading its halves had XLA compute each
    half in a fusion of its own, then copy them into the stack). Being a custom VJP, it
    takes reverse-mode differentiation only: ``jax.jvp`` (and ``jacfwd``) through it raise
    JAX's custom_vjp error; `sincos` (a custom JVP) takes both.
    """
    return _cos_sin_sum(x.astype(_f32), terms)


def _cos_sin_fwd(x, terms):
    return _cos_sin_sum(x.astype(_f32), terms), x


def _round_half_up(t):
    return jnp.floor(t + 0.5)


def _cos_sin_bwd(terms, x, g):
    # The same values (the rounding differs at exact ties only, where either quadrant is
    # exact) by other ops: XLA would otherwise merge this with the forward's computation and
    # read its two halves from there, which splits the forward fusion in two.
    sin, cos = _sin_cos(x.astype(_f32), _round_half_up)
    g_cos, g_sin = (jnp.concatenate([g[..., i, :]] * terms, axis=-1) for i in (0, 1))
    return ((cos * g_sin - sin * g_cos).astype(x.dtype),)


cos_sin.defvjp(_cos_sin_fwd, _cos_sin_bwd)


def scale_inputs(x):
    """``x^ = x d^(-1/4)`` in float32, so ``exp(q^ . k^) = exp(q . k / sqrt(d))``."""
    x = x.astype(_f32)
    return x * x.shape[-1] ** -0.25


# ---------------------------------------------------------------- the feature-map protocol
class KeyFeatures(NamedTuple):
    """What a feature-map mechanism hands the core for its keys (SPEC section 7).

    Attributes:
      phi: ``[B, Tk, H, M]`` float32 key features.
      log_scale: optional ``[B, Tk, H]``: the key features are ``exp(log_scale) phi``
        (`linear_attention`'s ``key_log_scale``; stabilised there by a detached max).
      log_decay: optional ``[B, Tk, H]`` log of a per-token state decay (a gated
        recurrence, causal only; `linear_attention`'s ``log_decay``).
    """

    phi: Any
    log_scale: Any = None
    log_decay: Any = None


def _accepted(fn: Callable, config: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of `config` that `fn` takes as keyword-only parameters."""
    names = {p.name for p in inspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY}
    return {k: v for k, v in config.items() if k in names}


@dataclasses.dataclass(frozen=True)
class FeatureMap:
    """A feature-map mechanism's features, exactly as its `attention` hands them to the core.

    ``la.get(name).feature_map`` (None for mechanisms that are not feature maps). Training
    code (distillation, recurrent decoding, sequence parallelism) goes through this record,
    so a new feature-map mechanism gets all of them by registering one::

        fm = la.get("performer").feature_map
        p = fm.resolve(params, rng, deterministic=False)    # this call's random features
        phi_q = fm.query(q, p)                              # [B, Tq, H, M]
        phi_k, log_scale, log_decay = fm.key(k, p)          # KeyFeatures
        out = core.attend(phi_q, phi_k, v, q.dtype, key_log_scale=log_scale,
                          log_decay=log_decay,
                          den_floor=fm.den_floor())         # == mechanism.attention(...)

    Attributes:
      query_fn: ``(q, params, **config) -> [B, Tq, H, M]`` float32.
      key_fn: ``(k, params, **config) -> KeyFeatures``.
      draw_fn: ``(params, rng, **config) -> params`` with freshly drawn random features
        (the redraw of a stochastic mechanism when ``deterministic=False``), or None.
      floor_fn: ``(**config) -> float``, the relative denominator floor gamma of this map
        (`den_floor`; when > 0 the features carry the key-mass channel, `mass_channel`),
        or None (no floor). Every caller of the core passes it on. A floor read from the
        config's ``den_floor`` must leave the features, less the channel, unchanged at
        ``den_floor=0``: the blocked non-causal pass then asks for them without the channel.
      token_wise: the features of each token depend on that token alone (not on the
        rest of the sequence), so the causal path may compute them chunk by chunk inside
        its scan (`attend_features`), never holding the whole sequence's features in the
        forward pass.
      config: config values (the mechanism's bound config); each function receives the
        keys it declares as keyword-only parameters.
    """

    query_fn: Callable[..., Any]
    key_fn: Callable[..., KeyFeatures]
    draw_fn: Callable[..., Any] | None = None
    floor_fn: Callable[..., float] | None = None
    token_wise: bool = False
    config: Mapping[str, Any] = dataclasses.field(default_factory=lambda: MappingProxyType({}))

    def bind(self, **config) -> FeatureMap:
        """This feature map with `config` values fixed."""
        return dataclasses.replace(self, config=MappingProxyType({**self.config, **config}))

    def _call(self, fn, *args, **config):
        return fn(*args, **_accepted(fn, {**self.config, **config}))

    def query(self, q, params, **config):
        """Query features ``[B, Tq, H, M]`` float32."""
        return self._call(self.query_fn, q, params, **config)

    def key(self, k, params, **config) -> KeyFeatures:
        """Key features with their log scale and log decay."""
        return KeyFeatures(*self._call(self.key_fn, k, params, **config))

    def den_floor(self, **config) -> float:
        """The relative denominator floor gamma (0.0: none) to pass to the core."""
        return 0.0 if self.floor_fn is None else float(self._call(self.floor_fn, **config))

    def resolve(self, params, rng=None, *, deterministic: bool = False, **config):
        """The params one call uses: `params` itself when deterministic (or when nothing is
        random), else `params` with the random features redrawn from `rng`."""
        if deterministic or self.draw_fn is None:
            return params
        return self._call(self.draw_fn, params, rng, **config)
