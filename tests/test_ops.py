"""ops.py against independent formulations of the same math."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from reference import ops

rng = np.random.default_rng(0)


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
    assert np.allclose(unpermute_rows(neox.reshape(T, -1).T, H).T, norm.reshape(T, -1), atol=1e-12)


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
    assert np.allclose(got, naive_attention(q, k, v, visible, 0.3), rtol=0, atol=1e-6)


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
    assert got.dtype == np.float32 and np.allclose(got, want, rtol=4e-7, atol=0)


def test_softcap_order_and_zero_disables():
    z = np.array([-100.0, -1.0, 0.0, 3.0, 100.0], np.float32)
    assert np.allclose(ops.softcap(z, 20.0), 20 * np.tanh(z / 20), rtol=1e-6)
    assert np.array_equal(ops.softcap(z, 0.0), z)


def test_activations():
    x = np.linspace(-8, 8, 33)
    assert np.allclose(ops.silu(x), x * ops.sigmoid(x))
    assert np.allclose(ops.swiglu(x, 2 * x), ops.silu(x) * 2 * x)
    from scipy.stats import norm
    assert np.allclose(ops.gelu_erf(x), x * norm.cdf(x), atol=1e-12)


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
    want = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + 1e-5) * w + b
    assert np.allclose(ops.layer_norm(x, w, b, 1e-5), want, atol=1e-5)
