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
   values ``a_ij = phi(q_i) . phi(k_j)``, for which the cross-entropy is undefined: the
   student distribution is then ``relu(a_ij) / sum_j relu(a_ij)`` and the loss adds the
   fraction of ``sum_j |a_ij|`` that is negative, so it is 0 exactly when every
   ``a_ij > 0`` and ``a_ij / sum_j a_ij = p_ij`` (for positive feature maps -- hedgehog,
   performer, linear_elu -- the penalty is 0 and this is the plain KL); the log uses
   ``max(s_ij, WEIGHT_FLOOR)``. The loss is computed in blocks of ``block_size`` query
   rows (``lax.map`` over blocks, each block rematerialised in the backward pass), so
   memory is ``O(block_size * T)`` per layer, never ``T x T``.
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
import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax import lax

import linattn_jax as la
from linattn_jax import core
from linattn_jax.linen import MultiHeadAttention

_f32 = jnp.float32
#: Floor of the student's weights inside the log (trigonometric features can go negative).
WEIGHT_FLOOR = 1e-6

# ---------------------------------------------------------------------------- feature maps
FeatureMap = Callable[..., Any]  # (x [B, T, H, d], params, *, is_query, mask) -> [B, T, H, M]


def _key_scale(n, mask):
    """``exp(n - max_valid n)`` for per-key log-scales ``n [B, T, H]`` (detached max)."""
    valid = core.key_mask(mask, n.shape[1], n.shape[0])[:, :, None]
    c = lax.stop_gradient(core.masked_max(n, valid, axis=1))
    return jnp.exp(jnp.where(valid, n - c, -jnp.inf))


def distillable_names() -> list[str]:
    """The mechanisms with a feature map (``la.get(name).feature_map``)."""
    return [n for n in la.names() if la.get(n).feature_map is not None]


def student_feature_map(name: str, config: Mapping[str, Any] | None = None) -> FeatureMap:
    """The student's feature map as attention matching uses it, from the library's protocol
    (``la.get(name).feature_map``, its deterministic features): ``(x, params, *, is_query,
    mask) -> [B, T, H, M]``, the key features times ``exp(log scale)`` relative to its max
    over the valid keys (a constant per row, so the normalised weights are unchanged).

    Raises:
      ValueError: `name` is not a feature-map mechanism, or its keys carry a decay (a gated
        recurrence such as rfa with ``gate=True``: not a kernel to match).
    """
    mech = la.get(name).bind(**dict(config or {}))
    fm = mech.feature_map
    if fm is None:
        raise ValueError(
            f"cannot distill into {name!r}: attention matching needs a feature-map mechanism, "
            f"one of {distillable_names()}"
        )
    shapes = jax.eval_shape(
        lambda r: fm.key(jnp.zeros((1, 1, 1, 4)), mech.init(r, num_heads=1, head_dim=4)),
        jax.random.key(0),
    )
    if shapes.log_decay is not None:
        raise ValueError(
            f"{name!r} with config {dict(mech.config)} is a decayed recurrence (its keys carry "
            "a log decay, e.g. rfa's gate); distill it without the decay"
        )

    def fmap(x, params, *, is_query, mask):
        if is_query:
            return fm.query(x, params)
        keys = fm.key(x, params)
        if keys.log_scale is None:
            return keys.phi
        return keys.phi * _key_scale(keys.log_scale, mask)[..., None]

    return fmap


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
    """``(sum of KL(p_i || s_i) (+ negative-mass penalty), number of query rows)`` over
    batch, heads and rows (see the module docstring).

    Args:
      q, k: ``[B, T, H, d]`` teacher queries and keys (gradients are not taken through them).
      params: the student mechanism's params for this layer.
      feature_map: `student_feature_map` of the student.
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
        # distribution is relu(a) / sum relu(a), and the fraction of |a| that is negative is
        # added as a penalty; the sum is 0 only where every a_ij > 0 and a / sum a = p.
        a = jnp.where(allowed, a, 0.0)
        pos, neg = jnp.maximum(a, 0.0), jnp.maximum(-a, 0.0)
        pos_sum = jnp.sum(pos, axis=-1, keepdims=True)
        s = pos / core.guard_denominator(pos_sum)
        log_s = jnp.log(jnp.maximum(s, WEIGHT_FLOOR))
        kl = jnp.sum(jnp.where(allowed, p * (jnp.where(allowed, log_p, 0.0) - log_s), 0.0), -1)
        neg_sum = jnp.sum(neg, axis=-1)
        kl = kl + neg_sum / core.guard_denominator(pos_sum[..., 0] + neg_sum)
        rows_ok = vb[:, None, :].astype(_f32)  # [B, 1, c]
        return jnp.sum(kl * rows_ok), jnp.sum(rows_ok) * h

    sums, counts = lax.map(block, (q_blocks, v_blocks, starts))
    return jnp.sum(sums), jnp.sum(counts)


def matching_loss(calls, mech_params: Mapping[tuple, Any], name: str, *, block_size: int = 128):
    """Mean KL over every captured attention call; returns ``(loss, [per-call KL])``.

    ``mech_params[path]`` holds the student's mechanism params of the layer at ``path``.
    """
    fmap = student_feature_map(name)
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
      student_name: the student's mechanism (one of `distillable_names`); its config is bound in
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
    student_feature_map(student_name)
    all_params = mechanism_params(student_variables)
    trainable = trainable_mechanism_params(student_variables)
    fixed = {
        p: {k: v for k, v in all_params[p].items() if k not in trainable[p]} for p in all_params
    }
    schedule = optax.cosine_decay_schedule(learning_rate, max(num_steps, 1))
    tx = optax.adam(schedule)
    opt_state = tx.init(trainable)

    def loss_of(params, fixed, teacher_vars, inputs):
        # the teacher's q, k are captured inside the same jit: paths and flags are static;
        # arrays are arguments, never closed over (see `train.lm.init_cache`)
        calls = capture_attention(teacher, teacher_vars, *inputs, deterministic=True)
        merged = {p: {**fixed.get(p, {}), **params.get(p, {})} for p in {c.path for c in calls}}
        return matching_loss(calls, merged, student_name, block_size=block_size)

    @jax.jit
    def step(params, opt_state, fixed, teacher_vars, inputs):
        grad_fn = jax.value_and_grad(loss_of, has_aux=True)
        (loss, _), grads = grad_fn(params, fixed, teacher_vars, inputs)
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
            loss, per = evaluate(params, fixed, teacher_variables, inputs)
            losses.append(float(loss))
            layers.append([float(x) for x in per])
        return float(np.mean(losses)), np.mean(np.asarray(layers), axis=0).tolist()

    initial, _ = eval_loss(trainable)
    history = []
    params = trainable
    for i in range(num_steps):
        inputs = first if (i == 0 and first is not None) else tuple(next(it))
        params, opt_state, loss = step(params, opt_state, fixed, teacher_variables, inputs)
        if log_every and ((i + 1) % log_every == 0 or i + 1 == num_steps):
            history.append((i + 1, float(loss)))
            if progress is not None:
                progress(i + 1, float(loss))
    final, per_layer = eval_loss(params)
    return Stage1Result(params, history, initial, final, per_layer)


# ---------------------------------------------------------------------------- runs
def teacher_config(config):
    """`config` with softmax attention (the teacher of a distillation run)."""
    c = config.copy_and_resolve_references()
    c.attention = "softmax"
    c.attention_config = ml_collections.ConfigDict()
    return c


def student_config(config, student: str, attention_config: Mapping[str, Any] | None = None):
    """`config` with the student mechanism and `attention_config` (default: the preset's
    settings for that mechanism, `train.configs.set_attention`)."""
    from train import configs

    c = configs.set_attention(config.copy_and_resolve_references(), student)
    if attention_config is not None:
        c.attention_config = ml_collections.ConfigDict(dict(attention_config))
    student_feature_map(student, c.attention_config)
    return c


def variables_of(state) -> dict:
    """``{"params": ..., **extra}`` of a `train.loop.TrainState`: the params its run evaluates
    (the parameter EMA when the optimizer keeps one, ``config.ema_decay > 0``)."""
    from train import loop

    ema = loop.ema_params(state.opt_state)
    return {"params": state.params if ema is None else ema, **state.extra}


def restore(config, workdir, *, data=None, prefer: str = "best"):
    """``(trainer, state, meta)`` of the run of `config` in `workdir` (best, else latest).

    Raises:
      FileNotFoundError: `workdir` has no checkpoint (says how to train one).
    """
    from train import checkpoint as ckpt_lib
    from train import loop

    trainer = loop.Trainer(config, data)
    ckpt = ckpt_lib.Checkpointer(
        workdir,
        async_save=False,
        best_metric=str(config.get("best_metric", "accuracy")),
        best_mode=str(config.get("best_mode", "max")),
    )
    try:
        abstract = trainer.abstract_sharded_state().as_dict()
        restored = ckpt.restore_best(abstract) if prefer == "best" else None
        restored = restored or ckpt.restore_latest(abstract)
    finally:
        ckpt.close()
    if restored is None:
        raise FileNotFoundError(
            f"no checkpoint of a {config.attention!r} {config.task!r} run in {workdir}; train "
            f"it first: python -m train --task {config.task} --preset {config.preset} "
            f"--attention {config.attention} --workdir {workdir} (or pass --train_teacher)"
        )
    state_dict, meta = restored
    return trainer, loop.TrainState.from_dict(state_dict), meta


def init_student(teacher_state, student_trainer):
    """A fresh student `TrainState` whose weights are the teacher's (except the mechanism
    params, which keep their init; ``fixed`` features are the student's own)."""
    state = student_trainer.init_state()
    merged, _, _ = transplant(variables_of(teacher_state), variables_of(state))
    params = jax.device_put(merged["params"], student_trainer.state_shardings.params)
    return state.replace(params=params, opt_state=student_trainer.tx.init(params))


def with_distilled(state, trainer, feature_maps: Mapping[tuple, Any]):
    """`state` with the mechanism params of every attention layer replaced."""
    merged = with_mechanism_params(variables_of(state), feature_maps)
    params = jax.device_put(merged["params"], trainer.state_shardings.params)
    return state.replace(params=params, opt_state=trainer.tx.init(params))


def seed_checkpoint(workdir, trainer, state, config) -> None:
    """Writes `state` as the step-0 checkpoint of `workdir`, so that
    `train.loop.train_and_evaluate` starts (resumes) from it: fine-tuning reuses the loop."""
    from train import checkpoint as ckpt_lib

    ckpt = ckpt_lib.Checkpointer(workdir, async_save=False)
    try:
        if not ckpt.latest.all_steps():
            state = state.replace(step=jnp.zeros((), jnp.int32))
            meta = {
                "step": 0,
                "batch_size": int(config.batch_size),
                "data_shuffle_seed": int(config.data_shuffle_seed),
                "seed": int(config.seed),
                "best": None,
                "best_step": None,
            }
            ckpt.save(0, state.as_dict(), meta)
            ckpt.wait()
    finally:
        ckpt.close()


def input_batches(trainer, *, seed: int) -> Iterator[tuple]:
    """Endless model-input tuples (global sharded arrays) from the training stream."""
    keys = trainer.input_keys
    it = trainer.data.train_batches(
        int(trainer.config.batch_size),
        seed=seed,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )
    for batch in it:
        yield tuple(trainer.to_global(batch, keys)[k] for k in keys)


def eval_inputs(trainer, num_batches: int) -> list[tuple]:
    """The first `num_batches` validation batches as model-input tuples."""
    keys = trainer.input_keys
    out = []
    it = trainer.data.eval_batches(
        "val",
        int(trainer.config.eval_batch_size),
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )
    for i, batch in enumerate(it):
        if i >= num_batches:
            break
        out.append(tuple(trainer.to_global(batch, keys)[k] for k in keys))
    return out


def save_feature_maps(path, feature_maps: Mapping[tuple, Any], info: Mapping[str, Any]) -> None:
    """Feature maps ``{path: params}`` (+ JSON-able `info`) to a msgpack file."""
    from flax import serialization

    tree = {
        "maps": {"/".join(p): jax.device_get(v) for p, v in feature_maps.items()},
        "info": json.dumps(dict(info)),
    }
    Path(path).write_bytes(serialization.msgpack_serialize(tree))


def load_feature_maps(path) -> tuple[dict[tuple, Any], dict]:
    """``(feature maps {path: params}, info)`` written by `save_feature_maps`."""
    from flax import serialization

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no feature-map file {path} (written by a distillation run)")
    tree = serialization.msgpack_restore(path.read_bytes())
    maps = {tuple(k.split("/")): v for k, v in tree["maps"].items()}
    return maps, json.loads(tree["info"])


def _check_maps_fit(maps: Mapping[tuple, Any], state, student: str) -> None:
    own = trainable_mechanism_params(variables_of(state))
    if set(maps) != set(own):
        raise ValueError(
            f"feature maps are for layers {sorted(maps)}, the {student!r} student has {sorted(own)}"
        )
    for p in own:
        want = jax.tree.map(lambda x: tuple(x.shape), own[p])
        got = jax.tree.map(lambda x: tuple(np.shape(x)), dict(maps[p]))
        if want != got:
            raise ValueError(f"feature maps of {p}: shapes {got}, the student needs {want}")


def _log(msg: str) -> None:
    print(msg, flush=True)


def distill(
    config,
    *,
    teacher_workdir,
    workdir,
    stage1_steps: int = 300,
    stage1_lr: float = 1e-2,
    block_size: int = 128,
    num_eval_batches: int = 2,
    stage2: bool = True,
    stage2_lr: float | None = None,
    baselines: bool = False,
    train_teacher: bool = False,
    data=None,
    log: Callable[[str], None] = _log,
) -> dict[str, Any]:
    """Distils the softmax teacher of `config` into ``config.attention`` (the student).

    Stage 1 (`distill_attention`) for `stage1_steps`, then stage 2: the loop
    (`train.loop.train_and_evaluate`) fine-tunes the whole student for
    ``config.num_train_steps`` at `stage2_lr` (default ``config.learning_rate``; a distilled
    student wants a smaller one than training from scratch -- on the test task 1e-3 undid
    stage 1 for flexformer_n, 1e-4 kept it) in ``workdir/stage2``, seeded with the distilled
    student as its step-0 checkpoint. With `baselines`, the same student is also fine-tuned
    the same way from the teacher's weights without stage 1 (``workdir/no_stage1``), and
    trained from scratch for ``stage1_steps + num_train_steps`` steps at
    ``config.learning_rate`` (``workdir/scratch``).

    Writes ``workdir/feature_maps.msgpack`` (the distilled maps, for `kernel_transfer`) and
    ``workdir/distill_summary.json``; returns the summary.
    """
    from train import loop

    workdir = Path(workdir).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    student = config.attention
    student_feature_map(student, config.attention_config)
    t_trainer, t_state = _teacher(config, teacher_workdir, train_teacher, data, log)
    data = t_trainer.data
    teacher_val = t_trainer.evaluate(t_state, "val")
    log(f"teacher (softmax) val: {_fmt(teacher_val)}")

    s_trainer = loop.Trainer(config, data)
    s_state = init_student(t_state, s_trainer)
    no_stage1_val = s_trainer.evaluate(s_state, "val")
    log(f"student {student} with the teacher's weights, before stage 1: {_fmt(no_stage1_val)}")
    writer = _writer(workdir, config)
    progress = _progress(stage1_steps, f"stage 1 ({student})", config)

    def on_step(step, loss):
        writer.write(step, "stage1", {"attention_kl": loss})
        progress.update(0, attention_kl=loss)

    def tick():
        for x in input_batches(s_trainer, seed=int(config.data_shuffle_seed) + 1):
            progress.update(1)
            yield x

    try:
        result = distill_attention(
            t_trainer.model,
            variables_of(t_state),
            student,
            variables_of(s_state),
            tick(),
            num_steps=stage1_steps,
            learning_rate=stage1_lr,
            block_size=block_size,
            eval_inputs=eval_inputs(s_trainer, num_eval_batches),
            log_every=max(1, int(config.log_every)),
            progress=on_step,
        )
    finally:
        progress.close()
    log(
        f"stage 1: attention KL {result.initial_loss:.4f} -> {result.final_loss:.4f} "
        f"(per layer {', '.join(f'{x:.4f}' for x in result.per_layer)})"
    )
    save_feature_maps(
        workdir / "feature_maps.msgpack",
        result.params,
        {"task": config.task, "student": student, "attention_config": _pairs(config)},
    )
    d_state = with_distilled(s_state, s_trainer, result.params)
    zero_shot = s_trainer.evaluate(d_state, "val")
    log(f"student after stage 1 (no fine-tuning) val: {_fmt(zero_shot)}")
    summary: dict[str, Any] = {
        "task": config.task,
        "preset": config.preset,
        "student": student,
        "attention_config": _pairs(config),
        "teacher_val": teacher_val,
        "student_before_stage1_val": no_stage1_val,
        "stage2_learning_rate": float(stage2_lr or config.learning_rate),
        "stage1": {
            "steps": stage1_steps,
            "learning_rate": stage1_lr,
            "initial_kl": result.initial_loss,
            "final_kl": result.final_loss,
            "per_layer_kl": result.per_layer,
            "history": result.history,
        },
        "after_stage1_val": zero_shot,
    }
    metric = str(config.get("best_metric", "accuracy"))
    s2_config = config.copy_and_resolve_references()
    if stage2_lr is not None:
        s2_config.learning_rate = float(stage2_lr)
    if stage2:
        seed_checkpoint(workdir / "stage2", s_trainer, d_state, s2_config)
        s2 = loop.train_and_evaluate(s2_config, workdir / "stage2", data=data)
        summary["stage2"] = {"steps": s2["steps"], "val": s2["val"], "test": s2["test"]}
        log(f"stage 2 ({s2['steps']} steps) val: {_fmt(s2['val'])}")
    if baselines:
        no_stage1 = init_student(t_state, s_trainer)
        seed_checkpoint(workdir / "no_stage1", s_trainer, no_stage1, s2_config)
        b1 = loop.train_and_evaluate(s2_config, workdir / "no_stage1", data=data)
        scratch_cfg = config.copy_and_resolve_references()
        scratch_cfg.num_train_steps = int(config.num_train_steps) + stage1_steps
        b2 = loop.train_and_evaluate(scratch_cfg, workdir / "scratch", data=data)
        summary["baselines"] = {
            "no_stage1": {"steps": b1["steps"], "val": b1["val"]},
            "scratch": {"steps": b2["steps"], "val": b2["val"]},
        }
        log(f"baseline, teacher weights without stage 1: {_fmt(b1['val'])}")
        log(f"baseline, from scratch ({b2['steps']} steps): {_fmt(b2['val'])}")
    final = summary.get("stage2", {}).get("val") or zero_shot
    if metric in final and teacher_val.get(metric):
        summary["recovery"] = final[metric] / teacher_val[metric]
    writer.close()
    (workdir / "distill_summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary


def kernel_transfer(
    config,
    *,
    teacher_workdir,
    source,
    workdir,
    own=None,
    stage1_steps: int = 300,
    stage1_lr: float = 1e-2,
    block_size: int = 128,
    num_eval_batches: int = 2,
    finetune: bool = False,
    train_teacher: bool = False,
    data=None,
    log: Callable[[str], None] = _log,
) -> dict[str, Any]:
    """Feature maps distilled on task A (`source`, a ``feature_maps.msgpack``) used on task B.

    Task B is `config` (student mechanism ``config.attention``, teacher in
    `teacher_workdir`). Compares three sets of maps in B's student (all other weights the
    B teacher's): ``own`` (distilled on B: the file `own`, or a fresh stage 1 of
    `stage1_steps`), ``transferred`` (from A) and ``init`` (untrained). For each: the
    attention-matching KL on B's validation batches and B's validation metric without
    fine-tuning; with `finetune`, also after ``config.num_train_steps`` steps of stage 2.
    ``drop`` = own - transferred (metric; positive = transfer loses). With `train_teacher`,
    B's teacher is trained in `teacher_workdir` first if it has no checkpoint.
    """
    from train import loop

    workdir = Path(workdir).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    student = config.attention
    student_feature_map(student, config.attention_config)
    src_maps, src_info = load_feature_maps(source)  # before any training: fail fast
    if src_info.get("student") not in (None, student):
        raise ValueError(f"{source} holds {src_info['student']!r} maps, not {student!r}")
    t_trainer, t_state = _teacher(config, teacher_workdir, train_teacher, data, log)
    data = t_trainer.data
    s_trainer = loop.Trainer(config, data)
    base = init_student(t_state, s_trainer)
    _check_maps_fit(src_maps, base, student)
    if own is not None:
        own_maps, _ = load_feature_maps(own)
        _check_maps_fit(own_maps, base, student)
    else:
        own_maps = distill_attention(
            t_trainer.model,
            variables_of(t_state),
            student,
            variables_of(base),
            input_batches(s_trainer, seed=int(config.data_shuffle_seed) + 1),
            num_steps=stage1_steps,
            learning_rate=stage1_lr,
            block_size=block_size,
        ).params
    variants = {
        "own": own_maps,
        "transferred": src_maps,
        "init": trainable_mechanism_params(variables_of(base)),
    }
    ev = eval_inputs(s_trainer, num_eval_batches)
    t_vars = variables_of(t_state)

    @jax.jit
    def kl(maps, fixed, t_vars, inputs):
        calls = capture_attention(t_trainer.model, t_vars, *inputs, deterministic=True)
        merged = {p: {**fixed[p], **maps[p]} for p in maps}
        return matching_loss(calls, merged, student, block_size=block_size)[0]

    fixed = mechanism_params(variables_of(base))

    metric = str(config.get("best_metric", "accuracy"))
    summary: dict[str, Any] = {
        "task": config.task,
        "student": student,
        "source": str(source),
        "source_task": src_info.get("task"),
        "teacher_val": t_trainer.evaluate(t_state, "val"),
    }
    for name, maps in variants.items():
        maps = jax.tree.map(jnp.asarray, maps)
        state = with_distilled(base, s_trainer, maps)
        row = {
            "attention_kl": float(np.mean([float(kl(maps, fixed, t_vars, x)) for x in ev])),
            "val": s_trainer.evaluate(state, "val"),
        }
        if finetune:
            seed_checkpoint(workdir / name, s_trainer, state, config)
            row["finetuned_val"] = loop.train_and_evaluate(config, workdir / name, data=data)["val"]
        summary[name] = row
        log(f"{name:12s} maps: attention KL {row['attention_kl']:.4f}, val {_fmt(row['val'])}")
    key = "finetuned_val" if finetune else "val"
    if metric in summary["own"][key]:
        summary["drop"] = summary["own"][key][metric] - summary["transferred"][key][metric]
        log(f"transfer drop ({metric}, own - transferred): {summary['drop']:+.4f}")
    (workdir / "transfer_summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary


def _teacher(config, teacher_workdir, train_teacher: bool, data, log):
    """``(trainer, state)`` of the softmax teacher of `config`, trained first if asked."""
    from train import loop

    t_cfg = teacher_config(config)
    if train_teacher and not _has_checkpoint(teacher_workdir):
        log(f"training the softmax teacher in {teacher_workdir}")
        loop.train_and_evaluate(t_cfg, teacher_workdir, data=data)
    t_trainer, t_state, _ = restore(t_cfg, teacher_workdir, data=data)
    return t_trainer, t_state


def _has_checkpoint(workdir) -> bool:
    root = Path(workdir)
    return any(
        (root / sub).is_dir() and any((root / sub).iterdir()) for sub in ("best", "checkpoints")
    )


def _pairs(config) -> list:
    raw = config.attention_config
    raw = raw.to_dict() if hasattr(raw, "to_dict") else dict(raw or {})
    return sorted(raw.items())


def _fmt(metrics: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v:.4f}" for k, v in metrics.items() if k != "count")


def _writer(workdir, config):
    from train import metrics as metrics_lib

    return metrics_lib.MetricsWriter(
        workdir, enabled=jax.process_index() == 0, tensorboard=bool(config.tensorboard)
    )


def _progress(total, desc, config):
    from train import metrics as metrics_lib

    return metrics_lib.Progress(
        total, enabled=jax.process_index() == 0 and bool(config.progress_bar), desc=desc
    )


__all__ = [
    "distill",
    "eval_inputs",
    "init_student",
    "input_batches",
    "kernel_transfer",
    "load_feature_maps",
    "restore",
    "save_feature_maps",
    "seed_checkpoint",
    "student_config",
    "teacher_config",
    "variables_of",
    "with_distilled",
    "WEIGHT_FLOOR",
    "AttentionCall",
    "Stage1Result",
    "attention_kl",
    "attention_paths",
    "capture_attention",
    "distill_attention",
    "distillable_names",
    "student_feature_map",
    "matching_loss",
    "mechanism_params",
    "trainable_mechanism_params",
    "transplant",
    "with_mechanism_params",
]


# ---------------------------------------------------------------------------- command line
_USAGE = """python -m train.distill: distil a softmax model into linear attention, or transfer
distilled feature maps to another task.

  python -m train.distill run --task listops --preset mini --student flexformer_n \\
      --teacher_workdir workdir/listops_mini_softmax --train_teacher --baselines
  python -m train.distill transfer --task text --preset mini --student flexformer_n \\
      --teacher_workdir workdir/text_mini_softmax --train_teacher \\
      --source workdir/distill/listops_mini_flexformer_n/feature_maps.msgpack

The teacher is the same config with softmax attention, read from --teacher_workdir (best
checkpoint, else latest); --train_teacher trains it there first if it has no checkpoint.
Transfer needs the two tasks' models to have the same layers, heads and head size (the LRA
mini presets of listops, text, retrieval and pathfinder do; image's has one layer).
Stage 2 (and the baselines, and transfer --finetune) run config.num_train_steps steps of
the ordinary training loop (`python -m train`): progress bar, checkpoints, metrics, summary.
Config fields: --set key=value (as for python -m train), e.g. --set num_train_steps=200.
"""


def main(argv=None) -> dict:
    import argparse
    import sys

    from train import configs

    p = argparse.ArgumentParser(
        prog="python -m train.distill",
        description=_USAGE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("command", nargs="?", default="run", choices=("run", "transfer"))
    p.add_argument("--task", default="listops", help=f"one of {sorted(configs.CONFIGS)}")
    p.add_argument("--preset", default="mini")
    p.add_argument("--student", default="flexformer_n", help=f"one of {distillable_names()}")
    p.add_argument("--teacher_workdir", default=None, help="the softmax run's workdir")
    p.add_argument("--train_teacher", action="store_true", help="train the teacher if absent")
    p.add_argument(
        "--workdir", default=None, help="default: workdir/distill/<task>_<preset>_<student>"
    )
    p.add_argument("--stage1_steps", type=int, default=300)
    p.add_argument("--stage1_lr", type=float, default=1e-2)
    p.add_argument("--block_size", type=int, default=128, help="query rows per loss block")
    p.add_argument("--no_stage2", action="store_true", help="stop after attention matching")
    p.add_argument("--stage2_lr", type=float, default=None, help="default: config.learning_rate")
    p.add_argument("--baselines", action="store_true", help="also train without stage 1 / scratch")
    p.add_argument("--source", default=None, help="transfer: feature_maps.msgpack of task A")
    p.add_argument("--own", default=None, help="transfer: B's own maps (default: distil now)")
    p.add_argument("--finetune", action="store_true", help="transfer: also fine-tune each")
    p.add_argument("--data_dir", default=None, help="override data.data_dir")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--no_progress", action="store_true")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)

    config = configs.set_attention(configs.get_config(args.task, args.preset), args.student)
    if args.data_dir is not None:
        config.data.data_dir = args.data_dir
    configs.apply_overrides(config, args.set)
    if args.no_progress:
        config.progress_bar = False
    student_feature_map(args.student, config.attention_config)
    teacher_dir = args.teacher_workdir or f"workdir/{args.task}_{args.preset}_softmax"
    name = f"{args.task}_{args.preset}_{args.student}"
    if args.command == "run":
        workdir = args.workdir or f"workdir/distill/{name}"
        summary = distill(
            config,
            teacher_workdir=teacher_dir,
            workdir=workdir,
            stage1_steps=args.stage1_steps,
            stage1_lr=args.stage1_lr,
            block_size=args.block_size,
            stage2=not args.no_stage2,
            stage2_lr=args.stage2_lr,
            baselines=args.baselines,
            train_teacher=args.train_teacher,
        )
        print(format_summary(summary), flush=True)
        return summary
    if args.source is None:
        p.error("transfer needs --source (a feature_maps.msgpack written by `run`)")
    workdir = args.workdir or f"workdir/transfer/{name}"
    return kernel_transfer(
        config,
        teacher_workdir=teacher_dir,
        source=args.source,
        own=args.own,
        workdir=workdir,
        stage1_steps=args.stage1_steps,
        stage1_lr=args.stage1_lr,
        block_size=args.block_size,
        finetune=args.finetune,
        train_teacher=args.train_teacher,
    )


def format_summary(summary: Mapping[str, Any]) -> str:
    """What ``python -m train.distill run`` prints at the end."""
    s1 = summary["stage1"]
    metric = "accuracy"

    def m(res):
        return "n/a" if not res or metric not in res else f"{res[metric]:.4f}"

    lines = [
        f"== distillation: {summary['task']} ({summary['preset']}), softmax -> "
        f"{summary['student']} {summary['attention_config']} ==",
        f"teacher val {metric}: {m(summary['teacher_val'])}",
        "student with the teacher's weights, no stage 1: "
        f"{m(summary['student_before_stage1_val'])}",
        f"stage 1 ({s1['steps']} steps): attention KL {s1['initial_kl']:.4f} -> "
        f"{s1['final_kl']:.4f}; val {metric} after stage 1: {m(summary['after_stage1_val'])}",
    ]
    if "stage2" in summary:
        lines.append(
            f"stage 2 ({summary['stage2']['steps']} steps): val {metric} "
            f"{m(summary['stage2']['val'])}, test {m(summary['stage2']['test'])}"
        )
    if "baselines" in summary:
        b = summary["baselines"]
        lines.append(
            f"baselines (same student): teacher weights without stage 1 "
            f"({b['no_stage1']['steps']} steps) {m(b['no_stage1']['val'])}, from scratch "
            f"({b['scratch']['steps']} steps) {m(b['scratch']['val'])}"
        )
    if "recovery" in summary:
        lines.append(f"recovered {100 * summary['recovery']:.1f}% of the teacher's {metric}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
