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
// are hinted to use huge pages and written with non-temporal stores.
//
// Small or strided planes take a second kernel with the same contract and task split (below,
// "channels in vector lanes"): a block of L channels is transposed into [position][channel] tiles, so
// each vector holds one position of L channels and no per-plane set-up or lane reduction remains.
#include "../convolution_backward.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && defined(__linux__)
#define ATEN_OVERRIDE_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define ATEN_OVERRIDE_CLONES
#endif
#define ATEN_OVERRIDE_INLINE inline __attribute__((always_inline))

namespace aten_override {
namespace {

// 64-byte vectors (GCC/Clang vector extensions): one AVX-512 register in the x86-64-v4 clone, two
// AVX2 registers in the v3 one. Loads and stores are unaligned.
template <typename acc_t>
struct Vec {
  typedef acc_t type __attribute__((vector_size(64), aligned(sizeof(acc_t))));
  static constexpr int64_t size = 64 / sizeof(acc_t);
  static ATEN_OVERRIDE_INLINE type load(const acc_t* p) { return *reinterpret_cast<const type*>(p); }
  static ATEN_OVERRIDE_INLINE void store(acc_t* p, type v) { *reinterpret_cast<type*>(p) = v; }
};

// Taps are processed at most kMaxTaps at a time so that their accumulators stay in registers.
constexpr int kMaxTaps = 8;

// The padded plane and the walks over it, for one problem.
struct Plane {
  int64_t in_t, in_h, in_w, out_t, out_h, out_w;
  int64_t pad_t, pad_h, pad_w, stride_t, stride_h, stride_w;
  int64_t rows_h;   // padded H
  int64_t pitch;    // row pitch of the padded plane (>= padded W)
  int64_t size;     // padded T * padded H * pitch
  int64_t margin;   // largest tap offset: gs keeps that many zeros before the plane
  int64_t slack;    // zeros after each buffer, so vector loops may run past their range
  bool flat;        // every stride 1: correlate / gather over the plane as one range
  int64_t taps;
  std::vector<int64_t> offset;  // offset of each tap in the padded plane
  // Strided: padded row r (t * rows_h + h) gathers from the taps of class
  // (t % stride_t) * stride_h + h % stride_h: class_taps[class_begin[c] .. class_begin[c + 1]).
  std::vector<int64_t> class_taps, class_begin;

  int64_t row(int64_t t, int64_t h) const { return (t * rows_h + h) * pitch; }
  int64_t in_row(int64_t t, int64_t h) const { return row(t + pad_t, h + pad_h) + pad_w; }
  int64_t out_row(int64_t t, int64_t h) const { return row(t * stride_t, h * stride_h); }
  // grad_output positions span [0, span) in gs (from its margin); interior of xp / grad_input [first, last).
  int64_t span() const { return out_row(out_t - 1, out_h - 1) + (out_w - 1) * stride_w + 1; }
  int64_t first() const { return in_row(0, 0); }
  int64_t last() const { return in_row(in_t - 1, in_h - 1) + in_w; }
};

Plane make_plane(const DirectProblem& p, int64_t lanes) {
  Plane g;
  g.in_t = p.in[0], g.in_h = p.in[1], g.in_w = p.in[2];
  g.out_t = p.out[0], g.out_h = p.out[1], g.out_w = p.out[2];
  g.pad_t = p.padding[0], g.pad_h = p.padding[1], g.pad_w = p.padding[2];
  g.stride_t = p.stride[0], g.stride_h = p.stride[1], g.stride_w = p.stride[2];
  g.flat = g.stride_t == 1 && g.stride_h == 1 && g.stride_w == 1;
  g.rows_h = g.in_h + 2 * g.pad_h;
  const int64_t width = g.in_w + 2 * g.pad_w;
  // Row by row, a vector may run past the row's end: round the pitch up so it stays in the row.
  g.pitch = g.flat ? width : (width + lanes - 1) / lanes * lanes;
  g.size = (g.in_t + 2 * g.pad_t) * g.rows_h * g.pitch;
  g.taps = p.kernel[0] * p.kernel[1] * p.kernel[2];
  const int64_t classes = g.stride_t * g.stride_h;
  std::vector<std::vector<int64_t>> by_class(classes);
  for (int64_t kt = 0, tap = 0; kt < p.kernel[0]; ++kt) {
    for (int64_t kh = 0; kh < p.kernel[1]; ++kh) {
      for (int64_t kw = 0; kw < p.kernel[2]; ++kw, ++tap) {
        const int64_t t = kt * p.dilation[0], h = kh * p.dilation[1];
        g.offset.push_back(g.row(t, h) + kw * p.dilation[2]);
        by_class[(t % g.stride_t) * g.stride_h + h % g.stride_h].push_back(tap);
      }
    }
  }
  g.margin = *std::max_element(g.offset.begin(), g.offset.end());
  g.slack = 4 * lanes;
  g.class_begin.push_back(0);
  for (const auto& taps : by_class) {
    g.class_taps.insert(g.class_taps.end(), taps.begin(), taps.end());
    g.class_begin.push_back(static_cast<int64_t>(g.class_taps.size()));
  }
  return g;
}

// acc[k] += sum_{j in [j0, j1)} gs[j] * xp[j + offset[k]] for NT taps, lane by lane: acc holds one
// vector per tap (reduced across lanes once, at the end). j1 - j0 is a multiple of the lanes.
template <int NT, typename acc_t>
ATEN_OVERRIDE_INLINE void correlate_block(
    acc_t* acc, const acc_t* gs, const acc_t* xp, const int64_t* offset, int64_t j0, int64_t j1) {
  using V = Vec<acc_t>;
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
template <int NT, typename acc_t>
ATEN_OVERRIDE_INLINE void gather_block(
    acc_t* out, const acc_t* gs, const acc_t* weight, const int64_t* offset, const int64_t* taps, bool accumulate,
    int64_t j0, int64_t j1) {
  using V = Vec<acc_t>;
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

// Splits `taps` taps into near-equal blocks of at most kMaxTaps: op.template run<NT>(first, index).
template <typename Op>
ATEN_OVERRIDE_INLINE void for_tap_blocks(int64_t taps, Op&& op) {
  if (taps == 0) return;
  const int64_t blocks = (taps + kMaxTaps - 1) / kMaxTaps;
  const int64_t per_block = (taps + blocks - 1) / blocks;
  for (int64_t first = 0, index = 0; first < taps; first += per_block, ++index) {
    switch (std::min(per_block, taps - first)) {
      case 1: op.template run<1>(first, index); break;
      case 2: op.template run<2>(first, index); break;
      case 3: op.template run<3>(first, index); break;
      case 4: op.template run<4>(first, index); break;
      case 5: op.template run<5>(first, index); break;
      case 6: op.template run<6>(first, index); break;
      case 7: op.template run<7>(first, index); break;
      default: op.template run<8>(first, index); break;
    }
  }
}

template <typename acc_t>
struct CorrelateOp {
  acc_t* acc;
  const acc_t* gs;
  const acc_t* xp;
  const int64_t* offset;
  int64_t j0, j1;
  template <int NT>
  ATEN_OVERRIDE_INLINE void run(int64_t first, int64_t) const {
    correlate_block<NT>(acc + first * Vec<acc_t>::size, gs, xp, offset + first, j0, j1);
  }
};

template <typename acc_t>
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
    gather_block<NT>(out, gs, weight, offset, taps + first, accumulate || index > 0, j0, j1);
  }
};

template <typename acc_t>
ATEN_OVERRIDE_INLINE int64_t round_up(int64_t n) {
  return (n + Vec<acc_t>::size - 1) / Vec<acc_t>::size * Vec<acc_t>::size;
}

// acc[k] (one vector per tap) += grad_weight contribution of one grad_output plane (`gs`, from its
// margin) and input plane `xp`.
template <typename acc_t>
ATEN_OVERRIDE_INLINE void correlate_plane(const Plane& g, acc_t* acc, const acc_t* gs, const acc_t* xp) {
  if (g.flat) {
    // gs is zero from span on (slack), so the range may be rounded up.
    for_tap_blocks(g.taps, CorrelateOp<acc_t>{acc, gs, xp, g.offset.data(), 0, round_up<acc_t>(g.span())});
    return;
  }
  // A row's positions past its last grad_output element are zeros of the same row (pitch rounded up).
  const int64_t width = round_up<acc_t>((g.out_w - 1) * g.stride_w + 1);
  for (int64_t t = 0; t < g.out_t; ++t) {
    for (int64_t h = 0; h < g.out_h; ++h) {
      const int64_t j0 = g.out_row(t, h);
      for_tap_blocks(g.taps, CorrelateOp<acc_t>{acc, gs, xp, g.offset.data(), j0, j0 + width});
    }
  }
}

// out (= or += when accumulate) the grad_input contribution of one grad_output plane, over the
// padded plane's interior [first, last) (rounded up; other positions get values nobody reads).
template <typename acc_t>
ATEN_OVERRIDE_INLINE void gather_plane(
    const Plane& g, acc_t* out, const acc_t* gs, const acc_t* weight, bool accumulate) {
  if (g.flat) {
    const int64_t j0 = g.first();
    for_tap_blocks(
        g.taps, GatherOp<acc_t>{out, gs, weight, g.offset.data(), g.class_taps.data(), accumulate, j0,
                                j0 + round_up<acc_t>(g.last() - j0)});
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
          count, GatherOp<acc_t>{out, gs, weight, g.offset.data(), g.class_taps.data() + begin, accumulate, j0,
                                 j0 + g.pitch});
    }
  }
}

// acc (one vector) += the sum of one grad_output plane (`gs`, from its margin): grad_bias.
template <typename acc_t>
ATEN_OVERRIDE_INLINE void sum_plane(const Plane& g, acc_t* acc, const acc_t* gs) {
  using V = Vec<acc_t>;
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

ATEN_OVERRIDE_CLONES void sum_f(const Plane& g, float* a, const float* gs) { sum_plane(g, a, gs); }
ATEN_OVERRIDE_CLONES void sum_d(const Plane& g, double* a, const double* gs) { sum_plane(g, a, gs); }
inline void sum(const Plane& g, float* a, const float* gs) { sum_f(g, a, gs); }
inline void sum(const Plane& g, double* a, const double* gs) { sum_d(g, a, gs); }

ATEN_OVERRIDE_CLONES void correlate_f(const Plane& g, float* a, const float* gs, const float* xp) {
  correlate_plane(g, a, gs, xp);
}
ATEN_OVERRIDE_CLONES void correlate_d(const Plane& g, double* a, const double* gs, const double* xp) {
  correlate_plane(g, a, gs, xp);
}
ATEN_OVERRIDE_CLONES void gather_f(const Plane& g, float* o, const float* gs, const float* w, bool accumulate) {
  gather_plane(g, o, gs, w, accumulate);
}
ATEN_OVERRIDE_CLONES void gather_d(const Plane& g, double* o, const double* gs, const double* w, bool accumulate) {
  gather_plane(g, o, gs, w, accumulate);
}
inline void correlate(const Plane& g, float* a, const float* gs, const float* xp) { correlate_f(g, a, gs, xp); }
inline void correlate(const Plane& g, double* a, const double* gs, const double* xp) { correlate_d(g, a, gs, xp); }
inline void gather(const Plane& g, float* o, const float* gs, const float* w, bool acc) { gather_f(g, o, gs, w, acc); }
inline void gather(const Plane& g, double* o, const double* gs, const double* w, bool acc) {
  gather_d(g, o, gs, w, acc);
}

// Moves `rows` rows of n elements: dst[r * dst_pitch + i * dst_step] = src[r * src_pitch + i], converting.
// Plain loops; the AVX-512 versions below take the unit-step float / bfloat16 moves.
template <typename From, typename To>
void move_rows_generic(
    const From* src, int64_t src_pitch, To* dst, int64_t dst_pitch, int64_t dst_step, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r, src += src_pitch, dst += dst_pitch) {
    for (int64_t i = 0; i < n; ++i) dst[i * dst_step] = static_cast<To>(src[i]);
  }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define ATEN_OVERRIDE_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))

// Rows are often a few elements (7x7 planes): one masked load and store each instead of a loop.
ATEN_OVERRIDE_AVX512 __m512 load_row(const float* src, __mmask16 m) { return _mm512_maskz_loadu_ps(m, src); }
ATEN_OVERRIDE_AVX512 __m512 load_row(const c10::BFloat16* src, __mmask16 m) {
  const __m256i bits = _mm256_maskz_loadu_epi16(m, src);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
ATEN_OVERRIDE_AVX512 void store_row(float* dst, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(dst, m, v); }
// float -> bfloat16 rounded to nearest even, NaN -> 0x7fc0 (c10::BFloat16's conversion).
ATEN_OVERRIDE_AVX512 void store_row(c10::BFloat16* dst, __m512 v, __mmask16 m) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  _mm256_mask_storeu_epi16(dst, m, _mm512_cvtepi32_epi16(r));
}

template <typename From, typename To>
ATEN_OVERRIDE_AVX512 void move_rows_avx512(
    const From* src, int64_t src_pitch, To* dst, int64_t dst_pitch, int64_t rows, int64_t n) {
  const __mmask16 tail = static_cast<__mmask16>((1u << (n % 16)) - 1);
  for (int64_t r = 0; r < rows; ++r, src += src_pitch, dst += dst_pitch) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) store_row(dst + i, load_row(src + i, 0xffff), 0xffff);
    if (i < n) store_row(dst + i, load_row(src + i, tail), tail);
  }
}

bool has_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl");
  return yes;
}

// memcpy whose whole cache lines bypass the cache (non-temporal stores: no read of the destination
// line before it is overwritten). The caller issues the store fence. grad_input is written once and
// never read here, so this saves a quarter of a memory-bound layer's traffic.
ATEN_OVERRIDE_AVX512 void copy_streaming(const char* src, char* dst, int64_t bytes) {
  const int64_t head = std::min<int64_t>(bytes, (64 - reinterpret_cast<uintptr_t>(dst) % 64) % 64);
  std::memcpy(dst, src, head);
  int64_t i = head;
  for (; i + 64 <= bytes; i += 64) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), _mm512_loadu_si512(src + i));
  }
  std::memcpy(dst + i, src + i, bytes - i);
}
#endif

template <typename From, typename To>
void move_rows(
    const From* src, int64_t src_pitch, To* dst, int64_t dst_pitch, int64_t dst_step, int64_t rows, int64_t n) {
#ifdef ATEN_OVERRIDE_AVX512
  constexpr bool fast = (std::is_same_v<From, float> || std::is_same_v<From, c10::BFloat16>) &&
      (std::is_same_v<To, float> || std::is_same_v<To, c10::BFloat16>);
  if constexpr (fast) {
    if (dst_step == 1 && has_avx512()) {
      move_rows_avx512(src, src_pitch, dst, dst_pitch, rows, n);
      return;
    }
  }
#endif
  move_rows_generic(src, src_pitch, dst, dst_pitch, dst_step, rows, n);
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

// Makes this thread's non-temporal stores (copy_streaming) visible before it leaves the parallel region.
void store_fence() {
#ifdef ATEN_OVERRIDE_AVX512
  _mm_sfence();
#endif
}

// Hints the kernel to back a freshly allocated output of `bytes` bytes with transparent huge pages
// (as c10's THP_MEM_ALLOC_ENABLE does for every large CPU allocation): its first touch then costs one
// fault per 2 MiB instead of per 4 KiB (measured: 38 MB written in 7 ms instead of 18 ms, one thread).
void advise_huge_pages(void* data, int64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHugePage = uintptr_t(1) << 21;
  if (bytes < static_cast<int64_t>(2 * kHugePage)) return;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(kHugePage - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);  // a hint: errors ignored
#else
  (void)data, (void)bytes;
#endif
}

// at::internal::GRAIN_SIZE, the size of one parallel task in ATen's elementwise kernels.
constexpr int64_t kSerialElements = 32768;

// Runs body(next_chunk) once per thread of at::parallel_for; next_chunk() hands out consecutive
// [begin, end) ranges of [0, tasks) (empty when none is left) to whichever thread asks first, so a
// thread that gets less CPU (a busy machine) takes fewer tasks. Each task's result does not depend on
// which thread computes it.
// Problems of fewer than kSerialElements elements (grad_output + input) run on the calling thread.
template <typename Body>
void for_each_chunk(int64_t tasks, int64_t elements, Body&& body) {
  const int64_t threads = elements < kSerialElements ? 1 : at::get_num_threads();
  const int64_t chunk = std::max<int64_t>(1, tasks / (8 * threads));
  std::atomic<int64_t> next{0};
  if (threads == 1) {
    body([&, done = false]() mutable -> std::pair<int64_t, int64_t> {
      const int64_t end = done ? 0 : tasks;
      done = true;
      return {0, end};
    });
    return;
  }
  at::parallel_for(0, std::min(threads, tasks), 1, [&](int64_t, int64_t) {
    body([&]() -> std::pair<int64_t, int64_t> {
      const int64_t begin = std::min(tasks, next.fetch_add(chunk, std::memory_order_relaxed));
      return {begin, std::min(tasks, begin + chunk)};
    });
  });
}

template <typename scalar_t>
using acc_type = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

// Asks for the cache lines of data[0 .. n) into L2.
template <typename T>
void prefetch(const T* data, int64_t n) {
  const char* p = reinterpret_cast<const char*>(data);
  for (int64_t i = 0; i < n * static_cast<int64_t>(sizeof(T)); i += 64) __builtin_prefetch(p + i, 0, 2);
}

// Bytes of one sample's input and grad_output planes a grad_weight task reads contiguously (at least
// one channel's): the hardware prefetchers need a few KiB of one stream to reach full speed.
constexpr int64_t kBlockBytes = 64 << 10;
// Smallest grad_input (bytes) written with non-temporal stores.
constexpr int64_t kStreamBytes = 8 << 20;

// Each of gi / gw / gb is null when not wanted (then w / x may be null too).
template <typename scalar_t>
void depthwise_impl(
    const DirectProblem& p, const scalar_t* go, const scalar_t* x, const scalar_t* w, scalar_t* gi, scalar_t* gw,
    scalar_t* gb) {
  using acc_t = acc_type<scalar_t>;
  constexpr int64_t L = Vec<acc_t>::size;
  const Plane g = make_plane(p, L);
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
  if (gi) advise_huge_pages(gi, gi_bytes);
#ifdef ATEN_OVERRIDE_AVX512
  // Only outputs far larger than the caches are worth streaming past them.
  const bool stream = gi_bytes >= kStreamBytes && has_avx512();
#else
  const bool stream = false;
#endif
  for_each_chunk(tasks, p.batch * channels * (in_plane + multiplier * out_plane), [&](auto&& next_chunk) {
    std::vector<acc_t> xp(gw ? g.size + g.slack : 0, acc_t(0));
    std::vector<acc_t> gs(g.margin + g.size + g.slack, acc_t(0));
    std::vector<acc_t> gp(gi ? g.size + g.slack : 0);
    // grad_input of one sample's block of channels (contiguous in grad_input), when streamed.
    std::vector<scalar_t> staging(stream ? block * in_plane : 0);
    // One vector of partial sums per grad_weight / grad_bias element of the block, for one sample;
    // each sample's lanes are then added, in a fixed order, into a double total per element (a
    // float32 running sum over the whole batch would lose digits that native's cascade sum keeps).
    std::vector<acc_t> acc(gw ? block * per_channel * L : 0), bias(gb ? block * multiplier * L : 0);
    std::vector<double> acc_total(gw ? block * per_channel : 0), bias_total(gb ? block * multiplier : 0);
    acc_t* spread = gs.data() + g.margin;
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
              if (gw) correlate(g, acc.data() + (co - c_begin * multiplier) * g.taps * L, spread, xp.data());
              if (gb) sum(g, bias.data() + (co - c_begin * multiplier) * L, spread);
              if (gi) gather(g, gp.data(), spread, weight.data() + co * g.taps, q > 0);
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

// Padded position index (in a Plane, lanes = 1) of each input position, in (t, h, w) order.
std::vector<int64_t> input_positions(const Plane& g) {
  std::vector<int64_t> out;
  out.reserve(g.in_t * g.in_h * g.in_w);
  for (int64_t t = 0; t < g.in_t; ++t)
    for (int64_t h = 0; h < g.in_h; ++h)
      for (int64_t w = 0; w < g.in_w; ++w) out.push_back(g.in_row(t, h) + w);
  return out;
}

// Padded position of tap 0 of each grad_output position, in (t, h, w) order.
std::vector<int64_t> output_positions(const Plane& g) {
  std::vector<int64_t> out;
  out.reserve(g.out_t * g.out_h * g.out_w);
  for (int64_t t = 0; t < g.out_t; ++t)
    for (int64_t h = 0; h < g.out_h; ++h)
      for (int64_t w = 0; w < g.out_w; ++w) out.push_back(g.out_row(t, h) + w * g.stride_w);
  return out;
}

// dst[index[i] * pitch + l] = src[l * lane_stride + i] for the first `lanes` of L lanes (0 in the
// others), i < positions: `lanes` planes into one vector per position of a tile whose positions are
// `pitch` elements apart (L: one vector of channels; more: several, filled one call each).
template <typename scalar_t, typename acc_t>
void load_tiles_generic(
    const scalar_t* src, int64_t lane_stride, int64_t lanes, const int64_t* index, int64_t positions, acc_t* dst,
    int64_t pitch) {
  constexpr int64_t L = Vec<acc_t>::size;
  for (int64_t i = 0; i < positions; ++i) {
    acc_t* d = dst + index[i] * pitch;
    for (int64_t l = 0; l < L; ++l) d[l] = l < lanes ? static_cast<acc_t>(src[l * lane_stride + i]) : acc_t(0);
  }
}

// dst[l * lane_stride + i] = src[index[i] * pitch + l] for l < lanes: tiles back into planes.
template <typename scalar_t, typename acc_t>
void store_tiles_generic(
    const acc_t* src, int64_t pitch, const int64_t* index, int64_t positions, scalar_t* dst, int64_t lane_stride,
    int64_t lanes) {
  for (int64_t l = 0; l < lanes; ++l) {
    for (int64_t i = 0; i < positions; ++i) dst[l * lane_stride + i] = static_cast<scalar_t>(src[index[i] * pitch + l]);
  }
}

#ifdef ATEN_OVERRIDE_AVX512
// In-place transpose of the 16x16 matrix whose rows are r[0..16): unpack pairs of rows, then
// shuffle 2x2 blocks, then 128-bit lanes twice.
ATEN_OVERRIDE_AVX512 ATEN_OVERRIDE_INLINE void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  // r[4i + j], 128-bit lane q: rows 4i..4i+3 of column 4q + j.
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
  }
  for (int j = 0; j < 4; ++j) {
    t[j] = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88);
    t[4 + j] = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xdd);
    t[8 + j] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88);
    t[12 + j] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xdd);
  }
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xdd);
    r[4 + j] = _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0x88);
    r[12 + j] = _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0xdd);
  }
}

template <typename scalar_t>
ATEN_OVERRIDE_AVX512 void load_tiles_avx512(
    const scalar_t* src, int64_t lane_stride, int64_t lanes, const int64_t* index, int64_t positions, float* dst,
    int64_t pitch) {
  for (int64_t i0 = 0; i0 < positions; i0 += 16) {
    const int64_t n = std::min<int64_t>(16, positions - i0);
    const __mmask16 m = static_cast<__mmask16>(n == 16 ? 0xffff : (1u << n) - 1);
    __m512 r[16];
    for (int l = 0; l < 16; ++l) r[l] = l < lanes ? load_row(src + l * lane_stride + i0, m) : _mm512_setzero_ps();
    transpose16(r);
    for (int64_t i = 0; i < n; ++i) _mm512_storeu_ps(dst + index[i0 + i] * pitch, r[i]);
  }
}

template <typename scalar_t>
ATEN_OVERRIDE_AVX512 void store_tiles_avx512(
    const float* src, int64_t pitch, const int64_t* index, int64_t positions, scalar_t* dst, int64_t lane_stride,
    int64_t lanes) {
  for (int64_t i0 = 0; i0 < positions; i0 += 16) {
    const int64_t n = std::min<int64_t>(16, positions - i0);
    const __mmask16 m = static_cast<__mmask16>(n == 16 ? 0xffff : (1u << n) - 1);
    __m512 r[16];
    for (int64_t i = 0; i < 16; ++i) r[i] = i < n ? _mm512_loadu_ps(src + index[i0 + i] * pitch) : _mm512_setzero_ps();
    transpose16(r);
    for (int64_t l = 0; l < lanes; ++l) store_row(dst + l * lane_stride + i0, r[l], m);
  }
}
#endif

template <typename scalar_t, typename acc_t>
constexpr bool kAvx512Tiles = std::is_same_v<acc_t, float> &&
    (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>);

template <typename scalar_t, typename acc_t>
void load_tiles(
    const scalar_t* src, int64_t lane_stride, int64_t lanes, const int64_t* index, int64_t positions, acc_t* dst,
    int64_t pitch = Vec<acc_t>::size) {
#ifdef ATEN_OVERRIDE_AVX512
  if constexpr (kAvx512Tiles<scalar_t, acc_t>) {
    if (has_avx512()) return load_tiles_avx512(src, lane_stride, lanes, index, positions, dst, pitch);
  }
#endif
  load_tiles_generic(src, lane_stride, lanes, index, positions, dst, pitch);
}

template <typename scalar_t, typename acc_t>
void store_tiles(
    const acc_t* src, const int64_t* index, int64_t positions, scalar_t* dst, int64_t lane_stride, int64_t lanes,
    int64_t pitch = Vec<acc_t>::size) {
#ifdef ATEN_OVERRIDE_AVX512
  if constexpr (kAvx512Tiles<scalar_t, acc_t>) {
    if (has_avx512()) return store_tiles_avx512(src, pitch, index, positions, dst, lane_stride, lanes);
  }
#endif
  store_tiles_generic(src, pitch, index, positions, dst, lane_stride, lanes);
}

// The positions the lanes kernels walk, in one list per walk rather than row by row (7x7 planes
// have rows of 7): every grad_output position (its tap-0 position in the padded plane), and the
// interior positions grouped by row class (Plane::class_taps: the taps that reach such a row).
struct LanesWalk {
  std::vector<int64_t> outputs;
  std::vector<int64_t> inputs, input_begin;  // class c: inputs[input_begin[c] .. input_begin[c + 1])
  std::vector<int64_t> class_taps, class_begin;
};

LanesWalk lanes_walk(const Plane& g) {
  LanesWalk walk;
  walk.outputs = output_positions(g);
  const int64_t classes = g.stride_t * g.stride_h;
  std::vector<std::vector<int64_t>> by_class(classes);
  for (int64_t t = g.pad_t; t < g.pad_t + g.in_t; ++t) {
    for (int64_t h = g.pad_h; h < g.pad_h + g.in_h; ++h) {
      auto& list = by_class[(t % g.stride_t) * g.stride_h + h % g.stride_h];
      for (int64_t w = 0; w < g.in_w; ++w) list.push_back(g.row(t, h) + g.pad_w + w);
    }
  }
  walk.input_begin.push_back(0);
  for (const auto& list : by_class) {
    walk.inputs.insert(walk.inputs.end(), list.begin(), list.end());
    walk.input_begin.push_back(static_cast<int64_t>(walk.inputs.size()));
  }
  walk.class_taps = g.class_taps;
  walk.class_begin = g.class_begin;
  return walk;
}

// Positions a running float32 sum covers before it is added into the sample's grad_weight /
// grad_bias sums (both lanes kernels). One running sum over a strided 1-D plane's 1,024 positions
// of mean-1 data measured 7-12 eps of grad_weight against native's 1.2; in chunks 1.2-2.4 eps
// (tests/ops/convolution_backward/test_compiled_adversarial.py).
constexpr int64_t kLanesChunk = 32;

// acc[k] += sum over the positions j in pos[0 .. count) of gs[j] * xt[j + offset[k]], NT taps (one
// vector each), kLanesChunk positions at a time; positions count L lanes each, offsets are
// pre-scaled by L.
template <int NT, typename acc_t>
ATEN_OVERRIDE_INLINE void lanes_correlate_block(
    acc_t* acc, const acc_t* gs, const acc_t* xt, const int64_t* offset, const int64_t* pos, int64_t count) {
  using V = Vec<acc_t>;
  constexpr int64_t L = V::size;
  for (int64_t i0 = 0; i0 < count; i0 += kLanesChunk) {
    typename V::type sums[NT];
    for (int k = 0; k < NT; ++k) sums[k] = typename V::type{};
    for (int64_t i = i0; i < std::min(count, i0 + kLanesChunk); ++i) {
      const int64_t j = pos[i] * L;
      const auto go = V::load(gs + j);
      for (int k = 0; k < NT; ++k) sums[k] += go * V::load(xt + j + offset[k]);
    }
    for (int k = 0; k < NT; ++k) V::store(acc + k * L, V::load(acc + k * L) + sums[k]);
  }
}

// out[j] (= or +=) sum over NT taps of weight[taps[k]] * gs[j - offset[taps[k]]] for the positions
// j in pos[0 .. count); weight holds one vector (L channels) per tap.
template <int NT, typename acc_t>
ATEN_OVERRIDE_INLINE void lanes_gather_block(
    acc_t* out, const acc_t* gs, const acc_t* weight, const int64_t* offset, const int64_t* taps, bool accumulate,
    const int64_t* pos, int64_t count) {
  using V = Vec<acc_t>;
  constexpr int64_t L = V::size;
  typename V::type wk[NT];
  const acc_t* src[NT];
  for (int k = 0; k < NT; ++k) {
    wk[k] = V::load(weight + taps[k] * L);
    src[k] = gs - offset[taps[k]];
  }
  for (int64_t i = 0; i < count; ++i) {
    const int64_t j = pos[i] * L;
    typename V::type s = {};
    if (accumulate) s = V::load(out + j);
    for (int k = 0; k < NT; ++k) s += wk[k] * V::load(src[k] + j);
    V::store(out + j, s);
  }
}

template <typename acc_t>
struct LanesCorrelateOp {
  acc_t* acc;
  const acc_t* gs;
  const acc_t* xt;
  const int64_t* offset;
  const int64_t* pos;
  int64_t count;
  template <int NT>
  ATEN_OVERRIDE_INLINE void run(int64_t first, int64_t) const {
    lanes_correlate_block<NT>(acc + first * Vec<acc_t>::size, gs, xt, offset + first, pos, count);
  }
};

template <typename acc_t>
struct LanesGatherOp {
  acc_t* out;
  const acc_t* gs;
  const acc_t* weight;
  const int64_t* offset;
  const int64_t* taps;
  bool accumulate;
  const int64_t* pos;
  int64_t count;
  template <int NT>
  ATEN_OVERRIDE_INLINE void run(int64_t first, int64_t index) const {
    lanes_gather_block<NT>(out, gs, weight, offset, taps + first, accumulate || index > 0, pos, count);
  }
};

// One grad_output tile (gs, from its margin) against the input tile xt: acc (one vector per tap, or
// null) += grad_weight, bias (one vector, or null) += grad_bias. `offset` is the Plane's, scaled by L.
template <typename acc_t>
ATEN_OVERRIDE_INLINE void lanes_correlate_plane(
    const LanesWalk& walk, int64_t taps, const int64_t* offset, acc_t* acc, acc_t* bias, const acc_t* gs,
    const acc_t* xt) {
  using V = Vec<acc_t>;
  const int64_t count = static_cast<int64_t>(walk.outputs.size());
  if (acc) for_tap_blocks(taps, LanesCorrelateOp<acc_t>{acc, gs, xt, offset, walk.outputs.data(), count});
  for (int64_t i0 = 0; bias && i0 < count; i0 += kLanesChunk) {
    typename V::type b = {};
    for (int64_t i = i0; i < std::min(count, i0 + kLanesChunk); ++i) b += V::load(gs + walk.outputs[i] * V::size);
    V::store(bias, V::load(bias) + b);
  }
}

// The grad_input tile (interior positions) of one grad_output tile: out (= or +=) the gather over
// each row class's taps (those whose rows of gs are not all gaps); `weight` one vector per tap.
template <typename acc_t>
ATEN_OVERRIDE_INLINE void lanes_gather_plane(
    const LanesWalk& walk, const int64_t* offset, acc_t* out, const acc_t* gs, const acc_t* weight, bool accumulate) {
  constexpr int64_t L = Vec<acc_t>::size;
  for (size_t c = 0; c + 1 < walk.class_begin.size(); ++c) {
    const int64_t begin = walk.class_begin[c], ntaps = walk.class_begin[c + 1] - begin;
    const int64_t* pos = walk.inputs.data() + walk.input_begin[c];
    const int64_t count = walk.input_begin[c + 1] - walk.input_begin[c];
    if (ntaps == 0) {
      for (int64_t i = 0; i < count && !accumulate; ++i) std::fill(out + pos[i] * L, out + (pos[i] + 1) * L, acc_t(0));
      continue;
    }
    for_tap_blocks(
        ntaps, LanesGatherOp<acc_t>{out, gs, weight, offset, walk.class_taps.data() + begin, accumulate, pos, count});
  }
}

ATEN_OVERRIDE_CLONES void lanes_correlate_f(
    const LanesWalk& walk, int64_t taps, const int64_t* o, float* acc, float* bias, const float* gs, const float* xt) {
  lanes_correlate_plane(walk, taps, o, acc, bias, gs, xt);
}
ATEN_OVERRIDE_CLONES void lanes_correlate_d(
    const LanesWalk& walk, int64_t taps, const int64_t* o, double* acc, double* bias, const double* gs,
    const double* xt) {
  lanes_correlate_plane(walk, taps, o, acc, bias, gs, xt);
}
ATEN_OVERRIDE_CLONES void lanes_gather_f(
    const LanesWalk& walk, const int64_t* o, float* out, const float* gs, const float* w, bool accumulate) {
  lanes_gather_plane(walk, o, out, gs, w, accumulate);
}
ATEN_OVERRIDE_CLONES void lanes_gather_d(
    const LanesWalk& walk, const int64_t* o, double* out, const double* gs, const double* w, bool accumulate) {
  lanes_gather_plane(walk, o, out, gs, w, accumulate);
}
inline void lanes_correlate(
    const LanesWalk& walk, int64_t taps, const int64_t* o, float* a, float* b, const float* gs, const float* xt) {
  lanes_correlate_f(walk, taps, o, a, b, gs, xt);
}
inline void lanes_correlate(
    const LanesWalk& walk, int64_t taps, const int64_t* o, double* a, double* b, const double* gs, const double* xt) {
  lanes_correlate_d(walk, taps, o, a, b, gs, xt);
}
inline void lanes_gather(const LanesWalk& walk, const int64_t* o, float* out, const float* gs, const float* w, bool acc) {
  lanes_gather_f(walk, o, out, gs, w, acc);
}
inline void lanes_gather(
    const LanesWalk& walk, const int64_t* o, double* out, const double* gs, const double* w, bool acc) {
  lanes_gather_d(walk, o, out, gs, w, acc);
}

// Largest input plane, and strided: largest grad_output plane, the channels-in-lanes kernel takes.
// Measured (float32 / bfloat16, 2 threads, MobileNetV2 / EfficientNet depthwise stages): stride 1,
// 7x7 to 10x10 planes 0.5-0.65x the per-plane kernel's time, 12x12 1.1x, 14x14 1.2x, 56x56 1.25x;
// stride 2, 14x14 to 56x56 inputs 0.45-0.75x, 112x112 1.05x.
constexpr int64_t kLanesMaxPlane = 128;
constexpr int64_t kLanesMaxStridedPlane = 1024;

// Whether the channels-in-lanes kernel computes p, with `lanes` channels per vector: small or strided
// planes, and enough channels to fill at least half the lanes.
bool lanes_kernel_applies(const DirectProblem& p, int64_t lanes) {
  const bool strided = p.stride[0] > 1 || p.stride[1] > 1 || p.stride[2] > 1;
  const int64_t in_plane = p.in[0] * p.in[1] * p.in[2], out_plane = p.out[0] * p.out[1] * p.out[2];
  return 2 * p.groups >= lanes && (in_plane <= kLanesMaxPlane || (strided && out_plane <= kLanesMaxStridedPlane));
}

// total[i] += partial[i], i < n (one sample's lane sums into the batch totals).
ATEN_OVERRIDE_CLONES void add_to_f(const float* partial, double* total, int64_t n) {
  for (int64_t i = 0; i < n; ++i) total[i] += static_cast<double>(partial[i]);
}
ATEN_OVERRIDE_CLONES void add_to_d(const double* partial, double* total, int64_t n) {
  for (int64_t i = 0; i < n; ++i) total[i] += partial[i];
}
inline void add_to(const float* partial, double* total, int64_t n) { add_to_f(partial, total, n); }
inline void add_to(const double* partial, double* total, int64_t n) { add_to_d(partial, total, n); }

// The channels-in-lanes kernel: same contract and task split as depthwise_impl, tasks of L channels.
template <typename scalar_t>
void depthwise_lanes_impl(
    const DirectProblem& p, const scalar_t* go, const scalar_t* x, const scalar_t* w, scalar_t* gi, scalar_t* gw,
    scalar_t* gb) {
  using acc_t = acc_type<scalar_t>;
  constexpr int64_t L = Vec<acc_t>::size;
  const Plane g = make_plane(p, 1);
  const int64_t channels = p.groups, multiplier = p.out_per_group;
  const int64_t in_plane = p.in[0] * p.in[1] * p.in[2], out_plane = p.out[0] * p.out[1] * p.out[2];
  const int64_t per_channel = multiplier * g.taps;
  const std::vector<int64_t> in_pos = input_positions(g), out_pos = output_positions(g);
  const LanesWalk walk = lanes_walk(g);
  std::vector<int64_t> offset(g.offset);
  for (auto& o : offset) o *= L;
  const bool by_channel = gw || gb;
  const int64_t blocks = (channels + L - 1) / L;
  const int64_t tasks = by_channel ? blocks : p.batch * blocks;
  const int64_t gi_bytes = gi ? p.batch * channels * in_plane * static_cast<int64_t>(sizeof(scalar_t)) : 0;
  if (gi) advise_huge_pages(gi, gi_bytes);
#ifdef ATEN_OVERRIDE_AVX512
  const bool stream = gi_bytes >= kStreamBytes && has_avx512();
#else
  const bool stream = false;
#endif
  for_each_chunk(tasks, p.batch * channels * (in_plane + multiplier * out_plane), [&](auto&& next_chunk) {
    // One block of grad_input planes (contiguous in grad_input), when streamed.
    std::vector<scalar_t> staging(stream ? L * in_plane : 0);
    // Tiles: input (zero borders), grad_output spread to tap-0 positions (zero gaps and margin), grad_input.
    std::vector<acc_t> xt(gw ? (g.size + 1) * L : 0, acc_t(0));
    std::vector<acc_t> gs((g.margin + g.size + 1) * L, acc_t(0));
    std::vector<acc_t> gp(gi ? (g.size + 1) * L : 0);
    // Per block: weight vectors, one sample's grad_weight / grad_bias vectors and their double totals.
    std::vector<acc_t> weight(gi ? per_channel * L : 0);
    std::vector<acc_t> acc(gw ? per_channel * L : 0), bias(gb ? multiplier * L : 0);
    std::vector<double> acc_total(acc.size()), bias_total(bias.size());
    acc_t* spread = gs.data() + g.margin * L;
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
        std::fill(acc_total.begin(), acc_total.end(), 0.0);
        std::fill(bias_total.begin(), bias_total.end(), 0.0);
        for (int64_t n = n_begin; n < n_end; ++n) {
          if (n + 1 < n_end) {
            prefetch(go + ((n + 1) * channels + c0) * multiplier * out_plane, lanes * multiplier * out_plane);
            if (gw) prefetch(x + ((n + 1) * channels + c0) * in_plane, lanes * in_plane);
          }
          std::fill(acc.begin(), acc.end(), acc_t(0));
          std::fill(bias.begin(), bias.end(), acc_t(0));
          if (gw) load_tiles(x + (n * channels + c0) * in_plane, in_plane, lanes, in_pos.data(), in_plane, xt.data());
          for (int64_t q = 0; q < multiplier; ++q) {
            // Output channels (c0 + l) * multiplier + q, l < lanes.
            load_tiles(
                go + ((n * channels + c0) * multiplier + q) * out_plane, multiplier * out_plane, lanes, out_pos.data(),
                out_plane, spread);
            lanes_correlate(
                walk, g.taps, offset.data(), gw ? acc.data() + q * g.taps * L : nullptr,
                gb ? bias.data() + q * L : nullptr, spread, xt.data());
            if (gi) lanes_gather(walk, offset.data(), gp.data(), spread, weight.data() + q * g.taps * L, q > 0);
          }
          if (gi) {
            scalar_t* out = gi + (n * channels + c0) * in_plane;
            store_tiles(gp.data(), in_pos.data(), in_plane, stream ? staging.data() : out, in_plane, lanes);
#ifdef ATEN_OVERRIDE_AVX512
            if (stream) {
              copy_streaming(
                  reinterpret_cast<const char*>(staging.data()), reinterpret_cast<char*>(out),
                  lanes * in_plane * static_cast<int64_t>(sizeof(scalar_t)));
            }
#endif
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


// --- Grouped layers: channels of a group in vector lanes ------------------------------------------
// ResNeXt's grouped layers (16 or 32 channels per group) are small GEMMs per group that im2col makes
// memory-bound. Here one sample's planes of one group are transposed into tiles of [padded
// position][channels of the group, padded to whole vectors], and both gradients are computed from
// the tiles directly, without columns:
//   grad_weight[co, ci, k] += sum_o go[o][co] * x[o * stride + offset[k]][ci]:
//     a vector of output channels times a broadcast input element, per (ci, k) pair;
//   grad_input[p][ci] = sum over the taps k of p's stride phase, and co, of
//     weight[k][co][ci] (a vector of input channels) * go[p - offset[k]][co] (broadcast),
//     four positions of one phase at a time, so each weight vector feeds four FMA chains.

// Where the grouped kernel applies, and its tile geometry.
struct GroupedTiles {
  int64_t ci_pad, co_pad;  // channels per group, rounded up to whole vectors
  int64_t bytes;           // tiles of one thread
};

template <typename acc_t>
GroupedTiles grouped_tiles(const DirectProblem& p, const Plane& g) {
  constexpr int64_t L = Vec<acc_t>::size;
  GroupedTiles t;
  t.ci_pad = (p.in_per_group + L - 1) / L * L;
  t.co_pad = (p.out_per_group + L - 1) / L * L;
  t.bytes = ((g.size + 1) * 2 * t.ci_pad + (g.margin + g.size + 1) * t.co_pad) * static_cast<int64_t>(sizeof(acc_t));
  return t;
}

// grad_input of `NP` positions j, j + step, ... (one stride phase of a row) over `ntaps` taps: the
// tile gp (pitch ci_pad) from gs (grad_output, pitch co_pad, from its margin) and wv ([k][co][ci_pad]).
// Each position sums into NA partial vectors (output channels c % NA), so that even one position
// runs NA independent FMA chains; they are added in a fixed order at the end.
template <int NP, int NA, typename acc_t>
ATEN_OVERRIDE_INLINE void grouped_gather_block(
    acc_t* gp, const acc_t* gs, const acc_t* wv, const int64_t* taps, int64_t ntaps, const int64_t* offset,
    int64_t co, int64_t co_pad, int64_t ci_pad, int64_t j, int64_t step) {
  using V = Vec<acc_t>;
  constexpr int64_t L = V::size;
  for (int64_t v = 0; v < ci_pad; v += L) {
    typename V::type s[NP][NA];
    for (int i = 0; i < NP; ++i)
      for (int a = 0; a < NA; ++a) s[i][a] = typename V::type{};
    for (int64_t t = 0; t < ntaps; ++t) {
      const int64_t k = taps[t];
      const acc_t* src = gs + (j - offset[k]) * co_pad;
      const acc_t* w = wv + k * co * ci_pad + v;
      int64_t c = 0;
      for (; c + NA <= co; c += NA) {
        for (int a = 0; a < NA; ++a) {
          const auto wk = V::load(w + (c + a) * ci_pad);
          for (int i = 0; i < NP; ++i) s[i][a] += wk * src[i * step * co_pad + c + a];
        }
      }
      for (; c < co; ++c) {
        const auto wk = V::load(w + c * ci_pad);
        for (int i = 0; i < NP; ++i) s[i][0] += wk * src[i * step * co_pad + c];
      }
    }
    for (int i = 0; i < NP; ++i) {
      for (int a = 1; a < NA; ++a) s[i][0] += s[i][a];
      V::store(gp + (j + i * step) * ci_pad + v, s[i][0]);
    }
  }
}

// acc[r] (NB vectors of output channels) += sum over the output positions opos[0 .. count) of
// gs[j][v .. v + L) * xt[j * ci_pad + xoff[r]] (xoff: offset[k] * ci_pad + ci of pair r),
// kLanesChunk positions at a time.
template <int NB, typename acc_t>
ATEN_OVERRIDE_INLINE void grouped_correlate_block(
    acc_t* acc, const acc_t* gs, const acc_t* xt, const int64_t* xoff, const int64_t* opos, int64_t count,
    int64_t co_pad, int64_t ci_pad, int64_t v) {
  using V = Vec<acc_t>;
  constexpr int64_t L = V::size;
  for (int64_t i0 = 0; i0 < count; i0 += kLanesChunk) {
    typename V::type sums[NB];
    for (int r = 0; r < NB; ++r) sums[r] = typename V::type{};
    for (int64_t i = i0; i < std::min(count, i0 + kLanesChunk); ++i) {
      const int64_t j = opos[i];
      const auto go = V::load(gs + j * co_pad + v);
      const acc_t* x = xt + j * ci_pad;
      for (int r = 0; r < NB; ++r) sums[r] += go * x[xoff[r]];
    }
    for (int r = 0; r < NB; ++r) V::store(acc + r * L, V::load(acc + r * L) + sums[r]);
  }
}

template <typename acc_t>
struct GroupedCorrelateOp {
  acc_t* acc;
  const acc_t* gs;
  const acc_t* xt;
  const int64_t* xoff;
  const int64_t* opos;
  int64_t count, co_pad, ci_pad, v;
  template <int NB>
  ATEN_OVERRIDE_INLINE void run(int64_t first, int64_t) const {
    grouped_correlate_block<NB>(acc + first * Vec<acc_t>::size, gs, xt, xoff + first, opos, count, co_pad, ci_pad, v);
  }
};

// The stride-phase classes of padded positions (t % stride_t, h % stride_h, w % stride_w) and the
// taps that reach each: class_taps[class_begin[c] .. class_begin[c + 1]).
struct PhaseTaps {
  std::vector<int64_t> class_taps, class_begin;
};

PhaseTaps phase_taps(const DirectProblem& p) {
  const int64_t classes = p.stride[0] * p.stride[1] * p.stride[2];
  std::vector<std::vector<int64_t>> by_class(classes);
  for (int64_t kt = 0, tap = 0; kt < p.kernel[0]; ++kt) {
    for (int64_t kh = 0; kh < p.kernel[1]; ++kh) {
      for (int64_t kw = 0; kw < p.kernel[2]; ++kw, ++tap) {
        const int64_t c = ((kt * p.dilation[0] % p.stride[0]) * p.stride[1] + kh * p.dilation[1] % p.stride[1]) *
                p.stride[2] + kw * p.dilation[2] % p.stride[2];
        by_class[c].push_back(tap);
      }
    }
  }
  PhaseTaps out;
  out.class_begin.push_back(0);
  for (const auto& taps : by_class) {
    out.class_taps.insert(out.class_taps.end(), taps.begin(), taps.end());
    out.class_begin.push_back(static_cast<int64_t>(out.class_taps.size()));
  }
  return out;
}

// grad_input tile of one group and sample: every interior position, by row and stride phase.
template <typename acc_t>
ATEN_OVERRIDE_INLINE void grouped_gather_plane(
    const Plane& g, const PhaseTaps& phases, const int64_t* offset, acc_t* gp, const acc_t* gs, const acc_t* wv,
    int64_t co, int64_t co_pad, int64_t ci_pad) {
  for (int64_t t = g.pad_t; t < g.pad_t + g.in_t; ++t) {
    for (int64_t h = g.pad_h; h < g.pad_h + g.in_h; ++h) {
      for (int64_t phase = 0; phase < g.stride_w; ++phase) {
        // Padded columns of this phase in [pad_w, pad_w + in_w).
        const int64_t c0 = g.pad_w + ((phase - g.pad_w) % g.stride_w + g.stride_w) % g.stride_w;
        if (c0 >= g.pad_w + g.in_w) continue;
        const int64_t count = (g.pad_w + g.in_w - 1 - c0) / g.stride_w + 1;
        const int64_t cls = ((t % g.stride_t) * g.stride_h + h % g.stride_h) * g.stride_w + phase;
        const int64_t begin = phases.class_begin[cls], ntaps = phases.class_begin[cls + 1] - begin;
        const int64_t* taps = phases.class_taps.data() + begin;
        const int64_t j0 = g.row(t, h) + c0;
        int64_t i = 0;
        for (; i + 4 <= count; i += 4) {
          grouped_gather_block<4, 1>(gp, gs, wv, taps, ntaps, offset, co, co_pad, ci_pad, j0 + i * g.stride_w, g.stride_w);
        }
        const int64_t j = j0 + i * g.stride_w;
        switch (count - i) {
          case 3: grouped_gather_block<3, 2>(gp, gs, wv, taps, ntaps, offset, co, co_pad, ci_pad, j, g.stride_w); break;
          case 2: grouped_gather_block<2, 2>(gp, gs, wv, taps, ntaps, offset, co, co_pad, ci_pad, j, g.stride_w); break;
          case 1: grouped_gather_block<1, 4>(gp, gs, wv, taps, ntaps, offset, co, co_pad, ci_pad, j, g.stride_w); break;
          default: break;
        }
      }
    }
  }
}

// grad_weight sums (acc: [co vector][pair][L]) of one group and sample.
template <typename acc_t>
ATEN_OVERRIDE_INLINE void grouped_correlate_plane(
    acc_t* acc, const acc_t* gs, const acc_t* xt, const int64_t* xoff, int64_t pairs, const int64_t* opos,
    int64_t count, int64_t co_pad, int64_t ci_pad) {
  constexpr int64_t L = Vec<acc_t>::size;
  for (int64_t v = 0; v < co_pad; v += L) {
    for_tap_blocks(pairs, GroupedCorrelateOp<acc_t>{acc + v / L * pairs * L, gs, xt, xoff, opos, count, co_pad, ci_pad, v});
  }
}

ATEN_OVERRIDE_CLONES void grouped_gather_f(
    const Plane& g, const PhaseTaps& ph, const int64_t* o, float* gp, const float* gs, const float* wv, int64_t co,
    int64_t co_pad, int64_t ci_pad) {
  grouped_gather_plane(g, ph, o, gp, gs, wv, co, co_pad, ci_pad);
}
ATEN_OVERRIDE_CLONES void grouped_gather_d(
    const Plane& g, const PhaseTaps& ph, const int64_t* o, double* gp, const double* gs, const double* wv, int64_t co,
    int64_t co_pad, int64_t ci_pad) {
  grouped_gather_plane(g, ph, o, gp, gs, wv, co, co_pad, ci_pad);
}
ATEN_OVERRIDE_CLONES void grouped_correlate_f(
    float* acc, const float* gs, const float* xt, const int64_t* xoff, int64_t pairs, const int64_t* opos,
    int64_t count, int64_t co_pad, int64_t ci_pad) {
  grouped_correlate_plane(acc, gs, xt, xoff, pairs, opos, count, co_pad, ci_pad);
}
ATEN_OVERRIDE_CLONES void grouped_correlate_d(
    double* acc, const double* gs, const double* xt, const int64_t* xoff, int64_t pairs, const int64_t* opos,
    int64_t count, int64_t co_pad, int64_t ci_pad) {
  grouped_correlate_plane(acc, gs, xt, xoff, pairs, opos, count, co_pad, ci_pad);
}
inline void grouped_gather(
    const Plane& g, const PhaseTaps& ph, const int64_t* o, float* gp, const float* gs, const float* wv, int64_t co,
    int64_t co_pad, int64_t ci_pad) {
  grouped_gather_f(g, ph, o, gp, gs, wv, co, co_pad, ci_pad);
}
inline void grouped_gather(
    const Plane& g, const PhaseTaps& ph, const int64_t* o, double* gp, const double* gs, const double* wv, int64_t co,
    int64_t co_pad, int64_t ci_pad) {
  grouped_gather_d(g, ph, o, gp, gs, wv, co, co_pad, ci_pad);
}
inline void grouped_correlate(
    float* acc, const float* gs, const float* xt, const int64_t* xoff, int64_t pairs, const int64_t* opos,
    int64_t count, int64_t co_pad, int64_t ci_pad) {
  grouped_correlate_f(acc, gs, xt, xoff, pairs, opos, count, co_pad, ci_pad);
}
inline void grouped_correlate(
    double* acc, const double* gs, const double* xt, const int64_t* xoff, int64_t pairs, const int64_t* opos,
    int64_t count, int64_t co_pad, int64_t ci_pad) {
  grouped_correlate_d(acc, gs, xt, xoff, pairs, opos, count, co_pad, ci_pad);
}

// Tasks: one group over the whole batch when grad_weight is wanted (its sums stay in one task, sample
// by sample), else (sample, group). Same summation order for any thread count.
template <typename scalar_t>
void grouped_lanes_impl(
    const DirectProblem& p, const scalar_t* go, const scalar_t* x, const scalar_t* w, scalar_t* gi, scalar_t* gw) {
  using acc_t = acc_type<scalar_t>;
  constexpr int64_t L = Vec<acc_t>::size;
  const Plane g = make_plane(p, 1);
  const GroupedTiles tiles = grouped_tiles<acc_t>(p, g);
  const int64_t ci = p.in_per_group, co = p.out_per_group, ci_pad = tiles.ci_pad, co_pad = tiles.co_pad;
  const int64_t groups = p.groups, taps = g.taps, pairs = ci * taps;
  const int64_t in_plane = p.in[0] * p.in[1] * p.in[2], out_plane = p.out[0] * p.out[1] * p.out[2];
  const std::vector<int64_t> in_pos = input_positions(g), out_pos = output_positions(g);
  const PhaseTaps phases = phase_taps(p);
  // Offsets into gs (margin included) of each output position, and into xt of each (ci, k) pair.
  std::vector<int64_t> opos(out_pos), xoff(pairs);
  for (auto& j : opos) j += g.margin;
  for (int64_t c = 0; c < ci; ++c) {
    for (int64_t k = 0; k < taps; ++k) xoff[c * taps + k] = (g.offset[k] - g.margin) * ci_pad + c;
  }
  const int64_t tasks = gw ? groups : p.batch * groups;
  const int64_t gi_bytes = gi ? p.batch * groups * ci * in_plane * static_cast<int64_t>(sizeof(scalar_t)) : 0;
  if (gi) advise_huge_pages(gi, gi_bytes);
#ifdef ATEN_OVERRIDE_AVX512
  const bool stream = gi_bytes >= kStreamBytes && has_avx512();
#else
  const bool stream = false;
#endif
  for_each_chunk(tasks, p.batch * groups * (ci * in_plane + co * out_plane), [&](auto&& next_chunk) {
    std::vector<scalar_t> staging(stream ? ci * in_plane : 0);
    // xt: input (zero borders); gs: grad_output at tap-0 positions (zero gaps and margin); gp: grad_input.
    std::vector<acc_t> xt(gw ? (g.size + 1) * ci_pad : 0, acc_t(0));
    std::vector<acc_t> gs((g.margin + g.size + 1) * co_pad, acc_t(0));
    std::vector<acc_t> gp(gi ? (g.size + 1) * ci_pad : 0);
    std::vector<acc_t> wv(gi ? taps * co * ci_pad : 0);
    std::vector<acc_t> acc(gw ? co_pad * pairs : 0);
    std::vector<double> acc_total(acc.size());
    acc_t* spread = gs.data() + g.margin * co_pad;
    for (auto [begin, end] = next_chunk(); begin < end; std::tie(begin, end) = next_chunk()) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t group = task % groups;
        const int64_t n_begin = gw ? 0 : task / groups, n_end = gw ? p.batch : n_begin + 1;
        for (int64_t k = 0; gi && k < taps; ++k) {
          for (int64_t o = 0; o < co; ++o) {
            for (int64_t c = 0; c < ci_pad; ++c) {
              wv[(k * co + o) * ci_pad + c] =
                  c < ci ? static_cast<acc_t>(w[((group * co + o) * ci + c) * taps + k]) : acc_t(0);
            }
          }
        }
        std::fill(acc_total.begin(), acc_total.end(), 0.0);
        for (int64_t n = n_begin; n < n_end; ++n) {
          const scalar_t* go_n = go + (n * groups + group) * co * out_plane;
          const scalar_t* x_n = x ? x + (n * groups + group) * ci * in_plane : nullptr;
          if (n + 1 < n_end) {
            prefetch(go_n + groups * co * out_plane, co * out_plane);
            if (gw) prefetch(x_n + groups * ci * in_plane, ci * in_plane);
          }
          for (int64_t c0 = 0; c0 < co; c0 += L) {
            load_tiles(go_n + c0 * out_plane, out_plane, std::min(L, co - c0), out_pos.data(), out_plane, spread + c0, co_pad);
          }
          if (gw) {
            for (int64_t c0 = 0; c0 < ci; c0 += L) {
              load_tiles(x_n + c0 * in_plane, in_plane, std::min(L, ci - c0), in_pos.data(), in_plane, xt.data() + c0, ci_pad);
            }
            std::fill(acc.begin(), acc.end(), acc_t(0));
            grouped_correlate(
                acc.data(), gs.data(), xt.data(), xoff.data(), pairs, opos.data(), out_plane, co_pad, ci_pad);
            add_to(acc.data(), acc_total.data(), static_cast<int64_t>(acc.size()));
          }
          if (gi) {
            grouped_gather(g, phases, g.offset.data(), gp.data(), spread, wv.data(), co, co_pad, ci_pad);
            scalar_t* out = gi + (n * groups + group) * ci * in_plane;
            scalar_t* dst = stream ? staging.data() : out;
            for (int64_t c0 = 0; c0 < ci; c0 += L) {
              store_tiles(gp.data() + c0, in_pos.data(), in_plane, dst + c0 * in_plane, in_plane, std::min(L, ci - c0), ci_pad);
            }
#ifdef ATEN_OVERRIDE_AVX512
            if (stream) {
              copy_streaming(
                  reinterpret_cast<const char*>(staging.data()), reinterpret_cast<char*>(out),
                  ci * in_plane * static_cast<int64_t>(sizeof(scalar_t)));
            }
#endif
          }
        }
        for (int64_t o = 0; gw && o < co; ++o) {
          for (int64_t r = 0; r < pairs; ++r) {
            gw[(group * co + o) * pairs + r] = static_cast<scalar_t>(acc_total[((o / L) * pairs + r) * L + o % L]);
          }
        }
      }
    }
    if (stream) store_fence();
  });
}

}  // namespace

const char* depthwise_cpu_kernel(const DirectProblem& p, at::ScalarType dtype) {
  const int64_t lanes = dtype == at::kDouble ? Vec<double>::size : Vec<float>::size;
  return lanes_kernel_applies(p, lanes) ? "channels-in-lanes" : "per-plane";
}

// Largest channels per group (input or output side) and tile bytes per thread (they stay in L2)
// the grouped kernel takes; larger groups are GEMMs that im2col serves well.
constexpr int64_t kGroupedMaxChannels = 64;
constexpr int64_t kGroupedMaxTileBytes = int64_t(1) << 20;

bool grouped_lanes_applies(const DirectProblem& p, at::ScalarType dtype) {
  if (p.groups < 2 || p.in_per_group < 2 || p.in_per_group > kGroupedMaxChannels ||
      p.out_per_group > kGroupedMaxChannels) {
    return false;
  }
  const Plane g = make_plane(p, 1);
  const int64_t bytes = dtype == at::kDouble ? grouped_tiles<double>(p, g).bytes : grouped_tiles<float>(p, g).bytes;
  return bytes <= kGroupedMaxTileBytes;
}

void grouped_lanes_backward_cpu(
    const DirectProblem& p, const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    at::Tensor* grad_input, at::Tensor* grad_weight) {
  TORCH_INTERNAL_ASSERT(p.in_per_group > 1 && grad_output.is_contiguous());
  TORCH_INTERNAL_ASSERT(!grad_input || (grad_input->is_contiguous() && weight.is_contiguous()));
  TORCH_INTERNAL_ASSERT(!grad_weight || (grad_weight->is_contiguous() && input.is_contiguous()));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, grad_output.scalar_type(), "grouped_lanes_backward_cpu", [&] {
    grouped_lanes_impl<scalar_t>(
        p, grad_output.const_data_ptr<scalar_t>(), grad_weight ? input.const_data_ptr<scalar_t>() : nullptr,
        grad_input ? weight.const_data_ptr<scalar_t>() : nullptr,
        grad_input ? grad_input->data_ptr<scalar_t>() : nullptr, grad_weight ? grad_weight->data_ptr<scalar_t>() : nullptr);
  });
}

void depthwise_backward_cpu(
    const DirectProblem& p, const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    at::Tensor* grad_input, at::Tensor* grad_weight, at::Tensor* grad_bias) {
  TORCH_INTERNAL_ASSERT(p.in_per_group == 1 && grad_output.is_contiguous());
  TORCH_INTERNAL_ASSERT(!grad_input || (grad_input->is_contiguous() && weight.is_contiguous()));
  TORCH_INTERNAL_ASSERT(!grad_weight || (grad_weight->is_contiguous() && input.is_contiguous()));
  TORCH_INTERNAL_ASSERT(!grad_bias || grad_bias->is_contiguous());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, grad_output.scalar_type(), "depthwise_backward_cpu", [&] {
    const auto data = [](at::Tensor* t) { return t ? t->data_ptr<scalar_t>() : nullptr; };
    const auto impl = lanes_kernel_applies(p, Vec<acc_type<scalar_t>>::size) ? depthwise_lanes_impl<scalar_t>
                                                                               : depthwise_impl<scalar_t>;
    impl(
        p, grad_output.const_data_ptr<scalar_t>(), grad_weight ? input.const_data_ptr<scalar_t>() : nullptr,
        grad_input ? weight.const_data_ptr<scalar_t>() : nullptr, data(grad_input), data(grad_weight), data(grad_bias));
  });
}

}  // namespace aten_override
