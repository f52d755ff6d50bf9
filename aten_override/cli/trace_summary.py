"""``trace-summary``: print the summary table (and optionally every call) of a saved trace.

Reads both the JSON lines that ``run --trace FILE`` / ``aten_override.trace(FILE)`` stream and the
JSON document of ``trace.save(FILE)``. Without ``--calls`` the records are not kept, so a file of
any length is summarised in memory bounded by its number of groups. A pipe closed early
(``trace-summary --calls FILE | head``) ends the command quietly.
"""

from __future__ import annotations

import argparse

HELP = (
    "print the summary table of a trace saved by `run --trace FILE` or aten_override.trace(FILE); "
    "exit code 1 if a verified call was beyond tolerance"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE", help="a trace: JSON lines (streamed) or JSON (trace.save)")
    parser.add_argument("--calls", action="store_true", help="also print every recorded call (and op) in order")
    parser.add_argument("--no-times", action="store_true", help="omit times (for diffs between runs)")
    parser.add_argument("--chrome-trace", metavar="OUT", help="also write the recorded calls as a Chrome trace (Perfetto) to OUT")
    parser.set_defaults(_parser=parser)


def main(args) -> int:
    from ..tracing import load

    try:
        data = load(args.file, records=bool(args.calls or args.chrome_trace))
    except (OSError, ValueError) as e:
        args._parser.error(f"{args.file}: {e}")
    times = not args.no_times
    if args.chrome_trace:
        data.save_chrome_trace(args.chrome_trace)
    if args.calls:
        for line in data.lines(times=times):
            print(line)
        print()
    print(data.summary(times=times))
    failures = data.failures()
    return 1 if failures else 0
