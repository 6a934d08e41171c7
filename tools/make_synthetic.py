"""Write Muse-Glimmer text GGUFs with the real keys and tensor names, filled with seeded random
weights. Used by tests (loader, caches, bad input) and for layouts too large to download.

    python -m tools.make_synthetic OUT.gguf [--layers 5 --embd 256 --ff 512 --heads 4 --heads-kv 2
                                             --head-dim 64 --vocab 512 --window 16 --type F32]
"""
import argparse
from dataclasses import dataclass

import numpy as np
from gguf import GGUFWriter, GGMLQuantizationType
from gguf import quants

ARCH = "muse-glimmer"


@dataclass
class TextDims:
    n_layer: int = 5
    n_embd: int = 256
    n_ff: int = 512
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 64
    n_vocab: int = 512
    n_swa: int = 16
    rope_base: float = 10000.0
    rms_eps: float = 1e-5
    logit_scale: float = 0.5
    softcap: float = 20.0
    qk_scale: float = 3.87
    # per-layer bools (written as an array), an int (written as the scalar period), or None for
    # the array of HF's rule (layer i full iff (n_layer - 1 - i) % 4 == 0), as the converter writes
    swa_pattern: object = None

    def swa_key_value(self):
        if isinstance(self.swa_pattern, int):
            return self.swa_pattern
        if self.swa_pattern is not None:
            return list(self.swa_pattern)
        return [(self.n_layer - 1 - i) % 4 != 0 for i in range(self.n_layer)]


def text_tensors(d, rng):  # TextDims -> {name: f32 array [out, in]}, weights scaled for unit activations
    E, F, D, V = d.n_embd, d.n_ff, d.head_dim, d.n_vocab
    q, kv = d.n_head * D, d.n_head_kv * D
    mat = lambda o, i: (rng.standard_normal((o, i)) / np.sqrt(i)).astype(np.float32)  # noqa: E731
    norm = lambda n: (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)  # noqa: E731
    t = {"token_embd.weight": rng.standard_normal((V, E)).astype(np.float32),
         "output_norm.weight": norm(E), "output.weight": mat(V, E) * 4}
    for il in range(d.n_layer):
        b = f"blk.{il}."
        t.update({
            b + "attn_norm.weight": norm(E), b + "attn_q.weight": mat(q, E), b + "attn_k.weight": mat(kv, E),
            b + "attn_v.weight": mat(kv, E), b + "attn_q_norm.weight": np.full(D, d.qk_scale, np.float32),
            b + "attn_k_norm.weight": np.ones(D, np.float32), b + "attn_gate.weight": mat(q, E),
            b + "attn_output.weight": mat(E, q), b + "post_attention_norm.weight": norm(E),
            b + "ffn_norm.weight": norm(E), b + "ffn_gate.weight": mat(F, E), b + "ffn_up.weight": mat(F, E),
            b + "ffn_down.weight": mat(E, F), b + "post_ffw_norm.weight": norm(E),
        })
    return t


class _EditingWriter(GGUFWriter):
    """Drops the keys in `omit` and writes `replace[key] = (value, GGUFValueType)` in place of the
    usual value, so a test can plant a missing key or a key of the wrong type."""

    def __init__(self, path, arch, omit, replace):
        self.omit, self.replace = omit, replace
        super().__init__(path, arch)

    def add_key_value(self, key, val, vtype, sub_type=None):
        if key in self.omit:
            return
        if key in self.replace:
            val, vtype = self.replace.pop(key)
        super().add_key_value(key, val, vtype, sub_type)


def vocab(n_vocab):  # -> tokens, token types: printable byte tokens, then BOS/EOS/EOT as CONTROL
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot|>"]
    tokens = [f"t{i}" for i in range(n_vocab - len(specials))] + specials
    types = [1] * (n_vocab - len(specials)) + [3] * len(specials)
    return tokens, types


def write_text_gguf(path, dims=None, qtype="F32", seed=0, tensors=None, extra_keys=None, omit_keys=()):
    """Writes a text GGUF; `tensors`, `extra_keys` ({key: (value, GGUFValueType)}, replacing or adding)
    and `omit_keys` let tests plant a bad shape, a key of another type or a missing key."""
    d = dims or TextDims()
    rng = np.random.default_rng(seed)
    tensors = text_tensors(d, rng) if tensors is None else tensors
    w = _EditingWriter(path, ARCH, set(omit_keys), dict(extra_keys or {}))
    a = lambda k: f"{ARCH}.{k}"  # noqa: E731
    w.add_uint32(a("context_length"), 4096)
    w.add_uint32(a("embedding_length"), d.n_embd)
    w.add_uint32(a("block_count"), d.n_layer)
    w.add_uint32(a("feed_forward_length"), d.n_ff)
    w.add_uint32(a("attention.head_count"), d.n_head)
    w.add_uint32(a("attention.head_count_kv"), d.n_head_kv)
    w.add_uint32(a("attention.key_length"), d.head_dim)
    w.add_uint32(a("attention.value_length"), d.head_dim)
    w.add_float32(a("rope.freq_base"), d.rope_base)
    w.add_float32(a("attention.layer_norm_rms_epsilon"), d.rms_eps)
    w.add_uint32(a("attention.sliding_window"), d.n_swa)
    pattern = d.swa_key_value()
    if isinstance(pattern, int):
        w.add_uint32(a("attention.sliding_window_pattern"), pattern)
    else:
        w.add_array(a("attention.sliding_window_pattern"), pattern)
    w.add_float32(a("logit_scale"), d.logit_scale)
    w.add_float32(a("final_logit_softcapping"), d.softcap)
    tokens, types = vocab(d.n_vocab)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "llama4")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", types)
    w.add_uint32("tokenizer.ggml.bos_token_id", d.n_vocab - 3)
    w.add_uint32("tokenizer.ggml.eos_token_id", d.n_vocab - 2)
    w.add_uint32("tokenizer.ggml.eot_token_id", d.n_vocab - 1)
    for key, (value, vtype) in list(w.replace.items()):
        w.add_key_value(key, value, vtype)
    qt = GGMLQuantizationType[qtype]
    for name, x in tensors.items():
        if x.ndim == 1 or qt == GGMLQuantizationType.F32:
            w.add_tensor(name, x.astype(np.float32))
        else:
            w.add_tensor(name, quants.quantize(x, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return d


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m tools.make_synthetic", description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--embd", type=int, default=256)
    p.add_argument("--ff", type=int, default=512)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--heads-kv", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--window", type=int, default=16)
    p.add_argument("--type", default="F32", help="GGML type of the 2-D weights (F32, F16, BF16, Q8_0, ...)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    dims = TextDims(n_layer=a.layers, n_embd=a.embd, n_ff=a.ff, n_head=a.heads, n_head_kv=a.heads_kv,
                    head_dim=a.head_dim, n_vocab=a.vocab, n_swa=a.window)
    write_text_gguf(a.out, dims, a.type, a.seed)


if __name__ == "__main__":
    main()
