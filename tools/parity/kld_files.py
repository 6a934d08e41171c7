"""Base-logits files: llama-perplexity's .kld (read memory-mapped, written whole through a temporary
file) and the float32 .npz base of --kl-divergence-base-f32 (KLD_F32_FORMAT), each read back as a
base that gives a chunk's per-token KL terms against a model's logits."""
import json
import os

import numpy as np

from reference import artifacts
from tools.parity.perplexity_arithmetic import (F32, kld_terms_f32, kld_terms_top_k, kld_terms_uint16, n_scored,
                                                row_width)

MAGIC = b"_logits_"
HEADER_BYTES = len(MAGIC) + 12  # n_ctx, n_vocab, n_chunk
KLD_F32_FORMAT = ("npz: n_ctx, n_vocab int64 [], tokens int32 [n_chunk * n_ctx], and either log_probs float32 "
                  "[n_chunk, n_scored, n_vocab] (log-softmax in float64, rounded) or, with --kl-top-k K, "
                  "top_ids int32 and top_log_probs float32 [n_chunk, n_scored, K] (most likely first) and "
                  "next_log_probs float32 [n_chunk, n_scored] (the scored token's); n_scored = n_ctx - 1 - n_ctx//2; "
                  "numerics str [] (how the reference computed it, the line the run printed; absent from older bases), "
                  "provenance str [] (JSON: reference.provenance's record of the run; absent from older bases)")


class KldError(Exception):
    """A base-logits file that is not what llama-perplexity writes; one-line message."""


class KldBase:
    """A base read back: n_ctx, n_vocab, tokens [n_chunk, n_ctx] i32, rows [n_chunk, n_scored, nv] u16
    (a read-only memory map: a base of the 30B vocabulary may be many GB)."""
    numerics = None  # llama-perplexity's format records no numerics

    def __init__(self, n_ctx, n_vocab, tokens, rows):
        self.n_ctx, self.n_vocab, self.tokens, self.rows = n_ctx, n_vocab, tokens, rows

    @property
    def n_chunk(self):  # -> chunks in the base
        return len(self.tokens)

    def terms(self, chunk, logits):  # chunk index, Q logits [n_scored, V] -> kl_terms
        return kld_terms_uint16(logits, self.rows[chunk], self.tokens[chunk, self.n_ctx // 2 + 1:])


def kld_size(n_ctx, n_vocab, n_chunk):  # -> the byte size of such a .kld file
    return HEADER_BYTES + 4 * n_ctx * n_chunk + 2 * n_chunk * n_scored(n_ctx) * row_width(n_vocab)


def read_kld_header(path):  # -> (n_ctx, n_vocab, n_chunk), checked against the file's size
    with artifacts.open_regular(path, KldError, what=".kld base") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(HEADER_BYTES)
    if len(head) < HEADER_BYTES or head[:8] != MAGIC:
        raise KldError(f"{path}: not a llama-perplexity .kld file (no _logits_ header)")
    n_ctx = int(np.frombuffer(head, np.uint32, 1, 8)[0])
    n_vocab, n_chunk = (int(v) for v in np.frombuffer(head, np.int32, 2, 12))
    if n_ctx < 4 or n_vocab < 1 or n_chunk < 1:
        raise KldError(f"{path}: header n_ctx {n_ctx}, n_vocab {n_vocab}, n_chunk {n_chunk} is not a base")
    want = kld_size(n_ctx, n_vocab, n_chunk)  # Python ints: a corrupt header cannot overflow or allocate
    if size != want:
        raise KldError(f"{path}: {size} bytes, but n_ctx {n_ctx}, n_vocab {n_vocab}, n_chunk {n_chunk} "
                       f"make {want} ({'truncated' if size < want else 'trailing bytes'})")
    return n_ctx, n_vocab, n_chunk


def read_kld(path):  # -> KldBase
    n_ctx, n_vocab, n_chunk = read_kld_header(path)
    tokens = np.memmap(path, np.int32, "r", HEADER_BYTES, (n_chunk, n_ctx))
    bad = (tokens < 0) | (tokens >= n_vocab)
    if bad.any():
        raise KldError(f"{path}: token {int(tokens[bad][0])} is outside the vocabulary of {n_vocab}")
    rows = np.memmap(path, np.uint16, "r", HEADER_BYTES + tokens.nbytes, (n_chunk, n_scored(n_ctx), row_width(n_vocab)))
    check_row_heads(path, rows)
    return KldBase(n_ctx, n_vocab, tokens, rows)


def check_row_heads(path, rows):  # [n_chunk, n_scored, nv] u16 -> None; KldError unless every row can be decoded
    """A row decodes as scale * code + min_log_prob: a NaN or Inf there (or a negative scale, or a
    min_log_prob above 0) makes every statistic of the row NaN or 0, which would print as a result."""
    for i in range(rows.shape[0]):  # chunk by chunk: the rows of a 30B base are GBs
        head = np.ascontiguousarray(rows[i, :, :4]).view(F32)  # [n_scored, 2]: scale, min_log_prob
        bad = ~np.isfinite(head).all(axis=1) | (head[:, 0] < 0) | (head[:, 1] > 0)
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            raise KldError(f"{path}: chunk {i} row {row} has scale {head[row, 0]}, min_log_prob {head[row, 1]}: "
                           "not a base llama-perplexity writes (finite, scale >= 0, min_log_prob <= 0)")


class KldWriter:
    """Writes a .kld file as llama-perplexity does: the header and tokens first, then chunk rows,
    into a temporary file beside `path` that replaces it at close() (reference.artifacts): an
    interrupted or failed run leaves an older base whole."""

    def __init__(self, path, n_ctx, n_vocab, tokens):  # tokens [n_chunk * n_ctx]
        self.path, self.writing = path, artifacts.writing(path, KldError)
        self.file = self.writing.__enter__()
        self.write_bytes(MAGIC + np.array([n_ctx], np.uint32).tobytes())
        self.write_bytes(np.array([n_vocab, len(tokens) // n_ctx], np.int32).tobytes())
        self.write_bytes(np.asarray(tokens, np.int32).tobytes())

    def write_bytes(self, data):  # -> None; a full disk names the base
        try:
            self.file.write(data)
        except OSError as e:
            self.discard()
            raise artifacts.write_failed(self.path, e, KldError) from None

    def write(self, rows):  # [n_scored, nv] u16 -> None
        self.write_bytes(np.ascontiguousarray(rows, np.uint16).tobytes())

    def close(self):  # -> None, the file complete under its name
        writing, self.writing = self.writing, None
        writing.__exit__(None, None, None)

    def discard(self):  # -> None: the temporary goes, an older base stays
        if self.writing is not None:
            writing, self.writing = self.writing, None
            writing.__exit__(KldError, KldError("discarded"), None)


def top_k_rows(log_probs, next_ids, k):  # [N, V] f64, [N], k -> {top_ids [N, k], top_log_probs, next_log_probs}
    top = np.argsort(-log_probs, axis=1, kind="stable")[:, :k]  # descending; ties by id
    return {"top_ids": top.astype(np.int32), "top_log_probs": np.take_along_axis(log_probs, top, 1).astype(F32),
            "next_log_probs": log_probs[np.arange(len(log_probs)), next_ids].astype(F32)}


def write_f32_base(path, n_ctx, n_vocab, tokens, chunks, numerics, record=None):  # chunks: [{name: [n_scored, ...]}] -> KLD_F32_FORMAT
    arrays = {name: np.stack([c[name] for c in chunks]) for name in chunks[0]}
    made_by = {"provenance": np.array(json.dumps(record))} if record else {}
    artifacts.save_npz(path, {"n_ctx": np.int64(n_ctx), "n_vocab": np.int64(n_vocab),
                              "tokens": np.asarray(tokens, np.int32), **arrays, "numerics": np.array(numerics),
                              **made_by}, KldError)


def read_f32_base(path):  # -> dict of KLD_F32_FORMAT's arrays, tokens as [n_chunk, n_ctx], checked
    artifacts.check_zip(path, KldError, f"{KLD_F32_FORMAT.split(':')[0]} base")
    try:
        with artifacts.open_regular(path, KldError, what="npz base") as f, np.load(f, allow_pickle=False) as z:
            base = {name: z[name] for name in z.files}
        n_ctx, n_vocab, tokens = (base[k] for k in ("n_ctx", "n_vocab", "tokens"))
    except (ValueError, KeyError, TypeError, OSError, EOFError) as e:
        raise KldError(f"{path}: not a {KLD_F32_FORMAT.split(':')[0]} base ({e})") from None
    if n_ctx.shape != () or n_vocab.shape != () or n_ctx.dtype.kind not in "iu" or n_vocab.dtype.kind not in "iu" \
            or tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise KldError(f"{path}: n_ctx and n_vocab must be integers, tokens a list of ids")
    n_ctx, n_vocab = int(n_ctx), int(n_vocab)
    n_chunk = len(tokens) // max(n_ctx, 1)
    rows = base.get("log_probs", base.get("top_ids"))
    if n_ctx < 4 or n_vocab < 1 or len(tokens) != n_chunk * n_ctx or rows is None or rows.ndim != 3 \
            or rows.shape[:2] != (n_chunk, n_scored(n_ctx)) or ("log_probs" in base and rows.shape[2] != n_vocab):
        raise KldError(f"{path}: the arrays {', '.join(f'{k} {v.shape}' for k, v in base.items())} do not fit "
                       f"n_ctx {n_ctx}, n_vocab {n_vocab}")
    if not all(np.isfinite(base[k]).all() for k in ("log_probs", "top_log_probs", "next_log_probs") if k in base):
        raise KldError(f"{path}: holds log-probabilities that are not finite")
    if "top_ids" in base and (base.get("top_log_probs", rows[:0]).shape != rows.shape
                              or base.get("next_log_probs", rows[:0]).shape != rows.shape[:2]):
        raise KldError(f"{path}: top_log_probs and next_log_probs do not fit top_ids {rows.shape}")
    for name in ("tokens", "top_ids"):
        if name in base and base[name].size and not 0 <= base[name].min() <= base[name].max() < n_vocab:
            raise KldError(f"{path}: a token of {name} is outside the vocabulary of {n_vocab}")
    if "numerics" in base and (base["numerics"].shape != () or base["numerics"].dtype.kind != "U"):
        raise KldError(f"{path}: numerics must be one string, not {base['numerics'].dtype} {base['numerics'].shape}")
    base["tokens"] = tokens.reshape(n_chunk, n_ctx)
    return base


class F32Base:
    """A --kl-divergence-base-f32 base: the same chunks, full-precision log-probabilities of every
    token, or (written with --kl-top-k) of the k most likely ones and of the scored token."""

    def __init__(self, path):
        self.arrays = read_f32_base(path)
        self.n_ctx, self.n_vocab, self.tokens = int(self.arrays["n_ctx"]), int(self.arrays["n_vocab"]), self.arrays["tokens"]
        self.numerics = str(self.arrays["numerics"]) if "numerics" in self.arrays else None  # numerics_line

    @property
    def n_chunk(self):  # -> chunks in the base
        return len(self.tokens)

    def terms(self, chunk, logits):  # chunk index, Q logits [n_scored, V] -> kl_terms
        next_ids, a = self.tokens[chunk, self.n_ctx // 2 + 1:], self.arrays
        if "log_probs" in a:
            return kld_terms_f32(logits, a["log_probs"][chunk], next_ids)
        return kld_terms_top_k(logits, a["top_ids"][chunk], a["top_log_probs"][chunk], a["next_log_probs"][chunk],
                               next_ids)
