// The GEMM kernels of the compiled backend: grad_input and grad_weight of non-transposed
// convolutions as matrix products (at::mm, so MKL or oneDNN), 1-D/2-D/3-D, any stride,
// padding and dilation; grouped layers group by group (channel slices, see kGroupWorkspaceBytes).
// With grad_output as the matrix go (C_out, positions):
//
// Im2col: per chunk of output positions, columns col (C_in * taps, positions) gathered from input
//   (zeros where a tap reads padding); grad_weight += go @ col^T, then the same buffer takes
//   col = weight^T @ go, added back into grad_input (col2im). A chunk is a set
//   of whole samples (folded into the GEMM's inner dim), a run of output rows of one sample, or a part
//   of one long row (1-D layers: wav2vec2's 1,599-position rows took a 13 MB workspace per call at one
//   second of audio, 131 MB at ten), sized so the workspace (columns plus a grad_output copy) stays
//   under kWorkspaceBytes: never a full N x C_in * taps x positions buffer. Pointwise layers (1x1,
//   stride 1, no padding) use input and grad_input themselves as the columns, views with no copy,
//   whenever a chunk is one sample.
// Kn2row: kernels with more than one tap in a single dim (a 3x1x1 temporal layer, a 1-D layer), stride
//   1: per tap, one GEMM on shifted views of input / grad_input (no copy at all):
//   grad_weight[:, :, tap] += go @ input_shifted^T, grad_input_shifted += weight[:, :, tap]^T @ go.
//   The kn2row-planes kernel computes the same products on our vector micro-kernels (kn2row_planes).
//
// Every output element is written by one GEMM call or one thread of col2im, in a fixed order: no
// atomics, and two runs give the same bits. float16 / bfloat16: the GEMMs run in float32 on float32
// copies, except where each output can be the result of a single oneDNN GEMM (AMX) that accumulates in
// float32 and rounds once, like native: pointwise layers whose batch fits one chunk, and bfloat16 Kn2row
// (kn2row_bf16, any stride: the taps stacked into the GEMM's inner dim for grad_input, phase by phase
// of the input's positions, the samples for grad_weight).
#include "../convolution_backward.h"
#include "fused.h"
#include "workspace.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <type_traits>
#include <vector>

namespace aten_override {
namespace {

// Bound on the columns plus grad_output copy of one chunk. Below native's own peak on the layers the
// GEMM classes serve (native allocates 15-110 MB there), so peak memory stays within 1.2x native.
constexpr int64_t kWorkspaceBytes = int64_t{8} << 20;

// Grouped layers run group by group, with chunks this small: a group's GEMMs are small, and its
// columns then stay in the L2 cache from im2col through both GEMMs to col2im (measured on ResNeXt's
// g=32 layers: all groups at once in 8 MiB chunks ran at native's speed, memory-bound).
constexpr int64_t kGroupWorkspaceBytes = int64_t{1} << 20;

// Samples with at least this many output positions are one chunk each (or several): the GEMMs are
// wide enough on their own, and pointwise layers then need no copy. Smaller samples are folded.
constexpr int64_t kMinSampleColumns = 512;

// A row is split into parts only when it is longer than the workspace allows and than this: narrower
// GEMMs lose speed (a grouped layer's 1 MiB workspace would otherwise cut wav2vec2's positional
// convolution, 49 frames of 48 channels x 128 taps per group, into GEMMs 25 columns wide).
constexpr int64_t kMinPartColumns = 256;

int64_t numel3(const std::array<int64_t, 3>& a) {
  return a[0] * a[1] * a[2];
}

bool pointwise(const DirectProblem& p) {
  for (int i = 0; i < 3; ++i) {
    if (p.kernel[i] != 1 || p.padding[i] != 0) return false;
  }
  return true;
}

// Pointwise with stride 1: the columns are input itself.
bool identity_columns(const DirectProblem& p) {
  return pointwise(p) && p.stride[0] == 1 && p.stride[1] == 1 && p.stride[2] == 1;
}

// Output positions: rows [row_begin, row_end) (a row is one (t, h) of grad_output, out[2] positions
// long) of samples [n_begin, n_end), positions [w_begin, w_end) of each row. Several samples only ever
// come with all their rows, and a part of a row (a long 1-D row) only ever alone.
struct Chunk {
  int64_t n_begin, n_end, row_begin, row_end, w_begin, w_end;
  int64_t samples() const {
    return n_end - n_begin;
  }
  int64_t rows() const {
    return row_end - row_begin;
  }
  int64_t width() const {
    return w_end - w_begin;
  }
  int64_t columns() const {
    return samples() * rows() * width();
  }
};

std::vector<Chunk> plan_chunks(const DirectProblem& p, int64_t bytes_per_column, int64_t budget) {
  const int64_t rows = p.out[0] * p.out[1], width = p.out[2], sample = rows * width;
  const int64_t max_columns = bytes_per_column == 0 ? sample : std::max<int64_t>(1, budget / bytes_per_column);
  std::vector<Chunk> chunks;
  if (sample <= max_columns) {
    const int64_t samples = sample >= kMinSampleColumns ? 1 : std::max<int64_t>(1, max_columns / sample);
    for (int64_t n = 0; n < p.batch; n += samples) chunks.push_back({n, std::min(n + samples, p.batch), 0, rows, 0, width});
  } else if (width <= std::max(max_columns, kMinPartColumns)) {
    const int64_t rows_per_chunk = std::max<int64_t>(1, max_columns / width);
    for (int64_t n = 0; n < p.batch; ++n) {
      for (int64_t r = 0; r < rows; r += rows_per_chunk) {
        chunks.push_back({n, n + 1, r, std::min(r + rows_per_chunk, rows), 0, width});
      }
    }
  } else {
    // Rows longer than a chunk (1-D layers): equal parts of each row.
    const int64_t most = std::max(max_columns, kMinPartColumns);
    const int64_t parts = (width + most - 1) / most, part = (width + parts - 1) / parts;
    for (int64_t n = 0; n < p.batch; ++n) {
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t w = 0; w < width; w += part) chunks.push_back({n, n + 1, r, r + 1, w, std::min(w + part, width)});
      }
    }
  }
  return chunks;
}

// Whether im2col_backward reads input and grad_input in place, with no columns.
bool column_views(const DirectProblem& p) {
  return identity_columns(p) && numel3(p.out) >= kMinSampleColumns;
}

// im2col_backward's chunks for elements of `element_size` bytes and a workspace of `budget` bytes.
std::vector<Chunk> im2col_plan(const DirectProblem& p, int64_t element_size, int64_t budget) {
  const int64_t columns_rows = p.groups * p.in_per_group * numel3(p.kernel), go_rows = p.groups * p.out_per_group;
  return plan_chunks(p, column_views(p) ? 0 : (columns_rows + go_rows) * element_size, budget);
}

// A kernel tap's walk along W: output position w reads input column w * stride + offset, inside
// the input for w in [lo, hi).
struct WTap {
  int64_t offset, lo, hi;
};

std::vector<WTap> w_taps(const DirectProblem& p) {
  std::vector<WTap> taps;
  const int64_t stride = p.stride[2], in = p.in[2], width = p.out[2];
  for (int64_t kw = 0; kw < p.kernel[2]; ++kw) {
    const int64_t offset = kw * p.dilation[2] - p.padding[2];
    const int64_t hi = in - 1 - offset < 0 ? 0 : std::min(width, (in - 1 - offset) / stride + 1);
    const int64_t lo = std::min(hi, offset >= 0 ? int64_t{0} : (-offset + stride - 1) / stride);
    taps.push_back({offset, lo, hi});
  }
  return taps;
}

// Calls f(tap, row, in_row, w_tap) for the rows [row_begin, row_end) of one sample (a row is one
// (t, h) of grad_output; `row` counts from row_begin) and every kernel tap, taps inner: in_row is
// the offset in an input plane of the input row (t, h) the tap reads, or -1 where it reads padding.
template <typename F>
inline void for_each_row_tap(
    const DirectProblem& p, int64_t row_begin, int64_t row_end, const std::vector<WTap>& wt, F f) {
  for (int64_t r = row_begin; r < row_end; ++r) {
    const int64_t t = r / p.out[1], h = r % p.out[1];
    int64_t tap = 0;
    for (int64_t kt = 0; kt < p.kernel[0]; ++kt) {
      const int64_t it = t * p.stride[0] - p.padding[0] + kt * p.dilation[0];
      for (int64_t kh = 0; kh < p.kernel[1]; ++kh) {
        const int64_t ih = h * p.stride[1] - p.padding[1] + kh * p.dilation[1];
        const bool inside = it >= 0 && it < p.in[0] && ih >= 0 && ih < p.in[1];
        const int64_t in_row = inside ? (it * p.in[1] + ih) * p.in[2] : -1;
        for (const WTap& w : wt) f(tap++, r - row_begin, in_row, w);
      }
    }
  }
}

// col[(c * taps + tap) * columns + j] = input at output position j of the chunk through tap, 0 in
// padding. One thread per channel (its taps' rows). S: the W stride when known at compile time, else 0.
template <int64_t S, typename scalar_t>
void im2col(const DirectProblem& p, const scalar_t* input, int64_t sample_stride, const Chunk& c, scalar_t* col) {
  const int64_t channels = p.groups * p.in_per_group, taps = numel3(p.kernel), width = c.width();
  const int64_t columns = c.columns(), plane = numel3(p.in);
  const int64_t sw = S ? S : p.stride[2];
  const std::vector<WTap> wt = w_taps(p);
  at::parallel_for(0, channels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t ci = begin; ci < end; ++ci) {
      for (int64_t n = c.n_begin; n < c.n_end; ++n) {
        const scalar_t* src_plane = input + n * sample_stride + ci * plane;
        scalar_t* dst_sample = col + ci * taps * columns + (n - c.n_begin) * c.rows() * width;
        for_each_row_tap(p, c.row_begin, c.row_end, wt, [&](int64_t tap, int64_t row, int64_t in_row, const WTap& w) {
          scalar_t* dst = dst_sample + tap * columns + row * width;  // the chunk's positions of the row
          if (in_row < 0) {
            std::fill(dst, dst + width, scalar_t(0));
            return;
          }
          // Positions [lo, hi) of the row read the input, w = c.w_begin + j.
          const int64_t lo = std::clamp(w.lo, c.w_begin, c.w_end) - c.w_begin;
          const int64_t hi = std::clamp(w.hi, c.w_begin, c.w_end) - c.w_begin;
          const scalar_t* src = src_plane + in_row + w.offset + c.w_begin * sw;
          std::fill(dst, dst + lo, scalar_t(0));
          for (int64_t j = lo; j < hi; ++j) dst[j] = src[j * sw];
          std::fill(dst + hi, dst + width, scalar_t(0));
        });
      }
    }
  });
}

// grad_input += col scattered back (the adjoint of im2col); a sample's planes are zeroed first by the
// chunk holding its first row. One thread per (sample, channel) plane, taps and positions in a fixed
// order.
template <int64_t S, typename scalar_t>
void col2im(
    const DirectProblem& p, const scalar_t* col, const Chunk& c, scalar_t* grad_input, int64_t sample_stride) {
  const int64_t channels = p.groups * p.in_per_group, taps = numel3(p.kernel), width = c.width();
  const int64_t columns = c.columns(), plane = numel3(p.in);
  const int64_t sw = S ? S : p.stride[2];
  const std::vector<WTap> wt = w_taps(p);
  at::parallel_for(0, c.samples() * channels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n = c.n_begin + item / channels, ci = item % channels;
      scalar_t* dst_plane = grad_input + n * sample_stride + ci * plane;
      if (c.row_begin == 0 && c.w_begin == 0) std::fill(dst_plane, dst_plane + plane, scalar_t(0));
      const scalar_t* src_sample = col + ci * taps * columns + (n - c.n_begin) * c.rows() * width;
      for_each_row_tap(p, c.row_begin, c.row_end, wt, [&](int64_t tap, int64_t row, int64_t in_row, const WTap& w) {
        if (in_row < 0) return;
        const scalar_t* src = src_sample + tap * columns + row * width;
        const int64_t lo = std::clamp(w.lo, c.w_begin, c.w_end) - c.w_begin;
        const int64_t hi = std::clamp(w.hi, c.w_begin, c.w_end) - c.w_begin;
        scalar_t* dst = dst_plane + in_row + w.offset + c.w_begin * sw;
        for (int64_t j = lo; j < hi; ++j) dst[j * sw] += src[j];
      });
    }
  });
}

// Whole samples (every row of the chunk's samples) go through a zero-padded copy of each input plane,
// so that every tap reads in bounds: no per-row range checks, which dominate on short rows (ResNeXt's
// 14-wide stages). Padded by `padding` on each side, every tap of every output position is inside.
std::array<int64_t, 3> padded_sizes(const DirectProblem& p) {
  return {p.in[0] + 2 * p.padding[0], p.in[1] + 2 * p.padding[1], p.in[2] + 2 * p.padding[2]};
}

// Calls f(tap, offset) for every tap, offset: the padded-plane offset of the tap's read for output
// position (0, 0, 0); output position (t, h, w) reads offset + ((t * st) * hp + h * sh) * wp + w * sw.
template <typename F>
inline void for_each_padded_tap(const DirectProblem& p, F f) {
  const auto ps = padded_sizes(p);
  int64_t tap = 0;
  for (int64_t kt = 0; kt < p.kernel[0]; ++kt) {
    for (int64_t kh = 0; kh < p.kernel[1]; ++kh) {
      for (int64_t kw = 0; kw < p.kernel[2]; ++kw) {
        f(tap++, ((kt * p.dilation[0]) * ps[1] + kh * p.dilation[1]) * ps[2] + kw * p.dilation[2]);
      }
    }
  }
}

// Copies a (T, H, W) plane into the interior of a zeroed padded plane, or back (to_padded false).
template <typename scalar_t>
void copy_padded(const DirectProblem& p, scalar_t* padded, scalar_t* plane, bool to_padded) {
  const auto ps = padded_sizes(p);
  for (int64_t t = 0; t < p.in[0]; ++t) {
    for (int64_t h = 0; h < p.in[1]; ++h) {
      scalar_t* row = padded + ((t + p.padding[0]) * ps[1] + h + p.padding[1]) * ps[2] + p.padding[2];
      scalar_t* in_row = plane + (t * p.in[1] + h) * p.in[2];
      if (to_padded) {
        std::copy(in_row, in_row + p.in[2], row);
      } else {
        std::copy(row, row + p.in[2], in_row);
      }
    }
  }
}

// im2col / col2im of whole samples through padded planes: for sample n and channel ci, calls
// row(dst_or_src column row, padded row) for every tap and output row.
template <typename scalar_t, typename F>
inline void walk_padded(const DirectProblem& p, scalar_t* col_sample, int64_t columns, scalar_t* padded, F row) {
  const auto ps = padded_sizes(p);
  const int64_t width = p.out[2];
  for_each_padded_tap(p, [&](int64_t tap, int64_t offset) {
    scalar_t* c = col_sample + tap * columns;
    for (int64_t t = 0; t < p.out[0]; ++t) {
      for (int64_t h = 0; h < p.out[1]; ++h, c += width) {
        row(c, padded + offset + (t * p.stride[0] * ps[1] + h * p.stride[1]) * ps[2]);
      }
    }
  });
}

template <int64_t S, typename scalar_t>
void im2col_padded(
    const DirectProblem& p, const scalar_t* input, int64_t sample_stride, const Chunk& c, scalar_t* col) {
  const int64_t channels = p.groups * p.in_per_group, taps = numel3(p.kernel), width = p.out[2];
  const int64_t columns = c.samples() * numel3(p.out), plane = numel3(p.in), sw = S ? S : p.stride[2];
  at::parallel_for(0, channels, 1, [&](int64_t begin, int64_t end) {
    std::vector<scalar_t> padded(numel3(padded_sizes(p)), scalar_t(0));
    for (int64_t ci = begin; ci < end; ++ci) {
      for (int64_t n = c.n_begin; n < c.n_end; ++n) {
        copy_padded(p, padded.data(), const_cast<scalar_t*>(input + n * sample_stride + ci * plane), true);
        scalar_t* col_sample = col + ci * taps * columns + (n - c.n_begin) * numel3(p.out);
        walk_padded(p, col_sample, columns, padded.data(), [&](scalar_t* dst, const scalar_t* src) {
          for (int64_t j = 0; j < width; ++j) dst[j] = src[j * sw];
        });
      }
    }
  });
}

template <int64_t S, typename scalar_t>
void col2im_padded(
    const DirectProblem& p, const scalar_t* col, const Chunk& c, scalar_t* grad_input, int64_t sample_stride) {
  const int64_t channels = p.groups * p.in_per_group, taps = numel3(p.kernel), width = p.out[2];
  const int64_t columns = c.samples() * numel3(p.out), plane = numel3(p.in), sw = S ? S : p.stride[2];
  at::parallel_for(0, c.samples() * channels, 1, [&](int64_t begin, int64_t end) {
    std::vector<scalar_t> padded(numel3(padded_sizes(p)));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n = c.n_begin + item / channels, ci = item % channels;
      std::fill(padded.begin(), padded.end(), scalar_t(0));
      scalar_t* col_sample = const_cast<scalar_t*>(col) + ci * taps * columns + (n - c.n_begin) * numel3(p.out);
      walk_padded(p, col_sample, columns, padded.data(), [&](const scalar_t* src, scalar_t* dst) {
        for (int64_t j = 0; j < width; ++j) dst[j * sw] += src[j];
      });
      copy_padded(p, padded.data(), grad_input + n * sample_stride + ci * plane, false);
    }
  });
}

// f.template operator()<S>() with S the W stride of p when it is 1 or 2 (so the row loops are
// compiled for it), else 0.
template <typename F>
void with_w_stride(const DirectProblem& p, F f) {
  switch (p.stride[2]) {
    case 1: return f(std::integral_constant<int64_t, 1>());
    case 2: return f(std::integral_constant<int64_t, 2>());
    default: return f(std::integral_constant<int64_t, 0>());
  }
}

// out = a @ b, or out += a @ b, in place (out may be a strided view: BLAS takes its row stride).
// out += a @ b, the product formed apart (in `scratch`, grown as needed) and added once. MKL's sgemm
// with beta = 1 accumulates every product straight into `out` on outputs of a few columns (measured:
// 2-3.4 eps of the result per call on 2-8 columns, 0.3 with the product formed apart), which made
// gemm-kn2row's grad_input one running float32 sum over all taps and channels: 16 eps of its scale
// where native has 4, on wav2vec2's positional convolution (test_long_sums_as_accurate_as_native).
void gemm_add(at::Tensor out, const at::Tensor& a, const at::Tensor& b, at::Tensor& scratch) {
  if (!scratch.defined() || scratch.numel() < out.numel()) scratch = at::empty({out.numel()}, out.options());
  at::Tensor product = scratch.narrow(0, 0, out.numel()).view(out.sizes());
  at::mm_out(product, a, b);
  out.add_(product);
}

// One sample's channels as a (channels, positions) matrix.
at::Tensor matrix(const at::Tensor& sample) {
  return sample.view({sample.size(0), -1});
}

// Buffers reused by the chunks of a call (and by the groups of a grouped layer).
struct Workspace {
  at::Tensor columns, grad_output, product;
  // The first `numel` elements of `buffer`, (re)allocated when it is smaller.
  at::Tensor get(at::Tensor& buffer, int64_t numel, const at::TensorOptions& options) {
    if (!buffer.defined() || buffer.numel() < numel) buffer = at::empty({numel}, options);
    return buffer.narrow(0, 0, numel);
  }
};

// grad_input / grad_weight (either may be undefined) of go's dtype, for one group (p.groups == 1).
// Each sample of go, x, gi is a contiguous block (the tensors may be channel slices of larger ones);
// w and gw are contiguous.
void im2col_backward(
    const DirectProblem& p, const at::Tensor& go, const at::Tensor& x, const at::Tensor& w, at::Tensor gi,
    at::Tensor gw, int64_t budget, Workspace& ws) {
  TORCH_INTERNAL_ASSERT(p.groups == 1);
  const int64_t c_in = p.in_per_group, c_out = p.out_per_group, taps = numel3(p.kernel);
  const int64_t width = p.out[2], sample = numel3(p.out);
  const bool views = column_views(p);
  const std::vector<Chunk> chunks = im2col_plan(p, go.element_size(), budget);
  int64_t max_columns = 0;
  for (const auto& c : chunks) max_columns = std::max(max_columns, c.columns());
  const at::Tensor col_ws = views ? at::Tensor() : ws.get(ws.columns, c_in * taps * max_columns, go.options());
  const at::Tensor go_ws = chunks.size() < static_cast<size_t>(p.batch)
      ? ws.get(ws.grad_output, c_out * max_columns, go.options())
      : at::Tensor();
  const at::Tensor w_t = gi.defined() ? w.view({c_out, -1}).t() : at::Tensor();  // (C_in * taps, C_out)
  at::Tensor gw2 = gw.defined() ? gw.view({c_out, -1}) : at::Tensor();
  bool first = true;
  for (const Chunk& c : chunks) {
    const int64_t columns = c.columns(), first_column = c.row_begin * width + c.w_begin;
    const bool whole = c.rows() == p.out[0] * p.out[1] && c.width() == width;
    at::Tensor go_c;  // (C_out, columns)
    if (c.samples() == 1) {
      go_c = matrix(go[c.n_begin]).narrow(1, first_column, columns);
    } else {
      go_c = go_ws.narrow(0, 0, c_out * columns).view({c_out, c.samples(), sample});
      go_c.copy_(go.narrow(0, c.n_begin, c.samples()).view({c.samples(), c_out, sample}).transpose(0, 1));
      go_c = go_c.view({c_out, columns});
    }
    // (C_in * taps, columns)
    at::Tensor col = views
        ? (gw.defined() ? matrix(x[c.n_begin]).narrow(1, first_column, columns) : at::Tensor())
        : col_ws.narrow(0, 0, c_in * taps * columns).view({c_in * taps, columns});
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, go.scalar_type(), "gemm_im2col_cpu", [&] {
      if (gw.defined()) {
        if (!views) {
          with_w_stride(p, [&](auto stride) {
            constexpr int64_t S = decltype(stride)::value;
            (whole ? im2col_padded<S, scalar_t> : im2col<S, scalar_t>)(
                p, x.const_data_ptr<scalar_t>(), x.stride(0), c, col.mutable_data_ptr<scalar_t>());
          });
        }
        if (first) {
          at::mm_out(gw2, go_c, col.t());
        } else {
          gemm_add(gw2, go_c, col.t(), ws.product);
        }
      }
      if (gi.defined()) {
        if (views) {
          at::Tensor out = matrix(gi[c.n_begin]).narrow(1, first_column, columns);
          at::mm_out(out, w_t, go_c);
        } else {
          at::mm_out(col, w_t, go_c);
          with_w_stride(p, [&](auto stride) {
            constexpr int64_t S = decltype(stride)::value;
            (whole ? col2im_padded<S, scalar_t> : col2im<S, scalar_t>)(
                p, col.const_data_ptr<scalar_t>(), c, gi.mutable_data_ptr<scalar_t>(), gi.stride(0));
          });
        }
      }
    });
    first = false;
  }
}


// The one dim with more than one tap (kn2row_applies() holds).
int kn2row_dim(const DirectProblem& p) {
  for (int i = 0; i < 3; ++i) {
    if (p.kernel[i] > 1) return i;
  }
  return 2;
}

// Kn2row for one group (p.groups == 1); tensors as for im2col_backward.
void kn2row_backward(
    const DirectProblem& p, const at::Tensor& go, const at::Tensor& x, const at::Tensor& w, at::Tensor gi,
    at::Tensor gw) {
  TORCH_INTERNAL_ASSERT(p.groups == 1);
  const int d = kn2row_dim(p);
  const int64_t taps = p.kernel[d], in_len = p.in[d], out_len = p.out[d];
  int64_t inner = 1;  // positions per index of dim d: the dims after it, 1x1 with stride 1
  for (int i = d + 1; i < 3; ++i) inner *= p.in[i];
  const int64_t c_in = p.in_per_group, c_out = p.out_per_group;
  // weight^T per tap: (taps, C_in, C_out).
  const at::Tensor w_t = gi.defined() ? w.view({c_out, c_in, taps}).permute({2, 1, 0}).contiguous() : at::Tensor();
  at::Tensor acc = gw.defined() ? at::zeros({taps, c_out, c_in}, go.options()) : at::Tensor();
  if (gi.defined()) gi.zero_();
  at::Tensor product;  // gemm_add's scratch
  for (int64_t n = 0; n < p.batch; ++n) {
    const at::Tensor go_n = matrix(go[n]);
    const at::Tensor x_n = gw.defined() ? matrix(x[n]) : at::Tensor();
    const at::Tensor gi_n = gi.defined() ? matrix(gi[n]) : at::Tensor();
    for (int64_t k = 0; k < taps; ++k) {
      // output index o reads input index o + shift; both in range for o in [o_begin, o_end).
      const int64_t shift = k * p.dilation[d] - p.padding[d];
      const int64_t o_begin = std::max<int64_t>(0, -shift), o_end = std::min(out_len, in_len - shift);
      if (o_end <= o_begin) continue;
      const int64_t columns = (o_end - o_begin) * inner;
      const at::Tensor go_v = go_n.narrow(1, o_begin * inner, columns);
      if (gw.defined()) gemm_add(acc[k], go_v, x_n.narrow(1, (o_begin + shift) * inner, columns).t(), product);
      if (gi.defined()) gemm_add(gi_n.narrow(1, (o_begin + shift) * inner, columns), w_t[k], go_v, product);
    }
  }
  if (gw.defined()) gw.view({c_out, c_in, taps}).copy_(acc.permute({1, 2, 0}));
}

// grad_input's columns (positions of one sample) per task of kn2row_planes: several micro-kernel
// column blocks, few enough that the task's block of grad_input (C_in x columns, added into once per
// tap) stays in the L2 (R(2+1)D's 144->64 3x1x1 layer, one Zen 4 thread: 171 ms with 2,048 columns, 161
// with 512 or 256).
constexpr int64_t kKn2rowColumns = 512;
// grad_weight's input channels per task of kn2row_planes (whole micro-kernel rows). Each task streams
// the transposed grad_output of its tap once: the fewer tasks per tap, the less it is read (the same
// layer: 191 ms with 8 rows, 166 with 16, 143 with 32, 133 with 48).
constexpr int64_t kKn2rowRows = 48;

// The kn2row-planes kernel: Kn2row for one group on fused::gemm's vector micro-kernels instead of BLAS
// (MKL runs its AVX2 code on AMD CPUs: 57-63 GFLOP/s on R(2+1)D's 3x1x1 layers on a Zen 4 core that
// reaches 104), float32 / float64, tensors as for kn2row_backward; a candidate of its own, so the
// autotuner measures it against gemm-kn2row per signature and gradient. The same products, in the
// tensors' own NC(positions) layout:
//   grad_input: tasks of (sample, kKn2rowColumns columns); per tap in order, columns
//     [(o_begin + shift) * inner, (o_end + shift) * inner) of the task += weight[:, :, k]^T @ grad_output's
//     columns shift * inner before them (a tap's sum over C_out in registers, then added: as
//     gemm_add's product formed apart);
//   grad_weight: grad_output transposed once to [position][C_out] (C_out padded to whole vectors; a
//     kept workspace), then tasks of (tap, kKn2rowRows input channels): per sample in order, that
//     sample's product (a running sum of kGemmBlock-term blocks over the tap's positions) added to the
//     task's sums.
// Each element is written by one task in a fixed order: the same bits for any thread count.
template <typename acc_t>
void kn2row_planes(
    const DirectProblem& p, const at::Tensor& go, const at::Tensor& x, const at::Tensor& w, at::Tensor gi,
    at::Tensor gw) {
  TORCH_INTERNAL_ASSERT(p.groups == 1);
  constexpr int64_t L = fused::Vec<acc_t>::size;
  const int d = kn2row_dim(p);
  const int64_t taps = p.kernel[d], in_len = p.in[d], out_len = p.out[d];
  int64_t inner = 1;  // positions per index of dim d: the dims after it, 1x1 with stride 1
  for (int i = d + 1; i < 3; ++i) inner *= p.in[i];
  const int64_t N = p.batch, c_in = p.in_per_group, c_out = p.out_per_group;
  const int64_t in_pos = in_len * inner, out_pos = out_len * inner;
  // each sample's channels are rows of its positions (gemm_backward_cpu's contiguous tensors, or their
  // channel slices)
  TORCH_INTERNAL_ASSERT((c_out <= 1 || go.stride(1) == out_pos) && (!x.defined() || c_in <= 1 || x.stride(1) == in_pos) &&
                        (!gi.defined() || c_in <= 1 || gi.stride(1) == in_pos));
  // tap k: outputs [o_begin, o_end) read input o + shift
  struct Tap {
    int64_t shift, o_begin, o_end;
  };
  std::vector<Tap> tap(taps);
  for (int64_t k = 0; k < taps; ++k) {
    const int64_t shift = k * p.dilation[d] - p.padding[d];
    tap[k] = {shift, std::max<int64_t>(0, -shift), std::min(out_len, in_len - shift)};
  }
  const acc_t* god = go.const_data_ptr<acc_t>();
  if (gi.defined()) {
    // weight^T per tap: (taps, C_in, C_out)
    const at::Tensor w_t = w.view({c_out, c_in, taps}).permute({2, 1, 0}).contiguous();
    const acc_t* wd = w_t.const_data_ptr<acc_t>();
    acc_t* gid = gi.mutable_data_ptr<acc_t>();
    const int64_t blocks = (in_pos + kKn2rowColumns - 1) / kKn2rowColumns;
    at::parallel_for(0, N * blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t n = t / blocks, c0 = t % blocks * kKn2rowColumns, c1 = std::min(in_pos, c0 + kKn2rowColumns);
        acc_t* gi_n = gid + n * gi.stride(0);
        const acc_t* go_n = god + n * go.stride(0);
        for (int64_t row = 0; row < c_in; ++row) std::fill(gi_n + row * in_pos + c0, gi_n + row * in_pos + c1, acc_t(0));
        for (int64_t k = 0; k < taps; ++k) {
          const int64_t g0 = std::max(c0, (tap[k].o_begin + tap[k].shift) * inner);
          const int64_t g1 = std::min(c1, (tap[k].o_end + tap[k].shift) * inner);
          if (g1 <= g0) continue;
          const int64_t cols = g1 - g0, whole = cols / L * L, from = g0 - tap[k].shift * inner;
          const acc_t* a = wd + k * c_in * c_out;
          if (whole > 0) {
            fused::gemm(c_in, whole, c_out, a, c_out, 1, go_n + from, out_pos, gi_n + g0, in_pos, /*accumulate=*/true);
          }
          for (int64_t ci = 0; ci < c_in; ++ci) {  // the last columns, fewer than a vector
            for (int64_t j = whole; j < cols; ++j) {
              acc_t sum = 0;
              for (int64_t co = 0; co < c_out; ++co) sum += a[ci * c_out + co] * go_n[co * out_pos + from + j];
              gi_n[ci * in_pos + g0 + j] += sum;
            }
          }
        }
      }
    });
  }
  if (gw.defined()) {
    const int64_t co_pad = fused::round_up<acc_t>(c_out);
    // grad_output as [sample][position][co_pad]
    const at::Tensor go_t = workspace::empty({N, out_pos, co_pad}, go.options());
    acc_t* go_td = go_t.mutable_data_ptr<acc_t>();
    std::vector<int64_t> index(out_pos);
    std::iota(index.begin(), index.end(), int64_t{0});
    const int64_t lane_blocks = co_pad / L;
    at::parallel_for(0, N * lane_blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t n = t / lane_blocks, c = t % lane_blocks * L;
        fused::load_tiles(god + n * go.stride(0) + c * out_pos, out_pos, std::min(L, c_out - c), index.data(), out_pos,
                          go_td + n * out_pos * co_pad + c, co_pad);
      }
    });
    // sums[k][ci][co_pad], then grad_weight (C_out, C_in, taps)
    at::Tensor sums = at::empty({taps, c_in, co_pad}, go.options());
    acc_t* sd = sums.mutable_data_ptr<acc_t>();
    const acc_t* xd = x.const_data_ptr<acc_t>();
    const int64_t row_blocks = (c_in + kKn2rowRows - 1) / kKn2rowRows;
    at::parallel_for(0, taps * row_blocks, 1, [&](int64_t begin, int64_t end) {
      std::vector<acc_t> part(kKn2rowRows * co_pad);
      for (int64_t t = begin; t < end; ++t) {
        const int64_t k = t / row_blocks, r0 = t % row_blocks * kKn2rowRows, rows = std::min(kKn2rowRows, c_in - r0);
        acc_t* out = sd + (k * c_in + r0) * co_pad;
        std::fill(out, out + rows * co_pad, acc_t(0));
        if (tap[k].o_end <= tap[k].o_begin) continue;  // a tap that only meets padding: zeros
        const int64_t first = tap[k].o_begin * inner, cols = (tap[k].o_end - tap[k].o_begin) * inner;
        const int64_t x_first = (tap[k].o_begin + tap[k].shift) * inner;
        for (int64_t n = 0; n < N; ++n) {
          fused::gemm(rows, co_pad, cols, xd + n * x.stride(0) + r0 * in_pos + x_first, in_pos, 1,
                      go_td + (n * out_pos + first) * co_pad, co_pad, part.data(), co_pad, /*accumulate=*/false);
          for (int64_t i = 0; i < rows * co_pad; ++i) out[i] += part[i];
        }
      }
    });
    gw.view({c_out, c_in, taps}).copy_(sums.narrow(2, 0, c_out).permute({2, 1, 0}));
  }
}

// The zero-padded grid kn2row_bf16's channel-major grad_output copy lives in, in grad_output's
// coordinates (grad_output at 0, zeros after it in every dim), and how each input position's taps reach
// it. Input position i = stride * j + r (per dim: phase r < stride, j < J) meets, through tap t,
// output position o = j + e with e = (r + padding - t * dilation) / stride, for the taps where that
// divides evenly: so within a phase every tap is one flat offset e for every position j of every
// sample, and grad_input[phase] = sum over its taps of weight_tap^T @ grad_output shifted by e, with
// the positions j laid out at the grid's pitch. Per dim the grid holds max(out, out - e_min, J + e_max)
// positions: a position a tap reaches past a row's end lands in its trailing zeros, one before a row's
// start in the previous row's trailing zeros (or the previous sample's zero frames, or the zeros in
// front of the first sample). Stride 1 (one phase, e = padding - t * dilation) also takes the input at
// `padding` in a grid of the same pitch, wide enough that output position o meets input position
// o + t * dilation - padding at grid offset t * dilation: grad_weight per tap is then one GEMM on views.
struct PaddedGrid {
  struct Phase {
    std::array<int64_t, 3> residue{0, 0, 0};  // r per dim
    std::array<int64_t, 3> count{1, 1, 1};    // J per dim: input positions stride * j + r < in
    std::vector<int64_t> taps;                // the weight's flat tap indices (depth major) meeting it
    std::vector<int64_t> offsets;             // each one's flat offset e in the grid (may be negative)
  };
  std::array<int64_t, 3> size{1, 1, 1};
  int64_t pitch = 1;                 // positions per sample (one channel)
  std::vector<Phase> phases;         // every residue vector, in order (one per stride product)
  std::vector<int64_t> tap_offsets;  // stride 1: the input grid's flat offset t * dilation per tap
  int64_t min_offset = 0, max_offset = 0;  // over the phases' offsets (and 0)

  // sizes_only: size and pitch alone (kn2row_bf16_unsupported, on every call a tuned choice serves)
  explicit PaddedGrid(const DirectProblem& p, bool sizes_only = false) {
    const bool unit_stride = p.stride[0] == 1 && p.stride[1] == 1 && p.stride[2] == 1;
    // per dim and residue: the taps meeting it and their e
    std::array<std::vector<std::vector<std::pair<int64_t, int64_t>>>, 3> reach;
    for (int d = 0; d < 3; ++d) {
      const int64_t s = p.stride[d];
      int64_t e_min = 0, e_max = 0, j_max = 0;
      reach[d].resize(s);
      for (int64_t r = 0; r < s; ++r) {
        j_max = std::max(j_max, (p.in[d] - r + s - 1) / s);
        for (int64_t t = 0; t < p.kernel[d]; ++t) {
          const int64_t num = r + p.padding[d] - t * p.dilation[d];
          if (((num % s) + s) % s != 0) continue;
          reach[d][r].emplace_back(t, num / s);
          e_min = std::min(e_min, num / s);
          e_max = std::max(e_max, num / s);
        }
      }
      size[d] = std::max({p.out[d], p.out[d] - e_min, j_max + e_max});
      if (unit_stride) size[d] = std::max({size[d], p.padding[d] + p.in[d], p.out[d] + (p.kernel[d] - 1) * p.dilation[d]});
    }
    pitch = size[0] * size[1] * size[2];
    if (sizes_only) return;
    for (int64_t r0 = 0; r0 < p.stride[0]; ++r0) {
      for (int64_t r1 = 0; r1 < p.stride[1]; ++r1) {
        for (int64_t r2 = 0; r2 < p.stride[2]; ++r2) {
          Phase phase;
          phase.residue = {r0, r1, r2};
          for (int d = 0; d < 3; ++d) phase.count[d] = (p.in[d] - phase.residue[d] + p.stride[d] - 1) / p.stride[d];
          for (const auto& [a, ea] : reach[0][r0]) {
            for (const auto& [b, eb] : reach[1][r1]) {
              for (const auto& [c, ec] : reach[2][r2]) {
                phase.taps.push_back((a * p.kernel[1] + b) * p.kernel[2] + c);
                phase.offsets.push_back(flat(ea, eb, ec));
                min_offset = std::min(min_offset, phase.offsets.back());
                max_offset = std::max(max_offset, phase.offsets.back());
              }
            }
          }
          phases.push_back(std::move(phase));
        }
      }
    }
    if (unit_stride) {
      for (int64_t a = 0; a < p.kernel[0]; ++a) {
        for (int64_t b = 0; b < p.kernel[1]; ++b) {
          for (int64_t c = 0; c < p.kernel[2]; ++c) {
            tap_offsets.push_back(flat(a * p.dilation[0], b * p.dilation[1], c * p.dilation[2]));
          }
        }
      }
    }
  }
  int64_t flat(int64_t a, int64_t b, int64_t c) const {
    return (a * size[1] + b) * size[2] + c;
  }
};

// t (N, C, *dims) copied channel-major into the grid: (C, front + N * pitch + back), sample n's grid
// starting at front + n * pitch, t's positions at grid offset `at`, zeros everywhere else.
at::Tensor to_grid(const at::Tensor& t, const std::array<int64_t, 3>& dims, const std::array<int64_t, 3>& at,
                   const PaddedGrid& g, int64_t front, int64_t back) {
  const int64_t N = t.size(0), C = t.size(1);
  at::Tensor buffer = workspace::empty({C, front + N * g.pitch + back}, t.options());
  buffer.narrow(1, 0, front).zero_();
  buffer.narrow(1, front + N * g.pitch, back).zero_();
  const at::Tensor grid = buffer.narrow(1, front, N * g.pitch).view({C, N, g.size[0], g.size[1], g.size[2]});
  for (int i = 0; i < 3; ++i) {
    grid.narrow(2 + i, 0, at[i]).zero_();
    grid.narrow(2 + i, at[i] + dims[i], g.size[i] - at[i] - dims[i]).zero_();
  }
  grid.narrow(2, at[0], dims[0]).narrow(3, at[1], dims[1]).narrow(4, at[2], dims[2])
      .copy_(t.flatten(2).view({N, C, dims[0], dims[1], dims[2]}).transpose(0, 1));
  return buffer;
}

// Which way round kn2row_bf16's grad_weight GEMMs run, (C_out, C_in) = grad_output @ input^T or
// (C_in, C_out) = input @ grad_output^T, per (C_out, C_in, K, thread count): measured, oneDNN's speed
// differing by 2-4x between them and flipping with the thread count on one machine (R(2+1)D's 3x1x1
// layer, K = 250,880: 26 against 20 ms one thread, 15 against 65 two; its 1x3x3 layer, K = 215,296: 8
// against 15 one thread, 19 against 7.7 two). The first call of a key times kSamples products each way
// on its first tap's operands into a scratch matrix, then every call (that one included) takes the
// faster way, read without a lock: the two ways sum in different orders, so a call's bits must not
// depend on which call of the process it is (measured on the real outputs, the first calls alternated).
class GemmOrientation {
 public:
  // Whether to run transposed; `product(transposed)` computes one way into scratch (the first call only).
  template <typename F>
  bool choose(F&& product) {
    const int decided = decided_.load(std::memory_order_acquire);
    if (decided >= 0) return decided == 1;
    std::lock_guard<std::mutex> lock(mutex_);
    if (decided_.load(std::memory_order_relaxed) < 0) {
      double best[2] = {1e30, 1e30};
      for (int i = 0; i < 2 * kSamples; ++i) {
        const bool transposed = i % 2 == 1;
        const auto start = std::chrono::steady_clock::now();
        product(transposed);
        best[transposed] =
            std::min(best[transposed], std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      }
      decided_.store(best[1] < best[0], std::memory_order_release);
    }
    return decided_.load(std::memory_order_relaxed) == 1;
  }

 private:
  static constexpr int kSamples = 2;
  std::mutex mutex_;
  std::atomic<int> decided_{-1};  // -1 until measured, then 1: transposed, 0: not
};

GemmOrientation& gemm_orientation(int64_t c_out, int64_t c_in, int64_t columns) {
  static std::mutex mutex;
  static std::map<std::array<int64_t, 4>, std::unique_ptr<GemmOrientation>> table;
  std::lock_guard<std::mutex> lock(mutex);
  auto& slot = table[{c_out, c_in, columns, static_cast<int64_t>(at::get_num_threads())}];
  if (!slot) slot = std::make_unique<GemmOrientation>();
  return *slot;
}

// Largest ratio of kn2row_bf16's grid positions to the larger of grad_output's positions and a phase's
// input positions: its copies take about this many times grad_output's and input's memory (a 3x3 layer
// padded 1 at 56x56: 1.07; R(2+1)D's 3x1x1 at 8 frames: 1.25; wav2vec2's positional convolution, 128
// taps over 49 frames: 3.6).
constexpr int64_t kMaxGridRatio = 4;

// Most bytes of kn2row_bf16's gathered input for a strided grad_weight: every tap's at once (one GEMM),
// else one tap's at a time.
constexpr int64_t kMaxGatherBytes = int64_t{256} << 20;

// Grid positions per grad_input task of kn2row_bf16: the task's stacked grad_output block (taps *
// C_out rows of this many bfloat16 values) takes about a quarter of the L2, at least kMinPartColumns.
int64_t kn2row_bf16_columns(int64_t stacked_rows, int64_t positions) {
  const int64_t columns = std::max<int64_t>(kMinPartColumns, l2_bytes() / 4 / (2 * stacked_rows) / 64 * 64);
  return std::min(columns, positions);
}

// gemm-kn2row in bfloat16, for one group (p.groups == 1; any stride, padding and dilation; tensors as
// for kn2row_planes): the products on the bfloat16 tensors by oneDNN's bfloat16 GEMMs (at::mm: AMX tiles
// or AVX512_BF16 dot products where the CPU has them), each output element the result of a single GEMM
// that sums in float32 and rounds once, as native's oneDNN convolution does (a GEMM per tap would
// round each tap's sum). grad_output is copied channel-major into the PaddedGrid, where within a phase
// of the input's positions a tap is one flat offset:
//   grad_input: tasks of (phase, sample, block of grid positions from its first position j to its
//     last), each the phase's taps' shifted grad_output rows stacked into one (taps * C_out, block)
//     matrix (plain copies: the grid's zeros stand where a tap meets no output) and one GEMM, weight as
//     (C_in, taps * C_out) @ stacked; the block's positions j go to grad_input at stride * j + r. A
//     phase no tap meets (a stride over the kernel's reach) is zero;
//   grad_weight: one GEMM over every sample and grid position, grad_output's columns against the
//     input's there: at stride 1 per tap, on a view of the input's grid shifted by the tap's offset;
//     strided, for every tap at once (per tap over kMaxGatherBytes), on the taps' input positions
//     o * stride + t * dilation - padding gathered into the grid's layout.
// The zeros the grid puts against real values are exact unless those are not finite: run_kernel
// declines a non-finite weight for grad_input and a non-finite grad_weight.
// R(2+1)D's 144 -> 64 3x1x1 layer (8 frames of 56x56, batch 8, one Sapphire Rapids thread): 82 ms
// against 183 of the 2-D bfloat16 call fold-2d serves it by.
void kn2row_bf16(
    const DirectProblem& p, const at::Tensor& go, const at::Tensor& x, const at::Tensor& w, at::Tensor gi,
    at::Tensor gw) {
  TORCH_INTERNAL_ASSERT(p.groups == 1 && go.scalar_type() == at::kBFloat16);
  const PaddedGrid g(p);
  const int64_t N = p.batch, c_in = p.in_per_group, c_out = p.out_per_group;
  const int64_t taps = p.kernel[0] * p.kernel[1] * p.kernel[2];
  const std::array<int64_t, 3> origin{0, 0, 0};
  // grad_input reads up to -min_offset positions before a sample's grid and max_offset past it
  const int64_t front = gi.defined() ? -g.min_offset : 0, back = gi.defined() ? g.max_offset : 0;
  const at::Tensor go_grid = to_grid(go, p.out, origin, g, front, back);
  if (gi.defined()) {
    // the tasks: (phase, sample, block) in phase order
    struct PhasePlan {
      at::Tensor w_st;  // weight as (C_in, taps * C_out): [ci][tap][co], the phase's taps
      int64_t last = 0, columns = 0, blocks = 0, first_task = 0;
    };
    std::vector<PhasePlan> plans(g.phases.size());
    int64_t tasks = 0, buffer_rows = 0, buffer_columns = 0;
    const at::Tensor w_taps = w.view({c_out, c_in, taps});
    for (size_t i = 0; i < g.phases.size(); ++i) {
      const auto& phase = g.phases[i];
      PhasePlan& plan = plans[i];
      plan.first_task = tasks;
      if (phase.count[0] * phase.count[1] * phase.count[2] == 0) continue;
      if (phase.taps.empty()) {  // no tap meets these input positions: their gradient is zero
        at::Tensor view = gi.view({N, c_in, p.in[0], p.in[1], p.in[2]});
        for (int d = 0; d < 3; ++d) view = view.slice(2 + d, phase.residue[d], p.in[d], p.stride[d]);
        view.zero_();
        continue;
      }
      const int64_t phase_taps = static_cast<int64_t>(phase.taps.size()), rows = phase_taps * c_out;
      const at::Tensor index = at::tensor(phase.taps, at::TensorOptions().dtype(at::kLong));
      plan.w_st = w_taps.index_select(2, index).permute({1, 2, 0}).reshape({c_in, rows});
      plan.last = g.flat(phase.count[0] - 1, phase.count[1] - 1, phase.count[2] - 1);
      plan.columns = kn2row_bf16_columns(rows, plan.last + 1);
      plan.blocks = (plan.last + plan.columns) / plan.columns;
      tasks += N * plan.blocks;
      buffer_rows = std::max(buffer_rows, rows);
      buffer_columns = std::max(buffer_columns, plan.columns);
    }
    const auto* god = go_grid.const_data_ptr<at::BFloat16>();
    const int64_t go_row = go_grid.size(1), in_pos = p.in[0] * p.in[1] * p.in[2];
    auto* gid = gi.mutable_data_ptr<at::BFloat16>();
    at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
      const at::Tensor stacked_buffer = at::empty({buffer_rows * buffer_columns}, go.options());
      const at::Tensor result_buffer = at::empty({c_in * buffer_columns}, go.options());
      auto* sd = stacked_buffer.mutable_data_ptr<at::BFloat16>();
      size_t ph = 0;
      for (int64_t t = begin; t < end; ++t) {
        while (ph + 1 < plans.size() && t >= plans[ph + 1].first_task) ++ph;
        const auto& phase = g.phases[ph];
        const PhasePlan& plan = plans[ph];
        const int64_t local = t - plan.first_task, columns = plan.columns;
        const int64_t n = local / plan.blocks, q0 = local % plan.blocks * columns;
        const int64_t cols = std::min(columns, plan.last + 1 - q0);
        const int64_t phase_taps = static_cast<int64_t>(phase.taps.size()), rows = phase_taps * c_out;
        const at::BFloat16* sample = god + front + n * g.pitch;
        for (int64_t k = 0; k < phase_taps; ++k) {
          for (int64_t co = 0; co < c_out; ++co) {
            std::memcpy(sd + (k * c_out + co) * columns, sample + co * go_row + q0 + phase.offsets[k],
                        cols * sizeof(at::BFloat16));
          }
        }
        const at::Tensor stacked = stacked_buffer.narrow(0, 0, rows * columns).view({rows, columns});
        const at::Tensor result = result_buffer.narrow(0, 0, c_in * columns).view({c_in, columns});
        at::Tensor out = result.narrow(1, 0, cols);
        at::mm_out(out, plan.w_st, stacked.narrow(1, 0, cols));
        const auto* rd = result.const_data_ptr<at::BFloat16>();
        // the block's positions j, grid row by grid row, to input positions stride * j + r
        at::BFloat16* gi_n = gid + n * gi.stride(0);
        for (int64_t q = q0; q < q0 + cols;) {
          const int64_t row = q / g.size[2], row_end = std::min(q0 + cols, (row + 1) * g.size[2]);
          const int64_t a = row / g.size[1], b = row % g.size[1];
          const int64_t c0 = q - row * g.size[2], c1 = std::min(row_end - row * g.size[2], phase.count[2]);
          if (a < phase.count[0] && b < phase.count[1] && c1 > c0) {
            const int64_t to = ((p.stride[0] * a + phase.residue[0]) * p.in[1] + p.stride[1] * b + phase.residue[1]) *
                    p.in[2] + p.stride[2] * c0 + phase.residue[2];
            const int64_t from = q - q0, s2 = p.stride[2];
            for (int64_t ci = 0; ci < c_in; ++ci) {
              const at::BFloat16* src = rd + ci * columns + from;
              at::BFloat16* dst = gi_n + ci * in_pos + to;
              if (s2 == 1) {
                std::memcpy(dst, src, (c1 - c0) * sizeof(at::BFloat16));
              } else {
                for (int64_t c = 0; c < c1 - c0; ++c) dst[c * s2] = src[c];
              }
            }
          }
          q = row_end;
        }
      }
    });
  }
  if (gw.defined()) {
    // every sample's grid but the last one's positions after its last grad_output position
    const int64_t columns = (N - 1) * g.pitch + g.flat(p.out[0] - 1, p.out[1] - 1, p.out[2] - 1) + 1;
    const at::Tensor go_m = go_grid.narrow(1, front, columns);
    // grad_weight (C_out, C_in) per tap = grad_output @ input^T, or its transpose input @ grad_output^T
    // (the same products, summed in float32 in another order), one GEMM after the other on oneDNN's
    // threads: GemmOrientation measures which way runs faster here. (Tasks of single-threaded GEMMs ran
    // 3x slower on two threads than one after the other: these long-K GEMMs stream their operands.)
    const auto product = [&](bool transposed, const at::Tensor& x_k, at::Tensor out) {
      if (transposed) {  // into a row-major (C_in, C_out) product: ATen would swap a transposed view back
        out.copy_(at::mm(x_k, go_m.t()).t());
      } else {
        at::mm_out(out, go_m, x_k.t());
      }
    };
    if (!g.tap_offsets.empty()) {
      // stride 1: the input in the grid at `padding`, tap k's columns a view at its offset
      const at::Tensor x_grid = to_grid(x, p.in, p.padding, g, 0, 0);
      at::Tensor acc = at::empty({taps, c_out, c_in}, go.options());
      GemmOrientation& orientation = gemm_orientation(c_out, c_in, columns);
      bool transposed = false;
      for (int64_t k = 0; k < taps; ++k) {
        const at::Tensor x_k = x_grid.narrow(1, g.tap_offsets[k], columns);
        if (k == 0) {
          const at::Tensor scratch = at::empty({c_out, c_in}, go.options());
          transposed = orientation.choose([&](bool t) { product(t, x_k, scratch); });
        }
        product(transposed, x_k, acc[k]);
      }
      gw.view({c_out, c_in, taps}).copy_(acc.permute({1, 2, 0}));
    } else {
      // strided: the taps' input positions o * stride + t * dilation - padding gathered into the grid's
      // layout, [tap][ci] rows (zeros where grad_output has its zeros), and one GEMM for every tap (per
      // tap where that copy would exceed kMaxGatherBytes): on two threads oneDNN ran wav2vec2's three
      // 512 x 512 tap products (K = 12,800) in 22 ms, as on one, and their 512 x 1,536 product in 11
      // (one thread: 21 and 19).
      at::Tensor x_padded = x.view({N, c_in, p.in[0], p.in[1], p.in[2]});
      if (p.padding[0] || p.padding[1] || p.padding[2]) {
        x_padded = at::constant_pad_nd(x_padded, {p.padding[2], p.padding[2], p.padding[1], p.padding[1], p.padding[0], p.padding[0]});
      }
      const int64_t at_once = taps * c_in * N * g.pitch * int64_t(sizeof(at::BFloat16)) <= kMaxGatherBytes ? taps : 1;
      const at::Tensor gathered = workspace::empty({at_once * c_in, N * g.pitch}, x.options());
      const at::Tensor gathered_taps = gathered.view({at_once, c_in, N, g.size[0], g.size[1], g.size[2]});
      for (int d = 0; d < 3; ++d) gathered_taps.narrow(3 + d, p.out[d], g.size[d] - p.out[d]).zero_();
      at::Tensor acc = at::empty({taps / at_once, c_out, at_once * c_in}, go.options());
      GemmOrientation& orientation = gemm_orientation(c_out, at_once * c_in, columns);
      bool transposed = false;
      for (int64_t k0 = 0; k0 < taps; k0 += at_once) {
        for (int64_t k = k0; k < k0 + at_once; ++k) {
          const int64_t tap[3] = {k / (p.kernel[1] * p.kernel[2]), k / p.kernel[2] % p.kernel[1], k % p.kernel[2]};
          at::Tensor from = x_padded;
          for (int d = 0; d < 3; ++d) {
            const int64_t start = tap[d] * p.dilation[d];
            from = from.slice(2 + d, start, start + (p.out[d] - 1) * p.stride[d] + 1, p.stride[d]);
          }
          gathered_taps[k - k0].narrow(2, 0, p.out[0]).narrow(3, 0, p.out[1]).narrow(4, 0, p.out[2])
              .copy_(from.transpose(0, 1));
        }
        const at::Tensor x_k = gathered.narrow(1, 0, columns);
        if (k0 == 0) {
          const at::Tensor scratch = at::empty({c_out, at_once * c_in}, go.options());
          transposed = orientation.choose([&](bool t) { product(t, x_k, scratch); });
        }
        product(transposed, x_k, acc[k0 / at_once]);
      }
      // acc: [tap block][co][tap in block][ci]
      gw.view({c_out, c_in, taps / at_once, at_once})
          .copy_(acc.view({taps / at_once, c_out, at_once, c_in}).permute({1, 3, 0, 2}));
    }
  }
}

bool reduced(at::ScalarType t) {
  return t == at::kHalf || t == at::kBFloat16;
}

}  // namespace

bool kn2row_applies(const DirectProblem& p) {
  int wide = 0;
  for (int i = 0; i < 3; ++i) {
    if (p.stride[i] != 1) return false;
    if (p.kernel[i] > 1) {
      if (wide++) return false;
      continue;
    }
    if (p.padding[i] != 0) return false;
    // A dim before the tap dim must be trivial, so that every shifted view is one strided matrix.
    if (!wide && p.in[i] != 1) {
      bool later = false;
      for (int j = i + 1; j < 3; ++j) later |= p.kernel[j] > 1;
      if (later) return false;
    }
  }
  return wide == 1;
}

std::optional<std::string> kn2row_bf16_unsupported(const DirectProblem& p) {
  if (p.groups > 1 && !kn2row_applies(p)) {
    return std::string(
        "groups > 1 where it takes only stride 1, taps in one dim, no padding on the other dims and size 1 before it");
  }
  const PaddedGrid g(p, /*sizes_only=*/true);
  int64_t phase_positions = 1;  // the residue-0 phase's, the largest
  for (int d = 0; d < 3; ++d) phase_positions *= (p.in[d] + p.stride[d] - 1) / p.stride[d];
  const int64_t positions = std::max(p.out[0] * p.out[1] * p.out[2], phase_positions);
  if (g.pitch > kMaxGridRatio * positions) {
    return c10::str("its zero-padded grid (", g.size[0], "x", g.size[1], "x", g.size[2], ") is over ", kMaxGridRatio,
                    "x grad_output's positions");
  }
  return std::nullopt;
}

bool gemm_keeps_reduced_dtype(GemmAlgorithm algorithm, const DirectProblem& p, int64_t element_size) {
  // Each output is then one oneDNN GEMM, accumulated in float32 and rounded once.
  return algorithm == GemmAlgorithm::Im2col && p.groups == 1 && pointwise(p) &&
      im2col_plan(p, element_size, kWorkspaceBytes).size() == 1;
}

void gemm_backward_cpu(
    GemmAlgorithm algorithm, const DirectProblem& p, const at::Tensor& grad_output, const at::Tensor& input,
    const at::Tensor& weight, at::Tensor* grad_input, at::Tensor* grad_weight) {
  const at::ScalarType dtype = grad_output.scalar_type();
  TORCH_INTERNAL_ASSERT(algorithm == GemmAlgorithm::Im2col || kn2row_applies(p) ||
                        (algorithm == GemmAlgorithm::Kn2row && dtype == at::kBFloat16 && !kn2row_bf16_unsupported(p)));
  // bfloat16 Kn2row: kn2row_bf16's oneDNN GEMMs, each rounding once
  const bool compute_in_dtype = !reduced(dtype) || gemm_keeps_reduced_dtype(algorithm, p, grad_output.element_size()) ||
      (algorithm == GemmAlgorithm::Kn2row && dtype == at::kBFloat16);
  const at::ScalarType compute = compute_in_dtype ? dtype : at::kFloat;
  // input is only read for grad_weight, weight only for grad_input: either may be undefined.
  const at::Tensor go = grad_output.to(compute);
  const at::Tensor x = input.defined() ? input.to(compute) : input, w = weight.defined() ? weight.to(compute) : weight;
  at::Tensor gi, gw;
  if (grad_input) gi = compute == dtype ? *grad_input : at::empty(grad_input->sizes(), go.options());
  if (grad_weight) gw = compute == dtype ? *grad_weight : at::empty(grad_weight->sizes(), go.options());
  // Group by group, each group's tensors a slice of the channels (see kGroupWorkspaceBytes).
  DirectProblem group = p;
  group.groups = 1;
  const auto slice = [](const at::Tensor& t, int64_t dim, int64_t g, int64_t size) {
    return t.defined() ? t.narrow(dim, g * size, size) : t;
  };
  Workspace ws;
  for (int64_t g = 0; g < p.groups; ++g) {
    const int64_t c_in = p.in_per_group, c_out = p.out_per_group;
    const at::Tensor go_g = slice(go, 1, g, c_out), x_g = slice(x, 1, g, c_in), w_g = slice(w, 0, g, c_out);
    const at::Tensor gi_g = slice(gi, 1, g, c_in), gw_g = slice(gw, 0, g, c_out);
    if (algorithm == GemmAlgorithm::Kn2rowPlanes) {
      TORCH_INTERNAL_ASSERT(compute == at::kFloat || compute == at::kDouble);
      if (compute == at::kFloat) {
        kn2row_planes<float>(group, go_g, x_g, w_g, gi_g, gw_g);
      } else {
        kn2row_planes<double>(group, go_g, x_g, w_g, gi_g, gw_g);
      }
    } else if (algorithm == GemmAlgorithm::Kn2row) {
      if (compute == at::kBFloat16) {
        kn2row_bf16(group, go_g, x_g, w_g, gi_g, gw_g);
      } else {
        kn2row_backward(group, go_g, x_g, w_g, gi_g, gw_g);
      }
    } else {
      im2col_backward(group, go_g, x_g, w_g, gi_g, gw_g, p.groups > 1 ? kGroupWorkspaceBytes : kWorkspaceBytes, ws);
    }
  }
  if (grad_input && compute != dtype) grad_input->copy_(gi);
  if (grad_weight && compute != dtype) grad_weight->copy_(gw);
}

}  // namespace aten_override
