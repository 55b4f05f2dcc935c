"""LRA data: one interface for every task, ``get_task(name, config) -> Task``.

Tasks (``TASKS``): ``listops`` (generated, or LRA's released TSVs), ``text`` (byte-level
IMDB, tfds), ``retrieval`` (AAN pairs, LRA's TSVs), ``image`` (grayscale CIFAR-10, tfds),
``pathfinder`` (generated 32x32, or LRA's released PNGs). Nothing is ever downloaded;
generated data is cached under ``data_dir``; a missing data set raises
``DatasetNotFoundError`` saying where it looked and how to prepare it
(``python -m train.data.prepare <task> --data_dir D`` prints the steps).

Typical loop::

    task = get_task("listops", {"variant": "mini", "data_dir": "/data"})
    for step, batch in enumerate(task.train_batches(32, seed=0, start_step=s), start=s):
        ...  # batch["inputs"]: int32 [32, task.seq_len], batch["targets"]: int32 [32]
    for batch in task.eval_batches("val", 64):
        ...  # + batch["mask"]: bool [64], False on padding rows of the last batch
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import config_keys, listops, pathfinder, retrieval, tfds_tasks
from .errors import DatasetNotFoundError
from .pipeline import ArraySource, LazySource, Task

_config = config_keys  # the module's old private name (tests/test_data_pathfinder.py)

TASKS: dict[str, Callable[[dict[str, Any]], Task]] = {
    "listops": listops.build_task,
    "text": tfds_tasks.build_text,
    "retrieval": retrieval.build_task,
    "image": tfds_tasks.build_image,
    "pathfinder": pathfinder.build_task,
}
ALIASES = {"imdb": "text", "aan": "retrieval", "cifar10": "image", "pathfinder32": "pathfinder"}


def get_task(name: str, config: Any = None, **overrides: Any) -> Task:
    """Build the ``Task`` for LRA task ``name`` from ``config`` (+ keyword overrides).

    Args:
      name: one of ``TASKS`` (or an alias: imdb, aan, cifar10, pathfinder32).
      config: an ``ml_collections.ConfigDict``, a dict, or None. Keys read (all optional;
        others are ignored, so a whole training config can be passed):
        - ``data_dir``: root for generated caches and released files (default
          ``$LINATTN_DATA_DIR`` or ``~/.cache/linattn_jax/data``).
        - ``variant``: ``"full"`` (LRA sizes, the default) or ``"mini"`` (CPU-sized).
        - ``seq_len``: token length (defaults per task and variant; fixed by the image
          size for image/pathfinder).
        - ``batch_size``, ``seed``: defaults of the batch methods (global batch, shuffle seed).
        - ``data_seed``: seed of the ListOps/Pathfinder generators (default 0).
        - ``source``: ``"generated"`` (default) or ``"lra"`` for listops/pathfinder.
        - ``lra_dir``: the extracted LRA ``lra_release/`` folder (default
          ``data_dir/lra_release``); ``listops_dir``, ``pathfinder_dir``, ``aan_dir``:
          direct folders; ``difficulty`` (pathfinder: easy/intermediate/hard, the
          release folder or the generated contour length 6/9/14).
        - ``tfds_data_dir``: tfds data dir for text/image (default ``data_dir``).
        - ``num_train``/``num_val``/``num_test``: split sizes (generation, or subsets).
        - listops: ``min_length``, ``max_length``, ``max_depth``, ``max_args``,
          ``value_p``; pathfinder: any ``PathfinderSpec`` field (``image_size``,
          ``contour_length``, ``distractor_length``, ``num_distractors``,
          ``paddle_length``, ``margin``, ``seed_distance``, ...); text/retrieval:
          ``add_cls``, ``add_eos``; image:
          ``downsample``; generated tasks: ``generate=False`` to fail instead of
          generating a missing cache.
      **overrides: keys that replace those of ``config``.

    Returns:
      The ``Task`` (see ``train.data.pipeline.Task``).

    Raises:
      DatasetNotFoundError: the data set is not on disk.
      ValueError: unknown task name or bad config values.
    """
    key = ALIASES.get(name, name)
    if key not in TASKS:
        raise ValueError(f"unknown task {name!r}; known: {sorted(TASKS)} (aliases {ALIASES})")
    cfg = config_keys.as_dict(config)
    cfg.update(overrides)
    return TASKS[key](cfg)


__all__ = [
    "ALIASES",
    "TASKS",
    "ArraySource",
    "DatasetNotFoundError",
    "LazySource",
    "Task",
    "get_task",
]
