"""Sequence parallelism: attention over sequences sharded along T on a mesh axis.

    attend = la.parallel.sequence_parallel(la.get("performer"), mesh, axis="seq")
    out = attend(q, k, v, params, rng, causal=True)    # q, k, v sharded [B, T/seq, H, D]

`sequence_parallel` returns a function with the signature of ``mechanism.attention`` whose
q, k, v (and mask) are split along T over the mesh axis `axis` (the batch over the other
mesh axes, or as `batch_axes` says), built with `jax.shard_map`. No device ever holds a
T-long tensor of another device:

* **Feature-map mechanisms** (``mechanism.feature_map``, SPEC section 7): each device maps
  its own queries and keys. Non-causal: the key states ``S = sum_j phi(k_j) v_j^T`` and
  ``z = sum_j phi(k_j)`` are summed over the axis (``psum``), under the key log-scales'
  global maximum (``pmax``). Causal: each device summarises its keys as a
  `linattn_jax.core.block_state`, the summaries (``[B, H, M, Dv]`` each) are gathered, and
  every device folds those of the devices before it (`linattn_jax.core.combine_states`:
  decays such as rfa's gate and the key log-scales of performer and flexformer carried
  exactly) into the initial state of its own chunked causal pass. For a token-wise map
  (``FeatureMap.token_wise``: all of the registered ones) both computations take their
  features chunk by chunk inside a scan, as one device's causal call does: the summary
  is a scan of chunk states folded by `combine_states` (the backward pass recomputes each
  chunk's features), and the causal pass (`core.causal.causal_fused`) starts from the
  gathered prefix. No device then holds its ``[B, T/n, H, M]`` features in the forward
  pass; per-device memory, forward and forward+backward, is about 1/n of one device's
  (docs/performance.md). Other maps map the device's block whole.
* **The Nystrom family** (nystromformer, soft, laplacian; non-causal): each device sums its
  tokens into the landmark segments of the whole sequence
  (`linattn_jax.landmarks.sharded_landmarks`: the same segments as the one-device call,
  also where a device boundary splits a segment or a padding mask moves them) and the
  ``[B, m, H, D]`` sums and ``[B, m]`` counts are summed over the axis; every device then
  builds the same ``m x m`` matrix and inverse. The key-side products ``C_k V`` (``[B, H,
  m, Dv]``) and ``C_k 1``, nystromformer's key softmax (its max and normaliser) and
  laplacian's whitening statistics (mean, then variance, over the valid queries of the
  sequence; the second moment for ``normalize="uncentered"``) are summed over the axis;
  laplacian's 1-D local branch takes its window's
  ``(w - 1) / 2`` edge rows from the neighbouring devices (``ppermute``), so each device
  must hold at least that many tokens. ``grid`` (2-D landmarks and local branch) is not
  supported (`NotImplementedError`): image sequences are short.
* **LARA** (non-causal; `linattn_jax.lara.lara_sharded`): the query and key landmarks
  come from the same segment sums (``grid`` included), so every device builds the same
  proposals; the draws are `lara.lara_noise` of `rng` for the whole batch, made
  once and split by batch rows, i.e. the one-device call's draws. The key softmax of each
  sample (its max, normaliser and ``[B, H, N, Dv]`` values f) and the query softmax r of
  the ``opt`` weights run over the axis; the final weights are per query, local.
* Every other mechanism (softmax, ra; causal calls of the non-causal ones) raises an error
  naming the supported ones.

The result equals ``mechanism.attention`` on one device to float32 rounding, gradients
included (tests/test_parallel.py), for causal calls only where the mechanism has a causal
form (the mechanism's own checks run first, on the whole arrays). Random features
(performer, rfa) are drawn once from `rng` and shared by all devices, so the sharded call
and the one-device call with the same `rng` use the same features.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from linattn_jax import core, landmarks, laplacian, lara, nystromformer, registry, soft
from linattn_jax.core.causal import causal_fused, fused_block_state
from linattn_jax.core.linear import NONCAUSAL_BLOCK, fused_is_wide, noncausal_fused

_f32 = jnp.float32


#: Non-causal mechanisms whose sums over the sequence take a mesh axis, by the attention
#: function their record carries (so a renamed copy of a record is the same mechanism
#: here): the computation behind each public function (its ``*_body``, called with
#: ``axis``).
_REDUCING = {
    nystromformer.NYSTROMFORMER.attention_fn: nystromformer.nystromformer_body,
    soft.SOFT.attention_fn: soft.soft_body,
    laplacian.LAPLACIAN.attention_fn: laplacian.laplacian_body,
}


def _is_lara(mechanism: registry.Mechanism) -> bool:
    return mechanism.attention_fn is lara.LARA.attention_fn


def _has_sharded_form(mechanism: registry.Mechanism) -> bool:
    return (
        mechanism.feature_map is not None
        or mechanism.attention_fn in _REDUCING
        or _is_lara(mechanism)
    )


def supported_names() -> list[str]:
    """Mechanisms that `sequence_parallel` accepts (the feature-map ones, the Nystrom family
    and LARA)."""
    return [n for n in registry.names() if _has_sharded_form(registry.get(n))]


def _check_mesh(mesh: Mesh, axis: str, batch_axes: Sequence[str]) -> None:
    if not isinstance(mesh, Mesh):
        got = f"{type(mesh).__name__} of {len(mesh)}" if isinstance(mesh, list | tuple) else ""
        raise TypeError(
            f"sequence_parallel: mesh must be a jax.sharding.Mesh, got {got or type(mesh).__name__}"
            f" {mesh!r:.80}; make one from a device list with jax.sharding.Mesh(np.array("
            "devices), ('seq',)) or jax.make_mesh((n,), ('seq',))"
        )
    names = tuple(mesh.axis_names)
    if axis not in names:
        raise ValueError(f"sequence_parallel: mesh axes {names} have no sequence axis {axis!r}")
    for a in batch_axes:
        if a not in names or a == axis:
            raise ValueError(
                f"sequence_parallel: batch_axes {tuple(batch_axes)} must be mesh axes other "
                f"than {axis!r}; mesh axes {names}"
            )


def _check_lengths(q, k, mask, mesh, axis, batch_axes):
    n = mesh.shape[axis]
    for what, x in (("q", q), ("k", k)):
        if x.ndim != 4 or x.shape[1] % n:
            raise ValueError(
                f"sequence_parallel: {what} {tuple(x.shape)} must be [B, T, H, D] with T "
                f"divisible by the {n} devices of mesh axis {axis!r}"
            )
    ways = 1
    for a in batch_axes:
        ways *= mesh.shape[a]
    if q.shape[0] % ways:
        raise ValueError(
            f"sequence_parallel: batch {q.shape[0]} is not divisible by the {ways} devices of "
            f"batch_axes {tuple(batch_axes)}"
        )
    if mask is not None and (mask.ndim != 2 or mask.shape[1] % n):
        raise ValueError(f"sequence_parallel: mask {tuple(mask.shape)} must be [B, Tk]")


def _exclusive_prefix(summary: core.RecurrentState, total_log_decay, axis: str):
    """The state of the keys on the devices before this one along `axis`."""
    gathered = jax.tree.map(lambda x: lax.all_gather(x, axis), (summary, total_log_decay))
    states, decays = gathered
    me = lax.axis_index(axis)
    n = decays.shape[0]
    b, h, m, dv = summary.s.shape
    acc = core.recurrent_init(b, h, m, dv)
    for j in range(n):  # static and small: the number of devices on the axis
        nxt = core.combine_states(acc, jax.tree.map(lambda x, j=j: x[j], states), decays[j])
        acc = jax.tree.map(lambda new, old, j=j: jnp.where(j < me, new, old), nxt, acc)
    return acc


def _feature_map_body(fmap, causal, chunk_size, axis):
    if causal and fmap.token_wise:
        return _fused_causal_body(fmap, chunk_size, axis)

    def body(q, k, v, params, extra, mask=None):
        del extra
        if not causal and fmap.token_wise and fused_is_wide(fmap, params, k, {}):
            return _fused_noncausal(fmap, params, q, k, v, mask, axis).astype(q.dtype)
        phi_q = fmap.query(q, params)
        keys = fmap.key(k, params)
        den_floor = fmap.den_floor()
        if not causal:
            if keys.log_decay is not None:
                raise ValueError("sequence_parallel: a log decay needs causal=True")
            state = core.block_state(keys.phi, v, mask=mask, key_log_scale=keys.log_scale)
            c = lax.stop_gradient(lax.pmax(state.c, axis))
            w = jnp.exp(state.c - c)
            s = lax.psum(state.s * w[..., None, None], axis)
            z = lax.psum(state.z * w[..., None], axis)
            mass = z[..., -1] if den_floor else None  # the query's mass column is 0
            out = core.read_out(phi_q.astype(_f32), s, z, mass, den_floor=den_floor)
            return out.astype(q.dtype)
        summary = core.block_state(
            keys.phi, v, mask=mask, log_decay=keys.log_decay, key_log_scale=keys.log_scale
        )
        if keys.log_decay is None:
            total = jnp.zeros(summary.c.shape, _f32)
        else:
            total = jnp.sum(keys.log_decay.astype(_f32), axis=1)
        prefix = _exclusive_prefix(summary, total, axis)
        out, _ = core.causal_linear_attention_from(
            prefix,
            phi_q,
            keys.phi,
            v,
            mask=mask,
            chunk_size=chunk_size,
            log_decay=keys.log_decay,
            key_log_scale=keys.log_scale,
            den_floor=den_floor,
        )
        return out.astype(q.dtype)

    return body


def _fused_noncausal(fmap, params, q, k, v, mask, axis):
    """The non-causal pass of a token-wise map with features wider than the head (as one
    device's over a long sequence, `core.attend_features`): this device's keys summed block
    by block, the sums of all devices added (under their largest key log-scale), then its
    queries read block by block (`noncausal_fused`); never ``[B, T/n, H, M]`` features at
    once, so the per-device memory falls with the shards."""

    def combine(s, z, zm, c):
        c_all = lax.stop_gradient(lax.pmax(c, axis))
        w = jnp.exp(c - c_all)
        sums = (s * w[..., None, None], z * w[..., None], zm * w)
        return tuple(lax.psum(x, axis) for x in sums)

    return noncausal_fused(
        fmap, params, q, k, v, mask, NONCAUSAL_BLOCK, fmap.den_floor(), {}, combine
    )


def _fused_causal_body(fmap, chunk_size, axis):
    """The causal body of a token-wise map: features computed chunk by chunk inside the
    scans, never ``[B, T/n, H, M]`` at once (in the forward pass). One scan over this
    device's keys gives its summary (`fused_block_state`); the summaries before it, folded
    (`_exclusive_prefix`), start the scan of its outputs (`causal_fused`)."""

    def body(q, k, v, params, extra, mask=None):
        del extra
        summary, total = fused_block_state(fmap, params, k, v, mask, chunk_size, {})
        prefix = _exclusive_prefix(summary, total, axis)
        out = causal_fused(fmap, params, q, k, v, mask, chunk_size, fmap.den_floor(), {}, prefix)
        return out.astype(q.dtype)

    return body


def _reducing_body(mechanism, causal, config, axis):
    """The body of a Nystrom-family mechanism: its core with ``axis`` (`nystrom_core.nystrom`)."""
    fn = _REDUCING[mechanism.attention_fn]
    cfg = {**mechanism.defaults, **config}
    if cfg.get("grid") is not None:
        raise NotImplementedError(
            f"sequence_parallel: {mechanism.name!r} with grid={cfg['grid']!r} (2-D landmarks) "
            "is not supported; image sequences fit on one device"
        )
    wanted = inspect.signature(fn).parameters
    cfg = {key: val for key, val in cfg.items() if key in wanted}

    def body(q, k, v, params, extra, mask=None):
        del extra
        p = {"params": params} if "params" in wanted else {}
        out = fn(q, k, v, mask=mask, causal=causal, output="linear", axis=axis, **p, **cfg)
        return out.astype(q.dtype)

    return body


def _lara_noise(mechanism, q, k, rng, deterministic, config):
    """LARA's unit draws for the whole batch, as the one-device call makes them (small:
    ``[B, L, S', H, d]``); ``{}`` when deterministic."""
    if deterministic:
        return {}
    cfg = {**mechanism.defaults, **config}
    b, tq, h, d = q.shape
    grid, m = cfg["grid"], cfg["num_landmarks"]
    n_prop = landmarks.num_landmarks(k.shape[1], m if grid else min(m, tq, k.shape[1]), grid)
    noise = lara.lara_noise(rng, b, n_prop, cfg["num_samples"], h, d, antithetic=cfg["antithetic"])
    return {"noise": noise}


def _lara_body(mechanism, deterministic, config, axis):
    cfg = {**mechanism.defaults, **config}

    def body(q, k, v, params, extra, mask=None):
        out = lara.lara_sharded(
            q, k, v, params, extra.get("noise"), mask=mask, deterministic=deterministic,
            seq_axis=axis, **cfg,
        )  # fmt: skip
        return out.astype(q.dtype)

    return body


def sequence_parallel(
    mechanism: registry.Mechanism,
    mesh: Mesh,
    axis: str = "seq",
    *,
    batch_axes: Sequence[str] | None = None,
) -> Callable:
    """``mechanism.attention`` on q, k, v sharded along T over the mesh axis `axis`.

    Args:
      mechanism: a registry mechanism (bound config applies); one of `supported_names`.
      mesh: the device mesh.
      axis: the mesh axis that splits the sequence (T must be divisible by its size).
      batch_axes: mesh axes that split the batch (default: every other mesh axis).

    Returns:
      ``fn(q, k, v, params, rng=None, *, mask=None, causal=False, deterministic=False,
      **config)`` with the contract of ``mechanism.attention``; the output is sharded like q.

    Raises:
      TypeError: `mechanism` is not a `Mechanism`, or `mesh` is not a Mesh (e.g. a list of
        devices).
      NotImplementedError: the mechanism is not one of `supported_names` (at call time: a
        Nystrom-family ``grid``).
      ValueError: the mesh has no `axis`, or (at call time) T or B do not divide.
    """
    if not isinstance(mechanism, registry.Mechanism):
        raise TypeError(
            "sequence_parallel: mechanism must be a registry Mechanism (la.get(name)), got "
            f"{type(mechanism).__name__} {mechanism!r}"
        )
    _check_mesh(mesh, axis, () if batch_axes is None else tuple(batch_axes))
    fmap = mechanism.feature_map
    if not _has_sharded_form(mechanism):
        raise NotImplementedError(
            f"sequence_parallel supports the mechanisms {supported_names()}; "
            f"{mechanism.name!r} is not one of them"
        )
    batch_axes = (
        tuple(a for a in mesh.axis_names if a != axis) if batch_axes is None else batch_axes
    )
    bspec = tuple(batch_axes) or None
    seq = PartitionSpec(bspec, axis, None, None)
    seq_mask = PartitionSpec(bspec, axis)

    @functools.lru_cache(maxsize=32)
    def sharded(causal, deterministic, config_items, masked, extra_keys):
        """The jitted shard_map of one call signature (cached: a repeated call outside jit
        compiles once, where an eager shard_map compiles op by op)."""
        config = dict(config_items)
        if _is_lara(mechanism):
            body = _lara_body(mechanism, deterministic, config, axis)
        elif fmap is None:
            body = _reducing_body(mechanism, causal, config, axis)
        else:
            chunk_size = int({**mechanism.defaults, **config}.get("chunk_size", 64))
            body = _feature_map_body(fmap.bind(**config), causal, chunk_size, axis)
        extra_spec = {key: PartitionSpec(bspec) for key in extra_keys}  # batch-major draws
        specs = (seq, seq, seq, PartitionSpec(), extra_spec) + ((seq_mask,) if masked else ())
        return jax.jit(
            jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=seq, check_vma=False)
        )

    def fn(q, k, v, params, rng=None, *, mask=None, causal=False, deterministic=False, **config):
        # The mechanism's own checks (shapes, dtypes, config, rng, params), abstractly.
        jax.eval_shape(
            lambda q, k, v, p, r: mechanism.attention(
                q, k, v, p, r, mask=mask, causal=causal, deterministic=deterministic, **config
            ),
            q,
            k,
            v,
            params,
            rng,
        )
        _check_lengths(q, k, mask, mesh, axis, tuple(batch_axes))
        extra, resolved = {}, params
        if _is_lara(mechanism):
            extra = _lara_noise(mechanism, q, k, rng, deterministic, config)
        elif fmap is not None:
            resolved = fmap.bind(**config).resolve(params, rng, deterministic=deterministic)
        key = (bool(causal), bool(deterministic), tuple(sorted(config.items())))
        key += (mask is not None, tuple(extra))
        try:
            call = sharded(*key)
        except TypeError:  # a config value without a hash: built for this call only
            call = sharded.__wrapped__(*key)
        args = (q, k, v, resolved, extra) + (() if mask is None else (mask,))
        return call(*args)

    return fn


__all__ = ["sequence_parallel", "supported_names"]
