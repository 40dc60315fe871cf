#!/usr/bin/env python3
"""Renders chat-template cases with Python Jinja2 the way transformers' apply_chat_template does,
for machines without transformers (hf_render.py is the same oracle through transformers itself).
Writes tests/data/chat_templates/expected/<name><set>.jsonl, one line per case: {"case", "text"},
or {"case", "error"} when the template raises ("error_type" too when that is not Jinja's
TemplateError, e.g. a TypeError). Two groups of templates and case sets:

- qwen3.5 (--group qwen3.5, the default): Qwen3.5's two copies on qwen3.5-conversations.jsonl
  (hand-written; set "") and qwen3.5-random-conversations.jsonl (seeded random conversations built
  from the strings the template treats specially; set ".random", rewritten by --random N).
- families (--group families): Gemma 3, GPT-OSS and the Mistral templates on conversations.jsonl
  (the 13 shared cases; set ""), families-conversations.jsonl (hand-written; set ".families") and
  families-random-conversations.jsonl (set ".families-random", rewritten by --random N, seed 3).
  A list content is passed as a list to Gemma 3's template, which renders lists itself, and joined
  (its text parts, nothing between) for the others, which would fail on a list: that is prepare's
  documented rule. GPT-OSS's strftime_now("%Y-%m-%d") returns the case's date_string when that
  is a YYYY-MM-DD date (a Llama-style "05 Dec 2026" is not one) or else 2025-08-05 (prepare's
  fixed default), so the files do not depend on the day they are written.

The ids are added by tools/tokenizer/npm_tokenizers_check.mjs add-ids:

  python3 tools/chat_template/jinja2_render.py [--random 150]   # needs jinja2 (3.1.6: transformers 5.17's)
  for f in tests/data/chat_templates/expected/qwen3.5*.jsonl; do
    NODE_PATH=/tmp/hf-tok-ref/node_modules node tools/tokenizer/npm_tokenizers_check.mjs add-ids \
        tests/data/tokenizer/qwen3.5-synthetic/tokenizer.json $f
  done
  python3 tools/chat_template/jinja2_render.py --group families [--random 200]
  # ids: gemma3 with tests/data/tokenizer/sentencepiece/gemma3, mistral-* with .../sentencepiece/mistral
  # (tests/data/chat_templates/README.md); GPT-OSS has no test tokenizer, so its files hold text only.

The environment is transformers' (utils/chat_template_utils.py, _compile_jinja_template):
ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]),
`tojson` as json.dumps(ensure_ascii=False), globals raise_exception and strftime_now; render()
gets messages, tools=None, documents=None, add_generation_prompt and the special tokens of
tokenizer_config.json. transformers' AssistantTracker extension only adds {% generation %}, which
these templates do not use.
"""
import argparse
import json
import os
import random
import re
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
DATA = os.path.join(ROOT, "tests", "data", "chat_templates")
# case set -> its conversations
CASE_SETS = {
    "": os.path.join(DATA, "qwen3.5-conversations.jsonl"),
    ".random": os.path.join(DATA, "qwen3.5-random-conversations.jsonl"),
}

# What random contents are made of: the template's tags, whitespace Python and JavaScript trim
# differently, Unicode, special tokens (not <|im_end|>, which would end a reply inside it).
PIECES = ["", " ", "  ", "\n", "\n\n", "\t", "\r\n", "text", "more words", "<think>", "</think>",
          "<tool_response>", "</tool_response>", "\u3000", "\u2003", "\u00a0", "\u001c", "\u0085", "\ufeff",
          "\u200b", "e\u0301", "\u00e9", "中文", "🙂", "'s", "<|im_start|>", "<tool_call>"]

# template name -> tokenizer_config.json holding the template
TEMPLATES = {
    "qwen3.5": os.path.join(DATA, "qwen3.5.tokenizer_config.json"),
    "qwen3.5-nothink": os.path.join(DATA, "qwen3.5-nothink.tokenizer_config.json"),
}

# The families group: template name -> tokenizer_config.json; case set -> conversations.
FAMILY_TEMPLATES = {name: os.path.join(DATA, f"{name}.tokenizer_config.json") for name in (
    "gemma3", "gpt-oss", "mistral-v1", "mistral-v3", "mistral-v3-tekken", "mistral-v3-tekken-first", "mistral-v7")}
FAMILY_CASE_SETS = {
    "": os.path.join(DATA, "conversations.jsonl"),
    ".families": os.path.join(DATA, "families-conversations.jsonl"),
    ".families-random": os.path.join(DATA, "families-random-conversations.jsonl"),
}
# Templates whose Jinja renders a list content itself; the others get the joined text.
RENDERS_LISTS = {"gemma3", "qwen3.5", "qwen3.5-nothink"}
GPT_OSS_DEFAULT_DATE = "2025-08-05"

# What random contents of the families group are made of: each template's tags, whitespace Python
# and JavaScript trim differently, Unicode, other templates' special tokens.
FAMILY_PIECES = ["", " ", "  ", "\n", "\n\n", "\t", "\r\n", "text", "more words", "\u3000", "\u2003", "\u00a0",
                 "\u001c", "\u0085", "\ufeff", "\u200b", "e\u0301", "\u00e9", "中文", "🙂", "'s", "[INST]", "[/INST]",
                 " [INST] ", "</s>", "<start_of_turn>", "<end_of_turn>", "<|start|>", "<|end|>", "<|message|>",
                 "<|channel|>final<|message|>", "<|channel|>analysis", "[SYSTEM_PROMPT]"]


def compile_template(text, date=None):
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        if date is not None:
            return date
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(text)


def token_text(t):
    return t["content"] if isinstance(t, dict) else t


def random_text(rng):
    return "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 6)))


def random_case(rng):
    messages = []
    for k in range(rng.randint(1, 7)):
        # A system message is usually first; a later one, or no user query, makes the template raise.
        if k == 0 and rng.random() < 0.3:
            role = "system"
        else:
            role = rng.choices(["user", "assistant", "tool", "system"], [40, 40, 17, 3])[0]
        if rng.random() < 0.25 and role in ("user", "tool"):
            content = "<tool_response>" + random_text(rng) + "</tool_response>"
        else:
            content = random_text(rng)
        if rng.random() < 0.1:
            content = [{"type": "text", "text": random_text(rng)} for _ in range(rng.randint(1, 3))]
        m = {"role": role, "content": content}
        r = rng.random()
        if role == "assistant" and r < 0.3:
            m["reasoning_content"] = random_text(rng)
        elif role == "assistant" and r < 0.4:
            m["reasoning_content"] = None
        messages.append(m)
    case = {"messages": messages}
    if rng.random() < 0.15:
        case["add_generation_prompt"] = True
    return case


def random_family_case(rng):
    """Mostly well-formed conversations (the Gemma and Mistral templates raise on anything else),
    with the perturbations each template treats specially."""
    text = lambda: "".join(rng.choice(FAMILY_PIECES) for _ in range(rng.randint(0, 5)))
    messages = []
    harmony = rng.random() < 0.25  # GPT-OSS's fields: a developer message, "thinking"
    r = rng.random()
    if r < 0.35:
        messages.append({"role": "system", "content": text()})
    elif r < 0.45 and harmony:
        messages.append({"role": "developer", "content": text()})
    turns = rng.randint(1, 4)
    for k in range(turns):
        messages.append({"role": "user", "content": text()})
        if k + 1 < turns or rng.random() < 0.85:
            m = {"role": "assistant", "content": text()}
            if harmony and rng.random() < 0.6:
                m["thinking"] = text()
            messages.append(m)
    for m in messages:
        if rng.random() < 0.08:
            m["content"] = [{"type": "text", "text": text()} for _ in range(rng.randint(1, 3))]
    if rng.random() < 0.1:  # a role out of place
        messages.insert(rng.randint(0, len(messages)), {"role": rng.choice(["system", "user", "assistant", "tool"]),
                                                        "content": text()})
    case = {"messages": messages}
    if rng.random() < 0.15:
        case["add_generation_prompt"] = True
    if rng.random() < 0.1:
        case["date_string"] = f"20{rng.randint(10, 39)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    return case


def joined(messages):
    """The messages with each list content joined to its text (prepare's rule for templates that do
    not render lists)."""
    out = []
    for m in messages:
        m = dict(m)
        if isinstance(m.get("content"), list):
            m["content"] = "".join(p["text"] for p in m["content"])
        out.append(m)
    return out


def render_group(templates, case_sets):
    for case_set, cases_path in case_sets.items():
        with open(cases_path, encoding="utf-8") as f:
            cases = [json.loads(line) for line in f]
        for name, config_path in templates.items():
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
            special = {k: token_text(config[k]) for k in ("bos_token", "eos_token", "pad_token", "unk_token")
                       if config.get(k) is not None}
            out_path = os.path.join(DATA, "expected", f"{name}{case_set}.jsonl")
            with open(out_path, "w", encoding="utf-8") as out:
                for i, case in enumerate(cases):
                    date = case.get("date_string") or ""
                    template = compile_template(config["chat_template"], date=date if re.fullmatch(
                        r"\d{4}-\d{2}-\d{2}", date) else GPT_OSS_DEFAULT_DATE)
                    messages = case["messages"] if name in RENDERS_LISTS else joined(case["messages"])
                    extra = {"date_string": case["date_string"]} if case.get("date_string") else {}
                    try:
                        text = template.render(messages=messages, tools=None, documents=None,
                                               add_generation_prompt=bool(case.get("add_generation_prompt")),
                                               **special, **extra)
                        line = {"case": i, "text": text}
                    except jinja2.exceptions.TemplateError as e:
                        line = {"case": i, "error": str(e)}
                    except Exception as e:  # what transformers would raise too (a TypeError, ...)
                        line = {"case": i, "error": str(e), "error_type": type(e).__name__}
                    out.write(json.dumps(line, ensure_ascii=False) + "\n")
            print(f"{out_path}: {len(cases)} cases (jinja2 {jinja2.__version__})")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--group", choices=["qwen3.5", "families"], default="qwen3.5")
    parser.add_argument("--random", type=int, default=0, help="rewrite the random case set with this many cases")
    parser.add_argument("--seed", type=int, default=None, help="seed of --random (qwen3.5: 35, families: 3)")
    args = parser.parse_args()
    if args.group == "families":
        if args.random:
            rng = random.Random(3 if args.seed is None else args.seed)
            with open(FAMILY_CASE_SETS[".families-random"], "w", encoding="utf-8") as f:
                for _ in range(args.random):
                    f.write(json.dumps(random_family_case(rng), ensure_ascii=False) + "\n")
        render_group(FAMILY_TEMPLATES, FAMILY_CASE_SETS)
        return
    if args.seed is None:
        args.seed = 35
    if args.random:
        rng = random.Random(args.seed)
        with open(CASE_SETS[".random"], "w", encoding="utf-8") as f:
            for _ in range(args.random):
                f.write(json.dumps(random_case(rng), ensure_ascii=False) + "\n")
    for case_set, cases_path in CASE_SETS.items():
        with open(cases_path, encoding="utf-8") as f:
            cases = [json.loads(line) for line in f]
        for name, config_path in TEMPLATES.items():
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
            template = compile_template(config["chat_template"])
            special = {k: token_text(config[k]) for k in ("bos_token", "eos_token", "pad_token", "unk_token")
                       if config.get(k) is not None}
            out_path = os.path.join(DATA, "expected", f"{name}{case_set}.jsonl")
            with open(out_path, "w", encoding="utf-8") as out:
                for i, case in enumerate(cases):
                    try:
                        text = template.render(messages=case["messages"], tools=None, documents=None,
                                               add_generation_prompt=bool(case.get("add_generation_prompt")),
                                               **special)
                        line = {"case": i, "text": text}
                    except jinja2.exceptions.TemplateError as e:
                        line = {"case": i, "error": str(e)}
                    out.write(json.dumps(line, ensure_ascii=False) + "\n")
            print(f"{out_path}: {len(cases)} cases (jinja2 {jinja2.__version__})")


if __name__ == "__main__":
    main()
