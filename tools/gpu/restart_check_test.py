#!/usr/bin/env python3
"""restart_check.py's verdicts on made-up files: a resume from shared memory with bitwise losses
passes; a checkpoint resume, a failed job, a different loss or a missing last step fails."""
import json
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))


def write_jsonl(path, losses):
    with open(path, "w") as f:
        for step, loss in losses.items():
            f.write(json.dumps({"step": step, "loss": loss}) + "\n")


class RestartCheck(unittest.TestCase):
    def run_check(self, ref, resumed, status, steps=4):
        with tempfile.TemporaryDirectory() as d:
            write_jsonl(f"{d}/ref.jsonl", ref)
            write_jsonl(f"{d}/res.jsonl", resumed)
            with open(f"{d}/status.txt", "w") as f:
                f.write(status)
            out = subprocess.run(
                [sys.executable, f"{HERE}/restart_check.py", "--ref", f"{d}/ref.jsonl", "--resumed", f"{d}/res.jsonl",
                 "--status", f"{d}/status.txt", "--killed-after", "2", "--seconds-to-next-step", "1.5",
                 "--steps", str(steps), "--what", "m"],
                capture_output=True, text=True, check=True).stdout
        return [line.split()[0] for line in out.splitlines()]

    ref = {1: 5.0, 2: 4.5, 3: 4.25, 4: 4.0}
    shm = "job crashed: succeeded, step 4/4, loss 12.4414\ninterrupted by 1 hostd restart(s); resumed from shared memory at step 2\n"

    def test_shm_resume_bitwise_passes(self):
        self.assertEqual(self.run_check(self.ref, self.ref, self.shm), ["PASS", "PASS", "INFO"])

    def test_checkpoint_resume_or_failed_job_fails_the_first_check(self):
        ckpt = self.shm.replace("shared memory at step 2", "checkpoint /x/checkpoint-2 (why)")
        self.assertEqual(self.run_check(self.ref, self.ref, ckpt)[0], "FAIL")
        self.assertEqual(self.run_check(self.ref, self.ref, self.shm.replace("succeeded", "failed"))[0], "FAIL")

    def test_other_loss_or_missing_last_step_fails_the_second(self):
        other = dict(self.ref)
        other[3] = 4.2500001
        self.assertEqual(self.run_check(self.ref, other, self.shm)[1], "FAIL")
        short = {k: v for k, v in self.ref.items() if k < 4}
        self.assertEqual(self.run_check(self.ref, short, self.shm)[1], "FAIL")


if __name__ == "__main__":
    unittest.main()
