"""``python -m train.lm``: train a byte-level causal LM, report perplexity, and sample from it
with the recurrent (constant-memory) decoder.

A thin entry over the modules that do the work: the data `train.data.text`, the model
`train.models.lm.CausalLM`, the loss `train.losses.lm_loss`, the workload table
`train.workloads` (``"lm"``), and decoding `train.generate`. The names those modules export
are re-exported here for callers of the single-file ``train.lm`` of earlier versions.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

import linattn_jax as la
from train import cli, loop
from train import trainer as trainer_lib
from train.data.text import (
    VOCAB_SIZE,
    WIKITEXT_FILES,
    TextData,
    decode_text,
    encode_text,
    load_text,
    stdlib_text,
)
from train.generate import decode_step, generate, init_cache, recurrent_logits
from train.losses import evaluate_perplexity, lm_loss, perplexity, token_nll
from train.models.layers import Block, Mlp, drop_path
from train.models.lm import CausalLM, build_lm

__all__ = [
    "VOCAB_SIZE",
    "WIKITEXT_FILES",
    "Block",
    "CausalLM",
    "Mlp",
    "TextData",
    "build_lm",
    "decode_step",
    "decode_text",
    "drop_path",
    "encode_text",
    "evaluate_perplexity",
    "generate",
    "init_cache",
    "lm_loss",
    "load_text",
    "config_from_argv",
    "main",
    "perplexity",
    "recurrent_logits",
    "stdlib_text",
    "token_nll",
]

_USAGE = """python -m train.lm: train a byte-level causal LM, report perplexity, and sample
from it with the recurrent (constant-memory) decoder.

  python -m train.lm --attention flexformer_n                 # mini preset: stdlib sources
  python -m train.lm --preset wikitext103 --set data.path=/data/wikitext-103-raw
  python -m train.lm --generate_only --workdir workdir/lm_mini_flexformer_n --prompt "def "

Training is the ordinary loop (`python -m train --task lm` does the same): progress bar,
checkpoints (rerun to resume), metrics, summary. Config fields: --set key=value.
"""


def parser():
    """The ``python -m train.lm`` parser (`train.cli.parser` plus the sampling flags)."""
    p = cli.parser(
        "python -m train.lm",
        _USAGE,
        task=None,
        preset_help="mini or wikitext103",
        attention_help=f"one of {la.causal_names()}",
        flags=("preset", "attention", "workdir", "steps", "set", "no_progress", "restart"),
    )
    p.add_argument("--generate_only", action="store_true", help="sample from the saved run")
    p.add_argument("--prompt", default="def ", help="text to continue")
    p.add_argument("--num_tokens", type=int, default=100, help="bytes to generate")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top_k", type=int, default=None)
    return p


def config_from_argv(argv=None):
    """``(args, config)``: the flags and the config ``python -m train.lm <argv>`` trains."""
    args, overrides = cli.parse(parser(), argv, config_flags=False)
    return args, cli.build_config(args, overrides, task="lm")


def main(argv=None) -> dict:
    """Train (unless ``--generate_only``), print perplexity, sample; returns
    ``{"summary", "sample"}``."""
    args, config = config_from_argv(argv)
    workdir = args.workdir or f"workdir/lm_{args.preset}_{args.attention}"
    out: dict[str, Any] = {}
    if not args.generate_only:
        summary = loop.train_and_evaluate(config, workdir, restart=args.restart)
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
    trainer, state, _ = trainer_lib.restore_run(config, workdir)
    variables = trainer_lib.eval_variables(state)
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
    import sys

    sys.exit(cli.run(main))
