// The fused depthwise kernel of the compiled backend: grad_input, grad_weight and grad_bias of a
// depthwise convolution (groups == C_in, any channel multiplier C_out / C_in), 1-D/2-D/3-D, any
// stride, padding and dilation (not transposed), in one pass over grad_output and input.
//
// Each (sample, input channel) plane is handled while it is in L1/L2: its input plane is copied (as
// acc_t) into the interior of a zero-padded buffer `xp`, and each of its grad_output planes is spread
// into `gs`, a buffer with the same row pitch where grad_output[o] sits at the padded position of
// tap 0 (o * stride; zeros elsewhere). Then with off[k] = the padded-plane offset of kernel tap k:
//   grad_weight[k] += sum_j gs[j] * xp[j + off[k]]          (correlation)
//   grad_input_padded[j] = sum_k weight[k] * gs[j - off[k]]  (gather: each element written once)
//   grad_bias += sum_j gs[j]
// All are unit-stride loops over j. With every stride 1 they run over the whole plane as one flat
// 1-D range, however short its rows (MobileNetV2's 7x7 planes); with strides they run row by row,
// skipping the grad_output rows that are all zeros (H/D) and the taps that only meet such rows.
// The padded borders of `xp` and the gaps of `gs` are zeroed once per thread, never per plane.
// grad_weight / grad_bias sums are kept per vector lane for one sample, then added into a double
// total per element (sample by sample, in a fixed order).
//
// Tasks are blocks of channels (whole batch) when grad_weight or grad_bias is wanted, else (sample,
// block of channels); threads take chunks of tasks as they finish (for_each_chunk). Every output
// element is computed by one task in a fixed order: no atomics on results, and every result is
// independent of the thread count (deterministic). float16 / bfloat16 convert into the acc_t
// (float32) buffers while packing, so there is no separate conversion pass. Large grad_input outputs
// are written with non-temporal stores where this machine measured that faster (streaming_stores(),
// below); the caller allocates them on huge pages (on_huge_pages, convolution_backward.cpp).
//
// Small or strided planes take a second kernel with the same contract and task split (below,
// "channels in vector lanes"): a block of L channels is transposed into [position][channel] tiles, so
// each vector holds one position of L channels and no per-plane set-up or lane reduction remains.
// On large planes, whose whole-plane tiles exceed the L2 cache, that kernel walks the plane in bands
// of rows whose tiles fit a share of the L2 read from the machine (below, "bands of rows"). With
// every stride 1 and kernel rows of at most 8 taps one position apart, both walk consecutive positions
// with a kernel row's taps in registers (below, "kernel rows in registers"): ConvNeXt's 7x7 and
// EfficientNet's 5x5 layers run at 0.52-0.74x the tap-block walk's time (one thread). The plane walk
// slides kernel rows of 2 or 3 taps in registers likewise (below, "the plane walk's kernel rows").
#include "fused.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace aten_override {
namespace fused {

namespace {
ATEN_OVERRIDE_CLONES void add_to_f(const float* partial, double* total, int64_t n) {
  for (int64_t i = 0; i < n; ++i) total[i] += static_cast<double>(partial[i]);
}
ATEN_OVERRIDE_CLONES void add_to_d(const double* partial, double* total, int64_t n) {
  for (int64_t i = 0; i < n; ++i) total[i] += partial[i];
}
}  // namespace
void add_to(const float* partial, double* total, int64_t n) { add_to_f(partial, total, n); }
void add_to(const double* partial, double* total, int64_t n) { add_to_d(partial, total, n); }

}  // namespace fused

namespace {
using namespace fused;

// acc[k] += sum_{j in [j0, j1)} gs[j] * xp[j + offset[k]] for NT taps, lane by lane: acc holds one
// vector per tap (reduced across lanes once, at the end). j1 - j0 is a multiple of the lanes.
template <int NT, typename V, typename acc_t>
ATEN_OVERRIDE_INLINE void correlate_block(
    acc_t* acc, const acc_t* gs, const acc_t* xp, const int64_t* offset, int64_t j0, int64_t j1) {
  typename V::type sums[NT];
  const acc_t* src[NT];
  for (int k = 0; k < NT; ++k) {
    sums[k] = V::load(acc + k * V::size);
    src[k] = xp + offset[k];
  }
  for (int64_t j = j0; j < j1; j += V::size) {
    const auto go = V::load(gs + j);
    for (int k = 0; k < NT; ++k) sums[k] += go * V::load(src[k] + j);
  }
  for (int k = 0; k < NT; ++k) V::store(acc + k * V::size, sums[k]);
}

// out[j] (= or +=) sum over NT taps of weight[tap] * gs[j - offset[tap]], j in [j0, j1) (a multiple
// of the lanes). Four vectors at a time: four independent FMA chains.
template <int NT, typename V, typename acc_t>
ATEN_OVERRIDE_INLINE void gather_block(
    acc_t* out, const acc_t* gs, const acc_t* weight, const int64_t* offset, const int64_t* taps, bool accumulate,
    int64_t j0, int64_t j1) {
  constexpr int64_t L = V::size;
  acc_t wk[NT];
  const acc_t* src[NT];
  for (int k = 0; k < NT; ++k) {
    wk[k] = weight[taps[k]];
    src[k] = gs - offset[taps[k]];
  }
  int64_t j = j0;
  for (; j + 4 * L <= j1; j += 4 * L) {
    typename V::type s0 = {}, s1 = {}, s2 = {}, s3 = {};
    if (accumulate) {
      s0 = V::load(out + j), s1 = V::load(out + j + L), s2 = V::load(out + j + 2 * L), s3 = V::load(out + j + 3 * L);
    }
    for (int k = 0; k < NT; ++k) {
      s0 += wk[k] * V::load(src[k] + j);
      s1 += wk[k] * V::load(src[k] + j + L);
      s2 += wk[k] * V::load(src[k] + j + 2 * L);
      s3 += wk[k] * V::load(src[k] + j + 3 * L);
    }
    V::store(out + j, s0), V::store(out + j + L, s1), V::store(out + j + 2 * L, s2), V::store(out + j + 3 * L, s3);
  }
  for (; j < j1; j += L) {
    typename V::type s = {};
    if (accumulate) s = V::load(out + j);
    for (int k = 0; k < NT; ++k) s += wk[k] * V::load(src[k] + j);
    V::store(out + j, s);
  }
}

template <typename V, typename acc_t>
struct CorrelateOp {
  acc_t* acc;
  const acc_t* gs;
  const acc_t* xp;
  const int64_t* offset;
  int64_t j0, j1;
  template <int NT>
  ATEN_OVERRIDE_INLINE void run(int64_t first, int64_t) const {
    correlate_block<NT, V>(acc + first * V::size, gs, xp, offset + first, j0, j1);
  }
};

template <typename V, typename acc_t>
struct GatherOp {
  acc_t* out;
  const acc_t* gs;
  const acc_t* weight;
  const int64_t* offset;
  const int64_t* taps;
  bool accumulate;
  int64_t j0, j1;
  template <int NT>
  ATEN_OVERRIDE_INLINE void run(int64_t first, int64_t index) const {
    gather_block<NT, V>(out, gs, weight, offset, taps + first, accumulate || index > 0, j0, j1);
  }
};

// Taps per kernel row if the register-blocked walks apply to g (kernel width `width`), else 0: every
// stride 1 (one row class, holding every tap in order), at most kMaxTaps taps per row, each row's taps
// one position apart.
int64_t register_row_width(const Plane& g, int64_t width) {
  if (!g.flat || width > kMaxTaps || g.taps % width != 0 || g.class_begin.size() != 2) return 0;
  for (int64_t k = 0; k < g.taps; ++k) {
    if (g.class_taps[k] != k || g.offset[k] != g.offset[k - k % width] + k % width) return 0;
  }
  return width;
}

// --- The plane walk's kernel rows in registers (every stride 1, rows of 2 or 3 taps) ---------------
// With every stride 1 the plane walk runs over the padded plane as one flat range, a vector holding
// L consecutive positions. The K taps of a kernel row are then one position apart: the vectors a
// row's taps read at position j are windows of two consecutive vectors at j + (row offset), shifted
// by 0 .. K - 1 positions (one register shuffle each), instead of K unaligned loads that mostly
// straddle two cache lines. The sums are the tap-block walk's, in the same order (bit for bit).
// Measured on MobileNetV2's 3x3 layers, NCHW, batch 16, bfloat16, one thread, Zen 4, kernel alone:
// 144 channels at 56x56 9.2 ms instead of 10.0-10.7, 192 at 28x28 3.3-3.6 instead of 3.9; the plane
// walk then takes 0.41-0.46x native's time there, the lanes walk 0.48-0.54x (their NCHW transposes).

// Widest kernel rows the plane walk slides (the windows are written out for K <= 3): the sums of a
// group of rows (R * K <= 9 vectors) and the rows' carried vectors stay in registers.
constexpr int64_t kSlideMaxWidth = 3;
// Most kernel rows the plane walk slides (their offsets sit in an array on the stack).
constexpr int64_t kSlideMaxRows = 64;

// The windows are one instruction each (vpermt2ps / vpermt2pd) only in the x86-64-v4 (AVX-512)
// target clone; GCC builds them through the stack in the x86-64-v3 and default clones (their
// disassembly: ~1,400 stack stores against 33), so there the plane walk keeps its tap blocks.
bool slide_instructions() {
#ifdef ATEN_OVERRIDE_AVX512
  static const bool yes = has_avx512() && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512cd");
  return yes;
#else
  return false;
#endif
}

// Whether the plane walk slides g's kernel rows (`width`: register_row_width's) in vectors of type V:
// only Vec's (AVX-512) windows are single instructions.
template <typename V>
ATEN_OVERRIDE_INLINE bool slides(const Plane& g, int64_t width) {
  return std::is_same_v<V, Vec<typename V::value_type>> && width >= 2 && width <= kSlideMaxWidth &&
      g.taps / width <= kSlideMaxRows;
}

// concat(a, b)[S .. S + L): a shifted down by S positions, b's first S positions after it.
template <int S, typename V, int... I>
ATEN_OVERRIDE_INLINE typename V::type window_of(typename V::type a, typename V::type b, std::integer_sequence<int, I...>) {
  if constexpr (S == 0) {
    return a;
  } else {
#if defined(__clang__)
    return __builtin_shufflevector(a, b, (S + I)...);
#else
    using index_t = std::conditional_t<sizeof(typename V::type) / V::size == 4, int32_t, int64_t>;
    typedef index_t mask_t __attribute__((vector_size(64)));
    return __builtin_shuffle(a, b, mask_t{static_cast<index_t>(S + I)...});
#endif
  }
}
template <int S, typename V>
ATEN_OVERRIDE_INLINE typename V::type window(typename V::type a, typename V::type b) {
  return window_of<S, V>(a, b, std::make_integer_sequence<int, static_cast<int>(V::size)>{});
}

// acc[r * K + k] += sum_{j in [0, J)} gs[j] * xp[j + row_offset[r] + k], r < R, k < K (one vector per
// tap, lane by lane, as correlate_block): each row's input vector at j + L is loaded once and carried.
template <int K, int R, typename acc_t>
ATEN_OVERRIDE_INLINE void slide_correlate_rows(
    acc_t* acc, const acc_t* gs, const acc_t* xp, const int64_t* row_offset, int64_t J) {
  using V = Vec<acc_t>;
  constexpr int64_t L = V::size;
  typename V::type sums[R][K], carried[R];
  ATEN_OVERRIDE_UNROLL
  for (int r = 0; r < R; ++r) {
    ATEN_OVERRIDE_UNROLL
    for (int k = 0; k < K; ++k) sums[r][k] = V::load(acc + (r * K + k) * L);
    carried[r] = V::load(xp + row_offset[r]);
  }
  for (int64_t j = 0; j < J; j += L) {
    const auto go = V::load(gs + j);
    ATEN_OVERRIDE_UNROLL
    for (int r = 0; r < R; ++r) {
      const auto next = V::load(xp + row_offset[r] + j + L);
      sums[r][0] += go * carried[r];
      if constexpr (K > 1) sums[r][1] += go * window<1, V>(carried[r], next);
      if constexpr (K > 2) sums[r][2] += go * window<2, V>(carried[r], next);
      carried[r] = next;
    }
  }
  ATEN_OVERRIDE_UNROLL
  for (int r = 0; r < R; ++r) {
    ATEN_OVERRIDE_UNROLL
    for (int k = 0; k < K; ++k) V::store(acc + (r * K + k) * L, sums[r][k]);
  }
}

// out[j] (= or +=) sum over r < R, k < K of weight[r * K + k] * gs[j - row_offset[r] - k], j in
// [j0, j1) (a multiple of the lanes), four vectors at a time (four FMA chains): a row's five vectors
// at j - row_offset[r] - L .. + 3L serve its K taps of the four.
template <int K, int R, typename acc_t>
ATEN_OVERRIDE_INLINE void slide_gather_rows(
    acc_t* out, const acc_t* gs, const acc_t* weight, const int64_t* row_offset, bool accumulate, int64_t j0,
    int64_t j1) {
  using V = Vec<acc_t>;
  constexpr int64_t L = V::size;
  constexpr int U = 4;
  int64_t j = j0;
  const auto step = [&](auto units) ATEN_OVERRIDE_ALWAYS_INLINE {
    constexpr int N = decltype(units)::value;
    typename V::type s[N];
    ATEN_OVERRIDE_UNROLL
    for (int u = 0; u < N; ++u) s[u] = accumulate ? V::load(out + j + u * L) : typename V::type{};
    ATEN_OVERRIDE_UNROLL
    for (int r = 0; r < R; ++r) {
      const acc_t* src = gs + j - row_offset[r];
      typename V::type v[N + 1];
      ATEN_OVERRIDE_UNROLL
      for (int u = 0; u <= N; ++u) v[u] = V::load(src + (u - 1) * L);
      ATEN_OVERRIDE_UNROLL
      for (int u = 0; u < N; ++u) {
        s[u] += weight[r * K] * v[u + 1];
        if constexpr (K > 1) s[u] += weight[r * K + 1] * window<L - 1, V>(v[u], v[u + 1]);
        if constexpr (K > 2) s[u] += weight[r * K + 2] * window<L - 2, V>(v[u], v[u + 1]);
      }
    }
    ATEN_OVERRIDE_UNROLL
    for (int u = 0; u < N; ++u) V::store(out + j + u * L, s[u]);
  };
  for (; j + U * L <= j1; j += U * L) step(std::integral_constant<int, U>{});
  for (; j < j1; j += L) step(std::integral_constant<int, 1>{});
}

// The kernel rows of a plane with row width K in groups of at most 9 / K rows: f(group's first row,
// std::integral_constant<int, R>{}). f is a lambda marked ATEN_OVERRIDE_ALWAYS_INLINE.
template <int K, typename F>
ATEN_OVERRIDE_INLINE void for_row_groups(int64_t rows, F&& f) {
  constexpr int64_t kMaxRows = 9 / K;
  for (int64_t r = 0; r < rows; r += kMaxRows) {
    switch (std::min(kMaxRows, rows - r)) {
      case 1: f(r, std::integral_constant<int, 1>{}); break;
      case 2: f(r, std::integral_constant<int, 2>{}); break;
      case 3: f(r, std::integral_constant<int, 3>{}); break;
      case 4:
        if constexpr (kMaxRows >= 4) f(r, std::integral_constant<int, 4>{});
        break;
    }
  }
}

// The kernel rows of g (row width `width`, where `slides`) in groups: f(std::integral_constant<int, K>,
// std::integral_constant<int, R>, the group's first row r, the g.offset of the first tap of rows r ..
// r + R - 1). f is a lambda marked ATEN_OVERRIDE_ALWAYS_INLINE.
template <typename F>
ATEN_OVERRIDE_INLINE void for_slid_row_groups(const Plane& g, int64_t width, F&& f) {
  int64_t offsets[kSlideMaxRows];
  for (int64_t r = 0; r < g.taps / width; ++r) offsets[r] = g.offset[r * width];
  const auto groups = [&](auto k) ATEN_OVERRIDE_ALWAYS_INLINE {
    for_row_groups<decltype(k)::value>(g.taps / width, [&](int64_t r, auto rows) ATEN_OVERRIDE_ALWAYS_INLINE {
      f(k, rows, r, offsets + r);
    });
  };
  if (width == 2) groups(std::integral_constant<int, 2>{});
  else groups(std::integral_constant<int, 3>{});
}

// acc[k] (one vector per tap) += grad_weight contribution of one grad_output plane (`gs`, from its
// margin) and input plane `xp`.
// `width`: register_row_width's for g (the plane walk slides kernel rows where `slides`).
template <typename V, typename acc_t>
ATEN_OVERRIDE_INLINE void correlate_plane(const Plane& g, int64_t width, acc_t* acc, const acc_t* gs, const acc_t* xp) {
  if (g.flat) {
    // gs is zero from span on (slack), so the range may be rounded up.
    const int64_t J = round_up<acc_t>(g.span());
    if constexpr (std::is_same_v<V, Vec<acc_t>>) {
      if (slides<V>(g, width)) {
        for_slid_row_groups(g, width, [&](auto k, auto rows, int64_t r, const int64_t* offsets) ATEN_OVERRIDE_ALWAYS_INLINE {
          constexpr int K = decltype(k)::value;
          slide_correlate_rows<K, decltype(rows)::value>(acc + r * K * V::size, gs, xp, offsets, J);
        });
        return;
      }
    }
    for_tap_blocks(g.taps, CorrelateOp<V, acc_t>{acc, gs, xp, g.offset.data(), 0, J});
    return;
  }
  // A row's positions past its last grad_output element are zeros of the same row (pitch rounded up).
  const int64_t row = round_up<acc_t>((g.out_w - 1) * g.stride_w + 1);
  for (int64_t t = 0; t < g.out_t; ++t) {
    for (int64_t h = 0; h < g.out_h; ++h) {
      const int64_t j0 = g.out_row(t, h);
      for_tap_blocks(g.taps, CorrelateOp<V, acc_t>{acc, gs, xp, g.offset.data(), j0, j0 + row});
    }
  }
}

// out (= or += when accumulate) the grad_input contribution of one grad_output plane, over the
// padded plane's interior [first, last) (rounded up; other positions get values nobody reads).
template <typename V, typename acc_t>
ATEN_OVERRIDE_INLINE void gather_plane(
    const Plane& g, int64_t width, acc_t* out, const acc_t* gs, const acc_t* weight, bool accumulate) {
  if (g.flat) {
    const int64_t j0 = g.first(), j1 = j0 + round_up<acc_t>(g.last() - j0);
    if constexpr (std::is_same_v<V, Vec<acc_t>>) {
      if (slides<V>(g, width)) {
        for_slid_row_groups(g, width, [&](auto k, auto rows, int64_t r, const int64_t* offsets) ATEN_OVERRIDE_ALWAYS_INLINE {
          constexpr int K = decltype(k)::value;
          slide_gather_rows<K, decltype(rows)::value>(out, gs, weight + r * K, offsets, accumulate || r > 0, j0, j1);
        });
        return;
      }
    }
    for_tap_blocks(g.taps, GatherOp<V, acc_t>{out, gs, weight, g.offset.data(), g.class_taps.data(), accumulate, j0, j1});
    return;
  }
  // Whole rows (the pitch is a multiple of the lanes): a row never runs into the next one.
  for (int64_t t = g.pad_t; t < g.pad_t + g.in_t; ++t) {
    for (int64_t h = g.pad_h; h < g.pad_h + g.in_h; ++h) {
      const int64_t cls = (t % g.stride_t) * g.stride_h + h % g.stride_h;
      const int64_t begin = g.class_begin[cls], count = g.class_begin[cls + 1] - begin;
      const int64_t j0 = g.row(t, h);
      if (count == 0) {
        if (!accumulate) std::fill(out + j0, out + j0 + g.pitch, acc_t(0));
        continue;
      }
      for_tap_blocks(
          count, GatherOp<V, acc_t>{out, gs, weight, g.offset.data(), g.class_taps.data() + begin, accumulate, j0,
                                 j0 + g.pitch});
    }
  }
}

// acc (one vector) += the sum of one grad_output plane (`gs`, from its margin): grad_bias.
template <typename V, typename acc_t>
ATEN_OVERRIDE_INLINE void sum_plane(const Plane& g, acc_t* acc, const acc_t* gs) {
  auto sum = V::load(acc);
  const int64_t width = g.flat ? round_up<acc_t>(g.span()) : round_up<acc_t>((g.out_w - 1) * g.stride_w + 1);
  for (int64_t t = 0; t < (g.flat ? 1 : g.out_t); ++t) {
    for (int64_t h = 0; h < (g.flat ? 1 : g.out_h); ++h) {
      const acc_t* row = gs + g.out_row(t, h);
      for (int64_t j = 0; j < width; j += V::size) sum += V::load(row + j);
    }
  }
  V::store(acc, sum);
}

// The vector code, compiled for each ISA level, in the vector type wide_vectors() gives (`wide`, read
// once per kernel call).
ATEN_OVERRIDE_CLONES void sum_f(const Plane& g, bool wide, float* a, const float* gs) {
  if (wide) return sum_plane<Vec<float>>(g, a, gs);
  sum_plane<VecPair<float>>(g, a, gs);
}
ATEN_OVERRIDE_CLONES void sum_d(const Plane& g, bool wide, double* a, const double* gs) {
  if (wide) return sum_plane<Vec<double>>(g, a, gs);
  sum_plane<VecPair<double>>(g, a, gs);
}
inline void sum(const Plane& g, bool wide, float* a, const float* gs) { sum_f(g, wide, a, gs); }
inline void sum(const Plane& g, bool wide, double* a, const double* gs) { sum_d(g, wide, a, gs); }

ATEN_OVERRIDE_CLONES void correlate_f(
    const Plane& g, int64_t width, bool wide, float* a, const float* gs, const float* xp) {
  if (wide) return correlate_plane<Vec<float>>(g, width, a, gs, xp);
  correlate_plane<VecPair<float>>(g, width, a, gs, xp);
}
ATEN_OVERRIDE_CLONES void correlate_d(
    const Plane& g, int64_t width, bool wide, double* a, const double* gs, const double* xp) {
  if (wide) return correlate_plane<Vec<double>>(g, width, a, gs, xp);
  correlate_plane<VecPair<double>>(g, width, a, gs, xp);
}
ATEN_OVERRIDE_CLONES void gather_f(
    const Plane& g, int64_t width, bool wide, float* o, const float* gs, const float* w, bool accumulate) {
  if (wide) return gather_plane<Vec<float>>(g, width, o, gs, w, accumulate);
  gather_plane<VecPair<float>>(g, width, o, gs, w, accumulate);
}
ATEN_OVERRIDE_CLONES void gather_d(
    const Plane& g, int64_t width, bool wide, double* o, const double* gs, const double* w, bool accumulate) {
  if (wide) return gather_plane<Vec<double>>(g, width, o, gs, w, accumulate);
  gather_plane<VecPair<double>>(g, width, o, gs, w, accumulate);
}
inline void correlate(const Plane& g, int64_t width, bool wide, float* a, const float* gs, const float* xp) {
  correlate_f(g, width, wide, a, gs, xp);
}
inline void correlate(const Plane& g, int64_t width, bool wide, double* a, const double* gs, const double* xp) {
  correlate_d(g, width, wide, a, gs, xp);
}
inline void gather(const Plane& g, int64_t width, bool wide, float* o, const float* gs, const float* w, bool acc) {
  gather_f(g, width, wide, o, gs, w, acc);
}
inline void gather(const Plane& g, int64_t width, bool wide, double* o, const double* gs, const double* w, bool acc) {
  gather_d(g, width, wide, o, gs, w, acc);
}

// Input plane into the interior of xp (its borders stay zero).
template <typename scalar_t, typename acc_t>
void pack_input(const Plane& g, const scalar_t* x, acc_t* xp) {
  for (int64_t t = 0; t < g.in_t; ++t) {
    move_rows(x + t * g.in_h * g.in_w, g.in_w, xp + g.in_row(t, 0), g.pitch, 1, g.in_h, g.in_w);
  }
}

// grad_output plane into gs at its tap-0 positions (the gaps stay zero).
template <typename scalar_t, typename acc_t>
void spread_grad_output(const Plane& g, const scalar_t* go, acc_t* gs) {
  for (int64_t t = 0; t < g.out_t; ++t) {
    move_rows(
        go + t * g.out_h * g.out_w, g.out_w, gs + g.out_row(t, 0), g.stride_h * g.pitch, g.stride_w, g.out_h, g.out_w);
  }
}

// The interior of the padded grad_input plane into grad_input.
template <typename scalar_t, typename acc_t>
void unpack_grad_input(const Plane& g, const acc_t* gp, scalar_t* gi) {
  for (int64_t t = 0; t < g.in_t; ++t) {
    move_rows(gp + g.in_row(t, 0), g.pitch, gi + t * g.in_h * g.in_w, g.in_w, 1, g.in_h, g.in_w);
  }
}

// Each of gi / gw / gb is null when not wanted (then w / x may be null too).
template <typename scalar_t>
void depthwise_impl(
    const DirectProblem& p, const scalar_t* go, const scalar_t* x, const scalar_t* w, scalar_t* gi, scalar_t* gw,
    scalar_t* gb) {
  using acc_t = acc_type<scalar_t>;
  constexpr int64_t L = Vec<acc_t>::size;
  const Plane g = make_plane(p, L);
  // Kernel rows slid in registers (2 or 3 taps), where the CPU runs the AVX-512 clone.
  const int64_t width = slide_instructions() ? register_row_width(g, p.kernel[2]) : 0;
  const bool wide = wide_vectors();
  const int64_t channels = p.groups, multiplier = p.out_per_group;
  const int64_t in_plane = p.in[0] * p.in[1] * p.in[2], out_plane = p.out[0] * p.out[1] * p.out[2];
  const int64_t per_channel = multiplier * g.taps;  // grad_weight / weight elements of one input channel
  // Tasks: blocks of input channels, each summing its grad_weight / grad_bias over the whole batch
  // (sample by sample, so the sums do not depend on the blocks), or without those (sample, block of
  // channels). A block spans enough channels that each sample's planes of the block are kBlockBytes of
  // contiguous memory (small planes would otherwise be read at a large stride, one DRAM latency each).
  const bool by_channel = gw || gb;
  const int64_t plane_bytes = (in_plane + multiplier * out_plane) * static_cast<int64_t>(sizeof(scalar_t));
  const int64_t block =
      std::max<int64_t>(1, std::min<int64_t>(kBlockBytes / plane_bytes, channels / (8 * at::get_num_threads())));
  const int64_t blocks = (channels + block - 1) / block;
  const int64_t tasks = by_channel ? blocks : p.batch * blocks;
  const int64_t gi_bytes = gi ? p.batch * channels * in_plane * static_cast<int64_t>(sizeof(scalar_t)) : 0;
#ifdef ATEN_OVERRIDE_AVX512
  // Only outputs far larger than the caches are worth streaming past them, where streaming measured faster.
  const bool stream = gi_bytes >= kStreamBytes && streaming_stores().streaming;
#else
  const bool stream = false;
#endif
  for_each_chunk(tasks, p.batch * channels * (in_plane + multiplier * out_plane), [&](auto&& next_chunk) {
    std::vector<acc_t> xp(gw ? g.size + g.slack : 0, acc_t(0));
    // One vector before the margin: the sliding gather reads a whole vector before the taps' first.
    std::vector<acc_t> gs(L + g.margin + g.size + g.slack, acc_t(0));
    std::vector<acc_t> gp(gi ? g.size + g.slack : 0);
    // grad_input of one sample's block of channels (contiguous in grad_input), when streamed.
    std::vector<scalar_t> staging(stream ? block * in_plane : 0);
    // One vector of partial sums per grad_weight / grad_bias element of the block, for one sample;
    // each sample's lanes are then added, in a fixed order, into a double total per element (a
    // float32 running sum over the whole batch would lose digits that native's cascade sum keeps).
    std::vector<acc_t> acc(gw ? block * per_channel * L : 0), bias(gb ? block * multiplier * L : 0);
    std::vector<double> acc_total(gw ? block * per_channel : 0), bias_total(gb ? block * multiplier : 0);
    acc_t* spread = gs.data() + L + g.margin;
    std::vector<acc_t> weight(gi ? channels * per_channel : 0);
    if (gi) std::copy(w, w + channels * per_channel, weight.begin());
    for (auto [begin, end] = next_chunk(); begin < end; std::tie(begin, end) = next_chunk()) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t c_begin = (task % blocks) * block, c_end = std::min(channels, c_begin + block);
        const int64_t n_begin = by_channel ? 0 : task / blocks, n_end = by_channel ? p.batch : n_begin + 1;
        std::fill(acc_total.begin(), acc_total.end(), 0.0);
        std::fill(bias_total.begin(), bias_total.end(), 0.0);
        // Lanes summed in a fixed order, added to the per-element totals.
        const auto fold = [&](const std::vector<acc_t>& partial, int64_t count, std::vector<double>& total) {
          for (int64_t i = 0; i < count; ++i) {
            acc_t sum = 0;
            for (int64_t lane = 0; lane < L; ++lane) sum += partial[i * L + lane];
            total[i] += static_cast<double>(sum);
          }
        };
        for (int64_t n = n_begin; n < n_end; ++n) {
          std::fill(acc.begin(), acc.end(), acc_t(0));
          std::fill(bias.begin(), bias.end(), acc_t(0));
          for (int64_t c = c_begin; c < c_end; ++c) {
            // The next plane's grad_output and input (the next sample's block at the block's end): they
            // arrive while this one is computed (measured: MobileNetV2's 112x112 stage 15 ms instead of 17-21).
            if (n + 1 < n_end || c + 1 < c_end) {
              const int64_t next = c + 1 < c_end ? n * channels + c + 1 : (n + 1) * channels + c_begin;
              prefetch(go + next * multiplier * out_plane, multiplier * out_plane);
              if (gw) prefetch(x + next * in_plane, in_plane);
            }
            if (gw) pack_input(g, x + (n * channels + c) * in_plane, xp.data());
            for (int64_t q = 0; q < multiplier; ++q) {
              const int64_t co = c * multiplier + q;  // output channel
              spread_grad_output(g, go + (n * channels * multiplier + co) * out_plane, spread);
              if (gw) correlate(g, width, wide, acc.data() + (co - c_begin * multiplier) * g.taps * L, spread, xp.data());
              if (gb) sum(g, wide, bias.data() + (co - c_begin * multiplier) * L, spread);
              if (gi) gather(g, width, wide, gp.data(), spread, weight.data() + co * g.taps, q > 0);
            }
            if (gi) {
              unpack_grad_input(
                  g, gp.data(), stream ? staging.data() + (c - c_begin) * in_plane : gi + (n * channels + c) * in_plane);
            }
          }
#ifdef ATEN_OVERRIDE_AVX512
          if (stream) {
            copy_streaming(
                reinterpret_cast<const char*>(staging.data()), reinterpret_cast<char*>(gi + (n * channels + c_begin) * in_plane),
                (c_end - c_begin) * in_plane * static_cast<int64_t>(sizeof(scalar_t)));
          }
#endif
          if (gw) fold(acc, (c_end - c_begin) * per_channel, acc_total);
          if (gb) fold(bias, (c_end - c_begin) * multiplier, bias_total);
        }
        const auto write = [](const std::vector<double>& total, int64_t count, scalar_t* out) {
          for (int64_t i = 0; i < count; ++i) out[i] = static_cast<scalar_t>(total[i]);
        };
        if (gw) write(acc_total, (c_end - c_begin) * per_channel, gw + c_begin * per_channel);
        if (gb) write(bias_total, (c_end - c_begin) * multiplier, gb + c_begin * multiplier);
      }
    }
    if (stream) store_fence();
  });
}


// --- Small planes: channels in vector lanes -------------------------------------------------------
// On planes of a few dozen positions (MobileNetV2's 7x7 and 14x14 stages) the per-plane costs above
// (row-by-row packing, lane reductions of grad_weight, loop set-up per tap block) outweigh the
// arithmetic. There a block of L input channels (L = the vector lanes) is transposed into tiles of
// [padded position][channel]: every vector holds one position of L channels, the tap arithmetic is
// the same walk over the padded plane with one channel per lane, and grad_weight / grad_bias need no
// reduction across lanes. The transposes are 16x16 register transposes (AVX-512, float / bfloat16)
// or plain loops, on L1-resident data.

// The positions the lanes kernels walk, in one list per walk rather than row by row (7x7 planes
// have rows of 7): every grad_output position (its tap-0 position in the padded plane), and the
// interior positions grouped by stride phase in every dimension (phase_taps: the taps that reach such
// a position). With strides, the gather thus multiplies no zeros between the spread grad_output
// positions: MobileNetV2's and EfficientNet's stride-2 layers do 2.25 instead of 4.5 (3x3) and 6.25
// instead of 12.5 (5x5) FMAs per input position and channel (the Plane's row classes split only T, H).
// Kernel alone, both gradients, one thread, Zen 3, against row classes (ABBA, 6 rounds): EfficientNet's
// 5x5 stride-2 layer 0.76x the time, MobileNetV2's stride-2 layers 0.90-0.95x (batch 16; 112x112 at 8).
//
// Every stride 1 with a kernel row's taps one position apart (dilation 1 in W) and at most kMaxTaps
// of them (ConvNeXt's 7x7, MobileNetV2's / EfficientNet's 3x3 and 5x5): the walks go run by run of
// consecutive positions instead (`row_width` > 0, below: "kernel rows in registers").
struct Run {
  int64_t first, count;  // positions first .. first + count - 1
};

struct LanesWalk {
  std::vector<int64_t> outputs;
  std::vector<int64_t> inputs, input_begin;  // class c: inputs[input_begin[c] .. input_begin[c + 1])
  // phase_taps' classes (stride phase in T, H and W), not the Plane's row classes (T, H only).
  std::vector<int64_t> class_taps, class_begin;
  // The register-blocked walks: taps per kernel row (row r's taps are r * row_width + 0 .. row_width - 1,
  // one position apart), 0 where they do not apply; `outputs` and the (single class's) inputs as runs.
  int64_t row_width = 0;
  std::vector<Run> output_runs, input_runs;
};

// The maximal runs of consecutive positions of a sorted list.
std::vector<Run> runs_of(const std::vector<int64_t>& positions) {
  std::vector<Run> runs;
  for (const int64_t q : positions) {
    if (!runs.empty() && runs.back().first + runs.back().count == q) ++runs.back().count;
    else runs.push_back({q, 1});
  }
  return runs;
}

LanesWalk lanes_walk(const DirectProblem& p, const Plane& g) {
  LanesWalk walk;
  walk.row_width = register_row_width(g, p.kernel[2]);
  walk.outputs = output_positions(g);
  std::vector<std::vector<int64_t>> by_class(g.stride_t * g.stride_h * g.stride_w);
  for (int64_t t = g.pad_t; t < g.pad_t + g.in_t; ++t) {
    for (int64_t h = g.pad_h; h < g.pad_h + g.in_h; ++h) {
      for (int64_t w = g.pad_w; w < g.pad_w + g.in_w; ++w) {
        by_class[g.phase_class(t, h, w)].push_back(g.row(t, h) + w);
      }
    }
  }
  flatten(by_class, walk.inputs, walk.input_begin);
  PhaseTaps phases = phase_taps(p);
  walk.class_taps = std::move(phases.class_taps);
  walk.class_begin = std::move(phases.class_begin);
  if (walk.row_width) {
    walk.output_runs = runs_of(walk.outputs);
    walk.input_runs = runs_of(walk.inputs);
  }
  return walk;
}

// The part of the plane one call of a lanes walk covers: the positions in [lo, hi), whose vectors sit
// at (position - base) * L in the tiles (whole-plane tiles: every position, base 0).
struct Window {
  int64_t lo = 0, hi = std::numeric_limits<int64_t>::max(), base = 0;
};

// The positions of the sorted list [begin, end) that lie in win: (first, count).
ATEN_OVERRIDE_INLINE std::pair<const int64_t*, int64_t> window_positions(
    const int64_t* begin, const int64_t* end, const Window& win) {
  const int64_t* first = std::lower_bound(begin, end, win.lo);
  return {first, std::lower_bound(first, end, win.hi) - first};
}

// acc[k] += sum over the positions j in pos[0 .. count) of gs[j] * xt[j + offset[k]], NT taps (one
// vector each), kLanesChunk positions at a time; positions count L lanes each (from `base`), offsets
// are pre-scaled by L.
template <int NT, typename V, typename acc_t>
ATEN_OVERRIDE_INLINE void lanes_correlate_block(
    acc_t* acc, const acc_t* gs, const acc_t* xt, const int64_t* offset, const int64_t* pos, int64_t count,
    int64_t base) {
  constexpr int64_t L = V::size;
  for (int64_t i0 = 0; i0 < count; i0 += kLanesChunk) {
    typename V::type sums[NT];
    for (int k = 0; k < NT; ++k) sums[k] = typename V::type{};
    for (int64_t i = i0; i < std::min(count, i0 + kLanesChunk); ++i) {
      const int64_t j = (pos[i] - base) * L;
      const auto go = V::load(gs + j);
      for (int k = 0; k < NT; ++k) sums[k] += go * V::load(xt + j + offset[k]);
    }
    for (int k = 0; k < NT; ++k) V::store(acc + k * L, V::load(acc + k * L) + sums[k]);
  }
}

// out[j] (= or +=) sum over NT taps of weight[taps[k]] * gs[j - offset[taps[k]]] for the positions
// j in pos[0 .. count) (from `base`); weight holds one vector (L channels) per tap.
template <int NT, typename V, typename acc_t>
ATEN_OVERRIDE_INLINE void lanes_gather_block(
    acc_t* out, const acc_t* gs, const acc_t* weight, const int64_t* offset, const int64_t* taps, bool accumulate,
    const int64_t* pos, int64_t count, int64_t base) {
  constexpr int64_t L = V::size;
  typename V::type wk[NT];
  const acc_t* src[NT];
  for (int k = 0; k < NT; ++k) {
    wk[k] = V::load(weight + taps[k] * L);
    src[k] = gs - offset[taps[k]];
  }
  for (int64_t i = 0; i < count; ++i) {
    const int64_t j = (pos[i] - base) * L;
    typename V::type s = {};
    if (accumulate) s = V::load(out + j);
    for (int k = 0; k < NT; ++k) s += wk[k] * V::load(src[k] + j);
    V::store(out + j, s);
  }
}

// --- Kernel rows in registers (every stride 1) -----------------------------------------------------
// With every stride 1, consecutive grad_output positions meet consecutive input positions, and the K
// taps of a kernel row are one position apart. So for U consecutive positions and one kernel row, U + K
// - 1 input vectors and U grad_output vectors serve U * K FMAs (the tap-block walks above load one
// vector per FMA): grad_weight keeps the row's K sums in registers, grad_input its U outputs over
// every kernel row, and each output is written once. The sums are the tap-block walks' sums, in runs
// of at most kLanesChunk positions for grad_weight.

// Positions per register block of these walks, U: U grad_output vectors and up to 8 sums (grad_weight)
// or U sums and up to 8 weight vectors (grad_input) in registers: 8 in AVX-512's 32 registers, 4 in
// AVX2's 16 (a VecPair takes two).
template <typename V>
constexpr int kRowsBlock = 8;
template <typename acc_t>
constexpr int kRowsBlock<VecPair<acc_t>> = 4;

// sums[u % P][k] += gs[u] * xt[u + k], u < U, k < K: gs and xt at the first position, one vector per
// position. P sets of partial sums keep at least 6 FMA chains in flight when K is small.
template <int K, int U, int P, typename V, typename acc_t>
ATEN_OVERRIDE_INLINE void rows_correlate_block(typename V::type (&sums)[P][K], const acc_t* gs, const acc_t* xt) {
  constexpr int64_t L = V::size;
  typename V::type g[U];
  ATEN_OVERRIDE_UNROLL
  for (int u = 0; u < U; ++u) g[u] = V::load(gs + u * L);
  // Each input vector is loaded once and used by every (u, k) with u + k = i while it is in a register.
  ATEN_OVERRIDE_UNROLL
  for (int i = 0; i < U + K - 1; ++i) {
    const typename V::type x = V::load(xt + i * L);
    ATEN_OVERRIDE_UNROLL
    for (int k = 0; k < K; ++k) {
      if (i - k >= 0 && i - k < U) sums[(i - k) % P][k] += g[i - k] * x;
    }
  }
}

// acc[r * K + k] += sum over positions j .. j + n - 1 of gs[j] * xt[j + offset[r * K] + k], every kernel
// row r < rows; j is the first position's vector offset, n <= kLanesChunk.
template <int K, typename V, typename acc_t>
ATEN_OVERRIDE_INLINE void rows_correlate(
    acc_t* acc, const acc_t* gs, const acc_t* xt, const int64_t* offset, int64_t rows, int64_t j, int64_t n) {
  constexpr int U = kRowsBlock<V>;
  constexpr int64_t L = V::size;
  constexpr int P = K <= 3 ? 2 : 1;
  for (int64_t r = 0; r < rows; ++r) {
    typename V::type sums[P][K];
    ATEN_OVERRIDE_UNROLL
    for (int q = 0; q < P; ++q) {
      ATEN_OVERRIDE_UNROLL
      for (int k = 0; k < K; ++k) sums[q][k] = typename V::type{};
    }
    const acc_t* g = gs + j;
    const acc_t* x = xt + j + offset[r * K];
    int64_t i = 0;
    for (; i + U <= n; i += U) rows_correlate_block<K, U, P, V>(sums, g + i * L, x + i * L);
    if constexpr (U > 4) {
      for (; i + 4 <= n; i += 4) rows_correlate_block<K, 4, P, V>(sums, g + i * L, x + i * L);
    }
    for (; i < n; ++i) rows_correlate_block<K, 1, P, V>(sums, g + i * L, x + i * L);
    acc_t* a = acc + r * K * L;
    ATEN_OVERRIDE_UNROLL
    for (int k = 0; k < K; ++k) {
      typename V::type total = sums[0][k];
      ATEN_OVERRIDE_UNROLL
      for (int q = 1; q < P; ++q) total += sums[q][k];
      V::store(a + k * L, V::load(a + k * L) + total);
    }
  }
}

// out[u] (= or +=) sum over kernel rows r < rows and k < K of weight[r * K + k] * gs[u - offset[r * K] -
// k], u < U; out and gs at the first position, one vector per position and per tap.
template <int K, int U, typename V, typename acc_t>
ATEN_OVERRIDE_INLINE void rows_gather_block(
    acc_t* out, const acc_t* gs, const acc_t* weight, const int64_t* offset, int64_t rows, bool accumulate) {
  constexpr int64_t L = V::size;
  typename V::type sums[U];
  ATEN_OVERRIDE_UNROLL
  for (int u = 0; u < U; ++u) sums[u] = accumulate ? V::load(out + u * L) : typename V::type{};
  for (int64_t r = 0; r < rows; ++r) {
    // s[i]: grad_output at position u - offset - (K - 1) + i.
    const acc_t* s = gs - offset[r * K] - (K - 1) * L;
    typename V::type w[K];
    ATEN_OVERRIDE_UNROLL
    for (int k = 0; k < K; ++k) w[k] = V::load(weight + (r * K + k) * L);
    // Each grad_output vector is loaded once and used by every (u, k) with u + K - 1 - k = i.
    ATEN_OVERRIDE_UNROLL
    for (int i = 0; i < U + K - 1; ++i) {
      const typename V::type x = V::load(s + i * L);
      ATEN_OVERRIDE_UNROLL
      for (int k = 0; k < K; ++k) {
        const int u = i - (K - 1) + k;
        if (u >= 0 && u < U) sums[u] += w[k] * x;
      }
    }
  }
  ATEN_OVERRIDE_UNROLL
  for (int u = 0; u < U; ++u) V::store(out + u * L, sums[u]);
}

// The runs of `runs` that meet win, clipped to it: f(first vector offset, positions); f is a lambda
// marked ATEN_OVERRIDE_ALWAYS_INLINE (see for_row_width).
template <typename acc_t, typename F>
ATEN_OVERRIDE_INLINE void for_runs(const std::vector<Run>& runs, const Window& win, F&& f) {
  constexpr int64_t L = Vec<acc_t>::size;
  auto it = std::partition_point(runs.begin(), runs.end(), [&](const Run& r) { return r.first + r.count <= win.lo; });
  for (; it != runs.end() && it->first < win.hi; ++it) {
    const int64_t lo = std::max(it->first, win.lo), hi = std::min(it->first + it->count, win.hi);
    if (lo < hi) f((lo - win.base) * L, hi - lo);
  }
}

template <int K, typename V, typename acc_t>
ATEN_OVERRIDE_INLINE void rows_correlate_runs(
    const LanesWalk& walk, int64_t rows, const int64_t* offset, acc_t* acc, const acc_t* gs, const acc_t* xt,
    const Window& win) {
  constexpr int64_t L = Vec<acc_t>::size;
  for_runs<acc_t>(walk.output_runs, win, [&](int64_t j, int64_t n) ATEN_OVERRIDE_ALWAYS_INLINE {
    for (int64_t i = 0; i < n; i += kLanesChunk) {
      rows_correlate<K, V>(acc, gs, xt, offset, rows, j + i * L, std::min(kLanesChunk, n - i));
    }
  });
}

template <int K, typename V, typename acc_t>
ATEN_OVERRIDE_INLINE void rows_gather_runs(
    const LanesWalk& walk, int64_t rows, const int64_t* offset, acc_t* out, const acc_t* gs, const acc_t* weight,
    bool accumulate, const Window& win) {
  constexpr int64_t L = Vec<acc_t>::size;
  for_runs<acc_t>(walk.input_runs, win, [&](int64_t j, int64_t n) ATEN_OVERRIDE_ALWAYS_INLINE {
    constexpr int U = kRowsBlock<V>;
    int64_t i = 0;
    for (; i + U <= n; i += U) rows_gather_block<K, U, V>(out + j + i * L, gs + j + i * L, weight, offset, rows, accumulate);
    if constexpr (U > 4) {
      for (; i + 4 <= n; i += 4) rows_gather_block<K, 4, V>(out + j + i * L, gs + j + i * L, weight, offset, rows, accumulate);
    }
    for (; i < n; ++i) rows_gather_block<K, 1, V>(out + j + i * L, gs + j + i * L, weight, offset, rows, accumulate);
  });
}

// Kernel rows of a register-blocked walk (row width K).
inline int64_t kernel_rows(const LanesWalk& walk, int64_t width) {
  return static_cast<int64_t>(walk.class_taps.size()) / width;
}

// Narrowest kernel rows whose grad_weight takes the register-blocked walk. Measured on MobileNetV2's and
// EfficientNet's 3x3 depthwise layers (7x7 to 112x112 planes, one thread, Zen 4): 1.0-1.2x the tap-block
// walk's time, while 5x5 and 7x7 rows take 0.52-0.74x of it. grad_input takes it at every width (3x3:
// 0.7-1.0x).
constexpr int64_t kRowsMinCorrelateWidth = 4;

// f(std::integral_constant<int, K>{}) for the walk's row width K (1 .. kMaxTaps). f is a lambda marked
// ATEN_OVERRIDE_ALWAYS_INLINE, so that its body is compiled into the caller's target clone.
template <typename F>
ATEN_OVERRIDE_INLINE void for_row_width(int64_t width, F&& f) {
  switch (width) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}

template <typename V, typename acc_t>
struct LanesCorrelateOp {
  acc_t* acc;
  const acc_t* gs;
  const acc_t* xt;
  const int64_t* offset;
  const int64_t* pos;
  int64_t count, base;
  template <int NT>
  ATEN_OVERRIDE_INLINE void run(int64_t first, int64_t) const {
    lanes_correlate_block<NT, V>(acc + first * V::size, gs, xt, offset + first, pos, count, base);
  }
};

template <typename V, typename acc_t>
struct LanesGatherOp {
  acc_t* out;
  const acc_t* gs;
  const acc_t* weight;
  const int64_t* offset;
  const int64_t* taps;
  bool accumulate;
  const int64_t* pos;
  int64_t count, base;
  template <int NT>
  ATEN_OVERRIDE_INLINE void run(int64_t first, int64_t index) const {
    lanes_gather_block<NT, V>(out, gs, weight, offset, taps + first, accumulate || index > 0, pos, count, base);
  }
};

// The grad_output positions in win (gs) against the input tile xt: acc (one vector per tap, or null)
// += grad_weight, bias (one vector, or null) += grad_bias. `offset` is the Plane's, scaled by L.
template <typename V, typename acc_t>
ATEN_OVERRIDE_INLINE void lanes_correlate_plane(
    const LanesWalk& walk, int64_t taps, const int64_t* offset, acc_t* acc, acc_t* bias, const acc_t* gs,
    const acc_t* xt, const Window& win) {
  const int64_t* outputs = walk.outputs.data();
  const auto [pos, count] = window_positions(outputs, outputs + walk.outputs.size(), win);
  if (acc && walk.row_width >= kRowsMinCorrelateWidth) {
    for_row_width(walk.row_width, [&](auto width) ATEN_OVERRIDE_ALWAYS_INLINE {
      rows_correlate_runs<decltype(width)::value, V>(walk, kernel_rows(walk, width), offset, acc, gs, xt, win);
    });
  } else if (acc) {
    for_tap_blocks(taps, LanesCorrelateOp<V, acc_t>{acc, gs, xt, offset, pos, count, win.base});
  }
  for (int64_t i0 = 0; bias && i0 < count; i0 += kLanesChunk) {
    typename V::type b = {};
    for (int64_t i = i0; i < std::min(count, i0 + kLanesChunk); ++i) b += V::load(gs + (pos[i] - win.base) * V::size);
    V::store(bias, V::load(bias) + b);
  }
}

// The grad_input tile (interior positions in win) of the grad_output tile gs: out (= or +=) the gather
// over each stride phase's taps (those that meet grad_output positions, not gaps); `weight` one
// vector per tap.
template <typename V, typename acc_t>
ATEN_OVERRIDE_INLINE void lanes_gather_plane(
    const LanesWalk& walk, const int64_t* offset, acc_t* out, const acc_t* gs, const acc_t* weight, bool accumulate,
    const Window& win) {
  constexpr int64_t L = Vec<acc_t>::size;
  if (walk.row_width) {
    for_row_width(walk.row_width, [&](auto width) ATEN_OVERRIDE_ALWAYS_INLINE {
      rows_gather_runs<decltype(width)::value, V>(walk, kernel_rows(walk, width), offset, out, gs, weight, accumulate, win);
    });
    return;
  }
  const int64_t* inputs = walk.inputs.data();
  for (size_t c = 0; c + 1 < walk.class_begin.size(); ++c) {
    const int64_t begin = walk.class_begin[c], ntaps = walk.class_begin[c + 1] - begin;
    const auto [pos, count] = window_positions(inputs + walk.input_begin[c], inputs + walk.input_begin[c + 1], win);
    if (ntaps == 0) {
      for (int64_t i = 0; i < count && !accumulate; ++i) {
        std::fill(out + (pos[i] - win.base) * L, out + (pos[i] - win.base + 1) * L, acc_t(0));
      }
      continue;
    }
    for_tap_blocks(
        ntaps,
        LanesGatherOp<V, acc_t>{out, gs, weight, offset, walk.class_taps.data() + begin, accumulate, pos, count, win.base});
  }
}

ATEN_OVERRIDE_CLONES void lanes_correlate_f(
    const LanesWalk& walk, int64_t taps, const int64_t* o, float* acc, float* bias, const float* gs, const float* xt,
    const Window& win, bool wide) {
  if (wide) return lanes_correlate_plane<Vec<float>>(walk, taps, o, acc, bias, gs, xt, win);
  lanes_correlate_plane<VecPair<float>>(walk, taps, o, acc, bias, gs, xt, win);
}
ATEN_OVERRIDE_CLONES void lanes_correlate_d(
    const LanesWalk& walk, int64_t taps, const int64_t* o, double* acc, double* bias, const double* gs,
    const double* xt, const Window& win, bool wide) {
  if (wide) return lanes_correlate_plane<Vec<double>>(walk, taps, o, acc, bias, gs, xt, win);
  lanes_correlate_plane<VecPair<double>>(walk, taps, o, acc, bias, gs, xt, win);
}
ATEN_OVERRIDE_CLONES void lanes_gather_f(
    const LanesWalk& walk, const int64_t* o, float* out, const float* gs, const float* w, bool accumulate,
    const Window& win, bool wide) {
  if (wide) return lanes_gather_plane<Vec<float>>(walk, o, out, gs, w, accumulate, win);
  lanes_gather_plane<VecPair<float>>(walk, o, out, gs, w, accumulate, win);
}
ATEN_OVERRIDE_CLONES void lanes_gather_d(
    const LanesWalk& walk, const int64_t* o, double* out, const double* gs, const double* w, bool accumulate,
    const Window& win, bool wide) {
  if (wide) return lanes_gather_plane<Vec<double>>(walk, o, out, gs, w, accumulate, win);
  lanes_gather_plane<VecPair<double>>(walk, o, out, gs, w, accumulate, win);
}
inline void lanes_correlate(
    const LanesWalk& walk, int64_t taps, const int64_t* o, float* a, float* b, const float* gs, const float* xt,
    const Window& win, bool wide) {
  lanes_correlate_f(walk, taps, o, a, b, gs, xt, win, wide);
}
inline void lanes_correlate(
    const LanesWalk& walk, int64_t taps, const int64_t* o, double* a, double* b, const double* gs, const double* xt,
    const Window& win, bool wide) {
  lanes_correlate_d(walk, taps, o, a, b, gs, xt, win, wide);
}
inline void lanes_gather(
    const LanesWalk& walk, const int64_t* o, float* out, const float* gs, const float* w, bool acc, const Window& win,
    bool wide) {
  lanes_gather_f(walk, o, out, gs, w, acc, win, wide);
}
inline void lanes_gather(
    const LanesWalk& walk, const int64_t* o, double* out, const double* gs, const double* w, bool acc,
    const Window& win, bool wide) {
  lanes_gather_d(walk, o, out, gs, w, acc, win, wide);
}

// The table's choice between the two walks (the autotuner measures both where both apply).
// Largest input plane, and strided: largest grad_output plane, the channels-in-lanes walk takes.
// Measured once (float32 / bfloat16, 2 threads, MobileNetV2 / EfficientNet depthwise stages, a
// Sapphire Rapids VM): stride 1, 7x7 to 10x10 planes 0.5-0.65x the per-plane kernel's time, 12x12
// 1.1x, 14x14 1.2x, 56x56 1.25x; stride 2, 14x14 to 56x56 inputs 0.45-0.75x, 112x112 1.05x.
constexpr int64_t kLanesMaxPlane = 128;
constexpr int64_t kLanesMaxStridedPlane = 1024;

// Bound on the channels-in-lanes walk's per-thread tiles (input, spread grad_output, grad_input; L
// channels of a whole padded plane each): beyond it a plane no longer fits any cache level and the
// walk is not a candidate.
constexpr int64_t kLanesMaxTileBytes = int64_t{16} << 20;

// The banded walk's tiles take at most 1 / kBandL2Divisor of the L2 cache: the rest holds the next
// band's input and grad_output rows, which are prefetched while a band is computed. It is a candidate
// only where the whole-plane tiles exceed the L2: on 56x56 planes (0.65 MiB of tiles, 1 MiB L2) bands
// measured 1.0-1.07x the whole-plane walk's time, on 112x112 planes (2.5 MiB) 0.86-0.98x (Zen 4, one
// thread, budgets of 1/4 to all of the L2 within noise of each other).
constexpr int64_t kBandL2Divisor = 2;

int64_t lanes_of(at::ScalarType dtype) {
  return dtype == at::kDouble ? Vec<double>::size : Vec<float>::size;
}

bool lanes_walk_preferred(const DirectProblem& p, int64_t lanes) {
  const bool strided = p.stride[0] > 1 || p.stride[1] > 1 || p.stride[2] > 1;
  const int64_t in_plane = p.in[0] * p.in[1] * p.in[2], out_plane = p.out[0] * p.out[1] * p.out[2];
  return 2 * p.groups >= lanes && (in_plane <= kLanesMaxPlane || (strided && out_plane <= kLanesMaxStridedPlane));
}

// --- Large planes: the channels-in-lanes walk in bands of rows -------------------------------------
// On large planes (MobileNetV2's 112x112 and 56x56 stages) the whole-plane tiles of L channels are
// megabytes each (114 x 114 positions x 64 bytes: 0.8 MiB per tile), far over L2, so each of the
// walk's passes (transpose in, correlate, gather, transpose out) goes to L3 or DRAM. The banded walk
// runs the same passes over bands of rows of the padded plane (of (t, h) rows in 3-D), sized so that
// a band's three tiles fit a share of the L2 read from the machine. A band of rows [r0, r1) holds, at
// the same offsets from its first position as in the whole-plane tiles:
//   - xt: the input rows of [r0, r1) and those its grad_output positions' taps reach after them,
//   - gs: the grad_output positions (at their tap 0) of rows [r0, r1) and those before them whose taps
//     reach its rows (re-read by the band after theirs: the overlap is the kernel's reach),
//   - gp: grad_input of rows [r0, r1), written out once the band's grad_output channels are done.
// grad_weight / grad_bias take the band's grad_output positions, grad_input the band's input rows:
// each position in exactly one band, so both are the whole-plane walk's sums (grad_input bit for bit;
// grad_weight / grad_bias in other chunks, bands in a fixed order). The whole-plane walk is the
// banded one with a single band.

// The padded plane of make_plane(p, 1) as rows of (t, h), by arithmetic: this runs on the per-call
// path (the table's choice, a tuned choice's check), where make_plane's tap lists would allocate.
struct PlaneRows {
  int64_t pitch;   // positions per row (padded W)
  int64_t rows;    // padded T * padded H
  int64_t margin;  // Plane::margin: the largest tap offset, in positions
  int64_t stride;  // stride in H: bands hold whole multiples of it (the same rows of gs stay gaps)
};

PlaneRows plane_rows(const DirectProblem& p) {
  int64_t padded[3];
  for (int i = 0; i < 3; ++i) padded[i] = p.in[i] + 2 * p.padding[i];
  const int64_t margin = ((p.kernel[0] - 1) * p.dilation[0] * padded[1] + (p.kernel[1] - 1) * p.dilation[1]) * padded[2] +
      (p.kernel[2] - 1) * p.dilation[2];
  return {padded[2], padded[0] * padded[1], margin, p.stride[1]};
}

// Positions of each tile of a band of `rows` rows: the band and the taps' reach (margin) either side.
int64_t band_tile_positions(const PlaneRows& r, int64_t rows) {
  return rows * r.pitch + 2 * r.margin + 1;
}

// Bytes per thread of a band's three tiles the walk touches: xt the band and the margin after it, gs
// the band and the margin before it, gp the band (one vector of L channels per position).
int64_t band_tile_bytes(const PlaneRows& r, int64_t rows, at::ScalarType dtype) {
  const int64_t element = dtype == at::kDouble ? 8 : 4;
  return (3 * rows * r.pitch + 2 * r.margin) * lanes_of(dtype) * element;
}

// Rows the taps reach before a position (ceil(margin / pitch)): a band shorter than that would
// re-read more grad_output rows than it owns.
int64_t reach_rows(const PlaneRows& r) {
  return (r.margin + r.pitch - 1) / r.pitch;
}

int64_t band_budget() {
  return cache_bytes(2) / kBandL2Divisor;
}

// Rows per band of the banded walk: the bands as even as the budget allows, a multiple of the stride
// in H where the budget allows it; 0 when not even a band of reach_rows fits the budget.
int64_t band_rows(const PlaneRows& r, at::ScalarType dtype, int64_t budget) {
  const int64_t fixed = band_tile_bytes(r, 0, dtype), per_row = band_tile_bytes(r, 1, dtype) - fixed;
  int64_t most = budget > fixed ? std::min(r.rows, (budget - fixed) / per_row) : 0;
  if (most >= r.stride) most -= most % r.stride;
  if (most < std::max<int64_t>(1, reach_rows(r))) return 0;
  const int64_t bands = (r.rows + most - 1) / most;
  const int64_t even = (r.rows + bands - 1) / bands;
  return std::min(most, (even + r.stride - 1) / r.stride * r.stride);
}

// One band of rows [r0, r1) of the padded plane and the position ranges it moves (input and
// grad_input positions in (t, h, w) order, grad_output positions likewise).
struct Band {
  int64_t r0, r1;
  Window win;                     // positions [r0 * pitch, r1 * pitch); tiles from r0 * pitch - margin
  int64_t in_first, in_count;     // input into xt: positions [r0 * pitch, (r1 + margin / pitch) * pitch)
  int64_t out_first, out_count;   // grad_output into gs: tap-0 positions [r0 * pitch - margin, r1 * pitch)
  int64_t gi_first, gi_count;     // grad_input out of gp: positions [r0 * pitch, r1 * pitch)
};

std::vector<Band> make_bands(
    const Plane& g, int64_t rows_per_band, const std::vector<int64_t>& in_pos, const std::vector<int64_t>& out_pos) {
  const auto range = [](const std::vector<int64_t>& list, int64_t lo, int64_t hi) {
    const int64_t first = std::lower_bound(list.begin(), list.end(), lo) - list.begin();
    const int64_t last = std::lower_bound(list.begin(), list.end(), hi) - list.begin();
    return std::make_pair(first, last - first);
  };
  std::vector<Band> bands;
  const int64_t rows = g.size / g.pitch, halo = g.margin / g.pitch * g.pitch;
  for (int64_t r0 = 0; r0 < rows; r0 += rows_per_band) {
    Band b;
    b.r0 = r0, b.r1 = std::min(rows, r0 + rows_per_band);
    const int64_t lo = b.r0 * g.pitch, hi = b.r1 * g.pitch;
    b.win = Window{lo, hi, lo - g.margin};
    std::tie(b.in_first, b.in_count) = range(in_pos, lo, hi + halo);
    std::tie(b.out_first, b.out_count) = range(out_pos, lo - g.margin, hi);
    std::tie(b.gi_first, b.gi_count) = range(in_pos, lo, hi);
    bands.push_back(b);
  }
  return bands;
}

// Whether padded row r (of (t, h)) holds input positions / grad_output positions (at their tap 0).
bool input_row(const Plane& g, int64_t r) {
  const int64_t t = r / g.rows_h, h = r % g.rows_h;
  return r >= 0 && t >= g.pad_t && t < g.pad_t + g.in_t && h >= g.pad_h && h < g.pad_h + g.in_h;
}
bool output_row(const Plane& g, int64_t r) {
  const int64_t t = r / g.rows_h, h = r % g.rows_h;
  return r >= 0 && t % g.stride_t == 0 && t / g.stride_t < g.out_t && h % g.stride_h == 0 && h / g.stride_h < g.out_h;
}

// A band tile's rows: tile row k is padded row r0 - reach + k of the band (r0 = its first row) and
// covers positions [k * pitch - skew, (k + 1) * pitch - skew) of the tile, for every band alike (each
// starts at r0 * pitch - margin). The padding columns and the gap columns of strided rows are never
// written, so they stay zero; rows are zeroed when they held data for an earlier band and hold none
// now (padding rows, gap rows, rows past the plane), so the tiles equal the whole-plane tiles on
// every position a band's walk reads.
template <typename acc_t>
class TileRows {
 public:
  TileRows(const Plane& g, int64_t positions)
      : pitch_(g.pitch), reach_((g.margin + g.pitch - 1) / g.pitch), skew_(reach_ * g.pitch - g.margin),
        positions_(positions), held_((positions + skew_ + g.pitch - 1) / g.pitch, 0) {}

  // holds(r): whether padded row r holds data for the band starting at row r0.
  template <typename Holds>
  void clear_stale(acc_t* tile, int64_t r0, Holds&& holds) {
    constexpr int64_t L = Vec<acc_t>::size;
    for (int64_t k = 0; k < static_cast<int64_t>(held_.size()); ++k) {
      const bool now = holds(r0 - reach_ + k);
      if (held_[k] && !now) {
        const int64_t begin = std::max<int64_t>(0, k * pitch_ - skew_), end = std::min(positions_, (k + 1) * pitch_ - skew_);
        std::fill(tile + begin * L, tile + end * L, acc_t(0));
      }
      held_[k] = now;
    }
  }

 private:
  int64_t pitch_, reach_, skew_, positions_;
  std::vector<char> held_;
};

// Where element (n, c, i) of a dense (N, C, *spatial) tensor sits, i its position in (t, h, w) order:
// n * sample + c * channel + i * position.
struct PlaneStrides {
  int64_t sample, channel, position;
};

// The strides of a tensor laid out NC(T)HW or channels-last (N(T)HWC, any number of spatial dims),
// else none.
std::optional<PlaneStrides> plane_strides(const at::Tensor& t) {
  const int64_t channels = t.size(1), plane = t.numel() / std::max<int64_t>(1, t.size(0) * channels);
  if (t.is_contiguous()) return PlaneStrides{channels * plane, plane, 1};
  if (t.movedim(1, -1).is_contiguous()) return PlaneStrides{plane * channels, 1, channels};
  return std::nullopt;
}

// The channels-in-lanes kernel: same contract and task split as depthwise_impl, tasks of L channels,
// the padded plane walked in bands of rows_per_band rows (the whole plane: one band). grad_output,
// input and grad_input are each NCHW or channels-last (their PlaneStrides). `streaming`: whether a
// grad_input of kStreamBytes or more goes out through staging with non-temporal stores (nullopt: as
// streaming_stores() measured, asked only for such a grad_input).
template <typename scalar_t>
void depthwise_lanes_impl(
    const DirectProblem& p, int64_t rows_per_band, const scalar_t* go, const scalar_t* x, const scalar_t* w,
    scalar_t* gi, scalar_t* gw, scalar_t* gb, PlaneStrides go_s, PlaneStrides x_s, PlaneStrides gi_s,
    std::optional<bool> streaming = std::nullopt) {
  using acc_t = acc_type<scalar_t>;
  constexpr int64_t L = Vec<acc_t>::size;
  const Plane g = make_plane(p, 1);
  const int64_t channels = p.groups, multiplier = p.out_per_group;
  const int64_t in_plane = p.in[0] * p.in[1] * p.in[2], out_plane = p.out[0] * p.out[1] * p.out[2];
  const int64_t per_channel = multiplier * g.taps;
  const std::vector<int64_t> in_pos = input_positions(g), out_pos = output_positions(g);
  const LanesWalk walk = lanes_walk(p, g);
  const bool wide = wide_vectors();
  const std::vector<Band> bands = make_bands(g, rows_per_band, in_pos, out_pos);
  const int64_t tile = band_tile_positions(plane_rows(p), rows_per_band), halo = g.margin / g.pitch;
  TORCH_INTERNAL_ASSERT(plane_rows(p).margin == g.margin && plane_rows(p).pitch == g.pitch);
  int64_t band_inputs = 0;  // most grad_input positions of a band
  for (const Band& b : bands) band_inputs = std::max(band_inputs, b.gi_count);
  std::vector<int64_t> offset(g.offset);
  for (auto& o : offset) o *= L;
  const bool by_channel = gw || gb;
  const int64_t blocks = (channels + L - 1) / L;
  const int64_t tasks = by_channel ? blocks : p.batch * blocks;
  const int64_t gi_bytes = gi ? p.batch * channels * in_plane * static_cast<int64_t>(sizeof(scalar_t)) : 0;
#ifdef ATEN_OVERRIDE_AVX512
  const bool stream = gi_bytes >= kStreamBytes && has_streaming() && gi_s.position == 1 &&
      (streaming ? *streaming : streaming_stores().streaming);
#else
  const bool stream = false;
#endif
  for_each_chunk(tasks, p.batch * channels * (in_plane + multiplier * out_plane), [&](auto&& next_chunk) {
    // One band of a block's grad_input planes, lane by lane, when streamed.
    std::vector<scalar_t> staging(stream ? L * band_inputs : 0);
    // Tiles: input (zero borders), grad_output spread to tap-0 positions (zero gaps and margin), grad_input.
    std::vector<acc_t> xt(gw ? tile * L : 0, acc_t(0)), gs(tile * L, acc_t(0)), gp(gi ? tile * L : 0);
    TileRows<acc_t> xt_rows(g, tile), gs_rows(g, tile);
    // Per block: weight vectors, one sample's grad_weight / grad_bias vectors and their double totals.
    std::vector<acc_t> weight(gi ? per_channel * L : 0);
    std::vector<acc_t> acc(gw ? per_channel * L : 0), bias(gb ? multiplier * L : 0);
    std::vector<double> acc_total(acc.size()), bias_total(bias.size());
    for (auto [begin, end] = next_chunk(); begin < end; std::tie(begin, end) = next_chunk()) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t c0 = (task % blocks) * L, lanes = std::min(L, channels - c0);
        const int64_t n_begin = by_channel ? 0 : task / blocks, n_end = by_channel ? p.batch : n_begin + 1;
        if (gi) {
          for (int64_t i = 0; i < per_channel; ++i) {
            for (int64_t l = 0; l < L; ++l) {
              weight[i * L + l] = l < lanes ? static_cast<acc_t>(w[(c0 + l) * per_channel + i]) : acc_t(0);
            }
          }
        }
        // Band b's input and grad_output rows of sample n, into L2 (channels-last planes: the hardware
        // prefetchers follow their one stream).
        const auto prefetch_band = [&](int64_t n, const Band& b) {
          for (int64_t l = 0; l < lanes; ++l) {
            if (gw && x_s.position == 1) prefetch(x + n * x_s.sample + (c0 + l) * x_s.channel + b.in_first, b.in_count);
            for (int64_t q = 0; q < multiplier && go_s.position == 1; ++q) {
              prefetch(go + n * go_s.sample + ((c0 + l) * multiplier + q) * go_s.channel + b.out_first, b.out_count);
            }
          }
        };
        std::fill(acc_total.begin(), acc_total.end(), 0.0);
        std::fill(bias_total.begin(), bias_total.end(), 0.0);
        for (int64_t n = n_begin; n < n_end; ++n) {
          std::fill(acc.begin(), acc.end(), acc_t(0));
          std::fill(bias.begin(), bias.end(), acc_t(0));
          for (size_t bi = 0; bi < bands.size(); ++bi) {
            const Band& b = bands[bi];
            // The next band (the next sample's first after the last) arrives while this one is computed.
            if (bi + 1 < bands.size()) prefetch_band(n, bands[bi + 1]);
            else if (n + 1 < n_end) prefetch_band(n + 1, bands[0]);
            if (gw) {
              xt_rows.clear_stale(xt.data(), b.r0, [&](int64_t r) { return r >= b.r0 && r < b.r1 + halo && input_row(g, r); });
              load_tiles(
                  x + n * x_s.sample + c0 * x_s.channel + b.in_first * x_s.position, x_s.channel, lanes,
                  in_pos.data() + b.in_first, b.in_count, xt.data(), L, b.win.base, x_s.position);
            }
            gs_rows.clear_stale(gs.data(), b.r0, [&](int64_t r) { return r < b.r1 && output_row(g, r); });
            for (int64_t q = 0; q < multiplier; ++q) {
              // Output channels (c0 + l) * multiplier + q, l < lanes.
              load_tiles(
                  go + n * go_s.sample + (c0 * multiplier + q) * go_s.channel + b.out_first * go_s.position,
                  multiplier * go_s.channel, lanes, out_pos.data() + b.out_first, b.out_count, gs.data(), L, b.win.base,
                  go_s.position);
              lanes_correlate(
                  walk, g.taps, offset.data(), gw ? acc.data() + q * g.taps * L : nullptr,
                  gb ? bias.data() + q * L : nullptr, gs.data(), xt.data(), b.win, wide);
              if (gi) {
                lanes_gather(walk, offset.data(), gp.data(), gs.data(), weight.data() + q * g.taps * L, q > 0, b.win, wide);
              }
            }
            if (gi) {
              scalar_t* out = gi + n * gi_s.sample + c0 * gi_s.channel + b.gi_first * gi_s.position;
              const int64_t* index = in_pos.data() + b.gi_first;
              if (!stream) {
                store_tiles(gp.data(), index, b.gi_count, out, gi_s.channel, lanes, L, b.win.base, gi_s.position);
              }
#ifdef ATEN_OVERRIDE_AVX512
              if (stream) {
                store_tiles(gp.data(), index, b.gi_count, staging.data(), b.gi_count, lanes, L, b.win.base);
                for (int64_t l = 0; l < lanes; ++l) {
                  copy_streaming(
                      reinterpret_cast<const char*>(staging.data() + l * b.gi_count), reinterpret_cast<char*>(out + l * in_plane),
                      b.gi_count * static_cast<int64_t>(sizeof(scalar_t)));
                }
              }
#endif
            }
          }
          add_to(acc.data(), acc_total.data(), static_cast<int64_t>(acc.size()));
          add_to(bias.data(), bias_total.data(), static_cast<int64_t>(bias.size()));
        }
        for (int64_t l = 0; l < lanes; ++l) {
          for (int64_t i = 0; gw && i < per_channel; ++i) {
            gw[(c0 + l) * per_channel + i] = static_cast<scalar_t>(acc_total[i * L + l]);
          }
          for (int64_t q = 0; gb && q < multiplier; ++q) {
            gb[(c0 + l) * multiplier + q] = static_cast<scalar_t>(bias_total[q * L + l]);
          }
        }
      }
    }
    if (stream) store_fence();
  });
}

// -1: measured; 0: ordinary stores; 1: streamed (set_streaming_stores).
std::atomic<int> forced_streaming{-1};

}  // namespace

StreamingStores streaming_stores() {
  static const StreamingStores measured = [] {
    StreamingStores out;
#ifdef ATEN_OVERRIDE_AVX512
    if (!fused::has_streaming()) return out;
    // grad_input alone of a 16-channel 3x3 stride-2 depthwise layer at 112x112 (MobileNetV2's layer.0),
    // grad_input twice the L3, on one thread (task 0 of a parallel region), each way: the walk's own
    // writes among its own reads.
    DirectProblem p;
    p.groups = 16, p.in_per_group = 1, p.out_per_group = 1;
    p.in = {1, 112, 112}, p.out = {1, 56, 56}, p.kernel = {1, 3, 3}, p.stride = {1, 2, 2}, p.padding = {0, 1, 1};
    const int64_t sample_bytes = p.groups * 112 * 112 * static_cast<int64_t>(sizeof(float));
    p.batch = std::clamp<int64_t>(2 * cache_bytes(3), int64_t{64} << 20, int64_t{256} << 20) / sample_bytes;
    const int64_t bands = band_rows(plane_rows(p), at::kFloat, band_budget());
    const int64_t rows = bands > 0 ? bands : plane_rows(p).rows;
    // Constant operands: a user's seeded random stream must not depend on whether this ran.
    const at::Tensor go = at::full({p.batch, p.groups, 56, 56}, 0.5f), w = at::full({p.groups, 1, 3, 3}, 0.25f);
    at::Tensor gi = at::zeros({p.batch, p.groups, 112, 112});  // its pages faulted in before any timed run
    const PlaneStrides go_s{p.groups * 56 * 56, 56 * 56, 1}, gi_s{p.groups * 112 * 112, 112 * 112, 1}, none{0, 0, 0};
    double best[2] = {INFINITY, INFINITY};
    at::parallel_for(0, std::max(1, at::get_num_threads()), 1, [&](int64_t begin, int64_t) {
      if (begin != 0) return;
      for (int run = 0; run < 4; ++run) {
        for (int i = 0; i < 2; ++i) {
          const int way = run % 2 ? 1 - i : i;  // every other run in reverse order
          const auto start = std::chrono::steady_clock::now();
          depthwise_lanes_impl<float>(
              p, rows, go.const_data_ptr<float>(), nullptr, w.const_data_ptr<float>(), gi.data_ptr<float>(), nullptr,
              nullptr, go_s, none, gi_s, way == 1);
          const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
          if (run > 0) best[way] = std::min(best[way], us);  // run 0 warms both up
        }
      }
    });
    out.direct_us = best[0];
    out.streamed_us = best[1];
    out.streaming = out.streamed_us < out.direct_us;
#endif
    return out;
  }();
  StreamingStores out = measured;
  const int forced = forced_streaming.load(std::memory_order_relaxed);
  if (forced >= 0) {
    out.streaming = forced == 1 && out.direct_us > 0;
    out.forced = true;
  }
  return out;
}

void set_streaming_stores(std::optional<bool> streaming) {
  forced_streaming.store(streaming ? int(*streaming) : -1);
}

bool depthwise_lanes_fits(const DirectProblem& p, at::ScalarType dtype) {
  const PlaneRows r = plane_rows(p);
  const int64_t element = dtype == at::kDouble ? 8 : 4;
  return 3 * band_tile_positions(r, r.rows) * lanes_of(dtype) * element <= kLanesMaxTileBytes;
}

std::optional<std::string> depthwise_bands_unsupported(const DirectProblem& p, at::ScalarType dtype) {
  if (p.in_per_group != 1 || p.groups == 1) return "not depthwise (groups == C_in > 1)";
  const int64_t l2 = cache_bytes(2), budget = band_budget();
  if (l2 == 0) return "the L2 cache size is unknown (neither /sys/devices/system/cpu nor sysconf reports it)";
  const PlaneRows r = plane_rows(p);
  const int64_t whole = band_tile_bytes(r, r.rows, dtype);
  if (whole <= l2) {
    return c10::str(
        "the whole plane's channels-in-lanes tiles (", whole >> 10, " KiB) fit the L2 (", l2 >> 10,
        " KiB): depthwise-lanes keeps them there");
  }
  if (band_rows(r, dtype, budget) == 0) {
    const int64_t rows = std::max<int64_t>(1, reach_rows(r));
    return c10::str(
        "a band of ", rows, " rows (the kernel's reach) needs ", band_tile_bytes(r, rows, dtype) >> 10,
        " KiB of tiles, over 1/", kBandL2Divisor, " of the L2 (", budget >> 10, " KiB)");
  }
  return std::nullopt;
}

DepthwiseWalk depthwise_table_walk(const DirectProblem& p, at::ScalarType dtype) {
  return lanes_walk_preferred(p, lanes_of(dtype)) && depthwise_lanes_fits(p, dtype) ? DepthwiseWalk::Lanes
                                                                                       : DepthwiseWalk::Plane;
}

bool depthwise_lanes_layout(const at::Tensor& t) {
  return plane_strides(t).has_value();
}

void depthwise_backward_cpu(
    const DirectProblem& p, DepthwiseWalk walk, const at::Tensor& grad_output, const at::Tensor& input,
    const at::Tensor& weight, at::Tensor* grad_input, at::Tensor* grad_weight, at::Tensor* grad_bias) {
  // The plane walk reads and writes NCHW planes; the lanes walks either layout.
  const auto layout_ok = [&](const at::Tensor& t) {
    return walk == DepthwiseWalk::Plane ? t.is_contiguous() : depthwise_lanes_layout(t);
  };
  TORCH_INTERNAL_ASSERT(p.in_per_group == 1 && layout_ok(grad_output));
  TORCH_INTERNAL_ASSERT(!grad_input || (layout_ok(*grad_input) && weight.is_contiguous()));
  TORCH_INTERNAL_ASSERT(!grad_weight || (grad_weight->is_contiguous() && layout_ok(input)));
  TORCH_INTERNAL_ASSERT(!grad_bias || grad_bias->is_contiguous());
  const at::ScalarType dtype = grad_output.scalar_type();
  const int64_t rows = walk == DepthwiseWalk::Bands ? band_rows(plane_rows(p), dtype, band_budget()) : plane_rows(p).rows;
  TORCH_INTERNAL_ASSERT(rows > 0, "depthwise bands: no band fits (depthwise_bands_unsupported declines this call)");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "depthwise_backward_cpu", [&] {
    const auto data = [](at::Tensor* t) { return t ? t->data_ptr<scalar_t>() : nullptr; };
    const scalar_t* go = grad_output.const_data_ptr<scalar_t>();
    const scalar_t* x = grad_weight ? input.const_data_ptr<scalar_t>() : nullptr;
    const scalar_t* w = grad_input ? weight.const_data_ptr<scalar_t>() : nullptr;
    if (walk == DepthwiseWalk::Plane) {
      depthwise_impl<scalar_t>(p, go, x, w, data(grad_input), data(grad_weight), data(grad_bias));
    } else {
      const PlaneStrides none{0, 0, 0};
      depthwise_lanes_impl<scalar_t>(
          p, rows, go, x, w, data(grad_input), data(grad_weight), data(grad_bias), *plane_strides(grad_output),
          grad_weight ? *plane_strides(input) : none, grad_input ? *plane_strides(*grad_input) : none);
    }
  });
}

}  // namespace aten_override
