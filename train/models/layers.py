"""Shared layers of the training models: dense, layer norm, MLP and the one pre-LN ``Block``.

Every model in `train.models` (the LRA encoder, the ViT and the causal LM) stacks the same
pre-LN block::

    x = x + DropPath(Dropout(MHA(LN(x), mask)))
    x = x + DropPath(MLP(LN(x)))                 MLP: Dense(mlp) -> gelu -> Dense(E)

with the attention `linattn_jax.linen.MultiHeadAttention` (any registered mechanism), causal
or not, and in decode mode (one token per call, its state in the ``cache`` collection) for
recurrent generation. Parameter names (``ln_attention``, ``attention``, ``ln_mlp``,
``mlp/wi``, ``mlp/wo``) are those of the checkpoints written before the blocks were merged.

Parameters carry logical axis names (``embed``, ``mlp``, ...) for FSDP-style sharding.
``dtype`` is the computation dtype; parameters stay float32.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from linattn_jax import get as la_get
from linattn_jax import parallel
from linattn_jax.linen import MultiHeadAttention


def dense(features, name, axes, dtype=None, **kw) -> nn.Dense:
    """``nn.Dense`` with xavier-uniform kernel and zero bias, partitioned by logical `axes`."""
    return nn.Dense(
        features,
        name=name,
        dtype=dtype,
        kernel_init=nn.with_logical_partitioning(nn.initializers.xavier_uniform(), axes),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), axes[-1:]),
        **kw,
    )


def layer_norm(name=None, dtype=None) -> nn.LayerNorm:
    """``nn.LayerNorm`` with its scale / bias on the logical ``embed`` axis."""
    return nn.LayerNorm(
        name=name,
        dtype=dtype,
        scale_init=nn.with_logical_partitioning(nn.initializers.ones_init(), ("embed",)),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), ("embed",)),
    )


def sinusoidal_positions(length: int, features: int) -> np.ndarray:
    """Fixed ``[length, features]`` sin/cos position table (Vaswani et al. 2017)."""
    pos = np.arange(length, dtype=np.float32)[:, None]
    rate = np.exp(-np.log(10_000.0) * np.arange(0, features, 2, dtype=np.float32) / features)
    table = np.zeros((length, features), np.float32)
    table[:, 0::2] = np.sin(pos * rate[None, :])
    table[:, 1::2] = np.cos(pos * rate[None, : features // 2])
    return table


def embedding(vocab_size: int, features: int, stddev: float, dtype=None) -> nn.Embed:
    """``nn.Embed`` named ``embed`` with N(0, stddev^2) init on the ``(vocab, embed)`` axes."""
    init = nn.initializers.normal(stddev=stddev)
    return nn.Embed(
        vocab_size,
        features,
        embedding_init=nn.with_logical_partitioning(init, ("vocab", "embed")),
        dtype=dtype,
        name="embed",
    )


def learned_positions(module: nn.Module, length: int, features: int):
    """The learned ``pos_embed`` parameter ``[length, features]`` of `module` (N(0, 0.02^2))."""
    init = nn.initializers.normal(stddev=0.02)
    return module.param(
        "pos_embed", nn.with_logical_partitioning(init, ("length", "embed")), (length, features)
    )


def prepend_cls(module: nn.Module, x):
    """``[CLS; x]``: `module`'s learned ``cls`` vector (zero init) before the tokens of
    ``x [B, T, E]`` -> ``[B, 1 + T, E]``."""
    b, _, e = x.shape
    init = nn.with_logical_partitioning(nn.initializers.zeros_init(), (None, None, "embed"))
    cls = jnp.broadcast_to(module.param("cls", init, (1, 1, e)).astype(x.dtype), (b, 1, e))
    return jnp.concatenate([cls, x], axis=1)


class Mlp(nn.Module):
    """``Dense(mlp_dim) -> gelu -> dropout -> Dense(E) -> dropout``: ``[B, T, E] -> [B, T, E]``."""

    mlp_dim: int
    dropout_rate: float = 0.0
    dtype: Any = None

    @nn.compact
    def __call__(self, x, *, deterministic: bool):
        features = x.shape[-1]
        y = dense(self.mlp_dim, "wi", ("embed", "mlp"), self.dtype)(x)
        y = nn.gelu(y)
        y = nn.Dropout(self.dropout_rate)(y, deterministic=deterministic)
        y = dense(features, "wo", ("mlp", "embed"), self.dtype)(y)
        return nn.Dropout(self.dropout_rate)(y, deterministic=deterministic)


def drop_path(module: nn.Module, x, rate: float, deterministic: bool):
    """Stochastic depth: zero a residual branch per example with probability `rate`
    (survivors scaled by ``1 / (1 - rate)``; rng stream ``dropout``)."""
    if deterministic or rate == 0.0:
        return x
    keep = jax.random.bernoulli(module.make_rng("dropout"), 1.0 - rate, (x.shape[0],))
    keep = keep.astype(x.dtype) / (1.0 - rate)
    return x * keep.reshape((-1,) + (1,) * (x.ndim - 1))


class Block(nn.Module):
    """The pre-LN transformer block of every model here; ``[B, T, E] -> [B, T, E]``.

    ``x + DropPath(Drop(MHA(LN(x), mask)))`` then ``x + DropPath(MLP(LN(x)))``.

    Attributes:
      num_heads, qkv_dim, mlp_dim: sizes.
      attention, attention_config: the mechanism (registry name, hashable config pairs).
      dropout_rate: dropout on the attention output and inside the MLP.
      drop_path_rate: stochastic depth of both residual branches (0: off).
      causal: causal attention (the LM).
      decode: one token per call, the attention state in the ``cache`` collection
        (`linattn_jax.linen.MultiHeadAttention`'s decode mode; same parameters).
      max_len: the KV-cache length of mechanisms without a feature map (decode only).
      dtype: computation dtype.
      mesh, seq_axis, batch_axes: with a mesh (not in decode mode), the attention runs
        sequence-parallel over its axis `seq_axis`, the batch over `batch_axes`
        (`linattn_jax.parallel.sequence_parallel`; same parameters as without).
    """

    num_heads: int
    qkv_dim: int
    mlp_dim: int
    attention: str
    attention_config: Any = ()
    dropout_rate: float = 0.0
    drop_path_rate: float = 0.0
    causal: bool = False
    decode: bool = False
    max_len: int = 0
    dtype: Any = None
    mesh: Any = None
    seq_axis: str = "seq"
    batch_axes: Any = None

    @nn.compact
    def __call__(self, x, mask=None, *, deterministic: bool = True):
        y = layer_norm("ln_attention", self.dtype)(x)
        y = MultiHeadAttention(
            num_heads=self.num_heads,
            qkv_features=self.qkv_dim,
            attention=self.attention,
            attention_config=self.attention_config,
            dtype=self.dtype,
            decode=self.decode,
            max_len=self.max_len,
            mesh=None if self.decode else self.mesh,
            seq_axis=self.seq_axis,
            batch_axes=self.batch_axes,
            name="attention",
        )(y, mask=mask, causal=self.causal, deterministic=deterministic)
        y = nn.Dropout(self.dropout_rate)(y, deterministic=deterministic)
        x = x + drop_path(self, y, self.drop_path_rate, deterministic)
        y = Mlp(self.mlp_dim, self.dropout_rate, self.dtype, name="mlp")(
            layer_norm("ln_mlp", self.dtype)(x), deterministic=deterministic
        )
        return x + drop_path(self, y, self.drop_path_rate, deterministic)


def sequence_parallel_model(model: nn.Module, mesh, batch_axes) -> nn.Module:
    """`model` (a `CausalLM`, or an LRA classifier with its ``encoder``) with its attention
    sequence-parallel over the mesh axis ``"seq"`` of `mesh`, the batch over `batch_axes`.

    Same parameters as `model`. Raises:
      ValueError: the model has no sequence-parallel attention (e.g. the ViT), or its
        mechanism is not one `linattn_jax.parallel.sequence_parallel` supports.
    """
    target = model.encoder if hasattr(model, "encoder") else model
    if not hasattr(target, "mesh"):
        raise ValueError(
            f"a 'seq' mesh axis needs a model with sequence-parallel attention (the causal "
            f"LM, the LRA encoders); {type(model).__name__} has none: drop 'seq' from mesh_axes"
        )
    mech = la_get(target.attention)
    causal = not hasattr(model, "encoder")  # the LM
    if target.attention not in parallel.supported_names() or (causal and mech.feature_map is None):
        names = [n for n in parallel.supported_names() if not causal or la_get(n).feature_map]
        raise ValueError(
            f"attention={target.attention!r} does not run sequence-parallel "
            f"({'causal' if causal else 'non-causal'}) over a 'seq' mesh axis; use one of "
            f"{names} or drop 'seq' from mesh_axes"
        )
    target = target.clone(mesh=mesh, batch_axes=tuple(batch_axes))
    return model.clone(encoder=target) if hasattr(model, "encoder") else target


def attention_config_pairs(config) -> tuple:
    """The mechanism config as hashable sorted ``(key, value)`` pairs (tuples for lists)."""
    raw = config.to_dict() if hasattr(config, "to_dict") else dict(config or {})
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in raw.items()))


def compute_dtype(config):
    """``config.model.dtype`` (``"float32"`` or ``"bfloat16"``) as a dtype.

    float16 is refused: it needs loss scaling, which the training loop does not do.
    """
    name = str(config.model.get("dtype", "float32"))
    if name not in ("float32", "bfloat16"):
        raise ValueError(f"model.dtype must be 'float32' or 'bfloat16', got {name!r}")
    return jnp.dtype(name)


__all__ = [
    "Block",
    "Mlp",
    "attention_config_pairs",
    "compute_dtype",
    "dense",
    "drop_path",
    "embedding",
    "layer_norm",
    "learned_positions",
    "prepend_cls",
    "sequence_parallel_model",
    "sinusoidal_positions",
]
