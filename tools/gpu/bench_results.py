"""bench/e2e/run_bench.sh's results (bench-results.json, written by bench/e2e/report.py) as the
GPU suite's checkers read them: load a file, pick one run, and whether it has a figure."""
import json


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
