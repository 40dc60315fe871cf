#!/usr/bin/env python3
"""Renders the Qwen3.5 chat-template cases with Python Jinja2 the way transformers'
apply_chat_template does, for machines without transformers (hf_render.py is the same oracle
through transformers itself). Writes tests/data/chat_templates/expected/<name><set>.jsonl, one
line per case: {"case", "text"}, or {"case", "error"} when the template raises. The case sets are
qwen3.5-conversations.jsonl (hand-written; set "") and qwen3.5-random-conversations.jsonl (seeded
random conversations built from the strings the template treats specially; set ".random",
rewritten by --random N). The ids are added by tools/tokenizer/npm_tokenizers_check.mjs add-ids:

  python3 tools/chat_template/jinja2_render.py [--random 150]   # needs jinja2 (3.1.6: transformers 5.17's)
  for f in tests/data/chat_templates/expected/qwen3.5*.jsonl; do
    NODE_PATH=/tmp/hf-tok-ref/node_modules node tools/tokenizer/npm_tokenizers_check.mjs add-ids \
        tests/data/tokenizer/qwen3.5-synthetic/tokenizer.json $f
  done

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


def compile_template(text):
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--random", type=int, default=0, help="rewrite the random case set with this many cases")
    parser.add_argument("--seed", type=int, default=35)
    args = parser.parse_args()
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
