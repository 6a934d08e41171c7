"""reference.metrics and tools.diff: the metrics, the near-tie rule, the gate and the exit statuses, on
synthetic logits and on real ones (the reference against llama.cpp's committed F16-KV golden)."""
import io
import json
import os
import zipfile

import numpy as np
import pytest
from reference.cli import UsageError
from conftest import GOLDEN, MODELS, cli_error, require, run_cli

from reference import metrics
from tools.parity import diff

NEAR_TIE_POS, REAL_POS = 2, 4


def logits_pair(real=True):  # -> ref [6, 40], ref64, test with a near-tie flip (and a real one)
    rng = np.random.default_rng(0)
    ref64 = rng.normal(size=(6, 40)) * 2
    ref64[NEAR_TIE_POS, :2] = [9.0, 9.0 - 1e-4]  # top-2 within the noise: either order is right
    ref64[REAL_POS, :2] = [9.0, 7.0]  # a clear winner
    ref = ref64.astype(np.float32)
    ref64 = ref64 + 2e-5  # noise floor max|ref64 - ref| ~ 2e-5 -> margin M ~ 1.6e-4 > 1e-4
    test = ref + rng.normal(size=ref.shape).astype(np.float32) * 1e-6
    test[NEAR_TIE_POS, :2] = ref[NEAR_TIE_POS, 1::-1]
    if real:
        test[REAL_POS, 5] = 12.0
    return ref, ref64, test


def npy_claiming(shape):  # -> bytes of a .npy whose header claims `shape` of float32 over 64 bytes of data
    f = io.BytesIO()
    np.lib.format.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False, "shape": shape})
    return f.getvalue() + bytes(64)


def test_metrics_by_hand():
    ref, x = np.array([[3.0, 4.0], [0.0, 0.0]]), np.array([[3.0, 5.0], [0.0, 0.0]])
    assert metrics.nmse(ref, x).tolist() == [1 / 25, 0.0]
    assert metrics.nmse(np.zeros(2), np.ones(2)) == np.inf
    assert metrics.max_abs_diff(ref, x).tolist() == [1.0, 0.0]
    assert metrics.cosine(ref, x)[0] == pytest.approx(29 / (5 * np.sqrt(34)))
    assert metrics.cosine(ref, x)[1] == 1.0
    z = np.array([[2.0, 1.0, 0.5, -1.0]])
    assert metrics.top1_margin(z)[0] == 1.0
    assert metrics.kl(z, z)[0] == 0.0
    uniform = np.zeros_like(z)
    p = np.exp(z) / np.exp(z).sum()
    assert metrics.kl(z, uniform)[0] == pytest.approx(np.sum(p * np.log(p * 4)))  # KL(ref || test)
    assert metrics.topk_agreement(z, np.array([[2.0, 0.0, 1.0, 3.0]]), 2)[0] == 0.5
    assert metrics.delta_p(z, np.array([[0.0, 1.0, 0.5, -1.0]]))[0] < 0


def test_near_tie_and_real_divergence_are_told_apart():
    ref, ref64, test = logits_pair()
    margin = diff.noise_margin(ref, ref64)
    assert 1e-4 < margin < 2e-4
    report = diff.diff_logits(ref, test, margin)
    kinds = {f["pos"]: f["kind"] for f in report["flips"]}
    assert kinds == {NEAR_TIE_POS: "near-tie", REAL_POS: "real"}
    assert (report["first_flip"], report["first_real"]) == (NEAR_TIE_POS, REAL_POS)
    assert report["summary"]["n_near_tie"] == report["summary"]["n_real"] == 1
    assert report["summary"]["top1"] == pytest.approx(4 / 6)
    assert np.argmax(report["per_position"]["kl"]) == REAL_POS
    failures = diff.check_gate(report, {})
    assert len(failures) == 1 and "position 4" in failures[0]
    # a margin under the tie's gap turns the near-tie into a real divergence
    tight = diff.diff_logits(ref, test, near_tie_margin=5e-5)
    assert {f["pos"]: f["kind"] for f in tight["flips"]}[NEAR_TIE_POS] == "real"


def test_gate_limits():
    ref, _, test = logits_pair(real=False)
    report = diff.diff_logits(ref, test, near_tie_margin=1e-3)
    assert diff.check_gate(report, {}) == []  # a near-tie alone passes
    assert diff.check_gate(report, diff.parse_gate("nmse=1e-6,top1=0.8")) == []
    failures = diff.check_gate(report, diff.parse_gate("nmse=1e-20, top1=1"))
    assert [f.split()[0] for f in failures] == ["nmse", "top1"]
    for bad in ("nmse", "speed=1", "kl=abc", "kl=nan"):
        with pytest.raises(UsageError):
            diff.parse_gate(bad)


def test_cli_pass_fail_and_outputs(tmp_path, capsys):
    ref, ref64, test = logits_pair()
    np.save(tmp_path / "ref.npy", ref)
    np.save(tmp_path / "ref64.npy", ref64)
    np.save(tmp_path / "real.npy", test)
    _, _, tie_only = logits_pair(real=False)
    np.save(tmp_path / "tie.npy", tie_only)

    status = diff.main([str(tmp_path / f) for f in ("ref.npy", "tie.npy")]
                       + ["--noise-floor", str(tmp_path / "ref64.npy"), "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert status == 0 and "near-tie" in out and "PASS" in out
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["status"] == "pass" and saved["prompts"][0]["flips"][0]["kind"] == "near-tie"

    real = run_cli("tools.diff", tmp_path / "ref.npy", tmp_path / "real.npy", "--noise-floor", tmp_path / "ref64.npy")
    assert real.returncode == 1 and "real divergence at position 4" in real.stdout
    gate = diff.main([str(tmp_path / "ref.npy"), str(tmp_path / "tie.npy"), "--near-tie-margin", "1e-3",
                      "--gate", "nmse=1e-20"])
    assert gate == 1 and "nmse = " in capsys.readouterr().out


def test_plot(tmp_path):
    require("matplotlib")  # an extra: [test] and [parity]
    ref, ref64, test = logits_pair()
    np.save(tmp_path / "ref.npy", ref)
    np.save(tmp_path / "test.npy", test)
    assert diff.main([str(tmp_path / "ref.npy"), str(tmp_path / "test.npy"), "--plot", str(tmp_path / "r.png")]) == 1
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


def test_directories_pair_by_prompt_id(tmp_path):
    ref, _, test = logits_pair(real=False)
    (tmp_path / "ref").mkdir()
    (tmp_path / "test").mkdir()
    np.save(tmp_path / "ref" / "golden_a.npy", ref)
    np.save(tmp_path / "ref" / "golden_b.npy", ref[:3])
    entries = [{"file": "golden_a.npy", "prompt_id": "a"}, {"file": "golden_b.npy", "prompt_id": "b"}]
    (tmp_path / "ref" / "manifest.json").write_text(json.dumps({"goldens": entries}))
    np.save(tmp_path / "test" / "b.npy", test[:3])
    args = [str(tmp_path / "ref"), str(tmp_path / "test"), "--near-tie-margin", "1e-3"]
    assert diff.main(args) == 2  # prompt a has no test logits
    np.save(tmp_path / "test" / "a.npy", test)
    assert diff.main(args + ["--json", str(tmp_path / "d.json")]) == 0
    prompts = json.loads((tmp_path / "d.json").read_text())["prompts"]
    assert [(p["prompt_id"], p["n_pos"]) for p in prompts] == [("a", 6), ("b", 3)]
    entries.append({"file": "../test/a.npy", "prompt_id": "c"})
    (tmp_path / "ref" / "manifest.json").write_text(json.dumps(entries))
    with pytest.raises(UsageError, match="outside"):
        diff.pair_files(str(tmp_path / "ref"), str(tmp_path / "test"))


@pytest.mark.parametrize("case", ["missing", "shape", "nan", "pickle", "not_npy", "huge_header"])
def test_bad_input_exits_2_with_one_line(tmp_path, case):
    ref = np.zeros((3, 10), np.float32)
    np.save(tmp_path / "ref.npy", ref)
    bad = tmp_path / "test.npy"
    if case == "shape":
        np.save(bad, np.zeros((3, 11), np.float32))
    elif case == "nan":
        np.save(bad, np.where(np.eye(3, 10) > 0, np.nan, 0).astype(np.float32))
    elif case == "pickle":
        np.save(bad, np.array([{"logits": 1}], dtype=object), allow_pickle=True)
    elif case == "not_npy":
        bad.write_text("0.1 0.2 0.3\n")
    elif case == "huge_header":  # 130 TiB claimed: refused from the header, nothing allocated
        bad.write_bytes(npy_claiming((70_000_000_000, 512)))
    r = run_cli("tools.diff", tmp_path / "ref.npy", bad)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and str(bad) in lines[0] and "Traceback" not in r.stderr
    expected = {"missing": "no such file", "shape": "does not match", "nan": "NaN", "pickle": "pickled",
                "not_npy": "not a .npy", "huge_header": "header claims shape [70000000000, 512]"}[case]
    assert expected in lines[0]


# ---------------------------------------------------------------------------------------------
# real model logits: the reference against llama.cpp with an F16 KV cache and flash attention

F16_KV_RUN = os.path.join(GOLDEN, "logits", "llama-cpp", "tiny-a-f32", "kv-f16_fa-on")
PLANTED = [20, 40, 55]  # positions given a real bug


@pytest.fixture(scope="module")
def real_pair():  # -> (reference logits of len64-nobos on tiny-a-f32, llama.cpp's F16-KV golden of it)
    from reference import gguf
    from reference.text import TextModel
    with open(os.path.join(F16_KV_RUN, "manifest.json")) as f:
        entry = next(e for e in json.load(f)["entries"] if e["id"] == "len64-nobos")
    lm = TextModel(gguf.load(os.path.join(MODELS, "tiny-a-f32.gguf"), "text"))
    ids = entry["token_ids"]
    return lm.prefill(ids, lm.new_cache(len(ids), "uniform")), np.load(os.path.join(F16_KV_RUN, entry["file"]))


def plant_real_bug(ref, test):  # -> test with a clearly different winner at PLANTED
    buggy = test.copy()
    for pos in PLANTED:
        fifth = np.argsort(ref[pos])[-5]
        buggy[pos, fifth] = buggy[pos].max() + 1.0
    return buggy


def test_near_tie_and_planted_bug_in_real_logits(real_pair):
    """llama.cpp rounds K, V (and Q, the probabilities) to F16 here: it flips one top-1 of this prompt
    (position 10, reference margin 0.0021) by its rounding alone. The typical-error rule gives
    M = 2 x median max|ref - test| = 0.031; every planted position has a reference margin far above
    it (checked), so the three are real and position 10 stays a near-tie."""
    ref, test = real_pair
    clean = diff.diff_logits(ref, test, diff.TYPICAL)
    assert [(f["pos"], f["kind"]) for f in clean["flips"]] == [(10, "near-tie")]
    assert clean["flips"][0]["ref_margin"] < 0.01 < clean["near_tie_margin"] < 0.05
    assert diff.check_gate(clean, {}) == []
    margins = metrics.top1_margin(ref)[PLANTED]
    assert margins.min() > 4 * clean["near_tie_margin"]

    report = diff.diff_logits(ref, plant_real_bug(ref, test), diff.TYPICAL)
    assert {f["pos"]: f["kind"] for f in report["flips"]} == {10: "near-tie", 20: "real", 40: "real", 55: "real"}
    # a bug on 3 of 64 positions leaves the median, and so M, where it was
    assert report["near_tie_margin"] == pytest.approx(clean["near_tie_margin"], rel=0.05)
    assert (report["first_flip"], report["first_real"]) == (10, 20)
    failures = diff.check_gate(report, {})
    assert [f.split(":")[0] for f in failures] == [f"real divergence at position {p}" for p in PLANTED]


def test_cli_typical_error_on_real_logits(real_pair, tmp_path):
    ref, test = real_pair
    np.save(tmp_path / "ref.npy", ref)
    np.save(tmp_path / "tie.npy", test)
    np.save(tmp_path / "bug.npy", plant_real_bug(ref, test))
    ok = run_cli("tools.diff", tmp_path / "ref.npy", tmp_path / "tie.npy", "--typical-error", "--gate", "nmse=1e-5")
    assert ok.returncode == 0 and "near-tie" in ok.stdout and "PASS" in ok.stdout, ok.stdout
    bad = run_cli("tools.diff", tmp_path / "ref.npy", tmp_path / "bug.npy", "--typical-error")
    assert bad.returncode == 1 and bad.stdout.count("real divergence at position") == 3
    # without a margin that knows the engine's precision, the F16 rounding flip counts as real
    strict = run_cli("tools.diff", tmp_path / "ref.npy", tmp_path / "tie.npy")
    assert strict.returncode == 1 and "real divergence at position 10" in strict.stdout


def test_corpus_report_worst_prompts_first(tmp_path):
    require("matplotlib")  # an extra: [test] and [parity]
    ref, _, test = logits_pair(real=False)
    rng = np.random.default_rng(1)
    for side in ("ref", "test"):
        (tmp_path / side).mkdir()
    for i in range(12):
        noise = rng.normal(size=ref.shape).astype(np.float32) * 10.0 ** (-9 + i % 4)
        np.save(tmp_path / "ref" / f"p{i:02d}.npy", ref)
        np.save(tmp_path / "test" / f"p{i:02d}.npy", (test if i == 7 else ref) + noise)
    args = [str(tmp_path / "ref"), str(tmp_path / "test"), "--near-tie-margin", "1e-3", "--worst", "5",
            "--json", str(tmp_path / "c.json"), "--plot", str(tmp_path / "c.png")]
    assert diff.main(args) == 0
    saved = json.loads((tmp_path / "c.json").read_text())
    overall = saved["overall"]
    assert overall["n_prompts"] == 12 and overall["n_pos"] == 72 and overall["n_near_tie"] == 1
    kl = {p["prompt_id"]: p["summary"]["kl_mean"] for p in saved["prompts"]}
    assert overall["kl_mean"] == pytest.approx(np.mean(list(kl.values())))
    table = [line.split()[0] for line in diff.format_report(
        [(p["prompt_id"], p, []) for p in saved["prompts"]], {}, "", n_prompts_shown=5).splitlines()[4:9]]
    assert table == sorted(kl, key=lambda k: -kl[k])[:5]
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("case", ["keys", "pickle", "positions", "zip", "huge_header", "k_over_vocab"])
def test_bad_topk_golden_exits_2(tmp_path, case):
    good = {"prompt_ids": np.arange(3), "tokens": np.array([5, 6]), "positions": np.array([0, 1]),
            "top_ids": np.array([[5, 1], [6, 2]]), "top_logprobs": np.array([[-0.1, -2.0], [-0.2, -3.0]])}
    bad = tmp_path / "g.topk.npz"
    if case == "keys":
        np.savez(bad, **{k: v for k, v in good.items() if k != "positions"})
    elif case == "pickle":
        np.savez(bad, **{**good, "tokens": np.array([{"x": 1}], dtype=object)})
    elif case == "positions":
        np.savez(bad, **{**good, "positions": np.array([1, 1])})
    elif case == "huge_header":  # a member claiming 70e9 x 512 floats: refused before np.load allocates them
        with zipfile.ZipFile(bad, "w") as z:
            for key, value in good.items():
                member = io.BytesIO()
                np.save(member, value)
                z.writestr(f"{key}.npy", npy_claiming((70_000_000_000, 512)) if key == "top_logprobs"
                           else member.getvalue())
    elif case == "k_over_vocab":  # 10 tokens per row from a vocabulary of 8
        np.savez(bad, **{**good, "top_ids": np.tile([5, 1, 0, 2, 3, 4, 6, 7, 7, 7], (2, 1)),
                         "top_logprobs": np.tile(-np.arange(1.0, 11.0), (2, 1))})
    else:
        bad.write_bytes(b"PK\x03\x04 not a zip")
    np.save(tmp_path / "full.npy", np.zeros((4, 8), np.float32))
    r = run_cli("tools.diff", bad, tmp_path / "full.npy")
    expected = {"huge_header": "header claims shape [70000000000, 512]",
                "k_over_vocab": "10 tokens per row, more than the vocabulary of 8"}.get(case, str(bad))
    cli_error(r, expected)
    if case != "k_over_vocab":  # a problem of one file names it; that one is of the pair
        assert str(bad) in r.stderr


def test_topk_golden_agreement_by_hand():
    # prompt of 3 tokens: generated tokens 0 and 1 are chosen at rows 2 and 3 of the full logits
    full = np.full((4, 8), -5.0, np.float32)
    full[2, [5, 1]] = [3.0, 2.0]
    full[3, [6, 3]] = [3.0, 2.0]
    golden = diff.TopK(prompt_ids=np.arange(3), tokens=np.array([5, 6]), positions=np.array([0, 1]),
                       ids=np.array([[5, 1], [6, 2]]), logprobs=np.array([[-0.1, -2.0], [-0.2, -3.0]]))
    report = diff.diff_pair(golden, full)
    assert report["per_position"]["topk_agree"] == [1.0, 0.5]  # {5, 1} = {5, 1}; {6, 3} vs {6, 2}
    assert report["per_position"]["top1_agree"] == [True, True]


@pytest.mark.parametrize("option, target, message", [
    ("--json-out", "missing/r.json", "no such directory"),
    ("--json-out", ".", "is a directory"),
    ("--plot", "missing/r.png", "no such directory"),
    ("--plot", "r.xyz", "matplotlib cannot write .xyz"),
], ids=["json-no-dir", "json-is-dir", "plot-no-dir", "plot-extension"])
def test_unwritable_output_exits_2_before_the_work(tmp_path, option, target, message):
    if target.endswith(".xyz"):
        require("matplotlib")  # the formats it writes; without it --plot is refused as missing matplotlib
    np.save(tmp_path / "ref.npy", np.zeros((3, 10), np.float32))
    r = run_cli("tools.diff", tmp_path / "ref.npy", tmp_path / "ref.npy", option, tmp_path / target)
    cli_error(r, f"tools.diff: {option} {tmp_path / target}", message)
    assert r.stdout == ""  # refused before anything was compared


@pytest.mark.parametrize("args, message", [
    ([], "the following arguments are required: ref, test"),
    (["--topk", "0"], "--topk: 0 is out of range [1, 100]"),
    (["--topk", "101"], "--topk: 101 is out of range [1, 100]"),
    (["--topk", "x"], "--topk: expected an integer, got 'x'"),
    (["--worst", "0"], "--worst: 0 is out of range"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--near-tie-margin", "1", "--typical-error"], "--typical-error: not allowed with argument --near-tie-margin"),
    (["--near-tie-margin", "-1"], "--near-tie-margin: -1 is out of range"),
    (["--near-tie-margin", "nan"], "--near-tie-margin: expected a number, got 'nan'"),
], ids=["no-args", "topk-0", "topk-101", "topk-text", "worst-0", "unknown", "two-margins", "margin-negative",
        "margin-nan"])
def test_bad_arguments_exit_2_with_one_line(tmp_path, args, message):
    np.save(tmp_path / "ref.npy", np.zeros((3, 10), np.float32))
    files = [tmp_path / "ref.npy"] * 2 if args else []
    cli_error(run_cli("tools.diff", *files, *args), "tools.diff: ", message)


# ---------------------------------------------------------------------------------------------
# .positions.npz goldens (reference.positions): some positions, whole rows or top-k

def positions_golden(full, at, k=None):  # -> Positions of rows `at` of full, as tools.golden writes it
    from reference.positions import sparse_golden
    g = sparse_golden(full[at], at, full.shape[1], k)
    lp = None if k is None else g["top_logits"].astype(np.float64) - g["logsumexp"].astype(np.float64)[:, None]
    return diff.Positions(g["positions"], full.shape[1], g.get("logits"), g.get("top_ids"), lp)


def test_positions_goldens_against_full_logits_and_each_other():
    full = np.random.default_rng(1).normal(size=(10, 32)).astype(np.float32) * 3
    rows = diff.diff_pair(full, positions_golden(full, [2, 5, 7]))
    assert rows["per_position"]["position"] == [2, 5, 7] and rows["summary"]["nmse"] == 0.0
    assert rows["coverage"] == {"positions": 3, "ref_only": 7, "test_only": 0, "ref_k": None, "test_k": None}
    top = diff.diff_pair(full, positions_golden(full, [2, 5, 7], k=5))
    # the stored logsumexp is float32: log-probabilities carry its rounding, half a spacing at |lse| < 8
    assert top["summary"]["max_abs"] <= np.spacing(np.float32(8)) and top["summary"]["top1"] == 1.0
    assert top["topk"] == 5 and top["coverage"]["test_k"] == 5
    # top 5 at 2, 5, 7 against top 3 at 5, 7, 9: positions 5 and 7, REF's first 3 tokens
    a, b = positions_golden(full, [2, 5, 7], k=5), positions_golden(full, [5, 7, 9], k=3)
    both = diff.diff_pair(a, b)
    assert both["per_position"]["position"] == [5, 7] and both["topk"] == 3
    assert both["coverage"] == {"positions": 2, "ref_only": 1, "test_only": 1, "ref_k": 5, "test_k": 3}
    assert both["summary"]["max_abs"] <= np.spacing(np.float32(8)) and both["summary"]["topk"] == 1.0
    assert "REF lists the top 5 only, TEST lists the top 3 only, 1 positions only in REF, 1 positions only in TEST" \
        in diff.coverage_note("p", both)
    # the test's third token replaced by one outside REF's list: counted at TEST's smallest listed value
    b.ids[:, 2] = [int(np.argsort(full[r])[0]) for r in (5, 7, 9)]
    b.logprobs[:, 2] -= 1.0
    moved = diff.diff_pair(a, b)
    assert moved["summary"]["topk"] == pytest.approx(2 / 3) and moved["summary"]["max_abs"] == pytest.approx(1.0)
    with pytest.raises(UsageError, match="no position in common"):
        diff.diff_pair(positions_golden(full, [0, 1]), positions_golden(full, [5]))


def test_positions_goldens_through_the_command_line(tmp_path):
    from reference.positions import sparse_golden
    full = np.random.default_rng(2).normal(size=(6, 16)).astype(np.float32)
    np.save(tmp_path / "full.npy", full)
    np.savez(tmp_path / "p.positions.npz", **sparse_golden(full[[1, 4]], [1, 4], 16, 4))
    r = run_cli("tools.diff", tmp_path / "full.npy", tmp_path / "p.positions.npz", "--gate", "top1=1")
    assert r.returncode == 0 and "PASS" in r.stdout, r.stdout + r.stderr
    assert "full: compared at 2 positions on the top 4 tokens; TEST lists the top 4 only, 4 positions only in REF" \
        in r.stdout


@pytest.mark.parametrize("case", ["keys", "order", "neither", "shapes", "positive"])
def test_bad_positions_golden_exits_2(tmp_path, case):
    good = {"positions": np.array([1, 3]), "n_vocab": np.int64(8), "top_ids": np.array([[5, 1], [6, 2]]),
            "top_logits": np.array([[2.0, 1.0], [3.0, 0.5]], np.float32), "logsumexp": np.float32([3.0, 4.0])}
    bad = {"keys": {k: v for k, v in good.items() if k != "n_vocab"}, "order": {**good, "positions": np.array([3, 1])},
           "neither": {"positions": good["positions"], "n_vocab": good["n_vocab"]},
           "shapes": {**good, "logsumexp": np.float32([3.0])},
           "positive": {**good, "logsumexp": np.float32([0.0, 0.0])}}[case]
    np.savez(tmp_path / "g.positions.npz", **bad)
    np.save(tmp_path / "full.npy", np.zeros((4, 8), np.float32))
    words = {"keys": "no array 'n_vocab'", "order": "positions must be ascending", "neither": "neither logits nor",
             "shapes": "are not integer [n, k]", "positive": "top_logits - logsumexp must be finite and <= 0"}[case]
    cli_error(run_cli("tools.diff", tmp_path / "full.npy", tmp_path / "g.positions.npz"), words)
