#!/usr/bin/env python3
"""The GPU suite's restart verdict (tools/gpu/run_suite.sh, part restart).

Reads the uninterrupted job's metrics JSONL, the resumed job's, and `slidedp status` of the
resumed job; prints summary lines (PASS / FAIL / INFO <part> <text>):
  - the job succeeded and resumed from shared memory ("resumed from shared memory at step N");
  - every step logged by both jobs has bitwise the same loss, and the resumed job logged its last step;
  - the time from the restart to the next step (a figure).
"""
import argparse
import re
import json
import sys


def losses(path):
    out = {}
    try:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    rec = json.loads(line)
                    out[int(rec["step"])] = float(rec["loss"])
    except (OSError, ValueError, KeyError) as e:
        print(f"cannot read {path}: {e}", file=sys.stderr)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ref", required=True)
    ap.add_argument("--resumed", required=True)
    ap.add_argument("--status", required=True)
    ap.add_argument("--killed-after", type=int, required=True)
    ap.add_argument("--seconds-to-next-step", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--what", default="")
    ap.add_argument("--part", default="restart")
    a = ap.parse_args()

    def line(status, text):
        print(f"{status:<4} {a.part:<11} {text}")

    try:
        status = open(a.status).read()
    except OSError:
        status = ""
    # The state as a word: `slidedp status` prints "job ID: succeeded, step N/M" (older: "ID  succeeded").
    ok_state = re.search(r"\bsucceeded\b", status.splitlines()[0].lower() if status else "") is not None
    shm = "resumed from shared memory" in status
    how = next((l.strip() for l in status.splitlines() if "resumed from" in l), "no resume line in slidedp status")
    line("PASS" if ok_state and shm else "FAIL",
         f"{a.what}: hostd SIGKILLed after step {a.killed_after}, restarted: {how} "
         f"(must succeed, resumed from shared memory)")
    ref, res = losses(a.ref), losses(a.resumed)
    common = sorted(set(ref) & set(res))
    differ = [s for s in common if ref[s] != res[s]]
    complete = a.steps in res and len(ref) == a.steps
    line("PASS" if common and not differ and complete else "FAIL",
         f"{a.what}: {len(common)} steps logged by both, {len(differ)} with another loss "
         f"(must be 0, bitwise; last step logged: {complete})" + (f"; first differs at {differ[0]}" if differ else ""))
    line("INFO", f"{a.what}: restart -> next step {a.seconds_to_next_step} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
