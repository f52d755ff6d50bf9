// Building blocks shared by the fused CPU kernels of the compiled backend (cpu/depthwise.cpp: the
// depthwise kernels; cpu/grouped.cpp: the grouped-lanes kernel): vectors, the zero-padded plane and
// its tap offsets, tap blocks, row moves with conversion, the [position][channel] tiles of the
// channels-in-lanes kernels and their 16x16 transposes, and the task split over threads.
#pragma once

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

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && defined(__linux__)
#define ATEN_OVERRIDE_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define ATEN_OVERRIDE_CLONES
#endif
#define ATEN_OVERRIDE_INLINE inline __attribute__((always_inline))
// The same for a lambda (after its parameter list): inlined, its body takes the caller's target clone.
#define ATEN_OVERRIDE_ALWAYS_INLINE __attribute__((always_inline))
// Fully unrolls the loop that follows (loops over compile-time register blocks: left rolled, their arrays
// of vectors would live in memory).
#if defined(__clang__)
#define ATEN_OVERRIDE_UNROLL _Pragma("unroll")
#elif defined(__GNUC__)
#define ATEN_OVERRIDE_UNROLL _Pragma("GCC unroll 64")
#else
#define ATEN_OVERRIDE_UNROLL
#endif

namespace aten_override {
namespace fused {

// 64-byte vectors (GCC/Clang vector extensions): one AVX-512 register in the x86-64-v4 clone, two
// AVX2 registers in the v3 one. Loads and stores are unaligned.
template <typename acc_t>
struct Vec {
  typedef acc_t type __attribute__((vector_size(64), aligned(sizeof(acc_t))));
  using value_type = acc_t;
  static constexpr int64_t size = 64 / sizeof(acc_t);
  static ATEN_OVERRIDE_INLINE type load(const acc_t* p) { return *reinterpret_cast<const type*>(p); }
  static ATEN_OVERRIDE_INLINE void store(acc_t* p, type v) { *reinterpret_cast<type*>(p) = v; }
};

// The same 64 bytes as two 32-byte vectors: what the vector micro-kernels compute in where the CPU has
// no AVX-512 (fused::wide_vectors() picks), two AVX2 registers per vector. GCC 12 splits Vec into
// AVX2 halves but keeps arrays of Vec (the micro-kernels' accumulators) in memory: on a Zen 3 core
// (AVX2, 2026-12-03) the GEMM micro-kernel ran at 3-7 GFLOP/s on Vec and 66-75 on this pair, and
// pointwise-fused took 8-21x native's time. The data layouts (channels padded to Vec::size) are the
// same for both.
// The functions compiled per ISA level (ATEN_OVERRIDE_CLONES) run the code of one or the other as
// wide_vectors() (convolution_backward.h) says: a target clone cannot tell at compile time which ISA it
// was built for.
template <typename acc_t>
struct VecPair {
  typedef acc_t half __attribute__((vector_size(32), aligned(sizeof(acc_t))));
  struct type {
    using value_type = acc_t;
    half lo, hi;
    friend ATEN_OVERRIDE_INLINE type operator+(type a, type b) { return {a.lo + b.lo, a.hi + b.hi}; }
    friend ATEN_OVERRIDE_INLINE type operator*(acc_t e, type b) { return {e * b.lo, e * b.hi}; }
    friend ATEN_OVERRIDE_INLINE type operator*(type a, type b) { return {a.lo * b.lo, a.hi * b.hi}; }
    friend ATEN_OVERRIDE_INLINE type operator*(type a, acc_t e) { return {a.lo * e, a.hi * e}; }
    friend ATEN_OVERRIDE_INLINE type operator-(type a, type b) { return {a.lo - b.lo, a.hi - b.hi}; }
    friend ATEN_OVERRIDE_INLINE type operator-(type a) { return {-a.lo, -a.hi}; }
    ATEN_OVERRIDE_INLINE type& operator+=(type b) {
      lo += b.lo, hi += b.hi;
      return *this;
    }
  };
  using value_type = acc_t;
  static constexpr int64_t size = Vec<acc_t>::size;
  static ATEN_OVERRIDE_INLINE type load(const acc_t* p) {
    return {*reinterpret_cast<const half*>(p), *reinterpret_cast<const half*>(p + size / 2)};
  }
  static ATEN_OVERRIDE_INLINE void store(acc_t* p, type v) {
    *reinterpret_cast<half*>(p) = v.lo;
    *reinterpret_cast<half*>(p + size / 2) = v.hi;
  }
};

// n rounded up to a whole number of acc_t vectors (channels padded to the vector width).
template <typename acc_t>
ATEN_OVERRIDE_INLINE int64_t round_up(int64_t n) {
  return (n + Vec<acc_t>::size - 1) / Vec<acc_t>::size * Vec<acc_t>::size;
}

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
  // The stride-phase class (phase_taps') of padded position (t, h, w).
  int64_t phase_class(int64_t t, int64_t h, int64_t w) const {
    return ((t % stride_t) * stride_h + h % stride_h) * stride_w + w % stride_w;
  }
  // grad_output positions span [0, span) in gs (from its margin); interior of xp / grad_input [first, last).
  int64_t span() const { return out_row(out_t - 1, out_h - 1) + (out_w - 1) * stride_w + 1; }
  int64_t first() const { return in_row(0, 0); }
  int64_t last() const { return in_row(in_t - 1, in_h - 1) + in_w; }
};

// Concatenates `lists` into `items`: list c is items[begin[c] .. begin[c + 1]).
inline void flatten(
    const std::vector<std::vector<int64_t>>& lists, std::vector<int64_t>& items, std::vector<int64_t>& begin) {
  begin.assign(1, 0);
  for (const auto& list : lists) {
    items.insert(items.end(), list.begin(), list.end());
    begin.push_back(static_cast<int64_t>(items.size()));
  }
}

inline Plane make_plane(const DirectProblem& p, int64_t lanes) {
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
  flatten(by_class, g.class_taps, g.class_begin);
  return g;
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
inline ATEN_OVERRIDE_AVX512 __m512 load_row(const float* src, __mmask16 m) { return _mm512_maskz_loadu_ps(m, src); }
inline ATEN_OVERRIDE_AVX512 __m512 load_row(const c10::BFloat16* src, __mmask16 m) {
  const __m256i bits = _mm256_maskz_loadu_epi16(m, src);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline ATEN_OVERRIDE_AVX512 void store_row(float* dst, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(dst, m, v); }
// float -> bfloat16 rounded to nearest even, NaN -> 0x7fc0 (c10::BFloat16's conversion).
inline ATEN_OVERRIDE_AVX512 void store_row(c10::BFloat16* dst, __m512 v, __mmask16 m) {
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

inline bool has_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl");
  return yes;
}

// memcpy whose whole cache lines bypass the cache (non-temporal stores: no read of the destination
// line before it is overwritten). The caller issues the store fence. grad_input is written once and
// never read here, so this saves a quarter of a memory-bound layer's traffic.
inline ATEN_OVERRIDE_AVX512 void copy_streaming_avx512(const char* src, char* dst, int64_t bytes) {
  const int64_t head = std::min<int64_t>(bytes, (64 - reinterpret_cast<uintptr_t>(dst) % 64) % 64);
  std::memcpy(dst, src, head);
  int64_t i = head;
  for (; i + 64 <= bytes; i += 64) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), _mm512_loadu_si512(src + i));
  }
  std::memcpy(dst + i, src + i, bytes - i);
}

#define ATEN_OVERRIDE_AVX2 __attribute__((target("avx2,fma")))

inline bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}

// The AVX2 versions of the moves above, 8 floats per register: CPUs without AVX-512 (Zen 3 and
// older) otherwise moved tiles one element at a time, 40% of a depthwise lanes walk's time on Zen 3.
// Rows of n < 8 elements go through a zeroed buffer (AVX2 has no 16-bit masked loads).
inline ATEN_OVERRIDE_AVX2 __m256 load8(const float* src) { return _mm256_loadu_ps(src); }
inline ATEN_OVERRIDE_AVX2 __m256 load8(const c10::BFloat16* src) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline ATEN_OVERRIDE_AVX2 void store8(float* dst, __m256 v) { _mm256_storeu_ps(dst, v); }
// float -> bfloat16 rounded to nearest even, NaN -> 0x7fc0 (c10::BFloat16's conversion).
inline ATEN_OVERRIDE_AVX2 void store8(c10::BFloat16* dst, __m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);  // 8 x 16 bits, in order
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_castsi256_si128(packed));
}
// float rows of n < 8 are read with AVX2's masked load instead: through the buffer (a libc memcpy, then
// a 32-byte load of what it stored in narrower pieces, which the store buffer cannot forward) the last
// positions of 7x7 planes were a third of load_tiles' time (perf, MobileNetV2's features.17 on Zen 3:
// load_tiles 0.93x the walks' time before, 0.57x after). Masked-off elements are not read (no fault
// past the row's end).
inline ATEN_OVERRIDE_AVX2 __m256i first_lanes8(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
template <typename T>
ATEN_OVERRIDE_AVX2 ATEN_OVERRIDE_INLINE __m256 load_row8(const T* src, int64_t n) {
  if (n >= 8) return load8(src);
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_maskload_ps(src, first_lanes8(n));
  } else {
    T buf[8] = {};
    std::memcpy(buf, src, n * sizeof(T));
    return load8(buf);
  }
}
// (Stores keep the buffer: its 32-byte store forwards to memcpy's narrower loads; AVX2's masked store
// measured no faster in the same profile.)
template <typename T>
ATEN_OVERRIDE_AVX2 ATEN_OVERRIDE_INLINE void store_row8(T* dst, __m256 v, int64_t n) {
  if (n >= 8) return store8(dst, v);
  T buf[8];
  store8(buf, v);
  std::memcpy(dst, buf, n * sizeof(T));
}

template <typename From, typename To>
ATEN_OVERRIDE_AVX2 void move_rows_avx2(
    const From* src, int64_t src_pitch, To* dst, int64_t dst_pitch, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r, src += src_pitch, dst += dst_pitch) {
    for (int64_t i = 0; i < n; i += 8) store_row8(dst + i, load_row8(src + i, n - i), n - i);
  }
}

inline ATEN_OVERRIDE_AVX2 void copy_streaming_avx2(const char* src, char* dst, int64_t bytes) {
  const int64_t head = std::min<int64_t>(bytes, (32 - reinterpret_cast<uintptr_t>(dst) % 32) % 32);
  std::memcpy(dst, src, head);
  int64_t i = head;
  for (; i + 32 <= bytes; i += 32) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
  }
  std::memcpy(dst + i, src + i, bytes - i);
}

// The AVX-512 moves run where the CPU has AVX-512 and the vector code computes in Vec (so forcing
// 'pair' vectors on an AVX-512 CPU runs, and tests, the AVX2 moves); the AVX2 moves elsewhere.
inline bool avx512_moves() {
  return has_avx512() && wide_vectors();
}

// Non-temporal stores (copy_streaming) exist on this CPU.
inline bool has_streaming() {
  return has_avx512() || has_avx2();
}

// copy_streaming_avx512 or copy_streaming_avx2, whichever the CPU runs.
inline void copy_streaming(const char* src, char* dst, int64_t bytes) {
  if (has_avx512()) return copy_streaming_avx512(src, dst, bytes);
  copy_streaming_avx2(src, dst, bytes);
}
#endif

template <typename From, typename To>
void move_rows(
    const From* src, int64_t src_pitch, To* dst, int64_t dst_pitch, int64_t dst_step, int64_t rows, int64_t n) {
#ifdef ATEN_OVERRIDE_AVX512
  constexpr bool fast = (std::is_same_v<From, float> || std::is_same_v<From, c10::BFloat16>) &&
      (std::is_same_v<To, float> || std::is_same_v<To, c10::BFloat16>);
  if constexpr (fast) {
    if (dst_step == 1 && avx512_moves()) return move_rows_avx512(src, src_pitch, dst, dst_pitch, rows, n);
    if (dst_step == 1 && has_avx2()) return move_rows_avx2(src, src_pitch, dst, dst_pitch, rows, n);
  }
#endif
  move_rows_generic(src, src_pitch, dst, dst_pitch, dst_step, rows, n);
}

// Makes this thread's non-temporal stores (copy_streaming) visible before it leaves the parallel region.
inline void store_fence() {
#ifdef ATEN_OVERRIDE_AVX512
  _mm_sfence();
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

// The stride-phase classes of padded positions (t % stride_t, h % stride_h, w % stride_w) and the
// taps that reach each: class_taps[class_begin[c] .. class_begin[c + 1]). The channels-in-lanes
// walks (cpu/depthwise.cpp, cpu/grouped.cpp) gather each padded position from its class's taps alone:
// the others meet only the zeros between spread grad_output positions.
struct PhaseTaps {
  std::vector<int64_t> class_taps, class_begin;
};

inline PhaseTaps phase_taps(const DirectProblem& p) {
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
  flatten(by_class, out.class_taps, out.class_begin);
  return out;
}

// Padded position index (in a Plane, lanes = 1) of each input position, in (t, h, w) order.
inline std::vector<int64_t> input_positions(const Plane& g) {
  std::vector<int64_t> out;
  out.reserve(g.in_t * g.in_h * g.in_w);
  for (int64_t t = 0; t < g.in_t; ++t)
    for (int64_t h = 0; h < g.in_h; ++h)
      for (int64_t w = 0; w < g.in_w; ++w) out.push_back(g.in_row(t, h) + w);
  return out;
}

// Padded position of tap 0 of each grad_output position, in (t, h, w) order.
inline std::vector<int64_t> output_positions(const Plane& g) {
  std::vector<int64_t> out;
  out.reserve(g.out_t * g.out_h * g.out_w);
  for (int64_t t = 0; t < g.out_t; ++t)
    for (int64_t h = 0; h < g.out_h; ++h)
      for (int64_t w = 0; w < g.out_w; ++w) out.push_back(g.out_row(t, h) + w * g.stride_w);
  return out;
}

// dst[(index[i] - base) * pitch + l] = src[l * lane_stride + i * pos_stride] for the first `lanes` of L
// lanes (0 in the others), i < positions: `lanes` planes into one vector per position of a tile whose
// positions are `pitch` elements apart (L: one vector of channels; more: several, filled one call
// each). A tile that holds part of a plane (depthwise bands) starts at position `base`. Planes are
// rows (pos_stride 1, NCHW) or, channels-last (NHWC), positions of `lanes` channels (lane_stride 1).
template <typename scalar_t, typename acc_t>
void load_tiles_generic(
    const scalar_t* src, int64_t lane_stride, int64_t lanes, const int64_t* index, int64_t positions, acc_t* dst,
    int64_t pitch, int64_t base, int64_t pos_stride) {
  constexpr int64_t L = Vec<acc_t>::size;
  for (int64_t i = 0; i < positions; ++i) {
    acc_t* d = dst + (index[i] - base) * pitch;
    for (int64_t l = 0; l < L; ++l) {
      d[l] = l < lanes ? static_cast<acc_t>(src[l * lane_stride + i * pos_stride]) : acc_t(0);
    }
  }
}

// dst[l * lane_stride + i * pos_stride] = src[(index[i] - base) * pitch + l] for l < lanes: tiles back
// into planes.
template <typename scalar_t, typename acc_t>
void store_tiles_generic(
    const acc_t* src, int64_t pitch, const int64_t* index, int64_t positions, scalar_t* dst, int64_t lane_stride,
    int64_t lanes, int64_t base, int64_t pos_stride) {
  for (int64_t l = 0; l < lanes; ++l) {
    for (int64_t i = 0; i < positions; ++i) {
      dst[l * lane_stride + i * pos_stride] = static_cast<scalar_t>(src[(index[i] - base) * pitch + l]);
    }
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
    int64_t pitch, int64_t base) {
  for (int64_t i0 = 0; i0 < positions; i0 += 16) {
    const int64_t n = std::min<int64_t>(16, positions - i0);
    const __mmask16 m = static_cast<__mmask16>(n == 16 ? 0xffff : (1u << n) - 1);
    __m512 r[16];
    for (int l = 0; l < 16; ++l) r[l] = l < lanes ? load_row(src + l * lane_stride + i0, m) : _mm512_setzero_ps();
    transpose16(r);
    for (int64_t i = 0; i < n; ++i) _mm512_storeu_ps(dst + (index[i0 + i] - base) * pitch, r[i]);
  }
}

// Channels-last planes (lane_stride 1): each position's `lanes` channels are one masked vector load.
template <typename scalar_t>
ATEN_OVERRIDE_AVX512 void load_positions_avx512(
    const scalar_t* src, int64_t pos_stride, int64_t lanes, const int64_t* index, int64_t positions, float* dst,
    int64_t pitch, int64_t base) {
  const __mmask16 m = static_cast<__mmask16>(lanes >= 16 ? 0xffff : (1u << lanes) - 1);
  for (int64_t i = 0; i < positions; ++i) _mm512_storeu_ps(dst + (index[i] - base) * pitch, load_row(src + i * pos_stride, m));
}

template <typename scalar_t>
ATEN_OVERRIDE_AVX512 void store_positions_avx512(
    const float* src, int64_t pitch, const int64_t* index, int64_t positions, scalar_t* dst, int64_t pos_stride,
    int64_t lanes, int64_t base) {
  const __mmask16 m = static_cast<__mmask16>(lanes >= 16 ? 0xffff : (1u << lanes) - 1);
  for (int64_t i = 0; i < positions; ++i) store_row(dst + i * pos_stride, _mm512_loadu_ps(src + (index[i] - base) * pitch), m);
}

template <typename scalar_t>
ATEN_OVERRIDE_AVX512 void store_tiles_avx512(
    const float* src, int64_t pitch, const int64_t* index, int64_t positions, scalar_t* dst, int64_t lane_stride,
    int64_t lanes, int64_t base) {
  for (int64_t i0 = 0; i0 < positions; i0 += 16) {
    const int64_t n = std::min<int64_t>(16, positions - i0);
    const __mmask16 m = static_cast<__mmask16>(n == 16 ? 0xffff : (1u << n) - 1);
    __m512 r[16];
    for (int64_t i = 0; i < 16; ++i) {
      r[i] = i < n ? _mm512_loadu_ps(src + (index[i0 + i] - base) * pitch) : _mm512_setzero_ps();
    }
    transpose16(r);
    for (int64_t l = 0; l < lanes; ++l) store_row(dst + l * lane_stride + i0, r[l], m);
  }
}

// In-place transpose of the 8x8 matrix whose rows are r[0..8).
ATEN_OVERRIDE_AVX2 ATEN_OVERRIDE_INLINE void transpose8(__m256 r[8]) {
  __m256 t[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    r[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    r[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
    r[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    r[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
  }
  for (int j = 0; j < 4; ++j) {
    t[j] = _mm256_permute2f128_ps(r[j], r[4 + j], 0x20);
    t[4 + j] = _mm256_permute2f128_ps(r[j], r[4 + j], 0x31);
  }
  for (int j = 0; j < 8; ++j) r[j] = t[j];
}

// load_tiles_avx512 in 8x8 blocks: 8 positions x lanes 8h .. 8h + 8 of the 16.
template <typename scalar_t>
ATEN_OVERRIDE_AVX2 void load_tiles_avx2(
    const scalar_t* src, int64_t lane_stride, int64_t lanes, const int64_t* index, int64_t positions, float* dst,
    int64_t pitch, int64_t base) {
  for (int64_t i0 = 0; i0 < positions; i0 += 8) {
    const int64_t n = std::min<int64_t>(8, positions - i0);
    for (int h = 0; h < 2; ++h) {
      __m256 r[8];
      for (int l = 0; l < 8; ++l) {
        r[l] = 8 * h + l < lanes ? load_row8(src + (8 * h + l) * lane_stride + i0, n) : _mm256_setzero_ps();
      }
      transpose8(r);
      for (int64_t i = 0; i < n; ++i) _mm256_storeu_ps(dst + (index[i0 + i] - base) * pitch + 8 * h, r[i]);
    }
  }
}

template <typename scalar_t>
ATEN_OVERRIDE_AVX2 void store_tiles_avx2(
    const float* src, int64_t pitch, const int64_t* index, int64_t positions, scalar_t* dst, int64_t lane_stride,
    int64_t lanes, int64_t base) {
  for (int64_t i0 = 0; i0 < positions; i0 += 8) {
    const int64_t n = std::min<int64_t>(8, positions - i0);
    for (int h = 0; h < 2 && 8 * h < lanes; ++h) {
      __m256 r[8];
      for (int64_t i = 0; i < 8; ++i) {
        r[i] = i < n ? _mm256_loadu_ps(src + (index[i0 + i] - base) * pitch + 8 * h) : _mm256_setzero_ps();
      }
      transpose8(r);
      for (int64_t l = 0; l < std::min<int64_t>(8, lanes - 8 * h); ++l) {
        store_row8(dst + (8 * h + l) * lane_stride + i0, r[l], n);
      }
    }
  }
}

// Channels-last planes (lane_stride 1): each position's `lanes` channels, two registers.
template <typename scalar_t>
ATEN_OVERRIDE_AVX2 void load_positions_avx2(
    const scalar_t* src, int64_t pos_stride, int64_t lanes, const int64_t* index, int64_t positions, float* dst,
    int64_t pitch, int64_t base) {
  for (int64_t i = 0; i < positions; ++i) {
    float* d = dst + (index[i] - base) * pitch;
    const scalar_t* p = src + i * pos_stride;
    _mm256_storeu_ps(d, lanes > 0 ? load_row8(p, lanes) : _mm256_setzero_ps());
    _mm256_storeu_ps(d + 8, lanes > 8 ? load_row8(p + 8, lanes - 8) : _mm256_setzero_ps());
  }
}

template <typename scalar_t>
ATEN_OVERRIDE_AVX2 void store_positions_avx2(
    const float* src, int64_t pitch, const int64_t* index, int64_t positions, scalar_t* dst, int64_t pos_stride,
    int64_t lanes, int64_t base) {
  for (int64_t i = 0; i < positions; ++i) {
    const float* s = src + (index[i] - base) * pitch;
    scalar_t* d = dst + i * pos_stride;
    if (lanes > 0) store_row8(d, _mm256_loadu_ps(s), lanes);
    if (lanes > 8) store_row8(d + 8, _mm256_loadu_ps(s + 8), lanes - 8);
  }
}
#endif

template <typename scalar_t, typename acc_t>
constexpr bool kAvx512Tiles = std::is_same_v<acc_t, float> &&
    (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>);

template <typename scalar_t, typename acc_t>
void load_tiles(
    const scalar_t* src, int64_t lane_stride, int64_t lanes, const int64_t* index, int64_t positions, acc_t* dst,
    int64_t pitch = Vec<acc_t>::size, int64_t base = 0, int64_t pos_stride = 1) {
#ifdef ATEN_OVERRIDE_AVX512
  if constexpr (kAvx512Tiles<scalar_t, acc_t>) {
    const bool avx512 = avx512_moves();
    if (pos_stride == 1 && avx512) return load_tiles_avx512(src, lane_stride, lanes, index, positions, dst, pitch, base);
    if (lane_stride == 1 && avx512) return load_positions_avx512(src, pos_stride, lanes, index, positions, dst, pitch, base);
    if (pos_stride == 1 && has_avx2()) return load_tiles_avx2(src, lane_stride, lanes, index, positions, dst, pitch, base);
    if (lane_stride == 1 && has_avx2()) return load_positions_avx2(src, pos_stride, lanes, index, positions, dst, pitch, base);
  }
#endif
  load_tiles_generic(src, lane_stride, lanes, index, positions, dst, pitch, base, pos_stride);
}

template <typename scalar_t, typename acc_t>
void store_tiles(
    const acc_t* src, const int64_t* index, int64_t positions, scalar_t* dst, int64_t lane_stride, int64_t lanes,
    int64_t pitch = Vec<acc_t>::size, int64_t base = 0, int64_t pos_stride = 1) {
#ifdef ATEN_OVERRIDE_AVX512
  if constexpr (kAvx512Tiles<scalar_t, acc_t>) {
    const bool avx512 = avx512_moves();
    if (pos_stride == 1 && avx512) return store_tiles_avx512(src, pitch, index, positions, dst, lane_stride, lanes, base);
    if (lane_stride == 1 && avx512) return store_positions_avx512(src, pitch, index, positions, dst, pos_stride, lanes, base);
    if (pos_stride == 1 && has_avx2()) return store_tiles_avx2(src, pitch, index, positions, dst, lane_stride, lanes, base);
    if (lane_stride == 1 && has_avx2()) return store_positions_avx2(src, pitch, index, positions, dst, pos_stride, lanes, base);
  }
#endif
  store_tiles_generic(src, pitch, index, positions, dst, lane_stride, lanes, base, pos_stride);
}

// Positions a running float32 sum covers before it is added into the sample's grad_weight /
// grad_bias sums (both lanes kernels). One running sum over a strided 1-D plane's 1,024 positions
// of mean-1 data measured 7-12 eps of grad_weight against native's 1.2; in chunks 1.2-2.4 eps
// (tests/ops/convolution_backward/test_compiled_adversarial.py).
constexpr int64_t kLanesChunk = 32;

// --- Small matrix products in vector registers (cpu/pointwise.cpp, cpu/winograd.cpp, cpu/kn2row.cpp) ---
// c (m x n) += a (m x k) @ b (k x n) (or = when not accumulating), b and c row-major with n a whole number of vectors, a with any
// strides (element (i, kk) at a[i * a_row + kk * a_col]: row-major, or a transposed view). Each
// micro-kernel keeps a block of c in registers, Rows<V> rows x Cols<V> vectors; per kk, a broadcast
// element of a times a vector of b per FMA. No packing: b's rows are re-read from L1/L2 for each block
// of rows, so the operands of one call should fit the L2 (the callers' chunks do). Why not BLAS: MKL's
// sgemm runs its AVX2 code on AMD CPUs (a Zen 5 core: 96 GFLOP/s against 199 in oneDNN's AVX-512
// convolutions), and these products are small (a chunk's 16 Winograd GEMMs; a pointwise layer's
// grad_weight over one chunk of positions).
//
// The register blocks per vector type (fused::wide_vectors()): AVX-512 has 32 registers, 8 x 3 accumulators;
// AVX2 16, and each VecPair takes two: 6 x 1 (12 accumulators, 2 for b's vector, 1 broadcast; on a Zen 3
// core 75 GFLOP/s, against 53-66 for 8 x 1, 4 x 1 and 3 x 2). The sums' order does not depend on them.
template <typename V>
constexpr int Rows = 8;
template <typename V>
constexpr int Cols = 3;
template <typename acc_t>
constexpr int Rows<VecPair<acc_t>> = 6;
template <typename acc_t>
constexpr int Cols<VecPair<acc_t>> = 1;
// Terms of k summed in registers before they are added to c: a float32 sum then runs over at most
// kGemmBlock terms at each level (one running sum of a pointwise chunk's ~1,000 mean-1 products
// measured 7.5 eps of grad_weight where native has 2.1).
constexpr int64_t kGemmBlock = 64;

// A tick called once per term of k (gemm_block's `tick`): nothing. pointwise-fused passes one that asks
// for the next chunk's rows, a few lines per tick.
struct NoTick {
  ATEN_OVERRIDE_INLINE void operator()() const {}
};

template <typename V, int R, int NV, typename acc_t, typename Tick>
ATEN_OVERRIDE_INLINE void gemm_tile(
    const acc_t* a, int64_t a_row, int64_t a_col, const acc_t* b, int64_t ldb, int64_t k, acc_t* c, int64_t ldc,
    bool accumulate, Tick&& tick) {
  constexpr int64_t L = V::size;
  for (int64_t k0 = 0; k0 < k; k0 += kGemmBlock) {
    const int64_t k1 = std::min(k, k0 + kGemmBlock);
    // Every index of acc a constant (unrolled loops): with a variable one GCC kept acc in memory,
    // zeroed per call by a `rep stos`.
    typename V::type acc[R][NV];
    ATEN_OVERRIDE_UNROLL
    for (int r = 0; r < R; ++r) {
      ATEN_OVERRIDE_UNROLL
      for (int v = 0; v < NV; ++v) acc[r][v] = typename V::type{};
    }
    const acc_t* a_k = a + k0 * a_col;
    const acc_t* b_k = b + k0 * ldb;
    for (int64_t kk = k0; kk < k1; ++kk, a_k += a_col, b_k += ldb) {
      tick();
      typename V::type bv[NV];
      ATEN_OVERRIDE_UNROLL
      for (int v = 0; v < NV; ++v) bv[v] = V::load(b_k + v * L);
      ATEN_OVERRIDE_UNROLL
      for (int r = 0; r < R; ++r) {
        const acc_t e = a_k[r * a_row];
        ATEN_OVERRIDE_UNROLL
        for (int v = 0; v < NV; ++v) acc[r][v] += e * bv[v];
      }
    }
    ATEN_OVERRIDE_UNROLL
    for (int r = 0; r < R; ++r) {
      ATEN_OVERRIDE_UNROLL
      for (int v = 0; v < NV; ++v) {
        acc_t* out = c + r * ldc + v * L;
        V::store(out, accumulate || k0 > 0 ? V::load(out) + acc[r][v] : acc[r][v]);
      }
    }
  }
}

// gemm_tile with R rows and the largest NV <= Cols<V> that is not over `vecs`.
template <typename V, int R, int NV = Cols<V>, typename acc_t, typename Tick>
ATEN_OVERRIDE_INLINE void gemm_tile_vecs(
    const acc_t* a, int64_t a_row, int64_t a_col, const acc_t* b, int64_t ldb, int64_t k, acc_t* c, int64_t ldc,
    int vecs, bool accumulate, Tick&& tick) {
  if constexpr (NV > 1) {
    if (vecs < NV) return gemm_tile_vecs<V, R, NV - 1>(a, a_row, a_col, b, ldb, k, c, ldc, vecs, accumulate, tick);
  }
  gemm_tile<V, R, NV>(a, a_row, a_col, b, ldb, k, c, ldc, accumulate, tick);
}

// One micro-kernel: `rows` (<= Rows<V>) rows x `vecs` (<= Cols<V>) vectors of c; tick() once per term of k.
template <typename V, int R = Rows<V>, typename acc_t, typename Tick = NoTick>
ATEN_OVERRIDE_INLINE void gemm_block(
    const acc_t* a, int64_t a_row, int64_t a_col, const acc_t* b, int64_t ldb, int64_t k, acc_t* c, int64_t ldc,
    int rows, int vecs, bool accumulate = true, Tick&& tick = Tick{}) {
  if constexpr (R > 1) {
    if (rows < R) return gemm_block<V, R - 1>(a, a_row, a_col, b, ldb, k, c, ldc, rows, vecs, accumulate, tick);
  }
  gemm_tile_vecs<V, R>(a, a_row, a_col, b, ldb, k, c, ldc, vecs, accumulate, tick);
}

// Terms of k per pass over c: all of k while a block of b's columns over all of k (k x Cols<V> vectors)
// fits half the L2, where it stays across the row blocks; else kGemmBlock, so that it stays in L1 (12
// KiB with Vec<float>) at the cost of a pass over c per chunk. A multiple of kGemmBlock either way, so
// c's sums are added in the same order: the same bits. One Zen 4 core (1 MiB of L2), float32, Vec:
// wav2vec2's grad_weight product (512 x 512, k = 12,792) at 30 GFLOP/s in one pass (each 2.4 MiB block
// of b's columns streamed from L3 once per 8 rows), 96 in chunks of 64 (77 in chunks of 256); its
// grad_input product (1,600 x 512, k = 512: a 96 KiB block) at 100 in one pass, 83 in chunks of 64.
template <typename V>
ATEN_OVERRIDE_INLINE int64_t gemm_chunk(int64_t k) {
  const int64_t l2 = l2_bytes();
  return k * Cols<V> * int64_t(sizeof(typename V::type)) > l2 / 2 ? kGemmBlock : k;
}

// c (m x n, ldc) += a @ b (see above; c = a @ b when not accumulating, k > 0): chunks of gemm_chunk terms
// outer, then column blocks, so a block of b's columns stays in cache across the row blocks. n is a
// multiple of V::size. Single-threaded.
template <typename V, typename acc_t>
ATEN_OVERRIDE_INLINE void gemm_add(
    int64_t m, int64_t n, int64_t k, const acc_t* a, int64_t a_row, int64_t a_col, const acc_t* b, int64_t ldb,
    acc_t* c, int64_t ldc, bool accumulate = true) {
  constexpr int64_t L = V::size;
  const int64_t chunk = gemm_chunk<V>(k);
  for (int64_t k0 = 0; k0 < k; k0 += chunk) {
    const int64_t kn = std::min(chunk, k - k0);
    for (int64_t j = 0; j < n; j += Cols<V> * L) {
      const int vecs = static_cast<int>(std::min<int64_t>(Cols<V>, (n - j) / L));
      for (int64_t i = 0; i < m; i += Rows<V>) {
        const int rows = static_cast<int>(std::min<int64_t>(Rows<V>, m - i));
        gemm_block<V>(a + i * a_row + k0 * a_col, a_row, a_col, b + k0 * ldb + j, ldb, kn, c + i * ldc + j, ldc, rows,
                      vecs, accumulate || k0 > 0);
      }
    }
  }
}

// Partial grad_weight sums ("slabs") of a kernel that splits its `tasks` tasks, in order, among them:
// at most kMaxSlabs, and fewer where they would take more than kSlabBytes (`slab_bytes` each; 0: no
// grad_weight). A number fixed by the problem, not the thread count, so the bits are the same for any.
constexpr int64_t kMaxSlabs = 32;
constexpr int64_t kSlabBytes = int64_t{8} << 20;
inline int64_t slab_count(int64_t tasks, int64_t slab_bytes) {
  const int64_t cap = slab_bytes > 0 ? std::max<int64_t>(1, kSlabBytes / slab_bytes) : kMaxSlabs;
  return std::min({kMaxSlabs, tasks, cap});
}

// out[r * cols + c] = sum over s < slabs of part[(s * rows + r) * ld + c], the slabs added in order, for
// r < rows, c < cols: the fixed number of grad_weight partial sums of a kernel, added row by row (a
// contiguous row of each slab at a time; summing the slabs of one element at a time read `slabs`
// streams a partial apart: 17% of pointwise-bf16's time on ResNet-50's 1024->256 layer at 14x14).
template <typename acc_t, typename out_t>
void sum_slabs(const acc_t* part, int64_t slabs, int64_t rows, int64_t cols, int64_t ld, out_t* out) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> row(cols);
    for (int64_t r = begin; r < end; ++r) {
      std::copy(part + r * ld, part + r * ld + cols, row.begin());
      for (int64_t s = 1; s < slabs; ++s) {
        const acc_t* p = part + (s * rows + r) * ld;
        for (int64_t c = 0; c < cols; ++c) row[c] += p[c];
      }
      for (int64_t c = 0; c < cols; ++c) out[r * cols + c] = static_cast<out_t>(row[c]);
    }
  });
}

// Rows<V> and Cols<V> of Vec (wide) or VecPair.
template <typename acc_t>
int rows_of(bool wide) {
  return wide ? Rows<Vec<acc_t>> : Rows<VecPair<acc_t>>;
}
template <typename acc_t>
int cols_of(bool wide) {
  return wide ? Cols<Vec<acc_t>> : Cols<VecPair<acc_t>>;
}

// gemm_add compiled for each ISA level (cpu/fused.cpp): callable from parallel_for lambdas and from
// code built for the default target.
void gemm(int64_t m, int64_t n, int64_t k, const float* a, int64_t a_row, int64_t a_col, const float* b, int64_t ldb,
          float* c, int64_t ldc, bool accumulate);
void gemm(int64_t m, int64_t n, int64_t k, const double* a, int64_t a_row, int64_t a_col, const double* b,
          int64_t ldb, double* c, int64_t ldc, bool accumulate);

// total[i] += partial[i], i < n (one sample's lane sums into the batch totals; cpu/depthwise.cpp).
void add_to(const float* partial, double* total, int64_t n);
void add_to(const double* partial, double* total, int64_t n);

}  // namespace fused
}  // namespace aten_override
