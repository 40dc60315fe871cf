#!/usr/bin/env python3
"""The GPU suite's runner (docs/gpu-suite.md): runs the named parts of the table in
tools/gpu/suite_parts.py, each through its recipe (tools/gpu/suite_recipes*.py), on the GPU machine
with the bundle in .gpu/ (tools/gpu/bundle.sh), from the repository root:

    tools/gpu/run_suite.py PART [PART...]     run the parts in order (one call: mind the minutes)
    tools/gpu/run_suite.py [--help|-h|list]    the parts, their knobs and thresholds
    DRY_RUN=1 tools/gpu/run_suite.py PART      print the commands, run nothing (no bundle needed)

tools/gpu/run_suite.sh is the same command. Output: $OUT/summary.txt (one line per check: PASS /
FAIL / INFO / SKIP, the figure and its threshold), $OUT/suite.log (everything printed), $OUT/env.txt
and $OUT/details.tar.gz (each part's logs and result files, rewritten after every part). Exit status
0 when no check failed, 1 otherwise, 2 for usage. Python 3.11 standard library only.
"""
import datetime
import glob
import os
import re
import shutil
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import suite_parts  # noqa: E402
from suite_parts import PARTS, SUITE_KNOBS, fmt  # noqa: E402

# Real text for the fine-tuning regime: the Python standard library's sources (the first 3,000 files
# over 200 bytes, sorted) tokenized with the Qwen3 tokenizer (TOK), packed into rows of 1,024 tokens
# in DS/train; DS/.ready marks it made, so later parts and calls on a warm machine share it.
TEXT_DATASET = """python3 - <<PY
import glob, json
with open("/tmp/corpus.jsonl", "w") as f:
    for p in sorted(glob.glob("/usr/lib/python3*/**/*.py", recursive=True))[:3000]:
        try: t = open(p, encoding="utf-8").read()
        except Exception: continue
        if len(t) > 200: f.write(json.dumps({"text": t}) + "\\n")
PY
slidedp prepare --model "$TOK" --input /tmp/corpus.jsonl --output "$DS" --seq-len 1024 --pack --overwrite && touch "$DS/.ready"
"""
_BS = set("\t\n !\"$&'()*,;<>?[\\]^`{|}")


def shq(s):
    """bash's printf %q of one argument (what the dry run prints, as run_suite.sh printed it)."""
    s = str(s)
    if s == "":
        return "''"
    if any(ord(c) < 32 and c not in "\t\n" or ord(c) == 127 for c in s) or "\t" in s or "\n" in s:
        return "$'" + s.encode("unicode_escape").decode().replace("'", "\\'") + "'"
    out = []
    for i, c in enumerate(s):
        if c in _BS or (c == "#" and i == 0) or (c == "~" and (i == 0 or s[i - 1] in ":=")):
            out.append("\\")
        out.append(c)
    return "".join(out)


class Suite:
    """One call of the suite: the knobs, the clock, the summary, and what a recipe runs through
    (stage, judge, check, result); `part`/`part_dir` are the running part's."""

    def __init__(self, env=None, out=None):
        self.env = os.environ if env is None else env
        self.t0 = time.monotonic()
        self.dry = self.env.get("DRY_RUN", "0") == "1"
        self.deadline = int(self.suite_knob("SUITE_DEADLINE"))
        self.work = self.suite_knob("SUITE_WORK")
        self.out = out or self.suite_knob("OUT")
        self.summary = os.path.join(self.out, "summary.txt")
        self.gpus = 1
        self.part = self.part_dir = None
        self.root = os.getcwd()

    # ---------------------------------------------------------------------------- knobs, clock
    def suite_knob(self, name):
        k = next(k for k in SUITE_KNOBS if k.name == name)
        return self.env.get(name) or k.default

    def k(self, name):
        """The running part's knob: the environment's value, else the table's default ("" for None)."""
        kn = suite_parts.knob(self.part, name)
        if kn.empty_ok and name in self.env:
            return self.env[name]
        return self.env.get(name) or (kn.default or "")

    def has(self, name):
        """Whether the knob is set and not empty (bash's ${X:+...})."""
        suite_parts.knob(self.part, name)
        return bool(self.env.get(name))

    def t(self, name):
        """The running part's threshold as a command line writes it (its knob's text when set)."""
        th = suite_parts.part(self.part).thresholds[name]
        if th.knob and self.env.get(th.knob):
            return self.env[th.knob]
        return fmt(th.value)

    def seconds(self):
        """Seconds since the start (bash's $SECONDS); a dry run's clock stands still at 0, so that its
        caps and budgets are the same on every machine."""
        return 0 if self.dry else int(time.monotonic() - self.t0)

    def left(self):
        """Seconds before SUITE_DEADLINE (a stage cap of "all that is left")."""
        return self.deadline - self.seconds()

    # ---------------------------------------------------------------------------- output
    def say(self, text):
        print(text, flush=True)

    def note(self, text):
        """A dry run's line: what a part would do where it has no single command to print."""
        if self.dry:
            self.say(f"DRY  {text}")

    def summary_lines(self, text):
        text = text if text.endswith("\n") or not text else text + "\n"
        sys.stdout.write(text)
        sys.stdout.flush()
        with open(self.summary, "a") as f:
            f.write(text)

    def result(self, status, text, part=None):
        self.summary_lines(f"{status:<4} {part or self.part:<11} {text}")

    # ---------------------------------------------------------------------------- running
    def stage(self, name, cap, *argv, env=None):
        """Runs argv with a time cap cut to what is left before SUITE_DEADLINE, output in
        part_dir/NAME.log. Returns its exit status (124: the cap), 125 when no time was left."""
        argv = [str(a) for a in argv]
        if env:  # as `env K=V ... CMD`
            argv = ["env"] + [f"{k}={v}" for k, v in env.items()] + argv
        log = os.path.join(self.part_dir, f"{name}.log")
        if self.dry:
            self.say(f"DRY  {name:<18} cap {cap:>4}s:" + "".join(" " + shq(a) for a in argv))
            return 0
        left = self.left() - 10
        if left < 15:
            line = f"=== {name}: not started, {left} s left before SUITE_DEADLINE"
            self.say(line)
            with open(log, "w") as f:
                f.write(line + "\n")
            return 125
        cap = min(int(cap), left)
        with open(log, "w") as f:
            f.write(f"=== {name} (cap {cap} s): {' '.join(argv)}\n")
        t0 = self.seconds()
        with open(log, "a") as f:
            rc = subprocess.call(["timeout", "--kill-after=15", str(cap)] + argv, stdout=f, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL)
        line = f"=== {name}: exit {rc} after {self.seconds() - t0} s" + (" (time cap)" if rc == 124 else "")
        self.say(line)
        with open(log, "a") as f:
            f.write(line + "\n")
        return rc

    def run_bench(self, name, cap=None, budget_margin=20, budget=None, **env):
        """A stage of bench/e2e/run_bench.sh (capped at what is left) with env in order, then BUDGET_S
        (what is left less budget_margin, unless given)."""
        cap = self.left() if cap is None else cap
        budget = self.left() - budget_margin if budget is None else budget
        return self.stage(name, cap, "bash", "bench/e2e/run_bench.sh", env={**env, "BUDGET_S": budget})

    def judge(self, check, *args):
        """A verdict of tools/gpu/suite_judge.py CHECK --part PART (its lines go to the summary)."""
        args = [str(a) for a in args]
        if self.dry:
            self.say(f"DRY  judge {check} {' '.join(args)}".rstrip())
            return
        self.check("tools/gpu/suite_judge.py", check, "--part", self.part, *args, _dry_word=None)

    def check(self, script, *args, _dry_word="check"):
        """A checker script whose stdout is summary lines (clip_check.py, routes_check.py, ...)."""
        args = [str(a) for a in args]
        if self.dry:
            self.say(f"DRY  {_dry_word} {script} {' '.join(args)}".rstrip())
            return
        r = subprocess.run([sys.executable, script, *args], stdout=subprocess.PIPE, text=True)
        self.summary_lines(r.stdout)

    def judge_exit(self, what, rc, gate=None):
        """PASS when the stage exited 0."""
        if self.dry:
            return
        gate = gate or "must exit 0"
        if rc == 0:
            self.result("PASS", f"{what}: exit 0 ({gate})")
        else:
            self.result("FAIL", f"{what}: exit {rc} ({gate}; see details.tar.gz: {self.part}/)")

    def sh(self, argv, out_file=None, append=False, env=None, timeout=None):
        """A command outside any stage (no cap, no log of its own); output into out_file."""
        if self.dry:
            return 0
        full_env = None if env is None else {**os.environ, **env}
        if out_file is None:
            return subprocess.call(argv, env=full_env, timeout=timeout)
        with open(out_file, "a" if append else "w") as f:
            try:
                return subprocess.call(argv, stdout=f, stderr=subprocess.STDOUT, env=full_env, timeout=timeout)
            except subprocess.TimeoutExpired:
                return 124

    # ---------------------------------------------------------------------------- files
    def new_dir(self, path):
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path, exist_ok=True)

    def write(self, path, text):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)

    def copy_metrics(self, pattern, dest):
        """Our metrics JSONL (hostd's output.dir/metrics-*.jsonl) into dest ("" when none)."""
        if self.dry:
            return
        text = ""
        for p in sorted(glob.glob(pattern)):
            with open(p, errors="replace") as f:
                text += f.read()
        with open(dest, "w") as f:
            f.write(text)

    def copy_globs(self, pattern, dest_dir):
        os.makedirs(dest_dir, exist_ok=True)
        for p in glob.glob(pattern):
            if os.path.isfile(p):
                shutil.copy(p, dest_dir)

    def find_cudnn(self):
        """libcudnn.so.9 for the CUDA backend: the system's, else PyTorch's pip package (suite_lib.sh)."""
        env = os.environ
        has = subprocess.run("ldconfig -p 2>/dev/null | grep -q libcudnn.so.9", shell=True).returncode == 0
        if not has and not env.get("SLIDEDP_CUDNN_LIB"):
            r = subprocess.run([sys.executable, "-c", "import nvidia.cudnn, os; "
                                "print(os.path.dirname(nvidia.cudnn.__file__))"], capture_output=True, text=True)
            d = r.stdout.strip() + "/lib"
            if r.returncode == 0 and os.path.isdir(d):
                env["SLIDEDP_CUDNN_LIB"] = d
                env["LD_LIBRARY_PATH"] = d + ":" + env.get("LD_LIBRARY_PATH", "")
        self.say(f"libcudnn: {env.get('SLIDEDP_CUDNN_LIB') or 'system'}")

    def text_dataset(self):
        """The Python sources tokenized into SUITE_DS/train, once per machine (suite_lib.sh's)."""
        ds, tok = os.environ.get("SUITE_DS") or "/tmp/ds", os.environ.get("SUITE_TOKENIZER") or \
            "tests/data/tokenizer/qwen3"
        if os.path.isfile(f"{ds}/.ready"):
            return
        if self.dry:
            self.say(f"DRY  text_dataset: the Python standard library's sources -> slidedp prepare ({tok}) -> {ds}/train")
            return
        self.stage("text_dataset", 90, "bash", "-c", TEXT_DATASET, env={"DS": ds, "TOK": tok})

    def pack_details(self):
        """The parts' result files, small ones only (the device tool returns <= 16 MiB a file)."""
        if self.dry:
            return
        subprocess.run(f'cd "{self.work}/out" && find . -type f -size -4M -print0 | tar --null -czf '
                       f'"{self.out}/details.tar.gz.tmp" -T - && mv "{self.out}/details.tar.gz.tmp" '
                       f'"{self.out}/details.tar.gz"', shell=True, stderr=subprocess.DEVNULL)


# ------------------------------------------------------------------------------------------ calls

def recipes():
    import suite_recipes
    import suite_recipes_runs
    return {**suite_recipes.RECIPES, **suite_recipes_runs.RECIPES}


def usage():
    lines = [__doc__.strip(), "", "Parts (minutes on 1x H200; what runs; what it is held to; knobs = defaults):"]
    for p in PARTS:
        need = f" [{p.gpus} GPUs]" if p.gpus > 1 else ""
        lines.append(f"  {p.name:<11} ~{p.minutes} min{need}: {p.runs}")
        lines.append(f"  {'':<11} gate: {p.gate_text()}" + (f"; against {p.peer}" if p.peer else ""))
        for k in p.knobs:
            lines.append(f"  {'':<12}{k.name}={k.default if k.default is not None else '(see text)'}"
                         + (f"  {k.doc}" if k.doc else ""))
        for name, t in p.thresholds.items():
            src = " (bench/e2e/report.py " + t.name + ")" if isinstance(t, suite_parts.Report) else ""
            lines.append(f"  {'':<12}threshold {name} = {fmt(t.value)}{src}" + (f" [{t.knob}]" if t.knob else "")
                         + (f"  {t.doc}" if t.doc else ""))
    lines += ["", "Suite knobs (environment):"]
    lines += [f"  {k.name}={k.default}  {k.doc}" for k in SUITE_KNOBS]
    return "\n".join(lines)


def bundle_env():
    """suite_lib.sh's environment: unpacks the bundle once, the CUDA environment and PATH."""
    r = subprocess.run(["bash", "-c", "source tools/gpu/suite_lib.sh >&2 && env -0"], stdout=subprocess.PIPE)
    for item in r.stdout.split(b"\0"):
        k, sep, v = item.decode(errors="replace").partition("=")
        if sep and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
            os.environ[k] = v


def tee_output(path):
    """Everything printed from here on (ours and every child's) also into path, as `exec > >(tee)`."""
    tee = subprocess.Popen(["tee", path], stdin=subprocess.PIPE)
    os.dup2(tee.stdin.fileno(), 1)
    os.dup2(tee.stdin.fileno(), 2)
    return tee


def header(s, parts):
    lines = [f"=== run_suite {' '.join(parts)} at {datetime.datetime.now(datetime.UTC):%Y-%m-%dT%H:%M:%SZ}; "
             f"SUITE_DEADLINE={s.deadline} s" + (", DRY_RUN" if s.dry else "")]
    try:
        with open(".gpu/build-info.txt") as f:
            lines.append(f.read().rstrip("\n"))
    except OSError:
        lines.append("bundle: no .gpu/build-info.txt")
    if not s.dry:
        probe = ("[ -n \"$(command -v nvidia-smi)\" ] && nvidia-smi --query-gpu=name,memory.total,driver_version "
                 "--format=csv,noheader | sort | uniq -c; echo \"host: $(nproc) cores, $(free -g | awk '/Mem:/ "
                 "{print $2}') GiB, /tmp $(df -h /tmp | awk 'NR == 2 {print $4}') free\"; python3 -c 'import torch, "
                 "transformers; print(\"torch\", torch.__version__, \"transformers\", transformers.__version__)' "
                 "2>&1 | tail -n 1")
        lines.append(subprocess.run(["bash", "-c", probe], stdout=subprocess.PIPE, text=True).stdout.rstrip("\n"))
    text = "\n".join(lines)
    s.say(text)
    with open(os.path.join(s.out, "env.txt"), "w") as f:
        f.write(text + "\n")


def count_gpus(s):
    if s.dry:
        return int(s.env.get("DRY_GPUS") or 1)
    if not shutil.which("nvidia-smi"):
        return 1
    r = subprocess.run(["nvidia-smi", "-L"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    return sum(1 for line in r.stdout.splitlines() if line.startswith("GPU"))


def verdicts(s, parts):
    """One line per part from the summary: FAIL if any of its checks failed. Returns the exit status."""
    s.say(f"=== summary ({s.summary})")
    with open(s.summary) as f:
        text = f.read()
    sys.stdout.write(text)
    status = 0
    for p in parts:
        n_fail = len(re.findall(rf"^FAIL {re.escape(p)} ", text, re.M))
        n_pass = len(re.findall(rf"^PASS {re.escape(p)} ", text, re.M))
        if n_fail:
            verdict, status = f"FAIL ({n_fail} of {n_fail + n_pass} checks)", 1
        elif n_pass:
            verdict = f"PASS ({n_pass} checks)"
        else:
            verdict = "DRY RUN" if s.dry else "no check ran"
        s.summary_lines(f"run_suite: {p} {verdict}")
    return status


def main(argv):
    os.chdir(suite_parts.ROOT)
    if not argv or argv[0] in ("--help", "-h", "list"):
        print(usage())
        return 0
    names = [p.name for p in PARTS]
    for p in argv:
        if p not in names:
            print(f"run_suite: unknown part '{p}' (parts: {' '.join(names)})", file=sys.stderr)
            return 2
    s = Suite()
    os.environ["OUT"] = s.out
    shutil.rmtree(os.path.join(s.work, "out"), ignore_errors=True)  # (what this call returns: its own parts)
    os.makedirs(s.out, exist_ok=True)
    os.makedirs(os.path.join(s.work, "out"), exist_ok=True)
    open(s.summary, "w").close()
    tee = tee_output(os.path.join(s.out, "suite.log"))
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
    if not s.dry and s.suite_knob("SUITE_BUNDLE") != "0":
        bundle_env()
    s.gpus = count_gpus(s)
    header(s, argv)
    table = recipes()
    for p in argv:
        s.part, s.part_dir = p, os.path.join(s.work, "out", p)
        s.new_dir(s.part_dir)
        t0 = s.seconds()
        s.say(f"=== part {p} (at {t0} s)")
        try:
            table[p](s)
        except Exception as e:  # a recipe that breaks fails its part; the next parts still run
            traceback.print_exc()
            s.result("FAIL", f"the runner failed: {type(e).__name__}: {e}"[:200])
        s.say(f"=== part {p} done after {s.seconds() - t0} s")
        s.pack_details()
    status = verdicts(s, argv)
    sys.stdout.flush()
    os.close(1)
    os.close(2)
    tee.stdin.close()
    tee.wait()
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
