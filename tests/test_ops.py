"""ops.py against independent formulations of the same math."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from reference import ops

rng = np.random.default_rng(0)
U32 = 2.0**-24  # the largest relative error of one rounding to float32 (round to nearest)
U64 = 2.0**-53  # the same for float64


def unpermute_rows(w, n_heads):  # the converter's HF -> GGUF row order: (H, 2, D/2) -> (H, D/2, 2)
    out, d = w.shape[0], w.shape[0] // n_heads
    return w.reshape(n_heads, 2, d // 2, -1).transpose(0, 2, 1, 3).reshape(out, -1)


def test_rope_norm_on_gguf_rows_equals_rope_neox_on_hf_rows():
    # the converter re-interleaves q/k rows so ggml's adjacent-pair RoPE equals HF's rotate_half
    H, D, T = 3, 16, 5
    x_hf = rng.standard_normal((T, H * D)).astype(np.float64)
    x_gguf = unpermute_rows(x_hf.T, H).T
    theta = ops.rope_angles(np.arange(T) * 7, D, 10000.0, np.float64)
    neox = ops.rope_neox(x_hf.reshape(T, H, D), theta)
    norm = ops.rope_norm(x_gguf.reshape(T, H, D), theta)
    # the same float64 rotations in two layouts (measured bit-identical); 1e-12 also admits another
    # evaluation order (2 products and a sum of values under 10: below 1e-14) and nothing else, since
    # a wrong pairing moves values of size 1
    assert np.allclose(unpermute_rows(neox.reshape(T, -1).T, H).T, norm.reshape(T, -1), rtol=0, atol=1e-12)


def test_rope_angles_f32_iterative_matches_exact_within_f32():
    p = np.array([0, 1, 100, 4000])
    exact = ops.rope_angles(p, 128, 10000.0, np.float64)
    f32 = ops.rope_angles(p, 128, 10000.0, np.float32)
    assert f32.dtype == np.float32 and f32[0].max() == 0
    # 64 f32 multiplications each add at most 0.5 ulp: relative error below 64 * 2^-24
    assert np.max(np.abs(f32 - exact) / np.maximum(exact, 1e-30)) < 64 * 2.0**-24


def naive_attention(q, k, v, visible, scale):  # repeat K/V per head, one head at a time, float64
    T, H, D = q.shape
    group = H // k.shape[1]
    out = np.zeros((T, H, D))
    for h in range(H):
        s = q[:, h].astype(np.float64) @ k[:, h // group].astype(np.float64).T * scale
        s[~visible] = -np.inf
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[:, h] = p @ v[:, h // group]
    return out


@pytest.mark.parametrize("H, Hkv", [(4, 4), (4, 2), (8, 1)])
def test_attention_gqa_contiguous_groups(H, Hkv):
    T, S, D = 6, 11, 8
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    k = rng.standard_normal((S, Hkv, D)).astype(np.float32)
    v = rng.standard_normal((S, Hkv, D)).astype(np.float32)
    visible = ops.causal_visible(np.arange(5, 11), np.arange(S), 4)
    got = ops.attention(q, k, v, visible, 0.3)
    assert got.dtype == np.float32
    # ops.attention works in float64 and rounds once to float32: one rounding (U32, measured 0.995 U32
    # over 600 draws), plus 1e-14 for the two float64 summation orders on values of size 1
    assert np.allclose(got, naive_attention(q, k, v, visible, 0.3), rtol=U32, atol=1e-14)


def test_swa_mask_window_is_strict():
    visible = ops.causal_visible(np.array([10]), np.arange(12), 4)[0]
    # p_q - p_k < 4: keys 7, 8, 9, 10 (self included); 11 is in the future
    assert np.flatnonzero(visible).tolist() == [7, 8, 9, 10]
    full = ops.causal_visible(np.array([10]), np.array([-1, 0, 5, 10, 11]), 0)[0]
    assert full.tolist() == [False, True, True, True, False]  # -1 is an empty ring slot


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 5), st.integers(2, 64), st.floats(1e-8, 1e-2))
def test_rms_norm_matches_float64_formula(rows, n, eps):
    x = np.random.default_rng(rows * n).standard_normal((rows, n)).astype(np.float32) * 3
    want = x.astype(np.float64) / np.sqrt(np.mean(x.astype(np.float64) ** 2, -1, keepdims=True) + eps)
    got = ops.rms_norm(x, eps)
    # float32 roundings, first order in U32: the squares 1, the mean 1, eps 1, mean + eps 1, sqrt
    # halves those 4 and adds 1, the reciprocal 1, x * scale 1: 5 U32, to first order (measured 3.0
    # U32 at most over every shape of this strategy and 5 eps)
    assert got.dtype == np.float32 and np.allclose(got, want, rtol=5 * U32, atol=0)


def test_softcap_order_and_zero_disables():
    z = np.linspace(-200, 200, 4001, dtype=np.float32)
    want = 20 * np.tanh(z.astype(np.float64) / 20)
    # float32 roundings, in U32: the reciprocal of the cap 1 and z times it 1 (tanh passes a relative
    # error of its argument on at most 1:1), numpy's float32 tanh taken as within 1 ulp = 2 (measured
    # 0.9 ulp over [-10, 10]), times the cap 1: 5 U32 (measured 2.4 U32 here, 3.2 on 100x the points)
    assert np.allclose(ops.softcap(z, 20.0), want, rtol=5 * U32, atol=0)
    assert np.array_equal(ops.softcap(z, 0.0), z)


def test_activations():
    # float64 on both sides; the reference side is scipy's logistic and normal CDF, which stay exact
    # for large |x| (expit does not overflow, ndtr uses erfc below 0)
    from scipy.special import expit
    from scipy.stats import norm
    x = np.linspace(-40, 40, 161)
    # each side: exp within 1 ulp = 2 U64 and 2 or 3 roundings of 1 U64: 9 U64 for the two sides of
    # sigmoid and SiLU, 11 U64 for SwiGLU's extra product on each side (measured 2.7 U64 at most)
    assert np.allclose(ops.sigmoid(x), expit(x), rtol=9 * U64, atol=0)
    assert np.allclose(ops.silu(x), x * expit(x), rtol=9 * U64, atol=0)
    up = np.cos(x)
    assert np.allclose(ops.swiglu(x, up), x * expit(x) * up, rtol=11 * U64, atol=0)
    # 0.5 x (1 + erf(x / sqrt 2)) cancels below 0, so the bound is absolute, in units of |x|: erf
    # within 1 ulp and the sum, at most 3 U64 of numbers under 2, times 0.5, and the last product 1:
    # 2.5 U64 |x|; x * ndtr(x) with ndtr within 2 ulp (4 U64) and the product: 5 U64 |x|; together
    # under 8 U64 |x| (measured 1.6 U64 |x| at most)
    assert np.all(np.abs(ops.gelu_erf(x) - x * norm.cdf(x)) <= 8 * U64 * np.abs(x))


def test_linear_is_batch_invariant():
    # float64 accumulation: a row's product does not depend on the rows computed with it
    w = rng.standard_normal((64, 300)).astype(np.float32)
    x = rng.standard_normal((17, 300)).astype(np.float32)
    together = ops.linear(x, w)
    apart = np.concatenate([ops.linear(x[i:i + 1], w) for i in range(17)])
    assert together.dtype == np.float32 and np.array_equal(together, apart)


def test_layer_norm():
    x = rng.standard_normal((3, 10)).astype(np.float32)
    w, b = rng.standard_normal(10).astype(np.float32), rng.standard_normal(10).astype(np.float32)
    x64 = x.astype(np.float64)
    mean, sd = x64.mean(-1, keepdims=True), np.sqrt(x64.var(-1, keepdims=True) + 1e-5)
    x_hat = (x64 - mean) / sd
    want = x_hat * w + b
    # float32 roundings after the float64 mean and variance, each at most U32 of the value rounded:
    # the mean (|mean| / sd on x_hat), x - mean, the variance of those, + eps, sqrt, the division
    # (together 5 U32 |x_hat|), * w and + b: at most 6 U32 of the scale below, to first order
    # (measured 2.5 U32 over 2000 draws)
    scale = np.abs(w) * (np.abs(x_hat) + np.abs(mean) / sd) + np.abs(want)
    assert np.all(np.abs(ops.layer_norm(x, w, b, 1e-5) - want) <= 6 * U32 * scale)
