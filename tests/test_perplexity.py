"""tools.perplexity against llama-perplexity: its .kld files and its printed output, recorded in
tests/fixtures/perplexity/ (README there: the commands), and live where the binary is present
(LLAMA_PERPLEXITY=path, or llama-perplexity on PATH)."""
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess

import numpy as np
import pytest

from conftest import GOLDEN, MODELS, ROOT, cli_error, run_cli
from reference import gguf
from reference.ggml_cpu import DEFAULT_TARGET, target_of_system_info
from reference.tokenizer import Tokenizer
from tools.parity import kld_files, perplexity as ppl
from tools.parity.perplexity_arithmetic import expf, n_scored, row_width

FIX = os.path.join(ROOT, "tests", "fixtures", "perplexity")
TEXT = os.path.join(FIX, "text-crlf.txt")
F32_MODEL = os.path.join(MODELS, "tiny-a-f32.gguf")
Q8_MODEL = os.path.join(MODELS, "tiny-a-q8_0.gguf")
Q4_MODEL = os.path.join(MODELS, "tiny-a-q4_k_m.gguf")
LLAMA_PERPLEXITY = os.environ.get("LLAMA_PERPLEXITY") or shutil.which("llama-perplexity")
STEP = 16 / 65535  # nats per u16 code: llama-perplexity stores log-probabilities over 16 nats
N_CTX = ["-c", "128", "-b", "128"]


def fixture(name):  # -> path under tests/fixtures/perplexity
    return os.path.join(FIX, name)


def recorded(name):  # -> the lines a recorded stream holds, llama.cpp's timestamp prefixes removed
    with open(fixture(name), encoding="utf-8") as f:
        return [re.sub(r"^\d+\.\d+\.\d+ [DIWE] ", "", line) for line in f.read().splitlines()]


def from_header(lines):  # -> the KL-mode lines from the chunk table's header on, trailing blanks dropped
    lines = lines[next(i for i, x in enumerate(lines) if x.startswith("chunk ")):]
    while lines and not lines[-1].strip():
        lines.pop()
    return lines


def statistic(lines, label):  # -> the numbers printed after `label` ("Mean    KLD") as floats
    line = next(x for x in lines if x.startswith(label))
    return [float(v) for v in re.findall(r"-?\d+\.\d+", line.split(":", 1)[1])]


def run_tool(capsys, *args):  # -> (exit status, stdout lines, stderr lines) of tools.perplexity.main in-process
    status = ppl.main(list(args))
    out, err = capsys.readouterr()
    return status, out.splitlines(), err.splitlines()


def digest(path):  # -> sha256 hex of a file
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_fixtures_are_of_the_committed_models():
    """The recorded runs hold for these exact files: a retrained tiny model must re-record them."""
    with open(fixture("manifest.json")) as f:
        manifest = json.load(f)
    for run in manifest["runs"]:
        assert digest(os.path.join(MODELS, run["model"])) == run["model_sha256"], run["id"]
    for name, sha in {**manifest["bases"], "text-crlf.txt": manifest["text"]["sha256"]}.items():
        assert digest(fixture(name)) == sha, name


def test_fixtures_name_their_cpu_target():
    """Every recorded llama-perplexity run logs its build's system_info: the CPU target the manifest
    names, the default of --cpu, against which the tests below compare --numerics ggml-cpu."""
    with open(fixture("manifest.json")) as f:
        manifest = json.load(f)
    assert manifest["cpu_target"] == DEFAULT_TARGET
    for run in manifest["runs"]:
        system_info = [x for x in recorded(f"{run['id']}.stderr") if "system_info:" in x]
        assert len(system_info) == 1 and target_of_system_info(system_info[0]) == manifest["cpu_target"], run["id"]


# ---------------------------------------------------------------------------------------------
# Writing a base: the reference's .kld against llama-perplexity's

def test_ggml_cpu_base_is_llama_perplexitys_own(tmp_path, capsys):
    """--numerics ggml-cpu with -b = -c (one sequence per batch, F16 KV cache and flash attention as
    llama-perplexity's defaults) computes llama.cpp's own logits: the file must be byte-identical
    (all 129024 u16 codes, every row header, the tokens), and PPL equal to its printed digits."""
    out = str(tmp_path / "ref.kld")
    status, stdout, stderr = run_tool(capsys, "-m", F32_MODEL, "-f", TEXT, *N_CTX, "--numerics", "ggml-cpu",
                                      "--kl-divergence-base", out)
    assert status == 0
    with open(out, "rb") as a, open(fixture("lcpp-tiny-a-f32.kld"), "rb") as b:
        assert a.read() == b.read()
    assert stdout[0] == next(x for x in recorded("lcpp-tiny-a-f32.stdout") if x.startswith("[1]"))
    assert final_estimate(stderr) == final_estimate(recorded("lcpp-tiny-a-f32.stderr"))


def test_neon_base_is_the_neon_llama_perplexitys_own(tmp_path, capsys):
    """llama-perplexity of the neon build run under qemu (golden/cpu_targets/neon, "fixtures": tiny-b-q8_0,
    llama.cpp's defaults, -c 128 -b 128) against --numerics ggml-cpu --cpu neon: byte-identical. Its
    u16 codes come from an FMA that aarch64 GCC forms in nearest_int; rounded as on x86, 74 of the
    129024 codes are one step off, so the check can fail."""
    fixtures = os.path.join(GOLDEN, "cpu_targets", "neon")
    made = json.loads(open(os.path.join(fixtures, "manifest.json")).read())["fixtures"]
    out = str(tmp_path / "ref.kld")
    status, _, _ = run_tool(capsys, "-m", os.path.join(ROOT, made["model"]["file"]), "-f", TEXT, *N_CTX,
                            "--numerics", "ggml-cpu", "--cpu", "neon", "--kl-divergence-base", out)
    assert status == 0
    with open(out, "rb") as a, open(os.path.join(fixtures, made["kld"]["file"]), "rb") as b:
        ours, theirs = a.read(), b.read()
    assert digest(os.path.join(fixtures, made["kld"]["file"])) == made["kld"]["sha256"]
    assert len(ours) == len(theirs) and ours == theirs


def test_ggml_cpu_base_in_two_batches_per_chunk(tmp_path, capsys):
    """-b 64 below -c 128: each chunk is decoded in two batches, the first without outputs, on one
    cache. llama-perplexity wrote the identical file with -b 64 (and with its default -b 2048, 16
    chunks a batch; tests/fixtures/perplexity/README.md), so the first two chunks' rows must be
    the committed base's."""
    out = str(tmp_path / "ref.kld")
    assert run_tool(capsys, "-m", F32_MODEL, "-f", TEXT, "-c", "128", "-b", "64", "--chunks", "2",
                    "--numerics", "ggml-cpu", "--kl-divergence-base", out)[0] == 0
    ref, lcpp = kld_files.read_kld(out), kld_files.read_kld(fixture("lcpp-tiny-a-f32.kld"))
    assert ref.n_chunk == 2 and np.array_equal(ref.tokens, lcpp.tokens[:2])
    assert np.array_equal(ref.rows, lcpp.rows[:2])


def final_estimate(lines):  # -> "Final estimate: PPL = X +/- Y" as printed (llama.cpp's shares a line)
    return re.search(r"Final estimate: PPL = \S+ \+/- \S+", "\n".join(lines)).group(0)

def test_exact_base_against_llama_perplexity_f32_kv(tmp_path, capsys):
    """The exact reference against llama.cpp with an F32 KV cache and flash attention off (its
    logits agree to NMSE 5e-12 on the goldens, golden/README.md): a logit difference of ~1e-6
    nats is 1/200 of a code step (16/65535 = 2.4e-4), so a code can move only where the rounding
    sits at a step's edge, and then by one. Measured: 126802 of 129024 codes identical (98.28 %),
    largest difference 1."""
    out = str(tmp_path / "ref.kld")
    status, stdout, stderr = run_tool(capsys, "-m", F32_MODEL, "-f", TEXT, *N_CTX, "--kl-divergence-base", out)
    assert status == 0
    ref, lcpp = kld_files.read_kld(out), kld_files.read_kld(fixture("lcpp-tiny-a-f32-kvf32.kld"))
    assert np.array_equal(ref.tokens, lcpp.tokens)  # the CRLF text tokenized as llama.cpp did
    same, total, largest = ppl.code_agreement(ref, lcpp)
    assert total == 4 * 63 * 512
    assert largest <= 1
    assert same / total >= 0.95  # a flip needs |dlogit| near a step's edge: ~2 |dlogit| / step of codes
    # PPL: the mean nll moves by the same ~1e-6 nats; printed to 4 decimals of a 1.6e6 perplexity
    ours = ppl_value(stderr)
    theirs = ppl_value(recorded("lcpp-tiny-a-f32-kvf32.stderr"))
    assert abs(np.log(ours / theirs)) < 1e-5
    with open(out, "rb") as a, open(fixture("ref-tiny-a-f32.kld"), "rb") as b:
        assert a.read() == b.read()  # the committed reference base, which the recorded runs read, is current


# ---------------------------------------------------------------------------------------------
# --cpu: the chunks as another CPU build of llama.cpp computes them (golden/cpu_targets)

CPU_TARGET_MODEL = os.path.join(GOLDEN, "presets", "models", "tiny-b-q4_k_m.gguf")
CPU_TARGET_PROMPT = "len33"  # 33 tokens, BOS first: one -c 33 chunk as llama-perplexity builds it


def cpu_target_golden(target, repack, kv_type, flash_attn):  # -> the Q4_K_M run's CPU_TARGET_PROMPT record
    with open(os.path.join(GOLDEN, "cpu_targets", target, "manifest.json")) as f:
        manifest = json.load(f)
    run = next(r for r in manifest["runs"] if (r["preset"], r["repack"], r["kv_type"], r["flash_attn"])
               == ("Q4_K_M", repack, kv_type, flash_attn))
    prompt_ids = next(p["token_ids"] for p in manifest["prompts"] if p["id"] == CPU_TARGET_PROMPT)
    return prompt_ids, next(p for p in run["prompts"] if p["id"] == CPU_TARGET_PROMPT)


@pytest.mark.parametrize("flags,repack,kv_type,flash_attn", [
    ([], "on", "f16", "on"),  # llama-perplexity's defaults
    (["--no-repack", "-ctk", "f32", "-ctv", "f32", "-fa", "off"], "off", "f32", "off"),  # the run whose logits are committed
])
def test_cpu_target_chunk_is_that_builds(flags, repack, kv_type, flash_attn):
    """tools.perplexity --cpu T computes a chunk as llama.cpp's T build does: tiny-b-q4_k_m on the
    33-token prompt of golden/cpu_targets as one -c 33 chunk (BOS first, one batch, one ubatch, as
    llama-perplexity decodes it). Bit for bit or not at all (the emulation is exact): the sha256
    of the chunk's float32 prefill logits is that build's, where the avx2 and avx512 builds differ;
    where the logits themselves are committed, the scored positions [16, 32) are those rows."""
    ids, golden = {}, {}
    for target in ("avx2", "avx512"):
        ids[target], golden[target] = cpu_target_golden(target, repack, kv_type, flash_attn)
    assert golden["avx2"]["prefill_sha256"] != golden["avx512"]["prefill_sha256"]  # so the check can fail
    for target in ("avx2", "avx512"):
        args = ppl.build_parser().parse_args(["-m", CPU_TARGET_MODEL, "-c", str(len(ids[target])),
                                              "--numerics", "ggml-cpu", "--cpu", target, *flags])
        lm, numerics = ppl.load_model(args)
        assert numerics == (f"numerics ggml-cpu: llama.cpp's {target} CPU build, KV cache {kv_type}, "
                            f"flash attention {flash_attn}, repack {repack}")
        chunk = ppl.chunk_ids(ids[target], 0, len(ids[target]), Tokenizer(lm.tokenizer).required_id("bos"))
        prefills, prefill = [], lm.prefill
        lm.prefill = lambda *a: prefills.append(prefill(*a)) or prefills[-1]  # every position of the chunk
        scored = ppl.chunk_logits(lm, chunk, args)
        assert len(prefills) == 1 and digest_of(prefills[0]) == golden[target]["prefill_sha256"], target
        committed = os.path.join(GOLDEN, "cpu_targets", target, "logits", "Q4_K_M",
                                 f"repack-{repack}_kv-{kv_type}_fa-{flash_attn}", f"{CPU_TARGET_PROMPT}.npy")
        if os.path.exists(committed):
            assert np.array_equal(scored, np.load(committed)[len(chunk) // 2:len(chunk) - 1])


def digest_of(logits):  # float32 array -> sha256 hex of its C-order bytes, as golden/cpu_targets records them
    return hashlib.sha256(np.ascontiguousarray(logits, np.float32).tobytes()).hexdigest()


def test_cpu_target_is_recorded(tmp_path, capsys):
    """The run names the numerics it rounds with on stderr, and the float32 base keeps that line,
    which a KL run reading the base prints beside its own (the u16 .kld, llama-perplexity's
    format, has no room for it)."""
    base = str(tmp_path / "base.npz")
    status, _, stderr = run_tool(capsys, "-m", F32_MODEL, "-f", TEXT, "-c", "16", "--chunks", "1", "--numerics",
                                 "ggml-cpu", "--cpu", "avx2", "-ctk", "f32", "-ctv", "f32", "--kl-divergence-base-f32", base)
    line = "numerics ggml-cpu: llama.cpp's avx2 CPU build, KV cache f32, flash attention on, repack on"
    assert status == 0 and f"tools.perplexity: {line}" in stderr
    assert str(np.load(base)["numerics"]) == line
    status, _, stderr = run_tool(capsys, "-m", F32_MODEL, "--kl-divergence-base-f32", base, "--kl-divergence")
    assert status == 0 and f"tools.perplexity: numerics exact, float32; the base's: {line}" in stderr


def ppl_value(lines):  # -> the PPL of a "Final estimate: PPL = X +/- Y" line
    return float(re.search(r"Final estimate: PPL = ([\d.]+)", "\n".join(lines)).group(1))


def test_the_readmes_first_command_runs_as_written(capsys):
    """The README's first perplexity line runs from a clean clone with the defaults (-c 512: the
    committed text must tokenize to at least 1024 tokens) and prints the figure written beside it."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        line = next(x for x in f if x.startswith("python -m tools.perplexity "))
    command, figure = line.split("#")
    status, _, stderr = run_tool(capsys, *shlex.split(command)[3:])
    assert status == 0
    assert final_estimate(stderr) == "Final estimate: " + figure.strip()


def test_expf_is_glibcs():
    """llama-perplexity's expf is glibc's; NumPy's exp (float64, rounded) differs from it in ~6 of
    10000 values, which can move a float32 log-sum-exp and so a u16 code."""
    from reference.ggml_cpu import libm
    x = np.random.default_rng(0).uniform(-40, 0, 20000).astype(np.float32)
    assert np.array_equal(expf(x), libm("expf", x))
    assert not np.array_equal(np.exp(x.astype(np.float64)).astype(np.float32), libm("expf", x))  # the check can fail


def test_text_is_read_as_bytes():
    """llama.cpp keeps the \\r of CRLF lines (and drops one trailing \\n): the tokens it stored in its
    base are the tokenization of the bytes; the same text with universal newlines tokenizes to
    other ids."""
    tok = Tokenizer(gguf.load(F32_MODEL, "text").tokenizer)
    stored = kld_files.read_kld(fixture("lcpp-tiny-a-f32.kld")).tokens.ravel().tolist()
    assert tok.tokenize(ppl.read_text(TEXT))[:len(stored)] == stored
    with open(TEXT, encoding="utf-8") as f:
        assert tok.tokenize(f.read().rstrip("\n"))[:len(stored)] != stored


# ---------------------------------------------------------------------------------------------
# llama-perplexity reading the reference's base

def storage_noise(lines):  # KL output lines -> checks llama-perplexity's f32 GGUF against the reference's base
    """Both sides are the same model to ~1e-6 nats; what is left is the u16 storage: every base
    log-probability is off by at most half a step, so the KLD per token lies within +-STEP, the
    same argmax and the same PPL(Q) as the model's own perplexity."""
    kld = statistic(lines, "Mean    KLD")
    assert abs(kld[0]) < STEP / 10 and kld[1] < STEP / 10
    assert abs(statistic(lines, "Maximum KLD")[0]) <= STEP and abs(statistic(lines, "Minimum KLD")[0]) <= STEP
    assert statistic(lines, "Same top p")[0] == 100.0


def test_llama_perplexity_on_reference_base_recorded():
    lines = recorded("lcpp-tiny-a-f32-kvf32-vs-ref-base.stdout")
    storage_noise(lines)
    assert statistic(lines, "Mean PPL(Q)")[0] == pytest.approx(ppl_value(recorded("lcpp-tiny-a-f32-kvf32.stderr")),
                                                               rel=1e-9)  # printed 4 vs 6 decimals


@pytest.mark.skipif(not LLAMA_PERPLEXITY, reason="llama-perplexity not present (recorded fixture checked above)")
def test_llama_perplexity_on_reference_base_live(tmp_path, capsys):
    base = str(tmp_path / "ref.kld")
    assert run_tool(capsys, "-m", F32_MODEL, "-f", TEXT, *N_CTX, "--kl-divergence-base", base)[0] == 0
    storage_noise(llama_perplexity("-m", F32_MODEL, *N_CTX, "-ctk", "f32", "-ctv", "f32", "-fa", "off",
                                   "--kl-divergence-base", base, "--kl-divergence"))


def llama_perplexity(*args):  # -> stdout lines of a KL run that printed its statistics
    """llama.cpp's logger writes from a thread that is not drained at exit (common/log.cpp at this
    commit): the last lines are sometimes lost. A run is repeated until its last line is there."""
    for _ in range(5):
        r = subprocess.run([LLAMA_PERPLEXITY, *args], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        if "Same top p:" in r.stdout:
            return r.stdout.splitlines()
    raise AssertionError(f"llama-perplexity lost its statistics in 5 runs: {r.stdout[-500:]}")


# ---------------------------------------------------------------------------------------------
# KL statistics: the reference's against what llama-perplexity printed

@pytest.mark.parametrize("base", ["lcpp", "ref"])
def test_kl_statistics_equal_llama_perplexitys_q8_0(capsys, base):
    """tiny-a-q8_0 with --numerics ggml-cpu against llama-perplexity's own base and against the
    reference's: the Q side is llama.cpp's arithmetic, so every chunk line and every statistic must
    be what llama-perplexity printed, digit for digit (Q8_0 is not repacked, so its --no-repack run
    is the modelled build's arithmetic)."""
    status, stdout, _ = run_tool(capsys, "-m", Q8_MODEL, *N_CTX, "--numerics", "ggml-cpu",
                                 "--kl-divergence-base", fixture(f"{base}-tiny-a-f32.kld"), "--kl-divergence")
    assert status == 0
    assert from_header(stdout) == from_header(recorded(f"lcpp-tiny-a-q8_0-vs-{base}-base.stdout"))


@pytest.mark.parametrize("base", ["lcpp", "ref"])
def test_kl_statistics_equal_llama_perplexitys_q4_k_m_no_repack(capsys, base):
    """tiny-a-q4_k_m as llama-perplexity --no-repack ran it (Q4_K rows in plain buffers: the tiled
    kernel for its 64-row batches, not the CPU repack): with --numerics ggml-cpu --no-repack every
    chunk line and statistic is what llama-perplexity printed, digit for digit."""
    status, stdout, _ = run_tool(capsys, "-m", Q4_MODEL, *N_CTX, "--numerics", "ggml-cpu", "--no-repack",
                                 "--kl-divergence-base", fixture(f"{base}-tiny-a-f32.kld"), "--kl-divergence")
    assert status == 0
    assert from_header(stdout) == from_header(recorded(f"lcpp-tiny-a-q4_k_m-vs-{base}-base.stdout"))


def test_compare_kld_two_bases(capsys):
    """--compare-kld of the exact reference's base and llama-perplexity's F32-KV one: the code
    agreement of test_exact_base_against_llama_perplexity_f32_kv, and a KLD at the storage noise."""
    status, stdout, _ = run_tool(capsys, "--compare-kld", fixture("ref-tiny-a-f32.kld"),
                                 fixture("lcpp-tiny-a-f32-kvf32.kld"))
    assert status == 0
    assert stdout[0].startswith("u16 log-probability codes: 126802 of 129024 identical (98.2778 %), largest difference 1")
    storage_noise(stdout)


def test_plot(tmp_path, capsys):
    plot = tmp_path / "kl.png"
    assert run_tool(capsys, "--compare-kld", fixture("ref-tiny-a-f32.kld"), fixture("lcpp-tiny-a-f32.kld"),
                    "--plot", str(plot))[0] == 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_f32_base_below_the_u16_noise_floor(tmp_path, capsys):
    """A float32 base of the exact reference, read back by the same model: the KLD is the float32
    rounding of the stored log-probabilities (~1e-7 nats), far below the u16 floor; against
    tiny-a-q8_0 (ggml-cpu, llama.cpp's logits) the mean KLD is the one llama-perplexity printed
    from the reference's u16 base, within that floor (STEP / 10: the recorded storage-noise mean)."""
    base = str(tmp_path / "base.npz")
    assert run_tool(capsys, "-m", F32_MODEL, "-f", TEXT, *N_CTX, "--kl-divergence-base-f32", base)[0] == 0
    status, stdout, _ = run_tool(capsys, "-m", F32_MODEL, *N_CTX, "--kl-divergence-base-f32", base, "--kl-divergence")
    assert status == 0
    assert abs(statistic(stdout, "Maximum KLD")[0]) < 1e-5 and statistic(stdout, "Same top p")[0] == 100.0
    status, stdout, _ = run_tool(capsys, "-m", Q8_MODEL, *N_CTX, "--numerics", "ggml-cpu",
                                 "--kl-divergence-base-f32", base, "--kl-divergence")
    printed = statistic(recorded("lcpp-tiny-a-q8_0-vs-ref-base.stdout"), "Mean    KLD")[0]
    assert abs(statistic(stdout, "Mean    KLD")[0] - printed) < STEP / 10


def test_top_k_base(tmp_path, capsys):
    """--kl-top-k K keeps each row's K most likely tokens and the rest of the base's mass as one
    outcome: with K = n_vocab the statistics are the full float32 base's (every printed line);
    with K = 16 the KLD is a lower bound of it (log-sum inequality), while PPL, Δp and the top
    token, kept exactly, print the same lines."""
    full, top_all, top16 = (str(tmp_path / f"{n}.npz") for n in ("full", "top512", "top16"))
    for path, extra in ((full, []), (top_all, ["--kl-top-k", "512"]), (top16, ["--kl-top-k", "16"])):
        assert run_tool(capsys, "-m", F32_MODEL, "-f", TEXT, *N_CTX, "--kl-divergence-base-f32", path, *extra)[0] == 0
    out = {path: run_tool(capsys, "-m", Q8_MODEL, *N_CTX, "--kl-divergence-base-f32", path, "--kl-divergence")[1]
           for path in (full, top_all, top16)}
    assert out[top_all] == out[full]
    exact = [x for x in out[full] if "KLD" not in x and not x.startswith(("chunk", " ", "  "))]
    assert exact == [x for x in out[top16] if "KLD" not in x and not x.startswith(("chunk", " ", "  "))]
    assert statistic(out[top16], "Mean    KLD")[0] < statistic(out[full], "Mean    KLD")[0]
    assert os.path.getsize(top16) < os.path.getsize(full) / 10


# ---------------------------------------------------------------------------------------------
# Bad input: one line, exit 2, no giant allocation

def write_bytes(path, data):  # -> path
    with open(path, "wb") as f:
        f.write(data)
    return str(path)


def kld_header(n_ctx, n_vocab, n_chunk):  # -> the 20 header bytes of a .kld file
    return kld_files.MAGIC + np.array([n_ctx], np.uint32).tobytes() + np.array([n_vocab, n_chunk], np.int32).tobytes()


def good_kld_bytes():  # -> the committed llama-perplexity base
    with open(fixture("lcpp-tiny-a-f32.kld"), "rb") as f:
        return f.read()


@pytest.mark.parametrize("name,data,expected", [
    ("empty.kld", b"", "no _logits_ header"),
    ("magic.kld", b"_logitz_" + good_kld_bytes()[8:], "no _logits_ header"),
    ("truncated.kld", good_kld_bytes()[:-2], "truncated"),
    ("trailing.kld", good_kld_bytes() + b"\0\0", "trailing bytes"),
    ("huge-vocab.kld", kld_header(128, 2**31 - 1, 4) + good_kld_bytes()[20:], "truncated"),
    ("huge-chunks.kld", kld_header(128, 512, 2**31 - 1) + good_kld_bytes()[20:], "truncated"),
    ("negative.kld", kld_header(128, -5, 4), "is not a base"),
    ("token.kld", good_kld_bytes()[:20] + np.array([9999], np.int32).tobytes() + good_kld_bytes()[24:],
     "token 9999 is outside the vocabulary of 512"),
])
def test_bad_kld(tmp_path, name, data, expected):
    path = write_bytes(tmp_path / name, data)
    r = run_cli("tools.perplexity", "--compare-kld", path, fixture("lcpp-tiny-a-f32.kld"))
    cli_error(r, expected)


def small_kld(tmp_path, n_vocab):  # -> a valid one-chunk .kld of n_ctx 8 over n_vocab tokens
    rows = np.zeros((n_scored(8), row_width(n_vocab)), np.uint16)
    return write_bytes(tmp_path / "small.kld", kld_header(8, n_vocab, 1) + np.zeros(8, np.int32).tobytes() + rows.tobytes())


@pytest.mark.parametrize("args,expected", [
    (["-f", TEXT], "-m M.gguf is required"),
    (["-m", F32_MODEL], "perplexity needs a text"),
    (["-m", F32_MODEL, "-f", TEXT, "-c", "1024"], "you need at least 2048 tokens"),
    (["-m", F32_MODEL, "-f", TEXT, "-c", "128", "-b", "200"], "must be below -c 128 or a multiple"),
    (["-m", F32_MODEL, "-f", TEXT, "-c", "4"], "out of range"),
    (["-m", F32_MODEL, "--kl-divergence"], "--kl-divergence reads one base"),
    (["-m", F32_MODEL, "-f", TEXT, "--plot", "x.png"], "--plot draws the KL statistics"),
    (["-m", F32_MODEL, "-f", TEXT, "--kl-top-k", "5"], "--kl-top-k applies to the base --kl-divergence-base-f32"),
    (["-m", F32_MODEL, "-f", TEXT, "--chunks", "0"], "--chunks must be -1 (all) or at least 1"),
    (["-m", F32_MODEL, "-f", TEXT, "--kl-divergence-base-f32", "out.npy"], "must name a .npz file"),
    (["-m", F32_MODEL, "-f", TEXT, "-fa", "on"], "for --numerics ggml-cpu only"),
    (["-m", F32_MODEL, "-f", TEXT, "--no-repack"], "--repack/--no-repack and --cpu choose llama.cpp's build for --numerics ggml-cpu only"),
    (["-m", F32_MODEL, "-f", TEXT, "--cpu", "avx2"], "--cpu choose llama.cpp's build for --numerics ggml-cpu only"),
    (["-m", F32_MODEL, "-f", TEXT, "--numerics", "ggml-cpu", "--cpu", "sse4"],
     "argument --cpu: invalid choice: 'sse4'"),
    (["-m", os.path.join(FIX, "no-such.gguf"), "-f", TEXT], "no-such.gguf"),
])
def test_bad_arguments(args, expected):
    cli_error(run_cli("tools.perplexity", *args), expected)


def test_what_a_target_does_not_emulate_exits_2_with_one_line():
    # every target is emulated, but not every weight type on it: BF16 products on NEON are refused
    # (reference/ggml_cpu/mul_mat.py) rather than rounded some other way
    # at the first product, so after the run's header lines: the error is the last line, exit 2
    r = run_cli("tools.perplexity", "-m", os.path.join(MODELS, "tiny-a-bf16.gguf"), "-f", TEXT, "-c", "64",
                "--numerics", "ggml-cpu", "--cpu", "neon")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "tools.perplexity: blk.0.attn_q.weight: BF16 weights are not emulated on the neon target")


def test_bad_text_and_bases(tmp_path):
    latin1 = write_bytes(tmp_path / "latin1.txt", b"caf\xe9 " * 400)
    cli_error(run_cli("tools.perplexity", "-m", F32_MODEL, "-f", latin1), "not UTF-8 text (byte 3)")
    cli_error(run_cli("tools.perplexity", "-m", F32_MODEL, "--kl-divergence-base", small_kld(tmp_path, 7),
                      "--kl-divergence"), "inconsistent vocabulary: the base has 7 tokens")
    npz = write_bytes(tmp_path / "bad.npz", b"not a zip")
    cli_error(run_cli("tools.perplexity", "-m", F32_MODEL, "--kl-divergence-base-f32", npz, "--kl-divergence"),
              "bad.npz: not a npz base")
    for name, arrays, expected in (
            ("shape.npz", {"n_ctx": 8, "n_vocab": 512, "tokens": np.zeros(8, np.int32),
                           "log_probs": np.zeros((1, 2, 512))}, "do not fit"),
            ("token.npz", {"n_ctx": 8, "n_vocab": 512, "tokens": np.full(8, 600, np.int32),
                           "log_probs": np.zeros((1, 3, 512))}, "a token of tokens is outside the vocabulary of 512"),
            ("top.npz", {"n_ctx": 8, "n_vocab": 512, "tokens": np.zeros(8, np.int32),
                         "top_ids": np.zeros((1, 3, 4), np.int32)}, "do not fit top_ids (1, 3, 4)")):
        np.savez(tmp_path / name, **arrays)
        cli_error(run_cli("tools.perplexity", "-m", F32_MODEL, "--kl-divergence-base-f32", str(tmp_path / name),
                          "--kl-divergence"), expected)
    other = write_bytes(tmp_path / "other.kld", good_kld_bytes()[:20] + np.roll(
        np.frombuffer(good_kld_bytes()[20:20 + 4 * 512], np.int32), 1).tobytes() + good_kld_bytes()[20 + 4 * 512:])
    cli_error(run_cli("tools.perplexity", "--compare-kld", other, fixture("lcpp-tiny-a-f32.kld")),
              "hold different tokens (first at 0)")
