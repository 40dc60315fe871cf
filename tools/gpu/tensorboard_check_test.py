#!/usr/bin/env python3
"""tensorboard_check.py's comparison on made-up scalars (no `tensorboard` package needed): equal
float32 values pass; a missing, extra or different step, an unknown tag and an empty file fail;
NaN (JSON null) matches NaN; the last record of a step run twice counts."""
import json
import math
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tensorboard_check as tc  # noqa: E402


def events_of(records):
    """What the writer would have written for `records`."""
    out = {}
    for step, r in records.items():
        for tag, (key, scale) in tc.TAGS.items():
            if key in r:
                out.setdefault(tag, {})[step] = tc.f32(None if r[key] is None else r[key] * scale)
    return out


RECORDS = {s: {"step": s, "loss": 3.0 / s, "lr": 1e-4 * s, "grad_norm": 0.1 + s, "tokens_per_s": 1234.5,
               "model_tflops": 0.3, "step_time_s": 0.25, "host_state_bytes": 3 << 28, "gpu_peak_bytes": 0,
               "skipped": False} for s in range(1, 6)}


class Compare(unittest.TestCase):
    def verdicts(self, events, records=RECORDS):
        return [ok for ok, _ in tc.compare(events, records)]

    def test_equal_float32_values_pass(self):
        v = self.verdicts(events_of(RECORDS))
        self.assertTrue(all(v))
        self.assertEqual(len(v), 1 + 8)  # the tag check, then the 8 tags this record has

    def test_a_double_that_is_not_float32_fails(self):
        ev = events_of(RECORDS)
        ev["train/loss"][2] = 3.0 / 2 + 1e-3
        self.assertFalse(all(self.verdicts(ev)))

    def test_missing_and_extra_steps_fail(self):
        ev = events_of(RECORDS)
        del ev["train/lr"][3]
        self.assertFalse(all(self.verdicts(ev)))
        ev = events_of(RECORDS)
        ev["train/lr"][6] = 1.0
        self.assertFalse(all(self.verdicts(ev)))

    def test_unknown_tag_and_nothing_to_compare_fail(self):
        ev = events_of(RECORDS)
        ev["train/other"] = {1: 1.0}
        self.assertFalse(self.verdicts(ev)[0])
        self.assertFalse(all(self.verdicts({}, {})))

    def test_null_loss_matches_nan_and_eval_loss_is_compared_where_present(self):
        recs = {s: dict(r) for s, r in RECORDS.items()}
        recs[2]["loss"] = None
        recs[5]["eval_loss"] = 2.5
        ev = events_of(recs)
        self.assertTrue(math.isnan(ev["train/loss"][2]))
        self.assertTrue(all(self.verdicts(ev, recs)))
        del ev["eval/loss"]
        self.assertFalse(all(self.verdicts(ev, recs)))

    def test_read_metrics_keeps_the_last_record_of_a_step(self):
        with tempfile.TemporaryDirectory() as d:
            path = f"{d}/m.jsonl"
            with open(path, "w") as f:
                for rec in [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.0}, {"step": 2, "loss": 1.5}]:
                    f.write(json.dumps(rec) + "\n")
            self.assertEqual(tc.read_metrics(path)[2]["loss"], 1.5)
            with open(path, "a") as f:
                f.write("{oops\n")
            with self.assertRaises(ValueError):
                tc.read_metrics(path)


if __name__ == "__main__":
    unittest.main()
