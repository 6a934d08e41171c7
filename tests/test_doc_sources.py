"""tools.doc_sources: the citations of docs/*.md resolve in the pinned source trees.

The check against the real trees runs where they are (LLAMA_CPP set to llama-cpp-python 0.3.36's
vendor/llama.cpp, transformers 5.23.0 installed); the resolver itself is checked everywhere on a
small tree made here."""
import glob
import importlib.metadata
import importlib.util
import io
import os
import pathlib

import pytest

from tools.regen import doc_sources

REPO = pathlib.Path(__file__).resolve().parent.parent
# the design notes; benchmarks.md is the measurements' log (figures and their commands), not a note on the sources
DOCS = sorted(d for d in glob.glob(str(REPO / "docs" / "*.md")) if not d.endswith("benchmarks.md"))


def test_every_note_cites_its_sources():
    assert {pathlib.Path(d).name for d in DOCS} >= {"architecture.md", "text.md", "vision.md", "dflash.md",
                                                   "ggml-cpu-numerics.md", "traps.md"}
    for doc in DOCS:
        found = doc_sources.citations(pathlib.Path(doc).read_text(encoding="utf-8"))
        assert len(found) >= 8, doc  # each note states facts, and every fact names its line
        assert all(first <= last for _, _, ranges in found for first, last in ranges), doc


def fake_trees(tmp_path):  # -> roots with llama.cpp/src/a.cpp (5 lines) and transformers/m.py (2 lines)
    (tmp_path / "vendor" / "llama.cpp" / "src").mkdir(parents=True)
    (tmp_path / "vendor" / "llama.cpp" / "src" / "a.cpp").write_text("one\ntwo\nthree\nfour\nfive\n")
    (tmp_path / "transformers").mkdir()
    (tmp_path / "transformers" / "m.py").write_text("x = 1\ny = 2\n")
    return str(tmp_path / "vendor" / "llama.cpp"), str(tmp_path / "transformers")


def test_resolves_and_refuses_on_a_small_tree(tmp_path):
    llama, hf = fake_trees(tmp_path)
    roots = {"llama.cpp": llama, "transformers": hf, "llama-cpp-python": str(tmp_path)}
    assert doc_sources.check(("llama.cpp", "src/a.cpp", [(2, 3), (5, 5)]), roots) == (
        None, ["2: two", "3: three", "5: five"])
    assert doc_sources.check(("llama.cpp", "src/a.cpp", [(4, 9)]), roots)[0] == "lines 4-9 outside the file's 5"
    assert doc_sources.check(("transformers", "gone.py", [(1, 1)]), roots)[0] == "no such file"
    assert doc_sources.citations("as `llama.cpp/src/a.cpp:2-3,5` and transformers/m.py:2 say") == [
        ("llama.cpp", "src/a.cpp", [(2, 3), (5, 5)]), ("transformers", "m.py", [(2, 2)])]


def test_exit_status(tmp_path, capsys):
    llama, hf = fake_trees(tmp_path)
    good, bad = tmp_path / "good.md", tmp_path / "bad.md"
    good.write_text("RMSNorm (`llama.cpp/src/a.cpp:1-2`), config (`transformers/m.py:2`).\n")
    bad.write_text("see `llama.cpp/src/a.cpp:6`\n")
    assert doc_sources.main(["--llama-cpp", llama, "--transformers", hf, str(good)]) == 0
    assert doc_sources.main(["--llama-cpp", llama, "--transformers", hf, str(good), str(bad)]) == 1
    assert "FAIL: lines 6-6 outside the file's 5" in capsys.readouterr().out
    assert doc_sources.main(["--llama-cpp", str(tmp_path / "none"), "--transformers", hf, str(good)]) == 2
    assert capsys.readouterr().err.strip() == f"tools.doc_sources: --llama-cpp {tmp_path / 'none'}: no such directory"
    assert doc_sources.main(["--llama-cpp", llama, "--transformers", hf, str(tmp_path / "missing.md")]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def pinned_trees():  # -> (llama.cpp dir, transformers dir) or None where this machine lacks them
    """LLAMA_CPP: llama-cpp-python 0.3.36's vendor/llama.cpp. transformers 5.23.0: TRANSFORMERS_SRC
    (its package directory, as .ci/run unpacks it from the wheel) or the installed package."""
    llama, hf = os.environ.get("LLAMA_CPP"), os.environ.get("TRANSFORMERS_SRC")
    if not llama or not os.path.isdir(os.path.join(llama, "src", "models")):
        return None
    if hf is None:
        spec = importlib.util.find_spec("transformers")
        if spec is None or importlib.metadata.version("transformers") != "5.23.0":
            return None
        hf = os.path.dirname(spec.origin)
    return (llama, hf) if os.path.isdir(os.path.join(hf, "models")) else None


def test_the_docs_citations_resolve_in_the_pinned_trees():
    if pinned_trees() is None:  # CI fetches both trees (.ci/run): there, their absence is a failure
        if os.environ.get("REFERENCE_CI"):
            pytest.fail("REFERENCE_CI: LLAMA_CPP and TRANSFORMERS_SRC must name the pinned trees")
        pytest.skip("needs LLAMA_CPP (llama.cpp 0c1e570) and transformers 5.23.0")
    llama, hf = pinned_trees()
    roots = {"llama.cpp": llama, "transformers": hf, "llama-cpp-python": os.path.dirname(os.path.dirname(llama))}
    out = io.StringIO()
    assert doc_sources.report(DOCS, roots, out) == 0, [line for line in out.getvalue().splitlines() if "FAIL" in line]
