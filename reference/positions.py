"""Which prompt positions' logits a golden keeps, and the sparse file that keeps them.

At the 30B's vocabulary (202048) one position of float32 logits is 0.8 MB, so a 16K-token prompt
is 13 GB of all-position logits. `--logits-positions` keeps some rows (`last`, `-256:`,
`0,5,100:120`: Python slice syntax over prompt positions, negative from the end) and `--logits-topk K`
keeps the K largest logits of each kept row instead of the whole row.

POSITIONS_FORMAT, the `.positions.npz` golden:
  positions  int64 [n]          the prompt positions kept, ascending, no repeats
  n_vocab    int64 []           the vocabulary the rows come from
  logits     float32 [n, V]     the whole rows                                   (without top-k)
  top_ids    int32 [n, k]       the k largest logits' token ids, largest first   (with top-k)
  top_logits float32 [n, k]     their logits
  logsumexp  float32 [n]        log(sum(exp(row))) of each whole row, from float64, so that
                                top_logits - logsumexp are the log-probabilities
"""
import argparse

import numpy as np

from . import artifacts
from .cli import strict_int

POSITIONS_FORMAT = __doc__.split("POSITIONS_FORMAT, ")[1]
SUFFIX = ".positions.npz"
MAX_ITEMS = 4096  # items in one spec: a list longer than that is a range
TOPK_BLOCK = 16  # kept rows reduced to their top-k at a time (26 MB of float64 a pass at the 30B's vocabulary)


def parse_positions(text):  # argparse type: "last" | "-256:" | "0,5,100:120" -> [int | slice]
    """Parsed before the prompt is known; `resolve` turns it into positions once it is."""
    items = text.split(",")
    if not text or len(items) > MAX_ITEMS:
        raise argparse.ArgumentTypeError(f"expected 'last' or comma-separated positions and start:stop ranges "
                                         f"(at most {MAX_ITEMS} items), got {text[:80]!r}")
    return [parse_item(item, text) for item in items]


def parse_item(item, text):  # "last" | "5" | "-256:" | "100:120" -> int | slice
    if item == "last":
        return -1
    parts = item.split(":")
    try:
        if len(parts) == 1:
            return strict_int(parts[0], negative=True)
        if len(parts) == 2:
            return slice(*(strict_int(p, negative=True) if p else None for p in parts))
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"bad position {item!r} in {text[:80]!r} (a number, 'last' or start:stop)")


def resolve(spec, n):  # [int | slice], prompt length -> int64 [m] ascending unique positions
    """A position outside the prompt is an error, not silently dropped; an empty range selects nothing."""
    chosen = []
    for item in spec:
        if isinstance(item, slice):
            chosen.extend(range(*item.indices(n)))
        elif -n <= item < n:
            chosen.append(item % n)
        else:
            raise ValueError(f"position {item} is outside a prompt of {n} tokens")
    if not chosen:
        raise ValueError(f"the positions select none of the prompt's {n} tokens")
    return np.unique(np.asarray(chosen, np.int64))


def clamped(spec, n):  # [int | slice], prompt length -> ["a:b runs as c:d"] for ranges reaching past the prompt
    """A range is cut to the prompt as Python cuts a slice; the caller says so in one warning line."""
    def bound(b):
        return "" if b is None else str(b)
    return [f"{bound(item.start)}:{bound(item.stop)} runs as {start}:{stop}"
            for item in spec if isinstance(item, slice)
            and any(b is not None and not -n <= b <= n for b in (item.start, item.stop))
            for start, stop, _ in [item.indices(n)]]


def top_k(rows, k):  # [n, V] -> (ids int32 [n, k] largest first, logits float32 [n, k], logsumexp float32 [n])
    k = min(k, rows.shape[1])
    ids = np.argpartition(rows, -k, axis=1)[:, -k:]
    picked = np.take_along_axis(rows, ids, axis=1)
    order = np.argsort(-picked, axis=1, kind="stable")
    ids, picked = np.take_along_axis(ids, order, axis=1), np.take_along_axis(picked, order, axis=1)
    return ids.astype(np.int32), picked.astype(np.float32), logsumexp(rows).astype(np.float32)


def logsumexp(rows):  # [n, V] -> float64 [n]
    r = rows.astype(np.float64)
    peak = r.max(axis=1, keepdims=True)
    return (peak + np.log(np.exp(r - peak).sum(axis=1, keepdims=True)))[:, 0]


def sparse_golden(rows, positions, n_vocab, k=None):  # [n, V] kept rows -> the arrays of POSITIONS_FORMAT
    golden = {"positions": np.asarray(positions, np.int64), "n_vocab": np.int64(n_vocab)}
    if k is None:
        golden["logits"] = np.asarray(rows, np.float32)
    else:
        golden["top_ids"], golden["top_logits"], golden["logsumexp"] = top_k(rows, k)
    return golden


def output_rows(spec, n, written, every_row):  # spec or None (all), prompt length -> (rows, kept)
    """rows: the prompt rows the output head computes, int64 [r] ascending, or None for all of
    them (`every_row`: a trace or a drafter reads them, or whole logits are `written`); kept: the
    positions a written golden holds, int64 [m]. The last row is always computed: decoding reads it.
    ValueError for positions outside the prompt."""
    kept = resolve(spec, n) if spec is not None else np.arange(n)
    if every_row or (written and spec is None):
        return None, kept
    return np.union1d(kept if written else [], [n - 1]).astype(np.int64), kept


def write_logits(path, logits, rows, kept, n_vocab, sparse, k=None, error=artifacts.ArtifactError):
    """logits [len(rows) or T, V] of the prompt `rows` (None: all) -> `path`: the whole float32
    .npy, or with `sparse` (positions kept, or top-k asked) POSITIONS_FORMAT of the `kept` rows."""
    if not sparse:
        artifacts.save_npy(path, logits.astype(np.float32), error)
        return
    at = kept if rows is None else np.searchsorted(rows, kept)
    if k is None:
        golden = sparse_golden(logits[at], kept, n_vocab)
    else:  # block by block: top-k's index and float64 passes take 8 bytes x vocabulary a row
        blocks = [sparse_golden(logits[at[i:i + TOPK_BLOCK]], kept[i:i + TOPK_BLOCK], n_vocab, k)
                  for i in range(0, len(at), TOPK_BLOCK)]
        golden = {key: np.concatenate([b[key] for b in blocks]) if blocks[0][key].ndim else blocks[0][key]
                  for key in blocks[0]}
    artifacts.save_npz(path, golden, error)
