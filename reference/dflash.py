"""DFlash speculative decoding as llama.cpp runs it (docs/dflash.md): a drafter that reads the
target's hidden states, and greedy verification around it. The output is the target's own greedy
continuation whatever the drafter proposes; the drafter only changes how many target passes it takes.

    capture   f_t = concat(x_in[L] for L in dflash.target_layers)   residual *entering* target layer L
    encode    g_t = rms(f_t Wfc) * enc.output_norm
    inject    per drafter layer: K = rope_neox(rms_h(g Wk) * k_norm, p_t), V = g Wv  -> cell at p_t
              (no attn_norm on g, no Q, no attention)
    draft     [anchor, MASK x n_max] at positions pos0 .. pos0 + n_max, h = raw token_embd rows
              per layer: x = rms(h) * attn_norm;  q, k = rope_neox(rms_h(x Wq|Wk) * q|k_norm);  v = x Wv
                         h += attn(q, context cells + draft cells, no causal cut, window per row) Wo
                         h += swiglu(u Wgate, u Wup) Wdown,   u = rms(h) * ffn_norm
              logits = rms(h) * output_norm  W_output(target)       no logit scale, no softcap
              row i >= 1 proposes the token at pos0 + i; row 0 (the anchor) is dropped
    verify    target on [anchor, d1 .. dk]: keep the drafts its argmax agrees with, plus one target
              token; both caches then forget every position after the kept ones.

The flow is llama.cpp's server (and transformers'): the target prefills the whole prompt, the drafter
is caught up on every prompt row chunk by chunk, the first token is the target's, and drafting
starts from it. The anchor is the last emitted token, which the target has not processed yet, so the
drafter cache holds context rows for positions 0 .. pos0 - 1 exactly when it drafts.

Departures from llama.cpp, none of which changes a token: speculative-simple drafts from the last
prompt token (one step more); a step with no budget left drafts nothing, where llama.cpp reads a
budget of 0 as "no limit" and verifies drafts past n_predict.
"""
import time
from dataclasses import asdict, dataclass

import numpy as np

from . import ops
from .governor import Plan
from .gguf import GGUFError
from .kv import CacheError, forget_from, n_live
from .text import Blocks
from .trace import NO_TRACE, Capture, layer_input, point

TOP_K = 10  # llama.cpp's draft sampler keeps the top 10 logits; p is renormalised over them


class DraftCache:
    """The drafter's K/V cells. A cell holds a position but has no fixed slot, as in llama.cpp's
    cache: rows are never overwritten by position, so a row left behind stays visible to every
    later query (the drafter's mask has no causal cut). Rows must be removed, not masked."""

    def __init__(self, n_layer, n_cells, n_head_kv, head_dim, dtype):
        self.k = np.zeros((n_layer, n_cells, n_head_kv, head_dim), dtype)
        self.v = np.zeros((n_layer, n_cells, n_head_kv, head_dim), dtype)
        self.pos = np.full(n_cells, -1, np.int64)

    def allocate(self, positions):  # positions [T] -> cells [T], the first free ones
        cells = np.flatnonzero(self.pos < 0)[:len(positions)]
        if len(cells) < len(positions):
            raise CacheError(f"drafter cache full ({len(self.pos)} cells)")
        self.pos[cells] = positions
        return cells

    def store(self, il, cells, k, v):  # cells [T] from allocate, k/v [T, Hkv, D] -> layer il's rows there
        self.k[il, cells], self.v[il, cells] = k, v

    def live(self, il):  # -> k [S, Hkv, D], v [S, Hkv, D], pos [S]: layer il's cells up to the last used one
        n = self.n_live()
        return self.k[il, :n], self.v[il, :n], self.pos[:n]

    def n_live(self):  # -> number of cells up to the last used one
        return n_live(self.pos)

    def remove_from(self, n_keep):  # forget every position >= n_keep (llama.cpp's seq_rm)
        forget_from(self.pos, n_keep)

    def positions(self):  # -> sorted positions held
        return np.sort(self.pos[self.pos >= 0])


def confidence(logits):  # [V] -> p of the top token, renormalised over the top 10 raw logits
    top = np.sort(logits)[-TOP_K:]
    return float(ops.softmax(top)[-1])


def draft_tokens(draft_logits, p_min):  # [n_max + 1, V] -> draft ids (rows 1..; cut at p < p_min)
    drafts = []
    for row in draft_logits[1:]:
        if confidence(row) < p_min:
            break
        drafts.append(int(np.argmax(row)))
    return drafts


def accept_greedy(target_logits, drafts, eog):  # [k + 1, V], k ids -> the ids the target emits
    """llama.cpp's sample_and_accept_n at temperature 0: the target's argmax row by row while it
    agrees with the draft, then one more target token. An agreed end-of-generation token ends the
    step unless it is the last draft (its bonus row is then read as well; the caller stops there)."""
    ids = []
    for i, d in enumerate(drafts):
        ids.append(int(np.argmax(target_logits[i])))
        if ids[-1] != d or (ids[-1] in eog and i + 1 < len(drafts)):
            return ids
    ids.append(int(np.argmax(target_logits[len(drafts)])))
    return ids


class Drafter(Blocks):
    """A DFlash drafter bound to its target: it borrows the target's token_embd and output, and
    computes through the target's backend."""

    def __init__(self, draft_model, target):  # GGUFModel (role dflash), TextModel
        check_pairing(draft_model, target)
        super().__init__(draft_model, target.dtype, target.backend)
        self.cfg = draft_model.config
        self.target = target

    def clamp_n_max(self, n_max):  # llama.cpp clamps the draft to the trained block_size
        return max(0, min(n_max, self.cfg.block_size - 1))

    def new_cache(self, n_ctx):  # context rows for n_ctx positions plus one draft
        c = self.cfg
        return DraftCache(c.n_layer, n_ctx + c.block_size, c.n_head_kv, c.head_dim, self.dtype)

    def capture(self, inner=NO_TRACE):  # -> a trace keeping the target's layer inputs this drafter reads
        return Capture([layer_input(il) for il in self.cfg.target_layers], inner)

    def features(self, captured):  # Capture of a target forward -> [T, n_target_layers * E]
        return np.concatenate([captured.points[layer_input(il)] for il in self.cfg.target_layers], axis=1)

    def encode(self, features, trace=NO_TRACE):  # [T, n_target_layers * E] -> g [T, E]
        trace("inp_target_features", features)
        g = self.norm(self.linear(features, self.tensors.fc), self.tensors.enc_output_norm, self.cfg.rms_eps)
        trace("inp_g_embeddings", g)
        return g

    def heads(self, x, w):  # x [T, E], w attn_q | attn_k | attn_v -> [T, H, D] or [T, Hkv, D]
        return self.linear(x, w).reshape(len(x), -1, self.cfg.head_dim)

    def rope(self, x, positions):  # x [T, H, D] -> [T, H, D]; NeoX pairs (j, j + D/2)
        theta = ops.rope_angles(positions, self.cfg.head_dim, self.cfg.rope_base, self.dtype)
        return self.backend.rope_neox(x, theta)

    def inject(self, g, positions, cache, trace=NO_TRACE):  # g [T, E], positions [T] -> None
        """Context K/V of every drafter layer from the same g, at the target positions."""
        cells = cache.allocate(positions)
        for il, layer in enumerate(self.layers):
            k = self.rope(self.norm(self.heads(g, layer.attn_k), layer.attn_k_norm, self.cfg.rms_eps), positions)
            v = self.heads(g, layer.attn_v)
            trace(point("Kcur_injected", il), k)
            trace(point("Vcur_injected", il), v)
            cache.store(il, cells, k, v)

    def draft_logits(self, anchor, pos0, n_max, cache, trace=NO_TRACE):  # -> [n_max + 1, V]
        """One draft pass over [anchor, MASK x n_max]; the draft's own cells are removed after it,
        so the cache again holds only context rows."""
        c = self.cfg
        tokens = [anchor] + [c.mask_token] * n_max
        positions = np.arange(pos0, pos0 + n_max + 1)
        h = self.target.embed(tokens)  # raw rows: the target's embedding norm is not applied
        trace("inp_noise_embd", h)
        cells = cache.allocate(positions)
        for il in range(c.n_layer):
            h = h + self.attention_sublayer(il, h, positions, cells, cache, trace)
            trace(point("ffn_inp", il), h)
            h = h + self.ffn(il, h, c.rms_eps, trace)  # the text model's FFN, without its post-norm
            trace(point("l_out", il), h)
        cache.remove_from(pos0)
        z = self.norm(h, self.tensors.output_norm, c.rms_eps)
        trace("result_norm", z)
        logits = self.linear(z, self.target.tensors.output)
        trace("result_output", logits)
        return logits

    def attention_sublayer(self, il, h, positions, cells, cache, trace):  # h [T, E] -> [T, E] (to add)
        c, layer = self.cfg, self.layers[il]
        x = self.norm(h, layer.attn_norm, c.rms_eps)
        trace(point("noise_norm", il), x)
        q = self.rope(self.norm(self.heads(x, layer.attn_q), layer.attn_q_norm, c.rms_eps), positions)
        k = self.rope(self.norm(self.heads(x, layer.attn_k), layer.attn_k_norm, c.rms_eps), positions)
        v = self.heads(x, layer.attn_v)
        trace(point("Qcur", il), q)
        trace(point("Kcur", il), k)
        trace(point("Vcur", il), v)
        cache.store(il, cells, k, v)
        k_rows, v_rows, k_pos = cache.live(il)
        # no causal cut: the draft's rows see each other and every context cell
        visible = ops.causal_visible(positions, k_pos, c.n_swa if c.swa_layers[il] else 0, causal=False)
        # A float64 scale (transformers' head_dim ** -0.5), where TextModel.attend takes llama.cpp's
        # float32 1.0f/sqrtf: the drafter's exact goldens (golden/dflash) are transformers', and a float32
        # scale moves their worst-row NMSE (len1-n3 1.888e-13 -> 1.847e-13, len7-n3 1.361e-13 -> 1.443e-13).
        # Under ggml-cpu the backend rounds the scale to float32 either way (reference/ggml_cpu/backend.py).
        o = self.backend.attention(q, k_rows, v_rows, visible, 1.0 / np.sqrt(c.head_dim))
        return self.linear(o.reshape(len(h), -1), layer.attn_output)


def check_pairing(draft_model, target):  # raise GGUFError (naming the drafter) if it cannot serve target
    c, t = draft_model.config, target.cfg
    problem = None
    if c.n_embd != t.n_embd:
        problem = f"drafter n_embd {c.n_embd} differs from the target's {t.n_embd}"
    elif not all(0 <= il <= t.n_layer for il in c.target_layers):
        problem = f"dflash.target_layers {list(c.target_layers)} outside the target's layers 0..{t.n_layer}"
    elif not 0 <= c.mask_token < t.n_vocab:
        problem = f"mask token {c.mask_token} is not in the target's vocabulary of {t.n_vocab}"
    elif draft_model.tokenizer is not None and draft_model.tokenizer.n_vocab != t.n_vocab:
        problem = f"drafter vocabulary of {draft_model.tokenizer.n_vocab} differs from the target's {t.n_vocab}"
    elif c.block_size < 1:
        problem = f"dflash.block_size {c.block_size} must be positive"
    if problem:
        raise GGUFError(draft_model.path, problem)


@dataclass(frozen=True)
class Step:
    drafted: int    # draft tokens the target verified
    accepted: int   # of them, agreed by the target (the step emitted accepted + 1 tokens)
    p_min: float


def acceptance(steps):  # [Step] -> {"drafted", "accepted", "steps": [{"drafted", "accepted", "p_min"}]}
    return {"drafted": sum(s.drafted for s in steps), "accepted": sum(s.accepted for s in steps),
            "steps": [asdict(s) for s in steps]}


class Speculator:
    """Greedy speculative decoding of a TextModel with a Drafter, over one target cache and one
    drafter cache that always hold the same committed positions."""

    def __init__(self, target, drafter, cache, draft_cache, chunk=2048, stop_at_eog=True):
        self.target, self.drafter = target, drafter
        self.cache, self.draft_cache = cache, draft_cache
        self.chunk = chunk
        # stop_at_eog False (a server's ignore_eos): an end-of-generation token is one more token
        self.eog = target.tokenizer.eog_ids if target.tokenizer and stop_at_eog else frozenset()

    def forward(self, token_ids, trace=NO_TRACE):  # [T] after the cache's tokens -> logits [T, V]
        """Target prefill in chunks; each chunk's layer inputs, captured from its trace points, are
        injected into the drafter at once, so the drafter never lags behind the target."""
        captured = self.drafter.capture(trace)

        def inject(positions):
            self.drafter.inject(self.drafter.encode(self.drafter.features(captured)), positions, self.draft_cache)
        return self.target.prefill(token_ids, self.cache, self.chunk, captured, after_chunk=inject)

    def draft(self, anchor, pos0, n_max, p_min):  # -> draft ids (at most n_max)
        if n_max == 0:
            return []
        return draft_tokens(self.drafter.draft_logits(anchor, pos0, n_max, self.draft_cache), p_min)

    def verify(self, anchor, drafts):  # -> (the ids the target emits, the target's row that chose each); caches rolled back
        pos0 = self.cache.n_past
        logits = self.forward([anchor] + drafts)
        ids = accept_greedy(logits, drafts, self.eog)
        n_keep = pos0 + len(ids)  # the anchor and the accepted drafts; the last id is the next anchor
        self.cache.truncate(n_keep)
        self.draft_cache.remove_from(n_keep)
        return ids, logits[:len(ids)]

    def greedy(self, next_logits, n_predict, n_max, p_min=0.0, governor=None, clock=time.perf_counter, steps=None):
        """Greedy tokens after a prefill whose last logits are `next_logits`, as they are verified: (id, the
        target's logit row [V] that chose it), the same ids and rows as one decode step per token (stop
        after an end-of-generation token, kept, or n_predict tokens). `steps` gets a Step per
        verification. With a governor, it decides per step whether to draft and with which floor, from
        the step times `clock` measures."""
        n_max = self.drafter.clamp_n_max(n_max)
        if governor is not None:
            governor.reset()
        if n_predict <= 0:
            return
        last, n = int(np.argmax(next_logits)), 1
        yield last, next_logits
        while n < n_predict and last not in self.eog and self.cache.n_past < self.cache.n_ctx:
            pos0 = self.cache.n_past
            # llama.cpp's budget: room in the context and in n_predict (the step adds one token more)
            budget = max(0, min(self.cache.n_ctx - pos0 - 2, n_predict - n - 1))
            plan = governor.plan() if governor is not None else Plan(True, p_min)
            start = clock()
            drafts = self.draft(last, pos0, n_max, plan.p_min)[:budget] if plan.draft and budget else []
            ids, rows = self.verify(last, drafts)
            if governor is not None:
                governor.record(plan, clock() - start, len(ids))
            if steps is not None:
                steps.append(Step(len(drafts), len(ids) - 1, plan.p_min))
            for last, row in zip(ids, rows):
                yield last, row
                n += 1
                if last in self.eog or n == n_predict:
                    break

    def decode(self, next_logits, n_predict, n_max, p_min=0.0, governor=None, clock=time.perf_counter):
        """-> (generated ids, [Step] per verification): greedy's ids."""
        steps = []
        return [t for t, _ in self.greedy(next_logits, n_predict, n_max, p_min, governor, clock, steps)], steps
