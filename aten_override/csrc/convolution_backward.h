// Shared declarations of the compiled backend of aten::convolution_backward.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <optional>
#include <string>

namespace aten_override {

// Bytes of this machine's level-`level` data (or unified) cache as cpu0 sees it: the kernel's
// /sys/devices/system/cpu/cpu0/cache entries (what lscpu shows), else sysconf; read once per level;
// 0 when neither says. /sys comes first: on an AMD EPYC VM glibc's sysconf gave 320 MiB of L3 where
// /sys (and the CPU) have 32 MiB. Tile bounds of the kernels and the autotuner's cache flush use it.
int64_t cache_bytes(int level);

// cache_bytes(2), or 1 MiB where the machine does not say: the L2 the kernels size their chunks and
// blocks by.
inline int64_t l2_bytes() {
  const int64_t bytes = cache_bytes(2);
  return bytes > 0 ? bytes : int64_t{1} << 20;
}

// cache_bytes(1), or 32 KiB where the machine does not say: the L1 data cache the kernels size their
// innermost blocks by.
inline int64_t l1_bytes() {
  const int64_t bytes = cache_bytes(1);
  return bytes > 0 ? bytes : int64_t{32} << 10;
}

// One non-transposed convolution, every spatial argument expanded to 3 dims (1-D and 2-D calls are
// padded in front with size-1 dims: kernel 1, stride 1, padding 0, dilation 1).
struct DirectProblem {
  int64_t batch = 0;
  int64_t groups = 1;
  int64_t in_per_group = 0;   // C_in / groups
  int64_t out_per_group = 0;  // C_out / groups
  std::array<int64_t, 3> in{1, 1, 1};
  std::array<int64_t, 3> out{1, 1, 1};
  std::array<int64_t, 3> kernel{1, 1, 1};
  std::array<int64_t, 3> stride{1, 1, 1};
  std::array<int64_t, 3> padding{0, 0, 0};
  std::array<int64_t, 3> dilation{1, 1, 1};
};

// The fused direct kernel (cpu/direct.cpp): depthwise (with channel multiplier), grouped and
// one-channel layers. All tensors are contiguous in NC(D)HW order and of the same floating dtype;
// grad_input is (N, C_in, *in), grad_weight (C_out, C_in / groups, *kernel). float16 / bfloat16
// accumulate in float32, float32 in float32, float64 in float64. Writes every element.
void direct_grad_input_cpu(
    const DirectProblem& p, const at::Tensor& grad_output, const at::Tensor& weight, at::Tensor& grad_input);
void direct_grad_weight_cpu(
    const DirectProblem& p, const at::Tensor& grad_output, const at::Tensor& input, at::Tensor& grad_weight);

// The CUDA kernels of the direct class (cuda/direct.cu; built only with ATEN_OVERRIDE_WITH_CUDA): the
// same contract as the CPU ones, for CUDA tensors on one device. They run on the current stream of that
// device, use no atomics (grad_weight reduces per-block partial sums in a fixed order), so results are
// bitwise reproducible and need no torch.use_deterministic_algorithms alert.
void direct_grad_input_cuda(
    const DirectProblem& p, const at::Tensor& grad_output, const at::Tensor& weight, at::Tensor& grad_input);
void direct_grad_weight_cuda(
    const DirectProblem& p, const at::Tensor& grad_output, const at::Tensor& input, at::Tensor& grad_weight);

// The GEMM kernels (cpu/gemm.cpp) for dense, large-group, pointwise and 3-D layers: grad_input and
// grad_weight as at::mm / at::addmm products over a bounded workspace, grouped layers group by group.
enum class GemmAlgorithm : int {
  Im2col,  // columns gathered per chunk of output positions (views of input for 1x1 stride 1)
  Kn2row,  // one GEMM per kernel tap on shifted views (bfloat16: see kn2row_bf16); only where kn2row_applies()
  Kn2rowPlanes,  // Kn2row's products on the vector micro-kernels (fused::gemm), float32 / float64
};

// Whether Kn2row can compute p: stride 1, more than one tap in exactly one dim, the dims after it 1x1
// without padding and the dims before it of size 1 (3x1x1 3-D layers, (k, 1) 2-D and all 1-D layers).
bool kn2row_applies(const DirectProblem& p);

// Why Kn2row cannot compute p in bfloat16 (nullopt: it can): there it runs on zero-padded copies (any
// stride, padding and dilation; strided grad_input phase by phase of the input's positions) and needs
// groups == 1 or kn2row_applies(), and a padded grid of at most a few times grad_output's positions.
std::optional<std::string> kn2row_bf16_unsupported(const DirectProblem& p);

// Whether gemm_backward_cpu computes a float16 / bfloat16 problem in its own dtype, each output one
// oneDNN GEMM that accumulates in float32 and rounds once (pointwise layers whose whole batch fits one
// workspace chunk), rather than in float32 on float32 copies.
bool gemm_keeps_reduced_dtype(GemmAlgorithm algorithm, const DirectProblem& p, int64_t element_size);

// grad_input (N, C_in, *in) and / or grad_weight (C_out, C_in / groups, *kernel) (nullptr: not
// wanted) of the contiguous NC(D)HW grad_output, input (undefined when grad_weight is not wanted) and
// weight (undefined when grad_input is not wanted), all of one floating dtype; the
// outputs are contiguous and every element is written. float16 / bfloat16 compute in float32 but
// where gemm_keeps_reduced_dtype(), and bfloat16 Kn2row (oneDNN's bfloat16 GEMMs, each output rounded once).
void gemm_backward_cpu(
    GemmAlgorithm algorithm, const DirectProblem& p, const at::Tensor& grad_output, const at::Tensor& input,
    const at::Tensor& weight, at::Tensor* grad_input, at::Tensor* grad_weight);

// The fused depthwise kernel (cpu/depthwise.cpp): groups == C_in (in_per_group == 1), any channel
// multiplier. grad_input / grad_weight as above and grad_bias (C_out,), each computed when its pointer
// is not null (then weight / input must be defined), all in one pass over grad_output, by one of
// three walks: plane by plane; with channels in the vector lanes over the whole padded plane (any
// plane whose tiles fit depthwise_lanes_fits); or the same over bands of its rows sized to a share of
// the L2 cache (planes whose whole-plane tiles exceed the L2: where depthwise_bands_unsupported gives
// no reason). All are candidates of the autotuner; depthwise_table_walk is the table's choice (small
// or strided planes: lanes, else plane).
enum class DepthwiseWalk { Plane, Lanes, Bands };
bool depthwise_lanes_fits(const DirectProblem& p, at::ScalarType dtype);
std::optional<std::string> depthwise_bands_unsupported(const DirectProblem& p, at::ScalarType dtype);
DepthwiseWalk depthwise_table_walk(const DirectProblem& p, at::ScalarType dtype);
// Whether the lanes walks read / write `t` in place: laid out NC(T)HW or channels-last (N(T)HWC).
bool depthwise_lanes_layout(const at::Tensor& t);
void depthwise_backward_cpu(
    const DirectProblem& p, DepthwiseWalk walk, const at::Tensor& grad_output, const at::Tensor& input,
    const at::Tensor& weight, at::Tensor* grad_input, at::Tensor* grad_weight, at::Tensor* grad_bias);

// The grouped kernel (cpu/grouped.cpp, on the channels-in-lanes tiles of cpu/fused.h): groups > 1 with 2 to 64
// channels per group on each side, not float16, whose tiles fit the L2 (grouped_lanes_unsupported says
// which of these a problem is not; nullopt: it is all). grad_input / grad_weight as for the direct
// kernel, each computed when its pointer is not null; grad_bias is the caller's. No columns: both
// gradients straight from [position][channel] tiles of each group.
std::optional<std::string> grouped_lanes_unsupported(const DirectProblem& p, at::ScalarType dtype);
void grouped_lanes_backward_cpu(
    const DirectProblem& p, const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    at::Tensor* grad_input, at::Tensor* grad_weight);

namespace fused {
// Whether the CPU kernels' vector code (cpu/fused.h) computes in 64-byte vectors, one AVX-512 register
// each (CPUs with AVX-512), or in pairs of 32-byte vectors, two AVX2 registers (every other CPU), with
// the register blocks of each. set_wide_vectors forces one (tests run both on any machine: the code of
// both is built for every ISA level); nullopt gives the CPU's back. Kernels read it per call or per task
// (their results do not depend on it beyond rounding): set it only while no kernel runs.
bool wide_vectors();
void set_wide_vectors(std::optional<bool> wide);
}  // namespace fused

// The Winograd kernel (cpu/winograd.cpp): 3x3 (or 1x3x3), stride 1, undilated, groups == 1 layers
// with the same padding of at most 2 in H and W (none in depth). grad_input by F(2x2, 3x3), grad_weight
// by F(3x3, 2x2). Tensors as for gemm_backward_cpu: contiguous
// NC(D)HW of one floating dtype, outputs contiguous, every element written; float16 / bfloat16
// compute in float32. winograd_unsupported says why a problem is not one of these (nullopt: it is).
std::optional<std::string> winograd_unsupported(const DirectProblem& p);
// Which code runs the Winograd kernel's 16 GEMMs per chunk, measured once per process on a chunk-sized
// float32 problem on one thread: the library's bmm (MKL) or fused::gemm_add's vector micro-kernels
// (vectors), with each one's fastest run in microseconds; `forced` when set_winograd_gemm chose instead
// (tests run both engines on any machine; nullopt: the measured one again).
struct WinogradGemm {
  bool vectors = false, forced = false;
  double library_us = 0, vectors_us = 0;
};
WinogradGemm winograd_gemm();
void set_winograd_gemm(std::optional<bool> vectors);
// How the depthwise walks and grouped-lanes write a grad_input of at least fused::kStreamBytes (8 MiB),
// measured once per process on one thread (streaming_stores()): through a staging buffer in L2 copied
// out with non-temporal stores (fused::copy_streaming: no read of each destination line before it is
// written), or with ordinary stores straight from their tiles. Timed on the kernel itself: grad_input
// alone of a 16-channel 3x3 stride-2 depthwise layer at 112x112 (MobileNetV2's layer.0) in the
// channels-in-lanes walk, over enough samples that grad_input is twice the L3 (64-256 MiB), each way;
// `direct_us` and `streamed_us` are the fastest of three runs (0: the CPU has no streaming stores),
// `streaming` whether the streamed run was faster, `forced` when set_streaming_stores chose instead
// (tests run both ways on any machine). A copy loop standing in for the kernel said the opposite of
// the kernels on a Zen 3 VM (streamed faster in 5 of 6 processes, where the kernels took 0.90-0.98x
// the streamed time with ordinary stores); the choice had been a constant set on AVX-512 machines.
struct StreamingStores {
  bool streaming = false, forced = false;
  double direct_us = 0, streamed_us = 0;
};
StreamingStores streaming_stores();
void set_streaming_stores(std::optional<bool> streaming);
void winograd_backward_cpu(
    const DirectProblem& p, const at::Tensor& grad_output, const at::Tensor& input,
    const at::Tensor& weight, at::Tensor* grad_input, at::Tensor* grad_weight);

// The pointwise kernel (cpu/pointwise.cpp): 1x1, stride-1, unpadded, groups == 1 layers in float32 /
// float64, both gradients in one pass over grad_output with vector micro-kernels (no BLAS), the same
// bits for any thread count. Tensors as for gemm_backward_cpu. pointwise_unsupported says why a
// problem is not one of these (nullopt: it is).
std::optional<std::string> pointwise_unsupported(const DirectProblem& p, at::ScalarType dtype);
void pointwise_backward_cpu(
    const DirectProblem& p, const at::Tensor& grad_output, const at::Tensor& input,
    const at::Tensor& weight, at::Tensor* grad_input, at::Tensor* grad_weight);

// The bfloat16 pointwise kernel (cpu/pointwise_bf16.cpp): the layers of pointwise_unsupported's in bfloat16,
// both gradients in one pass with the CPU's bfloat16 dot products (AVX512_BF16's vdpbf16ps), float32
// sums rounded once, the same bits for any thread count. pointwise_bf16_unsupported says why a problem
// is not one of these, or why this CPU cannot run it (nullopt: it is). bf16_dot() says which dot
// products it runs: "avx512_bf16" (the instruction), "emulated" (the same sums in scalar code, forced by
// set_bf16_dot(false) so that tests run the kernel on any CPU) or "none" (this CPU has no AVX512_BF16);
// set_bf16_dot(nullopt) gives the CPU's back. Set it only while no kernel runs.
std::optional<std::string> pointwise_bf16_unsupported(const DirectProblem& p, at::ScalarType dtype);
void pointwise_bf16_backward_cpu(
    const DirectProblem& p, const at::Tensor& grad_output, const at::Tensor& input,
    const at::Tensor& weight, at::Tensor* grad_input, at::Tensor* grad_weight);
const char* bf16_dot();
void set_bf16_dot(std::optional<bool> hardware);

// The kn2row-lanes kernel (cpu/kn2row.cpp): layers with every tap in one dim and every other spatial dim
// 1 (1-D layers), any stride, padding, dilation and groups, float32 / float64: per tap, one product over
// the positions where that tap meets the input, on channels-last copies (the input's in phases of the
// stride), with vector micro-kernels; the same bits for any thread count. Tensors as for gemm_backward_cpu.
// kn2row_lanes_unsupported says why a problem is not one of these (nullopt: it is).
std::optional<std::string> kn2row_lanes_unsupported(const DirectProblem& p, at::ScalarType dtype);
void kn2row_lanes_backward_cpu(
    const DirectProblem& p, const at::Tensor& grad_output, const at::Tensor& input,
    const at::Tensor& weight, at::Tensor* grad_input, at::Tensor* grad_weight);

}  // namespace aten_override
