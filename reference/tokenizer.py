"""GGUF byte-level BPE (tokenizer.ggml.model = gpt2) with llama.cpp's semantics (docs/text.md, Tokenizer).

    text --(special-token texts, longest first)--> fragments and special ids
         --(the pre-tokenizer named by tokenizer.ggml.pre)--> words
         --(bytes as GPT-2 characters, BPE: lowest merge rank first, then leftmost)--> ids

llama.cpp does not run the regexes of tokenizer.json but adaptations of them, and token parity with
it means reproducing those:
- gpt-4o / llama4 (GPT4O): the adapted regex, run on a "collapsed" text in which every code point
  >= 128 is one byte standing for its Unicode class. Every non-ASCII letter is then both upper and
  lower case, combining marks are not letters (they split away from their base letter, unlike
  transformers), and non-ASCII digits are numbers.
- llama-bpe (LLAMA3) and gpt-2: llama.cpp's hand-written scanners, quirks included.
Token attributes follow llama.cpp's load-time fixes: end-of-generation names become CONTROL, and
`<|start|>`, `<|message|>`, `<|channel|>`, `<|constrain|>` become USER_DEFINED (matched even
without special parsing, always rendered).

Not reproduced: the FIM-name and `<|end|>`/`</s>` attribute fixes and the per-model LSTRIP/RSTRIP
attributes (no Muse-Glimmer token has them); the order llama.cpp's unstable sort gives special
tokens of equal length (here: by id); code points Unicode assigned after 15.1 when Python's own
unicodedata is newer than llama.cpp's table (Python >= 3.14).
"""
import heapq
import os
import re
import unicodedata
from dataclasses import dataclass
from functools import lru_cache

from . import artifacts, gguf

UNDEFINED, NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 0, 1, 2, 3, 4, 5, 6

# llama.cpp's "gpt-oss hack": these are USER_DEFINED whatever the GGUF says (llama-vocab.cpp)
ALWAYS_RENDERED = frozenset(["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"])


class TokenizerError(ValueError):
    """A vocabulary or an input this tokenizer cannot handle; the message is one line."""


# ---------------------------------------------------------------------------------------------
# Bytes as printable characters (GPT-2's reversible map)

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


CHAR_OF_BYTE = gpt2_byte_chars()
BYTE_OF_CHAR = {ch: b for b, ch in CHAR_OF_BYTE.items()}


def byte_encode(word):  # str -> its UTF-8 bytes as GPT-2 characters
    return "".join(CHAR_OF_BYTE[b] for b in word.encode("utf-8"))


# ---------------------------------------------------------------------------------------------
# Unicode classes as llama.cpp's table has them (generated from Unicode 15.1)

WHITESPACE = frozenset([*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B),
                        0x2028, 0x2029, 0x202F, 0x205F, 0x3000])  # the White_Space property

# Code points Unicode 15.0 and 15.1 assigned (first-last, then the class), which an older Python
# unicodedata reports as unassigned; llama.cpp's table knows them.
UNICODE_15_ADDITIONS = """
0CF3M 0ECEM 2FFC-2FFFS 31EFS 10EFD-10EFFM 1123F-11240L 11241M 11B00-11B09P 11F00-11F01M 11F02L
11F03M 11F04-11F10L 11F12-11F33L 11F34-11F3AM 11F3E-11F42M 11F43-11F4FP 11F50-11F59N 1342FL
13440M 13441-13446L 13447-13455M 1B132L 1B155L 1D2C0-1D2D3N 1DF25-1DF2AL 1E030-1E06DL 1E08FM
1E4D0-1E4EBL 1E4EC-1E4EFM 1E4F0-1E4F9N 1F6DCS 1F774-1F776S 1F77B-1F77FS 1F7D9S 1FA75-1FA77S
1FA87-1FA88S 1FAAD-1FAAFS 1FABB-1FABDS 1FABFS 1FACE-1FACFS 1FADA-1FADBS 1FAE8S 1FAF7-1FAF8S
2B739L 2EBF0-2EE5DL 31350-323AFL
"""


def parse_additions(text):  # -> [(first, last, class)]
    ranges = []
    for item in text.split():
        first, _, last = item[:-1].partition("-")
        ranges.append((int(first, 16), int(last or first, 16), item[-1]))
    return ranges


ADDED_RANGES = parse_additions(UNICODE_15_ADDITIONS)


@lru_cache(maxsize=None)
def unicode_class(cp):  # code point -> "W" whitespace, "L", "N", "M", "P", "S" or "O" (anything else)
    if cp in WHITESPACE:
        return "W"
    category = unicodedata.category(chr(cp))
    if category == "Cn":
        category = next((c for first, last, c in ADDED_RANGES if first <= cp <= last), "O")
    return category[0] if category[0] in "LNMPS" else "O"


# the byte llama.cpp puts in the collapsed text for a code point >= 128 of each class
COLLAPSED_BYTE = {"W": 0x0B, "N": 0xD1, "L": 0xD2, "P": 0xD3, "M": 0xD4, "S": 0xD5, "O": 0xD0}
# \p{X} in a collapsed regex: the class byte plus the ASCII members of the class
COLLAPSED_CLASS = {"N": r"\xd10-9", "L": r"\xd2A-Za-z"}


class CollapseTable(dict):
    """str.translate table: ASCII stays, every other code point becomes its class byte."""

    def __missing__(self, cp):  # code point -> its byte in the collapsed text (computed once)
        self[cp] = cp if cp < 128 else COLLAPSED_BYTE[unicode_class(cp)]
        return self[cp]


COLLAPSE = CollapseTable()


def collapse_text(text):  # str -> bytes, one byte per code point
    return text.translate(COLLAPSE).encode("latin-1")


def collapse_regex(pattern):  # regex using \p{L}, \p{N} -> compiled bytes regex over collapsed text
    out, inside, i = "", False, 0
    while i < len(pattern):
        ch = pattern[i]
        escaped = i > 0 and pattern[i - 1] == "\\"
        if pattern.startswith("\\p{", i):
            members = COLLAPSED_CLASS[pattern[i + 3]]
            out += members if inside else f"[{members}]"
            i = pattern.index("}", i) + 1
            continue
        if ch == "[" and not escaped:
            inside = True
        elif ch == "]" and inside and not escaped:
            inside = False
        out += ch
        i += 1
    return re.compile(out.encode("ascii"))


# ---------------------------------------------------------------------------------------------
# Pre-tokenizers: str -> words

CONTRACTIONS = r"'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD]"
# llama.cpp's adaptation of the GPT4O / Llama-4 split (the original uses \p{Lu}..\p{M} classes)
GPT4O_REGEX = collapse_regex(
    rf"[^\r\n\p{{L}}\p{{N}}]?((?=[\p{{L}}])([^a-z]))*((?=[\p{{L}}])([^A-Z]))+(?:{CONTRACTIONS})?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?((?=[\p{{L}}])([^a-z]))+((?=[\p{{L}}])([^A-Z]))*(?:{CONTRACTIONS})?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def split_gpt4o(text):  # str -> words
    words, start = [], 0
    for m in GPT4O_REGEX.finditer(collapse_text(text)):
        if m.start() > start:  # text no alternative matched stays a word of its own
            words.append(text[start:m.start()])
        words.append(text[m.start():m.end()])
        start = m.end()
    if start < len(text):
        words.append(text[start:])
    return words


def classes_of(text):  # str -> [class per code point]
    return [unicode_class(ord(ch)) for ch in text]


def split_llama3(text):  # str -> words, llama.cpp's scanner for the LLAMA3 regex
    """(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*
    |\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+, as llama.cpp scans it (past the end a position has no class)."""
    cls, n = classes_of(text), len(text)
    at = lambda i: cls[i] if i < n else None  # noqa: E731
    # llama.cpp lowers with Unicode's table, but no non-ASCII letter lowers to s, t, m, d, r, e, v or l
    lower = lambda i: text[i].lower() if text[i].isascii() else text[i]  # noqa: E731
    words, pos = [], 0
    while pos < n:
        start, ch = pos, text[pos]
        if ch == "'" and pos + 1 < n and lower(pos + 1) in ("s", "t", "m", "d"):
            pos += 2
        elif ch == "'" and pos + 2 < n and lower(pos + 1) + lower(pos + 2) in ("re", "ve", "ll"):
            pos += 3
        elif ch not in "\r\n" and cls[pos] != "N" and (cls[pos] == "L" or at(pos + 1) == "L"):
            pos += 1
            while at(pos) == "L":
                pos += 1
        elif cls[pos] == "N":
            while at(pos) == "N" and pos - start < 3:
                pos += 1
        elif (at(pos + 1) if ch == " " else cls[pos]) not in ("W", "L", "N"):
            pos += ch == " "
            while at(pos) not in ("W", "L", "N", None):
                pos += 1
            while pos < n and text[pos] in "\r\n":
                pos += 1
        else:
            run = 0
            while at(pos + run) == "W":
                run += 1
            newline_end = max((pos + k + 1 for k in range(run) if text[pos + k] in "\r\n"), default=0)
            if newline_end:
                pos = newline_end
            elif run > 1 and pos + run < n:
                pos += run - 1
            else:
                pos += max(run, 1)
        words.append(text[start:pos])
    return words


def split_gpt2(text):  # str -> words, llama.cpp's scanner for the GPT-2 regex
    """'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S), as llama.cpp
    scans it: contractions are case-sensitive, and a lone whitespace is a word of its own."""
    cls, n = classes_of(text), len(text)
    at = lambda i: cls[i] if i < n else None  # noqa: E731
    words, pos = [], 0
    while pos < n:
        start, ch = pos, text[pos]
        kind = at(pos + 1) if ch == " " else cls[pos]
        if ch == "'" and pos + 1 < n and text[pos + 1] in "stmd":
            pos += 2
        elif ch == "'" and pos + 2 < n and text[pos + 1:pos + 3] in ("re", "ve", "ll"):
            pos += 3
        elif kind in ("L", "N"):
            pos += ch == " "
            while at(pos) == kind:
                pos += 1
        elif kind not in ("W", None):
            pos += ch == " "
            while at(pos) not in ("W", "L", "N", None):
                pos += 1
        else:
            run = 0
            while at(pos + run) == "W":
                run += 1
            pos += run - 1 if run > 1 and pos + run < n else max(run, 1)
        words.append(text[start:pos])
    return words


@dataclass(frozen=True)
class PreTokenizer:
    split: object
    ignore_merges: bool   # a word that is a whole token is taken as is, without BPE
    clean_spaces: bool    # detokenize removes the space before ?!., and some contractions
    add_bos: bool         # llama.cpp's default when tokenizer.ggml.add_bos_token is absent


GPT4O = PreTokenizer(split_gpt4o, ignore_merges=False, clean_spaces=False, add_bos=False)
LLAMA3 = PreTokenizer(split_llama3, ignore_merges=True, clean_spaces=True, add_bos=True)
GPT2 = PreTokenizer(split_gpt2, ignore_merges=False, clean_spaces=True, add_bos=False)

# tokenizer.ggml.pre -> pre-tokenizer, as llama.cpp maps the names (llama-vocab.cpp)
PRE_TOKENIZERS = {
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2", "talkie"], GPT4O),
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                     "lfm2", "jina-v5-nano"], LLAMA3),
    **dict.fromkeys(["gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de",
                     "a.x-4.0", "mellum", "modern-bert", "exaone4"], GPT2),
}


def read_vocab(path):  # any GGUF with a vocabulary (a model or a vocabulary-only file) -> TokenizerConfig
    return gguf.read_tokenizer(gguf.Metadata(gguf.open_reader(path), os.fspath(path)))


def pre_tokenizer(tok):  # TokenizerConfig -> PreTokenizer
    if tok.model != "gpt2":
        raise TokenizerError(f"tokenizer.ggml.model {tok.model!r} is not supported (only byte-level BPE, 'gpt2')")
    if tok.pre not in PRE_TOKENIZERS:
        raise TokenizerError(f"tokenizer.ggml.pre {tok.pre!r} is not supported "
                             f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})")
    return PRE_TOKENIZERS[tok.pre]


# ---------------------------------------------------------------------------------------------
# Token attributes and pieces (what llama_token_to_piece returns)

def token_text(tok, i):  # llama.cpp renames empty tokens
    return tok.tokens[i] or f"[EMPTY_{i}]"


def token_attr(tok, i):  # -> NORMAL, CONTROL, ... after llama.cpp's load-time fixes
    text = tok.tokens[i]
    if text in ALWAYS_RENDERED:
        return USER_DEFINED
    if text in gguf.EOG_TOKEN_NAMES:
        return CONTROL
    t = tok.token_types[i]
    return t if NORMAL <= t <= BYTE else UNDEFINED


def decode_gpt2_chars(text):  # GPT-2 characters -> bytes; llama.cpp marks a character outside the map
    out = bytearray()
    for ch in text:
        if ch in BYTE_OF_CHAR:
            out.append(BYTE_OF_CHAR[ch])
        else:
            out += f"[UNK_BYTE_0x{ch.encode('utf-8').hex()}{text}]".encode("utf-8")
    return bytes(out)


def token_to_piece(tok, i, special=True):  # -> bytes; CONTROL/UNKNOWN text only when `special`
    if not 0 <= i < tok.n_vocab:
        raise TokenizerError(f"token id {i} is out of range for a vocabulary of {tok.n_vocab}")
    attr, text = token_attr(tok, i), token_text(tok, i)
    if attr in (CONTROL, UNKNOWN):
        return text.encode("utf-8") if special else b""
    if attr == USER_DEFINED:
        return text.encode("utf-8")
    if attr == NORMAL:
        return decode_gpt2_chars(text)
    if attr == BYTE:  # "<0xXX>"
        return bytes([int(text[3:5], 16)])
    return b""


def clean_spaces(text):  # bytes -> bytes, llama_detokenize's three clean-up passes
    out = bytearray(text[:1])
    for i in range(1, len(text)):  # " ?", " !", " .", " ," lose the space
        if text[i - 1] == 0x20 and text[i] in b"?!.,":
            out.pop()
        out.append(text[i])
    text, out, i = bytearray(out), bytearray(out[:1]), 1
    while i < len(text):  # " ' " becomes "'" (llama.cpp zeroes the second space in place)
        x = text[i]
        if x == 0x27 and i + 1 < len(text) and text[i - 1] == 0x20 and text[i + 1] == 0x20:
            out.pop()
            text[i + 1] = 0
            i += 1
        out.append(x)
        i += 1
    text, out = bytes(out), bytearray(out[:1])
    for i in range(1, len(text)):  # " 's", " 'm", " 're", " 've" lose the space
        if text[i - 1] == 0x20 and text[i] == 0x27 and i + 1 < len(text):
            if text[i + 1:i + 2] in (b"s", b"m") or (i + 2 < len(text) and text[i + 1:i + 3] in (b"re", b"ve")):
                out.pop()
        out.append(text[i])
    return bytes(out)


def detokenize(tok, ids, special=True):  # TokenizerConfig, ids -> text (llama_detokenize, keeping BOS/EOS)
    text = b"".join(token_to_piece(tok, i, special) for i in ids)
    pre = PRE_TOKENIZERS.get(tok.pre)
    if pre is not None and pre.clean_spaces:
        text = clean_spaces(text)
    return text.decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------------------------
# Encoding

def parse_merges(merges):  # ["a b", ...] -> {(a, b): rank}; the first of duplicate merges wins
    ranks = {}
    for rank, merge in enumerate(merges):
        cut = merge.find(" ", 1)
        pair = (merge[:cut], merge[cut + 1:]) if cut >= 0 else ("", "")
        ranks.setdefault(pair, rank)
    return ranks


def bpe_merge(word, ranks):  # GPT-2-character word -> symbols after merging, llama.cpp's order
    """Repeatedly merge the adjacent pair of lowest rank (the leftmost among equal ranks), with the
    pairs a merge creates joining the queue at once, as llama.cpp's priority queue does."""
    symbols = list(word)
    nxt = list(range(1, len(symbols))) + [-1]
    prev = list(range(-1, len(symbols) - 1))
    queue = []

    def push(left, right):
        if left >= 0 and right >= 0:
            rank = ranks.get((symbols[left], symbols[right]))
            if rank is not None:
                heapq.heappush(queue, (rank, left, right, symbols[left] + symbols[right]))

    for i in range(len(symbols) - 1):
        push(i, i + 1)
    while queue:
        _, left, right, merged = heapq.heappop(queue)
        if not symbols[left] or not symbols[right] or symbols[left] + symbols[right] != merged:
            continue  # a pair that an earlier merge used up
        symbols[left], symbols[right] = merged, ""
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prev[nxt[right]] = left
        push(prev[left], left)
        push(left, nxt[left])
    return [s for s in symbols if s]


class Tokenizer:
    """Encodes text as llama_tokenize does; built once per vocabulary (dictionaries over it)."""

    WORD_CACHE_LIMIT = 1 << 16
    # Peak memory of tokenize per byte of text: measured 24 on glimmer-default (a 2.7 MB line of
    # words, numbers, CJK and accents); 32 leaves a third more for the other pre-tokenizers' scanners.
    PEAK_BYTES_PER_BYTE = 32

    def __init__(self, tok):  # TokenizerConfig
        self.tok = tok
        self.pre = pre_tokenizer(tok)
        self.add_bos = self.pre.add_bos if tok.add_bos is None else tok.add_bos
        self.id_of = {token_text(tok, i): i for i in range(tok.n_vocab)}  # the last of duplicates wins
        self.ranks = parse_merges(tok.merges)
        attrs = [token_attr(tok, i) for i in range(tok.n_vocab)]
        # matched before pre-tokenization, longest UTF-8 text first (llama.cpp's special cache)
        self.specials = sorted(((i, token_text(tok, i), attrs[i]) for i in range(tok.n_vocab)
                                if attrs[i] in (CONTROL, USER_DEFINED, UNKNOWN)),
                               key=lambda s: -len(s[1].encode("utf-8")))
        self.word_ids = {}
        self.longest = max((len(token_text(tok, i).encode("utf-8")) for i in range(tok.n_vocab)), default=1)

    def check_length(self, text, max_tokens=None):  # -> None; TokenizerError for a text too long to tokenize
        """Before the pre-tokenizer: every token covers at most `longest` bytes, so a text of n bytes
        is at least n / longest tokens, refused past max_tokens (a model's context); and its peak
        memory (PEAK_BYTES_PER_BYTE) must fit what this process can still allocate."""
        n = len(text.encode("utf-8", "surrogatepass"))
        at_least = -(-n // self.longest)
        if max_tokens is not None and at_least > max_tokens:
            raise TokenizerError(f"the text is {n} bytes: at least {at_least} tokens (the longest token is "
                                 f"{self.longest} bytes), more than the training context of {max_tokens} "
                                 "(--beyond-n-ctx-train runs it anyway)")
        artifacts.check_allocation(n * self.PEAK_BYTES_PER_BYTE, f"tokenizing a text of {n} bytes", TokenizerError)

    def split_special(self, text, parse_special):  # str -> [str fragment | special id]
        fragments = [text] if text else []
        for i, special_text, attr in self.specials:
            if not parse_special and attr != USER_DEFINED:
                continue
            split = []
            for f in fragments:
                if isinstance(f, int) or special_text not in f:
                    split.append(f)
                    continue
                for k, part in enumerate(f.split(special_text)):
                    if k:
                        split.append(i)
                    if part:
                        split.append(part)
            fragments = split
        return fragments

    def word_to_ids(self, word):  # GPT-2-character word -> ids
        ids = self.word_ids.get(word)
        if ids is not None:
            return ids
        if self.pre.ignore_merges and word in self.id_of:
            ids = [self.id_of[word]]
        else:
            ids = []
            for symbol in bpe_merge(word, self.ranks):
                if symbol in self.id_of:
                    ids.append(self.id_of[symbol])
                else:  # llama.cpp falls back to one token per byte of the symbol's UTF-8 text
                    ids += [self.id_of[chr(b)] for b in symbol.encode("utf-8") if b < 128 and chr(b) in self.id_of]
        if len(self.word_ids) >= self.WORD_CACHE_LIMIT:
            self.word_ids.clear()
        self.word_ids[word] = ids
        return ids

    def tokenize(self, text, add_special=True, parse_special=False, max_tokens=None):  # str -> ids (llama_tokenize)
        if not isinstance(text, str):
            raise TokenizerError(f"text to tokenize must be str, got {type(text).__name__}")
        self.check_length(text, max_tokens)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise TokenizerError(f"text is not valid Unicode ({e.reason} at {e.start})") from None
        ids = []
        if add_special and self.add_bos:
            ids.append(self.required_id("bos"))
        for fragment in self.split_special(text, parse_special):
            if isinstance(fragment, int):
                ids.append(fragment)
                continue
            for word in self.pre.split(fragment):
                ids += self.word_to_ids(byte_encode(word))
        if add_special and self.tok.add_eos:
            ids.append(self.required_id("eos"))
        return ids

    def required_id(self, name):  # "bos" | "eos" -> id, which the vocabulary must define
        i = getattr(self.tok, name)
        if i < 0:
            raise TokenizerError(f"the vocabulary asks for {name.upper()} but has no tokenizer.ggml.{name}_token_id")
        return i

    def detokenize(self, ids, special=True):  # ids -> text
        return detokenize(self.tok, ids, special)


# ---------------------------------------------------------------------------------------------
# Prompt bytes: what llama.cpp reads of bytes that are not valid UTF-8

def utf8_code_point(data, i):  # -> (code point, bytes read) at data[i], as llama.cpp's unicode_cpt_from_utf8
    """The lead byte says the length and the bytes after it need only be 10xxxxxx: an overlong
    form (C1 81) is read as its code point (A). A byte that starts no such sequence is U+FFFD,
    and the read goes on at the next byte."""
    lead = data[i]
    size = 1 if lead < 0x80 else 0 if lead < 0xC0 else 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4 if lead < 0xF8 else 0
    tail = data[i + 1:i + size]
    if size == 0 or len(tail) < size - 1 or any(b & 0xC0 != 0x80 for b in tail):
        return 0xFFFD, 1
    cpt = lead & (0x7F >> size if size > 1 else 0x7F)
    for b in tail:
        cpt = cpt << 6 | b & 0x3F
    return cpt, size


def llama_text(data, source):  # bytes (a prompt as given), where they came from -> the str llama.cpp's tokenizer sees
    try:
        return data.decode("utf-8")  # valid UTF-8 reads the same in both
    except UnicodeDecodeError:
        pass
    chars, i = [], 0
    while i < len(data):
        cpt, size = utf8_code_point(data, i)
        if 0xD800 <= cpt <= 0xDFFF or cpt > 0x10FFFF:  # llama.cpp aborts on the second, tokenizes the first
            raise TokenizerError(f"{source}: byte {i} encodes U+{cpt:X}, a surrogate or no code point")
        chars.append(chr(cpt))
        i += size
    return "".join(chars)
