"""``python -m train.bench_activations``: the attention mechanisms on the q, k, v that real
models produce, at init and after training steps (issues 19 and 13).

Four sections, each a markdown table on stdout (``--out FILE`` also writes them):

``denominators`` (Flexformer, "stable features"). A model with ``flexformer_n`` attention
and its trigonometric features (``features="trig"``, the map this section is about) is built
and trained for ``--steps`` steps on three workloads: the LRA encoder on ListOps mini
(`train.configs.listops`), the ViT mini preset on generated CIFAR-shaped images
(`mock_image_task`; nothing is downloaded) and the byte LM mini preset (the Python standard
library's sources). At init and at the end, the q and k every attention layer
receives on ``--examples`` training examples are captured (`capture`), in float32 and cast to
bfloat16, and the denominators ``den_i = sum_j phi(q_i) . phi~(k_j)`` of the linear
attention (all keys; ``j <= i`` when causal, with the running-max key stabiliser of the core)
are evaluated for ``flexformer_s`` (fresh init), ``flexformer_n`` (the layer's own params),
``flexformer_n`` with the raw map (``qk_radius=None`` and no floor, the seed's form; same
params) and ``performer`` (fresh init, the same feature count 2M), through each mechanism's
`linattn_jax.core.FeatureMap`. Reported (`weight_rows`): the fraction of negative
denominators; the fraction of rows the default relative floor (``den_floor``, see
`linattn_jax.core`) raises, ``|den_i| < den_floor x |phi(q_i)| sum_j |phi(k_j)|``; the
largest l1 norm of a normalised weight row (``sum_j |a_ij| / |den_i|``: 1 for positive
features, the factor by which a row can amplify v) with the floor and without it; for
performer the fraction of tiny denominators (``|den| < 1e-3 x`` the layer's median). Over the
unmasked query rows of every layer, heads and examples, non-causal and causal.

``stability``. The main job (``python -m train``: ListOps mini, 2-layer width-64 encoder)
for ``flexformer_n`` and ``softmax``: the train loss after ``--stability-steps`` steps for
seeds 0, 1, 2 on one device, and for seed 0 on one device, an (8, 1) and a (2, 4) mesh of
fake CPU devices (the command re-executes itself with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` when fewer devices exist). Seeds
change the init key only (``Trainer.init_key``): ListOps mini has no dropout and both
mechanisms are deterministic, so the per-step key is never drawn from.

``laplacian``. Models with ``laplacian`` attention at init: the ListOps mini
encoder, the ViT mini preset and DeiT-tiny (d = 64; generated 224 x 224 images). Per
model: the median L1 distance / d between q_i and k_j (valid pairs); quantiles of the Laplace
kernel entries ``exp(-|q_i - k_j|_1 / lambda)`` at lambda = d / 2 (our init), sqrt(d) and 4
(the paper's); the median entry of ``C_q = kappa(Q, K~)`` at the init lambda; and with the
layer's own landmarks and lambda, for the shared (``A = kappa(K~, K~)``, the default) and the
separate (``A = kappa(Q~, K~)``) landmark matrix: sigma_min and sigma_max of A, the
Newton-Schulz residual ``max |P V_k - I|`` (``P = A + eps I``, valid block) after 10, 20,
30 and 60 steps, and the relative change of the attention output (valid rows) from the
default 30 steps to 90 and from 30 steps to the exact inverse.

``kernels``. The same models' q, k at init: the median L1 distance / d and
squared L2 distance / d over the valid pairs, and the entry quantiles of laplacian's two
kernels at lambda = d / 2: the Laplace ``exp(-|q - k|_1 / lambda)`` and ``kernel="gaussian"``'s
``exp(-|q - k|_2^2 / (sqrt(pi) lambda))`` (`kernel_stats`).

The mechanism internals are read through the public API only: `linattn_jax.get`, each
mechanism's ``feature_map`` (`linattn_jax.core.FeatureMap`), `linattn_jax.landmarks` and
`kernels`. Nothing is cached or written except ``--out``.
"""

from train.bench_activations.common import (
    FAKE_DEVICES,
    MESHES,
    NS_ITERS,
    SECTIONS,
    SEEDS,
    TINY,
    Capture,
    capture,
    example_inputs,
    mock_image_task,
    run_steps,
    train_and_capture,
    workload_config,
    workload_data,
)
from train.bench_activations.denominators import (
    denominator_fractions,
    denominator_rows,
    denominator_section,
    denominators,
    floor_stats,
    weight_rows,
)
from train.bench_activations.laplacian import (
    kernel_stats,
    kernels_section,
    landmark_stats,
    laplacian_model_captures,
    laplacian_section,
    laplacian_stats,
    soft_iteration_change,
)
from train.bench_activations.stability import spread, stability, stability_section

__all__ = [
    "FAKE_DEVICES", "MESHES", "NS_ITERS", "SECTIONS", "SEEDS", "TINY", "Capture", "capture",
    "denominator_fractions", "denominator_rows", "denominator_section", "denominators",
    "floor_stats", "weight_rows",
    "example_inputs", "kernel_stats", "kernels_section", "landmark_stats",
    "laplacian_model_captures", "laplacian_section",
    "laplacian_stats", "mock_image_task", "run_steps", "soft_iteration_change", "spread",
    "stability", "stability_section", "train_and_capture", "workload_config", "workload_data",
]  # fmt: skip
