"""Peer implementations for ``python -m train.bench scaling``: the speed a mechanism should beat.

A peer is a plain ``jax.numpy`` transcription of a mechanism in the layout of its official
code, without our generality (no mask, no padding invariance, no validation). ``scaling``
times each registered mechanism's peer beside it, in the same process and on the same
inputs, as a row ``<name>_peer``, and prints a table of ``speed vs peer = peer time / our
time`` (> 1: ours is faster).

* ``lara``: the official PyTorch LARA (Zheng et al. 2022, HKUNLP ``efficient-attention``,
  ``LinearRA`` with ``proposal_gen="seg-means"``/1-D, ``mis_type="mis-opt"``, one sample),
  written here in jnp: heads-first ``[B, H, T, D]`` tensors (the official layout: the
  ``[B, T, H, D]`` inputs are transposed into it and the output back, as the official
  module's head split and merge do), landmarks by reshape-and-mean (the official split
  when T % C != 0), proposal ``mu = q~ + k~`` in the unscaled space with unit noise added
  before the ``d^(-1/4)`` scaling, and the ``[B, H, C, T]`` "proposal-major" layout
  of every log-density.
* ``performer``: the public JAX FAVOR+ (google-research ``performer/fast_attention/jax``,
  ``make_fast_softmax_attention`` with ``redraw_features=True``): one ``[M, d]`` Gaussian
  orthogonal projection shared by the batch and the heads, redrawn per call; the positive
  softmax-kernel features with the query stabiliser over its features and the key stabiliser
  over all keys and features; a length-first ``[T, B, H, .]`` layout; non-causal by two
  einsums, causal by a ``lax.scan`` over the positions carrying the prefix sums (their
  forward; its gradient here by autodiff of the scan, theirs by a hand-written scan).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from train.bench import common, timing


def _prm(x, w):
    """Official ``prm_projection(x, w, normalize=False)``: ``[B,H,T,D], [B,H,C,D] -> [B,H,C,T]``."""
    s = x.shape[-1] ** -0.5
    return jnp.einsum("bhcd,bhnd->bhcn", w, x * s) - s * 0.5 * jnp.sum(x * x, -1)[:, :, None, :]


def _segment_means(x, c):
    """The official 1-D landmarks: reshape-and-mean, or (T % C != 0) the first landmarks
    over T // C tokens and the rest over T // C + 1."""
    b, h, n, d = x.shape
    if n % c == 0:
        return x.reshape(b, h, c, n // c, d).mean(-2)
    segs = n // c
    num_k = (segs + 1) * c - n
    first = x[:, :, : num_k * segs].reshape(b, h, num_k, segs, d).mean(-2)
    last = x[:, :, num_k * segs :].reshape(b, h, c - num_k, segs + 1, d).mean(-2)
    return jnp.concatenate([first, last], axis=2)


def lara_peer(q, k, v, rng, *, num_landmarks: int = 64, alpha_coeff: float = 1.0, eps=None):
    """Official-layout LARA: ``q, k, v [B, T, H, D]`` -> ``[B, T, H, D]``.

    `eps`: optional unit noise ``[B, H, C, D]`` (default: drawn from `rng`).
    """
    q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))  # the official head split
    b, h, n, d = q.shape
    c = min(num_landmarks, n)
    q_bar, k_bar = _segment_means(q, c), _segment_means(k, c)
    mu = q_bar + k_bar
    w = mu + (jax.random.normal(rng, mu.shape, mu.dtype) if eps is None else eps)
    log_proj_q = _prm(q, w)  # [B, H, C, T]
    log_proj_k = _prm(k, w)
    kv_stats = jnp.einsum("bhcm,bhmd->bhcd", jax.nn.softmax(log_proj_k, -1), v)
    t_nc = jax.nn.softmax(jnp.einsum("bhcd,bhnd->bhcn", q_bar * d**-0.5, q), -1)
    log_proj_mu = _prm(mu, w)  # [B, H, C, C]
    log_proposal = jnp.diagonal(log_proj_mu, axis1=-2, axis2=-1)[..., None]
    bh = jnp.exp(log_proposal - jax.nn.logsumexp(log_proj_mu, -1, keepdims=True))
    alpha = bh + alpha_coeff * (t_nc - t_nc.mean(-2, keepdims=True))
    log_alpha = jnp.log(jnp.maximum(alpha, 1e-8))
    log_true = log_proj_q + jax.nn.logsumexp(log_proj_k, -1, keepdims=True)
    sniw = jax.nn.softmax(log_alpha + log_true - log_proposal, axis=-2)
    return jnp.einsum("bhcn,bhcd->bnhd", sniw, kv_stats)  # the official head merge


def _orthogonal_projection(rng, m: int, d: int):
    """The public code's Gaussian orthogonal random matrix ``[M, d]``: stacked QR blocks,
    rows scaled by the norms of independent Gaussian rows."""
    n_blocks = -(-m // d)
    k_q, k_n = jax.random.split(rng)
    blocks = [
        jnp.linalg.qr(jax.random.normal(k, (d, d)))[0].T for k in jax.random.split(k_q, n_blocks)
    ]
    rows = jnp.concatenate(blocks, axis=0)[:m]
    return jnp.linalg.norm(jax.random.normal(k_n, (m, d)), axis=1)[:, None] * rows


def _favor_features(x, w, *, is_query: bool, stabilizer: float = 1e-6):
    """Positive softmax-kernel features of ``x [T, B, H, d]`` with ``w [M, d]``."""
    normalizer = x.shape[-1] ** -0.25
    dash = jnp.einsum("tbhd,md->tbhm", normalizer * x, w)
    diag = 0.5 * normalizer**2 * jnp.sum(x * x, axis=-1, keepdims=True)
    axes = (-1,) if is_query else (0, -1)
    stab = jax.lax.stop_gradient(jnp.max(dash, axis=axes, keepdims=True))
    return w.shape[0] ** -0.5 * (jnp.exp(dash - diag - stab) + stabilizer)


def performer_peer(
    q, k, v, rng, *, num_features: int = 256, causal: bool = False, stabilizer: float = 1e-6
):
    """Public-layout FAVOR+: ``q, k, v [B, T, H, D]`` -> ``[B, T, H, D]`` (`stabilizer`: the
    public code's ``numerical_stabilizer``, added to every feature)."""
    q, k, v = (jnp.moveaxis(x, 1, 0) for x in (q, k, v))  # length first, as theirs
    w = _orthogonal_projection(rng, num_features, q.shape[-1])
    qp = _favor_features(q, w, is_query=True, stabilizer=stabilizer)
    kp = _favor_features(k, w, is_query=False, stabilizer=stabilizer)
    if not causal:
        kv = jnp.einsum("tbhm,tbhd->bhmd", kp, v)
        num = jnp.einsum("tbhm,bhmd->tbhd", qp, kv)
        den = jnp.einsum("tbhm,bhm->tbh", qp, jnp.sum(kp, axis=0))
    else:

        def step(carry, x):
            s, z = carry
            qt, kt, vt = x
            s, z = s + jnp.einsum("bhm,bhd->bhmd", kt, vt), z + kt
            return (s, z), (jnp.einsum("bhm,bhmd->bhd", qt, s), jnp.einsum("bhm,bhm->bh", qt, z))

        b, h, m, d = kp.shape[1], kp.shape[2], kp.shape[3], v.shape[-1]
        init = (jnp.zeros((b, h, m, d), v.dtype), jnp.zeros((b, h, m), v.dtype))
        _, (num, den) = jax.lax.scan(step, init, (qp, kp, v))
    return jnp.moveaxis(num / den[..., None], 0, 1)


#: name -> (peer, the mechanism config it corresponds to).
PEERS: dict[str, tuple[Callable, dict]] = {
    "lara": (lara_peer, {"num_landmarks": 64}),
    "performer": (performer_peer, {"num_features": 256}),
}
#: Peers with a causal form (the others are timed non-causal only).
CAUSAL_PEERS = frozenset({"performer"})


def peer_name(name: str) -> str:
    return f"{name}_peer"


def peer_names(names) -> list[str]:
    """`names` with each peer row right after its mechanism."""
    out = []
    for n in names:
        out.append(n)
        if n in PEERS:
            out.append(peer_name(n))
    return out


def peer_points(name: str, cfg, emit=None) -> list[dict]:
    """Times `name`'s peer (if any) at every T, mode and pass of `cfg` (causal only for
    `CAUSAL_PEERS`).

    Same inputs, pass definitions (forward; loss ``<out, ct>`` and its gradient w.r.t. q, k,
    v) and timing (`train.bench.timing.measure`) as the mechanism's own points.
    """
    modes = [m for m in cfg.modes if m == "noncausal" or name in CAUSAL_PEERS]
    if name not in PEERS or not modes:
        return []
    fn, config = PEERS[name]
    points = []
    for seq_len, mode, pass_ in itertools.product(cfg.seq_lens, modes, cfg.passes):
        q, k, v, ct = common.random_qkv(cfg.batch, seq_len, cfg.heads, cfg.head_dim)
        rng = jax.random.key(1)
        extra = {"causal": True} if mode == "causal" else {}

        def fwd(q, k, v, rng, extra=extra):
            return fn(q, k, v, rng, **config, **extra)

        f, args = (fwd, (q, k, v, rng))
        if pass_ == "fwd_bwd":
            f, args = common.fwd_bwd(fwd, argnums=(0, 1, 2)), (*args, ct)
        point = {
            "mechanism": peer_name(name),
            "peer_of": name,
            "seq_len": seq_len,
            "mode": mode,
            "pass": pass_,
            "quadratic": False,
            "status": "ok",
            "note": "",
        }
        try:
            point.update(timing.measure(f, args, repeats=cfg.repeats, min_total_s=cfg.min_total_s))
        except Exception as e:  # noqa: BLE001 -- a failing peer must not end the run
            point.update(status="error", note=f"{type(e).__name__}: {str(e)[:300]}")
        points.append(point)
        if emit is not None:
            emit(point)
    return points


def add_peer_ratios(points: list[dict]) -> list[dict]:
    """Sets ``speed_vs_peer = peer time / our time`` on each mechanism point that has a peer."""
    index = {
        (p["mechanism"], p["seq_len"], p["mode"], p["pass"]): p for p in points if "seq_len" in p
    }
    for p in points:
        if "seq_len" not in p or p["mechanism"] not in PEERS:
            continue
        peer = index.get((peer_name(p["mechanism"]), p["seq_len"], p["mode"], p["pass"]))
        if peer and peer.get("time_ms") and p.get("time_ms"):
            p["speed_vs_peer"] = peer["time_ms"] / p["time_ms"]
    return points


def peer_table(result: dict) -> str:
    """Markdown: per mechanism with a peer, our time, the peer's, and the speed ratio."""
    rows = [p for p in result["points"] if "speed_vs_peer" in p]
    if not rows:
        return ""
    out = [
        "\n#### speed vs peer (official-layout plain jnp; > 1: ours faster)\n",
        "| mechanism | T | mode | pass | ours | peer | speed vs peer |",
        "|---|---:|---|---|---:|---:|---:|",
    ]
    for p in sorted(rows, key=lambda r: (r["mechanism"], r["mode"], r["pass"], r["seq_len"])):
        peer_ms = p["time_ms"] * p["speed_vs_peer"]
        out.append(
            f"| {p['mechanism']} | {p['seq_len']} | {p['mode']} | {p['pass']} | "
            f"{p['time_ms']:.1f} ms | {peer_ms:.1f} ms | {p['speed_vs_peer']:.2f}x |"
        )
    return "\n".join(out) + "\n"


__all__ = [
    "CAUSAL_PEERS",
    "PEERS",
    "add_peer_ratios",
    "lara_peer",
    "peer_names",
    "peer_points",
    "peer_table",
    "performer_peer",
]
