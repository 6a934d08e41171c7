"""llama.cpp's logits of a few kept rows of a prompt: one llama_decode whose batch asks for logits at
those positions only, so llama.cpp's graph keeps just those rows from the last layer's FFN on
(inp_out_ids) and its kernels run at that row count. `reference.run --logits-positions` under
`--numerics ggml-cpu` must give these rows bit for bit (tests/test_output_rows.py).

    python -m tools.make_output_rows_golden --model golden/presets/models/tiny-b-q4_k_m.gguf \\
        --prompts golden/prompts/text-short.jsonl --positions 0,-3: --out tests/fixtures/output-rows

Weights in plain CPU buffers (use_extra_bufts=False, as golden/presets), F32 KV cache, flash
attention off, 2 threads, n_batch = n_ubatch = 512.
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np

from reference.positions import parse_positions, resolve
from tools import common


def kept_logits(llama_cpp, llm, ids, kept):  # -> f32 [len(kept), V]: one decode, logits flagged at `kept`
    batch = llama_cpp.llama_batch_init(len(ids), 0, 1)
    try:
        for i, token in enumerate(ids):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, i, 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = i in kept
        batch.n_tokens = len(ids)
        if llama_cpp.llama_decode(llm.ctx, batch) != 0:
            raise SystemExit("llama_decode failed")
        return np.array([np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, i), (llm.n_vocab(),))
                         for i in kept], np.float32)
    finally:
        llama_cpp.llama_batch_free(batch)


def main(argv=None):
    p = argparse.ArgumentParser(prog="tools.make_output_rows_golden")
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--prompts", type=Path, required=True, help="JSONL: id and token_ids per prompt")
    p.add_argument("--positions", type=parse_positions, required=True, help="as --logits-positions")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    import llama_cpp

    common.silence_llama_cpp(llama_cpp)
    common.plain_cpu_buffers(llama_cpp.llama_cpp)
    args.out.mkdir(parents=True, exist_ok=True)
    entries = []
    for line in args.prompts.read_text().splitlines():
        prompt = json.loads(line)
        llm = llama_cpp.Llama(model_path=str(args.model), n_ctx=1024, n_batch=512, n_ubatch=512,
                              logits_all=False, type_k=0, type_v=0, flash_attn=False, n_threads=2,
                              n_threads_batch=2, n_gpu_layers=0, seed=0, verbose=False)
        ids = prompt["token_ids"]
        kept = [int(i) for i in resolve(args.positions, len(ids))]
        np.save(args.out / f"{prompt['id']}.npy", kept_logits(llama_cpp, llm, ids, kept))
        llm.close()
        entries.append({"id": prompt["id"], "token_ids": ids, "positions": kept, "file": f"{prompt['id']}.npy"})
    common.save_json(args.out / "manifest.json", {
        "engine": "llama-cpp", "version": f"llama-cpp-python {llama_cpp.__version__} (llama.cpp {common.LLAMA_CPP_COMMIT})",
        "model": {"file": args.model.name, "sha256": common.sha256(args.model)},
        "options": {"kv_type": "f32", "flash_attn": "off", "repack": False, "n_ubatch": 512, "n_threads": 2,
                    "logits": "only at the kept positions (llama_batch.logits)"},
        "command": ["python", "-m", "tools.make_output_rows_golden", *(argv if argv is not None else sys.argv[1:])],
        "date": common.today(), "entries": entries})
    return 0


if __name__ == "__main__":
    sys.exit(main())
