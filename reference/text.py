"""The Muse-Glimmer language model forward, as llama.cpp computes it from a GGUF (docs/text.md, The forward).

    x = rms(E[t])                                      weightless embedding norm
    per layer:  h = rms(x) * attn_norm
                q, k, v, g = h Wq, h Wk, h Wv, h Wgate
                q, k = rms_h(q) * q_norm, rms_h(k) * k_norm      (3.87 already folded into q_norm)
                q, k = rope_norm(q), rope_norm(k)      only on sliding-window layers (full ones are NoPE)
                x += rms(((attn(q, k, v) * sigmoid(g)) Wo), 1e-8) * post_attention_norm
                x += rms(swiglu(u Wgate, u Wup) Wdown, 1e-8) * post_ffw_norm,   u = rms(x) * ffn_norm
    logits = softcap(rms(x) * output_norm Wout * logit_scale)

TextModel.forward follows llama.cpp's graph (src/models/muse-glimmer.cpp) line by line, with its
callback names (trace.TEXT_POINTS). The GGUF has already folded in what transformers applies at run
time (norm +1, qk_scale_factor, the rotate_half row order): nothing of it is applied again here.
"""
import numpy as np

from . import ops
from .backend import NumpyBackend
from .kv import KVCache
from .trace import NO_TRACE, layer_range, point


class Blocks:
    """What a stack of decoder layers computes with: its GGUF tensors, resolved at load into
    `tensors` (`layers[il].ffn_up`, ...), through its backend. Shared by the text model and the
    DFlash drafter, whose FFN is the text model's without the post-norm."""

    def __init__(self, gguf_model, dtype, backend):
        self.tensors = gguf_model.tensors
        self.layers = gguf_model.tensors.layers
        self.dtype = np.dtype(dtype)
        self.backend = backend or NumpyBackend(self.dtype)

    def norm_weight(self, w):  # gguf.Tensor [n] -> [n]
        return w.get(self.dtype)

    def norm(self, x, w, eps):  # x [..., n], w a norm weight [n] -> rms(x) * weight [n]
        return self.backend.rms_norm(x, eps) * self.norm_weight(w)

    def linear(self, x, w):  # x [T, in], w this model's tensor [out, in] -> [T, out]
        return self.backend.linear(x, w)

    def ffn(self, il, x, eps, trace):  # x [T, E] -> [T, E]: swiglu(u Wgate, u Wup) Wdown, u = rms(x) * ffn_norm
        layer = self.layers[il]
        u = self.norm(x, layer.ffn_norm, eps)
        trace(point("ffn_norm", il), u)
        f = self.backend.swiglu(self.linear(u, layer.ffn_gate), self.linear(u, layer.ffn_up))
        f = self.linear(f, layer.ffn_down)
        trace(point("ffn_out", il), f)
        return f


class TextModel(Blocks):
    def __init__(self, gguf_model, dtype=np.float32, backend=None):
        super().__init__(gguf_model, dtype, backend)
        self.cfg = gguf_model.config
        self.tokenizer = gguf_model.tokenizer

    def new_cache(self, n_ctx, kind="ring", chunk=2048):  # -> KVCache for one sequence
        c = self.cfg
        return KVCache(c.n_layer, c.swa_layers, c.n_swa, n_ctx, c.n_head_kv, c.head_dim,
                       self.dtype, kind, chunk)

    def embed(self, token_ids):  # [T] -> [T, E], the raw rows of token_embd
        return self.tensors.token_embd.rows(token_ids, self.dtype)

    def forward(self, embeddings, positions, cache, trace=NO_TRACE, progress=None, out_rows=None):
        """embeddings [T, E] (token rows, or image rows in their place), positions [T] -> logits [T, V],
        or [len(out_rows), V] for the batch rows `out_rows` alone (a row is 0.8 MB at a 202048
        vocabulary), kept from the last layer's FFN on, as llama.cpp keeps its output rows. Appends
        the batch's K/V to `cache`. `progress` wraps the layer range (tqdm, or None). The residual entering layer L is the trace
        point trace.layer_input(L): what a DFlash drafter reads from its target."""
        c = self.cfg
        x = self.backend.rms_norm(embeddings.astype(self.dtype, copy=False), c.rms_eps)
        trace("embd_norm", x)
        for il in layer_range(c.n_layer, progress):
            a = self.attention_sublayer(il, x, positions, cache, trace)
            if il == c.n_layer - 1 and out_rows is not None:
                # llama.cpp's inp_out_ids: the last FFN runs on the kept rows alone, and ggml's kernels
                # choose their path by row count, so the rows are kept where llama.cpp keeps them
                x, a = x[out_rows], a[out_rows]
            if not len(x):  # a chunk that keeps no output rows: its K/V are stored, no row goes further
                break
            x = x + a
            trace(point("ffn_inp", il), x)
            x = x + self.ffn_sublayer(il, x, trace)
            trace(point("l_out", il), x)
        cache.n_past = max(cache.n_past, int(np.max(positions)) + 1)
        return self.output_head(x, trace) if len(x) else np.zeros((0, c.n_vocab), self.dtype)

    def output_head(self, x, trace):  # x [T, E] -> logits [T, V]: softcap(rms(x) * output_norm Wout * logit_scale)
        c = self.cfg
        y = self.norm(x, self.tensors.output_norm, c.rms_eps)
        trace("result_norm", y)
        logits = self.backend.softcap(self.linear(y, self.tensors.output) * self.dtype.type(c.logit_scale), c.softcap)
        trace("result_output", logits)
        return logits

    def attention_sublayer(self, il, x, positions, cache, trace):  # x [T, E] -> [T, E] (to add to x)
        c, layer = self.cfg, self.layers[il]
        h = self.norm(x, layer.attn_norm, c.rms_eps)
        trace(point("attn_norm", il), h)
        q, k, v = self.qkv(il, h)
        trace(point("Qcur", il), q)
        trace(point("Kcur", il), k)
        trace(point("Vcur", il), v)
        gate = self.linear(h, layer.attn_gate)
        trace(point("attn_gate_proj", il), gate)
        q = self.norm(q, layer.attn_q_norm, c.rms_eps)
        k = self.norm(k, layer.attn_k_norm, c.rms_eps)
        trace(point("Qcur_normed", il), q)
        trace(point("Kcur_normed", il), k)
        if c.swa_layers[il]:  # RoPE on the sliding-window layers, NoPE on the full ones
            q, k = self.rope(q, positions), self.rope(k, positions)
            trace(point("Qcur_rope", il), q)
            trace(point("Kcur_rope", il), k)
        o = self.attend(il, q, k, v, positions, cache)
        trace(point("attn_out", il), o)
        g = self.backend.sigmoid(gate)
        trace(point("attn_gate_sig", il), g)
        o = o * g
        trace(point("attn_gated", il), o)
        a = self.linear(o, layer.attn_output)
        trace(point("attn_o_proj", il), a)
        a = self.norm(a, layer.post_attention_norm, c.post_norm_eps)
        trace(point("attn_post_norm", il), a)
        return a

    def ffn_sublayer(self, il, x, trace):  # x [T, E] -> [T, E] (to add to x)
        c = self.cfg
        f = self.norm(self.ffn(il, x, c.rms_eps, trace), self.layers[il].post_ffw_norm, c.post_norm_eps)
        trace(point("ffn_post_norm", il), f)
        return f

    def qkv(self, il, h):  # h [T, E] -> q [T, H, D], k [T, Hkv, D], v [T, Hkv, D]
        c, layer = self.cfg, self.layers[il]
        T, D, nq, nkv = h.shape[0], c.head_dim, c.n_head * c.head_dim, c.n_head_kv * c.head_dim
        if layer.attn_qkv is not None:
            fused = self.linear(h, layer.attn_qkv)
            q, k, v = fused[:, :nq], fused[:, nq:nq + nkv], fused[:, nq + nkv:]
        else:
            q, k, v = (self.linear(h, w) for w in (layer.attn_q, layer.attn_k, layer.attn_v))
        q, k, v = (p if bias is None else p + bias.get(self.dtype)
                   for p, bias in ((q, layer.attn_q_bias), (k, layer.attn_k_bias), (v, layer.attn_v_bias)))
        return q.reshape(T, c.n_head, D), k.reshape(T, c.n_head_kv, D), v.reshape(T, c.n_head_kv, D)

    def rope(self, x, positions):  # x [T, H, D] -> [T, H, D]; NORM pairs (2i, 2i+1)
        return self.backend.rope_norm(x, ops.rope_angles(positions, self.cfg.n_rot, self.cfg.rope_base_swa, self.dtype))

    def attend(self, il, q, k, v, positions, cache):  # q [T, H, D], k/v [T, Hkv, D] -> [T, H*D]
        """Stores the batch's K/V in the layer's cache, then attends over every row it holds; the
        mask decides what is live."""
        c, layer_cache = self.cfg, cache.layers[il]
        layer_cache.store(positions, k, v)
        k_rows, v_rows, k_pos = layer_cache.live()
        visible = ops.causal_visible(positions, k_pos, c.n_swa if c.swa_layers[il] else 0)
        kq_scale = self.dtype.type(1) / np.sqrt(self.dtype.type(c.head_dim))  # llama.cpp: 1.0f/sqrtf(head_dim)
        return self.backend.attention(q, k_rows, v_rows, visible, kq_scale).reshape(len(q), -1)

    # -----------------------------------------------------------------------------------------
    # Prefill and greedy decoding on top of either cache

    def prefill(self, token_ids, cache, chunk=2048, trace=NO_TRACE, progress=None, after_chunk=None,
                out_rows=None):  # [T] -> [T, V]
        return self.prefill_embeddings(self.embed(np.asarray(token_ids, np.int64)), cache, chunk, trace, progress,
                                       after_chunk, out_rows)

    def prefill_embeddings(self, rows, cache, chunk=2048, trace=NO_TRACE, progress=None,
                           after_chunk=None, out_rows=None):  # rows [T, E] -> logits [T, V]
        """Feeds embedding rows (token rows, or image rows in their place) in chunks of at most
        `chunk` after the cache's n_past positions; after_chunk(positions) runs after each chunk's
        forward (the DFlash drafter catches up on the chunk's layer inputs there). With `out_rows`
        (ascending indices into `rows`) only those rows' logits are computed: [len(out_rows), V]."""
        cache.check_room(len(rows), min(len(rows), chunk))
        out = []
        for start in range(0, len(rows), chunk):
            batch = rows[start:start + chunk]
            positions = np.arange(cache.n_past, cache.n_past + len(batch))
            keep = None if out_rows is None else out_rows[(out_rows >= start) & (out_rows < start + len(batch))] - start
            out.append(self.forward(batch, positions, cache, trace, progress, out_rows=keep))
            if after_chunk is not None:
                after_chunk(positions)
        return np.concatenate(out) if out else np.zeros((0, self.cfg.n_vocab), self.dtype)

    def decode_greedy(self, next_logits, n_predict, cache, chunk=2048, progress=None):  # [V] -> generated ids
        """Greedy tokens after a prefill whose last logits are `next_logits`. Stops after an
        end-of-generation token (kept in the output) or n_predict tokens, as llama.cpp does. The
        last token is never fed (its logits would go unused): the cache ends holding the prompt
        and every generated token but the last."""
        eog = self.tokenizer.eog_ids if self.tokenizer else frozenset()
        generated = []
        for _ in range(n_predict):
            token = int(np.argmax(next_logits))
            generated.append(token)
            if len(generated) == n_predict or token in eog or cache.n_past >= cache.n_ctx:
                break
            next_logits = self.prefill([token], cache, chunk, progress=progress)[-1]
        return generated
