"""GGUF byte-level BPE (tokenizer.ggml.model = gpt2): detokenization."""

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def gpt2_byte_chars():  # -> {byte: char}, GPT-2's reversible map of bytes to printable characters
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


BYTE_OF_CHAR = {ch: b for b, ch in gpt2_byte_chars().items()}


def detokenize(tok, ids):  # TokenizerConfig, ids -> text; special tokens render as their text
    out = bytearray()
    for i in ids:
        text = tok.tokens[i]
        if tok.token_types[i] == NORMAL:
            out.extend(BYTE_OF_CHAR.get(ch, ord("?")) for ch in text)
        else:
            out.extend(text.encode("utf-8"))
    return out.decode("utf-8", errors="replace")
