"""The GPU step-time model against every committed jaxllm GPU measurement.

    python benchmarks/step_time_check.py [--output=benchmarks/results/step_time_check.jsonl] [--records=FILE:LINE,...]

For each jaxllm record of :data:`RECORDS` (``jaxllm.bench`` lines of ``benchmarks/results/*/call*.jsonl`` on a GPU;
the PyTorch reference's lines are left out), the step time :mod:`jaxllm.analysis.gpu_time` predicts for the
program that was measured, one JSON line each in ``--output``: ``record`` (``FILE:LINE``, the line from 0),
``device_kind``, ``fitted`` (what of the model was fitted to it: :data:`FIT`, None for none), ``padded`` (its
program's gradients were padded, :data:`PADDED`), ``measured_step_time_s`` (the record's ``step_time_s``),
``predicted_step_time_s``, ``error`` (predicted / measured - 1), ``program`` (where the program came from),
``commit``, and for a profiled step ``categories`` (``{category: {"measured_s", "predicted_s"}}``, the profile's,
a step's seconds) and ``predicted_from_deviceless_s`` (the same config compiled here,
:data:`jaxllm.analysis.gpu_time.DEVICELESS` applied).

The program: a profiled record's optimized HLO, committed beside its trace; every other record's config (its
``config_file`` and ``overrides``, its ``xla_flags``) compiled here by XLA:GPU without a GPU
(``python -m jaxllm.plan --device=H100``, its optimized HLO dumped) from the source tree of the commit that ran it
(``git archive``; :data:`RECORDS` says which, and how the commit is known), with the installed jaxlib's XLA
(:data:`JAXLIB`; the GPUs ran 0.11.2's: the profiled records' ``predicted_from_deviceless_s`` beside their own
HLO's say how much that moves).  The compiled programs are committed in ``benchmarks/results/step_time_check/``
(:data:`PROGRAMS`, named by a hash of the commit, the command and the jaxlib), so the check runs from the
repository's files alone; a record without one is compiled (that needs the git history).

The model's constants are fitted to every committed trace (:data:`FIT`): the kernel constants to the four profiled
H100 steps of 2026-11-26, the H200's bandwidth factor to the kernels of the H200's profiled step outside its
optimizer (the padded gradients' fusions, :data:`PADDED`), the factor for programs compiled here to every profiled
step's own program against its config compiled here.  The script fits them again (:func:`check_fit`) and stops if
they differ from :data:`jaxllm.analysis.gpu_time.FITTED`, ``BANDWIDTH`` and ``DEVICELESS``.  No constant is fitted
to a record's step time; but the bandwidth factor was added because of the H200's records, so none of them is a
held-out check: the next GPU's records are.  Prints the table of docs/performance.md and the issue's checks.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib.metadata
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from jaxllm.analysis import gpu_fit, gpu_time, profile  # noqa: E402
from jaxllm.platform import gpu_env  # noqa: E402
from jaxllm.platform.hardware import GPU_KINDS  # noqa: E402

JAXLIB = importlib.metadata.version("jaxlib")  # whose XLA:GPU compiles the records' configs here

REPO = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))  # its git history: the commits' trees
RESULTS = os.path.join(ROOT, "benchmarks", "results")
PROGRAMS = os.path.join(RESULTS, "step_time_check")  # the records' configs compiled here at their commits
# call 1 of 2026-11-26 ran main at 1a5fcb2 with b3d2939's measuring tools (docs/performance.md, "jaxllm against a
# PyTorch GPT on one H100"): b3d2939 without its two changes to the step, which call 2 measured
CALL1 = (("jaxllm/model/fused_loss.py", "CHUNK_LOGITS = 1 << 26", "CHUNK_LOGITS = 1 << 24"),
         ("jaxllm/runtime/step.py", "held = model.cast_layers(cfg.model, params)", "held = params"))
# record file -> (commit that ran it, changes to its tree, how the commit is known); no record names its commit
RECORDS = {
    "2026-11-26-h100/call1.jsonl": ("b3d2939", CALL1, "docs/performance.md: call 1 ran main at 1a5fcb2 plus the "
                                    "measuring tools of b3d2939; b3d2939 with its loss chunks and cast undone"),
    "2026-11-26-h100/call2.jsonl": ("b3d2939", (), "docs/performance.md: call 2 with the two changes, committed "
                                    "with the records in b3d2939"),
    "2026-11-27-h200/call1.jsonl": ("ad136c8", (), "docs/performance.md: 'with main at ad136c8'"),
    "2026-11-27-h200/call2.jsonl": ("ad136c8", (), "docs/performance.md: 'with main at ad136c8'"),
    "2026-11-27-h200/call3.jsonl": ("ad136c8", (), "docs/performance.md: 'with main at ad136c8'"),
}
# the committed trace of a profiled record whose profile_trace names the GPU machine's folder
TRACES = {("2026-11-27-h200/call1.jsonl", 2): "benchmarks/results/2026-11-27-h200/call1-GPT1_5B-none-micro8-unrolled"}
# what each profiled record fits: the kernel constants (gpu_fit.fit) or its GPU's bandwidth factor
# (gpu_fit.bandwidth, its optimizer's kernels left out: the padded gradients' fusions)
FIT = {("2026-11-26-h100/call1.jsonl", 0): "kernels", ("2026-11-26-h100/call2.jsonl", 0): "kernels",
       ("2026-11-26-h100/call2.jsonl", 1): "kernels", ("2026-11-26-h100/call2.jsonl", 2): "kernels",
       ("2026-11-27-h200/call1.jsonl", 2): "bandwidth"}
SKIP = ("optimizer",)  # the categories gpu_fit.bandwidth leaves out of the H200 trace
# the records whose program's gradients were padded (the layers written out before jnp.unstack; docs/performance.md):
# XLA fused 48 pads, 47 adds and the norm into one kernel per stacked weight (231 ms measured, 14 ms priced); that
# program no longer exists, so these records are left out of the error statistics
PADDED = {("2026-11-27-h200/call1.jsonl", 1), ("2026-11-27-h200/call1.jsonl", 2)}
DEVICES = {kind: name for name, kind in GPU_KINDS.items()}


def records() -> list[tuple[str, int, dict]]:
    """Every jaxllm GPU record of :data:`RECORDS`: ``(file, line, record)``."""
    out = []
    for name in RECORDS:
        with open(os.path.join(RESULTS, name), encoding="utf-8") as f:
            for i, line in enumerate(f):
                rec = json.loads(line)
                if rec.get("framework", "jaxllm") == "jaxllm" and rec.get("platform") == "gpu":
                    out.append((name, i, rec))
    return out


def traced(name: str, index: int, rec: dict) -> str | None:
    """The committed prefix of a profiled record's trace and HLO (None: not profiled, or not committed)."""
    prefix = TRACES.get((name, index), rec.get("profile_trace"))
    path = prefix and os.path.join(ROOT, prefix)
    return path if path and os.path.exists(path + ".step.hlo.txt.gz") else None


def source_tree(commit: str, changes: tuple, trees: str) -> str:
    """The repository at ``commit`` with ``changes`` (file, old text, new text) made, under ``trees`` (once); the
    commits from this checkout's git history (``git archive``)."""
    tag = commit + ("-" + hashlib.sha1(repr(changes).encode()).hexdigest()[:8] if changes else "")
    tree = os.path.join(trees, tag)
    if os.path.isdir(tree):
        return tree
    partial = tree + ".partial"
    os.makedirs(partial, exist_ok=True)
    archive = subprocess.run(["git", "-C", REPO, "archive", commit], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", partial], input=archive, check=True)
    for path, old, new in changes:
        with open(os.path.join(partial, path), encoding="utf-8") as f:
            text = f.read()
        if text.count(old) != 1:
            raise RuntimeError(f"{commit}:{path}: {old!r} is not there once")
        with open(os.path.join(partial, path), "w", encoding="utf-8") as f:
            f.write(text.replace(old, new))
    os.symlink("kernels", os.path.join(partial, "jaxllm_kernels"))
    os.rename(partial, tree)
    return tree


def retired_flags(flags: str) -> str:
    """gpu_env's flags that this jaxlib's XLA no longer takes as compile options
    (:func:`jaxllm.platform.gpu_env.retired`), as ``XLA_FLAGS`` text, less those ``flags`` sets: an old tree's
    ``jaxllm.plan`` leaves a flag of ``XLA_FLAGS`` to XLA, whose parser ignores these, as a GPU run's does."""
    given = gpu_env.flag_names(flags)
    return " ".join(s.text() for s in gpu_env.retired("cuda") if s.is_flag and s.name not in given)


def compiled(name: str, index: int, rec: dict, trees: str) -> str:
    """The optimized HLO of ``rec``'s config compiled by XLA:GPU here at its commit (:data:`RECORDS`): committed in
    :data:`PROGRAMS` (named by the record and a hash of what was compiled), else compiled and written there."""
    commit, changes, _ = RECORDS[name]
    device = DEVICES[rec["device_kind"]]
    flags = rec.get("xla_flags") or rec.get("xla_flags_added", "")
    args = [f"--config={rec['config_file']}", *rec["overrides"], "--devices=1", f"--device={device}"]
    key = hashlib.sha1(json.dumps([commit, changes, args, flags, JAXLIB]).encode()).hexdigest()[:12]
    path = os.path.join(PROGRAMS, f"{name.replace('/', '-').removesuffix('.jsonl')}-{index}-{key}.hlo.txt.gz")
    if not os.path.exists(path):
        tree = source_tree(commit, changes, trees)
        with tempfile.TemporaryDirectory(dir=trees) as dump:
            env = {**os.environ, "PYTHONPATH": tree, "JAX_PLATFORMS": "cpu",
                   "XLA_FLAGS": f"{flags} {retired_flags(flags)} --xla_dump_to={dump} "
                                "--xla_dump_hlo_module_re=train_step".strip()}
            print(f"  compiling {name}:{index} at {commit}: {' '.join(args)}", flush=True)
            subprocess.run([sys.executable, "-m", "jaxllm.plan", *args], cwd=tree, env=env, check=True,
                           capture_output=True)
            (found,) = [f for f in os.listdir(dump) if f.endswith("gpu_after_optimizations.txt")]
            os.makedirs(PROGRAMS, exist_ok=True)
            with open(os.path.join(dump, found), encoding="utf-8") as f, gzip.open(path, "wt") as out:
                out.write(f.read())
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return f.read()


def fitted_constants(lines: list[dict]) -> tuple[dict, dict, float]:
    """The model's constants fitted again to :data:`FIT`'s records: ``(FITTED, BANDWIDTH, DEVICELESS)`` as
    :mod:`jaxllm.analysis.gpu_time` holds them (:func:`jaxllm.analysis.gpu_fit.fit`, ``gpu_fit.bandwidth``; the
    deviceless factor, the mean of the profiled steps' own programs' predictions over their compiles here, from
    ``lines`` when they hold every profiled record, else the source's)."""
    steps = {key: (*gpu_fit.load(traced(name, index, rec)), rec["step_time_s"], DEVICES[rec["device_kind"]])
             for name, index, rec in records() if (key := (name, index)) in FIT}
    fitted = gpu_fit.fit([step[:3] for key, step in steps.items() if FIT[key] == "kernels"])
    devices = {step[3] for key, step in steps.items() if FIT[key] == "bandwidth"}
    bandwidth = {d: gpu_fit.bandwidth([s[:3] for k, s in steps.items() if FIT[k] == "bandwidth" and s[3] == d], d,
                                      SKIP) for d in sorted(devices)}
    own = [x["predicted_step_time_s"] / x["deviceless_raw_s"] for x in lines if "deviceless_raw_s" in x]
    factor = float(f"{statistics.mean(own):.3g}") if len(own) == len(FIT) else gpu_time.DEVICELESS
    return fitted, bandwidth, factor


def check_fit(lines: list[dict]) -> None:
    """Exits 1 if :func:`fitted_constants` are not :data:`jaxllm.analysis.gpu_time.FITTED`, ``BANDWIDTH`` and
    ``DEVICELESS``, printing what the fit gives."""
    fitted, bandwidth, factor = fitted_constants(lines)
    if (fitted, bandwidth, factor) != (gpu_time.FITTED, gpu_time.BANDWIDTH, gpu_time.DEVICELESS):
        sys.exit("the fit gives other constants than jaxllm.analysis.gpu_time's FITTED, BANDWIDTH and DEVICELESS:\n"
                 f"{json.dumps(fitted, indent=1)}\nBANDWIDTH = {bandwidth}\nDEVICELESS = {factor}")


def categories(rec: dict, prefix: str, predicted: dict) -> dict:
    """A profiled step's seconds per category, measured (its trace) and predicted."""
    hlo_text, trace = gpu_fit.load(prefix)
    measured = {r["category"]: r["ms_per_step"] * 1e-3 for r in
                profile.summary(profile.kernels(trace), profile.program(hlo_text), 2, rec["step_time_s"])}
    return {c: {"measured_s": measured.get(c, 0.0), "predicted_s": predicted["categories"].get(c, 0.0)}
            for c in sorted(set(measured) | set(predicted["categories"]))}


def line(name: str, index: int, rec: dict, trees: str) -> dict:
    """The output line of one record (module docstring)."""
    device = gpu_time.device(DEVICES[rec["device_kind"]])
    prefix = traced(name, index, rec)
    commit, changes, how = RECORDS[name]
    here = compiled(name, index, rec, trees)
    own = gpu_fit.load(prefix)[0] if prefix else here
    predicted = gpu_time.predict(gpu_time.census(own), device, deviceless=not prefix)
    out = {"record": f"benchmarks/results/{name}:{index}", "device_kind": rec["device_kind"],
           "fitted": FIT.get((name, index)), "padded": (name, index) in PADDED,
           "measured_step_time_s": rec["step_time_s"],
           "predicted_step_time_s": predicted["step_s"], "error": predicted["step_s"] / rec["step_time_s"] - 1,
           "program": (f"the optimized HLO committed beside it ({os.path.relpath(prefix, ROOT)}.step.hlo.txt.gz)"
                       if prefix else f"its config compiled here by XLA:GPU (jaxlib {JAXLIB}) at {commit}"
                       + (" with call 1's changes" if changes else "")),
           "commit": commit, "commit_source": how,
           "variant": {k: rec.get(k) for k in ("micro_batch_size", "remat", "fp8")} | {
               "model": rec["config_file"].split(":")[-1], "layer_loop": rec["config"]["model"]["layer_loop"],
               "xla_flags_added": rec.get("xla_flags_added") or ("double buffering off" if "double_buffering=false"
                                                                 in rec.get("xla_flags", "") else None)}}
    if prefix:
        out["categories"] = categories(rec, prefix, predicted)
        raw = gpu_time.predict(gpu_time.census(here), device)["step_s"]
        out["predicted_from_deviceless_s"], out["deviceless_raw_s"] = raw * gpu_time.DEVICELESS, raw
    return out


def checks(lines: list[dict]) -> list[str]:
    """The issue's checks of the model against the records, one line each: per GPU the records' median and largest
    error (the padded-gradient ones apart, :data:`PADDED`), the order of every two variants of one model, device and
    date whose measured times differ by more than 10 %, and every category above 5 % of a profiled step within
    25 %."""
    out = []
    for kind in sorted({x["device_kind"] for x in lines}):
        errors = [abs(x["error"]) for x in lines if x["device_kind"] == kind and not x["padded"]]
        padded = [f"{x['error']:+.1%}" for x in lines if x["device_kind"] == kind and x["padded"]]
        out.append(f"{kind}: {len(errors)} records, median |error| {statistics.median(errors):.1%}, largest "
                   f"{max(errors):.1%}" + (f"; the padded-gradient records {', '.join(padded)}" if padded else ""))
    group = lambda x: (x["variant"]["model"], x["device_kind"], x["record"].split("/")[2])  # noqa: E731
    pairs = wrong = 0
    for a, b in itertools.combinations(lines, 2):
        if group(a) == group(b) and abs(a["measured_step_time_s"] / b["measured_step_time_s"] - 1) > 0.1:
            pairs += 1
            if (a["measured_step_time_s"] < b["measured_step_time_s"]) != (
                    a["predicted_step_time_s"] < b["predicted_step_time_s"]):
                wrong += 1
                out.append(f"  order wrong: {a['record']} against {b['record']}")
    out.append(f"variants more than 10 % apart (same model, device, date): {pairs} pairs, {wrong} predicted in the "
               "wrong order")
    for x in lines:
        for c, t in x.get("categories", {}).items():
            share = t["measured_s"] / x["measured_step_time_s"]
            if share > 0.05:
                err = t["predicted_s"] / t["measured_s"] - 1
                out.append(f"  {x['record']} {c}: {share:.0%} of the step, predicted {err:+.0%}"
                           + ("" if abs(err) <= 0.25 else "  (above 25 %)"))
    return out


def markdown(lines: list[dict]) -> str:
    """The records as the Markdown table of docs/performance.md (predicted against measured)."""
    rows = ["| record | GPU | model, micro batch, remat, layers | measured s/step | predicted s/step | error | "
            "fitted on it | program |", "|---|---|---|---|---|---|---|---|"]
    fits = {"kernels": "kernel constants", "bandwidth": "bandwidth factor", None: "no"}
    for x in lines:
        v = x["variant"]
        what = (f"{v['model']}, {v['micro_batch_size']}, {v['remat']}, {v['layer_loop']}"
                + (", FP8" if v["fp8"] else "") + (f", {v['xla_flags_added']}" if v["xla_flags_added"] else ""))
        rows.append(f"| {x['record'].removeprefix('benchmarks/results/')} | {x['device_kind'].split()[1]} | {what} | "
                    f"{x['measured_step_time_s']:.4f} | {x['predicted_step_time_s']:.4f} | {x['error']:+.1%} | "
                    f"{fits[x['fitted']] + (', padded' if x['padded'] else '')} | "
                    f"{'committed HLO' if 'committed' in x['program'] else 'compiled at ' + x['commit']} |")
    return "\n".join(rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", default=os.path.join(RESULTS, "step_time_check.jsonl"))
    p.add_argument("--records", default="", help="FILE:LINE,... of benchmarks/results (default: every record)")
    a = p.parse_args(argv)
    chosen = {tuple(r.rsplit(":", 1)) for r in a.records.split(",") if r}
    todo = [(n, i, r) for n, i, r in records() if not chosen or (n, str(i)) in chosen]
    missing = chosen - {(n, str(i)) for n, i, _ in todo}
    if missing:
        p.error(f"--records: no record {', '.join(sorted(':'.join(m) for m in missing))} in benchmarks/results "
                "(FILE:LINE, FILE relative to it, LINE from 0)")
    with tempfile.TemporaryDirectory(prefix="step-time-check-") as trees:
        lines = [line(name, index, rec, trees) for name, index, rec in todo]
    check_fit(lines)
    with open(a.output, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(x) + "\n" for x in lines)
    print(markdown(lines))
    print("\n".join(checks(lines)))
    print(f"wrote {len(lines)} lines to {a.output}")


if __name__ == "__main__":
    main()
