// The kn2row-lanes kernel of the compiled backend: grad_input and grad_weight of stride-1 layers whose
// taps all lie in one dim and whose other spatial dims are 1 (1-D layers, or 2-D / 3-D ones of that
// shape), any padding, dilation and groups, float32 / float64. Per tap, one product over only the
// positions where that tap meets the input, on channels-last copies with a group's channels in the
// vector lanes, by fused::gemm_add's micro-kernels (no BLAS):
//   grad_weight[:, :, k] += grad_output[o_begin:o_end]^T @ input[o_begin + shift : o_end + shift]
//   grad_input[o_begin + shift : o_end + shift] += grad_output[o_begin:o_end] @ weight[:, :, k]
// with shift = k * dilation - padding and [o_begin, o_end) the output positions whose input position
// o + shift exists (the rows are positions, the columns channels of one group).
//
// Why: wav2vec2's positional convolution (768 channels in 16 groups of 48, a kernel of 128 taps,
// padding 64, over the 49 frames of one second of audio): every output position meets the input
// through at most 49 of its 128 taps, so im2col / native compute 2.6x the products that count; and the
// products are small (48 x 48 x 49 per group, sample and tap), where a BLAS call costs more than its
// arithmetic (gemm-kn2row: 16 x 8 x 128 MKL calls per gradient) and MKL runs its AVX2 code on AMD CPUs.
//
// Layout: per group, [position][sample][channel] copies, so that a tap's valid positions are one run
// of rows for every sample: one product per (group, tap) serves the whole batch.
// Threads and bits: grad_weight's tasks are (group, tap) pairs; grad_input's are (group, block of
// input positions) pairs, each summing over the taps in order. Every element is written by one task
// in a fixed order: the same bits for any thread count, no atomics.
#include "../convolution_backward.h"
#include "fused.h"

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
  const int64_t l_in = p.in[d], l_out = p.out[d], taps = p.kernel[d];
  const int64_t ci_pad = fused::round_up<acc_t>(cin), co_pad = fused::round_up<acc_t>(cout);
  const auto options = go.options();
  const auto shift_of = [&](int64_t k) { return k * p.dilation[d] - p.padding[d]; };
  // Output positions o whose input position o + shift lies in [0, l_in).
  const auto valid = [&](int64_t shift) {
    return std::make_pair(std::max<int64_t>(0, -shift), std::min(l_out, l_in - shift));
  };
  std::vector<int64_t> index(std::max({l_in, l_out, p.kernel[d]}));
  std::iota(index.begin(), index.end(), int64_t{0});

  // Channels-last copies, per group a [position][sample][channel] block (channels padded with zeros to
  // whole vectors): a tap's valid positions are then one run of rows for every sample at once, and one
  // product serves the whole batch. grad_output, and input for grad_weight.
  const at::Tensor go_t = at::empty({G, l_out, N, co_pad}, options);
  const at::Tensor x_t = gw ? at::empty({G, l_in, N, ci_pad}, options) : at::Tensor();
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
        acc_t* xd = x_t.mutable_data_ptr<acc_t>() + (g * l_in * N + n) * ci_pad;
        for (int64_t c = 0; c < cin; c += L) {
          fused::load_tiles(xs + c * l_in, l_in, std::min(L, cin - c), index.data(), l_in, xd + c, N * ci_pad);
        }
      }
    }
  });
  const acc_t* go_d = go_t.const_data_ptr<acc_t>();

  if (gw) {
    // One task per (group, block of kTapBlock taps): each tap's (C_out / groups) x ci_pad sums are one
    // product over its valid positions of every sample, into a buffer of the block's taps (L2-sized),
    // then transposed into grad_weight's (C_out, C_in / groups, taps) layout.
    acc_t* out = gw->mutable_data_ptr<acc_t>();
    const acc_t* x_d = x_t.const_data_ptr<acc_t>();
    const int64_t tap_blocks = (taps + kTapBlock - 1) / kTapBlock;
    at::parallel_for(0, G * tap_blocks, 1, [&](int64_t begin, int64_t end) {
      std::vector<acc_t> sums(kTapBlock * cout * ci_pad);  // [tap in block][C_out / groups][ci_pad]
      for (int64_t t = begin; t < end; ++t) {
        const int64_t g = t / tap_blocks, k0 = t % tap_blocks * kTapBlock, k1 = std::min(taps, k0 + kTapBlock);
        for (int64_t k = k0; k < k1; ++k) {
          const int64_t shift = shift_of(k);
          const auto [o_begin, o_end] = valid(shift);
          acc_t* c = sums.data() + (k - k0) * cout * ci_pad;
          if (o_end <= o_begin) {  // a tap that only meets padding: zeros
            std::fill(c, c + cout * ci_pad, acc_t(0));
            continue;
          }
          const acc_t* a = go_d + (g * l_out + o_begin) * N * co_pad;  // its transpose: (C_out / groups) x rows
          const acc_t* b = x_d + (g * l_in + o_begin + shift) * N * ci_pad;
          fused::gemm(cout, ci_pad, (o_end - o_begin) * N, a, 1, co_pad, b, ci_pad, c, ci_pad, /*accumulate=*/false);
        }
        for (int64_t co = 0; co < cout; ++co) {
          const int64_t row = g * cout + co;
          for (int64_t c = 0; c < cin; c += L) {
            fused::store_tiles(sums.data() + co * ci_pad + c, index.data(), k1 - k0, out + (row * cin + c) * taps + k0,
                               taps, std::min(L, cin - c), cout * ci_pad);
          }
        }
      }
    });
  }

  if (gi) {
    // weight as [group][tap][C_out / groups][ci_pad]: per output channel, its (C_in / groups, taps)
    // block transposed.
    at::Tensor w_t = at::empty({G, taps, cout, ci_pad}, options);
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
    // grad_input as [group][position][sample][ci_pad], one task per (group, block of input positions),
    // each summing over the taps in order.
    at::Tensor gi_t = at::zeros({G, l_in, N, ci_pad}, options);
    const acc_t* w_d = w_t.const_data_ptr<acc_t>();
    const int64_t block = std::max<int64_t>(1, (l_in + kPositionBlocks - 1) / kPositionBlocks), blocks = (l_in + block - 1) / block;
    at::parallel_for(0, G * blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t g = t / blocks, s0 = t % blocks * block, s1 = std::min(l_in, s0 + block);
        for (int64_t k = 0; k < taps; ++k) {
          const int64_t shift = shift_of(k);
          auto [o_begin, o_end] = valid(shift);
          o_begin = std::max(o_begin, s0 - shift), o_end = std::min(o_end, s1 - shift);
          if (o_end <= o_begin) continue;
          fused::gemm((o_end - o_begin) * N, ci_pad, cout, go_d + (g * l_out + o_begin) * N * co_pad, co_pad, 1,
                          w_d + (g * taps + k) * cout * ci_pad, ci_pad,
                          gi_t.mutable_data_ptr<acc_t>() + (g * l_in + o_begin + shift) * N * ci_pad, ci_pad,
                          /*accumulate=*/true);
        }
      }
    });
    acc_t* out = gi->mutable_data_ptr<acc_t>();  // (N, C_in, l_in)
    const acc_t* sums = gi_t.const_data_ptr<acc_t>();
    at::parallel_for(0, G * N, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t g = t / N, n = t % N;
        for (int64_t c = 0; c < cin; c += L) {
          fused::store_tiles(sums + (g * l_in * N + n) * ci_pad + c, index.data(), l_in, out + ((n * G + g) * cin + c) * l_in,
                             l_in, std::min(L, cin - c), N * ci_pad);
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
    if (p.stride[i] != 1) return "not stride 1";
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
