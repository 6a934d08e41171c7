"""Where each text-model trace point lives in transformers' MuseGlimmerForConditionalGeneration.

tools/hf_trace.py records them with forward hooks (and wraps the two functions that are no module)
into a trace that lines up with a reference trace or a llama.cpp dump. Each entry is (module path,
what to record, how to turn it into the trace point), in forward order. Conversions every entry shares:
- HF activations are [batch, T, ...]; drop the batch axis. Inside attention HF keeps heads first
  ([batch, H, T, D]); the trace is [T, H, D].
- The GGUF's Q and K rows are in ggml's interleaved RoPE order; HF's q_proj/k_proj rows are in
  rotate_half order (llama.cpp's converter un-permutes them, conversion/muse_glimmer.py). Every
  Q/K point taken from HF goes through `hf_rope_rows_to_gguf` before comparing. RMSNorm over a
  head and RoPE itself commute with this per-head permutation, so one reorder serves all of them.
- The norms in HF add 1 to their weight at run time; the GGUF has it folded in. Same outputs.
"""
import numpy as np

HF_TEXT_MODULES = {
    "embd_norm": ("model.language_model.embed_tokens", "output", "embedding rows after the weightless RMSNorm"),
    "attn_norm-{il}": ("model.language_model.layers.{il}.input_layernorm", "output", ""),
    "Qcur-{il}": ("model.language_model.layers.{il}.self_attn.q_proj", "output", "hf_rope_rows_to_gguf"),
    "Kcur-{il}": ("model.language_model.layers.{il}.self_attn.k_proj", "output", "hf_rope_rows_to_gguf"),
    "Vcur-{il}": ("model.language_model.layers.{il}.self_attn.v_proj", "output", ""),
    "attn_gate_proj-{il}": ("model.language_model.layers.{il}.self_attn.gate_proj", "output", ""),
    "Qcur_normed-{il}": ("model.language_model.layers.{il}.self_attn.qk_norm", "output of the 1st call",
                         "times config.qk_scale_factor (the GGUF folds it into attn_q_norm); "
                         "transpose heads; hf_rope_rows_to_gguf"),
    "Kcur_normed-{il}": ("model.language_model.layers.{il}.self_attn.qk_norm", "output of the 2nd call",
                         "transpose heads; hf_rope_rows_to_gguf"),
    "Qcur_rope-{il}": ("model.language_model.layers.{il}.self_attn", "apply_rotary_pos_emb result [0]",
                       "no module: wrap the function; called on rope layers only (layer_rope_theta != 0); "
                       "transpose heads; hf_rope_rows_to_gguf"),
    "Kcur_rope-{il}": ("model.language_model.layers.{il}.self_attn", "apply_rotary_pos_emb result [1]",
                       "as Qcur_rope"),
    "attn_out-{il}": ("model.language_model.layers.{il}.self_attn", "attention_interface result [0]",
                      "no module: wrap the attention function, reshape [T, H*D]"),
    "attn_gate_sig-{il}": ("model.language_model.layers.{il}.self_attn.gate_proj", "output", "sigmoid of it"),
    "attn_gated-{il}": ("model.language_model.layers.{il}.self_attn.o_proj", "input", ""),
    "attn_o_proj-{il}": ("model.language_model.layers.{il}.self_attn.o_proj", "output", ""),
    "attn_post_norm-{il}": ("model.language_model.layers.{il}.post_attention_layernorm", "output", ""),
    "ffn_inp-{il}": ("model.language_model.layers.{il}.pre_feedforward_layernorm", "input", ""),
    "ffn_norm-{il}": ("model.language_model.layers.{il}.pre_feedforward_layernorm", "output", ""),
    "ffn_out-{il}": ("model.language_model.layers.{il}.mlp", "output", ""),
    "ffn_post_norm-{il}": ("model.language_model.layers.{il}.post_feedforward_layernorm", "output", ""),
    "l_out-{il}": ("model.language_model.layers.{il}", "output", ""),
    "result_norm": ("model.language_model.norm", "output", ""),
    "result_output": ("lm_head", "CausalLM output .logits",
                      "the model output, after output_multiplier and the tanh softcap (lm_head alone is before both)"),
}


def hf_module(name):  # "Qcur-3" -> ("model.language_model.layers.3.self_attn.q_proj", "output", note)
    op, _, il = name.rpartition("-")
    if op and il.isdigit():
        path, what, note = HF_TEXT_MODULES[op + "-{il}"]
        return path.format(il=il), what, note
    return HF_TEXT_MODULES[name]


def hf_rope_rows_to_gguf(x, head_dim):  # [..., n_head * head_dim] (or [..., n_head, head_dim]) -> same shape
    """HF keeps the two halves of each head apart (rotate_half pairs i with i + D/2); ggml pairs
    neighbours (2i, 2i+1). Element s*D/2 + j of a head moves to 2j + s, as the converter does to the rows."""
    shape = x.shape
    halves = x.reshape(*shape[:-1], -1, 2, head_dim // 2)
    return np.swapaxes(halves, -1, -2).reshape(shape)
