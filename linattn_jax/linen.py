"""Flax Linen modules: multi-head attention with any registered mechanism.

    layer = la.linen.MultiHeadAttention(num_heads=4, attention="performer",
                                        attention_config=(("num_features", 64),))
    variables = layer.init({"params": k0}, x)
    y = layer.apply(variables, x, rngs={"attention": k1})

Learnable mechanism params live in the ``params`` collection under
``mechanism``; fixed random features (performer, rfa) in the ``fixed``
collection (not trained; replace them to redraw). Sampling mechanisms draw
from the ``"attention"`` rng stream. Projection kernels carry the logical axis
names ``("embed", "heads", "kv")`` / ``("heads", "kv", "embed")``.

Decoding (``decode=True``): the layer takes one token ``[B, 1, F]`` per call and keeps its
state in the ``cache`` collection (pass ``mutable=["cache"]``; the first call, under
``init``, creates the empty state). A feature-map mechanism (``la.get(name).feature_map``)
keeps the constant-size recurrent state of causal linear attention
(`linattn_jax.core.recurrent_step`): the same features as its parallel causal form, so
the two agree to float rounding, rfa's gate and the key log-scales of performer and
flexformer included; the random features of performer and rfa are the fixed ones. Any
other mechanism keeps a cache of ``max_len`` keys and values and runs itself
(deterministic) for the new query over the cached prefix.

Long sequences (``mesh=``): the attention runs sequence-parallel,
`linattn_jax.parallel.sequence_parallel` over the mesh axis ``seq_axis`` (the batch over
the other mesh axes), with the same params and result as without (call it under ``jax.jit``
with inputs whose T divides by the axis size). Decoding ignores the mesh.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from linattn_jax import _module_utils as mu
from linattn_jax import core, parallel

attention_fn = mu.attention_fn


class MultiHeadAttention(nn.Module):
    """Projections + a registered attention mechanism + output projection.

    Attributes:
      num_heads: H.
      qkv_features: total q/k/v width (H * head_dim); default the input width.
      out_features: output width; default the input width.
      attention: registry name of the mechanism.
      attention_config: config bound to the mechanism, as a dict or a tuple of
        ``(key, value)`` pairs (hashable, so the module stays hashable).
      use_bias: biases in the projections.
      deterministic: default for calls (mechanism sampling off when True).
      dtype: computation dtype of the projections (e.g. ``jnp.bfloat16`` for mixed
        precision; default: inferred from inputs and params). The mechanism keeps its
        float32 internals and returns q's dtype.
      param_dtype: dtype of the parameters.
      decode: one-token decoding with a ``cache`` collection (see the module docstring);
        the parameters are the same as in parallel mode.
      max_len: cached positions for decoding a mechanism that is not a feature map.
      mesh: optional `jax.sharding.Mesh`: run the attention sequence-parallel over its axis
        `seq_axis` (`linattn_jax.parallel.sequence_parallel`; a mechanism it does not
        support raises there).
      seq_axis: the mesh axis that splits the sequence (default ``"seq"``).
      batch_axes: the mesh axes that split the batch (default: every other mesh axis; a
        tuple, e.g. a training config's ``data_axes``).
    """

    num_heads: int
    qkv_features: int | None = None
    out_features: int | None = None
    attention: str = "softmax"
    attention_config: Any = ()
    use_bias: bool = True
    deterministic: bool = False
    dtype: Any = None
    param_dtype: Any = jnp.float32
    decode: bool = False
    max_len: int = 0
    mesh: Any = None
    seq_axis: str = "seq"
    batch_axes: Any = None

    @nn.compact
    def __call__(self, inputs_q, inputs_kv=None, *, mask=None, causal=False, deterministic=None):
        """``inputs_q [B, Tq, F]`` -> ``[B, Tq, out]``; `mask` ``[B, Tk]`` key padding."""
        inputs_kv = inputs_q if inputs_kv is None else inputs_kv
        features = inputs_q.shape[-1]
        qkv_features = self.qkv_features or features
        head_dim = mu.head_dims(self.num_heads, qkv_features)
        mech = mu.bound_mechanism(self.attention, dict(self.attention_config))
        init = nn.initializers.lecun_normal()

        def proj(name):
            return nn.DenseGeneral(
                (self.num_heads, head_dim),
                use_bias=self.use_bias,
                name=name,
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                kernel_init=nn.with_logical_partitioning(init, mu.QKV_AXES),
            )

        q, k, v = proj("query")(inputs_q), proj("key")(inputs_kv), proj("value")(inputs_kv)

        def init_split(rng, which):
            params = mech.init(rng, num_heads=self.num_heads, head_dim=head_dim)
            return mu.split_params(mech, params)[which]

        trainable = self.param("mechanism", init_split, 0)
        fixed = {}
        if mech.fixed_params():
            fixed = self.variable(
                "fixed", "mechanism", lambda: init_split(self.make_rng("params"), 1)
            ).value
        params = {**trainable, **fixed}
        if self.decode:
            if inputs_q.ndim != 3 or inputs_q.shape[1] != 1 or inputs_kv is not inputs_q:
                raise ValueError(
                    "MultiHeadAttention(decode=True) takes one token of self-attention "
                    f"[B, 1, F]; got inputs_q {inputs_q.shape}"
                )
            out = self._decode_step(mech, q, k, v, params)
        else:
            deterministic = self.deterministic if deterministic is None else deterministic
            rng = None
            if mech.stochastic and not deterministic:
                rng = self.make_rng("attention")
            attend = mech.attention
            if self.mesh is not None:
                attend = parallel.sequence_parallel(
                    mech, self.mesh, self.seq_axis, batch_axes=self.batch_axes
                )
            out = attend(
                q, k, v, params, rng, mask=mask, causal=causal, deterministic=deterministic
            )
        return nn.DenseGeneral(
            self.out_features or features,
            axis=(-2, -1),
            use_bias=self.use_bias,
            name="out",
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            kernel_init=nn.with_logical_partitioning(init, mu.OUT_AXES),
        )(out)

    def _decode_step(self, mech, q, k, v, params):
        """One token of causal attention with the ``cache`` state; ``[B, 1, H, Dv]``."""
        b, _, h, dv = v.shape
        initialized = self.has_variable("cache", "state")
        fmap = mech.feature_map
        if fmap is not None:
            phi_q, keys = fmap.query(q, params), fmap.key(k, params)
            state = self.variable("cache", "state", core.recurrent_init, b, h, phi_q.shape[-1], dv)
            out, new = core.recurrent_step(state.value, phi_q, keys, v, den_floor=fmap.den_floor())
            if initialized:
                state.value = new
            return out.astype(q.dtype)
        if self.max_len < 1:
            raise ValueError(
                f"{mech.name!r} is not a feature map and decodes with a KV cache: "
                "MultiHeadAttention(decode=True) needs max_len >= 1"
            )

        def zeros():
            shape = (b, self.max_len, h)
            return (
                jnp.zeros((*shape, k.shape[-1]), k.dtype),
                jnp.zeros((*shape, dv), v.dtype),
                jnp.int32(0),
            )

        state = self.variable("cache", "state", zeros)
        kc, vc, idx = state.value
        kc = jax.lax.dynamic_update_slice_in_dim(kc, k, idx, axis=1)
        vc = jax.lax.dynamic_update_slice_in_dim(vc, v, idx, axis=1)
        mask = jnp.broadcast_to(jnp.arange(self.max_len)[None, :] <= idx, (b, self.max_len))
        out = mech.attention(q, kc, vc, params, None, mask=mask, deterministic=True)
        if initialized:
            state.value = (kc, vc, idx + 1)
        return out


__all__ = ["MultiHeadAttention", "attention_fn"]
