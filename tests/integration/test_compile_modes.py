r"""Every ``torch.compile`` mode reaches our kernel: calls counted per backend, gradients equal to
eager native (values and strides).

While :func:`aten_override.enable` is active, Inductor retargets ``aten.convolution_backward`` to
``aten_override::convolution_backward`` (:mod:`aten_override.compiled_graphs`), a custom op that
every wrapper calls through the dispatcher: the default Python wrapper, ``cpp_wrapper``
(``aoti_torch_call_dispatcher`` / a boxed dispatcher call) and AOTInductor (its proxy executor).

Each mode is compiled **once** (the first test of the mode compiles it, inside ``enable``) and
every backend then runs the same compiled graph: the custom op dispatches at run time, so which
backend serves a call is decided per call, not per graph. That keeps Inductor's C++ compiles, tens
of seconds each on 2 cores, to one per mode; the CI profile compiles two (Python wrapper and
``cpp_wrapper``), the other modes are slow.

Inductor's on-disk caches cannot hide a call: a cached graph still makes its calls at run time, and
the pass's ``uuid()`` is part of the cache key, so a graph compiled without it is never reused for a
compile with it.
"""

from __future__ import annotations

import contextlib
import types
import warnings

import pytest
import torch
from torch import nn

import aten_override
from aten_override import compiled_graphs
from aten_override.backends import implementation
from aten_override.compile_bypass import bypass_reasons
from aten_override.testing.example_backends import from_forward_convolutions

from ..backend_params import BACKENDS

# python, compiled (when built) and a user function with the aten signature.
USER = "user-function"
ALL_BACKENDS = [*BACKENDS, USER]
parametrize_all_backends = pytest.mark.parametrize("backend", ALL_BACKENDS)


def _backend(name: str):
    return from_forward_convolutions if name == USER else name


def _stats_key(name: str) -> str:
    return implementation(_backend(name)).name


@contextlib.contextmanager
def served(name: str, calls: int, **enable_kwargs):
    """``enable`` the backend for the block; then exactly ``calls`` calls were served by it, none fell
    back to ATen."""
    aten_override.reset_stats()
    with aten_override.enable(_backend(name), **enable_kwargs):
        yield
    stats = aten_override.stats()
    assert stats.get(_stats_key(name), 0) == calls, stats
    assert stats.get("fallback", 0) == 0, stats


@pytest.fixture(autouse=True)
def _pass_removed():
    """Every test leaves Inductor's post-grad passes without ours (when Inductor was imported)."""
    yield
    assert not compiled_graphs.is_active()
    import sys

    config = sys.modules.get("torch._inductor.config")
    if config is not None:
        from torch._inductor.custom_graph_pass import get_custom_graph_passes

        assert compiled_graphs.PASS not in get_custom_graph_passes(config.post_grad_custom_post_pass)


def _model() -> nn.Module:
    """Three convolution backward calls: a dense one, a depthwise one (the layer Inductor's layout
    optimisation hands odd strides), a transposed one."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=8),
        nn.ReLU(),
        nn.ConvTranspose2d(8, 4, 2, stride=2),
    ).double()


def _input(n: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    return torch.randn(n, 3, 10, 10, dtype=torch.float64, generator=g).requires_grad_()


def _grads(step, m: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    m.zero_grad(set_to_none=True)
    x.grad = None
    step(m, x)
    return [x.grad, *(p.grad for p in m.parameters())]


def _eager_step(m, x):
    m(x).square().sum().backward()


def _assert_equal_grads(got, expected, *, size1_strides=True):
    """Values, shapes and strides equal; ``size1_strides=False`` skips the strides of size-1 dims,
    which do not change the layout (Inductor's channels_last depthwise ``grad_weight`` of shape
    ``(8, 1, 3, 3)`` has strides ``(9, 1, 3, 1)``, eager's ``(9, 9, 3, 1)``)."""
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e)
        if size1_strides:
            assert g.stride() == e.stride(), (g.stride(), e.stride())
        else:
            layout = [(n, st) for n, st in zip(g.shape, g.stride()) if n != 1]
            assert layout == [(n, st) for n, st in zip(e.shape, e.stride()) if n != 1], (g.stride(), e.stride())


class _Mode:
    """One ``torch.compile`` configuration, compiled on first use and reused by every backend."""

    def __init__(self, compile_kwargs=None, *, op, config=None, batches=(2,), compiled_autograd=False, loss=None):
        self.compile_kwargs = compile_kwargs or {}
        self.op = op  # whether its backward graph calls aten_override::convolution_backward
        self.loss = loss or _loss
        self.config = config or {}
        self.batches = batches
        self.compiled_autograd = compiled_autograd
        self._compiled = None

    def context(self):
        stack = contextlib.ExitStack()
        if self.config:
            import torch._inductor.config as inductor_config

            stack.enter_context(inductor_config.patch(self.config))
        if self.compiled_autograd:
            stack.enter_context(torch._dynamo.config.patch(compiled_autograd=True))
        return stack

    def step(self, name: str):
        """The training step compiled for this mode. Dynamo keys its cache on code objects (and,
        inlining ``nn.Module``s, not on the module instance), so each mode compiles a function with
        a code object of its own: a graph compiled for one mode is never reused by another."""
        if self._compiled is None:
            if self.compiled_autograd:
                # The whole training step is compiled: Dynamo meets .backward() and compiled
                # autograd captures the backward graph, which Inductor then compiles.
                assert self.loss is _loss
                compiled = torch.compile(_own_code(_eager_step, name), **self.compile_kwargs)
                self._compiled = compiled
            else:
                compiled = torch.compile(_own_code(self.loss, name), **self.compile_kwargs)

                def step(m, x):
                    compiled(m, x).backward()

                self._compiled = step
        return self._compiled


def _loss(m, x):
    return m(x).square().sum()


def _sum_loss(m, x):
    return m(x).sum()


def _own_code(fn, name: str):
    name = f"{fn.__name__}_{name}"
    code = fn.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, fn.__globals__, name)


CPP = {"cpp_wrapper": True}
TRITON_BWD = {"max_autotune_conv_bwd_input_backends": "ATEN,TRITON", "max_autotune_conv_bwd_weight_backends": "ATEN,TRITON"}

# op=True: the graph would skip the dispatcher for aten's op (compiled_graphs.bypassing_wrapper), so
# the pass retargets it; op=False: it keeps aten's op, which its Python wrapper calls through the
# dispatcher. Either way every call must be served.
MODES = {
    "inductor": _Mode(op=False),
    "cpp_wrapper": _Mode({"options": CPP}, op=True),
}
SLOW_MODES = {
    "dynamic": _Mode({"dynamic": True}, op=False, batches=(2, 3)),
    "dynamic_cpp_wrapper": _Mode({"dynamic": True, "options": CPP}, op=True, batches=(2, 3)),
    "max_autotune": _Mode({"options": {"max_autotune": True}}, op=False),
    # Triton conv-backward templates allowed: retargeted so no template can replace the call (on
    # CPU Inductor has none anyway; on GPU this is what keeps the override serving).
    "max_autotune_triton_backends": _Mode({"options": {"max_autotune": True, **TRITON_BWD}}, op=True),
    "compiled_autograd": _Mode(compiled_autograd=True, op=False),
    "compiled_autograd_cpp_wrapper": _Mode({"options": CPP}, compiled_autograd=True, op=True),
    "no_layout_optimization_cpp_wrapper": _Mode({"options": {"layout_optimization": False, **CPP}}, op=True),
    # grad_output of the last layer is an expanded scalar: Inductor hands the op a stride-0 tensor
    # (its own lowering of aten's op would have materialised it first).
    "stride0_grad_output_cpp_wrapper": _Mode({"options": CPP}, op=True, loss=_sum_loss),
}

_MODEL = _model()  # shared by every mode and backend


def _check_mode(name: str, mode: _Mode, backend: str) -> None:
    with mode.context():
        step = mode.step(name)
        for n in mode.batches:
            x = _input(n)
            expected = _grads(lambda m, x: mode.loss(m, x).backward(), _MODEL, x)
            compiled_graphs.reset_op_calls()
            with served(backend, calls=3):
                got = _grads(step, _MODEL, x)
            assert compiled_graphs.op_calls() == (3 if mode.op else 0)
            # After enable() exits, the same graph (with our op or aten's) reaches native ATen.
            aten_override.reset_stats()
            native_compiled = _grads(step, _MODEL, x)
            assert aten_override.stats() == {"fallback_reasons": {}}, aten_override.stats()
            # Equal to native running the same compiled graph: values and every stride; to eager
            # native: values and layout (Inductor's layout optimisation may give a size-1 dim of a
            # gradient another stride than eager, native or not).
            _assert_equal_grads(got, native_compiled)
            _assert_equal_grads(got, expected, size1_strides=False)
    if mode.compiled_autograd:  # the backward really was captured by compiled autograd
        from torch._dynamo.utils import counters

        assert counters["compiled_autograd"]["captures"] >= 1, dict(counters["compiled_autograd"])


@pytest.mark.parametrize("mode", list(MODES))
@parametrize_all_backends
def test_compiled_mode(mode, backend):
    _check_mode(mode, MODES[mode], backend)


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(SLOW_MODES))
@parametrize_all_backends
def test_compiled_mode_slow(mode, backend):
    _check_mode(mode, SLOW_MODES[mode], backend)


# --- the mechanism ---------------------------------------------------------------------------


def test_pass_retargets_aten_convolution_backward():
    """The post-grad pass, on a graph traced from aten's op: under ``cpp_wrapper`` it leaves none of
    it behind; for the Python wrapper it changes nothing."""
    import torch._inductor.config as inductor_config

    from torch.fx.experimental.proxy_tensor import make_fx

    def f(go, x, w):
        return torch.ops.aten.convolution_backward.default(
            go, x, w, [4], [1, 1], [0, 0], [1, 1], False, [0, 0], 1, [True, True, True]
        )

    args = torch.randn(2, 4, 6, 6), torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3)
    gm = make_fx(f)(*args)
    before = str(gm.graph)
    compiled_graphs.PASS(gm.graph)
    assert str(gm.graph) == before
    with inductor_config.patch(cpp_wrapper=True):
        compiled_graphs.PASS(gm.graph)
    gm.recompile()
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten_override.convolution_backward.default in targets
    assert torch.ops.aten.convolution_backward.default not in targets
    for got, want in zip(gm(*args), f(*args), strict=True):
        torch.testing.assert_close(got, want)


def test_custom_op_opcheck():
    """Schema, fake kernel (aten's meta: same strides), aliasing, AOT dispatch: ``torch.library.opcheck``."""
    x = torch.randn(2, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    args = (torch.randn(2, 4, 6, 6), x, torch.randn(4, 3, 3, 3), [4], [1, 1], [0, 0], [1, 1], False, [0, 0], 1, [True, True, True])
    torch.library.opcheck(torch.ops.aten_override.convolution_backward.default, args)
    with torch._subclasses.FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        ours = torch.ops.aten_override.convolution_backward.default(*fake)
        theirs = torch.ops.aten.convolution_backward.default(*fake)
    assert [t.stride() for t in ours] == [t.stride() for t in theirs]


def test_enable_installs_and_removes_the_pass():
    import torch._inductor.config as inductor_config
    from torch._inductor.custom_graph_pass import get_custom_graph_passes

    def passes():
        return get_custom_graph_passes(inductor_config.post_grad_custom_post_pass)

    def theirs(graph):
        pass

    with inductor_config.patch(post_grad_custom_post_pass=theirs):
        with aten_override.enable("python"):
            assert passes() == (theirs, compiled_graphs.PASS)
            with aten_override.enable("aten"):  # nested: still one pass
                assert passes() == (theirs, compiled_graphs.PASS)
            assert compiled_graphs.is_active()
        assert passes() == (theirs,)
        with aten_override.enable("python", compiled_graphs=False):
            assert passes() == (theirs,) and not compiled_graphs.is_active()
    assert not passes()


def _assert_prints_ok(code: str) -> None:
    """Runs ``code`` in a fresh interpreter (nothing imported yet); it must print ``ok``."""
    from ..backend_params import run_python

    r = run_python(["-c", code])
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_pass_added_when_inductor_is_imported_inside_enable():
    """``torch._inductor.config`` imported for the first time inside ``enable`` (``torch.compile``
    does that) gets the pass: a fresh interpreter, since this one has imported it."""
    code = (
        "import sys, aten_override\n"
        "assert 'torch._inductor.config' not in sys.modules\n"
        "with aten_override.enable('python'):\n"
        "    import torch._inductor.config as c\n"
        "    from aten_override import compiled_graphs\n"
        "    assert c.post_grad_custom_post_pass == (compiled_graphs.PASS,), c.post_grad_custom_post_pass\n"
        "assert c.post_grad_custom_post_pass is None\n"
        "assert not any(type(f).__module__ == 'aten_override.compiled_graphs' for f in sys.meta_path)\n"
        "print('ok')\n"
    )
    _assert_prints_ok(code)


def test_import_hook_removed_when_inductor_never_imported():
    code = (
        "import sys, aten_override\n"
        "with aten_override.enable('python'):\n"
        "    assert any(type(f).__module__ == 'aten_override.compiled_graphs' for f in sys.meta_path)\n"
        "assert not any(type(f).__module__ == 'aten_override.compiled_graphs' for f in sys.meta_path)\n"
        "assert 'torch._inductor.config' not in sys.modules\n"
        "print('ok')\n"
    )
    _assert_prints_ok(code)


def test_bypass_reasons_empty_while_the_pass_is_active():
    import torch._inductor.config as inductor_config

    with inductor_config.patch(cpp_wrapper=True):
        assert bypass_reasons() and "compiled_graphs=True" in bypass_reasons()[0]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with aten_override.enable("python"):
                assert bypass_reasons() == []
        with pytest.warns(UserWarning, match="cpp_wrapper is on"):
            with aten_override.enable("python", compiled_graphs=False):
                pass


# --- what Inductor's other paths hand the kernel ----------------------------------------------


def _odd_strides(n, c, h, w):
    """``(n, c, h, w)`` laid out as ``(n, h, c, w)``: strides ``(h*c*w, w, c*w, 1)`` — neither NCHW nor
    NHWC, as Inductor's CPU layout optimisation has handed a depthwise backward, e.g. (800, 10, 80, 1)."""
    return torch.randn(n, h, c, w, dtype=torch.float64).permute(0, 2, 1, 3)


@parametrize_all_backends
@pytest.mark.parametrize("groups", [1, 8], ids=["dense", "depthwise"])
def test_layout_optimisation_odd_strides(backend, groups):
    x = _odd_strides(2, 8, 10, 10)
    assert x.stride() == (800, 10, 80, 1)
    go = _odd_strides(2, 8, 10, 10)
    w = torch.randn(8, 8 // groups, 3, 3, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    args = (go, x, w, [8], [1, 1], [1, 1], [1, 1], False, [0, 0], groups, [True, True, True])
    expected = aten_override.original_kernel("cpu")(*args)
    with served(backend, calls=1):
        got = torch.ops.aten.convolution_backward.default(*args)
    _assert_equal_grads(got, expected)


@parametrize_all_backends
def test_max_autotune_aten_choice_calls(backend):
    """The calls Inductor's conv-backward autotuning makes for its ATen choice
    (``torch/_inductor/kernel/conv.py`` ``call_aten_dx`` / ``call_aten_dw``): ``bias_sizes=None``, an
    uninitialised dummy for the operand whose gradient is not needed, one gradient per call, and
    ``convolution_backward.out`` (which redispatches to the functional op, hence to us).

    In torch 2.13 those helpers cannot run as written: they pass ``out1=/out2=/out3=`` (the schema
    says ``out0/out1/out2``) and ``None`` for the unneeded outputs, and ATen's ``.out`` kernel rejects
    any masked-out output ("Expected out tensor to have dtype nullptr"); they are candidates only
    beside Triton templates (GPU), so on CPU max-autotune takes the plain fallback
    (``test_compiled_mode_slow[max_autotune-*]``). Here: the functional calls they stand for, and
    ``.out`` with every output requested."""
    go = torch.randn(2, 8, 5, 5, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    x = torch.randn(2, 8, 10, 10, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    w = torch.randn(8, 1, 3, 3, dtype=torch.float64)
    conv = ([2, 2], [1, 1], [1, 1], False, [0, 0], 8)
    original = aten_override.original_kernel("cpu")
    want = original(go, x, w, None, *conv, [True, True, True])
    dummy_x = torch.empty_like(x).fill_(float("nan"))
    dummy_w = torch.empty_like(w).fill_(float("nan"))
    op = torch.ops.aten.convolution_backward
    native_outs = [torch.empty(0, dtype=torch.float64) for _ in range(3)]
    op.out(go, x, w, None, *conv, [True, True, True], out0=native_outs[0], out1=native_outs[1], out2=native_outs[2])
    outs = [torch.empty(0, dtype=torch.float64) for _ in range(3)]
    with served(backend, calls=3):
        dx, no_dw, no_db = op.default(go, dummy_x, w, None, *conv, [True, False, False])
        no_dx, dw, no_db2 = op.default(go, x, dummy_w, None, *conv, [False, True, False])
        op.out(go, x, w, None, *conv, [True, True, True], out0=outs[0], out1=outs[1], out2=outs[2])
    assert no_dw is None and no_db is None and no_dx is None and no_db2 is None
    _assert_equal_grads((dx, dw), want[:2])
    _assert_equal_grads(outs, native_outs)  # .out resizes the given tensors: its strides, not the kernel's


# --- AOTInductor -----------------------------------------------------------------------------


class _ConvBackward(nn.Module):
    """A graph with a convolution backward in it, as ``torch.export`` can capture one: the op itself
    (export traces forward code; a training step's ``.backward()`` is not exportable)."""

    def forward(self, go, x, w):
        return torch.ops.aten.convolution_backward.default(
            go, x, w, [8], [2, 2], [1, 1], [1, 1], False, [0, 0], 8, [True, True, True]
        )


@pytest.fixture(scope="module")
def aoti_package(tmp_path_factory):
    """Compiled with the pass active (inside ``enable``), loaded in this process."""
    args = _aoti_args()
    ep = torch.export.export(_ConvBackward(), args)
    with aten_override.enable("aten"):
        path = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path_factory.mktemp("aoti") / "conv_bwd.pt2"))
    return torch._inductor.aoti_load_package(path)


def _aoti_args():
    g = torch.Generator().manual_seed(3)
    go = torch.randn(2, 8, 5, 5, dtype=torch.float64, generator=g)
    x = torch.randn(2, 8, 10, 10, dtype=torch.float64, generator=g)
    w = torch.randn(8, 1, 3, 3, dtype=torch.float64, generator=g)
    return go, x, w


@pytest.mark.slow
@parametrize_all_backends
def test_aot_inductor(backend, aoti_package):
    args = _aoti_args()
    expected = aten_override.original_kernel("cpu")(
        *args, [8], [2, 2], [1, 1], [1, 1], False, [0, 0], 8, [True, True, True]
    )
    with served(backend, calls=1):
        got = aoti_package(*args)
    _assert_equal_grads(got, expected)
    aten_override.reset_stats()
    got = aoti_package(*args)  # no override: the custom op reaches native
    assert aten_override.stats().get("fallback", 0) == 0
    _assert_equal_grads(got, expected)


def test_export_decomposition_table():
    """``torch.export``: ``run_decompositions(compiled_graphs.decomposition_table())`` puts our op in
    the exported program explicitly (as ``torch._native``'s ``native_decomp_table()`` does), whatever
    is enabled when it is later compiled; run eagerly it is served like any call."""
    args = _aoti_args()
    ep = torch.export.export(_ConvBackward(), args).run_decompositions(compiled_graphs.decomposition_table())
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten_override.convolution_backward.default in targets
    assert torch.ops.aten.convolution_backward.default not in targets
    expected = _ConvBackward()(*args)
    with served("python", calls=1):
        got = ep.module()(*args)
    _assert_equal_grads(got, expected)


# --- the opt-out -----------------------------------------------------------------------------


@pytest.mark.slow
def test_cpp_wrapper_opt_out_bypasses_the_override():
    """``compiled_graphs=False``: Inductor keeps aten's op, which ``cpp_wrapper`` calls through ATen's
    C shim statically: our kernel serves nothing (and ``enable`` warns), the gradients are native's."""
    m = _model()
    x = _input()
    expected = _grads(_eager_step, m, x)
    compiled = torch.compile(_own_code(_loss, "opt_out"), options={"cpp_wrapper": True})
    import torch._inductor.config as inductor_config

    with inductor_config.patch(cpp_wrapper=True), pytest.warns(UserWarning, match="cpp_wrapper is on"):
        with aten_override.enable("python", compiled_graphs=False):
            aten_override.reset_stats()
            got = _grads(lambda m, x: compiled(m, x).backward(), m, x)
            assert aten_override.stats().get("python", 0) == 0, aten_override.stats()
    _assert_equal_grads(got, expected, size1_strides=False)
