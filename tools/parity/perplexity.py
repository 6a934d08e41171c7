"""Perplexity and KL divergence of the reference, computed as llama.cpp's llama-perplexity computes them
(tools/perplexity/perplexity.cpp), with its command line, its .kld base-logits files and its output.

    python -m tools.perplexity -m M.gguf -f TEXT -c N [-b N] [--chunks K]          perplexity
    python -m tools.perplexity -m M.gguf -f TEXT -c N --kl-divergence-base REF.kld  ... and write a base
    python -m tools.perplexity -m M.gguf --kl-divergence-base BASE.kld --kl-divergence   KL statistics
    python -m tools.perplexity --compare-kld ENGINE.kld REF.kld        two bases, without a model
    (the reference's own: --numerics exact|ggml-cpu, --backend numpy|numba, --dtype float32|float64,
     with ggml-cpu -fa, -ctk/-ctv, -nr/--no-repack and --cpu avx2|avx512|neon|neon-i8mm|neon-clang|neon-i8mm-clang,
     llama.cpp's CPU build)

The text (its bytes, as llama.cpp reads them: a CRLF file keeps its \\r; one trailing \\n is dropped)
is tokenized whole with BOS, cut into chunks of n_ctx tokens, each chunk's first token replaced by BOS,
and the positions [n_ctx/2, n_ctx - 1) of each chunk score the token after them. A .kld file is
`_logits_`, n_ctx (u32), n_vocab (i32), n_chunk (i32), the n_chunk*n_ctx tokens (i32), then per chunk
and scored position one row of u16: (scale, min_log_prob) as two f32, then n_vocab log-probability
codes, padded to an even count. The float arithmetic of the rows and of the statistics is
llama-perplexity's, float32 where it rounds to float32.

The u16 codes quantize log-probabilities over 16 nats to steps of 16/65535: a base read back has a
KL noise floor (near 5e-4 on real models), and log-probabilities more than 16 nats below a row's
maximum read back at that floor; --kl-divergence-base-f32 F.npz stores (and with --kl-divergence
reads) the base's float32 log-probabilities instead, all of them or (--kl-top-k K) the K most
likely and the scored token's: KLD_F32_FORMAT. The numerics a base was computed with (under
ggml-cpu: the CPU target, KV cache, flash attention, repack) go to stderr as the run starts, and
into the float32 base; the u16 .kld is llama-perplexity's format, which has no field for them.

Several chunks in one llama.cpp batch (-b a multiple of -c) are computed here one after another.

This module holds the runs and the command line; the row arithmetic is perplexity_arithmetic.py, the
printed statistics perplexity_statistics.py, the base files kld_files.py.
"""
import math
import os
import sys
import time

import numpy as np

from reference import artifacts, factory, gguf
from reference.cli import (BEYOND_TRAIN, BEYOND_TRAIN_HELP, MAX_THREADS, OneLineParser, UsageError, add_numerics_flags,
                           build_of, check_output, check_train_context, exit_status, flag, int_in)
from reference.factory import GGML_CPU_BACKENDS
from reference.ggml_cpu import GgmlCpuError, target as cpu_target
from reference.kv import CacheError
from reference.provenance import provenance, sidecar
from reference.tokenizer import Tokenizer, TokenizerError
from tools.common import check_plot, pyplot, save_figure
from tools.parity.kld_files import F32Base, KldError, KldWriter, read_kld, top_k_rows, write_f32_base
from tools.parity.perplexity_arithmetic import (F32, decode_rows, log_softmax64, n_scored, nll_plain, nll_written,
                                                uint16_rows)
from tools.parity.perplexity_statistics import KlSums, chunk_line, statistics_lines

PROG = "tools.perplexity"
FLASH_DEFAULT = "auto"  # llama-perplexity's -fa
MIN_STATS_COUNT = 100  # llama-perplexity prints no statistics for fewer scored tokens


# ---------------------------------------------------------------------------------------------
# The reference forward over llama-perplexity's chunks and batches

def load_model(args):  # -> (TextModel on the backend the options ask for, its numerics_line)
    build = build_of(args, FLASH_DEFAULT if args.numerics == "ggml-cpu" else None)
    for warning in factory.host_warnings(build):
        print(f"{PROG}: warning: {warning}", file=sys.stderr)
    for note in factory.notes(build):
        info(f"{PROG}: {note}")
    backend = factory.backend(build)
    numerics = numerics_line(build, backend)
    model = gguf.load(args.model, "text")
    if check_train_context(args.ctx_size, model.config.n_ctx_train, "-c", args.model, args.beyond_n_ctx_train):
        info(f"{PROG}: -c {args.ctx_size} is past the training context of {os.path.basename(args.model)} "
             f"({model.config.n_ctx_train} tokens): {BEYOND_TRAIN}")
    # the caller prints the line once its input is checked: bad input stays one line on stderr
    return factory.text_model(model, build, backend), numerics


def numerics_line(build, backend):  # factory.Build, the backend made of it -> how the reference rounds, one line
    if not build.ggml_cpu:
        return f"numerics exact, {build.dtype}"
    cache = (f"KV cache {backend.k_type}" if backend.k_type == backend.v_type
             else f"K cache {backend.k_type}, V cache {backend.v_type}")
    return (f"numerics ggml-cpu: llama.cpp's {backend.target.name} CPU build, {cache}, "
            f"flash attention {'on' if backend.flash_attn else 'off'}, repack {'on' if backend.repack else 'off'}")


def chunk_logits(lm, ids, args):  # ids [n_ctx] (BOS already first) -> f32 [n_scored, V] of [n_ctx/2, n_ctx - 1)
    """llama-perplexity decodes a chunk in batches of n_batch tokens (one batch when n_batch >= n_ctx),
    which llama.cpp splits into ubatches of n_ubatch; the cache keeps the chunk's earlier batches."""
    n_ctx = len(ids)
    batch = args.batch_size if args.batch_size < n_ctx else n_ctx
    ubatch = min(args.ubatch_size, batch)
    cache = lm.new_cache(n_ctx, "ring", ubatch)
    out = [lm.prefill(ids[start:start + batch], cache, ubatch) for start in range(0, n_ctx, batch)]
    return np.concatenate(out)[n_ctx // 2:n_ctx - 1].astype(F32)


def chunk_ids(tokens, chunk, n_ctx, bos):  # tokens [n] -> the chunk's ids [n_ctx], BOS first (bos >= 0)
    ids = np.array(tokens[chunk * n_ctx:(chunk + 1) * n_ctx], np.int64)
    if bos >= 0:
        ids[0] = bos
    return ids


def info(text):  # a LOG_INF line of llama-perplexity: stderr
    print(text, file=sys.stderr, flush=True)


def eta_line(prog, seconds, n_left):  # -> "X seconds per chunk - ETA ..." (one line on stderr here)
    """llama-perplexity's line, counting what runs here: each chunk on its own (its n_seq chunks of a
    batch one after another), the first chunk's whole work (forward, bases, scores) times those left."""
    total = int(seconds * n_left)
    hours = f"{total // 3600} hours " if total >= 3600 else ""
    return (f"{prog}: {seconds:.2f} seconds per chunk - ETA {hours}{(total % 3600 if hours else total) / 60.0:.2f} "
            f"minutes for the {n_left} chunks left")


def chunk_count(args, available, what):  # -> the chunks to run: --chunks, or all; more than there are is one warning
    if args.chunks > available:
        info(f"{PROG}: warning: --chunks {args.chunks}: {what} holds {available}; running {available}")
    return available if args.chunks < 0 else min(args.chunks, available)


def chunks(n_chunk, what):  # -> range of chunk indices with a progress bar on a terminal
    from tqdm import tqdm
    return tqdm(range(n_chunk), desc=what, unit="chunk", leave=False, disable=None)


# ---------------------------------------------------------------------------------------------
# The three modes

def read_text(path):  # -> the text as llama.cpp's -f reads it: bytes kept, one trailing \n dropped
    data = artifacts.read_bytes(path, UsageError, what="text")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"{path}: not UTF-8 text (byte {e.start})") from None
    return text[:-1] if text.endswith("\n") else text


def text_chunks(args, tokenizer):  # -> (tokens of -f, n_chunk): the whole text with BOS, cut to -c
    tokens = tokenizer.tokenize(read_text(args.file), add_special=True)
    n_ctx = args.ctx_size
    if len(tokens) < 2 * n_ctx:
        raise UsageError(f"you need at least {2 * n_ctx} tokens to evaluate perplexity with a context of "
                         f"{n_ctx}; {args.file} tokenizes to only {len(tokens)}")
    return tokens, chunk_count(args, len(tokens) // n_ctx, f"{args.file} at -c {n_ctx}")


class BaseWriters:
    """The bases a perplexity run writes: --kl-divergence-base (u16) and --kl-divergence-base-f32."""

    def __init__(self, args, n_vocab, tokens, numerics, record):  # tokens [n_chunk * n_ctx], the chunks scored
        self.n_ctx, self.n_vocab, self.tokens, self.f32_rows, self.numerics = args.ctx_size, n_vocab, tokens, [], numerics
        self.record, self.u16_path = record, args.kl_divergence_base
        self.fused_codes = args.cpu is not None and cpu_target(args.cpu).contracts_across_statements  # GCC on ARM
        self.f32_path, self.top_k = args.kl_divergence_base_f32, args.kl_top_k
        self.u16 = KldWriter(args.kl_divergence_base, self.n_ctx, n_vocab, tokens) if args.kl_divergence_base else None

    def add(self, logits, next_ids):  # [n_scored, V] f32 of one chunk, the tokens it scores -> None
        if self.u16:
            self.u16.write(uint16_rows(logits, self.fused_codes))
        if self.f32_path:
            log_probs = log_softmax64(logits)
            self.f32_rows.append(top_k_rows(log_probs, next_ids, self.top_k) if self.top_k
                                 else {"log_probs": log_probs.astype(F32)})

    def close(self):  # -> None, both files complete
        if self.u16:
            self.u16.close()  # llama-perplexity's format has no field for the provenance: F.kld.json beside it
            artifacts.write_json(sidecar(self.u16_path), self.record, KldError)
        if self.f32_path:
            write_f32_base(self.f32_path, self.n_ctx, self.n_vocab, self.tokens, self.f32_rows, self.numerics,
                           self.record)

    def discard(self):  # -> None: whatever is unfinished goes (nothing once close() ran)
        if self.u16:
            self.u16.discard()


def perplexity(args, lm, numerics):  # numerics_line of lm -> exit status; prints as llama-perplexity's perplexity()
    tokenizer = Tokenizer(lm.tokenizer)
    tokens, n_chunk = text_chunks(args, tokenizer)
    n_ctx, bos = args.ctx_size, tokenizer.required_id("bos") if tokenizer.add_bos else -1
    info(f"{PROG}: {numerics}")
    record = provenance(args.model, build_of(args, FLASH_DEFAULT if args.numerics == "ggml-cpu" else None), lm.backend,
                        args.ubatch_size, ctx_size=n_ctx, batch_size=args.batch_size)
    bases = BaseWriters(args, lm.cfg.n_vocab, tokens[:n_chunk * n_ctx], numerics, record)
    try:
        return scored_chunks(args, lm, tokens, n_chunk, bos, bases)
    finally:
        bases.discard()  # a run that fails leaves the bases that were there as they were


def scored_chunks(args, lm, tokens, n_chunk, bos, bases):  # -> exit status: perplexity()'s loop over the chunks
    n_ctx = args.ctx_size
    # the .kld writer's log_softmax rounds the nll to float32, the other one does not
    nll_of = nll_written if args.kl_divergence_base else nll_plain
    info(f"perplexity: calculating perplexity over {n_chunk} chunks, n_ctx={n_ctx}, "
         f"batch_size={min(args.batch_size, n_seq(args, n_ctx) * n_ctx)}, n_seq={n_seq(args, n_ctx)}")
    nll, nll2, count = 0.0, 0.0, 0
    for i in chunks(n_chunk, "perplexity"):
        t0 = time.perf_counter()
        logits = chunk_logits(lm, chunk_ids(tokens, i, n_ctx, bos), args)
        next_ids = np.asarray(tokens[i * n_ctx + n_ctx // 2 + 1:(i + 1) * n_ctx])
        bases.add(logits, next_ids)
        for v in nll_of(logits, next_ids).tolist():
            nll, nll2, count = nll + v, nll2 + v * v, count + 1
        if i == 0:
            info(eta_line("perplexity", time.perf_counter() - t0, n_chunk - 1))
        print(f"[{i + 1}]{math.exp(nll / count):.4f},", end="", flush=True)
    print()
    bases.close()
    return final_estimate(nll, nll2, count)


def n_seq(args, n_ctx):  # -> sequences per batch, as llama-perplexity derives them
    return max(1, args.batch_size // n_ctx)


def final_estimate(nll, nll2, count):  # running sums -> exit status, after the "Final estimate" line
    nll, nll2 = nll / count, nll2 / count
    ppl, var = math.exp(nll), nll2 - nll * nll
    if var <= 0:
        info("Unexpected negative standard deviation of log(prob)")
        return 0
    info(f"Final estimate: PPL = {ppl:.4f} +/- {math.sqrt(var / (count - 1)) * ppl:.5f}")
    return 0


CHUNK_HEADER = ("chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              "
                "Δp RMS            Same top p")


def kl_divergence(args, base, q_logits):  # q_logits(chunk) -> [n_scored, V]; prints as kl_divergence()
    n_chunk = chunk_count(args, base.n_chunk, "the base")
    info(f"kl_divergence: computing over {n_chunk} chunks, n_ctx={base.n_ctx}, batch_size={args.batch_size}, "
         f"n_seq={n_seq(args, base.n_ctx)}")
    sums = KlSums()
    for i in chunks(n_chunk, "kl-divergence"):
        t0 = time.perf_counter()
        logits = q_logits(i)
        sums.add(base.terms(i, logits))
        if i == 0:
            info(eta_line("kl_divergence", time.perf_counter() - t0, n_chunk - 1))
            print(f"\n{CHUNK_HEADER}")
        print(chunk_line(i + 1, sums), flush=True)
    print()
    if args.plot:
        plot_kl(args.plot, sums, f"{os.path.basename(args.model or args.compare_kld[0])} against its base")
    if sums.count < MIN_STATS_COUNT:
        info(f"kl_divergence: {sums.count} scored tokens: llama-perplexity prints statistics from {MIN_STATS_COUNT}")
        return 0
    print("\n".join(statistics_lines(sums)))
    return 0


def plot_kl(path, s, title):  # KlSums -> PNG: the per-token KLD (sorted) and the Δp histogram
    plt = pyplot(path)
    kld, p_diff = np.sort(np.concatenate(s.kld_values)), np.concatenate(s.p_diff_values)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(np.arange(1, len(kld) + 1) / len(kld), kld)
    left.set(xlabel="fraction of scored tokens", ylabel="KLD (nats)", title="KLD per token, sorted")
    left.set_yscale("symlog", linthresh=1e-5)  # the storage noise makes KLD values slightly negative
    right.hist(100 * p_diff, bins=60)
    right.set(yscale="log", xlabel="Δp (%)", ylabel="tokens", title="Δp = p_Q(token) - p_base(token)")
    fig.suptitle(f"{title}: {s.count} tokens, mean KLD {s.sums['kld'] / s.count:.6f}")
    fig.tight_layout()
    save_figure(plt, fig, path)


def code_agreement(a, b):  # KldBase x2 of one shape -> (identical codes, codes, largest |difference|)
    """Over the n_vocab codes of every row (the f32 headers and the padding left out)."""
    same, largest, V = 0, 0, a.n_vocab
    for i in range(a.n_chunk):  # chunk by chunk: a 30B base does not fit in memory as int32
        ca, cb = a.rows[i, :, 4:4 + V].astype(np.int32), b.rows[i, :, 4:4 + V].astype(np.int32)
        same += int(np.sum(ca == cb))
        largest = max(largest, int(np.max(np.abs(ca - cb))))
    return same, a.n_chunk * n_scored(a.n_ctx) * V, largest


def check_same_chunks(q, base, q_path, base_path):  # two bases -> None, UsageError unless one text and shape
    if (q.n_ctx, q.n_vocab, q.n_chunk) != (base.n_ctx, base.n_vocab, base.n_chunk):
        raise UsageError(f"{q_path} has n_ctx {q.n_ctx}, n_vocab {q.n_vocab}, n_chunk {q.n_chunk}; {base_path} "
                         f"{base.n_ctx}, {base.n_vocab}, {base.n_chunk}")
    differ = np.flatnonzero(np.asarray(q.tokens).ravel() != np.asarray(base.tokens).ravel())
    if len(differ):
        raise UsageError(f"{q_path} and {base_path} hold different tokens (first at {differ[0]})")


def compare_kld(args):  # --compare-kld Q.kld BASE.kld -> exit status
    q_path, base_path = args.compare_kld
    q, base = read_kld(q_path), read_kld(base_path)
    check_same_chunks(q, base, q_path, base_path)
    same, total, largest = code_agreement(q, base)
    print(f"u16 log-probability codes: {same} of {total} identical ({100 * same / total:.4f} %), "
          f"largest difference {largest} (steps of 16/65535 nats below each row's max)")
    heads = np.sum(np.all(np.asarray(q.rows[:, :, :4]) == np.asarray(base.rows[:, :, :4]), axis=2))
    print(f"row headers (scale, min_log_prob): {int(heads)} of {q.n_chunk * n_scored(q.n_ctx)} identical")
    return kl_divergence(args, base, lambda i: decode_rows(q.rows[i], q.n_vocab))


def read_base(args):  # --kl-divergence -> KldBase or F32Base
    if bool(args.kl_divergence_base) == bool(args.kl_divergence_base_f32):
        raise UsageError("--kl-divergence reads one base: --kl-divergence-base F.kld or --kl-divergence-base-f32 F.npz")
    return read_kld(args.kl_divergence_base) if args.kl_divergence_base else F32Base(args.kl_divergence_base_f32)


def kl_mode(args):  # --kl-divergence -> exit status: the model's logits against a base
    if args.kl_top_k:
        raise UsageError("--kl-top-k is chosen when the base is written; --kl-divergence reads what it holds")
    base = read_base(args)
    args.ctx_size = base.n_ctx  # the chunks the base was made of: checked against the training context
    lm, numerics = load_model(args)
    if base.n_vocab != lm.cfg.n_vocab:
        raise UsageError(f"inconsistent vocabulary: the base has {base.n_vocab} tokens, {args.model} {lm.cfg.n_vocab}")
    info(f"{PROG}: {numerics}" + (f"; the base's: {base.numerics}" if base.numerics else ""))
    tokenizer = Tokenizer(lm.tokenizer)
    bos = tokenizer.required_id("bos") if tokenizer.add_bos else -1
    tokens = np.asarray(base.tokens).ravel()
    return kl_divergence(args, base, lambda i: chunk_logits(lm, chunk_ids(tokens, i, base.n_ctx, bos), args))


def ppl_mode(args):  # -> exit status: perplexity of -f, writing the bases asked for
    if not args.file:
        raise UsageError("perplexity needs a text: -f TEXT")
    if args.batch_size >= args.ctx_size and args.batch_size % args.ctx_size:
        raise UsageError(f"-b {args.batch_size} must be below -c {args.ctx_size} or a multiple of it (llama-perplexity)")
    if args.kl_divergence_base:
        check_output(args.kl_divergence_base, "--kl-divergence-base")
    if args.kl_divergence_base_f32:
        check_output(args.kl_divergence_base_f32, "--kl-divergence-base-f32", ".npz")
    elif args.kl_top_k:
        raise UsageError("--kl-top-k applies to the base --kl-divergence-base-f32 writes")
    artifacts.refuse_overwrite([("--kl-divergence-base", args.kl_divergence_base),
                                ("--kl-divergence-base-f32", args.kl_divergence_base_f32)],
                               [("-m", args.model), ("-f", args.file)], UsageError)
    return perplexity(args, *load_model(args))


def build_parser():  # -> llama-perplexity's options and the reference's
    p = OneLineParser(prog=f"python -m {PROG}", description=__doc__)
    flag(p, "model", help="text GGUF")
    flag(p, "file", help="text file (its bytes, as llama.cpp reads them)")
    flag(p, "ctx_size", type=int_in(8, 1 << 20), default=512, help="tokens per chunk")
    flag(p, "batch_size", type=int_in(1, 1 << 20), default=2048,
         help="llama.cpp's logical batch: below -c a chunk is decoded in batches; a multiple of -c puts several "
              "chunks in one llama.cpp batch (here: one after another)")
    flag(p, "ubatch_size", type=int_in(1, 1 << 20), default=512, help="llama.cpp's physical batch")
    flag(p, "threads", type=int_in(1, MAX_THREADS),
         help="with --numerics ggml-cpu: llama.cpp's thread count (default 2, the modelled build's)")
    p.add_argument("--chunks", type=int_in(-1, 1 << 30), default=-1,
                   help="at most this many chunks (-1: all); here it also caps a --kl-divergence run")
    p.add_argument("--kl-divergence-base", metavar="F.kld",
                   help="without --kl-divergence: write the u16 base there; with it: read it")
    p.add_argument("--kl-divergence-base-f32", metavar="F.npz",
                   help="the same, with float32 log-probabilities (no u16 noise floor)")
    p.add_argument("--kl-top-k", type=int_in(1, 1 << 24), metavar="K",
                   help="--kl-divergence-base-f32 keeps only each row's K most likely tokens (and the scored one)")
    p.add_argument("--kl-divergence", action="store_true", help="KL divergence of -m against the base")
    p.add_argument("--compare-kld", nargs=2, metavar=("Q.kld", "BASE.kld"),
                   help="compare two bases of the same text (an engine's and the reference's), no model")
    p.add_argument(BEYOND_TRAIN, action="store_true", help=BEYOND_TRAIN_HELP + " (a line on stderr)")
    p.add_argument("--plot", metavar="F.png", help="with --kl-divergence or --compare-kld: the per-token KLD and Δp")
    add_numerics_flags(p, GGML_CPU_BACKENDS, "auto, as llama-perplexity's")
    return p


def work(args):  # -> exit status
    if args.plot:
        if not (args.kl_divergence or args.compare_kld):
            raise UsageError("--plot draws the KL statistics of --kl-divergence or --compare-kld")
        check_plot(args.plot)
    bases = (("--kl-divergence-base", args.kl_divergence_base), ("--kl-divergence-base-f32", args.kl_divergence_base_f32))
    artifacts.refuse_overwrite([("--plot", args.plot)], [("-m", args.model), ("-f", args.file), *bases,
                                                        *(("--compare-kld", q) for q in args.compare_kld or ())], UsageError)
    if args.compare_kld:
        return compare_kld(args)
    if not args.model:
        raise UsageError("-m M.gguf is required (or --compare-kld Q.kld BASE.kld)")
    if args.chunks == 0:
        raise UsageError("--chunks must be -1 (all) or at least 1")
    return kl_mode(args) if args.kl_divergence else ppl_mode(args)


def main(argv=None):  # -> exit status
    args = build_parser().parse_args(argv)
    return exit_status(PROG, lambda: work(args), (KldError, gguf.GGUFError, TokenizerError, GgmlCpuError, CacheError,
                                                   factory.FactoryError))


if __name__ == "__main__":
    sys.exit(main())
