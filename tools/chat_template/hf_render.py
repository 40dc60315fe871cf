#!/usr/bin/env python3
"""Writes the oracle for prepare's chat templates: tests/data/chat_templates/expected/<name>.jsonl,
one line per case of conversations.jsonl, {"case", "text", "ids"}: HF transformers'
apply_chat_template text with the model's own Jinja template, and the ids HF's tokenizer gives that
text (add_special_tokens=False, as apply_chat_template(tokenize=True) does).

  python3 tools/chat_template/hf_render.py     # from the repository root; needs transformers

Tokenizers: the Qwen3 tokenizer (tests/data/tokenizer/qwen3) for the Qwen templates, the Llama 3
tokenizer (tests/data/chat_templates/llama3) for the Llama templates. The Llama 3.2 template asks
strftime_now for today's date unless date_string is given; slidedp renders "26 Jul 2024" (the
template's own fallback) unless told otherwise, so that is what the oracle is given.

Qwen3.5's own case sets (qwen3.5-conversations.jsonl, qwen3.5-random-conversations.jsonl) go to
expected/qwen3.5*.jsonl (render_qwen3_5; jinja2_render.py writes the same without transformers).
"""
import json
import os

import transformers

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
DATA = os.path.join(ROOT, "tests", "data", "chat_templates")
QWEN3 = os.path.join(ROOT, "tests", "data", "tokenizer", "qwen3")
LLAMA3 = os.path.join(DATA, "llama3")

# template name -> (tokenizer_config.json holding the template, tokenizer directory)
TEMPLATES = {
    "qwen3": (os.path.join(QWEN3, "tokenizer_config.json"), QWEN3),
    "qwen2.5": (os.path.join(DATA, "qwen2.5-instruct.tokenizer_config.json"), QWEN3),
    "llama3": (os.path.join(LLAMA3, "tokenizer_config.json"), LLAMA3),
    "llama3.1": (os.path.join(DATA, "llama3.1-instruct.tokenizer_config.json"), LLAMA3),
    "llama3.2": (os.path.join(DATA, "llama3.2-instruct.tokenizer_config.json"), LLAMA3),
}


def main():
    with open(os.path.join(DATA, "conversations.jsonl"), encoding="utf-8") as f:
        cases = [json.loads(line) for line in f]
    os.makedirs(os.path.join(DATA, "expected"), exist_ok=True)
    for name, (config_path, tokenizer_dir) in TEMPLATES.items():
        with open(config_path, encoding="utf-8") as f:
            template = json.load(f)["chat_template"]
        tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
        out_path = os.path.join(DATA, "expected", f"{name}.jsonl")
        with open(out_path, "w", encoding="utf-8") as out:
            for i, case in enumerate(cases):
                kwargs = {}
                if case.get("date_string"):
                    kwargs["date_string"] = case["date_string"]
                elif name == "llama3.2":
                    kwargs["date_string"] = "26 Jul 2024"
                text = tok.apply_chat_template(case["messages"], chat_template=template, tokenize=False,
                                               add_generation_prompt=bool(case.get("add_generation_prompt")),
                                               **kwargs)
                ids = tok(text, add_special_tokens=False)["input_ids"]
                out.write(json.dumps({"case": i, "text": text, "ids": ids}, ensure_ascii=False) + "\n")
        print(f"transformers {transformers.__version__}: wrote {out_path}")
    render_qwen3_5()


# Qwen3.5's own case sets (jinja2_render.py writes the same files without transformers): the
# template does not read special tokens, so Qwen3's tokenizer object renders it; the ids are those
# of the tokenizer.json of Qwen3.5's structure (tests/data/tokenizer/qwen3.5-synthetic).
QWEN3_5_SETS = {"": "qwen3.5-conversations.jsonl", ".random": "qwen3.5-random-conversations.jsonl"}
QWEN3_5_TEMPLATES = {"qwen3.5": "qwen3.5.tokenizer_config.json", "qwen3.5-nothink": "qwen3.5-nothink.tokenizer_config.json"}


def render_qwen3_5():
    import jinja2
    import tokenizers

    tok = transformers.AutoTokenizer.from_pretrained(QWEN3)
    ids_of = tokenizers.Tokenizer.from_file(os.path.join(ROOT, "tests", "data", "tokenizer", "qwen3.5-synthetic",
                                                         "tokenizer.json"))
    for name, config in QWEN3_5_TEMPLATES.items():
        with open(os.path.join(DATA, config), encoding="utf-8") as f:
            template = json.load(f)["chat_template"]
        for case_set, cases_file in QWEN3_5_SETS.items():
            with open(os.path.join(DATA, cases_file), encoding="utf-8") as f:
                cases = [json.loads(line) for line in f]
            out_path = os.path.join(DATA, "expected", f"{name}{case_set}.jsonl")
            with open(out_path, "w", encoding="utf-8") as out:
                for i, case in enumerate(cases):
                    try:
                        text = tok.apply_chat_template(case["messages"], chat_template=template, tokenize=False,
                                                       add_generation_prompt=bool(case.get("add_generation_prompt")))
                        line = {"case": i, "text": text, "ids": ids_of.encode(text, add_special_tokens=False).ids}
                    except jinja2.exceptions.TemplateError as e:
                        line = {"case": i, "error": str(e)}
                    out.write(json.dumps(line, ensure_ascii=False) + "\n")
            print(f"transformers {transformers.__version__}: wrote {out_path}")


if __name__ == "__main__":
    main()
