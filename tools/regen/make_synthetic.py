"""Write Muse-Glimmer GGUFs with seeded random weights (tools/synthetic.py).

    python -m tools.make_synthetic OUT.gguf                       # a small test model (F32)
    python -m tools.make_synthetic OUT.gguf --layout 30b --mix ud-iq2_xxs   # the release layout
    python -m tools.make_synthetic OUT.gguf --layout 30b --mix q8_0 --layers 2   # real widths, 2 layers
    python -m tools.make_synthetic OUT.gguf --type Q8_0 --vocab 202048  # the release's vocabulary size, small tensors
    python -m tools.make_synthetic OUT.gguf --role mmproj --layout 30b --type F16  # the 50-layer tower
    python -m tools.make_synthetic OUT.gguf --role mmproj --layout 30b --type F16 --video  # with the video extension
    python -m tools.make_synthetic OUT.gguf --role dflash --layout 30b --type Q8_0 # the 5-layer drafter
"""
import argparse
import sys
from dataclasses import replace

from reference.cli import OneLineParser, UsageError, fail, int_in
from tools.synthetic import (MIXES, Q, RELEASE_30B, RELEASE_DRAFTER, RELEASE_MMPROJ, DraftDims, TextDims, VisionDims,
                             draft_shapes, text_shapes, type_problem, vision_shapes, write_draft_gguf,
                             write_layout_gguf, write_mmproj_gguf, write_text_gguf)


def ggml_type(text):  # argparse type: "Q8_0" -> GGMLQuantizationType
    if text not in Q.__members__:
        raise argparse.ArgumentTypeError(f"unknown GGML type {text!r} (e.g. F32, F16, BF16, Q8_0)")
    return Q[text]


# --layers is at most the reference loader's limit (0 < n_layer <= 512), and at the release layout at most
# the release's own count: deeper, it is only a bigger file (a 30B text layer is 1.9 GB at F32).
MAX_LAYERS = 512
MAX_VOCAB = 1 << 24  # 83 times the release's; the 3 special tokens come last (tools/synthetic.py vocab)
RELEASE_LAYERS = {"text": RELEASE_30B.n_layer, "mmproj": RELEASE_MMPROJ.n_layer, "dflash": RELEASE_DRAFTER.n_layer}


def write(a):  # parsed arguments -> None; UsageError for a combination no loader would accept
    release = a.layout == "30b"
    if a.layers is not None and release and a.layers > RELEASE_LAYERS[a.role]:
        raise UsageError(f"--layers {a.layers}: the 30b layout of {a.role} has at most "
                         f"{RELEASE_LAYERS[a.role]} layers")
    if a.layers == 1 and a.role == "text":  # HF's rule makes the one layer full attention
        raise UsageError("a text model needs at least 2 layers: with one it has no sliding-window layer, "
                         "which the loader refuses (llama.cpp aborts on it)")
    if a.video and a.role != "mmproj":
        raise UsageError(f"--video is the mmproj role's ({a.role} has no vision tower)")
    if a.vocab is not None and a.role != "text":
        raise UsageError(f"--vocab is the text role's ({a.role} has no vocabulary)")
    sizes = {} if a.layers is None else {"n_layer": a.layers}
    if a.vocab is not None:
        sizes["n_vocab"] = a.vocab
    if a.role == "text" and release:  # the mix chooses the types: random blocks that the release widths hold
        write_layout_gguf(a.out, replace(RELEASE_30B, **sizes), a.mix, a.seed)
        return
    if a.role == "mmproj":
        dims = replace(RELEASE_MMPROJ if release else VisionDims(), **sizes)
        shapes = vision_shapes(dims)
    elif a.role == "dflash":
        dims = replace(RELEASE_DRAFTER if release else DraftDims(), **sizes)
        shapes = draft_shapes(dims)
    else:
        dims = replace(TextDims(), **sizes)
        shapes = text_shapes(dims)
    problem = type_problem(shapes, a.type, from_floats=a.role == "text")
    if problem:
        raise UsageError(f"--type {a.type.name}: {problem}")
    if a.role == "mmproj":
        write_mmproj_gguf(a.out, dims, a.type.name, a.seed, release, a.video)
    elif a.role == "dflash":
        write_draft_gguf(a.out, dims, a.type.name, a.seed, release)
    else:
        write_text_gguf(a.out, dims, a.type.name, a.seed)


def main(argv=None):
    p = OneLineParser(prog="python -m tools.make_synthetic", description=__doc__)
    p.add_argument("out")
    p.add_argument("--role", choices=("text", "mmproj", "dflash"), default="text")
    p.add_argument("--layout", choices=("small", "30b"), default="small")
    p.add_argument("--mix", choices=sorted(MIXES), default="f32", help="text weight types (30b layout)")
    p.add_argument("--type", type=ggml_type, default="F32",
                   help="GGML type of the 2-D weights (small text; mmproj; dflash)")
    p.add_argument("--layers", type=int_in(1, MAX_LAYERS), help="override the layer count")
    p.add_argument("--vocab", type=int_in(4, MAX_VOCAB), help="override the vocabulary size (text)")
    p.add_argument("--video", action="store_true",
                   help="mmproj: add the video extension (clip.vision.temporal_patch_size, v.patch_embd.weight.t1)")
    p.add_argument("--seed", type=int_in(0, 2**63 - 1), default=0, help="numpy seeds are non-negative")
    a = p.parse_args(argv)
    try:
        write(a)
    except UsageError as e:
        return fail("tools.make_synthetic", e)
    except OSError as e:
        return fail("tools.make_synthetic", f"{e.filename or a.out}: {e.strerror or e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
