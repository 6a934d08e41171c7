"""Where each text-model trace point lives in transformers' MuseGlimmerForConditionalGeneration.

tools/parity/hf_trace.py records them with forward hooks (and wraps the two functions that are no module)
into a trace that lines up with a reference trace or a llama.cpp dump. HF_DEBUGGER_POINTS says where
the same points sit in the output of transformers' model_addition_debugger_context, which
tools/parity/dump_parse.py reads. Each entry is (module path,
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


HEADS_OPS = {"Qcur", "Kcur", "Vcur", "Qcur_normed", "Kcur_normed", "Qcur_rope", "Kcur_rope"}  # traced [T, H, D]
ROPE_ROW_OPS = HEADS_OPS - {"Vcur"}  # rows in rotate_half order in HF

# transformers' model_addition_debugger_context(model, debug_path, do_prune_layers=False, use_repr=False):
# per trace point, the module path under the top-level class and which tensor of its call the
# debugger saved ("outputs", or "inputs": its first positional argument). The debugger saves every
# module's inputs but the outputs of leaf modules only, and names each file after its module: a
# module called twice keeps the second call's tensors (qk_norm normalizes Q, then K: K survives).
# l_out-L is the input of layer L+1 (of the final norm after the last layer); result_output is the
# top-level call's logits file, which the debugger writes although it prunes that entry from the JSON.
HF_DEBUGGER_POINTS = {
    "embd_norm": ("model.language_model.embed_tokens.embed_norm", "outputs"),
    "attn_norm-{il}": ("model.language_model.layers.{il}.input_layernorm", "outputs"),
    "Qcur-{il}": ("model.language_model.layers.{il}.self_attn.q_proj", "outputs"),
    "Kcur-{il}": ("model.language_model.layers.{il}.self_attn.k_proj", "outputs"),
    "Vcur-{il}": ("model.language_model.layers.{il}.self_attn.v_proj", "outputs"),
    "attn_gate_proj-{il}": ("model.language_model.layers.{il}.self_attn.gate_proj", "outputs"),
    "Kcur_normed-{il}": ("model.language_model.layers.{il}.self_attn.qk_norm", "outputs"),
    "attn_gated-{il}": ("model.language_model.layers.{il}.self_attn.o_proj", "inputs"),
    "attn_o_proj-{il}": ("model.language_model.layers.{il}.self_attn.o_proj", "outputs"),
    "attn_post_norm-{il}": ("model.language_model.layers.{il}.post_attention_layernorm", "outputs"),
    "ffn_inp-{il}": ("model.language_model.layers.{il}.pre_feedforward_layernorm", "inputs"),
    "ffn_norm-{il}": ("model.language_model.layers.{il}.pre_feedforward_layernorm", "outputs"),
    "ffn_out-{il}": ("model.language_model.layers.{il}.mlp.down_proj", "outputs"),
    "ffn_post_norm-{il}": ("model.language_model.layers.{il}.post_feedforward_layernorm", "outputs"),
    "l_out-{il}": ("model.language_model.layers.{next}", "inputs"),
    "result_norm": ("model.language_model.norm", "outputs"),
    "result_output": ("", "outputs_logits"),
}
# points of our trace the debugger cannot hold, and why
HF_DEBUGGER_MISSING = {
    "Qcur_normed": "qk_norm's second call (K) overwrote the file of its first (Q)",
    "Qcur_rope": "apply_rotary_pos_emb is a function, not a module", "Kcur_rope": "as Qcur_rope",
    "attn_out": "the attention function is not a module",
    "attn_gate_sig": "torch.sigmoid of gate_proj's output is not a module",
}


def debugger_module(name, n_layer):  # "l_out-4", 5 -> ("model.language_model.norm", "inputs")
    op, _, il = name.rpartition("-")
    if not (op and il.isdigit()):
        return HF_DEBUGGER_POINTS[name]
    path, what = HF_DEBUGGER_POINTS[op + "-{il}"]
    if op == "l_out" and int(il) == n_layer - 1:
        return HF_DEBUGGER_POINTS["result_norm"][0], "inputs"
    return path.format(il=il, next=int(il) + 1), what


def trace_layout(op, a, head_dim, heads_first):  # [T, ...] or [H, T, D] from HF -> f32 [T, ...] as we trace
    if heads_first:  # Q and K inside HF attention, between qk_norm and the attention function
        a = a.swapaxes(0, 1)
    if op in HEADS_OPS:
        a = a.reshape(a.shape[0], -1, head_dim)
    elif a.ndim == 3:
        a = a.reshape(a.shape[0], -1)
    if op in ROPE_ROW_OPS:
        a = hf_rope_rows_to_gguf(a, head_dim)
    return np.ascontiguousarray(a, dtype=np.float32)


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
