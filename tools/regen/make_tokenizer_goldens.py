"""Tokenizer and chat-template goldens from llama.cpp and transformers (golden/tokenizer/).

    python -m tools.make_tokenizer_goldens --llama-bpe-vocab LLAMA_CPP/models/ggml-vocab-llama-bpe.gguf \\
        [--checkpoint build/tiny/tiny-a] [--out golden/tokenizer]

Writes:
- stress-vocab.gguf: a real vocabulary cut down to fit (llama.cpp's Llama-3 test vocabulary: the
  merges the stress strings use and the first COMMON_MERGES, every token they need, a few special
  tokens of each type), pre = llama-bpe. Its gpt-2 and llama4 variants differ only in
  tokenizer.ggml.pre; the test sets that key itself.
- tokens.json: the stress strings and, per vocabulary, llama.cpp's ids (llama_cpp.Llama(vocab_only=
  True).tokenize with and without BOS and special parsing), llama_detokenize of them (keeping
  special tokens, with and without their text), per-token pieces (llama_token_to_piece), and
  transformers' ids for the same strings.
- chat.json: conversations rendered by transformers' apply_chat_template with the tiny model's
  template (date pinned through `current_date`), llama.cpp's ids for each rendering, and image
  placeholders expanded by transformers' MuseGlimmerProcessor.replace_image_token.
- manifest.json: engines, versions, options, file hashes, date.
Needs llama-cpp-python 0.3.36, transformers 5.23.0 and tokenizers (the `parity` extra).
"""
import argparse
import ctypes
import datetime
import json
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from gguf import GGUFWriter

from reference.gguf import write_out
from reference.tokenizer import (BYTE, CHAR_OF_BYTE, CONTROL, GPT2, GPT4O, LLAMA3, NORMAL, PRE_TOKENIZERS, UNKNOWN,
                                 UNUSED, USER_DEFINED, byte_encode, read_vocab)
from tools.common import LLAMA_CPP_COMMIT, REPO, sha256

TINY_MODEL = REPO / "golden" / "models" / "tiny-a-f32.gguf"
CHAT_DATE = "2026-02-03"
COMMON_MERGES = 3000

# Every class of input the pre-tokenizers treat differently: at least 40, by concern.
STRESS_STRINGS = [
    # empty, whitespace runs, tabs, newlines
    "", " ", "  ", "   ", "\t", "\n", "\n\n\n", "\t\n", " \n \n", "\r\n\r\n", "   leading", "trailing   ",
    "a  b   c    d", "\t\tindented\ttabs\t", "x\u3000y\u00a0z\u2028w \u2003v", "line1\r\nline2\rline3\n",
    # plain English, case, punctuation
    "Hello world", " Hello World!", "Hello, world! How are you?", "w048 7tuijk dsdfhu", "!!!!!!", "...",
    "HelloWorld camelCase snake_case SCREAMING_CASE XMLHttpRequest", "iPhone McDonald's O'Neil",
    # contractions in every case
    "don't won't it's I'm you're we've they'll he'd", "DON'T WON'T IT'S I'M YOU'RE WE'VE THEY'LL HE'D",
    "Don'T wOn'T iT'S i'M yoU'Re", "' era", "'s 'S 'd 'll 'LL 'Re 've", "rock 'n' roll ' quoted ' x",
    # accented and combining characters
    "café naïve résumé Äpfel Ærø", "ÀÉÎÕÜ àéîõü ÀbC aBÀ", "Straße Œuvre ǅemal Ǆungla ǆ",
    "e\u0301te\u0301 cafe\u0301 nai\u0308ve", "a\u0300\u0301\u0302b \u0301x", "n\u0303o\u0308 A\u030a",
    # other scripts, CJK
    "我想在apple工作1314151天～", "日本語のテキストです。", "한국어 텍스트입니다", "нещо на Български",
    "नमस्ते दुनिया", "مرحبا بالعالم ٣٤٥", "កាន់តែពិសេសអាចខលចេញ", "Ελληνικά κείμενα",
    # emoji, ZWJ sequences, flags, skin tones
    "🚀 (normal) 😶\u200d🌫️ (zwj) ✅", "👨\u200d👩\u200d👧\u200d👦 family 👍🏽 skin", "🏳️\u200d🌈 flag 🇫🇷🇩🇪",
    # digits
    "1", "12", "123", "1234", "12345678901234567890", "3.14159 2,718 1e-10 -42", "１２３ ٣٤٥ Ⅻ ½ ²",
    # code
    "def f(x):\n    return x**2  # square\n", "for (int i = 0; i < n; ++i) { a[i] += b[i]; }",
    "<div class=\"x\">&amp;</div>", "https://example.com/path?q=1&r=2#frag", "SELECT * FROM t WHERE a >= 10;",
    # special-token text
    "<|start|>user<|message|>Hi there<|eot|>", "<|begin_of_text|>text<|end_of_text|>",
    "<|eot|><|eom|><|patch|><|image_start|>", "a<|start|>b<|message|>c", "<|eot", "<|start|><|start|>",
    "<tool>x</tool> <unk> <|endoftext|>",
    # long repeats
    "a" * 500, "ab" * 200, " " * 100, "=" * 80, "😀" * 50, "1" * 100,
    # control characters, code points Unicode 15 added, replacement character
    "\x00\x01\x1f\x7f", "a\U00011f05 \U0001fa75 \u0cf3 \U0001e4d0", "\ufffd",
]

# token texts appended to the stress vocabulary, with the GGUF type they get
EXTRA_TOKENS = [
    ("<|start|>", CONTROL), ("<|message|>", CONTROL), ("<|eot|>", CONTROL), ("<|eom|>", CONTROL),
    ("<|patch|>", CONTROL), ("<|image_start|>", CONTROL), ("<|image_end|>", CONTROL),
    ("<tool>", USER_DEFINED), ("<unk>", UNKNOWN), ("<|endoftext|>", NORMAL), ("[PAD7]", UNUSED), ("<0x41>", BYTE),
]
# words joined by added merges, across a boundary one engine (or Unicode version) splits and another
# does not: a letter and its combining mark (transformers keeps the mark in the word, llama.cpp's
# collapsed split cuts it off, docs/text.md), and "a" with a letter Unicode 15.0 added (a letter in
# llama.cpp's table, unassigned in Python 3.11's unicodedata)
JOINED_WORDS = ["e\u0301", "a\u0300", "n\u0303", "o\u0308", "i\u0302", "a\U00011f05"]
KEPT_SPECIALS = 16  # of the original CONTROL tokens (<|begin_of_text|>, <|end_of_text|>, ...)

CASES = {"bos+special": (True, True), "plain": (False, False), "bos": (True, False), "special": (False, True)}


# ---------------------------------------------------------------------------------------------
# llama.cpp

def llama_vocab(path):  # -> llama_cpp.Llama with only the vocabulary loaded
    import llama_cpp
    return llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)


def llama_detokenize(llm, ids, unparse_special):  # -> bytes of llama_detokenize (remove_special=False)
    import llama_cpp
    arr = (llama_cpp.llama_token * max(len(ids), 1))(*ids)
    size = 64 + 16 * len(ids)
    while True:
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_detokenize(llm._model.vocab, arr, len(ids), buf, size, False, unparse_special)
        if n >= 0:
            return buf.raw[:n]
        size = -n


def llama_piece(llm, i, special):  # -> bytes of llama_token_to_piece
    import llama_cpp
    buf = ctypes.create_string_buffer(256)
    n = llama_cpp.llama_token_to_piece(llm._model.vocab, i, buf, 256, 0, special)
    return buf.raw[:n]


def llama_goldens(path, strings, cases, piece_ids):  # -> {"cases", "detokenize", "pieces"}
    llm = llama_vocab(path)
    out = {"cases": {}, "detokenize": {}, "pieces": {}}
    for name in cases:
        add_bos, special = CASES[name]
        out["cases"][name] = [llm.tokenize(s.encode("utf-8"), add_bos=add_bos, special=special) for s in strings]
    ids = out["cases"][cases[0]]
    for unparse in (True, False):
        out["detokenize"][f"special={unparse}"] = [
            llama_detokenize(llm, x, unparse).decode("utf-8", errors="replace") for x in ids]
        out["pieces"][f"special={unparse}"] = {str(i): llama_piece(llm, i, unparse).hex() for i in piece_ids}
    return out


# ---------------------------------------------------------------------------------------------
# the stress vocabulary

def merge_closure(needed, producer):  # token texts, {merged: (a, b)} -> merge pairs that build them
    pairs, stack = set(), list(needed)
    while stack:
        t = stack.pop()
        if t in producer and producer[t] not in pairs:
            pairs.add(producer[t])
            stack.extend(producer[t])
    return pairs


def write_vocab_gguf(path, tokens, types, merges, pre, bos, eos):  # a vocabulary-only GGUF
    w = GGUFWriter(str(path), "llama")
    w.add_name(f"stress-{pre}")
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", pre)
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", [int(t) for t in types])
    w.add_array("tokenizer.ggml.merges", merges)
    w.add_uint32("tokenizer.ggml.bos_token_id", bos)
    w.add_uint32("tokenizer.ggml.eos_token_id", eos)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    write_out(w)


def with_pre(v, pre, tmp):  # TokenizerConfig -> path of a GGUF of it with another tokenizer.ggml.pre
    path = Path(tmp) / f"vocab{v.n_vocab}-{pre}.gguf"
    write_vocab_gguf(path, v.tokens, v.token_types, v.merges, pre, v.bos, v.eos)
    return path


def make_stress_vocab(full_path, out_path, tmp):  # cut llama.cpp's Llama-3 vocabulary down
    full = read_vocab(full_path)
    needed = set()
    for pre in ("llama-bpe", "gpt-2", "llama4"):
        llm = llama_vocab(with_pre(full, pre, tmp))
        for s in STRESS_STRINGS:
            needed.update(full.tokens[i] for i in llm.tokenize(s.encode("utf-8"), add_bos=False, special=False))
    producer = {}
    for m in full.merges:
        a, b = m.split(" ", 1)
        producer.setdefault(a + b, (a, b))
    pairs = merge_closure(needed, producer) | {tuple(m.split(" ", 1)) for m in full.merges[:COMMON_MERGES]}
    merges = [m for m in full.merges if tuple(m.split(" ", 1)) in pairs]
    keep = needed | set(CHAR_OF_BYTE.values()) | {t for pair in pairs for t in (*pair, "".join(pair))}
    specials = [i for i, t in enumerate(full.token_types) if t == CONTROL][:KEPT_SPECIALS]
    ids = [i for i, t in enumerate(full.tokens) if (t in keep and full.token_types[i] == NORMAL)] + specials
    tokens = [full.tokens[i] for i in ids]
    for word in JOINED_WORDS:
        tail = byte_encode(word[1:])
        pairs = [(tail[:k], tail[k]) for k in range(1, len(tail))] + [(byte_encode(word[0]), tail)]
        for left, right in pairs:
            if left + right not in tokens:
                merges.append(f"{left} {right}")
                tokens.append(left + right)
    types = [full.token_types[i] for i in ids] + [NORMAL] * (len(tokens) - len(ids)) + [k for _, k in EXTRA_TOKENS]
    tokens += [t for t, _ in EXTRA_TOKENS]
    write_vocab_gguf(out_path, tokens, types, merges, "llama-bpe",
                     tokens.index(full.tokens[full.bos]), tokens.index(full.tokens[full.eos]))


# ---------------------------------------------------------------------------------------------
# transformers

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"


def bpe_tokenizer(vocab, pre):  # TokenizerConfig, pre name -> tokenizers.Tokenizer as tokenizer.json would build it
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    bpe = models.BPE(vocab={t: i for i, t in enumerate(vocab.tokens)},
                     merges=[tuple(m.split(" ", 1)) for m in vocab.merges],
                     ignore_merges=PRE_TOKENIZERS[pre].ignore_merges)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split_regex(pre)), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken(t, special=k != USER_DEFINED, normalized=False)
                    for t, k in zip(vocab.tokens, vocab.token_types) if k in (CONTROL, USER_DEFINED, UNKNOWN)])
    return tok


def transformers_tokenizer(vocab, pre):  # TokenizerConfig, pre name -> PreTrainedTokenizerFast
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast(tokenizer_object=bpe_tokenizer(vocab, pre))


def transformers_ids(hf, strings):  # -> ids without special tokens added, special text parsed
    return [hf.encode(s, add_special_tokens=False) for s in strings]


def split_regex(pre):  # tokenizer.ggml.pre -> the regex its tokenizer.json has
    from tools.regen.make_tiny import LLAMA4_SPLIT
    return {GPT4O: LLAMA4_SPLIT, LLAMA3: LLAMA3_SPLIT, GPT2: GPT2_SPLIT}[PRE_TOKENIZERS[pre]]


# ---------------------------------------------------------------------------------------------
# chat

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name"},
        "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "hours": {"type": "array", "items": {"type": "integer"}},
        "filters": {"type": "object"}, "note": {"type": ["string", "null"]}},
        "required": ["city"]}}}
SEARCH = {"type": "function", "function": {
    "name": "browser.search", "description": "Search the web.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "top_k": {"type": "number"}},
                   "required": ["query"]}}}
CALC = {"name": "python", "description": "Run Python code.",  # a bare function, no "type"/"function" wrapper
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}}}


def call(cid, name, arguments):
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": arguments}}


def image_text(*parts):  # content parts: str -> text, "IMAGE"/"VIDEO" -> a media part
    return [{"type": p.lower()} if p in ("IMAGE", "VIDEO") else {"type": "text", "text": p} for p in parts]


# (id, messages, tools, options). `reply` marks conversations ending in assistant messages the
# parser must get back: the test renders the rest with a generation prompt and parses the remainder.
CONVERSATIONS = [
    ("user-only", [{"role": "user", "content": "Hello there!"}], None, {}),
    ("system", [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}], None, {}),
    ("system-effort", [{"role": "system", "content": "Be brief. Reasoning effort: low."},
                       {"role": "user", "content": "Why is the sky blue?"}], None, {}),
    ("strength-kwarg", [{"role": "user", "content": "2+2?"}], None, {"reasoning_strength": "low"}),
    ("multi-turn", [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
                    {"role": "user", "content": "Tell me a joke about cats."}], None, {}),
    ("tools", [{"role": "user", "content": "Weather in Paris?"}], [WEATHER, SEARCH, CALC], {}),
    ("tools-system", [{"role": "system", "content": "Use tools when needed."},
                      {"role": "user", "content": "Search for llamas"}], [SEARCH],
     {"tool_namespace_descriptions": {"browser": "Web browsing tools."}, "knowledge_cutoff": "2025-06-01"}),
    ("reasoning-reply", [{"role": "user", "content": "Is 91 prime?"},
                         {"role": "assistant", "reasoning_content": "91 = 7 * 13, so no.",
                          "content": "No: 91 = 7 x 13."}], None, {"reply": True}),
    ("tool-call-reply", [{"role": "user", "content": "Weather in Oslo for 3 days, metric?"},
                         {"role": "assistant", "reasoning_content": "I should call the tool.",
                          "tool_calls": [call("c1", "get_weather", {
                              "city": "Oslo", "days": 3, "metric": True, "hours": [6, 12],
                              "filters": {"wind": True, "rain": None}, "note": "line one\nline two"})]}],
     [WEATHER], {"reply": True}),
    ("parallel-calls-reply", [{"role": "user", "content": "Compare Rome and Lima."},
                              {"role": "assistant", "tool_calls": [call("a", "get_weather", {"city": "Rome"}),
                                                                   call("b", "get_weather", {"city": "Lima"})]}],
     [WEATHER], {"reply": True}),
    ("tool-results", [{"role": "user", "content": "Weather in Rome and Lima?"},
                      {"role": "assistant", "tool_calls": [call("a", "get_weather", {"city": "Rome"}),
                                                           call("b", "get_weather", {"city": "Lima"})]},
                      {"role": "tool", "tool_call_id": "a", "content": "Sunny, 24 C"},
                      {"role": "tool", "name": "get_weather", "content": "Cloudy, 18 C"},
                      {"role": "assistant", "content": "Rome is sunny (24 C); Lima is cloudy (18 C)."},
                      {"role": "user", "content": "Thanks!"}], [WEATHER], {}),
    ("answer-then-call-reply", [{"role": "user", "content": "Search llamas"},
                                {"role": "assistant", "content": "Searching now.", "end_turn": False},
                                {"role": "assistant", "tool_calls": [call("s", "browser.search",
                                                                          {"query": "llamas", "top_k": 3.5})]}],
     [SEARCH], {"reply": True}),
    ("recipient", [{"role": "user", "content": "Note this"},
                   {"role": "assistant", "recipient": "memory", "content": "user likes tea"},
                   {"role": "user", "content": "ok"}], None, {}),
    ("images", [{"role": "user", "content": image_text("Look at", "IMAGE", "and this", "IMAGE", "- same?")}], None,
     {"image_grids": [[1, 4, 6], [1, 8, 10]]}),
    ("video", [{"role": "user", "content": image_text("VIDEO", "What happens?")}], None, {}),
    ("no-generation-prompt", [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hey."}], None,
     {"add_generation_prompt": False}),
    ("string-arguments", [{"role": "user", "content": "x"},
                          {"role": "assistant", "tool_calls": [call("z", "get_weather", '{"city": "Oslo"}')]}],
     [WEATHER], {"error": True}),
]


def render_options(options):  # conversation options -> apply_chat_template keyword arguments
    kw = {k: v for k, v in options.items() if k not in ("reply", "image_grids", "error", "add_generation_prompt")}
    return dict(kw, add_generation_prompt=options.get("add_generation_prompt", True))


def split_reply(messages):  # -> (messages before the trailing assistant messages, those messages)
    k = len(messages)
    while k and messages[k - 1]["role"] == "assistant":
        k -= 1
    return messages[:k], messages[k:]


def expand_with_processor(hf_tokenizer, text, grids):  # -> transformers' ids with images expanded, tokens per image
    from transformers.models.muse_glimmer.processing_muse_glimmer import MuseGlimmerProcessor
    # the image processor needs torchvision; replace_image_token only reads merge_size and the grids
    proc = SimpleNamespace(image_processor=SimpleNamespace(merge_size=2), image_token="<|patch|>",
                           image_start_token="<|image_start|>", image_end_token="<|image_end|>")
    inputs = {"image_grid_thw": np.array(grids)}
    replacements = [MuseGlimmerProcessor.replace_image_token(proc, inputs, k) for k in range(len(grids))]
    parts = text.split("<|patch|>")
    expanded = parts[0] + "".join(r + part for r, part in zip(replacements, parts[1:]))
    return hf_tokenizer.encode(expanded, add_special_tokens=False), [r.count("<|patch|>") for r in replacements]


def chat_goldens(checkpoint, llm):  # -> list of rendered conversations
    import jinja2
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(checkpoint)
    out = []
    for cid, messages, tools, options in CONVERSATIONS:
        kw = dict(render_options(options), current_date=CHAT_DATE)
        entry = {"id": cid, "messages": messages, "tools": tools, "options": options}
        if options.get("error"):
            try:
                hf.apply_chat_template(messages, tools=tools, tokenize=False, **kw)
                raise SystemExit(f"{cid}: expected the template to raise")
            except jinja2.TemplateError as e:
                entry["error"] = str(e)
            out.append(entry)
            continue
        text = hf.apply_chat_template(messages, tools=tools, tokenize=False, **kw)
        entry["rendered"] = text
        entry["llama_cpp_ids"] = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        if options.get("reply"):
            context, _ = split_reply(messages)
            entry["rendered_context"] = hf.apply_chat_template(context, tools=tools, tokenize=False,
                                                               **dict(kw, add_generation_prompt=True))
        if options.get("image_grids"):
            ids, counts = expand_with_processor(hf, text, options["image_grids"])
            entry["expanded_ids"], entry["image_tokens"] = ids, counts
        out.append(entry)
    return out


# ---------------------------------------------------------------------------------------------

def versions():
    import llama_cpp
    import tokenizers
    import transformers
    return {"llama-cpp": f"llama-cpp-python {llama_cpp.__version__} (llama.cpp {LLAMA_CPP_COMMIT})",
            "transformers": transformers.__version__, "tokenizers": tokenizers.__version__}


def write_json(path, data, indent=None):  # compact unless indented
    separators = (",", ":") if indent is None else None
    path.write_text(json.dumps(data, ensure_ascii=False, indent=indent, separators=separators) + "\n", encoding="utf-8")


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m tools.make_tokenizer_goldens", description=__doc__.splitlines()[0])
    p.add_argument("--llama-bpe-vocab", required=True, help="llama.cpp's models/ggml-vocab-llama-bpe.gguf")
    p.add_argument("--checkpoint", default=str(REPO / "build" / "tiny" / "tiny-a"),
                   help="the tiny model's transformers checkpoint (its tokenizer and chat template)")
    p.add_argument("--out", default=str(REPO / "golden" / "tokenizer"))
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stress_path = out / "stress-vocab.gguf"
    vocabs = {}
    with tempfile.TemporaryDirectory() as tmp:
        make_stress_vocab(a.llama_bpe_vocab, stress_path, tmp)
        stress = read_vocab(stress_path)
        special_ids = [i for i, t in enumerate(stress.token_types) if t != NORMAL]
        for pre in ("llama-bpe", "gpt-2", "llama4"):
            path = stress_path if pre == "llama-bpe" else with_pre(stress, pre, tmp)
            g = llama_goldens(path, STRESS_STRINGS, ["bos+special", "plain"], special_ids + list(range(300)))
            g["transformers"] = transformers_ids(transformers_tokenizer(stress, pre), STRESS_STRINGS)
            vocabs[f"stress-{pre}"] = dict(file=stress_path.name, pre=pre, **g)
    tiny = read_vocab(TINY_MODEL)
    from transformers import AutoTokenizer
    g = llama_goldens(TINY_MODEL, STRESS_STRINGS, list(CASES), list(range(tiny.n_vocab)))
    g["transformers"] = transformers_ids(AutoTokenizer.from_pretrained(a.checkpoint), STRESS_STRINGS)
    vocabs["tiny-a"] = dict(file=TINY_MODEL.name, pre=tiny.pre, **g)
    write_json(out / "tokens.json", {"strings": STRESS_STRINGS, "vocabs": vocabs})
    conversations = chat_goldens(a.checkpoint, llama_vocab(TINY_MODEL))
    write_json(out / "chat.json", {"date": CHAT_DATE, "conversations": conversations})

    today = datetime.date.today().isoformat()
    manifest = {
        "about": "Tokenizer and chat goldens made by tools/regen/make_tokenizer_goldens.py; see golden/tokenizer/README.md.",
        "versions": versions(), "date": today,
        "files": {
            "stress-vocab.gguf": {
                "sha256": sha256(stress_path), "source": "llama.cpp models/ggml-vocab-llama-bpe.gguf, cut down",
                "source_sha256": sha256(Path(a.llama_bpe_vocab)),
                "note": "variants stress-gpt-2 and stress-llama4 differ only in tokenizer.ggml.pre"},
            "tiny-a-f32.gguf": {"sha256": sha256(TINY_MODEL)},
        },
        "tokens.json": {
            "engine": "llama-cpp", "calls": "Llama(vocab_only=True).tokenize(text_utf8, add_bos, special); "
            "llama_detokenize(ids of bos+special, remove_special=False, unparse_special); llama_token_to_piece(id, "
            "lstrip=0, special) as hex", "cases": {k: {"add_bos": v[0], "special": v[1]} for k, v in CASES.items()},
            "transformers": "tiny-a: AutoTokenizer(checkpoint).encode(add_special_tokens=False); stress-*: "
            "PreTrainedTokenizerFast over tokenizers BPE(vocab, merges) + Split(tokenizer.json regex of the pre) "
            "+ ByteLevel, CONTROL and UNKNOWN tokens as special added tokens, USER_DEFINED as plain added tokens, "
            "encode(add_special_tokens=False)"},
        "chat.json": {
            "engine": "transformers", "calls": f"AutoTokenizer(checkpoint).apply_chat_template(messages, tools=tools, "
            f"tokenize=False, current_date='{CHAT_DATE}', add_generation_prompt, extra options); llama_cpp ids: "
            "tokenize(rendered, add_bos=False, special=True); images: MuseGlimmerProcessor.replace_image_token on "
            "the given image_grid_thw (merge_size 2), then the tokenizer"},
    }
    write_json(out / "manifest.json", manifest, indent=1)
    sizes = {f.name: f.stat().st_size for f in out.iterdir()}
    print(json.dumps(sizes), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
