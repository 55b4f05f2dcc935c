"""Causal language modelling: a decoder-only transformer over bytes, with recurrent decoding.

Model (`CausalLM`, pre-LN GPT-style)::

    x = embed(tokens) + pos_emb                                [B, T, E]
    repeat num_layers:  x = x + MHA(LN(x), causal=True)
                        x = x + MLP(LN(x))
    logits = LN(x) @ embed^T  (tied) or Dense(vocab)           [B, T, V]

with the attention any causal mechanism (``la.causal_names()``: softmax, linear_elu,
performer, rfa, hedgehog, flexformer_s, flexformer_n, ra).

Text: any UTF-8 (or binary) file, byte-level ids (`train.data.tokenizers`: byte b -> b + 1,
0 = pad, ``vocab_size = 259``). A directory holding WikiText-103's raw files
(``wiki.train.raw``, ``wiki.valid.raw``, ``wiki.test.raw``) is read split by split; a single
file is split 90 / 5 / 5; ``path="stdlib"`` uses the Python standard library's sources (an
offline corpus of several MB). Training windows are random crops of ``T + 1`` bytes drawn
from ``(seed, step)``, so the stream is resumable; evaluation is one ordered pass of
non-overlapping windows. Perplexity is ``exp(mean NLL per byte)``; bits per byte is
``mean NLL / ln 2``.

Recurrent decoding (the constant-memory form of causal linear attention). For a feature-map
mechanism, layer by layer and head by head the state after t tokens is::

    S_t = sum_{j<=t} phi(k_j) v_j^T   [M, Dv],    z_t = sum_{j<=t} phi(k_j)   [M]
    out_t = phi(q_t)^T S_t / phi(q_t)^T z_t

updated one token at a time (`decode_step`, `generate`) by the decode mode of
`linattn_jax.linen.MultiHeadAttention`, which reads each mechanism's feature map through
the library's protocol (``la.get(name).feature_map``; `linattn_jax.core.recurrent_step`).
Key features may carry a log-scale n_j (performer's per-key stabiliser, flexformer's norm
term). A recurrence cannot see future keys, so the state keeps a *running* maximum
``c_t = max_{j<=t} n_j`` and rescales ``S, z`` by ``exp(c_{t-1} - c_t)`` when it grows; the
common factor cancels in the ratio, so the recurrent output equals the parallel causal one
(which stabilises the key scales by the same running max in `linattn_jax.core`) to float
rounding, for every feature-map mechanism, rfa's gate included (a decay of the state).
Generation uses the deterministic (fixed) features of performer and rfa. Mechanisms without
a feature map (softmax, ra) decode with a KV cache of ``max_len`` positions: the mechanism
itself runs for the one new query over the
cached keys with a key mask ``j <= t`` (for ra in its deterministic mode).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sysconfig
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import linattn_jax as la
from linattn_jax.linen import MultiHeadAttention

from .data.errors import DatasetNotFoundError
from .data.tokenizers import BYTE_OFFSET, BYTE_VOCAB_SIZE, decode_bytes
from .models import MlpBlock, _dense, _layer_norm, attention_config_pairs, compute_dtype

VOCAB_SIZE = BYTE_VOCAB_SIZE
WIKITEXT_FILES = {"train": "wiki.train.raw", "val": "wiki.valid.raw", "test": "wiki.test.raw"}
_f32 = jnp.float32


# ============================================================================ text data
def stdlib_text(max_bytes: int | None = None) -> bytes:
    """The Python standard library's ``*.py`` sources, sorted by path, concatenated.

    An offline text corpus (several MB of English comments and code) for CPU runs and tests.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    out, size = [], 0
    for p in files:
        data = p.read_bytes()
        out.append(data)
        size += len(data)
        if max_bytes is not None and size >= max_bytes:
            break
    text = b"".join(out)
    return text if max_bytes is None else text[:max_bytes]


@dataclasses.dataclass(frozen=True, eq=False)
class TextData:
    """Byte splits of a text corpus, read as token ids ``byte + 1`` (0 = pad).

    Attributes:
      splits: split name -> uint8 byte array (a memory map for large files).
      seq_len: T, the model's context; windows hold ``T + 1`` bytes (inputs + shifted targets).
      info: provenance.
    """

    splits: Mapping[str, np.ndarray]
    seq_len: int
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    vocab_size: int = VOCAB_SIZE
    input_keys = ("inputs",)

    def source(self, split: str) -> np.ndarray:
        if split not in self.splits:
            raise KeyError(f"text data has no split {split!r}; has {list(self.splits)}")
        data = self.splits[split]
        if len(data) < self.seq_len + 1:
            raise ValueError(
                f"split {split!r} has {len(data)} bytes, fewer than seq_len + 1 = "
                f"{self.seq_len + 1}"
            )
        return data

    def train_batch(
        self,
        step: int,
        batch_size: int,
        *,
        seed: int = 0,
        split: str = "train",
        process_index: int = 0,
        process_count: int = 1,
    ) -> dict[str, np.ndarray]:
        """Random windows at ``step``: ``inputs``, ``targets`` int32 ``[B / P, T]``.

        A pure function of ``(seed, step, batch_size)``: row r starts at an offset drawn
        from ``default_rng([seed, step])``; process p takes rows ``p, p + P, ...``.
        """
        if batch_size % process_count:
            raise ValueError(f"{batch_size=} must be a multiple of {process_count=}")
        data = self.source(split)
        rng = np.random.default_rng([int(seed), int(step)])
        starts = rng.integers(0, len(data) - self.seq_len, size=batch_size)
        starts = starts[process_index::process_count]
        rows = np.stack([np.asarray(data[s : s + self.seq_len + 1]) for s in starts])
        ids = rows.astype(np.int32) + BYTE_OFFSET
        return {
            "inputs": np.ascontiguousarray(ids[:, :-1]),
            "targets": np.ascontiguousarray(ids[:, 1:]),
        }

    def train_batches(
        self, batch_size: int, *, seed: int = 0, start_step: int = 0, num_threads: int = 0, **kwargs
    ) -> Iterator[dict[str, np.ndarray]]:
        """Endless ``train_batch(start_step), train_batch(start_step + 1), ...``.

        (`num_threads` is accepted for the loop's data API; slicing a byte array needs none.)
        """
        del num_threads
        step = start_step
        while True:
            yield self.train_batch(step, batch_size, seed=seed, **kwargs)
            step += 1

    def num_eval_windows(self, split: str) -> int:
        return (len(self.source(split)) - 1) // self.seq_len

    def eval_batches(
        self,
        split: str,
        batch_size: int,
        *,
        max_batches: int | None = None,
        process_index: int = 0,
        process_count: int = 1,
    ) -> Iterator[dict[str, np.ndarray]]:
        """Ordered non-overlapping windows (every byte after the first is a target once).

        Adds ``mask`` bool ``[B]`` (False on rows that pad the last batch).
        """
        if batch_size % process_count:
            raise ValueError(f"{batch_size=} must be a multiple of {process_count=}")
        data = self.source(split)
        n = self.num_eval_windows(split)
        t = self.seq_len
        num_batches = math.ceil(n / batch_size)
        if max_batches is not None and max_batches >= 0:
            num_batches = min(num_batches, max_batches)
        for b in range(num_batches):
            pos = b * batch_size + np.arange(batch_size)[process_index::process_count]
            rows = np.zeros((len(pos), t + 1), np.int32)
            for r, p in enumerate(pos):
                if p < n:
                    rows[r] = np.asarray(data[p * t : p * t + t + 1]).astype(np.int32) + 1
            yield {
                "inputs": np.ascontiguousarray(rows[:, :-1]),
                "targets": np.ascontiguousarray(rows[:, 1:]),
                "mask": pos < n,
            }


def _read(path: Path) -> np.ndarray:
    return (
        np.memmap(path, dtype=np.uint8, mode="r") if path.stat().st_size else np.zeros(0, np.uint8)
    )


def load_text(cfg: Mapping[str, Any], seq_len: int) -> TextData:
    """`TextData` from ``cfg["path"]`` (see the module docstring).

    Keys: ``path`` (a file, a WikiText-style directory, or ``"stdlib"``), ``max_bytes``
    (``stdlib`` only: corpus size), ``val_fraction`` (single file: val and test fraction
    each, default 0.05).

    Raises:
      DatasetNotFoundError: the path does not exist (or a directory lacks the raw files).
    """
    path = cfg.get("path") or "stdlib"
    frac = float(cfg.get("val_fraction") or 0.05)
    if path == "stdlib":
        text = np.frombuffer(stdlib_text(cfg.get("max_bytes")), np.uint8)
        return _split_single(text, frac, seq_len, {"source": "python stdlib *.py"})
    p = Path(os.path.expanduser(str(path)))
    how = (
        "  Point data.path at any text file, or at the extracted WikiText-103 raw folder\n"
        "  (wikitext-103-raw/ with wiki.train.raw, wiki.valid.raw, wiki.test.raw; from\n"
        "  https://huggingface.co/datasets/Salesforce/wikitext, config wikitext-103-raw-v1,\n"
        "  saved as those three files), or use data.path=stdlib (offline)."
    )
    if p.is_dir():
        files = {s: p / f for s, f in WIKITEXT_FILES.items()}
        missing = [str(f) for f in files.values() if not f.is_file()]
        if missing:
            raise DatasetNotFoundError(f"text corpus {p}", missing, how)
        splits = {s: _read(f) for s, f in files.items()}
        return TextData(splits, seq_len, {"source": str(p)})
    if not p.is_file():
        raise DatasetNotFoundError(f"text corpus {p}", [str(p)], how)
    return _split_single(_read(p), frac, seq_len, {"source": str(p)})


def _split_single(data: np.ndarray, frac: float, seq_len: int, info) -> TextData:
    if not 0 < frac < 0.5:
        raise ValueError(f"val_fraction must be in (0, 0.5), got {frac}")
    n = len(data)
    held = max(int(n * frac), seq_len + 1)
    if n - 2 * held < seq_len + 1:
        raise ValueError(
            f"text of {n} bytes is too short for seq_len={seq_len} with val_fraction={frac}"
        )
    cut1, cut2 = n - 2 * held, n - held
    splits = {"train": data[:cut1], "val": data[cut1:cut2], "test": data[cut2:]}
    return TextData(splits, seq_len, {**info, "bytes": n})


# ============================================================================ model
Mlp = MlpBlock  # ``Dense(mlp_dim) -> gelu -> dropout -> Dense(E) -> dropout``


def drop_path(module: nn.Module, x, rate: float, deterministic: bool):
    """Stochastic depth: zero a residual branch per example with probability `rate`."""
    if deterministic or rate == 0.0:
        return x
    keep = jax.random.bernoulli(module.make_rng("dropout"), 1.0 - rate, (x.shape[0],))
    return x * (keep.astype(x.dtype) / (1.0 - rate))[:, None, None]


class Block(nn.Module):
    """Pre-LN transformer block with any mechanism (shared by `CausalLM` and the ViT).

    ``x + DropPath(Drop(MHA(LN(x))))`` then ``x + DropPath(MLP(LN(x)))``; ``[B, T, E]``.
    With ``decode=True`` the attention decodes (`linattn_jax.linen.MultiHeadAttention`'s
    decode mode, same parameters): one token per call, its state in the ``cache`` collection.
    """

    num_heads: int
    qkv_dim: int
    mlp_dim: int
    attention: str
    attention_config: Any = ()
    dropout_rate: float = 0.0
    drop_path_rate: float = 0.0
    causal: bool = False
    decode: bool = False
    max_len: int = 0
    dtype: Any = None

    @nn.compact
    def __call__(self, x, mask=None, *, deterministic: bool = True):
        y = _layer_norm("ln_attention", self.dtype)(x)
        y = MultiHeadAttention(
            num_heads=self.num_heads,
            qkv_features=self.qkv_dim,
            attention=self.attention,
            attention_config=self.attention_config,
            dtype=self.dtype,
            decode=self.decode,
            max_len=self.max_len,
            name="attention",
        )(y, mask=mask, causal=self.causal, deterministic=deterministic)
        y = nn.Dropout(self.dropout_rate)(y, deterministic=deterministic)
        x = x + drop_path(self, y, self.drop_path_rate, deterministic)
        y = Mlp(self.mlp_dim, self.dropout_rate, self.dtype, name="mlp")(
            _layer_norm("ln_mlp", self.dtype)(x), deterministic=deterministic
        )
        return x + drop_path(self, y, self.drop_path_rate, deterministic)


class CausalLM(nn.Module):
    """Decoder-only LM: tokens ``[B, T]`` -> logits ``[B, T, vocab_size]`` float32.

    With ``decode=True`` tokens are ``[B, 1]``: one step of recurrent decoding (the caller
    makes the ``cache`` collection mutable; see `init_cache`, `decode_step`). ``dtype``: the
    computation dtype (``jnp.bfloat16`` for mixed precision; params stay float32).
    """

    vocab_size: int = VOCAB_SIZE
    max_len: int = 256
    num_layers: int = 2
    emb_dim: int = 64
    num_heads: int = 4
    qkv_dim: int = 64
    mlp_dim: int = 256
    attention: str = "softmax"
    attention_config: Any = ()
    dropout_rate: float = 0.0
    tie_embeddings: bool = True
    dtype: Any = None

    @nn.compact
    def __call__(self, tokens, *, deterministic: bool = True, decode: bool = False):
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [B, T] int ids, got shape {tokens.shape}")
        mech = la.get(self.attention)
        if not mech.supports_causal:
            raise ValueError(
                f"CausalLM needs a causal mechanism; {self.attention!r} is not one of "
                f"{la.causal_names()}"
            )
        b, t = tokens.shape
        if decode and t != 1:
            raise ValueError(f"decode=True takes one token per call, got tokens {tokens.shape}")
        if t > self.max_len:
            raise ValueError(f"tokens length {t} exceeds max_len={self.max_len}")
        embed = nn.Embed(
            self.vocab_size,
            self.emb_dim,
            embedding_init=nn.with_logical_partitioning(
                nn.initializers.normal(stddev=0.02), ("vocab", "embed")
            ),
            dtype=self.dtype,
            name="embed",
        )
        pos = self.param(
            "pos_embed",
            nn.with_logical_partitioning(nn.initializers.normal(stddev=0.02), ("length", "embed")),
            (self.max_len, self.emb_dim),
        )
        if decode:
            initialized = self.has_variable("cache", "position")
            index = self.variable("cache", "position", lambda: jnp.zeros((), jnp.int32))
            p = jax.lax.dynamic_slice_in_dim(pos, index.value, 1, axis=0)  # [1, E]
            if initialized:
                index.value = index.value + 1
        else:
            p = pos[:t]
        x = embed(tokens)
        x = x + p[None].astype(x.dtype)
        x = nn.Dropout(self.dropout_rate)(x, deterministic=deterministic)
        for i in range(self.num_layers):
            x = Block(
                num_heads=self.num_heads,
                qkv_dim=self.qkv_dim,
                mlp_dim=self.mlp_dim,
                attention=self.attention,
                attention_config=self.attention_config,
                dropout_rate=self.dropout_rate,
                causal=True,
                decode=decode,
                max_len=self.max_len,
                dtype=self.dtype,
                name=f"block_{i}",
            )(x, deterministic=deterministic)
        x = _layer_norm("ln_final", self.dtype)(x)
        if self.tie_embeddings:
            return embed.attend(x).astype(_f32)
        return _dense(self.vocab_size, "logits", ("embed", "vocab"), self.dtype)(x).astype(_f32)


# ============================================================================ decoding
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


# ============================================================================ loss
def token_nll(logits, targets, weights=None):
    """``(sum of NLL, number of tokens)`` over ``targets [B, T]`` (0 = pad, not counted).

    `weights` ``[B]`` zeroes whole rows (eval padding).
    """
    logp = jax.nn.log_softmax(logits.astype(_f32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]  # [B, T]
    w = (targets != 0).astype(_f32)
    if weights is not None:
        w = w * weights.astype(_f32)[:, None]
    return jnp.sum(nll * w), jnp.sum(w)


def perplexity(nll_sum, count) -> dict[str, float]:
    """``{"loss", "perplexity", "bits_per_byte"}`` from summed NLL (nats) and token count."""
    mean = float(nll_sum) / max(float(count), 1.0)
    return {
        "loss": mean,
        "perplexity": math.exp(min(mean, 50.0)),
        "bits_per_byte": mean / math.log(2),
    }


def evaluate_perplexity(
    model, variables, data: TextData, split="val", batch_size=8, max_batches=None
):
    """Perplexity of `model` on ``data[split]`` (one ordered pass; deterministic)."""

    @jax.jit
    def nll(variables, batch):  # variables as an argument: see `init_cache`
        logits = model.apply(variables, batch["inputs"], deterministic=True)
        return token_nll(logits, batch["targets"], batch["mask"])

    total, count = 0.0, 0.0
    for batch in data.eval_batches(split, batch_size, max_batches=max_batches):
        s, c = nll(variables, {k: jnp.asarray(v) for k, v in batch.items()})
        total, count = total + float(s), count + float(c)
    return perplexity(total, count)


def lm_loss(logits, batch, weights, config=None):
    """The loop's loss terms: mean NLL per target byte, next-byte accuracy, bits per byte.

    ``logits [B, T, V]``, ``batch["targets"] [B, T]`` (0 = pad), `weights` ``[B]``.
    """
    del config
    targets = batch["targets"]
    total, count = token_nll(logits, targets, weights)
    w = (targets != 0).astype(_f32) * weights.astype(_f32)[:, None]
    correct = jnp.sum((jnp.argmax(logits, axis=-1) == targets).astype(_f32) * w)
    return {
        "loss": (total, count),
        "accuracy": (correct, count),
        "bits_per_byte": (total / math.log(2.0), count),
    }


def build_lm(config, vocab_size: int = VOCAB_SIZE) -> CausalLM:
    """The `CausalLM` of ``config.model`` / ``config.attention`` / ``config.attention_config``."""
    m = config.model
    return CausalLM(
        vocab_size=vocab_size,
        max_len=int(config.data.seq_len),
        num_layers=int(m.num_layers),
        emb_dim=int(m.emb_dim),
        num_heads=int(m.num_heads),
        qkv_dim=int(m.qkv_dim),
        mlp_dim=int(m.mlp_dim),
        attention=config.attention,
        attention_config=attention_config_pairs(config.attention_config),
        dropout_rate=float(m.dropout_rate),
        tie_embeddings=bool(m.tie_embeddings),
        dtype=compute_dtype(config),
    )


def _lm_data(config) -> TextData:
    return load_text(config.data.to_dict(), int(config.data.seq_len))


def register_workload() -> None:
    """Adds the ``lm`` workload to `train.loop.WORKLOADS` (idempotent; done on import)."""
    from train import loop

    loop.WORKLOADS.setdefault(
        "lm", loop.Workload(_lm_data, lambda config, data: build_lm(config), lm_loss)
    )


register_workload()


def decode_text(ids) -> str:
    """Token ids -> text (bytes decoded as UTF-8 with replacement)."""
    return decode_bytes(np.asarray(ids)).decode("utf-8", errors="replace")


def encode_text(text: str) -> np.ndarray:
    """Text -> int32 ids ``byte + 1``."""
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32) + BYTE_OFFSET


__all__ = [
    "Block",
    "CausalLM",
    "Mlp",
    "TextData",
    "decode_step",
    "decode_text",
    "encode_text",
    "evaluate_perplexity",
    "generate",
    "init_cache",
    "load_text",
    "perplexity",
    "recurrent_logits",
    "stdlib_text",
    "token_nll",
    "build_lm",
    "lm_loss",
    "register_workload",
]


# ============================================================================ command line
_USAGE = """python -m train.lm: train a byte-level causal LM, report perplexity, and sample
from it with the recurrent (constant-memory) decoder.

  python -m train.lm --attention flexformer_n                 # mini preset: stdlib sources
  python -m train.lm --preset wikitext103 --set data.path=/data/wikitext-103-raw
  python -m train.lm --generate_only --workdir workdir/lm_mini_flexformer_n --prompt "def "

Training is the ordinary loop (`python -m train --task lm` does the same): progress bar,
checkpoints (rerun to resume), metrics, summary. Config fields: --set key=value.
"""


def main(argv=None) -> dict:
    import argparse
    import sys

    from train import configs

    p = argparse.ArgumentParser(
        prog="python -m train.lm",
        description=_USAGE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--preset", default="mini", help="mini or wikitext103")
    p.add_argument("--attention", default="flexformer_n", help=f"one of {la.causal_names()}")
    p.add_argument("--workdir", default=None, help="default: workdir/lm_<preset>_<attention>")
    p.add_argument("--steps", type=int, default=None, help="override num_train_steps")
    p.add_argument("--generate_only", action="store_true", help="sample from the saved run")
    p.add_argument("--prompt", default="def ", help="text to continue")
    p.add_argument("--num_tokens", type=int, default=100, help="bytes to generate")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top_k", type=int, default=None)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--no_progress", action="store_true")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)

    config = configs.set_attention(configs.get_config("lm", args.preset), args.attention)
    if args.steps is not None:
        config.num_train_steps = args.steps
    if args.no_progress:
        config.progress_bar = False
    configs.apply_overrides(config, args.set)
    workdir = args.workdir or f"workdir/lm_{args.preset}_{args.attention}"
    from train import distill, loop

    out: dict[str, Any] = {}
    if not args.generate_only:
        summary = loop.train_and_evaluate(config, workdir)
        print(loop.format_summary(summary), flush=True)
        for split in ("val", "test"):
            if summary.get(split):
                ppl = perplexity(summary[split]["loss"], 1.0)
                print(
                    f"{split}: perplexity {ppl['perplexity']:.3f}, "
                    f"{ppl['bits_per_byte']:.4f} bits per byte",
                    flush=True,
                )
        out["summary"] = summary
    trainer, state, _ = distill.restore(config, workdir)
    variables = distill.variables_of(state)
    prompt = encode_text(args.prompt)[None, : config.data.seq_len - 1]
    room = int(config.data.seq_len) - prompt.shape[1]
    ids = generate(
        trainer.model,
        variables,
        prompt,
        min(args.num_tokens, room),
        jax.random.key(int(config.seed)),
        temperature=args.temperature,
        top_k=args.top_k,
    )
    text = decode_text(np.asarray(ids[0]))
    print(f"--- sample ({args.attention}, recurrent decoding) ---\n{text}", flush=True)
    out["sample"] = text
    return out


if __name__ == "__main__":
    main()
