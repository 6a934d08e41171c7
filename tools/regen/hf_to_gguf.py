"""Run llama.cpp's own convert_hf_to_gguf.py with `tokenizer.ggml.pre` pinned to "llama4".

The converter names the pre-tokenizer by hashing how the HF tokenizer encodes a fixed test string,
and refuses any hash it does not know. The tiny tokenizers made by tools/regen/make_tiny.py are trained
from scratch, so their hash is unknown, but they split text with the Llama-4 regex, which llama.cpp
calls "llama4". This wrapper replaces that one method and changes nothing else.

    python -m tools.hf_to_gguf LLAMA_CPP_DIR [convert_hf_to_gguf.py arguments ...]
"""
from __future__ import annotations

import runpy
import sys
from pathlib import Path

PINNED_PRE = "llama4"


def main(argv: list[str]) -> None:
    usage = "usage: python -m tools.hf_to_gguf LLAMA_CPP_DIR [converter args ...]"
    if argv[:1] in (["-h"], ["--help"]):
        print(usage)
        sys.exit(0)
    if not argv:
        print(usage, file=sys.stderr)
        sys.exit(2)
    llama_dir = Path(argv[0]).resolve()
    script = llama_dir / "convert_hf_to_gguf.py"
    if not script.is_file() or not (llama_dir / "conversion").is_dir():
        print(f"tools.hf_to_gguf: {llama_dir} is not a llama.cpp source tree (no convert_hf_to_gguf.py and "
              "conversion/ there)", file=sys.stderr)
        sys.exit(2)
    # the converter's vendored gguf-py knows the muse-glimmer and dflash architectures
    sys.path[:0] = [str(llama_dir / "gguf-py"), str(llama_dir)]
    from conversion.base import TextModel  # the converter's own class

    TextModel.get_vocab_base_pre = lambda self, tokenizer: PINNED_PRE
    sys.argv = [str(script), *argv[1:]]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
