"""Planted bugs in copies of the reference forward: tools.bisect names the first layer and op of each
from the two traces alone (the clean forward as A, the buggy copy as B).

Model golden/models/tiny-a-f32.gguf: 5 layers, full / swa / swa / swa / full (the GGUF's
sliding_window_pattern array), window 16. The 40-token prompt is longer than the window, so the
sliding-window mask cuts keys on layers 1-3.

Threshold per trace point: tools.bisect's --noise-floor rule, 64 x NMSE(float64 trace, float32
trace) of the clean run, never below 64 x 2^-48. Every bug below is found at the op where it is
planted and at no earlier point; the smallest, the post-norm eps, moves attn_post_norm-0 by NMSE
2.7e-9 (measured) against a threshold of 1.8e-12 there.
"""
import dataclasses
import os

import numpy as np
import pytest
from conftest import MODELS

from reference import gguf, ops
from reference.text import TextModel
from reference.trace import Tracer
from tools.parity import bisect as bisect_tool

PROMPT = [497] + [int(t) for t in np.random.default_rng(40).integers(0, 497, 39)]


class PostNormEps(TextModel):
    """RMSNorm after attention and FFN with the model's rms eps (1e-5) instead of llama.cpp's
    hard-coded 1e-8."""

    def __init__(self, model, dtype=np.float32):
        super().__init__(model, dtype)
        self.cfg = dataclasses.replace(self.cfg, post_norm_eps=1e-5)


class ScalarSwaRule(TextModel):
    """llama.cpp's scalar fallback (period 4: layer i slides iff i % 4 < 3) instead of the GGUF's
    per-layer array: layers 0 and 4 become sliding-window (RoPE and window), layer 3 full (NoPE)."""

    def __init__(self, model, dtype=np.float32):
        super().__init__(model, dtype)
        period = 4
        swa = tuple(i % period < period - 1 for i in range(self.cfg.n_layer))
        self.cfg = dataclasses.replace(self.cfg, swa_layers=swa)


class NormWeightOff(TextModel):
    """Layer 2's post-attention norm weight 0.1 % too large: a small bug in the middle of the model."""

    def norm_weight(self, w):  # gguf.Tensor [n] -> [n]
        scale = 1.001 if w == self.layers[2].post_attention_norm else 1.0
        return super().norm_weight(w) * self.dtype.type(scale)


class AttentionCopy(TextModel):
    """TextModel.attention_sublayer copied, with two switches for the bugs planted in it."""
    gate_after_o_proj = False
    rope_on_full_layers = False

    def attention_sublayer(self, il, x, positions, cache, trace):  # x [T, E] -> [T, E] (to add to x)
        c, layer = self.cfg, self.layers[il]
        T, swa = x.shape[0], c.swa_layers[il]
        h = ops.rms_norm(x, c.rms_eps) * self.norm_weight(layer.attn_norm)
        trace(f"attn_norm-{il}", h)
        q, k, v = self.qkv(il, h)
        trace(f"Qcur-{il}", q), trace(f"Kcur-{il}", k), trace(f"Vcur-{il}", v)
        gate = self.backend.linear(h, layer.attn_gate)
        trace(f"attn_gate_proj-{il}", gate)
        q = ops.rms_norm(q, c.rms_eps) * self.norm_weight(layer.attn_q_norm)
        k = ops.rms_norm(k, c.rms_eps) * self.norm_weight(layer.attn_k_norm)
        trace(f"Qcur_normed-{il}", q), trace(f"Kcur_normed-{il}", k)
        if swa or self.rope_on_full_layers:
            theta = ops.rope_angles(positions, c.n_rot, c.rope_base_swa, self.dtype)
            q, k = ops.rope_norm(q, theta), ops.rope_norm(k, theta)
            trace(f"Qcur_rope-{il}", q), trace(f"Kcur_rope-{il}", k)
        layer_cache = cache.layers[il]
        layer_cache.store(positions, k, v)
        k_rows, v_rows, k_pos = layer_cache.live()
        visible = ops.causal_visible(positions, k_pos, c.n_swa if swa else 0)
        o = self.backend.attention(q, k_rows, v_rows, visible, 1.0 / np.sqrt(c.head_dim)).reshape(T, -1)
        trace(f"attn_out-{il}", o)
        g = ops.sigmoid(gate)
        trace(f"attn_gate_sig-{il}", g)
        if self.gate_after_o_proj:
            # ggml_mul broadcasts a [H*D] row over [E] by repeating it (E is a multiple of H*D),
            # so in llama.cpp this bug runs without a shape error
            a = self.backend.linear(o, layer.attn_output)
            trace(f"attn_o_proj-{il}", a)
            a = a * np.tile(g, (1, a.shape[1] // g.shape[1]))
        else:
            o = o * g
            trace(f"attn_gated-{il}", o)
            a = self.backend.linear(o, layer.attn_output)
            trace(f"attn_o_proj-{il}", a)
        a = ops.rms_norm(a, c.post_norm_eps) * self.norm_weight(layer.post_attention_norm)
        trace(f"attn_post_norm-{il}", a)
        return a


class GateAfterOProj(AttentionCopy):
    gate_after_o_proj = True


class RopeOnFullLayers(AttentionCopy):
    rope_on_full_layers = True


@pytest.fixture(scope="module")
def tiny_a():  # -> GGUFModel
    return gguf.load(os.path.join(MODELS, "tiny-a-f32.gguf"), "text")


def trace_of(lm, ids=PROMPT):  # -> {name: tensor} of one prefill
    tracer = Tracer(keep_in_memory=True)
    lm.prefill(ids, lm.new_cache(len(ids), "uniform"), trace=tracer)
    return tracer.points


@pytest.fixture(scope="module")
def clean(tiny_a):  # -> (clean trace, per-point thresholds from the float64 run)
    trace = trace_of(TextModel(tiny_a))
    return trace, bisect_tool.noise_thresholds(trace, trace_of(TextModel(tiny_a, np.float64)))


def test_the_prompt_is_longer_than_the_window(tiny_a):
    cfg = tiny_a.config
    assert cfg.swa_layers == (False, True, True, True, False) and len(PROMPT) > 2 * cfg.n_swa


def test_a_clean_copy_does_not_diverge(tiny_a, clean):
    trace, thresholds = clean
    result = bisect_tool.bisect(trace, trace_of(AttentionCopy(tiny_a)), thresholds)
    assert result["first"] is None and len(result["points"]) == len(trace)


def first_divergence(clean, buggy):  # -> (name, layer, op, result)
    trace, thresholds = clean
    result = bisect_tool.bisect(trace, buggy, thresholds)
    first = result["first"]
    assert first is not None, "the bug went unnoticed"
    return first["name"], first["layer"], first["op"], result


def test_post_norm_eps(tiny_a, clean):
    name, layer, op, result = first_divergence(clean, trace_of(PostNormEps(tiny_a)))
    assert (name, layer, op) == ("attn_post_norm-0", 0, "attn_post_norm")
    assert result["first"]["nmse"] > 100 * result["first"]["threshold"]


def test_norm_weight_off_by_a_thousandth(tiny_a, clean):
    name, layer, op, _ = first_divergence(clean, trace_of(NormWeightOff(tiny_a)))
    assert (name, layer, op) == ("attn_post_norm-2", 2, "attn_post_norm")


def test_neox_rope(tiny_a, clean, monkeypatch):
    monkeypatch.setattr(ops, "rope_norm", ops.rope_neox)
    name, layer, op, _ = first_divergence(clean, trace_of(TextModel(tiny_a)))
    assert (name, layer, op) == ("Qcur_rope-1", 1, "Qcur_rope")  # layer 0 is full: NoPE


def test_scalar_swa_rule_on_an_array_pattern_model(tiny_a, clean):
    name, layer, op, result = first_divergence(clean, trace_of(ScalarSwaRule(tiny_a)))
    assert (name, layer, op) == ("Qcur_rope-0", 0, "Qcur_rope") and result["first"]["only_in"] == "B"
    one_sided = {p["name"]: p["only_in"] for p in result["points"] if p["only_in"]}
    # layers 0 and 4 gain RoPE, layer 3 loses it: the scalar rule's pattern, read off the traces
    assert one_sided == {"Qcur_rope-0": "B", "Kcur_rope-0": "B", "Qcur_rope-3": "A", "Kcur_rope-3": "A",
                         "Qcur_rope-4": "B", "Kcur_rope-4": "B"}


def test_gate_after_o_proj(tiny_a, clean):
    name, layer, op, result = first_divergence(clean, trace_of(GateAfterOProj(tiny_a)))
    assert (name, layer, op) == ("attn_o_proj-0", 0, "attn_o_proj")
    by_name = {p["name"]: p for p in result["points"]}
    assert not by_name["attn_gate_sig-0"]["diverged"] and "attn_gated-0" in result["only_in_a"]


def test_rope_on_full_layers(tiny_a, clean):
    name, layer, op, result = first_divergence(clean, trace_of(RopeOnFullLayers(tiny_a)))
    assert (name, layer, op) == ("Qcur_rope-0", 0, "Qcur_rope") and result["first"]["only_in"] == "B"
    one_sided = {p["name"]: p["only_in"] for p in result["points"] if p["only_in"]}
    # unlike the scalar SWA rule, every layer that had RoPE keeps it
    assert one_sided == {"Qcur_rope-0": "B", "Kcur_rope-0": "B", "Qcur_rope-4": "B", "Kcur_rope-4": "B"}
