#!/usr/bin/env python3
"""The GPU suite's `slidedp plan` verdict (tools/gpu/run_suite.sh, part plan).

For each case NAME given, reads NAME.plan (what `slidedp plan JOB.yaml` printed before the job ran,
predicted from what `slidedp plan --measure` cached) and NAME.jsonl (the job's metrics); prints
summary lines (PASS / FAIL / INFO plan <text>):
  - the plan predicted a step ("predicted step X s"), and it is within --max-error (10%) of the
    median measured step from step --first-step (4) on;
  - the measuring job's wall time, from --measure-times (NAME=seconds), as a figure.
"""
import argparse
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from suite_judge import json_lines, read  # noqa: E402
from suite_parts import threshold  # noqa: E402


def predicted(path):
    m = re.search(r"^predicted step ([0-9.]+) s", read(path), re.M)
    return float(m.group(1)) if m else None


def measured(path, first_step):
    times = [float(r["step_time_s"]) for r in json_lines(read(path))
             if isinstance(r.get("step"), int) and r["step"] >= first_step and "step_time_s" in r]
    return statistics.median(times) if times else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--cases", nargs="+", required=True)
    ap.add_argument("--measure-times", nargs="*", default=[])
    ap.add_argument("--max-error", type=float, default=threshold("plan", "max_error"))  # suite_parts.py
    ap.add_argument("--first-step", type=int, default=4)
    ap.add_argument("--part", default="plan")
    a = ap.parse_args()
    failed = False

    def say(status, text):
        print(f"{status:<4} {a.part:<11} {text}")

    for case in a.cases:
        p = predicted(f"{a.dir}/{case}.plan")
        m = measured(f"{a.dir}/{case}.jsonl", a.first_step)
        if p is None or m is None:
            failed = True
            say("FAIL", f"{case}: " + ("no predicted step in the plan" if p is None else "no measured steps")
                + f" (see details.tar.gz: {a.part}/)")
            continue
        err = (p - m) / m
        ok = abs(err) <= a.max_error
        failed |= not ok
        say("PASS" if ok else "FAIL",
            f"{case}: plan predicted {p:.3f} s, measured {m:.3f} s (median from step {a.first_step}): "
            f"{100 * err:+.1f}% (must be within {100 * a.max_error:.0f}%)")
    for item in a.measure_times:
        name, _, secs = item.partition("=")
        say("INFO", f"{name}: `slidedp plan --measure` took {secs} s (the measuring job, queued to its end)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
