"""Byte-level tokenizer for the Text (IMDB) and Retrieval (AAN) tasks.

Ids follow LRA's ``tfds.deprecated.text.ByteTextEncoder`` for the bytes themselves
(byte ``b`` -> ``b + 1``, 0 = padding) and put the optional specials after them:

    0 = PAD, 1..256 = bytes 0..255, 257 = CLS, 258 = EOS;  vocab_size = 259

The vocabulary size does not depend on whether CLS/EOS are used, so a model's embedding
table is the same either way.
"""

from __future__ import annotations

import numpy as np

PAD_ID = 0
BYTE_OFFSET = 1
CLS_ID = 257
EOS_ID = 258
BYTE_VOCAB_SIZE = 259


def to_bytes(text: str | bytes | np.ndarray) -> bytes:
    """UTF-8 bytes of ``text`` (tfds yields ``bytes`` from array_record, ``str`` from mocks)."""
    if isinstance(text, np.ndarray):
        text = text.item()
    if isinstance(text, bytes):
        return text
    if isinstance(text, str):
        return text.encode("utf-8")
    raise TypeError(f"text must be str or bytes, got {type(text).__name__}")


def encode_bytes(
    text: str | bytes, seq_len: int, *, add_cls: bool = False, add_eos: bool = False
) -> np.ndarray:
    """Byte-tokenize ``text`` into an int32 ``[seq_len]`` row, truncated then padded with 0.

    With ``add_cls`` the row starts with CLS; with ``add_eos`` EOS follows the last byte
    kept (it survives truncation: the bytes are cut to make room for it).
    """
    if seq_len <= int(add_cls) + int(add_eos):
        raise ValueError(f"{seq_len=} leaves no room for text with {add_cls=}, {add_eos=}")
    room = seq_len - int(add_cls) - int(add_eos)
    data = np.frombuffer(to_bytes(text)[:room], dtype=np.uint8)
    out = np.zeros((seq_len,), dtype=np.int32)
    start = int(add_cls)
    if add_cls:
        out[0] = CLS_ID
    out[start : start + len(data)] = data.astype(np.int32) + BYTE_OFFSET
    if add_eos:
        out[start + len(data)] = EOS_ID
    return out


def decode_bytes(ids: np.ndarray) -> bytes:
    """Inverse of ``encode_bytes`` on the byte ids (specials and padding dropped)."""
    ids = np.asarray(ids)
    keep = ids[(ids >= BYTE_OFFSET) & (ids < BYTE_OFFSET + 256)]
    return (keep - BYTE_OFFSET).astype(np.uint8).tobytes()
