"""Reading the queries and keys every attention layer sees, without changing the model.

`capture_attention` intercepts every attention layer's call with
``flax.linen.intercept_methods``: its mask and causal flag, and the outputs of its ``query`` /
``key`` projections. Attention layers are `linattn_jax.linen.MultiHeadAttention` (so any model
built from it: the LRA classifiers, the ViT, the causal LM) and the self-attention of an HF
transformers BERT-family Flax model, plain or swapped by `linattn_jax.hf.swap_attention`
(``la.hf.self_attention_call``), so such a model can be distilled too.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn

import linattn_jax as la
from linattn_jax.linen import MultiHeadAttention


class AttentionCall(NamedTuple):
    """One call of an attention layer: its module path and what the mechanism saw.

    ``q``, ``k``: ``[B, T, H, d]`` projections; ``mask``: ``[B, T]`` bool or None;
    ``causal``: bool. Tied layers (one module called several times) give one entry per call.
    """

    path: tuple[str, ...]
    q: Any
    k: Any
    mask: Any
    causal: bool


def _layer_call(mdl, args, kwargs) -> tuple[Any, bool, int | None] | None:
    """``(mask, causal, num_heads)`` if `mdl` is an attention layer (``num_heads`` None when
    its projections already split the heads), else None."""
    if isinstance(mdl, MultiHeadAttention):
        return kwargs.get("mask"), bool(kwargs.get("causal", False)), None
    hf_call = la.hf.self_attention_call(mdl, args, kwargs)
    if hf_call is not None:
        return hf_call.mask, hf_call.causal, hf_call.num_heads
    return None


def capture_attention(model: nn.Module, variables, *args, **kwargs) -> list[AttentionCall]:
    """Runs ``model.apply(variables, *args, **kwargs)`` and returns every attention call.

    Works under ``jax.jit`` (call it inside the jitted function). The paths are the attention
    layers' module paths, which are also where their ``mechanism`` params live.
    """
    calls: list[AttentionCall] = []
    stack: list[dict[str, Any]] = []

    def interceptor(next_fun, call_args, call_kwargs, context):
        mdl = context.module
        if context.method_name != "__call__":
            return next_fun(*call_args, **call_kwargs)
        layer = _layer_call(mdl, call_args, call_kwargs)
        if layer is not None:
            path = tuple(mdl.path)
            stack.append({"path": path})
            out = next_fun(*call_args, **call_kwargs)
            rec = stack.pop()
            if rec.get("query") is not None and rec.get("key") is not None:
                mask, causal, heads = layer
                q, k = rec["query"], rec["key"]
                if heads is not None:  # [B, T, H * d] -> [B, T, H, d]
                    q = q.reshape(*q.shape[:2], heads, -1)
                    k = k.reshape(*k.shape[:2], heads, -1)
                calls.append(AttentionCall(path, q, k, mask, causal))
            return out
        out = next_fun(*call_args, **call_kwargs)
        if (
            stack
            and mdl.name in ("query", "key")
            and isinstance(mdl, (nn.Dense, nn.DenseGeneral))
            and tuple(mdl.path[:-1]) == stack[-1]["path"]
        ):
            stack[-1][mdl.name] = out
        return out

    with nn.intercept_methods(interceptor):
        model.apply(variables, *args, **kwargs)
    return calls
