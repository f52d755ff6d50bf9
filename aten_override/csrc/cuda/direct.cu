// CUDA kernels of the compiled backend's direct class (the CUDA counterpart of cpu/direct.cpp):
// grad_input and grad_weight of non-transposed convolutions with C_in / groups input channels per
// group (the backend routes only the depthwise class here: groups == C_in, any channel multiplier),
// 1-D/2-D/3-D (as 3-D with size-1 leading dims), any stride, padding and dilation; float64, float32,
// float16 and bfloat16 (the half types accumulate in float32: at::acc_type).
//
// grad_input: one thread per input element gathers over the taps and the output channels of its
//   group, in a fixed order; no two threads write the same element (no atomics). Like upstream's
//   conv_depthwise2d_backward_kernel (aten/src/ATen/native/cuda/DepthwiseConv2d.cu).
// grad_weight: a sum over (sample, output position) per weight element. Block (element, split)
//   reduces a fixed chunk of that sum (a strided loop per thread, then a warp-shuffle tree) into a
//   float32/float64 workspace; a second kernel adds each element's partial sums in split order and
//   rounds once. The split count depends on the problem only (not the device or the timing), so the
//   result is bitwise reproducible and there is no atomic to alert about under
//   torch.use_deterministic_algorithms.
//
// Everything runs on the current stream of the tensors' device (c10::cuda::getCurrentCUDAStream,
// what at::cuda::getCurrentCUDAStream returns; this file avoids ATen/cuda/CUDAContext.h, which pulls
// in the cuBLAS / cuSPARSE / cuSOLVER headers it has no use for). Indices are 32-bit when every
// tensor has under 2^30 elements, else 64-bit.
#include "../convolution_backward.h"

#include <ATen/AccumulateType.h>
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>

namespace aten_override {
namespace {

constexpr int kThreads = 256;  // every kernel's block size (a multiple of the warp size)
constexpr int kWarp = 32;
// grad_input's grid-stride loop: enough blocks to fill any current GPU, far below the grid limit.
constexpr int64_t kMaxBlocks = int64_t{1} << 16;
// grad_weight splits each element's sum into chunks of at least this many products ...
constexpr int64_t kMinChunk = 4 * kThreads;
// ... and into no more chunks than make about this many blocks in all. Constants, not the device's
// SM count: the split (hence the rounding) must not depend on which GPU runs it.
constexpr int64_t kTargetBlocks = 4096;

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// DirectProblem in the kernels' index type.
template <typename index_t>
struct Geometry {
  index_t batch, c_in, c_out, in_per_group, out_per_group;
  index_t in[3], out[3], kernel[3], stride[3], padding[3], dilation[3];
  index_t in_plane, out_plane, taps;
};

template <typename index_t>
Geometry<index_t> geometry(const DirectProblem& p) {
  Geometry<index_t> g;
  g.batch = static_cast<index_t>(p.batch);
  g.in_per_group = static_cast<index_t>(p.in_per_group);
  g.out_per_group = static_cast<index_t>(p.out_per_group);
  g.c_in = static_cast<index_t>(p.groups * p.in_per_group);
  g.c_out = static_cast<index_t>(p.groups * p.out_per_group);
  for (int d = 0; d < 3; ++d) {
    g.in[d] = static_cast<index_t>(p.in[d]);
    g.out[d] = static_cast<index_t>(p.out[d]);
    g.kernel[d] = static_cast<index_t>(p.kernel[d]);
    g.stride[d] = static_cast<index_t>(p.stride[d]);
    g.padding[d] = static_cast<index_t>(p.padding[d]);
    g.dilation[d] = static_cast<index_t>(p.dilation[d]);
  }
  g.in_plane = g.in[0] * g.in[1] * g.in[2];
  g.out_plane = g.out[0] * g.out[1] * g.out[2];
  g.taps = g.kernel[0] * g.kernel[1] * g.kernel[2];
  return g;
}

// 32-bit indices when every element index, and a grid-stride step past the last one, fits.
bool fits_32bit(std::initializer_list<int64_t> numels) {
  return std::all_of(numels.begin(), numels.end(), [](int64_t n) { return n < (int64_t{1} << 30); });
}

// --- grad_input -----------------------------------------------------------------------------------

// grad_input[n, c, i] = sum over the group's output channels co and taps k with
// i + padding - k * dilation = o * stride (0 <= o < out) of grad_output[n, co, o] * weight[co, c % in_per_group, k].
template <typename scalar_t, typename acc_t, typename index_t>
__global__ void __launch_bounds__(kThreads) grad_input_kernel(
    const Geometry<index_t> g, const scalar_t* __restrict__ grad_output, const scalar_t* __restrict__ weight,
    scalar_t* __restrict__ grad_input, const index_t numel) {
  const index_t step = static_cast<index_t>(gridDim.x) * kThreads;
  for (index_t i = static_cast<index_t>(blockIdx.x) * kThreads + threadIdx.x; i < numel; i += step) {
    index_t rest = i;
    const index_t x = rest % g.in[2];
    rest /= g.in[2];
    const index_t y = rest % g.in[1];
    rest /= g.in[1];
    const index_t z = rest % g.in[0];
    rest /= g.in[0];
    const index_t c = rest % g.c_in, n = rest / g.c_in;
    const index_t group = c / g.in_per_group, ci = c % g.in_per_group;
    acc_t sum = 0;
    for (index_t j = 0; j < g.out_per_group; ++j) {
      const index_t co = group * g.out_per_group + j;
      const scalar_t* go = grad_output + (n * g.c_out + co) * g.out_plane;
      const scalar_t* w = weight + (co * g.in_per_group + ci) * g.taps;
      // Along each dim, o * stride = position + padding - k * dilation decreases with k: stop below 0.
      for (index_t kz = 0; kz < g.kernel[0]; ++kz) {
        const index_t sz = z + g.padding[0] - kz * g.dilation[0];
        if (sz < 0) break;
        const index_t oz = sz / g.stride[0];
        if (sz % g.stride[0] != 0 || oz >= g.out[0]) continue;
        for (index_t ky = 0; ky < g.kernel[1]; ++ky) {
          const index_t sy = y + g.padding[1] - ky * g.dilation[1];
          if (sy < 0) break;
          const index_t oy = sy / g.stride[1];
          if (sy % g.stride[1] != 0 || oy >= g.out[1]) continue;
          for (index_t kx = 0; kx < g.kernel[2]; ++kx) {
            const index_t sx = x + g.padding[2] - kx * g.dilation[2];
            if (sx < 0) break;
            const index_t ox = sx / g.stride[2];
            if (sx % g.stride[2] != 0 || ox >= g.out[2]) continue;
            sum += static_cast<acc_t>(go[(oz * g.out[1] + oy) * g.out[2] + ox]) *
                static_cast<acc_t>(w[(kz * g.kernel[1] + ky) * g.kernel[2] + kx]);
          }
        }
      }
    }
    grad_input[i] = static_cast<scalar_t>(sum);
  }
}

template <typename scalar_t, typename index_t>
void launch_grad_input(
    const DirectProblem& p, const at::Tensor& grad_output, const at::Tensor& weight, at::Tensor& grad_input,
    cudaStream_t stream) {
  using acc_t = at::acc_type<scalar_t, /*is_cuda=*/true>;
  const int64_t numel = grad_input.numel();
  const auto blocks = static_cast<unsigned int>(std::min(ceil_div(numel, kThreads), kMaxBlocks));
  grad_input_kernel<scalar_t, acc_t, index_t><<<blocks, kThreads, 0, stream>>>(
      geometry<index_t>(p), grad_output.const_data_ptr<scalar_t>(), weight.const_data_ptr<scalar_t>(),
      grad_input.mutable_data_ptr<scalar_t>(), static_cast<index_t>(numel));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// --- grad_weight ----------------------------------------------------------------------------------

// The sum of `value` over the block (valid in thread 0), in an order fixed by the block size alone.
template <typename acc_t>
__device__ acc_t block_sum(acc_t value) {
  __shared__ acc_t warp_sums[kThreads / kWarp];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    value += __shfl_down_sync(0xffffffffu, value, offset);
  }
  if (lane == 0) warp_sums[warp] = value;
  __syncthreads();
  if (warp == 0) {
    value = lane < kThreads / kWarp ? warp_sums[lane] : acc_t(0);
    for (int offset = kWarp / 2; offset > 0; offset /= 2) {
      value += __shfl_down_sync(0xffffffffu, value, offset);
    }
  }
  return value;
}

// Block b = element * splits + split: partial[b] = the sum over r in [split * chunk, (split + 1) * chunk)
// of grad_output[n, co, o] * input[n, c, o * stride - padding + k * dilation] (zero outside the input),
// r = n * out_plane + o, for weight element (co, ci, k) and c = (co / out_per_group) * in_per_group + ci.
template <typename scalar_t, typename acc_t, typename index_t>
__global__ void __launch_bounds__(kThreads) grad_weight_partial_kernel(
    const Geometry<index_t> g, const scalar_t* __restrict__ grad_output, const scalar_t* __restrict__ input,
    acc_t* __restrict__ partial, const index_t splits, const index_t chunk) {
  const index_t block = blockIdx.x;
  const index_t element = block / splits, split = block % splits;
  const index_t tap = element % g.taps, pair = element / g.taps;
  const index_t ci = pair % g.in_per_group, co = pair / g.in_per_group;
  const index_t c = (co / g.out_per_group) * g.in_per_group + ci;
  const index_t kx = tap % g.kernel[2], ky = (tap / g.kernel[2]) % g.kernel[1], kz = tap / (g.kernel[2] * g.kernel[1]);
  const index_t shift_z = kz * g.dilation[0] - g.padding[0];
  const index_t shift_y = ky * g.dilation[1] - g.padding[1];
  const index_t shift_x = kx * g.dilation[2] - g.padding[2];
  const index_t total = g.batch * g.out_plane;
  const index_t begin = split * chunk;
  const index_t end = total - begin < chunk ? total : begin + chunk;
  acc_t sum = 0;
  for (index_t r = begin + threadIdx.x; r < end; r += kThreads) {
    const index_t n = r / g.out_plane, o = r % g.out_plane;
    const index_t ox = o % g.out[2], oy = (o / g.out[2]) % g.out[1], oz = o / (g.out[2] * g.out[1]);
    const index_t z = oz * g.stride[0] + shift_z, y = oy * g.stride[1] + shift_y, x = ox * g.stride[2] + shift_x;
    if (z >= 0 && z < g.in[0] && y >= 0 && y < g.in[1] && x >= 0 && x < g.in[2]) {
      sum += static_cast<acc_t>(grad_output[(n * g.c_out + co) * g.out_plane + o]) *
          static_cast<acc_t>(input[(n * g.c_in + c) * g.in_plane + (z * g.in[1] + y) * g.in[2] + x]);
    }
  }
  sum = block_sum(sum);
  if (threadIdx.x == 0) partial[block] = sum;
}

// grad_weight[e] = the partial sums of element e added in split order, rounded once to scalar_t.
template <typename scalar_t, typename acc_t, typename index_t>
__global__ void __launch_bounds__(kThreads) grad_weight_final_kernel(
    const acc_t* __restrict__ partial, scalar_t* __restrict__ grad_weight, const index_t elements,
    const index_t splits) {
  const index_t step = static_cast<index_t>(gridDim.x) * kThreads;
  for (index_t e = static_cast<index_t>(blockIdx.x) * kThreads + threadIdx.x; e < elements; e += step) {
    acc_t sum = 0;
    for (index_t s = 0; s < splits; ++s) sum += partial[e * splits + s];
    grad_weight[e] = static_cast<scalar_t>(sum);
  }
}

template <typename scalar_t, typename index_t>
void launch_grad_weight(
    const DirectProblem& p, const at::Tensor& grad_output, const at::Tensor& input, at::Tensor& grad_weight,
    cudaStream_t stream) {
  using acc_t = at::acc_type<scalar_t, /*is_cuda=*/true>;
  const int64_t elements = grad_weight.numel();
  const int64_t total = p.batch * p.out[0] * p.out[1] * p.out[2];
  if (total == 0) {
    grad_weight.zero_();
    return;
  }
  // Splits: enough blocks to fill the GPU, at least kMinChunk products per block, and
  // elements * splits blocks within the grid (and index) limit.
  int64_t splits = std::min(ceil_div(total, kMinChunk), std::max<int64_t>(1, kTargetBlocks / elements));
  splits = std::max<int64_t>(1, std::min(splits, (int64_t{1} << 30) / elements));
  const int64_t chunk = ceil_div(total, splits);
  splits = ceil_div(total, chunk);
  TORCH_CHECK(
      elements * splits < (int64_t{1} << 31), "convolution_backward[compiled]: grad_weight has too many elements (",
      elements, ") for the CUDA direct kernel");
  const at::Tensor partial = at::empty({elements * splits}, grad_weight.options().dtype(c10::CppTypeToScalarType<acc_t>::value));
  grad_weight_partial_kernel<scalar_t, acc_t, index_t><<<static_cast<unsigned int>(elements * splits), kThreads, 0, stream>>>(
      geometry<index_t>(p), grad_output.const_data_ptr<scalar_t>(), input.const_data_ptr<scalar_t>(),
      partial.mutable_data_ptr<acc_t>(), static_cast<index_t>(splits), static_cast<index_t>(chunk));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const auto blocks = static_cast<unsigned int>(std::min(ceil_div(elements, kThreads), kMaxBlocks));
  grad_weight_final_kernel<scalar_t, acc_t, index_t><<<blocks, kThreads, 0, stream>>>(
      partial.const_data_ptr<acc_t>(), grad_weight.mutable_data_ptr<scalar_t>(), static_cast<index_t>(elements),
      static_cast<index_t>(splits));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
struct Type {
  using type = T;
};

// What both entry points share: the checks, a guard on the tensors' device, its current stream, and
// the dispatch over dtype and index width: launch(Type<scalar_t>, Type<index_t>, stream).
template <typename Launch>
void dispatch_direct(const at::Tensor& grad_output, const at::Tensor& other, at::Tensor& out, const Launch& launch) {
  TORCH_INTERNAL_ASSERT(grad_output.is_cuda() && other.device() == grad_output.device() && out.device() == grad_output.device());
  TORCH_INTERNAL_ASSERT(grad_output.is_contiguous() && other.is_contiguous() && out.is_contiguous());
  TORCH_INTERNAL_ASSERT(other.scalar_type() == grad_output.scalar_type() && out.scalar_type() == grad_output.scalar_type());
  if (out.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(out.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const bool small = fits_32bit({grad_output.numel(), other.numel(), out.numel()});
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "direct_convolution_backward_cuda", [&] {
    if (small) {
      launch(Type<scalar_t>(), Type<int32_t>(), stream);
    } else {
      launch(Type<scalar_t>(), Type<int64_t>(), stream);
    }
  });
}

}  // namespace

void direct_grad_input_cuda(
    const DirectProblem& p, const at::Tensor& grad_output, const at::Tensor& weight, at::Tensor& grad_input) {
  dispatch_direct(grad_output, weight, grad_input, [&](auto scalar, auto index, cudaStream_t stream) {
    using scalar_t = typename decltype(scalar)::type;
    launch_grad_input<scalar_t, typename decltype(index)::type>(p, grad_output, weight, grad_input, stream);
  });
}

void direct_grad_weight_cuda(
    const DirectProblem& p, const at::Tensor& grad_output, const at::Tensor& input, at::Tensor& grad_weight) {
  dispatch_direct(grad_output, input, grad_weight, [&](auto scalar, auto index, cudaStream_t stream) {
    using scalar_t = typename decltype(scalar)::type;
    launch_grad_weight<scalar_t, typename decltype(index)::type>(p, grad_output, input, grad_weight, stream);
  });
}

}  // namespace aten_override
