"""The fixture library: Muse-Glimmer GGUFs (text model, vision projector, DFlash drafter) with the
real keys and tensor names, filled with seeded random weights, streamed to disk one block of rows at a
time (the 30B layout never sits in memory), and seeded test images. `python -m tools.make_synthetic`
(tools/regen/make_synthetic.py) writes the files from the command line.

Small models take f32 arrays and quantize them with gguf.quants; the 30B layout writes random but
valid quantized blocks directly (random quant bits, f16 scales set so each weight matrix has a
standard deviation of about 1/sqrt(n_in), which keeps activations of order one through the layers).
"""
from dataclasses import dataclass

import numpy as np
from gguf import GGUFWriter, GGMLQuantizationType, GGML_QUANT_SIZES
from gguf import quants
from tqdm import tqdm

from reference.gguf import PATCH_EMBD_T1, TEMPORAL_PATCH_SIZE
from reference.random_blocks import F16_SCALE_OFFSETS, block_scale_for_unit_std, random_rows

ARCH = "muse-glimmer"
Q = GGMLQuantizationType
ROWS_PER_WRITE = 2048


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


# The release (docs/text.md, The release's sizes): 52 layers, 6656 wide, 32/2 heads of 128, window 2048.
RELEASE_30B = TextDims(n_layer=52, n_embd=6656, n_ff=19968, n_head=32, n_head_kv=2, head_dim=128,
                       n_vocab=202048, n_swa=2048, logit_scale=0.19611613513818404, softcap=20.0)

# Weight types by tensor role. ud-iq2_xxs follows the UD-IQ2_XXS files: IQ2_XXS for most 2-D weights,
# more bits where quantization hurts most (V, ffn_down) and for the embeddings and the output head.
MIXES = {
    "f32": {},
    "q8_0": {"default": Q.Q8_0},
    "ud-iq2_xxs": {"default": Q.IQ2_XXS, "attn_v": Q.IQ4_XS, "ffn_down": Q.IQ3_XXS,
                   "token_embd": Q.Q4_K, "output": Q.Q6_K},
}


def weight_type(mix, name):  # tensor name -> GGML type under a mix (1-D tensors are always F32)
    table = MIXES[mix]
    role = name.split(".")[-2]
    return table.get(role, table.get("default", Q.F32))


def text_shapes(d):  # TextDims -> [(name, NumPy shape)] in the converter's order
    E, F, D, V = d.n_embd, d.n_ff, d.head_dim, d.n_vocab
    q, kv = d.n_head * D, d.n_head_kv * D
    shapes = [("token_embd.weight", (V, E))]
    for il in range(d.n_layer):
        b = f"blk.{il}."
        shapes += [(b + "attn_norm.weight", (E,)), (b + "attn_q.weight", (q, E)), (b + "attn_k.weight", (kv, E)),
                   (b + "attn_v.weight", (kv, E)), (b + "attn_q_norm.weight", (D,)), (b + "attn_k_norm.weight", (D,)),
                   (b + "attn_gate.weight", (q, E)), (b + "attn_output.weight", (E, q)),
                   (b + "post_attention_norm.weight", (E,)), (b + "ffn_norm.weight", (E,)),
                   (b + "ffn_gate.weight", (F, E)), (b + "ffn_up.weight", (F, E)), (b + "ffn_down.weight", (E, F)),
                   (b + "post_ffw_norm.weight", (E,))]
    return shapes + [("output_norm.weight", (E,)), ("output.weight", (V, E))]


def random_f32(name, shape, rng, qk_scale=3.87):  # -> f32 array of unit-scale random weights
    if name.endswith("attn_q_norm.weight"):  # what the converter synthesizes (docs/text.md, Tensors)
        return np.full(shape, qk_scale, np.float32)
    if name.endswith("attn_k_norm.weight"):
        return np.ones(shape, np.float32)
    if len(shape) == 1:  # norms and biases
        return (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    if name == "token_embd.weight":
        return rng.standard_normal(shape).astype(np.float32)
    scale = 4 if name == "output.weight" else 1  # a peaked output distribution
    return (scale * rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))).astype(np.float32)


def text_tensors(d, rng):  # TextDims -> {name: f32 array [out, in]}
    return {name: random_f32(name, shape, rng, d.qk_scale) for name, shape in text_shapes(d)}


# ---------------------------------------------------------------------------------------------
# Streaming writer

@dataclass
class TensorSpec:
    name: str
    shape: tuple        # NumPy [out, in]
    qtype: object
    rows: object        # (start, stop) -> the stored rows: f32 values or raw quantized bytes

    @property
    def nbytes(self):
        block, size = GGML_QUANT_SIZES[self.qtype]
        return int(np.prod(self.shape)) // block * size


def stream_gguf(path, arch, add_keys, specs, progress=False):
    """Writes the header, the keys (add_keys(writer)), the tensor infos, then each tensor's rows
    ROWS_PER_WRITE at a time; memory stays at one block of rows."""
    w = GGUFWriter(path, arch, use_temp_file=False)
    add_keys(w)
    for s in specs:
        w.add_tensor_info(s.name, s.shape, np.float32, s.nbytes, raw_dtype=s.qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    out = w.fout[0]
    w.write_padding(out, out.tell())
    for s in tqdm(specs, desc="tensors", disable=not progress):
        n_rows = s.shape[0] if len(s.shape) > 1 else 1
        for start in range(0, n_rows, ROWS_PER_WRITE):
            out.write(np.ascontiguousarray(s.rows(start, min(start + ROWS_PER_WRITE, n_rows))).tobytes())
        w.write_padding(out, s.nbytes)
    w.close()


# What convert_hf_to_gguf stores whatever --outtype says (ModelBase.prepare_tensors,
# llama.cpp/conversion/base.py:1083-1145): vectors, norms and every tensor not named *.weight in F32;
# "some tensor types are always in float32", of this model's only V_ENC_EMBD_POS (mtmd's
# ggml_interpolate asserts F32 on it); token_embd and output of a ternary file in F16. The patch
# embedding is F16 in an F16 file and F32 otherwise (MmprojModel.tensor_force_quant, :2743-2746).
ALWAYS_F32 = ("v.position_embd.weight",)
TERNARY_F16 = ("token_embd.weight", "output.weight")


def stored_type(name, shape, qtype):  # -> the GGML type the converter writes tensor `name` in, asked for qtype
    if len(shape) == 1 or name.endswith("_norm.weight") or not name.endswith(".weight") or name in ALWAYS_F32:
        return Q.F32
    if name == "v.patch_embd.weight":
        return Q.F16 if qtype == Q.F16 else Q.F32
    if name in TERNARY_F16 and qtype in (Q.TQ1_0, Q.TQ2_0):
        return Q.F16
    return qtype


def array_spec(name, x, qtype):  # a tensor held in memory, quantized as it is written
    qtype = stored_type(name, x.shape, qtype)
    if x.ndim == 1:  # one "row": the whole vector
        return TensorSpec(name, x.shape, Q.F32, lambda a, b: x.astype(np.float32))
    if qtype == Q.F32:
        return TensorSpec(name, x.shape, qtype, lambda a, b: x[a:b].astype(np.float32))
    return TensorSpec(name, x.shape, qtype, lambda a, b: quants.quantize(x[a:b], qtype))


def random_spec(name, shape, qtype, seed, qk_scale=3.87):  # a tensor generated row block by row block
    qtype = stored_type(name, shape, qtype)
    unit = block_scale_for_unit_std(qtype) if qtype not in (Q.F32, Q.F16, Q.BF16) else 1.0

    def rows(start, stop):
        rng = np.random.default_rng([seed, start])
        if len(shape) == 1:
            return random_f32(name, shape, rng, qk_scale)
        if qtype in (Q.F32, Q.F16, Q.BF16):
            return quants.quantize(random_f32(name, (stop - start, *shape[1:]), rng, qk_scale), qtype)
        n_in = int(np.prod(shape[1:]))
        std = 1.0 if name == "token_embd.weight" else 1.0 / np.sqrt(n_in)
        return random_rows(qtype, stop - start, n_in, std, rng, unit)
    return TensorSpec(name, shape, qtype, rows)


def text_keys(d):  # TextDims -> add_keys(writer) for the text role
    def add_keys(w):
        a = lambda k: f"{ARCH}.{k}"  # noqa: E731
        for key, value in (("context_length", 131072), ("embedding_length", d.n_embd), ("block_count", d.n_layer),
                           ("feed_forward_length", d.n_ff), ("attention.head_count", d.n_head),
                           ("attention.head_count_kv", d.n_head_kv), ("attention.key_length", d.head_dim),
                           ("attention.value_length", d.head_dim), ("attention.sliding_window", d.n_swa)):
            w.add_uint32(a(key), value)
        w.add_float32(a("rope.freq_base"), d.rope_base)
        w.add_float32(a("attention.layer_norm_rms_epsilon"), d.rms_eps)
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
        # a BPE vocabulary without merges is refused by llama.cpp's loader; the converter always writes them
        w.add_array("tokenizer.ggml.merges", ["t 1"])
    return add_keys


class EditingKeys:
    """Wraps add_keys so that the keys in `omit` are dropped and `replace[key] = (value,
    GGUFValueType)` is written in place of (or in addition to) the usual value: tests plant a
    missing key or a key of the wrong type with it."""

    def __init__(self, add_keys, omit, replace):
        self.add_keys, self.omit, self.replace = add_keys, set(omit), dict(replace)

    def __call__(self, w):
        original = w.add_key_value
        pending = dict(self.replace)

        def edited(key, val, vtype, sub_type=None):
            if key in self.omit:
                return
            if key in pending:
                val, vtype = pending.pop(key)
            original(key, val, vtype, sub_type)
        w.add_key_value = edited
        self.add_keys(w)
        for key, (val, vtype) in pending.items():
            original(key, val, vtype)


def vocab(n_vocab):  # -> tokens, token types: ordinary tokens, then BOS/EOS/EOT as CONTROL
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot|>"]
    tokens = [f"t{i}" for i in range(n_vocab - len(specials))] + specials
    types = [1] * (n_vocab - len(specials)) + [3] * len(specials)
    return tokens, types


def write_text_gguf(path, dims=None, qtype="F32", seed=0, tensors=None, extra_keys=None, omit_keys=()):
    """A small text GGUF from f32 arrays. `tensors`, `extra_keys` ({key: (value, GGUFValueType)},
    replacing or adding) and `omit_keys` let tests plant a bad shape, a key of another type or a
    missing key."""
    d = dims or TextDims()
    tensors = text_tensors(d, np.random.default_rng(seed)) if tensors is None else tensors
    specs = [array_spec(name, x, Q[qtype]) for name, x in tensors.items()]
    stream_gguf(path, ARCH, EditingKeys(text_keys(d), omit_keys, extra_keys or {}), specs)
    return d


def write_layout_gguf(path, dims, mix, seed=0, progress=True):  # the release layout, random blocks
    specs = [random_spec(name, shape, weight_type(mix, name), seed + i, dims.qk_scale)
             for i, (name, shape) in enumerate(text_shapes(dims))]
    stream_gguf(path, ARCH, text_keys(dims), specs, progress)


# ---------------------------------------------------------------------------------------------
# The vision projector (clip, projector muse-glimmer) and the DFlash drafter

@dataclass
class VisionDims:
    n_layer: int = 2
    n_embd: int = 64
    n_ff: int = 128
    n_head: int = 2
    patch: int = 14
    n_pos: int = 64          # position-table rows: a square grid, its side is the window
    merge: int = 2
    adapter: int = 128       # width of the adapter MLP (mm.0, mm.1)
    n_out: int = 256         # the text model's n_embd


# docs/vision.md, "GGUF": the 50-layer, 1536-wide tower of the release and its adapter to 6656
RELEASE_MMPROJ = VisionDims(n_layer=50, n_embd=1536, n_ff=8960, n_head=16, patch=14, n_pos=1024, merge=2,
                            adapter=4096, n_out=6656)


def vision_shapes(v):  # VisionDims -> [(name, NumPy shape)]
    E, F = v.n_embd, v.n_ff
    shapes = [("v.patch_embd.weight", (E, 3, v.patch, v.patch)), ("v.position_embd.weight", (v.n_pos, E)),
              ("v.pre_ln.weight", (E,)), ("v.pre_ln.bias", (E,))]
    for il in range(v.n_layer):
        b = f"v.blk.{il}."
        shapes += [(b + "ln1.weight", (E,)), (b + "ln1.bias", (E,))]
        for proj in ("attn_q", "attn_k", "attn_v", "attn_out"):
            shapes += [(b + proj + ".weight", (E, E)), (b + proj + ".bias", (E,))]
        shapes += [(b + "ln2.weight", (E,)), (b + "ln2.bias", (E,)), (b + "ffn_up.weight", (F, E)),
                   (b + "ffn_up.bias", (F,)), (b + "ffn_down.weight", (E, F)), (b + "ffn_down.bias", (E,))]
    return shapes + [("v.post_ln.weight", (E,)), ("v.post_ln.bias", (E,)),
                     ("mm.0.weight", (v.adapter, E * v.merge * v.merge)), ("mm.1.weight", (v.adapter, v.adapter)),
                     ("mm.2.weight", (v.n_out, v.adapter))]


def vision_keys(v):  # VisionDims -> add_keys(writer): the keys the converter writes for the mmproj
    def add_keys(w):
        w.add_string("general.type", "mmproj")
        w.add_string("clip.projector_type", "muse-glimmer")
        w.add_bool("clip.has_vision_encoder", True)
        side = int(round(np.sqrt(v.n_pos)))
        for key, value in (("image_size", side * v.patch * v.merge), ("patch_size", v.patch),
                           ("embedding_length", v.n_embd), ("feed_forward_length", v.n_ff),
                           ("block_count", v.n_layer), ("attention.head_count", v.n_head),
                           ("spatial_merge_size", v.merge), ("projection_dim", v.n_out)):
            w.add_uint32(f"clip.vision.{key}", value)
        w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-5)
        w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
        w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    return add_keys


def video_extension(v):  # VisionDims -> (add_keys, shapes) of the video extension (docs/vision.md, Video)
    def add_keys(w):
        w.add_uint32(TEMPORAL_PATCH_SIZE, 2)
    return add_keys, [(PATCH_EMBD_T1, (v.n_embd, 3, v.patch, v.patch))]  # F32: its name is not *.weight


def write_mmproj_gguf(path, dims=None, qtype="F32", seed=0, progress=False, video=False):  # -> path
    """video: with the extension tools.video_mmproj adds, a random second-frame half W1."""
    v = dims or VisionDims()
    add_keys, shapes = vision_keys(v), vision_shapes(v)
    if video:
        add_video_keys, video_shapes = video_extension(v)
        add_keys, shapes = chain(add_keys, add_video_keys), shapes + video_shapes
    specs = [random_spec(name, shape, Q[qtype], seed + i) for i, (name, shape) in enumerate(shapes)]
    stream_gguf(str(path), "clip", add_keys, specs, progress)
    return str(path)


def chain(*add_keys):  # add_keys functions -> one that calls each in turn
    def add_all(w):
        for add in add_keys:
            add(w)
    return add_all


@dataclass
class DraftDims:
    n_layer: int = 2
    n_embd: int = 256
    n_ff: int = 256
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 32
    block_size: int = 4
    target_layers: tuple = (2, 4)   # GGUF convention: the input of these target layers
    n_swa: int = 16
    mask_token: int = 511


# docs/dflash.md, "The drafter GGUF": 5 layers over the 52-layer target, 32/8 heads, block 16, target layers HF ids + 1
RELEASE_DRAFTER = DraftDims(n_layer=5, n_embd=6656, n_ff=19968, n_head=32, n_head_kv=8, head_dim=128,
                            block_size=16, target_layers=(2, 14, 26, 38, 50), n_swa=2048, mask_token=201818)


def draft_shapes(d):  # DraftDims -> [(name, NumPy shape)]
    E, F, D = d.n_embd, d.n_ff, d.head_dim
    q, kv = d.n_head * D, d.n_head_kv * D
    shapes = [("fc.weight", (E, len(d.target_layers) * E)), ("enc.output_norm.weight", (E,))]
    for il in range(d.n_layer):
        b = f"blk.{il}."
        shapes += [(b + "attn_norm.weight", (E,)), (b + "attn_q.weight", (q, E)), (b + "attn_k.weight", (kv, E)),
                   (b + "attn_v.weight", (kv, E)), (b + "attn_output.weight", (E, q)),
                   (b + "attn_q_norm.weight", (D,)), (b + "attn_k_norm.weight", (D,)), (b + "ffn_norm.weight", (E,)),
                   (b + "ffn_gate.weight", (F, E)), (b + "ffn_up.weight", (F, E)), (b + "ffn_down.weight", (E, F))]
    return shapes + [("output_norm.weight", (E,))]


def draft_keys(d):  # DraftDims -> add_keys(writer): the keys of the converter's dflash GGUF
    def add_keys(w):
        a = lambda k: f"dflash.{k}"  # noqa: E731
        for key, value in (("context_length", 131072), ("embedding_length", d.n_embd), ("block_count", d.n_layer),
                           ("feed_forward_length", d.n_ff), ("attention.head_count", d.n_head),
                           ("attention.head_count_kv", d.n_head_kv), ("attention.key_length", d.head_dim),
                           ("attention.value_length", d.head_dim), ("block_size", d.block_size),
                           ("attention.sliding_window", d.n_swa)):
            w.add_uint32(a(key), value)
        w.add_float32(a("rope.freq_base"), 500000.0)
        w.add_float32(a("attention.layer_norm_rms_epsilon"), 1e-5)
        w.add_array(a("target_layers"), list(d.target_layers))
        w.add_array(a("attention.sliding_window_pattern"), [True] * d.n_layer)
        w.add_uint32("tokenizer.ggml.mask_token_id", d.mask_token)
    return add_keys


def write_draft_gguf(path, dims=None, qtype="F32", seed=0, progress=False):  # -> path
    d = dims or DraftDims()
    specs = [random_spec(name, shape, Q[qtype], seed + i) for i, (name, shape) in enumerate(draft_shapes(d))]
    stream_gguf(str(path), "dflash", draft_keys(d), specs, progress)
    return str(path)


FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)


def type_problem(shapes, qtype, from_floats):  # -> why `qtype` cannot store these tensors, or ""
    """from_floats: the small text model quantizes f32 arrays with gguf-py; every other writer
    makes random blocks, which needs the block's f16 scale offsets (F16_SCALE_OFFSETS)."""
    if qtype in FLOAT_TYPES:
        return ""
    block = GGML_QUANT_SIZES[qtype][0]
    if from_floats:
        try:
            quants.quantize(np.zeros((1, block), np.float32), qtype)
        except NotImplementedError:
            return f"gguf-py cannot quantize {qtype.name}"
    elif qtype not in F16_SCALE_OFFSETS:
        return (f"random {qtype.name} blocks are not supported (types: "
                f"{', '.join(t.name for t in FLOAT_TYPES + tuple(F16_SCALE_OFFSETS))})")
    for name, shape in shapes:  # ggml blocks run along a row: its length must be a whole number of them
        n_in = int(np.prod(shape[1:]))
        if stored_type(name, shape, qtype) == qtype and n_in % block:
            return f"{name} has rows of {n_in} values, not a multiple of {qtype.name}'s block of {block}"
    return ""


# ---------------------------------------------------------------------------------------------
# Test images (the vision goldens' cases, tests and benchmarks)

def raw_words(seed, n):  # -> uint64 [n]; PCG64's raw stream is fixed across NumPy versions
    return np.random.PCG64(seed).random_raw(n).astype(np.uint64)


def synthetic_image(width, height, seed, kind):  # -> uint8 [height, width, 3]
    """'noise': uniform bytes. 'smooth': per channel an integer triangle wave over a slanted ramp,
    plus six solid rectangles with hard edges (Lanczos rings on them)."""
    if kind == "noise":
        n = height * width * 3
        data = raw_words(seed, (n + 7) // 8).astype("<u8").tobytes()[:n]
        return np.frombuffer(data, np.uint8).reshape(height, width, 3).copy()
    params = (raw_words(seed, 6 + 6 * 7) % np.uint64(1 << 16)).astype(np.int64)
    y, x = np.mgrid[0:height, 0:width].astype(np.int64)
    channels = []
    for c in range(3):
        fx, fy = 1 + params[2 * c] % 6, 1 + params[2 * c + 1] % 6
        v = (x * fx * 512) // max(width, 1) + (y * fy * 512) // max(height, 1) + params[c] % 512
        t = v % 512
        channels.append(np.where(t < 256, t, 511 - t))
    img = np.stack(channels, axis=-1)
    for r in range(6):
        p = params[6 + 7 * r: 13 + 7 * r]
        x0, x1 = sorted((int(p[0] % (width + 1)), int(p[1] % (width + 1))))
        y0, y1 = sorted((int(p[2] % (height + 1)), int(p[3] % (height + 1))))
        img[y0:y1, x0:x1] = p[4:7] % 256
    return img.astype(np.uint8)
