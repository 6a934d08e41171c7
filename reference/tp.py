"""Tensor parallelism simulated in NumPy, with the sharding a multi-GPU engine uses for this model.

- q, k, v and the attention gate are column-parallel by head: rank r owns heads
  [r*H/N, (r+1)*H/N) and kv heads [r*Hkv/N, (r+1)*Hkv/N), so a GQA group never straddles ranks
  (hence N <= n_head_kv). ffn_gate and ffn_up are column-parallel per segment of n_ff/N rows.
  Column-parallel products are the same dot products as on one device: nothing to simulate.
- attn_output and ffn_down are row-parallel: rank r multiplies its own input columns and the ranks'
  f32 partial products are summed (the all-reduce), in rank order, on the raw product, *before* the
  1e-8 post-norm. The post-norm is not linear: reducing after it changes the result (tests/test_tp.py
  plants that bug and shows it is caught).
- Norms, embeddings and the output head are replicated.

On GPUs the same plan runs one process per device with the all-reduce as NCCL's ncclAllReduce
(cupy.cuda.nccl.NcclCommunicator.allReduce on each rank's partial, ncclSum, on the compute stream)
after attn_output and after ffn_down; nothing else needs communication within a layer.
"""
import numpy as np

from . import ops
from .backend import NumpyBackend

ROW_PARALLEL = ("attn_output.weight", "ffn_down.weight")


class TPError(Exception):
    pass


def check_tp(cfg, n_ranks):  # TextConfig, N -> None; the sharding must split heads and n_ff evenly
    if n_ranks < 1 or cfg.n_head_kv % n_ranks or cfg.n_ff % n_ranks:
        raise TPError(f"--tp {n_ranks} must divide n_head_kv ({cfg.n_head_kv}) and n_ff ({cfg.n_ff})")


class TensorParallelBackend(NumpyBackend):
    """NumpyBackend whose row-parallel products are N partial products summed like an all-reduce."""

    def __init__(self, dtype, n_ranks):
        super().__init__(dtype)
        self.n_ranks = n_ranks

    def linear(self, x, w):  # x [T, in], w a GGUF tensor [out, in] -> [T, out]
        if not w.name.endswith(ROW_PARALLEL):
            return super().linear(x, w)
        w = w.get(np.float64)
        shard = x.shape[1] // self.n_ranks  # heads (attn_output) or n_ff segments (ffn_down)
        return self.all_reduce([ops.linear(x[:, r * shard:(r + 1) * shard], w[:, r * shard:(r + 1) * shard])
                                for r in range(self.n_ranks)])

    def all_reduce(self, partials):  # [[T, out] per rank] -> [T, out]: ncclSum, in rank order
        reduced = partials[0]
        for p in partials[1:]:
            reduced = reduced + p
        return reduced
