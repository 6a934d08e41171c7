"""Long prompts at the release vocabulary (202048): with --logits-positions the output head runs
for the kept positions only, so peak memory grows with the KV cache, not with prompt x vocabulary
(all-position float32 logits are 0.8 MB a position there)."""
import os
import subprocess
import sys

import numpy as np
import pytest

from reference.positions import SUFFIX
from tools.synthetic import RELEASE_30B, TextDims, write_text_gguf
from conftest import ROOT, cli_error, run_cli

# Two layers (one sliding-window, one full) of a narrow model with the 30B's vocabulary; a 64-token
# window and 128-row prefill chunks, so both prompts span more than two windows and three chunks.
DIMS = TextDims(n_layer=2, n_embd=64, n_ff=128, n_head=2, n_head_kv=1, head_dim=32, n_vocab=RELEASE_30B.n_vocab,
                n_swa=64, swa_pattern=[True, False])
CHUNK = 128
SHORT, LONG = 512, 2048
F32 = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_gguf(str(tmp_path_factory.mktemp("long") / "vocab-202048.gguf"))


def write_gguf(path):  # -> path of the synthetic model (F16: the two vocabulary matrices are 26 MB each)
    write_text_gguf(path, DIMS, qtype="F16")
    return path


def peak_rss(args):  # -> (exit status, stderr, peak RSS in bytes) of one `python -m reference.run` child
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen([sys.executable, "-m", "reference.run", *args], cwd=ROOT, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    err = child.stderr.read()
    _, status, usage = os.wait4(child.pid, 0)  # this child's own rusage, not the maximum over all children
    child.returncode = os.waitstatus_to_exitcode(status)
    return child.returncode, err, usage.ru_maxrss * 1024  # Linux reports kilobytes


def last_position_run(model, n, out):  # -> peak RSS of a prompt of n tokens keeping the last position's logits
    ids = ",".join(map(str, np.random.default_rng(n).integers(0, DIMS.n_vocab - 3, n)))
    status, err, rss = peak_rss(["--model", model, "--token-ids", ids, "--n-predict", "1", "--prefill-chunk",
                                 str(CHUNK), "--logits-positions", "last", "--logits-out", out])
    assert status == 0, err
    return rss


@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss units and os.wait4 as on Linux")
def test_peak_memory_is_bounded_as_the_prompt_grows(model, tmp_path):
    assert SHORT > max(2 * DIMS.n_swa, 3 * CHUNK)
    short = last_position_run(model, SHORT, str(tmp_path / f"short{SUFFIX}"))
    long = last_position_run(model, LONG, str(tmp_path / f"long{SUFFIX}"))
    grown = LONG - SHORT
    # what may grow with the prompt: the full layer's K/V rows (+ an int64 position), the prompt's
    # embedding rows and a chunk's attention scores over the longer context (x4 for the softmax's
    # temporaries), plus 32 MB of allocator and interpreter noise between two runs
    kv = grown * (2 * DIMS.n_head_kv * DIMS.head_dim * F32 + 8)
    rows = grown * DIMS.n_embd * F32
    scores = 4 * CHUNK * DIMS.n_head * grown * F32
    bound = kv + rows + scores + (32 << 20)
    all_positions = grown * DIMS.n_vocab * F32  # what all-position logits would add: 1.6 GB
    assert bound < all_positions / 20
    assert long - short < bound, (short, long, bound)
    golden = np.load(str(tmp_path / f"long{SUFFIX}"))
    assert golden["positions"].tolist() == [LONG - 1] and golden["logits"].shape == (1, DIMS.n_vocab)


def test_kept_rows_equal_the_all_position_logits(model, tmp_path):
    ids = ",".join(map(str, np.random.default_rng(1).integers(0, DIMS.n_vocab - 3, 300)))
    common = ["--model", model, "--token-ids", ids, "--n-predict", "0", "--prefill-chunk", str(CHUNK)]
    full, sparse, top = (str(tmp_path / n) for n in ("all.npy", f"some{SUFFIX}", f"top{SUFFIX}"))
    for extra in (["--logits-out", full], ["--logits-out", sparse, "--logits-positions=0,5,127:130,-2:"],
                  ["--logits-out", top, "--logits-positions=-20:", "--logits-topk", "5"]):  # 20 rows: two TOPK_BLOCKs
        r = run_cli("reference.run", *common, *extra)
        assert r.returncode == 0, r.stderr
    every, some, best = np.load(full), np.load(sparse), np.load(top)
    assert some["positions"].tolist() == [0, 5, 127, 128, 129, 298, 299] and int(some["n_vocab"]) == DIMS.n_vocab
    # the same rows through the same ops in a smaller batch: the output head is row by row
    np.testing.assert_array_equal(some["logits"], every[some["positions"]])
    np.testing.assert_array_equal(best["top_logits"], -np.sort(-every[-20:], axis=1)[:, :5])
    assert (np.take_along_axis(every[-20:], best["top_ids"].astype(np.int64), axis=1) == best["top_logits"]).all()


@pytest.mark.parametrize("extra, message", [
    (["--logits-positions", "last"], "--logits-positions and --logits-topk need --logits-out"),
    (["--logits-topk", "5", "--logits-out", "x.npy"], f"--logits-out must name a {SUFFIX} file"),
    (["--logits-positions", "last", "--logits-out", "x.npy"], f"--logits-out must name a {SUFFIX} file"),
    (["--logits-positions", "7", "--logits-out", f"x{SUFFIX}"], "--logits-positions: position 7 is outside a prompt of 3"),
    (["--logits-positions", "9:", "--logits-out", f"x{SUFFIX}"], "--logits-positions: the positions select none"),
    (["--logits-positions", "1:x", "--logits-out", f"x{SUFFIX}"], "argument --logits-positions: bad position '1:x'"),
    (["--logits-topk", "0", "--logits-out", f"x{SUFFIX}"], "argument --logits-topk: 0 is out of range"),
])
def test_bad_positions_are_one_line_exit_2(tmp_path, extra, message):
    extra = [str(tmp_path / e) if e.startswith("x.") else e for e in extra]
    line = cli_error(run_cli("reference.run", "--token-ids", "1,2,3", "--n-predict", "0", *extra))
    assert message in line
    assert os.listdir(tmp_path) == []
