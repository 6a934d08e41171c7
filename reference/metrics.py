"""The comparison math every tool and test uses; one function per metric, all reduce the last axis.

For logits `[n_pos, n_vocab]` each metric gives one value per position (row); for a whole tensor,
flatten it first. Everything is computed in float64 whatever the input dtype, so the metric adds no
rounding of its own to the difference it measures.

NMSE here is always `sum((ref - x)^2) / sum(ref^2)`: the convention of llama.cpp's
test-backend-ops and test-llama-archs. llama.cpp's check-nmse.py divides by the variance of ref
instead; the two differ whenever ref has a non-zero mean.
"""
import numpy as np


def nmse(ref, x):  # [..., n], [..., n] -> [...]
    """sum((ref - x)^2) / sum(ref^2) over the last axis, accumulated in float64.
    0 when the two are equal (even if ref is all zeros), inf when only ref is all zeros."""
    ref, x = np.asarray(ref, np.float64), np.asarray(x, np.float64)
    err = np.sum((ref - x) ** 2, axis=-1)
    norm = np.sum(ref ** 2, axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(err == 0, 0.0, err / norm)


def max_abs_diff(ref, x):  # [..., n], [..., n] -> [...]
    return np.max(np.abs(np.asarray(ref, np.float64) - np.asarray(x, np.float64)), axis=-1)


def cosine(ref, x):  # [..., n], [..., n] -> [...]
    """Cosine similarity; two all-zero rows count as identical (1), one all-zero row as unrelated (0)."""
    ref, x = np.asarray(ref, np.float64), np.asarray(x, np.float64)
    norm_ref, norm_x = np.linalg.norm(ref, axis=-1), np.linalg.norm(x, axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        cos = np.sum(ref * x, axis=-1) / (norm_ref * norm_x)
    return np.where((norm_ref == 0) & (norm_x == 0), 1.0, np.where(norm_ref * norm_x == 0, 0.0, cos))


def log_softmax(logits):  # [..., n_vocab] -> [..., n_vocab] float64
    z = np.asarray(logits, np.float64)
    z = z - np.max(z, axis=-1, keepdims=True)
    return z - np.log(np.sum(np.exp(z), axis=-1, keepdims=True))


def kl(ref_logits, test_logits):  # [..., n_vocab], [..., n_vocab] -> [...]
    """KL(ref || test) in nats over the full softmax: no top-k or log-prob cutoff (llama-perplexity
    drops tokens with log p_ref < -16; here every token counts)."""
    log_p, log_q = log_softmax(ref_logits), log_softmax(test_logits)
    return np.maximum(np.sum(np.exp(log_p) * (log_p - log_q), axis=-1), 0.0)


def top1_agreement(ref_logits, test_logits):  # [..., n_vocab], [..., n_vocab] -> [...] bool
    return np.argmax(ref_logits, axis=-1) == np.argmax(test_logits, axis=-1)


def shared_fraction(ids_a, ids_b):  # token ids [n, k], [n, k] -> [n]: how many of a's k are in b's, / k
    """Row by row without an [n, k, k] comparison (k is only bounded by a golden's file): ids offset
    by row * (largest id + 1) are one np.isin."""
    ids_a, ids_b = np.asarray(ids_a, np.int64), np.asarray(ids_b, np.int64)
    offset = np.arange(len(ids_a))[:, None] * (int(max(ids_a.max(initial=0), ids_b.max(initial=0))) + 1)
    return np.isin(ids_a + offset, ids_b + offset).sum(-1) / ids_a.shape[-1]


def topk_agreement(ref_logits, test_logits, k):  # [..., n_vocab], [..., n_vocab] -> [...]
    """Overlap of the two top-k token sets as a fraction of k (order inside the set ignored)."""
    ref_logits, test_logits = np.asarray(ref_logits), np.asarray(test_logits)
    k = min(k, ref_logits.shape[-1])
    top_ref = np.argpartition(ref_logits, -k, axis=-1)[..., -k:].reshape(-1, k)
    top_test = np.argpartition(test_logits, -k, axis=-1)[..., -k:].reshape(-1, k)
    return shared_fraction(top_ref, top_test).reshape(ref_logits.shape[:-1])


def top1_margin(logits):  # [..., n_vocab] -> [...]
    """Logit gap between the best and the second-best token: how close the argmax is to a tie."""
    z = np.asarray(logits, np.float64)
    if z.shape[-1] < 2:
        return np.full(z.shape[:-1], np.inf)
    top2 = np.partition(z, -2, axis=-1)[..., -2:]
    return top2[..., 1] - top2[..., 0]


def delta_p(ref_logits, test_logits):  # [..., n_vocab], [..., n_vocab] -> [...]
    """p_test(t) - p_ref(t) for t = the reference's top-1 token (llama-perplexity's Δp uses the
    true next token; with no labels, the reference's own choice is the token that matters)."""
    top = np.argmax(ref_logits, axis=-1)[..., None]
    p_ref = np.exp(np.take_along_axis(log_softmax(ref_logits), top, axis=-1))[..., 0]
    p_test = np.exp(np.take_along_axis(log_softmax(test_logits), top, axis=-1))[..., 0]
    return p_test - p_ref
