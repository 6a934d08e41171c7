"""Benchmarks as ratios against a peer run in the same process.

    python -m tools.bench text --model golden/models/tiny-b-f32.gguf --checkpoint build/tiny/tiny-b \
        [--prompt-len 100 --n-decode 32 --repeat 3 --json-out out.json]
    python -m tools.bench vision [--layers 4 --json-out out.json]
    python -m tools.bench scale --model 30B.gguf [--backend numba --prompt-len 64 --n-predict 8 --logits last]
    python -m tools.bench scale --mmproj MMPROJ.gguf [--image-size 1024]
    python -m tools.bench scale --mmproj MMPROJ.gguf --video-frames 96 --backend numba

`text`: prefill and decode tokens/s of this reference vs transformers eager (CPU, float32) on the
same weights; the checkpoint is the transformers directory the GGUF was converted from
(tools.make_tiny writes it under build/); needs the `parity` extra (torch, transformers).
`vision`: the tower's cost per window on the release's 32 x 32-patch windows (a narrow synthetic
tower), for 1, 4 and 9 windows and for a 1024 x 1024 image (1369 tokens) window-local vs with every
layer global: window-local layers cost the same per window, an N x N mask would not.
`scale`: one run at full size (the 30B layout from tools.make_synthetic): a prompt prefill and
greedy tokens on the text model, or one image through the tower, or with --video-frames one video
(synthetic 1280 x 720 frames at 2 fps, all kept up to the mmproj's max_frames; 16:9 at the release's
cap of 144 tokens a pair is a 9 x 16 grid, the cap exactly) through the tower pair by pair, on an
mmproj with the video extension (tools.make_synthetic --video); seconds, peak RSS of this process,
a progress bar per layer.
"""
import json
import os
import sys
import time
from functools import partial

import numpy as np
from tqdm import tqdm

from reference import factory, gguf
from reference.cli import OneLineParser, UsageError, add_json_out, exit_status, flag, int_in, write_json
from reference.provenance import args_record

# Bounds of the size arguments, checked as they are parsed, before anything is allocated from them.
# Prefill returns logits [prompt_len, n_vocab] float32: 4096 positions are 3.3 GB at the release's
# vocabulary of 202048, a fair share of a 24 GiB machine beside the mapped weights.
MAX_PROMPT = 4096
# scale --logits last computes the last position's row only: the cap is then the KV cache's and the
# run's time (a 16K-token prompt at full size is a run of days in numpy).
MAX_LAST_PROMPT = 1 << 17
# Every decode step is one pass over all the weights (minutes a step at full size in numpy), and the
# cache grows by a position a step: 4096 steps is already a run of days there.
MAX_DECODE = 4096
# The tower sees at most reference.vision.DEFAULT_MAX_TOKENS (4096) tokens, so a larger image is only
# scaled down first; the synthetic 4096 x 4096 image and its resize take about 1.4 GB.
MAX_IMAGE_SIDE = 4096
# The release tower has 50 layers (tools.make_synthetic.RELEASE_MMPROJ); a bench tower is never deeper.
MAX_VISION_LAYERS = 50
# scale --video-frames: the frames are 1280 x 720 (2.8 MB each), the release's max_frames is 96.
VIDEO_FRAME_SIZE = (1280, 720)
VIDEO_SOURCE_FPS = 2.0  # the release's sampling rate: every frame is kept, up to max_frames
MAX_VIDEO_FRAMES = 1024
MAX_REPEAT = 100  # the best of more rounds than this measures the machine's noise, not the engine
LAYER_BAR = partial(tqdm, desc="layers", leave=False)  # the progress wrapper the model forwards take


def best_of(repeat, fn):  # -> the fastest wall time of `repeat` calls (the least disturbed run)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def reference_runs(model, ids, n_decode, dtype=np.float32):  # GGUFModel -> (prefill fn, decode fn)
    lm = factory.text_model(model, factory.Build(dtype=np.dtype(dtype).name))
    n_ctx = len(ids) + n_decode

    def prefill():
        lm.prefill(ids, lm.new_cache(n_ctx, "ring"))

    def decode():
        cache = lm.new_cache(n_ctx, "ring")
        lm.prefill(ids, cache)
        for t in range(n_decode):
            lm.prefill([t], cache)
    return prefill, decode


def transformers_runs(checkpoint, ids, n_decode):  # -> (prefill fn, decode fn)
    try:
        import torch
        from transformers import AutoModelForImageTextToText
    except ImportError as e:
        raise UsageError(f"text needs torch and transformers, the parity extra ({e})") from None
    torch.set_grad_enabled(False)
    try:
        model = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    except (OSError, ValueError) as e:  # transformers' messages run over several lines: the first says it
        raise UsageError(f"{checkpoint}: cannot load the checkpoint ({str(e).strip().splitlines()[0]})") from None
    input_ids = torch.tensor([ids])

    def prefill():
        model(input_ids=input_ids, use_cache=False)

    def decode():
        out = model(input_ids=input_ids, use_cache=True)
        past = out.past_key_values
        for t in range(n_decode):
            out = model(input_ids=torch.tensor([[t]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
    return prefill, decode


def bench_text(args):  # -> report dict
    model = gguf.load(args.model, "text")  # a bad GGUF is refused before either engine is built
    ids = list(np.random.default_rng(0).integers(0, min(400, model.config.n_vocab), args.prompt_len))
    # both engines are built before any timing: a checkpoint that will not load is refused at once
    engines = {"reference": reference_runs(model, ids, args.n_predict),
               "transformers-eager": transformers_runs(args.checkpoint, ids, args.n_predict)}
    report = {"prompt_len": args.prompt_len, "n_decode": args.n_predict, "repeat": args.repeat, "engines": {}}
    for name, (prefill, decode) in tqdm(engines.items(), desc="engines"):
        prefill()  # warm-up: caches, lazy imports, allocator
        t_prefill = best_of(args.repeat, prefill)
        t_decode = best_of(args.repeat, decode) - t_prefill
        report["engines"][name] = {"prefill_tok_s": args.prompt_len / t_prefill,
                                   "decode_tok_s": args.n_predict / t_decode}
    ref, peer = report["engines"]["reference"], report["engines"]["transformers-eager"]
    report["ratio_reference_over_transformers"] = {k: ref[k] / peer[k] for k in ref}
    return report


def bench_vision(args):  # -> report dict
    import tempfile
    from tools.synthetic import VisionDims, synthetic_image, write_mmproj_gguf
    # 40 s at the defaults: a bar on stderr names each step while it runs
    with tempfile.TemporaryDirectory() as tmp, tqdm(total=6, desc="vision", file=sys.stderr) as bar:
        def step(what, fn):  # -> fn()
            bar.set_postfix_str(what)
            out = fn()
            bar.update()
            return out

        m = step("synthetic tower", lambda: factory.vision_model(gguf.load(write_mmproj_gguf(
            f"{tmp}/mm.gguf", VisionDims(n_pos=1024, n_layer=args.layers)), "mmproj"), factory.Build()))
        px = {k * k: m.preprocess(synthetic_image(448 * k, 448 * k, 1, "smooth")) for k in (1, 2, 3)}
        photo = m.preprocess(synthetic_image(1024, 1024, 2, "smooth"))
        m.is_global = lambda il: False
        per_window = {n: step(f"{n} window{'s' * (n > 1)}", lambda: best_of(args.repeat, lambda: m.forward(p))) / n
                      for n, p in px.items()}
        windowed = step("1024x1024 window-local", lambda: best_of(args.repeat, lambda: m.forward(photo)))
        m.is_global = lambda il: True
        all_global = step("1024x1024 all global", lambda: best_of(1, lambda: m.forward(photo)))
    return {"layers": args.layers, "s_per_window": per_window, "photo_1024_window_local_s": windowed,
            "photo_1024_all_global_s": all_global, "ratio_global_over_window_local": all_global / windowed}


def peak_rss_gb():  # -> this process's peak resident set so far, GB (Linux reports ru_maxrss in KiB)
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def bench_scale(args):  # -> report dict of one full-size run, with this process's peak RSS
    from tools.synthetic import synthetic_image
    report = {"backend": args.backend}
    # both GGUFs and the backend are checked before the text run, which takes hours at full size
    build = factory.Build(backend=args.backend)
    backend = factory.backend(build)
    lm = factory.text_model(gguf.load(args.model, "text"), build, backend) if args.model else None
    vision = factory.vision_model(gguf.load(args.mmproj, "mmproj"), build, backend) if args.mmproj else None
    if lm is not None:
        ids = list(np.random.default_rng(0).integers(0, lm.cfg.n_vocab, args.prompt_len))
        cache = lm.new_cache(args.prompt_len + args.n_predict, "ring")
        t0 = time.perf_counter()
        last = np.array([args.prompt_len - 1]) if args.logits == "last" else None
        logits = lm.prefill(ids, cache, progress=LAYER_BAR, out_rows=last)
        t1 = time.perf_counter()
        tokens = lm.decode_greedy(logits[-1], args.n_predict, cache, progress=LAYER_BAR)
        t2 = time.perf_counter()
        report.update(model=args.model, prompt_len=args.prompt_len, logits=args.logits, generated=len(tokens),
                      s_per_prefill_token=(t1 - t0) / args.prompt_len,
                      s_per_decoded_token=(t2 - t1) / max(len(tokens) - 1, 1))  # the last token is not fed
    if vision is not None and args.video_frames:
        report.update(mmproj=args.mmproj, **bench_video(vision, args.video_frames))
    elif vision is not None:
        t0 = time.perf_counter()
        out = vision.encode(synthetic_image(args.image_size, args.image_size, 0, "smooth"), progress=LAYER_BAR)
        report.update(mmproj=args.mmproj, image_size=args.image_size, image_tokens=len(out),
                      image_s=time.perf_counter() - t0)
    report["peak_rss_gb"] = peak_rss_gb()
    return report


def bench_video(vision, n_frames):  # VisionModel -> report entries of one synthetic video through the tower
    """A line per frame pair on stderr as it ends (its wall and CPU seconds, the peak RSS so far),
    so that a run stopped early still says what a pair costs."""
    from reference import video
    from reference.trace import NO_TRACE
    from reference.vision import check_video_extension
    from tools.synthetic import synthetic_image
    check_video_extension(vision.path, vision.cfg, vision.tensors)  # before the frames are made
    width, height = VIDEO_FRAME_SIZE
    frames = np.stack([synthetic_image(width, height, seed, "smooth") for seed in range(n_frames)])
    cfg = vision.cfg
    t0 = time.perf_counter()
    prepared = video.prepare(video.Video(frames, VIDEO_SOURCE_FPS, "synthetic"), cfg.video["fps"],
                             cfg.video["max_frames"], cfg.video["max_frame_tokens"], cfg.patch_size * cfg.merge_size)
    starts = [(time.perf_counter(), time.process_time())]

    def pair_started(g):  # encode_video asks for pair g's tracer as pair g - 1 has ended
        if g:
            pair_ended(g - 1)
        return NO_TRACE

    def pair_ended(g):
        starts.append((time.perf_counter(), time.process_time()))
        (w0, c0), (w1, c1) = starts[-2:]
        print(f"pair {g + 1}/{len(prepared.pairs)}: {w1 - w0:.1f} s wall, {c1 - c0:.1f} s CPU, "
              f"peak RSS {peak_rss_gb():.2f} GB", file=sys.stderr, flush=True)
    out = vision.encode_video(prepared, pair_started, progress=LAYER_BAR)
    pair_ended(len(prepared.pairs) - 1)
    t1, cpu = starts[-1][0], starts[-1][1] - starts[0][1]
    return {"video_frames": n_frames, "frame_size": f"{width}x{height}", "frames_kept": len(prepared.indices),
            "pairs": len(prepared.pairs), "grid": list(prepared.grid), "video_tokens": len(out),
            "preprocess_s": starts[0][0] - t0, "tower_s": t1 - starts[0][0], "tower_cpu_s": cpu,
            "s_per_pair": (t1 - starts[0][0]) / len(prepared.pairs)}


def print_text(report):
    for name, r in report["engines"].items():
        print(f"{name:20s} prefill {r['prefill_tok_s']:9.1f} tok/s   decode {r['decode_tok_s']:8.1f} tok/s")
    ratio = report["ratio_reference_over_transformers"]
    print(f"reference / transformers: prefill x{ratio['prefill_tok_s']:.2f}, decode x{ratio['decode_tok_s']:.2f}")


def print_vision(report):
    print("window-local layers, s per window: "
          + ", ".join(f"{n} windows {t:.3f}" for n, t in report["s_per_window"].items()))
    print(f"1024x1024 (1369 tokens, 9 windows), {report['layers']} layers: window-local "
          f"{report['photo_1024_window_local_s']:.2f} s, all global {report['photo_1024_all_global_s']:.2f} s "
          f"(x{report['ratio_global_over_window_local']:.1f})")


def build_parser():  # subparsers are made with the parent's class: their errors are one line too
    p = OneLineParser(prog="python -m tools.bench", description=__doc__)
    sub = p.add_subparsers(dest="what", required=True)
    t = sub.add_parser("text", help="text model prefill and decode, reference vs transformers eager")
    flag(t, "model", required=True)
    t.add_argument("--checkpoint", required=True)
    t.add_argument("--prompt-len", type=int_in(1, MAX_PROMPT), default=100)
    flag(t, "n_predict", type=int_in(1, MAX_DECODE), default=32)
    t.add_argument("--repeat", type=int_in(1, MAX_REPEAT), default=3)
    add_json_out(t, "the report")
    v = sub.add_parser("vision", help="vision tower cost per window, window-local vs all-global layers")
    v.add_argument("--layers", type=int_in(1, MAX_VISION_LAYERS), default=4)
    v.add_argument("--repeat", type=int_in(1, MAX_REPEAT), default=2)
    add_json_out(v, "the report")
    sc = sub.add_parser("scale", help="one full-size run: text prefill + decode, or one image through the tower")
    flag(sc, "model")
    sc.add_argument("--mmproj")
    sc.add_argument("--backend", default="numpy", choices=("numpy", "numba"))
    sc.add_argument("--prompt-len", type=int_in(1, MAX_LAST_PROMPT), default=64,
                    help=f"at most {MAX_PROMPT} with --logits all, {MAX_LAST_PROMPT} with --logits last")
    sc.add_argument("--logits", choices=("all", "last"), default="all",
                    help="the prompt positions whose logits the prefill computes")
    flag(sc, "n_predict", type=int_in(1, MAX_DECODE), default=8)
    sc.add_argument("--image-size", type=int_in(1, MAX_IMAGE_SIDE), default=1024)
    sc.add_argument("--video-frames", type=int_in(1, MAX_VIDEO_FRAMES),
                    help="one synthetic video of this many frames in place of the image (needs the video extension)")
    add_json_out(sc, "the report")
    return p


def main(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    if args.what == "scale" and not (args.model or args.mmproj):
        p.error("scale needs --model or --mmproj")
    if args.what == "scale" and args.logits == "all" and args.prompt_len > MAX_PROMPT:
        p.error(f"--prompt-len {args.prompt_len} keeps all-position logits: at most {MAX_PROMPT}; "
                "--logits last computes the last position only")
    if args.what == "text" and not os.path.isdir(args.checkpoint):  # found now, not after the reference's runs
        p.error(f"--checkpoint {args.checkpoint}: no such directory")
    bench, show = {"text": (bench_text, print_text), "vision": (bench_vision, print_vision),
                   "scale": (bench_scale, lambda r: print(json.dumps(r, indent=1)))}[args.what]

    def work():
        report = bench(args)
        show(report)
        if args.json_out:
            write_json(args.json_out, {**report, "provenance": args_record(args)})
        return 0
    return exit_status("tools.bench", work, (gguf.GGUFError, factory.FactoryError))



if __name__ == "__main__":
    sys.exit(main())
