"""Test configuration: fake CPU devices and strict rank promotion, set before jax imports."""

import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
# The 8 fake devices' in-process all-reduce aborts the process (SIGABRT, no message) when its
# threads reach the rendezvous too slowly, which happens on a loaded 2-core machine: give it
# room (seen in gdb: AwaitAndLogIfStuck in InProcessCommunicator::AllReduce).
if "collective_call_terminate_timeout" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += (
        " --xla_cpu_collective_call_terminate_timeout_seconds=3600"
        " --xla_cpu_collective_call_warn_stuck_timeout_seconds=600"
    )
# XLA's legacy CPU fusion emitters (the suite only; users get XLA's default): they compile
# the suite's small programs 2-3x faster (a flexformer causal gradient 1.09 s -> 0.40 s), and
# compile time is most of the suite's time. test_mechanisms compiles every mechanism's value
# and gradients with XLA's default flags in a fresh process and compares.
if "xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# pyproject's addopts rerun, once, a test whose xdist worker died without a Python error
# (pytest-rerunfailures, `--only-rerun` on xdist's "worker ... crashed while running"): CI
# lost a worker to a native fault inside test_vision's bfloat16 ViT test, which
# passes alone (3 runs) and with its file (1 run) here; the fault's frames were not in the
# log. A test that fails, or crashes twice, still fails; the summary counts every rerun.
# XLA's optimisation passes off for the suite (and the subprocesses its tests start, which
# inherit the variable): at the suite's tiny shapes the cost is compiling, and the properties
# tested (agreement with a reference, gradients, resumption, sharded == one device, where
# both sides compile the same way) do not depend on the optimised program. Measured: the
# causal chunked-vs-quadratic tests 1.6x, the bench model smoke 3x faster on CPU.
# test_mechanisms turns them back on (`optimised_xla`) for every mechanism's forward.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# One persistent compilation cache for the run, shared by the xdist workers and every
# subprocess a test starts (the command-line tests train, kill and resume the same program in
# several processes; a renamed record compiles what the original did): a program compiled
# once is loaded, not compiled again. It is keyed by the program, the XLA flags and the
# compile options, so a test with other options (`optimised_xla`) compiles its own.
# Measured: test_train_cli + test_renamed_records 171 s -> 113 s on 2 cores. The controller
# creates the directory (the workers inherit the variable) and removes it at the end.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="linattn-jax-test-cache-")
    _CACHE_OWNER = os.environ["JAX_COMPILATION_CACHE_DIR"]
else:
    _CACHE_OWNER = None
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.05")
# On a GPU (kernels/gpu_check.sh sets JAX_PLATFORMS=cuda) float32 matmuls default to TF32, whose
# 10-bit mantissa misses the float32 tolerances the tests are keyed to: on an H200 28 of
# the 152 compiled tests failed at the default, and passed at full precision, the setting below
# (27 in the same 4-process run; the 28th alone: docs/performance.md).
# The tests check the algorithms in float32; TF32 is a user's speed-for-precision choice, and
# `JAX_DEFAULT_MATMUL_PRECISION=default` runs the tests at it.
if os.environ["JAX_PLATFORMS"] != "cpu":
    os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")

# Hypothesis: the same examples on every run (CI must not fail by chance);
# HYPOTHESIS_PROFILE=explore draws new ones (and more of them) to look for bugs.
from hypothesis import settings  # noqa: E402

settings.register_profile("repeatable", derandomize=True, database=None, max_examples=10)
settings.register_profile("explore", derandomize=False, max_examples=200)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))


import pytest  # noqa: E402


@pytest.hookimpl(optionalhook=True)  # a plain pytest run (``-p no:xdist``) has no such hook
def pytest_xdist_make_scheduler(config, log):
    """xdist's work-stealing scheduler in place of its default (``-n N`` alone): each worker
    starts on a contiguous half of the tests, so a file's tests mostly share one process and
    the programs it compiled (compiling and lowering are 62% of the suite's test time, many of
    them the per-op programs of eager calls, cached per process), and an idle worker steals
    from the other's queue. On the idle 2-core machine: 14 min 40 s against 15 min 52 s
    (docs/development.md). An explicit ``--dist`` other than ``load`` is kept."""
    if config.getoption("dist") == "load":
        from xdist.scheduler import WorkStealingScheduling

        return WorkStealingScheduling(config, log)
    return None


@pytest.fixture
def optimised_xla(monkeypatch):
    """XLA's optimisation passes on (the suite runs with them off, see the top of this file),
    in this process and in the subprocesses a test starts. Used by test_mechanisms, so every
    mechanism's forward (and its gradients at large norms) is compiled optimised too."""
    before = jax.config.read("jax_disable_most_optimizations")
    monkeypatch.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "0")
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", before)


@pytest.fixture(autouse=True)
def registry_as_before():
    """Each test leaves the mechanism registry as it found it: a test that registers a
    mechanism (a training peer, a renamed copy) must not change `la.names()` for the tests
    that follow it in the same worker (a test iterating over every mechanism would meet it)."""
    from linattn_jax import registry

    before = dict(registry._REGISTRY)
    yield
    registry._REGISTRY.clear()
    registry._REGISTRY.update(before)


def pytest_unconfigure(config):
    """Removes the run's compilation cache (in the process that created it)."""
    if _CACHE_OWNER is not None:
        shutil.rmtree(_CACHE_OWNER, ignore_errors=True)
