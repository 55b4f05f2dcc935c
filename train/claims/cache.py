"""The run cache of the training claims: a run is reused only under the same key.

A run's key (``run_key.json`` in its directory) is the digest of its full config and the
code version (`code_version`) of the mechanism and training modules. `prepare` moves a
run whose key differs (or that has none: written before keys were kept) aside to
``<run>.stale`` and starts it afresh; a run with the right key and no finished summary is
resumed from its checkpoints by `train.loop.train_and_evaluate` (an interrupted claim
loses at most the steps since the last checkpoint).

A finished run's key and summary are also kept in a tracked ledger (`keep`, at the place
`train.claims.Settings.kept` gives): the workdir holds checkpoints and is not tracked, so
without the ledger a fresh clone would train every run again. `finished` reads the run's
directory first, then its kept copy, under the same key either way.

The code version hashes the ``*.py`` under `CODE_DIRS` except `EXCLUDED`:
``linattn_jax/`` (the mechanisms), ``kernels/`` (their kernels) and ``train/`` (models,
data generators, optimiser, loop, distillation); left out are ``train/claims`` (this
package: the verdicts and the report read runs, they do not make them, so editing a rule
must not retrain hours of runs), ``train/bench``, ``train/bench_activations`` and
``kernels/bench.py`` (benchmarks, which no training module imports). A run's key hashes
only the mechanisms it trains (`run_key`'s ``mechanisms``, default the config's
``attention``): left out are the files private to the other mechanisms, so a change to
laplacian does not rerun softmax's runs. A file is private to a mechanism when it is
reached by imports from the mechanism's module (`mechanism_modules`) and not from the
shared code: everything ``train/`` imports,
with the mechanism modules as dead ends (`private_files`; imports are read from the source
with `ast`: static imports only, and the library imports none of its own modules
dynamically; a file neither side reaches is hashed for every run). This rests on the
shared code calling a mechanism's module only for that mechanism (`linattn_jax.parallel`'s
and the modules' per-mechanism paths, e.g. ra's flax attention). Comments and
docstrings are hashed too: a conservative choice (a docstring edit reruns the runs), since
telling them apart from code would itself be code that can be wrong.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import shutil
from pathlib import Path

CODE_DIRS = ("linattn_jax", "kernels", "train")
EXCLUDED = ("train/claims", "train/bench", "train/bench_activations", "kernels/bench.py")
#: config fields that do not change what a run computes
VOLATILE = ("progress_bar",)
RUN_KEY = "run_key.json"
ROOT = Path(__file__).resolve().parents[2]


def source_files(root: Path = ROOT) -> tuple[str, ...]:
    """The hashed sources: ``*.py`` under `CODE_DIRS` but `EXCLUDED`, relative, sorted."""
    out = []
    for top in CODE_DIRS:
        for path in (Path(root) / top).rglob("*.py"):
            rel = path.relative_to(root).as_posix()
            if not any(rel == e or rel.startswith(e + "/") for e in EXCLUDED):
                out.append(rel)
    return tuple(sorted(out))


def _module_file(root: Path, dotted: str) -> str | None:
    """The source of module `dotted` (``a.b`` -> ``a/b.py`` or ``a/b/__init__.py``)."""
    parts = dotted.split(".")
    if parts[0] not in CODE_DIRS:
        return None
    base = Path(root, *parts)
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path.relative_to(root).as_posix()
    return None


def imported_files(root: Path, rel: str) -> set[str]:
    """The sources under `CODE_DIRS` that file `rel` imports (its direct targets:
    ``from a.b import c`` is ``a/b/c.py`` when c is a module, else ``a/b``'s file)."""
    module = rel.removesuffix(".py").removesuffix("/__init__").split("/")
    package = module if rel.endswith("__init__.py") else module[:-1]
    names = []
    for node in ast.walk(ast.parse((Path(root) / rel).read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            up = package[: len(package) - node.level + 1] if node.level else []
            base = ".".join(up + (node.module.split(".") if node.module else []))
            for a in node.names:
                sub = _module_file(root, f"{base}.{a.name}")
                names.append(f"{base}.{a.name}" if sub else base)
    return {f for n in names if (f := _module_file(root, n)) is not None}


def _reach(root: Path, start, stop=frozenset()) -> set[str]:
    """The files reached by imports from `start`, not entering (nor counting) `stop`."""
    seen, todo = set(), [f for f in start if f not in stop]
    while todo:
        f = todo.pop()
        if f not in seen:
            seen.add(f)
            todo += [g for g in imported_files(root, f) if g not in stop]
    return seen


def private_files(root: Path, modules, every) -> set[str]:
    """The files of the mechanism modules `every` (dotted names) that the run of `modules`
    does not execute: reached from another mechanism's module but neither from the shared
    code (``train/``'s imports, mechanism modules as dead ends) nor from `modules`."""

    def files(names):
        return {f for n in names if (f := _module_file(root, n)) is not None}

    roots = [f for f in source_files(root) if f.startswith("train/")]
    shared = _reach(root, roots, stop=frozenset(files(every)))
    own = _reach(root, files(modules))
    return _reach(root, files(every)) - shared - own


def mechanism_modules(names=None) -> tuple[str, ...]:
    """The modules that define the registered mechanisms `names` (default: every one)."""
    import linattn_jax as la

    return tuple(sorted({la.get(n).init_fn.__module__ for n in (names or la.names())}))


@functools.lru_cache(maxsize=32)
def code_version(root: Path = ROOT, modules: tuple[str, ...] | None = None, every=None) -> str:
    """16 hex digits of the sha256 of the source files (path and bytes, in path order):
    every one, or with `modules` (mechanism modules, dotted) those a run of them executes,
    without the `private_files` of the other mechanism modules (`every`, default
    `mechanism_modules()`)."""
    files = source_files(root)
    if modules is not None:
        skip = private_files(root, modules, every or mechanism_modules())
        files = [f for f in files if f not in skip]
    h = hashlib.sha256()
    for rel in files:
        h.update(rel.encode() + b"\0" + (Path(root) / rel).read_bytes() + b"\0")
    return h.hexdigest()[:16]


def config_digest(config) -> str:
    """16 hex digits of the sha256 of `config` (a ConfigDict or a dict) as sorted JSON,
    without the `VOLATILE` fields."""
    d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    d = {k: v for k, v in d.items() if k not in VOLATILE}
    text = json.dumps(d, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def run_key(config, mechanisms=None, **extra) -> dict:
    """``{"config": digest, "code": version, **extra}``: what a cached run must match
    (`mechanisms`: the registry names the run executes, default ``config.attention``, whose
    code version it takes; `extra`: settings outside the config, e.g. a distillation's stage
    steps)."""
    modules = mechanism_modules(mechanisms or (config.attention,))
    return {"config": config_digest(config), "code": code_version(ROOT, modules), **extra}


def read_key(run_dir: Path) -> dict | None:
    path = Path(run_dir) / RUN_KEY
    return json.loads(path.read_text()) if path.exists() else None


def prepare(run_dir: Path, key: dict, log=print) -> bool:
    """Makes `run_dir` a run of `key`: a directory holding another key (or none) is moved
    to ``<run_dir>.stale`` (replacing an older one); returns True when it was stale."""
    run_dir = Path(run_dir)
    stale = run_dir.exists() and read_key(run_dir) != key
    if stale:
        aside = run_dir.with_name(run_dir.name + ".stale")
        if aside.exists():
            shutil.rmtree(aside)
        run_dir.rename(aside)
        log(f"[claims] stale run moved to {aside} (its config or code changed)")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / RUN_KEY).write_text(json.dumps(key, indent=1) + "\n")
    return stale


def finished(
    run_dir: Path, key: dict, steps: int | None, name: str = "summary.json", copy=None
) -> dict | None:
    """The summary of a run of `key` that reached `steps` (read, not restored), else None:
    from `run_dir`, else from its kept `copy` (`keep`; None: none). A run finished in
    `run_dir` that `copy` lacks is kept there first."""
    summary = _summary(run_dir, key, steps, name)
    if summary is None:
        return None if copy is None else _summary(copy, key, steps, name)
    keep(run_dir, copy, name, overwrite=False)
    return summary


def _summary(run_dir: Path, key: dict, steps: int | None, name: str) -> dict | None:
    path = Path(run_dir) / name
    if read_key(run_dir) != key or not path.exists():
        return None
    summary = json.loads(path.read_text())
    return summary if steps is None or summary.get("steps", steps) == steps else None


def keep(run_dir: Path, copy, name: str = "summary.json", overwrite: bool = True) -> None:
    """Copies the key and the summary `name` of the finished run in `run_dir` to `copy`
    (the run's place in the tracked ledger, `Settings.kept`; None: nothing is kept), so
    that a fresh clone reads the run instead of training it again. Without `overwrite`, a
    copy that already holds a summary under the same key is left as it is. Nothing is done
    without a `copy`, or when `run_dir` holds no keyed summary `name`."""
    run_dir = Path(run_dir)
    key = read_key(run_dir)
    if copy is None or key is None or not (run_dir / name).exists():
        return
    copy = Path(copy)
    if read_key(copy) == key and (copy / name).exists() and not overwrite:
        return
    if copy.exists() and read_key(copy) != key:
        shutil.rmtree(copy)  # another key's copy: its summaries are of another run
    copy.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(run_dir / name, copy / name)
    shutil.copyfile(run_dir / RUN_KEY, copy / RUN_KEY)


def finished_run(config, run_dir: Path, copy=None) -> dict | None:
    """The summary of the training run of `config` in `run_dir` (or its kept `copy`) when
    it finished its ``num_train_steps`` under the current key (`run_key`), else None."""
    return finished(run_dir, run_key(config), int(config.num_train_steps), copy=copy)


def trained(config, run_dir: Path, log=print, copy=None) -> dict:
    """The summary of the training run of `config` in `run_dir`: re-read when finished
    under the same key (`run_key`) there or in its kept `copy`, else trained
    (`train.loop.train_and_evaluate`, which resumes from the run's checkpoints when its key
    matched) and kept in `copy` (`keep`)."""
    from train import loop

    key = run_key(config)  # hashes the code it runs: computed once
    summary = finished(run_dir, key, int(config.num_train_steps), copy=copy)
    if summary is None:
        prepare(run_dir, key, log=log)
        summary = loop.train_and_evaluate(config, run_dir)
        keep(run_dir, copy)
    return summary
