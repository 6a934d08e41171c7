"""Read engines' tensor dumps for tools.bisect: the text dump of llama.cpp's `llama-eval-callback` or
`llama-debug --verbose` (and the configuration it shows), transformers' model_addition_debugger_context
output (last sections) and the raw float32 .bin of llama.cpp's examples/model-conversion.

Both print every graph node through common/debug.cpp (`common_debug_cb_eval`):

    common_debug_cb_eval:              attn_norm-0 = (f32)   RMS_NORM(embd_norm{256, 7, 1, 1}, }) = {256, 7, 1, 1}
        [
            [
                [     -0.1234,       0.5678,       0.9012,    ...,       1.2345, ...  ],
                ...,
                [ ... the last 3 rows ... ],
            ],
        ]
        sum = 12.345678

Older builds wrote `ggml_debug:` in front and no sum; a later llama-debug prints `sum    = ` and
`sum_sq = ` (its tensors through LOG_DBG, so with the log's "0.00.010.542 D " prefix before each
piece); all are read. eval-callback's `-lv N` (0c1e570: the log's verbosity threshold,
common/arg.cpp) changes no tensor line: those are LOG output, printed at every level with 3 values
a side; it drops the prefixed info lines below 3 (the prompt's token ids and system_info:
--reproduce then has no prompt) and adds debug lines at 5, which are skipped. `{256, 7, 1, 1}` is
ggml's ne, fastest dimension first: numpy shape [1, 1, 7, 256]. Only the first and last 3 entries of each
dimension are printed, with `%12.4f` (so a printed value is within 5e-5 of the float), and `sum` is
a float32 running sum over the whole tensor (printed once per ne3 block, same value each time).
Quantized tensors get a header and no values.

A prompt split into ubatches runs the graph once per ubatch, and llama-debug also runs a warm-up
decode first unless given --no-warmup: each run is a pass, and a pass starts when the dump's first
(name, op) comes back. Within a pass one name can label several nodes (`Qcur-0` is the matmul and
then its 3-D reshape): the last one is kept, as it is the tensor the graph callback named.
`join_passes` concatenates the passes along the token axis.
"""
import json
import math
import os
import re
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from reference import artifacts, factory
from reference.ggml_cpu import CLANG_BUILDS, DEFAULT_TARGET, TARGETS, VARIANT_TARGET, target_of_system_info

from tools.parity.hf_names import HF_DEBUGGER_MISSING, HF_DEBUGGER_POINTS, HF_TEXT_MODULES, debugger_module, trace_layout

# common_debug_print_tensor prints the first and last n of each dimension (n = 3 in 0c1e570 and in the
# later debug tools read): n is read from each dump as the count before its "...", whatever a build prints
HEADER = re.compile(r"^[A-Za-z_]\w*: +(?P<name>\S.*?) = \((?P<type>\w+)\) +(?P<op>[^\s(]+)\(.*\) = \{(?P<ne>[\d, ]+)\}\s*$")
MAX_ELEMENTS = 2 ** 48  # far beyond any real tensor; keeps a corrupt ne from overflowing index math
# llama-debug after 0c1e570 pads them: "sum    = 1.0", "sum_sq = 2.0"
SUM = re.compile(r"^sum +=\s*(?P<sum>\S+)$")
SUM_SQ = re.compile(r"^sum_sq +=\s*(?P<sum>\S+)$")  # printed beside sum by newer llama.cpp debug tools
# common_init turns on the log's prefix and timestamps: "0.00.010.542 I " before every log call of a level
# other than output. The tensors come through LOG (no prefix) in 0c1e570; a later llama-debug prints
# them through LOG_DBG, one call per value, so a prefix can stand before each piece of a row, right
# after a value's 4 decimals ("0.79750.00.010.601 D , "): it starts after those, or after "...", or
# where no number runs on
DEBUG_LINE = re.compile(r"\d+\.\d\d\.\d\d\d\.\d\d\d D ")  # a line LOG_DBG began (-lv 5)
LOG_PREFIX = re.compile(r"(?:(?<=\.\d{4})|(?<=\.\.\.)|(?<![\d.]))\d+\.\d\d\.\d\d\d\.\d\d\d [DIWE] ")
# the types common_debug_print_tensor prints values of (common/debug.cpp:57-67, 184); quantized ones get a header only
PRINTED_TYPES = ("f32", "f16", "i64", "i32", "i16", "i8")
# the last node a text graph names (src/models/muse-glimmer.cpp): the logits, or the normed output of an embedding run
GRAPH_ENDS = ("result_output", "result_norm")


class DumpError(Exception):
    pass


@dataclass
class PartialTensor:
    """The printed part of one tensor: values at some flat (C-order) indices of shape ne[::-1]."""
    ne: tuple  # ggml order, 4 ints
    index: np.ndarray  # [k] int64
    values: np.ndarray  # [k] float64
    sum: float | None  # float32 running sum over all elements, as printed; None if not printed
    op: str
    type: str = "f32"  # the ggml type printed in the header: the cache views show the cache's
    sum_sq: float | None = None  # the sum of squares, where the dump prints it

    @property
    def size(self):  # -> number of elements of the whole tensor
        return int(np.prod(self.ne))


def read_row(text, ne, i1, i2, i3, where):  # "[ v, v, ..., v ]," -> (flat indices, values)
    index, values, i0 = [], [], 0
    for token in (t.strip() for t in text.strip().lstrip("[").rstrip(",").rstrip("]").split(",")):
        if token.startswith("..."):  # as many values follow as came before it
            i0 = max(ne[0] - i0, i0)
        elif token:
            if i0 >= ne[0] or i1 >= ne[1] or i2 >= ne[2] or i3 >= ne[3]:
                raise DumpError(f"{where}: more values than ne {list(ne)} allows")
            try:
                values.append(float(token))
            except ValueError:
                raise DumpError(f"{where}: {token!r} is not a number") from None
            index.append(((i3 * ne[2] + i2) * ne[1] + i1) * ne[0] + i0)
            i0 += 1
    return index, values


def read_values(ne, body, where):  # ggml ne, [(line number, text)] -> (index [k], values [k], (sum, sum_sq), whole)
    """Walks the nesting of common_debug_print_tensor: `[` per i3, `[` per i2, one line per i1 row;
    a `...,` line skips to the last 3 rows (inside an i2 block) or the last 3 i2 blocks. whole: all
    ne[3] outer blocks were opened and closed (a dump cut inside the tensor is not)."""
    index, values, total, squares = [], [], None, None
    depth = i1 = i2 = i3 = 0
    for lineno, line in body:
        s = line.strip()
        if s == "[":
            depth += 1
            if depth == 1:
                i2 = 0
            elif depth == 2:
                i1 = 0
        elif s.startswith("["):
            row_index, row_values = read_row(s, ne, i1, i2, i3, f"{where}:{lineno}")
            index += row_index
            values += row_values
            i1 += 1
        elif s in ("]", "],"):
            if depth == 1:
                i3 += 1
            elif depth == 2:
                i2 += 1
            depth -= 1
        elif s.startswith("..."):  # as many blocks or rows follow as came before it
            if depth == 1:
                i2 = ne[2] - i2
            elif depth == 2:
                i1 = ne[1] - i1
        elif SUM.match(s) and total is None:
            total = printed_number(SUM.match(s)["sum"], "sum", f"{where}:{lineno}")
        elif SUM_SQ.match(s) and squares is None:
            squares = printed_number(SUM_SQ.match(s)["sum"], "sum_sq", f"{where}:{lineno}")
    return np.array(index, np.int64), np.array(values, np.float64), (total, squares), depth == 0 and i3 == ne[3]


def printed_number(text, what, where):  # -> float; DumpError for text that is none
    try:
        return float(text)
    except ValueError:
        raise DumpError(f"{where}: {what} {text!r} is not a number") from None


def parse_dump(text, source="dump"):  # text -> [pass: {name: PartialTensor}] in graph order; a cut dump refused
    passes, cut = read_passes(text, source)
    if cut:
        raise DumpError(f"{source}: truncated: tensor {cut} is cut (the dump ends inside it)")
    return passes


def read_passes(text, source="dump"):  # text -> ([pass: {name: PartialTensor}], the tensor the dump ends inside or None)
    """A tensor whose values stop before the next tensor's header is a dump cut in the middle: refused.
    One the dump ends inside is its lost tail (llama.cpp's logger thread can be stopped at exit before it
    has written everything): it is left out, and the caller compares up to the last whole point."""
    blocks = []  # (name, op, type, ne, [(line number, body line)])
    for lineno, line in enumerate(text.splitlines(), 1):
        line = LOG_PREFIX.sub("", line)
        m = HEADER.match(line.strip())
        if m:
            ne = tuple(int(v) for v in m["ne"].split(",") if v.strip())
            if len(ne) != 4 or math.prod(ne) > MAX_ELEMENTS:
                raise DumpError(f"{source}:{lineno}: ne {{{m['ne']}}} is not 4 plausible dimensions")
            blocks.append((m["name"].strip(), m["op"], m["type"], ne, []))
        elif blocks:
            blocks[-1][4].append((lineno, line))
    if not blocks:
        raise DumpError(f"{source}: no tensor lines found (expected llama-eval-callback or "
                        "llama-debug --verbose output)")
    passes, first, last_whole = [], blocks[0][:2], None
    for n, (name, op, dtype, ne, body) in enumerate(blocks):
        index, values, (total, squares), whole = read_values(ne, body, source)
        if dtype in PRINTED_TYPES and not whole:
            if n < len(blocks) - 1 or last_whole is None:
                where = "the dump ends inside it" if n == len(blocks) - 1 else "its values stop before the next tensor"
                raise DumpError(f"{source}: truncated: tensor {name} is cut ({where}); the last whole point is "
                                f"{last_whole or 'none'}")
            return passes, name
        if (name, op) == first:
            passes.append({})
        passes[-1][name] = PartialTensor(ne, index, values, total, op, dtype, squares)
        last_whole = name
    return passes, None


def check_graph_end(passes, source, tail_lost=False):  # -> the last whole point where the last pass stops early, or None
    """A dump cut between two tensors parses as a shorter graph, whose missing points would be
    reported as points only in the other side, a divergence that is not there. Every pass but the last
    must end where a text graph ends (or, for a graph of other nodes, where the first pass ended); the
    last may stop early (its tail lost, `tail_lost`: it ended inside a tensor), and then the points
    after its last whole one are missing, never compared."""
    ends = [list(points)[-1] for points in passes]
    expected = ends[0] if ends[0] not in GRAPH_ENDS and len(passes) > 1 else None
    last = None
    for i, end in enumerate(ends):
        early = (end not in GRAPH_ENDS) if expected is None else end != expected
        if early and i < len(ends) - 1:
            raise DumpError(f"{source}: truncated: pass {i + 1} of {len(passes)} stops at {end}, before the graph's "
                            f"end ({expected or ' or '.join(GRAPH_ENDS)}); the last whole point is {end}")
        if early or (tail_lost and i == len(ends) - 1):
            last = end
    if not any(p.values.size for points in passes for p in points.values()):
        raise DumpError(f"{source}: holds no tensor values (only quantized tensors): nothing to compare")
    return last


def token_axis(nes):  # [ne of each pass] -> the ggml axis that counts tokens
    """The outermost axis longer than 1 in any pass: tokens are the slowest axis of every activation
    (ne = {E, T} or {D, H, T}). A pass of one token with per-head shape {D, H, 1} is ambiguous;
    the comparison in tools.bisect re-derives rows from the other side's row length."""
    return max([a for a in (1, 2, 3) if any(ne[a] > 1 for ne in nes)], default=1)


def pass_tokens(points):  # {name: PartialTensor} of one pass -> its number of tokens
    ne = next(iter(points.values())).ne
    return int(np.prod(ne[token_axis([ne]):]))


def concat(parts, axis):  # [PartialTensor], ggml axis -> PartialTensor
    ne = list(parts[0].ne)
    ne[axis] = sum(p.ne[axis] for p in parts)
    shape = tuple(reversed(ne))
    index, offset = [], 0
    for p in parts:
        multi = list(np.unravel_index(p.index, tuple(reversed(p.ne))))
        multi[3 - axis] = multi[3 - axis] + offset
        index.append(np.ravel_multi_index(tuple(multi), shape))
        offset += p.ne[axis]
    sums, squares = [p.sum for p in parts], [p.sum_sq for p in parts]
    total = None if None in sums else float(sum(sums))
    values = np.concatenate([p.values for p in parts])
    return PartialTensor(tuple(ne), np.concatenate(index), values, total, parts[-1].op, parts[-1].type,
                         None if None in squares else float(sum(squares)))


def join_passes(passes):  # [pass] -> ({name: PartialTensor}, [names left out])
    """A name missing from a pass (a dump cut short) or whose non-token axes change between passes
    (permuted views put tokens in the middle) is left out rather than joined misaligned."""
    joined, skipped = {}, []
    for name in dict.fromkeys(name for points in passes for name in points):
        parts = [points.get(name) for points in passes]
        if None in parts:
            skipped.append(name)
            continue
        axis = token_axis([p.ne for p in parts])
        if all(p.ne[:axis] + p.ne[axis + 1:] == parts[0].ne[:axis] + parts[0].ne[axis + 1:] for p in parts):
            joined[name] = concat(parts, axis)
        else:
            skipped.append(name)
    return joined, skipped


def load_dump(path, n_tokens=None):  # dump file -> Dump(points, notes, config)
    """Reads and joins a dump. With n_tokens (the other trace's prompt length), a first pass is
    dropped as llama-debug's warm-up when the passes after it add up to exactly n_tokens."""
    text = artifacts.read_bytes(path, DumpError, artifacts.DUMP_CAP, "dump").decode("utf-8", "replace")
    passes, cut = read_passes(text, path)
    last_whole = check_graph_end(passes, path, tail_lost=cut is not None)
    notes = []
    tokens = [pass_tokens(p) for p in passes]
    if n_tokens is not None and len(passes) > 1 and sum(tokens) != n_tokens and sum(tokens[1:]) == n_tokens:
        notes.append(f"{path}: dropped the first pass ({tokens[0]} tokens) as a warm-up run")
        passes = passes[1:]
    points, skipped = join_passes(passes)
    if last_whole:  # names the cut last pass lacks are lost with its tail, not left out
        skipped = [name for name in skipped if name in passes[-1] or not all(name in p for p in passes[:-1])]
    if skipped:
        notes.append(f"{path}: {len(skipped)} tensors left out (missing from a pass, or shaped differently "
                     f"between passes): {', '.join(skipped[:4])}{' ...' if len(skipped) > 4 else ''}")
    config = read_config(passes, text)
    config.last_whole = last_whole
    return Dump(points, notes, config)


class Dump(NamedTuple):
    points: dict  # {name: PartialTensor}
    notes: list  # [str]
    config: "LlamaConfig"


@dataclass
class LlamaConfig:
    """The part of llama.cpp's context setup a dump shows. It decides how llama.cpp rounds: an F16 or
    Q8_0 cache rounds K and V before attention reads them, flash attention sums in another order
    (and rounds Q to F16 for an F16 cache), and each ubatch attends over what the cache holds."""
    cache_k: str | None  # ggml type of the cache_k_l* nodes; None where the dump shows no cache
    cache_v: str | None
    flash_attn: bool | None  # FLASH_ATTN_EXT nodes: True; SOFT_MAX nodes (kq_soft_max-L): False; neither shown: None
    ubatches: list  # tokens of each pass, in order
    prompt: list | None  # the token ids llama-eval-callback logs before its dump
    system_info: str | None = None  # llama.cpp's system_info line (the CPU features built in); None: not logged
    last_whole: str | None = None  # the dump's tail was lost after this point (None: the dump is whole)
    variant: str | None = None  # the CPU variant a GGML_BACKEND_DL build loaded (its load_backend line); None: not logged

    @property
    def cpu(self):  # -> the --cpu the dump shows: the variant it loaded, else the target its system_info shows, or None
        if self.variant:
            return self.variant
        return target_of_system_info(self.system_info) if self.system_info else None

    @property
    def exact(self):  # -> True when llama.cpp rounds only as float32 math does (the exact reference)
        return self.cache_k == self.cache_v == "f32" and self.flash_attn is False

    def describe(self):  # -> "CPU avx512, K cache f16, V cache f16, flash attention on, 1 ubatch of 5 tokens"
        cache = f"K cache {self.cache_k or '?'}, V cache {self.cache_v or '?'}"
        passes = len(self.ubatches)
        return (f"CPU {self.cpu or '?'}, {cache}, flash attention {ON_OFF.get(self.flash_attn, '?')}, "
                f"{passes} ubatch{'es' if passes > 1 else ''} of {'+'.join(map(str, self.ubatches))} tokens")

    def cpu_note(self, cpu=None):  # --cpu given or None -> a line on the CPU target the reference takes, or None
        default = f"the reference rounds as {DEFAULT_TARGET}, the default"
        clang = CLANG_BUILDS.get(self.cpu)  # an ARM build: its system_info does not show the compiler
        if cpu:
            shown = self.cpu is None or same_build(self.cpu, cpu) or (clang is not None and clang.name == cpu)
            return None if shown else f"--cpu {cpu}: the dump's {self.cpu_source} shows the {self.cpu} build"
        if self.variant:
            return None
        if self.system_info is None:
            return f"the dump logs no system_info line (its CPU build): {default}"
        if self.cpu is None:
            return f"the dump's system_info shows none of the CPU builds {', '.join(TARGETS)}: {default}"
        if clang is not None:
            return f"system_info does not show the compiler: a clang build (as on macOS) is --cpu {clang.name}"
        return None

    @property
    def cpu_source(self):  # -> which line of the dump names its CPU build
        return "load_backend line" if self.variant else "system_info"

    def reference_options(self, cpu=None):  # --cpu or None -> reference.run options rounding as this configuration
        """DumpError where reference.run cannot round so. The CPU target is `cpu`, else the one the
        system_info line shows, else the default (cpu_note says which)."""
        if None in (self.cache_k, self.cache_v, self.flash_attn):
            raise DumpError("the dump does not show its cache types and whether flash attention ran (printed with "
                            "a --tensor-filter that leaves out cache_k_l*, cache_v_l* and the attention nodes?)")
        if not {self.cache_k, self.cache_v} <= set(CACHE_TYPES):
            raise DumpError(f"reference.run --numerics ggml-cpu models the cache types {', '.join(CACHE_TYPES)}; "
                            f"the dump's are K {self.cache_k}, V {self.cache_v}")
        if max(self.ubatches) > MAX_UBATCH:
            raise DumpError(f"reference.run --numerics ggml-cpu takes ubatches of at most {MAX_UBATCH} tokens; "
                            f"the dump's hold {max(self.ubatches)}")
        target = emulated_target(cpu or self.cpu or DEFAULT_TARGET)
        # one pass: the whole prompt was one ubatch, as reference.run's default chunk makes it
        chunk = ["-ub", str(self.ubatches[0])] if len(self.ubatches) > 1 else []
        return ["--numerics", "ggml-cpu", "-ctk", self.cache_k, "-ctv", self.cache_v,
                "-fa", ON_OFF[self.flash_attn], "--cpu", target, *chunk]


def same_build(a, b):  # two --cpu names -> whether they round alike (a llama.cpp variant and the target it is)
    return VARIANT_TARGET.get(a, a) == VARIANT_TARGET.get(b, b)


def emulated_target(name):  # CPU target name -> name, or DumpError where reference.run --cpu refuses it
    try:
        factory.check(factory.Build(numerics="ggml-cpu", cpu=name))
    except factory.FactoryError as e:
        raise DumpError(str(e)) from None
    return name


ON_OFF = {True: "on", False: "off"}
CACHE_TYPES = ("f32", "f16", "q8_0")  # the cache types reference.run -ctk and -ctv round as llama.cpp does
MAX_UBATCH = 512  # reference.run's ggml-cpu ubatch cap (llama.cpp's default -ub)
PROMPT_COUNT = re.compile(r"number of input tokens = (?P<n>\d+)\s*$")
PROMPT_ID = re.compile(r"\s(?P<id>\d+)\s*$")
DEBUG_PROMPT_COUNT = re.compile(r"^Token ids \((?P<n>\d+)\):\s*$")
DEBUG_PROMPT_ID = re.compile(r"\((\d+)\) ")  # "<|begin_of_text|>(497) the(319) "
SYSTEM_INFO = re.compile(r"\bsystem_info: (?P<info>.*?)\s*$", re.M)  # common_params_get_system_info, logged at start
# ggml_backend_load_best's choice in a GGML_BACKEND_DL build (ggml/src/ggml-backend-reg.cpp:259)
LOADED_VARIANT = re.compile(r"\bloaded CPU backend from \S*?ggml-cpu-(?P<variant>[\w.]+?)\.(?:so|dll|dylib)\b")


def cache_type(passes, prefix):  # [pass], "cache_k_l" -> ggml type of those nodes, or None
    return next((t.type for points in passes for name, t in points.items() if name.startswith(prefix)), None)


def logged_prompt(text):  # dump text -> the prompt's token ids as the tool logged them, or None
    """llama-eval-callback: `number of input tokens = N`, then one id per line, before the tensors;
    llama-debug: `Token ids (N):`, then one line of `piece(id) ` for each, after them. Debug lines
    (-lv 5) between them are skipped."""
    lines = [line for line in text.splitlines() if not DEBUG_LINE.match(line)]
    for i, line in enumerate(lines):
        count = PROMPT_COUNT.search(line)
        if count:
            ids = [PROMPT_ID.search(x) for x in lines[i + 1:i + 1 + int(count["n"])]]
            return [int(m["id"]) for m in ids] if len(ids) == int(count["n"]) and all(ids) else None
        count = DEBUG_PROMPT_COUNT.match(line)
        if count and i + 1 < len(lines):
            ids = [int(m) for m in DEBUG_PROMPT_ID.findall(lines[i + 1] + " ")]
            return ids if len(ids) == int(count["n"]) else None
    return None


def read_config(passes, text):  # [pass], dump text -> LlamaConfig
    ops = {t.op for points in passes for t in points.values()}
    flash = True if "FLASH_ATTN_EXT" in ops else False if "SOFT_MAX" in ops else None
    system_info, loaded = SYSTEM_INFO.search(text), LOADED_VARIANT.search(text)
    return LlamaConfig(cache_type(passes, "cache_k_l"), cache_type(passes, "cache_v_l"), flash,
                       [pass_tokens(p) for p in passes], logged_prompt(text), system_info and system_info["info"],
                       variant=loaded and loaded["variant"])


# --- transformers' model_addition_debugger_context(..., do_prune_layers=False, use_repr=False) -------

DEBUG_TREE = "_debug_tree_FULL_TENSORS.json"  # the debugger's tree: one node per module call, in call order
SAFETENSORS_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
                      "I64": np.int64, "I32": np.int32}
TORCH_SIZE = re.compile(r"^torch\.Size\(\[(?P<dims>[\d, ]*)\]\)$")


def read_tensor_entry(f, name, info, data_start, file_size, where):  # one safetensors header entry -> array
    """The header gives dtype, shape and [begin, end) offsets into the data: all three must agree with
    each other and with the file before a byte is allocated (a lying header is refused)."""
    try:
        dtype, shape, (begin, end) = SAFETENSORS_DTYPES[info["dtype"]], info["shape"], info["data_offsets"]
        n = math.prod(int(d) for d in shape) if all(isinstance(d, int) and d >= 0 for d in shape) else -1
    except (KeyError, TypeError, ValueError):
        raise DumpError(f"{where}: tensor {name!r} has no dtype of {'/'.join(SAFETENSORS_DTYPES)}, shape and "
                        "data_offsets") from None
    if n < 0 or not (isinstance(begin, int) and isinstance(end, int)) or not 0 <= begin <= end \
            or data_start + end > file_size or end - begin != n * np.dtype(dtype).itemsize:
        raise DumpError(f"{where}: tensor {name!r} claims shape {shape} of {info['dtype']} at bytes [{begin}, {end}) "
                        f"of {file_size - data_start}: sizes do not agree")
    artifacts.check_allocation(end - begin, f"{where}: tensor {name!r} of shape {shape}", DumpError)  # a sparse file
    f.seek(data_start + begin)
    a = np.frombuffer(f.read(end - begin), dtype).reshape(shape)
    # bfloat16 is the top half of a float32
    return (a.astype(np.uint32) << 16).view(np.float32) if info["dtype"] == "BF16" else a


def read_safetensors(path):  # .safetensors file -> {name: array}
    try:
        with artifacts.open_regular(path, DumpError, what="safetensors file") as f:
            size = os.fstat(f.fileno()).st_size
            n = int.from_bytes(f.read(8), "little")
            if size < 8 or n > size - 8 or n > artifacts.SAFETENSORS_HEADER_CAP:
                raise DumpError(f"{path}: header length {n} beyond the file's {size} bytes or the format's "
                                f"{artifacts.SAFETENSORS_HEADER_CAP}: not a safetensors file")
            header = artifacts.parse_json(f.read(n), f"{path}: the safetensors header", DumpError)
            if not isinstance(header, dict):
                raise DumpError(f"{path}: the safetensors header is not a JSON object")
            return {name: read_tensor_entry(f, name, info, 8 + n, size, path)
                    for name, info in header.items() if name != "__metadata__"}
    except OSError as e:
        raise DumpError(f"{path}: {e.strerror or e}") from None


def debug_tree_path(path):  # debugger directory or its *_FULL_TENSORS.json -> the JSON file, or None
    if os.path.isdir(path):
        trees = sorted(f for f in os.listdir(path) if f.endswith(DEBUG_TREE))
        return os.path.join(path, trees[0]) if len(trees) == 1 else None
    return path if path.endswith(DEBUG_TREE) else None


def module_calls(node, where, calls=None):  # debugger tree -> {module path: [node per call]} in call order
    """Every node names its module and lists its children as nodes: a tree that does not is an input
    error naming the field (a node left out would read as a point not recorded: a divergence)."""
    calls = {} if calls is None else calls
    path = node.get("module_path")
    if not isinstance(path, str):
        raise DumpError(f"{where}: a node's module_path is {json.dumps(path)[:40]}, not a module name")
    calls.setdefault(path, []).append(node)
    children = node.get("children", [])
    if not isinstance(children, list) or not all(isinstance(child, dict) for child in children):
        raise DumpError(f"{where}: {path}: children is not a list of module nodes")
    for child in children:
        module_calls(child, where, calls)
    return calls


def recorded(node, what, where):  # node, "outputs" | "inputs" -> the debugger's record of that tensor, or None
    """None where the module recorded no such tensor (a tuple output, no positional input); a record
    whose value is not a file name is an input error naming the module and field."""
    entry = node.get(what)
    if what == "inputs":  # the first positional argument, else the first keyword (self_attn's hidden_states)
        args = entry.get("args") if isinstance(entry, dict) else None
        entry = args[0] if isinstance(args, list) and args else None
    if not isinstance(entry, dict) or "value" not in entry:
        return None
    if isinstance(entry["value"], list):
        raise DumpError(f"{where}: the tree holds printed tensors (use_repr=True, the default): rerun "
                        "model_addition_debugger_context with use_repr=False for whole tensors")
    if not isinstance(entry["value"], str):
        raise DumpError(f"{where}: {node['module_path']}: {what} value {json.dumps(entry['value'])[:40]} "
                        "is not a file name")
    return entry


def recorded_array(directory, entry, where):  # debugger record {shape, value: "./FILE"} -> array
    name = os.path.normpath(entry["value"])
    if os.path.isabs(name) or name.startswith(".."):
        raise DumpError(f"{where}: value {entry['value']!r} is not a file beside the tree")
    tensors = read_safetensors(os.path.join(directory, name))
    if "data" not in tensors:
        raise DumpError(f"{where}: {name} holds no tensor 'data'")
    a = tensors["data"]
    claimed = TORCH_SIZE.match(str(entry.get("shape")))
    if claimed and [int(d) for d in claimed["dims"].split(",") if d.strip()] != list(a.shape):
        raise DumpError(f"{where}: {name} holds shape {list(a.shape)}, the tree records {entry['shape']}")
    if a.ndim < 2 or a.shape[0] != 1 or a.dtype.kind != "f":
        raise DumpError(f"{where}: {name} is {a.dtype} {list(a.shape)}: a float batch of one sequence was expected")
    return a[0]


def read_tree(path):  # debugger tree JSON -> its root node
    tree = artifacts.read_json(path, DumpError, what="debugger tree")
    if not isinstance(tree, dict) or not isinstance(tree.get("module_path"), str):
        raise DumpError(f"{path}: not a model_addition_debugger_context tree (no root module_path)")
    return tree


def debugger_layers(calls, root):  # -> sorted layer numbers the tree holds calls of
    prefix = f"{root}.{HF_DEBUGGER_POINTS['result_norm'][0].rsplit('.', 1)[0]}.layers."
    return sorted({int(p[len(prefix):]) for p in calls if p and p.startswith(prefix) and p[len(prefix):].isdigit()})


def debugger_names(layers):  # [layer] -> trace names the debugger can hold, in forward order
    n_layer = max(layers) + 1
    per_layer = [op for op in HF_TEXT_MODULES if op.endswith("-{il}") and op in HF_DEBUGGER_POINTS]
    return (["embd_norm"] + [op.format(il=il) for il in range(n_layer) for op in per_layer]
            + ["result_norm", "result_output"])


def debugger_entry(calls, root, name, n_layer, tree_file):  # -> the debugger's record of trace point name, or None
    if name == "result_output":  # the top-level logits: written, but pruned from the tree
        value = f"./{root}_{HF_DEBUGGER_POINTS[name][1]}.safetensors"
        return {"value": value} if os.path.exists(os.path.join(os.path.dirname(tree_file), value)) else None
    module, what = debugger_module(name, n_layer)
    nodes = calls.get(f"{root}.{module}")
    return recorded(nodes[-1], what, tree_file) if nodes else None  # the last call: its files overwrote the others'


def debugger_records(path):  # debugger dir or tree JSON -> (tree file, head_dim, {name: record}, [names missing])
    tree_file = debug_tree_path(path)
    tree = read_tree(tree_file)
    calls, root = module_calls(tree, tree_file), tree["module_path"]
    layers = debugger_layers(calls, root)
    if layers and layers != list(range(len(layers))):
        # a pruned tree would leave l_out of the kept layers without their next layer's input
        raise DumpError(f"{tree_file}: holds layers {', '.join(map(str, layers))} only: pruned "
                        "(do_prune_layers=True, the default); rerun with do_prune_layers=False")
    qk_norm = calls.get(f"{root}.{HF_DEBUGGER_POINTS['Kcur_normed-{il}'][0].format(il=layers[0])}") if layers else None
    size = TORCH_SIZE.match(str((recorded(qk_norm[-1], "outputs", tree_file) or {}).get("shape"))) if qk_norm else None
    if not size:
        raise DumpError(f"{tree_file}: no text-model layer with a recorded self_attn.qk_norm output: not a "
                        "Muse-Glimmer debugger tree")
    records = {name: debugger_entry(calls, root, name, max(layers) + 1, tree_file) for name in debugger_names(layers)}
    missing = [name for name, entry in records.items() if entry is None]
    for name in missing:  # an op of every layer (do_prune_layers=False) recorded on some layers only: a cut tree
        op, _, il = name.rpartition("-")
        if op and any(records.get(f"{op}-{other}") for other in layers):
            raise DumpError(f"{tree_file}: no record of {name} ({'.'.join(debugger_module(name, max(layers) + 1))}), "
                            f"which the tree records on other layers: a cut or edited tree")
    return tree_file, int(size["dims"].split(",")[-1]), {n: e for n, e in records.items() if e}, missing


def load_hf_debugger(path):  # debugger dir or tree JSON -> Dump(points in our layout, notes, no config)
    try:
        return debugger_dump(path)
    except (TypeError, ValueError, AttributeError, KeyError, IndexError) as e:  # a field of the wrong kind
        raise DumpError(f"{path}: malformed debugger tree ({type(e).__name__}: {str(e)[:100]})") from None


def debugger_dump(path):  # -> load_hf_debugger's Dump, or the error of a malformed field
    tree_file, head_dim, records, missing = debugger_records(path)
    points = {}
    for name, entry in records.items():
        op = name.rpartition("-")[0] or name
        a = recorded_array(os.path.dirname(tree_file), entry, tree_file)
        points[name] = trace_layout(op, a, head_dim, heads_first=op == "Kcur_normed")
    notes = [f"{tree_file}: transformers' debugger holds no {', '.join(HF_DEBUGGER_MISSING)} (module outputs "
             "and inputs only)"]
    if missing:
        notes.append(f"{tree_file}: {len(missing)} points not recorded: "
                     f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
    return Dump(points, notes, None)


# --- llama.cpp examples/model-conversion: llama-debug --save-logits [--embedding] --------------------

UNIT_ROW = 1e-5  # |L2 norm - 1| of every row below it: normalized embeddings, not result_norm


def read_companion_tokens(path):  # X.bin -> the int32 ids of X-tokens.bin beside it, or None
    tokens = path[:-len(".bin")] + "-tokens.bin"
    if not os.path.exists(tokens):
        return None
    data = artifacts.read_bytes(tokens, DumpError, artifacts.DUMP_CAP, "token file")
    if len(data) % 4:
        raise DumpError(f"{tokens}: {len(data)} bytes are not int32 token ids")
    return np.frombuffer(data, np.int32).tolist()


def check_not_normalized(rows, path):  # [rows, n] embeddings -> None, or DumpError when all have unit length
    # common_embd_normalize in float32: a unit row is within ~1e-7 sqrt(n) of 1, a norm's output is not
    if np.all(np.abs(np.linalg.norm(rows, axis=1) - 1) < UNIT_ROW):
        raise DumpError(f"{path}: every row has unit L2 norm: llama-debug normalized the embeddings (its default "
                        "--embd-normalize 2); write them with --embd-normalize -1")


def logits_bin_point(path):  # -> the trace point a model-conversion .bin holds
    return "result_norm" if path.endswith("-embeddings.bin") else "result_output"


def load_logits_bin(path, other):  # .bin, the other side's {name: tensor} -> Dump({point: [rows, n]}, notes, None)
    """save_output_data (examples/debug/debug.cpp, and scripts/utils/common.py for transformers) writes
    raw float32 with no header: the last token's logits (result_output, one row of n_vocab), or with
    --embedding the embeddings of every token (result_norm, rows of n_embd, no pooling). The row
    length comes from the other side's point; the companion X-tokens.bin gives the prompt."""
    artifacts.check_regular(path, DumpError, "model-conversion .bin")
    name, size = logits_bin_point(path), os.path.getsize(path)
    mine = other.get(name) if other else None
    if mine is None:
        raise DumpError(f"{path}: holds {name} only; the other side records no {name} to line it up with")
    row = mine.shape[-1] if isinstance(mine, np.ndarray) else mine.ne[0]
    if size == 0 or size % (4 * row):
        raise DumpError(f"{path}: {size} bytes are not float32 rows of {row} (the other side's {name}): "
                        "another model or not a model-conversion .bin")
    rows, tokens = size // (4 * row), read_companion_tokens(path)
    if name == "result_output" and rows != 1 or tokens is not None and name == "result_norm" and rows != len(tokens):
        raise DumpError(f"{path}: {rows} rows of {row}; llama-debug writes the last token's logits "
                        f"(1 row) or with --embedding one row per token ({len(tokens or [])} tokens)")
    artifacts.check_allocation(size, f"{path}: {rows} rows of {row}", DumpError)  # a sparse file holds any size
    values = np.fromfile(path, np.float32).reshape(rows, row)
    if name == "result_norm":
        check_not_normalized(values, path)
    n_other = mine.shape[0] if isinstance(mine, np.ndarray) and mine.ndim > 1 else None
    if tokens is not None and n_other is not None and len(tokens) != n_other:
        raise DumpError(f"{path}: made from {len(tokens)} tokens, the other side from {n_other}: another prompt")
    notes = [f"{path}: {name} of {'the last token' if name == 'result_output' else f'{rows} tokens'} only"
             + (f", prompt {','.join(map(str, tokens))}" if tokens else "")]
    return Dump({name: values}, notes, None)
