#!/usr/bin/env python3
"""Compares tok_bench (ours) with HF `tokenizers` on a large corpus: mismatching documents and MB/s.

Builds a corpus (JSONL, the tok_bench format) from text files found on the machine (Python's
own sources and docs under /usr/lib/python3*, site-packages text, plus the committed sample),
chunked at line boundaries into documents of at most --chunk-bytes. Files that are not valid
UTF-8 go in as {"hex": ...} so both sides see the same bytes (HF gets them decoded with
errors="replace", which is what our tokenizer does internally). For each thread count, runs
tok_bench and HF's encode_batch (RAYON_NUM_THREADS=N, in a fresh process) and reports the best
of --repeat timings. Prints and writes a JSON report.

  python3 tools/tokenizer/compare_and_bench.py --tok-bench build/bin/tok_bench \
      --tokenizer tests/data/tokenizer/qwen3/tokenizer.json --threads 1,16 --report out.json
"""
import argparse
import array
import glob
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SAMPLE = os.path.join(HERE, "..", "..", "tests", "data", "tokenizer", "sample.jsonl")
EXTS = (".py", ".txt", ".rst", ".md", ".html", ".json", ".c", ".h", ".cfg", ".toml", ".po", ".csv")


def build_corpus(path, roots, max_bytes, chunk_bytes, fuzz_docs=0, fuzz_seed=0):
    files = []
    for root in filter(None, roots):
        for r in sorted(glob.glob(root)):
            for dirpath, dirnames, filenames in os.walk(r):
                dirnames.sort()
                for name in sorted(filenames):
                    if name.endswith(EXTS):
                        files.append(os.path.join(dirpath, name))
    total = 0
    n_docs = n_hex = 0
    with open(path, "w", encoding="utf-8") as out, open(SAMPLE, encoding="utf-8") as sample:
        for line in sample:
            out.write(line)
            n_docs += 1
        if fuzz_docs:
            total += write_fuzz(out, fuzz_docs, fuzz_seed)
            n_docs += fuzz_docs
        for fpath in files:
            if total >= max_bytes:
                break
            try:
                with open(fpath, "rb") as f:
                    data = f.read()
            except OSError:
                continue
            lines = data.splitlines(keepends=True)
            chunk = b""
            for piece in lines + [None]:
                if piece is not None and len(chunk) + len(piece) <= chunk_bytes:
                    chunk += piece
                    continue
                if chunk:
                    try:
                        rec = {"text": chunk.decode("utf-8")}
                    except UnicodeDecodeError:
                        rec = {"hex": chunk.hex()}
                        n_hex += 1
                    out.write(json.dumps(rec, ensure_ascii=False) + "\n")
                    total += len(chunk)
                    n_docs += 1
                chunk = piece[:chunk_bytes] if piece is not None else b""
    return {"documents": n_docs, "bytes": total, "hex_documents": n_hex, "files_seen": len(files)}


# Code point pools for the fuzz corpus: scripts, digits of other scripts, combining marks (NFC),
# every Unicode space and line break, zero-width joiners, emoji, apostrophes for contractions.
FUZZ_POOLS = [
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ", "0123456789", " ,.;:!?'\"()[]{}<>-_=+*/\\|@#$%^&~`",
    "'sStTreREveVEmMllLLdD", " \t\n\r\x0b\x0c\x85\xa0\u1680\u180e\u2000\u2001\u2002\u2003\u2009\u200a\u2028\u2029\u202f\u205f\u3000",
    "".join(chr(c) for c in range(0xC0, 0x250)), "".join(chr(c) for c in range(0x300, 0x370)),
    "".join(chr(c) for c in range(0x370, 0x530)), "".join(chr(c) for c in range(0x590, 0x700)),
    "".join(chr(c) for c in range(0x900, 0x980)), "".join(chr(c) for c in range(0xE00, 0xE60)),
    "".join(chr(c) for c in range(0x1100, 0x1200)), "".join(chr(c) for c in range(0x3040, 0x3100)),
    "".join(chr(c) for c in range(0x4E00, 0x4F00)), "".join(chr(c) for c in range(0xAC00, 0xAD00)),
    "".join(chr(c) for c in range(0xFF00, 0xFF70)), "\u200b\u200c\u200d\ufeff\u00ad\u202e\u2060",
    "".join(chr(c) for c in range(0x1F300, 0x1F700)), "\u0660\u0661\u0966\u0967\u00bd\u00b2\u2160\u2460\U0001d7ce",
    "".join(chr(c) for c in range(0x2000, 0x2070)), "\u212a\u017f\u0130\u0131\u1e9e\u00df",
]


def write_fuzz(out, n_docs, seed):
    import random
    rng = random.Random(seed)
    total = 0
    for k in range(n_docs):
        parts = []
        for _ in range(rng.randint(1, 60)):
            pool = FUZZ_POOLS[rng.randrange(len(FUZZ_POOLS))]
            parts.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 24))))
        text = "".join(parts)
        if k % 10 == 9:  # raw invalid bytes among valid text
            raw = bytearray(text.encode("utf-8"))
            for _ in range(rng.randint(1, 5)):
                raw.insert(rng.randrange(len(raw) + 1), rng.choice([0x80, 0xBF, 0xC0, 0xC3, 0xE2, 0xED, 0xF0, 0xF4, 0xF8, 0xFF]))
            out.write(json.dumps({"hex": bytes(raw).hex()}) + "\n")
            total += len(raw)
        else:
            out.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
            total += len(text.encode("utf-8"))
    return total


def read_corpus(path):
    docs = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                obj = json.loads(line)
                docs.append(obj["text"] if "text" in obj else bytes.fromhex(obj["hex"]).decode("utf-8", "replace"))
    return docs


def hf_worker(args):
    """Runs in a child process with RAYON_NUM_THREADS set: times HF and optionally dumps ids."""
    import tokenizers
    tok = tokenizers.Tokenizer.from_file(args.tokenizer)
    docs = read_corpus(args.corpus)
    nbytes = sum(len(d.encode("utf-8", "surrogatepass")) for d in docs)
    fast = getattr(tok, "encode_batch_fast", None)
    best = 1e30
    for _ in range(args.repeat):
        t = time.perf_counter()
        (fast or tok.encode_batch)(docs, add_special_tokens=False)
        best = min(best, time.perf_counter() - t)
    if args.ids_out:
        encs = tok.encode_batch(docs, add_special_tokens=False)
        with open(args.ids_out, "wb") as f:
            for e in encs:
                a = array.array("I", e.ids)
                f.write(array.array("I", [len(a)]).tobytes())
                f.write(a.tobytes())
    print(json.dumps({"impl": "hf-tokenizers " + tokenizers.__version__ + (" encode_batch_fast" if fast else " encode_batch"),
                      "threads": int(os.environ.get("RAYON_NUM_THREADS", "0")), "documents": len(docs),
                      "bytes": nbytes, "seconds": round(best, 4), "MB_per_s": round(nbytes / best / 1e6, 2)}))


def read_ids(path):
    data = array.array("I")
    with open(path, "rb") as f:
        data.frombytes(f.read())
    out, i = [], 0
    while i < len(data):
        n = data[i]
        out.append(data[i + 1:i + 1 + n].tolist())
        i += 1 + n
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tok-bench")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--corpus", default="/tmp/tok_corpus.jsonl")
    ap.add_argument("--build-corpus", default="/usr/lib/python3*,/usr/local/lib/python3*/site-packages/transformers,"
                                              "/usr/lib/python3/dist-packages,/usr/share/doc")
    ap.add_argument("--max-bytes", type=int, default=64 << 20)
    ap.add_argument("--chunk-bytes", type=int, default=16 << 10)
    ap.add_argument("--fuzz-docs", type=int, default=0, help="add this many seeded random multi-script documents")
    ap.add_argument("--fuzz-seed", type=int, default=0)
    ap.add_argument("--threads", default="1,16")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--report")
    ap.add_argument("--mismatches", help="write the first mismatching documents here (JSONL)")
    ap.add_argument("--hf-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ids-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.hf_worker:
        return hf_worker(args)

    report = {"corpus": build_corpus(args.corpus, args.build_corpus.split(","), args.max_bytes, args.chunk_bytes,
                                     args.fuzz_docs, args.fuzz_seed)}
    print("corpus:", report["corpus"], flush=True)
    threads = [int(t) for t in args.threads.split(",")]
    runs = []
    ours_ids = hf_ids = None
    for i, n in enumerate(threads):
        ours_out = "/tmp/tok_ours.bin" if i == 0 else ""
        cmd = [args.tok_bench, "--tokenizer", args.tokenizer, "--corpus", args.corpus, "--threads", str(n),
               "--repeat", str(args.repeat)] + (["--out", ours_out] if ours_out else [])
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"tok_bench failed: {r.stderr}")
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
        print(runs[-1], flush=True)
        env = dict(os.environ, RAYON_NUM_THREADS=str(n), TOKENIZERS_PARALLELISM="true")
        hf_out = "/tmp/tok_hf.bin" if i == 0 else ""
        cmd = [sys.executable, os.path.abspath(__file__), "--hf-worker", "--tokenizer", args.tokenizer,
               "--corpus", args.corpus, "--repeat", str(args.repeat)] + (["--ids-out", hf_out] if hf_out else [])
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if r.returncode != 0:
            sys.exit(f"HF worker failed: {r.stderr}")
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
        print(runs[-1], flush=True)
        if i == 0:
            ours_ids, hf_ids = read_ids(ours_out), read_ids(hf_out)
    report["runs"] = runs
    docs = read_corpus(args.corpus)
    mismatched = [k for k in range(len(hf_ids)) if k >= len(ours_ids) or ours_ids[k] != hf_ids[k]]
    report["compare"] = {"documents": len(hf_ids), "ours_documents": len(ours_ids),
                         "mismatched_documents": len(mismatched),
                         "tokens": sum(len(x) for x in hf_ids)}
    if args.mismatches:
        with open(args.mismatches, "w", encoding="utf-8") as f:
            for k in mismatched[:50]:
                a, b = ours_ids[k] if k < len(ours_ids) else [], hf_ids[k]
                j = next((p for p in range(min(len(a), len(b))) if a[p] != b[p]), min(len(a), len(b)))
                f.write(json.dumps({"doc": k, "first_diff": j, "ours": a[max(0, j - 3):j + 5],
                                    "hf": b[max(0, j - 3):j + 5], "text": docs[k][:2000]},
                                   ensure_ascii=False) + "\n")
    print(json.dumps(report["compare"]), flush=True)
    if args.report:
        with open(args.report, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
