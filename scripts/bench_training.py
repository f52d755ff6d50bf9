#!/usr/bin/env python
r"""Training-step benchmark of real architectures: native vs ``aten_override.enable("compiled")``.

Builds real-size models from Hugging Face ``transformers`` configs with random init (nothing is
downloaded) plus one 3-D video network in plain torch, and times one SGD step (forward, loss,
backward, ``optimizer.step()``) natively and with the compiled backend, *interleaved* in one
process at a fixed thread count: each round times ``--steps`` steps of each side (median, ms), the
order of the sides alternating from round to round; the ratio is the median over the rounds of each
round's compiled / native time, so the machine speeding up or slowing down between rounds (a shared
VM) cancels out. ``--warmup`` untimed steps per side come first (oneDNN primitive caches,
allocator, the autotuner), the compiled side's until a step tunes nothing; the report gives each
side's first step and what tuning cost.

Then ``--trace-steps`` extra steps per side run under ``aten_override.trace()``, the sides alternating (the minimum over them
of each time is taken): the convolution backward's share of a step (the sum of the traced
``convolution_backward`` calls over the traced step's wall time; the tracer's module hooks make that
step a little slower than an untimed one), that sum on each side and its ratio (the *conv backward
time ratio*), and the top 8 conv layers by backward time on either side with what served each:
native's backend (upstream's choice, ``Mkldnn``, ``Slow2d``, ...) and the compiled backend's layer
class and the kernel that ran it (``class/kernel``: the layer-class table's choice, or the
autotuner's when ``ATEN_OVERRIDE_AUTOTUNE`` is unset or ``1``; tuning happens in the warmup steps),
with our GFLOP/s and % of the roofline against the machine's measured peaks (the header). A last
line says on how many layers native stays the winner (the autotuner measured it fastest) and what
they cost on each side. The summary gives, per thread count, the geometric means of the step ratio
and of the conv backward time ratio.

Models (``--models``; inputs: ``--batch`` images of ``--image-size`` or clips / audio):

==================== ==================================================================================
mobilenet_v2         ``MobileNetV2Config()`` (depth multiplier 1.0, 224), 1000 classes, cross entropy
efficientnet_b0      ``EfficientNetConfig`` with the B0 parameters (width / depth coefficient 1.0, image
                     size 224, dropout 0.2, hidden_dim 1280; the defaults are B7), cross entropy
resnet50             ``ResNetConfig()`` (ResNet-50), cross entropy
convnext_tiny        ``ConvNextConfig()`` (ConvNeXt-T), cross entropy
wav2vec2_base        ``Wav2Vec2Config(num_hidden_layers=2)``: wav2vec2-base with 2 of its 12 transformer
                     layers (the conv feature encoder and the conv positional embedding are whole),
                     ``Wav2Vec2ForCTC`` on 1 s of 16 kHz audio, CTC loss on 10 random tokens
r2plus1d_18          R(2+1)D-18 in plain torch (``transformers`` has no convolutional video model), the
                     layer list of torchvision's ``r2plus1d_18`` (Tran et al. 2018), 400 classes, clips
                     of ``--frames`` x 112 x 112, cross entropy
==================== ==================================================================================

``--autocast bfloat16`` runs each step's forward under ``torch.autocast("cpu", dtype=torch.bfloat16)``
(the convolutions and their backward in bfloat16, as users train on AVX512_BF16 / AMX CPUs). Each
model's step line also gives the minor page faults per step on each side: tensors over glibc's 32 MiB
mmap limit are mapped anew, and page-faulted, at every allocation, 10^4 to 10^5 faults per step that
vary from run to run and dominate a step's noise on a VM. ``--thp`` runs both sides with c10's
``THP_MEM_ALLOC_ENABLE=1`` (large tensors on transparent huge pages: ~20x fewer faults), which
PyTorch users can set for their own training too.

Each model's report counts the subnormal values among its conv layers' ``grad_output`` in one
step, and those within 2^24 of the subnormal range (their products with small weights and inputs are
subnormal): arithmetic with a subnormal operand or result takes a microcode assist on Intel CPUs, in
native's kernels and ours alike (random-init EfficientNet-B0's gradients underflow: its native
1-thread step on a Sapphire Rapids VM took 2.9 s, 0.85 s with ``torch.set_flush_denormal(True)``).
``--flush-denormal`` times both sides flushed.

``--quick`` (under 3 minutes on 2 cores): mobilenet_v2, efficientnet_b0, resnet50 and wav2vec2_base
at batch 2, 2 threads, 3 rounds of 1 step, 1 traced step per side.

Usage::

    python scripts/bench_training.py --quick
    python scripts/bench_training.py --models resnet50 efficientnet_b0 --threads 1 2 --csv train.csv
    python scripts/bench_training.py --autocast bfloat16 --thp --threads 1

Needs ``transformers`` (``pip install -e '.[bench]'``) for all models but r2plus1d_18.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import dataclasses
import math
import os
import resource
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable

import torch
from torch import nn

import aten_override
from aten_override import _machine
from aten_override.ops.convolution_backward import compiled
from aten_override.ops.convolution_backward.args import ConvolutionBackwardArgs
from interleave import interleaved  # scripts/interleave.py


@dataclasses.dataclass
class Workload:
    """A model in train mode and a function computing its loss on fixed random inputs."""

    name: str
    model: nn.Module
    loss: Callable[[], torch.Tensor]
    shape: str  # the input, for the table
    # the model's and its optimizer's state before the first step (restore_if_not_finite)
    initial: tuple[dict, dict] | None = None
    # steps per side that left a weight or buffer non-finite (each time restored to ``initial``)
    not_finite: dict[str, int] = dataclasses.field(default_factory=lambda: defaultdict(int))


def _image_classifier(name: str, model: nn.Module, batch: int, size: int) -> Workload:
    """A ``transformers`` image classifier: ``loss`` is its cross entropy on random labels."""
    x = torch.randn(batch, 3, size, size)
    labels = torch.randint(0, model.config.num_labels, (batch,))
    return Workload(name, model, lambda: model(pixel_values=x, labels=labels).loss, f"{batch}x3x{size}x{size}")


def mobilenet_v2(args) -> Workload:
    from transformers import MobileNetV2Config, MobileNetV2ForImageClassification

    config = MobileNetV2Config(depth_multiplier=1.0, image_size=224, num_labels=1000)
    return _image_classifier("mobilenet_v2", MobileNetV2ForImageClassification(config), args.batch, args.image_size)


def efficientnet_b0(args) -> Workload:
    from transformers import EfficientNetConfig, EfficientNetForImageClassification

    config = EfficientNetConfig(
        width_coefficient=1.0, depth_coefficient=1.0, image_size=224, dropout_rate=0.2, hidden_dim=1280, num_labels=1000
    )
    return _image_classifier("efficientnet_b0", EfficientNetForImageClassification(config), args.batch, args.image_size)


def resnet50(args) -> Workload:
    from transformers import ResNetConfig, ResNetForImageClassification

    config = ResNetConfig(num_labels=1000)  # the defaults are ResNet-50
    return _image_classifier("resnet50", ResNetForImageClassification(config), args.batch, args.image_size)


def convnext_tiny(args) -> Workload:
    from transformers import ConvNextConfig, ConvNextForImageClassification

    config = ConvNextConfig(num_labels=1000)  # the defaults are ConvNeXt-T
    return _image_classifier("convnext_tiny", ConvNextForImageClassification(config), args.batch, args.image_size)


def wav2vec2_base(args) -> Workload:
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    model = Wav2Vec2ForCTC(Wav2Vec2Config(num_hidden_layers=2))
    audio = torch.randn(args.batch, 16000)  # 1 s at 16 kHz
    labels = torch.randint(1, model.config.vocab_size, (args.batch, 10))
    return Workload(
        "wav2vec2_base", model, lambda: model(input_values=audio, labels=labels).loss, f"{args.batch}x16000"
    )


class Conv2Plus1D(nn.Sequential):
    """A (2+1)-D convolution: ``1 x 3 x 3`` spatial, batch norm, ReLU, ``3 x 1 x 1`` temporal."""

    def __init__(self, in_planes: int, out_planes: int, mid_planes: int, stride: int = 1):
        super().__init__(
            nn.Conv3d(in_planes, mid_planes, (1, 3, 3), stride=(1, stride, stride), padding=(0, 1, 1), bias=False),
            nn.BatchNorm3d(mid_planes),
            nn.ReLU(inplace=True),
            nn.Conv3d(mid_planes, out_planes, (3, 1, 1), stride=(stride, 1, 1), padding=(1, 0, 0), bias=False),
        )


class BasicBlock3d(nn.Module):
    """R(2+1)D's residual block; ``mid_planes`` keeps the parameters of a full ``3 x 3 x 3`` block."""

    def __init__(self, in_planes: int, planes: int, stride: int):
        super().__init__()
        mid = (in_planes * planes * 27) // (in_planes * 9 + 3 * planes)
        self.conv1 = nn.Sequential(Conv2Plus1D(in_planes, planes, mid, stride), nn.BatchNorm3d(planes), nn.ReLU(True))
        self.conv2 = nn.Sequential(Conv2Plus1D(planes, planes, mid), nn.BatchNorm3d(planes))
        self.downsample = None
        if stride != 1 or in_planes != planes:
            self.downsample = nn.Sequential(nn.Conv3d(in_planes, planes, 1, stride=stride, bias=False), nn.BatchNorm3d(planes))

    def forward(self, x):
        residual = x if self.downsample is None else self.downsample(x)
        return torch.relu(self.conv2(self.conv1(x)) + residual)


class R2Plus1D18(nn.Module):
    """R(2+1)D-18 (torchvision ``r2plus1d_18``'s layers): input ``(N, 3, T, 112, 112)``."""

    def __init__(self, num_classes: int = 400):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv3d(3, 45, (1, 7, 7), stride=(1, 2, 2), padding=(0, 3, 3), bias=False),
            nn.BatchNorm3d(45),
            nn.ReLU(True),
            nn.Conv3d(45, 64, (3, 1, 1), padding=(1, 0, 0), bias=False),
            nn.BatchNorm3d(64),
            nn.ReLU(True),
        )
        layers, in_planes = [], 64
        for planes, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers.append(nn.Sequential(BasicBlock3d(in_planes, planes, stride), BasicBlock3d(planes, planes, 1)))
            in_planes = planes
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x):
        return self.fc(self.layers(self.stem(x)).mean(dim=(2, 3, 4)))


def r2plus1d_18(args) -> Workload:
    model = R2Plus1D18()
    clips = torch.randn(args.batch, 3, args.frames, 112, 112)
    labels = torch.randint(0, 400, (args.batch,))
    return Workload(
        "r2plus1d_18", model, lambda: nn.functional.cross_entropy(model(clips), labels),
        f"{args.batch}x3x{args.frames}x112x112",
    )


MODELS: dict[str, Callable] = {
    f.__name__: f for f in (mobilenet_v2, efficientnet_b0, resnet50, convnext_tiny, wav2vec2_base, r2plus1d_18)
}
QUICK_MODELS = ("mobilenet_v2", "efficientnet_b0", "resnet50", "wav2vec2_base")
SIDES = ("native", "compiled")
TOP_LAYERS = 8


def build(name: str, args) -> tuple[Workload, torch.optim.Optimizer]:
    """The workload (seeded: the same weights and inputs every run) and its SGD optimizer."""
    torch.manual_seed(0)
    w = MODELS[name](args)
    w.model.train()
    # A small learning rate: thousands of steps on random labels must not diverge to inf / nan.
    opt = torch.optim.SGD(w.model.parameters(), lr=1e-4, momentum=0.9)
    w.initial = (copy.deepcopy(w.model.state_dict()), copy.deepcopy(opt.state_dict()))
    return w, opt


def restore_if_not_finite(w: Workload, opt: torch.optim.Optimizer, name: str) -> None:
    """After a step of side ``name`` (outside its timing): where a weight or buffer is no longer finite,
    count it against the side and restore the model and optimizer to their state before the first step.
    Both sides train the same model, so one side's wrong gradients would otherwise leave both timing
    steps on NaN from then on: torch 2.13's bfloat16 R(2+1)D-18 step on an AMX-BF16 CPU (oneDNN's 3-D
    grad_weight there, see the dead-taps class) left two weights NaN after its first native step and
    all 113 after its second, and every R(2+1)D bfloat16 number this script gave before measured both
    sides on NaN."""
    state = w.model.state_dict()
    if all(bool(t.isfinite().all()) for t in state.values() if t.is_floating_point()):
        return
    w.not_finite[name] += 1
    if w.initial is not None:
        w.model.load_state_dict(w.initial[0])
        opt.load_state_dict(copy.deepcopy(w.initial[1]))


def side(name: str):
    """The context of a side: nothing registered for native, ``enable("compiled")`` for ours."""
    return aten_override.enable("compiled") if name == "compiled" else contextlib.nullcontext()


# The step's compute dtype: float32, or bfloat16 under CPU autocast (``--autocast bfloat16``: the
# convolutions, their backward included, run in bfloat16; the weights and the update stay float32).
AUTOCAST: torch.dtype | None = None
# ``--flush-denormal``: torch.set_flush_denormal(True) (x86 FTZ + DAZ) before any thread pool exists:
# threads inherit the creating thread's floating-point environment, so every thread flushes.
FLUSH_DENORMAL = False


def step(w: Workload, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=AUTOCAST, enabled=AUTOCAST is not None):
        loss = w.loss()
    loss.backward()
    opt.step()


# Minor page faults of each timed step, per side: fresh pages of the tensors glibc maps anew (those over
# its 32 MiB mmap limit, or after it trimmed its heap). On a VM they cost ~1 us each and vary by 10^5
# per step from run to run: the main noise in a step's time (see --thp).
FAULTS: dict[str, list[int]] = defaultdict(list)


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def timed_steps(w: Workload, opt, name: str, steps: int) -> float:
    """Median seconds of ``steps`` training steps on side ``name`` (their page faults into FAULTS)."""
    times = []
    with side(name):
        for _ in range(steps):
            faults, start = minor_faults(), time.perf_counter()
            step(w, opt)
            times.append(time.perf_counter() - start)
            FAULTS[name].append(minor_faults() - faults)
            restore_if_not_finite(w, opt, name)
    return statistics.median(times)


# Untimed steps the compiled side's warmup may add while the autotuner still tunes: a signature whose
# native result is all zeros (random-init EfficientNet-B0's squeeze-excite layers, whose gradients
# underflow) is tuned on up to three calls before it is pinned.
MAX_EXTRA_WARMUP = 4


@dataclasses.dataclass
class Warmup:
    """The untimed steps before timing: each side's first step (seconds; the compiled side's tunes
    every signature it meets), the compiled side's steps, and what its tuning cost."""

    first_step: dict[str, float]
    compiled_steps: int = 0
    signatures: int = 0
    tune_s: float = 0.0


def _tuning() -> tuple[int, float]:
    t = aten_override.stats().get("compiled_tuning", {})
    return t.get("signatures", 0), t.get("us", 0) / 1e6


def warm_up(w: Workload, opt, warmup: int) -> Warmup | None:
    """``warmup`` untimed steps per side, the compiled side's continued (at most MAX_EXTRA_WARMUP
    more) until a step tunes no signature, so that no tuning falls into a timed step; none and
    ``None`` for ``warmup`` 0."""
    if warmup <= 0:
        return None
    first = {}
    tuned_before, tune_s_before = _tuning()
    for name in SIDES:
        first[name] = timed_steps(w, opt, name, 1)
    steps = 1
    for name in SIDES:
        for _ in range(warmup - 1):
            timed_steps(w, opt, name, 1)
    steps += warmup - 1
    for _ in range(MAX_EXTRA_WARMUP):
        tuned = _tuning()[0]
        timed_steps(w, opt, "compiled", 1)
        steps += 1
        if _tuning()[0] == tuned:
            break
    tuned_after, tune_s_after = _tuning()
    FAULTS.clear()
    return Warmup(first, steps, tuned_after - tuned_before, tune_s_after - tune_s_before)


def time_interleaved(w: Workload, opt, rounds: int, steps: int) -> tuple[dict, float]:
    """({side: median seconds per step}, median over rounds of compiled / native in the same round);
    warm_up comes first."""
    times, ratios = interleaved(lambda name: timed_steps(w, opt, name, steps), SIDES, rounds, reference="native")
    return times, ratios["compiled"]


@dataclasses.dataclass
class Layer:
    """One conv module's backward in a traced step: calls, total microseconds, what served it."""

    calls: int = 0
    us: float = 0.0
    served: str = ""
    flops: float = 0.0  # grad_input + grad_weight multiply-adds x 2, summed over the calls
    bytes: float = 0.0  # one pass over each tensor read or written, summed over the calls
    dtype: torch.dtype = torch.float32  # grad_output's (the roofline's peak is this dtype's)
    rescaled: int = 0  # calls the compiled backend computed on operands x 2^k (gradients below 2^-32)


def traced_steps(w: Workload, opt, name: str, steps: int) -> tuple[float, dict[str, Layer]]:
    """(wall seconds of a traced step, {module: Layer}) on side ``name``: the minimum over ``steps``
    traced steps of the wall time and of each layer's time (on a shared machine noise only adds
    time). ``served`` is upstream's backend for native, the compiled layer class (and depthwise
    kernel) for ours."""
    walls, layers = [], {}
    for _ in range(steps):
        with side(name), aten_override.trace(log=False) as t:
            start = time.perf_counter()
            step(w, opt)
            walls.append(time.perf_counter() - start)
        restore_if_not_finite(w, opt, name)
        this_step: dict[str, Layer] = defaultdict(Layer)
        for call in t.calls:
            layer = this_step[_short_module(call.module)]
            layer.calls += 1
            layer.us += call.time_us or 0.0
            layer.served = call.native_backend if name == "native" else _compiled_kernel(call)
            flops, nbytes = call_cost(call)
            layer.flops += flops
            layer.bytes += nbytes
            layer.dtype = getattr(torch, call.args["grad_output"].dtype)
            layer.rescaled += call.rescale_exponent > 0
        keep_fastest(layers, this_step)
    return min(walls), layers


def keep_fastest(best: dict[str, Layer], layers: dict[str, Layer]) -> None:
    """best[module] becomes layers[module] wherever that took less time (or best has no such module)."""
    for module, layer in layers.items():
        if module not in best or layer.us < best[module].us:
            best[module] = layer


def traced_interleaved(w: Workload, opt, steps: int) -> dict[str, tuple[float, dict[str, Layer]]]:
    """{side: traced_steps' result} over ``steps`` traced steps per side, the sides alternating (native,
    compiled, then compiled, native, ...) as in the timed rounds. Traced one side after the other, the
    same native kernel of one layer read 1.8x slower on the later side in two full runs (wav2vec2's
    conv_layers.1 at two threads), though it varies 2x from step to step on either side (289-613 ms in
    one process): a large call's noise on a VM, which alternating spreads over both sides."""
    traces: dict[str, tuple[float, dict[str, Layer]]] = {}
    for i in range(steps):
        for name in SIDES if i % 2 == 0 else SIDES[::-1]:
            wall, layers = traced_steps(w, opt, name, 1)
            if name in traces:
                keep_fastest(traces[name][1], layers)
                traces[name] = (min(wall, traces[name][0]), traces[name][1])
            else:
                traces[name] = (wall, layers)
    return traces


def call_cost(call) -> tuple[float, float]:
    """(FLOPs, bytes) of a traced ``convolution_backward`` call, for its roofline: 2 x the forward's
    multiply-adds for each of grad_input and grad_weight the mask asks for, and one pass over the
    tensors it reads (grad_output; input for grad_weight; weight for grad_input) and writes."""
    a = call.args
    go, x, w, mask = a["grad_output"], a["input"], a["weight"], a["output_mask"]
    small = x.shape[2:] if a["transposed"] else go.shape[2:]  # the side the kernel slides over
    macs = math.prod(w.shape) * go.shape[0] * math.prod(small)
    elements = math.prod(go.shape)
    if mask[0]:
        elements += math.prod(w.shape) + math.prod(x.shape)
    if mask[1]:
        elements += math.prod(x.shape) + math.prod(w.shape)
    return 2.0 * macs * (int(mask[0]) + int(mask[1])), elements * torch.empty((), dtype=getattr(torch, go.dtype)).element_size()


def _short_module(module: str | None) -> str:
    """The module path without the root class name (``ResNetForImageClassification.``)."""
    return module.split(".", 1)[-1] if module else "<no module>"


def _tail(text: str, width: int) -> str:
    return text if len(text) <= width else "…" + text[-(width - 1):]


def _compiled_kernel(call) -> str:
    """The compiled layer class of a traced call and the kernel that ran it (the tracer's
    ``compiled/<kernel>``: the table's choice or the autotuner's); the fallback reason otherwise."""
    if call.backend != "compiled":
        return f"{call.backend} ({call.fallback_reason})"
    values = {}
    for key, value in call.args.items():
        if hasattr(value, "shape"):
            value = torch.empty_strided(value.shape, value.stride, dtype=getattr(torch, value.dtype))
        values[key] = value
    cls = compiled.layer_class(ConvolutionBackwardArgs(**values))
    return f"{cls}/{(call.kernel or 'compiled/?').removeprefix('compiled/')}"


@dataclasses.dataclass
class Subnormals:
    """How many of the values that reached the conv layers' backward as ``grad_output`` in one step
    were subnormal (nonzero, below ``torch.finfo(dtype).tiny``), and the layer with the most."""

    values: int = 0
    subnormal: int = 0
    near: int = 0  # nonzero, below NEAR_SUBNORMAL x tiny: their products with small values underflow
    worst: str = "-"
    worst_share: float = 0.0

    @property
    def share(self) -> float:
        return self.subnormal / self.values if self.values else 0.0

    @property
    def near_share(self) -> float:
        return self.near / self.values if self.values else 0.0


# A grad_output value below 2^24 x finfo.tiny (~2e-31 in float32) times a weight or input below 2^-24
# (~6e-8; every small value of a random-init layer) is subnormal: random-init EfficientNet-B0's 1x1
# layers ran at 1.4 GFLOP/s unflushed with only 0.016% of their grad_output values subnormal.
NEAR_SUBNORMAL = 2.0**24


def subnormal_census(w: Workload, opt: torch.optim.Optimizer) -> Subnormals:
    """One untimed native step that counts the subnormal values of every conv layer's ``grad_output``
    (a hook on each conv module's output tensor).

    Arithmetic on subnormals takes a microcode assist on Intel CPUs (~100x slower per instruction),
    in native's kernels and ours alike, so a step whose gradients underflow (random-init EfficientNet:
    its squeeze-excite layers' gradients are ~1e-37, up to 98% of one layer's subnormal, 15% of all
    values within 2^24 of the range) measures the assists more than the kernels;
    ``--flush-denormal`` times it as with ``torch.set_flush_denormal(True)``."""
    census = Subnormals()

    def count(name: str):
        def hook(grad: torch.Tensor) -> None:
            tiny = torch.finfo(grad.dtype).tiny
            magnitude = grad.abs()
            nonzero = magnitude != 0
            k = int((nonzero & (magnitude < tiny)).sum())
            census.values += grad.numel()
            census.subnormal += k
            census.near += int((nonzero & (magnitude < tiny * NEAR_SUBNORMAL)).sum())
            if grad.numel() and k / grad.numel() > census.worst_share:
                census.worst, census.worst_share = name, k / grad.numel()
        return hook

    def on_output(module, args, output) -> None:
        if isinstance(output, torch.Tensor) and output.requires_grad and output.dtype.is_floating_point:
            output.register_hook(count(module._census_name))

    handles = []
    for name, module in w.model.named_modules():
        if isinstance(module, nn.modules.conv._ConvNd):
            module._census_name = name
            handles.append(module.register_forward_hook(on_output))
    try:
        step(w, opt)
    finally:
        for h in handles:
            h.remove()
    restore_if_not_finite(w, opt, "native")
    return census


def report(w: Workload, threads: int, times: dict, ratio: float, traces: dict, rounds: int, machine,
           subnormals: Subnormals, warmup: Warmup | None = None) -> dict:
    """Print one model's result; return its summary row (times in ms, shares in %)."""
    conv_us = {s: sum(layer.us for layer in traces[s][1].values()) for s in SIDES}
    shares = {s: 100 * conv_us[s] / 1e6 / traces[s][0] for s in SIDES}
    conv_ratio = conv_us["compiled"] / conv_us["native"] if conv_us["native"] else float("nan")
    print(f"\n== {w.name} ({w.shape}), {threads} threads ==")
    print(
        f"step: native {times['native'] * 1e3:.1f} ms, compiled {times['compiled'] * 1e3:.1f} ms, "
        f"ratio {ratio:.2f} (median of {rounds} rounds' ratios); minor page faults per step (median): "
        + ", ".join(f"{s} {statistics.median(FAULTS[s]):.0f}" for s in SIDES if FAULTS[s])
    )
    if warmup is not None:
        print(
            f"warmup (untimed): first step native {warmup.first_step['native'] * 1e3:.0f} ms, compiled "
            f"{warmup.first_step['compiled'] * 1e3:.0f} ms; the compiled side tuned {warmup.signatures} signatures "
            f"in {warmup.tune_s:.2f} s over its {warmup.compiled_steps} warmup steps"
        )
    print(
        "conv backward share of a traced step: "
        + ", ".join(f"{s} {shares[s]:.0f}% of {traces[s][0] * 1e3:.0f} ms" for s in SIDES)
        + f"; its time (the tracer's sum): native {conv_us['native'] / 1e3:.1f} ms, compiled "
        f"{conv_us['compiled'] / 1e3:.1f} ms, ratio {conv_ratio:.2f}"
    )
    print(
        f"subnormal conv grad_output values in a step: {100 * subnormals.share:.2g}% of {subnormals.values:,}"
        + (f" (most: {_tail(subnormals.worst, 50)}, {100 * subnormals.worst_share:.0f}%)" if subnormals.subnormal else "")
        + f", below 2^24 x tiny (products underflow): {100 * subnormals.near_share:.2g}%"
        + ("; flushed to zero (--flush-denormal)" if FLUSH_DENORMAL else
           "; each subnormal operand or result costs a microcode assist on Intel CPUs, natively and ours: see --flush-denormal"
           if subnormals.near_share > 0.001 else "")
    )
    if any(w.not_finite.values()):
        print(
            "steps that left a weight or buffer non-finite (each time the model was restored to its initial "
            "state, so that every step computes on finite values): "
            + ", ".join(f"{s} {w.not_finite[s]}" for s in SIDES)
            + ": that side's gradients are wrong here"
        )
    native, ours = traces["native"][1], traces["compiled"][1]
    print(f"top {TOP_LAYERS} conv layers by backward time (either side); GFLOP/s and % of roofline (measured peaks) of ours")
    print("  (a direct convolution's FLOPs: winograd and kn2row-lanes, which skip multiplications, can read above 100%):")
    print(
        f"  {'layer':50s} {'calls':>5s} {'native ms':>9s} {'upstream':10s} {'compiled ms':>11s} {'class/kernel':27s} "
        f"{'ratio':>5s} {'GFLOP/s':>7s} {'roof%':>5s}"
    )
    def worst(module):
        return max(native[module].us, ours.get(module, Layer()).us)
    for module in sorted(native, key=worst, reverse=True)[:TOP_LAYERS]:
        layer, o = native[module], ours.get(module, Layer(served="-"))
        r = o.us / layer.us if layer.us else float("nan")
        seconds = o.us / 1e6
        roof = max(o.flops / machine.peak(o.dtype), o.bytes / machine.bandwidth) if seconds else float("nan")
        print(
            f"  {_tail(module, 50):50s} {layer.calls:5d} {layer.us / 1e3:9.2f} {layer.served[:10]:10s} "
            f"{o.us / 1e3:11.2f} {o.served[:27]:27s} {r:5.2f} {o.flops / seconds / 1e9 if seconds else 0:7.1f} "
            f"{100 * roof / seconds if seconds else 0:5.0f}"
        )
    rescaled = [m for m, o in ours.items() if o.rescaled]
    if rescaled:
        print(
            f"computed on operands x 2^k (gradients below 2^-32: no subnormal products): {len(rescaled)} of "
            f"{len(ours)} layers ({sum(m in rescaled for m in sorted(native, key=worst, reverse=True)[:TOP_LAYERS])} "
            f"of the top {TOP_LAYERS})"
        )
    stays = {m: native[m] for m, o in ours.items() if o.served.endswith("/native") and m in native}
    if stays:
        stay_native = sum(layer.us for layer in stays.values())
        stay_ours = sum(ours[m].us for m in stays)
        on_rescaled = sum(m in rescaled for m in stays)
        print(
            f"native stays the winner (measured) on {len(stays)} of {len(ours)} layers: {stay_native / 1e3:.1f} ms "
            f"natively, {stay_ours / 1e3:.1f} ms through our backend (ratio {stay_ours / stay_native:.2f})"
            + (f"; on {on_rescaled} of them native's kernel ran on rescaled operands" if on_rescaled else "")
        )
    return {
        "model": w.name, "input": w.shape, "threads": threads,
        "native_ms": times["native"] * 1e3, "compiled_ms": times["compiled"] * 1e3, "ratio": ratio,
        "native_conv_bwd_pct": shares["native"], "compiled_conv_bwd_pct": shares["compiled"],
        "native_conv_bwd_ms": conv_us["native"] / 1e3, "compiled_conv_bwd_ms": conv_us["compiled"] / 1e3,
        "conv_bwd_ratio": conv_ratio,
        "dtype": str(AUTOCAST or torch.float32).removeprefix("torch."),
        "thp": os.environ.get("THP_MEM_ALLOC_ENABLE") == "1",
        "flush_denormal": FLUSH_DENORMAL, "subnormal_grad_output_pct": 100 * subnormals.share,
        "near_subnormal_grad_output_pct": 100 * subnormals.near_share,
        "native_faults": statistics.median(FAULTS["native"]) if FAULTS["native"] else float("nan"),
        "compiled_faults": statistics.median(FAULTS["compiled"]) if FAULTS["compiled"] else float("nan"),
        "native_not_finite_steps": w.not_finite["native"], "compiled_not_finite_steps": w.not_finite["compiled"],
    }


def print_summary(rows: list[dict]) -> None:
    print(f"\n{'model':16s} {'input':20s} {'threads':>7s} {'native ms':>10s} {'compiled ms':>11s} {'ratio':>6s} "
          f"{'conv bwd % native':>17s} {'ours':>5s} {'conv bwd ratio':>14s}")
    for r in rows:
        print(
            f"{r['model']:16s} {r['input']:20s} {r['threads']:7d} {r['native_ms']:10.1f} {r['compiled_ms']:11.1f} "
            f"{r['ratio']:6.2f} {r['native_conv_bwd_pct']:17.0f} {r['compiled_conv_bwd_pct']:5.0f} {r['conv_bwd_ratio']:14.2f}"
            + ("  native's gradients non-finite: model restored" if r["native_not_finite_steps"] else "")
            + ("  compiled's gradients non-finite: model restored" if r["compiled_not_finite_steps"] else "")
        )
    for threads in sorted({r["threads"] for r in rows}):
        these = [r for r in rows if r["threads"] == threads]
        step = statistics.geometric_mean([r["ratio"] for r in these])
        conv = statistics.geometric_mean([r["conv_bwd_ratio"] for r in these])
        worst = max(these, key=lambda r: r["ratio"])
        print(
            f"geomean at {threads} threads over {len(these)} models: step ratio {step:.2f}, conv backward time ratio "
            f"{conv:.2f}; slowest step ratio {worst['ratio']:.2f} ({worst['model']})"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"{', '.join(QUICK_MODELS)}; batch 2, 2 threads, 3 rounds of 1 step, 1 traced step")
    p.add_argument("--models", nargs="+", choices=list(MODELS), help="default: all (--quick: the quick ones)")
    p.add_argument("--threads", type=int, nargs="+", help="thread counts, each timed separately (default 1 2; --quick: 2)")
    p.add_argument("--batch", type=int, help="images / clips / utterances per step (default 8; --quick: 2)")
    p.add_argument("--image-size", type=int, default=224, help="H = W of the images (pixels)")
    p.add_argument("--frames", type=int, default=8, help="frames per r2plus1d_18 clip (112x112)")
    p.add_argument("--rounds", type=int, help="interleaved timing rounds (default 5; --quick: 3)")
    p.add_argument("--steps", type=int, help="timed steps per side per round (default 2; --quick: 1)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per side before timing")
    p.add_argument("--trace-steps", type=int, help="traced steps per side, the minimum taken (default 2; --quick: 1)")
    p.add_argument(
        "--autocast", choices=["bfloat16"],
        help="run each step's forward under torch.autocast('cpu', dtype=...): the convolutions and their backward in that dtype",
    )
    p.add_argument(
        "--thp", action="store_true",
        help="back both sides' large tensors with transparent huge pages (c10's THP_MEM_ALLOC_ENABLE=1; the "
        "script re-runs itself with it set): ~20x fewer page faults per step, far less noise on a VM",
    )
    p.add_argument(
        "--flush-denormal", action="store_true",
        help="both sides with torch.set_flush_denormal(True): subnormal values read and computed as zero "
        "(no microcode assists; what users training with underflowing gradients can set too)",
    )
    p.add_argument("--csv", type=Path, help="also write the summary rows as CSV")
    args = p.parse_args(argv)
    if args.thp and os.environ.get("THP_MEM_ALLOC_ENABLE") != "1" and argv is None:
        # c10 reads it once, at its first allocation: run again with it set.
        os.environ["THP_MEM_ALLOC_ENABLE"] = "1"
        os.execv(sys.executable, [sys.executable, *sys.argv])
    quick = args.quick
    args.models = args.models or list(QUICK_MODELS if quick else MODELS)
    args.threads = args.threads or ([2] if quick else [1, 2])
    args.batch = args.batch or (2 if quick else 8)
    args.rounds = args.rounds or (3 if quick else 5)
    args.steps = args.steps or (1 if quick else 2)
    args.trace_steps = args.trace_steps or (1 if quick else 2)

    global AUTOCAST, FLUSH_DENORMAL
    AUTOCAST = getattr(torch, args.autocast) if args.autocast else None
    if args.flush_denormal and not torch.set_flush_denormal(True):
        raise SystemExit("bench_training: --flush-denormal: this CPU has no FTZ/DAZ (torch.set_flush_denormal returned False)")
    FLUSH_DENORMAL = args.flush_denormal
    reason = aten_override.availability().get("compiled")
    if reason:
        raise SystemExit(f"bench_training: the compiled backend is not available: {reason}")
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        machine = _machine.measure()
        print(_machine.header(machine), flush=True)
        if FLUSH_DENORMAL:
            print("subnormal values flushed to zero (torch.set_flush_denormal(True), every thread)", flush=True)
        if AUTOCAST is not None:
            print(f"steps under torch.autocast('cpu', dtype={AUTOCAST})", flush=True)
        thp = os.environ.get("THP_MEM_ALLOC_ENABLE") == "1"
        print(f"large tensors on transparent huge pages (THP_MEM_ALLOC_ENABLE=1): {'yes' if thp else 'no'}", flush=True)
        for name in args.models:
            try:
                w, opt = build(name, args)
            except ImportError as e:
                print(f"\nskipping {name}: {e} (pip install -e '.[bench]')", file=sys.stderr)
                continue
            warmup = warm_up(w, opt, args.warmup)
            times, ratio = time_interleaved(w, opt, args.rounds, args.steps)
            traces = traced_interleaved(w, opt, args.trace_steps)
            subnormals = subnormal_census(w, opt)
            rows.append(report(w, threads, times, ratio, traces, args.rounds, machine, subnormals, warmup))
            sys.stdout.flush()
    print_summary(rows)
    if args.csv and rows:
        with args.csv.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    sys.exit(main())
