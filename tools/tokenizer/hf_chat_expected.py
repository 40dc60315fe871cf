#!/usr/bin/env python3
"""Renders the committed chat sample with HF transformers' apply_chat_template (the model's own
Jinja template) and writes the text and ids per conversation: the oracle for prepare's Qwen3
renderer (client/prepare tests).

  python3 tools/tokenizer/hf_chat_expected.py --model tests/data/tokenizer/qwen3 \
      --sample tests/data/tokenizer/chat_sample.jsonl --out tests/data/tokenizer/chat_sample.expected.jsonl
"""
import argparse
import json

import transformers


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--sample", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    tok = transformers.AutoTokenizer.from_pretrained(args.model)
    with open(args.sample, encoding="utf-8") as f, open(args.out, "w", encoding="utf-8") as out:
        for line in f:
            messages = json.loads(line)["messages"]
            text = tok.apply_chat_template(messages, tokenize=False)
            ids = tok(text, add_special_tokens=False)["input_ids"]
            out.write(json.dumps({"text": text, "ids": ids}, ensure_ascii=False) + "\n")
    print(f"transformers {transformers.__version__}: wrote {args.out}")


if __name__ == "__main__":
    main()
