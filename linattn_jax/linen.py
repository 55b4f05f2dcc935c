"""Flax Linen modules: multi-head attention with any registered mechanism.

`MultiHeadAttention` is a drop-in for ``flax.linen.MultiHeadDotProductAttention``: the same
constructor arguments, call signature and param names (``query``/``key``/``value``/``out``,
the same kernel shapes), so replacing ``nn.MultiHeadDotProductAttention(...)`` by
``la.linen.MultiHeadAttention(..., attention="flexformer_n")`` is the whole change and a
flax checkpoint maps onto it by path::

    layer = la.linen.MultiHeadAttention(num_heads=4, attention="performer",
                                        attention_config=(("num_features", 64),))
    variables = layer.init({"params": k0}, x)
    y = layer.apply(variables, x, mask=nn.make_attention_mask(pad, pad), causal=True)

`attention_fn` instead keeps flax's own module and runs a mechanism inside it
(``nn.MultiHeadDotProductAttention(..., attention_fn=la.linen.attention_fn("performer"))``).

Masks, bias, dropout (both ways): softmax is flax's own ``dot_product_attention`` (any
mask, dropout with flax's rng semantics, ``sow_weights``). Every other mechanism takes a
key-padding mask and causality (``causal=True``); a flax mask it cannot represent
(per-head, per-query, or causal when causality was not stated) raises ValueError naming
the mask's shape (under ``jit``, where the mask's values are unknown, those batch rows come
out NaN instead), and so do ``dropout_rate > 0`` and ``sow_weights=True``. A rank-2 mask
``[B, Tk]`` is a key-padding mask.

Learnable mechanism params live in the ``params`` collection under ``mechanism`` (none for
a mechanism without params), with the logical axis name ``"heads"`` on their head axis;
fixed random features (performer, rfa) in the ``fixed`` collection (not trained; every call
uses them unless ``redraw="call"`` is configured; replace them to redraw). Sampling
mechanisms sample only when ``deterministic=False`` is given (the attribute or the call),
from the ``"attention"`` rng stream. Projection kernels carry
the logical axis names ``("embed", "heads", "kv")`` / ``("heads", "kv", "embed")``.

Decoding (``decode=True``): the layer takes one token ``[B, 1, F]`` per call and keeps its
state in the ``cache`` collection (pass ``mutable=["cache"]``; the first call, under
``init``, creates the empty state, from one token with ``max_len`` or, as flax does, from
the full-length input ``[B, max_len, F]``). A feature-map mechanism
(``la.get(name).feature_map``) keeps the constant-size recurrent state of causal linear
attention (`linattn_jax.core.recurrent_step`): the same features as its parallel causal
form, so the two agree to float rounding, rfa's gate and the key log-scales of performer
and flexformer included; the random features of performer and rfa are the fixed ones. Any
other mechanism keeps a cache of ``max_len`` keys and values and runs itself
(deterministic) for the new query over the cached prefix (NaN once the cache is full).

Long sequences (``mesh=``): the attention runs sequence-parallel,
`linattn_jax.parallel.sequence_parallel` over the mesh axis ``seq_axis`` (the batch over
the other mesh axes), with the same params and result as without (call it under ``jax.jit``
with inputs whose T divides by the axis size). Decoding ignores the mesh.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from linattn_jax import _checks, parallel
from linattn_jax import _module_utils as mu

_default_kernel_init = nn.initializers.lecun_normal()


def mechanism_variables(module: nn.Module, mech, num_heads: int, head_dim: int) -> dict:
    """The mechanism's params, created on (or read from) `module`: each trainable one a
    ``params`` entry, each fixed one a ``fixed`` entry, named as in ``mech.init``, with the
    logical name ``"heads"`` on the head axis. Nothing is created for a mechanism without
    params. All of them come from one ``mech.init`` call (drawn with the rng flax hands the
    first one), so params drawn together keep their relation (e.g. flexformer_n's pairs,
    ``Omega2 = Omega1 + jitter``)."""
    fixed = mech.fixed_params()
    drawn: dict = {}

    def init(rng, key):
        if not drawn:
            drawn.update(mech.init(rng, num_heads=num_heads, head_dim=head_dim))
        return drawn[key]

    out = {}
    for key, names in mu.param_axes(mech, num_heads, head_dim).items():
        one = functools.partial(init, key=key)
        if names is not None:
            one = nn.with_logical_partitioning(one, names)
        if key in fixed:
            var = module.variable("fixed", key, lambda f=one: f(module.make_rng("params")))
            out[key] = nn.meta.unbox(var.value)
        else:
            out[key] = module.param(key, one)
    return out


class _Mechanism(nn.Module):
    """Holds a mechanism's variables (the ``mechanism`` entry of `MultiHeadAttention`)."""

    mech: Any
    num_heads: int
    head_dim: int

    @nn.compact
    def __call__(self):
        return mechanism_variables(self, self.mech, self.num_heads, self.head_dim)


class MechanismAttention(nn.Module):
    """An ``attention_fn`` for flax's ``nn.MultiHeadDotProductAttention`` that runs a
    mechanism with params (made by `attention_fn`). Flax adopts it as a submodule named
    ``attention_fn``: its params live there (``params/.../attention_fn/<name>``), created
    from the query's heads and depth on the first call."""

    attention: str
    attention_config: Any = ()
    causal: bool = False

    @nn.compact
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
        mech = mu.bound_mechanism(self.attention, dict(self.attention_config))
        params = mechanism_variables(self, mech, query.shape[-2], query.shape[-1])
        kw = mu.flax_kwargs(locals())
        return mu.flax_call(mech, params, self.causal, query, key, value, bias, mask, kw)


def attention_fn(name: str, *, causal: bool = False, **config):
    """An ``attention_fn`` for ``flax.linen.MultiHeadDotProductAttention`` running the
    registered mechanism `name` with `config`.

    A param-free mechanism gives a plain function; one with params gives a
    `MechanismAttention` module, which flax adopts as the submodule ``attention_fn``
    (its params live there) when it is built outside any module; built inside a
    ``@compact`` method, linen makes it a child of that method's module instead (params at
    ``MechanismAttention_<n>`` beside the attention layer). Build one per layer.

    It takes flax's arguments (``query, key, value, bias, mask, dropout_rng,
    dropout_rate, deterministic, dtype, precision, module, ...``, ``[batch, length, heads,
    depth]``): a mechanism whose record has a `Mechanism.flax_fn` (softmax: flax's own
    ``dot_product_attention``; ra) takes any mask, bias and dropout with flax's rng
    semantics; the others take key-padding masks and, with ``causal=True`` (or
    nnx's ``is_causal``), causality (the causal mask is ANDed into flax's mask), and refuse
    with ValueError a mask they cannot represent (a causal mask without ``causal=True``, a
    per-head or per-query pattern; under ``jit`` those batch rows come out NaN), a bias,
    ``dropout_rate > 0`` and ``sow_weights``. Flax's module hands out an rng only for
    dropout, so a sampling mechanism (ra, lara,
    performer's ``redraw="call"``) runs deterministic inside it.
    """
    mech = mu.bound_mechanism(name, config)
    if mu.has_params(mech):
        return MechanismAttention(name, tuple(sorted(config.items())), causal)
    return mu.attention_function(mech, causal)


class MultiHeadAttention(nn.Module):
    """Projections + a registered attention mechanism + output projection; flax's
    ``nn.MultiHeadDotProductAttention`` with `attention` (see the module docstring).

    Attributes (flax's, same defaults):
      num_heads, dtype, param_dtype, qkv_features, out_features, broadcast_dropout,
      dropout_rate, deterministic, precision, kernel_init, out_kernel_init, bias_init,
      out_bias_init, use_bias, decode, normalize_qk, force_fp32_for_softmax: as in flax.
        ``dropout_rate > 0`` applies to the mechanisms whose record has
        `Mechanism.attention_dropout` (softmax, ra), ``force_fp32_for_softmax`` to softmax
        (the others compute in float32 and refuse dropout). The default `kernel_init`
        carries logical axis names; one you pass is used as given. `attention_fn` must stay None.
    Keyword-only (ours):
      attention: registry name of the mechanism.
      attention_config: config bound to the mechanism, as a dict or a tuple of
        ``(key, value)`` pairs (hashable, so the module stays hashable).
      max_len: cached positions for decoding a mechanism that is not a feature map
        (default: the length of the input the cache is initialised from).
      mesh: optional `jax.sharding.Mesh`: run the attention sequence-parallel over its axis
        `seq_axis` (`linattn_jax.parallel.sequence_parallel`; a mechanism it does not
        support raises there).
      seq_axis: the mesh axis that splits the sequence (default ``"seq"``).
      batch_axes: the mesh axes that split the batch (default: every other mesh axis; a
        tuple, e.g. a training config's ``data_axes``).
    """

    num_heads: int
    dtype: Any = None
    param_dtype: Any = jnp.float32
    qkv_features: int | None = None
    out_features: int | None = None
    broadcast_dropout: bool = True
    dropout_rate: float = 0.0
    deterministic: bool | None = None
    precision: Any = None
    kernel_init: Any = None
    out_kernel_init: Any = None
    bias_init: Any = nn.initializers.zeros_init()
    out_bias_init: Any = None
    use_bias: bool = True
    attention_fn: Any = None
    decode: bool = False
    normalize_qk: bool = False
    force_fp32_for_softmax: bool = False
    _: dataclasses.KW_ONLY
    attention: str = "softmax"
    attention_config: Any = ()
    max_len: int = 0
    mesh: Any = None
    seq_axis: str = "seq"
    batch_axes: Any = None

    @nn.compact
    def __call__(
        self,
        inputs_q,
        inputs_k=None,
        inputs_v=None,
        *,
        inputs_kv=None,
        mask=None,
        deterministic: bool | None = None,
        dropout_rng=None,
        sow_weights: bool = False,
        causal: bool = False,
    ):
        """``inputs_q [B, Tq, F]`` -> ``[B, Tq, out]`` (flax's call; `causal` is ours).

        `mask`: flax's ``[B, H|1, Tq, Tk]`` (True = attend) or a ``[B, Tk]`` key-padding
        mask; `causal` ANDs in the causal mask.
        """
        mu.refuse_attention_fn("la.linen.MultiHeadAttention", self.attention_fn)
        if inputs_kv is not None:
            if inputs_k is not None or inputs_v is not None:
                raise ValueError("inputs_kv: pass either inputs_kv or inputs_k/inputs_v")
            inputs_k = inputs_kv
        inputs_k, inputs_v = mu.resolve_inputs(inputs_q, inputs_k, inputs_v)
        features = inputs_q.shape[-1]
        qkv_features = self.qkv_features or features
        head_dim = mu.head_dims(self.num_heads, qkv_features)
        mech = mu.bound_mechanism(self.attention, dict(self.attention_config))
        default_init = nn.with_logical_partitioning(_default_kernel_init, mu.QKV_AXES)

        def proj(name):
            return nn.DenseGeneral(
                (self.num_heads, head_dim),
                use_bias=self.use_bias,
                name=name,
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                kernel_init=self.kernel_init or default_init,
                bias_init=self.bias_init,
                precision=self.precision,
            )

        q, k, v = proj("query")(inputs_q), proj("key")(inputs_k), proj("value")(inputs_v)
        if self.normalize_qk:
            q, k = (
                nn.LayerNorm(
                    name=n, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype
                )(x)
                for n, x in (("query_ln", q), ("key_ln", k))
            )
        params = _Mechanism(mech, self.num_heads, head_dim, name="mechanism")()
        if self.decode:
            mu.check_decode_inputs(
                "MultiHeadAttention",
                inputs_q,
                inputs_k,
                inputs_v,
                mask,
                one_token=self.has_variable("cache", "state"),
            )
            out = self._decode(mech, q, k, v, params)
        else:
            out = self._attend(
                mech, q, k, v, params, mask, causal, deterministic, dropout_rng, sow_weights
            )
        out_init = self.out_kernel_init or self.kernel_init
        return nn.DenseGeneral(
            self.out_features or features,
            axis=(-2, -1),
            use_bias=self.use_bias,
            name="out",
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            kernel_init=out_init or nn.with_logical_partitioning(_default_kernel_init, mu.OUT_AXES),
            bias_init=self.out_bias_init or self.bias_init,
            precision=self.precision,
        )(out)

    def _attend(self, mech, q, k, v, params, mask, causal, deterministic, dropout_rng, sow):
        det = self.deterministic if deterministic is None else deterministic
        dropout = self.dropout_rate > 0
        if dropout and (not mech.attention_dropout or self.mesh is not None):
            _checks.refuse_unsupported(
                mech.name + " (sequence-parallel)" * (self.mesh is not None),
                dropout_rate=self.dropout_rate,
            )
        if dropout and det is None:
            raise ValueError(
                f"deterministic: dropout_rate={self.dropout_rate} needs deterministic=True or "
                "False (the attribute or the call), as flax's module does"
            )
        rng = None
        if det is False and (dropout or mech.stochastic):
            stream = "dropout" if dropout else "attention"
            if dropout_rng is None and not self.has_rng(stream):
                raise ValueError(
                    f"deterministic=False: {mech.name!r} needs the {stream!r} rng stream "
                    f"(apply(..., rngs={{{stream!r}: key}}) or dropout_rng=), or "
                    "deterministic=True"
                )
            rng = dropout_rng if dropout_rng is not None else self.make_rng(stream)
        attend = None
        if self.mesh is not None:
            attend = parallel.sequence_parallel(
                mech, self.mesh, self.seq_axis, batch_axes=self.batch_axes
            )
        return mu.flax_attention(
            mech,
            q,
            k,
            v,
            params,
            rng if not dropout or mech.stochastic else None,  # ra: fold_in(rng, 1)
            mask=mu.flax_mask(mask, k.shape[0], k.shape[1]),
            causal=causal,
            deterministic=not (dropout and det is False),
            dropout_rate=self.dropout_rate,
            broadcast_dropout=self.broadcast_dropout,
            dropout_rng=rng if dropout else None,
            dtype=self.dtype,
            precision=self.precision,
            module=self if sow else None,
            force_fp32_for_softmax=self.force_fp32_for_softmax,
            attend=attend,
        )

    def _decode(self, mech, q, k, v, params):
        """Causal attention of the new token(s) with the ``cache`` state; ``[B, T, H, Dv]``
        (T > 1 only while the cache is created, as flax's decode does)."""
        b, t, h, d = q.shape
        initialized = self.has_variable("cache", "state")
        max_len = self.max_len or (t if t > 1 else 0)
        state = self.variable(
            "cache",
            "state",
            lambda: mu.decode_init(
                mech, params, batch=b, num_heads=h, head_dim=d, max_len=max_len, dtype=k.dtype
            ),
        )
        if t > 1:  # creating the cache from the full-length input
            return mech.attention(q, k, v, params, None, causal=True, deterministic=True)
        out, new = mu.decode_step(mech, q, k, v, params, state.value)
        if initialized:
            state.value = new
        return out


__all__ = ["MechanismAttention", "MultiHeadAttention", "attention_fn", "mechanism_variables"]
