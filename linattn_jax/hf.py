"""HF transformers' Flax models with a linattn mechanism: `swap_attention`.

    from transformers import FlaxRobertaModel
    model = FlaxRobertaModel.from_pretrained("roberta-base")
    model = la.hf.swap_attention(model, "flexformer_n", num_features=64)
    out = model(input_ids, attention_mask=attention_mask)   # the same call as before

Needs the optional extra ``linattn_jax[hf]`` (``transformers>=4.40,<5``, the last line with
Flax models); ``import linattn_jax`` never imports transformers, this module imports it only
inside `swap_attention`.

The self-attention of every layer of a BERT-family model (``model_type`` one of
`SUPPORTED_MODEL_TYPES`: BERT, RoBERTa, XLM-RoBERTa, RoBERTa-PreLayerNorm, ELECTRA; their
heads included, e.g. ``FlaxRobertaForMaskedLM``) runs the mechanism instead of softmax. The
pretrained ``query`` / ``key`` / ``value`` projections and the output block are kept as they
are; the mechanism's own trainable params are new leaves ``.../attention/self/mechanism/<name>``
in ``model.params``, initialised from `seed`. Fixed random features (performer, rfa) are not
params: each layer draws them from `seed` and its path, the same draw at every call.

What the swapped layer honours: the HF ``attention_mask`` (``[B, T]`` padding, 1 = attend),
causality of a decoder config (``is_decoder=True``; only a mechanism in
``la.causal_names()``), ``head_mask`` (it scales each head's output, which is what it does
to softmax's weights). What it refuses, with a ValueError naming it: a non-causal mechanism
in a decoder, ``output_attentions=True`` (a linear mechanism has no weight matrix), the
decoding cache (``init_cache`` / ``past_key_values``), and training (``train=True``) with
``config.attention_probs_dropout_prob > 0`` (dropout on attention weights: set it to 0).
Stochastic mechanisms (``la.get(name).stochastic``: ra and lara sample, performer and rfa
with ``redraw="call"`` redraw their features) draw from the ``"dropout"`` rng stream when training
(``model(..., train=True, dropout_rng=key)``).
Cross-attention layers (``add_cross_attention=True``) keep softmax.

`self_attention_call` tells a tool that intercepts module calls (such as
``train.distill.capture_attention``) what one of these layers sees, swapped or not.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import inspect
import sys
import zlib
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core import unfreeze
from flax.traverse_util import flatten_dict, unflatten_dict

from linattn_jax import registry
from linattn_jax.transplant import transplant

#: ``model_type -> (modeling module, self-attention class)`` of the supported family (all of
#: them copies of ``FlaxBertSelfAttention``).
_FAMILY = {
    "bert": ("transformers.models.bert.modeling_flax_bert", "FlaxBertSelfAttention"),
    "roberta": ("transformers.models.roberta.modeling_flax_roberta", "FlaxRobertaSelfAttention"),
    "xlm-roberta": (
        "transformers.models.xlm_roberta.modeling_flax_xlm_roberta",
        "FlaxXLMRobertaSelfAttention",
    ),
    "roberta-prelayernorm": (
        "transformers.models.roberta_prelayernorm.modeling_flax_roberta_prelayernorm",
        "FlaxRobertaPreLayerNormSelfAttention",
    ),
    "electra": ("transformers.models.electra.modeling_flax_electra", "FlaxElectraSelfAttention"),
}
SUPPORTED_MODEL_TYPES = tuple(_FAMILY)


class SelfAttentionCall(NamedTuple):
    """What a BERT-family self-attention layer's mechanism sees in one call.

    ``mask``: ``[B, Tk]`` bool key padding (True = attend) or None; ``causal``: a decoder's
    causal self-attention; ``num_heads``: H (its ``query`` / ``key`` outputs are
    ``[B, T, H * d]``).
    """

    mask: Any
    causal: bool
    num_heads: int


def _family_classes() -> tuple[type, ...]:
    """The family's self-attention classes among the modules already imported (a model of
    one of them has imported it; transformers is never imported here)."""
    return tuple(getattr(sys.modules[m], c) for m, c in _FAMILY.values() if m in sys.modules)


def _is_self_attention(module) -> bool:
    parent = getattr(module, "parent", None)
    return isinstance(module, _family_classes()) and getattr(parent, "name", None) == "attention"


def _bound_args(module, args, kwargs) -> dict[str, Any]:
    """The arguments of a self-attention ``__call__`` by name, defaults filled in."""
    bound = inspect.signature(type(module).__call__).bind(module, *args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def self_attention_call(module, args, kwargs) -> SelfAttentionCall | None:
    """For a tool intercepting module calls (``flax.linen.intercept_methods``): what the
    self-attention layer `module`, called as ``module(*args, **kwargs)``, attends with;
    None when `module` is not the self-attention of a supported model (or is its
    cross-attention)."""
    if not _is_self_attention(module):
        return None
    a = _bound_args(module, args, kwargs)
    mask = _padding_mask(a["attention_mask"])
    return SelfAttentionCall(mask, bool(module.causal), int(module.config.num_attention_heads))


def _padding_mask(mask):
    if mask is None:
        return None
    if jnp.ndim(mask) != 2:
        raise ValueError(
            f"attention_mask of shape {jnp.shape(mask)}: a swapped BERT-family layer takes the "
            "HF padding mask [batch, length] (1 = attend)"
        )
    return jnp.asarray(mask) > 0


@dataclasses.dataclass(frozen=True)
class _Spec:
    """One swap: the mechanism (name, config as sorted items) and the seed of its draws."""

    attention: str
    config: tuple
    seed: int

    def mechanism(self) -> registry.Mechanism:
        return registry.get(self.attention).bind(**dict(self.config))


class _Mechanism(nn.Module):
    """The mechanism of one swapped layer: ``q, k, v [B, T, H, d] -> [B, T, H, d]``, its
    trainable params its own (named as the mechanism names them)."""

    spec: _Spec
    num_heads: int
    head_dim: int

    @nn.compact
    def __call__(self, q, k, v, *, mask, causal: bool, deterministic: bool):
        mech = self.spec.mechanism()
        h, d = self.num_heads, self.head_dim
        shapes = jax.eval_shape(lambda r: mech.init(r, num_heads=h, head_dim=d), jax.random.key(0))
        fixed_names = set(mech.fixed_params())
        params = {
            n: self.param(n, lambda rng, n=n: mech.init(rng, num_heads=h, head_dim=d)[n])
            for n in sorted(shapes)
            if n not in fixed_names
        }
        if fixed_names:
            where = zlib.crc32("/".join(self.path).encode())
            rng = jax.random.fold_in(jax.random.fold_in(jax.random.key(self.spec.seed), 1), where)
            draw = mech.init(rng, num_heads=h, head_dim=d)
            params.update({n: draw[n] for n in fixed_names})
        rng = None
        if mech.stochastic and not deterministic:
            rng = self.make_rng("dropout")
        return mech.attention(
            q, k, v, params, rng, mask=mask, causal=causal, deterministic=deterministic
        )


def _swapped_call(module, spec: _Spec, args, kwargs):
    """The swapped ``__call__`` of a self-attention layer (HF's signature and outputs)."""
    a = _bound_args(module, args, kwargs)
    config = module.config
    if a["key_value_states"] is not None:
        raise ValueError("a swapped self-attention layer got key_value_states (cross attention)")
    if a["output_attentions"]:
        raise ValueError(
            f"output_attentions=True: the swapped mechanism {spec.attention!r} has no "
            "attention weights to return; call the model with output_attentions=False"
        )
    if a["init_cache"] or module.has_variable("cache", "cached_key"):
        raise ValueError(
            "init_cache / past_key_values: a swapped layer does not keep HF's decoding cache; "
            "run the full sequence, or use la.linen.MultiHeadAttention(decode=True)"
        )
    deterministic = bool(a["deterministic"])
    if not deterministic and config.attention_probs_dropout_prob > 0:
        raise ValueError(
            f"config.attention_probs_dropout_prob={config.attention_probs_dropout_prob} in "
            f"training: {spec.attention!r} cannot drop attention weights; set "
            "model.config.attention_probs_dropout_prob = 0.0 (or call with train=False)"
        )
    hidden = a["hidden_states"]
    b, t = hidden.shape[:2]
    h = config.num_attention_heads
    d = config.hidden_size // h

    def heads(x):
        return x.reshape(b, t, h, d)

    q, k, v = heads(module.query(hidden)), heads(module.key(hidden)), heads(module.value(hidden))
    mask = _padding_mask(a["attention_mask"])
    out = module.mechanism(
        q, k, v, mask=mask, causal=bool(module.causal), deterministic=deterministic
    )
    if a["layer_head_mask"] is not None:
        out = out * jnp.asarray(a["layer_head_mask"]).astype(out.dtype)[None, None, :, None]
    return (out.reshape(b, t, h * d),)


def _interceptor(spec: _Spec):
    """Swaps the mechanism into every self-attention layer of the family."""

    def intercept(next_fun, args, kwargs, context):
        mdl = context.module
        if not _is_self_attention(mdl):
            return next_fun(*args, **kwargs)
        if context.method_name == "setup":
            next_fun(*args, **kwargs)
            h = mdl.config.num_attention_heads
            mdl.mechanism = _Mechanism(spec, h, mdl.config.hidden_size // h)
            return None
        if context.method_name == "__call__":
            return _swapped_call(mdl, spec, args, kwargs)
        return next_fun(*args, **kwargs)

    return intercept


def _swapped_module(module: nn.Module, spec: _Spec) -> nn.Module:
    """A copy of the HF root `module` (same fields) whose calls run under the swap."""
    base = type(module)
    intercept = _interceptor(spec)

    class Swapped(base):
        def __call__(self, *args, **kwargs):
            with nn.intercept_methods(intercept):
                return super().__call__(*args, **kwargs)

    Swapped.__name__ = Swapped.__qualname__ = base.__name__
    Swapped._linattn_swap = spec
    fields = {
        f.name: getattr(module, f.name)
        for f in dataclasses.fields(module)
        if f.init and f.name not in ("parent", "name")
    }
    return Swapped(**fields)


def _transformers():
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - the extra is installed in CI
        raise ImportError(
            "linattn_jax.hf needs HF transformers: pip install 'linattn_jax[hf]'"
        ) from e
    return transformers


def swap_attention(model, attention: str, *, seed: int = 0, **config):
    """A copy of the HF Flax `model` whose self-attention runs `attention`.

    Args:
      model: a ``transformers`` Flax model (``FlaxPreTrainedModel``) of the BERT family
        (``model.config.model_type`` in `SUPPORTED_MODEL_TYPES`), with its params.
      attention: registry name of the mechanism (``la.names()``).
      seed: seed of the mechanism's new params and of its fixed random features.
      **config: the mechanism's config (``la.get(attention).bind(**config)``).

    Returns:
      A model of the same class and config: ``model.params`` are the given model's params
      plus the mechanism's params of every layer; ``model(...)`` takes the same arguments.
      The given model is unchanged. Swapping "softmax" gives the original outputs.

    Raises:
      TypeError: `model` is not an HF Flax model.
      ValueError: another model type, a model already swapped or without params, a decoder
        config with a mechanism that cannot be causal, or a bad mechanism config.
    """
    transformers = _transformers()
    if not isinstance(model, transformers.FlaxPreTrainedModel):
        raise TypeError(
            f"swap_attention takes a transformers Flax model (FlaxPreTrainedModel), got "
            f"{type(model).__name__}"
        )
    model_type = model.config.model_type
    if model_type not in _FAMILY:
        raise ValueError(
            f"swap_attention: model_type {model_type!r} ({type(model).__name__}) is not "
            f"supported; supported: {list(SUPPORTED_MODEL_TYPES)}"
        )
    previous = getattr(type(model.module), "_linattn_swap", None)
    if previous is not None:
        raise ValueError(
            f"swap_attention: the model already runs {previous.attention!r}; swap the original"
        )
    if not getattr(model, "_is_initialized", True):
        raise ValueError("swap_attention needs a model with params (not _do_init=False)")
    spec = _Spec(attention, tuple(sorted(config.items())), int(seed))
    mech = spec.mechanism()  # validates the name and config
    if model.config.is_decoder and mech.name not in registry.causal_names():
        raise ValueError(
            f"swap_attention: {type(model).__name__} is a decoder (config.is_decoder=True) and "
            f"{attention!r} cannot be causal; causal mechanisms: {registry.causal_names()}"
        )
    importlib.import_module(_FAMILY[model_type][0])  # the class the swap recognises
    swapped = copy.copy(model)
    swapped._module = _swapped_module(model.module, spec)
    params = transplant(unfreeze(model.params), _new_params(swapped, model, spec))
    swapped._required_params = set(flatten_dict(params))
    swapped.params = params
    return swapped


def _new_params(swapped, model, spec: _Spec) -> dict:
    """The swapped model's param tree: the given model's leaves, and the new mechanism params
    drawn (one draw per layer, from `spec.seed` and the layer's path); the model is traced,
    not run. A leaf that does not fit stays abstract, for `transplant` to report."""
    shapes = jax.eval_shape(
        lambda rng: unfreeze(swapped.init_weights(rng, model.input_shape)), jax.random.key(0)
    )
    flat = flatten_dict(shapes)
    old = flatten_dict(unfreeze(model.params))
    mech = spec.mechanism()
    h = model.config.num_attention_heads
    d = model.config.hidden_size // h
    draws = {}
    for path, shape in flat.items():
        if path in old:  # the model's own leaf (its dtype, e.g. after to_bf16) where it fits
            if jnp.shape(old[path]) == shape.shape:
                flat[path] = old[path]
            continue
        i = len(path) - 1 - path[::-1].index("mechanism")  # .../attention/self/mechanism/...
        layer = path[:i]
        if layer not in draws:
            rng = jax.random.fold_in(
                jax.random.key(spec.seed), zlib.crc32("/".join(layer).encode())
            )
            draws[layer] = mech.init(rng, num_heads=h, head_dim=d)
        value = draws[layer]
        for key in path[i + 1 :]:
            value = value[key]
        flat[path] = value
    return unflatten_dict(flat)


__all__ = ["SUPPORTED_MODEL_TYPES", "SelfAttentionCall", "self_attention_call", "swap_attention"]
