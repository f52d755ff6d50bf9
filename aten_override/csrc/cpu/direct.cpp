// The fused direct kernel of the compiled backend: grad_input and grad_weight of depthwise (with
// channel multiplier), grouped and one-channel convolutions, 1-D/2-D/3-D, any stride, padding and
// dilation (not transposed).
//
// Each input plane (one sample, one channel) is copied once into a zero-padded buffer whose
// innermost (W) dim is split by stride phase: padded column j lives at [j % stride][j / stride].
// Every kernel tap then reads or writes a *contiguous* row segment for a contiguous row of
// grad_output, whatever the stride, so the inner loops are unit-stride and vectorize:
//   grad_input:  plane_row[tap + w] += weight[tap] * grad_output_row[w]   (scattered back)
//   grad_weight: acc[tap] += sum_w grad_output_row[w] * plane_row[tap + w]
// grad_weight takes up to 8 taps per pass over grad_output: one grad_output vector feeds all of them
// and their sums stay in vector registers over the whole plane.
// grad_input is parallel over (sample, input channel) and grad_weight over output channels, so no
// two threads write the same element: no atomics, and the result does not depend on the thread
// count (deterministic). The hot loops are compiled for AVX-512 / AVX2+FMA / baseline x86-64 and
// picked at load time (GCC/Clang target_clones); the vectors are GCC/Clang vector extensions (at::vec
// is not used: its SIMD paths are only enabled inside ATen's own per-capability build).
#include "../convolution_backward.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && defined(__linux__)
#define ATEN_OVERRIDE_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define ATEN_OVERRIDE_CLONES
#endif

namespace aten_override {
namespace {

// Layout of one zero-padded, phase-split input plane and of the walk over grad_output rows.
struct Geometry {
  int64_t out_t, out_h, out_w;  // grad_output spatial size
  int64_t stride_t, stride_h, stride_w;
  int64_t rows_h;     // padded H
  int64_t width;      // columns per W phase
  int64_t row_size;   // phases * width
  int64_t plane_size; // padded T * padded H * row_size
  int64_t taps;       // kernel elements
  const int64_t* tap_offset;  // offset of each kernel tap from a grad_output row's base
  // Taps by stride class ((kt*dt) % stride_t, (kh*dh) % stride_h, (kw*dw) % stride_w): class c's
  // taps are class_taps[class_begin[c] .. class_begin[c + 1]). A padded input row (rt, rh) and W
  // phase r only receive gradient from the taps of class (rt % stride_t, rh % stride_h, r).
  const int64_t* class_taps;
  const int64_t* class_begin;
  int64_t in_per_group;
};

// 32-byte vectors (GCC/Clang vector extensions): AVX(2) registers in the haswell / skylake-avx512
// clones, SSE pairs in the baseline one. Loads and stores are unaligned.
typedef float vfloat __attribute__((vector_size(32), aligned(4)));
typedef double vdouble __attribute__((vector_size(32), aligned(8)));
template <typename acc_t>
struct VecOf;
template <>
struct VecOf<float> {
  using type = vfloat;
};
template <>
struct VecOf<double> {
  using type = vdouble;
};

template <typename acc_t>
inline __attribute__((always_inline)) typename VecOf<acc_t>::type load(const acc_t* p) {
  return *reinterpret_cast<const typename VecOf<acc_t>::type*>(p);
}
template <typename acc_t>
inline __attribute__((always_inline)) void store(acc_t* p, typename VecOf<acc_t>::type v) {
  *reinterpret_cast<typename VecOf<acc_t>::type*>(p) = v;
}

// The kernel taps are processed NT at a time (NT <= kMaxTapBlock), so that their accumulators (or
// the grad_output vector they share) stay in registers.
constexpr int64_t kMaxTapBlock = 8;

// acc[k] += tail[k] + the lanes of sums[k], for NT taps.
template <int NT, typename acc_t>
inline __attribute__((always_inline)) void add_sums(
    acc_t* acc, const typename VecOf<acc_t>::type* sums, const acc_t* tail) {
  constexpr int64_t L = sizeof(typename VecOf<acc_t>::type) / sizeof(acc_t);
  for (int k = 0; k < NT; ++k) {
    acc_t total = tail[k];
    for (int64_t i = 0; i < L; ++i) total += sums[k][i];
    acc[k] += total;
  }
}

// plane[j] += sum over NT taps of weight[tap] * spread[j - tap], every j of the plane. `spread` is
// grad_output laid out like the plane (row (t, h) at (t * stride_t * rows_h + h * stride_h) * row_size,
// zeros elsewhere), so this is exactly the scatter plane[base + tap + w] += weight[tap] *
// grad_output[w], computed as a gather: no store is reloaded at an overlapping offset.
template <int NT, typename acc_t>
inline __attribute__((always_inline)) void gather_taps(
    acc_t* plane, const acc_t* spread, const acc_t* weight, const int64_t* tap_offset, const int64_t* taps,
    int64_t j0, int64_t j1) {
  using V = typename VecOf<acc_t>::type;
  constexpr int64_t L = sizeof(V) / sizeof(acc_t);
  acc_t wk[NT];
  const acc_t* src[NT];
  for (int k = 0; k < NT; ++k) {
    wk[k] = weight[taps[k]];
    src[k] = spread - tap_offset[taps[k]];
  }
  int64_t j = j0;
  for (; j + L <= j1; j += L) {
    V sum = load(plane + j);
    for (int k = 0; k < NT; ++k) {
      sum += wk[k] * load(src[k] + j);
    }
    store(plane + j, sum);
  }
  for (; j < j1; ++j) {
    for (int k = 0; k < NT; ++k) {
      plane[j] += wk[k] * src[k][j];
    }
  }
}

// acc[tap] += sum_j spread[j] * plane[j + tap] for NT taps, j over the plane: grad_weight when every
// stride is 1 (spread then has grad_output at the positions of the plane it multiplies, zeros
// elsewhere), one long vectorized pass however short the rows are.
template <int NT, typename acc_t>
inline __attribute__((always_inline)) void correlate_flat_taps(
    const Geometry& g, acc_t* acc, const acc_t* plane, const acc_t* spread, const int64_t* taps) {
  using V = typename VecOf<acc_t>::type;
  constexpr int64_t L = sizeof(V) / sizeof(acc_t);
  const int64_t span = ((g.out_t - 1) * g.rows_h + g.out_h - 1) * g.row_size + g.out_w;
  V sums[NT] = {};
  acc_t tail[NT] = {};
  int64_t j = 0;
  for (; j + L <= span; j += L) {
    const V go = load(spread + j);
    for (int k = 0; k < NT; ++k) {
      sums[k] += go * load(plane + taps[k] + j);
    }
  }
  for (; j < span; ++j) {
    for (int k = 0; k < NT; ++k) {
      tail[k] += spread[j] * plane[taps[k] + j];
    }
  }
  add_sums<NT>(acc, sums, tail);
}

// acc[tap] += sum over every grad_output row of grad_output_row[w] * plane[tap + w], for NT taps.
template <int NT, typename acc_t>
inline __attribute__((always_inline)) void correlate_taps(
    const Geometry& g, acc_t* acc, const acc_t* plane, const acc_t* grad_output, const int64_t* taps) {
  using V = typename VecOf<acc_t>::type;
  constexpr int64_t L = sizeof(V) / sizeof(acc_t);
  V sums[NT] = {};
  acc_t tail[NT] = {};
  for (int64_t t = 0; t < g.out_t; ++t) {
    for (int64_t h = 0; h < g.out_h; ++h) {
      const acc_t* go_row = grad_output + (t * g.out_h + h) * g.out_w;
      const acc_t* base = plane + (t * g.stride_t * g.rows_h + h * g.stride_h) * g.row_size;
      int64_t w = 0;
      for (; w + L <= g.out_w; w += L) {
        const V go = load(go_row + w);
        for (int k = 0; k < NT; ++k) {
          sums[k] += go * load(base + taps[k] + w);
        }
      }
      for (; w < g.out_w; ++w) {
        for (int k = 0; k < NT; ++k) {
          tail[k] += go_row[w] * base[taps[k] + w];
        }
      }
    }
  }
  add_sums<NT>(acc, sums, tail);
}

// Splits the taps into near-equal blocks of at most kMaxTapBlock and calls op.template run<NT>(first, NT).
template <typename Op>
inline __attribute__((always_inline)) void for_tap_blocks(int64_t taps, Op&& op) {
  if (taps == 0) return;
  const int64_t blocks = (taps + kMaxTapBlock - 1) / kMaxTapBlock;
  const int64_t per_block = (taps + blocks - 1) / blocks;
  for (int64_t first = 0; first < taps; first += per_block) {
    switch (std::min(per_block, taps - first)) {
      case 1: op.template run<1>(first); break;
      case 2: op.template run<2>(first); break;
      case 3: op.template run<3>(first); break;
      case 4: op.template run<4>(first); break;
      case 5: op.template run<5>(first); break;
      case 6: op.template run<6>(first); break;
      case 7: op.template run<7>(first); break;
      default: op.template run<8>(first); break;
    }
  }
}

template <typename acc_t>
struct GatherOp {
  const Geometry& g;
  acc_t* plane;
  const acc_t* spread;
  const acc_t* weight;
  const int64_t* taps;
  int64_t j0, j1;
  template <int NT>
  inline __attribute__((always_inline)) void run(int64_t first) const {
    gather_taps<NT>(plane, spread, weight, g.tap_offset, taps + first, j0, j1);
  }
};

// Flat: `grad_output` is the spread plane and every stride is 1 (correlate_flat_taps).
template <typename acc_t, bool Flat>
struct CorrelateOp {
  const Geometry& g;
  acc_t* acc;
  const acc_t* plane;
  const acc_t* grad_output;
  template <int NT>
  inline __attribute__((always_inline)) void run(int64_t first) const {
    if constexpr (Flat) {
      correlate_flat_taps<NT>(g, acc + first, plane, grad_output, g.tap_offset + first);
    } else {
      correlate_taps<NT>(g, acc + first, plane, grad_output, g.tap_offset + first);
    }
  }
};

// plane += weight (*) grad_output, for one (input channel, output channel) pair; `spread` as in gather_taps.
template <typename acc_t>
inline __attribute__((always_inline)) void scatter_plane(
    const Geometry& g, acc_t* plane, const acc_t* spread, const acc_t* weight) {
  const int64_t classes = g.stride_t * g.stride_h * g.stride_w;
  if (classes == 1) {
    for_tap_blocks(g.taps, GatherOp<acc_t>{g, plane, spread, weight, g.class_taps, 0, g.plane_size});
    return;
  }
  // Strided: each padded row and W phase gathers only from the taps that can reach it.
  const int64_t rows = g.plane_size / g.row_size;
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t rt = row / g.rows_h, rh = row % g.rows_h;
    for (int64_t r = 0; r < g.stride_w; ++r) {
      const int64_t cls = ((rt % g.stride_t) * g.stride_h + rh % g.stride_h) * g.stride_w + r;
      const int64_t j0 = row * g.row_size + r * g.width;
      for_tap_blocks(
          g.class_begin[cls + 1] - g.class_begin[cls],
          GatherOp<acc_t>{g, plane, spread, weight, g.class_taps + g.class_begin[cls], j0, j0 + g.width});
    }
  }
}

// acc[ci][tap] += sum over grad_output of grad_output * input, for one output channel.
// With every stride 1, `grad_output` is the spread plane (see gather_taps) instead.
template <typename acc_t>
inline __attribute__((always_inline)) void correlate_plane(
    const Geometry& g, acc_t* acc, const acc_t* planes, const acc_t* grad_output) {
  const bool flat = g.stride_t * g.stride_h * g.stride_w == 1;
  for (int64_t ci = 0; ci < g.in_per_group; ++ci) {
    if (flat) {
      for_tap_blocks(g.taps, CorrelateOp<acc_t, true>{g, acc + ci * g.taps, planes + ci * g.plane_size, grad_output});
    } else {
      for_tap_blocks(g.taps, CorrelateOp<acc_t, false>{g, acc + ci * g.taps, planes + ci * g.plane_size, grad_output});
    }
  }
}

ATEN_OVERRIDE_CLONES void scatter_plane_f(const Geometry& g, float* p, const float* go, const float* w) {
  scatter_plane(g, p, go, w);
}
ATEN_OVERRIDE_CLONES void scatter_plane_d(const Geometry& g, double* p, const double* go, const double* w) {
  scatter_plane(g, p, go, w);
}
ATEN_OVERRIDE_CLONES void correlate_plane_f(const Geometry& g, float* a, const float* p, const float* go) {
  correlate_plane(g, a, p, go);
}
ATEN_OVERRIDE_CLONES void correlate_plane_d(const Geometry& g, double* a, const double* p, const double* go) {
  correlate_plane(g, a, p, go);
}
inline void scatter(const Geometry& g, float* p, const float* go, const float* w) { scatter_plane_f(g, p, go, w); }
inline void scatter(const Geometry& g, double* p, const double* go, const double* w) { scatter_plane_d(g, p, go, w); }
inline void correlate(const Geometry& g, float* a, const float* p, const float* go) { correlate_plane_f(g, a, p, go); }
inline void correlate(const Geometry& g, double* a, const double* p, const double* go) { correlate_plane_d(g, a, p, go); }

struct Layout {
  Geometry geometry;
  std::vector<int64_t> tap_offset, class_taps, class_begin;
  int64_t in_plane, out_plane;
};

Layout make_layout(const DirectProblem& p) {
  Layout l;
  Geometry& g = l.geometry;
  const int64_t rows_t = p.in[0] + 2 * p.padding[0];
  g.rows_h = p.in[1] + 2 * p.padding[1];
  const int64_t phases = p.stride[2];
  g.width = (p.in[2] + 2 * p.padding[2] + phases - 1) / phases;
  g.row_size = phases * g.width;
  g.plane_size = rows_t * g.rows_h * g.row_size;
  g.out_t = p.out[0];
  g.out_h = p.out[1];
  g.out_w = p.out[2];
  g.stride_t = p.stride[0];
  g.stride_h = p.stride[1];
  g.stride_w = p.stride[2];
  g.taps = p.kernel[0] * p.kernel[1] * p.kernel[2];
  g.in_per_group = p.in_per_group;
  for (int64_t kt = 0; kt < p.kernel[0]; ++kt) {
    for (int64_t kh = 0; kh < p.kernel[1]; ++kh) {
      for (int64_t kw = 0; kw < p.kernel[2]; ++kw) {
        const int64_t col = kw * p.dilation[2];
        l.tap_offset.push_back(
            (kt * p.dilation[0] * g.rows_h + kh * p.dilation[1]) * g.row_size + (col % phases) * g.width +
            col / phases);
      }
    }
  }
  g.tap_offset = l.tap_offset.data();
  const int64_t classes = p.stride[0] * p.stride[1] * p.stride[2];
  std::vector<std::vector<int64_t>> by_class(classes);
  int64_t tap = 0;
  for (int64_t kt = 0; kt < p.kernel[0]; ++kt) {
    for (int64_t kh = 0; kh < p.kernel[1]; ++kh) {
      for (int64_t kw = 0; kw < p.kernel[2]; ++kw, ++tap) {
        const int64_t cls = ((kt * p.dilation[0] % p.stride[0]) * p.stride[1] + kh * p.dilation[1] % p.stride[1]) *
                p.stride[2] + kw * p.dilation[2] % p.stride[2];
        by_class[cls].push_back(tap);
      }
    }
  }
  l.class_begin.push_back(0);
  for (const auto& taps : by_class) {
    l.class_taps.insert(l.class_taps.end(), taps.begin(), taps.end());
    l.class_begin.push_back(static_cast<int64_t>(l.class_taps.size()));
  }
  g.class_taps = l.class_taps.data();
  g.class_begin = l.class_begin.data();
  l.in_plane = p.in[0] * p.in[1] * p.in[2];
  l.out_plane = p.out[0] * p.out[1] * p.out[2];
  return l;
}

// Walks the input columns w = 0, 1, ...: padded column j = w + padding lives at phase j % stride,
// position j / stride (without a division per element).
struct PackedColumn {
  const Geometry& g;
  int64_t phase, position;
  PackedColumn(const DirectProblem& p, const Geometry& geometry)
      : g(geometry), phase(p.padding[2] % p.stride[2]), position(p.padding[2] / p.stride[2]) {}
  int64_t index() const { return phase * g.width + position; }
  void next() {
    if (++phase == g.stride_w) {
      phase = 0;
      ++position;
    }
  }
};

template <typename scalar_t, typename acc_t>
void pack_plane(const DirectProblem& p, const Geometry& g, const scalar_t* src, acc_t* dst) {
  std::fill(dst, dst + g.plane_size, acc_t(0));
  for (int64_t t = 0; t < p.in[0]; ++t) {
    for (int64_t h = 0; h < p.in[1]; ++h) {
      const scalar_t* row = src + (t * p.in[1] + h) * p.in[2];
      acc_t* out = dst + ((t + p.padding[0]) * g.rows_h + h + p.padding[1]) * g.row_size;
      if (p.stride[2] == 1) {
        std::copy(row, row + p.in[2], out + p.padding[2]);  // converts scalar_t -> acc_t
      } else {
        PackedColumn column(p, g);
        for (int64_t w = 0; w < p.in[2]; ++w, column.next()) {
          out[column.index()] = static_cast<acc_t>(row[w]);
        }
      }
    }
  }
}

template <typename scalar_t, typename acc_t>
void unpack_plane(const DirectProblem& p, const Geometry& g, const acc_t* src, scalar_t* dst) {
  for (int64_t t = 0; t < p.in[0]; ++t) {
    for (int64_t h = 0; h < p.in[1]; ++h) {
      const acc_t* row = src + ((t + p.padding[0]) * g.rows_h + h + p.padding[1]) * g.row_size;
      scalar_t* out = dst + (t * p.in[1] + h) * p.in[2];
      if (p.stride[2] == 1) {
        std::copy(row + p.padding[2], row + p.padding[2] + p.in[2], out);
      } else {
        PackedColumn column(p, g);
        for (int64_t w = 0; w < p.in[2]; ++w, column.next()) {
          out[w] = static_cast<scalar_t>(row[column.index()]);
        }
      }
    }
  }
}

// grad_output plane as acc_t: the tensor's own memory when the types agree, else a converted copy.
template <typename scalar_t, typename acc_t>
const acc_t* as_acc(const scalar_t* src, int64_t n, std::vector<acc_t>& buffer) {
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    return src;
  } else {
    buffer.resize(n);
    std::copy(src, src + n, buffer.begin());
    return buffer.data();
  }
}

// Writes grad_output's rows at their plane positions (see gather_taps); the rest of `spread` stays zero.
template <typename scalar_t, typename acc_t>
void spread_plane(const Geometry& g, const scalar_t* grad_output, acc_t* spread) {
  for (int64_t t = 0; t < g.out_t; ++t) {
    for (int64_t h = 0; h < g.out_h; ++h) {
      const scalar_t* row = grad_output + (t * g.out_h + h) * g.out_w;
      std::copy(row, row + g.out_w, spread + (t * g.stride_t * g.rows_h + h * g.stride_h) * g.row_size);
    }
  }
}

template <typename scalar_t>
using acc_type = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

template <typename scalar_t>
void grad_input_impl(const DirectProblem& p, const scalar_t* go, const scalar_t* w, scalar_t* gi) {
  using acc_t = acc_type<scalar_t>;
  const Layout l = make_layout(p);
  const Geometry& g = l.geometry;
  const int64_t c_in = p.groups * p.in_per_group, c_out = p.groups * p.out_per_group;
  const int64_t margin = *std::max_element(l.tap_offset.begin(), l.tap_offset.end());
  at::parallel_for(0, p.batch * c_in, 1, [&](int64_t begin, int64_t end) {
    // spread: margin zeros, then grad_output rows at their plane positions (zeros between them).
    std::vector<acc_t> plane(g.plane_size), spread(margin + g.plane_size, acc_t(0)), w_buffer(g.taps);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / c_in, c = task % c_in;
      const int64_t group = c / p.in_per_group, ci = c % p.in_per_group;
      std::fill(plane.begin(), plane.end(), acc_t(0));
      for (int64_t co = group * p.out_per_group; co < (group + 1) * p.out_per_group; ++co) {
        spread_plane(g, go + (n * c_out + co) * l.out_plane, spread.data() + margin);
        const scalar_t* wk = w + (co * p.in_per_group + ci) * g.taps;
        std::copy(wk, wk + g.taps, w_buffer.begin());
        scatter(g, plane.data(), spread.data() + margin, w_buffer.data());
      }
      unpack_plane(p, g, plane.data(), gi + task * l.in_plane);
    }
  });
}

template <typename scalar_t>
void grad_weight_impl(const DirectProblem& p, const scalar_t* go, const scalar_t* x, scalar_t* gw) {
  using acc_t = acc_type<scalar_t>;
  const Layout l = make_layout(p);
  const Geometry& g = l.geometry;
  const int64_t c_in = p.groups * p.in_per_group, c_out = p.groups * p.out_per_group;
  const int64_t per_channel = p.in_per_group * g.taps;
  at::parallel_for(0, c_out, 1, [&](int64_t begin, int64_t end) {
    const bool flat = g.stride_t * g.stride_h * g.stride_w == 1;
    std::vector<acc_t> planes(p.in_per_group * g.plane_size), go_buffer, acc((end - begin) * per_channel, acc_t(0));
    std::vector<acc_t> spread(flat ? g.plane_size : 0, acc_t(0));
    const int64_t first_group = begin / p.out_per_group, last_group = (end - 1) / p.out_per_group;
    for (int64_t n = 0; n < p.batch; ++n) {
      for (int64_t group = first_group; group <= last_group; ++group) {
        for (int64_t ci = 0; ci < p.in_per_group; ++ci) {
          const int64_t c = group * p.in_per_group + ci;
          pack_plane(p, g, x + (n * c_in + c) * l.in_plane, planes.data() + ci * g.plane_size);
        }
        const int64_t co_end = std::min(end, (group + 1) * p.out_per_group);
        for (int64_t co = std::max(begin, group * p.out_per_group); co < co_end; ++co) {
          const acc_t* go_plane;
          if (flat) {
            spread_plane(g, go + (n * c_out + co) * l.out_plane, spread.data());
            go_plane = spread.data();
          } else {
            go_plane = as_acc<scalar_t, acc_t>(go + (n * c_out + co) * l.out_plane, l.out_plane, go_buffer);
          }
          correlate(g, acc.data() + (co - begin) * per_channel, planes.data(), go_plane);
        }
      }
    }
    std::transform(acc.begin(), acc.end(), gw + begin * per_channel, [](acc_t v) { return static_cast<scalar_t>(v); });
  });
}

}  // namespace

void direct_grad_input_cpu(
    const DirectProblem& p, const at::Tensor& grad_output, const at::Tensor& weight, at::Tensor& grad_input) {
  TORCH_INTERNAL_ASSERT(grad_output.is_contiguous() && weight.is_contiguous() && grad_input.is_contiguous());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, grad_input.scalar_type(), "direct_grad_input_cpu", [&] {
    grad_input_impl<scalar_t>(
        p, grad_output.const_data_ptr<scalar_t>(), weight.const_data_ptr<scalar_t>(), grad_input.data_ptr<scalar_t>());
  });
}

void direct_grad_weight_cpu(
    const DirectProblem& p, const at::Tensor& grad_output, const at::Tensor& input, at::Tensor& grad_weight) {
  TORCH_INTERNAL_ASSERT(grad_output.is_contiguous() && input.is_contiguous() && grad_weight.is_contiguous());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, grad_weight.scalar_type(), "direct_grad_weight_cpu", [&] {
    grad_weight_impl<scalar_t>(
        p, grad_output.const_data_ptr<scalar_t>(), input.const_data_ptr<scalar_t>(), grad_weight.data_ptr<scalar_t>());
  });
}

}  // namespace aten_override
