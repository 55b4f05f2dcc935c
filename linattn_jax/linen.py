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
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from linattn_jax import _module_utils as mu

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
        deterministic = self.deterministic if deterministic is None else deterministic
        rng = None
        if mech.stochastic and not deterministic:
            rng = self.make_rng("attention")
        out = mech.attention(
            q,
            k,
            v,
            {**trainable, **fixed},
            rng,
            mask=mask,
            causal=causal,
            deterministic=deterministic,
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


__all__ = ["MultiHeadAttention", "attention_fn"]
