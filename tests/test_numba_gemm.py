"""The exact mode's prefill GEMM (accel/numba/quant.py matmul_tiles and its microkernel gemm_tile):
its sums within their derived error bound against a float64 product, and each output's bits
independent of the batch around it. accel/harness.py checks its products against
reference/ops.py linear on every weight type (tests/test_numba.py test_harness_case)."""
import numpy as np
import pytest

from conftest import require

require("numba")  # the [accel] extra

from gguf import GGMLQuantizationType as GT  # noqa: E402
from numba import njit  # noqa: E402

from accel.numba import quant  # noqa: E402
from reference.random_blocks import random_weights  # noqa: E402

UNIT_ROUNDOFF = {np.float32: 2.0 ** -24, np.float64: 2.0 ** -53}


@njit
def gemm_tile(w, x, depth, acc):  # the intrinsic, callable from Python
    quant.gemm_tile(w, x, depth, acc)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("depth", [1, 77, quant.GEMM_DEPTH])
def test_gemm_tile_sums_within_the_float_bound(dtype, depth):
    rng = np.random.default_rng(depth)
    rows = 2 * quant.VECTOR_BYTES // np.dtype(dtype).itemsize
    w = rng.standard_normal((quant.GEMM_DEPTH, rows)).astype(dtype)
    x = rng.standard_normal((quant.GEMM_DEPTH, quant.GEMM_TOKENS)).astype(dtype)
    start = rng.standard_normal((quant.GEMM_TOKENS, rows))  # the float64 sums it adds to
    acc = start.copy()
    gemm_tile(w, x, depth, acc)
    products = x[:depth, :, None].astype(np.float64) * w[:depth, None, :]  # [depth, tokens, rows], exact
    # a sum of `depth` products in dtype, each FMA rounding once: |error| <= gamma_depth sum |w x|,
    # gamma_n = n u / (1 - n u) (Higham, Accuracy and Stability of Numerical Algorithms, 3.1); then
    # one rounding of the float64 addition, at most 2^-53 of a magnitude below |start| + sum |w x|
    n_u = depth * UNIT_ROUNDOFF[dtype]
    magnitude = np.abs(products).sum(0)
    bound = n_u / (1 - n_u) * magnitude + 2.0 ** -52 * (np.abs(start) + magnitude)
    assert np.all(np.abs(acc - (start + products.sum(0))) <= bound)
    assert np.any(acc != start)  # every output was written: the bound alone would pass a kernel adding 0


def gemm(qtype, blocks, x):  # -> matmul_tiles's [T, n_out] in x's dtype
    out = np.empty((len(x), len(blocks)), x.dtype)
    quant.matmul_tiles(int(qtype), blocks, x, out, quant.TABLES)
    return out


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_each_output_is_the_same_whatever_the_batch(dtype):
    """An output's sum runs over its own row and token only, in a fixed order, so a token's result
    does not depend on the tokens batched with it, nor on the band its row falls in: the same bits
    in every batch (the padding of the last token block and row band included)."""
    rng = np.random.default_rng(1)
    n_out, n_in, T = 75, 768, 2 * quant.GEMM_TOKENS + 5
    blocks = quant.as_blocks(random_weights(GT.Q4_K, n_out, n_in, rng), n_out)
    x = rng.standard_normal((T, n_in)).astype(dtype)
    full = gemm(GT.Q4_K, blocks, x)
    order = rng.permutation(T)
    assert np.array_equal(gemm(GT.Q4_K, blocks, x[order]), full[order])
    assert np.array_equal(gemm(GT.Q4_K, blocks, x[3:8]), full[3:8])  # one token block, padded
    assert np.array_equal(gemm(GT.Q4_K, blocks[5:], x), full[:, 5:])  # every row in another band
