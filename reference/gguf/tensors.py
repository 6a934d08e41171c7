"""Each role's tensors, resolved once at load into the record its forward reads (`layer.attn_norm`),
as llama.cpp resolves `layers[il].attn_norm` with create_tensor and the shape it expects
(src/models/muse-glimmer.cpp load_arch_tensors; a fused attn_qkv per layer as create_tensor_qkv,
src/llama-model.cpp:3396-3430). Shapes are NumPy's [out, in] (ggml's ne reversed). A tensor that
is missing, or whose shape disagrees with the metadata, is one TensorError naming it, before any
forward. The records hold handles (weights.Tensor): the data stays in the memory map until a
product reads it.
"""
from typing import NamedTuple

from .reader import GGUFError
from .weights import decodable, unsupported


class TensorError(GGUFError):
    """A tensor the metadata implies that the file lacks, or holds in another shape."""

    def __init__(self, path, tensor, problem):
        super().__init__(path, problem)
        self.tensor = tensor


class Resolver:
    """llama.cpp's create_tensor over one file: a name and its expected shape -> the handle."""

    def __init__(self, weights):
        self.weights = weights

    def __call__(self, name, shape, required=True):  # -> Tensor, or None for an optional one the file lacks
        w = self.weights
        if name not in w:
            if not required:
                return None
            raise TensorError(w.path, name, f"missing tensor {name}")
        if w.shape(name) != tuple(shape):
            raise TensorError(w.path, name, f"tensor {name} has shape {list(w.shape(name))}, "
                                            f"the metadata implies {list(shape)}")
        return w.tensor(name)

    def affine(self, prefix, shape):  # "v.blk.0.attn_q", weight shape -> Affine of its .weight and .bias
        return Affine(self(prefix + ".weight", shape), self(prefix + ".bias", shape[:1]))


def check_types(weights):  # every tensor of the file decodable, or GGUFError naming the first that is not
    for name, t in weights.tensors.items():
        if not decodable(t.tensor_type):
            raise GGUFError(weights.path, unsupported(t.tensor_type, name))


# ---------------------------------------------------------------------------------------------
# The text model

class TextLayer(NamedTuple):
    attn_norm: object
    attn_q: object            # None where the layer has a fused attn_qkv
    attn_k: object
    attn_v: object
    attn_qkv: object          # [q | k | v rows], or None
    attn_q_bias: object       # optional: None when absent
    attn_k_bias: object
    attn_v_bias: object
    attn_q_norm: object
    attn_k_norm: object
    attn_gate: object
    attn_output: object
    post_attention_norm: object
    ffn_norm: object
    ffn_gate: object
    ffn_up: object
    ffn_down: object
    post_ffw_norm: object


class TextTensors(NamedTuple):
    token_embd: object
    output_norm: object
    output: object
    layers: tuple  # TextLayer per layer


def text_tensors(c, weights):  # TextConfig, Weights -> TextTensors
    E, V, F, D = c.n_embd, c.n_vocab, c.n_ff, c.head_dim
    q, kv = c.n_head * D, c.n_head_kv * D
    create = Resolver(weights)

    def layer(b):  # "blk.{il}." -> TextLayer
        qkv = create(b + "attn_qkv.weight", (q + 2 * kv, E), required=False)
        split = qkv is None
        return TextLayer(
            attn_norm=create(b + "attn_norm.weight", (E,)),
            attn_q=create(b + "attn_q.weight", (q, E)) if split else None,
            attn_k=create(b + "attn_k.weight", (kv, E)) if split else None,
            attn_v=create(b + "attn_v.weight", (kv, E)) if split else None,
            attn_qkv=qkv,
            attn_q_bias=create(b + "attn_q.bias", (q,), required=False),
            attn_k_bias=create(b + "attn_k.bias", (kv,), required=False),
            attn_v_bias=create(b + "attn_v.bias", (kv,), required=False),
            attn_q_norm=create(b + "attn_q_norm.weight", (D,)),
            attn_k_norm=create(b + "attn_k_norm.weight", (D,)),
            attn_gate=create(b + "attn_gate.weight", (q, E)),
            attn_output=create(b + "attn_output.weight", (E, q)),
            post_attention_norm=create(b + "post_attention_norm.weight", (E,)),
            ffn_norm=create(b + "ffn_norm.weight", (E,)),
            ffn_gate=create(b + "ffn_gate.weight", (F, E)),
            ffn_up=create(b + "ffn_up.weight", (F, E)),
            ffn_down=create(b + "ffn_down.weight", (E, F)),
            post_ffw_norm=create(b + "post_ffw_norm.weight", (E,)),
        )

    return TextTensors(token_embd=create("token_embd.weight", (V, E)),
                       output_norm=create("output_norm.weight", (E,)),
                       output=create("output.weight", (V, E)),
                       layers=tuple(layer(f"blk.{il}.") for il in range(c.n_layer)))


# ---------------------------------------------------------------------------------------------
# The vision tower and adapter (tools/mtmd/clip.cpp's names)

class Affine(NamedTuple):  # a weight and its bias: a linear map, or a LayerNorm's scale and shift
    weight: object
    bias: object


class VisionLayer(NamedTuple):
    ln1: Affine
    attn_q: Affine
    attn_k: Affine
    attn_v: Affine
    attn_out: Affine
    ln2: Affine
    ffn_up: Affine
    ffn_down: Affine


class VisionTensors(NamedTuple):
    patch_embd: object      # [E, 3, p, p]; with the video extension the summed kernel W0 + W1
    patch_embd_t1: object   # the video extension's W1 (configs.PATCH_EMBD_T1), or None
    position_embd: object   # [side * side, E]
    pre_ln: Affine
    post_ln: Affine
    layers: tuple           # VisionLayer per layer
    mm_0: object            # the adapter: [hidden, 4 E], [hidden, hidden], [n_out, hidden]
    mm_1: object
    mm_2: object


def vision_tensors(c, weights, patch_embd_t1):  # VisionConfig, Weights, the extension's name -> VisionTensors
    E, F, P = c.n_embd, c.n_ff, c.patch_size
    create = Resolver(weights)
    rows = lambda name: weights.shape(name)[0] if name in weights else 0  # noqa: E731 (sizes no key holds)
    hidden = rows("mm.0.weight")

    def layer(b):  # "v.blk.{il}." -> VisionLayer
        return VisionLayer(ln1=create.affine(b + "ln1", (E,)),
                           attn_q=create.affine(b + "attn_q", (E, E)), attn_k=create.affine(b + "attn_k", (E, E)),
                           attn_v=create.affine(b + "attn_v", (E, E)), attn_out=create.affine(b + "attn_out", (E, E)),
                           ln2=create.affine(b + "ln2", (E,)),
                           ffn_up=create.affine(b + "ffn_up", (F, E)), ffn_down=create.affine(b + "ffn_down", (E, F)))

    return VisionTensors(
        patch_embd=create("v.patch_embd.weight", (E, 3, P, P)),
        patch_embd_t1=create(patch_embd_t1, (E, 3, P, P), required=False),
        position_embd=create("v.position_embd.weight", (rows("v.position_embd.weight"), E)),
        pre_ln=create.affine("v.pre_ln", (E,)), post_ln=create.affine("v.post_ln", (E,)),
        layers=tuple(layer(f"v.blk.{il}.") for il in range(c.n_layer)),
        mm_0=create("mm.0.weight", (hidden, E * c.merge_size * c.merge_size)),
        mm_1=create("mm.1.weight", (hidden, hidden)),
        mm_2=create("mm.2.weight", (rows("mm.2.weight"), hidden)),
    )


# ---------------------------------------------------------------------------------------------
# The DFlash drafter: it borrows its target's token_embd and output

class DraftLayer(NamedTuple):
    attn_norm: object
    attn_q: object
    attn_k: object
    attn_v: object
    attn_output: object
    attn_q_norm: object
    attn_k_norm: object
    ffn_norm: object
    ffn_gate: object
    ffn_up: object
    ffn_down: object


class DraftTensors(NamedTuple):
    fc: object               # [E, n_target_layers * E]
    enc_output_norm: object
    output_norm: object
    layers: tuple            # DraftLayer per layer


def draft_tensors(c, weights):  # DraftConfig, Weights -> DraftTensors
    E, F, D = c.n_embd, c.n_ff, c.head_dim
    q, kv = c.n_head * D, c.n_head_kv * D
    create = Resolver(weights)

    def layer(b):  # "blk.{il}." -> DraftLayer
        return DraftLayer(
            attn_norm=create(b + "attn_norm.weight", (E,)),
            attn_q=create(b + "attn_q.weight", (q, E)), attn_k=create(b + "attn_k.weight", (kv, E)),
            attn_v=create(b + "attn_v.weight", (kv, E)), attn_output=create(b + "attn_output.weight", (E, q)),
            attn_q_norm=create(b + "attn_q_norm.weight", (D,)), attn_k_norm=create(b + "attn_k_norm.weight", (D,)),
            ffn_norm=create(b + "ffn_norm.weight", (E,)),
            ffn_gate=create(b + "ffn_gate.weight", (F, E)), ffn_up=create(b + "ffn_up.weight", (F, E)),
            ffn_down=create(b + "ffn_down.weight", (E, F)),
        )

    return DraftTensors(fc=create("fc.weight", (E, len(c.target_layers) * E)),
                        enc_output_norm=create("enc.output_norm.weight", (E,)),
                        output_norm=create("output_norm.weight", (E,)),
                        layers=tuple(layer(f"blk.{il}.") for il in range(c.n_layer)))
