"""Distilling a trained softmax transformer into linear attention, and kernel transfer.

Hedgehog-style two stages (Zhang et al. 2024; the Flexformer seed's distillation study):

1. **Attention matching.** The student is the teacher's architecture with a feature-map
   mechanism (flexformer_n, flexformer_s, hedgehog, performer, rfa, linear_elu), initialised
   from the teacher's weights. Only the feature-map parameters are trained, layer by layer
   and head by head on the *teacher's* queries and keys (captured from the teacher's
   forward pass), to minimise

       KL(p_i || s_i),  p_i = softmax_j(q_i . k_j / sqrt d),
                        s_ij = phi(q_i) . phi(k_j) / sum_j' phi(q_i) . phi(k_j')

   averaged over layers, heads and (unpadded) query rows -- the cross-entropy of the
   teacher's weights against the student's normalised kernel weights, minus the teacher's
   (constant) entropy, so 0 means a perfect match. Masked keys take no part, causal models
   use causal weights. Trigonometric features (flexformer, rfa) can give negative kernel
   values ``a_ij = phi(q_i) . phi(k_j)``, for which the cross-entropy is undefined (and a
   clamped log would reward pushing row sums towards 0): the student distribution is
   ``relu(a_ij) / sum_j relu(a_ij)``, whose KL to p vanishes only when every ``a_ij > 0``,
   where it equals the signed weights; the log uses ``max(s_ij, WEIGHT_FLOOR)``. The loss
   is computed in blocks of ``block_size`` query rows (``lax.map`` over blocks, each block
   rematerialised in the backward pass), so memory is ``O(block_size * T)`` per layer,
   never ``T x T``.
   Performer (and rfa's fixed features) have nothing to learn here: stage 1 only measures
   them.
2. **Fine-tuning.** The whole student is trained on the task (the training loop's
   `train.loop.Trainer`, starting from the distilled parameters).

Kernel transfer: feature maps distilled on task A are copied into the student of task B
(same number of layers, heads and head size) and compared with B's own distilled maps and
with the untrained maps: attention-matching loss on B and B's task metric (`transfer`).

Queries and keys are read without changing the models: `capture_attention` intercepts every
`linattn_jax.linen.MultiHeadAttention` call (its ``mask`` / ``causal`` arguments and the
outputs of its ``query`` / ``key`` projections) with ``flax.linen.intercept_methods``, so
any model built from that module (the LRA classifiers, the ViT, the causal LM) can be
distilled.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from linattn_jax import core, flexformer, hedgehog, linear_elu, performer, rfa
from linattn_jax.linen import MultiHeadAttention

_f32 = jnp.float32
#: Floor of the student's weights inside the log (trigonometric features can go negative).
WEIGHT_FLOOR = 1e-6

# ---------------------------------------------------------------------------- feature maps
FeatureMap = Callable[..., Any]  # (x [B, T, H, d], params, *, is_query, mask) -> [B, T, H, M]


def _performer_map(x, p, *, is_query, mask):
    if _PERFORMER_OLD_API:  # (x, W, *, is_query, mask): the key max taken inside
        return performer.feature_map(x, p["features"], is_query=is_query, mask=mask)
    phi, n = performer.feature_map(x, p["features"])  # per-token stabilised + log-scale
    if is_query:
        return phi
    return phi * _key_scale(n, mask)[..., None]


def _key_scale(n, mask):
    """``exp(n - max_valid n)`` for per-key log-scales ``n [B, T, H]`` (detached max)."""
    valid = core.key_mask(mask, n.shape[1], n.shape[0])[:, :, None]
    c = lax.stop_gradient(core.masked_max(n, valid, axis=1))
    return jnp.exp(jnp.where(valid, n - c, -jnp.inf))


_PERFORMER_OLD_API = "is_query" in inspect.signature(performer.feature_map).parameters

FEATURE_MAPS: dict[str, FeatureMap] = {
    "flexformer_n": lambda x, p, *, is_query, mask: flexformer.feature_map_n(
        x, p, is_query=is_query, mask=mask
    ),
    "flexformer_s": lambda x, p, *, is_query, mask: flexformer.feature_map_s(
        x, p, is_query=is_query, mask=mask
    ),
    "hedgehog": lambda x, p, *, is_query, mask: hedgehog.feature_map(x, p),
    "performer": _performer_map,
    "rfa": lambda x, p, *, is_query, mask: rfa.feature_map(x, p),
    "linear_elu": lambda x, p, *, is_query, mask: linear_elu.feature_map(x),
}
"""The student feature maps (each mechanism's own, with its deterministic features)."""


def distillable_names() -> list[str]:
    return list(FEATURE_MAPS)


def _check_student(name: str, config: Mapping[str, Any] | None = None) -> FeatureMap:
    if name not in FEATURE_MAPS:
        raise ValueError(
            f"cannot distill into {name!r}: attention matching needs a feature-map mechanism, "
            f"one of {distillable_names()}"
        )
    if name == "rfa" and dict(config or {}).get("gate"):
        raise ValueError("rfa with gate=True is a decayed recurrence; distill rfa without gate")
    return FEATURE_MAPS[name]


# ---------------------------------------------------------------------------- capture
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


# ---------------------------------------------------------------------------- the loss
def attention_kl(
    q, k, params, feature_map: FeatureMap, *, mask=None, causal=False, block_size: int = 128
):
    """``(sum of KL(p_i || s_i), number of query rows)`` over batch, heads and rows.

    Args:
      q, k: ``[B, T, H, d]`` teacher queries and keys (gradients are not taken through them).
      params: the student mechanism's params for this layer.
      feature_map: ``FEATURE_MAPS[name]``.
      mask: ``[B, T]`` key-padding mask (also drops padded query rows), or None.
      causal: causal weights (``j <= i``) for both teacher and student.
      block_size: query rows per block (memory ``O(B H block_size T)``).
    """
    q = lax.stop_gradient(q).astype(_f32)
    k = lax.stop_gradient(k).astype(_f32)
    b, t, h, d = q.shape
    tk = k.shape[1]
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    valid_k = core.key_mask(mask, tk, b)  # [B, Tk]
    valid_q = valid_k if mask is not None and t == tk else jnp.ones((b, t), bool)
    phi_k = feature_map(k, params, is_query=False, mask=mask).astype(_f32)  # [B, Tk, H, M]
    phi_k = phi_k * valid_k[:, :, None, None].astype(_f32)
    c = min(block_size, t)
    n = -(-t // c)
    pad = n * c - t
    qp = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
    vq = jnp.pad(valid_q, ((0, 0), (0, pad)))
    q_blocks = jnp.moveaxis(qp.reshape(b, n, c, h, d), 1, 0)  # [n, B, c, H, d]
    v_blocks = jnp.moveaxis(vq.reshape(b, n, c), 1, 0)  # [n, B, c]
    starts = jnp.arange(n) * c
    key_pos = jnp.arange(tk)

    @jax.checkpoint
    def block(args):
        qb, vb, start = args
        allowed = jnp.broadcast_to(valid_k[:, None, None, :], (b, 1, c, tk))  # [B, 1, c, Tk]
        if causal:
            rows = start + jnp.arange(c)
            allowed = allowed & (key_pos[None, :] <= rows[:, None])[None, None]
        logits = jnp.einsum("bihd,bjhd->bhij", qb, k) * d**-0.5  # [B, H, c, Tk]
        logits = jnp.where(allowed, logits, -jnp.inf)
        row_max = jnp.max(logits, axis=-1, keepdims=True)
        row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
        log_p = logits - row_max
        log_p = log_p - jnp.log(jnp.sum(jnp.where(allowed, jnp.exp(log_p), 0.0), -1, keepdims=True))
        p = jnp.where(allowed, jnp.exp(log_p), 0.0)
        phi_q = feature_map(qb, params, is_query=True, mask=None).astype(_f32)  # [B, c, H, M]
        a = jnp.einsum("bihm,bjhm->bhij", phi_q, phi_k)
        # Negative kernel values (trigonometric features) carry no probability: the student
        # distribution is relu(a) / sum relu(a), a proper distribution whose KL to p is 0
        # only where every a_ij > 0, i.e. where it equals the signed weights a / sum a.
        a = jnp.where(allowed, jnp.maximum(a, 0.0), 0.0)
        s = a / core.guard_denominator(jnp.sum(a, axis=-1, keepdims=True))
        log_s = jnp.log(jnp.maximum(s, WEIGHT_FLOOR))
        kl = jnp.sum(jnp.where(allowed, p * (jnp.where(allowed, log_p, 0.0) - log_s), 0.0), -1)
        rows_ok = vb[:, None, :].astype(_f32)  # [B, 1, c]
        return jnp.sum(kl * rows_ok), jnp.sum(rows_ok) * h

    sums, counts = lax.map(block, (q_blocks, v_blocks, starts))
    return jnp.sum(sums), jnp.sum(counts)


def matching_loss(calls, mech_params: Mapping[tuple, Any], name: str, *, block_size: int = 128):
    """Mean KL over every captured attention call; returns ``(loss, [per-call KL])``.

    ``mech_params[path]`` holds the student's mechanism params of the layer at ``path``.
    """
    fmap = _check_student(name)
    per_call, total, count = [], 0.0, 0.0
    for call in calls:
        s, c = attention_kl(
            call.q,
            call.k,
            mech_params[call.path],
            fmap,
            mask=call.mask,
            causal=call.causal,
            block_size=block_size,
        )
        per_call.append(s / jnp.maximum(c, 1.0))
        total, count = total + s, count + c
    if not per_call:
        raise ValueError("the model made no MultiHeadAttention calls: nothing to distill")
    return total / jnp.maximum(count, 1.0), per_call


# ---------------------------------------------------------------------------- params
def _get(tree, path):
    for p in path:
        tree = tree[p]
    return tree


def _set(tree: dict, path, value) -> dict:
    """A copy of nested dict `tree` with ``tree[path] = value``."""
    if not path:
        return value
    out = dict(tree)
    out[path[0]] = _set(tree.get(path[0], {}), path[1:], value)
    return out


def attention_paths(variables) -> list[tuple[str, ...]]:
    """Paths (in ``params``) of every attention module: the parents of ``mechanism``."""
    out = []

    def walk(tree, path):
        if isinstance(tree, Mapping):
            if "mechanism" in tree and "query" in tree:
                out.append(path)
            for k, v in tree.items():
                walk(v, (*path, k))

    walk(nn.meta.unbox(variables["params"]), ())
    return out


def mechanism_params(variables, paths=None) -> dict[tuple, Any]:
    """``{path: trainable mechanism params ∪ fixed features}`` of every attention module."""
    variables = nn.meta.unbox(variables)
    paths = attention_paths(variables) if paths is None else paths
    out = {}
    for p in paths:
        params = dict(_get(variables["params"], p)["mechanism"])
        if "fixed" in variables:
            try:
                params.update(_get(variables["fixed"], p)["mechanism"])
            except KeyError:
                pass
        out[p] = params
    return out


def trainable_mechanism_params(variables) -> dict[tuple, Any]:
    """``{path: params["mechanism"]}`` (the learnable feature-map params only)."""
    variables = nn.meta.unbox(variables)
    return {p: dict(_get(variables["params"], p)["mechanism"]) for p in attention_paths(variables)}


def with_mechanism_params(variables, trainable: Mapping[tuple, Any]):
    """A copy of `variables` whose ``params[path]["mechanism"]`` are replaced by `trainable`."""
    variables = dict(nn.meta.unbox(variables))
    params = variables["params"]
    for p, value in trainable.items():
        params = _set(params, (*p, "mechanism"), value)
    variables["params"] = params
    return variables


def transplant(teacher_variables, student_variables, *, skip=("mechanism",)):
    """Student variables with every leaf the teacher has at the same path and shape copied
    from the teacher (projections, embeddings, MLPs, norms, head); the student's own
    mechanism params (`skip`) and collections the teacher lacks (``fixed``) are kept.

    Returns ``(variables, copied, kept)`` with the lists of copied / kept leaf paths.
    """
    teacher = nn.meta.unbox(teacher_variables)
    student = nn.meta.unbox(student_variables)
    copied, kept = [], []

    def merge(s_tree, t_tree, path):
        if isinstance(s_tree, Mapping):
            out = {}
            for key, value in s_tree.items():
                sub = (*path, key)
                if key in skip or not isinstance(t_tree, Mapping) or key not in t_tree:
                    out[key] = value
                    kept.extend(_leaf_paths(value, sub))
                else:
                    out[key] = merge(value, t_tree[key], sub)
            return out
        if getattr(t_tree, "shape", None) == getattr(s_tree, "shape", None):
            copied.append(path)
            return jnp.asarray(t_tree, dtype=s_tree.dtype)
        kept.append(path)
        return s_tree

    merged = {c: merge(v, teacher.get(c, {}), (c,)) for c, v in student.items()}
    return merged, copied, kept


def _leaf_paths(tree, path):
    if isinstance(tree, Mapping):
        return [q for k, v in tree.items() for q in _leaf_paths(v, (*path, k))]
    return [path]


# ---------------------------------------------------------------------------- stage 1
@dataclasses.dataclass
class Stage1Result:
    """Distilled mechanism params and the matching-loss history.

    ``params``: ``{path: trainable mechanism params}``; ``history``: ``[(step, loss)]``;
    ``initial_loss`` / ``final_loss``: the mean KL on the evaluation batches before and
    after; ``per_layer``: final KL per attention call.
    """

    params: dict
    history: list
    initial_loss: float
    final_loss: float
    per_layer: list


def distill_attention(
    teacher: nn.Module,
    teacher_variables,
    student_name: str,
    student_variables,
    batches: Iterable[tuple],
    *,
    num_steps: int,
    learning_rate: float = 1e-2,
    block_size: int = 128,
    eval_inputs: Iterable[tuple] = (),
    log_every: int = 0,
    progress: Callable[[int, float], None] | None = None,
) -> Stage1Result:
    """Stage 1: trains the student's feature-map params to match the teacher's attention.

    Args:
      teacher, teacher_variables: the trained softmax model.
      student_name: the student's mechanism (``FEATURE_MAPS``); its config is bound in
        the student model, the params come from `student_variables`.
      student_variables: the student's variables (for the fixed features and the initial
        feature-map params; its other weights are irrelevant here).
      batches: iterator of model-input tuples (e.g. ``(batch["inputs"],)``).
      num_steps: optimiser steps (Adam at `learning_rate`, cosine decay).
      block_size: query rows per block of the loss.
      eval_inputs: input tuples on which the initial and final loss are measured
        (default: the first training batch).
      progress: called as ``progress(step, loss)`` every `log_every` steps.
    """
    _check_student(student_name)
    all_params = mechanism_params(student_variables)
    trainable = trainable_mechanism_params(student_variables)
    fixed = {
        p: {k: v for k, v in all_params[p].items() if k not in trainable[p]} for p in all_params
    }
    schedule = optax.cosine_decay_schedule(learning_rate, max(num_steps, 1))
    tx = optax.adam(schedule)
    opt_state = tx.init(trainable)

    def loss_of(params, teacher_vars, inputs):
        # the teacher's q, k are captured inside the same jit: paths and flags are static
        calls = capture_attention(teacher, teacher_vars, *inputs, deterministic=True)
        merged = {p: {**fixed.get(p, {}), **params.get(p, {})} for p in {c.path for c in calls}}
        return matching_loss(calls, merged, student_name, block_size=block_size)

    @jax.jit
    def step(params, opt_state, teacher_vars, inputs):
        grad_fn = jax.value_and_grad(loss_of, has_aux=True)
        (loss, _), grads = grad_fn(params, teacher_vars, inputs)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    evaluate = jax.jit(loss_of)
    it = iter(batches)
    eval_inputs = [tuple(x) for x in eval_inputs]
    first = None
    if not eval_inputs:
        first = tuple(next(it))
        eval_inputs = [first]

    def eval_loss(params):
        losses, layers = [], []
        for inputs in eval_inputs:
            loss, per = evaluate(params, teacher_variables, inputs)
            losses.append(float(loss))
            layers.append([float(x) for x in per])
        return float(np.mean(losses)), np.mean(np.asarray(layers), axis=0).tolist()

    initial, _ = eval_loss(trainable)
    history = []
    params = trainable
    for i in range(num_steps):
        inputs = first if (i == 0 and first is not None) else tuple(next(it))
        params, opt_state, loss = step(params, opt_state, teacher_variables, inputs)
        if log_every and ((i + 1) % log_every == 0 or i + 1 == num_steps):
            history.append((i + 1, float(loss)))
            if progress is not None:
                progress(i + 1, float(loss))
    final, per_layer = eval_loss(params)
    return Stage1Result(params, history, initial, final, per_layer)


__all__ = [
    "FEATURE_MAPS",
    "WEIGHT_FLOOR",
    "AttentionCall",
    "Stage1Result",
    "attention_kl",
    "attention_paths",
    "capture_attention",
    "distill_attention",
    "distillable_names",
    "matching_loss",
    "mechanism_params",
    "trainable_mechanism_params",
    "transplant",
    "with_mechanism_params",
]
