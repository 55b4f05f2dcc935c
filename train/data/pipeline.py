"""Random-access example sources and ``Task``: seeded, resumable batches for every LRA task.

Every task ends up as a ``Task``: per split a random-access *source* (``len(src)`` and
``src[i] -> {"inputs": int32 [T], "targets": int32 []}``, pair tasks ``inputs1``/``inputs2``),
plus ``vocab_size``, ``num_classes``, ``seq_len`` and ``is_pair``.

Resumption contract (what a training loop checkpoints): the training stream is a pure
function of ``(seed, batch_size, step)``. Batch ``s`` holds the examples at positions
``[s * B, (s + 1) * B)`` of an endless stream in which epoch ``e`` is a permutation of the
split drawn from ``(seed, e)`` (grain's index shuffle; batches may straddle two epochs).
So ``task.train_batches(B, seed=k, start_step=s)`` yields exactly the batches
``s, s + 1, ...`` of ``task.train_batches(B, seed=k)``: to resume, save the step and start
there. ``task.train_batch(s, B, seed=k)`` returns one batch directly, and the iterator
returned by ``train_batches`` also has grain's ``get_state()/set_state()`` for loops that
prefer an opaque state.

Multi-host: ``batch_size`` is the *global* batch; process ``p`` of ``P`` gets the rows of
the global batch at stream positions ``p, p + P, ...`` (``batch_size // P`` rows), so the
union over processes is exactly the single-process batch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

Batch = dict[str, np.ndarray]
Example = dict[str, np.ndarray]


class Source(Protocol):
    """What a split is: random access to examples (grain's RandomAccessDataSource)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Example: ...


class ArraySource:
    """Examples held as aligned numpy arrays: example ``i`` is row ``i`` of every array.

    Arrays may be stored narrow (``uint8`` tokens, ``uint8`` labels) to save memory; rows
    are returned as ``int32``.
    """

    def __init__(self, arrays: Mapping[str, np.ndarray]):
        if not arrays:
            raise ValueError("ArraySource needs at least one array")
        lengths = {k: len(v) for k, v in arrays.items()}
        if len(set(lengths.values())) != 1:
            raise ValueError(f"ArraySource arrays must have equal lengths, got {lengths}")
        self.arrays = {k: np.asarray(v) for k, v in arrays.items()}
        self._len = next(iter(lengths.values()))

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> Example:
        index = int(index)
        if not -self._len <= index < self._len:
            raise IndexError(f"index {index} out of range for {self._len} examples")
        return {k: v[index].astype(np.int32) for k, v in self.arrays.items()}

    def __repr__(self) -> str:
        shapes = {k: (v.shape, str(v.dtype)) for k, v in self.arrays.items()}
        return f"ArraySource({shapes})"


class LazySource:
    """Examples computed on access: ``fn(raw[indices[i]])`` (decoding/tokenising at read time).

    Used where holding the tokenised split in memory would be wasteful (IMDB at 4k bytes,
    AAN pairs, released Pathfinder PNGs). ``indices`` selects a subset (``None``: all).
    """

    def __init__(
        self, raw: Any, fn: Callable[[Any], Example], indices: Sequence[int] | None = None
    ):
        self.raw = raw
        self.fn = fn
        self.indices = None if indices is None else np.asarray(indices, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.raw) if self.indices is None else len(self.indices)

    def __getitem__(self, index: int) -> Example:
        index = int(index)
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"index {index} out of range for {n} examples")
        j = index if self.indices is None else int(self.indices[index])
        return self.fn(self.raw[j])

    def __repr__(self) -> str:
        return f"LazySource(n={len(self)}, fn={getattr(self.fn, '__name__', self.fn)!r})"


def collate(examples: Sequence[Example]) -> Batch:
    """Stack examples into a batch dict: every leaf gets a leading batch axis, int32."""
    keys = examples[0].keys()
    return {k: np.stack([np.asarray(e[k]) for e in examples]).astype(np.int32) for k in keys}


def shuffle_seed(seed: int) -> int:
    """Map a user seed to grain's 32-bit shuffle seed.

    Grain folds the epoch in as ``seed + epoch``; hashing the user seed first keeps seed
    ``k`` epoch 1 from being the same permutation as seed ``k + 1`` epoch 0.
    """
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    return int(np.random.SeedSequence(int(seed)).generate_state(1, dtype=np.uint32)[0])


def iterate_from(ds, start_step: int = 0, *, num_threads: int = 0, prefetch: int = 2):
    """An iterator over the ``grain.MapDataset`` `ds` from index `start_step` on, read with
    `num_threads` threads and a `prefetch`-deep buffer (its ``get_state``/``set_state`` work)."""
    import grain

    if start_step:
        ds = ds[int(start_step) :]
    options = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch)
    return iter(ds.to_iter_dataset(options))


def check_process(batch_size: int, process_index: int, process_count: int) -> int:
    if not isinstance(batch_size, (int, np.integer)) or batch_size <= 0:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if process_count <= 0 or not 0 <= process_index < process_count:
        raise ValueError(f"need 0 <= {process_index=} < {process_count=}")
    if batch_size % process_count:
        raise ValueError(f"{batch_size=} must be a multiple of {process_count=}")
    return batch_size // process_count


class SplitAccess:
    """Split lookup shared by `Task` and `train.data.images.ImageTask`: both are frozen
    dataclasses with ``name``, ``splits`` (split name -> `Source`) and ``batch_size``."""

    name: str
    splits: Mapping[str, Source]
    batch_size: int

    def source(self, split: str) -> Source:
        """The random-access source of ``split``; a clear error names the known splits."""
        if split not in self.splits:
            raise KeyError(f"task {self.name!r} has no split {split!r}; has {list(self.splits)}")
        return self.splits[split]

    def num_examples(self, split: str) -> int:
        return len(self.source(split))

    def steps_per_epoch(self, batch_size: int | None = None, split: str = "train") -> int:
        """Number of full global batches in one pass over ``split``."""
        batch_size = self.batch_size if batch_size is None else batch_size
        return self.num_examples(split) // batch_size


@dataclasses.dataclass(frozen=True, eq=False)
class Task(SplitAccess):
    """One LRA task: its splits and the facts a model needs.

    Attributes:
      name: task name (``listops``, ``text``, ``retrieval``, ``image``, ``pathfinder``).
      splits: split name (``train``, ``val``, ``test``) -> random-access source.
      vocab_size: number of token ids; ids are in ``[0, vocab_size)``, 0 is padding
        (for image tasks 0 is also the black pixel: images have no padding).
      num_classes: number of target classes; targets are in ``[0, num_classes)``.
      seq_len: length ``T`` of every ``inputs`` row (of each of ``inputs1``/``inputs2``).
      is_pair: whether examples are pairs (retrieval): keys ``inputs1``, ``inputs2``.
      batch_size: default global batch size of the batch methods.
      seed: default shuffle seed of the training stream.
      info: provenance (files, generation parameters, label counts per split).

    Batches are dicts of numpy arrays: ``inputs`` int32 ``[B, T]`` (pair tasks:
    ``inputs1``, ``inputs2``), ``targets`` int32 ``[B]``; evaluation batches add
    ``mask`` bool ``[B]`` (False on rows that pad the last batch).
    """

    name: str
    splits: Mapping[str, Source] = dataclasses.field(repr=False)  # see ImageTask.splits
    vocab_size: int
    num_classes: int
    seq_len: int
    is_pair: bool
    batch_size: int = 32
    seed: int = 0
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def input_keys(self) -> tuple[str, ...]:
        """The token keys of a batch: ``("inputs",)`` or ``("inputs1", "inputs2")``."""
        return ("inputs1", "inputs2") if self.is_pair else ("inputs",)

    # ---------------------------------------------------------------- training stream
    def train_dataset(
        self,
        batch_size: int | None = None,
        *,
        seed: int | None = None,
        split: str = "train",
        process_index: int = 0,
        process_count: int = 1,
    ):
        """The endless, shuffled training stream as a ``grain.MapDataset`` of batches.

        ``ds[step]`` is the (per-process) batch at global step ``step``; random access, so
        any step can be read without replaying the ones before it.
        """
        import grain  # deferred: grain takes ~1 s to import

        batch_size = self.batch_size if batch_size is None else batch_size
        seed = self.seed if seed is None else seed
        local = check_process(batch_size, process_index, process_count)
        src = self.source(split)
        if len(src) == 0:
            raise ValueError(f"task {self.name!r} split {split!r} is empty")
        ds = grain.MapDataset.source(src).shuffle(seed=shuffle_seed(seed)).repeat()
        if process_count > 1:
            ds = ds[process_index::process_count]
        return ds.batch(local, drop_remainder=True, batch_fn=collate)

    def train_batch(self, step: int, batch_size: int | None = None, **kwargs) -> Batch:
        """The training batch at ``step`` (same keyword arguments as ``train_dataset``)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return self.train_dataset(batch_size, **kwargs)[int(step)]

    def train_batches(
        self,
        batch_size: int | None = None,
        *,
        seed: int | None = None,
        start_step: int = 0,
        split: str = "train",
        num_threads: int = 0,
        prefetch: int = 2,
        process_index: int = 0,
        process_count: int = 1,
    ) -> Iterator[Batch]:
        """Endless iterator over training batches ``start_step, start_step + 1, ...``.

        Deterministic given ``(seed, batch_size)``: resuming at ``start_step=s`` gives the
        same batches as the uninterrupted run from step ``s`` on. ``num_threads > 0`` reads
        examples with grain's thread pool (useful for lazily decoded sources). The returned
        grain iterator also offers ``get_state()``/``set_state()``.
        """

        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        ds = self.train_dataset(
            batch_size,
            seed=seed,
            split=split,
            process_index=process_index,
            process_count=process_count,
        )
        return iterate_from(ds, start_step, num_threads=num_threads, prefetch=prefetch)

    # ---------------------------------------------------------------- evaluation
    def num_eval_batches(self, split: str, batch_size: int | None = None) -> int:
        batch_size = self.batch_size if batch_size is None else batch_size
        return math.ceil(self.num_examples(split) / batch_size)

    def eval_batches(
        self,
        split: str,
        batch_size: int | None = None,
        *,
        process_index: int = 0,
        process_count: int = 1,
    ) -> Iterator[Batch]:
        """One ordered pass over ``split`` in global batches of ``batch_size``.

        The last batch is padded to full size with all-zero rows, flagged by ``mask``
        (bool ``[B]``, True on real examples) so a jitted eval step sees one shape.
        """
        batch_size = self.batch_size if batch_size is None else batch_size
        local = check_process(batch_size, process_index, process_count)
        src = self.source(split)
        n = len(src)
        if n == 0:
            return
        blank = {k: np.zeros_like(np.asarray(v), dtype=np.int32) for k, v in src[0].items()}
        for b in range(self.num_eval_batches(split, batch_size)):
            positions = b * batch_size + process_index + process_count * np.arange(local)
            rows = [src[int(p)] if p < n else blank for p in positions]
            batch = collate(rows)
            batch["mask"] = positions < n
            yield batch
