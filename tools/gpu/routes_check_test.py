#!/usr/bin/env python3
"""routes_check.py's verdicts on made-up files: auto's pick that is the fastest measured route (or
within 3% of it) passes; a slower pick, a missing route, or a plan without a route fails."""
import json
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROUTES = [("gpu", "replicated"), ("gpu", "sharded"), ("cpu", "replicated"), ("cpu", "sharded")]


class RoutesCheck(unittest.TestCase):
    def run_check(self, route, steps, expect=4):
        """steps: {(reduction, delivery): [step_time_s per step]}; route: the plan's `route` or None."""
        with tempfile.TemporaryDirectory() as d:
            os.mkdir(f"{d}/c")
            with open(f"{d}/c.plan.json", "w") as f:
                json.dump({"step_s": 1.0, "route": route} if route else {"step_s": 1.0}, f)
            for i, ((red, dlv), times) in enumerate(steps.items()):
                with open(f"{d}/c/metrics-c-plan-{i + 1}.jsonl", "w") as f:
                    for s, t in enumerate(times, start=1):
                        f.write(json.dumps({"step": s, "step_time_s": t, "tokens": 32768, "world_size": 2,
                                            "grad_reduction": red, "param_delivery": dlv}) + "\n")
            out = subprocess.run([sys.executable, f"{HERE}/routes_check.py", "--dir", d, "--cases", "c",
                                  "--expect-routes", str(expect), "--json", f"{d}/fig.json"],
                                 capture_output=True, text=True)
            figures = json.load(open(f"{d}/fig.json")) if os.path.exists(f"{d}/fig.json") else None
            return out.returncode, out.stdout, figures

    @staticmethod
    def times(late):
        return [9.0, 5.0, 3.0, late, late, late]  # steps 1-3 (AutoPolicy's warm-up) left out

    def test_fastest_pick_passes(self):
        steps = {r: self.times(2.0 + 0.1 * i) for i, r in enumerate(ROUTES)}
        rc, out, fig = self.run_check("grad_reduction gpu, param_delivery replicated, chunk_bytes 67108864", steps)
        self.assertEqual(rc, 0, out)
        self.assertIn("PASS", out)
        self.assertIn("fastest gpu+replicated", out)
        self.assertIn("8,192 tok/s per GPU", out)  # 32768 tokens / 2 GPUs / 2.0 s
        self.assertEqual(fig["c"]["auto"], "gpu+replicated")
        self.assertAlmostEqual(fig["c"]["routes"]["cpu+sharded"]["step_s"], 2.3)

    def test_close_pick_passes_and_slow_pick_fails(self):
        steps = {r: self.times(2.0 + 0.05 * i) for i, r in enumerate(ROUTES)}
        rc, out, _ = self.run_check("grad_reduction gpu, param_delivery sharded, chunk_bytes 67108864", steps)
        self.assertEqual(rc, 0, out)  # 2.05 / 2.0: +2.5%
        rc, out, _ = self.run_check("grad_reduction cpu, param_delivery replicated, chunk_bytes 67108864", steps)
        self.assertEqual(rc, 1, out)  # +5.0%
        self.assertIn("FAIL", out)

    def test_missing_route_or_pick_fails(self):
        steps = {r: self.times(2.0) for r in ROUTES[:3]}
        rc, out, _ = self.run_check("grad_reduction gpu, param_delivery replicated, chunk_bytes 1", steps)
        self.assertEqual(rc, 1, out)
        self.assertIn("3 of 4 routes measured", out)
        rc, out, _ = self.run_check(None, {r: self.times(2.0) for r in ROUTES})
        self.assertEqual(rc, 1, out)
        self.assertIn("no route", out)
        rc, out, _ = self.run_check("grad_reduction gpu, param_delivery replicated, chunk_bytes 1", {}, expect=4)
        self.assertEqual(rc, 1, out)
        self.assertIn("no measuring job", out)


if __name__ == "__main__":
    unittest.main()
