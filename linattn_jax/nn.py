"""Flax NNX modules: multi-head attention with any registered mechanism.

    layer = la.nn.MultiHeadAttention(
        num_heads=4, in_features=64, attention="flexformer_n",
        attention_config={"num_features": 64}, rngs=nnx.Rngs(params=0, attention=1))
    y = layer(x, mask=pad_mask, causal=True)            # x: [B, T, 64]

Learnable mechanism params (frequencies, scales, feature-map weights, proposal
networks) are `nnx.Param`s under ``layer.mechanism``; fixed random features
(performer, rfa) are `FixedFeatures` variables (not `nnx.Param`, so an optimizer
built with ``wrt=nnx.Param`` leaves them alone) that `redraw` replaces. Sampling
mechanisms draw from the ``"attention"`` rng stream.

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

from linattn_jax import _module_utils as mu
from linattn_jax import parallel


def _annotated(init, axes):
    """Logical axis names as metadata, not an eager placement: the training loop maps
    them to mesh axes (and a module built outside any mesh still works)."""
    return nnx.with_partitioning(init, axes, eager_sharding=False)


class FixedFeatures(nnx.Variable):
    """A non-trainable mechanism variable (a fixed random draw, e.g. performer's features)."""


class MultiHeadAttention(nnx.Module):
    """Projections + a registered attention mechanism + output projection.

    Args:
      num_heads: H.
      in_features: input width.
      qkv_features: total q/k/v width (H * head_dim); default `in_features`.
      out_features: output width; default `in_features`.
      attention: registry name of the mechanism.
      attention_config: config bound to the mechanism (e.g. ``{"num_features": 64}``).
      use_bias: biases in the projections.
      deterministic: default for calls (mechanism sampling off when True).
      dtype: computation dtype of the projections (e.g. ``jnp.bfloat16``; default: inferred
        from inputs and params); param_dtype: dtype of the parameters.
      rngs: ``params`` for init, ``attention`` (optional) for sampling.
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
        *,
        attention: str = "softmax",
        attention_config: Mapping[str, Any] | None = None,
        use_bias: bool = True,
        deterministic: bool = False,
        dtype=None,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
        mesh=None,
        seq_axis: str = "seq",
        batch_axes=None,
    ):
        qkv_features = qkv_features or in_features
        out_features = out_features or in_features
        head_dim = mu.head_dims(num_heads, qkv_features)
        self.num_heads, self.head_dim = num_heads, head_dim
        self.mech = nnx.static(mu.bound_mechanism(attention, attention_config))
        self.deterministic = deterministic
        self.attend = nnx.static(
            self.mech.attention
            if mesh is None
            else parallel.sequence_parallel(self.mech, mesh, seq_axis, batch_axes=batch_axes)
        )
        init = nnx.initializers.lecun_normal()

        def proj():
            return nnx.LinearGeneral(
                in_features,
                (num_heads, head_dim),
                use_bias=use_bias,
                dtype=dtype,
                param_dtype=param_dtype,
                kernel_init=_annotated(init, mu.QKV_AXES),
                rngs=rngs,
            )

        self.query, self.key, self.value = proj(), proj(), proj()
        self.out = nnx.LinearGeneral(
            (num_heads, head_dim),
            out_features,
            axis=(-2, -1),
            use_bias=use_bias,
            dtype=dtype,
            param_dtype=param_dtype,
            kernel_init=_annotated(init, mu.OUT_AXES),
            rngs=rngs,
        )
        params = self.mech.init(rngs.params(), num_heads=num_heads, head_dim=head_dim)
        trainable, fixed = mu.split_params(self.mech, params)
        self.mechanism = nnx.Dict(
            {k: nnx.Param(v) for k, v in trainable.items()}
            | {k: FixedFeatures(v) for k, v in fixed.items()}
        )
        self.rngs = rngs["attention"].fork() if "attention" in rngs else nnx.data(None)

    def mechanism_params(self) -> dict:
        """The mechanism's params as plain arrays (the functional API's `params`)."""
        return {k: v[...] for k, v in self.mechanism.items()}

    def redraw(self, rng) -> None:
        """Replaces the fixed random features with a fresh draw from `rng`."""
        fresh = self.mech.init(rng, num_heads=self.num_heads, head_dim=self.head_dim)
        for k in self.mech.fixed_params():
            self.mechanism[k][...] = fresh[k]

    def __call__(
        self,
        inputs_q,
        inputs_kv=None,
        *,
        mask=None,
        causal: bool = False,
        deterministic: bool | None = None,
        rngs: nnx.Rngs | jax.Array | None = None,
    ):
        """``inputs_q [B, Tq, F]`` -> ``[B, Tq, out]``.

        `inputs_kv` ``[B, Tk, F]`` defaults to `inputs_q`; `mask` is a ``[B, Tk]``
        key-padding mask (True = attend); `rngs` overrides the module's stream.
        """
        inputs_kv = inputs_q if inputs_kv is None else inputs_kv
        q, k, v = self.query(inputs_q), self.key(inputs_kv), self.value(inputs_kv)
        deterministic = self.deterministic if deterministic is None else deterministic
        rng = None
        if self.mech.stochastic and not deterministic:
            if isinstance(rngs, nnx.Rngs):
                rng = rngs.attention()
            elif rngs is not None:
                rng = rngs
            elif self.rngs is not None:
                rng = self.rngs()
        out = self.attend(
            q,
            k,
            v,
            self.mechanism_params(),
            rng,
            mask=mask,
            causal=causal,
            deterministic=deterministic,
        )
        return self.out(out)


attention_fn = mu.attention_fn

__all__ = ["FixedFeatures", "MultiHeadAttention", "attention_fn"]
