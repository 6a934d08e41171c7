"""KV caches. A cache holds, per layer, K (after QK-norm and RoPE) and V rows plus the absolute
position stored in each row (-1 = empty). Attention always reads the rows a layer has and lets the
mask (ops.causal_visible on those positions) decide what is live.

- Uniform: one row per position (row = pos), n_ctx rows on every layer.
- Ring: the persistent SWA ring. Sliding-window layers keep pad256(n_swa + chunk + 1) rows
  (ring_size), indexed by pos % rows; full layers stay uniform. A chunk of C new tokens needs the
  n_swa - 1 keys before its first token plus its own C rows, so the ring never overwrites a row a
  query of the same chunk can still see.
"""
import os
import resource

import numpy as np


class CacheError(Exception):
    pass


def pad256(n):  # int -> int, rounded up to a multiple of 256 as llama.cpp pads its caches
    return (n + 255) // 256 * 256


class LayerCache:
    """One layer's rows: k/v [rows, Hkv, D], pos [rows]; row = pos % rows (identity when rows >= n_ctx)."""

    def __init__(self, rows, n_head_kv, head_dim, dtype):
        self.k = np.zeros((rows, n_head_kv, head_dim), dtype)
        self.v = np.zeros((rows, n_head_kv, head_dim), dtype)
        self.pos = np.full(rows, -1, np.int64)
        self.rows = rows

    def store(self, positions, k, v):  # positions [T], k/v [T, Hkv, D]
        slots = np.asarray(positions) % self.rows
        self.k[slots], self.v[slots], self.pos[slots] = k, v, positions

    def live(self):  # -> k [S, Hkv, D], v [S, Hkv, D], pos [S]: rows up to the last filled one
        end = n_live(self.pos)
        return self.k[:end], self.v[:end], self.pos[:end]

    def truncate(self, n_keep):  # forget every position >= n_keep (rollback after a rejected draft)
        forget_from(self.pos, n_keep)


def n_live(pos):  # pos [rows] (-1 = empty) -> number of rows up to the last filled one
    return int(np.flatnonzero(pos >= 0).max(initial=-1)) + 1


def forget_from(pos, n_keep):  # pos [rows], in place: every position >= n_keep becomes empty (llama.cpp's seq_rm)
    pos[pos >= n_keep] = -1


def ring_size(n_swa, n_ctx, chunk):  # -> rows of a sliding-window layer's ring (module doc)
    return min(pad256(n_swa + chunk + 1), pad256(n_ctx))


def layer_rows(swa_layers, n_swa, n_ctx, kind, chunk):  # -> [rows of each layer's cache]
    return [ring_size(n_swa, n_ctx, chunk) if kind == "ring" and swa else n_ctx for swa in swa_layers]


def cache_bytes(cfg, n_ctx, kind, chunk, dtype):  # text config (swa_layers, n_swa, n_head_kv, head_dim) -> bytes
    """What KVCache(cfg..., n_ctx, kind, chunk) allocates: K and V rows and a position, per row."""
    rows = sum(layer_rows(cfg.swa_layers, cfg.n_swa, n_ctx, kind, chunk))
    return rows * (2 * cfg.n_head_kv * cfg.head_dim * np.dtype(dtype).itemsize + 8)


def memory_bytes():  # -> what this process may allocate: the machine's memory, or less under `ulimit -v`
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    return physical if limit == resource.RLIM_INFINITY else min(physical, limit)


def check_fits(cfg, n_ctx, kind, chunk, dtype, what):  # -> None; CacheError before a cache that could never be allocated
    """`what` names the context for the message (e.g. the flags that set it)."""
    need, have = cache_bytes(cfg, n_ctx, kind, chunk, dtype), memory_bytes()
    if need > have:
        raise CacheError(f"{what} needs a {need / 2**30:.3g} GiB KV cache, more than the {have / 2**30:.3g} GiB "
                         "of memory here")


class KVCache:
    """Per-layer caches for one sequence; `kind` is "uniform" or "ring"."""

    def __init__(self, n_layer, swa_layers, n_swa, n_ctx, n_head_kv, head_dim, dtype,
                 kind="ring", chunk=2048):
        if kind not in ("uniform", "ring"):
            raise CacheError(f"unknown KV cache kind {kind!r} (ring or uniform)")
        self.kind, self.n_ctx, self.n_swa, self.chunk = kind, n_ctx, n_swa, chunk
        self.layers = [self.new_layer(rows, n_head_kv, head_dim, dtype)
                       for rows in layer_rows(swa_layers[:n_layer], n_swa, n_ctx, kind, chunk)]
        self.n_past = 0

    def new_layer(self, rows, n_head_kv, head_dim, dtype):  # -> one layer's rows (a device cache overrides it)
        return LayerCache(rows, n_head_kv, head_dim, dtype)

    def check_room(self, n_new, batch):  # raise before tokens that would not fit
        if self.n_past + n_new > self.n_ctx:
            raise CacheError(f"context full: {self.n_past} + {n_new} tokens exceed --ctx {self.n_ctx}")
        if self.kind == "ring" and batch > self.chunk:
            raise CacheError(f"a batch of {batch} tokens exceeds the ring's chunk size {self.chunk}")

    def truncate(self, n_keep):  # keep positions [0, n_keep)
        for layer in self.layers:
            layer.truncate(n_keep)
        self.n_past = min(self.n_past, n_keep)
