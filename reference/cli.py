"""What every command line of the project shares: bad input is one line on stderr and exit status 2
(never a traceback, a usage block, a hang or a giant allocation), and numbers are range-checked as
they are parsed, before anything is allocated from them."""
import argparse
import math
import os
import re
import sys

from . import artifacts


class UsageError(Exception):
    """Bad command-line input found after parsing; main() prints it as one line and exits 2."""


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help as written (paragraphs kept), each option's default after its sentence."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.option_strings and action.default not in (None, False, argparse.SUPPRESS) and "default" not in text:
            text += " (default: %(default)s)"
        return text


class OneLineParser(argparse.ArgumentParser):
    """Options are matched whole (no abbreviations: --n would be a guess); --help shows defaults."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):  # kept: error() names an option as it was typed
        self.typed = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message):  # argparse prints usage + message; the contract is one line, exit 2
        message = as_typed(message, getattr(self, "typed", []))
        print(f"{self.prog.removeprefix('python -m ')}: {message}", file=sys.stderr)
        sys.exit(2)


def as_typed(message, argv):  # "argument -ub/--ubatch-size/...: m" -> "argument --ubatch-size: m", as typed
    head, colon, rest = message.partition(": ")
    names = head.removeprefix("argument ").split("/")
    typed = [n for n in names if any(a == n or a.startswith(n + "=") for a in argv)]
    if not head.startswith("argument ") or not colon or len(names) < 2 or not typed:
        return message
    return f"argument {typed[0]}: {rest}"


# The one grammar of a number on a command line, in an id list or a position spec: ASCII digits, a
# '-' only where negatives mean something, nothing else. Python's int() and float() also take
# Unicode digits ('٣'), '_' separators, '+', surrounding spaces, 'inf' and 'nan'.
INTEGER = re.compile(r"-?[0-9]+", re.ASCII)
DECIMAL = re.compile(r"-?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?", re.ASCII)  # 0.5, 1e-4, 3., .25
MAX_DIGITS = 30  # more than any count or position needs; int() of a million digits takes seconds


def strict_int(text, negative=False):  # -> int; ValueError unless `text` is ASCII digits (and a '-' if `negative`)
    if not isinstance(text, str) or len(text) > MAX_DIGITS or not INTEGER.fullmatch(text) or \
            (text.startswith("-") and not negative):
        raise ValueError(f"expected an integer, got {text[:40]!r} (ASCII digits{', a leading -' if negative else ''})")
    return int(text)


def strict_float(text):  # -> float; ValueError unless `text` is a decimal number in ASCII (no inf, nan, '_', '+')
    if not isinstance(text, str) or len(text) > MAX_DIGITS or not DECIMAL.fullmatch(text):
        raise ValueError(f"expected a number, got {text[:40]!r} (ASCII digits, '.', an exponent)")
    return float(text)


def int_in(low, high):  # -> an argparse type: an int with low <= n <= high
    def parse(text):
        try:
            n = strict_int(text, negative=True)  # "-1" where low is 0: out of range, said so
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        if not low <= n <= high:
            raise argparse.ArgumentTypeError(f"{n} is out of range [{low}, {high}]")
        return n
    return parse


def float_in(low, high):  # -> an argparse type: a float with low <= x <= high ("inf" where high is)
    def parse(text):
        try:
            x = math.inf if text == "inf" and high == math.inf else strict_float(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        if not low <= x <= high:  # also refuses nan
            raise argparse.ArgumentTypeError(f"{text} is out of range [{low}, {high}]")
        return x
    return parse


def names_in(known, what, once=False):  # -> an argparse type: "a,b" -> ["a", "b"], each one of `known`
    """An unknown name would silently select nothing; with `once`, a name given twice is refused too."""
    def parse(text):
        names = text.split(",")
        for name in names:
            if name not in known:
                raise argparse.ArgumentTypeError(f"unknown {what} {name!r} in {text!r} (known: {', '.join(known)})")
        if once and len(set(names)) < len(names):
            raise argparse.ArgumentTypeError(f"an {what} named twice in {text!r}")
        return names
    return parse


def check_output(path, option, suffix=None):  # -> None; UsageError unless `path` names a file that can be made
    """Checked before the work, so a typo in an output path costs nothing."""
    if os.path.isdir(path):
        raise UsageError(f"{option} {path} is a directory" + (f"; it takes a {suffix} file name" if suffix else ""))
    if suffix and not path.endswith(suffix):
        raise UsageError(f"{option} must name a {suffix} file, got {path!r}")
    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder):
        raise UsageError(f"{option} {path}: no such directory {folder}")
    if not os.access(folder, os.W_OK):
        raise UsageError(f"{option} {path}: the directory {folder} is not writable")


def check_output_dir(path, option, ours):  # -> None; UsageError unless `path` is new, empty or the project's
    """An output directory is written into or replaced whole (reference.artifacts.staged_dir): a file
    at its name, or a directory of files the project did not write (`ours`, see
    artifacts.check_output_dir), would be lost."""
    artifacts.check_output_dir(path, option, ours, UsageError)


def output_file(text):  # argparse type: a path check_output accepts, refused as it is parsed
    try:
        check_output(text, "file")
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


BEYOND_TRAIN = "--beyond-n-ctx-train"
BEYOND_TRAIN_HELP = ("run past the model's training context (refused otherwise: positions it never saw make a "
                     "golden of nothing); recorded in the output")


def check_train_context(n, n_train, what, model, beyond, error=UsageError):  # -> whether n is past n_train
    """Every tool refuses a prompt, context or generation longer than the model's training context
    the same way, unless --beyond-n-ctx-train asks for it; the caller records that it did."""
    if n_train and n > n_train:
        if not beyond:
            raise error(f"{what} {n} exceeds the training context of {os.path.basename(str(model))} "
                        f"({n_train} tokens; {BEYOND_TRAIN} runs it anyway)")
        return True
    return False


def parse_token_ids(text, n_vocab=None):  # "1,2,3" -> [1, 2, 3], each in [0, n_vocab) when it is known
    items = text.split(",")
    if not any(item.strip() for item in items):
        raise UsageError("--token-ids is empty")
    if not all(items):  # "1,,2" or "1,2,": a token left out?
        raise UsageError(f"--token-ids has an empty item: {text[:80]!r}")
    try:
        ids = [strict_int(t, negative=True) for t in items]  # a negative id is refused by its range below
    except ValueError as e:
        raise UsageError(f"--token-ids must be comma-separated integers ({e})") from None
    return check_token_ids(ids, n_vocab)


def check_token_ids(ids, n_vocab=None):  # -> ids; UsageError for one outside [0, n_vocab) (n_vocab None: < 0)
    bad = [i for i in ids if i < 0 or (n_vocab is not None and i >= n_vocab)]
    if bad:
        raise UsageError(f"token id {bad[0]} is out of range" + (f" for a vocabulary of {n_vocab}" if n_vocab else ""))
    return ids


def os_error(e):  # OSError -> "path: reason", one line
    return f"{e.filename}: {e.strerror or e}" if e.filename else str(e.strerror or e)


def fail(prog, message):  # one line on stderr -> exit status 2
    print(f"{prog}: {message}", file=sys.stderr)
    return 2


def exit_status(prog, work, errors=()):  # -> work()'s exit status; UsageError, OSError and `errors` one line, 2
    """What every main() ends in: the typed errors of bad input become the one line of the contract,
    and SIGINT, SIGTERM, SIGHUP and SIGPIPE the one line of reference.artifacts (exit 130, 143, 129, 141)."""
    with artifacts.interruptible(prog):
        try:
            return work()
        except (UsageError, artifacts.ArtifactError, *errors) as e:
            return fail(prog, e)
        except BrokenPipeError:  # stdout's reader is gone (| head): a stop, as SIGPIPE (interruptible)
            raise
        except OSError as e:
            return fail(prog, os_error(e))


def write_json(path, report):  # report dict -> the file at `path`, indented, whole or not at all
    artifacts.write_json(path, report, UsageError)


# -------------------------------------------------------------------------------------------------
# The flags the tools share, under llama.cpp's names (common/arg.cpp of llama.cpp 0c1e570) first and
# the project's older spellings after them, which keep working. A concept is one argparse dest with
# the same option strings in every tool (tests/test_flags.py reads every parser).

FLAG_NAMES = {  # concept (the dest) -> its option strings
    "model": ("-m", "--model"),
    "prompt": ("-p", "--prompt"),
    "file": ("-f", "--file", "--prompt-file"),
    "system_prompt": ("-sys", "--system-prompt", "--system"),
    "verbose_prompt": ("--verbose-prompt",),
    "n_predict": ("-n", "--n-predict", "--predict", "--n-decode"),
    "ctx_size": ("-c", "--ctx-size", "--ctx", "--n-ctx"),
    "threads": ("-t", "--threads"),
    "n_depth": ("-d", "--n-depth"),  # llama-bench's: the context before a test
    "repetitions": ("-r", "--repetitions"),  # llama-bench's
    "batch_size": ("-b", "--batch-size"),
    "ubatch_size": ("-ub", "--ubatch-size", "--prefill-chunk", "--n-ubatch"),
    "cache_type_k": ("-ctk", "--cache-type-k"),
    "cache_type_v": ("-ctv", "--cache-type-v"),
    "kv_type": ("--kv-type",),
    "flash_attn": ("-fa", "--flash-attn"),
    "repack": ("--repack",),
    "no_repack": ("-nr", "--no-repack"),
    "model_draft": ("-md", "--model-draft", "--spec-draft-model", "--draft-model"),
    "spec_draft_n_max": ("--spec-draft-n-max",),
    "spec_draft_p_min": ("--spec-draft-p-min", "--draft-p-min", "--spec-p-min"),
    "temp": ("--temp", "--temperature"),
    "top_k": ("--top-k",),
    "seed": ("-s", "--seed"),
    "numerics": ("--numerics",),
    "backend": ("--backend",),
    "dtype": ("--dtype",),
    "cpu": ("--cpu",),
    "json": ("--json",),
    "json_out": ("--json-out",),
}
FLASH_ATTN = ("on", "off", "auto")
MAX_THREADS = 1 << 10
DEFAULT_SEED = 0xFFFFFFFF  # llama.cpp's LLAMA_DEFAULT_SEED: a random seed; greedy decoding reads none


def flag(p, concept, **options):  # parser, FLAG_NAMES key, add_argument's options -> the action
    return p.add_argument(*FLAG_NAMES[concept], dest=concept, **options)


def add_json_out(p, what, checked=True):  # --json-out PATH (and --json PATH, its older spelling, out of --help)
    """--json prints JSON on stdout where it is a switch (reference.run); a tool that writes a JSON
    file takes its path as --json-out. The tools that took that path as --json keep taking it.
    checked=False: the tool checks the path itself (check_output) before its work."""
    kind = output_file if checked else None
    flag(p, "json_out", type=kind, metavar="F.json", help=f"write {what} as JSON to this file")
    p.add_argument("--json", dest="json_out", type=kind, help=argparse.SUPPRESS)


def add_sampling_flags(p):  # --temp, --top-k, --seed: llama.cpp's sampler flags a greedy tool accepts
    flag(p, "temp", type=float_in(0.0, 1e6), default=0.0,
         help="sampling temperature: only 0 (greedy, what every golden is) is accepted, or any value with --top-k 1")
    flag(p, "top_k", type=int_in(0, 1 << 31), default=None,
         help="top-k sampling: only 1 (greedy) is accepted; 0 or more than 1 samples unless --temp is 0")
    flag(p, "seed", type=int_in(0, (1 << 32) - 1), default=DEFAULT_SEED,
         help="recorded in the output; greedy decoding draws no random number")


def check_greedy(args):  # -> None; UsageError where --temp and --top-k ask for sampling
    if args.temp != 0 and args.top_k != 1:
        raise UsageError(f"--temp {args.temp:g} samples; the reference decodes greedily only "
                         "(--temp 0, or --top-k 1)")


def add_numerics_flags(p, backends, flash_default):  # the flags of factory.Build
    """flash_default: the tool's -fa when it is not given, in words for --help."""
    from .ggml_cpu.target import CPU_CHOICES
    flag(p, "dtype", choices=("float32", "float64"), default="float32",
         help="the exact numerics' float type (float64: a noise floor for tools.diff and tools.bisect)")
    flag(p, "backend", choices=backends, default="numpy",
         help="numba: the accel/ kernels, multiplying straight from the quantized blocks (the same logits)"
              + ("; cupy: CUDA kernels, the text forward resident on the GPU" if "cupy" in backends else ""))
    flag(p, "numerics", choices=("exact", "ggml-cpu"), default="exact",
         help="exact: float64 sums of the dequantized weights; ggml-cpu: round as llama.cpp's CPU backend does, "
              "bit for bit (a uniform KV cache, ubatches of at most 512 rows)")
    add_cache_flags(p, flash_default)
    flag(p, "repack", choices=("on", "off"),
         help="with --numerics ggml-cpu: llama.cpp's CPU repack of the target's weight types (default on)")
    flag(p, "no_repack", action="store_true", help="--repack off, as llama.cpp's -nr")
    flag(p, "cpu", choices=CPU_CHOICES, metavar="CPU",
         help="with --numerics ggml-cpu: the CPU build of llama.cpp to round as (default avx512; neon and "
              "neon-i8mm: ARM builds by GCC, the -clang ones the same by clang, as macOS builds are; the ARM ones "
              "on numpy only), or a variant of its portable x86 build by llama.cpp's name (haswell, alderlake: "
              "avx2; zen4, cooperlake: avx512; the others refused with the reason), or auto: the variant "
              "llama.cpp would load on this CPU. One of: " + ", ".join(CPU_CHOICES))


def add_cache_flags(p, flash_default):  # -ctk, -ctv, --kv-type (both), -fa: llama.cpp's KV cache and attention
    from .ggml_cpu.build import KV_TYPES
    flag(p, "cache_type_k", choices=KV_TYPES, metavar="TYPE",
         help=f"llama.cpp's K cache type, one of {', '.join(KV_TYPES)} (default f16)")
    flag(p, "cache_type_v", choices=KV_TYPES, metavar="TYPE",
         help="llama.cpp's V cache type (default f16; a q8_0 V needs flash attention, as in llama.cpp)")
    flag(p, "kv_type", choices=KV_TYPES, metavar="TYPE", help="both -ctk and -ctv")
    flag(p, "flash_attn", choices=FLASH_ATTN,
         help=f"llama.cpp's flash attention; auto is on, as llama.cpp decides on the CPU "
              f"(default: {flash_default}; a q8_0 cache needs it)")


def cache_types(args, default="f16"):  # -> (K type, V type): -ctk, -ctv, else --kv-type, else `default`
    return (args.cache_type_k or args.kv_type or default, args.cache_type_v or args.kv_type or default)


def given_cache_types(args):  # -> (K type, V type where it differs from K's), each None where not given
    if not (args.cache_type_k or args.cache_type_v or args.kv_type):
        return None, None
    k, v = cache_types(args)
    return k, (v if v != k else None)


def flash_choice(args, default=None):  # -> True | False | None (the factory's own default) from -fa
    value = args.flash_attn or default
    # auto: llama_context::resolve_fused_ops keeps flash attention where its op runs on the layer's device,
    # which on a CPU-only build is always: auto is on
    return None if value is None else value != "off"


def repack_choice(args):  # -> True | False | None (not given) from --repack and -nr
    if args.no_repack and args.repack == "on":
        raise UsageError("--repack on with --no-repack")
    return False if args.no_repack else {None: None, "on": True, "off": False}[args.repack]


def build_of(args, flash_default=None):  # parsed add_numerics_flags (and -t) -> factory.Build
    from .factory import Build
    threads = getattr(args, "threads", None)
    k_type, v_type = given_cache_types(args)
    return Build(args.backend, args.numerics, args.dtype, getattr(args, "tp", 1), k_type,
                 flash_choice(args, flash_default), repack_choice(args), n_threads=threads or Build.n_threads,
                 cpu=args.cpu, v_type=v_type)
