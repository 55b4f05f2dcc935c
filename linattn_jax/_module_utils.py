"""Helpers shared by the nnx and linen modules: flax's attention conventions (masks, bias,
dropout, ``sow_weights``) applied to a registered mechanism, the head axes of mechanism
params, and the decode state."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from linattn_jax import _checks, core, registry

#: Logical axis names of the projection kernels (map them to mesh axes with rules).
QKV_AXES = ("embed", "heads", "kv")
OUT_AXES = ("heads", "kv", "embed")
#: Logical name of a mechanism param's head axis.
HEAD_AXIS = "heads"


def bound_mechanism(name: str, config: Mapping[str, Any] | None) -> registry.Mechanism:
    """The registry mechanism `name` with `config` bound (validated: unknown keys raise)."""
    return registry.get(name).bind(**dict(config or {}))


def split_params(mech: registry.Mechanism, params: Mapping[str, Any]):
    """``(trainable, fixed)`` dicts of a mechanism's params."""
    fixed = mech.fixed_params()
    trainable = {k: v for k, v in params.items() if k not in fixed}
    return trainable, {k: v for k, v in params.items() if k in fixed}


def head_dims(num_heads: int, features: int) -> int:
    if features % num_heads:
        raise ValueError(f"qkv_features={features} must be divisible by num_heads={num_heads}")
    return features // num_heads


def param_axes(mech: registry.Mechanism, num_heads: int, head_dim: int) -> dict[str, Any]:
    """``{param name: logical axis names}`` of the mechanism's params: an axis whose size
    follows `num_heads` is ``"heads"``, the others None; None for a param with no head axis
    (shared by the heads, e.g. performer's features). Read off the shapes `mech.init` gives
    for `num_heads` and ``num_heads + 1`` heads (nothing is computed)."""

    def shapes(h):
        fn = lambda r: mech.init(r, num_heads=h, head_dim=head_dim)  # noqa: E731
        return jax.eval_shape(fn, jax.random.key(0))

    a, b = shapes(num_heads), shapes(num_heads + 1)
    out = {}
    for key, leaf in a.items():
        sa, sb = getattr(leaf, "shape", None), getattr(b[key], "shape", None)
        names = None
        if sa is not None and sb is not None and len(sa) == len(sb) and sa != sb:
            names = tuple(HEAD_AXIS if x != y else None for x, y in zip(sa, sb))
        out[key] = names
    return out


def has_params(mech: registry.Mechanism) -> bool:
    """Whether `mech` (with its bound config) creates any params."""
    shapes = jax.eval_shape(lambda r: mech.init(r, num_heads=1, head_dim=8), jax.random.key(0))
    return bool(jax.tree_util.tree_leaves(shapes))


# ----------------------------------------------------------------------------- flax masks


def _tril(tq, tk, xp=jnp):
    return xp.tril(xp.ones((tq, tk), bool))[None, None]


def _representable(m, causal, xp):
    """``(key_pad [B, Tk], ok [B])`` of a bool ``[B, H, Tq, Tk]`` mask `m` (see
    `key_padding`)."""
    tq, tk = m.shape[-2:]
    if causal:
        m = m & _tril(tq, tk, xp)
    kp = xp.any(m, axis=(1, 2))
    expect = xp.any(m, axis=-1)[..., None] & kp[:, None, None, :]
    if causal:
        expect = expect & _tril(tq, tk, xp)
    return kp, xp.all(m == expect, axis=(1, 2, 3))


def key_padding(name: str, mask, *, causal: bool, shape, causal_ok: bool = True):
    """Flax's `mask` (broadcastable to ``[B, H, Tq, Tk]``, True = attend) as the key-padding
    mask ``[B, Tk]`` a mechanism takes, and whether it is exactly one.

    With `causal`, the causal mask is ANDed in first. The mask is representable when it
    equals ``row[b, h, i] & key_pad[b, j] (& j <= i)``: one key-padding pattern shared by
    every head and query, where a query row may be all False (a padded query; its output
    is the mechanism's for the key padding, as flax's own is meaningless there). Returns
    ``(key_pad, ok)``. A concrete mask (also one closed over inside ``jit``) is checked
    now, in numpy: a mismatch raises ValueError naming the mask's shape and what to pass
    instead, and `ok` is None. A traced mask's values are unknown until it runs: `ok` is a
    ``[B]`` bool with which the caller poisons the unrepresentable batch rows with NaN.
    """
    concrete = not isinstance(mask, jax.core.Tracer)
    xp = np if concrete else jnp
    try:
        m = xp.broadcast_to(xp.asarray(mask).astype(bool), shape)
    except (ValueError, TypeError):
        raise ValueError(
            f"{name}: mask of shape {jnp.shape(mask)} does not broadcast to "
            f"[batch, heads, q_len, kv_len] = {shape}"
        ) from None
    kp, ok = _representable(m, causal, xp)
    if not concrete:
        return kp, ok
    if not ok.all():
        raise ValueError(_mask_message(name, m, jnp.shape(mask), causal, causal_ok))
    return kp, None


def _mask_message(name, m, shape, causal, causal_ok):
    """Why a concrete flax mask is not a key-padding mask (and causal), and what to pass."""
    if not causal and m.shape[-2] == m.shape[-1] and _representable(m, True, np)[1].all():
        if np.array_equal(m, m & _tril(*m.shape[-2:], np)):
            if not causal_ok:
                return (
                    f"{name}: mask of shape {shape} is causal and {name} cannot be causal; "
                    f"causal mechanisms: {registry.causal_names()}"
                )
            return (
                f"{name}: mask of shape {shape} is causal (e.g. nn.make_causal_mask); say so: "
                f"attention_fn({name!r}, causal=True), is_causal=True for nnx, or causal=True "
                "to la's MultiHeadAttention, with the mask holding only the padding (or None)"
            )
    what = "a key-padding mask" + (" ANDed with the causal mask" if causal else "")
    return (
        f"{name}: mask of shape {shape} is not {what}: it has a per-head or per-query pattern "
        f"{name} cannot represent. Pass nn.make_attention_mask(query_pad, key_pad) (one "
        "pattern shared by every head and query) with causality as causal=True, or use "
        "attention='softmax', which honours any mask"
    )


# ----------------------------------------------------------------------------- attention


def flax_attention(
    mech: registry.Mechanism,
    query,
    key,
    value,
    params,
    rng=None,
    *,
    bias=None,
    mask=None,
    causal: bool = False,
    deterministic: bool = True,
    dropout_rate: float = 0.0,
    broadcast_dropout: bool = True,
    dropout_rng=None,
    dtype=None,
    precision=None,
    module=None,
    force_fp32_for_softmax: bool = False,
    einsums=(None, None),
    attend=None,
):
    """`mech` under flax's attention conventions, ``[B, Tq, H, Dv]``.

    A mechanism with a `Mechanism.flax_fn` (softmax: flax's own ``dot_product_attention``;
    ra) is that function, without `attend`: any mask, bias, dropout and, for softmax,
    ``sow_weights`` (`module`). Any other mechanism
    takes the mask through `key_padding` (a key-padding mask and causality, which
    `causal` states) and refuses a bias, ``dropout_rate > 0``, a `module` to sow into and
    custom einsums with a ValueError naming the argument. `rng` (None: deterministic)
    drives a sampling mechanism; `attend` replaces ``mech.attention`` (e.g. the
    sequence-parallel form).
    """
    name = mech.name
    if mech.flax_fn is not None and attend is None:
        return mech.flax_fn(
            mech, query, key, value, rng, bias=bias, mask=mask, causal=causal, module=module,
            force_fp32_for_softmax=force_fp32_for_softmax, einsums=einsums,
            broadcast_dropout=broadcast_dropout, dropout_rng=dropout_rng,
            dropout_rate=dropout_rate, deterministic=deterministic, dtype=dtype,
            precision=precision,
        )  # fmt: skip
    _checks.refuse_unsupported(
        name, bias=bias, dropout_rate=dropout_rate, module=module, einsums=einsums
    )
    b, tq, h, _ = query.shape
    tk = key.shape[1]
    if causal and not mech.supports_causal:
        raise ValueError(
            f"causal=True: {name} cannot be causal; causal mechanisms: {registry.causal_names()}"
        )
    if causal and tq != tk:
        raise ValueError(
            f"causal=True needs q_len == kv_len, got query {query.shape}, key {key.shape}"
        )
    key_mask, ok = None, None
    if mask is not None:
        key_mask, ok = key_padding(
            name, mask, causal=causal, shape=(b, h, tq, tk), causal_ok=mech.supports_causal
        )
    if dtype is not None:
        query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))
    with _checks.matmul_precision(name, precision):
        out = (attend or mech.attention)(
            query,
            key,
            value,
            params,
            rng,
            mask=key_mask,
            causal=causal,
            deterministic=rng is None,
        )
    if ok is not None:
        out = jnp.where(ok[:, None, None, None], out, jnp.nan)
    return out


def flax_call(mech, params, causal: bool, query, key, value, bias, mask, kwargs):
    """An ``attention_fn`` call with flax's keyword arguments `kwargs` (those of
    ``nn.dot_product_attention`` and nnx's ``is_causal``): `flax_attention`. A sampling
    mechanism samples with ``dropout_rng`` when ``deterministic=False``."""
    kw = dict(kwargs)
    is_causal = kw.pop("is_causal", False)
    einsums = (kw.pop("qk_attn_weights_einsum", None), kw.pop("attn_weights_value_einsum", None))
    deterministic = kw.pop("deterministic", False)
    rng = kw.get("dropout_rng") if mech.stochastic and not deterministic else None
    return flax_attention(
        mech,
        query,
        key,
        value,
        params,
        rng,
        bias=bias,
        mask=mask,
        causal=bool(causal or is_causal),
        deterministic=deterministic,
        einsums=einsums,
        **kw,
    )


def attention_function(mech: registry.Mechanism, causal: bool):
    """The ``attention_fn`` of a param-free mechanism (a plain function)."""

    def fn(
        query,
        key,
        value,
        bias=None,
        mask=None,
        broadcast_dropout=True,
        dropout_rng=None,
        dropout_rate=0.0,
        deterministic=False,
        dtype=None,
        precision=None,
        module=None,
        force_fp32_for_softmax=False,
        qk_attn_weights_einsum=None,
        attn_weights_value_einsum=None,
        is_causal=False,
    ):
        return flax_call(mech, {}, causal, query, key, value, bias, mask, flax_kwargs(locals()))

    fn.__doc__ = f"flax attention_fn running {mech.name!r} (causal={causal})"
    return fn


#: Flax's keyword options of an ``attention_fn`` call.
FLAX_KWARGS = (
    "broadcast_dropout",
    "dropout_rng",
    "dropout_rate",
    "deterministic",
    "dtype",
    "precision",
    "module",
    "force_fp32_for_softmax",
    "qk_attn_weights_einsum",
    "attn_weights_value_einsum",
    "is_causal",
)


def flax_kwargs(local_vars: Mapping[str, Any]) -> dict[str, Any]:
    """Flax's keyword options out of an ``attention_fn``'s ``locals()``."""
    return {k: local_vars[k] for k in FLAX_KWARGS}


def flax_mask(mask, b: int, tk: int):
    """The modules' `mask`: a ``[B, Tk]`` key-padding mask (rank 2) as flax's
    ``[B, 1, 1, Tk]``; any other (flax's format, or None) unchanged."""
    if mask is not None and jnp.ndim(mask) == 2:
        if jnp.shape(mask) != (b, tk):
            raise ValueError(
                f"mask: a rank-2 mask is a key-padding mask [batch, kv_len] = {(b, tk)}, got "
                f"shape {jnp.shape(mask)} (flax's masks are [batch, heads|1, q_len, kv_len])"
            )
        return jnp.asarray(mask)[:, None, None, :]
    return mask


def resolve_inputs(inputs_q, inputs_k, inputs_v):
    """Flax's rule: `inputs_k` defaults to `inputs_q`, `inputs_v` to `inputs_k`."""
    if inputs_k is None:
        if inputs_v is not None:
            raise ValueError("inputs_v: needs inputs_k too (pass inputs_k, or neither)")
        inputs_k = inputs_q
    return inputs_k, inputs_k if inputs_v is None else inputs_v


def refuse_attention_fn(cls: str, attention_fn) -> None:
    if attention_fn is not None:
        raise ValueError(
            f"attention_fn: {cls} runs a registered mechanism (attention='...'); to keep "
            "flax's own module with a mechanism, pass attention_fn=la.linen/nn.attention_fn(...)"
            " to it instead"
        )


# ----------------------------------------------------------------------------- decoding


def decode_init(mech, params, *, batch: int, num_heads: int, head_dim: int, max_len: int, dtype):
    """The empty decode state: the recurrent state of a feature-map mechanism, else a KV
    cache ``(keys, values, index)`` of `max_len` positions."""
    fmap = mech.feature_map
    if fmap is not None:
        q = jax.ShapeDtypeStruct((batch, 1, num_heads, head_dim), dtype)
        m = jax.eval_shape(lambda x: fmap.query(x, params), q).shape[-1]
        return core.recurrent_init(batch, num_heads, m, head_dim)
    if max_len < 1:
        raise ValueError(
            f"{mech.name!r} is not a feature map and decodes with a KV cache: "
            "MultiHeadAttention(decode=True) needs max_len >= 1 (or a cache initialised from "
            "the full-length input [batch, max_len, features], as flax's decode does)"
        )
    shape = (batch, max_len, num_heads, head_dim)
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.int32(0)


def decode_step(mech, q, k, v, params, state):
    """One token of causal attention: ``(out [B, 1, H, Dv], new state)``.

    A KV cache that is full returns NaN rather than overwrite its last position."""
    fmap = mech.feature_map
    if fmap is not None:
        phi_q, keys = fmap.query(q, params), fmap.key(k, params)
        out, new = core.recurrent_step(state, phi_q, keys, v, den_floor=fmap.den_floor())
        return out.astype(q.dtype), new
    kc, vc, idx = state
    b, max_len = kc.shape[:2]
    kc = jax.lax.dynamic_update_slice_in_dim(kc, k.astype(kc.dtype), idx, axis=1)
    vc = jax.lax.dynamic_update_slice_in_dim(vc, v.astype(vc.dtype), idx, axis=1)
    mask = jnp.broadcast_to(jnp.arange(max_len)[None, :] <= idx, (b, max_len))
    out = mech.attention(q, kc, vc, params, None, mask=mask, deterministic=True)
    out = jnp.where(idx < max_len, out, jnp.nan)
    return out, (kc, vc, idx + 1)


def check_decode_inputs(cls: str, inputs_q, inputs_k, inputs_v, mask, *, one_token) -> None:
    """Decoding is causal self-attention of one token ``[B, 1, F]`` per call (`one_token`;
    flax creates the cache from the full-length input)."""
    self_attention = inputs_k is inputs_q and inputs_v is inputs_q
    if inputs_q.ndim != 3 or (one_token and inputs_q.shape[1] != 1) or not self_attention:
        raise ValueError(
            f"{cls}(decode=True) takes one token of self-attention [B, 1, F]; got inputs_q "
            f"{inputs_q.shape}" + ("" if self_attention else " with separate inputs_k/inputs_v")
        )
    if mask is not None:
        raise ValueError(f"mask: {cls}(decode=True) takes no mask (the cache is causal)")
