#!/usr/bin/env python3
"""Tests of the GPU suite's table and runner (tools/gpu/suite_parts.py, run_suite.py, the recipes and
suite_checks.py), no GPU: the table is whole (a recipe per part, knobs and thresholds that resolve),
knobs and thresholds read as documented, dry runs print the command lines recorded in
run_suite_golden.txt (first recorded from the bash run_suite.sh that the runner replaced, see
docs/gpu-suite.md), parts are selected and refused as before, a run with fake binaries judges and
summarizes, and the checks that were inline Python judge fake results against the table.

    python3 tools/gpu/run_suite_test.py                   the tests
    python3 tools/gpu/run_suite_test.py --update-golden   rewrite run_suite_golden.txt (review the diff)
"""
import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import run_suite  # noqa: E402
import suite_judge  # noqa: E402
import suite_parts  # noqa: E402

ROOT = suite_parts.ROOT
GOLDEN = os.path.join(HERE, "run_suite_golden.txt")
NPROC = str(len(os.sched_getaffinity(0)))

# (environment, parts) of the recorded dry runs: every part at its defaults (with two GPUs and one),
# then the knobs that change command lines.
CASES = [
    ({"DRY_GPUS": "2"}, [p.name for p in suite_parts.PARTS]),
    ({}, ["routes", "routespeed", "scaling", "big", "longctx"]),
    ({"KERNELS_FILTER": "Attn*", "KERNELS_WRAP": "compute-sanitizer --tool memcheck"}, ["kernels"]),
    ({"KERNELS_CTEST": "1", "KERNELS_BUILD_DIR": "b2", "KERNELS_CAP": "100"}, ["kernels"]),
    ({"LAYOUTS_PRESET": "qwen3-8b", "LAYOUTS_STEPS": "10"}, ["layouts"]),
    ({"LAYOUTS_PRESET": "foo"}, ["layouts"]),
    ({"HF_SHAPES": "tiny,small"}, ["hf"]),
    ({"FAMILIES_PRESETS": "tiny-qwen2", "FAMILIES_TOL": "1e-2"}, ["families"]),
    ({"CURVES_MODEL": "qwen3-1.7b"}, ["curves"]),
    ({"CURVES_MODEL": "tiny-moe"}, ["curves"]),
    ({"CURVES_BF16_GRADS": "1", "CURVES_STATES": "int8 bf16", "CURVES_PRE": "20", "CURVES_HF_CAP": "100"}, ["curves"]),
    ({"DRY_GPUS": "2", "ROUTESPEED_MODELS": "qwen3-0.6b", "ROUTESPEED_TOKENS": "8192 4096",
      "ROUTESPEED_RUNTIME_EXTRA": "deterministic: true"}, ["routespeed"]),
    ({"BENCH_MODEL": "qwen3-8b", "BENCH_RUNTIME_EXTRA": "deterministic: true", "BENCH_MAX_GRAD_NORM": "0"}, ["bench"]),
    ({"CLIP_VARIANTS": "spec:1.0: int8:1.0:state_dtype=int8 wait:1.0:speculation_bytes=0"}, ["clip"]),
    ({"MASTERSRC_VARIANTS": "mirror master_host bogus"}, ["mastersrc"]),
    ({"DRY_GPUS": "2", "BIG_GPUS": "2", "BIG_VARIANTS": "clip:1.0", "BIG_RUNTIME_EXTRA": "cast_on: host"}, ["big"]),
    ({"MEMLIMIT_RUNTIME_EXTRA": "policy: auto", "MEMLIMIT_STEPS": "7", "MEMLIMIT_STEADY_FROM": "5"}, ["memlimit"]),
    ({"AP_VARIANTS": "auto peer", "AP_SWEEP": "0", "AP_RUNTIME_EXTRA": "cast_on: host"}, ["autopolicy"]),
    ({"PLAN_TOKENS": "8192", "PLAN_POLICIES": "auto recompute", "PLAN_RUNTIME_EXTRA": "chunk_bytes: auto"}, ["plan"]),
    ({"DRY_GPUS": "2", "SCALING_STRONG": ""}, ["scaling"]),
    ({"DRY_GPUS": "2", "SCALING_STRONG": "32768"}, ["scaling"]),
    ({"STATE_MIRRORS": "none"}, ["state"]),
    ({"KBENCH_QUICK": "1"}, ["kbench"]),
    ({"LONGCTX_MODEL": "qwen3-4b", "LONGCTX_SEQ": "524288", "LONGCTX_LAYERS": "8", "LONGCTX_TILE": "",
      "LONGCTX_CHECKPOINT_DTYPE": "bf16", "LONGCTX_POLICY": "tools/gpu/layouts/x.yaml"}, ["longctx"]),
    ({"LONGCTX_WHAT": "compute peer", "LONGCTX_COMPUTE_LAYERS": "0", "LONGCTX_PEER_SEQS": "32768"}, ["longctx"]),
    ({"LONGCTX_SEQ": "100000"}, ["longctx"]),
    ({"LONGCTX_CP": "2", "DRY_GPUS": "2"}, ["longctx"]),
    ({"LONGCTX_CP": "1"}, ["longctx"]),
    ({"LONGCTX_WHAT": "bogus"}, ["longctx"]),
    ({"MOE_WHAT": "big", "MOE_RUNTIME_EXTRA": "cast_on: host", "MOE_PARAM_SOURCE": "mirror"}, ["moe"]),
    ({"MOEBENCH_TOKENS": "4096", "MOEBENCH_PRESET": "tiny-moe"}, ["moebench"]),
    ({"CP_MODEL": "tiny-moe", "CP_SEQ": "131072", "CP_DETERMINISTIC": "false", "CP_VOCAB": "512",
      "CP_TRAIN_EXTRA": "router_aux_loss_coef: 0.05", "CP_LAYERS": "4"}, ["cp1gpu"]),
    ({"SUITE_DEADLINE": "300"}, ["bench", "scaling"]),
]

# Lines that depend on the machine or the checkout (a bundle, datasets made earlier), not on the command lines.
DROP = re.compile(r"^(=== run_suite |bundle: |libcudnn: |=== part .* \(at |=== part .* done after |"
                  r"DRY  tiny_data |DRY  text_dataset: |DRY  \S+_gpu_test )")


def dry_run(env, parts, tmp):
    """One dry run in fresh folders; its output and the files it wrote (not under out/), normalized."""
    work, out = os.path.join(tmp, "work"), os.path.join(tmp, "out")
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    full = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", ""), "DRY_RUN": "1", "OUT": out,
            "SUITE_WORK": work, "SUITE_DS": os.path.join(work, "ds"), **env}
    r = subprocess.run([sys.executable, os.path.join(HERE, "run_suite.py"), *parts], env=full, cwd=ROOT,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    text = [line for line in r.stdout.splitlines() if not DROP.match(line)] + [f"rc={r.returncode}"]
    for d, _, files in sorted(os.walk(work)):
        for name in sorted(files):
            p = os.path.join(d, name)
            if not os.path.relpath(p, work).startswith("out" + os.sep):
                with open(p, errors="replace") as f:
                    text += [f"## {os.path.relpath(p, work)}"] + f.read().splitlines()
    text = "\n".join(text).replace(work, "<WORK>").replace(out, "<OUT>").replace(ROOT, "<ROOT>")
    text = re.sub(r"^\d{4}-\d\d-\d\dT[\d:]+Z$", "DATE", text, flags=re.M)
    return re.sub(rf"(--threads |OMP_NUM_THREADS=){NPROC}\b", r"\1NPROC", text)


def case_title(env, parts):
    return "# case: " + " ".join([f"{k}={v!r}" for k, v in env.items()] + parts)


def golden_runs(tmp):
    return "\n".join(case_title(env, parts) + "\n" + dry_run(env, parts, tmp) for env, parts in CASES) + "\n"


class TableTest(unittest.TestCase):
    def test_a_recipe_per_part(self):
        names = [p.name for p in suite_parts.PARTS]
        self.assertEqual(len(names), len(set(names)))
        self.assertEqual(sorted(names), sorted(run_suite.recipes()))

    def test_knobs_and_thresholds(self):
        seen = set()
        for p in suite_parts.PARTS:
            for k in p.knobs:
                self.assertNotIn(k.name, seen, f"{k.name} listed twice")
                seen.add(k.name)
                self.assertRegex(k.name, r"^[A-Z][A-Z0-9_]*$")
            for name, t in p.thresholds.items():
                self.assertIsInstance(suite_parts.threshold(p.name, name), float, f"{p.name}.{name}")
            self.assertNotIn("{", p.gate_text(), p.name)  # every {threshold} of the gate is one
        self.assertEqual(suite_parts.threshold("bench", "fsdp2"), suite_parts.report_module().T_FSDP2)
        self.assertEqual(suite_parts.threshold("families", "tol", env={"FAMILIES_TOL": "1e-2"}), 1e-2)
        self.assertEqual(suite_parts.threshold("families", "tol", env={}), 5e-3)

    def test_documented_parts_and_knobs(self):
        """Every part is a row of docs/gpu-suite.md, every knob that doc names is in the table."""
        with open(os.path.join(ROOT, "docs", "gpu-suite.md")) as f:
            doc = f.read()
        for p in suite_parts.PARTS:
            self.assertIn(f"| `{p.name}` |", doc)
        known = {k.name for p in suite_parts.PARTS for k in p.knobs} | {k.name for k in suite_parts.SUITE_KNOBS}
        known |= {t.knob for p in suite_parts.PARTS for t in p.thresholds.values() if t.knob}
        prefixes = tuple(p.name.upper() + "_" for p in suite_parts.PARTS) + (
            "SUITE_", "KERNELS_", "LAYOUTS_", "CURVES_", "DET_", "ROUTES_", "ROUTESPEED_", "BENCH_", "CLIP_", "BIG_",
            "MEMLIMIT_", "AP_", "PLAN_", "SCALING_", "STATE_", "RESTART_", "KBENCH_", "LONGCTX_", "MOE_", "CP_")
        for name in set(re.findall(r"\b([A-Z][A-Z0-9]*_[A-Z0-9_]+)\b", doc)):
            if name.startswith(prefixes) and not name.endswith("_"):
                self.assertIn(name, known, f"docs/gpu-suite.md names {name}, the table does not")

    def test_fmt(self):
        self.assertEqual([suite_parts.fmt(x) for x in (5e-3, 2e-2, 6e-4, 1e-2, 3.5, 5.0, 450, 1.25, 0.95)],
                         ["5e-3", "2e-2", "6e-4", "1e-2", "3.5", "5.0", "450", "1.25", "0.95"])


class KnobTest(unittest.TestCase):
    def suite(self, env, part):
        s = run_suite.Suite(env=env, out="/nonexistent")
        s.part = part
        return s

    def test_values(self):
        s = self.suite({}, "cp1gpu")
        self.assertEqual((s.k("CP_SEQ"), s.k("CP_LAYERS"), s.has("CP_LAYERS")), ("8192", "", False))
        s = self.suite({"CP_SEQ": "131072", "CP_LAYERS": ""}, "cp1gpu")
        self.assertEqual((s.k("CP_SEQ"), s.k("CP_LAYERS")), ("131072", ""))
        self.assertRaises(KeyError, s.k, "LONGCTX_SEQ")  # not this part's
        s = self.suite({"LONGCTX_TILE": ""}, "longctx")  # set but empty is a value (bash ${X-d})
        self.assertEqual(s.k("LONGCTX_TILE"), "")
        self.assertEqual(self.suite({}, "longctx").k("LONGCTX_TILE"), "32768")
        self.assertEqual(self.suite({"LONGCTX_STEPS": ""}, "longctx").k("LONGCTX_STEPS"), "2")  # ${X:-d}

    def test_thresholds(self):
        self.assertEqual(self.suite({}, "families").t("tol"), "5e-3")
        self.assertEqual(self.suite({"FAMILIES_TOL": "1e-2"}, "families").t("tol"), "1e-2")
        self.assertEqual(self.suite({}, "kbench").t("t_layer"), "550")

    def test_shq_like_bash(self):
        words = ["", "a b", "RUNTIME_EXTRA=deterministic: true, x: y", '{"a":1,"b":2}', "~a", "a=~b", "x~", "#a",
                 "a#", "é", "*.py", "$PWD", "it's", "a;b|c&d", "(x)[y]{z}", "--gtest_filter=A*:B?", "a\tb"]
        r = subprocess.run(["bash", "-c", 'printf "%q\\n" "$@"', "_", *words], stdout=subprocess.PIPE, text=True)
        self.assertEqual([run_suite.shq(w) for w in words], r.stdout.splitlines())


class DryRunTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()

    def tearDown(self):
        self.tmp.cleanup()

    def test_golden(self):
        """The command lines, specs and verdict lines of the recorded dry runs."""
        with open(GOLDEN) as f:
            want = f.read().split("\n# case: ")
        got = golden_runs(self.tmp.name).split("\n# case: ")
        self.assertEqual(len(want), len(got))
        for w, g in zip(want, got):
            self.assertEqual(w, g)

    def test_selection(self):
        r = subprocess.run([sys.executable, os.path.join(HERE, "run_suite.py"), "smoke", "bogus"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.assertEqual(r.returncode, 2)
        self.assertIn("unknown part 'bogus'", r.stdout)
        r = subprocess.run(["bash", os.path.join(HERE, "run_suite.sh"), "--help"], stdout=subprocess.PIPE, text=True)
        self.assertEqual(r.returncode, 0)
        for p in suite_parts.PARTS:
            self.assertIn(f"  {p.name} ", r.stdout)
            for k in p.knobs:
                self.assertIn(k.name, r.stdout)
        out = dry_run({}, ["kbench", "smoke"], self.tmp.name)
        self.assertLess(out.index("DRY  bench_kernels"), out.index("DRY  tiny_cuda"))
        self.assertTrue(out.rstrip().endswith("run_suite: kbench DRY RUN\nrun_suite: smoke DRY RUN\nrc=0"))


class FakeRunTest(unittest.TestCase):
    """Not dry: fake binaries on PATH, no bundle (SUITE_BUNDLE=0)."""

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.bin = os.path.join(self.tmp.name, "bin")
        os.makedirs(self.bin)
        self.fake("make_text_dataset", "echo made")

    def tearDown(self):
        self.tmp.cleanup()

    def fake(self, name, body):
        p = os.path.join(self.bin, name)
        with open(p, "w") as f:
            f.write("#!/bin/bash\n" + body + "\n")
        os.chmod(p, 0o755)

    def run_suite(self, *parts, **env):
        out, work = os.path.join(self.tmp.name, "out"), os.path.join(self.tmp.name, "work")
        full = {"PATH": self.bin + ":" + os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", ""),
                "SUITE_BUNDLE": "0", "OUT": out, "SUITE_WORK": work, **env}
        r = subprocess.run([sys.executable, os.path.join(HERE, "run_suite.py"), *parts], env=full, cwd=ROOT,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        with open(os.path.join(out, "summary.txt")) as f:
            return r.returncode, f.read(), r.stdout, out

    def test_smoke_pass_and_fail(self):
        self.fake("slidedp", 'echo "summary: SUCCEEDED after 120 step(s) in 1.0 s, final loss 3.1633, 9 tokens/s"')
        rc, summary, log, out = self.run_suite("smoke")
        self.assertEqual(rc, 0, log)
        self.assertRegex(summary, r"^PASS smoke       tiny example on CUDA: SUCCEEDED, 120 steps, final loss 3.1633 "
                                  r"\(<= 3.5 after 120 steps\)\n")
        self.assertTrue(summary.endswith("run_suite: smoke PASS (1 checks)\n"))
        for name in ("suite.log", "env.txt", "details.tar.gz"):
            self.assertTrue(os.path.isfile(os.path.join(out, name)), name)
        with open(os.path.join(out, "suite.log")) as f:
            self.assertIn("=== tiny_cuda: exit 0 after", f.read())
        self.fake("slidedp", 'echo "summary: SUCCEEDED after 120 step(s) in 1.0 s, final loss 4.2, 9 tokens/s"')
        rc, summary, log, _ = self.run_suite("smoke")
        self.assertEqual(rc, 1, log)
        self.assertIn("run_suite: smoke FAIL (1 of 1 checks)", summary)

    def test_deadline(self):
        """A stage that no longer fits is not started (125) and its check fails."""
        self.fake("slidedp", "exit 0")
        rc, summary, log, _ = self.run_suite("smoke", SUITE_DEADLINE="20")
        self.assertEqual(rc, 1, log)
        self.assertIn("=== tiny_cuda: not started", log)
        self.assertIn("FAIL smoke       tiny example on CUDA: exit 125", summary)

    def test_skip(self):
        rc, summary, log, _ = self.run_suite("scaling")
        self.assertEqual(rc, 0, log)
        self.assertRegex(summary, r"SKIP scaling     needs 2 GPUs \(nvidia-h200-x2\), \d+ visible\n"
                                  r"run_suite: scaling no check ran\n")


def judge(*argv):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = suite_judge.main([str(a) for a in argv])
    return rc, buf.getvalue()


class ChecksTest(unittest.TestCase):
    """The checks that were inline Python, on fake results, with the table's thresholds."""

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.d = self.tmp.name

    def tearDown(self):
        self.tmp.cleanup()

    def jsonl(self, name, rows):
        p = os.path.join(self.d, name)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))
        return p

    def bench_work(self, name, rows):
        """A run_bench.sh WORK folder with ours' metrics."""
        self.jsonl(f"{name}/runs/m/t/g/k/ours/out/metrics-x.jsonl", rows)
        return os.path.join(self.d, name)

    def test_cp1gpu(self):
        one = self.jsonl("one.jsonl", [{"step": s, "loss": 10.0, "grad_norm": 2.0, "tokens_per_s": 1} for s in (1, 2)])
        near = self.jsonl("cp.jsonl", [{"step": s, "loss": 10.01, "grad_norm": 2.02, "tokens_per_s": 1}
                                       for s in (1, 2)])
        args = ("cp1gpu", "--part", "cp1gpu", "--one", one, "--model", "m", "--seq", 8192, "--steps", 2)
        rc, out = judge(*args, "--cp", near)
        self.assertEqual(rc, 0, out)
        self.assertIn("(tol 2e-3)", out)  # the table's
        far = self.jsonl("cp2.jsonl", [{"step": s, "loss": 10.05, "grad_norm": 2.0, "tokens_per_s": 1} for s in (1, 2)])
        rc, out = judge(*args, "--cp", far)
        self.assertEqual(rc, 1, out)
        self.assertTrue(out.startswith("FAIL cp1gpu      m, 2 x 8192 tokens/step"), out)
        rc, out = judge(*args, "--cp", far, "--loss-tol", 1e-2)  # the command line wins over the table
        self.assertEqual(rc, 0, out)

    def test_memlimit(self):
        w = os.path.join(self.d, "ml")
        for name, tps, peak in (("free", 100.0, 50 * 2**30), ("limited", 95.0, 39 * 2**30)):
            self.jsonl(f"ml/{name}/runs/m/t/g/k/ours/out/metrics-x.jsonl",
                       [{"step": s, "tokens_per_s": tps, "gpu_peak_bytes": peak} for s in (1, 2, 3)])
        args = ("memlimit", "--part", "memlimit", "--work", w, "--model", "m", "--tokens", 65536, "--limit", "40GiB",
                "--steady-from", 2)
        rc, out = judge(*args)
        self.assertEqual(rc, 0, out)
        self.assertIn("limited / unlimited speed 0.950 (>= 0.9)", out)
        rc, out = judge(*args, "--speed", 0.96)
        self.assertEqual(rc, 1, out)

    def test_layeradam_states(self):
        for st, rate in (("fp32", 1.0), ("bf16", 1.3), ("int8", 1.6)):
            with open(os.path.join(self.d, f"layeradam_{st}_none.log"), "w") as f:
                f.write("noise\n" + json.dumps({"adam_Gparam_per_s": rate, "layeradam_gbps": 1, "layeradam_bytes_per_param":
                                                1, "triad_gbps": 1, "ratio_to_triad": 1, "isa": "avx512", "threads": 2,
                                                "hot_path_page_faults": 0}) + "\n")
        rc, out = judge("layeradam-states", "--part", "state", "--dir", self.d, "--mirrors", "none")
        self.assertEqual(rc, 0, out)
        self.assertIn("PASS state       LayerAdam int8 / fp32 moments, mirror none: 1.60x params/s (>= 1.5)", out)
        rc, out = judge("layeradam-states", "--part", "state", "--dir", self.d, "--mirrors", "none stream")
        self.assertEqual(rc, 1, out)  # no stream results

    def test_parity_and_final_loss(self):
        cuda = self.jsonl("c.jsonl", [{"step": 1, "grad_norm": 1.0, "loss": 2.0}, {"step": 2, "grad_norm": 1.01,
                                                                                    "loss": 1.995}])
        cpu = self.jsonl("p.jsonl", [{"step": 1, "grad_norm": 1.0, "loss": 2.0}, {"step": 2, "grad_norm": 1.0,
                                                                                   "loss": 2.0}])
        rc, out = judge("grad-parity", "--part", "families", "--cuda", cuda, "--cpu", cpu, "--what", "tiny-qwen2")
        self.assertEqual(rc, 0, out)
        self.assertIn("worst rel 0.01 (<= 0.02)", out)
        rc, out = judge("final-loss", "--part", "curves", "--a", cuda, "--b", cpu, "--state", "int8")
        self.assertEqual(rc, 0, out)
        self.assertIn("0.250% (<= 0.5%)", out)
        far = self.jsonl("f.jsonl", [{"step": 2, "loss": 1.98}])
        rc, out = judge("final-loss", "--part", "curves", "--a", far, "--b", cpu, "--state", "int8")
        self.assertEqual(rc, 1, out)

    def test_specbits_policy(self):
        a = self.bench_work("auto", [{"step": s, "loss": 1.0 + s, "speculated_fraction": 1.0} for s in range(1, 7)])
        b = self.bench_work("wait", [{"step": s, "loss": 1.0 + s} for s in range(1, 7)])
        rc, out = judge("specbits", "--part", "specbits", "--auto", a, "--wait", b, "--norm", "1e4")
        self.assertEqual(rc, 0, out)
        self.assertIn("bitwise equal", out)
        self.bench_work("recompute", [{"step": s, "loss": 1.0 + s} for s in range(1, 7)])
        self.bench_work("mixed", [{"step": s, "loss": 1.0 + s + 5e-5} for s in range(1, 7)])
        rc, out = judge("policy", "--part", "policy", "--work", self.d)
        self.assertEqual(rc, 0, out)
        self.assertIn("(<= 1e-4)", out)
        rc, out = judge("policy", "--part", "policy", "--work", self.d, "--loss-tol", 1e-5)
        self.assertEqual(rc, 1, out)

    def test_missing_threshold(self):
        """A threshold neither given nor in the table for that part is an error, not a silent default."""
        with contextlib.redirect_stderr(io.StringIO()):
            self.assertRaises(SystemExit, judge, "policy", "--part", "smoke", "--work", self.d)


if __name__ == "__main__":
    if sys.argv[1:] == ["--update-golden"]:
        with tempfile.TemporaryDirectory() as tmp:
            text = golden_runs(tmp)
        with open(GOLDEN, "w") as f:
            f.write(text)
        print(f"wrote {GOLDEN}: {len(CASES)} cases, {len(text.splitlines())} lines")
        sys.exit(0)
    unittest.main()
