"""Chat prompts and output parsing against transformers and llama.cpp (golden/tokenizer/chat.json,
made by tools/regen/make_tokenizer_goldens.py): renderings identical to transformers' apply_chat_template
with the tiny model's template, their token ids identical to llama.cpp's, image placeholders
expanded as transformers' processor does, and the parser getting the template's own renderings
back. Everything compared is text or integers: every comparison is exact."""
import datetime
import json
import os

import pytest

from reference import chat, gguf
from reference.chat import ChatError, chat_prompt, expand_images, parse_output, prompt_ids, render_chat
from reference.run import main as run_main
from reference.tokenizer import Tokenizer
from conftest import GOLDEN, MODELS, cli_error, run_cli
from test_gguf import STR, planted

with open(os.path.join(GOLDEN, "tokenizer", "chat.json"), encoding="utf-8") as f:
    CHAT = json.load(f)
DATE = CHAT["date"]
CONVERSATIONS = {c["id"]: c for c in CHAT["conversations"]}
TOK = gguf.load(os.path.join(MODELS, "tiny-a-f32.gguf"), "text").tokenizer
TOKENIZER = Tokenizer(TOK)
TEMPLATE_OPTIONS = ("reasoning_strength", "knowledge_cutoff", "tool_namespace_descriptions", "add_generation_prompt")


def render(conv, messages=None, **overrides):  # conversation -> our rendering, as the golden was made
    options = {k: v for k, v in conv["options"].items() if k in TEMPLATE_OPTIONS}
    return chat_prompt(TOK, conv["messages"] if messages is None else messages, tools=conv["tools"], date=DATE,
                       **dict(options, **overrides))


RENDERED = [c for c in CONVERSATIONS.values() if "rendered" in c]


def test_enough_conversations():
    assert len(RENDERED) >= 10


@pytest.mark.parametrize("conv", RENDERED, ids=lambda c: c["id"])
def test_rendering_matches_transformers(conv):
    assert render(conv) == conv["rendered"]


@pytest.mark.parametrize("conv", RENDERED, ids=lambda c: c["id"])
def test_prompt_ids_match_llama_cpp(conv):
    # llama.cpp's ids of the rendering (add_bos=False, special=True); prompt_ids drops the rendered
    # BOS and lets the tokenizer add it, so both ways give exactly one BOS
    assert TOKENIZER.tokenize(conv["rendered"], add_special=False, parse_special=True) == conv["llama_cpp_ids"]
    assert prompt_ids(TOKENIZER, conv["rendered"]) == conv["llama_cpp_ids"]
    assert conv["llama_cpp_ids"].count(TOK.bos) == 1


def test_template_errors_like_transformers():
    conv = CONVERSATIONS["string-arguments"]
    with pytest.raises(ChatError) as e:
        render(conv)
    assert conv["error"] in str(e.value) and "\n" not in str(e.value)


def test_images_expand_like_transformers():
    conv = CONVERSATIONS["images"]
    ids = prompt_ids(TOKENIZER, render(conv))
    assert expand_images(ids, TOK, conv["image_tokens"]) == conv["expanded_ids"]


def reply_of(conv):  # -> (context messages, what the trailing assistant messages say)
    messages = conv["messages"]
    k = len(messages)
    while messages[k - 1]["role"] == "assistant":
        k -= 1
    replies = messages[k:]
    calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
             for m in replies for c in m.get("tool_calls") or []]
    return messages[:k], {"reasoning_content": "".join(m.get("reasoning_content") or "" for m in replies),
                          "content": "".join(m.get("content") or "" for m in replies), "tool_calls": calls}


@pytest.mark.parametrize("conv", [c for c in RENDERED if "rendered_context" in c], ids=lambda c: c["id"])
def test_parser_round_trips_the_templates_renderings(conv):
    context, expected = reply_of(conv)
    assert render(conv, context, add_generation_prompt=True) == conv["rendered_context"]
    generated = conv["rendered"][len(conv["rendered_context"]):]
    assert parse_output(generated, conv["tools"]) == expected


# The cases of llama.cpp's tests/test-chat.cpp for this format (the "Muse Glimmer format tests").
SPECIAL_FUNCTION = [{"type": "function", "function": {"name": "special_function", "description": "I'm special",
                     "parameters": {"type": "object", "properties": {"arg1": {"type": "integer"}},
                                    "required": ["arg1"]}}}]
CALL = ('<atem:function_calls>\n<atem:invoke name="special_function">\n<atem:parameter name="arg1">1'
        '</atem:parameter>\n</atem:invoke>\n</atem:function_calls>')
CALLED = [{"name": "special_function", "arguments": {"arg1": 1}}]
LLAMA_CPP_CASES = [
    (" to=user<|message|>Hello, world!\nWhat's up?<|eot|>", None, ("", "Hello, world!\nWhat's up?", [])),
    (" to=special_function<|message|>" + CALL, SPECIAL_FUNCTION, ("", "", CALLED)),
    (" to=user<|message|>Hello, world!\nWhat's up?<|eom|><|start|>assistant to=special_function<|message|>" + CALL,
     SPECIAL_FUNCTION, ("", "Hello, world!\nWhat's up?", CALLED)),
    (" to=user<|message|>You invoke it like this:\n" + CALL + "<|eot|>", SPECIAL_FUNCTION,
     ("", "You invoke it like this:\n" + CALL, [])),
    (" to=self<|message|>I could use " + CALL + " here<|eom|><|start|>assistant to=user<|message|>Hello!<|eot|>",
     SPECIAL_FUNCTION, ("I could use " + CALL + " here", "Hello!", [])),
    (" to=self<|message|>I need to output the invoice details in JSON<|eom|><|start|>assistant to=user<|message|>"
     '{"amount": 123.45, "date": "2025-12-03"}', None,
     ("I need to output the invoice details in JSON", '{"amount": 123.45, "date": "2025-12-03"}', [])),
]


@pytest.mark.parametrize("generated,tools,expected", LLAMA_CPP_CASES)
def test_parser_matches_llama_cpp_test_cases(generated, tools, expected):
    reasoning, content, calls = expected
    assert parse_output(generated, tools) == {"reasoning_content": reasoning, "content": content, "tool_calls": calls}


def test_parser_without_reasoning_extraction_keeps_everything_as_content():
    generated = " to=self<|message|>hmm<|eom|><|start|>assistant to=user<|message|>Hi<|eot|>"
    assert parse_output(generated, extract_reasoning=False)["content"] == generated


def test_date_defaults_to_today():
    text = chat_prompt(TOK, [{"role": "user", "content": "Hi"}])
    assert f"Current date: {datetime.date.today().isoformat()}." in text


# ---------------------------------------------------------------------------------------------
# bad input

@pytest.mark.parametrize("template,messages,match", [
    ("", [], "no chat template"),
    ("{% for %}", [], "TemplateSyntaxError"),
    ("{{ ''.__class__.__mro__ }}", [], "SecurityError|UndefinedError"),
    ("{{ raise_exception('no tools here') }}", [], "no tools here"),
    # errors of the template's own code
    ("{{ 1/0 }}", [], "ZeroDivisionError"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", [], "RecursionError"),
])
def test_bad_templates_raise_one_line(template, messages, match):
    with pytest.raises(ChatError, match=match) as e:
        render_chat(template, messages)
    assert "\n" not in str(e.value)


NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
TWICE = "{% set ns = namespace(x=[1], y=[1]) %}{% for i in range(64) %}{% set ns.x = [ns.x, ns.x] %}" \
        "{% set ns.y = [ns.y, ns.y] %}{% endfor %}"  # lists that print 2^64 times [1]


@pytest.mark.parametrize("template, match", [
    (NESTED_LOOPS, r"over \d+ steps"),
    (NESTED_LOOPS.replace("x", ""), r"over \d+ steps"),  # printing nothing
    ('{{ "x" * 300000000 }}', r"operator \* would take it over \d+ characters"),
    ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "printing"),
    ('{{ "x"|center(10000000000) }}', "center would take it over"),
    ('{{ "x".zfill(10000000000) }}', "zfill would take it over"),
    ('{{ "%0300000000d" % 1 }}', "format would take it over"),
    ('{{ "{:0300000000}".format(1) }}', "format would take it over"),
    ('{{ "%(a)500000000s" % {"a": "x"} }}', "format would take it over"),  # a mapping key before the width
    ('{{ "{:{w}}".format("x", w=50000000000) }}', "format would take it over"),  # the width an argument
    ('{{ (range(1000)|list)|join("x" * 1000000) }}', "join would take it over"),
    ("{{ 2 ** 100000000 }}", r"integer of over \d+ bits"),
    (TWICE + "{{ ns.x }}", "printing would take it over"),
    (TWICE + "{{ ns.x|tojson }}", "filter tojson on a value of over"),
    (TWICE + "{{ ns.x == ns.y }}", "comparing a value of over"),
])
def test_runaway_templates_are_stopped(template, match):
    # each would run for hours or allocate gigabytes; refused within a second or two
    with pytest.raises(ChatError, match=match) as e:
        render_chat(template, [])
    assert "\n" not in str(e.value)


RECURSIVE = ("{% for i in range(100) recursive %}{% if loop.depth == 1 %}{{ loop(range(100000)) }}{% endif %}"
             "{% endfor %}")  # 10^7 iterations, all but 100 started by loop(...)


@pytest.mark.parametrize("template, match", [
    (RECURSIVE, r"over \d+ steps"),
    ("{{ lipsum(1000000) }}", "undefined"),  # one call that builds hundreds of MB: not offered
])
def test_runaway_templates_outside_plain_loops_are_stopped(template, match):
    with pytest.raises(ChatError, match=match):
        render_chat(template, [])


def test_templates_of_real_size_render():
    # a prompt built by appending to a namespace string copies it once per message: 250 messages of
    # 500 characters (about 32k tokens, well inside a 131072-token context) copy ~16 M characters
    template = ("{% set ns = namespace(s='') %}{% for m in messages %}"
                "{% set ns.s = ns.s + '<|start|>' + m.role + '<|message|>' + m.content + '<|end|>' %}"
                "{% endfor %}{{ ns.s }}")
    messages = [{"role": "user", "content": "x" * 500}] * 250
    assert render_chat(template, messages) == ("<|start|>user<|message|>" + "x" * 500 + "<|end|>") * 250
    # digits after a dot or colon outside a format field are not widths
    assert render_chat('{{ "build 0.123456789 at 12:345678901 for %s" % "me" }}', []) == \
        "build 0.123456789 at 12:345678901 for me"


def test_step_budget_grows_with_the_conversation(monkeypatch):
    # the release template compares each tool message without a name with every message: a long
    # agent conversation needs steps quadratic in its length, and gets them
    messages = [{"role": "user", "content": "Go."}]
    for i in range(30):
        call = {"id": f"c{i}", "type": "function", "function": {"name": "special_function", "arguments": {"arg1": i}}}
        messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": f"c{i}", "content": str(i)}]
    rendered = chat_prompt(TOK, messages, tools=SPECIAL_FUNCTION, date=DATE)
    monkeypatch.setattr(chat, "MAX_STEPS", 100)  # the rendering takes 5003 steps: the quadratic term pays
    assert chat_prompt(TOK, messages, tools=SPECIAL_FUNCTION, date=DATE) == rendered
    with pytest.raises(ChatError, match=r"over 2\d{5} steps"):  # 100 + (about 460 items in the input)^2
        render_chat(NESTED_LOOPS, messages)


def test_bad_arguments_and_output_raise():
    with pytest.raises(ChatError, match="YYYY-MM-DD"):
        chat_prompt(TOK, [], date="03/02/2026")
    with pytest.raises(ChatError, match="placeholders"):
        expand_images([1, 2, 3], TOK, [4])
    with pytest.raises(ChatError, match="not ATEM"):
        parse_output("garbage without a message")
    with pytest.raises(ChatError, match="JSON"):
        parse_output(" to=special_function<|message|>" + CALL.replace(">1<", ">one<"), SPECIAL_FUNCTION)


def test_cli_chat_prompt_matches_llama_cpp_ids(capsys):
    def cli_ids(*args):
        assert run_main(["--model", os.path.join(MODELS, "tiny-a-f32.gguf"), *args, "--date", DATE, "--tokenize-only"]) == 0
        return json.loads(capsys.readouterr().out)
    assert cli_ids("--chat", "--prompt", "Hello there!") == CONVERSATIONS["user-only"]["llama_cpp_ids"]
    assert (cli_ids("--chat", "--system", "You are terse.", "--prompt", "Hi")
            == CONVERSATIONS["system"]["llama_cpp_ids"])


@pytest.mark.parametrize("template, message", [
    (NESTED_LOOPS, "steps"),
    ('{{ "x" * 300000000 }}', "characters"),
    ("{{ 1/0 }}", "ZeroDivisionError"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
])
def test_cli_runaway_template_is_one_line_exit_2(tmp_path, template, message):
    path = planted(tmp_path, "template", extra_keys={"tokenizer.chat_template": (template, STR)})
    line = cli_error(run_cli("reference.run", "--model", path, "--chat", "--prompt", "hi", "--tokenize-only"))
    assert line.startswith("reference.run: chat template") and message in line


def test_cli_chat_bad_input_is_one_line_exit_2(capsys):
    for args, word in [(["--chat", "--prompt", "x", "--date", "2026-13-01"], "YYYY-MM-DD"),
                       (["--system", "x", "--prompt", "y"], "--chat"),
                       (["--chat", "--prompt", "x", "--no-special"], "--no-special")]:
        assert run_main(args) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and word in err, err
