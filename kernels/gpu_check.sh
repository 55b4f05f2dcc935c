#!/usr/bin/env bash
# The GPU check: compiled Pallas kernels against their references, then their timings and the
# mechanisms' scaling on the GPU. Run from the repository root on a GPU machine with jax[cuda],
# flax, optax, chex, pytest and ml_collections installed:
#   OUT=/some/dir bash kernels/gpu_check.sh
# Writes pytest_gpu.log, kernels_gpu.md, scaling_gpu.json and causal_{scan,parallel}.json under
# $OUT. PARTS picks the parts (default "tests kernels scaling causal"); each stops at its own
# timeout (*_TIMEOUT_S: 300, 240, 400, 300 s), so on a leased machine with a 10-minute command
# limit run them in two or three calls. Seen on an H200 (jax 0.11.2): the tests take 150 s with 4
# processes, the kernel bench over 110 s (at its 240 s limit its last rows, Newton-Schulz at m = 256,
# were cut), the scaling about 25 s per mechanism and performer's peer stand-in about 100 s, the causal
# part about 130 s per form.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" JAX_PLATFORMS=cuda
# Several test processes share the GPU: no process may take 75% of its memory up front.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
nvidia-smi -L
python3 -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
PARTS=${PARTS:-tests kernels scaling causal}
# The kernels' and the Nystrom mechanisms' tests, compiled (impl="auto" is Pallas on a GPU), with
# float32 matmuls at full precision (tests/conftest.py: the GPU default, TF32, misses the tests'
# float32 tolerances; JAX_DEFAULT_MATMUL_PRECISION=default runs them at TF32).
PYTEST=(timeout "${PYTEST_TIMEOUT_S:-300}" python3 -m pytest -rf -o "addopts=-m 'not slow'"
  -o cache_dir=/tmp/gpu_check_pytest_cache -n 4
  tests/test_kernels.py tests/test_l1_distance.py tests/test_newton_schulz.py tests/test_nystrom_core.py
  tests/test_laplacian.py tests/test_soft.py tests/test_nystromformer.py tests/test_landmarks.py)
[[ " $PARTS " == *" tests "* ]] && "${PYTEST[@]}" -v --tb=short 2>&1 | tee "$OUT/pytest_gpu.log" \
  | grep -E "FAILED|ERROR|passed|failed" | tail -60
# Kernel timings at the design card's sizes (`python -m kernels.bench`'s GPU defaults); the bench
# prints each group's table as soon as it is timed, so that a run cut short keeps what it timed.
[[ " $PARTS " == *" kernels "* ]] && timeout "${KERNELS_TIMEOUT_S:-240}" python3 -m kernels.bench 2>&1 \
  | tee "$OUT/kernels_gpu.md"
# Mechanisms' time and memory against softmax on the GPU.
MECHANISMS=${MECHANISMS:-softmax performer flexformer_s flexformer_n laplacian lara hedgehog nystromformer}
SCALING=(python3 -m train.bench scaling --seq-lens ${SEQ_LENS:-1024 4096 16384} --passes fwd fwd_bwd
  --repeats 10 --min-total-s 0.3 --time-limit-s 5 --mechanism-timeout-s 90)
[[ " $PARTS " == *" scaling "* ]] && timeout "${SCALING_TIMEOUT_S:-400}" "${SCALING[@]}" \
  --mechanisms $MECHANISMS --modes noncausal causal --out "$OUT/scaling_gpu.json" 2>&1 | tail -60
# The two causal forms (`linattn_jax.core.causal.CAUSAL_FORM`; "auto", above, is the parallel
# one on a GPU), causal attention only, each against softmax in its own run (not performer by
# default: its peer stand-in alone takes about 100 s).
for FORM in scan parallel; do
  [[ " $PARTS " == *" causal "* ]] && LINATTN_CAUSAL_FORM=$FORM timeout "${CAUSAL_TIMEOUT_S:-300}" \
    "${SCALING[@]}" --mechanisms ${CAUSAL_MECHANISMS:-softmax rfa flexformer_n} \
    --modes causal --out "$OUT/causal_$FORM.json" 2>&1 | tail -30
done
