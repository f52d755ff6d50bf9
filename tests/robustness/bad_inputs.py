r"""Invalid arguments of ``aten::convolution_backward``: a table of cases and a sweep runner.

Each case is a function returning the positional aten arguments: one valid 2-D call
(:func:`valid_args`: ``grad_output (2, 4, 6, 6)``, ``input (2, 3, 8, 8)``, ``weight (4, 3, 3, 3)``)
with one thing broken. :data:`UPSTREAM_CRASHES` lists the cases where the original kernel kills
the process; they are never run natively in the sweep.

    python bad_inputs.py BACKEND [BACKEND …]

runs every other case natively and under each backend in this one process (so a segfault is the
caller's exit status) and prints one JSON line per case, then a final ``{"_dispatcher": …}`` line.
"""

from __future__ import annotations

import json
import sys

import torch

f32 = torch.float32


def valid_args(**overrides) -> tuple:
    g = torch.Generator().manual_seed(0)
    args = dict(
        grad_output=torch.randn(2, 4, 6, 6, generator=g),
        input=torch.randn(2, 3, 8, 8, generator=g),
        weight=torch.randn(4, 3, 3, 3, generator=g),
        bias_sizes=[4], stride=[1, 1], padding=[0, 0], dilation=[1, 1], transposed=False,
        output_padding=[0, 0], groups=1, output_mask=[True, True, True],
    )
    args.update(overrides)
    return tuple(args.values())


def _t(*shape, dtype=f32, device="cpu"):
    return torch.randn(*shape).to(dtype=dtype, device=device) if dtype.is_floating_point or dtype.is_complex else torch.ones(*shape, dtype=dtype, device=device)


def _transposed(**overrides):
    # conv_transpose2d: input (2, 4, 6, 6), weight (4, 3, 3, 3) -> output (2, 3, 8, 8)
    base = dict(grad_output=_t(2, 3, 8, 8), input=_t(2, 4, 6, 6), weight=_t(4, 3, 3, 3), bias_sizes=[3], transposed=True)
    base.update(overrides)
    return valid_args(**base)


CASES = {
    # shapes
    "weight is 2-d": lambda: valid_args(weight=_t(4, 3)),
    "weight is 1-d": lambda: valid_args(weight=_t(4)),
    "weight is 0-d": lambda: valid_args(weight=torch.tensor(1.0)),
    "input 3-d, weight 4-d": lambda: valid_args(input=_t(2, 3, 8)),
    "grad_output 3-d": lambda: valid_args(grad_output=_t(2, 4, 6)),
    "input channels != weight.size(1)*groups": lambda: valid_args(input=_t(2, 5, 8, 8)),
    "kernel larger than padded input": lambda: valid_args(input=_t(2, 3, 2, 2), grad_output=_t(2, 4, 1, 1)),
    "zero spatial size": lambda: valid_args(input=_t(2, 3, 0, 8), grad_output=_t(2, 4, 0, 6)),
    "grad_output wrong spatial size": lambda: valid_args(grad_output=_t(2, 4, 6, 7)),
    "grad_output wrong channels": lambda: valid_args(grad_output=_t(2, 5, 6, 6)),
    "grad_output wrong batch": lambda: valid_args(grad_output=_t(3, 4, 6, 6)),
    "transposed: input channels != weight.size(0)": lambda: _transposed(input=_t(2, 5, 6, 6)),
    "transposed: grad_output wrong channels": lambda: _transposed(grad_output=_t(2, 5, 8, 8)),
    "transposed: grad_output wrong spatial size": lambda: _transposed(grad_output=_t(2, 3, 9, 9)),
    # dtypes
    "grad_output float64, others float32": lambda: valid_args(grad_output=_t(2, 4, 6, 6, dtype=torch.float64)),
    "weight float64, others float32": lambda: valid_args(weight=_t(4, 3, 3, 3, dtype=torch.float64)),
    "input bfloat16, others float32": lambda: valid_args(input=_t(2, 3, 8, 8, dtype=torch.bfloat16)),
    "all int64": lambda: valid_args(grad_output=_t(2, 4, 6, 6, dtype=torch.int64), input=_t(2, 3, 8, 8, dtype=torch.int64), weight=_t(4, 3, 3, 3, dtype=torch.int64)),
    "all bool": lambda: valid_args(grad_output=_t(2, 4, 6, 6, dtype=torch.bool), input=_t(2, 3, 8, 8, dtype=torch.bool), weight=_t(4, 3, 3, 3, dtype=torch.bool)),
    "all complex64": lambda: valid_args(grad_output=_t(2, 4, 6, 6, dtype=torch.complex64), input=_t(2, 3, 8, 8, dtype=torch.complex64), weight=_t(4, 3, 3, 3, dtype=torch.complex64)),
    # devices and layouts
    "weight on meta, others cpu": lambda: valid_args(weight=_t(4, 3, 3, 3, device="meta")),
    "grad_output on meta, others cpu": lambda: valid_args(grad_output=_t(2, 4, 6, 6, device="meta")),
    "input sparse coo": lambda: valid_args(input=_t(2, 3, 8, 8).to_sparse()),
    # groups
    "groups=0": lambda: valid_args(groups=0),
    "groups=-1": lambda: valid_args(groups=-1),
    "groups=2 does not divide C_in=3": lambda: valid_args(weight=_t(4, 1, 3, 3), groups=2),
    "groups=3 does not divide C_out=4": lambda: valid_args(weight=_t(4, 1, 3, 3), groups=3),
    "transposed: groups=3 does not divide C_in=4": lambda: _transposed(weight=_t(4, 1, 3, 3), groups=3),
    # stride / padding / dilation / output_padding
    "stride=0": lambda: valid_args(stride=[0, 1]),
    "stride=-1": lambda: valid_args(stride=[-1, -1]),
    "stride has 3 entries for 2-d": lambda: valid_args(stride=[1, 1, 1]),
    "stride empty": lambda: valid_args(stride=[]),
    "dilation=0": lambda: valid_args(dilation=[0, 0]),
    "dilation=-2": lambda: valid_args(dilation=[1, -2]),
    "padding=-1": lambda: valid_args(padding=[-1, -1], grad_output=_t(2, 4, 4, 4)),
    "padding has 3 entries for 2-d": lambda: valid_args(padding=[0, 0, 0]),
    "output_padding on a regular conv": lambda: valid_args(output_padding=[1, 1]),
    "transposed: output_padding >= stride and dilation": lambda: _transposed(output_padding=[1, 1], grad_output=_t(2, 3, 9, 9)),
    "transposed: negative output_padding": lambda: _transposed(output_padding=[-1, -1], grad_output=_t(2, 3, 7, 7)),
    # output_mask
    "output_mask has 2 entries": lambda: valid_args(output_mask=[True, True]),
    "output_mask has 4 entries": lambda: valid_args(output_mask=[True, True, True, True]),
}

# Cases the original kernel accepts although they are invalid (its result is meaningless); ours
# raise. Upstream's forward rejects them ("non-positive dilation is not supported").
UPSTREAM_ACCEPTS = {"dilation=0"}

# Cases decided before our kernel: the dispatcher picks the Meta kernel (a meta tensor among CPU
# ones), SparseCPU (a sparse input) or fails converting the arguments to the schema (bool[3]).
NOT_REACHED = {
    "weight on meta, others cpu",
    "grad_output on meta, others cpu",
    "input sparse coo",
    "output_mask has 2 entries",
    "output_mask has 4 entries",
}

# Native kernel kills the interpreter on these (torch 2.13.0): run them natively only in a child.
UPSTREAM_CRASHES = {
    "empty batch, bias_sizes=None, grad_bias requested": lambda: valid_args(
        grad_output=_t(0, 4, 6, 6), input=_t(0, 3, 8, 8), bias_sizes=None
    ),
    "zero input channels, bias_sizes=None, grad_bias requested": lambda: valid_args(
        grad_output=_t(2, 4, 6, 6), input=_t(2, 0, 8, 8), weight=_t(4, 0, 3, 3), bias_sizes=None
    ),
}


def outcome(fn) -> dict:
    """Call ``fn()``; ``{"ok": True}`` or the exception's type, family, message and notes."""
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - a sweep records everything
        return {
            "ok": False, "type": type(e).__name__, "family": family(e),
            "message": str(e).strip().splitlines()[0] if str(e).strip() else "",
            "notes": list(getattr(e, "__notes__", [])),
        }
    return {"ok": True}


def family(e: BaseException) -> str:
    """The family a caller catches: ``NotImplementedError`` (a ``RuntimeError`` subclass) apart."""
    for cls in (NotImplementedError, ValueError, IndexError, TypeError, RuntimeError):
        if isinstance(e, cls):
            return cls.__name__
    return type(e).__name__


def sweep(backends: list[str]) -> None:
    import aten_override
    from aten_override import _registration

    op = torch.ops.aten.convolution_backward.default
    before = torch._C._dispatch_dump("aten::convolution_backward")
    reached: list[str] = []

    def observer(keyset, aten_args, impl, route):
        reached.append(impl.name)
        return route(keyset, aten_args, impl)

    _registration.set_observer(observer)
    for case, make in CASES.items():
        row = {"case": case, "native": outcome(lambda: op(*make()))}
        for backend in backends:
            reached.clear()
            with aten_override.enable(backend):
                row[backend] = outcome(lambda: op(*make()))
            row[backend]["reached"] = bool(reached)
        print(json.dumps(row), flush=True)
    _registration.set_observer(None)
    args = valid_args()
    expected = op(*args)
    works = {}
    for backend in backends:
        aten_override.reset_stats()
        with aten_override.enable(backend):
            got = op(*args)
        works[backend] = aten_override.stats().get(backend, 0) == 1 and all(
            torch.allclose(g, e, atol=1e-5) for g, e in zip(got, expected)
        )
    aten_override.release()  # many enable() cycles a second leave the registration lingering idle
    print(json.dumps({"_dispatcher": {
        "unchanged": torch._C._dispatch_dump("aten::convolution_backward") == before,
        "registered": aten_override.is_registered(),
        "valid_call_works": works,
    }}), flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    sweep(sys.argv[1:])
