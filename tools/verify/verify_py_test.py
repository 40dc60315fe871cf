#!/usr/bin/env python3
"""Tests of the torch-free parts of the HF comparison scripts (runs with a bare python3):
segment chunking, the LR schedule formula, config fix-ups, curve loading and comparison, the
batches file reader, and (with SLIDEDP_DUMP_BATCHES=path/to/dump_batches) that dump_batches'
batches equal a pure-Python port of the sampler and micro-batch builder on a dataset written here
in the documented format (docs/dataset-format.md).

  python3 tools/verify/verify_py_test.py [-v]
"""
import json
import math
import os
import random
import struct
import subprocess
import sys
import tempfile
import unittest
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare_curves  # noqa: E402
import compare_params  # noqa: E402
import grad_diff  # noqa: E402
import hf_common  # noqa: E402
import hf_compare  # noqa: E402
import hf_train_reference  # noqa: E402


def write_dataset(d, docs, masks, seq_len, vocab):
    """A packed dataset per docs/dataset-format.md (pure Python writer for the test)."""
    os.makedirs(d)
    tokens, mask, doc_off, row_off = [], [], [0], [0]
    row_start = 0
    for doc, m in zip(docs, masks):
        if len(tokens) - row_start + len(doc) > seq_len and len(tokens) > row_start:
            row_off.append(len(tokens))
            row_start = len(tokens)
        for i in range(len(doc)):
            tokens.append(doc[i])
            mask.append(m[i])
            if len(tokens) - row_start == seq_len:
                row_off.append(len(tokens))
                row_start = len(tokens)
        doc_off.append(len(tokens))
    if row_off[-1] != len(tokens):
        row_off.append(len(tokens))
    files = [("tokens.bin", struct.pack(f"<{len(tokens)}I", *tokens)), ("loss_mask.bin", bytes(mask)),
             ("doc_offsets.bin", struct.pack(f"<{len(doc_off)}Q", *doc_off)),
             ("row_offsets.bin", struct.pack(f"<{len(row_off)}Q", *row_off))]
    for name, data in files:
        with open(os.path.join(d, name), "wb") as f:
            f.write(data)
    manifest = {"format": "slidedp-dataset", "version": 1, "token_dtype": "uint32", "vocab_size": vocab,
                "seq_len": seq_len, "packing": "packed", "num_tokens": len(tokens), "num_documents": len(docs),
                "num_rows": len(row_off) - 1, "num_trained_tokens": sum(mask), "truncated_documents": 0,
                "split_documents": sum(1 for doc in docs if len(doc) > seq_len),
                "files": [{"name": n, "bytes": len(b), "crc32": zlib.crc32(b)} for n, b in files], "metadata": {}}
    with open(os.path.join(d, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    return len(row_off) - 1


class PurePython(unittest.TestCase):
    def test_chunks_cover_every_segment_within_budget(self):
        rng = random.Random(0)
        for _ in range(50):
            lens = [rng.randint(1, 300) for _ in range(rng.randint(1, 40))]
            budget = rng.choice([64, 256, 1000, 4096])
            chunks = hf_common.chunk_segments(lens, budget)
            self.assertEqual(sorted(i for c in chunks for i in c), list(range(len(lens))))
            for c in chunks:
                width = max(lens[i] for i in c)
                self.assertTrue(len(c) == 1 or width * len(c) <= budget, (c, budget))

    def test_lr_multiplier_matches_schedule_h(self):
        f = hf_common.lr_multiplier
        self.assertEqual(f(0, "cosine", 10, 100, 1e-3, 0), 0.0)
        self.assertAlmostEqual(f(5, "cosine", 10, 100, 1e-3, 0), 0.5)
        self.assertAlmostEqual(f(10, "cosine", 10, 100, 1e-3, 0), 1.0)
        self.assertAlmostEqual(f(55, "cosine", 10, 100, 1e-3, 0), 0.5)
        self.assertAlmostEqual(f(100, "cosine", 10, 100, 1e-3, 1e-4), 0.1)
        self.assertAlmostEqual(f(150, "cosine", 10, 100, 1e-3, 1e-4), 0.1)  # clamped past total
        self.assertAlmostEqual(f(55, "linear", 10, 100, 1e-3, 0), 0.5)
        self.assertAlmostEqual(f(55, "linear", 10, 100, 1e-3, 1e-4), 0.1 + 0.9 * 0.5)
        self.assertEqual(f(3, "constant", 0, 0, 1e-3, 0), 1.0)
        self.assertEqual(f(3, "constant", 4, 0, 1e-3, 0), 0.75)

    def test_config_fixups(self):
        v5 = {"model_type": "qwen3", "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}, "dtype": "bfloat16"}
        c = hf_common.config_for_our_loader(v5)
        self.assertEqual(c["rope_theta"], 5e5)
        self.assertIsNone(c["rope_scaling"])
        self.assertFalse(c["tie_word_embeddings"])
        v4 = {"model_type": "qwen3", "rope_theta": 1e6, "rope_scaling": None, "tie_word_embeddings": True}
        self.assertEqual(hf_common.config_for_our_loader(v4)["rope_theta"], 1e6)
        self.assertTrue(hf_common.config_for_our_loader(v4)["tie_word_embeddings"])
        echoed = {"rope_scaling": {"rope_type": "default", "rope_theta": 2e6}}
        self.assertEqual(hf_common.config_for_our_loader(echoed)["rope_theta"], 2e6)
        yarn = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 64}
        c = hf_common.config_for_our_loader({"model_type": "qwen3", "rope_parameters": yarn})
        self.assertEqual(c["rope_parameters"], yarn)
        self.assertEqual(c["rope_theta"], 1e6)
        self.assertIsNone(c["rope_scaling"])
        old = hf_common.config_for_our_loader({"rope_theta": 1e6, "rope_scaling": {"type": "linear", "factor": 2}})
        self.assertEqual(old["rope_scaling"], {"type": "linear", "factor": 2})
        with self.assertRaises(ValueError):
            hf_common.config_for_our_loader({"rope_theta": 1e6, "rope_scaling": {"rope_type": "longrope", "factor": 4}})
        with self.assertRaises(ValueError):
            hf_common.config_for_our_loader({"model_type": "qwen3"})

    def test_segments_from_rows_and_make_rows(self):
        segs = hf_common.segments_from_rows([[1, 2, 3, 4, 5]], [[2, 3]])
        self.assertEqual(segs, [([1, 2], [2, -100]), ([3, 4, 5], [4, 5, -100])])
        rows, lens = hf_compare.make_rows(4, 300, 1000, random.Random(3))
        self.assertEqual([sum(l) for l in lens], [300] * 4)
        self.assertIn(1, lens[1])
        self.assertIn(2, lens[1])
        self.assertTrue(all(0 <= t < 1000 for r in rows for t in r))

    def test_curves(self):
        with tempfile.TemporaryDirectory() as d:
            ours = os.path.join(d, "metrics-j.jsonl")
            with open(ours, "w") as f:
                for s in range(1, 6):
                    f.write(json.dumps({"step": s, "loss": 5.0 - 0.1 * s, "lr": 1e-3}) + "\n")
                f.write(json.dumps({"step": 3, "loss": 4.7003}) + "\n")  # a restart repeats step 3
            ref = os.path.join(d, "hf.json")
            with open(ref, "w") as f:
                json.dump({"format": "slidedp-hf-curve", "curve": [{"step": s, "loss": 5.0 - 0.1 * s}
                                                                  for s in range(1, 6)]}, f)
            a, b = hf_common.load_curve(ours), hf_common.load_curve(ref)
            self.assertEqual(a[3], 4.7003)
            r = compare_curves.compare(a, b, steps=5)
            self.assertAlmostEqual(r["max_abs_diff"], 3e-4)
            self.assertEqual(r["max_at_step"], 3)
            self.assertEqual(r["worst_steps"][0][0], 3)
            self.assertEqual(len(r["worst_steps"]), 5)
            with self.assertRaises(ValueError):
                compare_curves.compare(a, b, steps=6)
            script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compare_curves.py")
            self.assertEqual(subprocess.run([sys.executable, script, ours, ref], capture_output=True).returncode, 0)
            # A reference run with --probe-fp32: the worst step shown with its batch's sensitivity.
            probed = os.path.join(d, "hf-probed.json")
            with open(probed, "w") as f:
                json.dump({"format": "slidedp-hf-curve", "curve": [
                    {"step": s, "loss": 5.0 - 0.1 * s, "loss_fp32_probe": 5.0 - 0.1 * s + 1e-4 * s}
                    for s in range(1, 6)]}, f)
            self.assertEqual(hf_common.load_probe(ref), {})
            rows, median = compare_curves.sensitivity(a, b, b, hf_common.load_probe(probed), top=2)
            self.assertEqual(rows[0][0], 3)
            self.assertAlmostEqual(rows[0][2], 3e-4)
            self.assertAlmostEqual(median, 3e-4)
            out = subprocess.run([sys.executable, script, ours, probed], capture_output=True, text=True)
            self.assertIn("step 3: 3.00e-04 vs 3.00e-04", out.stdout)
            self.assertEqual(subprocess.run([sys.executable, script, ours, ref, "--tol", "1e-4"],
                                            capture_output=True).returncode, 1)

    def test_unit_gaps(self):
        with tempfile.TemporaryDirectory() as d:
            # Ours: the worker's log lines (glog prefix, units in any order); the reference's JSON.
            log = os.path.join(d, "worker.log")
            with open(log, "w") as f:
                for s in range(1, 4):
                    for u in (2, 0, 1):
                        sq = 49.0 if (s, u) == (2, 1) else 1.0 + u
                        f.write(f"I1201 12:00:00.1 77 cuda_gradient_path.cc:186] unit norms: step {s} unit {u} "
                                f"squares {sq!r}\n")
                f.write("I1201 unit norms: step 4 unit 1 squares 2\n")  # step 4 lacks units 0, 2: skipped
            ref = os.path.join(d, "hf.json")
            with open(ref, "w") as f:
                json.dump({"format": "slidedp-hf-curve", "curve": [
                    {"step": s, "loss": 5.0, "unit_squares": [1.0, 2.0, 3.0]} for s in range(1, 4)]}, f)
            a, b = compare_curves.load_unit_squares(log), compare_curves.load_unit_squares(ref)
            self.assertEqual(sorted(a), [1, 2, 3])
            self.assertEqual(a[2], [1.0, 49.0, 3.0])
            rows = compare_curves.unit_gaps(a, b, top_steps=1, top_units=2)
            self.assertEqual(len(rows), 1)
            step, na, nb, units = rows[0]
            self.assertEqual(step, 2)
            self.assertAlmostEqual(na, math.sqrt(53.0))
            self.assertAlmostEqual(nb, math.sqrt(6.0))
            self.assertEqual(units[0][0], 1)
            self.assertAlmostEqual(units[0][1], 7.0)
            self.assertAlmostEqual(units[0][2], math.sqrt(2.0))
            curve = os.path.join(d, "metrics.jsonl")
            with open(curve, "w") as f:
                for s in range(1, 4):
                    f.write(json.dumps({"step": s, "loss": 5.0}) + "\n")
            self.assertEqual(compare_curves.load_unit_squares(curve), {})
            script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compare_curves.py")
            out = subprocess.run([sys.executable, script, curve, ref, "--first-units", log],
                                 capture_output=True, text=True)
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertIn("step 2: 7.28/2.449 (unit 1 7/1.414", out.stdout)
            # --bitwise: the first step where two runs differ at all (here step 2, unit 1).
            self.assertIsNone(compare_curves.first_difference({1: 5.0}, {1: 5.0}, a, a))
            d_step, la, lb, units = compare_curves.first_difference({1: 5.0, 2: 5.0, 3: 4.0}, {1: 5.0, 2: 5.0, 3: 4.5}, a, b)
            self.assertEqual((d_step, la, lb), (2, 5.0, 5.0))
            self.assertEqual(units, [(1, 49.0, 2.0)])
            self.assertEqual(compare_curves.first_difference({1: 5.0, 2: 4.0}, {1: 5.0, 2: 4.5})[0], 2)
            out = subprocess.run([sys.executable, script, curve, curve, "--bitwise", "--first-units", log,
                                  "--second-units", log], capture_output=True, text=True)
            self.assertIn("bitwise: equal at all 3 common steps (loss, unit norms)", out.stdout)
            out = subprocess.run([sys.executable, script, curve, ref, "--bitwise", "--first-units", log],
                                 capture_output=True, text=True)
            self.assertIn("bitwise: first difference at step 2: loss 5.0/5.0; 1 units differ: unit 1 49.0/2.0", out.stdout)

    def test_row_report(self):
        self.assertEqual(compare_params.percentile_ranks([3.0, 1.0, 2.0, 2.0]), [0.75, 0.0, 0.25, 0.25])
        drift = [0.01 * r for r in range(100)]  # row r drifted r %
        summary, per_step = compare_params.row_report(drift, {7: [99, 98, 98, 5, 100000, -1], 8: [1, 2, 3]}, top=2)
        self.assertEqual(summary["rows"], 100)
        self.assertAlmostEqual(summary["median"], 0.5)
        self.assertAlmostEqual(summary["p99"], 0.99)
        self.assertEqual(summary["max_row"], 99)
        # step 7: rows 5, 98, 99 (ids outside the table ignored); its median row ranks 0.98
        self.assertEqual(per_step[7]["rows"], 3)
        self.assertAlmostEqual(per_step[7]["median_rank"], 0.98)
        self.assertEqual([r for r, _ in per_step[7]["top"]], [99, 98])
        self.assertAlmostEqual(per_step[8]["median_rank"], 0.02)

    def test_synthetic_batches_roundtrip(self):
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "b.bin")
            hf_train_reference.write_synthetic_batches(p, steps=3, rows=2, seq=64, vocab=100, seed=0)
            bf = hf_common.BatchesFile(p)
            self.assertEqual(len(bf.steps), 3)
            for t in range(3):
                tokens, labels, positions, cu, meta = bf.step(t)
                self.assertEqual(len(tokens), 128)
                segs = hf_common.segments_of(tokens, labels, positions, cu)
                self.assertEqual(sum(len(s[0]) for s in segs), 128)
                self.assertEqual(sum(1 for _, l in segs for x in l if x != -100), meta["trained_tokens"])
            import argparse
            ns = argparse.Namespace(steps=0, **{k: None for k in hf_train_reference.SETTINGS})
            s = hf_train_reference.resolve_settings(ns, bf)
            self.assertEqual((s["steps"], s["total_steps"], s["schedule"], s["lr"]), (3, 3, "cosine", 3e-3))
            ns.lr, ns.steps = 1e-4, 2
            self.assertEqual(hf_train_reference.resolve_settings(ns, bf)["lr"], 1e-4)

    def test_decay_groups_are_hostds(self):
        """optimizer.no_decay: norm weights and biases go to the weight_decay 0 group (hostd's
        names, hostd/update/weight_decay.h); embedding and lm_head are decayed; a job's list and
        --no-decay choose the groups."""
        names = ["model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
                 "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.bias",
                 "model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight",
                 "model.layers.0.post_attention_layernorm.weight", "model.layers.0.mlp.down_proj.weight",
                 "model.norm.weight", "lm_head.weight"]
        named = [(n, n) for n in names]  # the "parameter" is its name here
        exempt = {"model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_proj.bias",
                  "model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight",
                  "model.layers.0.post_attention_layernorm.weight", "model.norm.weight"}
        g = hf_train_reference.decay_groups(named, 0.1, ["norm", "bias"])
        self.assertEqual([x["weight_decay"] for x in g], [0.1, 0.0])
        self.assertEqual(set(g[0]["params"]), set(names) - exempt)
        self.assertEqual(set(g[1]["params"]), exempt)
        g = hf_train_reference.decay_groups(named, 0.1, ["norm"])
        self.assertIn("model.layers.0.self_attn.q_proj.bias", g[0]["params"])
        g = hf_train_reference.decay_groups(named, 0.1, [])
        self.assertEqual(len(g), 1)
        self.assertEqual(g[0]["params"], names)
        self.assertEqual(hf_train_reference.no_decay_list("bias,norm"), ["bias", "norm"])
        self.assertEqual(hf_train_reference.no_decay_list("none"), [])
        with self.assertRaises(Exception):
            hf_train_reference.no_decay_list("norms")
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "b.bin")
            hf_train_reference.write_synthetic_batches(p, steps=2, rows=2, seq=64, vocab=100, seed=0)
            bf = hf_common.BatchesFile(p)
            import argparse
            ns = argparse.Namespace(steps=0, **{k: None for k in hf_train_reference.SETTINGS})
            self.assertEqual(hf_train_reference.resolve_settings(ns, bf)["no_decay"], ["norm", "bias"])
            bf.job["no_decay"] = []
            self.assertEqual(hf_train_reference.resolve_settings(ns, bf)["no_decay"], [])
            ns.no_decay = ["bias"]
            self.assertEqual(hf_train_reference.resolve_settings(ns, bf)["no_decay"], ["bias"])

    def test_sampler_port_is_a_permutation(self):
        for n in (1, 2, 7, 100):
            for e in (0, 1, 5):
                self.assertEqual(sorted(hf_common.epoch_permutation(n, 42, e)), list(range(n)))
        self.assertNotEqual(hf_common.epoch_permutation(50, 1, 0), hf_common.epoch_permutation(50, 1, 1))

    def test_grad_diff_bitwise_differences(self):
        # --repeat's comparison: only tensors whose bytes differ are listed, with how many F32
        # elements differ and by how much, whatever the tensors' order in the two files.
        def write(path, tensors):
            header, blob = {}, b""
            for name, vals in tensors:
                data = struct.pack(f"<{len(vals)}f", *vals)
                header[name] = {"dtype": "F32", "shape": [len(vals)], "data_offsets": [len(blob), len(blob) + len(data)]}
                blob += data
            h = json.dumps(header).encode()
            with open(path, "wb") as f:
                f.write(struct.pack("<Q", len(h)) + h + blob)
        with tempfile.TemporaryDirectory() as d:
            a, b = os.path.join(d, "a.safetensors"), os.path.join(d, "b.safetensors")
            write(a, [("x", [1.0, 2.0, 3.0]), ("y", [0.5, 0.25]), ("loss", [4.0])])
            write(b, [("loss", [4.0]), ("y", [0.5, 0.25]), ("x", [1.0, 2.5, 3.0])])
            self.assertEqual(grad_diff.bitwise_differences(a, a), [])
            self.assertEqual(grad_diff.bitwise_differences(a, b), [("x", 1, 0.5)])
            write(b, [("x", [1.0, 2.0, 3.0])])
            with self.assertRaises(SystemExit):
                grad_diff.bitwise_differences(a, b)


@unittest.skipUnless(os.environ.get("SLIDEDP_DUMP_BATCHES"), "set SLIDEDP_DUMP_BATCHES=path/to/dump_batches")
class DumpBatches(unittest.TestCase):
    def test_dump_equals_python_port(self):
        rng = random.Random(7)
        docs, masks = [], []
        for _ in range(60):
            n = rng.choice([1, 2, 5, 17, 40, 64, 90])
            docs.append([rng.randrange(300) for _ in range(n)])
            masks.append([rng.choice([0, 1, 1, 1]) for _ in range(n)])
        with tempfile.TemporaryDirectory() as d:
            data = os.path.join(d, "data")
            num_rows = write_dataset(data, docs, masks, seq_len=64, vocab=300)
            out = os.path.join(d, "b.bin")
            B, seed, steps = 6, 12345, (2 * num_rows) // 6 + 2  # crosses epoch boundaries
            subprocess.run([os.environ["SLIDEDP_DUMP_BATCHES"], "--data", data, "--global-batch", str(B), "--seed",
                            str(seed), "--steps", str(steps), "--out", out], check=True, capture_output=True)
            bf = hf_common.BatchesFile(out)
            ds = hf_common.read_dataset(data)
            self.assertEqual(bf.header["num_rows"], num_rows)
            for t in range(steps):
                rows = hf_common.global_rows(num_rows, B, seed, t)
                self.assertEqual(bf.steps[t]["rows"], rows, f"step {t}")
                tokens, labels, positions, cu, meta = bf.step(t)
                exp = hf_common.build_microbatch(ds, rows)
                self.assertEqual(([int(x) for x in tokens], [int(x) for x in labels], [int(x) for x in positions],
                                  [int(x) for x in cu]), exp, f"step {t}")
                self.assertEqual(meta["trained_tokens"], sum(1 for x in exp[1] if x != -100))
                hf_common.segments_of(tokens, labels, positions, cu)
                # row_tokens: each row's length, back to back; every row boundary is a piece boundary
                # (what attn_layouts_check splits the workers' micro-batches by)
                row_off = ds[4]
                self.assertEqual(meta["row_tokens"], [int(row_off[r + 1]) - int(row_off[r]) for r in rows])
                ends = [sum(meta["row_tokens"][:i + 1]) for i in range(len(rows))]
                self.assertTrue(set(ends) <= {int(x) for x in cu}, f"step {t}")

    def test_grad_diff_token_batch(self):
        # grad_diff hands a step's global batch to model_grads: one row per document, labels
        # implied (the next token); a batch with masked labels cannot be expressed and is refused.
        rng = random.Random(3)
        docs = [[rng.randrange(300) for _ in range(rng.choice([2, 9, 30, 64]))] for _ in range(40)]
        with tempfile.TemporaryDirectory() as d:
            for masked in (False, True):
                data = os.path.join(d, f"data{int(masked)}")
                masks = [[0 if masked and i == 1 else 1 for i in range(len(doc))] for doc in docs]
                write_dataset(data, docs, masks, seq_len=64, vocab=300)
                out = os.path.join(d, f"b{int(masked)}.bin")
                subprocess.run([os.environ["SLIDEDP_DUMP_BATCHES"], "--data", data, "--global-batch", "4", "--seed",
                                "1", "--steps", "2", "--out", out], check=True, capture_output=True)
                bf = hf_common.BatchesFile(out)
                if masked:
                    with self.assertRaises(SystemExit):
                        grad_diff.token_batch_of(bf, 1)
                    continue
                tok, segments, trained = grad_diff.token_batch_of(bf, 1)
                self.assertEqual(tok["rows"], [t for t, _ in segments])
                self.assertEqual(trained, bf.steps[1]["trained_tokens"])
                self.assertEqual(hf_common.segments_from_rows(tok["rows"], None), segments)


if __name__ == "__main__":
    unittest.main()
