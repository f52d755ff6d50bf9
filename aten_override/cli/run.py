"""``run``: run an unedited program with ``aten::convolution_backward`` overridden (and traced).

    python -m aten_override run [--backend B] [--autotune on|off|FILE] [--trace FILE] [--verify] script.py ARGS...
    python -m aten_override run [--backend B] [--autotune on|off|FILE] [--trace FILE] [--verify] -m package.module ARGS...

``--backend`` takes what ``test --backend`` takes: a backend name or ``module:function`` (a
function with the aten signature; under ``run`` an output it returns where ``output_mask`` is
False is dropped with a warning, as under ``enable(function)``).

The program runs in this process through :mod:`runpy`, as ``python script.py`` / ``python -m``
would run it: ``sys.argv`` is ``[script, *ARGS]`` (``-m``: the module's file, as Python sets it),
``sys.path[0]`` is the script's directory (``-m``: the current directory), and the exit code is the
program's (``sys.exit(n)``; 1 for an uncaught exception; 128 + the signal's number for SIGINT
(Ctrl-C: 130) and SIGTERM (143), as a shell reports a process the signal ended). ``--trace FILE``
streams records to FILE as JSON lines while the program runs (flushed line by line) and ends it
with a summary footer, also when the program raises or gets SIGINT/SIGTERM; a process killed
outright (SIGKILL, a crash in native code) leaves a valid file without the footer. A SIGINT/SIGTERM
whose exception CPython swallowed (its handler ran inside a weakref callback or ``__del__``) is
delivered again, so the program still stops (:func:`_redeliver_swallowed_signal`).
"""

from __future__ import annotations

import _thread
import argparse
import collections
import contextlib
import functools
import importlib.util
import io
import os
import runpy
import signal
import sys
import threading
import traceback
import types

from . import positive_int

HELP = "run a Python script or module (-m) with the override enabled, optionally tracing every call"


def add_arguments(parser: argparse.ArgumentParser, *, choosing: bool = True) -> None:
    """``run``'s options; ``choosing=False`` (``tune``) leaves out ``--backend`` and ``--autotune``, which
    ``tune`` sets itself (the compiled backend, measuring into its results file)."""
    from ..backends import Backend

    if choosing:
        parser.add_argument(
            "--backend",
            default=Backend.AUTO.value,
            metavar="B",
            help="backend serving aten::convolution_backward: "
            + ", ".join(b.value for b in Backend)
            + ", or module:function (a function with the aten signature) (default: %(default)s)",
        )
        parser.add_argument(
            "--autotune",
            metavar="on|off|FILE",
            help="the compiled backend's kernel choice: time candidates per call signature (on), the layer-class "
            "table (off), or on with a results file read at start and written at exit (default: "
            "$ATEN_OVERRIDE_AUTOTUNE, else on)",
        )
    parser.add_argument(
        "--trace", metavar="FILE",
        help="record every call, streamed to FILE as JSON lines while the program runs (read it with trace-summary)",
    )
    parser.add_argument("--trace-every", type=positive_int, metavar="N", default=1,
                        help="record every N-th call of each (module, shapes, backend) group (all are counted)")
    parser.add_argument("--trace-first", type=positive_int, metavar="N",
                        help="record only the first N calls of each group (all are counted)")
    parser.add_argument("--aggregate-only", action="store_true",
                        help="record no call, keep the per-group counts and times only (cheapest; implies tracing)")
    parser.add_argument(
        "--chrome-trace", metavar="FILE", help="record every call and save a Chrome trace (Perfetto) to FILE"
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="also run the original kernel on every call and report calls beyond tolerance (implies tracing)",
    )
    parser.add_argument(
        "--trace-ops", action="store_true", help="record every aten op of the backward pass, not only convolution_backward"
    )
    parser.add_argument(
        "--summary", action="store_true", help="print the summary table to stderr when the program ends"
    )
    parser.add_argument(
        "-m",
        dest="module",
        nargs=argparse.REMAINDER,
        metavar="MODULE ARGS",
        help="run a library module as a script, like python -m (everything after it goes to the module)",
    )
    parser.add_argument("program", nargs=argparse.REMAINDER, metavar="script.py ARGS", help="the script and its arguments")
    parser.set_defaults(_parser=parser)


def _check(args) -> None:
    """Turn bad command lines into argparse errors (exit code 2) before anything runs."""
    from ..testing.selection import backend_from_spec

    parser = args._parser
    try:
        args.impl = backend_from_spec(args.backend, strict=False)
    except (ValueError, RuntimeError, ImportError) as e:
        parser.error(f"--backend {args.backend}: {e}")
    if args.module is not None and args.program:
        parser.error("give either a script or -m MODULE, not both")
    if args.module is not None:
        if not args.module:
            parser.error("argument -m: expected a module name")
        name = args.module[0]
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError) as e:
            parser.error(f"-m {name}: {e}")
        if spec is None:
            parser.error(f"-m {name}: no module named {name!r}")
    elif not args.program:
        parser.error("expected a script (script.py ARGS...) or -m MODULE ARGS...")
    else:
        script = args.program[0]
        if not os.path.isfile(script):
            parser.error(f"script {script!r}: no such file")
    if args.chrome_trace is not None and args.aggregate_only:
        parser.error("--chrome-trace draws the recorded calls, and --aggregate-only records none: use one of them")
    for option in ("trace", "chrome_trace"):
        path = getattr(args, option)
        if path is not None:
            directory = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(directory):
                parser.error(f"--{option.replace('_', '-')} {path}: directory {directory!r} does not exist")


class Terminated(BaseException):
    """Raised in the program's main thread by SIGTERM while ``run`` runs it (a ``BaseException``, as
    ``KeyboardInterrupt`` is, so the program's ``except Exception`` does not swallow it)."""

    def __init__(self, signum: int):
        super().__init__(f"terminated by {signal.Signals(signum).name}")
        self.signum = signum


def _raise_terminated(signum, frame):
    raise Terminated(signum)


@contextlib.contextmanager
def _sigterm_as_exception():
    """While the program runs, SIGTERM unwinds it like Ctrl-C does (``finally`` blocks run, the trace
    gets its footer), and ``sys.unraisablehook`` delivers again a SIGTERM or Ctrl-C that CPython
    swallowed (:func:`_redeliver_swallowed_signal`). Only the main thread can set handlers (and
    only it runs them); elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    previous_hook = sys.unraisablehook
    sys.unraisablehook = functools.partial(_redeliver_swallowed_signal, previous_hook)
    try:
        yield
    finally:
        sys.unraisablehook = previous_hook
        signal.signal(signal.SIGTERM, previous)


def _redeliver_swallowed_signal(previous_hook, unraisable) -> None:
    """``sys.unraisablehook`` while the program runs: a SIGTERM or Ctrl-C that CPython swallowed is
    delivered again.

    Python runs a signal handler at the next bytecode boundary of the main thread. When that
    boundary is inside a weakref callback, a ``__del__`` or a garbage-collector callback, the
    handler's exception (our :class:`Terminated`, or ``KeyboardInterrupt`` from Ctrl-C's default
    handler) cannot propagate: CPython passes it to this hook ("Exception ignored in: ...") and goes
    on, and the program never stops. So, once the previous hook has printed it as usual, the signal
    is tripped again with ``_thread.interrupt_main(signum)`` and its handler runs at the next
    boundary after this hook has returned: normally in the code that dropped the object, where the
    exception propagates (if that is another such callback, the same happens there).

    The trip must be this frame's last step and must not be a call: CPython also runs pending
    handlers right after every call returns (and at function entry and backward jumps), so after
    ``_thread.interrupt_main(signum)`` called here the handler would run inside this hook, whose
    exceptions are swallowed too ("Exception ignored in sys.unraisablehook"; raising the signal with
    ``signal.raise_signal`` runs it at once, same end). A subscript is no such boundary:
    ``trip[signum]`` on a ``defaultdict`` whose factory is ``interrupt_main`` (all C) trips the
    signal without one, and nothing after it in this frame checks.
    """
    exc = unraisable.exc_value
    signum = None
    if threading.current_thread() is threading.main_thread():  # where handlers run
        if isinstance(exc, Terminated):
            signum = exc.signum
        elif isinstance(exc, KeyboardInterrupt):
            signum = signal.SIGINT
    if signum is None:
        previous_hook(unraisable)
        return
    trip = collections.defaultdict(functools.partial(_thread.interrupt_main, signum))
    try:
        previous_hook(unraisable)
        if sys.stderr is not None:
            print(f"aten_override run: {signal.Signals(signum).name} arrived inside a callback, where Python "
                  "ignores exceptions (above); delivering it again", file=sys.stderr)
    finally:
        trip[signum]  # interrupt_main(signum), no call: see the docstring


def _run_script(path: str) -> None:
    """Run the script at ``path`` as ``__main__``, as ``python path`` does: ``__file__`` absolute (Python
    3.9+; a script that changes directory still finds the files beside it) while ``sys.argv[0]`` stays as
    typed. ``runpy.run_path`` sets both to the path it is given, so it can give only one of them; these
    are its module globals for a source file otherwise (no loader, spec or cached file)."""
    file = os.path.abspath(path)
    with io.open_code(file) as f:
        code = compile(f.read(), file, "exec")
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=file, __cached__=None, __loader__=None, __package__=None, __spec__=None)
    saved = sys.modules.get("__main__")
    sys.modules["__main__"] = main
    try:
        exec(code, main.__dict__)
    finally:
        if saved is None:
            sys.modules.pop("__main__", None)
        else:
            sys.modules["__main__"] = saved


def _print_program_traceback(e: BaseException) -> None:
    """The traceback of an exception the program raised, from the program's first frame, as Python
    prints it: without the frames of ``run`` and runpy that called the program."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None and _is_launcher(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    traceback.print_exception(type(e), e, tb)


def _is_launcher(filename: str) -> bool:
    return filename in (__file__, runpy.__file__) or filename == "<frozen runpy>"


def _run_program(args) -> int:
    """Run the program as ``python script.py`` / ``python -m`` would; returns its exit code."""
    saved_argv = sys.argv[:]
    if args.module is not None:
        path0 = os.getcwd()
    else:
        path0 = os.path.dirname(os.path.abspath(args.program[0]))
    sys.path.insert(0, path0)
    try:
        if args.module is not None:
            sys.argv = list(args.module)  # runpy sets argv[0] to the module's file
            runpy.run_module(args.module[0], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(args.program)
            _run_script(args.program[0])
    except SystemExit as e:
        return _exit_code(e.code)
    except KeyboardInterrupt as e:
        _print_program_traceback(e)
        return 128 + signal.SIGINT
    except Terminated as e:
        print(f"aten_override run: the program was {e}", file=sys.stderr)
        return 128 + e.signum
    except BaseException as e:
        _print_program_traceback(e)
        return 1
    finally:
        sys.argv = saved_argv
        if path0 in sys.path:
            sys.path.remove(path0)
    return 0


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # sys.exit("message"), as the interpreter does
    return 1


def main(args) -> int:
    from .. import enable
    from ..tracing import trace

    _check(args)
    tracing = bool(args.trace or args.chrome_trace or args.verify or args.trace_ops or args.summary or args.aggregate_only)
    tracer = None
    if tracing:
        tracer = trace(args.trace, verify=args.verify, ops=args.trace_ops, log=False, every=args.trace_every,
                       first=args.trace_first, aggregate_only=args.aggregate_only)
    code = 1
    with _sigterm_as_exception():
        try:
            with enable(args.impl, autotune=args.autotune):
                if tracer is None:
                    code = _run_program(args)
                else:
                    with tracer:
                        code = _run_program(args)
        finally:
            if tracer is not None:
                _report(args, tracer)
    return code


def _report(args, tracer) -> None:
    from ..tracing import load

    data = tracer.data()
    agg = data.aggregates
    if args.trace:
        print(f"aten_override: {agg.calls} calls traced to {args.trace} ({agg.recorded} recorded)", file=sys.stderr)
    if args.chrome_trace:
        # the streamed file has every record; without one, the tracer's last `keep` records
        (load(args.trace) if args.trace else data).save_chrome_trace(args.chrome_trace)
        print(f"aten_override: Chrome trace written to {args.chrome_trace}", file=sys.stderr)
    if args.summary or args.verify or args.aggregate_only:
        print(data.summary(), file=sys.stderr)
