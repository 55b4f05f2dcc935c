"""The mechanism registry: one `Mechanism` record per attention mechanism.

A mechanism is a pair of pure functions written in its own module::

    def init(rng, *, num_heads, head_dim, <config keys with defaults>) -> params
    def attention(q, k, v, params, rng=None, *, mask=None, causal=False,
                  deterministic=False, <config keys with defaults>) -> out

The config keys a mechanism accepts are read off those two signatures (the
keyword-only parameters other than the structural ones), so a default is
written once, beside the code that uses it. `Mechanism.bind` fixes config
values; `Mechanism.init` / `Mechanism.attention` validate the keys and forward
to each function only the keys it declares.

Config values are checked where they are set: `Mechanism.bind` rejects a size key
(`SIZE_KEYS`) that is not an int >= 1, and a bound or call-time value that contradicts
the params' shapes (`Mechanism.params_config_fn`, e.g. ``num_features``) is a ValueError
at call time, never silently ignored.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

# Keyword-only parameters that are part of the call protocol, not config.
_STRUCTURAL = frozenset({"num_heads", "head_dim", "mask", "causal", "deterministic"})

#: Config keys that are sizes or counts, whichever mechanism takes them: each must be an
#: int >= 1 (checked by `Mechanism.bind` and at call time).
SIZE_KEYS = frozenset({"num_features", "num_landmarks", "num_samples", "chunk_size", "ns_iters"})


def _check_sizes(name: str, config: Mapping[str, Any]) -> None:
    for key in SIZE_KEYS & set(config):
        value = config[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"mechanism {name!r}: {key} must be an int >= 1, got {value!r}")


def _param_shapes(params) -> dict[str, Any]:
    return {k: tuple(getattr(v, "shape", ())) for k, v in params.items()}


def _config_params(fn: Callable) -> dict[str, Any]:
    """Keyword-only config parameters of `fn` and their defaults."""
    out = {}
    for p in inspect.signature(fn).parameters.values():
        if p.kind is p.KEYWORD_ONLY and p.name not in _STRUCTURAL:
            out[p.name] = p.default
    return out


@dataclasses.dataclass(frozen=True)
class Mechanism:
    """An attention mechanism behind the uniform functional API.

    Attributes:
      name: registry name, e.g. ``"performer"``.
      init_fn: ``init(rng, *, num_heads, head_dim, **config) -> params``.
      attention_fn: ``attention(q, k, v, params, rng=None, *, mask, causal,
        deterministic, **config) -> out`` with ``q: [B, Tq, H, Dk]``,
        ``k: [B, Tk, H, Dk]``, ``v: [B, Tk, H, Dv]``, ``out: [B, Tq, H, Dv]``.
      supports_causal: whether ``causal=True`` is implemented.
      stochastic: whether ``deterministic=False`` samples (needs ``rng``) under the bound
        config. With `stochastic_fn` it is computed from the config (and recomputed by
        `bind`), whatever value is passed.
      fixed_fn: ``fixed(**config) -> frozenset`` of top-level param names that
        are fixed random draws (non-trainable), e.g. performer's features.
      config: the config values fixed by `bind`.
      description: one line for tables.
      reference_fn: the naive quadratic form of `attention_fn` (same signature and
        the same features), the oracle its fast paths are tested against.
      feature_map_spec: the `linattn_jax.core.FeatureMap` of a feature-map mechanism
        (what its `attention_fn` hands to the shared core), None for the others; read it
        as `feature_map` (bound to this record's config).
      params_config_fn: ``(params) -> {key: value}``, the config values that the shapes
        of `params` imply (e.g. performer's ``num_features``), for the keys that only
        `init_fn` reads; None if there are none. A bound or call-time value that differs
        raises ValueError instead of being ignored.
      stochastic_fn: ``(**config) -> bool``, whether the mechanism samples under a config
        (e.g. performer's ``redraw="call"``); None when `stochastic` does not depend on it.
      flax_fn: ``flax_fn(mech, q, k, v, rng, *, bias, mask, causal, module,
        force_fp32_for_softmax, einsums, broadcast_dropout, dropout_rng, dropout_rate,
        deterministic, dtype, precision)``: the mechanism under all of flax's attention
        conventions (a mask of any shape, a bias, dropout on its weights, sown weights),
        which flax's modules and ours call; None: key-padding masks and causality only.
      attention_dropout: whether `flax_fn` applies dropout to attention weights (the
        modules refuse ``dropout_rate > 0`` otherwise).
    """

    name: str
    init_fn: Callable[..., Any]
    attention_fn: Callable[..., Any]
    supports_causal: bool
    stochastic: bool
    fixed_fn: Callable[..., frozenset] = lambda **_: frozenset()
    config: Mapping[str, Any] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    description: str = ""
    reference_fn: Callable[..., Any] | None = None
    feature_map_spec: Any = None
    params_config_fn: Callable[[Any], dict[str, Any]] | None = None
    stochastic_fn: Callable[..., bool] | None = None
    flax_fn: Callable[..., Any] | None = None
    attention_dropout: bool = False

    def __post_init__(self):
        if self.stochastic_fn is not None:
            merged = {**self.defaults}
            wanted = _config_params(self.stochastic_fn)
            value = self.stochastic_fn(**{k: v for k, v in merged.items() if k in wanted})
            object.__setattr__(self, "stochastic", bool(value))

    @property
    def feature_map(self):
        """The `linattn_jax.core.FeatureMap` (query features, key features with their log
        scale and log decay) with this mechanism's bound config, or None when the mechanism
        is not a feature map (SPEC section 7)."""
        if self.feature_map_spec is None:
            return None
        return self.feature_map_spec.bind(**self.config)

    @property
    def defaults(self) -> dict[str, Any]:
        """Every accepted config key with its default (bound values applied)."""
        out = {**_config_params(self.init_fn), **_config_params(self.attention_fn)}
        out.update(self.config)
        return out

    def _check_keys(self, config: Mapping[str, Any]) -> None:
        accepted = set(_config_params(self.init_fn)) | set(_config_params(self.attention_fn))
        unknown = sorted(set(config) - accepted)
        if unknown:
            raise TypeError(
                f"mechanism {self.name!r} got unknown config key(s) {unknown}; "
                f"accepted keys: {sorted(accepted)}"
            )

    def bind(self, **config) -> Mechanism:
        """Returns this mechanism with `config` values fixed (later calls may override).

        Raises:
          TypeError: an unknown key or an unhashable value.
          ValueError: a size (`SIZE_KEYS`) that is not an int >= 1.
        """
        self._check_keys(config)
        for key, value in config.items():
            try:
                hash(value)
            except TypeError as e:
                raise TypeError(
                    f"mechanism {self.name!r}: config {key}={value!r} must be hashable "
                    "(config is static under jit)"
                ) from e
        _check_sizes(self.name, config)
        merged = MappingProxyType({**self.config, **config})
        return dataclasses.replace(self, config=merged)

    def _split(self, fn: Callable, config: Mapping[str, Any]) -> dict[str, Any]:
        self._check_keys(config)
        _check_sizes(self.name, config)
        merged = {**self.config, **config}
        wanted = _config_params(fn)
        return {k: v for k, v in merged.items() if k in wanted}

    def _check_params_config(self, params, config: Mapping[str, Any]) -> None:
        """A bound or call-time value of a key that `params`' shapes fix must agree with them."""
        if self.params_config_fn is None or not isinstance(params, Mapping):
            return  # the mechanism's own checks name a params of the wrong kind
        given = {**self.config, **config}
        try:
            implied = self.params_config_fn(params)
        except (KeyError, AttributeError, IndexError, TypeError):
            return  # a params tree of the wrong layout: the mechanism's own checks name it
        for key, value in implied.items():
            if key in given and given[key] != value:
                where = "passed at call time" if key in config else "bound"
                raise ValueError(
                    f"mechanism {self.name!r}: {key}={given[key]!r} ({where}) contradicts "
                    f"params made with {key}={value!r} (param shapes {_param_shapes(params)}); "
                    f"pass params from init with {key}={given[key]!r}, or leave {key} unset"
                )

    def init(self, rng, *, num_heads: int, head_dim: int, **config):
        """Creates the mechanism's params (a pytree, ``{}`` if none)."""
        return self.init_fn(
            rng, num_heads=num_heads, head_dim=head_dim, **self._split(self.init_fn, config)
        )

    def attention(
        self, q, k, v, params, rng=None, *, mask=None, causal=False, deterministic=False, **config
    ):
        """Runs the mechanism; see the class docstring for shapes."""
        self._check_params_config(params, config)
        return self.attention_fn(
            q,
            k,
            v,
            params,
            rng,
            mask=mask,
            causal=causal,
            deterministic=deterministic,
            **self._split(self.attention_fn, config),
        )

    def reference(
        self, q, k, v, params, rng=None, *, mask=None, causal=False, deterministic=False, **config
    ):
        """The naive quadratic reference of `attention` (same arguments)."""
        if self.reference_fn is None:
            raise NotImplementedError(f"mechanism {self.name!r} has no separate reference")
        self._check_params_config(params, config)
        return self.reference_fn(
            q,
            k,
            v,
            params,
            rng,
            mask=mask,
            causal=causal,
            deterministic=deterministic,
            **self._split(self.reference_fn, config),
        )

    def fixed_params(self, **config) -> frozenset:
        """Top-level param names that are fixed random draws (non-trainable)."""
        return frozenset(self.fixed_fn(**self._split(self.fixed_fn, config)))


_REGISTRY: dict[str, Mechanism] = {}


def register(mech: Mechanism) -> Mechanism:
    """Adds `mech` to the registry (names must be unique)."""
    if mech.name in _REGISTRY:
        raise ValueError(f"mechanism {mech.name!r} is already registered")
    _REGISTRY[mech.name] = mech
    return mech


def get(name: str) -> Mechanism:
    """Looks up a mechanism by name."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown mechanism {name!r}; registered: {names()}") from None


def names() -> list[str]:
    """Registered mechanism names, in registration order."""
    return list(_REGISTRY)


def origin(name: str) -> str:
    """The registered name that `name`'s record was copied from: the earliest registered
    record equal to ``get(name)`` in every field but ``name`` (`name` itself for an
    original). Settings that a client keys by name (a training preset's mechanism settings)
    look up ``origin(name)``, so a renamed copy (``dataclasses.replace(get("performer"),
    name="mine")``, registered) gets what its original gets.

    Raises:
      KeyError: `name` is not registered.
    """
    mech = get(name)
    for other, record in _REGISTRY.items():
        if dataclasses.replace(record, name=name) == mech:
            return other
    return name


def causal_names() -> list[str]:
    """Names of the mechanisms that support ``causal=True``."""
    return [n for n, m in _REGISTRY.items() if m.supports_causal]
