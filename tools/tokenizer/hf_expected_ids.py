#!/usr/bin/env python3
"""Writes HF `tokenizers` ids for the committed tokenizer sample (the oracle for tok_test).

Reads the corpus format shared with tok_bench: one JSON object per line, {"text": ...} or
{"hex": ...} (raw bytes; decoded with errors="replace", as any Python caller of HF must).
Writes one {"ids": [...]} line per input line. Run where `tokenizers` is installed:

  python3 tools/tokenizer/hf_expected_ids.py \
      --tokenizer tests/data/tokenizer/qwen3/tokenizer.json \
      --sample tests/data/tokenizer/sample.jsonl --out tests/data/tokenizer/sample.expected.jsonl
"""
import argparse
import json

import tokenizers


def read_corpus(path):
    docs = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            obj = json.loads(line)
            if "text" in obj:
                docs.append(obj["text"])
            else:
                docs.append(bytes.fromhex(obj["hex"]).decode("utf-8", errors="replace"))
    return docs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--sample", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    tok = tokenizers.Tokenizer.from_file(args.tokenizer)
    docs = read_corpus(args.sample)
    with open(args.out, "w") as f:
        for d in docs:
            f.write(json.dumps({"ids": tok.encode(d, add_special_tokens=False).ids}) + "\n")
    print(f"wrote {len(docs)} id lists with tokenizers {tokenizers.__version__} to {args.out}")


if __name__ == "__main__":
    main()
