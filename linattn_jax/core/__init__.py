"""The shared linear-attention core.

Every feature-map mechanism computes, per head,

    out_i = phi(q_i)^T S / phi(q_i)^T z,   S = sum_j phi(k_j) v_j^T,  z = sum_j phi(k_j)

with the sums over unmasked keys (and j <= i when causal). Feature maps give
``phi_q: [B, Tq, H, M]`` and ``phi_k: [B, Tk, H, M]``; this module turns them
into ``[B, Tq, H, Dv]`` outputs:

* `linear_attention`: non-causal as two einsums, causal as chunked prefix sums
  (quadratic inside a chunk, the chunk states carried across chunks by a `lax.scan`, or
  on accelerators by a parallel prefix: `core.causal.CAUSAL_FORM`),
  with an optional per-token decay (the gated recurrence of RFA).
* `quadratic_reference`: the naive masked quadratic form of the same features,
  ``(phi(Q) phi(K)^T * tril) V / rowsum``: the oracle the fast paths are
  tested against.

Accumulation is float32 whatever the input dtype. Denominators are guarded by
`guard_denominator`, so a query whose keys are all masked returns zeros.

Relative denominator floor (``den_floor = gamma > 0``). Features that can be negative
(trigonometric random features) give denominators that can cancel to near zero while the
terms they sum are not small: the normalised weights of such a row have an l1 norm far
above 1 and the output is a large multiple of v. Given the key-mass channel (the last
feature column: 0 for queries and ``|phi(k_j)|`` for keys, `mass_channel`), every path
also accumulates ``m_i = |phi(q_i)| sum_j w_ij |phi(k_j)|`` (same weights w_ij: mask,
causality, decay, key scale), which bounds ``|den_i| <= m_i`` (Cauchy-Schwarz), and
raises ``|den_i|`` to at least ``gamma m_i`` keeping its sign. The l1 norm of every
normalised weight row is then at most ``1 / gamma``; rows with ``|den_i| >= gamma m_i`` are
unchanged bit for bit. The fused passes of a token-wise map whose floor is its config's
``den_floor`` ask it for its features without the channel and take ``|phi(k_j)|`` from
them (`key_mass`): the same values, without a concatenated copy of the features.

Layout: `linattn_jax.core.common` (the guard, the floor, masks, `read_out`),
`linattn_jax.core.linear` (`linear_attention`, `quadratic_reference`, `attend`,
`attend_features`, `normalized_weights`), `linattn_jax.core.causal` (the chunked causal
form and its in-scan variant), `linattn_jax.core.recurrent` (`RecurrentState`,
`recurrent_step`, `block_state`, `combine_states`) and `linattn_jax.core.features` (the
feature-map protocol, `sincos`, `cos_sin`, `scale_inputs`). The names a mechanism or a user
calls are re-exported here; the pieces the fast paths share among themselves and with
`linattn_jax.parallel` (the fused passes and their block states, `chunking`, the mask and
floor helpers) are public in their submodule.
"""

from linattn_jax.core.causal import causal_form, causal_linear_attention_from
from linattn_jax.core.common import (
    DENOMINATOR_EPS,
    denominator_floor,
    divide_rows,
    guard_denominator,
    heads_last,
    key_mask,
    key_mass,
    masked_max,
    mass_channel,
    read_out,
    rowdot,
    scale_rows,
)
from linattn_jax.core.features import (
    REDRAW,
    FeatureMap,
    KeyFeatures,
    check_redraw,
    cos_sin,
    redraws,
    scale_inputs,
    sincos,
)
from linattn_jax.core.linear import (
    attend,
    attend_features,
    linear_attention,
    normalized_weights,
    quadratic_reference,
)
from linattn_jax.core.recurrent import (
    RecurrentState,
    block_state,
    combine_states,
    recurrent_init,
    recurrent_step,
)

__all__ = [
    "DENOMINATOR_EPS",
    "REDRAW",
    "FeatureMap",
    "KeyFeatures",
    "RecurrentState",
    "attend_features",
    "block_state",
    "causal_form",
    "causal_linear_attention_from",
    "combine_states",
    "recurrent_init",
    "recurrent_step",
    "guard_denominator",
    "key_mass",
    "mass_channel",
    "denominator_floor",
    "read_out",
    "rowdot",
    "divide_rows",
    "scale_rows",
    "heads_last",
    "masked_max",
    "key_mask",
    "linear_attention",
    "quadratic_reference",
    "attend",
    "normalized_weights",
    "scale_inputs",
    "sincos",
    "cos_sin",
    "check_redraw",
    "redraws",
]
