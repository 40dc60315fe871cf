#!/usr/bin/env python3
"""autopolicy_check.py's verdicts on a made-up run: targets met pass (ratios, prediction, selection,
cache reuse), a slow layout and a bad prediction fail, a missing run fails."""
import json
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL, TOK, PEER = "qwen3-8b", 65536, 16384


def rec(kind, tok_s, tokens=TOK):
    return {"kind": kind, "model": MODEL, "tokens_per_gpu": tokens, "gpus": 1, "tokens_per_s_per_gpu": tok_s,
            "step_s": tokens / tok_s, "gpu_peak_gib": 120.0}


def write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


class AutoPolicyCheck(unittest.TestCase):
    def run_check(self, auto=11000.0, predicted=6.0, measured=6.1, cached_log=True, with_auto=True, sweep=()):
        with tempfile.TemporaryDirectory() as d:
            out, work = f"{d}/out", f"{d}/work"
            recs = {"cached": [rec("ours", auto)], "today": [rec("ours", 9300)], "peer": [rec("fsdp2", 6500, PEER)]}
            if with_auto:
                recs["auto"] = [rec("ours", auto)]
            for v, r in recs.items():
                write(f"{out}/{v}/bench-results.json", json.dumps(r))
            run = f"{work}/auto/runs/{MODEL}/s4096/t{TOK}/g1/ours"
            if with_auto:
                write(f"{run}/out/metrics-e2e-1.jsonl", "".join(
                    json.dumps({"step": s, "step_time_s": measured, "tokens_per_s": TOK / measured}) + "\n"
                    for s in range(1, 8)))
                write(f"{run}/run/hostd.log", "job e2e-1: AutoPolicy chose 30 selective, 6 keep_all in 8.20 s; step 3 "
                                              f"ran it in 6.2 s against {predicted} s predicted (+1%)\n"
                                              "AutoPolicy: step 2 (all recompute) took 7.3 s\n")
                write(f"{run}/run/worker0.log", "".join(
                    f"I1203 worker_agent.cc] AutoPolicy sweep: {name}: step {step} {t} s, peak 100.00 GiB (predicted 99 GiB)\n"
                    for name, step, t in sweep))
            write(f"{work}/cache/x.yaml", "layers:\n  - {kind: selective}\n  - {kind: keep_all, offload: true}\n"
                                          "  - {kind: keep_all, offload: 0.25}\n"
                                          "  - {kind: segment, keep: [qkv, gate_up]}\n"
                                          f"autopolicy:\n  predicted:\n    counts: [1, 1]\n    step_s: {predicted}\n")
            second = "runtime.policy auto: the layout cached at x.yaml; no probes\n" if cached_log else ""
            write(f"{work}/cached/runs/{MODEL}/s4096/t{TOK}/g1/ours/run/hostd.log", second)
            r = subprocess.run([sys.executable, f"{HERE}/autopolicy_check.py", "--dir", out, "--work", work,
                                "--model", MODEL, "--tokens", str(TOK), "--peer-tokens", str(PEER)],
                               capture_output=True, text=True)
        return r.returncode, r.stdout

    def test_targets_met_pass(self):
        rc, out = self.run_check()
        self.assertEqual(rc, 0, out)
        self.assertIn("policy auto / FSDP2 GPU-resident at 16K: 11,000 / 6,500 = 1.692 (target 1.65)", out)
        self.assertIn("PASS autopolicy  policy auto / act_policy auto: 1.183", out)
        self.assertIn("PASS autopolicy  selection 8.20 s", out)
        self.assertIn("runs the cached layout, no probes", out)
        self.assertIn("layout: 1 selective, 1 keep_all+offload, 1 keep_all+offload(0.25), 1 segment(qkv+gate_up)", out)

    def test_slow_layout_and_bad_prediction_fail(self):
        rc, out = self.run_check(auto=9000.0, predicted=5.0, measured=7.3)
        self.assertEqual(rc, 1)
        self.assertIn("FAIL autopolicy  policy auto / act_policy auto: 0.968", out)
        self.assertIn("FAIL autopolicy  predicted step 5.000 s against 7.300 s measured (steps 6+): +46.0%", out)

    def test_sweep_compares_with_the_fastest_fixed_layout(self):
        sweep = (("last 5 keep_all", 5, 6.0), ("last 9 selective, first 18 offloaded", 6, 6.4))
        rc, out = self.run_check(sweep=sweep)
        self.assertEqual(rc, 0, out)
        self.assertIn("PASS autopolicy  AutoPolicy's steady step 6.100 s against the fastest of 2 fixed layouts, "
                      "last 5 keep_all 6.000 s (step 5): 1.017 (<= 1.02)", out)
        self.assertIn("(steps 7+)", out)
        rc, out = self.run_check(sweep=(("last 5 keep_all", 5, 5.8),))
        self.assertEqual(rc, 1)
        self.assertIn("FAIL autopolicy  AutoPolicy's steady step 6.100 s against the fastest of 1 fixed layouts", out)

    def test_no_cache_reuse_or_run_fails(self):
        rc, out = self.run_check(cached_log=False, with_auto=False)
        self.assertEqual(rc, 1)
        self.assertIn("FAIL autopolicy  qwen3-8b auto: no result", out)
        self.assertIn("did not reuse the cache", out)


if __name__ == "__main__":
    unittest.main()
