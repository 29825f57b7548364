"""Pure functions from C4 JSON lines to fixed-length token windows (no Ray, no I/O).

Shared by the distributed training pipeline and the local held-out set, so that both cut text
exactly the same way.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

import numpy as np


def parse_c4_lines(lines: Iterable[str]) -> tuple[list[str], int]:
    """The `text` of each JSON-lines record, and how many records were skipped.

    A record is skipped (counted, never raised) when the line does not parse, is not a JSON
    object, or has no non-empty string `text`: one bad line in a multi-GB crawl must not stop a
    training run, but the count makes silent data loss visible. Blank lines are not records.
    """
    texts: list[str] = []
    skipped = 0
    for line in lines:
        if not line or not line.strip():
            continue
        try:
            record = json.loads(line)
        # Any exception, not just ValueError: deep nesting ("[[[[...") raises RecursionError,
        # and one line of the crawl must not fail the Ray Data task that reads it.
        except Exception:
            skipped += 1
            continue
        text = record.get("text") if isinstance(record, dict) else None
        if isinstance(text, str) and text:
            texts.append(text)
        else:
            skipped += 1
    return texts, skipped


def pack_documents(
    token_lists: Sequence[Sequence[int]], eos_id: int, seq_len: int
) -> tuple[np.ndarray, int]:
    """Concatenate documents, each followed by EOS, and cut the stream into full windows.

    Returns (windows int32 [n, seq_len], tail_tokens_dropped). The last partial window
    (< seq_len tokens) is dropped rather than padded: padding would waste compute and needs a
    loss mask, and the loss is at most one window per pack batch.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    total = sum(len(t) for t in token_lists) + len(token_lists)
    stream = np.empty(total, dtype=np.int64)
    pos = 0
    for tokens in token_lists:
        stream[pos : pos + len(tokens)] = tokens
        pos += len(tokens)
        stream[pos] = eos_id
        pos += 1
    if total and (stream.min() < 0 or stream.max() > np.iinfo(np.int32).max):
        raise ValueError("token ids must fit in int32 (0 <= id < 2**31)")
    n = total // seq_len
    windows = stream[: n * seq_len].reshape(n, seq_len).astype(np.int32)
    return windows, total - n * seq_len
