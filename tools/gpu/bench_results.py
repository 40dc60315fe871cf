"""bench/e2e/run_bench.sh's results as the GPU suite's checkers read them: the bench-results.json
records (written by bench/e2e/report.py: load a file, pick one run, and whether it has a figure)
and our runs' per-step metrics."""
import glob
import json


def ours_metrics(work):
    """Every step's metrics line (hostd's metrics-*.jsonl) of the `ours` runs under a run_bench.sh WORK
    folder, in step order."""
    rows = []
    for p in glob.glob(f"{work}/runs/*/*/*/*/ours/out/metrics-*.jsonl"):
        with open(p) as f:
            rows += [json.loads(line) for line in f if line.strip()]
    return sorted(rows, key=lambda r: r["step"])


def load(path):
    """The records of one bench-results.json; [] when it is missing or not JSON."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return []


def pick(recs, kind, model, tokens):
    """The one-GPU record of `kind` (ours, compute, fsdp2, ...) for `model` at `tokens` per GPU."""
    for r in recs:
        if r.get("kind") == kind and r.get("model") == model and r.get("tokens_per_gpu") == tokens \
                and r.get("gpus", 1) == 1:
            return r
    return None


def usable(r):
    return r is not None and not r.get("error") and r.get("tokens_per_s_per_gpu")
