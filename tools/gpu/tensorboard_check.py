#!/usr/bin/env python3
"""Checks a slidedp job's TensorBoard events (job spec `output.tensorboard: true`) against its
metrics JSONL, reading the events with TensorBoard's own reader (the `tensorboard` package's
EventAccumulator): every scalar the JSONL has, at the same steps, equal as float32.

  python3 tools/gpu/tensorboard_check.py --events OUT/tensorboard/JOB --metrics OUT/metrics-JOB.jsonl

--events is the job's events directory (or one events file). A step logged twice (a resumed job
runs steps again) counts with its last record on both sides, as TensorBoard itself drops the
points of steps run again. Prints PASS / FAIL lines; exits 0 when all pass, 1 on a mismatch, 2
when a file cannot be read or the `tensorboard` package is missing.
"""
import argparse
import json
import math
import struct
import sys

# tag -> (JSONL key, scale): hostd/metrics/tensorboard_sink.h's kStepScalarFields (whose field
# names are v1::StepMetrics'; the JSONL says `lr` for learning_rate).
TAGS = {
    "train/loss": ("loss", 1.0),
    "eval/loss": ("eval_loss", 1.0),
    "train/lr": ("lr", 1.0),
    "train/grad_norm": ("grad_norm", 1.0),
    "perf/tokens_per_s": ("tokens_per_s", 1.0),
    "perf/model_tflops": ("model_tflops", 1.0),
    "perf/mfu": ("mfu", 1.0),
    "perf/step_time_s": ("step_time_s", 1.0),
    "memory/host_gib": ("host_state_bytes", 1.0 / 2**30),
    "memory/gpu_peak_gib": ("gpu_peak_bytes", 1.0 / 2**30),
    # MoE models (a dotted key: a field of a nested JSONL object)
    "moe/router_aux_loss": ("router_aux_loss", 1.0),
    "moe/expert_tokens_min": ("expert_tokens.min", 1.0),
    "moe/expert_tokens_max": ("expert_tokens.max", 1.0),
    "moe/expert_tokens_mean": ("expert_tokens.mean", 1.0),
}


def field(rec, key):
    """rec's value at a dotted key, or KeyError."""
    for part in key.split("."):
        rec = rec[part]
    return rec


def has(rec, key):
    try:
        field(rec, key)
        return True
    except (KeyError, TypeError):
        return False


def f32(x):
    """x rounded to float32 as the writer does (C++ static_cast<float>); None (JSON null: NaN) -> NaN."""
    if x is None:
        return math.nan
    try:
        return struct.unpack("<f", struct.pack("<f", float(x)))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def same(a, b):
    return a == b or (math.isnan(a) and math.isnan(b))


def read_metrics(path):
    """The JSONL's records by step, the last record of a step winning."""
    by_step = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
                by_step[int(rec["step"])] = rec
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}: line {n}: {e}") from e
    return by_step


def read_events(path):
    """{tag: {step: value}} as TensorBoard reads them, and the file version it saw."""
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(path, size_guidance={ea.SCALARS: 0})
    acc.Reload()
    scalars = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
    return scalars, acc.file_version


def compare(events, records):
    """(ok, text) per check of `events` ({tag: {step: value}}) against `records` ({step: record})."""
    out = []
    unknown = sorted(set(events) - set(TAGS))
    out.append((not unknown, "tags are the writer's table's" + (f"; unknown: {', '.join(unknown)}" if unknown else "")))
    for tag, (key, scale) in TAGS.items():
        want = {s: f32(None if field(r, key) is None else field(r, key) * scale) for s, r in records.items()
                if has(r, key)}
        got = events.get(tag, {})
        if not want and not got:
            continue
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        differ = [s for s in sorted(set(want) & set(got)) if not same(want[s], got[s])]
        text = f"{tag} vs JSONL {key}: {len(want)} steps, {len(missing)} missing, {len(extra)} extra, {len(differ)} differ"
        if missing:
            text += f"; first missing step {missing[0]}"
        if extra:
            text += f"; first extra step {extra[0]}"
        if differ:
            s = differ[0]
            text += f"; step {s}: events {got[s]!r}, JSONL {want[s]!r} (float32)"
        out.append((not (missing or extra or differ), text))
    if len(out) == 1:
        out.append((False, "no scalars to compare (an empty events file, or a JSONL without records)"))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", required=True, help="the job's events directory or file")
    ap.add_argument("--metrics", required=True, help="the job's metrics-<job>.jsonl")
    a = ap.parse_args()
    try:
        records = read_metrics(a.metrics)
    except (OSError, ValueError) as e:
        print(f"FAIL tensorboard cannot read the metrics: {e}")
        return 2
    try:
        events, version = read_events(a.events)
    except ImportError as e:
        print(f"FAIL tensorboard the `tensorboard` package is needed (pip install tensorboard): {e}")
        return 2
    checks = [(version == 2.0, f"file version {version} (brain.Event:2)")] + compare(events, records)
    for ok, text in checks:
        print(f"{'PASS' if ok else 'FAIL'} tensorboard {text}")
    return 0 if all(ok for ok, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
