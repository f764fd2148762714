#!/usr/bin/env python3
"""Golden chat-template fixtures from HF transformers' own `apply_chat_template`.

The router (precise mode, control-plane/src/tokenize/hf.rs) and vllm-sim
(tests/vllm-sim/src/tokenizer.rs) render chat templates with minijinja configured like
transformers. This script makes "like transformers" checkable: it renders every template in
control-plane/vllm-wire/fixtures/chat_templates/*.jinja over a set of conversations with the
real implementation and writes what it produced to expected.json beside them. The Rust tests
tests/vllm-sim/tests/it/chat_template_golden.rs and control-plane/tests/it/chat_template_golden.rs
render the same inputs and compare byte for byte (or, for a conversation the template rejects,
check that the error carries transformers' message).

Rerun (from the repository root; needs python3 and PyPI, nothing from the model hub):

    python3 scripts/gen_chat_template_fixtures.py

It creates .venv-fixtures/ (git-ignored) with the pinned versions below, re-executes itself
inside it, builds a tiny word-level tokenizer in-process (no download) with each template's
bos/eos tokens, and calls `apply_chat_template(messages, tools=..., tokenize=False,
add_generation_prompt=..., **kwargs)` for each case. Commit the regenerated expected.json; a
diff in it is a change in transformers' behaviour or in the templates/cases here.

What the cases cover: plain chat, multi-turn, system messages (given and defaulted), no
generation prompt, unicode, content given as a list of text parts (flattened first the way
vLLM's "string" content format does, since vLLM, not transformers, does that step), extra
template variables (vLLM's chat_template_kwargs), tool definitions with tool calls and tool
results, `null` fields in messages, a last message left open (`continue_final_message`, with
and without whitespace the template trims), and conversations the template must reject.

Known differences between our rendering and transformers' are listed in KNOWN_DIFFERENCES
with the reason; the Rust tests assert that those cases still differ, and that no other does.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

PINS = {"transformers": "5.24.0", "tokenizers": "0.23.3", "jinja2": "3.1.6"}
ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv-fixtures"
FIXTURES = ROOT / "control-plane" / "vllm-wire" / "fixtures" / "chat_templates"

# Per template: its file and the special tokens its tokenizer has.
TEMPLATES = {
    "chatml": {"file": "chatml.jinja", "bos_token": "", "eos_token": "<|im_end|>"},
    "header_style": {
        "file": "header_style.jinja",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
    },
    "tools": {"file": "tools.jinja", "bos_token": "", "eos_token": "<|im_end|>"},
    "strict_roles": {"file": "strict_roles.jinja", "bos_token": "<s>", "eos_token": "</s>"},
    "python_methods": {"file": "python_methods.jinja", "bos_token": "", "eos_token": "<|eos|>"},
}

# Case name -> {"router"|"vllm_sim": reason}: where our rendering is known to differ.
KNOWN_DIFFERENCES: dict = {}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the user's current weather. Units: <celsius> & <fahrenheit>.",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "City, e.g. Zürich"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["location"],
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string"}},
            "required": ["zone"],
        },
    },
}
TOOL_CONVERSATION = [
    {"role": "system", "content": "You are a weather bot."},
    {"role": "user", "content": "Weather and time in Zürich?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"unit": "celsius", "location": "Zürich"}},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "get_time", "arguments": {"zone": "Europe/Zurich"}},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21, "sky": "sunny"}'},
    {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
    {"role": "assistant", "content": "It's 21 °C and sunny; the time is 14:05."},
    {"role": "user", "content": "Thanks!"},
]

SYS_CHAT = [
    {"role": "system", "content": "  Be brief.  \n"},
    {"role": "user", "content": "What is a KV cache?"},
    {"role": "assistant", "content": " Stored attention keys and values. "},
    {"role": "user", "content": "Why reuse it?"},
]
UNICODE = [{"role": "user", "content": "Grüße — 日本語で答えて 🚀\n\ttabbed \"quoted\" \\ back"}]
PARTS = [
    {
        "role": "user",
        "content": [{"type": "text", "text": "First part."}, {"type": "text", "text": "Second part."}],
    }
]


def case(name, template, messages, add_generation_prompt=True, tools=None, kwargs=None,
         content_format=None, continue_final_message=False):
    return {
        "name": name,
        "template": template,
        "messages": messages,
        "tools": tools,
        "kwargs": kwargs or {},
        "add_generation_prompt": add_generation_prompt,
        "content_format": content_format,
        "continue_final_message": continue_final_message,
    }


# A conversation whose last message the model is to continue (vLLM's request field
# `continue_final_message`, which it passes to apply_chat_template without a generation prompt).
PREFILLED = [
    {"role": "user", "content": "Give me a positive affirmation for today!"},
    {"role": "assistant", "content": "Ok! Here you go:"},
]
# The same, the assistant's text ending in whitespace a template may trim.
PREFILLED_SPACE = [
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "  Blue, and  \n"},
]


CASES = [
    case("chatml/plain", "chatml", [{"role": "user", "content": "Hello!"}]),
    case("chatml/multi_turn_system", "chatml", SYS_CHAT),
    case("chatml/no_generation_prompt", "chatml", SYS_CHAT, add_generation_prompt=False),
    case("chatml/unicode", "chatml", UNICODE),
    case("chatml/content_parts", "chatml", PARTS, content_format="string"),
    case("header_style/default_system", "header_style", [{"role": "user", "content": " Hi there \n"}]),
    case("header_style/multi_turn_system", "header_style", SYS_CHAT),
    case("header_style/no_generation_prompt", "header_style", SYS_CHAT, add_generation_prompt=False),
    case("header_style/unicode", "header_style", UNICODE),
    case("header_style/kwargs_date", "header_style", [{"role": "user", "content": "Date?"}],
         kwargs={"date_string": "29 Feb 2024"}),
    case("tools/no_tools", "tools", SYS_CHAT),
    case("tools/definitions", "tools", [{"role": "user", "content": "Weather in Zürich?"}],
         tools=[WEATHER_TOOL, TIME_TOOL]),
    case("tools/calls_and_results", "tools", TOOL_CONVERSATION, tools=[WEATHER_TOOL, TIME_TOOL]),
    case("tools/calls_no_generation_prompt", "tools", TOOL_CONVERSATION[:5],
         tools=[WEATHER_TOOL, TIME_TOOL], add_generation_prompt=False),
    case("tools/null_tool_calls", "tools",
         [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello.", "tool_calls": None},
          {"role": "user", "content": "Bye"}]),
    case("strict_roles/system_folded", "strict_roles", SYS_CHAT),
    case("strict_roles/plain", "strict_roles", [{"role": "user", "content": "Hello!"}]),
    case("strict_roles/unicode", "strict_roles", UNICODE),
    case("strict_roles/error_two_users", "strict_roles",
         [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]),
    case("strict_roles/error_assistant_first", "strict_roles",
         [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]),
    case("strict_roles/error_tool_role", "strict_roles",
         [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}]),
    case("python_methods/default_system", "python_methods", [{"role": "user", "content": "Why is the sky blue?"}]),
    case("python_methods/thinking_stripped", "python_methods",
         [{"role": "system", "content": "\n Think first. \n"},
          {"role": "user", "content": "2+2?"},
          {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
          {"role": "user", "content": "And 3+3?"},
          {"role": "assistant", "content": "<think>again</think>6"}], add_generation_prompt=False),
    case("python_methods/tools", "python_methods", TOOL_CONVERSATION, tools=[WEATHER_TOOL, TIME_TOOL]),
    case("python_methods/unicode", "python_methods", UNICODE),
    case("chatml/continue_final_message", "chatml", PREFILLED, add_generation_prompt=False,
         continue_final_message=True),
    case("chatml/continue_final_message_spaces", "chatml", PREFILLED_SPACE,
         add_generation_prompt=False, continue_final_message=True),
    case("header_style/continue_final_message", "header_style", PREFILLED,
         add_generation_prompt=False, continue_final_message=True),
    case("header_style/continue_final_message_trimmed", "header_style", PREFILLED_SPACE,
         add_generation_prompt=False, continue_final_message=True),
]


def ensure_venv():
    """Re-executes this script in .venv-fixtures with the pinned packages."""
    python = VENV / "bin" / "python"
    if Path(sys.prefix).resolve() == VENV.resolve():
        return
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    pins = [f"{k}=={v}" for k, v in PINS.items()]
    subprocess.run([str(python), "-m", "pip", "install", "-q", *pins], check=True)
    os.execv(str(python), [str(python), __file__, *sys.argv[1:]])


def tokenizer_for(bos, eos):
    """A word-level tokenizer built in-process: only its special tokens matter here."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0}
    for t in (bos, eos):
        if t:
            vocab.setdefault(t, len(vocab))
    inner = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    special = {"unk_token": "[UNK]"}
    if bos:
        special["bos_token"] = bos
    if eos:
        special["eos_token"] = eos
    return PreTrainedTokenizerFast(tokenizer_object=inner, **special)


def flatten_string_format(messages):
    """vLLM's "string" content format: a list of text parts becomes their texts joined by
    newlines. vLLM does this before it calls transformers; the router does it too."""
    out = []
    for m in messages:
        m = dict(m)
        if isinstance(m.get("content"), list):
            m["content"] = "\n".join(p["text"] if isinstance(p, dict) else p for p in m["content"])
        out.append(m)
    return out


def main():
    ensure_venv()
    import copy

    import jinja2
    import tokenizers
    import transformers

    versions = {
        "python": sys.version.split()[0],
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "jinja2": jinja2.__version__,
    }
    for name, pin in PINS.items():
        if versions[name] != pin:
            sys.exit(f"{name} {versions[name]} is installed, {pin} is pinned")
    names = {c["name"] for c in CASES}
    unknown = set(KNOWN_DIFFERENCES) - names
    if unknown:
        sys.exit(f"KNOWN_DIFFERENCES names no case: {sorted(unknown)}")

    out_cases = []
    for c in CASES:
        spec = TEMPLATES[c["template"]]
        tok = tokenizer_for(spec["bos_token"], spec["eos_token"])
        tok.chat_template = (FIXTURES / spec["file"]).read_text(encoding="utf-8")
        messages = copy.deepcopy(c["messages"])
        rendered_from = None
        if c["content_format"] == "string":
            rendered_from = flatten_string_format(messages)
            messages = rendered_from
        record = {
            "name": c["name"],
            "template": c["template"],
            "bos_token": spec["bos_token"],
            "eos_token": spec["eos_token"],
            "messages": c["messages"],
            "tools": c["tools"],
            "kwargs": c["kwargs"],
            "add_generation_prompt": c["add_generation_prompt"],
        }
        if rendered_from is not None:
            record["content_format"] = c["content_format"]
            record["rendered_from"] = rendered_from
        options = {}
        if c["continue_final_message"]:
            record["continue_final_message"] = True
            options["continue_final_message"] = True
        try:
            text = tok.apply_chat_template(
                messages,
                tools=copy.deepcopy(c["tools"]),
                tokenize=False,
                add_generation_prompt=c["add_generation_prompt"],
                **options,
                **copy.deepcopy(c["kwargs"]),
            )
            record["expected"] = text
        except jinja2.exceptions.TemplateError as e:
            record["expected_error"] = str(e)
        if c["name"] in KNOWN_DIFFERENCES:
            record["known_difference"] = KNOWN_DIFFERENCES[c["name"]]
        out_cases.append(record)

    doc = {
        "about": "Generated by scripts/gen_chat_template_fixtures.py with HF transformers' "
        "apply_chat_template(tokenize=False); do not edit by hand.",
        "versions": versions,
        "templates": TEMPLATES,
        "cases": out_cases,
    }
    path = FIXTURES / "expected.json"
    path.write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    errors = sum("expected_error" in c for c in out_cases)
    print(f"wrote {path.relative_to(ROOT)}: {len(out_cases)} cases ({errors} errors), {versions}")


if __name__ == "__main__":
    main()
