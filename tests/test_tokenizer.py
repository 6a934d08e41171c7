"""The GGUF tokenizer against llama.cpp's (golden/tokenizer/tokens.json, made by
tools/regen/make_tokenizer_goldens.py): token ids on the stress strings with and without BOS and special
parsing, detokenization, per-token pieces; where transformers' tokenizer differs from llama.cpp the
difference is documented here. Ids are integers: every comparison is exact."""
import dataclasses
import json
import os

import pytest
from gguf import GGUFValueType

from reference import tokenizer as T
from reference.run import main as run_main
from reference.tokenizer import Tokenizer, TokenizerError, detokenize, read_vocab, token_to_piece
from tools.synthetic import write_text_gguf
from conftest import GOLDEN, MODELS, run_cli

TOKENIZER_GOLDEN = os.path.join(GOLDEN, "tokenizer")
with open(os.path.join(TOKENIZER_GOLDEN, "tokens.json"), encoding="utf-8") as f:
    TOKENS = json.load(f)
STRINGS = TOKENS["strings"]
VOCABS = TOKENS["vocabs"]
CASES = {"bos+special": (True, True), "plain": (False, False), "bos": (True, False), "special": (False, True)}


def vocab(name):  # golden vocabulary name -> TokenizerConfig (variants differ only in tokenizer.ggml.pre)
    entry = VOCABS[name]
    file = os.path.basename(entry["file"])  # a manifest names files; it never leads outside golden/
    path = next(p for p in (os.path.join(TOKENIZER_GOLDEN, file), os.path.join(MODELS, file)) if os.path.isfile(p))
    return dataclasses.replace(read_vocab(path), pre=entry["pre"])


TOKENIZERS = {name: Tokenizer(vocab(name)) for name in VOCABS}


def string_index(prefix):
    return next(i for i, s in enumerate(STRINGS) if s.startswith(prefix))


def test_stress_strings_cover_the_required_cases():
    assert len(STRINGS) >= 40
    joined = "".join(STRINGS)
    for needed in ("", "\u0301", "\u200d", "我", "'LL", "\t", "<|eot|>", "12345", "a" * 500):
        assert needed in STRINGS or needed in joined


@pytest.mark.parametrize("name,case", [(n, c) for n in VOCABS for c in VOCABS[n]["cases"]])
def test_token_ids_match_llama_cpp(name, case):
    add_bos, special = CASES[case]
    tok = TOKENIZERS[name]
    mismatches = [(s, tok.tokenize(s, add_bos, special), ref)
                  for s, ref in zip(STRINGS, VOCABS[name]["cases"][case]) if tok.tokenize(s, add_bos, special) != ref]
    assert not mismatches, f"{len(mismatches)} strings differ, first: {mismatches[0]}"


@pytest.mark.parametrize("name", VOCABS)
def test_detokenize_matches_llama_cpp(name):
    cfg, entry = vocab(name), VOCABS[name]
    ids = entry["cases"][next(iter(entry["cases"]))]
    for key, texts in entry["detokenize"].items():
        special = key == "special=True"
        assert [detokenize(cfg, x, special) for x in ids] == texts


@pytest.mark.parametrize("name", VOCABS)
def test_pieces_match_llama_cpp(name):
    cfg = vocab(name)
    for key, pieces in VOCABS[name]["pieces"].items():
        special = key == "special=True"
        assert {i: token_to_piece(cfg, int(i), special).hex() for i in pieces} == pieces


@pytest.mark.parametrize("name", ["tiny-a", "stress-llama4"])
def test_detokenize_round_trips(name):
    # byte-level BPE loses nothing, and the gpt-4o family does not clean up spaces
    tok = TOKENIZERS[name]
    for s in STRINGS:
        assert tok.detokenize(tok.tokenize(s, add_special=False, parse_special=True)) == s


def test_start_and_message_are_user_defined():
    # llama.cpp forces <|start|> and <|message|> to USER_DEFINED: matched without special parsing
    # and rendered without special; <|eot|> stays CONTROL (docs/text.md, Tokenizer)
    tiny = VOCABS["tiny-a"]
    plain = tiny["cases"]["plain"][string_index("<|start|>user<|message|>Hi there")]
    assert 500 in plain and 501 in plain and 502 not in plain
    cfg = vocab("tiny-a")
    assert token_to_piece(cfg, 500, special=False) == b"<|start|>"
    assert token_to_piece(cfg, 502, special=False) == b""


# Where transformers and llama.cpp disagree (the goldens hold both engines' ids):
# - llama4: transformers runs the original Llama-4 regex, in which combining marks (\p{M}) belong
#   to the word; llama.cpp's collapsed adaptation cuts them off, so merges across a letter and its
#   mark (which the stress vocabulary has) apply in transformers only.
# - every stress variant: "<|endoftext|>" is a NORMAL token in the GGUF, but llama.cpp makes
#   end-of-generation names CONTROL, so with special parsing it is one token there and plain text
#   in transformers.
TRANSFORMERS_DIFFERENCES = {
    "tiny-a": set(),
    "stress-llama-bpe": {"<tool>x</tool> <unk> <|endoftext|>"},
    "stress-gpt-2": {"<tool>x</tool> <unk> <|endoftext|>"},
    "stress-llama4": {"<tool>x</tool> <unk> <|endoftext|>", "e\u0301te\u0301 cafe\u0301 nai\u0308ve",
                      "a\u0300\u0301\u0302b \u0301x", "n\u0303o\u0308 A\u030a"},
}


@pytest.mark.parametrize("name", VOCABS)
def test_transformers_differences_are_the_documented_ones(name):
    entry = VOCABS[name]
    llama = [ids[1:] if ids[:1] == [TOKENIZERS[name].tok.bos] else ids for ids in entry["cases"]["bos+special"]]
    differing = {s for s, hf, lc in zip(STRINGS, entry["transformers"], llama) if hf != lc}
    assert differing == TRANSFORMERS_DIFFERENCES[name]


def test_unicode_15_letters_are_letters():
    # "a" + a Kawi letter (Unicode 15.0) is one word only if the letter is a letter, as in
    # llama.cpp's table; the stress vocabulary merges the two
    i = string_index("a\U00011f05")
    tok = TOKENIZERS["stress-llama4"]
    assert tok.tokenize(STRINGS[i], add_special=False) == VOCABS["stress-llama4"]["cases"]["plain"][i]
    assert len(T.split_gpt4o("a\U00011f05")) == 1


# ---------------------------------------------------------------------------------------------
# bad input

def test_bad_input_raises_typed_errors():
    cfg = vocab("tiny-a")
    with pytest.raises(TokenizerError, match="qwen2"):
        Tokenizer(dataclasses.replace(cfg, pre="qwen2"))
    with pytest.raises(TokenizerError, match="model"):
        Tokenizer(dataclasses.replace(cfg, model="llama"))
    tok = TOKENIZERS["tiny-a"]
    with pytest.raises(TokenizerError, match="str"):
        tok.tokenize(b"bytes")
    with pytest.raises(TokenizerError, match="Unicode"):
        tok.tokenize("lone \ud800 surrogate")
    with pytest.raises(TokenizerError, match="out of range"):
        token_to_piece(cfg, cfg.n_vocab)
    with pytest.raises(TokenizerError, match="BOS"):
        Tokenizer(dataclasses.replace(cfg, bos=-1)).tokenize("x")


# ---------------------------------------------------------------------------------------------
# the command line

def cli(capsys, *args):  # -> (exit status, stdout, stderr) of reference.run, in this process
    try:
        status = run_main(["--model", os.path.join(MODELS, "tiny-a-f32.gguf"), *args])  # the goldens are tiny-a's
    except SystemExit as e:  # argparse's own errors
        status = e.code
    out = capsys.readouterr()
    return status, out.out, out.err


def test_cli_prompt_tokens_match_llama_cpp(capsys):
    i = string_index("<|start|>user<|message|>Hi there")
    tiny = VOCABS["tiny-a"]["cases"]
    r = run_cli("reference.run", "--model", os.path.join(MODELS, "tiny-a-f32.gguf"), "--prompt", STRINGS[i], "--tokenize-only")  # once through the real entry point
    assert r.returncode == 0 and json.loads(r.stdout) == tiny["bos+special"][i], r.stderr
    status, out, _ = cli(capsys, "--prompt", STRINGS[i], "--no-special", "--tokenize-only")
    assert status == 0 and json.loads(out) == tiny["bos"][i]


def test_cli_prompt_file(capsys, tmp_path):
    i = string_index("def f(x)")
    path = tmp_path / "p.txt"
    path.write_bytes(STRINGS[i].encode("utf-8"))
    status, out, _ = cli(capsys, "--prompt-file", str(path), "--tokenize-only")
    assert status == 0 and json.loads(out) == VOCABS["tiny-a"]["cases"]["bos+special"][i]


def assert_one_line_exit_2(result, *words):
    status, out, err = result
    assert status == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    for w in words:
        assert w in err


def test_cli_bad_input_is_one_line_exit_2(capsys, tmp_path):
    bad = tmp_path / "surrogate.txt"  # invalid UTF-8 reads as llama.cpp reads it (tests/test_prompt_bytes.py)
    bad.write_bytes(b"a\xed\xa0\x80")  # but an encoded surrogate, which llama.cpp tokenizes, is refused
    assert_one_line_exit_2(cli(capsys, "--prompt-file", str(bad)), "surrogate.txt", "byte 1 encodes U+D800")
    assert_one_line_exit_2(cli(capsys, "--prompt", "x", "--token-ids", "1"), "not allowed")
    assert_one_line_exit_2(cli(capsys, "--no-special"), "--no-special")
    other_pre = str(tmp_path / "qwen.gguf")
    write_text_gguf(other_pre, extra_keys={"tokenizer.ggml.pre": ("qwen2", GGUFValueType.STRING)})
    assert_one_line_exit_2(cli(capsys, "--model", other_pre, "--prompt", "hi"), "qwen2")
