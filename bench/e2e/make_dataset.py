#!/usr/bin/env python3
"""Throughput-benchmark dataset in the pre-tokenized format of docs/dataset-format.md (version 1).

Every row is one document of exactly --seq-len uniformly random token ids below --vocab, with a
loss on every token: the same work per row as the FSDP2 peer (full-length causal sequences of
random ids), so model FLOP/s compare one to one. Written to DIR.tmp-PID and renamed into place
(a dataset directory is complete or absent), like DatasetWriter.

Usage: make_dataset.py --out DIR --rows N --seq-len S [--vocab V] [--seed K]
"""
import argparse
import json
import os
import random
import shutil
import struct
import sys
import zlib
from array import array


def random_tokens(n, vocab, seed):
    """n uint32 token ids in [0, vocab), as little-endian bytes."""
    try:
        import numpy as np
        return np.random.default_rng(seed).integers(0, vocab, size=n, dtype=np.uint32).astype("<u4").tobytes()
    except ImportError:
        rng = random.Random(seed)
        a = array("I", (rng.randrange(vocab) for _ in range(n)))
        if sys.byteorder != "little":
            a.byteswap()
        return a.tobytes()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, required=True)
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    if a.rows <= 0 or a.seq_len <= 0 or a.vocab < 2:
        sys.exit(f"make_dataset: need rows > 0, seq-len > 0, vocab >= 2; got {a.rows}, {a.seq_len}, {a.vocab}")
    n = a.rows * a.seq_len
    offsets = struct.pack(f"<{a.rows + 1}Q", *(r * a.seq_len for r in range(a.rows + 1)))
    blobs = {
        "tokens.bin": random_tokens(n, a.vocab, a.seed),
        "loss_mask.bin": b"\x01" * n,
        "doc_offsets.bin": offsets,  # one document per row: the same bounds
        "row_offsets.bin": offsets,
    }
    out = os.path.abspath(a.out.rstrip("/"))
    tmp = f"{out}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    files = []
    for name, data in blobs.items():
        with open(os.path.join(tmp, name), "wb") as f:
            f.write(data)
        files.append({"name": name, "bytes": len(data), "crc32": zlib.crc32(data) & 0xFFFFFFFF})
    manifest = {
        "format": "slidedp-dataset", "version": 1, "token_dtype": "uint32",
        "vocab_size": a.vocab, "seq_len": a.seq_len, "packing": "packed",
        "num_tokens": n, "num_documents": a.rows, "num_rows": a.rows,
        "num_trained_tokens": n, "truncated_documents": 0, "split_documents": 0,
        "files": files,
        "metadata": {"source": "bench/e2e/make_dataset.py", "pattern": "random", "seed": a.seed,
                     "note": "one full-length document per row"},
    }
    with open(os.path.join(tmp, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    shutil.rmtree(out, ignore_errors=True)
    os.rename(tmp, out)
    print(f"make_dataset: {a.rows} rows x {a.seq_len} tokens ({n} tokens, vocab {a.vocab}) -> {out}")


if __name__ == "__main__":
    main()
