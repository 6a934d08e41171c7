"""The configs of the three roles, read from a GGUF's metadata: every key llama.cpp reads, with
llama.cpp's defaults where a key is absent (docs/text.md, docs/vision.md, docs/dflash.md), each
checked where a bad value would make nonsense; the tokenizer's keys; the names of the video extension.
"""
import math
from dataclasses import dataclass, field

from gguf import GGUFValueType

from .reader import INT_TYPES, GGUFError


def swa_layers_from(meta, key, n_layer, default_period):  # -> tuple[bool] per layer
    """llama.cpp's load_swa_pattern: an array is copied (missing entries are full layers);
    a scalar period P (default 4 when absent) makes layer i SWA iff P == 0 or i % P < P - 1."""
    f = meta.reader.fields.get(key)
    if f is not None and f.types[0] == GGUFValueType.ARRAY:
        if f.types[-1] not in INT_TYPES | {GGUFValueType.BOOL}:
            raise GGUFError(meta.path, f"key {key} should be an array of bool or int")
        values = [bool(v) for v in f.value][:n_layer]
        return tuple(values + [False] * (n_layer - len(values)))
    period = meta.int(key, default=default_period)
    return tuple(period == 0 or (i % period) < period - 1 for i in range(n_layer))


# Token texts llama.cpp marks end-of-generation wherever they occur (llama-vocab.cpp, load).
# `<|eom|>` is not among them: it is EOG only when tokenizer.ggml.eom_token_id names it.
EOG_TOKEN_NAMES = frozenset([
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
])


@dataclass(frozen=True)
class TokenizerConfig:
    model: str
    pre: str
    tokens: list = field(repr=False)
    token_types: list = field(repr=False)
    merges: list = field(repr=False)
    bos: int
    eos: int
    eot: int
    eom: int
    pad: int
    mask: int
    add_bos: object        # True/False from the GGUF, None when absent (the pre-tokenizer decides)
    add_eos: bool
    chat_template: str = field(repr=False)

    @property
    def n_vocab(self):
        return len(self.tokens)

    @property
    def eog_ids(self):  # llama.cpp's end-of-generation set: EOS, EOT, EOM and its list of names
        named = {i for i, t in enumerate(self.tokens) if t in EOG_TOKEN_NAMES}
        return frozenset(named | {i for i in (self.eos, self.eot, self.eom) if i >= 0})


def read_tokenizer(meta):  # Metadata -> TokenizerConfig (ids are -1 where the key is absent)
    tokens = meta.array("tokenizer.ggml.tokens")
    if not tokens:
        raise GGUFError(meta.path, "missing required key tokenizer.ggml.tokens")
    n_vocab = len(tokens)

    def token_id(name):
        i = meta.int(f"tokenizer.ggml.{name}_token_id", default=-1)
        if i >= n_vocab:
            raise GGUFError(meta.path, f"tokenizer.ggml.{name}_token_id {i} is outside the vocabulary ({n_vocab})")
        return i

    token_types = meta.array("tokenizer.ggml.token_type", default=[1] * n_vocab)
    if len(token_types) != n_vocab:  # one type per token: the tokenizer looks them up by id
        raise GGUFError(meta.path, f"tokenizer.ggml.token_type has {len(token_types)} entries "
                                   f"for {n_vocab} tokens")
    return TokenizerConfig(
        model=meta.str("tokenizer.ggml.model", default="gpt2"),
        pre=meta.str("tokenizer.ggml.pre", default="default"),
        tokens=tokens, token_types=token_types,
        merges=meta.array("tokenizer.ggml.merges", default=[]),
        bos=token_id("bos"), eos=token_id("eos"), eot=token_id("eot"), eom=token_id("eom"),
        pad=token_id("padding"), mask=token_id("mask"),
        add_bos=meta.bool("tokenizer.ggml.add_bos_token", default=None),
        add_eos=meta.bool("tokenizer.ggml.add_eos_token", default=False),
        chat_template=meta.str("tokenizer.chat_template", default=""),
    )


@dataclass(frozen=True)
class TextConfig:
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int         # attention.key_length (128 on the release; n_embd/n_head would be 208)
    head_dim_v: int
    n_rot: int
    rope_base: float
    rope_base_swa: float  # rope.freq_base_swa, falling back to rope.freq_base (muse override)
    rms_eps: float
    n_swa: int
    swa_layers: tuple     # per layer: sliding-window attention and RoPE; full layers are NoPE
    logit_scale: float
    softcap: float        # 30.0 when absent (llama.cpp hparams default); 0 disables
    post_norm_eps: float = 1e-8  # hard-coded in llama.cpp's muse-glimmer graph, not a GGUF key


def read_text_config(meta):  # Metadata -> TextConfig
    a = lambda k: f"muse-glimmer.{k}"  # noqa: E731
    n_layer = meta.int(a("block_count"), required=True)
    n_embd = meta.int(a("embedding_length"), required=True)
    n_head = meta.int(a("attention.head_count"), required=True, per_layer=n_layer)
    n_head_kv = meta.int(a("attention.head_count_kv"), default=n_head, per_layer=n_layer)
    head_dim = meta.int(a("attention.key_length"), default=n_embd // max(n_head, 1))
    rope_base = meta.float(a("rope.freq_base"), default=10000.0)
    cfg = TextConfig(
        n_vocab=len(meta.array("tokenizer.ggml.tokens", default=[])),
        n_ctx_train=meta.int(a("context_length"), required=True),
        n_embd=n_embd, n_layer=n_layer,
        n_ff=meta.int(a("feed_forward_length"), required=True, per_layer=n_layer),
        n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim,
        head_dim_v=meta.int(a("attention.value_length"), default=n_embd // max(n_head, 1)),
        n_rot=meta.int(a("rope.dimension_count"), default=head_dim),
        rope_base=rope_base,
        rope_base_swa=meta.float(a("rope.freq_base_swa"), default=rope_base),
        rms_eps=meta.float(a("attention.layer_norm_rms_epsilon"), required=True),
        n_swa=meta.int(a("attention.sliding_window"), required=True),
        swa_layers=swa_layers_from(meta, a("attention.sliding_window_pattern"), n_layer, 4),
        logit_scale=meta.float(a("logit_scale"), required=True),
        softcap=meta.float(a("final_logit_softcapping"), default=30.0),
    )
    _validate_text(meta.path, cfg)
    return cfg


def _validate_text(path, c):
    if not (0 < c.n_layer <= 512 and 0 < c.n_embd and 0 < c.n_head and 0 < c.n_head_kv and 0 < c.n_ff):
        raise GGUFError(path, f"implausible sizes: n_layer={c.n_layer} n_embd={c.n_embd} "
                              f"n_head={c.n_head} n_head_kv={c.n_head_kv} n_ff={c.n_ff}")
    if c.n_head % c.n_head_kv:
        raise GGUFError(path, f"head_count {c.n_head} is not a multiple of head_count_kv {c.n_head_kv}")
    if c.head_dim != c.head_dim_v or c.n_rot != c.head_dim or c.head_dim % 2:
        raise GGUFError(path, f"unsupported head geometry: key_length={c.head_dim} "
                              f"value_length={c.head_dim_v} rope.dimension_count={c.n_rot}")
    if c.n_vocab == 0:
        raise GGUFError(path, "the vocabulary (tokenizer.ggml.tokens) is empty")
    if not any(c.swa_layers):
        raise GGUFError(path, "sliding_window_pattern has no sliding-window layer "
                              "(llama.cpp aborts on such a model)")
    if c.n_swa <= 0:
        raise GGUFError(path, f"sliding_window must be positive, not {c.n_swa}")
    for key, value in (("attention.layer_norm_rms_epsilon", c.rms_eps), ("rope.freq_base", c.rope_base),
                       ("rope.freq_base_swa", c.rope_base_swa), ("logit_scale", c.logit_scale)):
        _check_positive(path, f"muse-glimmer.{key}", value)
    if not (math.isfinite(c.softcap) and c.softcap >= 0):
        raise GGUFError(path, f"muse-glimmer.final_logit_softcapping must be finite and not negative "
                              f"(0 turns it off), not {c.softcap}")


def _check_positive(path, key, value):  # an epsilon, a RoPE base, a scale: 0, < 0, inf or nan make nan or nonsense
    if not (math.isfinite(value) and value > 0):
        raise GGUFError(path, f"{key} must be positive and finite, not {value}")


# The video extension (tools/video_mmproj.py; docs/vision.md, Video): names fixed for every reader and writer.
PATCH_EMBD_T1 = "v.patch_embd.weight.t1"  # the second frame's kernel half W1; v.patch_embd.weight keeps W0 + W1
TEMPORAL_PATCH_SIZE = "clip.vision.temporal_patch_size"
VIDEO_FPS = "clip.vision.video.fps"
VIDEO_MAX_FRAMES = "clip.vision.video.max_frames"
VIDEO_MAX_FRAME_TOKENS = "clip.vision.video.max_frame_tokens"
VIDEO_TIMESTAMP_FORMAT = "clip.vision.video.timestamp_format"
# MuseGlimmerVideoProcessor's class defaults (transformers/models/muse_glimmer/video_processing_muse_glimmer.py:96-115)
VIDEO_DEFAULTS = {"fps": 2.0, "max_frames": 96, "max_frame_tokens": 144, "timestamp_format": "Time: {timestamp:.1f}s"}


@dataclass(frozen=True)
class VisionConfig:
    image_size: int
    patch_size: int
    n_embd: int
    n_ff: int
    n_layer: int
    n_head: int
    layer_norm_eps: float
    merge_size: int
    image_mean: tuple
    image_std: tuple
    projection_dim: int
    rope_theta: float = 10000.0     # hard-coded in llama.cpp's clip.cpp, not a key
    sparse_factor: int = 4          # every 4th tower layer attends globally (clip.cpp)
    temporal_patch_size: int = 0    # 0: no video extension
    video: dict = field(default_factory=lambda: dict(VIDEO_DEFAULTS))  # fps, max_frames, max_frame_tokens, timestamp_format

    @property
    def head_dim(self):
        return self.n_embd // self.n_head


def read_vision_config(meta):  # Metadata -> VisionConfig
    projector = meta.str("clip.projector_type", required=True)
    if projector != "muse-glimmer":
        raise GGUFError(meta.path, f"clip.projector_type is {projector!r}, not 'muse-glimmer'")
    if not meta.bool("clip.has_vision_encoder", default=False):
        raise GGUFError(meta.path, "mmproj has no vision encoder (clip.has_vision_encoder)")
    v = lambda k: f"clip.vision.{k}"  # noqa: E731
    cfg = VisionConfig(
        image_size=meta.int(v("image_size"), required=True),
        patch_size=meta.int(v("patch_size"), required=True),
        n_embd=meta.int(v("embedding_length"), required=True),
        n_ff=meta.int(v("feed_forward_length"), required=True),
        n_layer=meta.int(v("block_count"), required=True),
        n_head=meta.int(v("attention.head_count"), required=True),
        layer_norm_eps=meta.float(v("attention.layer_norm_epsilon"), default=1e-6),
        merge_size=meta.int(v("spatial_merge_size"), default=2),
        image_mean=tuple(meta.array(v("image_mean"), default=[0.5, 0.5, 0.5])),
        image_std=tuple(meta.array(v("image_std"), default=[0.5, 0.5, 0.5])),
        projection_dim=meta.int(v("projection_dim"), default=0),
        temporal_patch_size=meta.int(TEMPORAL_PATCH_SIZE, default=0),
        video={"fps": meta.float(VIDEO_FPS, default=VIDEO_DEFAULTS["fps"]),
               "max_frames": meta.int(VIDEO_MAX_FRAMES, default=VIDEO_DEFAULTS["max_frames"]),
               "max_frame_tokens": meta.int(VIDEO_MAX_FRAME_TOKENS, default=VIDEO_DEFAULTS["max_frame_tokens"]),
               "timestamp_format": meta.str(VIDEO_TIMESTAMP_FORMAT, default=VIDEO_DEFAULTS["timestamp_format"])},
    )
    if cfg.temporal_patch_size not in (0, 2):
        raise GGUFError(meta.path, f"{TEMPORAL_PATCH_SIZE} is {cfg.temporal_patch_size}; the tower pairs frames (2)")
    if not (cfg.video["fps"] > 0 and math.isfinite(cfg.video["fps"]) and cfg.video["max_frames"] > 0
            and cfg.video["max_frame_tokens"] > 0):
        raise GGUFError(meta.path, f"implausible video defaults {cfg.video}")
    if not (0 < cfg.n_layer <= 512 and cfg.n_head > 0 and cfg.n_embd % cfg.n_head == 0 and cfg.patch_size > 0):
        raise GGUFError(meta.path, f"implausible vision sizes: layers={cfg.n_layer} width={cfg.n_embd} "
                                   f"heads={cfg.n_head} patch={cfg.patch_size}")
    _check_positive(meta.path, v("attention.layer_norm_epsilon"), cfg.layer_norm_eps)
    for key, values in (("image_mean", cfg.image_mean), ("image_std", cfg.image_std)):
        if len(values) != 3 or not all(math.isfinite(x) for x in values):
            raise GGUFError(meta.path, f"{v(key)} must be 3 finite numbers (R, G, B), not {list(values)}")
    for x in cfg.image_std:  # pixels are divided by it
        _check_positive(meta.path, v("image_std"), x)
    return cfg


@dataclass(frozen=True)
class DraftConfig:
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    rope_base: float
    rms_eps: float
    block_size: int
    target_layers: tuple  # GGUF convention: the *input* of each target layer (HF ids + 1)
    n_swa: int
    swa_layers: tuple
    mask_token: int
    n_ctx_train: int


def read_draft_config(meta):  # Metadata -> DraftConfig
    a = lambda k: f"dflash.{k}"  # noqa: E731
    n_layer = meta.int(a("block_count"), required=True)
    n_embd = meta.int(a("embedding_length"), required=True)
    n_head = meta.int(a("attention.head_count"), required=True, per_layer=n_layer)
    n_swa = meta.int(a("attention.sliding_window"), default=0)
    target_layers = meta.array(a("target_layers"))
    if not target_layers:
        raise GGUFError(meta.path, "missing required key dflash.target_layers")
    cfg = DraftConfig(
        n_embd=n_embd, n_layer=n_layer,
        n_ff=meta.int(a("feed_forward_length"), required=True, per_layer=n_layer),
        n_head=n_head,
        n_head_kv=meta.int(a("attention.head_count_kv"), default=n_head, per_layer=n_layer),
        head_dim=meta.int(a("attention.key_length"), default=n_embd // max(n_head, 1)),
        rope_base=meta.float(a("rope.freq_base"), default=10000.0),
        rms_eps=meta.float(a("attention.layer_norm_rms_epsilon"), required=True),
        block_size=meta.int(a("block_size"), default=16),
        target_layers=tuple(int(x) for x in target_layers),
        n_swa=n_swa,
        swa_layers=(swa_layers_from(meta, a("attention.sliding_window_pattern"), n_layer, 4)
                    if n_swa > 0 else (False,) * n_layer),
        mask_token=meta.int("tokenizer.ggml.mask_token_id", default=-1),
        n_ctx_train=meta.int(a("context_length"), default=0),
    )
    if not (0 < cfg.n_layer <= 512 and cfg.n_head > 0 and cfg.n_head_kv > 0 and cfg.n_head % cfg.n_head_kv == 0):
        raise GGUFError(meta.path, f"implausible drafter sizes: layers={cfg.n_layer} heads={cfg.n_head}/{cfg.n_head_kv}")
    _check_positive(meta.path, a("attention.layer_norm_rms_epsilon"), cfg.rms_eps)
    _check_positive(meta.path, a("rope.freq_base"), cfg.rope_base)
    return cfg
