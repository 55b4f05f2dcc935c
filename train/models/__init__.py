"""The training models, all stacks of one pre-LN `layers.Block` over
`linattn_jax.linen.MultiHeadAttention`:

- `layers`: ``dense``, ``layer_norm``, ``Mlp``, ``drop_path``, ``Block`` and config helpers;
- `lra`: the LRA encoder, classifier and dual encoder (``build_classifier``);
- `vit`: ViT / DeiT (``build_vit``);
- `lm`: the causal byte LM (``build_lm``).

``from train.models import X`` works for every public name of the submodules (and the names
the single-file ``train/models.py`` exported before: ``EncoderBlock`` and ``MlpBlock`` are
``Block`` and ``Mlp``).
"""

from .layers import (
    Block,
    Mlp,
    attention_config_pairs,
    compute_dtype,
    dense,
    drop_path,
    embedding,
    layer_norm,
    learned_positions,
    prepend_cls,
    sinusoidal_positions,
)
from .lm import CausalLM, build_lm
from .lra import (
    POOLINGS,
    POS_EMBS,
    ClassifierHead,
    DualEncoderClassifier,
    Encoder,
    EncoderClassifier,
    build_classifier,
    build_encoder,
)
from .vit import ViT, build_vit

EncoderBlock = Block  # the LRA block's name before the blocks were merged (same params)
MlpBlock = Mlp  # the MLP's name before the merge

__all__ = [
    "POOLINGS",
    "POS_EMBS",
    "Block",
    "CausalLM",
    "ClassifierHead",
    "DualEncoderClassifier",
    "Encoder",
    "EncoderBlock",
    "EncoderClassifier",
    "Mlp",
    "MlpBlock",
    "ViT",
    "attention_config_pairs",
    "build_classifier",
    "build_encoder",
    "build_lm",
    "build_vit",
    "compute_dtype",
    "dense",
    "drop_path",
    "embedding",
    "layer_norm",
    "learned_positions",
    "prepend_cls",
    "sinusoidal_positions",
]
