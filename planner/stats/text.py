"""Calibration text and tokens.

The default text ships with every Python: the docstrings of standard-library modules and their
public classes and functions, gathered at run time (nothing is downloaded, nothing is copied into
this package). Tokens come from the checkpoint's own tokenizer when it has one; otherwise the
UTF-8 bytes of the text, modulo the vocabulary, stand in for token ids (said in the stats file).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import sys
from pathlib import Path

import numpy as np

__all__ = ["default_text", "calibration_ids", "STDLIB_MODULES"]

STDLIB_MODULES = (
    "argparse", "collections", "json", "re", "typing", "functools", "itertools", "pathlib", "subprocess",
    "threading", "decimal", "datetime", "string", "textwrap", "statistics", "csv", "sqlite3", "zipfile",
    "tarfile", "logging", "unittest", "inspect", "email.message", "http.client", "urllib.parse", "socket",
    "heapq", "bisect", "fractions", "difflib", "shutil", "tempfile", "pickletools", "asyncio.tasks",
)  # fmt: skip


def default_text(min_chars: int = 200_000) -> str:
    parts: list[str] = []
    for name in STDLIB_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        for obj in [module, *(v for k, v in sorted(vars(module).items()) if not k.startswith("_"))]:
            if getattr(obj, "__module__", name) != name and obj is not module:
                continue
            doc = inspect.getdoc(obj) if inspect.ismodule(obj) or inspect.isclass(obj) or inspect.isfunction(obj) else None
            if doc:
                parts.append(doc)
        if sum(len(p) for p in parts) >= min_chars:
            break
    return "\n\n".join(parts)


def calibration_ids(path: Path, vocab_size: int, *, text: str | None, tokens: int, seq_len: int) -> tuple[np.ndarray, dict]:
    """(ids of shape (sequences, seq_len), provenance) for `tokens` calibration tokens."""
    source = "python-stdlib-docstrings" if text is None else "user text"
    body = default_text() if text is None else text
    tokenizer_name = "utf-8 bytes mod vocab"
    ids = None
    if any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
            ids = np.array(tok(body, add_special_tokens=False)["input_ids"], dtype=np.int64)
            tokenizer_name = type(tok).__name__
        except Exception:  # a tokenizer that does not load falls back to bytes, and says so
            ids = None
    if ids is None:
        ids = np.frombuffer(body.encode("utf-8"), dtype=np.uint8).astype(np.int64) % vocab_size
    n_seq = max(1, tokens // seq_len)
    need = n_seq * seq_len
    text_tokens = int(ids.size)
    repeated = text_tokens < need
    if repeated:  # a short text is cycled, and the provenance says so
        ids = np.resize(ids, need)
    out = ids[:need].reshape(n_seq, seq_len)
    provenance = {
        "source": source,
        "text_sha256": hashlib.sha256(body.encode()).hexdigest(),
        "python": sys.version.split()[0] if text is None else None,
        "tokenizer": tokenizer_name,
        "sequences": n_seq,
        "sequence_length": seq_len,
        "tokens": need,
        "text_tokens": text_tokens,
        "text_repeated": repeated,
    }
    return out, provenance
