r"""``aten_override.trace()``: which implementation served each ``aten::convolution_backward``.

PyTorch's own tools do not say which kernel ran a convolution backward: the profiler shows
``aten::convolution_backward`` but not whether oneDNN, cuDNN or a slow path served it,
``TORCH_SHOW_DISPATCH_TRACE`` prints nothing in release wheels, and a ``TorchDispatchMode`` sees
the arguments but not the kernel. :class:`trace` hooks into our kernel
(:func:`aten_override._registration.set_observer`) and records, per call:

- a call id, the thread, the autograd node and the module that owns the convolution
  (``Net.body.0``, named as ``torch.distributed._tools.ModTracker`` names modules: the root's class,
  then attribute names), found by global module forward hooks installed only while tracing, which
  tag the autograd nodes created inside each module (``node.metadata``);
- every argument, with shape, stride, dtype, device and memory format of the tensors;
- which backend ran it, or that it fell back to the original kernel and why;
- the backend upstream would have chosen (``torch._C._select_conv_backend``) and the global flags
  upstream reads at backward time (deterministic, cuDNN/oneDNN enabled, ``fp32_precision``);
- the wall time in microseconds (CUDA: ``torch.cuda.Event``), and with ``verify=True`` the error
  against the original kernel on the same inputs.

Lines read like ``torch.testing._internal.logging_tensor`` (``$n`` tensor ids, ``f32[8, 64, 56,
56]``) and also go to ``logging.getLogger("aten_override.trace")`` at INFO level. Traces export to
JSON (:meth:`trace.save`, read back with :func:`load`) and to the Chrome trace format (opens in
Perfetto / ``chrome://tracing``); ``trace(path)`` streams records to ``path`` as JSON lines while the
run goes on. Memory is bounded: the last ``keep`` records and running aggregates of every call per
(module, shapes, backend) group; ``every=``, ``first=`` and ``aggregate_only=`` sample the records.
Profiler ranges (``aten_override::convolution_backward[<backend>]``) come from
:mod:`aten_override._registration`, traced or not.

With no trace active the kernel's path has no hook (the observer is ``None``) and no module hooks
are installed.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import functools
import itertools
import json
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.utils._dtype_abbrs import dtype_abbrs
from torch.utils._python_dispatch import TorchDispatchMode

from . import _registration
from .ops.convolution_backward.args import (
    ConvolutionBackwardArgs,
    canonical_call,
    empty_like_native,
    native_backend,
    native_defect_reason,
    output_memory_format,
    significant_strides,
)

__all__ = ["trace", "CallRecord", "OpRecord", "TensorInfo", "Verification", "TraceData", "Aggregates", "load", "default_tolerance"]

log = logging.getLogger("aten_override.trace")

FORMAT = "aten_override.trace"
FORMAT_VERSION = 1
"""Version of the one-document JSON of :meth:`TraceData.save`."""
STREAM_VERSION = 2
"""Version of the JSON-lines file ``trace(path)`` streams: a header line ``{"format", "version",
"environment", "options"}``, one line per record (``{"type": "call", ...}`` / ``{"type": "op",
...}``, tensors as ``{"$": [id, shape, stride, dtype, device, memory_format]}``) and a footer
``{"type": "summary", "aggregates": {...}}``."""
MODULE_KEY = "aten_override.module"
_ARG_NAMES = tuple(f.name for f in dataclasses.fields(ConvolutionBackwardArgs))
_OUTPUT_NAMES = ("grad_input", "grad_weight", "grad_bias")

# torch._C._ConvBackend in 2.13 has no member for value 9 (MkldnnTranspose) and a member literally
# named "MpsTranspose," (see ConvUtils.h vs. Module.cpp's py::enum_).
_CONV_BACKEND_NAMES = {int(v): k.rstrip(",") for k, v in torch._C._ConvBackend.__members__.items()}
_CONV_BACKEND_NAMES.setdefault(9, "MkldnnTranspose")


def conv_backend_name(backend: torch._C._ConvBackend) -> str:
    """The name of a ``torch._C._ConvBackend`` value, including the ones 2.13 does not expose."""
    return _CONV_BACKEND_NAMES.get(int(backend), f"ConvBackend({int(backend)})")


# --- records -----------------------------------------------------------------------------------


@dataclasses.dataclass
class TensorInfo:
    """A tensor as the trace sees it: ``id`` is its ``$n`` within the trace; ``memory_format`` is
    ``"contiguous"``, ``"channels_last"``, ``"channels_last_3d"`` or ``"strided"``."""

    id: int
    shape: list[int]
    stride: list[int]
    dtype: str
    device: str
    memory_format: str

    def __str__(self) -> str:
        text = f"${self.id}: {_short_dtype(self.dtype)}[{', '.join(map(str, self.shape))}]"
        if self.memory_format in ("channels_last", "channels_last_3d"):
            text += "{" + self.memory_format + "}"
        elif self.memory_format == "strided":
            text += "{stride=[" + ", ".join(map(str, self.stride)) + "]}"
        if self.device != "cpu":
            text += f"@{self.device}"
        return text


@dataclasses.dataclass
class Verification:
    """A call compared with the original kernel on the same inputs (``verify=True``).

    The original's result is the original kernel's on the same inputs; where that kernel is known to
    crash or be wrong (``reference`` says why), the original kernel's result on float64 copies, rounded
    into the layout and dtype it gives the call (float64 takes no oneDNN path on the CPU).

    Per requested output, ``max_abs`` is ``max |ours - original|`` and ``max_rel`` is
    ``max_abs / max |original|`` (the fields hold the largest over the outputs); ``ok`` is ``max_abs
    <= atol + rtol * max |original|`` for every output, with matching shapes and dtypes. ``strides_match`` is reported apart: a layout difference is a bug but not a
    numerical one. Strides are compared on the dims of size > 1 (``args.significant_strides``: a size-1
    dim's stride carries no layout), as the test bed's ``check_tensor`` compares them.
    """

    max_abs: float
    max_rel: float
    rtol: float
    atol: float
    strides_match: bool
    ok: bool
    mismatches: list[str] = dataclasses.field(default_factory=list)
    # "original", or where the original kernel is known to crash or be wrong on the call
    # (``args.native_defect_reason``) what stood in for it and why
    reference: str = "original"


# The host time (ns) the outermost trace measured for the call in progress on this thread: nested traces
# report it, not their own span around the outer traces' observers.
_call_time = threading.local()


def _original_result(keyset, aten_args: tuple, args: ConvolutionBackwardArgs) -> tuple[tuple, str]:
    """The original kernel's result for ``verify`` and what it is (``Verification.reference``).

    Where the original kernel is known to crash, hang or be wrong on the call, it runs on a stand-in
    and its result is laid out in the strides and dtype it gives the call (``args.empty_like_native``):
    on float64 copies for torch 2.13's oneDNN defects (``args.native_defect_reason``), and on the same
    values with canonical strides where a size-1 dim has an odd stride (``args.canonical_call``: the
    grouped channels-last ``grad_weight`` reads it)."""
    go, x, w = args.grad_output, args.input, args.weight
    reason = native_defect_reason(
        device_type=args.device_type, dtype=go.dtype, transposed=args.transposed, input_size=list(x.shape[2:]),
        grad_output_size=list(go.shape[2:]), kernel=list(w.shape[2:]), stride=args.stride, padding=args.padding,
        dilation=args.dilation, groups=int(args.groups), c_in=x.shape[1], c_out=go.shape[1])
    canonical = canonical_call(args)
    if reason is None and canonical is args:
        return _registration.call_original(keyset, aten_args), "original"
    run = canonical.as_aten_args()
    if reason is not None:
        run = tuple(a.double() if isinstance(a, torch.Tensor) else a for a in run)
    gi, gw, gb = _registration.call_original(keyset, run)
    backend = native_backend(args)
    fmt = output_memory_format(args, backend)
    if gi is not None:
        gi = empty_like_native(x, fmt, backend, is_input=True).copy_(gi)
    if gw is not None:
        gw = empty_like_native(w, fmt, backend).copy_(gw)
    if gb is not None:
        gb = gb.to(go.dtype)
    stand_ins = ([f"in float64: {reason}"] if reason is not None else []) + (
        [] if canonical is args else ["on canonical strides of size-1 dims (args.canonical_call)"])
    return (gi, gw, gb), "the original kernel " + "; ".join(stand_ins)


@dataclasses.dataclass
class CallRecord:
    """One ``aten::convolution_backward`` call. ``id`` numbers every call the trace saw, recorded or
    not (gaps show sampling). Times are in microseconds; ``start_us`` is host time since the trace
    began. ``time_us`` is measured with CUDA events for CUDA tensors
    (``timer="cuda_event"``) and equals ``host_us`` on CPU; it is ``None`` when timing is off."""

    id: int
    thread: str
    thread_id: int
    module: str | None
    node: str | None
    args: dict[str, Any]
    outputs: list[TensorInfo | None]
    requested: str
    backend: str
    fallback_reason: str | None
    native_backend: str | None
    flags: dict[str, Any]
    start_us: float
    host_us: float | None
    time_us: float | None
    timer: str
    verify: Verification | None = None
    error: str | None = None
    kernel: str | None = None  # the compiled backend's kernel: "compiled/depthwise-lanes", "compiled/native"
    tuning: dict | None = None  # on the call that tuned its signature: {"times_us": {...}, "rejected": {...}}
    # k > 0: the compiled backend computed the call on grad_output (or input and weight) x 2^k, its results
    # x 2^-k (gradients in the subnormal range: ``_C.subnormal_cost()``)
    rescale_exponent: int = 0
    inner_calls: int = 0  # calls the backend made to aten::convolution_backward itself (original kernel)

    @property
    def served_by(self) -> str:
        """The backend, or the compiled backend's kernel (``compiled/gemm-im2col``)."""
        return self.kernel or self.backend

    @property
    def fallback(self) -> bool:
        return self.fallback_reason is not None

    def to_json(self) -> dict:
        """A JSON-ready dict (``"type": "call"``), faster than ``dataclasses.asdict``."""
        d = dict(self.__dict__)  # TensorInfo values: _ENCODER's default writes their fields
        d["type"] = "call"
        if self.verify is not None:
            d["verify"] = dataclasses.asdict(self.verify)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> CallRecord:
        d = dict(d)
        d.pop("type", None)
        d["args"] = {k: _tensor_info_from(v) for k, v in d["args"].items()}
        d["outputs"] = [_tensor_info_from(v) for v in d["outputs"]]
        d["verify"] = Verification(**d["verify"]) if d.get("verify") else None
        return cls(**d)


@dataclasses.dataclass
class OpRecord:
    """Any other aten op run by the autograd engine while tracing with ``ops=True``."""

    seq: int
    thread: str
    thread_id: int
    op: str
    node: str | None
    module: str | None
    args: list[Any]
    outputs: list[Any]
    start_us: float
    host_us: float | None

    def to_json(self) -> dict:
        d = dict(self.__dict__)
        d["type"] = "op"
        return d

    @classmethod
    def from_dict(cls, d: dict) -> OpRecord:
        d = dict(d)
        d.pop("type", None)
        d["args"] = [_tensor_info_from(v) for v in d["args"]]
        d["outputs"] = [_tensor_info_from(v) for v in d["outputs"]]
        return cls(**d)


_PLAIN = frozenset({int, float, bool, str, type(None)})
_IDS_MIN_SWEEP = 256
"""The ``$n`` table of :meth:`trace._tensor_id` is first swept of dead tensors at this size."""


def _encode_default(value):
    """``json`` hook: a :class:`TensorInfo` as its fields, anything else as ``str``."""
    if type(value) is TensorInfo:
        return value.__dict__
    return str(value)


def _encode_compact(value):
    """``json`` hook of the streamed file: a :class:`TensorInfo` as ``{"$": [id, shape, stride,
    dtype, device, memory_format]}`` (a fifth less to write and encode than its fields by name)."""
    if type(value) is TensorInfo:
        d = value.__dict__
        return {"$": [d["id"], d["shape"], d["stride"], d["dtype"], d["device"], d["memory_format"]]}
    return str(value)


_ENCODER = json.JSONEncoder(default=_encode_compact, check_circular=False, separators=(",", ":"))


def _tensor_info_from(value):
    if isinstance(value, dict):
        if value.keys() == {"$"}:  # the streamed file's compact form
            return TensorInfo(*value["$"])
        if value.keys() == {f.name for f in dataclasses.fields(TensorInfo)}:
            return TensorInfo(**value)
    if isinstance(value, list):
        return [_tensor_info_from(v) for v in value]
    return value


def _short_dtype(dtype: str) -> str:
    return _DTYPE_ABBRS.get(dtype, dtype)


_DTYPE_ABBRS = {str(k).removeprefix("torch."): v for k, v in dtype_abbrs.items()}


def _memory_format(t: torch.Tensor) -> str:
    if t.is_contiguous():
        return "contiguous"
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last):
        return "channels_last"
    if t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d):
        return "channels_last_3d"
    return "strided"


@functools.lru_cache(maxsize=None)
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@functools.lru_cache(maxsize=64)
def _device_name(device: torch.device) -> str:
    return str(device)


def default_tolerance(dtype: torch.dtype | str, device_type: str = "cpu") -> tuple[float, float]:
    """``(rtol, atol)`` for ``verify``, normwise: a call passes if ``max |ours - original| <= atol +
    rtol * max |original|``. A convolution backward sums ``N * prod(spatial_out)`` (weight) or
    ``C_out * prod(kernel)`` (input) products, so the bounds are looser than
    ``torch.testing.assert_close``'s elementwise ones; float32 on CUDA allows TF32 when
    ``torch.backends.cudnn.conv.fp32_precision`` is ``"tf32"`` (upstream's default)."""
    name = str(dtype).removeprefix("torch.")
    if name == "float32" and device_type == "cuda" and torch.backends.cudnn.conv.fp32_precision == "tf32":
        return 5e-3, 1e-5
    return {
        "float64": (1e-10, 1e-12),
        "float32": (1e-4, 1e-6),
        "float16": (1e-2, 1e-4),
        "bfloat16": (5e-2, 1e-3),
    }.get(name, (0.0, 0.0))


def current_flags() -> dict[str, Any]:
    """The global flags ``at::native::convolution_backward`` reads at backward time (the getters
    behind ``torch.backends.{cudnn,mkldnn}`` and ``torch.are_deterministic_algorithms_enabled``)."""
    C = torch._C
    return {
        "deterministic": C._get_deterministic_algorithms(),
        "mkldnn_enabled": C._get_mkldnn_enabled(),
        "mkldnn_fp32_precision": C._get_fp32_precision_getter("mkldnn", "conv"),
        "cudnn_enabled": C._get_cudnn_enabled(),
        "cudnn_benchmark": C._get_cudnn_benchmark(),
        "cudnn_deterministic": C._get_cudnn_deterministic(),
        "cudnn_fp32_precision": C._get_fp32_precision_getter("cuda", "conv"),
    }


# --- module attribution ------------------------------------------------------------------------


class _ModuleTagger:
    """Global module hooks (installed only while tracing) that tag autograd nodes with the module
    whose forward created them. Names follow ``ModTracker``: the outermost module is its class
    name, submodules are the dotted path of ``named_modules`` (``Net.layer1.0.conv2``).

    The forward hook walks back from the outputs' ``grad_fn`` to the inputs' ``grad_fn`` and tags
    every node on the way that has no tag yet; inner modules' hooks run first, so each node gets the
    innermost module that created it. The walk costs O(nodes created inside the module) per module
    call, only while tracing. Under ``torch.compile`` the hooks do nothing: calls are attributed to
    the compiled module as a whole (``OptimizedModule``).
    """

    def __init__(self) -> None:
        self.names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.local = threading.local()
        self.handles: list = []

    def install(self) -> None:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        self.handles = [
            register_module_forward_pre_hook(self._pre_hook),
            register_module_forward_hook(self._post_hook, always_call=True),
        ]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def _stack(self) -> list:
        stack = getattr(self.local, "stack", None)
        if stack is None:
            stack = self.local.stack = []
        return stack

    def _name(self, module, parent) -> str:
        name = self.names.get(module)
        if name is None:
            if parent is not None:
                parent_module, parent_name = parent
                # named_modules, not named_children: containers such as ModuleList are never called
                for child, path in _named_descendants(parent_module, parent_name):
                    self.names.setdefault(child, path)
                name = self.names.get(module)
            if name is None:
                name = self.names[module] = type(module).__name__
        return name

    def _pre_hook(self, module, args) -> None:
        if torch.compiler.is_compiling():
            return
        stack = self._stack()
        name = self._name(module, stack[-1][:2] if stack else None)
        # (global pre-hooks do not see kwargs)
        stops = {id(a.grad_fn) for a in _tensors(args) if a.grad_fn is not None}
        stack.append((module, name, stops))

    def _post_hook(self, module, args, output) -> None:
        if torch.compiler.is_compiling():
            return
        stack = self._stack()
        if not stack or stack[-1][0] is not module:
            return
        _, name, stops = stack.pop()
        if output is None or not torch.is_grad_enabled():
            return
        todo = [t.grad_fn for t in _tensors(output) if t.grad_fn is not None]
        seen = set(stops)
        while todo:
            node = todo.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            node.metadata.setdefault(MODULE_KEY, name)  # inner modules tagged theirs already
            todo.extend(n for n, _ in node.next_functions)


def _named_descendants(module, prefix: str):
    for path, child in module.named_modules(prefix=prefix):
        if child is not module:
            yield child, path


def _tensors(value) -> Iterable[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def _current_node() -> tuple[str | None, str | None]:
    node = torch._C._current_autograd_node()
    if node is None:
        return None, None
    return type(node).__name__, node.metadata.get(MODULE_KEY)


# --- the tracer --------------------------------------------------------------------------------


class trace(contextlib.ContextDecorator):
    r"""Record every ``aten::convolution_backward`` call (and with ``ops=True`` every aten op the
    autograd engine runs) while active, in bounded memory whatever the run's length.

    Works with or without :func:`aten_override.enable`: when no backend is enabled the trace keeps
    our kernel registered (:func:`aten_override.install`) so native calls are recorded with
    ``backend="aten"``; on exit the dispatcher is as before
    (``torch._C._dispatch_dump("aten::convolution_backward")``).

    What is kept:

    - **aggregates** of every call, per group (module, ``input`` and ``weight`` dtype and shape,
      the backend or kernel that served it, fallback or not): calls, total time; fallback reasons,
      verification and error counts. :meth:`summary` prints them. Memory grows with the number of
      groups, not of calls.
    - **records** (:class:`CallRecord`, :class:`OpRecord`) of the calls the sampling options select:
      the last ``keep`` in memory (:attr:`calls`, :attr:`ops`), and all of them streamed to
      ``path`` as they happen. Calls that fail verification or raise are always recorded.

    Args:
        path: stream records to this file as JSON lines (a header line, one line per record,
            flushed line by line, and a ``summary`` footer with the aggregates on exit, at
            interpreter exit, or — under ``python -m aten_override run`` — on SIGINT/SIGTERM).
            A process killed before the footer leaves a valid file without it; :func:`load` then
            recomputes the summary from the records. ``None``: records stay in memory only.
        verify: also run the original kernel on the same inputs of every call and record the
            error (:class:`Verification`); :meth:`failures` lists the calls beyond tolerance.
        rtol, atol: override :func:`default_tolerance` for ``verify``.
        ops: also record every other aten op run in the backward pass (ops that run while
            ``torch._C._current_autograd_node()`` is set), with a ``TorchDispatchMode``. Dispatch
            modes are thread-local: ops of a backward run on a thread started inside the block are
            not recorded (its ``convolution_backward`` calls are). It costs a Python call per op,
            forward ops included.
        timing: measure each call (``time.perf_counter_ns``; CUDA: events, synchronised on exit).
        log: emit each recorded call's lines to ``logging.getLogger("aten_override.trace")`` at
            INFO level.
        native: ask ``torch._C._select_conv_backend`` which backend upstream would have chosen
            (once per group, on its first call).
        keep: how many records :attr:`calls` (and :attr:`ops`) hold: the last ``keep``; ``None``
            keeps every one (memory then grows with the run, ~4 KB a call).
        every: record every ``every``-th call of each group (the 1st, ``every+1``-th, ...).
        first: record only the first ``first`` calls of each group.
        aggregate_only: record nothing, keep the aggregates only (the cheapest mode: a few
            microseconds a call, ``scripts/trace_overhead.py``).

    Attributes:
        calls: the last ``keep`` recorded :class:`CallRecord`\ s, in call order (a new list).
        ops: the last ``keep`` :class:`OpRecord`\ s (``ops=True``).
        path: the streamed file, or ``None``.

    Raises:
        RuntimeError: on entering a trace object that is already active (nest a new one instead).
            Exceptions of the backend propagate unchanged; their call is recorded with ``error``.
        ValueError: ``every``, ``first`` or ``keep`` below 1 (``keep`` may be ``None``).
        OSError: ``path`` cannot be opened for writing (on entering).

    Example::

        >>> with aten_override.enable("python"), aten_override.trace(verify=True) as t:
        ...     model(x).sum().backward()
        >>> print(t.summary())
        >>> t.save("trace.json"); t.save_chrome_trace("trace.chrome.json")
        >>> with aten_override.trace("run.jsonl", first=3, keep=100):  # a long run
        ...     train(epochs=90)
        >>> print(aten_override.tracing.load("run.jsonl").summary())
    """

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        *,
        verify: bool = False,
        rtol: float | None = None,
        atol: float | None = None,
        ops: bool = False,
        timing: bool = True,
        log: bool = True,
        native: bool = True,
        keep: int | None = 1_000,
        every: int = 1,
        first: int | None = None,
        aggregate_only: bool = False,
    ):
        for name, value in (("every", every), ("first", first), ("keep", keep)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"aten_override.trace: {name} must be a positive integer, got {value!r}")
        self.path = None if path is None else os.fspath(path)
        self.verify = verify
        self.rtol, self.atol = rtol, atol
        self.record_ops = ops and not aggregate_only
        self.timing = timing
        self.log = log
        self.native = native
        self.keep = keep
        self.every = every
        self.first = first
        self.aggregate_only = aggregate_only
        self._calls: collections.deque = collections.deque(maxlen=keep)
        self._ops: collections.deque = collections.deque(maxlen=keep)
        self._agg = _LiveAggregates()
        self._lock = threading.Lock()
        self._active = False
        self._file = None

    @property
    def calls(self) -> list[CallRecord]:
        return list(self._calls)

    @property
    def ops(self) -> list[OpRecord]:
        return list(self._ops)

    # -- lifecycle ------------------------------------------------------------------------------

    def __enter__(self) -> trace:
        if self._active:
            raise RuntimeError("aten_override.trace: this trace is already active (create a new one to nest)")
        self._calls.clear()
        self._ops.clear()
        self._agg = _LiveAggregates()
        self._ids: dict[int, tuple[weakref.ref, int]] = {}
        self._ids_lock = threading.RLock()
        self._ids_sweep_at = _IDS_MIN_SWEEP
        self._next_tensor_id = itertools.count()
        self._next_call_id = itertools.count(1)
        self._pending_events: list = []
        self._t0 = time.perf_counter_ns()
        self._tagger = _ModuleTagger()
        self._exit = contextlib.ExitStack()
        try:
            if self.path is not None:
                # line-buffered: every record reaches the OS as one write, so a killed process
                # leaves whole lines
                self._file = open(self.path, "w", buffering=1)
                self._exit.callback(self._close_file)
                self._write({"format": FORMAT, "version": STREAM_VERSION, "environment": _environment(),
                             "options": self._options()})
                atexit.register(self._close_file)
                self._exit.callback(atexit.unregister, self._close_file)
            _registration.pin()
            self._exit.callback(_registration.unpin)
            self._previous_observer = _registration.set_observer(self._observe)
            self._exit.callback(_registration.set_observer, self._previous_observer)
            self._tagger.install()
            self._exit.callback(self._tagger.remove)
            if self.record_ops:
                self._exit.enter_context(_OpRecorder(self))
        except BaseException:
            self._exit.close()
            raise
        self._active = True
        return self

    def __exit__(self, *exc) -> None:
        self._active = False
        try:
            self._exit.close()
        finally:
            self._resolve_cuda_times()

    def _options(self) -> dict:
        return {"verify": self.verify, "ops": self.record_ops, "keep": self.keep, "every": self.every,
                "first": self.first, "aggregate_only": self.aggregate_only}

    def _write(self, obj: dict) -> None:
        f = self._file
        if f is not None:
            f.write(_ENCODER.encode(obj) + "\n")

    def _close_file(self) -> None:
        """Write the summary footer and close the streamed file (once; also at interpreter exit)."""
        with self._lock:
            f = self._file
            if f is None:
                return
            try:
                self._resolve_cuda_times_locked(self._pending_events)
                self._pending_events = []
                self._write({"type": "summary", "aggregates": self._agg.snapshot().to_dict()})
            finally:
                self._file = None
                f.close()

    # -- the observer ---------------------------------------------------------------------------

    def _route(self, keyset, aten_args, impl, route):
        previous = self._previous_observer
        if previous is not None:  # an outer trace records this call too
            return previous(keyset, aten_args, impl, route)
        return route(keyset, aten_args, impl)

    def _call_end(self, start: int) -> int:
        """The call's end on the host clock, ``start`` plus the call's own time: ours, or, under an outer
        trace, the time that trace measured (ours would include its bookkeeping and its verify's rerun of
        the original kernel). Published for a trace inside this one."""
        elapsed = time.perf_counter_ns() - start
        if self._previous_observer is not None and getattr(_call_time, "ns", None) is not None:
            elapsed = _call_time.ns
        _call_time.ns = elapsed
        return start + elapsed

    def _observe(self, keyset, aten_args: tuple, impl, route):
        call_id = next(self._next_call_id)  # every call gets its number, recorded or not
        node = torch._C._current_autograd_node()
        module = node.metadata.get(MODULE_KEY) if node is not None else None
        grad_output, x, w = aten_args[0], aten_args[1], aten_args[2]
        cuda = self.timing and grad_output.is_cuda
        events = None
        if cuda:
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        start = time.perf_counter_ns()
        _call_time.ns = None
        try:
            result, decision = self._route(keyset, aten_args, impl, route)
        except BaseException as e:
            end = self._call_end(start)
            if events is not None:
                events[1].record()
            record = self._record(call_id, aten_args, impl, module, node, start, end, events)
            record.error = f"{type(e).__name__}: {e}"
            record.inner_calls = _registration.inner_calls()
            # how the call was routed before it raised (None: it raised choosing, e.g. on invalid arguments)
            decision = _registration.last_decision()
            if decision is not None:
                record.backend, record.fallback_reason = decision.backend, decision.reason
            with self._lock:
                group = self._agg.group(module, x, w, record.backend, record.fallback_reason is not None, self, aten_args)
                group.calls += 1
                record.native_backend = group.native
                if record.fallback_reason is not None:
                    self._agg.add_fallback(decision)
                self._agg.add_error(record)
            self._add(record, events, group)
            raise
        end = self._call_end(start)
        if events is not None:
            events[1].record()
        served, fallback = decision.backend, decision.reason is not None
        kernel = tuning = None
        rescale_exponent = 0
        if served == "compiled":
            kernel, tuning, rescale_exponent = _compiled_kernel()
        verification = None
        if self.verify:
            verification = self._verify(keyset, aten_args, ConvolutionBackwardArgs(*aten_args), result, decision)
        failed = verification is not None and not (verification.ok and verification.strides_match)
        agg = self._agg
        with self._lock:
            group = agg.group(module, x, w, kernel or served, fallback, self, aten_args)
            n = group.calls = group.calls + 1
            if self.timing and events is None:
                group.total_us += (end - start) / 1e3
            if fallback:
                agg.add_fallback(decision)
            if verification is not None:
                agg.verified += 1
        if failed or (
            not self.aggregate_only
            and (self.every == 1 or (n - 1) % self.every == 0)
            and (self.first is None or n <= self.first)
        ):
            record = self._record(call_id, aten_args, impl, module, node, start, end, events)
            record.native_backend = group.native
            record.outputs = [self._describe(t) for t in result]
            record.backend, record.fallback_reason = served, decision.reason
            record.kernel, record.tuning, record.rescale_exponent = kernel, tuning, rescale_exponent
            record.verify = verification
            record.inner_calls = _registration.inner_calls()
            if failed:
                with self._lock:
                    agg.add_failure(record)
            self._add(record, events, group)
        elif events is not None:
            with self._lock:
                self._pend((None, events, group))
        return result, decision

    def _record(self, call_id, aten_args, impl, module, node, start, end, events) -> CallRecord:
        host_us = (end - start) / 1e3 if self.timing else None
        return CallRecord(
            id=call_id,
            thread=threading.current_thread().name,
            thread_id=threading.get_ident(),
            module=module,
            node=type(node).__name__ if node is not None else None,
            args={name: self._describe(value) for name, value in zip(_ARG_NAMES, aten_args)},
            outputs=[None, None, None],
            requested=impl.name,
            backend=impl.name,
            fallback_reason=None,
            native_backend=None,
            flags=current_flags(),
            start_us=(start - self._t0) / 1e3,
            host_us=host_us,
            time_us=host_us if events is None else None,
            timer="cuda_event" if aten_args[0].is_cuda else "cpu",
        )

    @staticmethod
    def _native_backend(aten_args) -> str:
        try:
            return conv_backend_name(native_backend(ConvolutionBackwardArgs(*aten_args)))
        except Exception as e:  # invalid arguments: the backend reports them
            return f"? ({type(e).__name__})"

    def _add(self, record: CallRecord, events, group=None) -> None:
        with self._lock:
            self._calls.append(record)
            self._agg.recorded += 1
            if events is not None:
                self._pend((record, events, group))
            else:
                self._write(record.to_json())
        if self.log and log.isEnabledFor(logging.INFO):
            for line in format_call(record, times=self.timing):
                log.info("%s", line)

    def _pend(self, item) -> None:
        """Queue a CUDA call's events (lock held); resolve the oldest half when 256 wait, so the
        queue stays bounded (they have long completed then: synchronising costs nothing)."""
        self._pending_events.append(item)
        if len(self._pending_events) >= 256:
            self._resolve_cuda_times_locked(self._pending_events[:128])
            del self._pending_events[:128]

    def _add_op(self, record: OpRecord) -> None:
        with self._lock:
            self._ops.append(record)
            self._write(record.to_json())

    def _describe(self, value):
        kind = type(value)
        if kind in _PLAIN:
            return value
        if kind is list or kind is tuple:
            return [v if type(v) in _PLAIN else self._describe(v) for v in value]
        if isinstance(value, torch.Tensor):
            return self._tensor_info(value)
        if isinstance(value, torch.SymInt):
            return str(value)
        return value

    def _tensor_id(self, t: torch.Tensor) -> int:
        """``$n`` of ``t``: stable while ``t`` lives; a new tensor at a reused address gets a new n.

        The table maps ``id(t)`` to a weak reference *without a callback* and ``n``: an entry whose
        reference is dead belongs to a tensor that is gone (its address may hold a new tensor, which
        then gets a new n). Dead entries are dropped by :meth:`_sweep_ids` when the table has grown
        to twice its size after the last sweep (at least ``_IDS_MIN_SWEEP``), so it stays bounded
        by the live tensors at amortized O(1) per call. No callback, because CPython ignores an
        exception raised inside a weakref callback (it prints "Exception ignored in: ..." and goes
        on): with one callback per traced tensor, a SIGTERM / Ctrl-C whose handler ran inside it was
        lost, and ``aten_override run`` never exited (see :mod:`aten_override.cli.run`).

        The lookup takes no lock (a live entry is never removed); adding and sweeping do, so a sweep
        cannot drop the entry another thread just added at a reused address. The lock is reentrant:
        an allocation here may run the garbage collector, and a finalizer may trace a tensor."""
        key = id(t)
        entry = self._ids.get(key)
        if entry is not None and entry[0]() is t:
            return entry[1]
        with self._ids_lock:
            entry = self._ids.get(key)  # another thread may have numbered t meanwhile
            if entry is not None and entry[0]() is t:
                return entry[1]
            n = next(self._next_tensor_id)
            self._ids[key] = (weakref.ref(t), n)
            if len(self._ids) >= self._ids_sweep_at:
                self._sweep_ids()
        return n

    def _sweep_ids(self) -> None:
        """Drop the entries of dead tensors (``_ids_lock`` held); the next sweep comes when the
        table has doubled, so each costs O(1) per entry added since the previous one."""
        ids = self._ids
        for key, entry in list(ids.items()):
            if entry[0]() is None and ids.get(key) is entry:  # not re-added by a reentrant call
                del ids[key]
        self._ids_sweep_at = max(2 * len(ids), _IDS_MIN_SWEEP)

    def _tensor_info(self, t: torch.Tensor) -> TensorInfo:
        strided = t.layout is torch.strided
        return TensorInfo(
            id=self._tensor_id(t),
            shape=list(t.shape),
            stride=list(t.stride()) if strided else [],
            dtype=_dtype_name(t.dtype),
            device=_device_name(t.device),
            memory_format=_memory_format(t) if strided else str(t.layout).removeprefix("torch."),
        )

    def _verify(self, keyset, aten_args, args: ConvolutionBackwardArgs, result, decision) -> Verification:
        default_rtol, default_atol = default_tolerance(args.input.dtype, args.device_type)
        rtol = default_rtol if self.rtol is None else self.rtol
        atol = default_atol if self.atol is None else self.atol
        if decision.backend == "aten":  # served by the original kernel: nothing to compare
            return Verification(0.0, 0.0, rtol, atol, True, True)
        expected, reference = _original_result(keyset, aten_args, args)
        max_abs = max_rel = 0.0
        strides_match = within = True
        mismatches = []
        for name, asked, ours, ref in zip(_OUTPUT_NAMES, args.output_mask, result, expected):
            if not asked and ours is None:
                # an output the mask leaves out is None, as the schema says, where the original's
                # oneDNN path returns an unasked grad_weight (the README's table of deliberate differences)
                continue
            if ours is None or ref is None:
                if (ours is None) != (ref is None):
                    within = False
                    mismatches.append(f"{name}: {'None' if ours is None else 'a tensor'} vs. the original's")
                continue
            if ours.shape != ref.shape or ours.dtype != ref.dtype:
                within = False
                mismatches.append(
                    f"{name}: {_short_dtype(str(ours.dtype).removeprefix('torch.'))}{list(ours.shape)} vs. "
                    f"the original's {_short_dtype(str(ref.dtype).removeprefix('torch.'))}{list(ref.shape)}"
                )
                continue
            if significant_strides(ours) != significant_strides(ref):
                strides_match = False
                mismatches.append(f"{name}: stride {list(ours.stride())} vs. the original's {list(ref.stride())}")
            if ours.numel() == 0:
                continue
            diff = (ours.double() - ref.double()).abs().max().item()
            scale = ref.double().abs().max().item()
            rel = diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)
            max_abs, max_rel = max(max_abs, diff), max(max_rel, rel)
            if not diff <= atol + rtol * scale:  # also catches NaN
                within = False
                mismatches.append(f"{name}: max_abs={diff:.3g} max_rel={rel:.3g} beyond tolerance")
        return Verification(max_abs, max_rel, rtol, atol, strides_match, within, mismatches, reference)

    def _resolve_cuda_times(self) -> None:
        with self._lock:
            self._resolve_cuda_times_locked(self._pending_events)
            self._pending_events = []

    def _resolve_cuda_times_locked(self, pending) -> None:
        """CUDA event times of ``pending`` ``(record or None, events, group)``: into the record (then
        streamed) and the group's total."""
        for record, (start, end), group in pending:
            end.synchronize()
            us = start.elapsed_time(end) * 1e3
            if group is not None:
                group.total_us += us
            if record is not None:
                record.time_us = us
                self._write(record.to_json())

    # -- results --------------------------------------------------------------------------------

    def data(self) -> TraceData:
        """The kept records and the aggregates of every call as a :class:`TraceData` (what
        :meth:`save` writes)."""
        self._resolve_cuda_times()
        with self._lock:
            return TraceData(list(self._calls), list(self._ops), _environment(), self._agg.snapshot(self.timing))

    def lines(self, *, times: bool = True) -> list[str]:
        return self.data().lines(times=times)

    def format(self, *, times: bool = True) -> str:
        return "\n".join(self.lines(times=times))

    def summary(self, *, times: bool = True) -> str:
        """Every call (sampled or not) grouped by module, shapes and backend: counts and time
        (microseconds), fallback reasons, verification failures and errors."""
        return self.data().summary(times=times)

    def failures(self) -> list[CallRecord]:
        return self.data().failures()

    def to_dict(self) -> dict:
        return self.data().to_dict()

    def save(self, path: str | os.PathLike) -> None:
        """Write the kept records and the aggregates as one JSON document (format version 1)."""
        self.data().save(path)

    def save_chrome_trace(self, path: str | os.PathLike) -> None:
        self.data().save_chrome_trace(path)

    def __str__(self) -> str:
        return self.format()


class _Group:
    """Running aggregate of one (module, input, weight, served, fallback) group."""

    __slots__ = ("module", "input", "weight", "served", "fallback", "native", "calls", "total_us")

    def __init__(self, module, input, weight, served, fallback, native):
        self.module, self.input, self.weight = module, input, weight
        self.served, self.fallback, self.native = served, fallback, native
        self.calls = 0
        self.total_us = 0.0


def _shape_text(shape, dtype) -> str:
    return f"{_short_dtype(_dtype_name(dtype))}[{', '.join(map(str, shape))}]"


class _LiveAggregates:
    """The tracer's running aggregates: O(groups) memory whatever the number of calls."""

    MAX_KEPT = 100  # failing / raising calls kept for the summary

    def __init__(self) -> None:
        self.groups: dict[tuple, _Group] = {}
        self.fallbacks = 0
        self.fallback_reasons: dict[str, int] = {}
        self.verified = 0
        self.failed = 0
        self.failures: list[CallRecord] = []
        self.n_errors = 0
        self.errors: list[CallRecord] = []
        self.recorded = 0

    def group(self, module, x, w, served, fallback, tracer, aten_args) -> _Group:
        key = (module, x.shape, x.dtype, w.shape, w.dtype, served, fallback)
        g = self.groups.get(key)
        if g is None:
            native = tracer._native_backend(aten_args) if tracer.native else None
            g = self.groups.setdefault(key, _Group(module, _shape_text(x.shape, x.dtype), _shape_text(w.shape, w.dtype),
                                                   served, fallback, native))
        return g

    def add_fallback(self, decision: _registration.Decision) -> None:
        self.fallbacks += 1
        key = f"{decision.requested}: {decision.reason}"
        self.fallback_reasons[key] = self.fallback_reasons.get(key, 0) + 1

    def add_failure(self, record: CallRecord) -> None:
        self.failed += 1
        if len(self.failures) < self.MAX_KEPT:
            self.failures.append(record)

    def add_error(self, record: CallRecord) -> None:
        self.n_errors += 1
        if len(self.errors) < self.MAX_KEPT:
            self.errors.append(record)

    def snapshot(self, timing: bool = True) -> Aggregates:
        groups = [
            {"module": g.module, "input": g.input, "weight": g.weight, "backend": g.served, "fallback": g.fallback,
             "upstream": g.native, "calls": g.calls, "total_us": g.total_us if timing else None}
            for g in list(self.groups.values())
        ]
        return Aggregates(
            groups=groups,
            calls=sum(g["calls"] for g in groups),
            fallbacks=self.fallbacks,
            fallback_reasons=dict(self.fallback_reasons),
            verified=self.verified,
            failed=self.failed,
            failures=list(self.failures),
            n_errors=self.n_errors,
            errors=list(self.errors),
            recorded=self.recorded,
        )


def _compiled_kernel() -> tuple[str | None, dict | None, int]:
    """The kernel the compiled backend's last call in this thread ran; if that call tuned its
    signature, every candidate's fastest run (microseconds; ``grad_input:<kernel>`` / ``grad_weight:<kernel>`` for each gradient alone) and why the others could not win; and the k of
    the 2^k its operands were rescaled by (0: not rescaled)."""
    from .ops.convolution_backward import compiled

    ext = compiled.extension()
    if ext is None:
        return None, None, 0
    last = ext.last_call()
    tuning = {"times_us": dict(last["times_us"]), "rejected": dict(last["rejected"])} if last["tuned"] else None
    return f"compiled/{last['kernel']}", tuning, last["rescale_exponent"]


# --- every aten op of the backward pass --------------------------------------------------------


class _OpRecorder(TorchDispatchMode):
    """Records the aten ops run by the autograd engine (``_current_autograd_node()`` is set)."""

    def __init__(self, tracer: trace):
        super().__init__()
        self.tracer = tracer
        self.seq = itertools.count(1)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        node = torch._C._current_autograd_node()
        if node is None or func is torch.ops.aten.convolution_backward.default:
            return func(*args, **kwargs)  # not backward / recorded by the observer itself
        t = self.tracer
        start = time.perf_counter_ns()
        out = func(*args, **kwargs)
        end = time.perf_counter_ns()
        outputs = list(out) if isinstance(out, (tuple, list)) else [out]
        record = OpRecord(
            seq=next(self.seq),
            thread=threading.current_thread().name,
            thread_id=threading.get_ident(),
            op=str(func.overloadpacket._qualified_op_name).replace("::", ".")
            + ("" if func._overloadname == "default" else f".{func._overloadname}"),
            node=type(node).__name__,
            module=node.metadata.get(MODULE_KEY),
            args=[t._describe(a) for a in (*args, *kwargs.values())],
            outputs=[t._describe(o) for o in outputs],
            start_us=(start - t._t0) / 1e3,
            host_us=(end - start) / 1e3 if t.timing else None,
        )
        t._add_op(record)
        return out


# --- formatting and export ---------------------------------------------------------------------


def _format_value(value) -> str:
    if isinstance(value, TensorInfo):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(_format_value(v) for v in value) + "]"
    return str(value)


def format_call(c: CallRecord, *, times: bool = True) -> list[str]:
    """The lines of one call: a header (id, module, backend, upstream's choice, time) and the call
    in LoggingTensor style, plus the verification when there is one."""
    served = c.served_by
    if c.fallback_reason is not None:
        served += f" (fallback from {c.requested}: {c.fallback_reason})"
    header = [f"call {c.id}", c.module or "<no module>", f"backend={served}"]
    if c.rescale_exponent:
        header.append(f"rescaled=2^{c.rescale_exponent}")
    if c.native_backend is not None:
        header.append(f"upstream={c.native_backend}")
    if c.thread != "MainThread":
        header.append(f"thread={c.thread}")
    if times and c.time_us is not None:
        header.append(f"{c.time_us:.1f}us")
    if c.tuning is not None:
        tried = [f"{k} {v:.0f}us" if times else k for k, v in c.tuning["times_us"].items()]
        tried += [f"{k} ({why})" if times else k for k, why in c.tuning["rejected"].items()]
        header.append("tuned: " + ", ".join(tried))
    outputs = ", ".join("None" if o is None else str(o) for o in c.outputs)
    args = ", ".join(
        _format_value(v) if name in ("grad_output", "input", "weight") else f"{name}={_format_value(v)}"
        for name, v in c.args.items()
    )
    lines = ["  ".join(header), f"  {outputs} = aten.convolution_backward({args})"]
    if c.error is not None:
        lines.append(f"  raised {c.error}")
    v = c.verify
    if v is not None:
        status = "ok" if v.ok and v.strides_match else "MISMATCH"
        lines.append(
            f"  verify: {status}  max_abs={v.max_abs:.3g}  max_rel={v.max_rel:.3g}  "
            f"strides={'match' if v.strides_match else 'differ'}  (rtol={v.rtol:g}, atol={v.atol:g})"
        )
        if v.reference != "original":
            lines.append(f"    against {v.reference}")
        lines.extend(f"    {m}" for m in v.mismatches)
    return lines


def format_op(o: OpRecord, *, times: bool = True) -> str:
    outputs = ", ".join(_format_value(v) for v in o.outputs)
    args = ", ".join(_format_value(v) for v in o.args)
    line = f"{outputs} = {o.op}({args})"
    extra = [o.module or "<no module>", o.node or ""]
    if times and o.host_us is not None:
        extra.append(f"{o.host_us:.1f}us")
    return line + "  # " + " ".join(e for e in extra if e)


def _environment() -> dict:
    from . import __version__

    return {"torch": torch.__version__, "aten_override": __version__, "pid": os.getpid()}


@dataclasses.dataclass
class Aggregates:
    """Counts over every traced call, sampled or not (what :meth:`TraceData.summary` prints).

    ``groups``: one dict per (module, input, weight, backend, fallback) with ``upstream`` (upstream's
    choice on the group's first call), ``calls`` and ``total_us`` (microseconds; ``None`` without
    timing). ``failures`` / ``errors``: the first 100 calls beyond tolerance / that raised;
    ``failed`` / ``n_errors`` count them all. ``recorded``: how many calls have a record."""

    groups: list[dict]
    calls: int
    fallbacks: int = 0
    fallback_reasons: dict[str, int] = dataclasses.field(default_factory=dict)
    verified: int = 0
    failed: int = 0
    failures: list[CallRecord] = dataclasses.field(default_factory=list)
    n_errors: int = 0
    errors: list[CallRecord] = dataclasses.field(default_factory=list)
    recorded: int = 0

    @classmethod
    def from_calls(cls, calls: Iterable[CallRecord]) -> Aggregates:
        builder = _AggregateBuilder()
        for c in calls:
            builder.add(c)
        return builder.result()

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["failures"] = [c.to_json() for c in self.failures]
        d["errors"] = [c.to_json() for c in self.errors]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Aggregates:
        d = dict(d)
        d["failures"] = [CallRecord.from_dict(c) for c in d.get("failures", [])]
        d["errors"] = [CallRecord.from_dict(c) for c in d.get("errors", [])]
        return cls(**d)


class _AggregateBuilder:
    """Aggregates from records, one at a time (a streamed file read without keeping its records)."""

    def __init__(self) -> None:
        self.groups: dict[tuple, dict] = {}
        self.agg = Aggregates(groups=[], calls=0)

    def add(self, c: CallRecord) -> None:
        agg = self.agg
        key = (c.module, _shape(c.args["input"]), _shape(c.args["weight"]), c.served_by, c.fallback)
        g = self.groups.get(key)
        if g is None:
            g = self.groups[key] = {"module": c.module, "input": key[1], "weight": key[2], "backend": c.served_by,
                                    "fallback": c.fallback, "upstream": c.native_backend, "calls": 0, "total_us": 0.0}
        g["calls"] += 1
        g["total_us"] += c.time_us or 0.0
        agg.calls += 1
        agg.recorded += 1
        if c.fallback:
            agg.fallbacks += 1
            reason = f"{c.requested}: {c.fallback_reason}"
            agg.fallback_reasons[reason] = agg.fallback_reasons.get(reason, 0) + 1
        if c.verify is not None:
            agg.verified += 1
            if not (c.verify.ok and c.verify.strides_match):
                agg.failed += 1
                if len(agg.failures) < _LiveAggregates.MAX_KEPT:
                    agg.failures.append(c)
        if c.error is not None:
            agg.n_errors += 1
            if len(agg.errors) < _LiveAggregates.MAX_KEPT:
                agg.errors.append(c)

    def result(self) -> Aggregates:
        self.agg.groups = list(self.groups.values())
        return self.agg


@dataclasses.dataclass
class TraceData:
    """A finished trace, in memory or loaded back with :func:`load`.

    ``aggregates`` count every traced call (``None``: computed from ``calls``); ``complete`` is
    False for a streamed file without its summary footer (the traced process was killed), whose
    aggregates are then those of its records."""

    calls: list[CallRecord]
    ops: list[OpRecord] = dataclasses.field(default_factory=list)
    environment: dict = dataclasses.field(default_factory=dict)
    aggregates: Aggregates | None = None
    complete: bool = True

    def lines(self, *, times: bool = True) -> list[str]:
        """Calls and ops in the order they ran (by start time)."""
        events = [(c.start_us, 0, c) for c in self.calls] + [(o.start_us, 1, o) for o in self.ops]
        events.sort(key=lambda e: (e[0], e[1]))
        out = []
        for _, _, e in events:
            if isinstance(e, CallRecord):
                out.extend(format_call(e, times=times))
            else:
                out.append(format_op(e, times=times))
        return out

    def _aggregates(self) -> Aggregates:
        return self.aggregates if self.aggregates is not None else Aggregates.from_calls(self.calls)

    def failures(self) -> list[CallRecord]:
        """Calls whose verification failed (beyond tolerance, wrong shape/dtype or strides)."""
        if self.aggregates is not None:
            return list(self.aggregates.failures)
        return [c for c in self.calls if c.verify is not None and not (c.verify.ok and c.verify.strides_match)]

    def summary(self, *, times: bool = True) -> str:
        """A table of calls grouped by module, input/weight shape and backend, with counts and total
        time (microseconds), then fallback reasons and verification failures."""
        return _summary(self._aggregates(), times=times, complete=self.complete)

    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "environment": self.environment,
            "calls": [dataclasses.asdict(c) for c in self.calls],
            "ops": [dataclasses.asdict(o) for o in self.ops],
            **({"aggregates": self.aggregates.to_dict()} if self.aggregates is not None else {}),
        }

    def save(self, path: str | os.PathLike) -> None:
        """Write JSON (``format``, ``version``, ``environment``, ``calls``, ``ops``, ``aggregates``)."""
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1, default=_encode_default)
            f.write("\n")

    def chrome_trace(self) -> dict:
        """The Chrome trace event format (``ph: "X"`` complete events, ``ts``/``dur`` in
        microseconds of host time), which Perfetto and ``chrome://tracing`` open. Only recorded
        calls appear."""
        pid = self.environment.get("pid", 0)
        events = []
        threads = {}
        for c in self.calls:
            threads[c.thread_id] = c.thread
            name = f"convolution_backward[{c.served_by}]"
            events.append(
                {
                    "name": name,
                    "cat": "aten_override",
                    "ph": "X",
                    "ts": c.start_us,
                    "dur": c.host_us or 0.0,
                    "pid": pid,
                    "tid": c.thread_id,
                    "args": {
                        "call": c.id,
                        "module": c.module,
                        "requested": c.requested,
                        "backend": c.backend,
                        "fallback_reason": c.fallback_reason,
                        "upstream": c.native_backend,
                        "time_us": c.time_us,
                        "grad_output": str(c.args["grad_output"]),
                        "input": str(c.args["input"]),
                        "weight": str(c.args["weight"]),
                        "verify": dataclasses.asdict(c.verify) if c.verify else None,
                        "error": c.error,
                        "inner_calls": c.inner_calls,
                    },
                }
            )
        for o in self.ops:
            threads[o.thread_id] = o.thread
            events.append(
                {
                    "name": o.op,
                    "cat": "aten",
                    "ph": "X",
                    "ts": o.start_us,
                    "dur": o.host_us or 0.0,
                    "pid": pid,
                    "tid": o.thread_id,
                    "args": {"module": o.module, "node": o.node},
                }
            )
        meta = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": "aten_override.trace"}}]
        meta += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": n}} for tid, n in threads.items()]
        return {"traceEvents": meta + events, "displayTimeUnit": "ms"}

    def save_chrome_trace(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            json.dump(self.chrome_trace(), f, default=str)
            f.write("\n")

    @classmethod
    def from_dict(cls, d: dict) -> TraceData:
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError(f"not an {FORMAT} file (no \"format\": \"{FORMAT}\" field)")
        if d.get("version") != FORMAT_VERSION:
            raise ValueError(f"{FORMAT} version {d.get('version')!r} is not supported (expected {FORMAT_VERSION})")
        aggregates = d.get("aggregates")
        return cls(
            [CallRecord.from_dict(c) for c in d["calls"]],
            [OpRecord.from_dict(o) for o in d.get("ops", [])],
            d.get("environment", {}),
            Aggregates.from_dict(aggregates) if aggregates is not None else None,
        )


def load(path: str | os.PathLike, *, records: bool = True) -> TraceData:
    """Read a trace: the JSON lines ``trace(path)`` streams (version 2), or the JSON document of
    :meth:`trace.save` (version 1).

    A streamed file whose process was killed has no summary footer (``complete`` is False) and may
    end in a partial line, which is ignored; the aggregates are then computed from its records.

    Args:
        records: keep the call and op records (``False``: only the aggregates, in memory bounded by
            the number of groups whatever the file's length).

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not valid JSON or not an aten_override trace.
    """
    with open(path) as f:
        first = f.readline()
        try:
            header = json.loads(first)
        except json.JSONDecodeError:
            header = None
        if isinstance(header, dict) and header.get("format") == FORMAT and header.get("version") == STREAM_VERSION:
            try:
                return _load_stream(f, header, records)
            except (KeyError, TypeError) as e:
                raise ValueError(f"malformed {FORMAT} file: {type(e).__name__}: {e}") from None
        f.seek(0)
        try:
            d = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"not an {FORMAT} file: {e}") from None
    try:
        return TraceData.from_dict(d)
    except (KeyError, TypeError) as e:
        raise ValueError(f"malformed {FORMAT} file: {type(e).__name__}: {e}") from None


def _load_stream(f, header: dict, records: bool) -> TraceData:
    calls: list[CallRecord] = []
    ops: list[OpRecord] = []
    builder = _AggregateBuilder()
    footer = None
    for n, line in enumerate(f, start=2):
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            if not line.endswith("\n"):  # the last line of a killed process: partial
                break
            raise ValueError(f"not an {FORMAT} file: line {n}: {e}") from None
        kind = item.get("type")
        if kind == "call":
            call = CallRecord.from_dict(item)
            builder.add(call)
            if records:
                calls.append(call)
        elif kind == "op":
            if records:
                ops.append(OpRecord.from_dict(item))
        elif kind == "summary":
            footer = Aggregates.from_dict(item["aggregates"])
    return TraceData(calls, ops, header.get("environment", {}), footer or builder.result(), complete=footer is not None)


def _shape(info) -> str:
    return f"{_short_dtype(info.dtype)}[{', '.join(map(str, info.shape))}]" if isinstance(info, TensorInfo) else "?"


def _table(header: Sequence[str], rows: list[Sequence[str]], right: set[int]) -> list[str]:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def fmt(row):
        cells = [str(v).rjust(w) if i in right else str(v).ljust(w) for i, (v, w) in enumerate(zip(row, widths))]
        return "  ".join(cells).rstrip()

    return [fmt(header), fmt(["-" * w for w in widths]), *map(fmt, rows)]


def _summary(agg: Aggregates, *, times: bool, complete: bool = True) -> str:
    rows = []
    for g in agg.groups:
        served = g["backend"] + (" (fallback)" if g["fallback"] else "")
        row = [g["module"] or "<no module>", g["input"], g["weight"], served, g["upstream"] or "", str(g["calls"])]
        total = g["total_us"] or 0.0
        if times:
            row += [f"{total:.1f}", f"{total / g['calls']:.1f}" if g["calls"] else "0.0"]
        rows.append((row, total if times else 0.0))
    rows = [r for r, _ in sorted(rows, key=lambda r: -r[1])] if times else [r for r, _ in rows]
    header = ["module", "input", "weight", "backend", "upstream", "calls"] + (["total_us", "mean_us"] if times else [])
    lines = [f"aten::convolution_backward: {agg.calls} calls, {agg.fallbacks} fallbacks"]
    lines += _table(header, rows, right={5, 6, 7})
    if agg.recorded < agg.calls:
        lines.append(f"records: {agg.recorded} of {agg.calls} calls (sampled; every call is counted above)")
    if not complete:
        lines.append("no summary footer: the traced process ended before writing it; counts are those of its records")
    if agg.fallback_reasons:
        lines.append("fallbacks:")
        lines += [f"  {n} x {r}" for r, n in agg.fallback_reasons.items()]
    if agg.verified:
        lines.append(f"verify: {agg.verified - agg.failed}/{agg.verified} calls within tolerance")
        for c in agg.failures:
            v = c.verify
            lines.append(
                f"  MISMATCH call {c.id} {c.module or '<no module>'} [{c.backend}] (rtol={v.rtol:g}, atol={v.atol:g}): "
                + "; ".join(v.mismatches)
            )
        if agg.failed > len(agg.failures):
            lines.append(f"  ... and {agg.failed - len(agg.failures)} more")
    if agg.n_errors:
        lines.append("errors:")
        lines += [f"  call {c.id} {c.module or '<no module>'} [{c.backend}]: {c.error}" for c in agg.errors]
        if agg.n_errors > len(agg.errors):
            lines.append(f"  ... and {agg.n_errors - len(agg.errors)} more")
    return "\n".join(lines)
