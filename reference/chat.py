"""Chat prompts in, model output out: Muse-Glimmer's ATEM chat format (spec/text.md §5).

- `render_chat` runs the GGUF's `tokenizer.chat_template` in jinja2's immutable sandbox with what
  llama.cpp and transformers give a template: `strftime_now` (pinned by `date` for reproducible
  prompts, since the default system block carries today's date), `raise_exception`, a `tojson` that
  writes `json.dumps` (no HTML escaping, keys in order), `tools`, and the reasoning strength, which
  llama.cpp binds to both `reasoning_effort` and `reasoning_strength`.
- `prompt_ids` tokenizes a rendered prompt as llama.cpp does: special-token text is parsed, and the
  BOS the template wrote is not doubled.
- `expand_images`: the template writes one `<|patch|>` per image; the model reads
  `<|image_start|>`, one `<|patch|>` per image token (one embedding row each), `<|image_end|>`.
- `parse_output` splits generated text into reasoning (the `to=self` channel), the final content
  and ATEM tool calls, following llama.cpp's muse-glimmer PEG parser; arguments come back typed by
  the tool's JSON schema (raw text for string parameters, JSON values otherwise).
"""
import json
from datetime import date as Date, datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

GENERATION_PROMPT = "<|start|>assistant"
IMAGE_PLACEHOLDER, IMAGE_START, IMAGE_END = "<|patch|>", "<|image_start|>", "<|image_end|>"


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


def template_environment(now):  # datetime that strftime_now formats -> sandboxed environment
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: now.strftime(fmt))
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
    try:
        compiled = template_environment(now).from_string(template)
        return compiled.render(messages=messages, tools=tools, bos_token=bos_token, eos_token=eos_token,
                               add_generation_prompt=add_generation_prompt, **variables)
    except ChatError:
        raise
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as e:
        first_line = str(e).splitlines()[0] if str(e) else ""
        raise ChatError(f"chat template failed: {type(e).__name__}: {first_line}") from None


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
