"""Prepare LRA data: ``python -m train.data.prepare <task> --data_dir D [--variant mini]``.

``listops`` and ``pathfinder`` are generated here and cached under ``D``; for ``text``,
``image`` and ``retrieval`` (which must be downloaded) the command checks whether the data
is already in place and otherwise prints the steps that put it there. It never downloads.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from . import ALIASES, TASKS, get_task, listops, pathfinder
from .errors import DatasetNotFoundError

GENERATED = {"listops": listops, "pathfinder": pathfinder}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.data.prepare", description=__doc__)
    parser.add_argument("task", choices=sorted(TASKS) + sorted(ALIASES))
    parser.add_argument("--data_dir", required=True, help="root folder for caches and data")
    parser.add_argument("--variant", choices=("mini", "full"), default="full")
    parser.add_argument("--data_seed", type=int, default=0, help="generator seed")
    parser.add_argument("--overwrite", action="store_true", help="regenerate an existing cache")
    for split in ("train", "val", "test"):
        parser.add_argument(f"--num_{split}", type=int, help=f"override the {split} size")
    parser.add_argument(
        "--examples", metavar="PNG", help="pathfinder: also save a grid of 32 test images here"
    )
    args = parser.parse_args(argv)
    name = ALIASES.get(args.task, args.task)
    cfg = {"data_dir": args.data_dir, "variant": args.variant, "data_seed": args.data_seed}
    cfg.update({k: getattr(args, k) for k in ("num_train", "num_val", "num_test")})

    if name in GENERATED:
        module = GENERATED[name]
        spec = module.spec_from_config(cfg)
        print(f"generating {name} ({args.variant}): {dataclasses.asdict(spec)}")
        start = time.perf_counter()
        out = module.prepare(args.data_dir, spec, overwrite=args.overwrite)
        meta = json.loads((out / "spec.json").read_text())
        print(f"done in {time.perf_counter() - start:.1f} s -> {out}")
        print(f"label counts: {meta['label_counts']}")
        if args.examples and name == "pathfinder":
            test = pathfinder.load_generated(out)["test"]
            images, labels = test["images"][:32], test["labels"][:32]
            pathfinder.save_grid(args.examples, images, labels, scale=3)
            print(f"example grid (bar under each image: white = connected) -> {args.examples}")
        return 0

    try:
        task = get_task(name, cfg)
    except DatasetNotFoundError as error:
        print(error, file=sys.stderr)
        return 1
    sizes = {s: len(src) for s, src in task.splits.items()}
    print(f"{name} is ready: splits {sizes}, seq_len {task.seq_len}, vocab {task.vocab_size}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
