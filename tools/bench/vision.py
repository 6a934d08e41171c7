"""`python -m tools.bench_accel vision`: one synthetic image through the tower on numba (exact
numerics), and through llama-mtmd-cli (its own "mtmd batch encoding done" time)."""
import os
import re
import signal
import subprocess
import tempfile
import time

import numpy as np

from reference import factory, gguf
from reference.cli import UsageError
from tools.bench.engines import command_line, set_threads, text_vocab
from tools.bench.forward import LAYER_BAR
from tools.bench.make import llama_tool

MTMD_ENCODED = re.compile(rb"mtmd batch encoding done in (\d+) ms")  # mtmd-cli.cpp, after mtmd_batch_encode


def write_ppm(path, rgb):  # uint8 [H, W, 3] -> a binary PPM file, which llama.cpp's stb_image reads
    h, w, _ = rgb.shape
    with open(path, "wb") as f:
        f.write(b"P6\n%d %d\n255\n" % (w, h) + np.ascontiguousarray(rgb, np.uint8).tobytes())


def mtmd_encode_s(cli, model, mmproj, image, threads):  # -> seconds llama-mtmd-cli reports for encoding the image
    """Plain CPU buffers and no warm-up run, as the text engines; stopped once the encoding is
    reported, before the text model would take the embeddings and generate. The tower's image is one
    chunk, encoded in one batch: the first such line is all of it."""
    cmd = [cli, "-m", model, "--mmproj", mmproj, "--image", image, "-p", "x", "-n", "1", "-t", str(threads),
           "--no-repack", "--no-warmup", "--chat-template", "chatml"]
    last = b""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True) as proc:
        for line in proc.stdout:
            found = MTMD_ENCODED.search(line)
            if found:
                os.killpg(proc.pid, signal.SIGKILL)  # its process group: a wrapper's children too
                return int(found.group(1)) / 1000
            last = line.strip() or last
    raise UsageError(f"llama-mtmd-cli exited with status {proc.returncode} before encoding the image: "
                     f"{last.decode(errors='replace')[:200]}")


def vision(args):  # -> report dict
    from tools.synthetic import synthetic_image
    set_threads(args.threads)
    build = factory.Build(backend="numba")
    tower = factory.vision_model(gguf.load(args.mmproj, "mmproj"), build, factory.backend(build))
    if args.llama_bin:
        cli = llama_tool(args.llama_bin, "llama-mtmd-cli")
        text_vocab(args.model)
    image = synthetic_image(args.image_size, args.image_size, 0, "smooth")
    report = {"mmproj": os.path.basename(args.mmproj), "image_size": args.image_size, "threads": args.threads,
              "command": command_line()}
    if args.llama_bin:  # first: a llama.cpp that fails is found before the tower's minutes
        with tempfile.TemporaryDirectory() as tmp:
            write_ppm(os.path.join(tmp, "image.ppm"), image)
            report["llama_mtmd_cli_s"] = mtmd_encode_s(cli, args.model, args.mmproj, os.path.join(tmp, "image.ppm"),
                                                       args.threads)
    t0 = time.perf_counter()
    report["image_tokens"] = len(tower.encode(image, progress=LAYER_BAR))
    report["numba_s"] = time.perf_counter() - t0
    if args.llama_bin:
        report["numba_over_llama_mtmd_cli"] = report["llama_mtmd_cli_s"] / report["numba_s"]  # of its speed
    return report


def print_vision(report):
    line = f"{report['image_size']}x{report['image_size']} ({report['image_tokens']} tokens): numba {report['numba_s']:.1f} s"
    if "llama_mtmd_cli_s" in report:
        line += (f", llama-mtmd-cli {report['llama_mtmd_cli_s']:.1f} s: numba x{report['numba_over_llama_mtmd_cli']:.2f} "
                 "of its speed")
    print(line)


def plot_vision(report, path):  # -> None: each engine's seconds for the image as bars
    from tools.common import pyplot, save_figure
    plt = pyplot(path)
    seconds = {name: report[key] for name, key in (("numba", "numba_s"), ("llama-mtmd-cli", "llama_mtmd_cli_s"))
               if key in report}
    fig, ax = plt.subplots(figsize=(4.5, 3.5))
    ax.bar(list(seconds), list(seconds.values()), color="tab:blue")
    ax.set_ylabel("seconds")
    ax.set_title(f"{report['image_size']} x {report['image_size']} image, {report['threads']} threads")
    fig.suptitle(report["mmproj"])
    fig.tight_layout()
    save_figure(plt, fig, path)

