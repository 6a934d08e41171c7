"""The Muse-Glimmer language model forward, as llama.cpp computes it from a GGUF (spec/text.md §3).

    x = rms(E[t])                                      weightless embedding norm
    per layer:  h = rms(x) * attn_norm
                q, k, v, g = h Wq, h Wk, h Wv, h Wgate
                q, k = rms_h(q) * q_norm, rms_h(k) * k_norm      (3.87 already folded into q_norm)
                q, k = rope_norm(q), rope_norm(k)      only on sliding-window layers (full ones are NoPE)
                x += rms(((attn(q, k, v) * sigmoid(g)) Wo), 1e-8) * post_attention_norm
                x += rms(swiglu(u Wgate, u Wup) Wdown, 1e-8) * post_ffw_norm,   u = rms(x) * ffn_norm
    logits = softcap(rms(x) * output_norm Wout * logit_scale)

The GGUF has already folded in what transformers applies at run time (norm +1, qk_scale_factor,
the rotate_half row order): nothing of it is applied again here.
"""
import numpy as np
from tqdm import tqdm

from . import ops
from .backend import NumpyBackend
from .kv import KVCache
from .trace import Tracer

NO_TRACE = Tracer()


class TextModel:
    def __init__(self, gguf_model, dtype=np.float32, backend=None):
        self.cfg = gguf_model.config
        self.weights = gguf_model.weights
        self.tokenizer = gguf_model.tokenizer
        self.dtype = np.dtype(dtype)
        self.backend = backend or NumpyBackend(self.dtype)

    def new_cache(self, n_ctx, kind="ring", chunk=2048):  # -> KVCache for one sequence
        c = self.cfg
        return KVCache(c.n_layer, c.swa_layers, c.n_swa, n_ctx, c.n_head_kv, c.head_dim,
                       self.dtype, kind, chunk)

    def norm_weight(self, name):  # [n]
        return self.weights.get(name, self.dtype)

    def embed(self, token_ids):  # [T] -> [T, E], the raw rows of token_embd
        return self.weights.rows("token_embd.weight", token_ids, self.dtype)

    def forward(self, embeddings, positions, cache, trace=NO_TRACE, progress=False, layer_inputs=None, out_rows=None):
        """embeddings [T, E] (token rows, or image rows in their place), positions [T] -> logits [T, V],
        or [len(out_rows), V] for the batch rows `out_rows` alone.
        Appends the batch's K/V to `cache`. `layer_inputs`, a dict whose keys are layer ids, gets
        the residual entering each of those layers ([T, E]; id n_layer is the last layer's output):
        what a DFlash drafter reads from its target (dflash.target_layers)."""
        c = self.cfg
        x = self.backend.rms_norm(embeddings.astype(self.dtype, copy=False), c.rms_eps)
        trace("embd_norm", x)
        for il in tqdm(range(c.n_layer), desc="layers", disable=not progress, leave=False):
            if layer_inputs is not None and il in layer_inputs:
                layer_inputs[il] = x
            x = x + self.attention_block(il, x, positions, cache, trace)
            trace(f"ffn_inp-{il}", x)
            x = x + self.ffn_block(il, x, trace)
            trace(f"l_out-{il}", x)
        if layer_inputs is not None and c.n_layer in layer_inputs:
            layer_inputs[c.n_layer] = x
        cache.n_past = max(cache.n_past, int(np.max(positions)) + 1)
        y = self.backend.rms_norm(x, c.rms_eps) * self.norm_weight("output_norm.weight")
        trace("result_norm", y)
        if out_rows is not None:  # the output head only where logits are wanted: a row is 0.8 MB at a 202048 vocabulary
            y = y[out_rows]
        logits = self.backend.softcap(
            self.backend.linear(y, self.weights, "output.weight") * self.dtype.type(c.logit_scale), c.softcap)
        trace("result_output", logits)
        return logits

    def qkv(self, il, h):  # h [T, E] -> q [T, H, D], k [T, Hkv, D], v [T, Hkv, D]
        c, w, b = self.cfg, self.weights, f"blk.{il}."
        T, D, nq, nkv = h.shape[0], c.head_dim, c.n_head * c.head_dim, c.n_head_kv * c.head_dim
        if b + "attn_qkv.weight" in w:
            fused = self.backend.linear(h, w, b + "attn_qkv.weight")
            q, k, v = fused[:, :nq], fused[:, nq:nq + nkv], fused[:, nq + nkv:]
        else:
            q, k, v = (self.backend.linear(h, w, b + f"attn_{p}.weight") for p in "qkv")
        q, k, v = (p + w.get(b + f"attn_{n}.bias", self.dtype) if b + f"attn_{n}.bias" in w else p
                   for p, n in ((q, "q"), (k, "k"), (v, "v")))
        return q.reshape(T, c.n_head, D), k.reshape(T, c.n_head_kv, D), v.reshape(T, c.n_head_kv, D)

    def attention_block(self, il, x, positions, cache, trace):  # x [T, E] -> [T, E] (to add to x)
        c, w, b = self.cfg, self.weights, f"blk.{il}."
        T, swa = x.shape[0], c.swa_layers[il]
        h = self.backend.rms_norm(x, c.rms_eps) * self.norm_weight(b + "attn_norm.weight")
        trace(f"attn_norm-{il}", h)
        q, k, v = self.qkv(il, h)
        trace(f"Qcur-{il}", q), trace(f"Kcur-{il}", k), trace(f"Vcur-{il}", v)
        gate = self.backend.linear(h, w, b + "attn_gate.weight")
        trace(f"attn_gate_proj-{il}", gate)
        q = self.backend.rms_norm(q, c.rms_eps) * self.norm_weight(b + "attn_q_norm.weight")
        k = self.backend.rms_norm(k, c.rms_eps) * self.norm_weight(b + "attn_k_norm.weight")
        trace(f"Qcur_normed-{il}", q), trace(f"Kcur_normed-{il}", k)
        if swa:
            theta = ops.rope_angles(positions, c.n_rot, c.rope_base_swa, self.dtype)
            q, k = self.backend.rope_norm(q, theta), self.backend.rope_norm(k, theta)
            trace(f"Qcur_rope-{il}", q), trace(f"Kcur_rope-{il}", k)
        layer_cache = cache.layers[il]
        layer_cache.store(positions, k, v)
        k_rows, v_rows, k_pos = layer_cache.live()
        visible = ops.causal_visible(positions, k_pos, c.n_swa if swa else 0)
        kq_scale = self.dtype.type(1) / np.sqrt(self.dtype.type(c.head_dim))  # llama.cpp: 1.0f/sqrtf(head_dim)
        o = self.backend.attention(q, k_rows, v_rows, visible, kq_scale).reshape(T, -1)
        trace(f"attn_out-{il}", o)
        g = self.backend.sigmoid(gate)
        trace(f"attn_gate_sig-{il}", g)
        o = o * g
        trace(f"attn_gated-{il}", o)
        a = self.backend.linear(o, w, b + "attn_output.weight")
        trace(f"attn_o_proj-{il}", a)
        a = self.backend.rms_norm(a, c.post_norm_eps) * self.norm_weight(b + "post_attention_norm.weight")
        trace(f"attn_post_norm-{il}", a)
        return a

    def ffn_block(self, il, x, trace):  # x [T, E] -> [T, E] (to add to x)
        c, w, b = self.cfg, self.weights, f"blk.{il}."
        u = self.backend.rms_norm(x, c.rms_eps) * self.norm_weight(b + "ffn_norm.weight")
        trace(f"ffn_norm-{il}", u)
        f = self.backend.swiglu(self.backend.linear(u, w, b + "ffn_gate.weight"),
                                self.backend.linear(u, w, b + "ffn_up.weight"))
        f = self.backend.linear(f, w, b + "ffn_down.weight")
        trace(f"ffn_out-{il}", f)
        f = self.backend.rms_norm(f, c.post_norm_eps) * self.norm_weight(b + "post_ffw_norm.weight")
        trace(f"ffn_post_norm-{il}", f)
        return f

    # -----------------------------------------------------------------------------------------
    # Prefill and greedy decoding on top of either cache

    def prefill(self, token_ids, cache, chunk=2048, trace=NO_TRACE, progress=False, out_rows=None):  # [T] -> [T, V]
        return self.prefill_embeddings(self.embed(np.asarray(token_ids, np.int64)), cache, chunk, trace, progress,
                                       out_rows)

    def prefill_embeddings(self, rows, cache, chunk=2048, trace=NO_TRACE, progress=False, out_rows=None):
        """[T, E] -> logits [T, V]. Feeds embedding rows (token rows, or image rows in their place) in
        chunks of at most `chunk` after the cache's n_past positions. With `out_rows` (ascending
        indices into `rows`) only those rows' logits are computed: [len(out_rows), V]."""
        cache.check_room(len(rows), min(len(rows), chunk))
        out = []
        for start in range(0, len(rows), chunk):
            batch = rows[start:start + chunk]
            positions = np.arange(cache.n_past, cache.n_past + len(batch))
            keep = None if out_rows is None else out_rows[(out_rows >= start) & (out_rows < start + len(batch))] - start
            out.append(self.forward(batch, positions, cache, trace, progress, out_rows=keep))
        return np.concatenate(out) if out else np.zeros((0, self.cfg.n_vocab), self.dtype)

    def decode_greedy(self, next_logits, n_predict, cache, chunk=2048, progress=False):  # [V] -> generated ids
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
