"""Video input as transformers 5.23.0 preprocesses it for Muse-Glimmer (docs/vision.md, Video).

    indices  = trunc(linspace_f32(0, T-1, n))        n = frames kept at `fps` of the source's, <= max_frames, even
    grid     = smart_resize(H, W, 28, max_frame_tokens)   transformers' own (ties: set order)
    frames   = lanczos_int16(frames[indices])         torch's uint8 antialiased Lanczos (int16 weights)
    pixels   = (f32(u8) - 255 mean) / (255 std)       the fused rescale + normalize, float32
    pairs    = frames padded to an even count by repeating the last; pair g = frames 2g, 2g+1
    stamps   = "Time: {t:.1f}s", t = f32(index of frame 2g) / f32(source fps)

Sources (transformers/models/muse_glimmer/video_processing_muse_glimmer.py): sample_frames :190-230,
resize :127-150, smart_resize :60-92, patchify :152-188 (ops.im2col of a pair); the timestamps transformers/video_utils.py:101-106;
the fused normalisation transformers/image_processing_backends.py:329-369.

Inputs come as a directory of frame images (sorted by name), a .npy uint8 [T, H, W, 3], or a video
file decoded by PyAV (the [video] extra). Every refusal is a VideoError of one line, raised before
any model loads; a file's decode is bounded in frames, pixels and seconds.
"""
import math
import os
import time
from dataclasses import dataclass

import numpy as np

from . import artifacts
from .image import ImageError, load_rgb, resize_lanczos
from .trace import check_npy_header

TEMPORAL_PATCH = 2        # frames per pair: transformers' temporal_patch_size; the GGUF's clip.vision.temporal_patch_size
UNKNOWN_FPS = 24.0        # sample_frames' default when the source's rate is unknown (:218-223)
MAX_FRAMES_READ = 100_000        # frames a source may hold: beyond, refused before decoding (an hour at 25 fps is 90k)
MAX_FRAME_PIXELS = 50_000_000    # per frame, as reference.image.MAX_PIXELS
MAX_TOTAL_BYTES = 8 << 30        # decoded uint8 frames held at once
DECODE_SECONDS = 600.0           # wall-clock bound on decoding one file
FRAME_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".tif", ".tiff", ".gif")


class VideoError(Exception):
    """A video that cannot be used; the message is one line naming the source and the problem."""

    def __init__(self, path, problem):
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


@dataclass(frozen=True)
class Video:
    frames: np.ndarray      # uint8 [T, H, W, 3], every frame of the source (or the decoded ones, see indices)
    fps: float | None       # the source's frame rate (None: unknown, sampled as 24)
    name: str               # for messages
    total: int = 0          # frames in the source (0: len(frames))


# ---------------------------------------------------------------------------------------------
# Sampling and timestamps

def linspace_f32(start, end, n):  # -> float32 [n]; torch.linspace on the CPU in float32
    """Two-sided, as torch's CPU kernel: start + step*i below n/2, end - step*(n-1-i) from there,
    each a fused multiply-add (exact product, one rounding; the float64 product of a float32 step
    and an index below 2^29 is exact)."""
    if n == 1:
        return np.array([start], np.float32)
    step = np.float64(np.float32(np.float32(end - start) / np.float32(n - 1)))
    i = np.arange(n, dtype=np.float64)
    low = (np.float64(start) + step * i).astype(np.float32)
    high = (np.float64(end) - step * (n - 1 - i)).astype(np.float32)
    return np.where(i < n // 2, low, high)


def sample_indices(total, source_fps, fps, max_frames, temporal=TEMPORAL_PATCH):  # -> int64 [n]
    """MuseGlimmerVideoProcessor.sample_frames: fps and max_frames apply together (a cap), the count
    rounded down to whole pairs, at least one pair, at most the source."""
    n = min(int(total * fps / (source_fps or UNKNOWN_FPS)), max_frames, total)
    n = max(temporal, (n // temporal) * temporal)
    n = min(n, total)
    return linspace_f32(0, total - 1, n).astype(np.int64)  # .long(): truncation


def pair_timestamps(indices, source_fps, temporal=TEMPORAL_PATCH):  # -> [seconds] of each pair's first frame
    """float32(index) / float32(fps), as a 0-d int64 tensor divided by a Python float; a pair made
    by padding repeats the last stamp (processing_muse_glimmer.py:90-94)."""
    n_pairs = -(-len(indices) // temporal)
    fps = np.float32(source_fps or UNKNOWN_FPS)
    stamps = [float(np.float32(i) / fps) for i in indices[::temporal]][:n_pairs]
    return stamps + stamps[-1:] * (n_pairs - len(stamps))


# ---------------------------------------------------------------------------------------------
# Resize and pixels

def smart_resize(height, width, unit, max_tokens):  # -> (rows, cols) in merged tokens
    """transformers' smart_resize as it runs: the candidates go through a set(), so an exact tie
    goes to whichever the set yields first (int and tuple hashes are not randomised); llama.cpp's
    image grid takes the larger one instead (reference.vision.grid_size)."""
    ideal_h, ideal_w = height / unit, width / unit
    ratio = ideal_w / ideal_h if ideal_h > 0 else 1.0
    if ideal_h * ideal_w > max_tokens:
        ideal_h = (max_tokens / ratio) ** 0.5
        ideal_w = ideal_h * ratio
    candidates = list({(a, b) for a in (math.floor(ideal_h), math.ceil(ideal_h))
                       for b in (math.floor(ideal_w), math.ceil(ideal_w))})
    candidates = [(a, b) for a, b in candidates if a >= 1 and b >= 1 and a * b <= max_tokens]
    if not candidates:
        candidates = [(max(1, round(ideal_h)), max(1, round(ideal_w)))]
    return min(candidates, key=lambda grid: abs(grid[0] / grid[1] - height / width))


def normalize(frames, mean, std):  # uint8 [..., 3] -> float32; (f32(u8) - 255 mean) / (255 std)
    """rescale fused into normalize: mean and std scaled by 1/rescale_factor = 255 in float32, then
    tvF.normalize's sub_ and div_ in float32."""
    scale = np.float32(255.0)
    mean = np.asarray(mean, np.float32) * scale
    std = np.asarray(std, np.float32) * scale
    return (frames.astype(np.float32) - mean) / std


@dataclass(frozen=True)
class Prepared:
    pairs: np.ndarray       # uint8 [n_pairs, 2, h, w, 3], resized, padded to whole pairs
    indices: np.ndarray     # int64 [n]: the source frames kept
    timestamps: list        # seconds per pair
    grid: tuple             # (rows, cols) of merged tokens per pair


def prepare(video, fps, max_frames, max_frame_tokens, unit):  # Video -> Prepared
    total = video.total or len(video.frames)
    indices = sample_indices(total, video.fps, fps, max_frames)
    frames = video.frames[indices] if not video.total else video.frames  # a decoded file holds only its kept frames
    rows, cols = smart_resize(frames.shape[1], frames.shape[2], unit, max_frame_tokens)
    resized = np.stack([resize_lanczos(f, cols * unit, rows * unit, int16=True) for f in frames])
    if len(resized) % TEMPORAL_PATCH:
        resized = np.concatenate([resized, resized[-1:].repeat(TEMPORAL_PATCH - len(resized) % TEMPORAL_PATCH, 0)])
    pairs = resized.reshape(-1, TEMPORAL_PATCH, *resized.shape[1:])
    return Prepared(pairs, indices, pair_timestamps(indices, video.fps), (rows, cols))


# ---------------------------------------------------------------------------------------------
# Sources

def check_layout(shape, dtype, name):  # -> None; VideoError unless uint8 [T, H, W, 3] of bounded size
    if len(shape) != 4 or shape[-1] != 3:
        raise VideoError(name, f"frames must be an array [T, H, W, 3], not {list(shape)}")
    if dtype != np.uint8:
        raise VideoError(name, f"frames must be uint8, not {dtype}")
    t, h, w, _ = shape
    if t == 0:
        raise VideoError(name, "the video has no frames")
    if h == 0 or w == 0:
        raise VideoError(name, f"frames of {w}x{h} pixels")
    if t > MAX_FRAMES_READ or h * w > MAX_FRAME_PIXELS or t * h * w * 3 > MAX_TOTAL_BYTES:
        raise VideoError(name, f"{t} frames of {w}x{h} is more than {MAX_FRAMES_READ} frames, {MAX_FRAME_PIXELS} "
                               f"pixels a frame or {MAX_TOTAL_BYTES >> 30} GiB")


def check_frames(frames, name):  # -> uint8 [T, H, W, 3]; VideoError for anything else
    if not isinstance(frames, np.ndarray):
        raise VideoError(name, f"frames must be an array [T, H, W, 3], not {type(frames).__name__}")
    check_layout(frames.shape, frames.dtype, name)
    return frames


def check_fps(fps, name):  # -> the rate, or None; VideoError unless positive and finite
    if fps is not None and not (math.isfinite(fps) and fps > 0):
        raise VideoError(name, f"a frame rate must be positive and finite, not {fps}")
    return fps


def load_npy(path, fps):  # -> Video of a .npy uint8 [T, H, W, 3]
    error = artifacts.path_error(VideoError, path)
    with artifacts.open_regular(path, error, what="video array") as f:
        try:
            check_npy_header(f, os.fstat(f.fileno()).st_size)  # a header cannot promise more than the file holds
            f.seek(0)
            frames = np.load(f, allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            raise VideoError(path, f"not a readable .npy array ({str(e).splitlines()[0][:120]})") from None
    return Video(check_frames(frames, path), check_fps(fps, path), path)


def load_frame_dir(path, fps):  # -> Video of the image files of a directory, in name order
    names = sorted(n for n in os.listdir(path) if n.lower().endswith(FRAME_SUFFIXES))
    if not names:
        raise VideoError(path, f"the directory holds no frame images ({', '.join(FRAME_SUFFIXES)})")
    if len(names) > MAX_FRAMES_READ:
        raise VideoError(path, f"{len(names)} frames is more than {MAX_FRAMES_READ}")
    frames, size = [], None
    for n in names:
        try:
            rgb = load_rgb(os.path.join(path, n))
        except ImageError as e:
            raise VideoError(path, f"frame {e}") from None
        if size is not None and rgb.shape != size:
            raise VideoError(path, f"frame {n} is {rgb.shape[1]}x{rgb.shape[0]}, the first {size[1]}x{size[0]}: "
                                   "frames must share one size")
        size = rgb.shape
        frames.append(rgb)
        if len(frames) * rgb.nbytes > MAX_TOTAL_BYTES:
            raise VideoError(path, f"{len(names)} frames of {size[1]}x{size[0]} need more than "
                                   f"{MAX_TOTAL_BYTES >> 30} GiB")
    return Video(check_frames(np.stack(frames), path), check_fps(fps, path), path)


def load_file(path, fps, keep):  # keep(total, fps) -> indices; -> Video of the kept frames of a video file
    """PyAV (FFmpeg) decodes the first video stream; the container's frame count and size are
    checked before decoding, and decoding stops at the last kept frame or DECODE_SECONDS."""
    try:
        import av
    except ModuleNotFoundError:
        raise VideoError(path, 'decoding a video file needs PyAV: pip install -e ".[video]"') from None
    start = time.monotonic()
    try:
        with av.open(path) as container:
            if not container.streams.video:
                raise VideoError(path, "has no video stream")
            stream = container.streams.video[0]
            rate = check_fps(fps if fps is not None else (float(stream.average_rate) if stream.average_rate else None), path)
            codec = stream.codec_context
            if codec is None or not (codec.width and codec.height):  # a file cut before its codec parameters
                raise VideoError(path, "has no decodable video stream (truncated?)")
            w, h = codec.width, codec.height
            if w * h > MAX_FRAME_PIXELS:
                raise VideoError(path, f"frames of {w}x{h} are more than {MAX_FRAME_PIXELS} pixels")
            total = stream.frames or count_frames(path, start)
            if total == 0:
                raise VideoError(path, "the video has no frames")
            if total > MAX_FRAMES_READ:
                raise VideoError(path, f"claims {total} frames, more than {MAX_FRAMES_READ}")
            wanted = keep(total, rate)
            if len(wanted) * w * h * 3 > MAX_TOTAL_BYTES:
                raise VideoError(path, f"{len(wanted)} frames of {w}x{h} need more than {MAX_TOTAL_BYTES >> 30} GiB")
            frames = decode_frames(container, stream, set(wanted.tolist()), int(wanted[-1]), path, start)
    except VideoError:
        raise
    except (av.error.FFmpegError, OSError, ValueError) as e:
        raise VideoError(path, f"cannot decode ({type(e).__name__}: {str(e).splitlines()[0][:160]})") from None
    got = [frames.get(i) for i in wanted.tolist()]
    if any(g is None for g in got):
        raise VideoError(path, f"decoded {len(frames)} of the {len(wanted)} frames it should hold (truncated?)")
    return Video(check_frames(np.stack(got), path), rate, path, total)


def count_frames(path, start):  # -> frames of the first video stream, counted by demuxing packets (no decode)
    import av
    n = 0
    with av.open(path) as container:
        for packet in container.demux(video=0):
            n += packet.size > 0
            if n > MAX_FRAMES_READ or time.monotonic() - start > DECODE_SECONDS:
                break
    return n


def decode_frames(container, stream, wanted, last, path, start):  # -> {index: uint8 [H, W, 3]}
    frames = {}
    for i, frame in enumerate(container.decode(stream)):
        if time.monotonic() - start > DECODE_SECONDS:
            raise VideoError(path, f"decoding took longer than {DECODE_SECONDS:.0f} s")
        if i in wanted:
            rgb = frame.to_ndarray(format="rgb24")
            if frames and rgb.shape != next(iter(frames.values())).shape:
                raise VideoError(path, f"frame {i} is {rgb.shape[1]}x{rgb.shape[0]}: frames must share one size")
            frames[i] = rgb
        if i >= last:
            break
    return frames


def load(path, fps=None, keep=None):  # -> Video; fps: the source's rate (--video-fps), keep for files
    """A directory of frames, a .npy [T, H, W, 3] uint8, or a video file (PyAV). For a file, only the
    frames `keep(total, rate)` selects are decoded."""
    path = os.fspath(path)
    check_fps(fps, path)
    if not os.path.exists(path):
        raise VideoError(path, "no such file or directory")
    if os.path.isdir(path):
        return load_frame_dir(path, fps)
    if path.lower().endswith(".npy"):
        return load_npy(path, fps)
    artifacts.check_regular(path, artifacts.path_error(VideoError, path), "video file")
    return load_file(path, fps, keep)
