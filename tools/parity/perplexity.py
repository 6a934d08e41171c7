"""Perplexity and KL divergence of the reference, computed as llama.cpp's llama-perplexity computes them
(tools/perplexity/perplexity.cpp), with its command line, its .kld base-logits files and its output.

    python -m tools.perplexity -m M.gguf -f TEXT -c N [-b N] [--chunks K]          perplexity
    python -m tools.perplexity -m M.gguf -f TEXT -c N --kl-divergence-base REF.kld  ... and write a base
    python -m tools.perplexity -m M.gguf --kl-divergence-base BASE.kld --kl-divergence   KL statistics
    python -m tools.perplexity --compare-kld ENGINE.kld REF.kld        two bases, without a model
    (the reference's own: --numerics exact|ggml-cpu, --backend numpy|numba, --dtype float32|float64,
     with ggml-cpu -fa, -ctk/-ctv, -nr/--no-repack and --cpu avx2|avx512|neon|neon-i8mm|neon-clang|neon-i8mm-clang,
     llama.cpp's CPU build)

The text (its bytes, as llama.cpp reads them: a CRLF file keeps its \\r; one trailing \\n is dropped)
is tokenized whole with BOS, cut into chunks of n_ctx tokens, each chunk's first token replaced by BOS,
and the positions [n_ctx/2, n_ctx - 1) of each chunk score the token after them. A .kld file is
`_logits_`, n_ctx (u32), n_vocab (i32), n_chunk (i32), the n_chunk*n_ctx tokens (i32), then per chunk
and scored position one row of u16: (scale, min_log_prob) as two f32, then n_vocab log-probability
codes, padded to an even count. The float arithmetic of the rows and of the statistics is
llama-perplexity's, float32 where it rounds to float32.

The u16 codes quantize log-probabilities over 16 nats to steps of 16/65535: a base read back has a
KL noise floor (near 5e-4 on real models), and log-probabilities more than 16 nats below a row's
maximum read back at that floor; --kl-divergence-base-f32 F.npz stores (and with --kl-divergence
reads) the base's float32 log-probabilities instead, all of them or (--kl-top-k K) the K most
likely and the scored token's: KLD_F32_FORMAT. The numerics a base was computed with (under
ggml-cpu: the CPU target, KV cache, flash attention, repack) go to stderr as the run starts, and
into the float32 base; the u16 .kld is llama-perplexity's format, which has no field for them.

Several chunks in one llama.cpp batch (-b a multiple of -c) are computed here one after another.
"""
import ctypes
import ctypes.util
import functools
import json
import math
import os
import sys
import time

import numpy as np

from reference import artifacts, factory, gguf
from reference.cli import (BEYOND_TRAIN, BEYOND_TRAIN_HELP, MAX_THREADS, OneLineParser, UsageError, add_numerics_flags,
                           build_of, check_output, check_train_context, exit_status, flag, int_in)
from reference.factory import GGML_CPU_BACKENDS
from reference.ggml_cpu import GgmlCpuError, libm, target as cpu_target
from reference.kv import CacheError
from reference.provenance import provenance, sidecar
from reference.tokenizer import Tokenizer, TokenizerError
from tools.common import check_plot, pyplot, save_figure

PROG = "tools.perplexity"
FLASH_DEFAULT = "auto"  # llama-perplexity's -fa
MAGIC = b"_logits_"
HEADER_BYTES = len(MAGIC) + 12  # n_ctx, n_vocab, n_chunk
F32, F64 = np.float32, np.float64
LOG_RANGE = F32(16)  # llama-perplexity stores log-probabilities down to max - 16
SUM_ROWS = 16  # rows per block of sequential_sum
MIN_STATS_COUNT = 100  # llama-perplexity prints no statistics for fewer scored tokens
KLD_F32_FORMAT = ("npz: n_ctx, n_vocab int64 [], tokens int32 [n_chunk * n_ctx], and either log_probs float32 "
                  "[n_chunk, n_scored, n_vocab] (log-softmax in float64, rounded) or, with --kl-top-k K, "
                  "top_ids int32 and top_log_probs float32 [n_chunk, n_scored, K] (most likely first) and "
                  "next_log_probs float32 [n_chunk, n_scored] (the scored token's); n_scored = n_ctx - 1 - n_ctx//2; "
                  "numerics str [] (how the reference computed it, the line the run printed; absent from older bases), "
                  "provenance str [] (JSON: reference.provenance's record of the run; absent from older bases)")


class KldError(Exception):
    """A base-logits file that is not what llama-perplexity writes; one-line message."""


def n_scored(n_ctx):  # -> scored positions per chunk: [n_ctx/2, n_ctx - 1)
    return n_ctx - 1 - n_ctx // 2


def row_width(n_vocab):  # -> u16 per stored row: 4 (scale, min_log_prob) + n_vocab padded to even
    return 2 * ((n_vocab + 1) // 2) + 4


# ---------------------------------------------------------------------------------------------
# llama-perplexity's float arithmetic, row-wise

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


# ---------------------------------------------------------------------------------------------
# The statistics and lines llama-perplexity prints

def mean_and_uncertainty(total, total2, count):  # -> (mean, its uncertainty), as the C++ lambda
    if count < 1:
        return 0.0, 0.0
    f = total / count
    df = total2 / count - f * f
    return f, (math.sqrt(df / (count - 1)) if df > 0 and count > 10 else 0.0)


def covariance(sum_a, sum_b, sum_ab, count):  # -> covariance of the two means, as the C++ lambda
    if count < 10:
        return 0.0
    return (sum_ab / count - (sum_a / count) * (sum_b / count)) / (count - 1)


def sqrt_or_nan(x):  # C's sqrt: nan for a negative argument, where math.sqrt raises
    return math.sqrt(x) if x >= 0 else math.nan


def ratio_or_nan(a, b):  # C's a/b in double: nan or inf for b == 0, where Python raises
    return a / b if b else (math.nan if a == 0 or math.isnan(a) else math.copysign(math.inf, a))


class KlSums:
    """kl_divergence_result: running double sums over the scored tokens, and the kept values."""

    NAMES = ("nll", "nll2", "nll_base", "nll_base2", "nll_nll_base", "kld", "kld2", "p_diff", "p_diff2", "p_diff4")

    def __init__(self):
        self.sums = dict.fromkeys(self.NAMES, 0.0)
        self.n_same_top, self.count = 0, 0
        self.kld_values, self.p_diff_values = [], []

    def add(self, terms):  # kl_terms dict of one chunk -> None
        for name in self.NAMES:
            for v in np.asarray(terms[name], F64).tolist():  # in token order, as one worker would
                self.sums[name] += v
        self.n_same_top += int(np.sum(terms["same_top"]))
        self.count += len(terms["kld"])
        self.kld_values.append(terms["kld_value"])
        self.p_diff_values.append(terms["p_diff_value"])

    def mean(self, name, name2):  # -> mean_and_uncertainty of a summed pair
        return mean_and_uncertainty(self.sums[name], self.sums[name2], self.count)


def log_ppl_ratio(s):  # KlSums -> (log_ppl, log_ppl_base, covariance, ratio value, ratio uncertainty)
    log_ppl, log_ppl_base = s.mean("nll", "nll2"), s.mean("nll_base", "nll_base2")
    cov = covariance(s.sums["nll"], s.sums["nll_base"], s.sums["nll_nll_base"], s.count)
    unc = sqrt_or_nan(log_ppl[1] ** 2 + log_ppl_base[1] ** 2 - 2.0 * cov)
    return log_ppl, log_ppl_base, cov, log_ppl[0] - log_ppl_base[0], unc


def rms_p_diff(s):  # KlSums -> (RMS Δp, its uncertainty)
    mse = s.mean("p_diff2", "p_diff4")
    rms = math.sqrt(mse[0])
    return rms, ratio_or_nan(0.5, rms) * mse[1]


def same_top(s):  # KlSums -> (share of the same argmax, its uncertainty)
    p = s.n_same_top / s.count
    return p, sqrt_or_nan(ratio_or_nan(p * (1 - p), s.count - 1))


def chunk_line(chunk, s):  # chunk number (1-based), KlSums so far -> the per-chunk line of KL mode
    log_ppl, _, _, ratio, ratio_unc = log_ppl_ratio(s)
    ppl = math.exp(log_ppl[0])
    kl = s.mean("kld", "kld2")
    rms, rms_unc = rms_p_diff(s)
    top, top_unc = same_top(s)
    return (f"{chunk:4d}    {ppl:9.4f} ± {ppl * log_ppl[1]:9.4f}    {ratio:10.5f} ± {ratio_unc:10.5f}"
            f"    {kl[0]:10.5f} ± {kl[1]:10.5f}    {100 * rms:6.3f} ± {100 * rms_unc:6.3f} %"
            f"    {100 * top:6.3f} ± {100 * top_unc:6.3f} %")


def percentile(values, fraction):  # sorted [n] f32, f32 fraction -> f32, the C++ lambda in float
    if fraction <= 0:
        return values[0]
    if fraction >= 1:
        return values[-1]
    p = F32(fraction * F32(len(values) - 1))
    ip = int(p)
    p = F32(p - F32(ip))
    return F32((F32(1) - p) * values[ip] + p * values[min(ip + 1, len(values) - 1)])


def median(values):  # sorted [n] f32 -> f32: 0.5f*(a + b) for an even count
    n = len(values)
    return F32(F32(0.5) * (values[n // 2] + values[n // 2 - 1])) if n % 2 == 0 else values[n // 2]


KLD_PERCENTILES = (("99.9%", 0.999), ("99.0%", 0.990), ("95.0%", 0.950), ("90.0%", 0.900), None,
                   ("10.0%", 0.100), (" 5.0%", 0.050), (" 1.0%", 0.010), (" 0.1%", 0.001))
P_DIFF_PERCENTILES = (KLD_PERCENTILES[:4] + (("75.0%", 0.750), None, ("25.0%", 0.250)) + KLD_PERCENTILES[5:])


def quantiles(values, table):  # sorted [n] f32, (label, fraction) | None for the median -> [(label, float)]
    return [("Median", float(median(values))) if item is None else (item[0], float(percentile(values, F32(item[1]))))
            for item in table]


def ppl_block(s):  # KlSums -> lines of "====== Perplexity statistics ======"
    log_ppl, log_ppl_base, cov, ratio, ratio_unc = log_ppl_ratio(s)
    ppl, ppl_base = math.exp(log_ppl[0]), math.exp(log_ppl_base[0])
    ppl_unc, ppl_base_unc = ppl * log_ppl[1], ppl_base * log_ppl_base[1]
    cor = ratio_or_nan(cov, log_ppl[1] * log_ppl_base[1])
    diff_unc = sqrt_or_nan(ppl_unc ** 2 + ppl_base_unc ** 2 - 2.0 * ppl * ppl_base * cov)
    return ["====== Perplexity statistics ======",
            f"Mean PPL(Q)                   : {ppl:10.6f} ± {ppl_unc:10.6f}",
            f"Mean PPL(base)                : {ppl_base:10.6f} ± {ppl_base_unc:10.6f}",
            f"Cor(ln(PPL(Q)), ln(PPL(base))): {100.0 * cor:6.2f}%",
            f"Mean ln(PPL(Q)/PPL(base))     : {ratio:10.6f} ± {ratio_unc:10.6f}",
            f"Mean PPL(Q)/PPL(base)         : {math.exp(ratio):10.6f} ± {math.exp(ratio) * ratio_unc:10.6f}",
            f"Mean PPL(Q)-PPL(base)         : {ppl - ppl_base:10.6f} ± {diff_unc:10.6f}", ""]


def kld_block(s):  # KlSums -> lines of "====== KL divergence statistics ======"
    values = np.sort(np.concatenate(s.kld_values))
    kl = s.mean("kld", "kld2")
    lines = ["====== KL divergence statistics ======", f"Mean    KLD: {kl[0]:10.6f} ± {kl[1]:10.6f}",
             f"Maximum KLD: {float(values[-1]):10.6f}"]
    for label, value in quantiles(values, KLD_PERCENTILES):
        lines.append(f"{label:<7} KLD: {value:10.6f}")
    return lines + [f"Minimum KLD: {float(values[0]):10.6f}", ""]


def p_diff_block(s):  # KlSums -> lines of "====== Token probability statistics ======"
    values = np.sort(np.concatenate(s.p_diff_values))
    mean, unc = s.mean("p_diff", "p_diff2")
    lines = ["====== Token probability statistics ======", f"Mean    Δp: {100 * mean:6.3f} ± {100 * unc:5.3f} %",
             f"Maximum Δp: {100.0 * float(values[-1]):6.3f}%"]
    for label, value in quantiles(values, P_DIFF_PERCENTILES):
        lines.append(f"{label:<7} Δp: {100.0 * value:6.3f}%")
    rms, rms_unc = rms_p_diff(s)
    top, top_unc = same_top(s)
    return lines + [f"Minimum Δp: {100.0 * float(values[0]):6.3f}%", f"RMS Δp    : {100 * rms:6.3f} ± {100 * rms_unc:5.3f} %",
                    f"Same top p: {100 * top:6.3f} ± {100 * top_unc:5.3f} %"]


def statistics_lines(s):  # KlSums -> the three blocks llama-perplexity prints after the chunks
    return ppl_block(s) + kld_block(s) + p_diff_block(s)


# ---------------------------------------------------------------------------------------------
# .kld files

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


# ---------------------------------------------------------------------------------------------
# The reference forward over llama-perplexity's chunks and batches

def load_model(args):  # -> (TextModel on the backend the options ask for, its numerics_line)
    build = build_of(args, FLASH_DEFAULT if args.numerics == "ggml-cpu" else None)
    for warning in factory.host_warnings(build):
        print(f"{PROG}: warning: {warning}", file=sys.stderr)
    for note in factory.notes(build):
        info(f"{PROG}: {note}")
    backend = factory.backend(build)
    numerics = numerics_line(build, backend)
    model = gguf.load(args.model, "text")
    if check_train_context(args.ctx_size, model.config.n_ctx_train, "-c", args.model, args.beyond_n_ctx_train):
        info(f"{PROG}: -c {args.ctx_size} is past the training context of {os.path.basename(args.model)} "
             f"({model.config.n_ctx_train} tokens): {BEYOND_TRAIN}")
    # the caller prints the line once its input is checked: bad input stays one line on stderr
    return factory.text_model(model, build, backend), numerics


def numerics_line(build, backend):  # factory.Build, the backend made of it -> how the reference rounds, one line
    if not build.ggml_cpu:
        return f"numerics exact, {build.dtype}"
    cache = (f"KV cache {backend.k_type}" if backend.k_type == backend.v_type
             else f"K cache {backend.k_type}, V cache {backend.v_type}")
    return (f"numerics ggml-cpu: llama.cpp's {backend.target.name} CPU build, {cache}, "
            f"flash attention {'on' if backend.flash_attn else 'off'}, repack {'on' if backend.repack else 'off'}")


def chunk_logits(lm, ids, args):  # ids [n_ctx] (BOS already first) -> f32 [n_scored, V] of [n_ctx/2, n_ctx - 1)
    """llama-perplexity decodes a chunk in batches of n_batch tokens (one batch when n_batch >= n_ctx),
    which llama.cpp splits into ubatches of n_ubatch; the cache keeps the chunk's earlier batches."""
    n_ctx = len(ids)
    batch = args.batch_size if args.batch_size < n_ctx else n_ctx
    ubatch = min(args.ubatch_size, batch)
    cache = lm.new_cache(n_ctx, "ring", ubatch)
    out = [lm.prefill(ids[start:start + batch], cache, ubatch) for start in range(0, n_ctx, batch)]
    return np.concatenate(out)[n_ctx // 2:n_ctx - 1].astype(F32)


def chunk_ids(tokens, chunk, n_ctx, bos):  # tokens [n] -> the chunk's ids [n_ctx], BOS first (bos >= 0)
    ids = np.array(tokens[chunk * n_ctx:(chunk + 1) * n_ctx], np.int64)
    if bos >= 0:
        ids[0] = bos
    return ids


def info(text):  # a LOG_INF line of llama-perplexity: stderr
    print(text, file=sys.stderr, flush=True)


def eta_line(prog, seconds, n_left):  # -> "X seconds per chunk - ETA ..." (one line on stderr here)
    """llama-perplexity's line, counting what runs here: each chunk on its own (its n_seq chunks of a
    batch one after another), the first chunk's whole work (forward, bases, scores) times those left."""
    total = int(seconds * n_left)
    hours = f"{total // 3600} hours " if total >= 3600 else ""
    return (f"{prog}: {seconds:.2f} seconds per chunk - ETA {hours}{(total % 3600 if hours else total) / 60.0:.2f} "
            f"minutes for the {n_left} chunks left")


def chunk_count(args, available, what):  # -> the chunks to run: --chunks, or all; more than there are is one warning
    if args.chunks > available:
        info(f"{PROG}: warning: --chunks {args.chunks}: {what} holds {available}; running {available}")
    return available if args.chunks < 0 else min(args.chunks, available)


def chunks(n_chunk, what):  # -> range of chunk indices with a progress bar on a terminal
    from tqdm import tqdm
    return tqdm(range(n_chunk), desc=what, unit="chunk", leave=False, disable=None)


# ---------------------------------------------------------------------------------------------
# The three modes

def read_text(path):  # -> the text as llama.cpp's -f reads it: bytes kept, one trailing \n dropped
    data = artifacts.read_bytes(path, UsageError, what="text")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"{path}: not UTF-8 text (byte {e.start})") from None
    return text[:-1] if text.endswith("\n") else text


def text_chunks(args, tokenizer):  # -> (tokens of -f, n_chunk): the whole text with BOS, cut to -c
    tokens = tokenizer.tokenize(read_text(args.file), add_special=True)
    n_ctx = args.ctx_size
    if len(tokens) < 2 * n_ctx:
        raise UsageError(f"you need at least {2 * n_ctx} tokens to evaluate perplexity with a context of "
                         f"{n_ctx}; {args.file} tokenizes to only {len(tokens)}")
    return tokens, chunk_count(args, len(tokens) // n_ctx, f"{args.file} at -c {n_ctx}")


class BaseWriters:
    """The bases a perplexity run writes: --kl-divergence-base (u16) and --kl-divergence-base-f32."""

    def __init__(self, args, n_vocab, tokens, numerics, record):  # tokens [n_chunk * n_ctx], the chunks scored
        self.n_ctx, self.n_vocab, self.tokens, self.f32_rows, self.numerics = args.ctx_size, n_vocab, tokens, [], numerics
        self.record, self.u16_path = record, args.kl_divergence_base
        self.fused_codes = args.cpu is not None and cpu_target(args.cpu).contracts_across_statements  # GCC on ARM
        self.f32_path, self.top_k = args.kl_divergence_base_f32, args.kl_top_k
        self.u16 = KldWriter(args.kl_divergence_base, self.n_ctx, n_vocab, tokens) if args.kl_divergence_base else None

    def add(self, logits, next_ids):  # [n_scored, V] f32 of one chunk, the tokens it scores -> None
        if self.u16:
            self.u16.write(uint16_rows(logits, self.fused_codes))
        if self.f32_path:
            log_probs = log_softmax64(logits)
            self.f32_rows.append(top_k_rows(log_probs, next_ids, self.top_k) if self.top_k
                                 else {"log_probs": log_probs.astype(F32)})

    def close(self):  # -> None, both files complete
        if self.u16:
            self.u16.close()  # llama-perplexity's format has no field for the provenance: F.kld.json beside it
            artifacts.write_json(sidecar(self.u16_path), self.record, KldError)
        if self.f32_path:
            write_f32_base(self.f32_path, self.n_ctx, self.n_vocab, self.tokens, self.f32_rows, self.numerics,
                           self.record)

    def discard(self):  # -> None: whatever is unfinished goes (nothing once close() ran)
        if self.u16:
            self.u16.discard()


def perplexity(args, lm, numerics):  # numerics_line of lm -> exit status; prints as llama-perplexity's perplexity()
    tokenizer = Tokenizer(lm.tokenizer)
    tokens, n_chunk = text_chunks(args, tokenizer)
    n_ctx, bos = args.ctx_size, tokenizer.required_id("bos") if tokenizer.add_bos else -1
    info(f"{PROG}: {numerics}")
    record = provenance(args.model, build_of(args, FLASH_DEFAULT if args.numerics == "ggml-cpu" else None), lm.backend,
                        args.ubatch_size, ctx_size=n_ctx, batch_size=args.batch_size)
    bases = BaseWriters(args, lm.cfg.n_vocab, tokens[:n_chunk * n_ctx], numerics, record)
    try:
        return scored_chunks(args, lm, tokens, n_chunk, bos, bases)
    finally:
        bases.discard()  # a run that fails leaves the bases that were there as they were


def scored_chunks(args, lm, tokens, n_chunk, bos, bases):  # -> exit status: perplexity()'s loop over the chunks
    n_ctx = args.ctx_size
    # the .kld writer's log_softmax rounds the nll to float32, the other one does not
    nll_of = nll_written if args.kl_divergence_base else nll_plain
    info(f"perplexity: calculating perplexity over {n_chunk} chunks, n_ctx={n_ctx}, "
         f"batch_size={min(args.batch_size, n_seq(args, n_ctx) * n_ctx)}, n_seq={n_seq(args, n_ctx)}")
    nll, nll2, count = 0.0, 0.0, 0
    for i in chunks(n_chunk, "perplexity"):
        t0 = time.perf_counter()
        logits = chunk_logits(lm, chunk_ids(tokens, i, n_ctx, bos), args)
        next_ids = np.asarray(tokens[i * n_ctx + n_ctx // 2 + 1:(i + 1) * n_ctx])
        bases.add(logits, next_ids)
        for v in nll_of(logits, next_ids).tolist():
            nll, nll2, count = nll + v, nll2 + v * v, count + 1
        if i == 0:
            info(eta_line("perplexity", time.perf_counter() - t0, n_chunk - 1))
        print(f"[{i + 1}]{math.exp(nll / count):.4f},", end="", flush=True)
    print()
    bases.close()
    return final_estimate(nll, nll2, count)


def n_seq(args, n_ctx):  # -> sequences per batch, as llama-perplexity derives them
    return max(1, args.batch_size // n_ctx)


def final_estimate(nll, nll2, count):  # running sums -> exit status, after the "Final estimate" line
    nll, nll2 = nll / count, nll2 / count
    ppl, var = math.exp(nll), nll2 - nll * nll
    if var <= 0:
        info("Unexpected negative standard deviation of log(prob)")
        return 0
    info(f"Final estimate: PPL = {ppl:.4f} +/- {math.sqrt(var / (count - 1)) * ppl:.5f}")
    return 0


CHUNK_HEADER = ("chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              "
                "Δp RMS            Same top p")


def kl_divergence(args, base, q_logits):  # q_logits(chunk) -> [n_scored, V]; prints as kl_divergence()
    n_chunk = chunk_count(args, base.n_chunk, "the base")
    info(f"kl_divergence: computing over {n_chunk} chunks, n_ctx={base.n_ctx}, batch_size={args.batch_size}, "
         f"n_seq={n_seq(args, base.n_ctx)}")
    sums = KlSums()
    for i in chunks(n_chunk, "kl-divergence"):
        t0 = time.perf_counter()
        logits = q_logits(i)
        sums.add(base.terms(i, logits))
        if i == 0:
            info(eta_line("kl_divergence", time.perf_counter() - t0, n_chunk - 1))
            print(f"\n{CHUNK_HEADER}")
        print(chunk_line(i + 1, sums), flush=True)
    print()
    if args.plot:
        plot_kl(args.plot, sums, f"{os.path.basename(args.model or args.compare_kld[0])} against its base")
    if sums.count < MIN_STATS_COUNT:
        info(f"kl_divergence: {sums.count} scored tokens: llama-perplexity prints statistics from {MIN_STATS_COUNT}")
        return 0
    print("\n".join(statistics_lines(sums)))
    return 0


def plot_kl(path, s, title):  # KlSums -> PNG: the per-token KLD (sorted) and the Δp histogram
    plt = pyplot(path)
    kld, p_diff = np.sort(np.concatenate(s.kld_values)), np.concatenate(s.p_diff_values)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(np.arange(1, len(kld) + 1) / len(kld), kld)
    left.set(xlabel="fraction of scored tokens", ylabel="KLD (nats)", title="KLD per token, sorted")
    left.set_yscale("symlog", linthresh=1e-5)  # the storage noise makes KLD values slightly negative
    right.hist(100 * p_diff, bins=60)
    right.set(yscale="log", xlabel="Δp (%)", ylabel="tokens", title="Δp = p_Q(token) - p_base(token)")
    fig.suptitle(f"{title}: {s.count} tokens, mean KLD {s.sums['kld'] / s.count:.6f}")
    fig.tight_layout()
    save_figure(plt, fig, path)


def code_agreement(a, b):  # KldBase x2 of one shape -> (identical codes, codes, largest |difference|)
    """Over the n_vocab codes of every row (the f32 headers and the padding left out)."""
    same, largest, V = 0, 0, a.n_vocab
    for i in range(a.n_chunk):  # chunk by chunk: a 30B base does not fit in memory as int32
        ca, cb = a.rows[i, :, 4:4 + V].astype(np.int32), b.rows[i, :, 4:4 + V].astype(np.int32)
        same += int(np.sum(ca == cb))
        largest = max(largest, int(np.max(np.abs(ca - cb))))
    return same, a.n_chunk * n_scored(a.n_ctx) * V, largest


def check_same_chunks(q, base, q_path, base_path):  # two bases -> None, UsageError unless one text and shape
    if (q.n_ctx, q.n_vocab, q.n_chunk) != (base.n_ctx, base.n_vocab, base.n_chunk):
        raise UsageError(f"{q_path} has n_ctx {q.n_ctx}, n_vocab {q.n_vocab}, n_chunk {q.n_chunk}; {base_path} "
                         f"{base.n_ctx}, {base.n_vocab}, {base.n_chunk}")
    differ = np.flatnonzero(np.asarray(q.tokens).ravel() != np.asarray(base.tokens).ravel())
    if len(differ):
        raise UsageError(f"{q_path} and {base_path} hold different tokens (first at {differ[0]})")


def compare_kld(args):  # --compare-kld Q.kld BASE.kld -> exit status
    q_path, base_path = args.compare_kld
    q, base = read_kld(q_path), read_kld(base_path)
    check_same_chunks(q, base, q_path, base_path)
    same, total, largest = code_agreement(q, base)
    print(f"u16 log-probability codes: {same} of {total} identical ({100 * same / total:.4f} %), "
          f"largest difference {largest} (steps of 16/65535 nats below each row's max)")
    heads = np.sum(np.all(np.asarray(q.rows[:, :, :4]) == np.asarray(base.rows[:, :, :4]), axis=2))
    print(f"row headers (scale, min_log_prob): {int(heads)} of {q.n_chunk * n_scored(q.n_ctx)} identical")
    return kl_divergence(args, base, lambda i: decode_rows(q.rows[i], q.n_vocab))


def read_base(args):  # --kl-divergence -> KldBase or F32Base
    if bool(args.kl_divergence_base) == bool(args.kl_divergence_base_f32):
        raise UsageError("--kl-divergence reads one base: --kl-divergence-base F.kld or --kl-divergence-base-f32 F.npz")
    return read_kld(args.kl_divergence_base) if args.kl_divergence_base else F32Base(args.kl_divergence_base_f32)


def kl_mode(args):  # --kl-divergence -> exit status: the model's logits against a base
    if args.kl_top_k:
        raise UsageError("--kl-top-k is chosen when the base is written; --kl-divergence reads what it holds")
    base = read_base(args)
    args.ctx_size = base.n_ctx  # the chunks the base was made of: checked against the training context
    lm, numerics = load_model(args)
    if base.n_vocab != lm.cfg.n_vocab:
        raise UsageError(f"inconsistent vocabulary: the base has {base.n_vocab} tokens, {args.model} {lm.cfg.n_vocab}")
    info(f"{PROG}: {numerics}" + (f"; the base's: {base.numerics}" if base.numerics else ""))
    tokenizer = Tokenizer(lm.tokenizer)
    bos = tokenizer.required_id("bos") if tokenizer.add_bos else -1
    tokens = np.asarray(base.tokens).ravel()
    return kl_divergence(args, base, lambda i: chunk_logits(lm, chunk_ids(tokens, i, base.n_ctx, bos), args))


def ppl_mode(args):  # -> exit status: perplexity of -f, writing the bases asked for
    if not args.file:
        raise UsageError("perplexity needs a text: -f TEXT")
    if args.batch_size >= args.ctx_size and args.batch_size % args.ctx_size:
        raise UsageError(f"-b {args.batch_size} must be below -c {args.ctx_size} or a multiple of it (llama-perplexity)")
    if args.kl_divergence_base:
        check_output(args.kl_divergence_base, "--kl-divergence-base")
    if args.kl_divergence_base_f32:
        check_output(args.kl_divergence_base_f32, "--kl-divergence-base-f32", ".npz")
    elif args.kl_top_k:
        raise UsageError("--kl-top-k applies to the base --kl-divergence-base-f32 writes")
    artifacts.refuse_overwrite([("--kl-divergence-base", args.kl_divergence_base),
                                ("--kl-divergence-base-f32", args.kl_divergence_base_f32)],
                               [("-m", args.model), ("-f", args.file)], UsageError)
    return perplexity(args, *load_model(args))


def build_parser():  # -> llama-perplexity's options and the reference's
    p = OneLineParser(prog=f"python -m {PROG}", description=__doc__)
    flag(p, "model", help="text GGUF")
    flag(p, "file", help="text file (its bytes, as llama.cpp reads them)")
    flag(p, "ctx_size", type=int_in(8, 1 << 20), default=512, help="tokens per chunk")
    flag(p, "batch_size", type=int_in(1, 1 << 20), default=2048,
         help="llama.cpp's logical batch: below -c a chunk is decoded in batches; a multiple of -c puts several "
              "chunks in one llama.cpp batch (here: one after another)")
    flag(p, "ubatch_size", type=int_in(1, 1 << 20), default=512, help="llama.cpp's physical batch")
    flag(p, "threads", type=int_in(1, MAX_THREADS),
         help="with --numerics ggml-cpu: llama.cpp's thread count (default 2, the modelled build's)")
    p.add_argument("--chunks", type=int_in(-1, 1 << 30), default=-1,
                   help="at most this many chunks (-1: all); here it also caps a --kl-divergence run")
    p.add_argument("--kl-divergence-base", metavar="F.kld",
                   help="without --kl-divergence: write the u16 base there; with it: read it")
    p.add_argument("--kl-divergence-base-f32", metavar="F.npz",
                   help="the same, with float32 log-probabilities (no u16 noise floor)")
    p.add_argument("--kl-top-k", type=int_in(1, 1 << 24), metavar="K",
                   help="--kl-divergence-base-f32 keeps only each row's K most likely tokens (and the scored one)")
    p.add_argument("--kl-divergence", action="store_true", help="KL divergence of -m against the base")
    p.add_argument("--compare-kld", nargs=2, metavar=("Q.kld", "BASE.kld"),
                   help="compare two bases of the same text (an engine's and the reference's), no model")
    p.add_argument(BEYOND_TRAIN, action="store_true", help=BEYOND_TRAIN_HELP + " (a line on stderr)")
    p.add_argument("--plot", metavar="F.png", help="with --kl-divergence or --compare-kld: the per-token KLD and Δp")
    add_numerics_flags(p, GGML_CPU_BACKENDS, "auto, as llama-perplexity's")
    return p


def work(args):  # -> exit status
    if args.plot:
        if not (args.kl_divergence or args.compare_kld):
            raise UsageError("--plot draws the KL statistics of --kl-divergence or --compare-kld")
        check_plot(args.plot)
    bases = (("--kl-divergence-base", args.kl_divergence_base), ("--kl-divergence-base-f32", args.kl_divergence_base_f32))
    artifacts.refuse_overwrite([("--plot", args.plot)], [("-m", args.model), ("-f", args.file), *bases,
                                                        *(("--compare-kld", q) for q in args.compare_kld or ())], UsageError)
    if args.compare_kld:
        return compare_kld(args)
    if not args.model:
        raise UsageError("-m M.gguf is required (or --compare-kld Q.kld BASE.kld)")
    if args.chunks == 0:
        raise UsageError("--chunks must be -1 (all) or at least 1")
    return kl_mode(args) if args.kl_divergence else ppl_mode(args)


def main(argv=None):  # -> exit status
    args = build_parser().parse_args(argv)
    return exit_status(PROG, lambda: work(args), (KldError, gguf.GGUFError, TokenizerError, GgmlCpuError, CacheError,
                                                   factory.FactoryError))


if __name__ == "__main__":
    sys.exit(main())
