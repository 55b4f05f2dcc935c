"""Training stack for linattn_jax: LRA data (``train.data``), models, the loop, checkpoints.

Submodules are imported on demand; importing ``train`` itself pulls in nothing heavy.
"""
