"""Input validation shared by every mechanism. Everything here runs at trace time."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from linattn_jax import registry
from linattn_jax.registry import causal_names


def check_inputs(name: str, q, k, v, mask=None, *, causal: bool = False) -> None:
    """Validates ``q [B, Tq, H, Dk]``, ``k [B, Tk, H, Dk]``, ``v [B, Tk, H, Dv]`` and ``mask``.

    Raises:
      ValueError: wrong rank, mismatched B/H/Dk/Tk, a bad mask shape or dtype, or
        ``causal=True`` with ``Tq != Tk``; the message names the argument and shapes.
      TypeError: a non-floating q, k or v.
    """
    for arg, x in (("q", q), ("k", k), ("v", v)):
        if jnp.ndim(x) != 4:
            raise ValueError(
                f"{name}: {arg} must have rank 4 [batch, length, heads, depth], got shape "
                f"{jnp.shape(x)}"
            )
        if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
            raise TypeError(f"{name}: {arg} must be a floating dtype, got {jnp.result_type(x)}")
    (bq, tq, hq, dq), (bk, tk, hk, dk), (bv, tv, hv, _) = q.shape, k.shape, v.shape
    if not bq == bk == bv:
        raise ValueError(
            f"{name}: batch sizes differ: q {q.shape}, k {k.shape}, v {v.shape} (axis 0)"
        )
    if not hq == hk == hv:
        raise ValueError(
            f"{name}: head counts differ: q {q.shape}, k {k.shape}, v {v.shape} (axis 2)"
        )
    if dq != dk:
        raise ValueError(f"{name}: q and k depths differ: q {q.shape}, k {k.shape} (axis 3)")
    if tk != tv:
        raise ValueError(f"{name}: k and v lengths differ: k {k.shape}, v {v.shape} (axis 1)")
    if mask is not None:
        if jnp.shape(mask) != (bk, tk):
            raise ValueError(
                f"{name}: mask must be a key-padding mask [batch, Tk] = {(bk, tk)}, got shape "
                f"{jnp.shape(mask)}"
            )
        if jnp.result_type(mask) != jnp.bool_:
            raise TypeError(
                f"{name}: mask must be bool (True = attend), got {jnp.result_type(mask)}"
            )
    if causal and tq != tk:
        raise ValueError(f"{name}: causal=True needs Tq == Tk, got q {q.shape}, k {k.shape}")


def check_causal_supported(name: str, causal: bool) -> None:
    """Raises NotImplementedError for ``causal=True`` on a mechanism without causal support."""
    if causal:
        raise NotImplementedError(
            f"{name} does not support causal=True; causal mechanisms: {causal_names()}"
        )


def _is_key(rng) -> bool:
    """A typed key (`jax.random.key`) or a legacy uint32 ``[2]`` key (`jax.random.PRNGKey`)."""
    dtype = getattr(rng, "dtype", None)
    if dtype is None:
        return False
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return True
    return dtype == jnp.uint32 and tuple(rng.shape)[-1:] == (2,)


def check_rng(name: str, rng, deterministic: bool) -> None:
    """A sampling call (``deterministic=False``) needs an rng key, and a key it is.

    Raises:
      ValueError: `rng` is None on a sampling call.
      TypeError: `rng` is not a key (e.g. the int ``0``); the message names its type.
    """
    if deterministic:
        return
    if rng is None:
        raise ValueError(
            f"{name}: rng is required when deterministic=False (the mechanism samples); "
            "pass a jax.random.key or deterministic=True"
        )
    if not _is_key(rng):
        raise TypeError(
            f"{name}: rng must be a jax.random.key (or a legacy uint32[2] jax.random.PRNGKey), "
            f"got {type(rng).__name__} {_short(rng)}; e.g. rng=jax.random.key(0)"
        )


def check_positive(name: str, **values) -> None:
    """Each config value must be an int >= 1."""
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: {key} must be an int >= 1, got {value!r}")


def check_float(name: str, key: str, value, ok, accepted: str) -> None:
    """`value` must be a real number (not a bool) with ``ok(value)`` (NaN fails any
    comparison); `accepted` says which, e.g. ``"a float > 0"``."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not ok(value):
        raise ValueError(f"{name}: {key} must be {accepted}, got {value!r}")


def check_bool(name: str, key: str, value) -> None:
    """`value` must be True or False (not 0 / 1 or a truthy object)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name}: {key} must be True or False, got {value!r}")


def check_choice(name: str, key: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name}: {key} must be one of {list(choices)}, got {value!r}")


def require_params(name: str, params, *keys: str) -> None:
    """Checks that `params` is a mapping with every one of `keys` (the mechanism's ``init``
    makes them); TypeError for None or another kind of tree, ValueError for a missing key."""
    if not isinstance(params, Mapping):
        raise TypeError(
            f"{name}: params must be the dict returned by la.get({name!r}).init (keys "
            f"{list(keys)}), got {type(params).__name__} {_short(params)}"
        )
    for key in keys:
        if key not in params:
            raise ValueError(
                f"{name}: params is missing {key!r}; got keys {sorted(params)} "
                f"(pass the params returned by la.get({name!r}).init)"
            )


def check_params(name: str, params, expected: dict) -> None:
    """Checks that ``params[key].shape == shape`` for each entry of `expected`."""
    require_params(name, params, *expected)
    for key, shape in expected.items():
        if tuple(jnp.shape(params[key])) != tuple(shape):
            raise ValueError(
                f"{name}: params[{key!r}] has shape {tuple(jnp.shape(params[key]))}, expected "
                f"{tuple(shape)} for these inputs"
            )


def _short(x, limit: int = 60) -> str:
    text = repr(x)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@contextlib.contextmanager
def matmul_precision(name, precision):
    """A scope for flax's `precision` argument (one `jax.lax.Precision` or its name)."""
    if precision is None:
        yield
        return
    value = getattr(precision, "name", precision)
    if not isinstance(value, str):
        raise ValueError(
            f"{name}: precision={precision!r}: give one jax.lax.Precision or its name (a pair "
            "of precisions is supported by softmax only)"
        )
    with jax.default_matmul_precision(value.lower()):
        yield


def refuse_unsupported(name, *, bias=None, dropout_rate=0.0, module=None, einsums=(None, None)):
    """ValueError naming the first flax option mechanism `name` cannot apply; the message
    names the mechanisms whose records can (`Mechanism.flax_fn`, `attention_dropout`)."""
    records = {n: registry.get(n) for n in registry.names()}
    if bias is not None:
        takes = [n for n, m in records.items() if m.flax_fn is not None]
        raise ValueError(
            f"bias: {name} cannot add an attention bias (got shape {jnp.shape(bias)}); the "
            f"mechanisms with flax's bias: {takes}"
        )
    if dropout_rate > 0:
        takes = [n for n, m in records.items() if m.attention_dropout]
        raise ValueError(
            f"dropout_rate={dropout_rate}: {name} applies no attention dropout; set "
            f"dropout_rate=0 (the mechanisms that apply it: {takes})"
        )
    if module is not None:
        raise ValueError(
            f"sow_weights=True: {name} cannot sow [batch, heads, q_len, kv_len] attention "
            "weights; only attention='softmax' forms them"
        )
    if any(einsums):
        raise ValueError(
            f"qk_attn_weights_einsum / attn_weights_value_einsum: {name} has no such einsums"
        )
