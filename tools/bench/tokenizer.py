"""Tokenizer throughput: the reference (pure Python) against the `tokenizers` library (Rust) on the
same vocabulary, one thread, text already in memory, special-token text parsed by both.

    python -m tools.bench_tokenizer [--model GGUF] [--repeat 3]

The text is this repository's own .py and .md files plus the stress strings of the goldens (code,
English, other scripts); the reference starts each timed pass with an empty word cache. Prints
MB/s of both and the ratio, line by line and the whole text in one call, and how many lines the
two encode alike (tokenizers runs the tokenizer.json regex, not llama.cpp's adaptation, and
parses USER_DEFINED and end-of-generation names as llama.cpp does not, so a few may differ).
"""
import os
import sys
import time
from pathlib import Path

from reference.cli import OneLineParser, UsageError, fail, flag, int_in
from reference.gguf import GGUFError
from reference.tokenizer import Tokenizer, TokenizerError, pre_tokenizer, read_vocab
from tools.common import REPO, import_extra
from tools.regen.make_tokenizer_goldens import STRESS_STRINGS, bpe_tokenizer

DEFAULT_VOCAB = REPO / "golden" / "tokenizer" / "stress-vocab.gguf"


def bench_text():  # -> the benchmark text
    files = sorted(p for d in ("reference", "tools", "tests") for p in (REPO / d).rglob("*.py"))
    files += sorted(REPO.glob("*.md"))
    return "".join(p.read_text(encoding="utf-8") for p in files) + "\n".join(STRESS_STRINGS)


def best_seconds(encode, repeat):  # fn() -> the fastest of `repeat` timed calls
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        encode()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv=None):
    p = OneLineParser(prog="python -m tools.bench_tokenizer", description=__doc__)
    flag(p, "model", default=str(DEFAULT_VOCAB),
                   help="any GGUF with a vocabulary (default: the stress vocabulary)")
    p.add_argument("--repeat", type=int_in(1, 100), default=3,
                   help="timed passes, the best counts (more measures the machine's noise)")
    a = p.parse_args(argv)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        vocab = read_vocab(a.model)
        pre_tokenizer(vocab)  # a tokenizer the reference does not implement is refused before either side runs
        import_extra("tokenizers", "its Rust side")  # after the arguments: their errors are the user's first
    except (UsageError, GGUFError, TokenizerError) as e:
        return fail("tools.bench_tokenizer", e)
    text = bench_text()
    lines = text.splitlines(keepends=True)
    rust = bpe_tokenizer(vocab, vocab.pre)

    t0 = time.perf_counter()
    tok = Tokenizer(vocab)
    build = time.perf_counter() - t0

    def reference(pieces):
        tok.word_ids.clear()  # each pass starts with an empty word cache
        return [tok.tokenize(piece, add_special=False, parse_special=True) for piece in pieces]

    def tokenizers(pieces):
        return [rust.encode(piece, add_special_tokens=False).ids for piece in pieces]

    mb = len(text.encode("utf-8")) / 1e6
    print(f"vocab {Path(a.model).name}: {vocab.n_vocab} tokens, pre {vocab.pre} (built in {build:.3f} s); "
          f"text {mb:.3f} MB, {len(lines)} lines")
    for mode, pieces in (("line by line", lines), ("one call", [text])):
        t_ref = best_seconds(lambda: reference(pieces), a.repeat)
        t_rust = best_seconds(lambda: tokenizers(pieces), a.repeat)
        print(f"{mode:>12}: reference {mb / t_ref:7.3f} MB/s, tokenizers {mb / t_rust:7.3f} MB/s, "
              f"ratio {t_ref / t_rust:.1f}")
    same = sum(x == y for x, y in zip(reference(lines), tokenizers(lines)))
    print(f"lines encoded alike: {same}/{len(lines)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
