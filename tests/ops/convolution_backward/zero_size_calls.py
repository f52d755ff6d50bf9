r"""Calls of ``aten::convolution_backward`` with zero-size dims on every axis, drawn reproducibly.

Each call is drawn from a seed: 1-D/2-D/3-D, regular and transposed, ``N``, ``C_in / groups`` and
``C_out / groups`` of 0, 1 or 2 (so groups can be empty), spatial and kernel sizes including 0,
stride, padding, dilation, ``output_padding``, contiguous or channels_last ``input`` / ``weight``,
every ``output_mask``, ``bias_sizes`` given or ``None``, float32 / float64 / bfloat16, and a
``grad_output`` of the forward's output size or, sometimes, of another size or channel count
(for a zero batch or zero input channels only: upstream's Empty backend never reads it, and the
zero-channel forward gives 0 output channels; a mis-sized ``grad_output`` of other calls is pinned
by tests/robustness/bad_inputs.py).

Run as a script it calls the original kernel on every drawn call and prints one JSON line per call
(``{"index": i, "ok": bool}``): the tests run it in a child interpreter first, so a call on which
native crashes the process would be seen, not take the test run down.
"""

from __future__ import annotations

import json
import random
import sys

import torch

SEED = 20261201
COUNT = 600


def _channels_last(t: torch.Tensor) -> torch.Tensor:
    fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(t.dim())
    return t.contiguous(memory_format=fmt) if fmt is not None else t


def draw(rng: random.Random) -> tuple[tuple, str]:
    """One call's aten arguments and a readable id."""
    d = rng.choice((1, 2, 3))
    transposed = rng.random() < 0.4
    groups = rng.choice((1, 1, 2, 3))
    n = rng.choice((0, 0, 1, 2))
    in_per_group = rng.choice((0, 0, 1, 2))
    out_per_group = rng.choice((0, 1, 1, 2))
    c_in, c_out = in_per_group * groups, out_per_group * groups
    spatial = [rng.choice((0, 1, 3, 5)) for _ in range(d)]
    kernel = [rng.choice((0, 1, 2, 3)) if rng.random() < 0.15 else rng.choice((1, 2, 3)) for _ in range(d)]
    stride = [rng.choice((1, 2)) for _ in range(d)]
    padding = [rng.choice((0, 1, 2)) for _ in range(d)]
    dilation = [rng.choice((1, 2)) for _ in range(d)]
    output_padding = [rng.choice((0, 0, 1)) for _ in range(d)] if transposed else [0] * d
    dtype = rng.choice((torch.float32, torch.float32, torch.float64, torch.bfloat16))
    if transposed:
        wshape = (c_in, out_per_group, *kernel)
        out = [(i - 1) * s - 2 * p + dd * (k - 1) + op + 1
               for i, k, s, p, dd, op in zip(spatial, kernel, stride, padding, dilation, output_padding)]
    else:
        wshape = (c_out, in_per_group, *kernel)
        out = [(i + 2 * p - dd * (k - 1) - 1) // s + 1 for i, k, s, p, dd in zip(spatial, kernel, stride, padding, dilation)]
    out = [max(o, 0) for o in out]
    go_channels = c_out
    roll = rng.random()
    if n == 0 or c_in == 0:
        # upstream's Empty backend reads nothing of grad_output but its number of dims
        if c_in == 0 and not transposed and roll < 0.5:
            go_channels = 0  # the zero-channel forward's output: 0 channels, the bias dropped
        elif roll < 0.65:
            out = [o + 1 for o in out]
        elif roll < 0.8:
            go_channels = c_out + 1
    x = torch.randn(n, c_in, *spatial, dtype=dtype)
    w = torch.randn(*wshape, dtype=dtype)
    go = torch.randn(n, go_channels, *out, dtype=dtype)
    layout = rng.choice(("contiguous", "channels_last")) if d > 1 else "contiguous"
    if layout == "channels_last":
        x, w = _channels_last(x), _channels_last(w)
    mask = [rng.random() < 0.6 for _ in range(3)]
    bias_sizes = [c_out] if rng.random() < 0.8 else None
    if bias_sizes is None and mask[2] and (n == 0 or c_in == 0):
        bias_sizes = [c_out]  # upstream aborts the process there (pinned in test_native_defects)
    args = (go, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, mask)
    name = (
        f"{'T' if transposed else ''}{d}d_N{n}_Cin{c_in}_Cout{c_out}_g{groups}_x{spatial}_k{kernel}_go{list(go.shape)}"
        f"_s{stride}_p{padding}_d{dilation}_op{output_padding}_{layout}_{str(dtype)[6:]}_mask{''.join('TF'[not m] for m in mask)}"
        f"_bias{bias_sizes}"
    ).replace(" ", "")
    return args, name


def calls(seed: int = SEED, count: int = COUNT) -> list[tuple[tuple, str]]:
    """``count`` drawn calls; the same for the same seed."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    return [draw(rng) for _ in range(count)]


if __name__ == "__main__":
    import aten_override

    native = aten_override.original_kernel("cpu")
    for i, (args, name) in enumerate(calls()):
        try:
            native(*args)
            ok = True
        except Exception:  # noqa: BLE001 - only whether it raised
            ok = False
        print(json.dumps({"index": i, "name": name, "ok": ok}), flush=True)
    sys.exit(0)
