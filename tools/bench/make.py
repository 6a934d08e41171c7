"""`python -m tools.bench_accel make`: the benchmark's GGUFs. The mid layout (the release's widths,
two layers) as F16 and, through llama-quantize, Q4_K_M and IQ2_XXS; or the 30B release layout's
UD-IQ2_XXS text model and F16 projector, written block by block without llama-quantize."""
import os
import subprocess
from dataclasses import replace

import numpy as np
from gguf import GGUFWriter

from reference import gguf
from reference.cli import UsageError
from tools.synthetic import (ARCH, Q, RELEASE_30B, RELEASE_MMPROJ, TensorSpec, random_spec, stream_gguf, text_keys,
                             text_shapes, write_layout_gguf, write_mmproj_gguf)

MID = replace(RELEASE_30B, n_layer=2)  # one sliding-window layer, one full layer
QUANTS = (("q4_k_m", "Q4_K_M"), ("iq2_xxs", "IQ2_XXS"))


def f16_spec(dims, name, shape, seed):  # make_synthetic's random rows of a tensor, matrices stored as F16
    spec = random_spec(name, shape, Q.F32, seed, dims.qk_scale)
    if len(shape) == 1:
        return spec
    return TensorSpec(name, shape, Q.F16, lambda start, stop: spec.rows(start, stop).astype(np.float16))


def write_uniform_imatrix(path, dims):  # an importance matrix of ones for every matrix but token_embd
    w = GGUFWriter(path, "imatrix")
    w.add_string("general.type", "imatrix")
    w.add_array("imatrix.datasets", ["uniform"])
    w.add_uint32("imatrix.chunk_count", 1)
    w.add_uint32("imatrix.chunk_size", 1)
    for name, shape in text_shapes(dims):
        if len(shape) == 2 and name != "token_embd.weight":
            w.add_tensor(name + ".in_sum2", np.ones(shape[1], np.float32))
            w.add_tensor(name + ".counts", np.ones(1, np.float32))
    gguf.write_out(w)


def make_release(out):  # -> exit status: the 30B layout's UD-IQ2_XXS text model (9.2 GB) and F16 projector
    """Random blocks of the release mix written directly (no llama-quantize), with the keys and
    tensor types llama.cpp loads a converted file with (tools/synthetic.py)."""
    os.makedirs(out, exist_ok=True)
    for name, write in (("30b-ud-iq2_xxs.gguf", lambda path: write_layout_gguf(path, RELEASE_30B, "ud-iq2_xxs")),
                        ("30b-mmproj-f16.gguf", lambda path: write_mmproj_gguf(path, RELEASE_MMPROJ, "F16", progress=True))):
        path = os.path.join(out, name)
        if not os.path.exists(path):
            write(path + ".part")
            os.replace(path + ".part", path)
    return 0


def llama_tool(llama_bin, name):  # -> the path of llama.cpp's executable `name` in llama_bin; UsageError if none
    path = os.path.join(llama_bin, name)
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise UsageError(f"--llama-bin {llama_bin}: no executable {name} there")
    return path


def make(args):  # -> exit status
    if args.layout == "30b":
        return make_release(args.out)
    if not args.llama_bin:
        raise UsageError("--layout mid quantizes with llama-quantize: --llama-bin DIR")
    quantize = llama_tool(args.llama_bin, "llama-quantize")  # before writing 7.5 GB of F16
    os.makedirs(args.out, exist_ok=True)
    f16 = os.path.join(args.out, "mid-f16.gguf")
    if not os.path.exists(f16):
        specs = [f16_spec(MID, name, shape, i) for i, (name, shape) in enumerate(text_shapes(MID))]
        stream_gguf(f16 + ".part", ARCH, text_keys(MID), specs, progress=True)
        os.replace(f16 + ".part", f16)
    imatrix = os.path.join(args.out, "mid.imatrix.gguf")
    write_uniform_imatrix(imatrix, MID)
    env = dict(os.environ, LD_LIBRARY_PATH=args.llama_bin)
    for suffix, qtype in QUANTS:
        dst = os.path.join(args.out, f"mid-{suffix}.gguf")
        if not os.path.exists(dst):
            status = subprocess.run([quantize, "--imatrix", imatrix, f16, dst + ".part", qtype, str(args.threads)],
                                    env=env).returncode
            if status:  # llama-quantize has printed why
                raise UsageError(f"llama-quantize exited with status {status} making {dst}")
            os.replace(dst + ".part", dst)
    return 0
