#!/usr/bin/env python3
"""clip_check.py's verdicts on made-up bench results: targets met pass, a slow clipping variant
fails its ratios, a missing variant fails, and the figures are printed."""
import json
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))


def ours(tok_s, step_s, hidden=0.97, spec=0.9):
    return {"kind": "ours", "model": "qwen3-4b", "tokens_per_gpu": 16384, "gpus": 1, "tokens_per_s_per_gpu": tok_s,
            "step_s": step_s, "busy_s": {"worker_gate_wait": 0.01, "host_update": 0.9}, "host_hidden_fraction": hidden,
            "speculated_fraction": spec, "rolled_back_steps": 0, "grad_norm": 0.5}


class ClipCheck(unittest.TestCase):
    def run_check(self, variants):
        with tempfile.TemporaryDirectory() as d:
            for name, recs in variants.items():
                os.makedirs(f"{d}/{name}")
                with open(f"{d}/{name}/bench-results.json", "w") as f:
                    json.dump(recs, f)
            out = subprocess.run([sys.executable, f"{HERE}/clip_check.py", "--dir", d], capture_output=True, text=True)
        return out.returncode, out.stdout

    peers = [{"kind": "compute", "model": "qwen3-4b", "tokens_per_gpu": 16384, "gpus": 1, "tokens_per_s_per_gpu": 11000},
             {"kind": "fsdp2", "model": "qwen3-4b", "tokens_per_gpu": 16384, "gpus": 1, "tokens_per_s_per_gpu": 8500}]

    def test_targets_met_pass(self):
        rc, out = self.run_check({"spec": [ours(10800, 1.52)], "high": [ours(10800, 1.52)],
                                  "wait": [ours(9500, 1.72, 0.5, 0)], "noclip": [ours(10850, 1.51)],
                                  "peers": self.peers})
        self.assertEqual(rc, 0, out)
        self.assertEqual(out.count("PASS"), 6, out)
        self.assertIn("host hidden 0.97", out)
        self.assertIn("waits for the norm / speculative: 1.132", out)

    def test_slow_clipping_fails(self):
        rc, out = self.run_check({"spec": [ours(9500, 1.72)], "noclip": [ours(10850, 1.51)], "peers": self.peers})
        self.assertEqual(rc, 1)
        self.assertIn("FAIL clip        qwen3-4b 16K spec / compute-only: 0.864", out)
        self.assertIn("spec step / no-clip step: 1.139", out)

    def test_further_variants_are_figures(self):
        rc, out = self.run_check({"spec": [ours(10800, 1.52)], "noclip": [ours(10850, 1.51)],
                                  "bf16": [ours(11000, 1.49)], "peers": self.peers})
        self.assertEqual(rc, 0, out)
        self.assertIn("INFO clip        qwen3-4b 16K bf16: 11,000 tok/s", out)
        self.assertIn("/ compute-only 1.000, / FSDP2 1.294, step / no-clip step 0.987", out)

    def test_missing_variant_fails(self):
        rc, out = self.run_check({"noclip": [ours(10850, 1.51)], "peers": self.peers})
        self.assertEqual(rc, 1)
        self.assertIn("spec: did not run", out)


if __name__ == "__main__":
    unittest.main()
