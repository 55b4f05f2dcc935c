"""Benchmarks of every registered mechanism: ``python -m train.bench <subcommand> [flags]``.

Subcommands (each prints a markdown table, writes JSON with ``--out`` and a PNG with ``--plot``),
one module each:

* ``scaling`` (`scaling`): forward and forward+backward wall time (median of timed calls after
  a warm-up, compiled once ahead of time, ``block_until_ready``) and XLA's compiled memory
  figures (``jit(f).lower(...).compile().memory_analysis()``: temp + argument + output bytes)
  for every mechanism in the registry, plus ``jax.nn.dot_product_attention`` as
  ``softmax_xla``, over a range of T, causal and non-causal where supported; ratios to
  ``softmax`` (and to ``softmax_xla``) measured in the same run; jnp stand-ins of the public
  code (`peers`) beside the mechanisms that have one.
* ``fidelity`` (`fidelity`): relative error ``|out - softmax|_F / |softmax|_F`` of each
  mechanism as its budget (``num_features`` / ``num_landmarks`` / ``num_samples``) grows, on
  Gaussian and on clustered inputs, mean and std over seeds.
* ``kernels``: the Pallas kernels against their XLA references (`kernels.bench`).
* ``model`` (`model`): one training step (AdamW) of a small 2-layer dual encoder shaped like
  LRA Retrieval (two documents of T = 4k bytes, B = 2) per mechanism: step time and memory as
  ratios to softmax.
* ``kernel_fit`` (`kernel_fit`): fits each learnable kernel to a non-stationary target
  attention at an equal feature budget, or (``--target subspace``) to a Gaussian kernel on
  a subspace (kernel recovery).
* ``equivalence`` (`equivalence`): a random-feature mechanism trained beside a stand-in of
  its public algorithm in the same model, config and seeds (curves and accuracies).
* ``official`` (`official`): our LARA beside the official PyTorch code (a checkout given by
  ``--repo``), forward and forward+backward, torch on as many threads as XLA's cores.
* ``performer_jax`` (`performer_jax`): our performer beside the public Performer-JAX (a
  checkout given by ``--repo``), in one process, its projection fixed and redrawn per call.
* ``parallel`` (`parallel`): per-device memory of sequence-parallel attention.
* ``report`` (`summary`): the markdown summary (ratios at one T, crossing points, growth per
  doubling, fidelity and model tables) from the JSON files of the other subcommands.

Timing and memory are measured in one place, `timing`. Everything is read off the registry
(`linattn_jax.names`), so a new mechanism is benchmarked without touching this package. A
point whose compiled memory exceeds ``--memory-budget-gib``, or whose predicted time
(extrapolated from the smaller T of the same series) exceeds ``--time-limit-s``, is compiled
(so its memory is still reported) but not run, with a note. With ``--isolate`` (the default on
the command line) each mechanism runs in its own subprocess under a hard
``--mechanism-timeout-s`` (`isolation`), so a hang or an out-of-memory kill costs one
mechanism's remaining points, not the run.
"""

from train.bench.common import (
    BUDGET_KEYS,
    PASSES,
    SOFTMAX,
    SOFTMAX_XLA,
    attention_callable,
    bench_names,
    budget_keys,
    default_memory_budget_gib,
    environment,
    is_quadratic,
    mechanism_state,
    supports_causal,
)
from train.bench.fidelity import (
    fidelity_configs,
    fidelity_sweep,
    fidelity_table,
    make_inputs,
    plot_fidelity,
    relative_error,
)
from train.bench.isolation import PARENT_ONLY, strip_flags
from train.bench.model import merge_model, model_point, model_table, plot_model, run_model
from train.bench.scaling import (
    ScalingConfig,
    add_ratios,
    merge_scaling,
    plot_scaling,
    predict_seconds,
    run_scaling,
    scaling_points,
    scaling_table,
)
from train.bench.summary import crossing, fitted_exponent, growth_per_doubling, report
from train.bench.timing import measure, memory_figures, time_compiled


def main(argv=None):
    """``python -m train.bench`` in-process: `train.bench.__main__.main`."""
    from train.bench.__main__ import main as cli_main

    return cli_main(argv)


__all__ = [
    "BUDGET_KEYS",
    "PARENT_ONLY",
    "PASSES",
    "SOFTMAX",
    "SOFTMAX_XLA",
    "ScalingConfig",
    "add_ratios",
    "attention_callable",
    "bench_names",
    "budget_keys",
    "crossing",
    "default_memory_budget_gib",
    "environment",
    "fidelity_configs",
    "fidelity_sweep",
    "fidelity_table",
    "fitted_exponent",
    "growth_per_doubling",
    "is_quadratic",
    "main",
    "make_inputs",
    "measure",
    "mechanism_state",
    "memory_figures",
    "merge_model",
    "merge_scaling",
    "model_point",
    "model_table",
    "plot_fidelity",
    "plot_model",
    "plot_scaling",
    "predict_seconds",
    "relative_error",
    "report",
    "run_model",
    "run_scaling",
    "scaling_points",
    "scaling_table",
    "strip_flags",
    "supports_causal",
    "time_compiled",
]
