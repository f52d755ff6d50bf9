"""Mutation check of the shipped test suite: does ``python -m aten_override test`` catch real bugs?

Takes the correct reference backend
``aten_override.testing.example_backends:from_forward_convolutions`` (the control) and the
mutants of :data:`aten_override.testing.mutants.MUTANTS` (each the reference with one plausible
bug), runs the shipped suite against all of them, in two runs of the ``test`` command:

1. the default profile (``-m "not slow"``: OpInfo samples, error inputs, module training steps,
   the CI fuzz with its fixed cases) but gradcheck;
2. a short seeded fuzz (``--fuzz 300 --seed 0``);
3. gradcheck (``test_fn_grad``, the rest of the default profile) on the control and the mutants
   not caught yet (a failing gradcheck takes minutes to write its report),

and prints a table: each mutant, the tests that caught it (or ``MISSED``), and the first failure
message. The control must pass everything. Exit status 0 only when the control passed and every
mutant was caught; 1 otherwise; 2 when a run did not produce its report (a crash). The CPU model,
torch's version and the thread count head the output (oneDNN's summation order, hence a correct
backend's rounding, depends on the CPU).

Not run by CI's default profile (4-11 minutes on 2 cores, idle / shared); ``tests/scripts/test_mutation_check.py``
runs it in the slow profile. Examples::

    scripts/run.sh python scripts/mutation_check.py
    scripts/run.sh python scripts/mutation_check.py --mutant flipped_kernel --mutant no_empty_path
    scripts/run.sh python scripts/mutation_check.py --fuzz 1000 --seed 3 --json results.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from aten_override._machine import cpu_model  # noqa: E402
from aten_override.testing.mutants import CONTROL, MUTANTS  # noqa: E402

MUTANTS_MODULE = "aten_override.testing.mutants"
GRADCHECK = "test_fn_grad"
"""Run last, only on the mutants nothing else caught: a failing fast gradcheck recomputes the full
Jacobians in slow mode for its report, one backward per output element (many minutes for the 3-D
ops, per mutant)."""


def run_suite(specs: list[str], extra: list[str], report: str, log: str) -> dict | None:
    """``python -m aten_override test --backend S ... EXTRA --report REPORT``; its output goes to
    ``log``. Returns the report, or ``None`` when the run wrote none (it crashed)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    argv = [sys.executable, "-m", "aten_override", "test"]
    for spec in specs:
        argv += ["--backend", spec]
    argv += [*extra, "--report", report]
    with open(log, "w") as out:
        code = subprocess.run(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    if not os.path.exists(report):
        print(f"mutation_check: {' '.join(argv)} exited {code} with no report; see {log}")
        return None
    with open(report) as f:
        return json.load(f)


def _short(test: str, backend: str, run: str) -> str:
    """``test_matches_native_B_convolution_backward_conv1d_cpu_float32`` ->
    ``matches_native_conv1d_float32``; the fuzzer's test -> ``fuzz (RUN)``."""
    name = test.removeprefix("test_").replace(f"_{backend}_", "_", 1)
    for noise in ("convolution_backward_", "memory_format_", "nn_functional_", "nn_", "_cpu"):
        name = name.replace(noise, "")
    return f"fuzz ({run})" if name == "matches_native" else name


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mutant", action="append", choices=sorted(MUTANTS), metavar="NAME",
                        help="only this mutant (repeatable; default: all of aten_override.testing.mutants.MUTANTS)")
    parser.add_argument("--fuzz", type=int, default=300, help="examples of the seeded fuzz run (default 300)")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed of the fuzz run (default 0)")
    parser.add_argument("--json", metavar="FILE", help="also write {backend: {caught_by: [...], messages: [...]}}")
    parser.add_argument("--keep", metavar="DIR", help="keep the runs' logs and reports in DIR")
    parser.add_argument("-v", "--verbose", action="store_true", help="also the first line of each mutant's first 3 failures")
    args = parser.parse_args(argv)

    import torch

    print(f"CPU: {cpu_model()}; torch {torch.__version__}; {torch.get_num_threads()} threads")
    names = args.mutant or list(MUTANTS)
    specs = [CONTROL] + [f"{MUTANTS_MODULE}:{name}" for name in names]
    backends = [spec.rpartition(":")[2] for spec in specs]
    runs = {
        "default profile but gradcheck": ["-k", f"not {GRADCHECK}"],
        f"fuzz {args.fuzz}, seed {args.seed}": ["--fuzz", str(args.fuzz), "--seed", str(args.seed)],
        "gradcheck, on the control and the mutants not caught yet": ["-k", GRADCHECK],
    }
    workdir = args.keep or tempfile.mkdtemp(prefix="mutation_check.")
    os.makedirs(workdir, exist_ok=True)
    failed: dict[str, list[tuple[str, str]]] = {b: [] for b in backends}  # (test, first line of its failure)
    passed = {b: 0 for b in backends}
    for i, (label, extra) in enumerate(runs.items()):
        run_specs = specs
        if extra[-1] == GRADCHECK:
            run_specs = [spec for spec, b in zip(specs, backends) if b == backends[0] or not failed[b]]
        print(f"running the suite ({label}) on {len(run_specs)} backends; log: {workdir}/run{i}.log", flush=True)
        report = run_suite(run_specs, extra, os.path.join(workdir, f"run{i}.json"), os.path.join(workdir, f"run{i}.log"))
        if report is None:
            return 2
        run = "CI" if i == 0 else label.partition(",")[0] if "fuzz" in label else label
        for b in backends:
            outcome = report["backends"].get(b, {})
            passed[b] += len(outcome.get("passed", []))
            failed[b] += [(_short(t, b, run), report["failure_messages"].get(t, "")) for t in outcome.get("failed", [])]

    control = backends[0]
    rows = [("mutant", "caught by", "bug")]
    for b in backends:
        tests = [t for t, _ in failed[b]]
        if b == control:
            caught = f"control FAILED {len(tests)}: {', '.join(tests[:3])}" if tests else f"control: passed {passed[b]} tests"
            bug = "none: the reference"
        else:
            more = f", +{len(tests) - 2}" if len(tests) > 2 else ""
            caught = f"{len(tests)} tests: {', '.join(tests[:2])}{more}" if tests else "MISSED"
            bug = MUTANTS[b]
        rows.append((b, caught, bug))
    widths = [max(len(r[i]) for r in rows) for i in range(2)]
    for r in rows:
        print(f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]}")
    if args.verbose:
        for b in backends:
            for test, message in failed[b][:3]:
                print(f"{b}: {test}: {message}")

    missed = [b for b in backends[1:] if not failed[b]]
    control_ok = not failed[control] and passed[control] > 0
    print(f"\ncontrol {'passed' if control_ok else 'FAILED'}; {len(backends) - 1 - len(missed)}/{len(backends) - 1} "
          f"mutants caught{'; MISSED: ' + ', '.join(missed) if missed else ''}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({b: {"caught_by": [t for t, _ in failed[b]], "messages": [m for _, m in failed[b]]}
                       for b in backends}, f, indent=1)
    return 0 if control_ok and not missed else 1


if __name__ == "__main__":
    sys.exit(main())
