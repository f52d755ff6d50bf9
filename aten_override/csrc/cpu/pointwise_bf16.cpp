// The bfloat16 pointwise kernel of the compiled backend: grad_input and grad_weight of bfloat16 1x1
// layers (stride 1, no padding, groups == 1) in one pass over grad_output, with the CPU's bfloat16 dot
// products: AVX512_BF16's vdpbf16ps, 16 float32 lanes each += a[2i] * b[2i] + a[2i+1] * b[2i+1] (the
// odd product added first, then the even one, each add rounded: Intel's definition, and what a Zen 4
// core computes, bit for bit on 1.6 million random lanes), twice the multiply-adds of a float32 FMA.
//
// Why: native sends these layers (autocast's bfloat16 training of MobileNetV2, EfficientNet, ResNet-50)
// to oneDNN, whose bfloat16 backward of few-channel 1x1 layers reached 22-49% of the bfloat16 peak on
// a Zen 4 core (46 GFLOP/s on MobileNetV2's 16->96 expand at 112x112, 100 on ResNet-50's 256->64 at
// 56x56, against 212 measured), and pointwise-fused computes in float32 only.
//
// How: pointwise-fused's plan (cpu/pointwise.cpp) on pairs of bfloat16 values. A chunk is a run of one
// sample's positions (an even number but at a plane's end) whose rows fit a share of the L2. Per chunk:
//   grad_input[ci, q] = sum over channel pairs cp of dot((weight[2cp, ci], weight[2cp+1, ci]),
//     (grad_output[2cp, q], grad_output[2cp+1, q])): the chunk's grad_output rows interleaved in pairs
//     of channels ([cp][q] pairs), a broadcast weight pair times 16 positions per instruction, kRows
//     input channels x kCols vectors of positions per micro-kernel, rounded to bfloat16 once;
//   grad_weight[co, ci] += sum over position pairs pp of dot((grad_output[co, 2pp], grad_output[co,
//     2pp+1]), (input[ci, 2pp], input[ci, 2pp+1])): the chunk's input transposed to [pp][ci] pairs
//     (a 32-bit 16x16 transpose of the rows read as pairs), a broadcast grad_output pair (two
//     neighbours in its row, read in place) times 16 input channels per instruction, kRows output
//     channels x kCols vectors of input channels per micro-kernel.
// Sums run over blocks of kDotBlock pairs in registers, then are added to a float32 total; grad_weight's
// totals are a fixed number of slab partials added in slab order and rounded to bfloat16 once, so any
// thread count gives the same bits. Where the CPU has no AVX512_BF16 the kernel declines, unless the
// emulated dot products are forced (set_bf16_dot: the same sums in scalar code, the same bits but for
// denormals, which the instruction flushes to zero), so tests run it on any machine.
#include "../convolution_backward.h"
#include "fused.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/bit_cast.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

namespace aten_override {

namespace {

using BF16 = c10::BFloat16;
using Pair = uint32_t;  // two bfloat16 values, the low 16 bits the first (an even element of vdpbf16ps)

constexpr int64_t kLanes = 16;  // float32 lanes (pairs) per vector
constexpr int kRows = 8;        // micro-kernel: rows of c (broadcast pairs) ...
constexpr int kCols = 3;        // ... x vectors of c: 24 accumulators, 3 loads and a broadcast per step
constexpr int64_t kStep = kCols * kLanes;
// Pairs summed in registers before the sum is added to the stored float32 total (256 products).
constexpr int64_t kDotBlock = 128;

// -1: the CPU's; 0: emulated; 1: the instruction (set_bf16_dot).
std::atomic<int> forced_dot{-1};

bool cpu_has_bf16_dot() {
#ifdef ATEN_OVERRIDE_AVX512
  static const bool yes = fused::has_avx512() && __builtin_cpu_supports("avx512bf16");
  return yes;
#else
  return false;
#endif
}

ATEN_OVERRIDE_INLINE Pair pair_at(const BF16* p) {
  Pair v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
ATEN_OVERRIDE_INLINE Pair make_pair(BF16 lo, BF16 hi) { return Pair(lo.x) | Pair(hi.x) << 16; }
ATEN_OVERRIDE_INLINE float low(Pair v) { return c10::bit_cast<float>(v << 16); }
ATEN_OVERRIDE_INLINE float high(Pair v) { return c10::bit_cast<float>(v & 0xffff0000u); }

int64_t pairs_of(int64_t n) { return (n + 1) / 2; }
int64_t lanes_of(int64_t n) { return (n + kLanes - 1) / kLanes * kLanes; }

// The operations of a chunk, on the instruction (Hardware) or in scalar code (Emulated):
//   tile: c[r * ldc + v * 16 + i] (= or +=) sum_{kk < k} dot(a(r, kk), b[kk * ldb + v * 16 + i]) for
//     r < rows, v < vecs, with a(r, kk) the pair at a + r * a_row + kk * a_k (bfloat16 elements, any
//     alignment), in blocks of kDotBlock pairs;
//   channel_pairs: gp[cp * ldp + q] = (go[2cp][q], go[2cp+1][q]) for q < ldp (a multiple of 16), zeros
//     past C_out and n;
//   position_pairs: xt[pp * ci_pad + ci] = (x[ci][2pp], x[ci][2pp+1]), zeros past C_in and n;
//   round_rows: dst[r * ld + q] = bfloat16(src[r * lds + q]) for r < rows, q < n (n <= kStep).
struct Emulated {
  static void tile(const BF16* a, int64_t a_row, int64_t a_k, const Pair* b, int64_t ldb, int64_t k, float* c,
                   int64_t ldc, int rows, int vecs, bool accumulate) {
    const int64_t width = vecs * kLanes;
    for (int64_t k0 = 0; k0 < k; k0 += kDotBlock) {
      const int64_t k1 = std::min(k, k0 + kDotBlock);
      for (int r = 0; r < rows; ++r) {
        float acc[kStep] = {};
        for (int64_t kk = k0; kk < k1; ++kk) {
          const Pair e = pair_at(a + r * a_row + kk * a_k);
          const float e0 = low(e), e1 = high(e);
          const Pair* bk = b + kk * ldb;
          for (int64_t i = 0; i < width; ++i) {
            const float odd = acc[i] + e1 * high(bk[i]);  // vdpbf16ps' order: the odd product first
            acc[i] = odd + e0 * low(bk[i]);
          }
        }
        float* out = c + r * ldc;
        for (int64_t i = 0; i < width; ++i) out[i] = accumulate || k0 > 0 ? out[i] + acc[i] : acc[i];
      }
    }
  }
  static void channel_pairs(const BF16* go, int64_t plane, int64_t c_out, int64_t n, Pair* gp, int64_t ldp) {
    for (int64_t cp = 0; cp < pairs_of(c_out); ++cp) {
      for (int64_t q = 0; q < ldp; ++q) {
        const bool in = q < n, second = 2 * cp + 1 < c_out;
        gp[cp * ldp + q] =
            make_pair(in ? go[2 * cp * plane + q] : BF16(0.f), in && second ? go[(2 * cp + 1) * plane + q] : BF16(0.f));
      }
    }
  }
  static void position_pairs(const BF16* x, int64_t plane, int64_t c_in, int64_t n, Pair* xt, int64_t ci_pad) {
    for (int64_t pp = 0; pp < pairs_of(n); ++pp) {
      for (int64_t ci = 0; ci < ci_pad; ++ci) {
        const BF16* row = x + ci * plane + 2 * pp;
        xt[pp * ci_pad + ci] = ci < c_in ? make_pair(row[0], 2 * pp + 1 < n ? row[1] : BF16(0.f)) : 0;
      }
    }
  }
  static void round_rows(const float* src, int64_t lds, BF16* dst, int64_t ld, int rows, int64_t n) {
    for (int r = 0; r < rows; ++r) {
      for (int64_t q = 0; q < n; ++q) dst[r * ld + q] = BF16(src[r * lds + q]);
    }
  }
};

#ifdef ATEN_OVERRIDE_AVX512
#define ATEN_OVERRIDE_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

template <int R, int NV>
ATEN_OVERRIDE_AVX512_BF16 ATEN_OVERRIDE_INLINE void dot_tile(
    const BF16* a, int64_t a_row, int64_t a_k, const Pair* b, int64_t ldb, int64_t k, float* c, int64_t ldc,
    bool accumulate) {
  if (accumulate) {
    // c's tile is read back at the end of each block: ask for it now (a slab's partial may be in L3).
    ATEN_OVERRIDE_UNROLL
    for (int r = 0; r < R; ++r) {
      ATEN_OVERRIDE_UNROLL
      for (int v = 0; v < NV; ++v) _mm_prefetch(reinterpret_cast<const char*>(c + r * ldc + v * kLanes), _MM_HINT_T0);
    }
  }
  for (int64_t k0 = 0; k0 < k; k0 += kDotBlock) {
    const int64_t k1 = std::min(k, k0 + kDotBlock);
    __m512 acc[R][NV];
    ATEN_OVERRIDE_UNROLL
    for (int r = 0; r < R; ++r) {
      ATEN_OVERRIDE_UNROLL
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
    }
    const BF16* a_k0 = a + k0 * a_k;
    const Pair* b_k0 = b + k0 * ldb;
    for (int64_t kk = k0; kk < k1; ++kk, a_k0 += a_k, b_k0 += ldb) {
      __m512bh bv[NV];
      ATEN_OVERRIDE_UNROLL
      for (int v = 0; v < NV; ++v) bv[v] = (__m512bh)_mm512_loadu_si512(b_k0 + v * kLanes);
      ATEN_OVERRIDE_UNROLL
      for (int r = 0; r < R; ++r) {
        const __m512bh e = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair_at(a_k0 + r * a_row)));
        ATEN_OVERRIDE_UNROLL
        for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], e, bv[v]);
      }
    }
    ATEN_OVERRIDE_UNROLL
    for (int r = 0; r < R; ++r) {
      ATEN_OVERRIDE_UNROLL
      for (int v = 0; v < NV; ++v) {
        float* out = c + r * ldc + v * kLanes;
        _mm512_storeu_ps(out, accumulate || k0 > 0 ? _mm512_add_ps(_mm512_loadu_ps(out), acc[r][v]) : acc[r][v]);
      }
    }
  }
}

// dot_tile with R rows (the largest that is not over `rows`) and `vecs` vectors.
template <int R = kRows>
ATEN_OVERRIDE_AVX512_BF16 ATEN_OVERRIDE_INLINE void dot_block(
    const BF16* a, int64_t a_row, int64_t a_k, const Pair* b, int64_t ldb, int64_t k, float* c, int64_t ldc, int rows,
    int vecs, bool accumulate) {
  if constexpr (R > 1) {
    if (rows < R) return dot_block<R - 1>(a, a_row, a_k, b, ldb, k, c, ldc, rows, vecs, accumulate);
  }
  static_assert(kCols == 3);
  if (vecs >= 3) return dot_tile<R, 3>(a, a_row, a_k, b, ldb, k, c, ldc, accumulate);
  if (vecs == 2) return dot_tile<R, 2>(a, a_row, a_k, b, ldb, k, c, ldc, accumulate);
  dot_tile<R, 1>(a, a_row, a_k, b, ldb, k, c, ldc, accumulate);
}

ATEN_OVERRIDE_INLINE __mmask32 first_words(int64_t n) {
  return n >= 32 ? ~__mmask32(0) : n <= 0 ? __mmask32(0) : (__mmask32(1) << n) - 1;
}

struct Hardware {
  ATEN_OVERRIDE_AVX512_BF16 static void tile(
      const BF16* a, int64_t a_row, int64_t a_k, const Pair* b, int64_t ldb, int64_t k, float* c, int64_t ldc,
      int rows, int vecs, bool accumulate) {
    dot_block(a, a_row, a_k, b, ldb, k, c, ldc, rows, vecs, accumulate);
  }
  // Two rows' 32 positions interleaved into 32 pairs by two word permutes.
  ATEN_OVERRIDE_AVX512_BF16 static void channel_pairs(
      const BF16* go, int64_t plane, int64_t c_out, int64_t n, Pair* gp, int64_t ldp) {
    alignas(64) uint16_t first[32], second[32];
    for (int i = 0; i < 16; ++i) {
      first[2 * i] = i, first[2 * i + 1] = 32 + i;
      second[2 * i] = 16 + i, second[2 * i + 1] = 48 + i;
    }
    const __m512i lo_half = _mm512_load_si512(first), hi_half = _mm512_load_si512(second);
    for (int64_t cp = 0; cp < pairs_of(c_out); ++cp) {
      const BF16* row0 = go + 2 * cp * plane;
      const BF16* row1 = 2 * cp + 1 < c_out ? row0 + plane : nullptr;
      Pair* out = gp + cp * ldp;
      for (int64_t q = 0; q < ldp; q += 32) {
        const __mmask32 m = first_words(n - q);
        const __m512i a = _mm512_maskz_loadu_epi16(m, row0 + q);
        const __m512i b = row1 ? _mm512_maskz_loadu_epi16(m, row1 + q) : _mm512_setzero_si512();
        _mm512_storeu_si512(out + q, _mm512_permutex2var_epi16(a, lo_half, b));
        if (q + kLanes < ldp) _mm512_storeu_si512(out + q + kLanes, _mm512_permutex2var_epi16(a, hi_half, b));
      }
    }
  }
  // 16 channels' rows of 16 pairs, read as 32-bit elements, transposed in registers (fused.h's 16x16).
  ATEN_OVERRIDE_AVX512_BF16 static void position_pairs(
      const BF16* x, int64_t plane, int64_t c_in, int64_t n, Pair* xt, int64_t ci_pad) {
    const int64_t pairs = pairs_of(n);
    for (int64_t c0 = 0; c0 < ci_pad; c0 += kLanes) {
      for (int64_t pp0 = 0; pp0 < pairs; pp0 += kLanes) {
        const __mmask32 m = first_words(n - 2 * pp0);
        __m512 r[16];
        for (int l = 0; l < 16; ++l) {
          r[l] = c0 + l < c_in ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(m, x + (c0 + l) * plane + 2 * pp0))
                               : _mm512_setzero_ps();
        }
        fused::transpose16(r);
        const int64_t count = std::min(kLanes, pairs - pp0);
        for (int64_t t = 0; t < count; ++t) _mm512_storeu_ps(reinterpret_cast<float*>(xt + (pp0 + t) * ci_pad + c0), r[t]);
      }
    }
  }
  ATEN_OVERRIDE_AVX512_BF16 static void round_rows(
      const float* src, int64_t lds, BF16* dst, int64_t ld, int rows, int64_t n) {
    for (int r = 0; r < rows; ++r) {
      for (int64_t q = 0; q < n; q += kLanes) {
        const __mmask16 m = static_cast<__mmask16>(first_words(n - q));
        fused::store_row(dst + r * ld + q, _mm512_loadu_ps(src + r * lds + q), m);
      }
    }
  }
};
#endif

// One chunk: positions [0, n) of one sample; go / x / gi rows `plane` elements apart.
struct Chunk {
  const BF16* go;
  const BF16* x;   // null: no grad_weight
  const Pair* wp;  // the weight packed for grad_input (null: no grad_input)
  BF16* gi;
  float* gw;  // this slab's partial, (C_out, ci_pad)
  Pair* gp;   // the chunk's grad_output in channel pairs, [cp][lanes_of(n)] (this thread's buffer)
  Pair* xt;   // the chunk's input in position pairs, [pp][ci_pad] (this thread's buffer)
  int64_t n, plane, c_in, c_out, ci_pad;
};

template <typename Dot>
void run_chunk(const Chunk& k) {
  // Rows a plane apart defeat the hardware prefetchers: ask for the chunk's rows up front.
  for (int64_t c = 0; c < k.c_out; ++c) fused::prefetch(k.go + c * k.plane, k.n);
  if (k.x) {
    for (int64_t c = 0; c < k.c_in; ++c) fused::prefetch(k.x + c * k.plane, k.n);
  }
  if (k.wp) {
    // wp[(c / kRows * cps + cp) * kRows + c % kRows] = (weight[2cp, c], weight[2cp + 1, c]).
    const int64_t ldp = lanes_of(k.n), cps = pairs_of(k.c_out);
    Dot::channel_pairs(k.go, k.plane, k.c_out, k.n, k.gp, ldp);
    float tile[kRows * kStep];
    for (int64_t q = 0; q < k.n; q += kStep) {
      const int64_t width = std::min(kStep, k.n - q);
      const int vecs = static_cast<int>((width + kLanes - 1) / kLanes);
      for (int64_t c = 0; c < k.c_in; c += kRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kRows, k.c_in - c));
        const BF16* a = reinterpret_cast<const BF16*>(k.wp + c / kRows * cps * kRows);
        Dot::tile(a, 2, 2 * kRows, k.gp + q, ldp, cps, tile, kStep, rows, vecs, false);
        Dot::round_rows(tile, kStep, k.gi + c * k.plane + q, k.plane, rows, width);
      }
    }
  }
  if (k.x) {
    // grad_weight (C_out x ci_pad) += grad_output's position pairs (C_out x n / 2) @ xt (n / 2 x ci_pad);
    // an odd chunk's last position is a pair of its own, (grad_output, 0).
    Dot::position_pairs(k.x, k.plane, k.c_in, k.n, k.xt, k.ci_pad);
    const int64_t whole = k.n / 2;
    for (int64_t c = 0; c < k.ci_pad; c += kStep) {
      const int vecs = static_cast<int>(std::min<int64_t>(kCols, (k.ci_pad - c) / kLanes));
      for (int64_t r = 0; r < k.c_out; r += kRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kRows, k.c_out - r));
        float* out = k.gw + r * k.ci_pad + c;
        Dot::tile(k.go + r * k.plane, k.plane, 2, k.xt + c, k.ci_pad, whole, out, k.ci_pad, rows, vecs, true);
        if (k.n % 2) {
          Pair last[kRows];
          for (int i = 0; i < rows; ++i) last[i] = make_pair(k.go[(r + i) * k.plane + k.n - 1], BF16(0.f));
          Dot::tile(reinterpret_cast<const BF16*>(last), 2, 0, k.xt + whole * k.ci_pad + c, k.ci_pad, 1, out, k.ci_pad,
                    rows, vecs, true);
        }
      }
    }
  }
}

bool use_hardware() {
  const int forced = forced_dot.load(std::memory_order_relaxed);
  return forced < 0 ? cpu_has_bf16_dot() : forced == 1;
}

// Positions per chunk: grad_output and input rows and their pair copies within half the L2, a whole
// number of grad_input micro-kernels (so an even number), at least one, at most the plane.
int64_t chunk_positions(const DirectProblem& p, int64_t plane) {
  const int64_t l2 = l2_bytes();
  const int64_t n = l2 / 2 / (2 * (p.in_per_group + p.out_per_group) * int64_t(sizeof(BF16))) / kStep * kStep;
  return std::min(plane, std::max(kStep, n));
}

}  // namespace

const char* bf16_dot() {
  const int forced = forced_dot.load(std::memory_order_relaxed);
  if (forced == 0) return "emulated";
  return forced == 1 || cpu_has_bf16_dot() ? "avx512_bf16" : "none";
}

void set_bf16_dot(std::optional<bool> hardware) {
  TORCH_CHECK(!hardware.value_or(false) || cpu_has_bf16_dot(),
              "set_bf16_dot: this CPU has no AVX512_BF16 dot products (vdpbf16ps)");
  forced_dot.store(hardware ? int(*hardware) : -1);
}

std::optional<std::string> pointwise_bf16_unsupported(const DirectProblem& p, at::ScalarType dtype) {
  // The layers pointwise-fused computes (grouped, not 1x1 stride 1 unpadded, empty: its reasons).
  if (auto why = pointwise_unsupported(p, at::kFloat)) return why;
  if (dtype != at::kBFloat16) return "not bfloat16 (pointwise-fused computes float32 / float64)";
  if (std::strcmp(bf16_dot(), "none") == 0) return "this CPU has no AVX512_BF16 dot products (vdpbf16ps)";
  return std::nullopt;
}

void pointwise_bf16_backward_cpu(
    const DirectProblem& p, const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    at::Tensor* grad_input, at::Tensor* grad_weight) {
  TORCH_INTERNAL_ASSERT(!pointwise_bf16_unsupported(p, grad_output.scalar_type()));
  const int64_t c_in = p.in_per_group, c_out = p.out_per_group, plane = p.in[0] * p.in[1] * p.in[2];
  const bool hardware = use_hardware();
  const int64_t per_chunk = chunk_positions(p, plane);
  const int64_t chunks = (plane + per_chunk - 1) / per_chunk, tasks = p.batch * chunks;
  const int64_t cps = pairs_of(c_out), ci_pad = lanes_of(c_in);
  std::vector<Pair> wp;
  if (grad_input) {
    const BF16* w = weight.const_data_ptr<BF16>();
    const int64_t blocks = (c_in + kRows - 1) / kRows;
    wp.assign(blocks * cps * kRows, 0);
    for (int64_t c = 0; c < c_in; ++c) {
      for (int64_t cp = 0; cp < cps; ++cp) {
        const BF16 second = 2 * cp + 1 < c_out ? w[(2 * cp + 1) * c_in + c] : BF16(0.f);
        wp[(c / kRows * cps + cp) * kRows + c % kRows] = make_pair(w[2 * cp * c_in + c], second);
      }
    }
  }
  const int64_t slabs = fused::slab_count(tasks, grad_weight ? c_out * ci_pad * int64_t(sizeof(float)) : 0);
  at::Tensor partial = grad_weight ? at::zeros({slabs, c_out, ci_pad}, grad_output.options().dtype(at::kFloat))
                                   : at::Tensor();
  const BF16* go = grad_output.const_data_ptr<BF16>();
  const BF16* x = grad_weight ? input.const_data_ptr<BF16>() : nullptr;
  BF16* gi = grad_input ? grad_input->mutable_data_ptr<BF16>() : nullptr;
  float* part = grad_weight ? partial.mutable_data_ptr<float>() : nullptr;
  const int64_t grain = plane * (c_in + c_out) * p.batch < fused::kSerialElements ? slabs : 1;
  at::parallel_for(0, slabs, grain, [&](int64_t begin, int64_t end) {
    std::vector<Pair> gp(grad_input ? cps * lanes_of(per_chunk) : 0);
    std::vector<Pair> xt(grad_weight ? pairs_of(per_chunk) * ci_pad : 0);
    for (int64_t s = begin; s < end; ++s) {
      for (int64_t t = s * tasks / slabs; t < (s + 1) * tasks / slabs; ++t) {
        const int64_t n = t / chunks, first = t % chunks * per_chunk;
        Chunk k;
        k.go = go + n * c_out * plane + first;
        k.x = x ? x + n * c_in * plane + first : nullptr;
        k.wp = grad_input ? wp.data() : nullptr;
        k.gi = gi ? gi + n * c_in * plane + first : nullptr;
        k.gw = part ? part + s * c_out * ci_pad : nullptr;
        k.gp = gp.data(), k.xt = xt.data();
        k.n = std::min(per_chunk, plane - first);
        k.plane = plane, k.c_in = c_in, k.c_out = c_out, k.ci_pad = ci_pad;
#ifdef ATEN_OVERRIDE_AVX512
        if (hardware) {
          run_chunk<Hardware>(k);
          continue;
        }
#endif
        run_chunk<Emulated>(k);
      }
    }
  });
  if (grad_weight) {
    // The slabs' partials added in slab order, rounded once.
    fused::sum_slabs(part, slabs, c_out, c_in, ci_pad, grad_weight->mutable_data_ptr<BF16>());
  }
}

}  // namespace aten_override
