#!/usr/bin/env python3
"""Tests of tools/gpu/suite_judge.py on hand-written outputs of the tools it reads (no GPU, no
torch): each check passes on a good result, fails on a bad or missing one, and prints its
threshold. Run: python3 tools/gpu/suite_judge_test.py
"""
import contextlib
import io
import json
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import suite_judge  # noqa: E402


def run(*argv):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = suite_judge.main([str(a) for a in argv])
    return rc, buf.getvalue()


class JudgeTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.d = self.tmp.name

    def tearDown(self):
        self.tmp.cleanup()

    def write(self, name, text):
        path = os.path.join(self.d, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text if isinstance(text, str) else json.dumps(text))
        return path

    def test_tiny(self):
        log = self.write("tiny.log", "[###] step 120/120\nsummary: SUCCEEDED after 120 step(s) in 1.0 s, "
                                     "final loss 3.1633, 90000 tokens/s\n")
        self.write("run/worker-0.log", "I CUDA backend on GPU 0: FP32 residual stream, attention cudnn 91900\n")
        rc, out = run("tiny", "--part", "smoke", "--log", log, "--rc", 0, "--max-loss", 3.5, "--expect-steps", 120,
                      "--run-dir", os.path.join(self.d, "run"))
        self.assertEqual(rc, 0, out)
        self.assertIn("PASS smoke", out)
        self.assertIn("3.1633", out)
        self.assertIn("<= 3.5", out)
        self.assertIn("attention cudnn", out)
        rc, out = run("tiny", "--part", "smoke", "--log", log, "--rc", 1, "--max-loss", 3.5, "--expect-steps", 120,
                      "--run-dir", self.d)
        self.assertEqual(rc, 1)
        high = self.write("high.log", "summary: SUCCEEDED after 120 step(s) in 1.0 s, final loss 4.2, 1 tokens/s\n")
        rc, out = run("tiny", "--part", "smoke", "--log", high, "--rc", 0, "--max-loss", 3.5, "--expect-steps", 120,
                      "--run-dir", self.d)
        self.assertEqual(rc, 1, out)

    def test_gtest(self):
        ok = self.write("xml/a_gpu_test.xml", '<testsuites><testsuite name="A" tests="2">'
                        '<testcase classname="A" name="x"/><testcase classname="A" name="y"/></testsuite></testsuites>')
        self.write("xml/b_gpu_test.xml", '<testsuites><testsuite name="B"><testcase classname="B" name="z">'
                   '<failure message="boom"/></testcase><testcase classname="B" name="s"><skipped/></testcase>'
                   '</testsuite></testsuites>')
        xml = os.path.dirname(ok)
        rc, out = run("gtest", "--part", "kernels", "--xml-dir", xml, "--rc", "a_gpu_test=0")
        self.assertEqual(rc, 0, out)
        self.assertIn("1 binaries, 2 tests, 0 failed", out)
        rc, out = run("gtest", "--part", "kernels", "--xml-dir", xml, "--rc", "a_gpu_test=0", "--rc", "b_gpu_test=1")
        self.assertEqual(rc, 1)
        self.assertIn("B.z", out)
        self.assertIn("1 skipped", out)
        rc, out = run("gtest", "--part", "kernels", "--xml-dir", xml, "--rc", "c_gpu_test=0")  # no XML
        self.assertEqual(rc, 1)
        rc, out = run("gtest", "--part", "kernels", "--xml-dir", xml)  # no binary at all
        self.assertEqual(rc, 1)
        self.assertIn("none found", out)

    def test_layouts(self):
        good = ("attention layouts: 400 micro-batches, 1661 document pieces\n"
                "PASS  attention layouts: 0 of 400 micro-batches differ beyond 2.0e-02 in some document (up to 6 "
                "documents, 1 one-token pieces)\nINFO  attention layouts: worst cuDNN vs own O 7.700e-04 at step 3\n"
                "ALL PASS: 0 failure(s)\n")
        rc, out = run("layouts", "--part", "layouts", "--log", self.write("l.log", good), "--rc", 0, "--expect", 400)
        self.assertEqual(rc, 0, out)
        self.assertIn("0 of 400", out)
        self.assertIn("2.0e-02", out)
        rc, out = run("layouts", "--part", "layouts", "--log", self.write("l.log", good), "--rc", 0, "--expect", 398)
        self.assertEqual(rc, 1)
        bad = good.replace("PASS  attention layouts: 0", "FAIL  attention layouts: 1")
        rc, out = run("layouts", "--part", "layouts", "--log", self.write("b.log", bad), "--rc", 1, "--expect", 400)
        self.assertEqual(rc, 1)

    def test_stages(self):
        self.write("verify_py_test.log", "=== verify_py_test: python3 ...\nOK\n=== verify_py_test: exit 0 after 3 s\n")
        self.write("hf_train_selftest.log", "=== hf_train_selftest: exit 1 after 9 s\n")
        rc, out = run("stages", "--part", "hf", "--dir", self.d, "--names", "verify_py_test,hf_train_selftest")
        self.assertEqual(rc, 1)
        self.assertIn("PASS hf          verify_py_test: exit 0", out)
        self.assertIn("FAIL hf          hf_train_selftest: exit 1", out)

    def test_hf_compare(self):
        rec = {"shape": "tiny", "backend": "cuda", "grouping": "single", "policy": "keep-all", "loss_rel": 9e-6,
               "grad_rel": {"model.layers.3.self_attn.k_norm.weight": 2.04e-2, "model.embed_tokens.weight": 5e-3},
               "floor_rel": {"model.layers.3.self_attn.k_norm.weight": 1.82e-2, "model.embed_tokens.weight": 4e-3},
               "problems": [], "pass": False}
        ok = dict(rec, grad_rel={"model.embed_tokens.weight": 5e-3}, **{"pass": True})
        path = self.write("hf.jsonl", json.dumps(rec) + "\n" + json.dumps(ok) + "\n")
        rc, out = run("hf-compare", "--part", "hf", "--results", path, "--loss-tol", 1e-3, "--grad-tol", 2e-2,
                      "--floor-factor", 1.25)
        self.assertEqual(rc, 0, out)
        self.assertIn("2/2 runs pass", out)
        self.assertIn("strict", out)
        self.assertIn("1/2", out)
        far = dict(rec, grad_rel={"model.layers.3.self_attn.k_norm.weight": 2.5e-2})  # 1.37x the floor
        path = self.write("hf2.jsonl", json.dumps(far) + "\n")
        rc, out = run("hf-compare", "--part", "hf", "--results", path, "--loss-tol", 1e-3, "--grad-tol", 2e-2,
                      "--floor-factor", 1.25)
        self.assertEqual(rc, 1, out)
        self.assertIn("k_norm", out)
        # As far from HF autocast, but as close to HF's FP32 gradient as HF autocast is: passes.
        exact = dict(far, grad_rel_fp32={"model.layers.3.self_attn.k_norm.weight": 1.9e-2})
        path = self.write("hf4.jsonl", json.dumps(exact) + "\n")
        rc, out = run("hf-compare", "--part", "hf", "--results", path, "--loss-tol", 1e-3, "--grad-tol", 2e-2,
                      "--floor-factor", 1.25)
        self.assertEqual(rc, 0, out)
        far_exact = dict(far, grad_rel_fp32={"model.layers.3.self_attn.k_norm.weight": 2.4e-2})  # 1.32x
        path = self.write("hf5.jsonl", json.dumps(far_exact) + "\n")
        rc, out = run("hf-compare", "--part", "hf", "--results", path, "--loss-tol", 1e-3, "--grad-tol", 2e-2,
                      "--floor-factor", 1.25)
        self.assertEqual(rc, 1, out)
        err = self.write("hf3.jsonl", json.dumps({"shape": "mha", "pass": False, "error": "model_grads died"}) + "\n")
        rc, out = run("hf-compare", "--part", "hf", "--results", err, "--loss-tol", 1e-3, "--grad-tol", 2e-2,
                      "--floor-factor", 1.25)
        self.assertEqual(rc, 1)
        rc, out = run("hf-compare", "--part", "hf", "--results", os.path.join(self.d, "none"), "--loss-tol", 1e-3,
                      "--grad-tol", 2e-2, "--floor-factor", 1.25)
        self.assertEqual(rc, 1)

    def test_eval_parity(self):
        cuda = self.write("cuda.jsonl", "\n".join(json.dumps(r) for r in [
            {"step": 1, "loss": 6.2, "eval_loss": 6.2401}, {"step": 2, "loss": 6.1, "eval_loss": 6.2402}]) + "\n")
        cpu = self.write("cpu.jsonl", "\n".join(json.dumps(r) for r in [
            {"step": 1, "loss": 6.2, "eval_loss": 6.2400}, {"step": 2, "loss": 6.1, "eval_loss": 6.2400}]) + "\n")
        rc, out = run("eval-parity", "--part", "families", "--cuda", cuda, "--cpu", cpu, "--tol", 1e-3, "--what", "x")
        self.assertEqual(rc, 0, out)
        rc, out = run("eval-parity", "--part", "families", "--cuda", cuda, "--cpu", cpu, "--tol", 1e-6, "--what", "x")
        self.assertEqual(rc, 1, out)
        none = self.write("none.jsonl", json.dumps({"step": 1, "loss": 6.2}) + "\n")
        rc, out = run("eval-parity", "--part", "families", "--cuda", none, "--cpu", cpu, "--tol", 1e-3, "--what", "x")
        self.assertEqual(rc, 1, out)

    def test_tokenizer(self):
        rep = {"compare": {"documents": 20035, "ours_documents": 20035, "mismatched_documents": 0, "tokens": 9},
               "runs": [{"impl": "slidedp", "threads": 16, "MB_per_s": 113.0},
                        {"impl": "hf-tokenizers 0.23 encode_batch_fast", "threads": 16, "MB_per_s": 18.3}]}
        rc, out = run("tokenizer", "--part", "hf", "--report", self.write("t.json", rep), "--rc", 0)
        self.assertEqual(rc, 0, out)
        self.assertIn("0 of 20035", out)
        self.assertIn("113.0 MB/s", out)
        rep["compare"]["mismatched_documents"] = 2
        rc, out = run("tokenizer", "--part", "hf", "--report", self.write("t.json", rep), "--rc", 0)
        self.assertEqual(rc, 1)

    def test_graddiff(self):
        log = ("loss: ours 4.695233, HF autocast 4.695158, HF fp32 4.695427, HF mirror-fp32-norms 4.695270\n"
               "gradient norm: ours 1.539521, HF autocast 1.540799, HF fp32 1.541670, HF mirror-fp32-norms 1.539626\n")
        args = ["--loss-tol", 1e-3, "--norm-tol", 2e-2, "--what", "1.7B step 2"]
        rc, out = run("graddiff", "--part", "graddiff", "--log", self.write("g.log", log), "--rc", 0, *args)
        self.assertEqual(rc, 0, out)
        self.assertEqual(out.count("PASS"), 2)
        spike = log.replace("gradient norm: ours 1.539521", "gradient norm: ours 5.742900")
        rc, out = run("graddiff", "--part", "graddiff", "--log", self.write("g2.log", spike), "--rc", 0, *args)
        self.assertEqual(rc, 1)
        rc, out = run("graddiff", "--part", "graddiff", "--log", self.write("g3.log", "Traceback\n"), "--rc", 1, *args)
        self.assertEqual(rc, 1)

    def curve_json(self, name, steps=200, diff=3.5e-4, tol=6e-4, first=1):
        return self.write(name, {"steps": steps, "first_step": first, "last_step": first + steps - 1,
                                 "max_abs_diff": diff, "max_at_step": 74, "mean_abs_diff": 8.5e-5,
                                 "tol": tol, "pass": diff <= tol, "first_difference": None})

    def test_curve(self):
        rc, out = run("curve", "--part", "curves", "--json", self.curve_json("c.json"), "--expect-steps", 200,
                      "--what", "ours vs HF")
        self.assertEqual(rc, 0, out)
        self.assertIn("3.50e-04", out)
        self.assertIn("<= 0.0006 over 200 steps", out)
        rc, out = run("curve", "--part", "curves", "--json", self.curve_json("c2.json", diff=1.8e-3),
                      "--expect-steps", 200, "--what", "ours vs HF")
        self.assertEqual(rc, 1)
        rc, out = run("curve", "--part", "curves", "--json", self.curve_json("c3.json", steps=121),
                      "--expect-steps", 200, "--what", "ours vs HF")
        self.assertEqual(rc, 1)
        self.assertIn("incomplete: 121 of 200", out)
        rc, out = run("curve", "--part", "curves", "--info", "--json", self.curve_json("c4.json", diff=1e-2),
                      "--expect-steps", 200, "--what", "HF mirror vs HF")
        self.assertEqual(rc, 0)
        self.assertIn("INFO", out)
        rc, out = run("curve", "--part", "curves", "--json", os.path.join(self.d, "none.json"), "--expect-steps", 200,
                      "--what", "x")
        self.assertEqual(rc, 1)

    def test_bitwise(self):
        ua = self.write("ua.txt", "unit norms: step 1 unit 0 squares 1.5\nunit norms: step 1 unit 1 squares 2\n")
        j = self.curve_json("b.json", steps=3, diff=0.0, tol=0.0)
        rc, out = run("bitwise", "--part", "determinism", "--json", j, "--expect-steps", 3, "--units-a", ua,
                      "--units-b", ua, "--what", "0.6B twice")
        self.assertEqual(rc, 0, out)
        self.assertIn("2/2 unit-norm lines", out)
        d = suite_judge.load_json(j)
        d["first_difference"] = [2, 12.1, 12.2, [[5, 1.0, 1.1]]]
        j2 = self.write("b2.json", d)
        rc, out = run("bitwise", "--part", "determinism", "--json", j2, "--expect-steps", 3, "--units-a", ua,
                      "--units-b", ua, "--what", "0.6B twice")
        self.assertEqual(rc, 1)
        self.assertIn("first difference at step 2", out)
        empty = self.write("e.txt", "")
        rc, out = run("bitwise", "--part", "determinism", "--json", j, "--expect-steps", 3, "--units-a", empty,
                      "--units-b", empty, "--what", "no unit lines")
        self.assertEqual(rc, 1)

    def test_params(self):
        j = self.write("p.json", {"worst_rel_l2": 6.3e-5, "worst_tensor": "model.norm.weight", "max_abs": 1e-6,
                                  "pass": True})
        rc, out = run("params", "--part", "routes", "--json", j, "--tol", 1e-4, "--what", "g2 vs g1")
        self.assertEqual(rc, 0, out)
        self.assertIn("6.30e-05", out)

    def test_offload(self):
        logs = []
        for r, peak in ((0, 41.3), (0.5, 41.1), (1.0, 29.6)):
            logs.append(self.write(f"o{r}.log", "step 0: 5.2 s loss 11.9313\n" + json.dumps(
                {"mode": "compute_only", "loss": 11.93126392364502, "offload_ratio": r, "step_s": 5.3,
                 "peak_gib": peak, "offload_host_gib": 22.5 * r}) + "\n"))
        rc, out = run("offload", "--part", "offload", "--logs", *logs)
        self.assertEqual(rc, 0, out)
        self.assertIn("bitwise equal", out)
        logs.append(self.write("o9.log", json.dumps({"mode": "compute_only", "loss": 11.93126392364503,
                                                     "offload_ratio": 0.25, "step_s": 5, "peak_gib": 1}) + "\n"))
        rc, out = run("offload", "--part", "offload", "--logs", *logs)
        self.assertEqual(rc, 1)
        logs.append(self.write("oe.log", json.dumps({"mode": "compute_only", "error": "out of memory"}) + "\n"))
        rc, out = run("offload", "--part", "offload", "--logs", *logs)
        self.assertEqual(rc, 1)
        self.assertIn("out of memory", out)

    def bench_results(self, fsdp2_16k=10778.0, offload=True):
        gib = 2.0 ** 30
        recs = [
            {"kind": "ours", "model": "qwen3-4b", "gpus": 1, "tokens_per_gpu": 65536, "tokens_per_s_per_gpu": 16363.0,
             "tokens_per_s": 16363.0, "model_tflops": 450.0, "step_s": 4.01, "gpu_peak_gib": 114.0,
             "host_state_gib": 13.07 * 4.022468096 * 1e9 / gib * gib / 1e9 * 1e9 / gib, "host_sampled_gib": 55.0},
            {"kind": "compute", "model": "qwen3-4b", "gpus": 1, "tokens_per_gpu": 65536, "tokens_per_s_per_gpu": 15899.0},
            {"kind": "ours", "model": "qwen3-4b", "gpus": 1, "tokens_per_gpu": 16384, "tokens_per_s_per_gpu": 12000.0},
            {"kind": "fsdp2", "model": "qwen3-4b", "gpus": 1, "tokens_per_gpu": 16384,
             "tokens_per_s_per_gpu": fsdp2_16k},
        ]
        if offload:
            recs.append({"kind": "fsdp2-offload", "model": "qwen3-4b", "gpus": 1, "tokens_per_gpu": 16384,
                         "tokens_per_s_per_gpu": 1980.0})
        return self.write("bench-results.json", recs)

    def test_bench(self):
        args = ["--model", "qwen3-4b", "--tokens", 65536, "--peer-tokens", 16384]
        rc, out = run("bench", "--part", "bench", "--results", self.bench_results(), *args, "--offload")
        self.assertEqual(rc, 0, out)
        for want in ("= 1.03 (>= 0.95", "= 1.52 (>= 1.5)", "= 6.06 (>= 4)", "GiB per billion"):
            self.assertIn(want, out)
        rc, out = run("bench", "--part", "bench", "--results", self.bench_results(fsdp2_16k=11500.0), *args)
        self.assertEqual(rc, 1)
        self.assertIn("FAIL bench", out)
        rc, out = run("bench", "--part", "bench", "--results", self.bench_results(offload=False), *args, "--offload")
        self.assertEqual(rc, 1)
        self.assertIn("fsdp2-offload at 16K did not run", out)
        rc, out = run("bench", "--part", "bench", "--results", os.path.join(self.d, "none.json"), *args)
        self.assertEqual(rc, 1)

    def test_scaling(self):
        recs = [{"kind": "ours", "model": "qwen3-8b", "gpus": 1, "tokens_per_gpu": 65536, "tokens_per_s": 7761.0,
                 "tokens_per_s_per_gpu": 7761.0},
                {"kind": "ours", "model": "qwen3-8b", "gpus": 2, "tokens_per_gpu": 65536, "tokens_per_s": 15583.0,
                 "tokens_per_s_per_gpu": 7791.5},
                {"kind": "fsdp2", "model": "qwen3-8b", "gpus": 2, "tokens_per_gpu": 16384, "tokens_per_s_per_gpu": 6739.0}]
        rc, out = run("scaling", "--part", "scaling", "--results", self.write("s.json", recs), "--model", "qwen3-8b",
                      "--tokens", 65536, "--peer-tokens", 16384)
        self.assertEqual(rc, 1, out)  # 2.01x passes, 1.16x against FSDP2 does not
        self.assertIn("PASS scaling", out)
        self.assertIn("2.01x", out)
        self.assertIn("1.16", out)

    def test_strong_scaling(self):
        def ours(gpus, per_gpu, tps):
            return {"kind": "ours", "model": "qwen3-8b", "gpus": gpus, "tokens_per_gpu": per_gpu, "tokens_per_s": tps,
                    "tokens_per_s_per_gpu": tps / gpus}
        recs = [ours(1, 65536, 7761.0), ours(2, 65536, 15583.0), ours(1, 16384, 7000.0), ours(2, 32768, 15000.0),
                ours(2, 8192, 11900.0),
                {"kind": "fsdp2", "model": "qwen3-8b", "gpus": 2, "tokens_per_gpu": 16384, "tokens_per_s_per_gpu": 5000.0}]
        args = ["--results", self.write("strong.json", recs), "--model", "qwen3-8b", "--tokens", 65536,
                "--peer-tokens", 16384]
        rc, out = run("scaling", "--part", "scaling", *args, "--strong", "65536,16384")
        self.assertEqual(rc, 1, out)  # 64K: 15000 / 7761 = 1.93x passes; 16K: 11900 / 7000 = 1.70x does not
        self.assertIn("PASS scaling     qwen3-8b strong scaling at 64K tokens per step", out)
        self.assertIn("1.93x (>= 1.9)", out)
        self.assertIn("FAIL scaling     qwen3-8b strong scaling at 16K tokens per step", out)
        self.assertIn("1.70x", out)
        # A global batch whose 2-GPU run is missing is a failure that says so.
        rc, out = run("scaling", "--part", "scaling", *args, "--strong", "131072")
        self.assertEqual(rc, 1, out)
        self.assertIn("strong scaling at 128K", out)
        # Without --strong only the weak scaling and the peer are judged.
        rc, out = run("scaling", "--part", "scaling", *args)
        self.assertEqual(rc, 0, out)
        self.assertNotIn("strong", out)

    def test_layeradam(self):
        bench = {"bench": "layeradam", "adam_Gparam_per_s": 4.24, "threads": 16, "layeradam_bytes_per_param": 30.0,
                 "layeradam_bytes_per_param_no_mirror": 28.0, "layeradam_gbps": 127.3, "layeradam_gbps_best": 131.0,
                 "triad_gbps": 138.4, "triad_gbps_best": 140.2, "triad_reference_stores": "stream",
                 "triad_stream_gbps": 138.4, "triad_cached_gbps": 96.0, "triad_cached_gbps_write_allocate": 128.0,
                 "ratio_to_triad": 0.92, "hot_path_page_faults": 0, "warmup_reps": 2, "warmup_page_faults": 7}
        line = {"bench": "torch_cpu_adamw", "params": 268435456, "threads": 16, "layeradam": bench,
                "adamw_fused_Gparam_per_s": 3.82, "layeradam_over_torch_fused": 1.11, "layeradam_over_copy": 1.39}

        def judge(*lines, **kw):
            log = self.write("a.log", "".join(json.dumps(l) + "\n" for l in lines))
            return run("layeradam", "--part", "host", "--log", log, "--t-torch", 1.1, "--t-copy", 0.8,
                       *(["--t-triad", kw["t_triad"]] if "t_triad" in kw else []))

        rc, out = judge(bench, line)  # torch_cpu_adamw.py echoes bench_layeradam's line first
        self.assertEqual(rc, 0, out)
        self.assertIn("PASS host        LayerAdam / same-run triad: 127.3 / 138.4 GB/s = 0.92", out)
        self.assertIn("30 B/param", out)
        self.assertIn(">= 0.85", out)  # the default target
        self.assertIn("INFO host        LayerAdam 30 B/param moved (28 without the mirror): 127.3 GB/s", out)
        self.assertIn("140.2 best", out)
        self.assertIn("PASS host        page faults in LayerAdam's timed passes: 0 (7 in 2 warm-up passes", out)
        rc, out = judge(line, t_triad=0.95)
        self.assertEqual(rc, 1, out)
        self.assertIn("FAIL host        LayerAdam / same-run triad", out)
        self.assertIn(">= 0.95", out)

        line["layeradam_over_torch_fused"] = 1.05
        rc, out = judge(line)
        self.assertEqual(rc, 1)
        self.assertIn("PASS host        LayerAdam / same-run triad", out)
        line["layeradam_over_torch_fused"] = 1.11

        line["layeradam"] = dict(bench, hot_path_page_faults=3)
        rc, out = judge(line)
        self.assertEqual(rc, 1, out)
        self.assertIn("FAIL host        page faults in LayerAdam's timed passes: 3", out)

        # A bench_layeradam from before the triad: the copy and torch gates as before, the triad a FAIL.
        line["layeradam"] = {"adam_Gparam_per_s": 4.24}
        rc, out = judge(line)
        self.assertEqual(rc, 1, out)
        self.assertIn("PASS host        LayerAdam 4.24 Gparam/s / torch fused", out)
        self.assertIn("FAIL host        LayerAdam / same-run triad: no triad figure", out)

        # torch missing (the script died importing it): the torch gate fails, bench_layeradam's own
        # line is still judged.
        rc, out = judge(bench)
        self.assertEqual(rc, 1, out)
        self.assertIn("FAIL host        LayerAdam vs torch CPU AdamW", out)
        self.assertIn("PASS host        LayerAdam / same-run triad", out)
        rc, out = judge()
        self.assertEqual(rc, 1, out)
        self.assertIn("no triad figure in bench_layeradam's result (no result", out)

    def test_figures(self):
        copy = self.write("c.log", json.dumps({"gpus": 1, "direction": "h2d", "layeradam": False,
                                               "per_gpu": [{"gpu": 0, "h2d_gbs": 53.7, "d2h_gbs": 0}]}) + "\n")
        rc, out = run("copy", "--part", "host", "--log", copy)
        self.assertEqual(rc, 0)
        self.assertIn("53.7", out)
        cold = self.write("cold.txt", "state: SUCCEEDED\nsubmit to first step: 44.40 s\n")
        rc, out = run("warm", "--part", "host", "--cold", cold, "--warm", os.path.join(self.d, "missing"))
        self.assertEqual(rc, 0)
        self.assertIn("cold 44.40 s", out)
        self.assertIn("warm: no figure", out)

    def test_copy_priority(self):
        def case(mode, direction, h2d, d2h, adam=None, priority=0.0):
            j = {"case": mode, "gpus": 1, "direction": direction, "layeradam": adam is not None,
                 "copy_priority": priority, "duty_ms": [20, 20],
                 "per_gpu": [{"gpu": 0, "h2d_gbs": h2d, "d2h_gbs": d2h}]}
            if adam is not None:
                j["layeradam_gparams_per_s"] = adam
                j["layeradam_paused_s"] = 0.4 if priority else 0
            return json.dumps(j)

        def summary(direction, alone, with_adam, with_pri, h2d_pri):
            return json.dumps({"summary": True, "gpus": 1, "direction": direction, "duty_ms": [20, 20],
                               "copy_gbs_alone": alone, "copy_gbs_with_adam": with_adam,
                               "copy_ratio_with_adam": with_adam / alone, "h2d_ratio_with_adam": with_adam / alone,
                               "adam_gparams_alone": 3.9, "adam_gparams_with_copies": 1.7,
                               "adam_ratio_with_copies": 1.7 / 3.9, "copy_priority": 0.5,
                               "copy_gbs_with_adam_priority": with_pri,
                               "copy_ratio_with_adam_priority": with_pri / alone,
                               "h2d_ratio_with_adam_priority": h2d_pri,
                               "adam_gparams_with_copies_priority": 2.9,
                               "adam_ratio_with_copies_priority": 2.9 / 3.9})

        good = "\n".join([json.dumps({"case": "layeradam_alone", "gpus": 0, "direction": "none", "layeradam": True,
                                      "per_gpu": [], "layeradam_gparams_per_s": 3.9}),
                          case("copies_alone", "h2d", 53.7, 0), case("with_layeradam", "h2d", 27.0, 0, 1.7),
                          case("with_layeradam_priority", "h2d", 50.1, 0, 2.9, 0.5),
                          summary("h2d", 53.7, 27.0, 50.1, 50.1 / 53.7),
                          summary("both", 92.0, 54.0, 70.0, 0.8)]) + "\n"
        rc, out = run("copy", "--part", "host", "--log", self.write("good.log", good))
        self.assertEqual(rc, 0, out)
        self.assertIn("PASS host        DMA before Adam, bench_copy 1 GPU(s) h2d, duty 20:20 ms: H2D with LayerAdam "
                      "+ copy priority 0.5 / alone = 0.93 (>= 0.9)", out)
        self.assertIn("ratios copies with LayerAdam / alone 0.50, with priority 0.93", out)
        self.assertIn("LayerAdam Gparam/s alone 3.90 / with copies 1.70 / with copies + priority 2.90", out)
        self.assertIn("with LayerAdam + copy priority 0.5, duty 20:20 ms: H2D/D2H GB/s per GPU 50.1/0.0", out)
        self.assertNotIn("DMA before Adam, bench_copy 1 GPU(s) both", out)  # D2H is not marked: figures only
        bad = good.replace(json.dumps(50.1 / 53.7), "0.6")
        rc, out = run("copy", "--part", "host", "--log", self.write("bad.log", bad))
        self.assertEqual(rc, 1, out)
        self.assertIn("FAIL host        DMA before Adam, bench_copy 1 GPU(s) h2d, duty 20:20 ms: H2D with LayerAdam "
                      "+ copy priority 0.5 / alone = 0.60 (>= 0.9)", out)
        # LayerAdam ran but no case had priority (a bench_copy from before it): a failed gate.
        old = "\n".join([case("copies_alone", "h2d", 53.7, 0), case("with_layeradam", "h2d", 27.0, 0, 1.7)])
        rc, out = run("copy", "--part", "host", "--log", self.write("old.log", old))
        self.assertEqual(rc, 1, out)
        self.assertIn("no H2D case with copy priority", out)

    def test_kbench(self):
        lines = ['JSON {"op":"ceiling_gemm_bf16_8192","tflops":803.7}']
        for model in ("qwen3-4b", "qwen3-8b"):
            for t, fwd, bwd in ((4096, 452, 389), (16384, 634, 510)):
                lines.append(f'JSON {{"op":"attn_fwd_causal_cudnn","model":"{model}","tokens":{t},"ms":1,"tflops":{fwd}}}')
                lines.append(f'JSON {{"op":"attn_bwd_causal_cudnn","model":"{model}","tokens":{t},"ms":1,"tflops":{bwd}}}')
        lines.append('JSON {"op":"layer_fwd_bwd_keep_all_fp32res","model":"qwen3-8b","tokens":65536,"ms":9,"tflops":604.8}')
        lines.append('JSON {"op":"layer_fwd_bwd_recompute_fp32res","model":"qwen3-8b","tokens":65536,"ms":9,"tflops":474.5}')
        log = self.write("k.log", "\n".join(lines) + "\n")
        args = ["--t-fwd", 400, "--t-bwd", 300, "--t-layer", 550]
        rc, out = run("kbench", "--part", "kbench", "--log", log, "--rc", 0, *args)
        self.assertEqual(rc, 0, out)
        self.assertEqual(out.count("PASS"), 3)
        rc, out = run("kbench", "--part", "kbench", "--log", log, "--rc", 0, "--t-fwd", 500, "--t-bwd", 300,
                      "--t-layer", 550)
        self.assertEqual(rc, 1)

    def longctx_dir(self, tflops=(455.0, 471.5), losses=(12.02, 12.01), exit_line="exit 0 after 401 s", extra_log=""):
        """A run_suite.sh longctx results folder: ours' 256K steps, compute-only on 4 layers, FSDP2 that
        ran out of memory at 64K and 32K and ran at 16K."""
        d = os.path.join(self.d, "lc")
        rows = [{"step": i + 1, "loss": l, "tokens": 262144, "step_time_s": 7.27e16 / (t * 1e12),
                 "tokens_per_s": 262144 * t * 1e12 / 7.27e16, "model_tflops": t, "gpu_peak_bytes": 118 * 2**30,
                 "host_state_bytes": 47 * 2**30, "mfu": t / 989.4,
                 "busy_s": {"worker_step": 150.0, "worker_gate_wait": 0.4, "worker_h2d": 9.0, "worker_cast": 1.0,
                            "worker_d2h": 12.0, "host_update": 20.0, "host_update_tail": 0.5}}
                for i, (l, t) in enumerate(zip(losses, tflops))]
        self.write("lc/ours/metrics.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
        self.write("lc/ours/stage.log", "=== longctx_ours (cap 470 s): env slidedp run job.yaml\n" + extra_log +
                   f"summary: SUCCEEDED after {len(rows)} step(s) in 380.0 s\n=== longctx_ours: {exit_line}\n")
        self.write("lc/ours/run/hostd.log", "I job longctx: host state: 99.10 GiB (master 30.51, adam m+v 15.49, "
                   "bf16 mirror 0.00, job segment 0.01, grad rings 0.50, step gradient staging 0.00, activation "
                   "offload 52.00, undo copies 0.00, cast staging 0.25; 8190735360 params)\n")
        self.write("lc/ours/hostmem", "130000000 25000000\n")
        self.write("lc/ours/started", "2026-12-04T01:02:03Z\n")
        comp = {"mode": "compute_only", "model": "qwen3-8b", "layers": 4, "seq": 262144, "tokens_per_step": 262144,
                "step_s": 19.5, "tokens_per_s": 13443.0, "model_tflops": 492.0, "peak_gib": 40.2, "offload_ratio": 0}
        self.write("lc/compute/stage.log", "step 0: 25 s\nstep 1: 19.5 s\n" + json.dumps(comp) +
                   "\n=== longctx_compute: exit 0 after 60 s\n")
        oom = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 40.00 GiB\n=== {}: exit 1 after 31 s\n"
        self.write("lc/peer/s65536.log", oom.format("longctx_peer_s65536"))
        self.write("lc/peer/s32768.log", oom.format("longctx_peer_s32768"))
        peer = {"peer": "fsdp2", "model": "qwen3-8b", "seq": 16384, "mbs": 1, "step_s": 2.6,
                "tokens_per_s_per_gpu": 6300.0, "model_tflops_per_gpu": 330.0, "peak_gib": 131.0}
        self.write("lc/peer/s16384.log", "step 0 loss 12.1 9.0s\n" + json.dumps(peer) +
                   "\n=== longctx_peer_s16384: exit 0 after 45 s\n")
        return d

    def longctx(self, d, ran="ours compute peer", steps=2):
        return run("longctx", "--part", "longctx", "--dir", d, "--model", "qwen3-8b", "--seq", 262144,
                   "--expect-steps", steps, "--t-tflops", 450, "--ran", ran)

    def test_longctx(self):
        d = self.longctx_dir()
        rc, out = self.longctx(d)
        self.assertEqual(rc, 0, out)
        self.assertIn("PASS longctx     qwen3-8b ours, one sequence of 262,144 tokens per step trains: exit 0 after "
                      "401 s, 2 of 2 steps, losses 12.0200, 12.0100 (finite loss on every step, 2 steps)", out)
        self.assertIn("step 2 471.5 model TFLOP/s", out)
        self.assertIn("(>= 450 on step 2)", out)
        self.assertIn("GPU peak 118.0 GiB, host state 47.0 GiB, hostd's plan 99.10 GiB of it 52.00 GiB activation "
                      "offload (pinned), MemAvailable drop 100.1 GiB", out)
        self.assertIn("compute-only (bench_step, 4 of 36 layers", out)
        self.assertIn("ours / compute-only at 256K: model TFLOP/s 471.5 / 492.0 = 0.958 (compute-only on 4 of 36 "
                      "layers", out)
        self.assertIn("FSDP2 GPU-resident at its longest sequence that ran, 16K x 1 row (64K out of GPU memory, 32K out "
                      "of GPU memory): 6,300 tok/s, 330.0 model TFLOP/s", out)
        self.assertIn("model TFLOP/s 471.5 / 330.0 = 1.43x (16x the sequence", out)
        self.assertNotIn("earlier call", out)
        self.assertNotIn("FAIL", out)

    def test_longctx_fails(self):
        rc, out = self.longctx(self.longctx_dir(tflops=(400.0, 430.0)))  # too slow
        self.assertEqual(rc, 1, out)
        self.assertIn("FAIL longctx     qwen3-8b ours, one sequence of 262,144 tokens per step: step 2 430.0", out)
        self.assertIn("PASS longctx     qwen3-8b ours, one sequence of 262,144 tokens per step trains", out)
        rc, out = self.longctx(self.longctx_dir(losses=(12.0, None)))  # a non-finite loss (null in the JSONL)
        self.assertEqual(rc, 1, out)
        self.assertIn("FAIL longctx     qwen3-8b ours, one sequence of 262,144 tokens per step trains", out)
        self.assertIn("losses 12.0000, None", out)
        # cut by the time cap after one step: the job's own words go into the summary
        d = self.longctx_dir(tflops=(455.0,), losses=(12.0,), exit_line="exit 124 after 470 s",
                             extra_log="slidedp: worker 0 was killed by signal 15 (logs in /x/run)\n")
        rc, out = self.longctx(d)
        self.assertEqual(rc, 1, out)
        self.assertIn("trains: exit 124 after 470 s (time cap), 1 of 2 steps", out)
        self.assertIn("INFO longctx     qwen3-8b ours 256K: slidedp: worker 0 was killed by signal 15", out)
        self.assertIn("FAIL longctx     qwen3-8b ours, one sequence of 262,144 tokens per step: step 1 455.0 model "
                      "TFLOP/s", out)  # the warm-up step's figure is no pass
        self.assertIn("step 2 did not finish) (>= 450 on step 2)", out)
        # refused: no step at all
        d = self.longctx_dir(tflops=(), losses=(), exit_line="exit 8 after 40 s",
                             extra_log="error: RESOURCE_EXHAUSTED: activations need 150.2 GiB of 139.8 GiB; raise "
                                       "runtime.offload_ratio\n")
        rc, out = self.longctx(d)
        self.assertEqual(rc, 1, out)
        self.assertIn("0 of 2 steps", out)
        self.assertIn("INFO longctx     qwen3-8b ours 256K: error: RESOURCE_EXHAUSTED: activations need 150.2 GiB", out)
        self.assertIn("model TFLOP/s: no step finished (>= 450)", out)
        # ours asked for and absent
        rc, out = self.longctx(os.path.join(self.d, "none"))
        self.assertEqual(rc, 1, out)
        self.assertIn("did not run (no log)", out)

    def test_longctx_split_calls(self):
        d = self.longctx_dir()
        # a call that ran only the peer: ours and compute-only come from the earlier call, said so
        rc, out = self.longctx(d, ran="peer")
        self.assertEqual(rc, 0, out)
        self.assertIn("(finite loss on every step, 2 steps) [from an earlier call on this machine, "
                      "2026-12-04T01:02:03Z]", out)
        self.assertIn("peak 40.2 GiB [from an earlier call on this machine]", out)
        # nothing of ours at all and not asked for: SKIP, not FAIL
        import shutil
        shutil.rmtree(os.path.join(d, "ours"))
        rc, out = self.longctx(d, ran="compute peer")
        self.assertEqual(rc, 0, out)
        self.assertIn("SKIP longctx     qwen3-8b ours, one sequence of 262,144 tokens per step: did not run (not in "
                      "LONGCTX_WHAT, no earlier result)", out)
        self.assertIn("16K x 1 row", out)
        # no sequence length of the peer ran
        for name in ("s16384.log",):
            os.remove(os.path.join(d, "peer", name))
        rc, out = self.longctx(d, ran="compute peer")
        self.assertIn("no sequence length ran (64K out of GPU memory, 32K out of GPU memory)", out)

    def test_broken_judge_fails(self):
        bad = self.write("bad.json", {"steps": "x"})
        rc, out = run("curve", "--part", "curves", "--json", bad, "--expect-steps", 200, "--what", "x")
        self.assertEqual(rc, 1)
        self.assertIn("the judge failed", out)


if __name__ == "__main__":
    unittest.main()
