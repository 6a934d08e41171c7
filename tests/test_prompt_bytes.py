"""Prompt text is bytes, read as llama.cpp reads them: `--prompt-file` keeps a CRLF file's \r, and
invalid UTF-8 becomes what llama.cpp's unicode_cpts_from_utf8 makes of it (U+FFFD per byte that
starts no sequence, an overlong form its code point). Against llama.cpp's own ids, recorded by
tools/regen/make_prompt_bytes_fixture.py (tests/fixtures/prompt-bytes/llama-cpp-ids.json)."""
import json
import os

import pytest

from reference.run import DEFAULT_MODEL, main as run_main
from reference.tokenizer import llama_text
from conftest import cli_error, run_cli

FIXTURE = json.load(open(os.path.join(os.path.dirname(__file__), "fixtures", "prompt-bytes", "llama-cpp-ids.json")))


def tokenize_file(capsys, path):  # -> ids reference.run --tokenize-only gives for the file, in this process
    assert run_main(["--model", DEFAULT_MODEL, "--prompt-file", str(path), "--tokenize-only"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("name", sorted(FIXTURE["cases"]))
def test_prompt_file_ids_are_llama_cpp_ids(capsys, tmp_path, name):
    case = FIXTURE["cases"][name]
    path = tmp_path / "prompt.txt"
    path.write_bytes(bytes.fromhex(case["bytes_hex"]))
    assert tokenize_file(capsys, path) == case["llama_cpp_ids"]


def test_crlf_is_not_lf(capsys, tmp_path):  # the fixture would pass if no case held a \r: one does, and it counts
    crlf = bytes.fromhex(FIXTURE["cases"]["crlf"]["bytes_hex"])
    assert b"\r\n" in crlf
    path = tmp_path / "lf.txt"
    path.write_bytes(crlf.replace(b"\r\n", b"\n"))
    assert tokenize_file(capsys, path) != FIXTURE["cases"]["crlf"]["llama_cpp_ids"]


def test_prompt_argument_bytes_survive_the_shell(tmp_path):
    # argv is bytes: Python decodes what is not UTF-8 to escapes, which reference.run turns back
    case = FIXTURE["cases"]["latin-1"]
    r = run_cli("reference.run", "--prompt", os.fsdecode(bytes.fromhex(case["bytes_hex"])), "--tokenize-only")
    assert r.returncode == 0 and json.loads(r.stdout) == case["llama_cpp_ids"], r.stderr


@pytest.mark.parametrize("data, message", [
    (b"a\xed\xa0\x80", "byte 1 encodes U+D800"),  # an encoded surrogate: llama.cpp tokenizes its bytes
    (b"ab\xf4\x90\x80\x80", "byte 2 encodes U+110000"),  # above U+10FFFF: llama.cpp aborts (invalid codepoint)
])
def test_bytes_no_code_point_reads_are_refused(tmp_path, data, message):
    path = tmp_path / "bad.txt"
    path.write_bytes(data)
    line = cli_error(run_cli("reference.run", "--prompt-file", str(path), "--tokenize-only"))
    assert str(path) in line and message in line


def test_valid_utf8_decodes_as_python_does():
    text = "caf\u00e9 \u4e2d\U0001f600\r\n"
    assert llama_text(text.encode("utf-8"), "x") == text
