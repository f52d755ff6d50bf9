// Shared declarations of the compiled backend of aten::convolution_backward.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>

namespace aten_override {

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

// The fused depthwise kernel (cpu/depthwise.cpp): groups == C_in (in_per_group == 1), any channel
// multiplier. grad_input / grad_weight as above and grad_bias (C_out,), each computed when its pointer
// is not null (then weight / input must be defined), all in one pass over grad_output.
void depthwise_backward_cpu(
    const DirectProblem& p, const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    at::Tensor* grad_input, at::Tensor* grad_weight, at::Tensor* grad_bias);

}  // namespace aten_override
