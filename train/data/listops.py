"""ListOps (LRA): generator, exact evaluator, tokenizer, TSV reader/writer, task builder.

Rules (LRA's ``lra_benchmarks/data/listops.py``, re-implemented):

* A tree node at depth ``d`` (the root has ``d = 1``) is an operator only if
  ``d < max_depth``, and then only with probability ``value_p`` (0.25); otherwise it is a
  digit ``0..9``. (The name is LRA's ``VALUE_P``; its code makes a *digit* when
  ``random() > VALUE_P``, so 0.25 is the operator probability.) So trees are at most
  ``max_depth`` (10) levels deep counting the leaf level, i.e. at most
  ``max_depth - 1`` nested operators.
* An operator is one of ``[MIN [MAX [MED [SM`` (SM = sum mod 10) applied to
  ``2..max_args`` (10) arguments, closed by ``]``.
* Length = number of tokens once the parentheses are dropped (operators, digits and
  ``]``), the count LRA's generator keeps (a digit counts 1, an operator node counts 2
  plus its arguments) and exactly the number of tokens the model sees. LRA keeps a tree
  when ``min_length < length < max_length`` (both bounds *exclusive*): with the defaults
  ``500 < length < 2000``, so every example fits ``seq_len = 2000`` untruncated.
* Examples are unique (as LRA's ``set``); the first ``num_train`` generated go to train,
  then ``num_val``, then ``num_test``. Deviation from LRA: generation order is kept (LRA
  iterates a Python ``set``, whose order depends on the hash seed), and the random stream
  stops early on a tree that already reached ``max_length`` (it would be rejected anyway,
  so the distribution of accepted trees is unchanged), which makes generation fast.
* MED is ``int(numpy.median(args))`` as in LRA: for an even count, the mean of the two
  middle values truncated, i.e. ``(a + b) // 2`` (all values are non-negative), e.g.
  ``[MED 1 2 ] = 1``, ``[MED 3 8 ] = 5``.

Text format (LRA's released ``basic_{train,val,test}.tsv``): a header ``Source\\tTarget``,
then one ``<expression>\\t<label>`` per line, the expression written with LRA's
parentheses: ``[MAX 2 9 ]`` is ``( ( ( [MAX 2 ) 9 ) ] )``.

Tokenizer (LRA after its bracket fix: parentheses dropped, ``]`` kept as a token):
``0 = PAD``, digit ``k -> k + 1`` (1..10), ``[MIN 11, [MAX 12, [MED 13, [SM 14, ] 15``;
``vocab_size = 16``; rows right-padded with 0 (truncated, as LRA, if longer than
``seq_len``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from . import config_keys as _config
from .errors import DatasetNotFoundError
from .pipeline import ArraySource, Task

OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
CLOSE = "]"
PAD_ID = 0
VOCAB = ("<pad>", *"0123456789", *OPERATORS, CLOSE)  # token string by id
VOCAB_SIZE = len(VOCAB)  # 16
NUM_CLASSES = 10
SPLITS = ("train", "val", "test")
LRA_FILES = {s: f"basic_{s}.tsv" for s in SPLITS}

# Internal one-character-per-token form ("compact"): digits, a/b/c/d for the operators, "]".
_OP_CHARS = "abcd"
_OP_OF_CHAR = dict(zip(_OP_CHARS, OPERATORS, strict=True))
_LUT = np.full((256,), 255, dtype=np.uint8)  # compact byte -> token id (255 = invalid)
for _i, _ch in enumerate("0123456789" + _OP_CHARS + CLOSE):
    _LUT[ord(_ch)] = _i + 1


@dataclasses.dataclass(frozen=True)
class ListOpsSpec:
    """Generation parameters. Defaults are LRA's (``variant="full"``)."""

    min_length: int = 500  # exclusive lower bound on the token count
    max_length: int = 2000  # exclusive upper bound on the token count
    max_depth: int = 10
    max_args: int = 10
    value_p: float = 0.25  # LRA's VALUE_P: P(operator) for a node above the depth cap
    num_train: int = 96_000
    num_val: int = 2_000
    num_test: int = 2_000
    seed: int = 0

    def __post_init__(self):
        if not 0 <= self.min_length < self.max_length - 1:
            raise ValueError(f"need 0 <= {self.min_length=} < {self.max_length=} - 1")
        if self.max_depth < 2 or self.max_args < 2:
            raise ValueError(f"need {self.max_depth=} >= 2 and {self.max_args=} >= 2")
        if not 0.0 < self.value_p < 1.0:
            raise ValueError(f"value_p must be in (0, 1), got {self.value_p}")
        if min(self.num_train, self.num_val, self.num_test) < 0:
            raise ValueError("split sizes must be >= 0")

    @property
    def num_examples(self) -> int:
        return self.num_train + self.num_val + self.num_test

    def cache_name(self) -> str:
        return (
            f"len{self.min_length}-{self.max_length}_depth{self.max_depth}_args{self.max_args}"
            f"_p{self.value_p:g}_n{self.num_train}-{self.num_val}-{self.num_test}_seed{self.seed}"
        )


MINI = ListOpsSpec(min_length=20, max_length=100, num_train=5_000, num_val=500, num_test=500)
FULL = ListOpsSpec()
SEQ_LEN = {"mini": 128, "full": 2000}


# ----------------------------------------------------------------------------- generator
def generate_compact(spec: ListOpsSpec) -> list[str]:
    """``spec.num_examples`` unique expressions in compact form, in generation order.

    Reproducible: a ``random.Random(spec.seed)`` stream (Python's Mersenne Twister, stable
    across platforms and versions) drives every draw.
    """
    rng = random.Random(spec.seed)
    rand = rng.random  # bound once: this loop is the whole cost of generation
    max_depth, max_length, value_p = spec.max_depth, spec.max_length, spec.value_p
    arg_span = spec.max_args - 1  # number of arguments: 2 + floor(U * (max_args - 1))

    def grow(depth: int, out: list[str], force_operator: bool = False) -> bool:
        """Append one random subtree to ``out``; False once it reached max_length."""
        if not force_operator and (depth >= max_depth or rand() > value_p):
            out.append("0123456789"[int(rand() * 10)])
            return len(out) < max_length
        slot = len(out)
        out.append("")  # the operator, drawn after its arguments as LRA does
        for _ in range(2 + int(rand() * arg_span)):
            if not grow(depth + 1, out):
                return False
        out[slot] = "abcd"[int(rand() * 4)]
        out.append(CLOSE)
        return len(out) < max_length

    # A lone digit (length 1) is kept only when min_length == 0; otherwise the root must
    # be an operator, and drawing it as one directly only skips trees LRA would reject.
    force_root = spec.min_length >= 1
    seen: dict[str, None] = {}
    stale = 0  # draws since the last new example: bounds the loop for impossible specs
    while len(seen) < spec.num_examples:
        out: list[str] = []
        stale += 1
        if grow(1, out, force_root) and spec.min_length < len(out) < max_length:
            before = len(seen)
            seen.setdefault("".join(out), None)
            stale = 0 if len(seen) > before else stale
        if stale > 1_000_000:
            raise RuntimeError(
                f"found only {len(seen)} unique ListOps expressions of the "
                f"{spec.num_examples} requested with {spec}; widen the length bounds"
            )
    return list(seen)


def generate(spec: ListOpsSpec) -> dict[str, tuple[list[str], np.ndarray]]:
    """Generate the three splits: split -> (LRA-format expressions, int32 labels)."""
    exprs = generate_compact(spec)
    labels = np.array([_evaluate_compact(e) for e in exprs], dtype=np.int32)
    bounds = np.cumsum([0, spec.num_train, spec.num_val, spec.num_test])
    return {
        split: ([_render_lra(_parse(e)) for e in exprs[a:b]], labels[a:b])
        for split, a, b in zip(SPLITS, bounds[:-1], bounds[1:], strict=True)
    }


# ----------------------------------------------------------------------------- formats
def _compact_bytes(expression: str) -> np.ndarray:
    """Any ListOps text (LRA's with parentheses, or without) -> compact uint8 chars."""
    s = expression.replace("(", " ").replace(")", " ")
    for op, ch in zip(OPERATORS, _OP_CHARS, strict=True):
        s = s.replace(op, ch)
    try:
        raw = np.frombuffer(s.encode("ascii"), dtype=np.uint8)
    except UnicodeEncodeError as e:
        raise ValueError(f"non-ASCII character in ListOps expression {expression[:80]!r}") from e
    nonspace = raw != ord(" ")
    chars = raw[nonspace]
    starts = nonspace & ~np.concatenate([[False], nonspace[:-1]])
    # every token must be one compact char: a digit 0-9, a known operator, or "]"
    if int(starts.sum()) != len(chars) or (_LUT[chars] == 255).any():
        bad = [t for t in expression.replace("(", " ").replace(")", " ").split() if t not in VOCAB]
        raise ValueError(f"unknown ListOps token(s) {bad[:5]} in {expression[:80]!r}")
    return chars


def compact(expression: str) -> str:
    """Compact one-char-per-token form of ``expression`` (digits, a-d for operators, ``]``)."""
    return _compact_bytes(expression).tobytes().decode("ascii")


def tokens(expression: str) -> list[str]:
    """The model's tokens of ``expression``: parentheses dropped, e.g. ``['[MAX', '2', ']']``."""
    return [VOCAB[i] for i in _LUT[_compact_bytes(expression)]]


def _parse(c: str) -> Any:
    """Compact string -> nested (operator, [args]) tree; digits become ints."""
    stack: list[tuple[str, list]] = []
    root = None
    for ch in c:
        if root is not None:
            raise ValueError(f"tokens after the end of the expression in {c[:80]!r}")
        if ch in _OP_OF_CHAR:
            stack.append((_OP_OF_CHAR[ch], []))
            continue
        if ch == CLOSE:
            if not stack:
                raise ValueError(f"unmatched ']' in {c[:80]!r}")
            node = stack.pop()
            if not node[1]:
                raise ValueError(f"operator {node[0]} without arguments in {c[:80]!r}")
        else:
            node = int(ch)
        if stack:
            stack[-1][1].append(node)
        else:
            root = node
    if stack or root is None:
        raise ValueError(f"unclosed or empty expression {c[:80]!r}")
    return root


def _render_lra(node) -> str:
    if isinstance(node, int):
        return str(node)
    op, args = node
    # LRA's tree is ((((op, a1), a2), ...), "]"): one "( ... )" per pair
    return "( " * (len(args) + 1) + op + "".join(f" {_render_lra(a)} )" for a in args) + " ] )"


def to_lra_string(expression: str) -> str:
    """LRA's text form (``to_string`` with parentheses) of any ListOps expression."""
    return _render_lra(_parse(compact(expression)))


def apply_operator(op: str, args: Sequence[int]) -> int:
    """Value of one operator on its argument values, as LRA's ``to_value`` computes it."""
    if not args:
        raise ValueError(f"{op} needs at least one argument")
    if op == "[MIN":
        return min(args)
    if op == "[MAX":
        return max(args)
    if op == "[SM":
        return sum(args) % 10
    if op == "[MED":
        s = sorted(args)
        n = len(s)
        # int(np.median(s)): the mean of the two middle values, truncated (values >= 0)
        return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) // 2
    raise ValueError(f"unknown ListOps operator {op!r}")


def _evaluate_compact(c: str) -> int:
    stack: list[tuple[str, list[int]]] = []
    result = None
    for ch in c:
        if result is not None:
            raise ValueError(f"tokens after the end of the expression in {c[:80]!r}")
        if ch in _OP_OF_CHAR:
            stack.append((_OP_OF_CHAR[ch], []))
            continue
        if ch == CLOSE:
            if not stack:
                raise ValueError(f"unmatched ']' in {c[:80]!r}")
            op, args = stack.pop()
            value = apply_operator(op, args)
        else:
            value = ord(ch) - ord("0")
        if stack:
            stack[-1][1].append(value)
        else:
            result = value
    if stack or result is None:
        raise ValueError(f"unclosed or empty expression {c[:80]!r}")
    return result


def evaluate(expression: str) -> int:
    """Exact value (0..9) of a ListOps expression, with or without LRA's parentheses."""
    return _evaluate_compact(compact(expression))


def encode(expression: str, seq_len: int) -> np.ndarray:
    """Token ids of ``expression`` as an int32 ``[seq_len]`` row (0-padded, truncated)."""
    ids = _LUT[_compact_bytes(expression)][:seq_len]
    out = np.zeros((seq_len,), dtype=np.int32)
    out[: len(ids)] = ids
    return out


def encode_many(expressions: Sequence[str], seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of many expressions: (uint8 ``[N, seq_len]``, full lengths int32 ``[N]``)."""
    out = np.zeros((len(expressions), seq_len), dtype=np.uint8)
    lengths = np.zeros((len(expressions),), dtype=np.int32)
    for i, e in enumerate(expressions):
        ids = _LUT[_compact_bytes(e)]
        lengths[i] = len(ids)
        out[i, : min(len(ids), seq_len)] = ids[:seq_len]
    return out, lengths


def write_tsv(path: str | os.PathLike, expressions: Sequence[str], labels: Sequence[int]) -> None:
    """Write LRA's TSV (``Source\\tTarget`` header); atomic (temp file, then rename)."""
    if len(expressions) != len(labels):
        raise ValueError(f"{len(expressions)=} != {len(labels)=}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="ascii", newline="\n") as f:
        f.write("Source\tTarget\n")
        f.writelines(f"{e}\t{int(y)}\n" for e, y in zip(expressions, labels, strict=True))
    os.replace(tmp, path)


def _iter_tsv(path: str | os.PathLike) -> Iterator[tuple[str, int]]:
    """Yield ``(expression, label)`` from an LRA ListOps TSV (header line optional)."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\r\n")
            if not line or (lineno == 1 and line.startswith("Source")):
                continue
            parts = line.split("\t")
            if len(parts) != 2:
                raise ValueError(f"{path}:{lineno}: expected 'Source<TAB>Target': {line[:80]!r}")
            try:
                yield parts[0], int(parts[1])
            except ValueError as e:
                raise ValueError(f"{path}:{lineno}: target {parts[1]!r} is not an int") from e


def read_tsv(path: str | os.PathLike) -> tuple[list[str], np.ndarray]:
    """Read an LRA ListOps TSV: (expressions as written, int32 labels)."""
    rows = list(_iter_tsv(path))
    return [e for e, _ in rows], np.asarray([y for _, y in rows], dtype=np.int32)


def load_tsv(path: str | os.PathLike, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tokenise an LRA ListOps TSV while streaming it (the text is never held whole).

    Returns (ids uint8 ``[N, seq_len]``, untruncated token counts int32 ``[N]``, labels
    int32 ``[N]``).
    """
    with open(path, "rb") as f:
        upper = sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 24), b"")) + 1
    ids = np.zeros((upper, seq_len), dtype=np.uint8)
    lengths = np.zeros((upper,), dtype=np.int32)
    labels = np.zeros((upper,), dtype=np.int32)
    n = 0
    for n, (expression, label) in enumerate(_iter_tsv(path), 1):
        row = _LUT[_compact_bytes(expression)]
        lengths[n - 1], labels[n - 1] = len(row), label
        ids[n - 1, : min(len(row), seq_len)] = row[:seq_len]
    return ids[:n].copy(), lengths[:n], labels[:n]


# ----------------------------------------------------------------------------- cache
def cache_dir(data_dir: str | os.PathLike, spec: ListOpsSpec) -> Path:
    return Path(data_dir) / "listops" / spec.cache_name()


def prepare(data_dir: str | os.PathLike, spec: ListOpsSpec, *, overwrite: bool = False) -> Path:
    """Generate ``spec`` into ``data_dir/listops/<params>/basic_*.tsv`` unless cached."""
    out = cache_dir(data_dir, spec)
    done = out / "spec.json"
    if done.exists() and not overwrite:
        return out
    start = time.perf_counter()
    splits = generate(spec)
    seconds = time.perf_counter() - start
    for split, (exprs, labels) in splits.items():
        write_tsv(out / LRA_FILES[split], exprs, labels)
    meta = {
        "spec": dataclasses.asdict(spec),
        "generation_seconds": round(seconds, 3),
        "label_counts": {s: np.bincount(y, minlength=10).tolist() for s, (_, y) in splits.items()},
    }
    tmp = done.with_name(f".spec.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, done)  # written last: marks the cache complete
    return out


# ----------------------------------------------------------------------------- task
def spec_from_config(cfg: Mapping[str, Any]) -> ListOpsSpec:
    base = MINI if _config.variant(cfg) == "mini" else FULL
    fields = {f.name for f in dataclasses.fields(ListOpsSpec)} - {"seed"}
    overrides = {k: cfg[k] for k in fields if cfg.get(k) is not None}
    return dataclasses.replace(base, seed=int(cfg.get("data_seed") or 0), **overrides)


def lra_dirs(cfg: Mapping[str, Any]) -> list[Path]:
    """Where released LRA ListOps files are looked for, in order."""
    root = _config.data_dir(cfg)
    dirs = [Path(os.path.expanduser(str(cfg["listops_dir"])))] if cfg.get("listops_dir") else []
    if cfg.get("lra_dir"):
        dirs.append(Path(os.path.expanduser(str(cfg["lra_dir"]))) / "listops-1000")
    return dirs + [root / "lra_release" / "listops-1000", root / "listops-1000"]


def _read_dir(directory: Path, seq_len: int) -> tuple[dict[str, ArraySource], dict[str, Any]]:
    splits, info = {}, {"files": {}, "label_counts": {}, "truncated": {}, "max_tokens": {}}
    for split in SPLITS:
        path = directory / LRA_FILES[split]
        ids, lengths, labels = load_tsv(path, seq_len)
        splits[split] = ArraySource({"inputs": ids, "targets": labels.astype(np.uint8)})
        info["files"][split] = str(path)
        info["label_counts"][split] = np.bincount(labels, minlength=NUM_CLASSES).tolist()
        info["truncated"][split] = int((lengths > seq_len).sum())
        info["max_tokens"][split] = int(lengths.max()) if len(lengths) else 0
    return splits, info


def build_task(cfg: Mapping[str, Any]) -> Task:
    """ListOps ``Task`` from a config dict (see ``train.data.get_task`` for the keys)."""
    variant = _config.variant(cfg)
    seq_len = _config.positive_int(cfg, "seq_len", SEQ_LEN[variant])
    source = _config.choice(cfg, "source", "generated", ("generated", "lra"))
    if source == "lra":
        candidates = lra_dirs(cfg)
        found = next((d for d in candidates if (d / LRA_FILES["train"]).is_file()), None)
        if found is None:
            raise DatasetNotFoundError(
                "listops (LRA release)",
                [d / LRA_FILES["train"] for d in candidates],
                "  Download the LRA release (lra_release.gz from the google-research/"
                "long-range-arena README) on a machine with internet, extract it and set "
                "config.lra_dir to its lra_release/ folder (or config.listops_dir to the folder "
                "holding basic_train.tsv, basic_val.tsv, basic_test.tsv).\n"
                "  Or use the generated data: config.source='generated' (the default), made "
                "by: python -m train.data.prepare listops --data_dir DIR [--variant mini]",
            )
        splits, info = _read_dir(found, seq_len)
        info["source"] = "lra"
    else:
        spec = spec_from_config(cfg)
        directory = cache_dir(_config.data_dir(cfg), spec)
        if not (directory / "spec.json").exists():
            if cfg.get("generate", True) is False:
                raise DatasetNotFoundError(
                    "listops (generated)",
                    [directory],
                    f"  python -m train.data.prepare listops --data_dir {_config.data_dir(cfg)}"
                    f" --variant {variant}   (or leave config.generate unset: generated on use)",
                )
            prepare(_config.data_dir(cfg), spec)
        splits, info = _read_dir(directory, seq_len)
        info.update(source="generated", spec=dataclasses.asdict(spec))
    return Task(
        name="listops",
        splits=splits,
        vocab_size=VOCAB_SIZE,
        num_classes=NUM_CLASSES,
        seq_len=seq_len,
        is_pair=False,
        batch_size=_config.positive_int(cfg, "batch_size", 32),
        seed=int(cfg.get("seed") or 0),
        info=info,
    )
