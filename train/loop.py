"""The training loop: ``train_and_evaluate(config, workdir) -> summary``.

What one run does (everything driven by an ``ml_collections`` config, see
``train/configs/default.py``):

1. Mesh from ``config.mesh_shape``/``mesh_axes``; the workload (``WORKLOADS[config.task]``)
   builds its data and its Flax Linen model.
2. Init via ``jax.eval_shape`` -> logical partition specs -> ``NamedSharding`` ->
   ``jax.jit(init, out_shardings=...)``: parameters and Adam moments are created already
   sharded (FSDP over ``fsdp`` via the logical-axis rules).
3. Resume from the newest checkpoint that restores (``train.checkpoint``): same step,
   same data position (the data stream is a pure function of ``(seed, batch, step)``) and
   same randomness (the step rng is ``fold_in(key, step)``, never carried state).
4. The step, ``jax.jit(train_step, in_shardings, out_shardings, donate_argnums=0)``,
   compiled ahead of time once to log its memory analysis; batches are global arrays
   split over the data axes.
5. Eval every ``eval_every`` steps (val split), best-checkpoint tracking, checkpoints every
   ``checkpoint_every`` steps, JSONL + TensorBoard + tqdm, a PNG of the curves at the end,
   and a summary (also ``workdir/summary.json``).

Adding a task or model
----------------------
A workload is three functions; add them to the table in ``train/workloads.py`` and give
it a config::

    def build_data(config):            # -> object with the train.data.Task batch API:
        ...                            #    train_batches(B, seed=, start_step=, num_threads=,
                                       #      process_index=, process_count=, and prefetch=
                                       #      when num_threads > 0) -> iter of dicts (the
                                       #      first batch fixes the keys/shapes/dtypes),
                                       #    eval_batches(split, B, process_index=,
                                       #      process_count=) -> iter of dicts with "mask" [B],
                                       #    input_keys (batch keys fed to the model, in order),
                                       #    splits (mapping with at least "train", "val")
    def build_model(config, data):     # -> flax.linen Module, called as
        ...                            #    model(*[batch[k] for k in data.input_keys],
                                       #          deterministic=bool) -> outputs
    def loss_fn(outputs, batch, weights, config):  # weights: float [B], 0 on eval padding
        return {"loss": (sum, count), "accuracy": (sum, count), ...}

    WORKLOADS = {..., "my_task": Workload(build_data, build_model, loss_fn)}  # workloads.py
    # config: start from train.configs.default.get_config(), set config.task = "my_task"
    # (and add a module to train.configs.CONFIGS to get `python -m train --task my_task`).

The optimiser minimises ``sum / count`` of ``"loss"``; every entry is reported as
``sum / count`` for training (per step) and evaluation (over the split). Variable
collections other than ``params`` (e.g. ``fixed`` random features, a distillation
teacher) are carried in ``TrainState.extra``: sharded, checkpointed, not optimised. The
model gets rng streams ``dropout`` and ``attention`` (``fold_in(key, step)`` split), and
``best_metric``/``best_mode`` in the config choose what ranks the best checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import resource
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from train import checkpoint as ckpt_lib
from train import metrics as metrics_lib
from train import sharding as shard_lib
from train.losses import classification_loss  # re-exported for old callers
from train.workloads import LRA_WORKLOAD, WORKLOADS, Workload, get_workload

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


def learning_rate_schedule(config) -> optax.Schedule:
    """Linear warmup to ``learning_rate`` then ``rsqrt`` (LRA), ``cosine`` or ``constant``.

    rsqrt: ``lr * min(1, s / w) * sqrt(w / max(s, w))`` (LRA's ``linear_warmup *
    rsqrt_decay`` with its constant folded into the peak).
    """
    peak = float(config.learning_rate)
    warmup = int(config.warmup_steps)
    total = int(config.num_train_steps)
    kind = config.schedule
    if kind == "cosine":
        return optax.warmup_cosine_decay_schedule(
            0.0,
            peak,
            warmup_steps=warmup,
            decay_steps=max(total, warmup + 1),
            end_value=peak * float(config.end_lr_fraction),
        )
    if kind not in ("rsqrt", "constant"):
        raise ValueError(f"schedule must be 'rsqrt', 'cosine' or 'constant', got {kind!r}")

    def schedule(step):
        s = jnp.asarray(step, jnp.float32)
        ramp = jnp.minimum(1.0, s / warmup) if warmup > 0 else 1.0
        if kind == "constant" or warmup == 0:
            return peak * ramp
        return peak * ramp * jnp.sqrt(warmup / jnp.maximum(s, warmup))

    return schedule


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


def make_optimizer(config) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """adamw(schedule) with LRA's betas, global-norm clipping, a weight-decay mask and, when
    ``config.ema_decay > 0``, a parameter EMA (`param_ema`).

    Decayed: params with ``ndim >= 2`` (kernels, embeddings), except biases and norm scales
    of any rank (the q/k/v projections' biases are ``[heads, head_dim]``), attention-mechanism
    params (unless ``config.decay_mechanism_params``) and params named in
    ``config.no_decay_params``.
    """
    schedule = learning_rate_schedule(config)
    no_decay = set(config.get("no_decay_params", ()) or ())

    def decay_mask(params):
        def keep(path, x):
            names = [getattr(p, "key", getattr(p, "name", "")) for p in path]
            if "mechanism" in names and not config.decay_mechanism_params:
                return False
            if no_decay.intersection(names) or names[-1] in ("bias", "scale"):
                return False
            return x.ndim >= 2

        return jax.tree_util.tree_map_with_path(keep, params)

    parts = []
    if config.grad_clip_norm:
        parts.append(optax.clip_by_global_norm(float(config.grad_clip_norm)))
    parts.append(
        optax.adamw(
            schedule,
            b1=float(config.b1),
            b2=float(config.b2),
            eps=float(config.eps),
            weight_decay=float(config.weight_decay),
            mask=decay_mask,
        )
    )
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
        self.replicated = shard_lib.replicated(self.mesh)
        self._setup_state()
        self._setup_steps()

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
        return self.model.init(rngs, *self._dummy_inputs(), deterministic=True)

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

    def _train_step(self, state: TrainState, batch):
        rng = jax.random.fold_in(self.train_key, state.step)

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
        return {k: self.batch_sharding for k in keys}

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
                (v.shape[0] * procs, *v.shape[1:]), v.dtype, sharding=self.batch_sharding
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
        return shard_lib.global_batch({k: batch[k] for k in keys}, self.batch_sharding)

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


def _device_peak_bytes() -> int | None:
    stats = []
    for d in jax.local_devices():
        try:
            s = d.memory_stats()
        except Exception:
            s = None
        if s and "peak_bytes_in_use" in s:
            stats.append(int(s["peak_bytes_in_use"]))
    return max(stats) if stats else None


def _maxrss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def maybe_initialize_distributed(config) -> None:
    """``jax.distributed.initialize`` when ``config.distributed`` or ``$LINATTN_DISTRIBUTED=1``.

    ``config.coordinator_address`` / ``num_processes`` / ``process_id`` are passed when set
    (None: detected from the cluster environment). CPU processes exchange collectives with
    gloo (how the multi-process test runs; accelerators use their own). Never called for an
    ordinary single-process run; must run before anything touches a jax device.
    """
    if not (config.distributed or os.environ.get("LINATTN_DISTRIBUTED") == "1"):
        return
    if jax.config.jax_cpu_collectives_implementation is None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=config.get("coordinator_address"),
        num_processes=config.get("num_processes"),
        process_id=config.get("process_id"),
    )


# ----------------------------------------------------------------------------- the loop
def train_and_evaluate(config, workdir: str | os.PathLike, *, data=None) -> dict[str, Any]:
    """Train ``config`` in ``workdir`` (resuming from its checkpoints); returns the summary.

    ``data``: an already built data object (tests); default ``workload.build_data(config)``.
    """
    workdir = Path(workdir).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    is_main = jax.process_index() == 0
    t_start = time.time()
    trainer = Trainer(config, data)
    if is_main:
        (workdir / "config.json").write_text(config.to_json_best_effort(indent=2) + "\n")
    num_steps = int(config.num_train_steps)
    bs = int(config.batch_size)

    with contextlib.ExitStack() as stack:
        ckpt = ckpt_lib.Checkpointer(
            workdir,
            max_to_keep=int(config.max_to_keep),
            async_save=bool(config.async_checkpointing),
            best_metric=str(config.get("best_metric", "accuracy")),
            best_mode=str(config.get("best_mode", "max")),
        )
        stack.callback(ckpt.close)
        best_metric = ckpt.best_metric
        better = (lambda a, b: a > b) if ckpt.best_mode == "max" else (lambda a, b: a < b)

        restored = ckpt.restore_latest(trainer.abstract_sharded_state().as_dict())
        if restored is None:
            state = trainer.init_state()
            meta = {"best": None, "best_step": None}
            start = 0
        else:
            state_dict, meta = restored
            state = TrainState.from_dict(state_dict)
            start = int(jax.device_get(state.step))
            if meta.get("batch_size") not in (None, bs) or meta.get("data_shuffle_seed") not in (
                None,
                int(config.data_shuffle_seed),
            ):
                log.warning("resuming with a different batch size / data seed: the stream differs")
        n_params = count_params(state.params)
        n_extra = count_params(state.extra)

        train_keys = trainer.train_keys
        mem = None
        step_fn = trainer.train_step
        if config.compile_memory_analysis and start < num_steps:
            step_fn, mem = trainer.compile_train_step()

        writer = metrics_lib.MetricsWriter(
            workdir, enabled=is_main, tensorboard=config.tensorboard, resume_step=start
        )
        stack.callback(writer.close)
        progress = metrics_lib.Progress(
            num_steps,
            start,
            enabled=is_main and bool(config.progress_bar),
            desc=f"{config.task}/{config.attention}",
        )
        if is_main:
            progress.write(
                f"{config.task} ({config.preset}) with {config.attention}: {n_params:,} params "
                f"(+{n_extra:,} fixed), mesh {dict(trainer.mesh.shape)}, devices "
                f"{jax.device_count()} x {jax.devices()[0].platform}, "
                f"{'resuming at step ' + str(start) if start else 'from scratch'}"
            )
            if mem:
                progress.write(
                    "compiled train step memory: "
                    + ", ".join(f"{k}={v / 2**20:.1f}MiB" for k, v in mem.items())
                )

        def meta_now(step):
            return {
                "step": int(step),
                "batch_size": bs,
                "data_shuffle_seed": int(config.data_shuffle_seed),
                "seed": int(config.seed),
                "best": meta.get("best"),
                "best_step": meta.get("best_step"),
            }

        threads = int(config.data.get("num_threads", 0))
        batches = trainer.data.train_batches(
            bs,
            seed=int(config.data_shuffle_seed),
            start_step=start,
            num_threads=threads,
            **({"prefetch": max(2, threads)} if threads else {}),  # grain: prefetch >= threads
            process_index=jax.process_index(),
            process_count=jax.process_count(),
        )
        window: list[dict[str, jax.Array]] = []
        last_train: dict[str, float] = {}
        last_eval: dict[str, float] = {}
        timed_steps, timed_seconds, t_mark = 0, 0.0, None
        step = start
        try:
            while step < num_steps:
                batch = trainer.to_global(next(batches), train_keys)
                state, m = step_fn(state, batch)
                step += 1
                window.append(m)
                if step == start + 1:
                    jax.block_until_ready(m)  # the first step includes compilation/warm-up
                    t_mark = time.time()
                log_now = step % int(config.log_every) == 0 or step == num_steps
                eval_now = step % int(config.eval_every) == 0 or step == num_steps
                ckpt_now = step % int(config.checkpoint_every) == 0 or step == num_steps
                if log_now or eval_now or ckpt_now:
                    host = jax.device_get(window)
                    last_train = {k: float(np.mean([w[k] for w in host])) for k in host[0]}
                    window = []
                    if t_mark is not None and step > start + 1:
                        now = time.time()
                        timed_seconds += now - t_mark
                        timed_steps = step - start - 1
                        t_mark = now
                    last_train["steps_per_sec"] = (
                        timed_steps / timed_seconds if timed_seconds else 0.0
                    )
                    if log_now:
                        writer.write(step, "train", last_train)
                progress.update(
                    1, **{k: last_train[k] for k in ("loss", "accuracy") if k in last_train}
                )
                if eval_now:
                    last_eval = trainer.evaluate(state, "val", int(config.num_eval_batches))
                    writer.write(step, "val", last_eval)
                    value = last_eval.get(best_metric)
                    if value is not None and (
                        meta.get("best") is None or better(value, meta["best"])
                    ):
                        meta["best"], meta["best_step"] = float(value), step
                        ckpt.save_best(step, state.as_dict(), meta_now(step), last_eval)
                    if is_main:
                        progress.write(
                            f"step {step}: val "
                            + ", ".join(
                                f"{k}={v:.4f}" for k, v in last_eval.items() if k != "count"
                            )
                            + f" (best {best_metric}={meta['best']} at {meta['best_step']})"
                        )
                    if t_mark is not None:
                        t_mark = time.time()  # eval time is not training time
                if ckpt_now:
                    ckpt.save(step, state.as_dict(), meta_now(step))
                    if t_mark is not None:
                        t_mark = time.time()
            ckpt.wait()
        finally:
            progress.close()

        final = {"val": last_eval} if last_eval else {}
        if start >= num_steps:  # nothing left to train: evaluate the restored state
            final["val"] = trainer.evaluate(state, "val", int(config.num_eval_batches))
        splits = getattr(trainer.data, "splits", {})
        if config.eval_test and "test" in splits:
            final["test"] = trainer.evaluate(state, "test", -1)
            writer.write(step, "test", final["test"])
        writer.flush()

    summary = {
        "task": config.task,
        "preset": config.preset,
        "attention": config.attention,
        "steps": int(step),
        "resumed_from": int(start),
        "params": n_params,
        "fixed_params": n_extra,
        "train": last_train,
        "val": final.get("val", {}),
        "test": final.get("test", {}),
        "best": {"metric": best_metric, "value": meta.get("best"), "step": meta.get("best_step")},
        "steps_per_sec": last_train.get("steps_per_sec"),
        "wall_seconds": time.time() - t_start,
        "memory": {
            "compiled_train_step": mem,
            "device_peak_bytes": _device_peak_bytes(),
            "host_maxrss_bytes": _maxrss_bytes(),
        },
        "devices": f"{jax.device_count()} x {jax.devices()[0].platform}",
        "mesh": {k: int(v) for k, v in trainer.mesh.shape.items()},
        "workdir": str(workdir),
    }
    previous = workdir / "summary.json"
    if not last_train and previous.exists():
        # Nothing trained in this call (the run was complete): keep the speed and memory
        # that the training call measured.
        try:
            before = json.loads(previous.read_text())
            summary["steps_per_sec"] = before.get("steps_per_sec")
            summary["memory"]["compiled_train_step"] = (before.get("memory") or {}).get(
                "compiled_train_step"
            )
        except (OSError, ValueError):
            pass
    if is_main:
        if config.plot and (workdir / "metrics.jsonl").exists():
            try:
                metrics_lib.plot_curves(
                    workdir / "metrics.jsonl",
                    workdir / "curves.png",
                    title=f"{config.task} / {config.attention}",
                )
                summary["plot"] = str(workdir / "curves.png")
            except Exception as e:  # a plot must never lose a finished run
                log.warning("plotting failed: %s", e)
        (workdir / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return summary


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


def format_summary(summary: Mapping[str, Any]) -> str:
    """A human-readable summary (what ``python -m train`` prints at the end)."""

    def pct(x):
        return "n/a" if x is None else f"{100 * x:.2f}%"

    val, test = summary.get("val", {}), summary.get("test", {})
    lines = [
        f"== {summary['task']} ({summary['preset']}) / attention={summary['attention']} ==",
        f"steps: {summary['steps']}"
        + (f" (resumed from {summary['resumed_from']})" if summary["resumed_from"] else "")
        + f", params: {summary['params']:,} trainable + {summary['fixed_params']:,} fixed",
    ]
    if summary["train"]:
        lines.append(
            f"train (last window): loss {summary['train'].get('loss', float('nan')):.4f}, "
            f"accuracy {pct(summary['train'].get('accuracy'))}"
        )
    else:
        lines.append("train: nothing left to train (the run was already complete)")
    for name, res in (("val", val), ("test", test)):
        if res:
            lines.append(
                f"{name}: accuracy {pct(res.get('accuracy'))} vs majority-class baseline "
                f"{pct(res.get('majority'))} (loss {res.get('loss', float('nan')):.4f}, "
                f"{int(res.get('count', 0))} examples)"
            )
    best = summary.get("best", {})
    if best.get("value") is not None:
        lines.append(f"best val {best['metric']}: {best['value']:.4f} at step {best['step']}")
    sps = summary.get("steps_per_sec")
    lines.append(
        f"speed: {sps:.2f} steps/s (excluding compilation and eval), wall "
        f"{summary['wall_seconds']:.1f}s on {summary['devices']}, mesh {summary['mesh']}"
        if sps
        else f"wall {summary['wall_seconds']:.1f}s on {summary['devices']}"
    )
    mem = summary.get("memory", {})
    parts = []
    if mem.get("device_peak_bytes"):
        parts.append(f"device peak {mem['device_peak_bytes'] / 2**20:.1f} MiB (memory_stats)")
    if mem.get("compiled_train_step"):
        parts.append(
            f"train step {mem['compiled_train_step']['estimated_peak_bytes'] / 2**20:.1f} MiB "
            "(compiled memory_analysis: args + outputs - aliased + temps)"
        )
    parts.append(f"host max RSS {mem.get('host_maxrss_bytes', 0) / 2**20:.0f} MiB (getrusage)")
    lines.append("memory: " + "; ".join(parts))
    lines.append(
        f"workdir: {summary['workdir']}"
        + (f", plot {summary['plot']}" if summary.get("plot") else "")
    )
    return "\n".join(lines)


__all__ = [
    "LRA_WORKLOAD",
    "WORKLOADS",
    "ParamEmaState",
    "Trainer",
    "TrainState",
    "Workload",
    "classification_loss",
    "ema_params",
    "eval_variables",
    "format_summary",
    "get_workload",
    "restore_run",
    "learning_rate_schedule",
    "make_optimizer",
    "maybe_initialize_distributed",
    "param_ema",
    "train_and_evaluate",
]
