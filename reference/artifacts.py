"""How every command reads and writes an artifact (goldens, manifests, bases, traces, positions,
plots, JSON reports), so that a stored one can be trusted for as long as it is kept:

- a file is written to a temporary name in its own directory, fsynced and renamed over its name:
  it appears whole or not at all, and an older file under that name stays as it was until then;
- a directory (a trace) is built beside its name and renamed into place;
- an output directory is new, empty or one the project wrote (its own index or manifest): any
  other is refused before anything is written, so no user's file is replaced or lost;
- an output that is the same file as an input (or a directory that holds one), two outputs that
  are one file (however spelled, before either exists) and an output inside another are refused
  before anything is opened for writing;
- only regular files are read (a FIFO would block, /dev/zero never ends), each under a size cap,
  a zip archive under a decompression cap, a size a header promises under the memory left, and
  JSON under a depth limit found by a streaming scan; every failure is the caller's typed error,
  one line naming the file;
- SIGINT, SIGTERM, SIGHUP (the terminal closed) and SIGPIPE (a reader of stdout gone, `| head`)
  remove what is unfinished, keep what was whole, print one line "interrupted; <file> left as it
  was" and exit 128 + the signal number (130, 143, 129, 141).
"""
import contextlib
import functools
import hashlib
import json
import os
import resource
import shutil
import signal
import stat
import sys
import threading
import zipfile

import numpy as np

GiB = 1 << 30
TEXT_CAP = GiB  # a prompt, perplexity text or JSON-lines prompt set: wikitext-103 (0.5 GB) fits
DUMP_CAP = 4 * GiB  # a llama-eval-callback dump prints 6 rows of 6 values per tensor: GBs are ~1e5 passes
JSON_CAP = 256 << 20  # a manifest, trace index, part file or debugger tree: 1e5 entries of 1 KB fit
# JSON nesting: a manifest nests 4 deep, a 30B debugger tree ~30 (module path depth x 2); Python's
# recursive parser fails near 900 (the stack), so anything past this is refused before it parses.
JSON_DEPTH = 128
SAFETENSORS_HEADER_CAP = 100_000_000  # the safetensors format's own limit on its JSON header
# A zip golden's members are .npy arrays of floats and token ids. np.savez stores them (ratio 1);
# deflate shrinks float32 logits by ~1.1x and int32 ids by ~3x. A member that inflates more than
# this is not such an array (a run of zeros: a bomb), so the whole archive is refused before reading.
INFLATE_RATIO = 32
INFLATE_FLOOR = 1 << 20  # small archives: headers and tiny arrays compress by more than the ratio


class ArtifactError(Exception):
    """An artifact that cannot be read or written as the contract says; the message is one line."""


class Interrupted(BaseException):
    """A signal of STOPS inside interruptible(): BaseException, so that no `except Exception` keeps it.
    args: (signal number, the output it left as it was)."""


STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE)


_unfinished = {}  # temporary path -> the final path it becomes once whole
_declared = []  # outputs a command named, in order; the interrupted line names the first not yet whole
_written = set()


# -------------------------------------------------------------------------------------------------
# Signals

def unfinished_target():  # -> the output being written now, or the first declared one not yet whole, or None
    return next(iter(_unfinished.values()), None) or next((p for p in _declared if p not in _written), None)


def interrupted_line(prog, target):  # -> the one line a command prints when SIGINT or SIGTERM stops it
    return f"{prog}: interrupted; {target} left as it was" if target else f"{prog}: interrupted; nothing was written"


def remove_unfinished():  # -> None: every temporary file or directory in the making is deleted
    for tmp in list(_unfinished):
        remove(tmp)
        _unfinished.pop(tmp, None)


def remove(path):  # a file or a directory tree -> gone, whichever it is; quiet when it is not there
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


@contextlib.contextmanager
def interruptible(prog):  # the body of a command's main: a signal of STOPS -> cleanup, one line, exit 128 + signal
    """The handler only raises Interrupted; cleanup runs as the stack unwinds (write_file's and
    staged_dir's `finally`) and again here, so that nothing half-made survives. A write to a
    closed stdout is a BrokenPipeError before the SIGPIPE handler runs: it is the same stop. Off the
    main thread (a Ray actor's worker thread) signals cannot be caught and nothing is installed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):  # the target is taken now: unwinding removes it from _unfinished
        if _holding:  # a signal Python saw just before signals_held() blocked it: raised when that ends
            _deferred.append(signum)
            return
        raise Interrupted(signum, unfinished_target())
    old = {s: signal.signal(s, handler) for s in STOPS}
    _declared.clear()
    _written.clear()
    try:
        yield
    except (Interrupted, BrokenPipeError) as e:
        signum, target = e.args if isinstance(e, Interrupted) else (signal.SIGPIPE, unfinished_target())
        for s in old:  # a second signal during cleanup must not interrupt the cleanup
            signal.signal(s, signal.SIG_IGN)
        remove_unfinished()
        if signum == signal.SIGPIPE:  # nobody reads stdout: what is buffered there goes nowhere, quietly
            with contextlib.suppress(OSError, ValueError):  # a stdout without a descriptor (captured) has no pipe
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        with contextlib.suppress(OSError):
            sys.stdout.flush()
        with contextlib.suppress(OSError):
            print(interrupted_line(prog, target), file=sys.stderr, flush=True)
        raise SystemExit(128 + signum) from None
    finally:
        for s, h in old.items():
            signal.signal(s, h)


_holding = False  # inside signals_held(): interruptible's handler defers a signal to its end
_deferred = []


@contextlib.contextmanager
def signals_held():  # a critical section that a signal cannot cut in two (a directory swap, a last manifest)
    """The signals are blocked; one already received (a write's EPIPE brings SIGPIPE with it) is
    kept by the handler and raised once the section is whole."""
    global _holding
    old, outer = signal.pthread_sigmask(signal.SIG_BLOCK, set(STOPS)), _holding
    _holding = True
    try:
        yield
    finally:
        _holding = outer
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    if _deferred and not outer:
        signum = _deferred[0]
        _deferred.clear()
        raise Interrupted(signum, unfinished_target())


# -------------------------------------------------------------------------------------------------
# Outputs

def path_key(path, realpath=os.path.realpath):  # -> the path a writer replaces: its folder resolved, its name kept
    """Every writer here replaces a name (os.replace, a rename of a directory), never follows a link
    at it, so two spellings are one output when their folders resolve to one (symlinks, "..", ".")
    and the names agree."""
    folder, name = os.path.split(os.path.abspath(os.fspath(path)))
    return os.path.join(realpath(folder), name) if name else realpath(folder)


def _identity(path):  # -> (device, inode) of an existing file or directory, None when there is none
    try:
        info = os.stat(path)
    except (OSError, ValueError):
        return None
    return info.st_dev, info.st_ino


def _ancestors(key):  # "/a/b/c" -> "/a/b", "/a", "/"
    while True:
        parent = os.path.dirname(key)
        if parent == key:
            return
        yield parent
        key = parent


def refuse_overwrite(outputs, inputs, error=ArtifactError):
    """outputs, inputs: [(option, path or None)]. Refuses, before anything is opened for writing:
    an output that is an input (samefile, so a hard link or another spelling counts, or the same
    resolved path), two outputs that are one file (samefile, or one resolved path before either
    exists: `x.npz` and `./x.npz`), an output inside another (a file named inside a --trace directory
    that replaces it whole) and an output directory that holds an input. Linear in the number of
    paths (a corpus names four per prompt). The outputs are then the ones the interrupted line can name."""
    outputs = [(o, os.fspath(p)) for o, p in outputs if p is not None]
    inputs = [(o, os.fspath(p)) for o, p in inputs if p is not None and os.path.exists(p)]
    realpath = functools.lru_cache(maxsize=None)(os.path.realpath)  # a golden run's outputs share one folder
    by_key, by_identity = {}, {}
    for option, out in outputs:
        key = path_key(out, realpath)
        seen = by_key.get(key) or by_identity.get(_identity(out))
        if seen:
            raise error(f"{option} {out} and {seen[0]} {seen[1]} are one file")
        by_key[key] = (option, out)
        if _identity(out):
            by_identity[_identity(out)] = (option, out)
    for key, (option, out) in by_key.items():
        outer = next((by_key[a] for a in _ancestors(key) if a in by_key), None)
        if outer:
            raise error(f"{option} {out} lies inside {outer[0]} {outer[1]}, which is written whole")
    for in_option, given in inputs:
        keys = (path_key(given, realpath), realpath(given))
        hit = by_identity.get(_identity(given)) or next((by_key[k] for k in keys if k in by_key), None)
        hit = hit or next((by_key[a] for k in keys for a in _ancestors(k) if a in by_key), None)
        if hit:
            raise error(f"{hit[0]} {hit[1]} would overwrite the input {in_option} {given}")
    _declared.extend(out for _, out in outputs)


def check_output_dir(path, option, ours, error=ArtifactError):  # -> None; refused unless new, empty or ours
    """An output directory is written into (goldens) or replaced whole (a trace): a directory of
    someone else's files would lose them. So it must be new, empty, or one this project wrote,
    which `ours` tells: {file name in it: predicate(path of that file) -> bool} (a trace's
    index.json, a golden's manifest.json, a corpus's tasks/). Refused before anything is written."""
    path = os.fspath(path)
    if not os.path.lexists(path):
        return
    if not os.path.isdir(path):
        raise error(f"{option} {path} exists and is not a directory")
    try:
        names = os.listdir(path)
    except OSError as e:
        raise error(f"{option} {path}: {e.strerror or e}") from None
    if not names or any(name in names and mine(os.path.join(path, name)) for name, mine in ours.items()):
        return
    more = f" and {len(names) - 1} more" if len(names) > 1 else ""
    raise error(f"{option} {path} holds files this project did not write ({sorted(names)[0]!r}{more}; no "
                f"{' or '.join(ours)} of its own): name a new or empty directory")


def json_marker(accepts, what="JSON file"):  # predicate(value) -> predicate(path): the file reads as JSON it accepts
    def mine(path):
        try:
            return bool(accepts(read_json(path, what=what)))
        except ArtifactError:
            return False
    return mine


def fsync_dir(folder):  # -> None: the rename itself made durable
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some filesystems (and /proc-like ones) refuse fsync on a directory: nothing to keep
        pass
    finally:
        os.close(fd)


def temporary_name(path):  # -> ".NAME.tmpPID" beside path: hidden, so no reader lists it as an artifact
    folder, name = os.path.split(os.fspath(path))
    return os.path.join(folder, f".{name}.tmp{os.getpid()}")


def write_failed(path, e, error):  # OSError while writing `path` -> the caller's one-line error
    reason = e.strerror or str(e)  # numpy's short write is "51200 requested and 10208 written"
    return error(f"{path}: cannot write it ({reason}); {path} left as it was")


@contextlib.contextmanager
def writing(path, error=ArtifactError):  # -> yields a binary file; on a clean exit it replaces `path`, whole
    """`path` gets what was written, whole, or stays as it was (a full disk, a signal, an error).
    The context's value after the block: none; write_file returns the digest."""
    path = os.fspath(path)
    tmp = temporary_name(path)
    _unfinished[tmp] = path
    try:
        try:
            with open(tmp, "wb") as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            fsync_dir(os.path.dirname(path) or ".")
        except OSError as e:
            raise write_failed(path, e, error) from None
        _written.add(path)
    finally:
        _unfinished.pop(tmp, None)
        remove(tmp)  # gone already once renamed


def write_file(path, write, error=ArtifactError):  # write(binary file) -> sha256 hex of what was written
    with writing(path, error) as f:
        write(f)
    return file_sha256(path)


def write_bytes(path, data, error=ArtifactError):  # -> sha256
    return write_file(path, lambda f: f.write(data), error)


def write_text(path, text, error=ArtifactError):  # -> sha256
    return write_bytes(path, text.encode("utf-8"), error)


def write_json(path, value, error=ArtifactError):  # -> sha256; indented, one trailing newline
    return write_text(path, json.dumps(value, indent=1) + "\n", error)


def save_npy(path, array, error=ArtifactError):  # -> sha256
    return write_file(path, lambda f: np.save(f, array, allow_pickle=False), error)


def save_npz(path, arrays, error=ArtifactError):  # {name: array} -> sha256
    return write_file(path, lambda f: np.savez(f, **arrays), error)


def save_figure(fig, path, error=ArtifactError, dpi=110):  # matplotlib figure -> the file, its format by extension
    extension = os.path.splitext(os.fspath(path))[1].lstrip(".").lower() or "png"
    return write_file(path, lambda f: fig.savefig(f, format=extension, dpi=dpi), error)


@contextlib.contextmanager
def staged_dir(path, error=ArtifactError):  # -> yields the directory to fill; it replaces `path` when whole
    """Built as .NAME.tmpPID beside `path`; on success an older `path` is moved aside, the new one
    renamed into place and the old one deleted, signals held between the two renames. On failure
    or a signal the half-built directory goes and an older `path` stays as it was."""
    path = os.fspath(path).rstrip(os.sep) or os.sep
    tmp = temporary_name(path)
    remove(tmp)
    _unfinished[tmp] = path
    try:
        try:
            os.makedirs(tmp)
        except OSError as e:
            raise write_failed(path, e, error) from None
        yield tmp
        old = f"{tmp}.old"
        try:
            with signals_held():
                if os.path.lexists(path):
                    os.rename(path, old)
                os.rename(tmp, path)
            fsync_dir(os.path.dirname(path) or ".")
        except OSError as e:
            raise write_failed(path, e, error) from None
        remove(old)
        _written.add(path)
    finally:
        _unfinished.pop(tmp, None)
        remove(tmp)


# -------------------------------------------------------------------------------------------------
# Inputs

def kind_of(mode):  # st_mode -> what a file that is not regular is, for the message
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path, error=ArtifactError, cap=None, what="file"):  # -> a binary file object, read only
    """Refuses what is not a regular file by name before it can block or never end, and a file
    larger than `cap` bytes. Opened O_NONBLOCK and checked again on the descriptor: a FIFO put in
    place between the two looks cannot block the open."""
    path = os.fspath(path)
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            raise error(f"{path}: {kind_of(mode)}, not a regular file ({what})")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise error(f"{path}: {e.strerror or e}") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or (cap is not None and info.st_size > cap):
        os.close(fd)
        if not stat.S_ISREG(info.st_mode):
            raise error(f"{path}: {kind_of(info.st_mode)}, not a regular file ({what})")
        raise error(f"{path}: {info.st_size} bytes, more than the {cap} a {what} may hold")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def read_bytes(path, error=ArtifactError, cap=TEXT_CAP, what="text file"):  # -> bytes, whole
    try:
        with open_regular(path, error, cap, what) as f:
            check_allocation(os.fstat(f.fileno()).st_size, f"{path}: a {what}", error)  # under the cap, yet sparse
            return f.read()
    except OSError as e:
        raise error(f"{path}: {e.strerror or e}") from None


def check_regular(path, error=ArtifactError, what="file"):  # -> None; the file exists, regular, readable
    open_regular(path, error, None, what).close()


def path_error(error_class, path):  # a (path, problem) exception class -> the one-message error open_regular takes
    """For the errors that keep the path and the problem apart (gguf.GGUFError, image.ImageError)."""
    prefix = f"{os.fspath(path)}: "
    return lambda message: error_class(path, message.removeprefix(prefix))


# bytes json_depth looks at a time: its memory (about 20 bytes a byte of a block, 5 MB) whatever the document's size
JSON_SCAN_BLOCK = 1 << 18


def json_blocks(data):  # bytes | str -> its UTF-8 bytes, JSON_SCAN_BLOCK at a time, without a copy of the whole
    if isinstance(data, str):  # UTF-8 never puts an ASCII byte inside a multi-byte character: blocks scan alone
        for start in range(0, len(data), JSON_SCAN_BLOCK):
            yield data[start:start + JSON_SCAN_BLOCK].encode("utf-8", "surrogatepass")
        return
    view = memoryview(data)
    for start in range(0, len(view), JSON_SCAN_BLOCK):
        yield view[start:start + JSON_SCAN_BLOCK]


def json_depth(data):  # bytes or str of JSON -> its deepest nesting of [ and {, without parsing it
    """One streaming pass, carrying between blocks only whether it is inside a string and how many
    backslashes end the block: no second copy of the document (checking a 173 MB manifest held
    2.98 GB when this was a regex over the whole). A quote counts when an even run of backslashes
    precedes it; brackets count outside strings."""
    depth = peak = 0
    inside, run = 0, 0  # inside a string at the block's start; backslashes ending the last block
    for block in json_blocks(data):
        a = np.frombuffer(block, np.uint8)
        at = np.arange(a.size, dtype=np.int32)
        last_plain = np.maximum.accumulate(np.where(a == ord("\\"), -1, at))  # last non-backslash at or before i
        before = np.concatenate((np.int32([-1]), last_plain[:-1]))
        run_before = at - 1 - before + np.where(before < 0, run, 0)  # backslashes right before byte i
        quotes = np.cumsum((a == ord('"')) & (run_before % 2 == 0), dtype=np.int32)
        outside = (quotes + inside) % 2 == 0  # after byte i: outside a string
        step = (outside & ((a == ord("[")) | (a == ord("{")))).astype(np.int8) - \
            (outside & ((a == ord("]")) | (a == ord("}")))).astype(np.int8)
        levels = np.cumsum(step, dtype=np.int64) + depth
        peak = max(peak, int(levels.max(initial=depth)))
        depth, inside = int(levels[-1]), int(quotes[-1] + inside) % 2
        run = a.size - 1 - int(last_plain[-1]) if last_plain[-1] >= 0 else run + a.size
    return peak


def parse_json(data, where, error=ArtifactError, depth=JSON_DEPTH, what=None):  # bytes | str -> value
    """json.loads recurses once per level and raises RecursionError near 900: deeper input is
    refused first, by its bracket depth. `what` names the file's kind in the message."""
    where = f"{where}: cannot read the {what}" if what else where
    if json_depth(data) > depth:
        raise error(f"{where}: JSON nested more than {depth} deep")
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise error(f"{where}: not JSON ({str(e).splitlines()[0][:120]})") from None


def read_json(path, error=ArtifactError, cap=JSON_CAP, what="JSON file"):  # -> the value of a JSON file
    return parse_json(read_bytes(path, error, cap, what), path, error, what=what)


def check_zip(path, error=ArtifactError, what="zip archive"):  # -> None; the archive may be read in full
    """Every member's inflated size, from the central directory (zipfile never inflates past it),
    against INFLATE_RATIO x its compressed size: decided before one byte is inflated."""
    try:
        with open_regular(path, error, None, what) as f, zipfile.ZipFile(f) as archive:
            members = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        raise error(f"{path}: not a {what} (a corrupt zip: {e})") from None
    for info in members:
        if info.file_size > max(INFLATE_RATIO * info.compress_size, INFLATE_FLOOR):
            raise error(f"{path}: member {info.filename} inflates {info.compress_size} bytes to {info.file_size}, "
                        f"more than {INFLATE_RATIO}x: not a {what}")


def memory_left():  # -> bytes this process can still allocate: free memory, and its address-space limit if set
    try:
        with open("/proc/meminfo", "rb") as f:
            free = next(int(line.split()[1]) << 10 for line in f if line.startswith(b"MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit != resource.RLIM_INFINITY:
        try:
            with open("/proc/self/statm", "rb") as f:
                held = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            held = 0
        free = min(free, limit - held)
    return free


def check_allocation(n_bytes, what, error=ArtifactError):  # -> None; refused when n_bytes cannot be had now
    """A size read from a header (a .npy's shape over a sparse file, which holds whatever it claims),
    checked before the allocation: one line, not a MemoryError traceback or the OOM killer."""
    left = memory_left()
    if n_bytes > left:
        raise error(f"{what}: {n_bytes} bytes, more than the {left} this process can still allocate")


# -------------------------------------------------------------------------------------------------
# Digests

_digests = {}  # (realpath, device, inode, size, mtime_ns, ctime_ns) -> sha256


def file_sha256(path):  # -> sha256 hex of a file's bytes
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def cached_sha256(path):  # -> sha256 of a file, hashed once per process while its stat stays the same
    """A model of 18 GB takes a minute to hash; a file replaced or rewritten under its name changes
    its inode, size or mtime/ctime, and is hashed again."""
    info = os.stat(path)
    key = (os.path.realpath(path), info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)
    if key not in _digests:
        _digests[key] = file_sha256(path)
    return _digests[key]


def content_digest(value):  # JSON-able value -> sha256 of its canonical JSON (keys sorted)
    return hashlib.sha256(json.dumps(value, sort_keys=True, ensure_ascii=True).encode()).hexdigest()
