"""``tune``: run a program once to fill the compiled backend's autotune results file (offline tuning).

    python -m aten_override tune [--file tune.json] script.py ARGS...
    python -m aten_override tune [--file tune.json] -m package.module ARGS...

The program runs as with ``run --backend compiled --autotune FILE``: every call signature it reaches
is tuned once (:mod:`aten_override.autotune`) and the table is written to FILE, whose valid entries
any later ``enable("compiled", autotune=FILE)`` (or ``ATEN_OVERRIDE_AUTOTUNE=FILE``) takes without
timing again. Prints, per kernel, how many signatures it won and what tuning cost.
"""

from __future__ import annotations

import collections
import sys

from . import run

DEFAULT_FILE = "aten_override_autotune.json"

HELP = "run a script or module (-m) once with the compiled backend to fill an autotune results file"


def add_arguments(parser) -> None:
    run.add_arguments(parser, choosing=False)  # (no --backend / --autotune: a new user found them listed, then refused)
    parser.add_argument(
        "--file",
        help=f"the results file to extend (default: ${{ATEN_OVERRIDE_AUTOTUNE}} if it is a path, else {DEFAULT_FILE})",
    )
    parser.set_defaults(backend="compiled", autotune=None)


def main(args) -> int:
    from .. import autotune

    args.file = args.file or autotune.setting().path or DEFAULT_FILE
    args.autotune = args.file
    code = run.main(args)
    rows = autotune.entries()
    won = collections.Counter(r["kernel"] for r in rows)
    cost_ms = sum(r["tune_us"] for r in rows) / 1e3
    tuned = sum(1 for r in rows if r["tune_us"] > 0)
    print(
        f"aten_override: {len(rows)} signatures in {args.file} ({tuned} tuned now, {cost_ms:.0f} ms); "
        + ", ".join(f"{k}: {n}" for k, n in won.most_common()),
        file=sys.stderr,
    )
    return code
