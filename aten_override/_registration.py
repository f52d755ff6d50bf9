r"""The only module that touches aten's dispatcher.

Lifecycle
---------
``aten::convolution_backward`` is ``CompositeExplicitAutograd, CUDA: convolution_backward`` in
native_functions.yaml. While at least one :func:`push` is active (or :func:`pin` holds it), one
``torch.library.Library("aten", "IMPL")`` registers :func:`_kernel` for the **CPU** and **CUDA**
dispatch keys. Before registering, the kernels those keys computed are captured with
``torch.library.get_kernel``: they are the ``aten`` backend, every fallback, and the reference of
the tests. When the last ``push`` is popped the library is destroyed and the dispatcher is exactly
as before (``torch._C._dispatch_dump("aten::convolution_backward")`` shows no trace of us).
Interpreter exit destroys it too.

Per-step ``enable()`` (a ``train_step`` decorated with it, a ``with`` block in the training loop):
registering and destroying a Python ``torch.library`` kernel keeps ~64 bytes of native memory per
dispatch key in upstream's dispatcher (~210 bytes a cycle with our two keys and two
``get_kernel`` captures; measured on torch 2.13.0, ``tests/robustness/test_leaks.py``). So once the
Python library has been registered :data:`LINGER_AFTER` times within :data:`LINGER_WINDOW_S`
seconds, leaving the last ``push`` no longer destroys it: it *lingers idle*, and the kernel hands
every call straight to the captured original kernel (not counted, not traced) until the next
``push`` makes a backend active again without any dispatcher write. :func:`release` destroys an idle
registration at once; interpreter exit always does. The C++ registration of the compiled backend
does not leak and never lingers.

The compiled kernels keep their large temporaries between calls (``_C.workspace()``,
csrc/cpu/workspace.h: at most 256 MiB by default). Leaving the last ``push`` frees them the first
time; from the second ``enable("compiled")`` block that registers our kernel afresh (a per-step or
per-epoch ``enable()``; not a nested block, a ``trace()`` or another backend's block), they are kept
between blocks until :func:`release` or interpreter exit, so each block does not fault its
temporaries in afresh (bench_training.py, which leaves ``enable()`` after every compiled step:
R(2+1)D-18's bfloat16 ``gemm-kn2row`` temporal layer 156-217 ms a step freed, 70-80 kept, against
native's 87-107).

While the active backend is ``compiled`` and no observer (the tracer) is set, the C++ kernel of
``aten_override._C`` is registered at the same keys instead (``_C.register_kernels()``, a
``torch::Library`` owned by the extension): no Python runs per call, and its counters are merged
into :func:`stats`. Otherwise, and always while :func:`pin` holds the registration (so entering and
leaving :func:`enable` never writes the dispatcher), the Python kernel serves the compiled backend
through the extension's binding.

Threads
-------
The dispatcher is process-global and autograd runs CUDA backward on its own worker threads, so
the active backend is process-global, not thread-local: the most recently pushed entry that is
still active wins, whichever thread pushed it. Pushes and pops are serialised by a lock; the kernel
reads the active backend once per call, so every call is served wholly by one implementation.
Registering and deregistering write the dispatcher's table while other threads may be reading it
without a lock (upstream's design, pytorch#8713); a program that enters and leaves :func:`enable`
while *other* threads run backward should hold :func:`pin` (``aten_override.install()``), after
which entering and leaving only flips the active backend and never writes the dispatcher.
"""

from __future__ import annotations

import atexit
import itertools
import threading
import time
import warnings
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.library import Library, get_kernel

from . import backends
from .backends import ATEN_IMPL, Implementation
from .ops.convolution_backward.args import ConvolutionBackwardArgs

__all__ = [
    "OP",
    "push",
    "pop",
    "pin",
    "unpin",
    "is_registered",
    "active_backend",
    "original_kernel",
    "call_original",
    "stats",
    "reset_stats",
    "set_observer",
    "release",
    "is_lingering",
    "inner_calls",
    "last_decision",
    "Decision",
    "LINGER_AFTER",
    "LINGER_WINDOW_S",
]

OP = "aten::convolution_backward"
DISPATCH_KEYS = ("CPU", "CUDA")
_OVERRIDE_WARNING = r"(?s).*Overriding a previously registered kernel.*"

LINGER_AFTER = 8
"""Registrations of the Python library within :data:`LINGER_WINDOW_S` seconds after which an idle
registration lingers instead of being destroyed (a per-step ``enable()``)."""
LINGER_WINDOW_S = 60.0


@dataclass(frozen=True)
class Decision:
    """How one call was served: ``backend`` ran it; ``requested`` was active; ``reason`` says why the
    original kernel ran instead of ``requested`` (``None`` when it was not a fallback)."""

    requested: str
    backend: str
    reason: str | None = None

    @property
    def fallback(self) -> bool:
        return self.reason is not None


class _State:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.stack: list[tuple[int, Implementation]] = []
        self.tokens = itertools.count(1)
        self.pins = 0
        self.library: Library | _CompiledRegistration | None = None
        self.originals: dict[str, torch._C._SafeKernelFunction] = {}
        # Read without the lock by _kernel: one attribute load is atomic under the GIL.
        self.active: Implementation | None = None
        self.observer: Callable | None = None
        self.counts: Counter = Counter()
        self.fallback_reasons: Counter = Counter()
        self.counts_lock = threading.Lock()
        # monotonic times of the last LINGER_AFTER registrations of the Python library
        self.registered_at: deque = deque(maxlen=LINGER_AFTER)
        # set once per-step use is seen; cleared by release() and interpreter exit
        self.linger = False
        # enable("compiled") blocks that registered our kernel afresh since release() or start (not a
        # switch between the C++ and the Python registration, not a nested block): from the second on,
        # leaving the last push keeps the compiled kernels' temporaries (see the module's docstring)
        self.compiled_blocks = 0


_state = _State()


# --- the kernel ----------------------------------------------------------------------------


def _device_key(keyset) -> str:
    return "CUDA" if keyset.has(torch._C.DispatchKey.CUDA) else "CPU"


def call_original(keyset, aten_args: tuple):
    """Run the captured original kernel for ``keyset``'s device (no re-dispatch)."""
    return _state.originals[_device_key(keyset)].call_boxed(keyset, *aten_args)


_profiler_enabled = torch.autograd._profiler_enabled  # one C call: near-zero cost when no profiler runs


def _range_name(chosen: Implementation, args: ConvolutionBackwardArgs | None) -> str:
    """``aten_override::convolution_backward[<backend>]``; the compiled backend's range names the
    kernel it will run (``compiled/depthwise-plane``, ``compiled/tuning`` on a tuning call)."""
    name = chosen.name
    if name == "compiled" and args is not None:
        from .ops.convolution_backward import compiled

        try:
            name = f"compiled/{compiled.planned_kernel(args)}"
        except Exception:  # invalid arguments: the backend itself raises the error
            pass
    return f"aten_override::convolution_backward[{name}]"


_decided = threading.local()


def last_decision() -> Decision | None:
    """The decision :func:`_route` made for this thread's current (or last) call, set before the
    call runs, so a trace records how a call that raised was routed; ``None`` while the call has not
    been routed (cleared as each call enters the kernel)."""
    return getattr(_decided, "decision", None)


def _route(keyset, aten_args: tuple, impl: Implementation):
    """Serve one call with ``impl`` (or the original kernel); returns ``(result, Decision)``.

    The decision is counted (:func:`stats`) and kept for :func:`last_decision` before the
    implementation runs, so calls that raise are counted and traced too. While a profiler records
    (``torch.profiler``, ``torch.autograd.profiler``), the call is a ``record_function`` range named
    by :func:`_range_name`."""
    if impl.is_aten:
        decision = _decided.decision = Decision(impl.name, impl.name)
        _count(decision)
        if _profiler_enabled():
            with torch.profiler.record_function(_range_name(impl, None)):
                return call_original(keyset, aten_args), decision
        return call_original(keyset, aten_args), decision
    args = ConvolutionBackwardArgs(*aten_args)
    chosen, reason = impl.select(args)
    decision = _decided.decision = Decision(impl.name, chosen.name, reason)
    _count(decision)
    if _profiler_enabled():
        with torch.profiler.record_function(_range_name(chosen, args)):
            return _serve(keyset, aten_args, args, chosen), decision
    return _serve(keyset, aten_args, args, chosen), decision


def _serve(keyset, aten_args, args, chosen):
    if chosen.is_aten:
        return call_original(keyset, aten_args)
    try:
        return chosen(args)
    except Exception as e:
        e.add_note(f"aten_override: raised by backend {chosen.name!r} serving {OP}; the dispatcher is unchanged")
        raise


_reentry = threading.local()


def _kernel(keyset, *aten_args):
    if getattr(_reentry, "depth", 0):
        # A backend called aten::convolution_backward itself (e.g. a user function delegating to
        # torch.ops.aten.convolution_backward, or torch.nn.grad): that inner call is part of the
        # outer one. It runs the original kernel (no recursion into the backend) and is neither
        # counted as a call nor traced as one; the outer call's count of inner calls goes up.
        _reentry.inner += 1
        with _state.counts_lock:
            _state.counts["inner_calls"] += 1
        return call_original(keyset, aten_args)
    impl = _state.active
    if impl is None:
        if _state.observer is None and not _state.pins:
            # Idle (lingering, or popped between the dispatcher's lookup and this call): the
            # original kernel, as if nothing were registered.
            return call_original(keyset, aten_args)
        impl = ATEN_IMPL
    _reentry.depth = 1
    _reentry.inner = 0
    _decided.decision = None  # each call starts without one: a trace whose observer chain raises before routing records none
    try:
        return _observe_and_route(keyset, aten_args, impl)
    finally:
        _reentry.depth = 0


def inner_calls() -> int:
    """How many times the backend serving this thread's current (or last) call called
    ``aten::convolution_backward`` itself (each served by the original kernel, inside that call)."""
    return getattr(_reentry, "inner", 0)


def _observe_and_route(keyset, aten_args, impl):
    observer = _state.observer
    if observer is not None:
        return observer(keyset, aten_args, impl, _route)[0]
    return _route(keyset, aten_args, impl)[0]


def _count(decision: Decision) -> None:
    with _state.counts_lock:
        _state.counts[decision.backend] += 1
        if decision.reason is not None:
            _state.counts["fallback"] += 1
            _state.fallback_reasons[f"{decision.requested}: {decision.reason}"] += 1


# --- registration lifecycle ----------------------------------------------------------------


_captured: tuple[str, dict] | None = None  # (the dispatcher dump at capture, the kernels)


def _capture_originals() -> dict[str, torch._C._SafeKernelFunction]:
    """The kernels of the CPU and CUDA keys, captured with ``get_kernel`` while nothing of ours is
    registered. Each ``get_kernel`` keeps ~55 bytes of upstream's native memory, so the capture is
    reused while the operator's dispatcher entry is unchanged (its ``_dispatch_dump``, ~15 us, keeps
    nothing): per-step ``enable("compiled")`` cycles do not grow."""
    global _captured
    dump = torch._C._dispatch_dump(OP)
    if _captured is None or _captured[0] != dump:
        _captured = (dump, {key: get_kernel(OP, key) for key in DISPATCH_KEYS})
    return _captured[1]


class _CompiledRegistration:
    """Stands in for the :class:`Library` while the C++ kernel of ``aten_override._C`` is registered."""

    def __init__(self, ext) -> None:
        self.ext = ext
        ext.register_kernels()

    def _destroy(self) -> None:
        self.ext.deregister_kernels()


def _compiled_extension():
    """The extension when the C++ kernel should serve calls directly, else ``None``."""
    impl = _state.active
    if _state.pins or _state.observer is not None or impl is not backends._IMPLS[backends.Backend.COMPILED]:
        return None
    from .ops.convolution_backward import compiled

    return compiled.extension()


def _register() -> None:
    ext = _compiled_extension()
    afresh = _state.library is None  # (not a switch between the C++ and the Python registration)
    if _state.library is not None:
        if isinstance(_state.library, _CompiledRegistration) == (ext is not None):
            return
        _deregister()
    if afresh and _state.active is backends._IMPLS[backends.Backend.COMPILED]:
        _state.compiled_blocks += 1
    originals = _capture_originals()
    if ext is not None:
        _state.library = _CompiledRegistration(ext)
        _state.originals = originals
        return
    lib = Library("aten", "IMPL")
    _state.registered_at.append(time.monotonic())
    try:
        with warnings.catch_warnings():
            # Overriding the CUDA key replaces a real kernel; upstream warns once per process.
            warnings.filterwarnings("ignore", message=_OVERRIDE_WARNING, category=UserWarning)
            for key in DISPATCH_KEYS:
                lib.impl("convolution_backward", _kernel, key, with_keyset=True)
    except BaseException:
        lib._destroy()
        raise
    _state.originals = originals
    _state.library = lib


def _deregister() -> None:
    lib, _state.library = _state.library, None
    if lib is not None:
        lib._destroy()
    if _state.compiled_blocks <= 1:
        _release_workspace()


def _release_workspace() -> None:
    """Free the compiled kernels' kept temporaries (``_C.workspace()``, csrc/cpu/workspace.h): with
    our kernel out of the dispatcher and no re-entry seen (or on :func:`release` / exit), nothing of
    ours holds memory."""
    ext = _loaded_extension()
    if ext is not None:
        ext.release_workspace()


def _sync_registration() -> None:
    if _state.stack or _state.pins or _state.observer is not None:
        _register()
    elif not _should_linger():
        _deregister()


def _should_linger() -> bool:
    """Whether an idle Python registration stays (see the module's docstring)."""
    if not isinstance(_state.library, Library):
        return False
    times = _state.registered_at
    if len(times) == LINGER_AFTER and time.monotonic() - times[0] <= LINGER_WINDOW_S:
        _state.linger = True
    return _state.linger


def release() -> bool:
    """Destroy an idle, lingering registration now: the dispatcher table is exactly as before
    (``torch._C._dispatch_dump("aten::convolution_backward")``), and the next ``enable()`` cycles
    start counting towards :data:`LINGER_AFTER` afresh, and the compiled kernels' kept temporaries
    (``_C.workspace()``), kept between blocks from the second ``enable("compiled")`` block on, are
    freed (the next block's exit frees them again, and the count starts over). Does nothing while a backend
    is enabled, :func:`pin` holds it or a trace observes. Returns whether a registration was
    destroyed."""
    with _state.lock:
        if _state.stack or _state.pins or _state.observer is not None:
            return False
        _state.registered_at.clear()
        _state.linger = False
        _state.compiled_blocks = 0
        if _state.library is None:
            _release_workspace()
            return False
        _deregister()
        return True


def is_lingering() -> bool:
    """Whether our kernel is registered but idle (every call runs the original kernel, uncounted)."""
    with _state.lock:
        idle = not (_state.stack or _state.pins or _state.observer is not None)
        return idle and _state.library is not None


def push(impl: Implementation) -> int:
    """Make ``impl`` the active backend (registering if needed); returns a token for :func:`pop`."""
    with _state.lock:
        token = next(_state.tokens)
        _state.stack.append((token, impl))
        previous, _state.active = _state.active, impl
        try:
            _sync_registration()
        except BaseException:
            _state.stack.pop()
            _state.active = previous
            _sync_registration()
            raise
        return token


def pop(token: int) -> None:
    """Undo the :func:`push` that returned ``token``; the previous active backend comes back, and
    with the last one the dispatcher is restored."""
    with _state.lock:
        for i, (t, _) in enumerate(_state.stack):
            if t == token:
                del _state.stack[i]
                break
        else:
            raise RuntimeError(f"aten_override: token {token} is not active (popped twice?)")
        _state.active = _state.stack[-1][1] if _state.stack else None
        _sync_registration()


def pin() -> None:
    """Keep the registration installed until the matching :func:`unpin`, even with no active
    backend (calls then run the original kernel). Use while other threads run backward and this one
    enters and leaves :func:`enable`: no dispatcher writes happen in between."""
    with _state.lock:
        _state.pins += 1
        try:
            _sync_registration()
        except BaseException:
            _state.pins -= 1
            raise


def unpin() -> None:
    with _state.lock:
        if _state.pins == 0:
            raise RuntimeError("aten_override: uninstall() without a matching install()")
        _state.pins -= 1
        _sync_registration()


def is_registered() -> bool:
    """Whether our kernel is registered at the dispatcher right now (also while it lingers idle,
    see :func:`is_lingering`)."""
    return _state.library is not None


def active_backend() -> str | None:
    """The name of the backend new calls go to, or ``None`` when none is enabled."""
    impl = _state.active
    return None if impl is None else impl.name


def original_kernel(device_type: str = "cpu") -> Callable:
    """The original ``aten::convolution_backward`` kernel of ``device_type``'s dispatch key, callable
    with the aten arguments. Captured before we register; when nothing is registered it is captured
    now."""
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"aten_override: original_kernel() serves the CPU and CUDA dispatch keys, got device_type={device_type!r}")
    key = device_type.upper()
    with _state.lock:
        kernel = _state.originals.get(key) if _state.library is not None else get_kernel(OP, key)
    keyset = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))

    def call(*aten_args):
        return kernel.call_boxed(keyset, *aten_args)

    call.__name__ = f"original_convolution_backward_{key.lower()}"
    return call


def set_observer(observer: Callable | None) -> Callable | None:
    """Install ``observer(keyset, aten_args, impl, route) -> (result, Decision)`` around every call
    (the tracer); returns the previous one. ``None`` removes it: then the kernel's path has no hook."""
    with _state.lock:
        previous, _state.observer = _state.observer, observer
        _sync_registration()  # an observer needs the Python kernel
        return previous


def stats() -> dict[str, object]:
    """Calls served per backend since :func:`reset_stats`: ``{"python": n, "aten": n, "fallback": n,
    "fallback_reasons": {"python: <reason>": n}}``. ``fallback`` counts calls the requested backend
    handed to the original kernel (they are counted under ``aten`` too). ``inner_calls`` counts the
    calls a backend made to the op itself (served by the original kernel inside the outer call, not
    counted as calls of their own). Calls the C++ kernel served
    are merged in; ``"compiled_layer_classes": {class: n}`` counts the compiled backend's calls per
    layer class (``compiled.LAYER_CLASSES``; ``dense``/``transposed`` ran native by choice),
    ``"compiled_kernels": {kernel: n}`` per kernel that ran (``native`` where the table or the
    autotuner chose it), and ``"compiled_tuning": {"signatures": n, "us": t, "evicted_bytes": b}``
    what tuning cost (microseconds) and the bytes it evicted from the caches around its timed runs
    (CPUs with ``clflushopt``; 0 elsewhere, or where the call's tensors exceed the caches), when any
    signature was tuned; ``"compiled_rescaled": n`` the calls it computed on operands x 2^k because
    their gradients underflow (``_C.subnormal_cost()``), when any; ``"compiled_non_finite": {"declined":
    n, "skipped": m}`` the declines of a chosen kernel of ours (an inf / NaN: native computed the call
    after it; a call served rescaled and retried may decline twice) and the calls sent to native
    without running it (their signature's last call was declined and an operand still holds an inf /
    NaN; never in deterministic mode), when any."""
    with _state.counts_lock:
        counts = Counter(_state.counts)
        reasons = Counter(_state.fallback_reasons)
    ext = _loaded_extension()
    layer_classes = {}
    if ext is not None:
        cpp = ext.stats()
        counts["compiled"] += cpp["served"]
        counts["aten"] += cpp["fallback"]
        counts["fallback"] += cpp["fallback"]
        reasons.update({f"compiled: {r}": n for r, n in cpp["fallback_reasons"].items()})
        layer_classes = cpp["layer_classes"]
        kernels = cpp["kernels"]
        tuning = {"signatures": cpp["tunings"], "us": cpp["tune_us"], "evicted_bytes": cpp["evicted_bytes"]}
        rescaled = cpp["rescaled"]
        non_finite = {"declined": cpp["declined"], "skipped": cpp["skipped"]}
    out: dict[str, object] = {k: n for k, n in counts.items() if n}
    out["fallback_reasons"] = dict(reasons)
    if layer_classes:
        out["compiled_layer_classes"] = dict(layer_classes)
    if ext is not None and kernels:
        out["compiled_kernels"] = dict(kernels)
    if ext is not None and tuning["signatures"]:
        out["compiled_tuning"] = tuning
    if ext is not None and rescaled:
        out["compiled_rescaled"] = rescaled
    if ext is not None and any(non_finite.values()):
        out["compiled_non_finite"] = non_finite
    return out


def reset_stats() -> None:
    with _state.counts_lock:
        _state.counts.clear()
        _state.fallback_reasons.clear()
    ext = _loaded_extension()
    if ext is not None:
        ext.reset_stats()


def _loaded_extension():
    """``aten_override._C`` if the compiled backend module was imported and the extension loaded."""
    import sys

    compiled = sys.modules.get("aten_override.ops.convolution_backward.compiled")
    return None if compiled is None else compiled.extension()


@atexit.register
def _restore_at_exit() -> None:
    with _state.lock:
        _state.stack.clear()
        _state.pins = 0
        _state.active = None
        _state.observer = None
        _state.linger = False
        _state.compiled_blocks = 0
        _deregister()

