"""Records llama.cpp's token ids for prompt bytes that are not plain UTF-8 lines (CRLF, a lone CR,
invalid UTF-8, an overlong form, a BOM), read by tests/test_prompt_bytes.py:

    python -m tools.make_prompt_bytes_fixture  # needs llama-cpp-python (the parity extra)

llama_tokenize gets the bytes as they are, with BOS and special-token parsing, as llama-cli and
llama-server tokenize a prompt.
"""
import datetime
import hashlib
import json
import os
import sys

from reference.factory import DEFAULT_MODEL
from reference.cli import OneLineParser
from tools.common import REPO

ROOT = str(REPO)
OUT = os.path.join(ROOT, "tests", "fixtures", "prompt-bytes", "llama-cpp-ids.json")
CASES = {
    "crlf": b"def f(x):\r\n    return x\r\n\r\nprint(f(1))\r\n",
    "lone-cr": b"one\rtwo\r",
    "latin-1": b"caf\xe9 au lait",  # E9 starts a 3-byte sequence that does not follow: one U+FFFD
    "truncated-3-byte": b"x\xe2\x82y",  # E2 82 then y: two U+FFFD, one per byte
    "bad-leads": b"\xff\xfeab\x80",
    "overlong": b"\xc1\x81\xc0\x80!",  # read as A and U+0000: llama.cpp checks only the 10xxxxxx bytes
    "bom": b"\xef\xbb\xbfhello",
}


def main(argv=None):
    OneLineParser(prog="python -m tools.make_prompt_bytes_fixture", description=__doc__).parse_args(argv)
    import llama_cpp
    model = llama_cpp.Llama(DEFAULT_MODEL, vocab_only=True, verbose=False)
    with open(DEFAULT_MODEL, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    cases = {name: {"bytes_hex": data.hex(), "llama_cpp_ids": model.tokenize(data, add_bos=True, special=True)}
             for name, data in CASES.items()}
    manifest = {"engine": "llama-cpp-python", "version": llama_cpp.__version__,
                "llama_cpp": "vendored llama.cpp, commit 0c1e570", "call": "Llama.tokenize(data, add_bos=True, special=True)",
                "model": os.path.relpath(DEFAULT_MODEL, ROOT), "model_sha256": sha,
                "date": datetime.date.today().isoformat()}
    with open(OUT, "w") as f:
        json.dump({"manifest": manifest, "cases": cases}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
