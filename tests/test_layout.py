"""The layout rules of ``train/``, checked by walking every module's imports (ast, nothing run).

- configs are data: ``train/configs`` imports only the standard library, ``ml_collections``
  and ``train.configs``;
- no module imports another module's underscore names (``from m import _x``, ``m._x``, or a
  module whose own name is private);
- ``train`` reaches the mechanisms only through the public top level of ``linattn_jax``
  (``la.get``, ``la.core``, ``la.linen``, ... : the names in ``linattn_jax.__all__``) and
  the ``linattn_jax.core`` / ``linattn_jax.linen`` modules;
- nothing but the entry points imports ``train.cli``;
- ``train.workloads`` is the only library module that imports the data, the models and the
  losses together (entry points, which only wire them, are exempt);
- nothing imports a workload into existence: no config imports a model or data module;
- no file in ``train/``, ``linattn_jax/`` or ``kernels/`` is over 600 lines;
- no function there is over 120 lines (the ``def`` node's ``lineno .. end_lineno``), the
  config builders aside (``get_config`` in ``train/configs/``, `FUNCTION_LENGTH_EXEMPT`).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import linattn_jax as la

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "train"
#: The packages the length rules cover (tests, notebooks and scripts aside).
PACKAGES = ("train", "linattn_jax", "kernels")
MAX_LINES = 600
MAX_FUNCTION_LINES = 120

#: Functions exempt from the function-length rule, as ``(path glob, function name)``: the
#: config builders, which are data (one assignment per hyperparameter), not logic.
FUNCTION_LENGTH_EXEMPT = {("train/configs/*.py", "get_config")}

#: Entry points: run as ``python -m ...``; the only importers of ``train.cli``. Any
#: ``__main__.py`` is one too.
ENTRY_POINTS = {
    "train/lm.py",
    "train/vision.py",
    "train/results.py",
}

#: Files over the line limit that other issues own, with why (agreed exceptions only).
LONG_FILE_EXCEPTIONS: dict[str, str] = {
    "linattn_jax/flexformer.py": "two mechanisms x two feature kinds, their four public entry "
    "points and the kernel-inspection helpers (kernel, trig_kernel, shift_invariance_gap, "
    "spectral_samples); the helpers are the part to move to a module of their own",
}

#: Modules that read mechanism internals beyond ``la.get`` / ``la.core`` / ``la.linen``
#: (agreed exceptions only): module -> the linattn_jax submodules it imports.
LINATTN_EXCEPTIONS: dict[str, set[str]] = {
    # the kernel-recovery benchmark reads the learned frequencies and temperature
    # (flexformer.spectral_samples, log_temperature_scale), which the record does not carry
    "train/bench/kernel_fit.py": {"linattn_jax.flexformer"},
}

#: ``train.configs`` modules that may import one named ``train`` module (agreed exceptions).
CONFIG_IMPORT_EXCEPTIONS: dict[str, set[str]] = {}

ALLOWED_LINATTN = {"linattn_jax", "linattn_jax.core", "linattn_jax.linen"}


def _files():
    return sorted(p for p in TRAIN.rglob("*.py") if "__pycache__" not in p.parts)


def _package_files():
    """Every module of `PACKAGES`."""
    return sorted(
        p
        for package in PACKAGES
        for p in (ROOT / package).rglob("*.py")
        if "__pycache__" not in p.parts
    )


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _package(path: Path) -> str:
    name = _module_name(path)
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _resolve(path: Path, node: ast.ImportFrom) -> str:
    """The absolute module name of a ``from X import ...`` (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    base = _package(path).split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(path: Path):
    """``(module, names, node)`` of every import in `path`; for ``from m import a`` the
    module is ``m`` and names ``[a]``; for ``import m`` names is empty."""
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, [], node
        elif isinstance(node, ast.ImportFrom):
            yield _resolve(path, node), [a.name for a in node.names], node


def _is_repo_module(dotted: str) -> bool:
    """Whether `dotted` names a module or package of this repository."""
    candidate = ROOT / Path(*dotted.split("."))
    return candidate.with_suffix(".py").exists() or (candidate / "__init__.py").exists()


def _imported_modules(path: Path) -> set[str]:
    """Every module `path` imports (``from pkg import sub`` counts ``pkg.sub`` when it is a
    module of this repository)."""
    out = set()
    for module, names, _ in _imports(path):
        out.add(module)
        out.update(f"{module}.{n}" for n in names if _is_repo_module(f"{module}.{n}"))
    return out


def _is_entry(path: Path) -> bool:
    return path.name == "__main__.py" or _rel(path) in ENTRY_POINTS


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _bound_modules(path: Path) -> dict[str, str]:
    """Local name -> module for ``import m [as n]`` and ``from p import m [as n]`` (m a
    module), to catch ``n._private`` attribute reads."""
    tree = ast.parse(path.read_text(), str(path))
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(path, node)
            for a in node.names:
                if _is_repo_module(f"{base}.{a.name}"):
                    out[a.asname or a.name] = f"{base}.{a.name}"
    return out


def test_configs_are_data():
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    bad = []
    for path in (TRAIN / "configs").glob("*.py"):
        allowed = CONFIG_IMPORT_EXCEPTIONS.get(_rel(path), set())
        for module in _imported_modules(path):
            top = module.split(".")[0]
            if top in stdlib or top == "ml_collections" or module in allowed:
                continue
            if (
                module == "train"
                or module == "train.configs"
                or module.startswith("train.configs.")
            ):
                continue
            bad.append(f"{_rel(path)} imports {module}")
    assert not bad, "configs must be data only:\n" + "\n".join(bad)


def _private_attribute_reads(path: Path) -> list[str]:
    """``m._name`` reads in `path` of a module `m` it imports, as failure lines."""
    modules = _bound_modules(path)
    return [
        f"{_rel(path)}:{node.lineno} reads {modules[node.value.id]}.{node.attr}"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id in modules
        and _private(node.attr)
    ]


def test_no_private_names_across_modules():
    bad = []
    for path in _files():
        for module, names, node in _imports(path):
            if any(_private(part) for part in module.split(".")):
                bad.append(f"{_rel(path)}:{node.lineno} imports private module {module}")
            for n in names:
                if _private(n):
                    bad.append(f"{_rel(path)}:{node.lineno} imports {module}.{n}")
        bad += _private_attribute_reads(path)
    assert not bad, "no module may use another module's underscore names:\n" + "\n".join(bad)


def test_no_private_names_across_library_modules():
    """In linattn_jax and kernels no module uses another module's underscore names (a
    package's private modules, e.g. ``linattn_jax._checks``, may be imported inside that
    package; what they define for others is public-named)."""
    bad = []
    for path in _package_files():
        if _rel(path).startswith("train/"):
            continue  # train/ has the stricter rule above
        top = _module_name(path).split(".")[0]
        for module, names, node in _imports(path):
            inside = module.split(".")[0] == top
            if any(_private(part) for part in module.split(".")) and not inside:
                bad.append(f"{_rel(path)}:{node.lineno} imports private module {module}")
            for n in names:
                if _private(n) and not (_is_repo_module(f"{module}.{n}") and inside):
                    bad.append(f"{_rel(path)}:{node.lineno} imports {module}.{n}")
        bad += _private_attribute_reads(path)
    assert not bad, "no module may use another module's underscore names:\n" + "\n".join(bad)


def test_mechanisms_only_through_the_public_api():
    public = set(la.__all__)
    bad = []
    for path in _files():
        allowed = ALLOWED_LINATTN | LINATTN_EXCEPTIONS.get(_rel(path), set())
        for module, names, node in _imports(path):
            if module.split(".")[0] != "linattn_jax":
                continue
            if module not in allowed:
                bad.append(f"{_rel(path)}:{node.lineno} imports {module}")
            elif module == "linattn_jax":
                bad += [
                    f"{_rel(path)}:{node.lineno} imports linattn_jax.{n}"
                    for n in names
                    if n not in public and f"linattn_jax.{n}" not in allowed
                ]
        modules = _bound_modules(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and modules.get(node.value.id) == "linattn_jax"
                and node.attr not in public
            ):
                bad.append(f"{_rel(path)}:{node.lineno} reads linattn_jax.{node.attr}")
    assert not bad, "train reaches mechanisms only through la.get / la.core / la.linen:\n" + (
        "\n".join(bad)
    )


def test_only_entry_points_import_the_cli():
    bad = [
        _rel(path)
        for path in _files()
        if not _is_entry(path)
        and path != TRAIN / "cli.py"
        and "train.cli" in _imported_modules(path)
    ]
    assert not bad, f"only entry points may import train.cli: {bad}"


def _touches(modules: set[str], package: str) -> bool:
    return any(m == package or m.startswith(package + ".") for m in modules)


def test_only_workloads_joins_data_models_and_losses():
    bad = []
    for path in _files():
        if _is_entry(path) or path == TRAIN / "workloads.py":
            continue
        mods = _imported_modules(path)
        if all(_touches(mods, p) for p in ("train.data", "train.models", "train.losses")):
            bad.append(_rel(path))
    assert not bad, f"only train/workloads.py may import data, models and losses together: {bad}"


def test_no_workload_registered_by_import():
    for path in (TRAIN / "configs").glob("*.py"):
        mods = _imported_modules(path)
        for package in (
            "train.models",
            "train.lm",
            "train.vision",
            "train.loop",
            "train.workloads",
        ):
            assert not _touches(mods, package), f"{_rel(path)} imports {package}"
    src = (ROOT / "train" / "workloads.py").read_text()
    assert "WORKLOADS: dict[str, Workload] = {" in src  # one literal table


def test_file_length():
    long = {
        _rel(p): n for p in _package_files() if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    bad = {f: n for f, n in long.items() if f not in LONG_FILE_EXCEPTIONS}
    assert not bad, f"files over {MAX_LINES} lines (split them): {bad}"


def test_long_file_exceptions_are_still_needed():
    stale = [
        f
        for f in LONG_FILE_EXCEPTIONS
        if not (ROOT / f).exists() or len((ROOT / f).read_text().splitlines()) <= MAX_LINES
    ]
    assert not stale, f"remove these from LONG_FILE_EXCEPTIONS (fixed or gone): {stale}"


def _exempt(path: Path, name: str) -> bool:
    return any(
        path.relative_to(ROOT).match(pattern) and name == fn
        for pattern, fn in FUNCTION_LENGTH_EXEMPT
    )


def test_function_length():
    long = []
    for path in _package_files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            n = node.end_lineno - node.lineno + 1
            if n > MAX_FUNCTION_LINES and not _exempt(path, node.name):
                long.append(f"{_rel(path)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them):\n" + "\n".join(long)


def test_function_length_exemptions_match_something():
    exempt = [
        (_rel(p), node.name)
        for p in _package_files()
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.FunctionDef) and _exempt(p, node.name)
    ]
    assert exempt, f"FUNCTION_LENGTH_EXEMPT names no function: {FUNCTION_LENGTH_EXEMPT}"


def _module_graph():
    """Module -> the modules of this repository it imports (at any depth of its code, so a
    function-level import counts), over `PACKAGES`; packages' ``__init__`` left out (they
    gather their modules' names for users)."""
    files = {_module_name(p): p for p in _package_files() if p.name != "__init__.py"}
    return {name: sorted(_imported_modules(p) & set(files) - {name}) for name, p in files.items()}


def _cycles(graph):
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    """The modules of train/, linattn_jax/ and kernels/ import one another without a circle,
    function-level imports included (a circle hidden inside a function is still one)."""
    assert _cycles(_module_graph()) == []


def test_every_mechanism_and_kernel_module_has_its_test_file():
    """The tests mirror the modules: a module that defines a registered mechanism, and each
    kernel of `kernels`, has ``tests/test_<module>.py``."""
    modules = {la.get(n).attention_fn.__module__.rpartition(".")[2] for n in la.names()}
    modules |= {"l1_distance", "newton_schulz"}
    missing = sorted(m for m in modules if not (ROOT / "tests" / f"test_{m}.py").exists())
    assert not missing, f"modules without tests/test_<module>.py: {missing}"


def test_registered_functions_are_the_functions_users_read():
    """A record's functions are plain ``def`` s of their module, under their own names (no
    wrapper rewriting ``__name__`` / ``__doc__`` or the signature): what ``inspect``, an IDE
    and grep show is what the registry calls."""
    import inspect
    import sys

    bad = []
    for name in la.names():
        mech = la.get(name)
        for field in ("init_fn", "attention_fn", "reference_fn", "flax_fn"):
            fn = getattr(mech, field)
            if fn is None:
                continue
            module = sys.modules[fn.__module__]
            source = inspect.getsource(fn).lstrip()
            if getattr(module, fn.__qualname__, None) is not fn or not source.startswith(
                f"def {fn.__name__}("
            ):
                bad.append(f"{name}.{field} = {fn.__module__}.{fn.__qualname__}")
    assert not bad, "registered functions that are not their module's def:\n" + "\n".join(bad)


MAX_DOCSTRING_LINES = 80


def test_docstrings_are_specifications_not_notebooks():
    """No docstring in the library or the training stack is over `MAX_DOCSTRING_LINES`
    lines: measurements and their history belong in docs/, with the commands behind them."""
    bad = []
    for path in _package_files():
        tree = ast.parse(path.read_text())
        nodes = [tree] + [
            n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.ClassDef)
        ]
        for node in nodes:
            doc = ast.get_docstring(node, clean=False)
            if doc and doc.count("\n") + 1 > MAX_DOCSTRING_LINES:
                bad.append(f"{_rel(path)}:{getattr(node, 'name', '<module>')}")
    assert not bad, f"docstrings over {MAX_DOCSTRING_LINES} lines: {bad}"
