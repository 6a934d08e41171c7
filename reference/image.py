"""Image files to uint8 RGB, and the uint8 Lanczos-3 resize llama.cpp's mtmd uses (docs/vision.md).

Decoding follows llama.cpp (stb_image forced to 3 channels), not transformers:
- alpha is dropped, not composited (`alpha="white"` composites on white as transformers does);
- gray is replicated to 3 channels; 16-bit samples keep their high byte (stb's 16 -> 8 rule);
- a palette image becomes its palette colours; CMYK goes through Pillow's CMYK -> RGB;
- EXIF orientation is ignored, as llama.cpp ignores it (transformers' load_image transposes).
Pixels are exact for lossless formats (PNG, BMP, ...). JPEG decoders differ (stb's IDCT and chroma
upsampling are not libjpeg's), so a JPEG's pixels can differ from llama.cpp's by a few levels.
Pillow reads more formats than stb (WebP, TIFF); llama.cpp refuses those, the reference reads them.
"""
import os
import warnings

import numpy as np
from PIL import Image

from . import artifacts

# Refuse an image before decoding it when its header promises more pixels than this (a
# decompression bomb); 50 MP is an 8K x 6K photo, far above anything the 4096-token cap keeps.
MAX_PIXELS = 50_000_000
LANCZOS_SUPPORT = 3.0
PRECISION_BITS = 22  # Pillow's fixed point: 32 bits - 8 for the pixel - 2 of headroom


class ImageError(Exception):
    """An image that cannot be used; the message is one line naming the file and the problem."""

    def __init__(self, path, problem):
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


def load_rgb(path, alpha="drop"):  # path -> uint8 [H, W, 3]
    path = os.fspath(path)
    # a FIFO or device is refused by name before Pillow's read could block or never end
    with artifacts.open_regular(path, artifacts.path_error(ImageError, path), what="image") as f:
        return decode_rgb(f, path, alpha)


def decode_rgb(f, name, alpha="drop"):  # a binary file object, its name for messages -> uint8 [H, W, 3]
    if alpha not in ("drop", "white"):
        raise ValueError("alpha must be 'drop' (llama.cpp) or 'white' (transformers)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(f) as img:
                w, h = img.size
                if w * h > MAX_PIXELS:
                    raise ImageError(name, f"{w}x{h} pixels is more than the {MAX_PIXELS} allowed "
                                           "(decompression bomb?)")
                img.load()
                try:
                    return to_rgb(img, alpha)
                except ValueError as e:  # a file whose pixels have no RGB form here (mode F)
                    raise ImageError(name, f"cannot convert to RGB ({e})") from None
    except ImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageError(name, f"refused as a decompression bomb ({e})") from None
    except Image.UnidentifiedImageError:
        raise ImageError(name, "not an image file Pillow can identify") from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:  # truncated or corrupt data
        raise ImageError(name, f"cannot decode ({type(e).__name__}: {e})") from None


def to_rgb(img, alpha="drop"):  # PIL image -> uint8 [H, W, 3]; ValueError for a mode it cannot take
    if alpha not in ("drop", "white"):
        raise ValueError("alpha must be 'drop' (llama.cpp) or 'white' (transformers)")
    mode = img.mode
    if mode in ("I;16", "I;16B", "I;16L", "I"):
        # 16-bit gray (Pillow's "I" for PNG): stb keeps the high byte; Pillow's own
        # convert("L") would clip at 255 instead.
        gray = (np.asarray(img).astype(np.int64) >> 8).clip(0, 255).astype(np.uint8)
        return np.repeat(gray[..., None], 3, axis=2)
    if mode == "F":
        # stb_image, which llama.cpp decodes with, reads 8- and 16-bit samples only
        raise ValueError("floating-point pixels (mode F) are not supported")
    has_alpha = "A" in img.getbands() or img.info.get("transparency") is not None
    if has_alpha and alpha == "white":
        # the same Pillow calls as transformers' convert_to_rgb, so the pixels are its pixels
        white = Image.new("RGBA", img.size, (255, 255, 255, 255))
        return np.asarray(Image.alpha_composite(white, img.convert("RGBA")).convert("RGB"))
    if mode in ("1", "L", "LA", "La"):
        gray = np.asarray(img.convert("L"))
        return np.repeat(gray[..., None], 3, axis=2)
    # P (palette colours, transparency dropped), RGB, RGBA (alpha dropped), CMYK, YCbCr, ...
    return np.ascontiguousarray(np.asarray(img.convert("RGBA" if mode == "P" else "RGB"))[..., :3])


# ---------------------------------------------------------------------------------------------
# Resize: Pillow 11.3's uint8 resampling as ported by llama.cpp (mtmd-image.cpp resize_pillow)

def lanczos(x):  # x [...] float64 -> [...]; sinc(x) sinc(x/3) on [-3, 3)
    def sinc(v):
        safe = np.where(v == 0.0, 1.0, v)
        return np.where(v == 0.0, 1.0, np.sin(np.pi * safe) / (np.pi * safe))
    return np.where((x >= -LANCZOS_SUPPORT) & (x < LANCZOS_SUPPORT), sinc(x) * sinc(x / 3.0), 0.0)


def resample_weights(in_size, out_size, int16=False):  # -> first tap [out], fixed-point weights int64 [out, ksize], bits
    """Per output pixel: the first input pixel it reads and its taps' weights, normalised to sum 1
    in float64, then rounded to fixed point (+-0.5, truncated toward 0). Pillow (int16=False) uses 22
    bits. torch's uint8 antialiased resize (int16=True; aten's _compute_index_ranges_int16_weights)
    scales the tap offsets by 1/scale rather than dividing by it and takes, per pass, the fewest bits
    p < 22 at which the largest weight reaches 2^15 in p + 1 bits, so the weights fit int16."""
    scale = in_size / out_size
    filter_scale = max(scale, 1.0)  # downscaling widens the kernel (anti-aliasing)
    support = LANCZOS_SUPPORT * filter_scale
    ksize = int(np.ceil(support)) * 2 + 1
    centers = (np.arange(out_size) + 0.5) * scale
    # C's (int) truncates toward zero; the clamp at 0 makes that a floor for every kept value
    xmin = np.maximum(np.trunc(centers - support + 0.5), 0).astype(np.int64)
    xmax = np.minimum(np.trunc(centers + support + 0.5), in_size).astype(np.int64)
    taps = np.arange(ksize)
    live = taps[None, :] < (xmax - xmin)[:, None]
    offsets = taps[None, :] + xmin[:, None] - centers[:, None] + 0.5
    w = np.where(live, lanczos(offsets * (1.0 / filter_scale) if int16 else offsets / filter_scale), 0.0)
    total = w.sum(axis=1, keepdims=True)
    w = np.where(total != 0.0, w / np.where(total != 0.0, total, 1.0), w)
    bits = PRECISION_BITS
    if int16:
        peak = w.max()
        bits = next((p for p in range(PRECISION_BITS) if int(0.5 + peak * (1 << (p + 1))) >= 1 << 15), PRECISION_BITS)
    fixed = np.trunc(w * (1 << bits) + np.where(w < 0, -0.5, 0.5)).astype(np.int64)
    return xmin, fixed, bits


def resample_axis(img, out_size, axis, int16=False):  # uint8 [H, W, 3], axis 0 (rows) or 1 (columns) -> uint8
    """One separable pass: integer accumulation from a 0.5 rounding bias, arithmetic shift (a floor),
    clamp to [0, 255]. Values stay below 2^31, so int64 gives exactly C's int32 sums."""
    in_size = img.shape[axis]
    first, weights, bits = resample_weights(in_size, out_size, int16)
    src = np.moveaxis(img, axis, 0)
    acc = np.full((out_size,) + src.shape[1:], 1 << (bits - 1), np.int64)
    for k in range(weights.shape[1]):
        idx = np.minimum(first + k, in_size - 1)  # taps past the kernel end have weight 0
        acc += src[idx].astype(np.int64) * weights[:, k].reshape((-1,) + (1,) * (src.ndim - 1))
    out = np.clip(acc >> bits, 0, 255).astype(np.uint8)
    return np.ascontiguousarray(np.moveaxis(out, 0, axis))


def resize_lanczos(img, width, height, int16=False):  # uint8 [H, W, 3] -> uint8 [height, width, 3]
    """Horizontal pass first, then vertical, with a uint8 image in between (Pillow 11.3, llama.cpp
    and torch's uint8 path; Pillow 13 runs the vertical pass first when the width grows and the
    height shrinks). A pass whose size does not change is skipped. int16: torch's weights
    (resample_weights), which transformers' video processor runs through torchvision."""
    if not (0 < width <= 65536 and 0 < height <= 65536):
        raise ValueError(f"resize target {width}x{height} is out of range")
    if img.shape[1] != width:
        img = resample_axis(img, width, 1, int16)
    if img.shape[0] != height:
        img = resample_axis(img, height, 0, int16)
    return img
