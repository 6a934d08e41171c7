"""llama-perplexity's float arithmetic, row by row (tools/perplexity/perplexity.cpp): glibc's expf,
the sequential double sums, log_softmax into the .kld file's u16 rows, the negative log-likelihoods,
and the per-token terms of kl_divergence_result, float32 where the C++ rounds to float32."""
import ctypes
import ctypes.util
import functools
import math

import numpy as np

from reference.ggml_cpu import libm

F32, F64 = np.float32, np.float64
LOG_RANGE = F32(16)  # llama-perplexity stores log-probabilities down to max - 16
SUM_ROWS = 16  # rows per block of sequential_sum


def n_scored(n_ctx):  # -> scored positions per chunk: [n_ctx/2, n_ctx - 1)
    return n_ctx - 1 - n_ctx // 2


def row_width(n_vocab):  # -> u16 per stored row: 4 (scale, min_log_prob) + n_vocab padded to even
    return 2 * ((n_vocab + 1) // 2) + 4


@functools.lru_cache(maxsize=None)
def expf_loop():  # -> numba-compiled (x [n] f32, out [n] f32) -> None calling glibc's expf, or None
    """NumPy's exp, even in float64 and rounded, differs from glibc's expf in ~6 of 10000 values;
    the C library's own function is called, from a compiled loop where numba is installed."""
    try:
        import numba
    except ImportError:
        return None
    c_expf = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6").expf
    c_expf.restype, c_expf.argtypes = ctypes.c_float, [ctypes.c_float]

    @numba.njit
    def loop(x, out):
        for i in range(x.size):
            out[i] = c_expf(x[i])
    return loop


def expf(x):  # [...] f32 -> [...] f32: glibc's expf, as llama-perplexity calls it
    x = np.ascontiguousarray(x, F32)
    loop = expf_loop()
    if loop is None:
        return libm("expf", x)  # one ctypes call per value: exact, slow
    out = np.empty_like(x)
    loop(x.ravel(), out.ravel())
    return out


def sequential_sum(x):  # [N, V] f32 -> [N] f64: `double sum += x[i]` in index order
    # a few rows at a time: the float64 running sums of 255 rows of the 30B's vocabulary are 0.8 GB
    return np.concatenate([np.add.accumulate(np.asarray(x[i:i + SUM_ROWS], F64), axis=1)[:, -1]
                           for i in range(0, len(x), SUM_ROWS)])


def log_sum_exp(logits, max_logit):  # [N, V] f32, [N] f32 -> (sum_exp [N] f64, f32 log(sum_exp) [N])
    sum_exp = sequential_sum(expf(logits - max_logit[:, None]))
    return sum_exp, np.array([math.log(s) for s in sum_exp], F32)  # math.log: glibc's log, as the C++


def uint16_rows(logits, fused=False):  # [N, V] f32 -> [N, row_width(V)] u16: log_softmax(n_vocab, logits, uint16_t *)
    """fused: llama-perplexity built by aarch64 GCC, which contracts nearest_int's `fval + 12582912.f`
    with the product `inv_scale*(logits[i] - min_logit)` into one FMA (-ffp-contract=fast, the
    inlined nearest_int of tools/perplexity/perplexity.cpp:72-77, 101): the product is not rounded
    to float32 first. clang contracts only within one expression, so its builds round the product.
    On x86-64 only ggml is compiled for the CPU's features (GGML_NATIVE, the
    GGML_AVX* flags); the tools are built for baseline x86-64, which has no FMA, so the product rounds."""
    n, V = logits.shape
    max_logit = logits.max(axis=1)
    min_logit = np.maximum(logits.min(axis=1), max_logit - LOG_RANGE)
    _, lse = log_sum_exp(logits, max_logit)
    scale = (max_logit - min_logit) / F32(65535)
    with np.errstate(divide="ignore"):
        inv_scale = np.where(scale != 0, F32(1) / scale, F32(0))
    # nearest_int(): +1.5*2^23 rounds half to even; 65536 (never seen) would wrap as the C++ stores it
    # fused: the float64 product of two float32s is exact, and adding 1.5*2^23 then rounds it to the
    # nearest integer, ties to even, as np.rint does
    product = (np.asarray(inv_scale, F64)[:, None] * np.asarray(logits - min_logit[:, None], F64) if fused
               else inv_scale[:, None] * (logits - min_logit[:, None]))
    codes = np.rint(product).astype(np.int64) & 0xFFFF
    rows = np.zeros((n, row_width(V)), np.uint16)
    rows[:, 4:4 + V] = np.where(logits > min_logit[:, None], codes, 0)
    rows[:, :4] = np.stack([scale, (min_logit - max_logit) - lse], axis=1).astype(F32).view(np.uint16)
    return rows


def nll_written(logits, next_ids):  # [N, V] f32, [N] -> [N] f64: what the .kld writer adds to nll
    max_logit = logits.max(axis=1)
    _, lse = log_sum_exp(logits, max_logit)
    return ((max_logit + lse) - logits[np.arange(len(logits)), next_ids]).astype(F64)


def nll_plain(logits, next_ids):  # [N, V] f32, [N] -> [N] f64: the other log_softmax, without a file
    max_logit = logits.max(axis=1)
    sum_exp, _ = log_sum_exp(logits, max_logit)
    shifted = logits[np.arange(len(logits)), next_ids] - max_logit  # f32, then a double log
    return -(shifted.astype(F64) - np.array([math.log(s) for s in sum_exp]))


def decode_rows(rows, n_vocab):  # [N, row_width] u16 -> [N, n_vocab] f32 log-probabilities
    head = np.ascontiguousarray(rows[:, :4]).view(F32)  # [N, 2]: scale, min_log_prob
    return head[:, :1] * rows[:, 4:4 + n_vocab].astype(F32) + head[:, 1:]


def kld_terms_uint16(logits, rows, next_ids):  # [N, V] f32, [N, nv] u16, [N] -> KLD terms (kl_terms)
    """log_softmax(n_vocab, logits, base_log_prob, tok, kld): float32 where the C++ is float."""
    n, V = logits.shape
    at = np.arange(n), next_ids
    max_logit = logits.max(axis=1)
    _, lse = log_sum_exp(logits, max_logit)
    nll = (max_logit + lse) - logits[at]
    log_base = decode_rows(rows, V)
    nll_base = -log_base[at]
    shifted = (max_logit + lse)[:, None]
    term = expf(log_base) * ((log_base - logits) + shifted)
    kld = sequential_sum(np.where(log_base > F32(-16), term, F32(0)))
    p_diff = expf(-nll) - expf(-nll_base)
    return kl_terms(nll, nll * nll, nll_base, nll_base * nll_base, nll * nll_base, kld, p_diff,
                    np.argmax(logits, axis=1) == np.argmax(log_base, axis=1))


def kld_terms_f32(logits, log_base, next_ids):  # [N, V], [N, V] f32 log-probs, [N] -> terms in float64
    at = np.arange(len(logits)), next_ids
    log_q = log_softmax64(logits)
    log_base = np.asarray(log_base, F64)
    nll, nll_base = -log_q[at], -log_base[at]
    kld = np.sum(np.exp(log_base) * (log_base - log_q), axis=1)
    p_diff = np.exp(-nll) - np.exp(-nll_base)
    return kl_terms(nll, nll * nll, nll_base, nll_base * nll_base, nll * nll_base, kld, p_diff,
                    np.argmax(logits, axis=1) == np.argmax(log_base, axis=1))


def kld_terms_top_k(logits, top_ids, top_lp, next_lp, next_ids):  # [N, V], [N, k] x2, [N], [N] -> kl_terms
    """The base's k most likely tokens, the rest of its mass as one more outcome: a lower bound of
    the KLD (the log-sum inequality), exact for k = n_vocab; PPL, Δp and the top token are exact."""
    log_q = log_softmax64(logits)
    at = np.arange(len(logits)), next_ids
    lp_base, lq = np.asarray(top_lp, F64), np.take_along_axis(log_q, top_ids.astype(np.int64), 1)
    outside = np.ones(log_q.shape, bool)
    np.put_along_axis(outside, top_ids.astype(np.int64), False, 1)
    rest_q = np.sum(np.exp(log_q) * outside, axis=1)  # summed, not 1 - top: no cancellation
    rest_base = np.maximum(1 - np.sum(np.exp(lp_base), axis=1), 0.0)  # float32 rounding only, for k = n_vocab
    with np.errstate(divide="ignore", invalid="ignore"):
        rest = np.where((rest_base > 0) & (rest_q > 0), rest_base * (np.log(rest_base) - np.log(rest_q)), 0.0)
    kld = np.sum(np.exp(lp_base) * (lp_base - lq), axis=1) + rest
    nll, nll_base = -log_q[at], -np.asarray(next_lp, F64)
    p_diff = np.exp(-nll) - np.exp(-nll_base)
    return kl_terms(nll, nll * nll, nll_base, nll_base * nll_base, nll * nll_base, kld, p_diff,
                    np.argmax(logits, axis=1) == top_ids[:, 0])


def log_softmax64(logits):  # [N, V] -> [N, V] f64
    z = np.asarray(logits, F64)
    z = z - z.max(axis=1, keepdims=True)
    return z - np.log(np.sum(np.exp(z), axis=1, keepdims=True))


def kl_terms(nll, nll2, nll_base, nll_base2, nll_nll_base, kld, p_diff, same_top):  # -> dict of [N]
    """The per-token values kl_divergence_result sums, each as the C++ rounds it before the sum:
    p_diff*p_diff is a float product, its square a double one; the KLD value kept for the
    percentiles is (float) of the double sum."""
    p_diff = np.asarray(p_diff)
    p_diff2 = (p_diff * p_diff).astype(F64)
    kld = np.asarray(kld, F64)
    return {"nll": nll, "nll2": nll2, "nll_base": nll_base, "nll_base2": nll_base2,
            "nll_nll_base": nll_nll_base, "kld": kld, "kld2": kld * kld, "p_diff": p_diff,
            "p_diff2": p_diff2, "p_diff4": p_diff2 * p_diff2, "same_top": same_top,
            "kld_value": kld.astype(F32), "p_diff_value": p_diff.astype(F32)}
