#!/usr/bin/env python3
"""plan_check.py's verdicts on made-up files: a prediction within 10% of the median step from
step 4 passes; one 20% off, a plan without a prediction, or no metrics fails."""
import json
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))


class PlanCheck(unittest.TestCase):
    def run_check(self, plan_text, step_times):
        with tempfile.TemporaryDirectory() as d:
            with open(f"{d}/c.plan", "w") as f:
                f.write(plan_text)
            with open(f"{d}/c.jsonl", "w") as f:
                for step, t in enumerate(step_times, start=1):
                    f.write(json.dumps({"step": step, "step_time_s": t}) + "\n")
            out = subprocess.run([sys.executable, f"{HERE}/plan_check.py", "--dir", d, "--cases", "c",
                                  "--measure-times", "c=41"], capture_output=True, text=True)
            return out.returncode, out.stdout

    def test_close_prediction_passes(self):
        # Steps 1-3 (warm-up, slow) are left out; the median of 2.0, 2.1, 2.2 is 2.1.
        rc, out = self.run_check("plan: 1 GPU(s)\npredicted step 2.000 s = 8000 tokens/s\n", [9, 5, 3, 2.0, 2.1, 2.2])
        self.assertEqual(rc, 0, out)
        self.assertIn("PASS", out)
        self.assertIn("-4.8%", out)
        self.assertIn("INFO", out)

    def test_far_prediction_fails(self):
        rc, out = self.run_check("predicted step 2.520 s = x\n", [2.1] * 6)
        self.assertEqual(rc, 1, out)
        self.assertIn("FAIL", out)

    def test_no_prediction_fails(self):
        rc, out = self.run_check("not measured\n", [2.1] * 6)
        self.assertEqual(rc, 1, out)
        rc, out = self.run_check("predicted step 2.0 s\n", [])
        self.assertEqual(rc, 1, out)


if __name__ == "__main__":
    unittest.main()
