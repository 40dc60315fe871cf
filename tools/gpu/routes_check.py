#!/usr/bin/env python3
"""The GPU suite's route measurements (tools/gpu/run_suite.sh, part routespeed; issue 26).

For each case NAME given, reads NAME.plan.json (`slidedp plan --measure JOB.yaml --json` of a spec
whose routes are `auto`: hostd measured every route the workers can run, each by its own job, then
planned; `route` is what `auto` resolves to, the shortest measured step) and NAME/*.jsonl (the
metrics of those measuring jobs, one file per route). Prints summary lines (PASS / FAIL / INFO
<part> <text>):
  - INFO: each route's measured step (the median from --first-step on: AutoPolicy's validated
    layout) and tokens/s per GPU, and which route is fastest;
  - PASS when every one of --expect-routes routes was measured and the route `auto` picks is the
    fastest measured or within --tolerance (3%) of it (the pick compares the plans predicted from
    each route's record; a wrong order there is a finding); FAIL otherwise.
"""
import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from suite_judge import json_lines, read  # noqa: E402
from suite_parts import threshold  # noqa: E402


def route_key(grad_reduction, param_delivery):
    return f"{grad_reduction}+{param_delivery}"


def picked(plan):
    """`grad_reduction gpu, param_delivery sharded, chunk_bytes N` -> "gpu+sharded"."""
    fields = {}
    for part in plan.get("route", "").split(","):
        k, _, v = part.strip().partition(" ")
        fields[k] = v
    if "grad_reduction" not in fields or "param_delivery" not in fields:
        return None
    return route_key(fields["grad_reduction"], fields["param_delivery"])


def measured_routes(folder, first_step):
    """{route: (median step s, tokens/s per GPU, steps counted)} of the measuring jobs' metrics."""
    out = {}
    try:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".jsonl"))
    except OSError:
        return out
    for name in names:
        rows = [r for r in json_lines(read(os.path.join(folder, name))) if isinstance(r.get("step"), int)]
        if not rows:
            continue
        last = rows[-1]
        route = route_key(last.get("grad_reduction", "?"), last.get("param_delivery", "?"))
        late = [r for r in rows if r["step"] >= first_step and r.get("step_time_s")] or \
            [r for r in rows if r.get("step_time_s")]
        if not late:
            continue
        step = statistics.median(float(r["step_time_s"]) for r in late)
        world = max(1, int(last.get("world_size", 1)))
        tokens = statistics.median(float(r.get("tokens", 0)) for r in late)
        out[route] = (step, tokens / world / step if step > 0 else 0.0, len(late))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--cases", nargs="+", required=True)
    ap.add_argument("--expect-routes", type=int, default=4)
    ap.add_argument("--tolerance", type=float, default=threshold("routespeed", "tolerance"))  # suite_parts.py
    ap.add_argument("--first-step", type=int, default=4)
    ap.add_argument("--part", default="routespeed")
    ap.add_argument("--json", help="write every case's figures here")
    a = ap.parse_args()
    failed = False
    figures = {}

    def say(status, text):
        print(f"{status:<4} {a.part:<11} {text}")

    for case in a.cases:
        routes = measured_routes(os.path.join(a.dir, case), a.first_step)
        try:
            plan = json.loads(read(os.path.join(a.dir, case + ".plan.json")) or "{}")
        except ValueError:
            plan = {}
        pick = picked(plan) if isinstance(plan, dict) else None
        figures[case] = {"routes": {k: {"step_s": s, "tokens_per_s_per_gpu": t, "steps": n}
                                    for k, (s, t, n) in routes.items()}, "auto": pick}
        if not routes:
            failed = True
            say("FAIL", f"{case}: no measuring job's metrics (see details.tar.gz: {a.part}/)")
            continue
        fastest = min(routes, key=lambda k: routes[k][0])
        say("INFO", f"{case}: " + ", ".join(
            f"{k} {s:.3f} s ({t:,.0f} tok/s per GPU)" for k, (s, t, _) in sorted(routes.items(), key=lambda kv: kv[1][0]))
            + f"; fastest {fastest}")
        problems = []
        if len(routes) < a.expect_routes:
            problems.append(f"{len(routes)} of {a.expect_routes} routes measured")
        if pick is None:
            problems.append("no route in the plan's JSON")
        elif pick not in routes:
            problems.append(f"auto picks {pick}, which no measuring job ran")
        if problems:
            failed = True
            say("FAIL", f"{case}: " + "; ".join(problems))
            continue
        gap = routes[pick][0] / routes[fastest][0] - 1
        ok = gap <= a.tolerance
        failed |= not ok
        say("PASS" if ok else "FAIL",
            f"{case}: runtime routes auto picks {pick}, measured {routes[pick][0]:.3f} s: {100 * gap:+.1f}% of the "
            f"fastest measured ({fastest}; must be within {100 * a.tolerance:.0f}%)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(figures, f, indent=2)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
