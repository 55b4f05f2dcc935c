"""The trainer of one config: `TrainState`, the optimiser (schedule, clipping, weight decay,
parameter EMA), and `Trainer` (model, mesh, shardings, jitted train / eval steps).

`train.loop.train_and_evaluate` drives a `Trainer`; distillation and the tests build one
directly. `restore_run` and `eval_variables` read a finished run back (its best checkpoint
and the parameters it evaluates).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, NamedTuple

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from train import checkpoint as ckpt_lib
from train import sharding as shard_lib
from train.models.layers import sequence_parallel_model
from train.schedules import learning_rate_schedule
from train.workloads import get_workload

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- state
@flax.struct.dataclass
class TrainState:
    """``step`` (completed steps), ``params`` (optimised), ``extra`` (other collections,
    e.g. ``fixed``; not optimised), ``opt_state`` (optax)."""

    step: jax.Array
    params: Any
    extra: Any
    opt_state: Any

    def as_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "params": self.params,
            "extra": self.extra,
            "opt_state": self.opt_state,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TrainState:
        return cls(step=d["step"], params=d["params"], extra=d["extra"], opt_state=d["opt_state"])


class ParamEmaState(NamedTuple):
    """State of `param_ema`: the moving average, a tree shaped like the params."""

    ema: Any


def param_ema(decay: float) -> optax.GradientTransformation:
    """Exponential moving average of the parameters, kept in the optimizer state.

    The last link of a chain: ``update(updates, state, params)`` passes the updates through
    unchanged and sets ``ema <- decay * ema + (1 - decay) * (params + updates)``, i.e. the
    average of the parameters *after* each step; ``ema`` starts at the initial params (no
    bias correction, as DeiT / timm's ``ModelEma``). Being optimizer state, it is sharded
    like the params and checkpointed with them. `ema_params` reads it back.
    """
    if not 0.0 < decay < 1.0:
        raise ValueError(f"ema_decay must be in (0, 1), got {decay}")

    def init(params):
        return ParamEmaState(ema=params)

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("param_ema needs the params: call tx.update(grads, state, params)")
        ema = jax.tree.map(
            lambda e, p, u: decay * e + (1.0 - decay) * (p + u), state.ema, params, updates
        )
        return updates, ParamEmaState(ema=ema)

    return optax.GradientTransformation(init, update)


def ema_params(opt_state):
    """The `param_ema` average inside `opt_state`, or None when the chain keeps none."""
    found = [
        s
        for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, ParamEmaState))
        if isinstance(s, ParamEmaState)
    ]
    return found[0].ema if found else None


def _path_names(path) -> list[str]:
    return [str(getattr(p, "key", getattr(p, "name", getattr(p, "idx", "")))) for p in path]


def is_mechanism_param(path) -> bool:
    """Whether the param at `path` (a `jax.tree_util` key path) is an attention mechanism's:
    one component of the path is named ``mechanism`` (where `linattn_jax.linen` keeps the
    learnable params of every mechanism: flexformer frequencies and temperature, rfa's
    sigma, hedgehog's maps, laplacian's lambda and filters, lara's learned proposals)."""
    return "mechanism" in _path_names(path)


def mechanism_mask(params):
    """True on every leaf of `params` that `is_mechanism_param`."""
    return jax.tree_util.tree_map_with_path(lambda path, _: is_mechanism_param(path), params)


def make_optimizer(config) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """adamw(schedule) with LRA's betas, global-norm clipping, per-group settings for the
    attention mechanisms' params and, when ``config.ema_decay > 0``, a parameter EMA
    (`param_ema`).

    Two groups (`mechanism_mask`) after one clipping of the global norm: the mechanisms'
    params (`is_mechanism_param`) get the learning rate times ``config.mechanism_lr_mult``
    and decoupled weight decay ``config.mechanism_weight_decay`` (every leaf, any rank; 0 =
    none); the rest get ``config.learning_rate`` and ``config.weight_decay`` on params with
    ``ndim >= 2`` (kernels, embeddings), except biases and norm scales of any rank (the
    q/k/v projections' biases are ``[heads, head_dim]``) and params named in
    ``config.no_decay_params``. Both share the schedule's shape. This is
    ``optax.multi_transform`` of two adamw's written as one chain (Adam is elementwise, so
    one ``scale_by_adam`` serves both groups; the groups differ in masked decay and a
    masked scale): the optimizer state keeps one leaf tree per moment, shaped and sharded
    like the params (a multi_transform state holds masked placeholders instead).
    """
    schedule = learning_rate_schedule(config)
    no_decay = set(config.get("no_decay_params", ()) or ())
    lr_mult = float(config.get("mechanism_lr_mult", 1.0))
    mech_wd = float(config.get("mechanism_weight_decay", 0.0))
    if not lr_mult > 0:
        raise ValueError(f"mechanism_lr_mult must be > 0, got {lr_mult}")
    if not mech_wd >= 0:
        raise ValueError(f"mechanism_weight_decay must be >= 0, got {mech_wd}")

    def decay_mask(params):
        def keep(path, x):
            names = _path_names(path)
            if is_mechanism_param(path) or no_decay.intersection(names):
                return False
            return names[-1] not in ("bias", "scale") and x.ndim >= 2

        return jax.tree_util.tree_map_with_path(keep, params)

    parts = []
    if config.grad_clip_norm:
        parts.append(optax.clip_by_global_norm(float(config.grad_clip_norm)))
    parts += [
        optax.scale_by_adam(b1=float(config.b1), b2=float(config.b2), eps=float(config.eps)),
        optax.add_decayed_weights(float(config.weight_decay), decay_mask),
        optax.add_decayed_weights(mech_wd, mechanism_mask),
        optax.scale_by_learning_rate(schedule),
        optax.masked(optax.scale(lr_mult), mechanism_mask),
    ]
    if float(config.get("ema_decay", 0.0) or 0.0) > 0.0:
        parts.append(param_ema(float(config.ema_decay)))
    return optax.chain(*parts), schedule


def count_params(tree) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(tree)))


# ----------------------------------------------------------------------------- trainer
class Trainer:
    """Model, optimiser, mesh, shardings and the jitted steps of one config.

    Usable on its own (tests build one and call ``init_state`` / ``train_step``);
    ``train_and_evaluate`` drives it.
    """

    def __init__(self, config, data=None, *, devices=None):
        self.config = config
        self.workload = get_workload(config.task)
        self.data = self.workload.build_data(config) if data is None else data
        self.model = self.workload.build_model(config, self.data)
        self.input_keys = tuple(self.data.input_keys)
        self.example = self._example_batch()
        self.train_keys = tuple(self.example)  # every key of a training batch
        self.eval_keys = (*self.train_keys, "mask")
        self.mesh = shard_lib.make_mesh(config, devices)
        self.rules = shard_lib.rules(config)
        self.tx, self.schedule = make_optimizer(config)
        root = jax.random.key(int(config.seed))
        self.init_key, self.train_key = jax.random.split(root)
        self.batch_sharding = shard_lib.batch_sharding(self.mesh, config)
        self.input_shardings = shard_lib.input_shardings(self.mesh, config, self.example)
        self.replicated = shard_lib.replicated(self.mesh)
        self.init_model = self.model  # init on one example row: never sequence-parallel
        if shard_lib.SEQ_AXIS in self.mesh.axis_names:
            self.model = sequence_parallel_model(
                self.model, self.mesh, shard_lib.data_axes(self.mesh, config)
            )
        self._setup_state()
        self._setup_steps()
        if shard_lib.SEQ_AXIS in self.mesh.axis_names:
            self._check_sequence_parallel()

    # -------------------------------------------------------------- init / shardings
    def _example_batch(self) -> dict[str, np.ndarray]:
        """The first local training batch: fixes the batch keys, shapes and dtypes."""
        it = self.data.train_batches(
            int(self.config.batch_size),
            seed=int(self.config.data_shuffle_seed),
            process_index=jax.process_index(),
            process_count=jax.process_count(),
        )
        return {k: np.asarray(v) for k, v in next(iter(it)).items()}

    def _dummy_inputs(self):
        return [jnp.asarray(self.example[k][:1]) for k in self.input_keys]

    def _init_variables(self, key):
        k_params, k_dropout, k_attn = jax.random.split(key, 3)
        rngs = {"params": k_params, "dropout": k_dropout, "attention": k_attn}
        return self.init_model.init(rngs, *self._dummy_inputs(), deterministic=True)

    def _setup_state(self):
        abstract_vars = jax.eval_shape(self._init_variables, self.init_key)  # boxed
        var_shardings = shard_lib.logical_shardings(abstract_vars, self.mesh, self.rules)
        var_shardings = dict(var_shardings)
        param_shardings = var_shardings.pop("params")
        extra_shardings = var_shardings
        abstract_params = nn.meta.unbox(abstract_vars["params"])
        abstract_opt = jax.eval_shape(self.tx.init, abstract_params)
        opt_shardings = optax.tree_map_params(
            self.tx,
            lambda _, s: s,
            abstract_opt,
            param_shardings,
            transform_non_params=lambda _: self.replicated,
        )
        self.state_shardings = TrainState(
            step=self.replicated,
            params=param_shardings,
            extra=extra_shardings,
            opt_state=opt_shardings,
        )

        def init(key):
            variables = dict(nn.meta.unbox(self._init_variables(key)))
            params = variables.pop("params")
            return TrainState(
                step=jnp.zeros((), jnp.int32),
                params=params,
                extra=variables,
                opt_state=self.tx.init(params),
            )

        self._init = jax.jit(init, out_shardings=self.state_shardings)
        self.abstract_state = jax.eval_shape(init, self.init_key)

    def _check_sequence_parallel(self):
        """Trace the train step on abstract inputs: T (or T + 1 with a CLS token) must
        divide by the size of the mesh axis ``seq``."""
        n = self.mesh.shape[shard_lib.SEQ_AXIS]
        try:
            jax.eval_shape(self._train_step, self.abstract_sharded_state(), self.batch_spec())
        except ValueError as err:
            if "sequence_parallel" not in str(err):
                raise
            shapes = {k: v.shape for k, v in self.example.items()}
            raise ValueError(
                f"mesh axis 'seq' of {n} devices: the attention length (data.seq_len, + 1 "
                f"with a CLS token) must divide by {n} (batch {shapes}): {err}"
            ) from err

    def init_state(self) -> TrainState:
        """A fresh, sharded train state (deterministic in ``config.seed``)."""
        return self._init(self.init_key)

    def abstract_sharded_state(self) -> TrainState:
        """ShapeDtypeStructs with shardings: the restore target."""
        return ckpt_lib.abstract_like(self.abstract_state, self.state_shardings)

    # -------------------------------------------------------------- steps
    def _apply(self, params, extra, batch, *, train: bool, rng=None):
        inputs = [batch[k] for k in self.input_keys]
        rngs = {}
        if rng is not None:
            k_dropout, k_attn = jax.random.split(rng)
            rngs = {"dropout": k_dropout, "attention": k_attn}
        return self.model.apply(
            {"params": params, **extra}, *inputs, deterministic=not train, rngs=rngs
        )

    def _loss_terms(self, outputs, batch):
        weights = batch["mask"].astype(jnp.float32) if "mask" in batch else None
        if weights is None:
            first = batch[self.input_keys[0]]
            weights = jnp.ones(first.shape[:1], jnp.float32)
        return self.workload.loss_fn(outputs, batch, weights, self.config)

    def redraw_fixed(self, extra, step):
        """`extra` with the ``fixed`` collection (performer's and rfa's random features)
        drawn afresh when ``config.redraw_every`` > 0 and `step` (> 0) is a multiple of it;
        else `extra` itself. The draw is the init's distribution from the key
        ``fold_in(init_key, step)``: a function of (seed, step) alone, so a run resumed
        from a checkpoint redraws exactly what the uninterrupted run does. Traceable
        (`step` may be a traced int): the train step calls it first."""
        every = int(self.config.get("redraw_every", 0) or 0)
        if every < 0:
            raise ValueError(f"redraw_every must be >= 0, got {every}")
        if every == 0 or "fixed" not in extra:
            return extra

        def fresh():
            drawn = nn.meta.unbox(self._init_variables(jax.random.fold_in(self.init_key, step)))
            return {**extra, "fixed": drawn["fixed"]}

        due = jnp.logical_and(step > 0, step % every == 0)
        return jax.lax.cond(due, fresh, lambda: dict(extra))

    def _train_step(self, state: TrainState, batch):
        rng = jax.random.fold_in(self.train_key, state.step)
        state = state.replace(extra=self.redraw_fixed(state.extra, state.step))

        def loss_fn(params):
            outputs = self._apply(params, state.extra, batch, train=True, rng=rng)
            terms = self._loss_terms(outputs, batch)
            total, count = terms["loss"]
            return total / jnp.maximum(count, 1.0), terms

        (loss, terms), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {k: s / jnp.maximum(c, 1.0) for k, (s, c) in terms.items()}
        metrics["loss"] = loss
        metrics["grad_norm"] = optax.global_norm(grads)
        metrics["lr"] = jnp.asarray(self.schedule(state.step), jnp.float32)
        new = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        return new, metrics

    def _eval_step(self, params, extra, batch):
        outputs = self._apply(params, extra, batch, train=False)
        terms = self._loss_terms(outputs, batch)
        return {k: jnp.stack([s, c]) for k, (s, c) in terms.items()}

    def _batch_shardings(self, keys):
        return {k: self.input_shardings.get(k, self.batch_sharding) for k in keys}

    def _setup_steps(self):
        self.train_step = jax.jit(
            self._train_step,
            in_shardings=(self.state_shardings, self._batch_shardings(self.train_keys)),
            out_shardings=(self.state_shardings, self.replicated),
            donate_argnums=0,
        )
        self.eval_step = jax.jit(
            self._eval_step,
            in_shardings=(
                self.state_shardings.params,
                self.state_shardings.extra,
                self._batch_shardings(self.eval_keys),
            ),
            out_shardings=self.replicated,
        )

    def batch_spec(self) -> dict[str, jax.ShapeDtypeStruct]:
        """Global shapes/dtypes/shardings of a training batch (the AOT-compile target)."""
        procs = jax.process_count()
        return {
            k: jax.ShapeDtypeStruct(
                (v.shape[0] * procs, *v.shape[1:]), v.dtype, sharding=self.input_shardings[k]
            )
            for k, v in self.example.items()
        }

    def compile_train_step(self):
        """AOT-compile the train step; returns ``(compiled, memory_analysis dict or None)``."""
        lowered = self.train_step.lower(self.abstract_sharded_state(), self.batch_spec())
        compiled = lowered.compile()
        return compiled, memory_analysis_dict(compiled)

    def to_global(self, batch: Mapping[str, np.ndarray], keys=None) -> dict[str, jax.Array]:
        """Local numpy rows of ``keys`` (default: the training keys) -> global sharded arrays."""
        keys = self.train_keys if keys is None else keys
        return shard_lib.global_batch({k: batch[k] for k in keys}, self._batch_shardings(keys))

    # -------------------------------------------------------------- evaluation
    def eval_params(self, state: TrainState):
        """The params evaluation uses: the EMA when ``config.ema_decay > 0``, else the params."""
        ema = ema_params(state.opt_state)
        return state.params if ema is None else ema

    def evaluate(self, state: TrainState, split: str, num_batches: int = -1) -> dict[str, float]:
        """``sum / count`` of every loss term over ``split`` (or its first ``num_batches``),
        with `eval_params` (the parameter EMA when one is kept)."""
        keys = self.eval_keys
        params = self.eval_params(state)
        totals, labels = None, []
        it = self.data.eval_batches(
            split,
            int(self.config.eval_batch_size),
            process_index=jax.process_index(),
            process_count=jax.process_count(),
        )
        for i, batch in enumerate(it):
            if 0 <= num_batches <= i:
                break
            out = self.eval_step(params, state.extra, self.to_global(batch, keys))
            totals = out if totals is None else jax.tree.map(jnp.add, totals, out)
            if "targets" in batch and np.ndim(batch["targets"]) == 1:
                labels.append(np.asarray(batch["targets"])[np.asarray(batch["mask"])])
        if totals is None:
            return {}
        totals = jax.device_get(totals)
        result = {k: float(v[0] / max(v[1], 1.0)) for k, v in totals.items()}
        result["count"] = float(next(iter(totals.values()))[1])
        labels = np.concatenate(labels) if labels else np.zeros((0,), np.int64)
        if labels.size and labels.min() >= 0 and jax.process_count() == 1:
            # accuracy of always predicting the split's most frequent class
            result["majority"] = float(np.bincount(labels).max() / labels.size)
        return result


def memory_analysis_dict(compiled) -> dict[str, int] | None:
    """Byte counts of ``compiled.memory_analysis()`` and an estimated peak (None if absent)."""
    try:
        ma = compiled.memory_analysis()
    except Exception:  # not every backend implements it
        return None
    if ma is None:
        return None
    fields = (
        "argument_size_in_bytes",
        "output_size_in_bytes",
        "alias_size_in_bytes",
        "temp_size_in_bytes",
        "generated_code_size_in_bytes",
    )
    out = {f: int(getattr(ma, f, 0) or 0) for f in fields}
    # live at once: inputs + outputs (minus donated/aliased) + temporaries
    out["estimated_peak_bytes"] = (
        out["argument_size_in_bytes"]
        + out["output_size_in_bytes"]
        - out["alias_size_in_bytes"]
        + out["temp_size_in_bytes"]
    )
    return out


def eval_variables(state) -> dict:
    """``{"params": ..., **extra}`` of a `TrainState`: the params its run evaluates (the
    parameter EMA when the optimizer keeps one, ``config.ema_decay > 0``)."""
    ema = ema_params(state.opt_state)
    return {"params": state.params if ema is None else ema, **state.extra}


def restore_run(config, workdir, *, data=None, prefer: str = "best"):
    """``(trainer, state, meta)`` of the run of `config` in `workdir` (best, else latest).

    Raises:
      FileNotFoundError: `workdir` has no checkpoint (says how to train one).
    """
    trainer = Trainer(config, data)
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
    return trainer, TrainState.from_dict(state_dict), meta


__all__ = [
    "ParamEmaState",
    "TrainState",
    "Trainer",
    "count_params",
    "ema_params",
    "eval_variables",
    "learning_rate_schedule",
    "is_mechanism_param",
    "make_optimizer",
    "memory_analysis_dict",
    "mechanism_mask",
    "param_ema",
    "restore_run",
]
