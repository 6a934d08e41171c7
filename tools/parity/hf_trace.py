"""A trace of transformers' own forward, in this reference's trace format, for tools.bisect.

    python -m tools.hf_trace --checkpoint DIR --token-ids 1,2,3 --out TRACE_DIR [--without OP,...]
    python -m tools.hf_trace --checkpoint DIR --token-ids 1,2,3 --out DEBUG_DIR --debugger [--only-read]

Loads a Muse-Glimmer checkpoint (MuseGlimmerForConditionalGeneration, float32, eager attention, CPU),
runs one forward over the token ids (positions 0..T-1, no cache) and writes TRACE_DIR: one f32 .npy
per point plus index.json (reference/trace.py), with our names, shapes and layouts, and manifest.json
(engine, versions, options, checkpoint sha256, tokens, date). The directory is a trace source for
`python -m tools.bisect` as it stands. Needs torch and transformers (the [parity] extra).

With --debugger it runs transformers' own model_addition_debugger_context on that forward instead
(do_prune_layers=False: every layer; use_repr=False: whole tensors as safetensors files beside the
JSON tree) and adds manifest.json; --only-read then deletes the files tools.bisect does not read.
tools.bisect reads that directory as a trace source too (tools/parity/dump_parse.py, HF_DEBUGGER_POINTS in
tools/parity/hf_names.py): 14 points per layer, as the debugger records module outputs and inputs only.

Where each point comes from (tools/parity/hf_names.py has the module paths):
- module outputs (forward hooks): embd_norm, attn_norm, Qcur, Kcur, Vcur, attn_gate_proj,
  attn_o_proj, attn_post_norm, ffn_norm, ffn_out, ffn_post_norm, l_out, result_norm;
- module inputs (forward pre-hooks): attn_gated (o_proj's input), ffn_inp (pre_feedforward_layernorm's);
- Qcur_normed, Kcur_normed: the 1st and 2nd call of the layer's weightless qk_norm; Q is multiplied
  by qk_scale_factor in torch, as HF's forward does next (the GGUF folds it into attn_q_norm);
- Qcur_rope, Kcur_rope: no module; the modeling module's apply_rotary_pos_emb is wrapped for the
  forward. HF calls it on the layers whose layer_rope_theta is non-zero only, so the NoPE layers
  have no RoPE point, as in our trace;
- attn_out: no module; the eager attention function is wrapped (its output before the gate);
- attn_gate_sig: HF never keeps sigmoid(gate) apart; it is torch.sigmoid of gate_proj's output,
  the same kernel on the same tensor as HF's forward;
- result_output: the model's logits (after output_multiplier and the tanh softcap).
Every point of our text trace has a counterpart; llama.cpp's extra nodes (kq-0, the cache views)
have none, and the vision tower and the drafter are not traced. Q and K points are turned from HF's rotate_half
row order to the GGUF's interleaved order (hf_rope_rows_to_gguf); heads-first tensors
[1, H, T, D] become [T, H, D]; the batch axis is dropped. The whole checkpoint is loaded in float32
(about 4 bytes per parameter of memory).
"""
import contextlib
import os
import sys

from reference import artifacts
from reference.cli import OneLineParser, exit_status, parse_token_ids
from reference.trace import OURS as TRACE_OURS, Tracer

from tools.common import sha256, today
from tools.parity.dump_parse import DumpError, debugger_records
from tools.parity.hf_names import HF_DEBUGGER_MISSING, HF_TEXT_MODULES, hf_module, trace_layout

TRACE_OPS = [name.removesuffix("-{il}") for name in HF_TEXT_MODULES]  # forward order, as text.py traces
OUTPUT_HOOK_OPS = ["embd_norm", "attn_norm", "Qcur", "Kcur", "Vcur", "attn_gate_proj", "attn_o_proj",
                   "attn_post_norm", "ffn_norm", "ffn_out", "ffn_post_norm", "l_out", "result_norm"]
INPUT_HOOK_OPS = ["attn_gated", "ffn_inp"]


class HFTraceError(Exception):
    pass


def is_manifest(value):  # -> whether a JSON value is the manifest.json this tool writes
    return isinstance(value, dict) and str(value.get("command", "")).startswith("python -m tools.hf_trace")


# --out: a trace or a debugger directory of this tool (artifacts.check_output_dir)
OURS = {**TRACE_OURS, "manifest.json": artifacts.json_marker(is_manifest, "hf_trace manifest")}


def ops_without(text):  # "attn_gate_sig,ffn_inp" | None -> the other trace ops, in forward order
    left_out = [op for op in (text or "").split(",") if op]
    unknown = [op for op in left_out if op not in TRACE_OPS]
    if unknown:
        raise HFTraceError(f"--without: unknown trace op(s) {', '.join(unknown)} (known: {', '.join(TRACE_OPS)})")
    return [op for op in TRACE_OPS if op not in left_out]


def read_text_config(checkpoint):  # checkpoint dir -> the text_config dict of its config.json
    path = os.path.join(checkpoint, "config.json")
    config = artifacts.read_json(path, HFTraceError, what="checkpoint's config")
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type != "muse_glimmer" or not isinstance(config.get("text_config"), dict):
        raise HFTraceError(f"{path}: not a Muse-Glimmer checkpoint (model_type {model_type!r})")
    return config["text_config"]


def check_token_ids(ids, text_config, checkpoint):  # -> None, or HFTraceError
    vocab = text_config.get("vocab_size")
    if not isinstance(vocab, int):
        raise HFTraceError(f"{checkpoint}: config.json has no text_config.vocab_size")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise HFTraceError(f"{checkpoint}: token id {bad[0]} out of range [0, {vocab})")


def load_checkpoint(checkpoint):  # checkpoint dir -> MuseGlimmerForConditionalGeneration (f32, eager, eval)
    try:
        import torch
        from transformers import MuseGlimmerForConditionalGeneration
    except ImportError as e:
        raise HFTraceError(f"tools.hf_trace needs torch and transformers ({e})") from None
    try:
        model = MuseGlimmerForConditionalGeneration.from_pretrained(
            checkpoint, dtype=torch.float32, attn_implementation="eager")
    except (OSError, ValueError) as e:
        raise HFTraceError(f"{checkpoint}: cannot load the checkpoint ({e})") from None
    return model.eval()


def to_trace_layout(op, x, head_dim, heads_first):  # torch [1, T, ...] or [1, H, T, D] -> f32 [T, ...] as we trace
    return trace_layout(op, x.detach().float().numpy()[0], head_dim, heads_first)


def point_name(op, il):  # "Qcur", 3 -> "Qcur-3"; layer-free ops keep their name
    return op if il is None else f"{op}-{il}"


class Recorder:
    """Turns the tensors of one HF forward into trace points. HF runs the layers one after another,
    so the layer whose attention was entered last owns every qk_norm and RoPE call until the next."""

    def __init__(self, ops, text_config):
        self.ops, self.head_dim, self.qk_scale = ops, text_config.head_dim, text_config.qk_scale_factor
        self.points, self.layer, self.qk_norm_calls = {}, None, 0

    def record(self, op, il, x, heads_first=False):  # torch tensor -> None
        if op in self.ops:
            self.points[point_name(op, il)] = to_trace_layout(op, x, self.head_dim, heads_first)

    def output_hook(self, op, il):  # -> forward hook recording the module's output
        def hook(module, args, output):
            self.record(op, il, output)
            if op == "attn_gate_proj":
                # the same kernel on the same tensor as HF's torch.sigmoid(self.gate_proj(...))
                self.record("attn_gate_sig", il, output.sigmoid())
        return hook

    def input_hook(self, op, il):  # -> forward pre-hook recording the module's first input
        def hook(module, args):
            self.record(op, il, args[0])
        return hook

    def attention_entered(self, il):  # -> forward pre-hook of layer il's self_attn
        def hook(module, args, kwargs):
            self.layer, self.qk_norm_calls = il, 0
        return hook

    def qk_norm_hook(self, module, args, output):  # HF's attention normalizes Q first, then K
        if self.qk_norm_calls == 0:
            self.record("Qcur_normed", self.layer, output * self.qk_scale, heads_first=True)
        else:
            self.record("Kcur_normed", self.layer, output, heads_first=True)
        self.qk_norm_calls += 1

    def traced_rope(self, rope):  # apply_rotary_pos_emb -> the same function, recording its results
        def traced(q, k, *args, **kwargs):
            q_rope, k_rope = rope(q, k, *args, **kwargs)
            self.record("Qcur_rope", self.layer, q_rope, heads_first=True)
            self.record("Kcur_rope", self.layer, k_rope, heads_first=True)
            return q_rope, k_rope
        return traced

    def traced_attention(self, attention):  # eager_attention_forward -> the same, recording its output
        def traced(module, *args, **kwargs):
            out, weights = attention(module, *args, **kwargs)
            self.record("attn_out", module.layer_idx, out)  # [1, T, H, D]: tokens first already
            return out, weights
        return traced


def register_hooks(model, recorder):  # -> hook handles, to remove after the forward
    handles, layers = [], range(model.config.text_config.num_hidden_layers)
    for op in OUTPUT_HOOK_OPS + INPUT_HOOK_OPS:
        for il in (layers if op + "-{il}" in HF_TEXT_MODULES else [None]):
            module = model.get_submodule(hf_module(point_name(op, il))[0])
            if op in INPUT_HOOK_OPS:
                handles.append(module.register_forward_pre_hook(recorder.input_hook(op, il)))
            else:
                handles.append(module.register_forward_hook(recorder.output_hook(op, il)))
    for il in layers:
        attention = model.get_submodule(hf_module(f"Qcur_rope-{il}")[0])
        handles.append(attention.register_forward_pre_hook(recorder.attention_entered(il), with_kwargs=True))
        handles.append(attention.qk_norm.register_forward_hook(recorder.qk_norm_hook))
    return handles


@contextlib.contextmanager
def traced_functions(recorder):  # RoPE and eager attention are functions, not modules: wrap them meanwhile
    from transformers.models.muse_glimmer import modeling_muse_glimmer as hf
    rope, attention = hf.apply_rotary_pos_emb, hf.eager_attention_forward
    hf.apply_rotary_pos_emb = recorder.traced_rope(rope)
    hf.eager_attention_forward = recorder.traced_attention(attention)
    try:
        yield
    finally:
        hf.apply_rotary_pos_emb, hf.eager_attention_forward = rope, attention


def forward_points(model, token_ids, ops):  # model, [T], ops -> {name: f32 array} in forward order
    import torch
    recorder = Recorder(ops, model.config.text_config)
    handles = register_hooks(model, recorder)
    try:
        with traced_functions(recorder), torch.no_grad():
            logits = model(input_ids=torch.tensor([token_ids]), use_cache=False).logits
        recorder.record("result_output", None, logits)
    finally:
        for h in handles:
            h.remove()
    return dict(sorted(recorder.points.items(), key=lambda item: forward_rank(item[0])))


def forward_rank(name):  # "Qcur-3" -> sort key: embd_norm, then layer by layer in op order, then the output
    op, _, il = name.rpartition("-")
    if op and il.isdigit():
        return (1, int(il), TRACE_OPS.index(op))
    return (0 if name == "embd_norm" else 2, 0, TRACE_OPS.index(name))


def manifest(checkpoint, token_ids, ops):  # -> what made the trace (written beside index.json)
    import torch
    import transformers
    weights = os.path.join(checkpoint, "model.safetensors")
    return {"engine": "transformers", "version": transformers.__version__, "torch": torch.__version__,
            "model": "MuseGlimmerForConditionalGeneration",
            "checkpoint": os.path.basename(os.path.normpath(checkpoint)),
            "weights_sha256": sha256(weights) if os.path.exists(weights) else None,
            "options": {"dtype": "float32", "attn_implementation": "eager", "device": "cpu", "use_cache": False},
            "token_ids": token_ids, "left_out": [op for op in TRACE_OPS if op not in ops],
            "date": today(), "command": "python -m tools.hf_trace"}


def write_trace(points, directory, about):  # {name: array}, dir, manifest -> None
    tracer = Tracer(directory)
    for name, x in points.items():
        tracer(name, x)
    # inside the trace before it is renamed into place: the manifest and the points appear together
    artifacts.write_json(os.path.join(tracer.directory, "manifest.json"), about, HFTraceError)
    tracer.close()


def hf_trace(checkpoint, token_ids, out, ops=None):  # -> {name: f32 array}, also written to `out`
    ops = list(TRACE_OPS) if ops is None else ops
    check_token_ids(token_ids, read_text_config(checkpoint), checkpoint)
    points = forward_points(load_checkpoint(checkpoint), token_ids, ops)
    write_trace(points, out, manifest(checkpoint, token_ids, ops))
    return points


def debugger_dump(checkpoint, token_ids, out, only_read=False):  # -> files written to `out`
    """transformers' own model_addition_debugger_context on the same forward, every layer kept
    (do_prune_layers=False) and whole tensors in safetensors files (use_repr=False), plus manifest.json.
    only_read: keep the tree JSON and the files tools.bisect reads, delete the rest (inputs of every
    module, masks, RoPE tables) to keep a fixture small."""
    import torch
    from transformers import model_addition_debugger_context
    check_token_ids(token_ids, read_text_config(checkpoint), checkpoint)
    model = load_checkpoint(checkpoint)
    with model_addition_debugger_context(model, debug_path=out, do_prune_layers=False, use_repr=False):
        model(input_ids=torch.tensor([token_ids]), use_cache=False)
    tree_file, _, records, _ = debugger_records(out)
    read = {os.path.basename(tree_file)} | {os.path.normpath(r["value"]) for r in records.values()}
    for name in set(os.listdir(out)) - read if only_read else ():
        os.remove(os.path.join(out, name))
    about = manifest(checkpoint, token_ids, TRACE_OPS)
    about.update(tool="transformers.model_addition_debugger_context", left_out=sorted(HF_DEBUGGER_MISSING),
                 command="python -m tools.hf_trace --debugger" + (" --only-read" if only_read else ""))
    about["options"].update(do_prune_layers=False, use_repr=False)
    artifacts.write_json(os.path.join(out, "manifest.json"), about, HFTraceError)
    return sorted(os.listdir(out))


def main(argv=None):  # -> exit status
    p = OneLineParser(prog="python -m tools.hf_trace", description=__doc__)
    p.add_argument("--checkpoint", required=True, help="transformers Muse-Glimmer checkpoint directory")
    p.add_argument("--token-ids", required=True, help="comma-separated prompt token ids")
    p.add_argument("--out", required=True, help="trace directory to write")
    p.add_argument("--without", help="comma-separated ops not to record (e.g. attn_gate_sig,ffn_inp)")
    p.add_argument("--debugger", action="store_true",
                   help="write transformers' model_addition_debugger_context output instead (JSON + safetensors)")
    p.add_argument("--only-read", action="store_true", help="with --debugger: keep only the files tools.bisect reads")
    args = p.parse_args(argv)

    def work():
        if args.only_read and not args.debugger or args.debugger and args.without:
            raise HFTraceError("--only-read goes with --debugger, --without without it")
        artifacts.check_output_dir(args.out, "--out", OURS, HFTraceError)
        if args.debugger:
            files = debugger_dump(args.checkpoint, parse_token_ids(args.token_ids), args.out, args.only_read)
            print(f"{len(files)} files written to {args.out}")
            return 0
        points = hf_trace(args.checkpoint, parse_token_ids(args.token_ids), args.out, ops_without(args.without))
        print(f"{len(points)} trace points written to {args.out}")
        return 0
    return exit_status("tools.hf_trace", work, (HFTraceError, DumpError))


if __name__ == "__main__":
    sys.exit(main())
