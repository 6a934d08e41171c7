"""The Muse-Glimmer text forward resident on the device (reference/text.py's math, as kernels):
weights as raw GGUF blocks, the KV cache (uniform, or the persistent SWA ring) in device memory,
and one fixed sequence of launches per step, which a decode step captures once as a CUDA graph and
replays for every token.

What changes from one step to the next lives in small device buffers the graph reads: the input
rows, [key count, positions], and the RoPE cos/sin of the positions (ops.rope_angles' float32
angles, taken on the host as the reference takes them). The launch sequence depends only on the
number of tokens T, so a step of T tokens (T <= GRAPH_MAX_TOKENS: decode, draft verification) is
one graph per (cache, T) bucket; longer prefill chunks run the same launches eagerly.

Per layer (13 launches; norms fused with the residual adds around them):
    u = rms(x) * attn_norm                     residual_norm (fused with the previous layer's end)
    q|k|v, gate = u Wqkv, u Wgate              linear x 2..4
    q, K, V -> rope(rms_h(q|k) * norm), cache  qk_norm_rope_store
    o = attn(q, cache) * sigmoid(gate)         attention_cache
    a = o Wo                                   linear
    x += rms(a) * post_attn; u = rms(x) * ffn  residual_norm
    f = swiglu(u Wg, u Wu) Wd                  linear x 2, swiglu, linear
    x += rms(f) * post_ffw; u = next norm      residual_norm
"""
import numpy as np

from reference import ops
from reference.kv import KVCache
from reference.text import TextModel
from reference.trace import NO_TRACE, point

from . import launch

GRAPH_MAX_TOKENS = 8


class DeviceLayerCache:
    """One layer's cache rows on the device: k/v [rows, Hkv, D] float32, pos int32 [rows] (-1 = empty)."""

    def __init__(self, rt, rows, n_head_kv, head_dim):
        self.rows = rows
        self.k = rt.zeros((rows, n_head_kv, head_dim))
        self.v = rt.zeros((rows, n_head_kv, head_dim))
        self.pos = rt.full((rows,), -1, np.int32)


class DeviceKVCache(KVCache):
    """reference/kv.py KVCache with its rows on the device (same row counts, same ring slots);
    `graphs` holds the decode graphs captured against these buffers."""

    def __init__(self, rt, n_layer, swa_layers, n_swa, n_ctx, n_head_kv, head_dim, kind="ring", chunk=2048):
        self.rt = rt  # new_layer, which KVCache.__init__ calls, allocates on it
        super().__init__(n_layer, swa_layers, n_swa, n_ctx, n_head_kv, head_dim, np.float32, kind, chunk)
        self.graphs = {}  # T -> graph

    def new_layer(self, rows, n_head_kv, head_dim, dtype):  # -> DeviceLayerCache (float32, as the kernels are)
        return DeviceLayerCache(self.rt, rows, n_head_kv, head_dim)

    def truncate(self, n_keep):  # keep positions [0, n_keep)
        for layer in self.layers:
            launch.truncate_positions(self.rt, layer, n_keep)
        self.n_past = min(self.n_past, n_keep)


class StepBuffers:
    """Every device array one step of T tokens reads or writes (cfg: the model's TextConfig)."""

    def __init__(self, rt, cfg, T):
        E, F, D = cfg.n_embd, cfg.n_ff, cfg.head_dim
        nq, nkv = cfg.n_head * D, cfg.n_head_kv * D
        self.T = T
        self.rows = rt.empty((T, E))                 # input embeddings (token or image rows)
        self.step = rt.zeros((1 + T,), np.int32)     # key count, then the positions
        self.cos, self.sin = rt.empty((T, D // 2)), rt.empty((T, D // 2))
        self.x, self.u = rt.empty((T, E)), rt.empty((T, E))
        self.qkv = rt.empty((T, nq + 2 * nkv))      # separate q/k/v products write its column views
        self.q, self.k, self.v = self.qkv[:, :nq], self.qkv[:, nq:nq + nkv], self.qkv[:, nq + nkv:]
        self.gate, self.q_rope, self.attn = rt.empty((T, nq)), rt.empty((T, nq)), rt.empty((T, nq))
        self.a = rt.empty((T, E))
        self.ffn_gate, self.ffn_up, self.ffn_act = rt.empty((T, F)), rt.empty((T, F)), rt.empty((T, F))
        self.f = rt.empty((T, E))
        self.raw_logits, self.logits = rt.empty((T, cfg.n_vocab)), rt.empty((T, cfg.n_vocab))


class Recorder:
    """Trace points of an eager step (a drafter's target layer inputs among them), copied to the
    host as they are made, those the trace wants only. The inactive recorder of a captured step
    allocates and copies nothing."""

    def __init__(self, rt, trace=NO_TRACE):
        self.rt, self.trace = rt, trace

    def buffer(self, shape):  # a device array for a kernel's optional trace output, or None
        return self.rt.empty(shape) if self.trace.enabled else None

    def __call__(self, name, dev, shape=None):
        if self.trace.wants(name):
            self.trace(name, self.rt.to_host(dev).reshape(shape or dev.shape))


class DeviceTextModel(TextModel):
    """A TextModel whose forward runs on the device when given a DeviceKVCache (new_cache makes
    one); with a reference KVCache (TextModel.new_cache) it is TextModel's per-op path through the
    backend. The device step's own methods are named device_*, so none of them replaces one of
    TextModel's that the per-op path calls."""

    def __init__(self, gguf_model, dtype, backend):
        super().__init__(gguf_model, dtype, backend)
        c = self.cfg
        if c.n_rot != c.head_dim:
            raise ValueError(f"rope.dimension_count {c.n_rot} != head size {c.head_dim}: not supported on the device")
        launch.check_head_dim(c.head_dim)
        self.rt = backend.rt
        self.steps = {}  # T -> StepBuffers, for T <= GRAPH_MAX_TOKENS
        self.use_graphs = True  # False runs every step eagerly (the harness compares the two)

    def new_cache(self, n_ctx, kind="ring", chunk=2048):  # -> DeviceKVCache for one sequence
        c = self.cfg
        return DeviceKVCache(self.rt, c.n_layer, c.swa_layers, c.n_swa, n_ctx, c.n_head_kv, c.head_dim, kind, chunk)

    def buffers(self, T):  # -> StepBuffers for T tokens (kept for the graph sizes)
        if T in self.steps:
            return self.steps[T]
        s = StepBuffers(self.rt, self.cfg, T)
        if T <= GRAPH_MAX_TOKENS:
            self.steps[T] = s
        return s

    def forward(self, embeddings, positions, cache, trace=NO_TRACE, progress=None, out_rows=None):
        """embeddings [T, E], positions [T] -> logits [T, V] (or the rows out_rows), as TextModel.forward."""
        if not isinstance(cache, DeviceKVCache):
            return super().forward(embeddings, positions, cache, trace, progress, out_rows)
        positions = np.asarray(positions)
        T = len(positions)
        s = self.buffers(T)
        theta = ops.rope_angles(positions, self.cfg.n_rot, self.cfg.rope_base_swa, np.float32)
        self.rt.copy_in(s.rows, embeddings.astype(np.float32, copy=False))
        self.rt.copy_in(s.step, np.concatenate([[positions.max() + 1], positions]).astype(np.int32))
        self.rt.copy_in(s.cos, np.cos(theta))
        self.rt.copy_in(s.sin, np.sin(theta))
        if trace.enabled or T > GRAPH_MAX_TOKENS or not self.use_graphs:
            self.device_step(s, cache, Recorder(self.rt, trace))
        else:
            if T not in cache.graphs:
                self.upload()  # nothing may be copied to the device while a stream captures
                cache.graphs[T] = self.rt.capture(lambda: self.device_step(s, cache, Recorder(self.rt)))
            cache.graphs[T].replay()
        cache.n_past = max(cache.n_past, int(positions.max()) + 1)
        logits = self.rt.to_host(s.logits)
        return logits if out_rows is None else logits[out_rows]

    def upload(self):  # every matrix and vector a step reads -> device (once; later calls find them there)
        t = self.tensors  # token_embd stays on the host, which looks up the input rows
        for w in (t.output_norm, t.output, *(w for layer in self.layers for w in layer if w is not None)):
            if len(w.shape) == 2:
                self.device_matrix(w)
            else:
                self.device_vector(w)

    def device_matrix(self, w):  # gguf.Tensor -> the DeviceTensor of a matrix
        t = self.backend.tensor(w)
        if t is None:
            raise ValueError(f"tensor {w.name} ({w.type_name}) has no device kernel")
        return t

    def device_vector(self, w):  # gguf.Tensor -> device float32 [n]: a norm weight or a bias
        return self.backend.vector(w)

    def device_linear(self, x, w, y):  # device x [T, in], gguf.Tensor -> y [T, out]
        launch.linear(self.rt, x, self.device_matrix(w), y, self.backend.tables)

    def device_step(self, s, cache, rec):  # the launches of one step: s.rows, s.step, s.cos/sin -> s.logits
        c, rt = self.cfg, self.rt
        launch.residual_norm(rt, s.rows, None, c.rms_eps, None, s.x, self.device_vector(self.layers[0].attn_norm),
                             c.rms_eps, s.u)
        rec("embd_norm", s.x)
        rec(point("attn_norm", 0), s.u)
        for il, layer in enumerate(self.layers):
            self.device_attention(il, s, cache, rec)
            a_normed = rec.buffer((s.T, c.n_embd))
            launch.residual_norm(rt, s.a, self.device_vector(layer.post_attention_norm), c.post_norm_eps,
                                 s.x, s.x, self.device_vector(layer.ffn_norm), c.rms_eps, s.u, a_normed)
            rec(point("attn_post_norm", il), a_normed)
            rec(point("ffn_inp", il), s.x)
            rec(point("ffn_norm", il), s.u)
            self.device_linear(s.u, layer.ffn_gate, s.ffn_gate)
            self.device_linear(s.u, layer.ffn_up, s.ffn_up)
            launch.elementwise(rt, "swiglu_flat", s.ffn_act, s.ffn_gate, s.ffn_up)
            self.device_linear(s.ffn_act, layer.ffn_down, s.f)
            rec(point("ffn_out", il), s.f)
            last = il == c.n_layer - 1
            f_normed = rec.buffer((s.T, c.n_embd))
            next_norm = self.tensors.output_norm if last else self.layers[il + 1].attn_norm
            launch.residual_norm(rt, s.f, self.device_vector(layer.post_ffw_norm), c.post_norm_eps, s.x, s.x,
                                 self.device_vector(next_norm), c.rms_eps, s.u, f_normed)
            rec(point("ffn_post_norm", il), f_normed)
            rec(point("l_out", il), s.x)
            rec("result_norm" if last else point("attn_norm", il + 1), s.u)
        self.device_linear(s.u, self.tensors.output, s.raw_logits)
        launch.scale_softcap(rt, s.raw_logits, np.float32(c.logit_scale), c.softcap, s.logits)
        rec("result_output", s.logits)

    def device_attention(self, il, s, cache, rec):  # s.u -> s.a (before the post-attention norm)
        c, rt, layer = self.cfg, self.rt, self.layers[il]
        T, H, Hkv, D, swa = s.T, c.n_head, c.n_head_kv, c.head_dim, c.swa_layers[il]
        if layer.attn_qkv is not None:  # its product fills s.qkv, of which s.q, s.k and s.v are column views
            self.device_linear(s.u, layer.attn_qkv, s.qkv)
        else:
            for w, y in ((layer.attn_q, s.q), (layer.attn_k, s.k), (layer.attn_v, s.v)):
                self.device_linear(s.u, w, y)
        for bias, y in ((layer.attn_q_bias, s.q), (layer.attn_k_bias, s.k), (layer.attn_v_bias, s.v)):
            if bias is not None:
                launch.add_bias(rt, y, self.device_vector(bias))
        rec(point("Qcur", il), s.q, (T, H, D))
        rec(point("Kcur", il), s.k, (T, Hkv, D))
        rec(point("Vcur", il), s.v, (T, Hkv, D))
        self.device_linear(s.u, layer.attn_gate, s.gate)
        rec(point("attn_gate_proj", il), s.gate)
        layer_cache = cache.layers[il]
        q_normed, k_normed = rec.buffer((T, H, D)), rec.buffer((T, Hkv, D))
        k_roped = rec.buffer((T, Hkv, D)) if swa else None
        launch.qk_norm_rope_store(rt, s.q, s.k, s.v, self.device_vector(layer.attn_q_norm),
                                  self.device_vector(layer.attn_k_norm), c.rms_eps, s.cos if swa else None,
                                  s.sin if swa else None, s.step, H, Hkv, D, s.q_rope, layer_cache, q_normed, k_normed,
                                  k_roped)
        rec(point("Qcur_normed", il), q_normed)
        rec(point("Kcur_normed", il), k_normed)
        if swa:
            rec(point("Qcur_rope", il), s.q_rope, (T, H, D))
            rec(point("Kcur_rope", il), k_roped)
        attn_out, gate_sig = rec.buffer((T, H * D)), rec.buffer((T, H * D))
        kq_scale = np.float32(1) / np.sqrt(np.float32(D))  # llama.cpp's 1.0f/sqrtf(head_dim), as reference/text.py
        launch.attention_cache(rt, s.q_rope, layer_cache, s.step, H, Hkv, D, c.n_swa if swa else 0, kq_scale, s.gate,
                               s.attn, attn_out, gate_sig)
        rec(point("attn_out", il), attn_out)
        rec(point("attn_gate_sig", il), gate_sig)
        rec(point("attn_gated", il), s.attn)
        self.device_linear(s.attn, layer.attn_output, s.a)
        rec(point("attn_o_proj", il), s.a)
