"""``trace-summary``: print the summary table (and optionally every call) of a saved trace."""

from __future__ import annotations

import argparse

HELP = (
    "print the summary table of a trace saved by `run --trace FILE` or aten_override.trace().save(FILE); "
    "exit code 1 if a verified call was beyond tolerance"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE", help="a JSON trace")
    parser.add_argument("--calls", action="store_true", help="also print every call (and op) in order")
    parser.add_argument("--no-times", action="store_true", help="omit times (for diffs between runs)")
    parser.set_defaults(_parser=parser)


def main(args) -> int:
    from ..tracing import load

    try:
        data = load(args.file)
    except (OSError, ValueError) as e:
        args._parser.error(f"{args.file}: {e}")
    times = not args.no_times
    if args.calls:
        for line in data.lines(times=times):
            print(line)
        print()
    print(data.summary(times=times))
    failures = data.failures()
    return 1 if failures else 0
