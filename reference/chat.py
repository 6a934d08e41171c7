"""Chat prompts in, model output out: Muse-Glimmer's ATEM chat format (docs/text.md, Chat template).

- `render_chat` runs the GGUF's `tokenizer.chat_template` in jinja2's immutable sandbox with what
  llama.cpp and transformers give a template: `strftime_now` (pinned by `date` for reproducible
  prompts, since the default system block carries today's date), `raise_exception`, a `tojson` that
  writes `json.dumps` (no HTML escaping, keys in order), `tools`, and the reasoning strength, which
  llama.cpp binds to both `reasoning_effort` and `reasoning_strength`. The template is untrusted
  input, so the sandbox also bounds its work (`BoundedSandbox`): a template that would loop for
  hours or build gigabytes is a ChatError instead.
- `prompt_ids` tokenizes a rendered prompt as llama.cpp does: special-token text is parsed, and the
  BOS the template wrote is not doubled.
- `expand_images`: the template writes one `<|patch|>` per image; the model reads
  `<|image_start|>`, one `<|patch|>` per image token (one embedding row each), `<|image_end|>`.
- `expand_videos`: the template writes one `<|video|>` per video; transformers' processor makes it
  `<|vid_start|>`, per frame pair its timestamp text and one `<|video|>` per token, pairs separated
  by `<|vid_frame_separator|>`, then `<|vid_end|>` (processing_muse_glimmer.py:75-101).
- `parse_output` splits generated text into reasoning (the `to=self` channel), the final content
  and ATEM tool calls, following llama.cpp's muse-glimmer PEG parser; arguments come back typed by
  the tool's JSON schema (raw text for string parameters, JSON values otherwise).
"""
import functools
import json
import re
import string
from collections.abc import Iterator, Mapping, MappingView
from datetime import date as Date, datetime

import jinja2
import jinja2.ext
import numpy as np
from jinja2 import nodes
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

GENERATION_PROMPT = "<|start|>assistant"
IMAGE_PLACEHOLDER, IMAGE_START, IMAGE_END = "<|patch|>", "<|image_start|>", "<|image_end|>"
VIDEO_PLACEHOLDER, VIDEO_START, VIDEO_END = "<|video|>", "<|vid_start|>", "<|vid_end|>"
VIDEO_SEPARATOR = "<|vid_frame_separator|>"


class ChatError(ValueError):
    """A template that cannot render, a bad argument, or model output that is not ATEM; one line."""


# ---------------------------------------------------------------------------------------------
# Rendering

def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):  # jinja filter
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def raise_exception(message):  # the template's own error, as one line
    raise ChatError(f"chat template: {message}")


def parse_date(text):  # "YYYY-MM-DD" -> date
    try:
        return Date.fromisoformat(text)
    except (TypeError, ValueError):
        raise ChatError(f"date must be YYYY-MM-DD, got {text!r}") from None


# The bounds of one rendering. The release template renders each golden conversation in at most
# 69 steps and 11 k characters (as BoundedSandbox counts them), and a 131072-token context holds
# about 0.5 M characters: a template that needs more is runaway, not a prompt.
MAX_STEPS = 1 << 20      # loop iterations, calls and filters, about a second of them; plus (items in
                         # the input)^2, since a template may compare every message with every other
                         # (the release one does, to name a tool message that has no name), up to
MAX_INPUT_STEPS = 1 << 26  # a minute of steps whatever the input
MAX_CHARS = 1 << 26      # the longest value one rendering may build, and the longest text it prints
MAX_WORK = 1 << 32       # characters built, printed and compared in all, copies included: a template
                         # that builds its prompt by `ns.s = ns.s + ...` copies it once per message
MAX_INT_BITS = 1 << 16   # big-integer arithmetic grows faster than the digits
GROWING = frozenset(["center", "ljust", "rjust", "zfill", "expandtabs", "indent", "wordwrap", "join", "replace",
                     "batch", "slice", "tojson", "format", "format_map"])  # can build far more than they read
WIDTH_ARGS = frozenset(["center", "ljust", "rjust", "zfill", "expandtabs", "indent", "replace", "batch", "slice",
                        "tojson"])  # ... and of these an integer argument is a width or a count
CONSUMING = frozenset(["join", "batch", "slice"])  # read an iterator whole: as a list it can be measured first
PERCENT_FIELD = re.compile(r"%(?:\([^)]*\))?[-+ #0]*(\d*)(?:\.(\d*))?")  # a % field ("%(key)" too): width, precision


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with a budget for one rendering (a GGUF's template is untrusted input):
    every loop iteration, call and filter is a step, and what is printed or built counts against
    MAX_CHARS. An operation whose result can be far larger than what it reads (* and %, padding,
    joining, replacing, indenting, formatting, powers) is refused before it runs; the others are
    counted after. Whatever is printed, compared or filtered is measured first: a few lists that
    share items can stand for more text than any machine holds."""

    intercepted_binops = frozenset(["+", "*", "**", "%"])

    def __init__(self, max_steps, filters, **options):
        super().__init__(**options)
        self.filters = {name: self.bounded_filter(name, f) for name, f in {**self.filters, **filters}.items()}
        self.filters.update(loop_steps=loop_steps, printed=printed, compared=compared)
        self.tests = {name: self.bounded_test(name, t) for name, t in self.tests.items()}
        self.steps, self.max_steps, self.work, self.printed = 0, max_steps, 0, 0
        self.measured = {}  # id -> (value, characters, depth); the value is kept so that its id stays its own

    def compile_bounded(self, source):  # template text -> Template whose loops, printing and comparing are counted
        tree = self.parse(source)
        for loop in list(tree.find_all(nodes.For)):
            loop.iter = through("loop_steps", loop.iter)
        for node in list(tree.find_all((nodes.Output, nodes.Concat))):  # literal text, {{ }} and ~ operands
            node.nodes = [through("printed", n) for n in node.nodes]
        for node in list(tree.find_all(nodes.Compare)):
            node.expr = through("compared", node.expr)
            for operand in node.ops:
                operand.expr = through("compared", operand.expr)
        for pair in list(tree.find_all(nodes.Pair)):  # a dict key is hashed
            if not isinstance(pair.key, nodes.Const):
                pair.key = through("compared", pair.key)
        return self.from_string(tree)

    def step(self):
        self.steps += 1
        if self.steps > self.max_steps:
            raise ChatError(f"chat template: over {self.max_steps} steps (loop iterations and calls); "
                            "does it loop without end?")

    def check_room(self, n, what):  # raise before an operation that would build a value of n characters
        if n > MAX_CHARS:
            raise ChatError(f"chat template: {what} would take it over {MAX_CHARS} characters in one value")
        if self.work + n > MAX_WORK:
            raise ChatError(f"chat template: {what} would take it over {MAX_WORK} characters built in all")

    def count(self, n, what):  # n more characters built, printed or compared
        self.check_room(n, what)
        self.work += n

    def built(self, value, what):  # -> value, counted as what an operation allocated for it
        """A string's characters, an integer's digits, a container's own items (not its items'
        contents: it shares those with whatever held them already)."""
        if isinstance(value, (str, list, tuple, dict, set, frozenset)):
            self.count(len(value), what)
        elif isinstance(value, int):
            self.count(self.measure(value)[0], what)
        return value

    def check_readable(self, value, what):  # -> characters of a value read whole (print, compare, filter)
        n = self.measure(value)[0]
        if n > MAX_CHARS:
            raise ChatError(f"chat template: {what} a value of over {MAX_CHARS} characters")
        return n

    def measure(self, value):  # -> (characters of value as text, nesting depth), about
        """Containers count each item every time it appears (a list holding a list twice prints it
        twice); each object is measured once, so that measuring takes no longer than building."""
        if isinstance(value, str):
            return len(value), 0
        if isinstance(value, int):
            return value.bit_length() // 3 + 1, 0
        if isinstance(value, float):
            return len(repr(value)), 0
        if isinstance(value, Namespace):  # prints its attributes; a copy, since `set ns.x` changes them
            value = dict(object.__getattribute__(value, "_Namespace__attrs"))
        if isinstance(value, Mapping):
            items = [*value.keys(), *value.values()]
        elif isinstance(value, (list, tuple, set, frozenset, MappingView)):
            items = value
        else:
            return 1, 0
        known = self.measured.get(id(value))
        if known is None:
            self.measured[id(value)] = (value, 1, 0)  # a container holding itself counts once
            size, depth = len(items) + 2, 0
            for item in items:
                n, d = self.measure(item)
                size, depth = size + n, max(depth, d + 1)
                if size > MAX_CHARS:
                    break
            known = self.measured[id(value)] = (value, size, depth)
        return known[1], known[2]

    def check_growth(self, name, value, args):  # raise before a GROWING filter or str method builds too much
        """Bound: every character or item of `value` is written once, with the longest other
        argument and the widest width once per level of nesting added (a format's widths are in
        its format string)."""
        if name not in GROWING:
            return
        widths = [a for a in args if isinstance(a, int)] if name in WIDTH_ARGS else []
        if name in ("format", "format_map") and isinstance(value, str):
            widths = format_widths(value)
            if "*" in value or re.search(r"\{[^{}]*\{", value):  # "%*d", "{:{w}}": a width is an argument
                widths += [a for a in args if isinstance(a, int)]
                widths += [v for a in args if isinstance(a, Mapping) for v in a.values() if isinstance(v, int)]
        longest = max((self.measure(a)[0] for a in args), default=0)
        size, depth = self.measure(value)
        self.check_room(size * (1 + longest + max(widths, default=0) * (depth + 1)), name)

    def check_bits(self, bits):
        if bits > MAX_INT_BITS:
            raise ChatError(f"chat template: an integer of over {MAX_INT_BITS} bits")

    def call_binop(self, context, operator, left, right):
        if operator == "*" and isinstance(left, int) and isinstance(right, int):
            self.check_bits(left.bit_length() + right.bit_length())
        elif operator == "*" and (isinstance(left, int) or isinstance(right, int)):
            count, repeated = (left, right) if isinstance(left, int) else (right, left)
            self.check_room(self.measure(repeated)[0] * max(count, 0), "operator *")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
            self.check_bits(left.bit_length() * right if abs(left) > 1 else 1)
        elif operator == "%" and isinstance(left, str):
            self.check_growth("format", left, [right])
        return self.built(super().call_binop(context, operator, left, right), f"operator {operator}")

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's names: no clash with keywords)
        __self.step()
        if isinstance(__obj, LoopContext) and args:  # a recursive loop's next level: its items are steps too
            args = [counted_steps(__self, args[0]), *args[1:]]
        method = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
        if isinstance(getattr(method, "__self__", None), str):
            args = [listed(method.__name__, a) for a in args]
            __self.check_growth(method.__name__, method.__self__, [*args, *kwargs.values()])
        return __self.built(super().call(__context, __obj, *args, **kwargs), "a call")

    def bounded_filter(self, name, f):  # filter -> the same filter, one step, checked before and counted after
        skip = 1 if getattr(f, "jinja_pass_arg", None) else 0  # the context or environment jinja passes first

        @functools.wraps(f)  # keeps jinja_pass_arg
        def bounded(*args, **kwargs):
            self.step()
            args = [listed(name, a) for a in args]
            self.check_readable(args[skip], f"filter {name} on")
            self.check_growth(name, args[skip], [*args[skip + 1:], *kwargs.values()])
            return self.built(f(*args, **kwargs), f"filter {name}")
        return bounded

    def bounded_test(self, name, test):  # test -> the same test, its operands measured first (eq, in: compared)
        skip = 1 if getattr(test, "jinja_pass_arg", None) else 0

        @functools.wraps(test)
        def bounded(*args, **kwargs):
            for value in [*args[skip:], *kwargs.values()]:
                self.check_readable(value, f"test {name} on")
            return test(*args, **kwargs)
        return bounded


def format_widths(text):  # -> the widths and precisions in the % and {} fields of a format string
    widths = [int(n) for field in PERCENT_FIELD.findall(text) for n in field if n]
    try:
        specs = [spec for _, _, spec, _ in string.Formatter().parse(text) if spec]
    except ValueError:  # not a valid {} format: str.format would refuse it before building anything
        specs = []
    return widths + [int(n) for spec in specs for n in re.findall(r"\d+", spec)]


def through(name, node):  # jinja expression node -> the same, passed through the filter `name`
    return nodes.Filter(node, name, [], [], None, None, lineno=node.lineno)


def listed(name, value):  # -> value, an iterator that a CONSUMING operation reads made a list
    return list(value) if name in CONSUMING and isinstance(value, Iterator) else value


# The filters compile_bounded inserts. They take the context, which also keeps jinja from running
# them once at compile time as it does filters of constants.

def counted_steps(env, items):  # -> the items, one step each
    for item in items:
        env.step()
        yield item


@jinja2.pass_context
def loop_steps(context, items):  # what every for loop iterates
    return counted_steps(context.environment, items)


@jinja2.pass_context
def printed(context, value):  # every printed value and ~ operand: its text counted
    env = context.environment
    n = env.measure(value)[0]
    env.count(n, "printing")
    env.printed += n
    if env.printed > MAX_CHARS:
        raise ChatError(f"chat template: printing would take it over {MAX_CHARS} characters of prompt")
    return value


@jinja2.pass_context
def compared(context, value):  # every operand of ==, <, in ... and every dict key: read whole
    env = context.environment
    env.count(env.check_readable(value, "comparing"), "comparing")
    return value


def template_environment(now, max_steps=MAX_STEPS):  # datetime that strftime_now formats -> sandboxed environment
    env = BoundedSandbox(max_steps, {"tojson": tojson}, trim_blocks=True, lstrip_blocks=True,
                         extensions=[jinja2.ext.loopcontrols])
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: now.strftime(fmt))
    del env.globals["lipsum"]  # builds text in one call, beyond the counting; no chat template needs it
    return env


def render_chat(template, messages, tools=None, bos_token="", eos_token="", add_generation_prompt=True,
                date=None, reasoning_strength=None, **variables):  # -> prompt text
    """`date` ("YYYY-MM-DD" or a date) pins what strftime_now reports; without it, now."""
    if not template:
        raise ChatError("the model has no chat template (tokenizer.chat_template)")
    now = datetime.now() if date is None else datetime.combine(
        date if isinstance(date, Date) else parse_date(date), datetime.min.time())
    if reasoning_strength is not None:
        variables.update(reasoning_effort=reasoning_strength, reasoning_strength=reasoning_strength)
    inputs = dict(messages=messages, tools=tools, bos_token=bos_token, eos_token=eos_token,
                  add_generation_prompt=add_generation_prompt, **variables)
    try:
        max_steps = MAX_STEPS + min(count_items(inputs) ** 2, MAX_INPUT_STEPS)
        compiled = template_environment(now, max_steps).compile_bounded(template)
        return compiled.render(**inputs)
    except ChatError:
        raise
    # what a template's own code can raise: jinja's errors (undefined names, the sandbox's refusals),
    # Python's on its operations (1/0, recursion without end, a bad index or argument)
    except (jinja2.TemplateError, ArithmeticError, RecursionError, LookupError, TypeError, ValueError,
            AttributeError, MemoryError) as e:
        first_line = str(e).splitlines()[0] if str(e) else ""
        raise ChatError(f"chat template failed: {type(e).__name__}: {first_line}") from None


def count_items(value):  # -> list items and mapping entries in value, at every level (JSON-like input)
    if isinstance(value, Mapping):
        return len(value) + sum(count_items(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return len(value) + sum(count_items(v) for v in value)
    return 0


def special_text(tok, i):  # TokenizerConfig, id (-1 when absent) -> the token's text or ""
    return tok.tokens[i] if i >= 0 else ""


def chat_prompt(tok, messages, **options):  # TokenizerConfig, messages -> prompt text from the GGUF's template
    return render_chat(tok.chat_template, messages, bos_token=special_text(tok, tok.bos),
                       eos_token=special_text(tok, tok.eos), **options)


def prompt_ids(tokenizer, prompt):  # Tokenizer, rendered prompt -> ids, exactly one BOS when the model adds one
    bos_text = special_text(tokenizer.tok, tokenizer.tok.bos)
    if tokenizer.add_bos and bos_text and prompt.startswith(bos_text):
        prompt = prompt[len(bos_text):]  # llama.cpp drops the rendered BOS and lets the tokenizer add it
    return tokenizer.tokenize(prompt, add_special=True, parse_special=True)


def token_id(tok, text):  # TokenizerConfig, token text -> id
    try:
        return tok.tokens.index(text)
    except ValueError:
        raise ChatError(f"the vocabulary has no {text} token") from None


def expand_images(ids, tok, n_image_tokens):  # ids with one <|patch|> per image, tokens per image -> ids
    patch, start, end = (token_id(tok, t) for t in (IMAGE_PLACEHOLDER, IMAGE_START, IMAGE_END))
    if ids.count(patch) != len(n_image_tokens):
        raise ChatError(f"the prompt has {ids.count(patch)} image placeholders for {len(n_image_tokens)} images")
    counts, out = iter(n_image_tokens), []
    for i in ids:
        out += [start] + [patch] * next(counts) + [end] if i == patch else [i]
    return out


def image_prompt_rows(tok, embed, prompt, images):  # ids, [[n_i, E] per image] -> embedding rows [T, E]
    """The prompt as mtmd decodes it: each <|patch|> becomes <|image_start|>, the image's rows,
    <|image_end|> (one position per row); a prompt without one gets them after BOS, where
    llama-mtmd-cli puts its media markers. `embed` (ids [T] -> [T, E]) gives the token rows; the
    image rows are raw projections, which the text model's embedding norm then treats as token rows."""
    patch = token_id(tok, IMAGE_PLACEHOLDER)
    if patch not in prompt:
        at = 1 if prompt and prompt[0] == tok.bos else 0
        prompt = prompt[:at] + [patch] * len(images) + prompt[at:]
    ids = np.asarray(expand_images(prompt, tok, [len(e) for e in images]))
    rows = embed(ids)
    rows[ids == patch] = np.concatenate(images).astype(rows.dtype)
    return rows


def timestamp_text(fmt, seconds):  # frame_timestamp_format, float -> its text; ChatError for a format that fails
    try:
        return fmt.format(timestamp=seconds)
    except (KeyError, IndexError, ValueError, AttributeError) as e:
        raise ChatError(f"video timestamp format {fmt!r} fails: {type(e).__name__}: {e}") from None


def expand_videos(ids, tokenizer, videos):  # ids with one <|video|> per video, [(stamp texts, tokens per pair)] -> ids
    """Each stamp's text sits between special tokens, so tokenizing it alone gives the ids
    transformers' tokenizer gives the expanded string."""
    tok = tokenizer.tok
    video, start, end, sep = (token_id(tok, t) for t in (VIDEO_PLACEHOLDER, VIDEO_START, VIDEO_END, VIDEO_SEPARATOR))
    if ids.count(video) != len(videos):
        raise ChatError(f"the prompt has {ids.count(video)} video placeholders for {len(videos)} videos")
    pending, out = iter(videos), []
    for i in ids:
        if i != video:
            out.append(i)
            continue
        stamps, per_pair = next(pending)
        out.append(start)
        for g, text in enumerate(stamps):
            out += tokenizer.tokenize(text, add_special=False, parse_special=False) + [video] * per_pair
            out.append(sep if g < len(stamps) - 1 else end)
    return out


def video_prompt_rows(tokenizer, embed, prompt, videos):  # ids, [(stamp texts, tokens per pair, rows [n, E])] -> [T, E]
    """As image_prompt_rows, for videos: a prompt without a <|video|> gets one per video after BOS."""
    tok = tokenizer.tok
    video = token_id(tok, VIDEO_PLACEHOLDER)
    if video not in prompt:
        at = 1 if prompt and prompt[0] == tok.bos else 0
        prompt = prompt[:at] + [video] * len(videos) + prompt[at:]
    ids = np.asarray(expand_videos(prompt, tokenizer, [(stamps, n) for stamps, n, _ in videos]))
    rows = embed(ids)
    rows[ids == video] = np.concatenate([e for _, _, e in videos]).astype(rows.dtype)
    return rows


# ---------------------------------------------------------------------------------------------
# Parsing model output

def is_any_schema(schema):  # a schema that constrains nothing
    keys = ("$ref", "oneOf", "anyOf", "type", "const", "enum", "properties", "allOf", "items",
            "prefixItems", "pattern", "minLength", "maxLength", "format")
    return isinstance(schema, dict) and not any(k in schema for k in keys)


def all_may_be_string(children):  # allOf: every child that constrains something allows a string
    constraining = [c for c in children if not is_any_schema(c)]
    return bool(constraining) and all(may_be_string(c) for c in constraining)


def may_be_string(schema):  # JSON schema -> whether a value may be a string (llama.cpp's rule; $ref: no)
    if not isinstance(schema, dict) or "$ref" in schema:
        return False
    for key in ("oneOf", "anyOf"):
        if key in schema:
            return any(may_be_string(c) for c in schema[key])
    kind = schema.get("type")
    if isinstance(kind, list):
        return any(may_be_string({**schema, "type": k}) for k in kind)
    if "const" in schema:
        return isinstance(schema["const"], str)
    if "enum" in schema:
        return any(isinstance(v, str) for v in schema["enum"])
    if kind is None:
        if "properties" in schema or "items" in schema or "prefixItems" in schema:
            return False
        if "allOf" in schema:
            return all_may_be_string(schema["allOf"])
        return any(k in schema for k in ("pattern", "minLength", "maxLength", "format"))
    if kind in ("object", "string") and "allOf" in schema and "properties" not in schema:
        return all_may_be_string(schema["allOf"])
    return kind == "string"


def tool_parameters(tools):  # OpenAI-style tools -> {name: {parameter: schema}}, in the tools' order
    functions = {}
    for tool in tools or []:
        fn = tool.get("function", tool)
        functions[fn["name"]] = (fn.get("parameters") or {}).get("properties") or {}
    return functions


class OutputParser:
    """A cursor over `<|start|>assistant` + the generated text; each method consumes or fails."""

    def __init__(self, text):  # "<|start|>assistant" + generated text
        self.text, self.pos = text, 0
        self.furthest = (-1, "")  # (offset, message): the failure a user needs to see

    def fail(self, expected):  # raise, remembering the failure deepest into the text
        near = self.text[self.pos:self.pos + 40]
        offset = self.pos - len(GENERATION_PROMPT)  # in the generated text
        error = f"model output is not ATEM: expected {expected} at offset {offset}, found {near!r}"
        if self.pos >= self.furthest[0]:
            self.furthest = (self.pos, error)
        raise ChatError(error)

    def accept(self, literal):  # -> whether the literal was there (and is consumed)
        if self.text.startswith(literal, self.pos):
            self.pos += len(literal)
            return True
        return False

    def expect(self, literal):  # consume the literal or fail
        if not self.accept(literal):
            self.fail(repr(literal))

    def until(self, *ends):  # -> the text before the first of `ends` (or the rest), not consuming the end
        found = [k for k in (self.text.find(e, self.pos) for e in ends) if k >= 0]
        stop = min(found) if found else len(self.text)
        piece, self.pos = self.text[self.pos:stop], stop
        return piece

    def space(self):  # consume whitespace
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1

    def reasoning_blocks(self):  # -> reasoning text of the leading `to=self` messages
        parts = []
        while self.text.startswith(GENERATION_PROMPT + " to=self<|message|>", self.pos):
            mark = self.pos
            self.pos += len(GENERATION_PROMPT + " to=self<|message|>")
            part = self.until("<|eom|>")
            if not self.accept("<|eom|>"):
                self.pos = mark  # an unterminated analysis is not reasoning (the final must then match)
                break
            parts.append(part)
        return "".join(parts)

    def final(self):  # -> content of a `to=user` (or recipient-less) message
        self.accept(" to=user")
        self.expect("<|message|>")
        return self.until("<|eot|>", "<|eom|>")

    def argument(self, schema):  # -> the value of one <atem:parameter>, after its name
        if may_be_string(schema):
            value = self.until("</atem:parameter>")
        else:
            try:
                value, self.pos = json.JSONDecoder().raw_decode(self.text, self.pos)
            except json.JSONDecodeError:
                self.fail("a JSON value")
        self.expect("</atem:parameter>")
        return value

    def tool_call(self, functions):  # -> {"name", "arguments"}
        self.expect(" to=")
        self.until("<|message|>")
        self.expect("<|message|><atem:function_calls>")
        self.space()
        self.expect('<atem:invoke name="')
        name = next((n for n in functions if self.text.startswith(n + '">', self.pos)), None)
        if name is None:
            self.fail("the name of an offered tool")
        self.pos += len(name) + 2
        self.space()
        arguments = {}
        while self.accept('<atem:parameter name="'):
            params = functions[name]
            key = next((k for k in params if self.text.startswith(k + '">', self.pos)), None)
            if key is None:
                self.fail(f"a parameter of {name}")
            self.pos += len(key) + 2
            arguments[key] = self.argument(params[key])
            self.space()
        self.expect("</atem:invoke>")
        self.space()
        self.expect("</atem:function_calls>")
        return {"name": name, "arguments": arguments}

    def tool_calls(self, functions):  # -> calls separated by <|eom|><|start|>assistant
        calls = [self.tool_call(functions)]
        while (call := self.attempt(lambda: self.next_tool_call(functions))) is not None:
            calls.append(call)
        return calls

    def next_tool_call(self, functions):  # -> the call after an <|eom|><|start|>assistant
        self.expect("<|eom|>" + GENERATION_PROMPT)
        return self.tool_call(functions)

    def trailing_tool_calls(self, functions):  # "answer, then act": <|eom|><|start|>assistant + calls
        self.expect("<|eom|>" + GENERATION_PROMPT)
        return self.tool_calls(functions)

    def attempt(self, parse):  # -> parse(), or None with the cursor back where it was (PEG backtracking)
        mark = self.pos
        try:
            return parse()
        except ChatError:
            self.pos = mark
            return None


def parse_output(generated, tools=None, extract_reasoning=True):
    """Text generated after the prompt's `<|start|>assistant` -> {"reasoning_content", "content",
    "tool_calls": [{"name", "arguments": {...}}]}. What follows the last message (its <|eot|>) is
    ignored. Grammar: (start analysis)* start (tool_calls | final (<|eom|> start tool_calls)?)."""
    p = OutputParser(GENERATION_PROMPT + generated)
    try:
        return parse_message(p, tool_parameters(tools), extract_reasoning)
    except ChatError:
        raise ChatError(p.furthest[1]) from None


def parse_message(p, functions, extract_reasoning):  # OutputParser at the start -> message dict
    message = {"reasoning_content": "", "content": "", "tool_calls": []}
    if not extract_reasoning and not functions:
        p.expect(GENERATION_PROMPT)
        message["content"] = p.text[p.pos:]
        return message
    analysis = p.reasoning_blocks()
    message["reasoning_content" if extract_reasoning else "content"] = analysis
    p.expect(GENERATION_PROMPT)
    if functions:
        calls = p.attempt(lambda: p.tool_calls(functions))
        if calls is not None:
            message["tool_calls"] = calls
            return message
    message["content"] += p.final()
    if functions:
        message["tool_calls"] = p.attempt(lambda: p.trailing_tool_calls(functions)) or []
    return message
