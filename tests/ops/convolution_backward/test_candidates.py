r"""Every candidate kernel of the compiled backend's measured choice, on every call it claims.

The autotuner may pick any kernel whose predicate (``candidate_unsupported`` in
``csrc/convolution_backward.cpp``) accepts a call, on whichever machine it runs: a kernel that only
wins elsewhere must still be right here. So each kernel is run by name (``_C.run_kernel``) on a
matrix of calls — every class, 1-D/2-D/3-D, strided / padded / dilated, channel multipliers, every
floating dtype, channels-last, every output mask, and planes beyond the sizes the layer-class table
gives a kernel (the channels-in-lanes depthwise walk on 113x113 stride-2 and 56x56 planes; its
banded walk on planes whose whole-plane tiles exceed half the L2 cache) — and its result is compared with the original kernel's and float64's (values, dtypes, shapes, strides).
A kernel that cannot compute a call must say why (``ValueError``), never run.
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys

import pytest
import torch

from aten_override.ops.convolution_backward import compiled
from aten_override.testing.comparison import call_native, check_against_native, float64_reference
from tests.helpers import assert_within_twice_native_error

pytestmark = pytest.mark.skipif(compiled.unavailable_reason() is not None, reason=str(compiled.unavailable_reason()))

# The kernels the autotuner chooses between (not the correctness classes zeros / sum / upcast, nor
# the autotuner's fake test candidate).
CANDIDATES = ("native", "depthwise-plane", "depthwise-lanes", "depthwise-bands", "direct", "grouped-lanes", "gemm-im2col",
              "gemm-kn2row", "winograd", "pointwise-fused", "kn2row-lanes", "pointwise-bf16", "kn2row-planes")


def _call(c_in, c_out, groups, kernel, spatial, *, stride=1, padding=0, dilation=1, batch=2,
          dtype=torch.float32, channels_last=False, mask=(True, True, True), seed=0):
    dims = len(spatial)
    kernel, dilation = (list(v) if isinstance(v, tuple) else [v] * dims for v in (kernel, dilation))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, c_in, *spatial, generator=g)
    w = torch.randn(c_out, c_in // groups, *kernel, generator=g)
    conv = (torch.nn.functional.conv1d, torch.nn.functional.conv2d, torch.nn.functional.conv3d)[dims - 1]
    y = conv(x, w, stride=stride, padding=padding, dilation=dilation, groups=groups)
    go = torch.randn(y.shape, generator=g)
    x, w, go = x.to(dtype), w.to(dtype), go.to(dtype)
    if channels_last:
        fmt = torch.channels_last if dims == 2 else torch.channels_last_3d
        x, go = x.contiguous(memory_format=fmt), go.contiguous(memory_format=fmt)
    padding = list(padding) if isinstance(padding, tuple) else [padding] * dims
    stride = list(stride) if isinstance(stride, tuple) else [stride] * dims
    return (go, x, w, [c_out], stride, padding, dilation, False, [0] * dims, groups, list(mask))


def _calls():
    calls = {
        # depthwise: the table gives lanes only small or strided planes; both walks are candidates everywhere
        "depthwise 113x113 s2 (MobileNetV2 layer.0)": _call(20, 20, 20, 3, (33, 113), stride=2),
        "depthwise 56x56 k3 p1": _call(18, 18, 18, 3, (56, 56), padding=1),
        "depthwise 28x28 k7 p3 x2": _call(17, 34, 17, 7, (28, 28), padding=3),
        "depthwise 1-D k31 (Conformer)": _call(24, 24, 24, 31, (300,), padding=15),
        "depthwise 3-D dilated": _call(16, 16, 16, 3, (6, 12, 12), padding=2, dilation=2),
        "depthwise 5x5 s2 bf16": _call(20, 20, 20, 5, (29, 29), stride=2, padding=2, dtype=torch.bfloat16),
        "depthwise 14x14 f16": _call(20, 20, 20, 3, (14, 14), padding=1, dtype=torch.float16),
        "depthwise 14x14 f64 x2": _call(9, 18, 9, 3, (14, 14), padding=1, dtype=torch.float64),
        "depthwise channels_last s2": _call(20, 20, 20, 3, (23, 23), stride=2, padding=1, channels_last=True),
        # the lanes walks gather each input position from the taps of its stride phase in every
        # dimension: phases no tap reaches (dilation a multiple of the stride, strides over the kernel),
        # strides differing per dimension, a channel multiplier, 3-D, on whole-plane and banded tiles
        "depthwise s2 dilation 2 (phases without taps)": _call(20, 20, 20, 3, (21, 23), stride=2, padding=2,
                                                               dilation=2),
        "depthwise 1-D k2 s3 (phases without taps)": _call(17, 17, 17, 2, (40,), stride=3, padding=1),
        "depthwise k(3, 5) s(1, 2) p(1, 2) x2": _call(10, 20, 10, (3, 5), (15, 17), stride=(1, 2), padding=(1, 2)),
        "depthwise 3-D k3 s(2, 1, 3) p1": _call(16, 16, 16, 3, (7, 9, 14), stride=(2, 1, 3), padding=1),
        "depthwise 118x118 k3 s2 d2 p2 batch 1 (bands)": _call(17, 17, 17, 3, (118, 118), stride=2, padding=2,
                                                               dilation=2, batch=1),
        # depthwise-bands: planes whose whole-plane lanes tiles (3 x 64 bytes per padded position) exceed
        # the L2 of machines with up to 2 MiB per core; channels not a multiple of 16, batch 1 and 3
        "depthwise 112x112 s2 (MobileNetV2 layer.0) batch 3": _call(20, 20, 20, 3, (112, 112), stride=2, padding=1, batch=3),
        "depthwise 112x112 k3 p1 bf16 batch 1": _call(18, 18, 18, 3, (112, 112), padding=1, dtype=torch.bfloat16, batch=1),
        "depthwise 115x115 k5 s2 p2 f64 (EfficientNet)": _call(9, 9, 9, 5, (115, 115), stride=2, padding=2,
                                                                dtype=torch.float64, batch=1),
        "depthwise 120x100 k3 dilation 2": _call(17, 17, 17, 3, (120, 100), padding=2, dilation=2, batch=1),
        "depthwise 112x96 k3 p1 x2": _call(10, 20, 10, 3, (112, 96), padding=1, batch=1),
        "depthwise 3-D 16x20x20 k3 p1": _call(17, 17, 17, 3, (16, 20, 20), padding=1, batch=1),
        "depthwise 3-D 18x21x21 k3 s2 bf16": _call(16, 16, 16, 3, (18, 21, 21), stride=2, padding=1,
                                                   dtype=torch.bfloat16, batch=1),
        # depthwise-lanes / -bands with every stride 1 keep a kernel row's taps in registers (widths 1 to
        # 8; 9 and dilation in W take the tap-block walk): runs of positions shorter than its 8- and
        # 4-position blocks (W_out 1 to 7), dilation in H only, 3-D, multipliers, every dtype, bands
        "depthwise k1 p0 x3": _call(5, 15, 5, 1, (9, 11)),
        "depthwise 1-D k2 p1 odd channels": _call(19, 19, 19, 2, (37,), padding=1, batch=3),
        "depthwise k4 p1 W_out 3": _call(16, 16, 16, 4, (12, 4), padding=1),
        "depthwise k5 p0 W_out 1": _call(17, 17, 17, 5, (9, 5)),
        "depthwise 1x6 p1 3-D": _call(16, 32, 16, (2, 1, 6), (3, 5, 13), padding=1),
        "depthwise 3x7 dilation (2, 1) p3": _call(21, 21, 21, (3, 7), (17, 23), padding=3, dilation=(2, 1)),
        "depthwise k8 p3 bf16": _call(18, 18, 18, 8, (15, 15), padding=3, dtype=torch.bfloat16),
        "depthwise k9 p4 (tap blocks)": _call(16, 16, 16, 9, (12, 12), padding=4),
        "depthwise k7 p3 f64 x2": _call(9, 18, 9, 7, (10, 9), padding=3, dtype=torch.float64),
        "depthwise k7 p3 f16 channels_last": _call(20, 20, 20, 7, (9, 14), padding=3, dtype=torch.float16,
                                                   channels_last=True),
        "depthwise 112x112 k5 p2 batch 1 (bands)": _call(17, 17, 17, 5, (112, 112), padding=2, batch=1),
        # depthwise-plane with every stride 1 slides kernel rows of 2 or 3 taps in registers, in groups
        # of 4 (2 taps) or 3 (3 taps) rows: groups with fewer rows, no padding (its first shifted read
        # lies before the taps' first position), float64 (8 lanes), a multiplier, every dtype
        "depthwise 7x3 p0 (row groups 3, 3, 1)": _call(16, 16, 16, (7, 3), (12, 9)),
        "depthwise 5x2 p0 f64 x2 (row groups 4, 1)": _call(9, 18, 9, (5, 2), (11, 10), dtype=torch.float64),
        "depthwise k3 p0 7x7 f16": _call(20, 20, 20, 3, (7, 7), dtype=torch.float16),
        "depthwise k3 p1 21x19 bf16 x3": _call(6, 18, 6, 3, (21, 19), padding=1, dtype=torch.bfloat16),
        "depthwise 3x3 dilation (3, 1) p3": _call(16, 16, 16, 3, (17, 23), padding=3, dilation=(3, 1)),
        "depthwise 66x3 (66 kernel rows: tap blocks)": _call(4, 4, 4, (66, 3), (67, 9), batch=1),
        # grad_input of 8 MiB or more is written with non-temporal stores (AVX-512 or AVX2 ones)
        "depthwise 112x112 k3 p1 96 channels (streamed grad_input)": _call(96, 96, 96, 3, (112, 112), padding=1),
        "grouped 16 per group 28x28 batch 24 (streamed grad_input)": _call(128, 128, 8, 3, (28, 28), padding=1,
                                                                          batch=24),
        "grouped 4 per group s2": _call(16, 16, 4, 3, (15, 15), stride=2, padding=1),
        "grouped 16 per group s2": _call(64, 64, 4, 3, (16, 16), stride=2, padding=1),
        "grouped 1-D k16 (wav2vec2 pos_conv)": _call(32, 32, 4, 16, (20,), padding=8),
        "one-channel 1-D k10 s5": _call(1, 16, 1, 10, (400,), stride=5),
        "dense 3x3": _call(8, 12, 1, 3, (10, 10), padding=1),
        "pointwise s2": _call(16, 24, 1, 1, (14, 14), stride=2),
        "pointwise channels_last bf16": _call(32, 16, 1, 1, (8, 8), dtype=torch.bfloat16, channels_last=True),
        # GEMM kernels on pointwise layers: every dtype the predicates admit, odd lengths, batch 1
        "pointwise 16->96 112x56 (MobileNetV2 expand)": _call(16, 96, 1, 1, (112, 56)),
        "pointwise 144->24 1-D odd length": _call(144, 24, 1, 1, (1001,), batch=3),
        "pointwise 13->70 3-D 5x7x9 bf16": _call(13, 70, 1, 1, (5, 7, 9), dtype=torch.bfloat16, batch=5),
        "pointwise 24->40 f16": _call(24, 40, 1, 1, (17, 19), dtype=torch.float16),
        "pointwise 9->1000 f64 batch 1": _call(9, 1000, 1, 1, (6, 6), dtype=torch.float64, batch=1),
        "pointwise 64->1024 7x7 (EfficientNet project)": _call(1024, 64, 1, 1, (7, 7), batch=9),
        # pointwise-fused (1x1 stride 1, float32 / float64): chunks of a sample with a partial last one
        # (112x112 at batch 1), more (sample, chunk) tasks than grad_weight partials (batch 40 of 7x7:
        # tasks share a partial), channels not a multiple of its 8-row / 16-lane blocks, positions not
        # a multiple of the vector width, wide layers whose partials are capped by size, channels-last
        "pointwise 16->96 112x112 batch 1 (chunks)": _call(16, 96, 1, 1, (112, 112), batch=1),
        "pointwise 13->21 7x7 batch 40 (partials)": _call(13, 21, 1, 1, (7, 7), batch=40),
        "pointwise 1->3 1-D 17 f64": _call(1, 3, 1, 1, (17,), dtype=torch.float64, batch=3),
        "pointwise 1152->1280 3x3 (wide)": _call(1152, 1280, 1, 1, (3, 3), batch=2),
        "pointwise 40->24 channels_last": _call(40, 24, 1, 1, (15, 9), channels_last=True),
        # pointwise-bf16 (1x1 stride 1, bfloat16): pairs of channels and of positions, so odd C_out and odd
        # planes (a chunk's last position a pair of its own), C_in off the 16 lanes, chunks, partials
        "pointwise 16->96 112x112 bf16 batch 1 (chunks)": _call(16, 96, 1, 1, (112, 112), dtype=torch.bfloat16,
                                                               batch=1),
        "pointwise 96->24 28x28 bf16 (EfficientNet project)": _call(96, 24, 1, 1, (28, 28), dtype=torch.bfloat16),
        "pointwise 17->33 7x7 bf16 batch 40 (odd plane, partials)": _call(17, 33, 1, 1, (7, 7), dtype=torch.bfloat16,
                                                                         batch=40),
        "pointwise 3->5 1-D 1 bf16": _call(3, 5, 1, 1, (1,), dtype=torch.bfloat16, batch=3),
        "pointwise 200->1 1-D 999 bf16": _call(200, 1, 1, 1, (999,), dtype=torch.bfloat16),
        "pointwise 1->64 1-D 77 bf16": _call(1, 64, 1, 1, (77,), dtype=torch.bfloat16),
        "pointwise 40->24 channels_last bf16": _call(40, 24, 1, 1, (15, 9), dtype=torch.bfloat16, channels_last=True),
        "1-D k3 s2 (wav2vec2 feature encoder)": _call(16, 16, 1, 3, (199,), stride=2),
        # gemm-im2col splits rows longer than its workspace holds (8 MiB; 1 MiB per group): parts that
        # start and end inside the padding, strides and dilation across part boundaries, float64
        "1-D k5 s2 p3 d2 long rows": _call(256, 128, 1, 5, (8001,), stride=2, padding=3, dilation=2),
        "grouped 1-D k7 s3 p2 d2 long rows f64": _call(128, 64, 2, 7, (4600,), stride=3, padding=2, dilation=2,
                                                      dtype=torch.float64, batch=1),
        "3x1x1 (R(2+1)D)": _call(8, 8, 1, 1, (6, 7, 7)),
        "3-D 3x3x3": _call(4, 6, 1, 3, (5, 6, 6), padding=1),
        # winograd (3x3 stride 1, groups 1): padding 0-2, odd and tiny planes (partial tiles, tiles
        # reaching past the plane), channels not a multiple of the vector width, several tile chunks
        # with a partial last one (ResNet's 56x56 stage at 64 channels), every dtype, channels-last
        "3x3 p0 odd 7x9": _call(3, 5, 1, 3, (7, 9), batch=3),
        "3x3 p2 17->33 5x6": _call(17, 33, 1, 3, (5, 6), padding=2, batch=1),
        "3x3 p1 1x1 plane": _call(4, 4, 1, 3, (1, 1), padding=1),
        "3x3 p1 64->64 56x22 (ResNet-50 stage 1)": _call(64, 64, 1, 3, (56, 22), padding=1),
        "3x3 p1 256->256 9x9 (one task)": _call(256, 256, 1, 3, (9, 9), padding=1),
        "3x3 p1 bf16": _call(20, 18, 1, 3, (13, 11), padding=1, dtype=torch.bfloat16, batch=3),
        "3x3 p1 f16": _call(16, 24, 1, 3, (9, 10), padding=1, dtype=torch.float16),
        "3x3 p1 f64": _call(9, 7, 1, 3, (11, 8), padding=1, dtype=torch.float64),
        "3x3 p1 channels_last": _call(24, 40, 1, 3, (12, 15), padding=1, channels_last=True),
    }
    # kn2row-lanes (1-D shaped, stride 1): a kernel longer than the input (wav2vec2's positional
    # convolution: 128 taps over 49 frames, each position meets the input through some of its taps),
    # tap blocks with a partial last one, taps that only meet padding (zeros), dilation, sums over more
    # than 64 channels / positions, channels not a multiple of the vector width, every float dtype it
    # computes, 2-D / 3-D layers of 1-D shape
    calls["grouped 1-D k128 p64 over 49 frames (wav2vec2 positional)"] = _call(96, 96, 2, 128, (49,), padding=64,
                                                                              batch=3)
    calls["1-D k9 p4 over 4 positions, dead taps f64"] = _call(20, 70, 1, 9, (4,), padding=4, dtype=torch.float64)
    calls["1-D k3 p1 d2 40->80 long rows"] = _call(40, 80, 1, 3, (300,), padding=1, dilation=2, batch=3)
    # kn2row-lanes at strides > 1: the input's copies in phases (position i at row (i % s) * ceil(L / s) +
    # i / s), a tap's positions one run of rows in its phase: phases of unequal length (L not a multiple
    # of s), strides over the kernel (positions no tap meets), padding shifting taps across phases,
    # dilation, groups, a 2-D layer of 1-D shape, float64
    calls["1-D k3 s2 64->48 over 401 (wav2vec2 conv_layers)"] = _call(64, 48, 1, 3, (401,), stride=2, batch=3)
    calls["1-D k2 s2 40->24 over 64"] = _call(40, 24, 1, 2, (64,), stride=2)
    calls["1-D k2 s3 p1 over 50 (gaps)"] = _call(20, 36, 1, 2, (50,), stride=3, padding=1)
    calls["1-D k5 s4 p3 d2 grouped"] = _call(24, 32, 4, 5, (97,), stride=4, padding=3, dilation=2)
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(2, 16, 1, 60, generator=g), torch.randn(24, 16, 1, 7, generator=g)
    go = torch.randn(torch.nn.functional.conv2d(x, w, stride=(1, 3), padding=(0, 2)).shape, generator=g)
    calls["1x7 s(1, 3) p(0, 2) 2-D of 1-D shape"] = (go, x, w, [24], [1, 3], [0, 2], [1, 1], False, [0, 0], 1,
                                                     [True, True, True])
    calls["1-D k3 s2 p1 f64 over 33"] = _call(18, 20, 1, 3, (33,), stride=2, padding=1, dtype=torch.float64)
    g = torch.Generator().manual_seed(4)
    x2, w2 = torch.randn(2, 24, 1, 40, generator=g), torch.randn(36, 8, 1, 5, generator=g)
    go2 = torch.randn(2, 36, 1, 38, generator=g)
    calls["2-D 1x5 p(0,1) groups 3 (1-D shaped)"] = (go2, x2, w2, [36], [1, 1], [0, 1], [1, 1], False, [0, 0], 3,
                                                      [True, True, True])
    x3, w3, go3 = torch.randn(2, 5, 1, 1, 30, generator=g), torch.randn(7, 5, 1, 1, 4, generator=g), torch.randn(
        2, 7, 1, 1, 27, generator=g)
    calls["3-D 1x1x4 (1-D shaped)"] = (go3, x3, w3, [7], [1, 1, 1], [0, 0, 0], [1, 1, 1], False, [0, 0, 0], 1,
                                       [True, True, True])
    # kn2row: taps in one dim only
    go, x, w, *rest = _call(8, 8, 1, 1, (6, 7, 7))
    w3 = torch.randn(8, 8, 3, 1, 1, generator=torch.Generator().manual_seed(1))
    go3 = torch.randn(2, 8, 4, 7, 7, generator=torch.Generator().manual_seed(2))
    calls["3x1x1 (R(2+1)D)"] = (go3, x, w3, [8], [1, 1, 1], [0, 0, 0], [1, 1, 1], False, [0, 0, 0], 1, [True, True, True])
    # kn2row-planes: several 2,048-column tasks per sample, columns not a whole number of vectors, C_out
    # padded, a padded tap, dilation
    calls["3x1x1 p2 d2 20->24 5x30x31 (column blocks)"] = _call(20, 24, 1, (3, 1, 1), (5, 30, 31), padding=(2, 0, 0),
                                                               dilation=(2, 1, 1))
    # gemm-kn2row in bfloat16 (oneDNN's bfloat16 GEMMs, each output rounded once): a padded temporal
    # layer, several grad_input blocks and a channels-last input, taps in the last dim
    # (1-D, dilated: HiFi-GAN), taps in H, groups
    calls["3x1x1 p1 bf16 12->10 (R(2+1)D temporal)"] = _call(12, 10, 1, (3, 1, 1), (4, 9, 9), padding=(1, 0, 0),
                                                            dtype=torch.bfloat16, batch=3)
    calls["3x1x1 p1 bf16 channels_last 20->24 5x30x31 (blocks)"] = _call(
        20, 24, 1, (3, 1, 1), (5, 30, 31), padding=(1, 0, 0), dtype=torch.bfloat16, channels_last=True)
    calls["1-D k7 p9 d3 bf16 (HiFi-GAN)"] = _call(16, 16, 1, 7, (50,), padding=9, dilation=3, dtype=torch.bfloat16)
    calls["2-D 3x1 p(1,0) bf16 (taps in H)"] = _call(10, 12, 1, (3, 1), (9, 7), padding=(1, 0), dtype=torch.bfloat16)
    calls["grouped 1-D k5 p2 bf16"] = _call(16, 24, 2, 5, (40,), padding=2, dtype=torch.bfloat16)
    # R(2+1)D's spatial 1x3x3 layers: depth folded into the batch
    g = torch.Generator().manual_seed(3)
    x5, w5, go5 = torch.randn(2, 6, 3, 9, 8, generator=g), torch.randn(10, 6, 1, 3, 3, generator=g), torch.randn(2, 10, 3, 9, 8, generator=g)
    calls["1x3x3 p(0,1,1) (R(2+1)D spatial)"] = (go5, x5, w5, [10], [1, 1, 1], [0, 1, 1], [1, 1, 1], False, [0, 0, 0], 1,
                                                 [True, True, True])
    # The lanes walks read grad_output / input and write grad_input in place when NCHW or channels-last
    # (ConvNeXt's depthwise layers arrive all channels-last): every dtype (AVX-512 position loads for
    # float / bfloat16, plain loops otherwise), channels not a multiple of 16 (masked lanes), multipliers
    # (channel stride 2), bands, 3-D, 1-D (N, L, C) permuted, and each tensor channels-last alone
    calls["depthwise k7 p3 channels_last (ConvNeXt)"] = _call(40, 40, 40, 7, (14, 14), padding=3, channels_last=True)
    calls["depthwise k3 p1 channels_last bf16"] = _call(24, 24, 24, 3, (13, 11), padding=1, dtype=torch.bfloat16,
                                                        channels_last=True)
    calls["depthwise k3 p1 channels_last f64 x2"] = _call(9, 18, 9, 3, (10, 12), padding=1, dtype=torch.float64,
                                                          channels_last=True)
    calls["depthwise 112x112 k3 p1 channels_last (bands)"] = _call(20, 20, 20, 3, (112, 112), padding=1, batch=1,
                                                                   channels_last=True)
    calls["depthwise 3-D k3 p1 channels_last_3d"] = _call(17, 17, 17, 3, (4, 9, 9), padding=1, channels_last=True)
    go, x, w, *rest = _call(19, 19, 19, 5, (30,), padding=2, batch=3)
    calls["depthwise 1-D k5 (N, L, C) permuted"] = (
        go.transpose(1, 2).contiguous().transpose(1, 2), x.transpose(1, 2).contiguous().transpose(1, 2), w, *rest)
    go, x, w, *rest = _call(33, 33, 33, 7, (12, 10), padding=3)
    calls["depthwise k7 grad_output channels_last only"] = (go.contiguous(memory_format=torch.channels_last), x, w, *rest)
    calls["depthwise k7 input channels_last only"] = (go, x.contiguous(memory_format=torch.channels_last), w, *rest)
    for mask in ((True, False, False), (False, True, True), (False, True, False)):
        bits = "".join("1" if m else "0" for m in mask)
        calls[f"3x3 p1 mask {bits}"] = _call(12, 20, 1, 3, (10, 13), padding=1, mask=mask)
        calls[f"depthwise 56x56 mask {bits}"] = _call(18, 18, 18, 3, (20, 56), padding=1, mask=mask)
        calls[f"depthwise k7 28x28 mask {bits}"] = _call(17, 17, 17, 7, (28, 28), padding=3, mask=mask)
        calls[f"depthwise k7 channels_last mask {bits}"] = _call(20, 20, 20, 7, (9, 9), padding=3, channels_last=True,
                                                                 mask=mask)
        calls[f"depthwise 112x112 s2 mask {bits}"] = _call(17, 17, 17, 3, (112, 112), stride=2, padding=1, batch=1,
                                                           mask=mask)
        calls[f"pointwise 16->96 mask {bits}"] = _call(16, 96, 1, 1, (33, 40), mask=mask)
        calls[f"pointwise 16->96 bf16 mask {bits}"] = _call(16, 96, 1, 1, (33, 41), dtype=torch.bfloat16, mask=mask)
        calls[f"1-D long rows mask {bits}"] = _call(512, 8, 1, 4, (2203,), stride=2, padding=1, batch=1, mask=mask)
        calls[f"grouped 1-D k40 p20 mask {bits}"] = _call(32, 48, 2, 40, (17,), padding=20, mask=mask)
    return calls


CALLS = _calls()


def _claimed(calls, kernels=CANDIDATES):
    """The (kernel, call name) pairs of `calls` that each kernel computes (run once each)."""
    ext = compiled.extension()
    cases = []
    for (name, args), kernel in itertools.product(calls.items(), kernels):
        try:
            ext.run_kernel(kernel, *args)
        except ValueError:
            continue
        cases.append(pytest.param(kernel, name, id=f"{kernel}-{name}"))
    return cases


# Every (kernel, call) of CALLS that the kernel computes (each tried once, at collection).
CLAIMED = _claimed(CALLS) if compiled.unavailable_reason() is None else []


@pytest.mark.parametrize("kernel,call", CLAIMED)
def test_candidate_matches_native(kernel, call):
    args = CALLS[call]
    ours = compiled.extension().run_kernel(kernel, *args)
    assert ours is not None, f"{kernel} declined finite inputs"
    reference = None if args[0].dtype is torch.float64 else float64_reference(args)
    check_against_native(ours, call_native(args), reference, output_mask=args[-1], where=f"{kernel} on {call}")


@pytest.mark.parametrize("call,budget", [("1-D k5 s2 p3 d2 long rows", 8 << 20),
                                         ("grouped 1-D k7 s3 p2 d2 long rows f64", 1 << 20)])
def test_gemm_im2col_workspace_stays_bounded_on_long_rows(call, budget):
    """gemm-im2col's columns stay within its workspace bound on 1-D layers too: a row longer than the
    bound holds is split into parts (it used to be one chunk: wav2vec2's encoder took 13 MB of columns
    per call on one second of audio, 131 MB on ten). Every allocation but the outputs is within it."""
    args = CALLS[call]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        ours = compiled.extension().run_kernel("gemm-im2col", *args)
    outputs = {t.numel() * t.element_size() for t in ours if t is not None}
    allocations = [e.cpu_memory_usage for e in prof.events() if e.name == "aten::empty"]
    assert allocations, "the profiler no longer sees the workspace's allocation"
    assert max(a for a in allocations if a not in outputs) <= budget, (allocations, outputs)


def test_every_depthwise_call_has_both_walks():
    """Both depthwise walks are candidates on every depthwise call here (the tiles fit)."""
    ext = compiled.extension()
    for name, args in CALLS.items():
        if name.startswith("depthwise"):
            for kernel in ("depthwise-plane", "depthwise-lanes"):
                ext.run_kernel(kernel, *args)  # raises ValueError if not a candidate


@pytest.mark.parametrize("kernel", ["depthwise-lanes", "depthwise-bands"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_depthwise_lanes_walks_read_and_write_channels_last_in_place(kernel, dtype):
    """ConvNeXt's depthwise calls arrive with grad_output and input channels-last, and native gives
    grad_input channels-last: the lanes walks read and write them in place, no layout copy (the plane
    walk copies to NCHW and back), and the results are native's."""
    args = _call(20, 20, 20, 7, (112, 112), padding=3, batch=1, dtype=dtype, channels_last=True)
    ext = compiled.extension()
    try:
        ext.run_kernel(kernel, *args)
    except ValueError as e:  # bands: the whole-plane tiles fit this machine's L2
        pytest.skip(str(e))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ours = ext.run_kernel(kernel, *args)
    copies = [e.name for e in prof.events() if e.name in ("aten::copy_", "aten::contiguous", "aten::clone")]
    assert copies == [], f"{kernel} copied a tensor: {copies}"
    assert ours[0].is_contiguous(memory_format=torch.channels_last)
    reference = None if dtype is torch.float64 else float64_reference(args)
    check_against_native(ours, call_native(args), reference, output_mask=args[-1], where=f"{kernel} channels-last {dtype}")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ext.run_kernel("depthwise-plane", *args)
    assert any(e.name == "aten::copy_" for e in prof.events()), "the profiler no longer sees the plane walk's copies"


BAND_CALLS = [name for name in CALLS if name.startswith("depthwise 112x112") or name.startswith("depthwise 3-D 16x")]


@pytest.mark.parametrize("call", BAND_CALLS)
def test_depthwise_bands_claim_large_planes(call):
    """The banded walk is a candidate where the whole-plane tiles exceed the L2 (here: machines with
    up to 2 MiB of L2 per core) and a band of the kernel's reach fits its share of the L2; where it is
    not, it says which of the two the machine's L2 decides (a 512 KiB L2, Zen 3: the 3-D call's band
    of 47 rows needs 320 KiB, over the 256 KiB budget), and the sizes it gives agree with that."""
    try:
        compiled.extension().run_kernel("depthwise-bands", *CALLS[call])
    except ValueError as e:
        if "fit the L2" in str(e):
            pytest.skip(f"this machine's L2 holds the whole plane: {e}")
        band = re.search(r"needs (\d+) KiB of tiles, over 1/\d+ of the L2 \((\d+) KiB\)", str(e))
        assert band and int(band[1]) > int(band[2]), e
        pytest.skip(f"this machine's L2 holds no band of the kernel's reach: {e}")


def test_depthwise_bands_decline_small_planes_and_say_why():
    ext = compiled.extension()
    with pytest.raises(ValueError, match=r"depthwise-bands cannot compute this call: the whole plane's "
                                         r"channels-in-lanes tiles \(\d+ KiB\) fit the L2 \(\d+ KiB\)"):
        ext.run_kernel("depthwise-bands", *CALLS["depthwise 14x14 f16"])
    with pytest.raises(ValueError, match="depthwise-bands cannot compute this call: not depthwise"):
        ext.run_kernel("depthwise-bands", *CALLS["dense 3x3"])
    # 3-D with 9 taps in depth: a band must span 8 padded 66x66 slices (the kernel's reach), over 11 MiB
    x, w, go = torch.zeros(1, 16, 12, 64, 64), torch.zeros(16, 1, 9, 3, 3), torch.zeros(1, 16, 6, 64, 64)
    reach = (go, x, w, [16], [1, 1, 1], [1, 1, 1], [1, 1, 1], False, [0, 0, 0], 16, [True, True, True])
    with pytest.raises(ValueError, match=r"a band of \d+ rows \(the kernel's reach\) needs \d+ KiB of tiles"):
        ext.run_kernel("depthwise-bands", *reach)


def test_winograd_declines_non_finite_grad_output_and_weight():
    """A Winograd tile mixes its 4x4 positions (B^T d B, then A^T M A): one inf in grad_output is
    inf - inf = NaN across the tile and its neighbours' outputs, where native has finite values. So
    the kernel declines (native's result serves) whenever grad_input or grad_weight is not finite,
    and when the weight is not (the tuner's and the table's contract for kernels that sum over
    padding zeros)."""
    ext = compiled.extension()
    args = _call(8, 8, 1, 3, (12, 12), padding=1)
    assert ext.run_kernel("winograd", *args) is not None
    for index, value in (((0, 0, 0, 0), float("inf")), ((1, 7, 5, 6), float("-inf")), ((1, 7, 11, 11), float("nan"))):
        go = args[0].clone()
        go[index] = value
        assert ext.run_kernel("winograd", go, *args[1:]) is None, index
        gi_only = (go, *args[1:-1], [True, False, False])
        assert ext.run_kernel("winograd", *gi_only) is None, index
    w = args[2].clone()
    w[3, 2, 1, 1] = float("inf")
    assert ext.run_kernel("winograd", args[0], args[1], w, *args[3:-1], [True, False, False]) is None


@pytest.fixture(params=["wide", "pair"])
def vector_type(request):
    """Forces the vector code's type: 64-byte vectors in AVX-512 registers or pairs of 32-byte AVX2
    vectors, each with its own register blocks (the CPU's otherwise, so one machine would test only
    its own; the code of both is built for every ISA level), and restores the CPU's."""
    yield from _forced(compiled.extension().set_vector_type, request.param)


def _forced(setter, choice):
    """A fixture's body: setter(choice) for one test, then setter(None) (the measured or the CPU's own)."""
    setter(choice)
    try:
        yield choice
    finally:
        setter(None)


# The kernels whose vector code computes in either vector type: the products of fused.h's micro-kernels
# (winograd's with its GEMMs there, and its transforms), the depthwise walks and grouped-lanes.
_VECTOR_CODE_KERNELS = ("pointwise-fused", "kn2row-lanes", "winograd", "depthwise-plane", "depthwise-lanes",
                        "depthwise-bands", "grouped-lanes")
_VECTOR_CODE_CALLS = [p for p in CLAIMED if p.values[0] in _VECTOR_CODE_KERNELS]


@pytest.mark.parametrize("kernel,call", _VECTOR_CODE_CALLS)
def test_vector_code_matches_native_in_either_vector_type(vector_type, kernel, call):
    """Every call these kernels claim, computed in Vec (AVX-512's register blocks) and in VecPair
    (AVX2's): on a Zen 3 core GCC kept Vec's accumulators in memory (pointwise-fused 8-21x native's
    time, the depthwise walks 2.5-4x their VecPair time), so CPUs without AVX-512 compute in VecPair;
    both must give native's results."""
    ext = compiled.extension()
    args = CALLS[call]
    assert ext.vector_type() == vector_type
    if kernel == "winograd":
        ext.set_winograd_gemm("vectors")
    try:
        ours = ext.run_kernel(kernel, *args)
    finally:
        ext.set_winograd_gemm(None)
    reference = None if args[0].dtype is torch.float64 else float64_reference(args)
    check_against_native(ours, call_native(args), reference, output_mask=args[-1],
                         where=f"{kernel} ({vector_type} vectors) on {call}")


@pytest.mark.parametrize("kernel,call", [p for p in _VECTOR_CODE_CALLS if p.values[0] != "pointwise-fused"])
def test_wide_and_pair_vectors_give_the_same_bits(kernel, call):
    """Each sum has the same order in either vector type, and the tile moves are exact (on an AVX-512
    CPU 'wide' moves tiles with AVX-512, 'pair' with AVX2, bfloat16 rounding included; elsewhere both
    with AVX2): the same bits. pointwise-fused is left out: its register blocks change its sums'
    order."""
    ext = compiled.extension()
    results = []
    try:
        ext.set_winograd_gemm("vectors")
        for forced in ("wide", "pair"):
            ext.set_vector_type(forced)
            results.append(ext.run_kernel(kernel, *CALLS[call]))
    finally:
        ext.set_vector_type(None)
        ext.set_winograd_gemm(None)
    _assert_same_bits(results, f"{kernel} on {call}")


def test_vector_type_is_the_cpus_and_can_be_forced():
    ext = compiled.extension()
    flags = set()
    if sys.platform.startswith("linux"):
        with open("/proc/cpuinfo") as f:
            flags = next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    assert ext.vector_type() == ("wide" if {"avx512f", "avx512bw", "avx512vl"} <= flags else "pair")
    before = ext.vector_type()
    try:
        for forced in ("pair", "wide"):
            ext.set_vector_type(forced)
            assert ext.vector_type() == forced
        with pytest.raises(ValueError, match="type must be 'wide', 'pair' or None, got 'avx2'"):
            ext.set_vector_type("avx2")
    finally:
        ext.set_vector_type(None)
    assert ext.vector_type() == before


# The kernels whose every sum has a fixed order: the same bits at any thread count. gemm-im2col and
# gemm-kn2row call the library's GEMMs (MKL / oneDNN), whose bits change with its thread count.
_OWN_KERNELS = tuple(k for k in CANDIDATES if k not in ("native", "gemm-im2col", "gemm-kn2row"))


def _run_at_thread_counts(kernel, args, counts=(1, 2, 3, 1)):
    """The kernel's results at each of `counts` threads (the thread count restored after)."""
    ext = compiled.extension()
    before = torch.get_num_threads()
    results = []
    try:
        for threads in counts:
            torch.set_num_threads(threads)
            results.append(ext.run_kernel(kernel, *args))
    finally:
        torch.set_num_threads(before)
    return results


def _assert_same_bits(results, where):
    for run, other in enumerate(results[1:], 1):
        for i, (a, b) in enumerate(zip(results[0], other)):
            assert (a is None) == (b is None)
            if a is not None:  # (strides follow native's, which change with the thread count on 1x1 weights)
                assert torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)), (
                    f"{where}: output {i} of run {run} differs from run 0's")


@pytest.mark.parametrize("kernel,call", [p for p in CLAIMED if p.values[0] in _OWN_KERNELS])
def test_own_kernels_give_the_same_bits_at_any_thread_count(kernel, call):
    """Every call our own kernels claim: 1, 2, 3 and again 1 thread give the same bits (tasks are
    blocks of channels, positions or taps, each element written by one task; grad_weight's partial
    sums are fixed in number and added in order)."""
    _assert_same_bits(_run_at_thread_counts(kernel, CALLS[call]), f"{kernel} on {call}")


@pytest.mark.parametrize("kernel,call", [("pointwise-fused", "pointwise 16->96 112x112 batch 1 (chunks)"),
                                         ("pointwise-fused", "pointwise 13->21 7x7 batch 40 (partials)"),
                                         ("kn2row-lanes", "grouped 1-D k128 p64 over 49 frames (wav2vec2 positional)"),
                                         ("kn2row-lanes", "1-D k3 p1 d2 40->80 long rows")])
def test_fused_kernels_give_the_same_bits_at_any_thread_count(kernel, call, vector_type):
    """pointwise-fused: grad_weight's partial sums are a fixed number of slabs of (sample, chunk) tasks,
    added in slab order; kn2row-lanes: one task per (group, block of taps) for grad_weight, per (group,
    block of positions) summing over the taps in order for grad_input. Each element is written by one
    task: 1, 2 and 3 threads give the same bits."""
    _assert_same_bits(_run_at_thread_counts(kernel, CALLS[call]), f"{kernel} on {call}")


@pytest.mark.parametrize("shape", [(2, 16, 24, 112), (4, 32, 2048, 8), (8, 512, 2048, 7)],
                         ids=["grad_weight over 2x112x112", "grad_input over 2048 channels", "ResNet-50 layer4 conv3"])
def test_pointwise_fused_long_sums_as_accurate_as_native(shape, vector_type):
    """Each float32 sum of the kernel runs over blocks of 64 terms, then their totals: grad_weight over
    every position of the batch (mean-1 data, like a ReLU's output), grad_input over C_out channels.
    One running sum measured 7.5 eps (grad_weight, 25,088 positions) and 14-22 eps (grad_input,
    2,048 channels) where native's blocked GEMM sums have 2-5; now within 2x native's error + 2 eps of
    the result's scale, against float64."""
    n, c_in, c_out, size = shape
    g = torch.Generator().manual_seed(5)
    x = torch.rand(n, c_in, size, size, generator=g) + 0.5
    go = torch.rand(n, c_out, size, size, generator=g) + 0.5
    w = torch.randn(c_out, c_in, 1, 1, generator=g) / c_in ** 0.5 + 1.0
    args = (go, x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1, [True, True, False])
    ours = compiled.extension().run_kernel("pointwise-fused", *args)
    native = call_native(args)
    exact = call_native([t.double() if isinstance(t, torch.Tensor) else t for t in args])
    assert_within_twice_native_error(ours, native, exact, outputs=(0, 1))


def _long_sum_call(c_in, c_out, groups, kernel, spatial, *, stride=1, padding=0, dilation=1, batch=2,
                   channels_last=False):
    """A float32 call whose sums are long and do not cancel: input and grad_output uniform in [0.5, 1.5)
    (a ReLU's output and a loss's gradient are one-signed too), weight with a positive mean."""
    dims = len(spatial)
    kernel = list(kernel) if isinstance(kernel, tuple) else [kernel] * dims
    g = torch.Generator().manual_seed(7)
    fan_in = c_in // groups * kernel[0]
    x = torch.rand(batch, c_in, *spatial, generator=g) + 0.5
    w = torch.randn(c_out, c_in // groups, *kernel, generator=g) / fan_in ** 0.5 + 1.0 / (c_in // groups)
    conv = (torch.nn.functional.conv1d, torch.nn.functional.conv2d, torch.nn.functional.conv3d)[dims - 1]
    go = torch.rand(conv(x, w, stride=stride, padding=padding, dilation=dilation, groups=groups).shape, generator=g) + 0.5
    if channels_last:
        fmt = torch.channels_last if dims == 2 else torch.channels_last_3d
        x, go = x.contiguous(memory_format=fmt), go.contiguous(memory_format=fmt)
    return (go, x, w, [c_out], [stride] * dims, [padding] * dims, [dilation] * dims, False, [0] * dims, groups,
            [True, True, True])


# Calls with long float32 sums of each kind some kernel claims: grad_weight / grad_bias over every
# position of the batch (depthwise, one-channel, winograd's tiles), grad_input over C_out / groups x taps
# (grouped with 64 and 48 channels per group and 31 / 128 taps, dense 3x3 over 256 channels, wide 1-D
# kernels), positions reached by a few columns of a tap (the ends of wav2vec2's positional convolution).
LONG_SUMS = {
    "depthwise 3x3 112x112": _long_sum_call(32, 32, 32, 3, (112, 112), padding=1),
    "depthwise 7x7 56x56 channels_last (ConvNeXt)": _long_sum_call(48, 48, 48, 7, (56, 56), padding=3,
                                                                   channels_last=True),
    "depthwise 5x5 s2 112x112": _long_sum_call(32, 32, 32, 5, (112, 112), stride=2, padding=2),
    "depthwise 1-D k31 over 4000": _long_sum_call(32, 32, 32, 31, (4000,), padding=15),
    "grouped 1-D k31 64 per group": _long_sum_call(128, 128, 2, 31, (60,), padding=15),
    "grouped 3x3 32 per group 28x28": _long_sum_call(256, 256, 8, 3, (28, 28), padding=1, batch=4),
    "grouped 1-D k128 p64 48 per group (wav2vec2 positional)": _long_sum_call(768, 768, 16, 128, (49,),
                                                                              padding=64),
    "dense 3x3 256 channels 14x14": _long_sum_call(256, 256, 1, 3, (14, 14), padding=1, batch=4),
    "dense 3x3 64 channels 56x56": _long_sum_call(64, 64, 1, 3, (56, 56), padding=1, batch=4),
    "one-channel 1-D k10 s5 over 16000": _long_sum_call(1, 64, 1, 10, (16000,), stride=5, batch=4),
    "1-D k3 s2 512 channels": _long_sum_call(512, 512, 1, 3, (999,), stride=2),
    "1-D k3 d2 over 3000": _long_sum_call(128, 128, 1, 3, (3000,), padding=2, dilation=2),
    "1-D k64 p32 over 200": _long_sum_call(64, 64, 1, 64, (200,), padding=32),
    "3x1x1 (R(2+1)D)": _long_sum_call(64, 64, 1, (3, 1, 1), (8, 28, 28)),
    "pointwise 512->2048 7x7": _long_sum_call(512, 2048, 1, 1, (7, 7), batch=8),
}


LONG_SUMS_CLAIMED = _claimed(LONG_SUMS, CANDIDATES[1:]) if compiled.unavailable_reason() is None else []


@pytest.mark.parametrize("kernel,call", LONG_SUMS_CLAIMED)
def test_long_sums_as_accurate_as_native(kernel, call, vector_type):
    """Every float32 sum of every kernel is as accurate as native's blocked GEMM sums: within 2x native's
    error + 2 eps of the result's scale, against float64, on each output. Two kernels were not:
    grouped-lanes' grad_input was one running sum over C_out / groups x taps (17-31 eps where native has
    2-4) and now sums blocks of at most 128 terms; gemm-kn2row's grad_input went through MKL's addmm_,
    which on outputs of 2-8 columns adds every product into the running total (16 eps at the ends of
    wav2vec2's positional convolution, native 4), and now forms each tap's product apart."""
    args = LONG_SUMS[call]
    ours = compiled.extension().run_kernel(kernel, *args)
    native = call_native(args)
    exact = call_native([t.double() if isinstance(t, torch.Tensor) else t for t in args])
    assert_within_twice_native_error(ours, native, exact, outputs=(0, 1, 2))


def test_long_sums_reach_the_kernels_that_summed_in_one_chain():
    """The calls above still reach the two kernels whose sums were fixed (where their predicates admit
    this machine: grouped-lanes needs its tiles within the L2), so the test above can fail for them."""
    claimed = {(p.values[0], p.values[1]) for p in LONG_SUMS_CLAIMED}
    assert ("gemm-kn2row", "grouped 1-D k128 p64 48 per group (wav2vec2 positional)") in claimed
    assert ("grouped-lanes", "grouped 1-D k31 64 per group") in claimed
    assert ("grouped-lanes", "grouped 1-D k128 p64 48 per group (wav2vec2 positional)") in claimed


@pytest.mark.parametrize("where", ["grad_output", "input", "weight"])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_pointwise_fused_non_finite_values_decline_or_match_native(where, bad):
    """No padding, so every product native forms is one of ours and no other: an inf or NaN gives
    native's NaN / inf pattern, or the kernel declines (grad_weight not finite, or the weight: the
    contract of every kernel here) and native's result serves."""
    ext = compiled.extension()
    args = list(_call(20, 36, 1, 1, (9, 30), batch=3))
    index = {"grad_output": 0, "input": 1, "weight": 2}[where]
    t = args[index].clone()
    t.view(-1)[t.numel() // 2 + 3] = bad
    args[index] = t
    for mask in ([True, True, True], [True, False, False], [False, True, False]):
        call = (*args[:-1], mask)
        ours = ext.run_kernel("pointwise-fused", *call)
        if ours is None:
            continue
        for o, n, wanted in zip(ours, call_native(call), mask):
            if wanted:
                torch.testing.assert_close(o, n, equal_nan=True, rtol=1e-4, atol=1e-4)
    assert ext.run_kernel("pointwise-fused", *(*args[:-1], [True, False, False])) is None or where != "weight"


def test_pointwise_fused_declines_what_it_does_not_compute_and_says_why():
    ext = compiled.extension()
    for call, why in (("pointwise s2", "not 1x1 with stride 1 and no padding"),
                      ("dense 3x3", "not 1x1 with stride 1 and no padding"),
                      ("3x1x1 (R(2+1)D)", "not 1x1 with stride 1 and no padding"),
                      ("grouped 16 per group s2", "grouped"),
                      ("pointwise channels_last bf16", "float16 / bfloat16"),
                      ("pointwise 24->40 f16", "float16 / bfloat16")):
        with pytest.raises(ValueError, match=f"pointwise-fused cannot compute this call: {why}"):
            ext.run_kernel("pointwise-fused", *CALLS[call])
    grouped_1x1 = _call(8, 8, 2, 1, (5, 5))
    with pytest.raises(ValueError, match="pointwise-fused cannot compute this call: grouped"):
        ext.run_kernel("pointwise-fused", *grouped_1x1)


# --- pointwise-bf16: the CPU's bfloat16 dot products (AVX512_BF16), or the same sums emulated -----

def _cpu_flags():
    if not sys.platform.startswith("linux"):
        return set()
    with open("/proc/cpuinfo") as f:
        return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())


HAS_BF16_DOT = "avx512_bf16" in _cpu_flags() and {"avx512f", "avx512bw", "avx512vl"} <= _cpu_flags()


def _claimed_by_pointwise_bf16():
    """The calls of CALLS pointwise-bf16 computes with its dot products emulated (so on any CPU)."""
    ext = compiled.extension()
    ext.set_bf16_dot("emulated")
    try:
        return [p.values[1] for p in _claimed(CALLS, ("pointwise-bf16",))]
    finally:
        ext.set_bf16_dot(None)


POINTWISE_BF16_CALLS = _claimed_by_pointwise_bf16() if compiled.unavailable_reason() is None else []


@pytest.fixture(params=["avx512_bf16", "emulated"])
def bf16_dot(request):
    """Forces pointwise-bf16's dot products: the CPU's AVX512_BF16 instruction, or the same sums in
    scalar code, which runs on any CPU (so every machine tests the kernel's chunks, pairs and tails);
    restores the CPU's after."""
    if request.param == "avx512_bf16" and not HAS_BF16_DOT:
        pytest.skip("this CPU has no AVX512_BF16 (no avx512_bf16 flag in /proc/cpuinfo)")
    yield from _forced(compiled.extension().set_bf16_dot, request.param)


def test_pointwise_bf16_claims_its_calls():
    """Every bfloat16 stride-1 1x1 call of CALLS (odd planes and channel counts, chunks, partials,
    channels-last, every mask) and nothing else, so the tests below can fail."""
    expected = {name for name, args in CALLS.items()
                if name.startswith("pointwise") and args[0].dtype is torch.bfloat16 and " s2" not in name}
    assert len(expected) >= 10
    assert set(POINTWISE_BF16_CALLS) == expected


@pytest.mark.parametrize("call", POINTWISE_BF16_CALLS)
def test_pointwise_bf16_matches_native(bf16_dot, call):
    args = CALLS[call]
    ours = compiled.extension().run_kernel("pointwise-bf16", *args)
    assert ours is not None, "pointwise-bf16 declined finite inputs"
    check_against_native(ours, call_native(args), float64_reference(args), output_mask=args[-1],
                         where=f"pointwise-bf16 ({bf16_dot}) on {call}")


@pytest.mark.skipif(not HAS_BF16_DOT, reason="this CPU has no AVX512_BF16 (no avx512_bf16 flag in /proc/cpuinfo)")
@pytest.mark.parametrize("call", POINTWISE_BF16_CALLS)
def test_pointwise_bf16_instruction_and_emulation_give_the_same_bits(call):
    """vdpbf16ps adds the odd product, then the even one, each add rounded (Intel's definition; a Zen 4
    core matched it on 1.6 million random lanes): the emulation sums in that order, so the two give the
    same bits (denormals aside, which the instruction flushes), and the emulation that CPUs without
    AVX512_BF16 test is the kernel that runs here. The instruction's data moves (word permutes, 16x16
    transposes of pairs, masked tails, rounding) are checked by the same equality."""
    ext = compiled.extension()
    results = []
    try:
        for kind in ("avx512_bf16", "emulated"):
            ext.set_bf16_dot(kind)
            results.append(ext.run_kernel("pointwise-bf16", *CALLS[call]))
    finally:
        ext.set_bf16_dot(None)
    _assert_same_bits(results, f"pointwise-bf16 on {call}")


@pytest.mark.parametrize("call", ["pointwise 16->96 112x112 bf16 batch 1 (chunks)",
                                  "pointwise 17->33 7x7 bf16 batch 40 (odd plane, partials)"])
def test_pointwise_bf16_gives_the_same_bits_at_any_thread_count(bf16_dot, call):
    """grad_weight's float32 partials are a fixed number of slabs of (sample, chunk) tasks, added in
    slab order and rounded once; each grad_input element is written by one task."""
    _assert_same_bits(_run_at_thread_counts("pointwise-bf16", CALLS[call]), f"pointwise-bf16 ({bf16_dot}) on {call}")


@pytest.mark.parametrize("shape", [(2, 16, 24, 112), (4, 32, 2048, 8), (8, 512, 2048, 7), (8, 96, 24, 56)],
                         ids=["grad_weight over 2x112x112", "grad_input over 2048 channels", "ResNet-50 layer4 conv3",
                              "EfficientNet project"])
def test_pointwise_bf16_long_sums_as_accurate_as_native(bf16_dot, shape):
    """One-signed data (a ReLU's output, a loss's gradient) with long float32 sums: grad_weight over
    every position of the batch, grad_input over C_out channels. Each sum runs over blocks of 128 pairs,
    then their totals, rounded to bfloat16 once: within twice native's error against float64 (plus a
    few bfloat16 ulps of the result's scale), as every comparison here."""
    n, c_in, c_out, size = shape
    g = torch.Generator().manual_seed(5)
    x = (torch.rand(n, c_in, size, size, generator=g) + 0.5).bfloat16()
    go = (torch.rand(n, c_out, size, size, generator=g) + 0.5).bfloat16()
    w = (torch.randn(c_out, c_in, 1, 1, generator=g) / c_in ** 0.5 + 1.0).bfloat16()
    args = (go, x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1, [True, True, False])
    ours = compiled.extension().run_kernel("pointwise-bf16", *args)
    check_against_native(ours, call_native(args), float64_reference(args), output_mask=args[-1],
                         where=f"pointwise-bf16 ({bf16_dot}) long sums {shape}")


@pytest.mark.parametrize("where", ["grad_output", "input", "weight"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_pointwise_bf16_non_finite_values_decline_or_match_native(bf16_dot, where, bad):
    """As pointwise-fused: no padding, so an inf or NaN gives native's pattern, or the kernel declines
    (a grad_weight or weight not finite) and native's result serves. The planes are odd (9x31), and a
    bad value also sits in the first position of a plane that follows another in memory: an odd chunk's
    last position is a pair of its own, so that value never reaches the channel before it."""
    ext = compiled.extension()
    args = list(_call(20, 35, 1, 1, (9, 31), batch=3, dtype=torch.bfloat16))
    index = {"grad_output": 0, "input": 1, "weight": 2}[where]
    t = args[index].clone()
    flat = t.view(-1)
    flat[t.numel() // 2 + 3] = bad
    if where != "weight":
        t[1, 5, 0, 0] = bad
    args[index] = t
    for mask in ([True, True, True], [True, False, False], [False, True, False]):
        call = (*args[:-1], mask)
        ours = ext.run_kernel("pointwise-bf16", *call)
        if ours is None:
            continue
        for o, n, wanted in zip(ours, call_native(call), mask):
            if wanted:
                # bfloat16's error scales with the result: native's own grad_weight, on a CPU without
                # bfloat16 instructions (a Zen 3 VM), was 0.29 from float64 on a largest value of 83.5
                finite = n.float()[n.float().isfinite()]
                scale = finite.abs().max().item() if finite.numel() else 1.0
                torch.testing.assert_close(o.float(), n.float(), equal_nan=True, rtol=2e-2, atol=2 ** -6 * scale)
    assert ext.run_kernel("pointwise-bf16", *(*args[:-1], [True, False, False])) is None or where != "weight"


def test_bf16_dot_is_the_cpus_and_can_be_forced():
    ext = compiled.extension()
    assert ext.bf16_dot() == ("avx512_bf16" if HAS_BF16_DOT else "none")
    try:
        ext.set_bf16_dot("emulated")
        assert ext.bf16_dot() == "emulated"
        with pytest.raises(ValueError, match="kind must be 'avx512_bf16', 'emulated' or None, got 'amx'"):
            ext.set_bf16_dot("amx")
        if HAS_BF16_DOT:
            ext.set_bf16_dot("avx512_bf16")
            assert ext.bf16_dot() == "avx512_bf16"
        else:
            with pytest.raises(RuntimeError, match="this CPU has no AVX512_BF16"):
                ext.set_bf16_dot("avx512_bf16")
    finally:
        ext.set_bf16_dot(None)
    assert ext.bf16_dot() == ("avx512_bf16" if HAS_BF16_DOT else "none")


def test_pointwise_bf16_declines_what_it_does_not_compute_and_says_why():
    ext = compiled.extension()
    cases = [("pointwise s2", "not 1x1 with stride 1 and no padding"),
             ("pointwise 16->96 112x56 (MobileNetV2 expand)", "not bfloat16"),
             ("pointwise 24->40 f16", "not bfloat16"),
             ("3x3 p1 bf16", "not 1x1 with stride 1 and no padding")]
    try:
        ext.set_bf16_dot("emulated")
        for call, why in cases:
            with pytest.raises(ValueError, match=f"pointwise-bf16 cannot compute this call: {why}"):
                ext.run_kernel("pointwise-bf16", *CALLS[call])
        with pytest.raises(ValueError, match="pointwise-bf16 cannot compute this call: grouped"):
            ext.run_kernel("pointwise-bf16", *_call(8, 8, 2, 1, (5, 5), dtype=torch.bfloat16))
    finally:
        ext.set_bf16_dot(None)
    if not HAS_BF16_DOT:
        with pytest.raises(ValueError, match="this CPU has no AVX512_BF16 dot products"):
            ext.run_kernel("pointwise-bf16", *CALLS["pointwise 96->24 28x28 bf16 (EfficientNet project)"])


@pytest.fixture(params=["library", "vectors"])
def winograd_engine(request):
    """Forces the winograd kernel's GEMM engine (measured once per process, so one machine would
    otherwise test only the engine that wins there), and restores the measured choice."""
    yield from _forced(compiled.extension().set_winograd_gemm, request.param)


_WINOGRAD_CALLS = [name for kernel, name in (p.values for p in CLAIMED) if kernel == "winograd"]


@pytest.mark.parametrize("call", _WINOGRAD_CALLS)
def test_winograd_matches_native_with_either_gemm_engine(winograd_engine, call):
    """Both engines of the 16 GEMMs per chunk (the library's bmm, our vector micro-kernels with any
    strides of a: grad_weight reads H^T as a transposed view), whichever this machine measured faster."""
    args = CALLS[call]
    assert compiled.extension().winograd_gemm()["engine"] == winograd_engine
    ours = compiled.extension().run_kernel("winograd", *args)
    reference = None if args[0].dtype is torch.float64 else float64_reference(args)
    check_against_native(ours, call_native(args), reference, output_mask=args[-1],
                         where=f"winograd ({winograd_engine} GEMMs) on {call}")


def test_winograd_gemm_engine_is_the_measured_faster_one():
    ext = compiled.extension()
    report = ext.winograd_gemm()
    assert report["library_us"] > 0 and report["vectors_us"] > 0, report
    assert not report["forced"]
    assert report["engine"] == ("vectors" if report["vectors_us"] < report["library_us"] else "library"), report
    # The probe runs once per process: in a fresh one, it must not draw from the default generator
    # (a user's seeded random stream would then depend on whether winograd was measured).
    code = ("import torch; from aten_override.ops.convolution_backward import compiled; torch.manual_seed(0); "
            "s = torch.random.get_rng_state(); compiled.extension().winograd_gemm(); "
            "print(torch.equal(s, torch.random.get_rng_state()))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "True"
    with pytest.raises(ValueError, match="engine must be 'library', 'vectors' or None, got 'mkl'"):
        ext.set_winograd_gemm("mkl")
    assert ext.winograd_gemm() == report


def test_streaming_stores_are_the_measured_faster_way():
    """How large grad_input outputs are written is measured once per process, on the kernel (a constant
    had chosen non-temporal stores everywhere: on a Zen 3 VM they were the slower way), and forcing shows."""
    ext = compiled.extension()
    report = ext.streaming_stores()
    assert not report["forced"]
    if report["direct_us"] == 0:  # no streaming stores on this CPU: nothing measured, never streamed
        assert report == {"streaming": False, "direct_us": 0.0, "streamed_us": 0.0, "forced": False}
    else:
        assert report["streamed_us"] > 0, report
        assert report["streaming"] == (report["streamed_us"] < report["direct_us"]), report
    try:
        for way in (False, True):
            ext.set_streaming_stores(way)
            assert ext.streaming_stores() == {**report, "streaming": way and report["direct_us"] > 0, "forced": True}
    finally:
        ext.set_streaming_stores(None)
    assert ext.streaming_stores() == report  # measured once per process
    # In a fresh process the measurement must not draw from the default generator.
    code = ("import torch; from aten_override.ops.convolution_backward import compiled; torch.manual_seed(0); "
            "s = torch.random.get_rng_state(); compiled.extension().streaming_stores(); "
            "print(torch.equal(s, torch.random.get_rng_state()))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "True"


@pytest.mark.parametrize("kernel,call", [p for p in CLAIMED if "streamed grad_input" in p.values[1]])
def test_large_grad_input_is_the_same_written_either_way(kernel, call):
    """A grad_input of 8 MiB or more, written with ordinary stores and through a staging buffer with
    non-temporal stores (whichever this machine measured faster serves; both forced here): native's
    values, and the same bits both ways."""
    ext = compiled.extension()
    args = CALLS[call]
    results = []
    try:
        for way in (False, True):
            ext.set_streaming_stores(way)
            results.append(ext.run_kernel(kernel, *args))
    finally:
        ext.set_streaming_stores(None)
    assert results[0][0].numel() * results[0][0].element_size() >= 8 << 20, "grad_input under the streaming bound"
    check_against_native(results[1], call_native(args), float64_reference(args), output_mask=args[-1],
                         where=f"{kernel} on {call}, streamed")
    _assert_same_bits(results, f"{kernel} on {call}, ordinary stores (run 0) and streamed (run 1)")


@pytest.mark.parametrize("call", ["3x3 p1 64->64 56x22 (ResNet-50 stage 1)", "3x3 p1 256->256 9x9 (one task)"])
def test_winograd_gives_the_same_bits_at_any_thread_count(call, winograd_engine):
    """Threads take runs of tile chunks; grad_weight's partial sums are at most 32 runs of chunks, a
    number that does not depend on the thread count, added in run order (they were one per thread, so
    grad_weight's bits changed with the thread count); a single run computes on the calling thread,
    its GEMMs on the library's threads. 1, 2, 3 and again 1 thread give the same bits, and native's
    values."""
    args = CALLS[call]
    results = _run_at_thread_counts("winograd", args)
    _assert_same_bits(results, f"winograd on {call}")
    check_against_native(results[0], call_native(args), float64_reference(args), output_mask=args[-1], where=call)


def test_depthwise_bands_are_deterministic():
    """Two runs give the same bits, and so do 1 and 2 threads (tasks are blocks of channels; bands run
    in a fixed order within a task)."""
    ext = compiled.extension()
    args = CALLS["depthwise 112x112 s2 (MobileNetV2 layer.0) batch 3"]
    try:
        first = ext.run_kernel("depthwise-bands", *args)
    except ValueError as e:
        pytest.skip(str(e))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ext.run_kernel("depthwise-bands", *args)
        torch.set_num_threads(2)
        two = ext.run_kernel("depthwise-bands", *args)
    finally:
        torch.set_num_threads(threads)
    for a, b, c in zip(first, one, two):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)) and torch.equal(b.view(torch.int32), c.view(torch.int32))


@pytest.mark.parametrize("kernel", ["kn2row-lanes", "gemm-kn2row", "kn2row-planes"])
@pytest.mark.parametrize("stride", [1, 4])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kn2row_kernels_keep_a_non_finite_grad_output_where_only_padding_meets_it(kernel, stride, bad, dtype):
    """The kn2row kernels form only the products of positions where a tap meets the input. An inf or NaN
    in grad_output at an output position that only padding meets gives native NaN in grad_weight
    (inf x 0); it used to vanish from ours (found by a fresh-user review: under enable("compiled") an inf
    in a bias-free layer's incoming gradient disappeared from the whole backward). Such calls decline,
    and native's result serves; finite ones are still computed."""
    ext = compiled.extension()
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 4, 6, generator=g, dtype=dtype), torch.randn(4, 4, 7, generator=g, dtype=dtype)
    go = torch.randn(torch.nn.functional.conv1d(x, w, stride=stride, padding=9).shape, generator=g, dtype=dtype)
    args = [go, x, w, None, [stride], [9], [1], False, [0], 1, [True, True, False]]
    try:
        assert ext.run_kernel(kernel, *args) is not None
    except ValueError as e:  # gemm-kn2row: stride 1 only
        pytest.skip(str(e))
    go = go.clone()
    go[1, 2, 0] = bad  # output position 0 reads input positions -9..-3: padding only
    args[0] = go
    native = call_native(args)
    assert native[1].isnan().any()
    ours = ext.run_kernel(kernel, *args)
    assert ours is None or torch.equal(ours[1].isnan(), native[1].isnan())
    assert ext.run_kernel(kernel, *(*args[:-1], [True, False, False])) is not None  # grad_input: no dead products


def test_kn2row_lanes_declines_what_it_does_not_compute_and_says_why():
    ext = compiled.extension()
    for call, why in [("depthwise 1-D k31 (Conformer)", "one input channel per group"),
                      ("dense 3x3", "not 1-D shaped"),
                      ("3x1x1 (R(2+1)D)", "not 1-D shaped"),
                      ("depthwise 5x5 s2 bf16", "float16 / bfloat16: not built")]:
        with pytest.raises(ValueError, match=f"kn2row-lanes cannot compute this call: {why}"):
            ext.run_kernel("kn2row-lanes", *CALLS[call])


def test_a_kernel_that_cannot_compute_a_call_says_why():
    ext = compiled.extension()
    with pytest.raises(ValueError, match="depthwise-lanes cannot compute this call: not depthwise"):
        ext.run_kernel("depthwise-lanes", *CALLS["dense 3x3"])
    with pytest.raises(ValueError, match="gemm-kn2row cannot compute this call"):
        ext.run_kernel("gemm-kn2row", *CALLS["dense 3x3"])
    with pytest.raises(ValueError, match="unknown kernel"):
        ext.run_kernel("depthwise", *CALLS["dense 3x3"])
    for call, why in (("1-D k3 s2 (wav2vec2 feature encoder)", "kernel not 3x3"), ("grouped 16 per group s2", "grouped"),
                      ("3-D 3x3x3", r"kernel not 3x3 \(or 1x3x3\)"), ("pointwise s2", "kernel not 3x3")):
        with pytest.raises(ValueError, match=f"winograd cannot compute this call: {why}"):
            ext.run_kernel("winograd", *CALLS[call])
    for change, why in ((dict(stride=2), "strided"), (dict(dilation=2, padding=2), "dilated"),
                        (dict(padding=3), "padding not the same in H and W, at most 2")):
        with pytest.raises(ValueError, match=f"winograd cannot compute this call: {why}"):
            ext.run_kernel("winograd", *_call(8, 8, 1, 3, (12, 12), **change))
    # lanes tiles beyond 16 MiB: a 1-D plane of 2^20 positions (16 lanes x 4 bytes x 3 tiles)
    big = _call(16, 16, 16, 3, (1 << 20,), padding=1, batch=1)
    with pytest.raises(ValueError, match="exceed 16 MiB"):
        ext.run_kernel("depthwise-lanes", *big)


def _split_cases():
    """Splits (grad_input and grad_bias from one kernel, grad_weight from another) on every call
    asking for both gradients where both kernels are candidates."""
    ext = compiled.extension()
    cases = []
    for name, args in CALLS.items():
        if not (args[-1][0] and args[-1][1]):
            continue
        claimed = []
        for kernel in CANDIDATES:
            try:
                ext.run_kernel(kernel, *args)
            except ValueError:
                continue
            claimed.append(kernel)
        for gi, gw in itertools.permutations(claimed[:3], 2):
            cases.append(pytest.param(f"{gi}+{gw}", name, id=f"{gi}+{gw}-{name}"))
    return cases


@pytest.mark.parametrize("choice,call", _split_cases() if compiled.unavailable_reason() is None else [])
def test_split_matches_native(choice, call):
    """What the autotuner may choose when the fastest grad_input and grad_weight kernels differ."""
    args = CALLS[call]
    ours = compiled.extension().run_kernel(choice, *args)
    reference = None if args[0].dtype is torch.float64 else float64_reference(args)
    check_against_native(ours, call_native(args), reference, output_mask=args[-1], where=f"{choice} on {call}")


def test_a_split_needs_both_gradients():
    ext = compiled.extension()
    go, x, w, *rest = CALLS["dense 3x3"]
    args = (go, x, w, *rest[:-1], [True, False, True])
    with pytest.raises(ValueError, match="is a split: it needs a call asking for grad_input and grad_weight"):
        ext.run_kernel("gemm-im2col+native", *args)
    with pytest.raises(ValueError, match="unknown kernel"):
        ext.run_kernel("native+native", *CALLS["dense 3x3"])


def _sys_cache_bytes(level):
    """cpu0's level-`level` data / unified cache from /sys, in bytes; None where /sys does not say."""
    from pathlib import Path

    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            found, kind, size = ((index / f).read_text().strip() for f in ("level", "type", "size"))
        except OSError:
            continue
        if int(found) == level and kind != "Instruction":
            return int(size.rstrip("KM")) << {"K": 10, "M": 20}.get(size[-1], 0)
    return None


@pytest.mark.parametrize("level", [1, 2, 3])
def test_cache_sizes_are_the_machines(level):
    """Tiles (depthwise bands, grouped lanes) and the autotuner's cache flush are sized by the caches
    the kernel reports in /sys: glibc's sysconf said 320 MiB of L3 on an AMD EPYC VM with 32 MiB."""
    expected = _sys_cache_bytes(level)
    if expected is None:
        pytest.skip(f"/sys reports no level-{level} cache here")
    assert compiled.extension().cache_bytes(level) == expected
    assert compiled.extension().cache_bytes(7) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")], ids=["inf", "-inf", "nan"])
def test_non_finite_anywhere_is_declined(dtype, value):
    """A kernel that sums over padding zeros declines a call with a non-finite weight (grad_input) or a
    non-finite grad_weight: the scan must see one at any position of any dtype, across the parallel
    chunks of a large tensor (2^16 elements each) and in a non-contiguous weight; finite tensors of
    the same calls are not declined."""
    ext = compiled.extension()
    # Depthwise, 1024 channels x 9x9 taps: 82944 weight elements (two parallel chunks).
    depthwise = _call(1024, 1024, 1024, 9, (9, 9), padding=4, batch=1, dtype=dtype, mask=(True, False, False))
    assert ext.run_kernel("depthwise-lanes", *depthwise) is not None
    numel = depthwise[2].numel()
    for position in (0, numel // 2, (1 << 16) - 1, 1 << 16, numel - 1):
        weight = depthwise[2].clone()
        weight.view(-1)[position] = value
        assert ext.run_kernel("depthwise-lanes", depthwise[0], depthwise[1], weight, *depthwise[3:]) is None, position
    # A channels-last weight (not contiguous as NCHW) with the bad value in its last channel.
    weight = depthwise[2].clone().contiguous(memory_format=torch.channels_last)
    weight[-1, 0, -1, -1] = value
    assert ext.run_kernel("depthwise-lanes", depthwise[0], depthwise[1], weight, *depthwise[3:]) is None
    if dtype in (torch.float32, torch.float64):
        # grad_weight (64 x 128 x 3 x 3 = 73728 elements) made non-finite by one input element.
        dense = _call(128, 64, 1, 3, (6, 6), padding=1, batch=1, dtype=dtype, mask=(False, True, False))
        assert ext.run_kernel("gemm-im2col", *dense) is not None
        x = dense[1].clone()
        x[0, -1, -1, -1] = value
        assert ext.run_kernel("gemm-im2col", dense[0], x, *dense[2:]) is None


def _transparent_huge_pages() -> str | None:
    """The kernel's transparent-huge-page mode (``always``, ``madvise`` or ``never``); None without them."""
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return None
    found = re.search(r"\[(\w+)\]", text)
    return found.group(1) if found else None


def _hinted_huge(t: torch.Tensor) -> bool:
    """Whether the mapping that holds ``t``'s first 2 MiB-aligned byte is madvise(MADV_HUGEPAGE)d: ``hg``
    in its VmFlags (/proc/self/smaps). (Its AnonHugePages would depend on the heap: glibc serves a
    large request from free heap space already faulted in 4 KiB pages when it has some.)"""
    address = (t.data_ptr() + (2 << 20) - 1) & ~((2 << 20) - 1)
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if re.fullmatch(r"[0-9a-f]+-[0-9a-f]+", head):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return "hg" in line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


# grad_input over glibc's largest mmap threshold (32 MiB): each call maps it afresh.
LARGE_CALLS = {
    "1x1 320->8, 64x64, batch 8 (40 MiB grad_input)": _call(320, 8, 1, 1, (64, 64), batch=8, mask=(True, False, False)),
    "depthwise 112x112 s2, batch 8 (38.5 MiB grad_input)": _call(96, 96, 96, 3, (112, 112), stride=2, padding=1, batch=8,
                                                                 mask=(True, False, False)),
}
LARGE_CLAIMED = _claimed(LARGE_CALLS, [k for k in CANDIDATES if k != "native"]) if compiled.unavailable_reason() is None else []


@pytest.mark.skipif(_transparent_huge_pages() is None, reason="this kernel has no transparent huge pages")
@pytest.mark.parametrize("kernel,call", LARGE_CLAIMED)
def test_large_grad_input_is_hinted_onto_huge_pages(kernel, call):
    """Every kernel's grad_input over 32 MiB is hinted onto transparent huge pages (``on_huge_pages`` in
    csrc/convolution_backward.cpp), where a plain allocation of its size is not: glibc maps such an
    allocation afresh on most calls, and its first
    touch then faults every 4 KiB page (2.2 us each on a Zen 3 VM: MobileNetV2's 112x112 stride-2
    depthwise call took 34 ms without the hint, 14 ms with it). Only the depthwise and grouped kernels
    had the hint before session 32; it now sits where the outputs are allocated (pointwise-fused on
    ResNet-50's 256->128 layer at batch 16: 0.77x its time; kn2row-planes on R(2+1)D's temporal layer:
    0.86x). Values are checked as everywhere above."""
    args = LARGE_CALLS[call]
    if os.environ.get("THP_MEM_ALLOC_ENABLE") == "1":
        pytest.skip("c10 hints every large allocation itself (THP_MEM_ALLOC_ENABLE=1)")
    if _hinted_huge(torch.empty(args[1].shape)):  # a plain allocation of grad_input's size: the control
        pytest.skip("this process's heap already carries the hint where a plain allocation lands")
    gi = compiled.extension().run_kernel(kernel, *args)[0]
    assert gi.numel() * gi.element_size() > 32 << 20
    assert _hinted_huge(gi), f"{kernel}: grad_input of {call} is not hinted onto huge pages"
    check_against_native((gi, None, None), call_native(args), output_mask=args[-1], where=f"{kernel} on {call}")
