r"""Command line: ``python -m aten_override COMMAND …`` (also the ``aten-override`` script).

Each command lives in its own module of :mod:`aten_override.cli`, which provides
``HELP: str``, ``add_arguments(parser)`` and ``main(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# command name -> module in aten_override.cli
COMMANDS = {
    "demo": "demo",
    "info": "info",
    "run": "run",
    "trace-summary": "trace_summary",
    "test": "test",
    "tune": "tune",
}


def _modules():
    for name, module in COMMANDS.items():
        try:
            yield name, importlib.import_module(f"aten_override.cli.{module}")
        except ModuleNotFoundError as e:
            if e.name != f"aten_override.cli.{module}":
                raise


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m aten_override",
        description="Replace aten::convolution_backward at PyTorch's dispatcher.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module in _modules():
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_main=module.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = int(args._main(args) or 0)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader closed the pipe (`trace-summary --calls | head`): stop quietly. Python's
        # documented recipe (the signal module's "Note on SIGPIPE"): point stdout at devnull so the
        # interpreter's final flush does not raise again, and exit 1.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
