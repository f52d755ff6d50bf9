"""Command modules of ``python -m aten_override``: each has ``HELP``, ``add_arguments(parser)`` and
``main(args) -> int``."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """argparse ``type=`` for counts: a clear error for 0, negatives and non-integers."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value
