"""Compare a test engine's logits with reference logits, position by position, and gate on the result.

    python -m tools.diff REF TEST [--gate nmse=1e-4,top1=0.999]
                         [--near-tie-margin X | --noise-floor F64 | --typical-error]
                         [--json OUT.json] [--plot OUT.png] [--topk 5] [--worst 20]

REF and TEST are float `.npy` logits `[n_pos, n_vocab]` (a 1-D `[n_vocab]` counts as one position),
top-k goldens `.topk.npz` (llama-server, openai; format in tools/parity/golden.py), goldens of some
positions `.positions.npz` (tools.golden --logits-positions; reference/positions.py), or two
directories of them: a
golden or corpus directory of tools.golden is read through its `manifest.json` (a JSON list of
entries, or an object holding it under "goldens", "entries" or "files"; each entry has "file" and
"prompt_id" or "id"). Without a manifest the files pair by name. The two sides must hold the same
prompts (a prompt without a golden, or a manifest marked incomplete, counts as missing) unless
--allow-subset: then the prompts both hold are compared and a note names what was left out.

Per position: NMSE, max|diff|, cosine, KL(ref||test), top-1 and top-k agreement, the reference's top-1
margin (logit gap top1 - top2) and delta-p (probability of the reference's top-1 under test minus
under ref). NMSE is sum((ref-test)^2) / sum(ref^2) accumulated in float64 (llama.cpp test-backend-ops).

A top-k golden against full logits: position n_prompt - 1 + i of the full side lines up with
generated token i of the golden (the full side must be the logits of prompt + those tokens, e.g.
tools.golden with continuation_ids, to compare more than the first). Only the golden's k tokens are
known there, so NMSE, max|diff| and cosine are over the log-probabilities of those k tokens (log-
probabilities, not logits: they do not depend on a per-row offset of the logits), KL is over those k
tokens plus one bucket for the rest of the probability mass (a lower bound of the full KL), top-k
agreement is the overlap of the full side's k best with the golden's, and the margin is a log-
probability gap, which equals the logit gap.

Any two goldens are compared at the positions both have; the report's coverage counts the positions
only one side has, and the k of a side that lists top-k tokens only (a note line says so). Whole rows
on both sides are compared as logits. A top-k side against whole rows is compared on its k tokens,
as above. Two top-k sides are compared on REF's first k = min(k_ref, k_test) tokens: a token of those
missing from TEST's list counts at TEST's smallest listed log-probability (an upper bound of its
value there, so its difference is a lower bound), and top-k agreement is the overlap of the two
first-k lists.

Near-tie rule. A position whose top-1 differs is a near-tie when the reference's own top1-top2
margin is below M, else a real divergence. M is, in order of preference:
  --near-tie-margin X            M = X;
  --noise-floor F64              M = 8 * max|ref64 - ref| over the prompt, where ref64 are the float64
                                 logits of the run that made REF (`tools.golden --engine reference
                                 --dtype float64` or `reference.run --dtype float64`);
  --typical-error                M = 2 * the median over the prompt's positions of max|ref - test|:
                                 for a test engine of lower precision than REF (an F16 KV cache,
                                 quantized activations), whose rounding moves each logit by about that
                                 much, so a top1-top2 gap by up to twice it. A bug confined to a few
                                 positions does not move the median; one that spoils every position
                                 inflates M, but then the NMSE and KL gates fail;
  none of them                   M = 8 * float32 spacing at max|ref|: only the rounding of the logits
                                 themselves, so almost every flip counts as real.
Why 8: max|ref64 - ref| = d bounds how far the float32 reference is from the exact logits. A test
engine of the same float32 quality is also within about d, so one logit may differ by 2d between the
two runs and a top1-top2 gap (two logits) by 4d; a factor 2 more allows engines whose summation
order is less careful than the reference's (which carries long sums in float64).

Gate: `--gate key=limit,...`, checked for every prompt. Upper limits: nmse (whole prompt), nmse_pos
(worst position), max_abs, kl (mean over positions), kl_max, delta_p (largest |delta-p|). Lower
limits: cosine (worst position), top1 and topk (mean agreement). top1 counts near-tie flips as
disagreements, so it bounds how many near-ties are tolerated; a real divergence fails regardless.

Corpus directories: the report lists the prompts worst first (most real divergences, then largest
mean KL; --worst N of them, all in the JSON) and an overall line: positions, mean KL and top-1
agreement over all positions, near-tie and real flips, prompts with a real divergence. The PNG then
adds the mean KL of every prompt, worst first.

Exit status: 0 pass, 1 gate failed (every real divergence fails; near-ties alone do not),
2 bad input (one line on stderr naming the file and the problem).
"""
import json
import math
import os
import sys
import zipfile
from dataclasses import dataclass

import numpy as np

from reference import artifacts, metrics
from reference.cli import (OneLineParser, UsageError, add_json_out, check_output, fail, float_in, int_in,
                           strict_float)
from reference.positions import SUFFIX as POSITIONS_SUFFIX
from reference.provenance import describe, differences, read_sidecar
from reference.trace import check_npy_header, load_npy
from tools.common import check_plot, pyplot, save_figure, write_text

NEAR_TIE_FACTOR = 8
TYPICAL_FACTOR = 2
TYPICAL = "typical"
NPY_MAGIC = b"\x93NUMPY"
ZIP_MAGIC = b"PK\x03\x04"
TOPK_SUFFIX = ".topk.npz"
GOLDEN_SUFFIXES = (TOPK_SUFFIX, POSITIONS_SUFFIX, ".npy")  # the longer suffixes first
MANIFEST = "manifest.json"
# --topk: the agreement is read at small k (default 5); past 100 it says little about parity and
# argpartition's cost grows with k
MAX_TOPK = 100
NMSE_DEFINITION = "NMSE = sum((ref-test)^2) / sum(ref^2), float64 (llama.cpp test-backend-ops)"

# gate key -> (summary field, "max" = the field must not exceed the limit | "min" = must reach it)
GATE_KEYS = {
    "nmse": ("nmse", "max"),
    "nmse_pos": ("nmse_pos_max", "max"),
    "max_abs": ("max_abs", "max"),
    "cosine": ("cosine_min", "min"),
    "kl": ("kl_mean", "max"),
    "kl_max": ("kl_max", "max"),
    "top1": ("top1", "min"),
    "topk": ("topk", "min"),
    "delta_p": ("delta_p_abs_max", "max"),
}


@dataclass
class TopK:
    """A top-k golden: the k best tokens and their log-probabilities for each generated token."""
    prompt_ids: np.ndarray    # [n_prompt] int
    tokens: np.ndarray        # [n_gen] int, the generated tokens
    positions: np.ndarray     # [n] int: row r describes the choice of tokens[positions[r]]
    ids: np.ndarray           # [n, k] int, best first
    logprobs: np.ndarray      # [n, k] float64


@dataclass
class Positions:
    """A golden of some prompt positions (reference.positions POSITIONS_FORMAT): whole rows of logits,
    or the top k of each row as log-probabilities (top_logits - logsumexp)."""
    positions: np.ndarray         # [n] int, ascending: row i holds the logits of position positions[i]
    n_vocab: int
    rows: np.ndarray | None       # [n, n_vocab] logits, or None
    ids: np.ndarray | None        # [n, k] int, best first, or None
    logprobs: np.ndarray | None   # [n, k] float64, or None


def check_logits(a, what):  # [n_pos, n_vocab] -> None, raises UsageError
    if a.dtype.kind != "f":
        raise UsageError(f"{what}: dtype {a.dtype} is not a float array of logits")
    if a.ndim != 2 or a.size == 0:
        raise UsageError(f"{what}: shape {list(a.shape)} is not [n_pos, n_vocab]")
    n_nan, n_inf = int(np.isnan(a).sum()), int(np.isinf(a).sum())
    if n_nan or n_inf:
        raise UsageError(f"{what}: contains {n_nan} NaN and {n_inf} Inf values")


def read_magic(path, magic, what):  # -> None, raises UsageError unless a regular file starts with magic
    try:
        with artifacts.open_regular(path, UsageError, what=f"{what} golden") as f:
            if f.read(len(magic)) != magic:
                raise UsageError(f"{path}: not a {what} file")
    except OSError as e:
        raise UsageError(f"{path}: {e.strerror or e}") from None


def load_logits(path):  # .npy file -> [n_pos, n_vocab]
    read_magic(path, NPY_MAGIC, ".npy")
    try:
        a = load_npy(path)  # refuses a header that claims more data than the file holds
    except OSError as e:
        raise UsageError(f"{path}: {e.strerror or e}") from None
    except ValueError as e:
        # numpy refuses object arrays here, which is how a pickle inside a .npy shows up
        problem = "holds pickled objects (refused)" if "allow_pickle" in str(e) else f"corrupt .npy ({e})"
        raise UsageError(f"{path}: {problem}") from None
    if a.ndim == 1:
        a = a[None, :]
    check_logits(a, path)
    return a


def read_npz(path, suffix, keys, optional=()):  # -> {key: array} of an .npz golden; UsageError naming the file
    read_magic(path, ZIP_MAGIC, suffix)
    artifacts.check_zip(path, UsageError, f"{suffix} golden")  # a member inflating to GBs, refused before it inflates
    try:
        with zipfile.ZipFile(path) as archive:
            # each member's header against the member's size, before np.load allocates what it claims
            for info in archive.infolist():
                if info.filename.endswith(".npy"):
                    with archive.open(info) as member:
                        check_npy_header(member, info.file_size)
        with np.load(path, allow_pickle=False) as z:
            missing = [k for k in keys if k not in z]
            if missing:
                raise UsageError(f"{path}: no array {missing[0]!r} (a {suffix} golden holds {', '.join(keys)})")
            return {k: z[k] for k in keys + tuple(k for k in optional if k in z)}
    # NotImplementedError: a compression method zipfile cannot read
    except (ValueError, OSError, zipfile.BadZipFile, NotImplementedError) as e:
        raise UsageError(f"{path}: corrupt .npz ({e})") from None


def check_top(path, ids, lp, name):  # top ids [n, k] and log-probabilities -> None, raises UsageError
    # ids compared as Python ints: a uint64 id past 2^63 would wrap negative as int64
    if not np.all(np.isfinite(lp)) or np.any(lp > 0) or ids.size and not 0 <= int(ids.min()) <= int(ids.max()) < 2**31:
        raise UsageError(f"{path}: {name} must be finite and <= 0, ids in [0, 2^31)")


def load_topk(path):  # .topk.npz file -> TopK
    arrays = read_npz(path, TOPK_SUFFIX, ("prompt_ids", "tokens", "positions", "top_ids", "top_logprobs"))
    ids, lp = arrays["top_ids"], arrays["top_logprobs"]
    positions = arrays["positions"]
    if any(arrays[k].dtype.kind not in "iu" for k in ("prompt_ids", "tokens", "positions", "top_ids")) \
            or lp.dtype.kind != "f":
        raise UsageError(f"{path}: ids and positions must be integers, top_logprobs floats")
    if ids.ndim != 2 or lp.shape != ids.shape or positions.shape != ids.shape[:1] or ids.shape[0] == 0 \
            or ids.shape[1] < 2 or arrays["prompt_ids"].ndim != 1 or arrays["prompt_ids"].size == 0 \
            or arrays["tokens"].ndim != 1:
        raise UsageError(f"{path}: shapes {[list(a.shape) for a in arrays.values()]} are not "
                       "[n_prompt], [n_gen], [n], [n, k >= 2], [n, k]")
    if np.any(np.diff(positions) <= 0) or positions[0] < 0 or positions[-1] >= arrays["tokens"].size:
        raise UsageError(f"{path}: positions must increase within the {arrays['tokens'].size} generated tokens")
    check_top(path, ids, lp, "top_logprobs")
    return TopK(arrays["prompt_ids"], arrays["tokens"], positions.astype(np.int64), ids.astype(np.int64),
                lp.astype(np.float64))


def load_positions(path):  # .positions.npz file (reference.positions POSITIONS_FORMAT) -> Positions
    a = read_npz(path, POSITIONS_SUFFIX, ("positions", "n_vocab"), ("logits", "top_ids", "top_logits", "logsumexp"))
    positions, n_vocab = a["positions"], a["n_vocab"]
    if positions.dtype.kind not in "iu" or positions.ndim != 1 or not positions.size or n_vocab.shape != () \
            or n_vocab.dtype.kind not in "iu" or n_vocab < 0 or np.any(np.diff(positions) <= 0) or positions[0] < 0:
        raise UsageError(f"{path}: positions must be ascending integers [n], n_vocab a number")
    if "logits" in a:
        check_logits(a["logits"], path)
        if a["logits"].shape[0] != positions.size:
            raise UsageError(f"{path}: logits {list(a['logits'].shape)} for {positions.size} positions")
        return Positions(positions.astype(np.int64), int(n_vocab), a["logits"], None, None)
    if not all(k in a for k in ("top_ids", "top_logits", "logsumexp")):
        raise UsageError(f"{path}: neither logits nor top_ids, top_logits and logsumexp")
    ids, top, lse = a["top_ids"], a["top_logits"], a["logsumexp"]
    if ids.dtype.kind not in "iu" or top.dtype.kind != "f" or lse.dtype.kind != "f" or ids.ndim != 2 \
            or top.shape != ids.shape or lse.shape != positions.shape or ids.shape[0] != positions.size:
        raise UsageError(f"{path}: top_ids, top_logits, logsumexp {[list(a[k].shape) for k in ('top_ids', 'top_logits', 'logsumexp')]} "
                         f"are not integer [n, k], float [n, k], float [n] for {positions.size} positions")
    lp = top.astype(np.float64) - lse.astype(np.float64)[:, None]
    check_top(path, ids, lp, "top_logits - logsumexp")
    return Positions(positions.astype(np.int64), int(n_vocab), None, ids.astype(np.int64), lp)


def load_golden(path):  # file -> [n_pos, n_vocab] | TopK | Positions
    path = str(path)
    if path.endswith(TOPK_SUFFIX):
        return load_topk(path)
    return load_positions(path) if path.endswith(POSITIONS_SUFFIX) else load_logits(path)


def check_digests(path, directory, entry, key):  # -> None; UsageError when a file is not the one the manifest vouches for
    """tools.golden lists each entry's files with their sha256 (entry "sha256"); a manifest that says
    so ("digests") vouches for no entry without them. A file that differs was written after the
    manifest (an interrupted run into an older directory) or changed since: it is refused."""
    digests = entry.get("sha256")
    if not isinstance(digests, dict) or entry["file"] not in digests:
        raise UsageError(f"{path}: entry {key!r} lists no sha256 of {entry['file']}, which the manifest's "
                         "\"digests\" promises")
    for name, digest in digests.items():
        file = os.path.join(directory, str(name))
        if os.path.commonpath([os.path.realpath(directory), os.path.realpath(file)]) != os.path.realpath(directory):
            raise UsageError(f"{path}: entry {key!r} points outside the directory: {name!r}")
        if not os.path.isfile(file) or artifacts.cached_sha256(file) != digest:
            raise UsageError(f"{file}: not the file {path} vouches for (sha256 differs or it is missing: written "
                             "after the manifest, by an interrupted run, or changed since)")


def read_manifest(directory):  # dir with manifest.json -> ({prompt_id: path}, the manifest's other fields, [notes])
    path = os.path.join(directory, MANIFEST)
    manifest = artifacts.read_json(path, UsageError, what="manifest")
    header, notes = {}, []
    if isinstance(manifest, dict):
        header = manifest
        manifest = next((manifest[k] for k in ("goldens", "entries", "files") if k in manifest), None)
    if not isinstance(manifest, list):
        raise UsageError(f"{path}: expected a list of entries")
    root = os.path.realpath(directory)
    files = {}
    for entry in manifest:
        if isinstance(entry, dict) and entry.get("file", "") is None and "skipped" in entry:
            notes.append(f"{directory}: prompt {entry.get('id')!r} has no golden ({str(entry['skipped'])[:160]})")
            continue
        if not isinstance(entry, dict) or not isinstance(entry.get("file"), str):
            raise UsageError(f"{path}: entry without a \"file\": {entry!r:.80}")
        key = str(entry.get("prompt_id", entry.get("id", os.path.splitext(entry["file"])[0])))
        if "digests" in header:
            check_digests(path, directory, entry, key)
        file = os.path.realpath(os.path.join(directory, entry["file"]))
        if os.path.commonpath([root, file]) != root:
            raise UsageError(f"{path}: entry {key!r} points outside the directory: {entry['file']!r}")
        if key in files:
            raise UsageError(f"{path}: prompt id {key!r} appears twice")
        files[key] = file
    return files, header, notes


def logit_files(path):  # file or dir -> ({prompt_id: path}, manifest fields, [notes on the source])
    if not os.path.exists(path):
        raise UsageError(f"{path}: no such file or directory")
    if not os.path.isdir(path):
        return {golden_name(os.path.basename(path)): path}, {}, []
    if os.path.exists(os.path.join(path, MANIFEST)):
        return read_manifest(path)
    names = sorted(n for n in os.listdir(path) if n.endswith(GOLDEN_SUFFIXES) and not n.startswith("."))
    note = f"{path}: no {MANIFEST} vouches for these files: paired by file name, as they are"
    return {golden_name(n): os.path.join(path, n) for n in names}, {}, [note]


def golden_files(path):  # -> the files of a golden directory an output must not replace ([] for a file)
    if not os.path.isdir(path):
        return []
    return [os.path.join(path, n) for n in os.listdir(path) if n.endswith(GOLDEN_SUFFIXES) or n == MANIFEST]


def golden_name(file):  # "len7.topk.npz" -> "len7"
    return next((file.removesuffix(x) for x in GOLDEN_SUFFIXES if file.endswith(x)), file)


def pair_files(ref_path, test_path, allow_subset=False):  # -> ([(prompt_id, ref file, test file)], [notes])
    for path in (ref_path, test_path):
        if not os.path.exists(path):
            raise UsageError(f"{path}: no such file or directory")
    if os.path.isdir(ref_path) != os.path.isdir(test_path):
        raise UsageError(f"{test_path}: cannot compare a file with a directory ({ref_path})")
    (ref, ref_header, ref_notes), (test, test_header, test_notes) = logit_files(ref_path), logit_files(test_path)
    notes = ref_notes + test_notes + [
        f"{side} {path} was made by this project's reference (self_made): not an independent golden"
        for side, path, header in (("REF", ref_path, ref_header), ("TEST", test_path, test_header))
        if header.get("self_made")]
    if not os.path.isdir(ref_path):
        return [(next(iter(ref)), ref_path, test_path)], notes
    if not ref:
        raise UsageError(f"{ref_path}: no logits found")
    for side, path, header in (("REF", ref_path, ref_header), ("TEST", test_path, test_header)):
        if header.get("incomplete") and not allow_subset:
            raise UsageError(f"{path}/{MANIFEST}: the run that made {side} is incomplete "
                             f"({str(header['incomplete'])[:120]}); --allow-subset compares what it holds")
    for path, have, other_path, other in ((test_path, test, ref_path, ref), (ref_path, ref, test_path, test)):
        missing = [k for k in other if k not in have]
        if missing and not allow_subset:
            raise UsageError(f"{path}: no logits for {len(missing)} of the {len(other)} prompts of {other_path} "
                             f"({', '.join(missing[:8])}); --allow-subset compares the prompts both hold")
        if missing:
            notes.append(f"{path}: no logits for {len(missing)} of the {len(other)} prompts of {other_path}, "
                         f"left out (--allow-subset): {', '.join(missing[:8])}")
    shared = [k for k in ref if k in test]
    if not shared:
        raise UsageError(f"{test_path}: no prompt in common with {ref_path}")
    return [(k, ref[k], test[k]) for k in shared], notes


def noise_margin(ref, ref64):  # [n_pos, n_vocab] x2 -> near-tie margin
    if ref64.shape != ref.shape:
        raise UsageError(f"noise floor shape {list(ref64.shape)} does not match reference {list(ref.shape)}")
    return NEAR_TIE_FACTOR * float(metrics.max_abs_diff(ref64.reshape(-1), ref.reshape(-1)))


def rounding_margin(ref):  # [n_pos, n] -> near-tie margin when no noise floor is known
    return NEAR_TIE_FACTOR * float(np.spacing(np.float32(np.max(np.abs(ref)))))


def typical_margin(ref, test):  # [n_pos, n] x2 -> near-tie margin from the test's typical error
    return TYPICAL_FACTOR * float(np.median(metrics.max_abs_diff(ref, test)))


def make_report(ref, test, pos, near_tie_margin, n_vocab, topk):  # compared values, per-position metrics -> report
    """ref/test are what the metrics were computed on (logits, or log-probabilities of top-k tokens);
    near_tie_margin is a number, TYPICAL or None (module doc)."""
    if near_tie_margin is None:
        near_tie_margin = rounding_margin(ref)
    elif near_tie_margin == TYPICAL:
        near_tie_margin = typical_margin(ref, test)
    flips = [{"pos": int(pos["position"][i]), "row": int(i), "ref_token": int(pos["ref_top1"][i]),
              "test_token": int(pos["test_top1"][i]),
              "ref_margin": float(pos["ref_margin"][i]),
              "kind": "near-tie" if pos["ref_margin"][i] < near_tie_margin else "real"}
             for i in np.flatnonzero(~pos["top1_agree"])]
    real = [f["pos"] for f in flips if f["kind"] == "real"]
    summary = {
        "nmse": float(metrics.nmse(ref.reshape(-1), test.reshape(-1))),
        "nmse_pos_max": float(pos["nmse"].max()), "max_abs": float(pos["max_abs"].max()),
        "cosine_min": float(pos["cosine"].min()), "kl_mean": float(pos["kl"].mean()),
        "kl_max": float(pos["kl"].max()), "top1": float(pos["top1_agree"].mean()),
        "topk": float(pos["topk_agree"].mean()), "delta_p_abs_max": float(np.abs(pos["delta_p"]).max()),
        "delta_p_rms": float(np.sqrt(np.mean(pos["delta_p"] ** 2))),
        "n_near_tie": len(flips) - len(real), "n_real": len(real),
    }
    return {
        "n_pos": int(ref.shape[0]), "n_vocab": int(n_vocab), "topk": int(topk),
        "near_tie_margin": float(near_tie_margin), "summary": summary, "flips": flips,
        "first_flip": flips[0]["pos"] if flips else None, "first_real": real[0] if real else None,
        "per_position": {k: v.tolist() for k, v in pos.items()},
    }


def diff_logits(ref, test, near_tie_margin=None, topk=5, at=None):  # [n_pos, n_vocab] x2 -> report dict
    """Per-position metrics, aggregates and top-1 flips classified by the near-tie rule (module doc);
    `at`: the positions the rows are of (default 0, 1, ...)."""
    check_logits(ref, "reference")
    check_logits(test, "test")
    if ref.shape != test.shape:
        raise UsageError(f"shape {list(test.shape)} does not match reference {list(ref.shape)}")
    pos = {
        "nmse": metrics.nmse(ref, test), "max_abs": metrics.max_abs_diff(ref, test),
        "cosine": metrics.cosine(ref, test), "kl": metrics.kl(ref, test),
        "top1_agree": metrics.top1_agreement(ref, test), "topk_agree": metrics.topk_agreement(ref, test, topk),
        "ref_margin": metrics.top1_margin(ref), "delta_p": metrics.delta_p(ref, test),
        "ref_top1": np.argmax(ref, axis=-1), "test_top1": np.argmax(test, axis=-1),
        "position": np.arange(ref.shape[0]) if at is None else at,
    }
    return make_report(ref, test, pos, near_tie_margin, ref.shape[1], topk)


def bucket_kl(lp_ref, lp_test):  # [n, k] log-probabilities of the same tokens x2 -> [n]
    """KL(ref||test) over the k tokens plus one bucket holding the rest of each distribution: merging
    tokens never raises KL, so this is a lower bound of the KL over the full vocabulary."""
    def with_rest(lp):  # [n, k] -> [n, k+1] probabilities
        p = np.exp(lp)
        return np.concatenate([p, np.maximum(1 - p.sum(-1, keepdims=True), 0)], axis=-1)
    p, q = with_rest(lp_ref), with_rest(lp_test)
    tiny = np.finfo(np.float64).tiny
    return np.maximum(np.sum(p * (np.log(np.maximum(p, tiny)) - np.log(np.maximum(q, tiny))), axis=-1), 0.0)


def view(golden):  # logits | TopK | Positions -> (positions [n], logits [n, V] | None, ids [n, k] | None, logprobs | None)
    """Every golden as rows of the full sequence: a top-k golden's generated token i was chosen at
    position n_prompt - 1 + positions[i] of prompt + generated tokens."""
    if isinstance(golden, TopK):
        return golden.prompt_ids.size - 1 + golden.positions, None, golden.ids, golden.logprobs
    if isinstance(golden, Positions):
        return golden.positions, golden.rows, golden.ids, golden.logprobs
    return np.arange(golden.shape[0]), golden, None, None


def sparse_metrics(at, lp_ref, lp_test, ids_ref, ids_test, ref_margin, p_ref, p_test, top1):  # -> per-position dict
    return {"nmse": metrics.nmse(lp_ref, lp_test), "max_abs": metrics.max_abs_diff(lp_ref, lp_test),
            "cosine": metrics.cosine(lp_ref, lp_test), "kl": bucket_kl(lp_ref, lp_test),
            "top1_agree": top1[0] == top1[1], "topk_agree": metrics.shared_fraction(ids_ref, ids_test),
            "ref_margin": ref_margin, "delta_p": p_test - p_ref, "ref_top1": top1[0], "test_top1": top1[1],
            "position": at}


def gap(lp):  # [n, k] log-probabilities best first -> top1 - top2; unknown (inf: every flip real) when k = 1
    return lp[:, 0] - lp[:, 1] if lp.shape[1] > 1 else np.full(lp.shape[0], np.inf)


def diff_sparse_dense(at, ref, test, near_tie_margin):  # (rows, ids, logprobs) of each side, one side rows only
    """Compares on the sparse side's k tokens (module doc); either side may be the sparse one."""
    ref_is_top = ref[0] is None
    full, (_, ids, lp_top) = (test[0], ref) if ref_is_top else (ref[0], test)
    check_logits(full, "test" if ref_is_top else "reference")
    k = ids.shape[1]
    if k > full.shape[1]:
        raise UsageError(f"the top-k golden lists {k} tokens per row, more than the vocabulary of {full.shape[1]}")
    if ids.max() >= full.shape[1]:
        raise UsageError(f"top-k token id {int(ids.max())} is outside a vocabulary of {full.shape[1]}")
    lp_all = metrics.log_softmax(full)
    lp_full = np.take_along_axis(lp_all, ids, axis=-1)
    full_top1, full_topk = np.argmax(full, axis=-1), np.argpartition(full, -k, axis=-1)[:, -k:]
    if ref_is_top:
        pos = sparse_metrics(at, lp_top, lp_full, ids, full_topk, gap(lp_top), np.exp(lp_top[:, 0]),
                             np.exp(lp_full[:, 0]), (ids[:, 0], full_top1))
    else:
        # the reference's top-1 may be missing from the test's k tokens: its probability there counts as 0
        in_top = ids == full_top1[:, None]
        p_test = np.where(in_top.any(-1), np.exp(np.where(in_top, lp_top, -np.inf).max(-1)), 0.0)
        pos = sparse_metrics(at, lp_full, lp_top, full_topk, ids, metrics.top1_margin(full),
                             np.exp(lp_all[np.arange(len(full)), full_top1]), p_test, (full_top1, ids[:, 0]))
    lp_ref, lp_test = (lp_top, lp_full) if ref_is_top else (lp_full, lp_top)
    return make_report(lp_ref, lp_test, pos, near_tie_margin, full.shape[1], k)


def diff_sparse(at, ref, test, near_tie_margin, n_vocab):  # (None, ids, logprobs) of each side -> report dict
    """Two top-k goldens, compared on the reference's first k = min(k_ref, k_test) tokens. A token of
    those missing from the test's list counts at the test's smallest listed log-probability, an upper
    bound of its value there, so its difference is a lower bound."""
    (_, ids_r, lp_r), (_, ids_t, lp_t) = ref, test
    k = min(ids_r.shape[1], ids_t.shape[1])
    ids, lp_ref = ids_r[:, :k], lp_r[:, :k]
    match = ids_t[:, None, :] == ids[:, :, None]                                       # [n, k, k_test]
    lp_test = np.where(match.any(-1), np.where(match, lp_t[:, None, :], -np.inf).max(-1), lp_t[:, -1:])
    pos = sparse_metrics(at, lp_ref, lp_test, ids, ids_t[:, :k], gap(lp_r), np.exp(lp_ref[:, 0]),
                         np.exp(lp_test[:, 0]), (ids_r[:, 0], ids_t[:, 0]))
    return make_report(lp_ref, lp_test, pos, near_tie_margin, n_vocab, k)


def coverage(at, at_ref, at_test, ref, test):  # -> what of each side the comparison used
    def k(side):  # the top-k a side lists, None for whole rows
        return None if side[0] is not None else int(side[1].shape[1])
    return {"positions": int(at.size), "ref_only": int(at_ref.size - at.size), "test_only": int(at_test.size - at.size),
            "ref_k": k(ref), "test_k": k(test)}


def diff_pair(ref, test, near_tie_margin=None, topk=5):  # logits | TopK | Positions x2 -> report dict
    """On the positions both sides have (the others are counted in the report's coverage), on whole
    rows where both have them, else on the tokens the sparse side lists (module doc)."""
    if not isinstance(ref, (TopK, Positions)) and not isinstance(test, (TopK, Positions)):
        return diff_logits(ref, test, near_tie_margin, topk)
    (at_ref, *r), (at_test, *t) = view(ref), view(test)
    at, i_ref, i_test = np.intersect1d(at_ref, at_test, return_indices=True)
    if not at.size:
        raise UsageError(f"no position in common: REF has positions {at_ref[0]}..{at_ref[-1]}, "
                         f"TEST {at_test[0]}..{at_test[-1]}")
    r, t = ([None if a is None else a[i] for a in side] for side, i in ((r, i_ref), (t, i_test)))
    if r[0] is not None and t[0] is not None:
        report = diff_logits(r[0], t[0], near_tie_margin, topk, at)
    elif r[0] is not None or t[0] is not None:
        report = diff_sparse_dense(at, r, t, near_tie_margin)
    else:
        n_vocab = max(getattr(g, "n_vocab", 0) for g in (ref, test))
        report = diff_sparse(at, r, t, near_tie_margin, n_vocab)
    report["coverage"] = coverage(at, at_ref, at_test, r, t)
    return report


def coverage_note(key, report):  # -> a line saying what a comparison left out or truncated, or None
    c = report.get("coverage")
    if not c:
        return None
    parts = [f"REF lists the top {c['ref_k']} only" if c["ref_k"] else "",
             f"TEST lists the top {c['test_k']} only" if c["test_k"] else "",
             f"{c['ref_only']} positions only in REF" if c["ref_only"] else "",
             f"{c['test_only']} positions only in TEST" if c["test_only"] else ""]
    tokens = "whole rows" if not (c["ref_k"] or c["test_k"]) else f"the top {report['topk']} tokens"
    return f"{key}: compared at {c['positions']} positions on {tokens}; " + ", ".join(p for p in parts if p) \
        if any(parts) else None


def parse_gate(text):  # "nmse=1e-4,top1=0.999" -> {"nmse": 1e-4, "top1": 0.999}
    gate = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key.strip() not in GATE_KEYS:
            raise UsageError(f"--gate: bad item {item!r} (keys: {', '.join(GATE_KEYS)})")
        try:  # strict_float: no nan (every comparison with NaN is false: the limit would never fail)
            gate[key.strip()] = strict_float(value.strip())
        except ValueError:
            raise UsageError(f"--gate: {key.strip()} needs a number, got {value!r}") from None
    return gate


def check_gate(report, gate):  # report of diff_logits, gate of parse_gate -> [failure lines]; [] = pass
    failures = [f"real divergence at position {f['pos']}: ref top-1 {f['ref_token']} (margin "
                f"{f['ref_margin']:.3g}) -> test {f['test_token']}" for f in report["flips"] if f["kind"] == "real"]
    for key, limit in gate.items():
        field, direction = GATE_KEYS[key]
        value = report["summary"][field]
        if (value > limit) if direction == "max" else (value < limit):
            failures.append(f"{key} = {value:.4g} {'>' if direction == 'max' else '<'} {limit:g}")
    return failures


def worst_first(runs):  # [(id, report, failures)] -> the same, most real divergences then largest mean KL first
    return sorted(runs, key=lambda run: (-run[1]["summary"]["n_real"], -run[1]["summary"]["kl_mean"]))


def corpus_summary(runs):  # [(id, report, failures)] -> aggregates over every position of every prompt
    n_pos = sum(r["n_pos"] for _, r, _ in runs)

    def mean(field):  # a per-prompt mean -> the mean over every position
        return float(sum(r["summary"][field] * r["n_pos"] for _, r, _ in runs) / n_pos)

    return {"n_prompts": len(runs), "n_pos": int(n_pos), "kl_mean": mean("kl_mean"),
            "kl_max": max(r["summary"]["kl_max"] for _, r, _ in runs), "top1": mean("top1"),
            "nmse_max": max(r["summary"]["nmse"] for _, r, _ in runs),
            "n_near_tie": sum(r["summary"]["n_near_tie"] for _, r, _ in runs),
            "n_real": sum(r["summary"]["n_real"] for _, r, _ in runs),
            "prompts_with_real": sum(r["summary"]["n_real"] > 0 for _, r, _ in runs),
            "prompts_failed": sum(bool(fails) for _, _, fails in runs)}


def format_report(runs, gate, margin_rule, n_worst=8, notes=(), n_prompts_shown=20):  # [(id, report, failures)] -> text
    topk = runs[0][1]["topk"]
    lines = [NMSE_DEFINITION + "; KL(ref||test) in nats on the full softmax",
             f"near-tie: a top-1 flip where the reference's top1-top2 margin < M; {margin_rule}", *notes, "",
             f"{'prompt':<16} {'n_pos':>5} {'nmse':>9} {'max|d|':>9} {'min cos':>9} {'mean KL':>9} "
             f"{'max KL':>9} {'top1':>6} {f'top{topk}':>6} {'M':>9} {'ties':>5} {'real':>5} {'1st flip':>8}"]
    shown = worst_first(runs)[:n_prompts_shown] if len(runs) > 1 else runs
    for key, r, _ in shown:
        s = r["summary"]
        lines.append(f"{key:<16.16} {r['n_pos']:>5} {s['nmse']:>9.2e} {s['max_abs']:>9.2e} {s['cosine_min']:>9.6f} "
                     f"{s['kl_mean']:>9.2e} {s['kl_max']:>9.2e} {s['top1']:>6.3f} {s['topk']:>6.3f} "
                     f"{r['near_tie_margin']:>9.2e} {s['n_near_tie']:>5} {s['n_real']:>5} "
                     f"{'-' if r['first_flip'] is None else r['first_flip']:>8}")
    if len(runs) > 1:
        c = corpus_summary(runs)
        if len(shown) < len(runs):
            lines.append(f"... {len(runs) - len(shown)} more prompts (worst first above; all in --json)")
        lines += ["", f"overall: {c['n_prompts']} prompts, {c['n_pos']} positions, mean KL {c['kl_mean']:.3g}, "
                      f"max KL {c['kl_max']:.3g}, top-1 {c['top1']:.4f}, worst prompt NMSE {c['nmse_max']:.3g}, "
                      f"{c['n_near_tie']} near-tie and {c['n_real']} real flips, "
                      f"{c['prompts_with_real']} prompts with a real divergence"]
    worst = sorted(((r["per_position"]["kl"][i], key, i, r) for key, r, _ in runs for i in range(r["n_pos"])),
                   key=lambda t: -t[0])[:n_worst]
    lines += ["", "worst positions by KL:", f"{'prompt':<16} {'pos':>5} {'nmse':>9} {'KL':>9} {'margin':>9} "
              f"{'ref top1':>9} {'test top1':>9} {'delta_p':>9}"]
    for kl, key, i, r in worst:
        p = r["per_position"]
        lines.append(f"{key:<16.16} {p['position'][i]:>5} {p['nmse'][i]:>9.2e} {kl:>9.2e} {p['ref_margin'][i]:>9.3g} "
                     f"{p['ref_top1'][i]:>9} {p['test_top1'][i]:>9} {p['delta_p'][i]:>+9.2e}")
    flips = [(key, f) for key, r, _ in worst_first(runs) for f in r["flips"]]
    if flips:
        lines += ["", "top-1 flips:"] + [f"  {key} pos {f['pos']}: {f['ref_token']} -> {f['test_token']}, "
                                         f"ref margin {f['ref_margin']:.3g}: {f['kind']}" for key, f in flips[:50]]
        if len(flips) > 50:
            lines.append(f"  ... {len(flips) - 50} more (all in --json)")
    failures = [f"  {key}: {line}" for key, _, fails in worst_first(runs) for line in fails]
    gate_text = ", ".join(f"{k}{'<=' if GATE_KEYS[k][1] == 'max' else '>='}{v:g}" for k, v in gate.items())
    lines += ["", f"gate ({gate_text or 'no metric limits'}; real divergences always fail): "
              + ("FAIL" if failures else "PASS")] + failures[:50]
    return "\n".join(lines)


def flip_markers(ax, r, y, start, label):  # near-tie and real flips of one prompt as markers on a curve
    for kind, style in (("near-tie", {"marker": "^", "color": "orange"}), ("real", {"marker": "X", "color": "red"})):
        at = [f["row"] for f in r["flips"] if f["kind"] == kind]
        ax.scatter(start + np.array(at, int), y[at], s=60, zorder=3, **style, label=f"{kind} flip" if label else None)


def plot_report(runs, path):  # [(id, report, failures)] -> PNG: NMSE and KL per position (+ KL per prompt)
    plt = pyplot(path)
    corpus = len(runs) > 1
    fig, axes = plt.subplots(3 if corpus else 2, 1, figsize=(11, 9 if corpus else 6))
    start = 0
    for n, (key, r, _) in enumerate(runs):
        x = start + np.arange(r["n_pos"])
        for ax, metric in zip(axes[:2], ("nmse", "kl")):
            # log axes cannot show an exact 0; draw it at the bottom of the float64 range instead
            y = np.maximum(r["per_position"][metric], 1e-30)
            ax.semilogy(x, y, ".-", lw=0.8, ms=3, label=key if metric == "nmse" and n < 10 else None)
            flip_markers(ax, r, y, start, label=metric == "kl" and n == 0)
        if start:
            for ax in axes[:2]:
                ax.axvline(start - 0.5, color="grey", ls=":", lw=0.5)
        start += r["n_pos"]
    axes[0].set_ylabel("NMSE")
    axes[1].set_ylabel("KL(ref||test)")
    axes[1].set_xlabel("position (prompts side by side)")
    axes[0].set_title(NMSE_DEFINITION, fontsize=9)
    if corpus:
        ranked = worst_first(runs)
        kl = np.maximum([r["summary"]["kl_mean"] for _, r, _ in ranked], 1e-30)
        colors = ["red" if r["summary"]["n_real"] else "orange" if r["summary"]["n_near_tie"] else "tab:blue"
                  for _, r, _ in ranked]
        axes[2].bar(np.arange(len(ranked)), kl, color=colors)
        axes[2].set_yscale("log")
        axes[2].set_ylabel("mean KL per prompt")
        axes[2].set_xlabel("prompts, worst first (red: a real divergence, orange: near-ties only)")
        if len(ranked) <= 40:
            axes[2].set_xticks(np.arange(len(ranked)), [k for k, _, _ in ranked], rotation=60, ha="right", fontsize=6)
        c = corpus_summary(runs)
        axes[2].set_title(f"{c['n_prompts']} prompts: mean KL {c['kl_mean']:.3g}, top-1 {c['top1']:.4f}, "
                          f"{c['n_near_tie']} near-tie / {c['n_real']} real flips", fontsize=9)
    for ax in axes:
        ax.grid(True, which="major", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    save_figure(plt, fig, path)


def margin_rule(args):  # parsed CLI args -> the near-tie rule in force, as text
    if args.near_tie_margin is not None:
        return f"M = {args.near_tie_margin:g} (--near-tie-margin)"
    if args.noise_floor:
        return f"M = {NEAR_TIE_FACTOR} x max|ref64 - ref| (noise floor {args.noise_floor})"
    if args.typical_error:
        return f"M = {TYPICAL_FACTOR} x median over positions of max|ref - test| (--typical-error)"
    return f"M = {NEAR_TIE_FACTOR} x float32 spacing at max|ref| (no noise floor given)"


def prompt_margin(args, noise, key, ref):  # -> near-tie margin M for one prompt: a number, TYPICAL or None
    if args.near_tie_margin is not None:
        return args.near_tie_margin
    if args.typical_error:
        return TYPICAL
    if noise is None:
        return None
    if not isinstance(ref, np.ndarray):
        raise UsageError(f"{args.noise_floor}: a noise floor needs full reference logits, REF is a sparse golden")
    noise_file = noise.get(key) if os.path.isdir(args.noise_floor) else args.noise_floor
    if noise_file is None:
        raise UsageError(f"{args.noise_floor}: no float64 logits for prompt {key!r}")
    ref64 = load_logits(noise_file)
    try:
        return noise_margin(ref, ref64)
    except UsageError as e:
        raise UsageError(f"{noise_file}: {e}") from None


def side_record(path):  # REF or TEST -> its provenance: a file's sidecar, a directory's manifest header, or None
    if os.path.isdir(path):
        return logit_files(path)[1] or None
    return read_sidecar(path)


def provenance_lines(ref, test):  # -> both sides' provenance, and the settings that explain a difference, if any
    records = {"REF": side_record(ref), "TEST": side_record(test)}
    lines = [f"{side}: {describe(r) if r else 'no provenance recorded'}" for side, r in records.items()]
    if all(records.values()):
        differ = differences(records["REF"], records["TEST"])
        if differ:
            lines.append(f"the configurations differ in {', '.join(differ)}: that alone moves logits beyond float "
                         "noise, so compare like with like before calling a difference a bug")
    return lines


def run_diff(args):  # parsed CLI args -> exit status
    gate, rule = parse_gate(args.gate or ""), margin_rule(args)
    if args.json_out:
        check_output(args.json_out, "--json-out")
    if args.plot:
        check_plot(args.plot)
    inputs = [(name, path) for name, given in (("REF", args.ref), ("TEST", args.test), ("--noise-floor", args.noise_floor))
              if given for path in [given, *golden_files(given)]]
    artifacts.refuse_overwrite([("--json-out", args.json_out), ("--plot", args.plot)], inputs, UsageError)
    noise = logit_files(args.noise_floor)[0] if args.noise_floor else None
    pairs, notes = pair_files(args.ref, args.test, args.allow_subset)
    runs = []
    for key, ref_file, test_file in pairs:
        ref, test = load_golden(ref_file), load_golden(test_file)
        margin = prompt_margin(args, noise, key, ref)
        try:
            report = diff_pair(ref, test, margin, args.topk)
        except UsageError as e:
            raise UsageError(f"{test_file}: {e} ({ref_file})") from None
        runs.append((key, report, check_gate(report, gate)))
        notes += [note for note in [coverage_note(key, report)] if note]
    print("\n".join(provenance_lines(args.ref, args.test)))
    print(format_report(runs, gate, rule, notes=notes, n_prompts_shown=args.worst))
    failed = any(fails for _, _, fails in runs)
    if args.json_out:
        write_text(args.json_out, "--json-out", json.dumps({
            "nmse_definition": NMSE_DEFINITION, "provenance": {"ref": side_record(args.ref), "test": side_record(args.test)},
            "near_tie_rule": rule, "gate": gate, "notes": notes,
            "status": "fail" if failed else "pass", "overall": corpus_summary(runs),
            "prompts": [{"prompt_id": key, "failures": fails, **r} for key, r, fails in runs]}))
    if args.plot:
        plot_report(runs, args.plot)
    return 1 if failed else 0


def main(argv=None):  # -> exit status
    p = OneLineParser(prog="python -m tools.diff", description=__doc__)
    p.add_argument("ref", help="reference logits .npy, top-k golden .topk.npz, or a golden/corpus directory")
    p.add_argument("test", help="test logits or directory, paired with REF by prompt id")
    p.add_argument("--gate", help=f"limits, e.g. nmse=1e-4,top1=0.999 (keys: {', '.join(GATE_KEYS)})")
    margin = p.add_mutually_exclusive_group()
    # M is compared with a top1-top2 logit gap, which is never negative: any M >= 0 is a rule
    # (0: every flip is real; inf: every flip a near-tie)
    margin.add_argument("--near-tie-margin", type=float_in(0.0, math.inf),
                        help="near-tie threshold M in logits")
    margin.add_argument("--noise-floor", help="float64 logits of the run that made REF (file or directory)")
    margin.add_argument("--typical-error", action="store_true",
                        help="M from the test's typical error (a lower-precision test engine)")
    p.add_argument("--topk", type=int_in(1, MAX_TOPK), default=5,
                   help=f"k of the top-k agreement, at most {MAX_TOPK} (default 5; a top-k golden sets its own)")
    # --worst only cuts the list of prompts printed: any positive count is cheap
    p.add_argument("--worst", type=int_in(1, sys.maxsize), default=20,
                   help="prompts listed in the report, worst first (default 20)")
    p.add_argument("--allow-subset", action="store_true",
                   help="compare the prompts both sides hold when their prompt sets differ (refused otherwise)")
    add_json_out(p, "the full report", checked=False)
    p.add_argument("--plot", help="write a PNG of NMSE and KL per position (and mean KL per prompt)")
    args = p.parse_args(argv)
    with artifacts.interruptible("tools.diff"):
        try:
            return run_diff(args)
        except UsageError as e:
            return fail("tools.diff", e)


if __name__ == "__main__":
    sys.exit(main())
