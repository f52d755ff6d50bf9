// The kn2row-lanes kernel of the compiled backend: grad_input and grad_weight of layers whose taps all
// lie in one dim and whose other spatial dims are 1 (1-D layers, or 2-D / 3-D ones of that shape), any
// stride, padding, dilation and groups, float32 / float64. Per tap, one product over only the
// positions where that tap meets the input, on channels-last copies with a group's channels in the
// vector lanes, by fused::gemm_add's micro-kernels (no BLAS):
//   grad_weight[:, :, k] += grad_output[o_begin:o_end]^T @ input[stride * o + shift, o in o_begin:o_end]
//   grad_input[stride * o + shift, o in o_begin:o_end] += grad_output[o_begin:o_end] @ weight[:, :, k]
// with shift = k * dilation - padding and [o_begin, o_end) the output positions whose input position
// stride * o + shift exists (the rows are positions, the columns channels of one group).
//
// Why: wav2vec2's positional convolution (768 channels in 16 groups of 48, a kernel of 128 taps,
// padding 64, over the 49 frames of one second of audio): every output position meets the input
// through at most 49 of its 128 taps, so im2col / native compute 2.6x the products that count; and the
// products are small (48 x 48 x 49 per group, sample and tap), where a BLAS call costs more than its
// arithmetic (gemm-kn2row: 16 x 8 x 128 MKL calls per gradient) and MKL runs its AVX2 code on AMD CPUs.
// Its feature encoder's dense stride-2 layers (512 channels, 3 taps, 3,199 to 199 positions) are large
// GEMMs, which native's oneDNN ran at 47-86 GFLOP/s on a Zen 4 core that reaches 111.
//
// Layout: per group, [position][sample][channel] copies, so that a tap's valid positions are one run
// of rows for every sample: one product per (group, tap) serves the whole batch. With a stride s the
// input's copies are in phases: position i at row (i % s) * Q + i / s (Q = ceil(L_in / s)), so that
// the positions stride * o + shift of a tap's valid outputs are again one run of rows, in phase
// shift mod s (stride 1: one phase, the plain order).
// Threads and bits: grad_weight's tasks are (group, block of taps, block of output channels); grad_input's
// are (group, block of input rows) pairs, each summing over the taps in order. Every element is written by one task
// in a fixed order: the same bits for any thread count, no atomics. Threads take tasks as they finish
// (fused::for_each_chunk): with a stride the blocks' work differs (wav2vec2's stride-2, 3-tap layers: the
// even phase's blocks meet two taps, the odd phase's one), and an even split of the blocks left one of two
// threads idle for a third of grad_input's GEMMs.
#include "../convolution_backward.h"
#include "fused.h"
#include "workspace.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <numeric>
#include <vector>

namespace aten_override {
namespace {


// grad_input's input positions are split into at most this many blocks per group (tasks for threads
// when there are few groups); each block sums over the taps in order, so the bits do not depend on it.
constexpr int64_t kPositionBlocks = 16;

// grad_weight's taps per task: their sums (taps x C_out / groups x ci_pad) stay in the L2 until they
// are transposed into grad_weight (wav2vec2's positional convolution: 16 x 48 x 48 floats, 147 KiB).
constexpr int64_t kTapBlock = 16;
// grad_weight's output channels of a group are split into at most this many blocks of whole
// micro-kernels (tasks for threads when there are few groups and taps); a fixed number, not the thread
// count's, though the sums do not depend on it.
constexpr int64_t kRowBlocks = 4;

// The dim holding the taps (the last one when the kernel has a single tap).
int tap_dim(const DirectProblem& p) {
  for (int i = 0; i < 3; ++i) {
    if (p.kernel[i] > 1) return i;
  }
  return 2;
}

template <typename acc_t>
void kn2row_lanes_typed(
    const DirectProblem& p, const at::Tensor& go, const at::Tensor& x, const at::Tensor& w, at::Tensor* gi,
    at::Tensor* gw) {
  constexpr int64_t L = fused::Vec<acc_t>::size;
  const int d = tap_dim(p);
  const int64_t N = p.batch, G = p.groups, cin = p.in_per_group, cout = p.out_per_group;
  const int64_t l_in = p.in[d], l_out = p.out[d], taps = p.kernel[d], stride = p.stride[d];
  const int64_t ci_pad = fused::round_up<acc_t>(cin), co_pad = fused::round_up<acc_t>(cout);
  const auto options = go.options();
  // The input's rows: `stride` phases of q_len rows, input position i at row (i % stride) * q_len + i / stride.
  const int64_t q_len = (l_in + stride - 1) / stride, rows_in = stride * q_len;
  // Tap k: its outputs o read input row row0 + o, for o in [o_begin, o_end) (those whose input position
  // stride * o + shift lies in [0, l_in)).
  struct TapRows {
    int64_t row0, o_begin, o_end;
  };
  const auto tap_rows = [&](int64_t k) {
    const int64_t shift = k * p.dilation[d] - p.padding[d];
    const int64_t phase = ((shift % stride) + stride) % stride, q0 = (shift - phase) / stride;
    const int64_t phase_len = phase < l_in ? (l_in - phase + stride - 1) / stride : 0;
    return TapRows{phase * q_len + q0, std::max<int64_t>(0, -q0), std::min(l_out, phase_len - q0)};
  };
  std::vector<int64_t> index(std::max({l_in, l_out, p.kernel[d]}));
  std::iota(index.begin(), index.end(), int64_t{0});
  // for_each_chunk's size of the problem (it runs serially below kSerialElements)
  const int64_t elements = N * G * (cin * l_in + cout * l_out);
  std::vector<int64_t> in_rows(l_in);
  for (int64_t i = 0; i < l_in; ++i) in_rows[i] = i % stride * q_len + i / stride;

  // Channels-last copies, per group a [position][sample][channel] block (channels padded with zeros to
  // whole vectors): a tap's valid positions are then one run of rows for every sample at once, and one
  // product serves the whole batch. grad_output, and input (in phases) for grad_weight.
  const at::Tensor go_t = workspace::empty({G, l_out, N, co_pad}, options);
  const at::Tensor x_t = gw ? workspace::empty({G, rows_in, N, ci_pad}, options) : at::Tensor();
  at::parallel_for(0, G * N, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t g = t / N, n = t % N;
      const acc_t* src = go.const_data_ptr<acc_t>() + (n * G + g) * cout * l_out;
      acc_t* dst = go_t.mutable_data_ptr<acc_t>() + (g * l_out * N + n) * co_pad;
      for (int64_t c = 0; c < cout; c += L) {
        fused::load_tiles(src + c * l_out, l_out, std::min(L, cout - c), index.data(), l_out, dst + c, N * co_pad);
      }
      if (gw) {
        const acc_t* xs = x.const_data_ptr<acc_t>() + (n * G + g) * cin * l_in;
        acc_t* xd = x_t.mutable_data_ptr<acc_t>() + (g * rows_in * N + n) * ci_pad;
        for (int64_t c = 0; c < cin; c += L) {
          fused::load_tiles(xs + c * l_in, l_in, std::min(L, cin - c), in_rows.data(), l_in, xd + c, N * ci_pad);
        }
      }
    }
  });
  const acc_t* go_d = go_t.const_data_ptr<acc_t>();

  if (gw) {
    // One task per (group, block of kTapBlock taps, block of output channels): each tap's rows of
    // (C_out / groups) x ci_pad sums are one product over its valid positions of every sample, into a
    // buffer of the block's taps (L2-sized), then transposed into grad_weight's (C_out, C_in / groups,
    // taps) layout. The channel blocks (kRowBlocks, whole micro-kernels) give threads work where a
    // layer has few groups and taps (wav2vec2's encoder: one group, 2-3 taps); each sum is the same.
    acc_t* out = gw->mutable_data_ptr<acc_t>();
    const acc_t* x_d = x_t.const_data_ptr<acc_t>();
    const int64_t tap_blocks = (taps + kTapBlock - 1) / kTapBlock;
    const int64_t rows = fused::rows_of<acc_t>(fused::wide_vectors());
    const int64_t row_block = (cout + kRowBlocks * rows - 1) / (kRowBlocks * rows) * rows;
    const int64_t row_blocks = (cout + row_block - 1) / row_block;
    fused::for_each_chunk(G * tap_blocks * row_blocks, elements, [&](auto&& next_chunk) {
      std::vector<acc_t> sums(kTapBlock * row_block * ci_pad);  // [tap in block][output channel in block][ci_pad]
      for (auto [begin, end] = next_chunk(); begin < end; std::tie(begin, end) = next_chunk()) {
        for (int64_t t = begin; t < end; ++t) {
          const int64_t g = t / (tap_blocks * row_blocks), rest = t % (tap_blocks * row_blocks);
          const int64_t k0 = rest / row_blocks * kTapBlock, k1 = std::min(taps, k0 + kTapBlock);
          const int64_t r0 = rest % row_blocks * row_block, r1 = std::min(cout, r0 + row_block), m = r1 - r0;
          for (int64_t k = k0; k < k1; ++k) {
            const auto [row0, o_begin, o_end] = tap_rows(k);
            acc_t* c = sums.data() + (k - k0) * m * ci_pad;
            if (o_end <= o_begin) {  // a tap that only meets padding: zeros
              std::fill(c, c + m * ci_pad, acc_t(0));
              continue;
            }
            const acc_t* a = go_d + (g * l_out + o_begin) * N * co_pad + r0;  // its transpose: channels x rows
            const acc_t* b = x_d + (g * rows_in + row0 + o_begin) * N * ci_pad;
            fused::gemm(m, ci_pad, (o_end - o_begin) * N, a, 1, co_pad, b, ci_pad, c, ci_pad, /*accumulate=*/false);
          }
          for (int64_t co = r0; co < r1; ++co) {
            const int64_t row = g * cout + co;
            for (int64_t c = 0; c < cin; c += L) {
              fused::store_tiles(sums.data() + (co - r0) * ci_pad + c, index.data(), k1 - k0, out + (row * cin + c) * taps + k0,
                                 taps, std::min(L, cin - c), m * ci_pad);
            }
          }
        }
      }
    });
  }

  if (gi) {
    // weight as [group][tap][C_out / groups][ci_pad]: per output channel, its (C_in / groups, taps)
    // block transposed.
    at::Tensor w_t = workspace::empty({G, taps, cout, ci_pad}, options);
    at::parallel_for(0, G * cout, 16, [&](int64_t begin, int64_t end) {
      const acc_t* src = w.const_data_ptr<acc_t>();
      acc_t* dst = w_t.mutable_data_ptr<acc_t>();
      for (int64_t row = begin; row < end; ++row) {
        const int64_t g = row / cout, co = row % cout;
        for (int64_t c = 0; c < cin; c += L) {
          fused::load_tiles(src + (row * cin + c) * taps, taps, std::min(L, cin - c), index.data(), taps,
                            dst + (g * taps * cout + co) * ci_pad + c, cout * ci_pad);
        }
      }
    });
    // grad_input as [group][input row][sample][ci_pad] (the input's phases), one task per (group, block
    // of input rows), each summing over the taps in order.
    at::Tensor gi_t = workspace::zeros({G, rows_in, N, ci_pad}, options);
    const acc_t* w_d = w_t.const_data_ptr<acc_t>();
    const int64_t block = std::max<int64_t>(1, (rows_in + kPositionBlocks - 1) / kPositionBlocks);
    const int64_t blocks = (rows_in + block - 1) / block;
    fused::for_each_chunk(G * blocks, elements, [&](auto&& next_chunk) {
      for (auto [begin, end] = next_chunk(); begin < end; std::tie(begin, end) = next_chunk()) {
        for (int64_t t = begin; t < end; ++t) {
          const int64_t g = t / blocks, s0 = t % blocks * block, s1 = std::min(rows_in, s0 + block);
          for (int64_t k = 0; k < taps; ++k) {
            auto [row0, o_begin, o_end] = tap_rows(k);
            o_begin = std::max(o_begin, s0 - row0), o_end = std::min(o_end, s1 - row0);
            if (o_end <= o_begin) continue;
            fused::gemm((o_end - o_begin) * N, ci_pad, cout, go_d + (g * l_out + o_begin) * N * co_pad, co_pad, 1,
                        w_d + (g * taps + k) * cout * ci_pad, ci_pad,
                        gi_t.mutable_data_ptr<acc_t>() + (g * rows_in + row0 + o_begin) * N * ci_pad, ci_pad,
                        /*accumulate=*/true);
          }
        }
      }
    });
    acc_t* out = gi->mutable_data_ptr<acc_t>();  // (N, C_in, l_in)
    const acc_t* sums = gi_t.const_data_ptr<acc_t>();
    at::parallel_for(0, G * N, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t g = t / N, n = t % N;
        for (int64_t c = 0; c < cin; c += L) {
          fused::store_tiles(sums + (g * rows_in * N + n) * ci_pad + c, in_rows.data(), l_in,
                             out + ((n * G + g) * cin + c) * l_in, l_in, std::min(L, cin - c), N * ci_pad);
        }
      }
    });
  }
}

}  // namespace

std::optional<std::string> kn2row_lanes_unsupported(const DirectProblem& p, at::ScalarType dtype) {
  if (dtype != at::kFloat && dtype != at::kDouble) return "float16 / bfloat16: not built";
  // One channel per group would fill one lane of each vector (measured on a Conformer-sized depthwise
  // 1-D layer: 8x native's time); the depthwise and one-channel kernels serve those.
  if (p.in_per_group == 1) return "one input channel per group (depthwise, one-channel: their own kernels)";
  const int d = tap_dim(p);
  for (int i = 0; i < 3; ++i) {
    if (i != d && (p.in[i] != 1 || p.kernel[i] != 1 || p.padding[i] != 0)) {
      return "not 1-D shaped (taps in one dim, every other spatial dim 1)";
    }
  }
  if (p.batch == 0 || p.in_per_group == 0 || p.out_per_group == 0 || p.in[d] == 0 || p.out[d] == 0) return "empty";
  return std::nullopt;
}

void kn2row_lanes_backward_cpu(
    const DirectProblem& p, const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    at::Tensor* grad_input, at::Tensor* grad_weight) {
  TORCH_INTERNAL_ASSERT(!kn2row_lanes_unsupported(p, grad_output.scalar_type()));
  if (grad_output.scalar_type() == at::kFloat) {
    kn2row_lanes_typed<float>(p, grad_output, input, weight, grad_input, grad_weight);
  } else {
    kn2row_lanes_typed<double>(p, grad_output, input, weight, grad_input, grad_weight);
  }
}

}  // namespace aten_override
