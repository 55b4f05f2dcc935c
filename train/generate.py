"""Sampling from the causal LM with recurrent decoding (constant memory for feature maps).

For a feature-map mechanism, layer by layer and head by head the state after t tokens is::

    S_t = sum_{j<=t} phi(k_j) v_j^T   [M, Dv],    z_t = sum_{j<=t} phi(k_j)   [M]
    out_t = phi(q_t)^T S_t / phi(q_t)^T z_t

updated one token at a time (`decode_step`, `generate`) by the decode mode of
`linattn_jax.linen.MultiHeadAttention`, which reads each mechanism's feature map through
the library's protocol (``la.get(name).feature_map``; `linattn_jax.core.recurrent_step`).
Key features may carry a log-scale n_j (performer's per-key stabiliser, flexformer's norm
term). A recurrence cannot see future keys, so the state keeps a *running* maximum
``c_t = max_{j<=t} n_j`` and rescales ``S, z`` by ``exp(c_{t-1} - c_t)`` when it grows; the
common factor cancels in the ratio, so the recurrent output equals the parallel causal one
to float rounding, for every feature-map mechanism, rfa's gate included (a decay of the
state). Generation uses the deterministic (fixed) features of performer and rfa. Mechanisms
without a feature map (softmax, ra) decode with a KV cache of ``max_len`` positions: the
mechanism itself runs for the one new query over the cached keys with a key mask ``j <= t``
(for ra in its deterministic mode).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from train.models.lm import CausalLM


def init_cache(model: CausalLM, variables, batch_size: int):
    """The empty decoding cache (``cache`` collection) for `batch_size` sequences."""
    params_only = {k: v for k, v in variables.items() if k != "cache"}

    # Arrays go in as arguments, never closed over: a jitted closure keeps its captured
    # buffers alive, and a training step may donate (free) those buffers afterwards.
    def fn(params_only):
        _, updates = model.apply(
            params_only,
            jnp.zeros((batch_size, 1), jnp.int32),
            decode=True,
            mutable=["cache"],
        )
        return updates["cache"]

    return jax.jit(fn)(params_only)


def decode_step(model: CausalLM, variables, cache, tokens):
    """One token per sequence: ``tokens [B]`` -> ``(logits [B, V], cache)``."""
    out, updates = model.apply(
        {**variables, "cache": cache}, tokens[:, None], decode=True, mutable=["cache"]
    )
    return out[:, 0], updates["cache"]


def recurrent_logits(model: CausalLM, variables, tokens):
    """Logits ``[B, T, V]`` of `tokens` ``[B, T]`` computed token by token (the recurrent form).

    Equals ``model.apply(variables, tokens)`` (the parallel form) up to float rounding; see
    the module docstring for performer's eps term.
    """
    variables = {k: v for k, v in variables.items() if k != "cache"}
    cache = init_cache(model, variables, tokens.shape[0])

    @jax.jit
    def run(variables, cache, tokens):
        def step(cache, tok):
            logits, cache = decode_step(model, variables, cache, tok)
            return cache, logits

        _, logits = jax.lax.scan(step, cache, jnp.swapaxes(tokens, 0, 1))
        return jnp.swapaxes(logits, 0, 1)

    return run(variables, cache, tokens)


def generate(
    model: CausalLM,
    variables,
    prompt,
    num_tokens: int,
    rng,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
):
    """Sample `num_tokens` continuations of `prompt` ``[B, P]`` (int ids) with the recurrence.

    The prompt is consumed token by token (constant memory for feature-map mechanisms),
    then tokens are sampled from ``softmax(logits / temperature)`` (greedy when
    ``temperature == 0``; ``top_k`` keeps the k most likely). Returns ``[B, P + num_tokens]``.
    Positions are learned, so ``P + num_tokens <= model.max_len``.
    """
    prompt = jnp.asarray(prompt, jnp.int32)
    if prompt.ndim != 2 or prompt.shape[1] < 1:
        raise ValueError(f"prompt must be [B, P] with P >= 1, got shape {prompt.shape}")
    total = prompt.shape[1] + num_tokens
    if total > model.max_len:
        raise ValueError(f"prompt + num_tokens = {total} exceeds max_len={model.max_len}")
    variables = {k: v for k, v in variables.items() if k != "cache"}
    cache = init_cache(model, variables, prompt.shape[0])

    def sample(logits, key):
        logits = logits.at[:, 0].set(-jnp.inf)  # never sample padding
        if temperature == 0:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32)
        logits = logits / temperature
        if top_k is not None:
            kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
            logits = jnp.where(logits < kth, -jnp.inf, logits)
        return jax.random.categorical(key, logits).astype(jnp.int32)

    @jax.jit
    def run(variables, cache, prompt, rng):
        def feed(cache, tok):
            logits, cache = decode_step(model, variables, cache, tok)
            return cache, logits

        cache, logits = jax.lax.scan(feed, cache, jnp.swapaxes(prompt, 0, 1))
        first = sample(logits[-1], jax.random.fold_in(rng, 0))

        def gen(carry, i):
            cache, tok = carry
            logits, cache = decode_step(model, variables, cache, tok)
            nxt = sample(logits, jax.random.fold_in(rng, i))
            return (cache, nxt), tok

        (_, last), toks = jax.lax.scan(gen, (cache, first), jnp.arange(1, num_tokens))
        out = jnp.concatenate([jnp.swapaxes(toks, 0, 1), last[:, None]], axis=1)
        return jnp.concatenate([prompt, out[:, :num_tokens]], axis=1)

    if num_tokens == 0:
        return prompt
    return run(variables, cache, prompt, rng)


__all__ = ["decode_step", "generate", "init_cache", "recurrent_logits"]
