"""The one error a missing data set raises."""

from __future__ import annotations

from collections.abc import Sequence


class DatasetNotFoundError(FileNotFoundError):
    """A data set is not on disk (nothing is ever downloaded).

    The message names the data set, every place it was looked for, and the steps that
    prepare it. ``dataset``, ``looked_in`` and ``how_to_prepare`` are kept as attributes
    so a command line can print them separately.
    """

    def __init__(self, dataset: str, looked_in: Sequence[str], how_to_prepare: str):
        self.dataset = dataset
        self.looked_in = tuple(str(p) for p in looked_in)
        self.how_to_prepare = how_to_prepare
        where = "\n".join(f"  - {p}" for p in self.looked_in) or "  (nowhere)"
        super().__init__(
            f"data set {dataset!r} is not on disk (nothing is downloaded at run time).\n"
            f"Looked for it in:\n{where}\n"
            f"To prepare it:\n{how_to_prepare}"
        )

    def __reduce__(self):  # keep it picklable (multiprocessing, pytest-xdist)
        return (type(self), (self.dataset, self.looked_in, self.how_to_prepare))
