"""Compare a test engine's logits with reference logits, position by position, and gate on the result.

    python -m tools.diff REF TEST [--gate nmse=1e-4,top1=0.999] [--near-tie-margin X | --noise-floor F64]
                         [--json OUT.json] [--plot OUT.png] [--topk 5]

REF and TEST are float `.npy` logits `[n_pos, n_vocab]` (a 1-D `[n_vocab]` counts as one position),
or two directories of them. A directory with a `manifest.json` is read through it: a JSON list of
entries (or an object holding that list under "goldens", "entries" or "files"), each with "file" and
"prompt_id" (or "id"), as tools/golden.py writes it. Without a manifest the `.npy` files pair by
name. Every reference prompt needs a test counterpart.

Per position: NMSE, max|diff|, cosine, KL(ref||test), top-1 and top-k agreement, the reference's top-1
margin (logit gap top1 - top2) and delta-p (probability of the reference's top-1 under test minus
under ref). NMSE is sum((ref-test)^2) / sum(ref^2) accumulated in float64 (llama.cpp test-backend-ops).

Near-tie rule. A position whose top-1 differs is a near-tie when the reference's own top1-top2
margin is below M, else a real divergence. M is, in order of preference:
  --near-tie-margin X            M = X;
  --noise-floor F64              M = 8 * max|ref64 - ref| over the prompt, where ref64 are the float64
                                 logits of the run that made REF (`reference.run --dtype float64`);
  neither                        M = 8 * float32 spacing at max|ref|: only the rounding of the logits
                                 themselves, so almost every flip counts as real.
Why 8: max|ref64 - ref| = d bounds how far the float32 reference is from the exact logits. A test
engine of the same float32 quality is also within about d, so one logit may differ by 2d between the
two runs and a top1-top2 gap (two logits) by 4d; a factor 2 more allows engines whose summation
order is less careful than the reference's (which carries long sums in float64).

Gate: `--gate key=limit,...`, checked for every prompt. Upper limits: nmse (whole prompt), nmse_pos
(worst position), max_abs, kl (mean over positions), kl_max, delta_p (largest |delta-p|). Lower
limits: cosine (worst position), top1 and topk (mean agreement). top1 counts near-tie flips as
disagreements, so it bounds how many near-ties are tolerated; a real divergence fails regardless.

Exit status: 0 pass, 1 gate failed (every real divergence fails; near-ties alone do not),
2 bad input (one line on stderr naming the file and the problem).
"""
import argparse
import json
import os
import sys

import numpy as np

from . import metrics

NEAR_TIE_FACTOR = 8
NPY_MAGIC = b"\x93NUMPY"
MANIFEST = "manifest.json"
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


class BadInput(Exception):
    """A file or argument that cannot be compared; the message names it and says why."""


def check_logits(a, what):  # [n_pos, n_vocab] -> None, raises BadInput
    if a.dtype.kind != "f":
        raise BadInput(f"{what}: dtype {a.dtype} is not a float array of logits")
    if a.ndim != 2 or a.size == 0:
        raise BadInput(f"{what}: shape {list(a.shape)} is not [n_pos, n_vocab]")
    n_nan, n_inf = int(np.isnan(a).sum()), int(np.isinf(a).sum())
    if n_nan or n_inf:
        raise BadInput(f"{what}: contains {n_nan} NaN and {n_inf} Inf values")


def load_logits(path):  # .npy file -> [n_pos, n_vocab]
    try:
        with open(path, "rb") as f:
            if f.read(len(NPY_MAGIC)) != NPY_MAGIC:
                raise BadInput(f"{path}: not a .npy file")
        a = np.load(path, allow_pickle=False)
    except OSError as e:
        raise BadInput(f"{path}: {e.strerror or e}") from None
    except ValueError as e:
        # numpy refuses object arrays here, which is how a pickle inside a .npy shows up
        problem = "holds pickled objects (refused)" if "allow_pickle" in str(e) else f"corrupt .npy ({e})"
        raise BadInput(f"{path}: {problem}") from None
    if a.ndim == 1:
        a = a[None, :]
    check_logits(a, path)
    return a


def manifest_files(directory):  # dir with manifest.json -> {prompt_id: path}
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise BadInput(f"{path}: cannot read manifest ({e})") from None
    if isinstance(manifest, dict):
        manifest = next((manifest[k] for k in ("goldens", "entries", "files") if k in manifest), None)
    if not isinstance(manifest, list):
        raise BadInput(f"{path}: expected a list of entries")
    root = os.path.realpath(directory)
    files = {}
    for entry in manifest:
        if not isinstance(entry, dict) or not isinstance(entry.get("file"), str):
            raise BadInput(f"{path}: entry without a \"file\": {entry!r:.80}")
        key = str(entry.get("prompt_id", entry.get("id", os.path.splitext(entry["file"])[0])))
        file = os.path.realpath(os.path.join(directory, entry["file"]))
        if os.path.commonpath([root, file]) != root:
            raise BadInput(f"{path}: entry {key!r} points outside the directory: {entry['file']!r}")
        if key in files:
            raise BadInput(f"{path}: prompt id {key!r} appears twice")
        files[key] = file
    return files


def logit_files(path):  # file or dir -> {prompt_id: path}
    if not os.path.exists(path):
        raise BadInput(f"{path}: no such file or directory")
    if not os.path.isdir(path):
        return {os.path.splitext(os.path.basename(path))[0]: path}
    if os.path.exists(os.path.join(path, MANIFEST)):
        return manifest_files(path)
    return {name[:-4]: os.path.join(path, name) for name in sorted(os.listdir(path)) if name.endswith(".npy")}


def pair_files(ref_path, test_path):  # -> [(prompt_id, ref file, test file)]
    if os.path.isdir(ref_path) != os.path.isdir(test_path):
        raise BadInput(f"{test_path}: cannot compare a file with a directory ({ref_path})")
    ref, test = logit_files(ref_path), logit_files(test_path)
    if not os.path.isdir(ref_path):
        return [(next(iter(ref)), ref_path, test_path)]
    if not ref:
        raise BadInput(f"{ref_path}: no logits found")
    missing = [k for k in ref if k not in test]
    if missing:
        raise BadInput(f"{test_path}: no logits for prompt(s) {', '.join(missing)} of {ref_path}")
    return [(k, ref[k], test[k]) for k in ref]


def noise_margin(ref, ref64):  # [n_pos, n_vocab] x2 -> near-tie margin
    if ref64.shape != ref.shape:
        raise BadInput(f"noise floor shape {list(ref64.shape)} does not match reference {list(ref.shape)}")
    return NEAR_TIE_FACTOR * float(metrics.max_abs_diff(ref64.reshape(-1), ref.reshape(-1)))


def rounding_margin(ref):  # [n_pos, n_vocab] -> near-tie margin when no noise floor is known
    return NEAR_TIE_FACTOR * float(np.spacing(np.float32(np.max(np.abs(ref)))))


def diff_logits(ref, test, near_tie_margin=None, topk=5):  # [n_pos, n_vocab] x2 -> report dict
    """Per-position metrics, aggregates and top-1 flips classified by the near-tie rule (module doc)."""
    check_logits(ref, "reference")
    check_logits(test, "test")
    if ref.shape != test.shape:
        raise BadInput(f"shape {list(test.shape)} does not match reference {list(ref.shape)}")
    if near_tie_margin is None:
        near_tie_margin = rounding_margin(ref)
    pos = {
        "nmse": metrics.nmse(ref, test), "max_abs": metrics.max_abs_diff(ref, test),
        "cosine": metrics.cosine(ref, test), "kl": metrics.kl(ref, test),
        "top1_agree": metrics.top1_agreement(ref, test), "topk_agree": metrics.topk_agreement(ref, test, topk),
        "ref_margin": metrics.top1_margin(ref), "delta_p": metrics.delta_p(ref, test),
        "ref_top1": np.argmax(ref, axis=-1), "test_top1": np.argmax(test, axis=-1),
    }
    flips = [{"pos": int(i), "ref_token": int(pos["ref_top1"][i]), "test_token": int(pos["test_top1"][i]),
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
        "n_pos": int(ref.shape[0]), "n_vocab": int(ref.shape[1]), "topk": topk,
        "near_tie_margin": float(near_tie_margin), "summary": summary, "flips": flips,
        "first_flip": flips[0]["pos"] if flips else None, "first_real": real[0] if real else None,
        "per_position": {k: v.tolist() for k, v in pos.items()},
    }


def parse_gate(text):  # "nmse=1e-4,top1=0.999" -> {"nmse": 1e-4, "top1": 0.999}
    gate = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key.strip() not in GATE_KEYS:
            raise BadInput(f"--gate: bad item {item!r} (keys: {', '.join(GATE_KEYS)})")
        try:
            gate[key.strip()] = float(value)
        except ValueError:
            raise BadInput(f"--gate: {key.strip()} needs a number, got {value!r}") from None
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


def format_report(runs, gate, margin_rule, n_worst=8):  # [(id, report, failures)] -> text
    topk = runs[0][1]["topk"]
    lines = [NMSE_DEFINITION + "; KL(ref||test) in nats on the full softmax",
             f"near-tie: a top-1 flip where the reference's top1-top2 margin < M; {margin_rule}", "",
             f"{'prompt':<16} {'n_pos':>5} {'nmse':>9} {'max|d|':>9} {'min cos':>9} {'mean KL':>9} "
             f"{'max KL':>9} {'top1':>6} {f'top{topk}':>6} {'M':>9} {'ties':>5} {'real':>5} {'1st flip':>8}"]
    for key, r, _ in runs:
        s = r["summary"]
        lines.append(f"{key:<16.16} {r['n_pos']:>5} {s['nmse']:>9.2e} {s['max_abs']:>9.2e} {s['cosine_min']:>9.6f} "
                     f"{s['kl_mean']:>9.2e} {s['kl_max']:>9.2e} {s['top1']:>6.3f} {s['topk']:>6.3f} "
                     f"{r['near_tie_margin']:>9.2e} {s['n_near_tie']:>5} {s['n_real']:>5} "
                     f"{'-' if r['first_flip'] is None else r['first_flip']:>8}")
    worst = sorted(((r["per_position"]["kl"][i], key, i, r) for key, r, _ in runs for i in range(r["n_pos"])),
                   key=lambda t: -t[0])[:n_worst]
    lines += ["", "worst positions by KL:", f"{'prompt':<16} {'pos':>5} {'nmse':>9} {'KL':>9} {'margin':>9} "
              f"{'ref top1':>9} {'test top1':>9} {'delta_p':>9}"]
    for kl, key, i, r in worst:
        p = r["per_position"]
        lines.append(f"{key:<16.16} {i:>5} {p['nmse'][i]:>9.2e} {kl:>9.2e} {p['ref_margin'][i]:>9.3g} "
                     f"{p['ref_top1'][i]:>9} {p['test_top1'][i]:>9} {p['delta_p'][i]:>+9.2e}")
    flips = [(key, f) for key, r, _ in runs for f in r["flips"]]
    if flips:
        lines += ["", "top-1 flips:"] + [f"  {key} pos {f['pos']}: {f['ref_token']} -> {f['test_token']}, "
                                         f"ref margin {f['ref_margin']:.3g}: {f['kind']}" for key, f in flips]
    failures = [f"  {key}: {line}" for key, _, fails in runs for line in fails]
    gate_text = ", ".join(f"{k}{'<=' if GATE_KEYS[k][1] == 'max' else '>='}{v:g}" for k, v in gate.items())
    lines += ["", f"gate ({gate_text or 'no metric limits'}; real divergences always fail): "
              + ("FAIL" if failures else "PASS")] + failures
    return "\n".join(lines)


def plot_report(runs, path):  # [(id, report, failures)] -> PNG with NMSE and KL per position
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BadInput(f"{path}: --plot needs matplotlib (pip install matplotlib)") from None
    fig, axes = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    start = 0
    for key, r, _ in runs:
        x = start + np.arange(r["n_pos"])
        for ax, metric in zip(axes, ("nmse", "kl")):
            # log axes cannot show an exact 0; draw it at the bottom of the float64 range instead
            y = np.maximum(r["per_position"][metric], 1e-30)
            ax.semilogy(x, y, ".-", lw=0.8, ms=3, label=key if metric == "nmse" else None)
            for kind, style in (("near-tie", {"marker": "^", "color": "orange"}),
                                ("real", {"marker": "X", "color": "red"})):
                at = [f["pos"] for f in r["flips"] if f["kind"] == kind]
                ax.scatter(start + np.array(at, int), y[at], s=60, zorder=3, **style,
                           label=f"{kind} flip" if (metric == "kl" and key == runs[0][0]) else None)
        if start:
            for ax in axes:
                ax.axvline(start - 0.5, color="grey", ls=":", lw=0.8)
        start += r["n_pos"]
    axes[0].set_ylabel("NMSE")
    axes[1].set_ylabel("KL(ref||test)")
    axes[1].set_xlabel("position (prompts side by side)")
    axes[0].set_title(NMSE_DEFINITION, fontsize=9)
    for ax in axes:
        ax.grid(True, which="major", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def margin_rule(args):  # parsed CLI args -> the near-tie rule in force, as text
    if args.near_tie_margin is not None:
        return f"M = {args.near_tie_margin:g} (--near-tie-margin)"
    if args.noise_floor:
        return f"M = {NEAR_TIE_FACTOR} x max|ref64 - ref| (noise floor {args.noise_floor})"
    return f"M = {NEAR_TIE_FACTOR} x float32 spacing at max|ref| (no noise floor given)"


def prompt_margin(args, noise, key, ref):  # -> near-tie margin M for one prompt; None: the rounding default
    if args.near_tie_margin is not None or noise is None:
        return args.near_tie_margin
    noise_file = noise.get(key) if os.path.isdir(args.noise_floor) else args.noise_floor
    if noise_file is None:
        raise BadInput(f"{args.noise_floor}: no float64 logits for prompt {key!r}")
    ref64 = load_logits(noise_file)
    try:
        return noise_margin(ref, ref64)
    except BadInput as e:
        raise BadInput(f"{noise_file}: {e}") from None


def run_diff(args):  # parsed CLI args -> exit status
    gate, rule = parse_gate(args.gate or ""), margin_rule(args)
    noise = logit_files(args.noise_floor) if args.noise_floor else None
    runs = []
    for key, ref_file, test_file in pair_files(args.ref, args.test):
        ref, test = load_logits(ref_file), load_logits(test_file)
        margin = prompt_margin(args, noise, key, ref)
        try:
            report = diff_logits(ref, test, margin, args.topk)
        except BadInput as e:
            raise BadInput(f"{test_file}: {e} ({ref_file})") from None
        runs.append((key, report, check_gate(report, gate)))
    print(format_report(runs, gate, rule))
    failed = any(fails for _, _, fails in runs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"nmse_definition": NMSE_DEFINITION, "near_tie_rule": rule, "gate": gate,
                       "status": "fail" if failed else "pass",
                       "prompts": [{"prompt_id": key, "failures": fails, **r} for key, r, fails in runs]}, f)
    if args.plot:
        plot_report(runs, args.plot)
    return 1 if failed else 0


def main(argv=None):  # -> exit status
    p = argparse.ArgumentParser(prog="python -m tools.diff", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ref", help="reference logits .npy or directory of goldens")
    p.add_argument("test", help="test logits .npy or directory, paired with REF by prompt id")
    p.add_argument("--gate", help=f"limits, e.g. nmse=1e-4,top1=0.999 (keys: {', '.join(GATE_KEYS)})")
    margin = p.add_mutually_exclusive_group()
    margin.add_argument("--near-tie-margin", type=float, help="near-tie threshold M in logits")
    margin.add_argument("--noise-floor", help="float64 logits of the run that made REF (file or directory)")
    p.add_argument("--topk", type=int, default=5, help="k of the top-k agreement (default 5)")
    p.add_argument("--json", help="write the full report as JSON")
    p.add_argument("--plot", help="write a PNG of NMSE and KL per position")
    args = p.parse_args(argv)
    if args.topk < 1:
        p.error("--topk must be at least 1")
    try:
        return run_diff(args)
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
