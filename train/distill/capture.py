"""Reading the queries and keys every attention layer sees, without changing the model.

`capture_attention` intercepts every `linattn_jax.linen.MultiHeadAttention` call (its
``mask`` / ``causal`` arguments and the outputs of its ``query`` / ``key`` projections) with
``flax.linen.intercept_methods``, so any model built from that module (the LRA classifiers,
the ViT, the causal LM) can be distilled.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn

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


def capture_attention(model: nn.Module, variables, *args, **kwargs) -> list[AttentionCall]:
    """Runs ``model.apply(variables, *args, **kwargs)`` and returns every attention call.

    Works under ``jax.jit`` (call it inside the jitted function). The paths are the
    `MultiHeadAttention` modules' paths, which are also where their ``mechanism`` params live.
    """
    calls: list[AttentionCall] = []
    stack: list[dict[str, Any]] = []

    def interceptor(next_fun, call_args, call_kwargs, context):
        mdl = context.module
        if context.method_name != "__call__":
            return next_fun(*call_args, **call_kwargs)
        if isinstance(mdl, MultiHeadAttention):
            stack.append({})
            out = next_fun(*call_args, **call_kwargs)
            rec = stack.pop()
            if rec.get("query") is not None and rec.get("key") is not None:
                calls.append(
                    AttentionCall(
                        tuple(mdl.path),
                        rec["query"],
                        rec["key"],
                        call_kwargs.get("mask"),
                        bool(call_kwargs.get("causal", False)),
                    )
                )
            return out
        out = next_fun(*call_args, **call_kwargs)
        if (
            stack
            and isinstance(mdl, nn.DenseGeneral)
            and mdl.name in ("query", "key")
            and isinstance(mdl.parent, MultiHeadAttention)
        ):
            stack[-1][mdl.name] = out
        return out

    with nn.intercept_methods(interceptor):
        model.apply(variables, *args, **kwargs)
    return calls
