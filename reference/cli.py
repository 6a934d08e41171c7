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


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints usage + message; the contract is one line, exit 2
        print(f"{self.prog.removeprefix('python -m ')}: {message}", file=sys.stderr)
        sys.exit(2)


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
