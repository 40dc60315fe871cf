#!/usr/bin/env python3
"""The GPU suite's verdicts (tools/gpu/run_suite.sh): reads what a part's commands wrote and prints
one summary line per check,

    PASS curves      ours vs HF autocast, qwen3-0.6b, 200 steps: max |dloss| 3.50e-04 at step 74 (<= 6e-04)

STATUS is PASS or FAIL (a gate), INFO (a figure with no gate) or SKIP (not applicable here). Exit
status 1 when a line is FAIL, else 0. Thresholds come from the table, tools/gpu/suite_parts.py (the
--part's thresholds; an option given on the command line wins), or, for the end-to-end targets,
from bench/e2e/report.py (the one place issue 4's targets are written).
Pure Python (no numpy/torch): `python3 tools/gpu/suite_judge_test.py` tests it on any machine.

  suite_judge.py CHECK --part PART [options]       (CHECK: see the subcommands' --help)
"""
import argparse
import glob
import json
import math
import os
import re
import sys
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)


class Verdicts:
    """Collects and prints the summary lines of one judge call."""

    def __init__(self, part):
        self.part = part
        self.failed = False

    def line(self, status, text):
        print(f"{status:<4} {self.part:<11} {text}", flush=True)
        self.failed |= status == "FAIL"

    def gate(self, ok, text):
        self.line("PASS" if ok else "FAIL", text)

    def info(self, text):
        self.line("INFO", text)


def read(path, default=""):
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return default


def load_json(path):
    with open(path) as f:
        return json.load(f)


def json_lines(text, prefix=""):
    out = []
    for line in text.splitlines():
        line = line.strip()
        if prefix:
            if not line.startswith(prefix):
                continue
            line = line[len(prefix):].strip()
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


def last_line(text, n=160):
    lines = [l.strip() for l in text.splitlines() if l.strip() and not l.startswith("===")]
    return lines[-1][:n] if lines else "no output"


def report_module():
    """bench/e2e/report.py (targets, presets), imported by path (suite_parts.py's copy)."""
    import suite_parts
    return suite_parts.report_module()


# ----------------------------------------------------------------------------------------- checks

def check_tiny(a, v):
    """The tiny example on the CUDA backend: `slidedp run` succeeded, all steps, final loss <= max."""
    log = read(a.log)
    m = re.search(r"summary: (\w+) after (\d+) step\(s\) in [0-9.]+ s, final loss ([-+0-9.eEnaif]+)", log)
    if a.rc != 0 or not m:
        v.gate(False, f"tiny example on CUDA: exit {a.rc}: {last_line(log)} (must succeed, final loss <= {a.max_loss:g})")
        return
    state, steps, loss = m.group(1), int(m.group(2)), float(m.group(3))
    ok = steps == a.expect_steps and math.isfinite(loss) and loss <= a.max_loss
    v.gate(ok, f"tiny example on CUDA: {state}, {steps} steps, final loss {loss:.4f} "
               f"(<= {a.max_loss:g} after {a.expect_steps} steps)")
    for p in sorted(glob.glob(os.path.join(a.run_dir, "**", "*.log"), recursive=True)):
        hit = re.search(r"CUDA backend on GPU \d+: .*", read(p))
        if hit:
            v.info(f"worker: {hit.group(0)[:160]}")
            break


def junit_cases(path):
    """(tests, [failed names], skipped) of a JUnit XML file (gtest's --gtest_output=xml or ctest's
    --output-junit)."""
    root = ET.parse(path).getroot()
    tests, failed, skipped = 0, [], 0
    for case in root.iter("testcase"):
        tests += 1
        name = f"{case.get('classname', '')}.{case.get('name', '')}".strip(".")
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(name)
        elif case.find("skipped") is not None or case.get("status") in ("notrun", "disabled") \
                or case.get("result") == "skipped":
            skipped += 1
    return tests, failed, skipped


def check_gtest(a, v):
    """Every GPU test binary: exit 0 and no failed test in its XML; at least one binary."""
    rcs = dict(item.split("=", 1) for item in a.rc)
    if not rcs:
        v.gate(False, f"GPU test binaries: none found ({a.none_why})")
        return
    total = skipped = 0
    bad = []
    for name, rc in sorted(rcs.items()):
        xml = os.path.join(a.xml_dir, name + ".xml")
        try:
            t, failed, s = junit_cases(xml)
        except (OSError, ET.ParseError) as e:
            t, failed, s = 0, [f"(no XML: {type(e).__name__})"], 0
        total += t
        skipped += s
        if rc != "0" or failed:
            bad.append((name, rc, t, failed))
    for name, rc, t, failed in bad:
        v.gate(False, f"{name}: exit {rc}, {len(failed)} of {t} failed: {', '.join(failed[:4])}"
                      + (" ..." if len(failed) > 4 else ""))
    v.gate(not bad, f"GPU test binaries: {len(rcs)} binaries, {total} tests, "
                    f"{sum(len(b[3]) for b in bad)} failed, {skipped} skipped, {len(bad)} binaries failing "
                    f"(every binary must exit 0)")


def check_layouts(a, v):
    """attn_layouts_check: exit 0 and its PASS line; the micro-batch count it read."""
    log = read(a.log)
    m = re.search(r"^(PASS|FAIL)\s+attention layouts: (\d+) of (\d+) micro-batches differ beyond ([0-9.e+-]+)",
                  log, re.M)
    if not m:
        v.gate(False, f"attention layouts: exit {a.rc}: {last_line(log)} (cuDNN vs own per document, "
                      "every micro-batch must pass)")
        return
    bad, n, tol = int(m.group(2)), int(m.group(3)), m.group(4)
    ok = a.rc == 0 and m.group(1) == "PASS" and bad == 0 and (a.expect == 0 or n == a.expect)
    v.gate(ok, f"attention layouts, cuDNN vs own per document: {bad} of {n} micro-batches differ "
               f"(0 allowed, tolerance {tol} rel; {a.expect or n} micro-batches expected)")
    worst = re.findall(r"^INFO\s+attention layouts: worst cuDNN vs own (\S+) ([0-9.e+-]+) at", log, re.M)
    if worst:
        v.info("attention layouts worst: " + ", ".join(f"{k} {float(x):.2e}" for k, x in worst))


def check_stages(a, v):
    """gpu_verify.sh's stages (=== NAME: exit RC lines in DIR/NAME.log)."""
    for name in a.names.split(","):
        log = read(os.path.join(a.dir, name + ".log"))
        m = re.findall(rf"^=== {re.escape(name)}: exit (\d+) after (\d+) s", log, re.M)
        if not m:
            v.gate(False, f"{name}: did not finish ({last_line(log)})")
        else:
            rc, secs = m[-1]
            v.gate(rc == "0", f"{name}: exit {rc} after {secs} s (must exit 0)")


def check_hf_compare(a, v):
    """hf_compare.py's records: loss and every gradient against HF autocast."""
    recs = json_lines(read(a.results))
    runs = [r for r in recs if "backend" in r or "error" in r]
    if not runs:
        v.gate(False, f"hf_compare: no records in {os.path.basename(a.results)} (see hf_compare.log)")
        return
    strict = sum(1 for r in runs if r.get("pass"))
    floor_ok, notes = 0, []
    worst_loss = 0.0
    for r in runs:
        label = f"{r.get('shape')} {r.get('backend', '')} {r.get('grouping', '')} {r.get('policy', '')}".strip()
        if r.get("error") or r.get("problems"):
            notes.append(f"{label}: {(r.get('error') or r.get('problems')[0])[:80]}")
            continue
        loss_rel = float(r.get("loss_rel", math.inf))
        worst_loss = max(worst_loss, loss_rel)
        floors = r.get("floor_rel") or {}
        to_fp32 = r.get("grad_rel_fp32") or {}
        over = []
        for name, rel in (r.get("grad_rel") or {}).items():
            limit = max(a.grad_tol, a.floor_factor * float(floors.get(name, 0.0)))
            # HF autocast is itself a BF16 estimate: a tensor whose gradient sums many BF16 terms with
            # cancellation (a bias) can sit farther from it than the floor while being as close to the
            # exact FP32 gradient as HF autocast is: that passes too.
            as_exact = name in to_fp32 and float(to_fp32[name]) <= a.floor_factor * float(floors.get(name, 0.0))
            if not float(rel) <= limit and not as_exact:
                over.append((name, float(rel), floors.get(name)))
        if loss_rel <= a.loss_tol and not over and r.get("grad_rel"):
            floor_ok += 1
        else:
            name, rel, fl = max(over, key=lambda x: x[1]) if over else ("(loss)", loss_rel, None)
            notes.append(f"{label}: {name.replace('model.', '')} {rel:.3g}" + (f" (HF floor {fl:.3g})" if fl else ""))
    v.gate(floor_ok == len(runs),
           f"hf_compare, ours vs HF autocast: {floor_ok}/{len(runs)} runs pass; worst loss rel {worst_loss:.2e} "
           f"(loss rel <= {a.loss_tol:g}; every gradient rel L2 <= {a.grad_tol:g}, or <= {a.floor_factor:g}x HF's "
           "own FP32-vs-autocast distance on that tensor, from HF autocast or from HF FP32)")
    for n in notes[:6]:
        v.info(f"hf_compare failing: {n}")
    v.info(f"hf_compare strict (every gradient <= {a.grad_tol:g}, hf_compare.py's own verdict): "
           f"{strict}/{len(runs)} runs pass" + ("" if any("floor_rel" in r for r in runs) else
                                                 "; records carry no floor_rel (old hf_compare.py)"))


def check_tokenizer(a, v):
    """compare_and_bench.py's report: 0 documents tokenized differently from HF tokenizers."""
    try:
        rep = load_json(a.report)
        c = rep["compare"]
    except (OSError, ValueError, KeyError) as e:
        v.gate(False, f"tokenizer vs HF tokenizers: exit {a.rc}, no report ({type(e).__name__}; see the log)")
        return
    ok = a.rc == 0 and c["mismatched_documents"] == 0 and c["documents"] == c["ours_documents"] > 0
    v.gate(ok, f"tokenizer vs HF tokenizers: {c['mismatched_documents']} of {c['documents']} documents differ "
               f"({c['tokens']} tokens; 0 allowed)")
    runs = rep.get("runs", [])
    speed = [f"{r.get('impl', '?').split(' ')[0]} {r['MB_per_s']:.1f} MB/s at {r.get('threads', '?')} threads"
             for r in runs if isinstance(r, dict) and r.get("MB_per_s")]
    if speed:
        v.info("tokenizer speed: " + ", ".join(speed))


NUM = r"([-+0-9.eEnaif]+)"


def check_graddiff(a, v):
    """grad_diff.py on one step's batch: ours against HF autocast (loss and total gradient norm)."""
    log = read(a.log)
    lm = re.search(rf"loss: ours {NUM}, HF autocast {NUM}, HF fp32 {NUM}, HF mirror-fp32-norms {NUM}", log)
    gm = re.search(rf"gradient norm: ours {NUM}, HF autocast {NUM}, HF fp32 {NUM}, HF mirror-fp32-norms {NUM}", log)
    if not (lm and gm):
        v.gate(False, f"gradients vs HF on one batch: exit {a.rc}: {last_line(log)}")
        return
    l_o, l_a, l_f, l_m = (float(x) for x in lm.groups())
    g_o, g_a, g_f, g_m = (float(x) for x in gm.groups())
    lr, gr = abs(l_o - l_a) / abs(l_a), abs(g_o - g_a) / abs(g_a)
    v.gate(lr <= a.loss_tol, f"{a.what}: loss ours {l_o:.6f} vs HF autocast {l_a:.6f}: rel {lr:.2e} "
                             f"(<= {a.loss_tol:g})")
    v.gate(gr <= a.norm_tol, f"{a.what}: gradient norm ours {g_o:.4f} vs HF autocast {g_a:.4f}: rel {gr:.2e} "
                             f"(<= {a.norm_tol:g})")
    v.info(f"{a.what}: the reference's own spread: HF fp32 vs autocast loss rel {abs(l_f - l_a) / abs(l_a):.2e}, "
           f"norm rel {abs(g_f - g_a) / abs(g_a):.2e}; ours vs HF mirror-fp32-norms norm rel "
           f"{abs(g_o - g_m) / abs(g_m):.2e}")


def check_curve(a, v):
    """compare_curves.py --json: its verdict, over the expected steps 1..N."""
    try:
        r = load_json(a.json)
    except (OSError, ValueError):
        (v.info if a.info else lambda t: v.gate(False, t))(f"{a.what}: no comparison (missing curve; see the logs)")
        return
    complete = r["first_step"] == 1 and r["steps"] >= a.expect_steps
    text = (f"{a.what}: max |dloss| {r['max_abs_diff']:.2e} at step {r['max_at_step']}, mean "
            f"{r['mean_abs_diff']:.2e}, over steps {r['first_step']}-{r['last_step']}")
    if a.info:
        v.info(text + ("" if complete else f" (incomplete: {r['steps']} of {a.expect_steps} steps)"))
    elif not complete:
        v.gate(False, text + f" (incomplete: {r['steps']} of {a.expect_steps} steps; <= {r['tol']:g} over all)")
    else:
        v.gate(bool(r["pass"]), text + f" (<= {r['tol']:g} over {a.expect_steps} steps)")


def count_unit_lines(path):
    return sum(1 for l in read(path).splitlines() if "unit norms:" in l)


def check_bitwise(a, v):
    """compare_curves.py --bitwise --json: equal losses and unit norms at every step."""
    try:
        r = load_json(a.json)
    except (OSError, ValueError):
        v.gate(False, f"{a.what}: no comparison (a run failed; see the logs)")
        return
    ua, ub = count_unit_lines(a.units_a), count_unit_lines(a.units_b)
    diff = r.get("first_difference")
    ok = diff is None and r["steps"] >= a.expect_steps and ua > 0 and ua == ub
    where = "equal" if diff is None else f"first difference at step {diff[0]} ({len(diff[3])} units)"
    v.gate(ok, f"{a.what}: {where} over {r['steps']} steps, {ua}/{ub} unit-norm lines "
               f"(bitwise equal losses and unit norms at all {a.expect_steps} steps)")


def check_params(a, v):
    """compare_params.py --json: worst tensor's relative L2 within its tolerance."""
    try:
        r = load_json(a.json)
    except (OSError, ValueError):
        v.gate(False, f"{a.what}: no comparison (missing checkpoint; see the logs)")
        return
    v.gate(bool(r["pass"]), f"{a.what}: worst tensor rel L2 {r['worst_rel_l2']:.2e} "
                            f"({r['worst_tensor'].replace('model.', '')}) (<= {a.tol:g})")


def check_offload(a, v):
    """bench_step at several offload ratios: bitwise the same loss (offload only moves checkpoints)."""
    rows = []
    for log in a.logs:
        js = [j for j in json_lines(read(log)) if j.get("mode") == "compute_only"]
        rows.append((log, js[-1] if js else {"error": last_line(read(log))}))
    bad = [(l, j) for l, j in rows if "loss" not in j or j.get("error")]
    if bad:
        v.gate(False, "activation offload: " + "; ".join(f"{os.path.basename(l)}: {j.get('error', 'no result')}"[:120]
                                                         for l, j in bad))
        return
    losses = {repr(float(j["loss"])) for _, j in rows}
    v.gate(len(losses) == 1, f"activation offload, bench_step losses at offload ratios "
                             f"{', '.join(str(j['offload_ratio']) for _, j in rows)}: {', '.join(sorted(losses))} "
                             "(bitwise equal)")
    v.info("activation offload: " + "; ".join(
        f"ratio {j['offload_ratio']}: step {j['step_s']:.2f} s, GPU peak {j['peak_gib']:.1f} GiB, "
        f"pinned {j.get('offload_host_gib', 0):.1f} GiB" for _, j in rows))


def e2e_records(path):
    try:
        return load_json(path)
    except (OSError, ValueError):
        return []


def pick(recs, kind, model, tokens=None, gpus=1):
    for r in recs:
        if r.get("kind") == kind and r.get("model") == model and r.get("gpus", 1) == gpus \
                and (tokens is None or r.get("tokens_per_gpu") == tokens):
            return r
    return None


def usable(r):
    return r is not None and not r.get("error") and r.get("tokens_per_s_per_gpu")


def why(r, kind, tokens):
    if r is None:
        return f"{kind} at {tokens // 1024}K did not run"
    return f"{kind} at {tokens // 1024}K: {str(r.get('error', 'no result'))[:100]}"


def check_bench(a, v):
    """The end-to-end benchmark against compute-only and the FSDP2 peers, measured in the same run."""
    rep = report_module()
    recs = e2e_records(a.results)
    m, t, p = a.model, a.tokens, a.peer_tokens
    ours, comp = pick(recs, "ours", m, t), pick(recs, "compute", m, t)
    if not usable(ours):
        v.gate(False, f"{m} ours: {why(ours, 'ours', t)}")
    else:
        v.info(f"{m} ours at {t // 1024}K: {ours['tokens_per_s_per_gpu']:,.0f} tok/s, {ours.get('model_tflops', 0):.1f} "
               f"TFLOP/s, step {ours.get('step_s', 0):.2f} s, GPU peak {ours.get('gpu_peak_gib', 0):.1f} GiB")
    if usable(ours) and usable(comp):
        r = ours["tokens_per_s_per_gpu"] / comp["tokens_per_s_per_gpu"]
        text = (f"{m} ours / compute-only at {t // 1024}K: {ours['tokens_per_s_per_gpu']:,.0f} / "
                f"{comp['tokens_per_s_per_gpu']:,.0f} = {r:.2f}")
        if t >= rep.T_COMPUTE_MIN_TOKENS:
            v.gate(r >= rep.T_COMPUTE, text + f" (>= {rep.T_COMPUTE:g} at >= {rep.T_COMPUTE_MIN_TOKENS // 1024}K)")
        else:
            v.info(text + f" (the >= {rep.T_COMPUTE:g} target applies from {rep.T_COMPUTE_MIN_TOKENS // 1024}K)")
    elif usable(ours):
        v.gate(False, f"{m} ours / compute-only: {why(comp, 'compute', t)}")
    params = rep.preset_params(m)
    if usable(ours) and ours.get("host_state_gib") and params:
        gb = ours["host_state_gib"] / (params / 1e9)
        v.gate(gb <= rep.T_HOST, f"{m} host state: {ours['host_state_gib']:.1f} GiB = {gb:.2f} GiB per billion "
                                 f"parameters (<= {rep.T_HOST:g})")
        if ours.get("host_sampled_gib"):
            v.info(f"{m} host memory sampled over the job (MemAvailable drop): {ours['host_sampled_gib']:.1f} GiB = "
                   f"{ours['host_sampled_gib'] / (params / 1e9):.2f} GiB/B (state + processes + CUDA context)")
    # FSDP2 GPU-resident: ours at its best batch against the peer at its best (it runs out of memory
    # long before ours' batch), the convention of the figures of record.
    peers = [r for r in recs if r.get("kind") == "fsdp2" and r.get("model") == m and r.get("gpus", 1) == 1]
    best_peer = max((r for r in peers if usable(r)), key=lambda r: r["tokens_per_s_per_gpu"], default=None)
    best_ours = max((r for r in recs if r.get("kind") == "ours" and r.get("model") == m and r.get("gpus", 1) == 1
                     and usable(r)), key=lambda r: r["tokens_per_s_per_gpu"], default=None)
    if best_peer and best_ours:
        r = best_ours["tokens_per_s_per_gpu"] / best_peer["tokens_per_s_per_gpu"]
        v.gate(r >= rep.T_FSDP2, f"{m} ours ({best_ours['tokens_per_gpu'] // 1024}K) / FSDP2 GPU-resident "
                                 f"({best_peer['tokens_per_gpu'] // 1024}K), same run: "
                                 f"{best_ours['tokens_per_s_per_gpu']:,.0f} / {best_peer['tokens_per_s_per_gpu']:,.0f} "
                                 f"= {r:.2f} (>= {rep.T_FSDP2:g})")
    elif best_ours:
        v.gate(False, f"{m} ours / FSDP2 GPU-resident: " + (why(pick(recs, "fsdp2", m, p), "fsdp2", p)))
    if a.offload:
        o16, off = pick(recs, "ours", m, p), pick(recs, "fsdp2-offload", m, p)
        if usable(o16) and usable(off):
            r = o16["tokens_per_s_per_gpu"] / off["tokens_per_s_per_gpu"]
            v.gate(r >= rep.T_OFFLOAD, f"{m} ours / FSDP2 CPU offload at the same {p // 1024}K: "
                                       f"{o16['tokens_per_s_per_gpu']:,.0f} / {off['tokens_per_s_per_gpu']:,.0f} = "
                                       f"{r:.2f} (>= {rep.T_OFFLOAD:g})")
        else:
            v.gate(False, f"{m} ours / FSDP2 CPU offload: "
                          + (why(off, "fsdp2-offload", p) if usable(o16) else why(o16, "ours", p)))


def check_scaling(a, v):
    """1 -> 2 GPUs at the same tokens per GPU (total tokens/s), at each --strong global batch (1 GPU
    at G against 2 GPUs at G / 2 each), and ours / FSDP2 on 2 GPUs."""
    rep = report_module()
    recs = e2e_records(a.results)
    m, t, p = a.model, a.tokens, a.peer_tokens
    for g in a.strong or []:
        s1, s2 = pick(recs, "ours", m, g, 1), pick(recs, "ours", m, g // 2, 2)
        if usable(s1) and usable(s2):
            s = s2["tokens_per_s"] / s1["tokens_per_s"]
            v.gate(s >= a.t_strong,
                   f"{m} strong scaling at {g // 1024}K tokens per step: 1 GPU {s1['tokens_per_s']:,.0f} -> 2 GPUs "
                   f"({g // 2048}K each) {s2['tokens_per_s']:,.0f} tok/s = {s:.2f}x (>= {a.t_strong:g})")
        else:
            v.gate(False, f"{m} strong scaling at {g // 1024}K: "
                          + (why(s2, "ours on 2 GPUs", g // 2) if usable(s1) else why(s1, "ours on 1 GPU", g)))
    o1, o2 = pick(recs, "ours", m, t, 1), pick(recs, "ours", m, t, 2)
    if usable(o1) and usable(o2):
        s = o2["tokens_per_s"] / o1["tokens_per_s"]
        v.gate(s >= rep.T_SCALING, f"{m} 1 -> 2 GPUs at {t // 1024}K per GPU: {o1['tokens_per_s']:,.0f} -> "
                                   f"{o2['tokens_per_s']:,.0f} tok/s = {s:.2f}x (>= {rep.T_SCALING:g})")
    else:
        v.gate(False, f"{m} 1 -> 2 GPUs: " + (why(o2, "ours on 2 GPUs", t) if usable(o1) else why(o1, "ours on 1 GPU", t)))
    f2 = pick(recs, "fsdp2", m, p, 2)
    if usable(o2) and usable(f2):
        r = o2["tokens_per_s_per_gpu"] / f2["tokens_per_s_per_gpu"]
        v.gate(r >= rep.T_FSDP2, f"{m} on 2 GPUs, ours ({t // 1024}K) / FSDP2 GPU-resident ({p // 1024}K) per GPU: "
                                 f"{o2['tokens_per_s_per_gpu']:,.0f} / {f2['tokens_per_s_per_gpu']:,.0f} = {r:.2f} "
                                 f"(>= {rep.T_FSDP2:g})")
    elif usable(o2):
        v.gate(False, f"{m} on 2 GPUs, ours / FSDP2: {why(f2, 'fsdp2 on 2 GPUs', p)}")


def check_layeradam(a, v):
    """torch_cpu_adamw.py's JSON line: LayerAdam against torch's fused CPU AdamW and the copy bandwidth;
    bench_layeradam's own figures (nested there, or its own line when torch did not run): against the
    same-run triad on its own workers, bytes per parameter, page faults in the timed passes."""
    text = read(a.log)
    js = [j for j in json_lines(text) if j.get("bench") == "torch_cpu_adamw"]
    if not js or "layeradam_over_torch_fused" not in js[-1]:
        v.gate(False, f"LayerAdam vs torch CPU AdamW: {last_line(text)}")
    else:
        j = js[-1]
        la = j["layeradam"]
        v.gate(j["layeradam_over_torch_fused"] >= a.t_torch,
               f"LayerAdam {la.get('adam_Gparam_per_s', 0):.2f} Gparam/s / torch fused CPU AdamW "
               f"{j['adamw_fused_Gparam_per_s']:.2f} = {j['layeradam_over_torch_fused']:.2f} "
               f"({j['params']:,} params, {j['threads']} threads; >= {a.t_torch:g})")
        v.gate(j["layeradam_over_copy"] >= a.t_copy,
               f"LayerAdam traffic / memcpy bandwidth: {j['layeradam_over_copy']:.2f} (>= {a.t_copy:g})")
    # torch_cpu_adamw.py echoes bench_layeradam's output before importing torch, so its line is there
    # even when the torch part failed.
    la = (js[-1].get("layeradam") if js else None) or next(
        (j for j in reversed(json_lines(text)) if j.get("bench") == "layeradam"), None)
    if not la or "ratio_to_triad" not in la:
        v.gate(False, "LayerAdam / same-run triad: no triad figure in bench_layeradam's result"
                      + ("" if la else f" (no result: {last_line(text)})"))
    else:
        v.gate(la["ratio_to_triad"] >= a.t_triad,
               f"LayerAdam / same-run triad: {la['layeradam_gbps']:.1f} / {la['triad_gbps']:.1f} GB/s = "
               f"{la['ratio_to_triad']:.2f} (bytes moved: {la['layeradam_bytes_per_param']:g} B/param, triad "
               f"{la.get('triad_reference_stores', '?')} stores; {la.get('threads', '?')} workers; >= {a.t_triad:g})")
        v.info(f"LayerAdam {la['layeradam_bytes_per_param']:g} B/param moved "
               f"({la.get('layeradam_bytes_per_param_no_mirror', 0):g} without the mirror): "
               f"{la['layeradam_gbps']:.1f} GB/s (best {la.get('layeradam_gbps_best', 0):.1f}); triad "
               f"{la['triad_gbps']:.1f} GB/s median, {la.get('triad_gbps_best', 0):.1f} best "
               f"(streaming stores {la.get('triad_stream_gbps', 0):.1f} at 12 B/elem; cached "
               f"{la.get('triad_cached_gbps', 0):.1f} at 12 B/elem, "
               f"{la.get('triad_cached_gbps_write_allocate', 0):.1f} at 16 B/elem)")
    if not la or "hot_path_page_faults" not in la:
        v.gate(False, "page faults in LayerAdam's timed passes: no count in bench_layeradam's result")
    else:
        v.gate(la["hot_path_page_faults"] == 0,
               f"page faults in LayerAdam's timed passes: {la['hot_path_page_faults']} "
               f"({la.get('warmup_page_faults', '?')} in {la.get('warmup_reps', '?')} warm-up passes; == 0)")


def check_copy(a, v):
    """bench_copy's JSON lines: per-GPU H2D/D2H GB/s alone, with LayerAdam and with LayerAdam + copy
    priority (figures), the summaries' ratios (INFO), and "DMA before Adam": H2D copies with LayerAdam
    and priority on >= t_ratio of their solo GB/s (a gate per H2D case; D2H is not marked urgent)."""
    js = json_lines(read(a.log))
    if not js:
        v.info(f"bench_copy: no result ({last_line(read(a.log))})")
    for j in js:
        if j.get("summary"):
            continue
        if j.get("case") == "layeradam_alone":
            v.info(f"bench_copy LayerAdam alone: {j.get('layeradam_gparams_per_s', 0):.2f} Gparam/s")
            continue
        per = ", ".join(f"{g['h2d_gbs']:.1f}/{g['d2h_gbs']:.1f}" for g in j.get("per_gpu", []))
        duty = j.get("duty_ms") or [0, 0]
        mode = (" with LayerAdam" if j.get("layeradam") else "") + \
            (f" + copy priority {j['copy_priority']:g}" if j.get("copy_priority") else "")
        v.info(f"bench_copy {j.get('gpus')} GPU(s) {j.get('direction')}{mode}"
               + (f", duty {duty[0]:g}:{duty[1]:g} ms" if duty[0] else "") + f": H2D/D2H GB/s per GPU {per}"
               + (f"; LayerAdam {j['layeradam_gparams_per_s']:.2f} Gparam/s" if "layeradam_gparams_per_s" in j else "")
               + (f", paused {j['layeradam_paused_s']:.2f} s" if j.get("layeradam_paused_s") else ""))
    sums = [j for j in js if j.get("summary")]
    for j in sums:
        duty = j.get("duty_ms") or [0, 0]
        what = f"bench_copy {j['gpus']} GPU(s) {j['direction']}" + (f", duty {duty[0]:g}:{duty[1]:g} ms" if duty[0] else "")
        pri = "copy_ratio_with_adam_priority" in j
        v.info(f"{what}: copies GB/s per GPU alone {j['copy_gbs_alone']:.1f} / with LayerAdam {j['copy_gbs_with_adam']:.1f}"
               + (f" / with LayerAdam + priority {j['copy_gbs_with_adam_priority']:.1f}" if pri else "")
               + f"; LayerAdam Gparam/s alone {j['adam_gparams_alone']:.2f} / with copies {j['adam_gparams_with_copies']:.2f}"
               + (f" / with copies + priority {j['adam_gparams_with_copies_priority']:.2f}" if pri else ""))
        v.info(f"{what}: ratios copies with LayerAdam / alone {j['copy_ratio_with_adam']:.2f}"
               + (f", with priority {j['copy_ratio_with_adam_priority']:.2f}" if pri else "")
               + f" (H2D {j['h2d_ratio_with_adam']:.2f}" + (f", {j['h2d_ratio_with_adam_priority']:.2f}" if pri else "")
               + f"); LayerAdam with copies / alone {j['adam_ratio_with_copies']:.2f}"
               + (f", with priority {j['adam_ratio_with_copies_priority']:.2f}" if pri else ""))
        if pri and j["direction"] == "h2d":
            r = j["h2d_ratio_with_adam_priority"]
            v.gate(r >= a.t_ratio, f"DMA before Adam, {what}: H2D with LayerAdam + copy priority "
                                   f"{j.get('copy_priority', 0):g} / alone = {r:.2f} (>= {a.t_ratio:g})")
    ran_adam = any(j.get("layeradam") and j.get("case") != "layeradam_alone" for j in js)
    if ran_adam and not any("copy_ratio_with_adam_priority" in j and j["direction"] == "h2d" for j in sums):
        v.gate(False, "DMA before Adam: no H2D case with copy priority in bench_copy's output "
                      "(a bench_copy from before it, or --copy-priority 0)")


def check_warm(a, v):
    """Two jobs back to back on a node service: submit -> first step, cold and warm (figures)."""
    vals = []
    for label, path in (("cold", a.cold), ("warm", a.warm)):
        m = re.search(r"submit to first step: ([0-9.]+) s", read(path))
        vals.append(f"{label} {m.group(1)} s" if m else f"{label}: no figure ({last_line(read(path), 80)})")
    v.info(f"{a.what}: submit -> first step " + ", ".join(vals))


def check_kbench(a, v):
    """bench_kernels' JSON lines: cuDNN attention and the decoder layer against issue 3's targets."""
    js = json_lines(read(a.log), prefix="JSON")
    if not js:
        v.gate(False, f"bench_kernels: exit {a.rc}: {last_line(read(a.log))}")
        return
    ceil = {j["op"]: j for j in js if j["op"].startswith("ceiling_")}
    if ceil:
        v.info("ceilings: " + ", ".join(f"{k[8:]} {j.get('tflops', j.get('gbps'))}" for k, j in ceil.items()))
    for op, target in (("attn_fwd_causal_cudnn", a.t_fwd), ("attn_bwd_causal_cudnn", a.t_bwd)):
        rows = [j for j in js if j["op"] == op and j["tokens"] >= 4096]
        if not rows:
            v.gate(False, f"{op}: no rows (cuDNN not loaded?)")
            continue
        w = min(rows, key=lambda j: j["tflops"])
        v.gate(w["tflops"] >= target, f"{op}, causal, >= 4K tokens: min {w['tflops']:.0f} TFLOP/s "
                                      f"({w['model']} {w['tokens'] // 1024}K; {len(rows)} cases) (>= {target:g})")
    own = [j for j in js if j["op"] in ("attn_fwd_causal", "attn_bwd_causal")]
    if own:
        v.info("own attention: " + ", ".join(f"{j['op'][5:8]} {j['model']} {j['tokens'] // 1024}K {j['tflops']:.0f}"
                                             for j in own[:6]))
    layer = [j for j in js if j["op"] == "layer_fwd_bwd_keep_all_fp32res"]
    for j in layer:
        text = f"Qwen3-8B decoder layer keep-all (FP32 residual), {j['tokens'] // 1024}K tokens: {j['tflops']:.1f} TFLOP/s"
        if j["tokens"] >= 65536:
            v.gate(j["tflops"] >= a.t_layer, text + f" (>= {a.t_layer:g})")
        else:
            v.info(text + f" (the {a.t_layer:g} target is for 64K)")
    for j in js:
        if j["op"].startswith("layer_fwd_bwd_") and j["op"] != "layer_fwd_bwd_keep_all_fp32res" \
                or j["op"].startswith("head_ce_"):
            v.info(f"{j['op']} {j['tokens'] // 1024}K: {j['tflops']:.1f} TFLOP/s, {j['ms']:.1f} ms")


def eval_losses(path):
    """{step: eval_loss} of a metrics JSONL (the records a validation pass followed)."""
    out = {}
    for j in json_lines(read(path)):
        if isinstance(j, dict) and j.get("eval_loss") is not None:
            out[int(j["step"])] = float(j["eval_loss"])
    return out


def check_eval_parity(a, v):
    """Validation on CUDA against the CPU backend (the same weights): every pass's loss within --tol."""
    cuda, cpu = eval_losses(a.cuda), eval_losses(a.cpu)
    if not cuda or set(cuda) != set(cpu):
        v.gate(False, f"{a.what}: validation passes CUDA {sorted(cuda)} vs CPU {sorted(cpu)} (the same steps, >= 1)")
        return
    worst = max(abs(cuda[s] - cpu[s]) / abs(cpu[s]) for s in cpu)
    v.gate(worst <= a.tol and all(math.isfinite(x) for x in cuda.values()),
           f"{a.what}: validation loss CUDA vs CPU backend, {len(cuda)} passes, worst rel {worst:.2e} "
           f"(CUDA {cuda[max(cuda)]:.5f}, CPU {cpu[max(cpu)]:.5f}; <= {a.tol:g})")


def check_sdpa(a, v):
    """bench/kernels/torch_sdpa.py (PyTorch's cuDNN and FlashAttention-2 backends): figures only."""
    js = json_lines(read(a.log))
    if not js:
        v.info(f"torch SDPA: no result ({last_line(read(a.log))})")
        return
    v.info("torch SDPA: " + ", ".join(f"{j['op'].replace('torch_', '').replace('_causal', '')} {j['model']} "
                                      f"{j['tokens'] // 1024}K {j.get('tflops', 0):.0f}" for j in js[:12]))


# ------------------------------------------------------------------------------------------ main

def fill_thresholds(a, th):
    """Every threshold option not given: the --part's value in suite_parts.py."""
    import suite_parts
    for dest, name in th.items():
        if getattr(a, dest) is None:
            if name not in getattr(suite_parts.BY_NAME.get(a.part), "thresholds", {}):
                raise SystemExit(f"suite_judge {a.check}: --{dest.replace('_', '-')} not given and part "
                                 f"{a.part!r} has no threshold {name!r} in suite_parts.py")
            setattr(a, dest, suite_parts.threshold(a.part, name))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="check", required=True)

    def add(name, fn, *args, th=None):
        """A check: its options; th maps an option's dest to the --part's threshold in suite_parts.py
        (the option's default)."""
        p = sub.add_parser(name, help=fn.__doc__.splitlines()[0])
        p.add_argument("--part", required=True)
        for spec in args:
            flag, kw = spec[0], dict(spec[1]) if len(spec) > 1 else {}
            p.add_argument(flag, **kw)
        p.set_defaults(fn=fn, th=th or {})

    F, I, S = {"type": float}, {"type": int}, {}
    add("tiny", check_tiny, ("--log",), ("--rc", I), ("--max-loss", F), ("--expect-steps", I), ("--run-dir", S),
        th={"max_loss": "max_loss"})
    add("gtest", check_gtest, ("--xml-dir",), ("--rc", {"action": "append", "default": []}),
        ("--none-why", {"default": "no *_gpu_test binary"}))
    add("layouts", check_layouts, ("--log",), ("--rc", I), ("--expect", {"type": int, "default": 0}))
    add("stages", check_stages, ("--dir",), ("--names",))
    add("hf-compare", check_hf_compare, ("--results",), ("--loss-tol", F), ("--grad-tol", F), ("--floor-factor", F),
        th={"loss_tol": "loss_tol", "grad_tol": "grad_tol", "floor_factor": "floor_factor"})
    add("tokenizer", check_tokenizer, ("--report",), ("--rc", I))
    add("graddiff", check_graddiff, ("--log",), ("--rc", I), ("--loss-tol", F), ("--norm-tol", F), ("--what",),
        th={"loss_tol": "loss_tol", "norm_tol": "norm_tol"})
    add("curve", check_curve, ("--json",), ("--expect-steps", I), ("--what",), ("--info", {"action": "store_true"}))
    add("bitwise", check_bitwise, ("--json",), ("--expect-steps", I), ("--units-a",), ("--units-b",), ("--what",))
    add("params", check_params, ("--json",), ("--tol", F), ("--what",), th={"tol": "weight_tol"})
    add("offload", check_offload, ("--logs", {"nargs": "+"}))
    add("bench", check_bench, ("--results",), ("--model",), ("--tokens", I), ("--peer-tokens", I),
        ("--offload", {"action": "store_true"}))
    add("scaling", check_scaling, ("--results",), ("--model",), ("--tokens", I), ("--peer-tokens", I),
        ("--strong", {"type": lambda x: [int(g) for g in x.split(",") if g], "default": []}), ("--t-strong", F),
        th={"t_strong": "t_strong"})
    add("layeradam", check_layeradam, ("--log",), ("--t-torch", F), ("--t-copy", F), ("--t-triad", F),
        th={"t_torch": "t_torch", "t_copy": "t_copy", "t_triad": "t_triad"})
    add("copy", check_copy, ("--log",), ("--t-ratio", F), th={"t_ratio": "t_ratio"})
    add("warm", check_warm, ("--cold",), ("--warm",), ("--what", {"default": "warm host"}))
    add("kbench", check_kbench, ("--log",), ("--rc", I), ("--t-fwd", F), ("--t-bwd", F), ("--t-layer", F),
        th={"t_fwd": "t_fwd", "t_bwd": "t_bwd", "t_layer": "t_layer"})
    add("sdpa", check_sdpa, ("--log",))
    add("eval-parity", check_eval_parity, ("--cuda",), ("--cpu",), ("--tol", F), ("--what",), th={"tol": "tol"})
    import suite_checks  # the checks that were inline Python in run_suite.sh
    suite_checks.register(add)
    a = ap.parse_args(argv)
    fill_thresholds(a, a.th)
    v = Verdicts(a.part)
    try:
        a.fn(a, v)
    except Exception as e:  # a judge that breaks is a failed check, never a silent pass
        v.gate(False, f"{a.check}: the judge failed: {type(e).__name__}: {e}"[:200])
    return 1 if v.failed else 0


if __name__ == "__main__":
    sys.exit(main())
