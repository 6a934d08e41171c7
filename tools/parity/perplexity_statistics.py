"""The statistics llama-perplexity's kl_divergence() prints, from the per-token terms of
perplexity_arithmetic.kl_terms: the running double sums, the means with their uncertainties, the
per-chunk line and the three blocks after the chunks, each number rounded as the C++ rounds it."""
import math

import numpy as np

from tools.parity.perplexity_arithmetic import F32, F64


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
