r"""``test``: run the shipped test suite against a backend, yours included.

::

    python -m aten_override test                          # every available backend, CPU (+CUDA)
    python -m aten_override test --backend python --device cpu -k conv2d
    python -m aten_override test --backend my_pkg.conv:backward   # your function, aten signature
    python -m aten_override test --fuzz 5000              # only the fuzzer, 5000 examples
    python -m aten_override test --fuzz 5000 --seed 7     # the same 5000 examples every run
    python -m aten_override test --backend a:f --backend b:g --report out.json   # outcomes as JSON

Runs :mod:`aten_override.testing.suite` (from wherever the package is installed) with
``pytest.main`` and ends with a table per backend: passed / failed / skipped, and the skip
reasons (``--report FILE``: every test's outcome per backend, as JSON). Exit status: pytest's (0
when everything passed).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re

from . import positive_int

HELP = "run the shipped op test suite against a backend (or your own, as module:function)"

_SUITE_TESTS = ("test_matches_native", "test_errors", "test_fn_grad", "test_fn_gradgrad",
                "test_fn_fwgrad_bwgrad", "test_train_step")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend", action="append", metavar="B",
        help="a backend (python, compiled, aten, auto) or module:function; repeatable "
        "(default: every available backend, aten as the control)",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), help="only this device (default: cpu, and cuda when present)")
    parser.add_argument("--fuzz", type=positive_int, metavar="N", help="run only the differential fuzzer, N examples per backend and device")
    parser.add_argument(
        "--seed", type=int, metavar="S",
        help="hypothesis seed for --fuzz: the same examples on every run (default: new random examples each run)",
    )
    parser.add_argument("-k", dest="keyword", metavar="EXPR", help="pytest -k expression selecting tests")
    parser.add_argument("--slow", action="store_true", help="include the tests marked slow (float16/bfloat16 samples, gradgradcheck)")
    parser.add_argument("-x", "--exitfirst", action="store_true", help="stop at the first failure")
    parser.add_argument(
        "--report", metavar="FILE",
        help='write {"exit_code": N, "backends": {backend: {"passed"|"failed"|"skipped": [test, ...]}}, '
        '"failure_messages": {test: first line}} as JSON',
    )
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER, help="after --: passed to pytest as is")


class _Summary:
    """pytest plugin collecting one outcome per test (not per subtest) and skip reasons."""

    def __init__(self, backend_names: list[str], rerun: dict[str, str] | None = None):
        self.tokens = {name: re.sub(r"\W", "_", name) for name in backend_names}
        # backend name -> the command that reruns one of its tests (append the test's name)
        self.rerun = rerun or {}
        self.results: dict[str, tuple[str, str]] = {}  # nodeid -> (backend, passed/failed/skipped)
        self.skip_reasons: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.failed_subtests: dict[str, list[str]] = collections.defaultdict(list)
        self.failure_messages: dict[str, str] = {}  # test name -> the first failure's first line
        self.collection_errors: list[str] = []

    def pytest_collectreport(self, report) -> None:
        if report.failed:
            self.collection_errors.append(report.nodeid)

    def pytest_configure(self, config) -> None:
        from .. import pytest_plugin

        for marker in pytest_plugin._MARKERS:
            config.addinivalue_line("markers", marker)

    def backend_of(self, nodeid: str) -> str:
        test = nodeid.rpartition("::")[2]
        best = (len(test), "(other)")
        for name, token in self.tokens.items():
            i = test.find(f"_{token}_")
            if 0 <= i < best[0]:
                best = (i, name)
        return best[1]

    def pytest_runtest_logreport(self, report) -> None:
        backend = self.backend_of(report.nodeid)
        subtest = getattr(report, "context", None)
        if report.failed:
            crash = getattr(report.longrepr, "reprcrash", None)
            message = crash.message if crash is not None else str(report.longrepr)
            self.failure_messages.setdefault(report.nodeid.rpartition("::")[2], message.strip().split("\n")[0][:300])
        if report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            label = "" if subtest is None else f" (subtest {subtest.msg})"
            self.skip_reasons[backend][reason.removeprefix("Skipped: ") + label] += 1
        if subtest is not None:
            if report.failed:
                self.failed_subtests[report.nodeid].append(str(subtest.msg))
            return
        if report.failed:
            self.results[report.nodeid] = (backend, "failed")
        elif report.skipped:
            self.results[report.nodeid] = (backend, "skipped")
        elif report.when == "call" and report.nodeid not in self.results:
            self.results[report.nodeid] = (backend, "passed")

    def outcomes(self) -> dict[str, dict[str, list[str]]]:
        """``{backend: {"passed" | "failed" | "skipped": [test name, ...]}}``; a test with a failed
        subtest failed."""
        out: dict[str, dict[str, list[str]]] = {
            name: {"passed": [], "failed": [], "skipped": []} for name in self.tokens
        }
        for nodeid, (backend, outcome) in self.results.items():
            if self.failed_subtests.get(nodeid):
                outcome = "failed"
            out.setdefault(backend, {"passed": [], "failed": [], "skipped": []})[outcome].append(
                nodeid.rpartition("::")[2]
            )
        return out

    def counts(self) -> dict[str, collections.Counter]:
        """``{backend: Counter(passed=, failed=, skipped=)}``; a test with a failed subtest failed."""
        return {
            backend: collections.Counter({k: len(v) for k, v in tests.items() if v})
            for backend, tests in self.outcomes().items()
        }

    def render(self) -> str:
        counts = self.counts()
        width = max(len("backend"), *(len(n) for n in counts))
        lines = [f"{'backend':<{width}}  {'passed':>6}  {'failed':>6}  {'skipped':>7}"]
        for name, c in counts.items():
            lines.append(f"{name:<{width}}  {c['passed']:>6}  {c['failed']:>6}  {c['skipped']:>7}")
        for name in counts:
            for reason, n in self.skip_reasons.get(name, {}).items():
                lines.append(f"  {name}: skipped {n}x: {reason}")
            failed = [
                nodeid.rpartition("::")[2]
                + (f" [subtests: {', '.join(self.failed_subtests[nodeid])}]" if self.failed_subtests.get(nodeid) else "")
                for nodeid, (backend, outcome) in self.results.items()
                if backend == name and (outcome == "failed" or self.failed_subtests.get(nodeid))
            ]
            for test in failed[:20]:
                lines.append(f"  {name}: FAILED {test}")
            if len(failed) > 20:
                lines.append(f"  {name}: ... and {len(failed) - 20} more failures")
            if failed and name in self.rerun:
                lines.append(f"  rerun one: {self.rerun[name]} -k {failed[0].split(' ')[0]}")
        for nodeid in self.collection_errors:
            lines.append(f"ERROR collecting {nodeid} (see above)")
        return "\n".join(lines)


def _rerun_commands(args, impls) -> dict[str, str]:
    """Per backend, a command users can run to repeat one failed test (replacing PyTorch's "run
    `python test_fuzz.py …` from the base repo dir", which names a file of our installed package)."""
    import shlex

    options = []
    if args.device:
        options += ["--device", args.device]
    if args.fuzz is not None:
        options += ["--fuzz", str(args.fuzz)]
    if args.seed is not None:
        options += ["--seed", str(args.seed)]
    if args.slow:
        options.append("--slow")
    return {
        impl.name: shlex.join(["python", "-m", "aten_override", "test", "--backend", getattr(impl, "spec", impl.name), *options])
        for impl in impls
    }


def main(args) -> int:
    import pytest

    from ..testing.selection import BACKENDS_ENV, FUZZ_ENV, backend_from_spec, backends_under_test
    from ..testing.suite import SUITE_DIR, SUITE_MODULES

    specs = args.backend or []
    try:
        impls = [backend_from_spec(s) for s in specs] if specs else backends_under_test()
    except (ValueError, RuntimeError, ImportError) as e:
        print(f"aten_override test: {e}")
        return 2
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("aten_override test: --device cuda, but there is no CUDA device in this process")
            return 2

    env = {BACKENDS_ENV: ",".join(specs) if specs else ",".join(i.name for i in impls)}
    # The compiled backend is tested kernel by kernel on the layers its layer-class table gives each;
    # measuring would let native serve some of them (ATEN_OVERRIDE_AUTOTUNE=1 tests what it picks).
    env["ATEN_OVERRIDE_AUTOTUNE"] = os.environ.get("ATEN_OVERRIDE_AUTOTUNE", "0")
    if args.device:
        env["PYTORCH_TESTING_DEVICE_ONLY_FOR"] = args.device
    modules = SUITE_MODULES
    if args.fuzz is not None:
        env[FUZZ_ENV] = str(args.fuzz)
        modules = ("test_fuzz",)
    pytest_args = [os.path.join(SUITE_DIR, f"{m}.py") for m in modules]
    pytest_args += ["-q", "-p", "no:cacheprovider"]
    if not args.slow:
        pytest_args += ["-m", "not slow"]
    if args.keyword:
        pytest_args += ["-k", args.keyword]
    if args.exitfirst:
        pytest_args.append("-x")
    if args.seed is not None:
        pytest_args.append(f"--hypothesis-seed={args.seed}")
    pytest_args += [a for a in args.pytest_args if a != "--"]

    summary = _Summary([i.name for i in impls], rerun=_rerun_commands(args, impls))
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        code = int(pytest.main(pytest_args, plugins=[summary]))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if args.report:
        with open(args.report, "w") as f:
            json.dump({"exit_code": code, "backends": summary.outcomes(), "failure_messages": summary.failure_messages},
                      f, indent=1)
    device = args.device or "all devices"
    print(f"\naten_override test summary ({device}{'' if args.slow else ', not slow'}; pytest exit {code})")
    print(summary.render())
    return code
