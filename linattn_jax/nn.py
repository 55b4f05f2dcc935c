"""Flax NNX modules: multi-head attention with any registered mechanism.

`MultiHeadAttention` is a drop-in for ``flax.nnx.MultiHeadAttention``: the same constructor
arguments, call signature and param names (``query``/``key``/``value``/``out``, the same
kernel shapes), with ``attention=`` (keyword-only) choosing the mechanism::

    layer = la.nn.MultiHeadAttention(
        num_heads=4, in_features=64, attention="flexformer_n",
        attention_config={"num_features": 64}, rngs=nnx.Rngs(0))
    y = layer(x, mask=nnx.make_attention_mask(pad, pad), is_causal=True)   # x: [B, T, 64]

`attention_fn` instead keeps flax's own module and runs a mechanism inside it
(``nnx.MultiHeadAttention(..., attention_fn=la.nn.attention_fn("performer", num_heads=4,
head_dim=16, rngs=rngs))``). Masks, bias, dropout and ``sow_weights`` follow the rules of
`linattn_jax.linen` (softmax is flax's own attention; the others take key-padding masks and
causality, ``is_causal=True`` or ``causal=True``, and refuse what they cannot do).

Learnable mechanism params (frequencies, scales, feature-map weights, proposal
networks) are `nnx.Param`s under ``layer.mechanism`` (absent for a mechanism without
params), with the logical axis name ``"heads"`` on their head axis; fixed random features
(performer, rfa) are `FixedFeatures` variables (not `nnx.Param`, so an optimizer
built with ``wrt=nnx.Param`` leaves them alone) that `redraw` replaces. As in flax,
``deterministic`` defaults to None: no rng is needed unless ``deterministic=False`` is
given with dropout (softmax: the ``dropout`` stream) or a sampling mechanism (the
``attention`` stream, else the default one).

Decoding: ``init_cache(input_shape)`` then ``decode=True`` calls of one token, as in flax;
the state is a feature map's recurrent state or a KV cache of ``input_shape[1]`` positions
(see `linattn_jax.linen`).

Long sequences (``mesh=``): the attention runs sequence-parallel,
`linattn_jax.parallel.sequence_parallel` over the mesh axis ``seq_axis`` (the batch over
the other mesh axes), with the same params and result as without.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from linattn_jax import _checks, parallel
from linattn_jax import _module_utils as mu

_default_kernel_init = nnx.initializers.lecun_normal()
_zeros = nnx.initializers.zeros_init()


def _annotated(init, axes):
    """Logical axis names as metadata, not an eager placement: the training loop maps
    them to mesh axes (and a module built outside any mesh still works)."""
    return nnx.with_partitioning(init, axes, eager_sharding=False)


class FixedFeatures(nnx.Variable):
    """A non-trainable mechanism variable (a fixed random draw, e.g. performer's features)."""


def mechanism_variables(mech, num_heads: int, head_dim: int, rngs: nnx.Rngs):
    """The mechanism's params as an `nnx.Dict` of `nnx.Param` (trainable) and
    `FixedFeatures` (fixed), with ``"heads"`` on the head axis; None without params."""
    params = mech.init(rngs.params(), num_heads=num_heads, head_dim=head_dim)
    if not params:
        return None
    axes = mu.param_axes(mech, num_heads, head_dim)
    fixed = mech.fixed_params()
    out = {}
    for key, value in params.items():
        kind = FixedFeatures if key in fixed else nnx.Param
        meta = {} if axes[key] is None else {"out_sharding": axes[key], "eager_sharding": False}
        out[key] = kind(value, **meta)
    return nnx.Dict(out)


def _mechanism_params(variables) -> dict:
    return {} if variables is None else {k: v[...] for k, v in variables.items()}


class MechanismAttention(nnx.Module):
    """An ``attention_fn`` for flax's ``nnx.MultiHeadAttention`` that runs a mechanism with
    params (made by `attention_fn`); its params are the attribute ``mechanism``."""

    def __init__(self, mech, *, causal: bool, num_heads: int, head_dim: int, rngs: nnx.Rngs):
        self.mech = nnx.static(mech)
        self.causal = causal
        self.mechanism = mechanism_variables(mech, num_heads, head_dim, rngs)

    def mechanism_params(self) -> dict:
        """The mechanism's params as plain arrays."""
        return _mechanism_params(self.mechanism)

    def __call__(
        self,
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
        kw = mu.flax_kwargs(locals())
        params = _mechanism_params(self.mechanism)
        return mu.flax_call(self.mech, params, self.causal, query, key, value, bias, mask, kw)


def attention_fn(
    name: str,
    *,
    causal: bool = False,
    num_heads: int | None = None,
    head_dim: int | None = None,
    rngs: nnx.Rngs | None = None,
    **config,
):
    """An ``attention_fn`` for ``flax.nnx.MultiHeadAttention`` running the mechanism `name`
    with `config` (rules: `linattn_jax.linen.attention_fn`; nnx's ``is_causal=True`` also
    makes it causal).

    A param-free mechanism gives a plain function. One with params gives a
    `MechanismAttention` module (flax keeps it as the attribute ``attention_fn``, its params
    under it), created now, so it needs `num_heads`, `head_dim` (qkv_features // num_heads)
    and `rngs`.
    """
    mech = mu.bound_mechanism(name, config)
    if not mu.has_params(mech):
        return mu.attention_function(mech, causal)
    missing = [
        k
        for k, v in (("num_heads", num_heads), ("head_dim", head_dim), ("rngs", rngs))
        if v is None
    ]
    if missing:
        raise ValueError(
            f"{missing}: mechanism {name!r} has params, created with the attention_fn; pass "
            "num_heads, head_dim and rngs (or swap the module: la.nn.MultiHeadAttention)"
        )
    return MechanismAttention(
        mech, causal=causal, num_heads=num_heads, head_dim=head_dim, rngs=rngs
    )


class MultiHeadAttention(nnx.Module):
    """Projections + a registered attention mechanism + output projection; flax's
    ``nnx.MultiHeadAttention`` with `attention` (see the module docstring).

    Args (flax's, same defaults): num_heads, in_features, qkv_features, out_features,
      num_kv_heads (only None or num_heads), in_kv_features, dtype, param_dtype,
      broadcast_dropout, dropout_rate (a record with `Mechanism.attention_dropout`:
      softmax, ra), deterministic, precision, kernel_init (the default carries logical axis
      names), out_kernel_init, bias_init,
      out_bias_init, use_bias, decode, normalize_qk, rngs, keep_rngs. `attention_fn` must
      stay None.
    Keyword-only (ours):
      attention: registry name of the mechanism.
      attention_config: config bound to the mechanism (e.g. ``{"num_features": 64}``).
      mesh: optional `jax.sharding.Mesh`: run the attention sequence-parallel over its axis
        `seq_axis` (`linattn_jax.parallel.sequence_parallel`).
      seq_axis: the mesh axis that splits the sequence (default ``"seq"``).
      batch_axes: the mesh axes that split the batch (default: every other mesh axis).
    """

    def __init__(
        self,
        num_heads: int,
        in_features: int,
        qkv_features: int | None = None,
        out_features: int | None = None,
        num_kv_heads: int | None = None,
        in_kv_features: int | None = None,
        *,
        dtype=None,
        param_dtype=jnp.float32,
        broadcast_dropout: bool = True,
        dropout_rate: float = 0.0,
        deterministic: bool | None = None,
        precision=None,
        kernel_init=None,
        out_kernel_init=None,
        bias_init=_zeros,
        out_bias_init=None,
        use_bias: bool = True,
        attention_fn=None,
        decode: bool | None = None,
        normalize_qk: bool = False,
        rngs: nnx.Rngs,
        keep_rngs: bool = True,
        attention: str = "softmax",
        attention_config: Mapping[str, Any] | None = None,
        mesh=None,
        seq_axis: str = "seq",
        batch_axes=None,
    ):
        mu.refuse_attention_fn("la.nn.MultiHeadAttention", attention_fn)
        if num_kv_heads not in (None, num_heads):
            raise ValueError(
                f"num_kv_heads={num_kv_heads}: grouped-query attention is not supported "
                f"(pass None or num_heads={num_heads})"
            )
        qkv_features = qkv_features or in_features
        out_features = out_features or in_features
        head_dim = mu.head_dims(num_heads, qkv_features)
        self.num_heads, self.head_dim, self.in_features = num_heads, head_dim, in_features
        self.mech = nnx.static(mu.bound_mechanism(attention, attention_config))
        self.deterministic, self.decode, self.normalize_qk = deterministic, decode, normalize_qk
        self.dropout_rate, self.broadcast_dropout = dropout_rate, broadcast_dropout
        self.dtype, self.precision = dtype, precision
        self.attend = nnx.static(
            None
            if mesh is None
            else parallel.sequence_parallel(self.mech, mesh, seq_axis, batch_axes=batch_axes)
        )

        def linear(n_in, n_out, axes, init, b_init, **kw):
            init = init or _annotated(_default_kernel_init, axes)
            return nnx.LinearGeneral(
                n_in,
                n_out,
                use_bias=use_bias,
                dtype=dtype,
                param_dtype=param_dtype,
                kernel_init=init,
                bias_init=b_init,
                precision=precision,
                rngs=rngs,
                **kw,
            )

        kv_in = in_kv_features or in_features
        shape = (num_heads, head_dim)
        self.query = linear(in_features, shape, mu.QKV_AXES, kernel_init, bias_init)
        self.key = linear(kv_in, shape, mu.QKV_AXES, kernel_init, bias_init)
        self.value = linear(kv_in, shape, mu.QKV_AXES, kernel_init, bias_init)
        self.query_ln = self.key_ln = nnx.data(None)
        if normalize_qk:
            self.query_ln, self.key_ln = (
                nnx.LayerNorm(
                    head_dim, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs
                )
                for _ in range(2)
            )
        self.out = linear(
            shape,
            out_features,
            mu.OUT_AXES,
            out_kernel_init or kernel_init,
            out_bias_init or bias_init,
            axis=(-2, -1),
        )
        variables = mechanism_variables(self.mech, num_heads, head_dim, rngs)
        self.mechanism = nnx.data(None) if variables is None else variables
        # flax keeps a dropout stream when it drops out; a sampling mechanism keeps its own.
        stream = "attention" if self.mech.stochastic else "dropout"
        need = keep_rngs and (
            self.mech.stochastic or (dropout_rate > 0 and self.mech.attention_dropout)
        )
        self.rngs = nnx.data(None)
        if need and (stream in rngs or "default" in rngs):
            self.rngs = (rngs[stream] if stream in rngs else rngs.default).fork()
        self.cache = nnx.data(None)

    def mechanism_params(self) -> dict:
        """The mechanism's params as plain arrays (the functional API's `params`)."""
        return _mechanism_params(self.mechanism)

    def redraw(self, rng) -> None:
        """Replaces the fixed random features with a fresh draw from `rng`."""
        fresh = self.mech.init(rng, num_heads=self.num_heads, head_dim=self.head_dim)
        for k in self.mech.fixed_params():
            self.mechanism[k][...] = fresh[k]

    def init_cache(self, input_shape, dtype=jnp.float32) -> None:
        """Creates the empty decode state for inputs ``[B, max_len, F]`` (flax's call)."""
        b, max_len = input_shape[0], input_shape[-2]
        self.cache = nnx.Cache(
            mu.decode_init(
                self.mech,
                self.mechanism_params(),
                batch=b,
                num_heads=self.num_heads,
                head_dim=self.head_dim,
                max_len=max_len,
                dtype=dtype,
            )
        )

    def __call__(
        self,
        inputs_q,
        inputs_k=None,
        inputs_v=None,
        *,
        mask=None,
        deterministic: bool | None = None,
        rngs: nnx.Rngs | nnx.RngStream | jax.Array | None = None,
        sow_weights: bool = False,
        decode: bool | None = None,
        is_causal: bool = False,
        causal: bool = False,
        out_sharding=None,
        qkv_sharding=None,
    ):
        """``inputs_q [B, Tq, F]`` -> ``[B, Tq, out]`` (flax's call; `causal` is ours, an
        alias of `is_causal`).

        `mask`: flax's ``[B, H|1, Tq, Tk]`` (True = attend) or a ``[B, Tk]`` key-padding
        mask; `rngs` (an `nnx.Rngs`, a stream or a key) overrides the module's stream.
        """
        inputs_k, inputs_v = mu.resolve_inputs(inputs_q, inputs_k, inputs_v)
        if inputs_q.shape[-1] != self.in_features:
            raise ValueError(
                f"inputs_q: last axis {inputs_q.shape[-1]}, the module expects "
                f"in_features={self.in_features}"
            )
        q = self.query(inputs_q, out_sharding=qkv_sharding)
        k = self.key(inputs_k, out_sharding=qkv_sharding)
        v = self.value(inputs_v, out_sharding=qkv_sharding)
        if self.normalize_qk:
            q, k = self.query_ln(q), self.key_ln(k)
        params = self.mechanism_params()
        if self.decode if decode is None else decode:
            mu.check_decode_inputs(
                "MultiHeadAttention", inputs_q, inputs_k, inputs_v, mask, one_token=True
            )
            if self.cache is None:
                raise ValueError("decode=True: call init_cache(input_shape) first")
            out, new = mu.decode_step(self.mech, q, k, v, params, self.cache.get_value())
            self.cache.set_value(new)
            return self.out(out, out_sharding=out_sharding)
        det = self.deterministic if deterministic is None else deterministic
        dropout = self.dropout_rate > 0
        if dropout and (not self.mech.attention_dropout or self.attend is not None):
            _checks.refuse_unsupported(
                self.mech.name + " (sequence-parallel)" * (self.attend is not None),
                dropout_rate=self.dropout_rate,
            )
        if dropout and det is None:
            raise ValueError(
                f"deterministic: dropout_rate={self.dropout_rate} needs deterministic=True or "
                "False (the constructor or the call), as flax's module does"
            )
        rng = None
        if det is False and (dropout or self.mech.stochastic):
            rng = self._rng(rngs, "dropout" if dropout else "attention")
        out = mu.flax_attention(
            self.mech,
            q,
            k,
            v,
            params,
            rng if not dropout or self.mech.stochastic else None,  # ra: fold_in(rng, 1)
            mask=mu.flax_mask(mask, k.shape[0], k.shape[1]),
            causal=bool(is_causal or causal),
            deterministic=not (dropout and det is False),
            dropout_rate=self.dropout_rate,
            broadcast_dropout=self.broadcast_dropout,
            dropout_rng=rng if dropout else None,
            dtype=self.dtype,
            precision=self.precision,
            module=self if sow_weights else None,
            attend=self.attend,
        )
        return self.out(out, out_sharding=out_sharding)

    def _rng(self, rngs, stream: str):
        """A key for `stream`: from the call's `rngs`, else the module's forked stream."""
        if isinstance(rngs, nnx.Rngs):
            return rngs[stream]() if stream in rngs else rngs.default()
        if isinstance(rngs, nnx.RngStream):
            return rngs()
        if rngs is not None:
            return rngs
        if self.rngs is None:
            raise ValueError(
                f"deterministic=False: {self.mech.name!r} needs an rng: build the module with "
                f"rngs=nnx.Rngs(..., {stream}=...) and keep_rngs=True, pass rngs= to the call, "
                "or deterministic=True"
            )
        return self.rngs()


__all__ = ["FixedFeatures", "MechanismAttention", "MultiHeadAttention", "attention_fn"]
