"""Distilling a trained softmax transformer into linear attention, and kernel transfer:
``python -m train.distill run|transfer [flags]``.

Hedgehog-style two stages (Zhang et al. 2024; the Flexformer seed's distillation study):

1. **Attention matching** (`stages.distill_attention`). The student is the teacher's
   architecture with a feature-map mechanism (every mechanism whose
   ``la.get(name).feature_map`` is not None: flexformer_n, flexformer_s, hedgehog, performer,
   rfa, linear_elu, and any new one without edits), initialised from the teacher's weights.
   Only the feature-map parameters are trained, layer by layer and head by head on the
   *teacher's* queries and keys (`capture`), to minimise the attention KL (`losses`).
2. **Fine-tuning.** The whole student is trained on the task (the training loop, starting
   from the distilled parameters; `states.seed_checkpoint`).

Kernel transfer (`stages.kernel_transfer`): feature maps distilled on task A are copied into
the student of task B (same number of layers, heads and head size) and compared with B's own
distilled maps and with the untrained maps: attention-matching loss on B and B's task metric.

Modules: `losses` (feature map, KL), `capture` (queries and keys of every attention call),
`params` (parameter trees, transplant, feature-map files), `states` (teacher and student
train states, checkpoints, batches), `stages` (the runs), ``__main__`` (the command line).
"""

from train.distill.capture import AttentionCall, capture_attention
from train.distill.losses import (
    WEIGHT_FLOOR,
    attention_kl,
    distillable_names,
    matching_loss,
    student_feature_map,
)
from train.distill.params import (
    attention_paths,
    load_feature_maps,
    mechanism_params,
    save_feature_maps,
    trainable_mechanism_params,
    transplant,
    with_mechanism_params,
)
from train.distill.stages import (
    Stage1Result,
    distill,
    distill_attention,
    format_summary,
    kernel_transfer,
)
from train.distill.states import (
    check_maps_fit,
    eval_inputs,
    init_student,
    input_batches,
    seed_checkpoint,
    student_config,
    teacher_config,
    with_distilled,
)


def main(argv=None) -> dict:
    """``python -m train.distill`` in-process: `train.distill.__main__.main`."""
    from train.distill.__main__ import main as cli_main

    return cli_main(argv)


__all__ = [
    "WEIGHT_FLOOR",
    "AttentionCall",
    "Stage1Result",
    "attention_kl",
    "attention_paths",
    "capture_attention",
    "check_maps_fit",
    "distill",
    "distill_attention",
    "distillable_names",
    "eval_inputs",
    "format_summary",
    "init_student",
    "input_batches",
    "kernel_transfer",
    "load_feature_maps",
    "main",
    "matching_loss",
    "mechanism_params",
    "save_feature_maps",
    "seed_checkpoint",
    "student_config",
    "student_feature_map",
    "teacher_config",
    "trainable_mechanism_params",
    "transplant",
    "with_distilled",
    "with_mechanism_params",
]
