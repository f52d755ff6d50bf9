// The Winograd kernel of the compiled backend: grad_input and grad_weight of 3x3, stride-1,
// undilated, groups == 1 convolutions (2-D, and 3-D with a 1x3x3 kernel, whose depth is folded into
// the batch) by Winograd's minimal filtering (Lavin & Gray, "Fast Algorithms for Convolutional
// Neural Networks", CVPR 2016): 2.25x fewer multiplications than the direct / im2col products, which
// become 16 GEMMs, one per tile position (at::bmm, or our vector micro-kernels where MKL is slower:
// winograd_gemm()).
//
// F(m, r) computes m outputs of an r-tap correlation from an m + r - 1 = 4 point tile:
//   y = A^T [(G g) . (B^T d)]
// and, exchanging the roles of A and G, the same matrices compute r outputs of an m-tap correlation:
//   z = G^T [(A h) . (B^T d)].
// In 2-D each transform is applied along both axes.
//
//   grad_input  = correlation of grad_output (padded by 2 - padding) with the flipped weight, summed
//                 over C_out: F(2x2, 3x3). Per tile position xi, one GEMM
//                 M[xi] (tiles x C_in) = V[xi] (tiles x C_out) @ U[xi] (C_out x C_in),
//                 V = B^T d B of 4x4 grad_output tiles, U = G w G^T of the flipped weight; then A^T M A.
//   grad_weight = correlation of the padded input with grad_output, summed over samples and
//                 positions: F(3x3, 2x2). Per tile position,
//                 M[xi] (C_out x C_in) += H[xi]^T (C_out x tiles) @ V[xi] (tiles x C_in),
//                 H = A h A^T of 2x2 grad_output tiles, V = B^T d B of 4x4 input tiles; then G^T M G.
//
// Accuracy (float32 against float64): both stay within native's own error (the tests' bound: twice
// native's plus a few ulps of the result's scale). Larger tiles, with fewer multiplications still,
// did not: grad_input by F(4x4, 3x3) had 20x native's error on 512-channel layers, grad_weight by
// F(3x3, 4x4) up to 7x on small layers, so they are not built.
//
// Layout: grad_output and input are transposed once (16x16 blocks, cpu/fused.h) into [position]
// [channel] planes, channels padded to the vector width with zeros; the transforms are vectorized over
// channels. Tiles are processed in chunks whose transformed tiles fit the L2 cache read from the
// machine (one thread's), so each chunk goes from the transform through its GEMMs to the output
// transform without a round trip to memory. Threads take contiguous runs of chunks, each with
// single-threaded GEMMs (see Split). grad_weight's tiles are split into at most kWeightTasks runs, a
// number that does not depend on the thread count, each summed into its own partial; the partials are
// added in run order. float16 / bfloat16 compute in float32, float32 in float32, float64 in float64.
// No atomics, and every sum's order is fixed: the same bits for any thread count.
#include "fused.h"
#include "workspace.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <type_traits>
#include <utility>
#include <vector>

namespace aten_override {
namespace {

// The element type of a vector type (fused::Vec's or fused::VecPair's).
template <typename V, typename = void>
struct elem_of {
  using type = std::remove_cv_t<std::remove_reference_t<decltype(std::declval<V>()[0])>>;
};
template <typename V>
struct elem_of<V, std::void_t<typename V::value_type>> {
  using type = typename V::value_type;
};
template <typename V>
using elem_t = typename elem_of<V>::type;


// --- the 1-D transforms; each 2-D transform applies one of them along both axes -----------------
// B^T of F(2, 3) / F(3, 2) (alpha = 4).
struct Data4 {
  static constexpr int kIn = 4, kOut = 4;
  template <typename V>
  static ATEN_OVERRIDE_INLINE void apply(const V* d, V* o) {
    o[0] = d[0] - d[2];
    o[1] = d[1] + d[2];
    o[2] = d[2] - d[1];
    o[3] = d[1] - d[3];
  }
};
// G of F(2, 3): the 3-tap weight to 4 points (grad_input's weight transform).
struct Weight4 {
  static constexpr int kIn = 3, kOut = 4;
  template <typename V>
  static ATEN_OVERRIDE_INLINE void apply(const V* g, V* o) {
    using S = elem_t<V>;
    const V half_sum = (g[0] + g[2]) * S(0.5), half_mid = g[1] * S(0.5);
    o[0] = g[0];
    o[1] = half_sum + half_mid;
    o[2] = half_sum - half_mid;
    o[3] = g[2];
  }
};
// A^T of F(2, 3): 4 points to 2 grad_input positions.
struct Output2 {
  static constexpr int kIn = 4, kOut = 2;
  template <typename V>
  static ATEN_OVERRIDE_INLINE void apply(const V* m, V* o) {
    o[0] = m[0] + m[1] + m[2];
    o[1] = m[1] - m[2] - m[3];
  }
};
// A of F(2, 3) (= the grad_output transform of F(3, 2)): 2 grad_output positions to 4 points.
struct GradOutput4 {
  static constexpr int kIn = 2, kOut = 4;
  template <typename V>
  static ATEN_OVERRIDE_INLINE void apply(const V* h, V* o) {
    o[0] = h[0];
    o[1] = h[0] + h[1];
    o[2] = h[0] - h[1];
    o[3] = -h[1];
  }
};
// G^T of F(2, 3): 4 points to the 3 taps of grad_weight.
struct Taps4 {
  static constexpr int kIn = 4, kOut = 3;
  template <typename V>
  static ATEN_OVERRIDE_INLINE void apply(const V* m, V* o) {
    using S = elem_t<V>;
    const V half_sum = (m[1] + m[2]) * S(0.5);
    o[0] = m[0] + half_sum;
    o[1] = (m[1] - m[2]) * S(0.5);
    o[2] = half_sum + m[3];
  }
};
// out = T in T^T for an In x In tile of vectors (row-major), out Out x Out.
template <typename T, typename V>
ATEN_OVERRIDE_INLINE void transform2d(const V* in, V* out) {
  constexpr int In = T::kIn, Out = T::kOut;
  V rows[Out * In];
  for (int j = 0; j < In; ++j) {  // along the first axis, column by column
    V col[In], res[Out];
    for (int i = 0; i < In; ++i) col[i] = in[i * In + j];
    T::apply(col, res);
    for (int i = 0; i < Out; ++i) rows[i * In + j] = res[i];
  }
  for (int i = 0; i < Out; ++i) T::apply(rows + i * In, out + i * Out);  // then along the second
}

// What a transform pass works on. Tile passes: the [position][channel] planes (count, height,
// width, channels) of the tensor read (transforms of grad_output / input tiles) or written
// (grad_input's output transform); tiles [t0, t1) of the (planes, tiles_h, tiles_w) grid, the tile at
// (ty, tx) starting at (ty * step - offset, tx * step - offset); the transformed tiles are rows
// [xi][t - t0][channel]. Tap passes: `rows` rows of [tap][row][channel] (flip: taps reversed).
struct Pass {
  int64_t height = 0, width = 0, channels = 0;
  int64_t tiles_h = 0, tiles_w = 0, step = 0, offset = 0, t0 = 0, t1 = 0;
  int64_t rows = 0;
  bool flip = false;
};

enum class Transform { Data4, GradOutput4, Output2, Weight4, Taps4 };

// Tiles [begin, end) of T::kIn x T::kIn positions of src (zeros outside the plane), transformed into
// dst[xi][t - t0][channel].
template <typename T, typename W, typename acc_t>
ATEN_OVERRIDE_INLINE void transform_tiles(const Pass& g, const acc_t* src, acc_t* dst, int64_t begin, int64_t end) {
  using V = typename W::type;
  constexpr int In = T::kIn, Out = T::kOut;
  constexpr int64_t L = fused::Vec<acc_t>::size;
  const int64_t C = g.channels, xi_stride = (g.t1 - g.t0) * C;
  for (int64_t t = begin; t < end; ++t) {
    const int64_t plane = t / (g.tiles_h * g.tiles_w), ty = t / g.tiles_w % g.tiles_h, tx = t % g.tiles_w;
    const int64_t y0 = ty * g.step - g.offset, x0 = tx * g.step - g.offset;
    const acc_t* base = src + plane * g.height * g.width * C;
    acc_t* out = dst + (t - g.t0) * C;
    bool inside[In * In];
    const acc_t* ptr[In * In];
    for (int i = 0; i < In; ++i) {
      for (int j = 0; j < In; ++j) {
        const int64_t y = y0 + i, x = x0 + j;
        inside[i * In + j] = y >= 0 && y < g.height && x >= 0 && x < g.width;
        ptr[i * In + j] = base + (y * g.width + x) * C;
      }
    }
    for (int64_t c = 0; c < C; c += L) {
      V d[In * In], v[Out * Out];
      for (int k = 0; k < In * In; ++k) d[k] = inside[k] ? W::load(ptr[k] + c) : V{};
      transform2d<T>(d, v);
      for (int k = 0; k < Out * Out; ++k) W::store(out + k * xi_stride + c, v[k]);
    }
  }
}

// grad_input's output transform: src[xi][t - t0][channel] (16 points) of tiles [begin, end) to their
// 2 x 2 positions (ty * 2, tx * 2) in the planes of dst, those inside the plane.
template <typename W, typename acc_t>
ATEN_OVERRIDE_INLINE void output_tiles(const Pass& g, const acc_t* src, acc_t* dst, int64_t begin, int64_t end) {
  using V = typename W::type;
  constexpr int64_t L = fused::Vec<acc_t>::size;
  const int64_t C = g.channels, xi_stride = (g.t1 - g.t0) * C;
  for (int64_t t = begin; t < end; ++t) {
    const int64_t plane = t / (g.tiles_h * g.tiles_w), ty = t / g.tiles_w % g.tiles_h, tx = t % g.tiles_w;
    const int64_t y0 = ty * 2, x0 = tx * 2;
    acc_t* base = dst + plane * g.height * g.width * C;
    const acc_t* in = src + (t - g.t0) * C;
    for (int64_t c = 0; c < C; c += L) {
      V p[16], y[4];
      for (int k = 0; k < 16; ++k) p[k] = W::load(in + k * xi_stride + c);
      transform2d<Output2>(p, y);
      for (int i = 0; i < 2; ++i) {
        for (int j = 0; j < 2; ++j) {
          if (y0 + i < g.height && x0 + j < g.width) W::store(base + ((y0 + i) * g.width + x0 + j) * C + c, y[i * 2 + j]);
        }
      }
    }
  }
}

// Rows [begin, end) of [tap][row][channel] src (In x In taps) transformed into dst (Out x Out taps).
template <typename T, typename W, typename acc_t>
ATEN_OVERRIDE_INLINE void transform_taps(const Pass& g, const acc_t* src, acc_t* dst, int64_t begin, int64_t end) {
  using V = typename W::type;
  constexpr int In = T::kIn, Out = T::kOut;
  constexpr int64_t L = fused::Vec<acc_t>::size;
  const int64_t C = g.channels, tap_stride = g.rows * C;
  for (int64_t r = begin; r < end; ++r) {
    for (int64_t c = 0; c < C; c += L) {
      V w[In * In], u[Out * Out];
      for (int k = 0; k < In * In; ++k) w[k] = W::load(src + (g.flip ? In * In - 1 - k : k) * tap_stride + r * C + c);
      transform2d<T>(w, u);
      for (int k = 0; k < Out * Out; ++k) W::store(dst + k * tap_stride + r * C + c, u[k]);
    }
  }
}

template <typename W, typename acc_t>
ATEN_OVERRIDE_INLINE void run_range(Transform tr, const Pass& g, const acc_t* src, acc_t* dst, int64_t begin, int64_t end) {
  switch (tr) {
    case Transform::Data4: return transform_tiles<Data4, W>(g, src, dst, begin, end);
    case Transform::GradOutput4: return transform_tiles<GradOutput4, W>(g, src, dst, begin, end);
    case Transform::Output2: return output_tiles<W>(g, src, dst, begin, end);
    case Transform::Weight4: return transform_taps<Weight4, W>(g, src, dst, begin, end);
    case Transform::Taps4: return transform_taps<Taps4, W>(g, src, dst, begin, end);
  }
}

// The vector code compiled per instruction set (target_clones applies to these functions, not to the
// lambdas of at::parallel_for, so the parallel loop calls them), in the vector type wide_vectors() gives.
ATEN_OVERRIDE_CLONES void run_range_f(Transform tr, const Pass& g, const float* src, float* dst, int64_t begin, int64_t end) {
  if (fused::wide_vectors()) return run_range<fused::Vec<float>>(tr, g, src, dst, begin, end);
  run_range<fused::VecPair<float>>(tr, g, src, dst, begin, end);
}
ATEN_OVERRIDE_CLONES void run_range_d(
    Transform tr, const Pass& g, const double* src, double* dst, int64_t begin, int64_t end) {
  if (fused::wide_vectors()) return run_range<fused::Vec<double>>(tr, g, src, dst, begin, end);
  run_range<fused::VecPair<double>>(tr, g, src, dst, begin, end);
}

// A tap pass (Weight4, Taps4), parallel over its rows.
template <typename acc_t>
void run_taps(Transform tr, const Pass& g, const acc_t* src, acc_t* dst) {
  at::parallel_for(0, g.rows, 4, [&](int64_t b, int64_t e) {
    if constexpr (std::is_same_v<acc_t, float>) {
      run_range_f(tr, g, src, dst, b, e);
    } else {
      run_range_d(tr, g, src, dst, b, e);
    }
  });
}

// 0, step, 2 * step, ...: the tile positions of fused::load_tiles / store_tiles.
std::vector<int64_t> positions_every(int64_t n, int64_t step) {
  std::vector<int64_t> index(n);
  for (int64_t i = 0; i < n; ++i) index[i] = i * step;
  return index;
}

// `t`, contiguous (N, C, S) (S positions per sample: D * H * W), as a [sample][position][channel]
// tensor (N, S, Cp) of acc_t, Cp = C rounded up to the vector width, the extra channels zero:
// 16 x 16 transposes (fused::load_tiles), parallel over samples and channel blocks.
template <typename scalar_t, typename acc_t>
at::Tensor planes_of(const at::Tensor& t, int64_t N, int64_t C, int64_t S) {
  constexpr int64_t L = fused::Vec<acc_t>::size;
  const int64_t Cp = fused::round_up<acc_t>(C), blocks = Cp / L;
  at::Tensor out = workspace::empty({N, S, Cp}, t.options().dtype(c10::CppTypeToScalarType<acc_t>::value));
  const std::vector<int64_t> index = positions_every(S, 1);
  const scalar_t* src = t.const_data_ptr<scalar_t>();
  acc_t* dst = out.mutable_data_ptr<acc_t>();
  at::parallel_for(0, N * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n = i / blocks, c0 = i % blocks * L;
      fused::load_tiles(src + (n * C + c0) * S, S, std::min(L, C - c0), index.data(), S, dst + n * S * Cp + c0, Cp);
    }
  });
  return out;
}

// planes_of's inverse: src (N, S, Cp) into the contiguous (N, C, S) dst.
template <typename scalar_t, typename acc_t>
void store_planes(const acc_t* src, int64_t N, int64_t C, int64_t S, scalar_t* dst) {
  constexpr int64_t L = fused::Vec<acc_t>::size;
  const int64_t Cp = fused::round_up<acc_t>(C), blocks = Cp / L;
  const std::vector<int64_t> index = positions_every(S, 1);
  at::parallel_for(0, N * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n = i / blocks, c0 = i % blocks * L;
      fused::store_tiles(src + n * S * Cp + c0, index.data(), S, dst + (n * C + c0) * S, S, std::min(L, C - c0), Cp);
    }
  });
}

// The 3x3 taps of a (K, C, 3, 3) weight as (9, K, Cp) acc_t, and back.
template <typename scalar_t, typename acc_t>
at::Tensor taps_of(const scalar_t* w, int64_t K, int64_t C, const at::TensorOptions& options) {
  constexpr int64_t L = fused::Vec<acc_t>::size;
  const int64_t Cp = fused::round_up<acc_t>(C);
  at::Tensor out = at::empty({9, K, Cp}, options);
  acc_t* dst = out.mutable_data_ptr<acc_t>();
  const std::vector<int64_t> index = positions_every(9, K);
  at::parallel_for(0, K, 1, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      for (int64_t c0 = 0; c0 < Cp; c0 += L) {
        fused::load_tiles(w + (k * C + c0) * 9, 9, std::min(L, C - c0), index.data(), 9, dst + k * Cp + c0, Cp);
      }
    }
  });
  return out;
}
template <typename scalar_t, typename acc_t>
void store_taps(const acc_t* taps, int64_t K, int64_t C, scalar_t* w) {
  constexpr int64_t L = fused::Vec<acc_t>::size;
  const int64_t Cp = fused::round_up<acc_t>(C);
  const std::vector<int64_t> index = positions_every(9, K);
  at::parallel_for(0, K, 1, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      for (int64_t c0 = 0; c0 < C; c0 += L) {
        fused::store_tiles(taps + k * Cp + c0, index.data(), 9, w + (k * C + c0) * 9, 9, std::min(L, C - c0), Cp);
      }
    }
  });
}

// Tiles per chunk: a chunk's two transformed operands (16 x tiles x channels each) within the L2
// cache read from the machine (one thread's), at least 64 tiles (the GEMMs' rows).
int64_t chunk_tiles(int64_t channels_a, int64_t channels_b, int64_t element, int64_t tiles) {
  const int64_t l2 = std::max<int64_t>(cache_bytes(2), int64_t{256} << 10);
  const int64_t per_tile = 16 * (channels_a + channels_b) * element;
  return std::max<int64_t>(1, std::min(tiles, std::max<int64_t>(l2 / per_tile, 64)));
}

// grad_weight's most partial sums (runs of chunks): fixed, so that the bits do not depend on the thread
// count, and more than the threads of most machines, so that each thread takes one run or more.
constexpr int64_t kWeightTasks = 32;

// The chunks of `tiles` split into contiguous runs, tasks of at::parallel_for (at most max_tasks, at
// most one per chunk): task g takes chunks [g * chunks / tasks, (g + 1) * chunks / tasks). Each
// task runs its chunks' transforms and GEMMs on one thread, so the GEMMs are single-threaded and the
// chunk stays in that core's L2 (measured: 16 small GEMMs per chunk on all threads lost to native at
// 2 threads). One task runs on the calling thread, its GEMMs on the library's threads.
struct Split {
  int64_t tiles, chunk, chunks, tasks;
  Split(int64_t tiles_, int64_t chunk_, int64_t max_tasks)
      : tiles(tiles_), chunk(chunk_), chunks((tiles_ + chunk_ - 1) / chunk_),
        tasks(std::max<int64_t>(1, std::min<int64_t>(chunks, max_tasks))) {}
  int64_t first_tile(int64_t task) const { return std::min(tiles, task * chunks / tasks * chunk); }
};

// One transform pass over a chunk on the calling thread.
template <typename acc_t>
void run_serial(Transform tr, const Pass& g, const acc_t* src, acc_t* dst) {
  if constexpr (std::is_same_v<acc_t, float>) {
    run_range_f(tr, g, src, dst, g.t0, g.t1);
  } else {
    run_range_d(tr, g, src, dst, g.t0, g.t1);
  }
}

// --- The 16 GEMMs of a chunk -----------------------------------------------------------------------
// Either the library's batched GEMM (at::bmm: MKL for float32 / float64) or fused::gemm_add's vector
// micro-kernels, whichever ran a chunk-sized problem faster on this machine (measured once per
// process, winograd_gemm()). MKL's sgemm runs its AVX2 code on AMD CPUs: on a Zen 5 core it reached 96
// GFLOP/s in a 2048^2 product where oneDNN's AVX-512 convolutions reach 199, so native beat this
// kernel's 2.25x fewer multiplications on ResNet-50's 3x3 layers (1.1-1.4x native's time).

// c[xi] (= or += when accumulate) a[xi] @ b[xi] for each of the 16 tile positions; a any strides (a
// transposed view), b and c rows contiguous with a whole number of vectors per row. On the calling
// thread inside a task; across the library's threads (one GEMM per tile position) outside one.
void batched_gemm(bool vectors, const at::Tensor& a, const at::Tensor& b, at::Tensor& c, bool accumulate) {
  if (!vectors) {
    if (accumulate) {
      c.baddbmm_(a, b);
    } else {
      at::bmm_out(c, a, b);
    }
    return;
  }
  TORCH_INTERNAL_ASSERT(b.stride(2) == 1 && c.stride(2) == 1 && b.size(2) == c.size(2));
  const int64_t m = a.size(1), k = a.size(2), n = b.size(2);
  if (!accumulate && k == 0) c.zero_();
  AT_DISPATCH_FLOATING_TYPES(c.scalar_type(), "winograd_gemm", [&] {
    TORCH_INTERNAL_ASSERT(n % fused::Vec<scalar_t>::size == 0);
    const scalar_t* ad = a.const_data_ptr<scalar_t>();
    const scalar_t* bd = b.const_data_ptr<scalar_t>();
    scalar_t* cd = c.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, a.size(0), 1, [&](int64_t begin, int64_t end) {
      for (int64_t xi = begin; xi < end; ++xi) {
        const scalar_t* axi = ad + xi * a.stride(0);
        const scalar_t* bxi = bd + xi * b.stride(0);
        scalar_t* cxi = cd + xi * c.stride(0);
        fused::gemm(m, n, k, axi, a.stride(1), a.stride(2), bxi, b.stride(1), cxi, c.stride(1), accumulate);
      }
    });
  });
}

// -1: the measured engine; 0: the library's; 1: the vector micro-kernels (set_winograd_gemm).
std::atomic<int> forced_engine{-1};

}  // namespace

void set_winograd_gemm(std::optional<bool> vectors) {
  forced_engine.store(vectors ? (*vectors ? 1 : 0) : -1);
}

WinogradGemm winograd_gemm() {
  // A chunk's grad_input GEMMs on a 256-channel layer: 16 x (64 tiles x 256) @ (256 x 256), float32,
  // each engine on one thread (task 0 of a parallel region: the library's threads are not used),
  // interleaved, fastest of five runs.
  static const WinogradGemm measured = [] {
    WinogradGemm out;
    at::parallel_for(0, std::max(1, at::get_num_threads()), 1, [&](int64_t begin, int64_t) {
      if (begin != 0) return;
      // Constant operands: at::randn would draw from the process's default generator, and a user's
      // seeded random stream must not depend on whether this kernel was measured.
      const at::Tensor a = at::full({16, 64, 256}, 0.5f), b = at::full({16, 256, 256}, 0.25f);
      at::Tensor c = at::empty({16, 64, 256});
      double best[2] = {INFINITY, INFINITY};
      for (int run = 0; run < 6; ++run) {
        for (int e = 0; e < 2; ++e) {
          const auto start = std::chrono::steady_clock::now();
          batched_gemm(e == 1, a, b, c, false);
          const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
          if (run > 0) best[e] = std::min(best[e], us);  // run 0 warms both up
        }
      }
      out.library_us = best[0];
      out.vectors_us = best[1];
    });
    out.vectors = out.vectors_us < out.library_us;
    return out;
  }();
  WinogradGemm out = measured;
  const int forced = forced_engine.load();
  if (forced >= 0) {
    out.vectors = forced == 1;
    out.forced = true;
  }
  return out;
}

namespace {

// The sizes of a problem: batch, C_out, C_in, depth (folded into the batch), input and grad_output
// planes; C_out and C_in padded to the width of acc_t's vectors.
struct Sizes {
  int64_t N, K, C, D, H, W, Ho, Wo, Kp, Cp;
  template <typename acc_t>
  static Sizes of(const DirectProblem& p) {
    return {p.batch,  p.out_per_group, p.in_per_group, p.in[0], p.in[1], p.in[2], p.out[1], p.out[2],
            fused::round_up<acc_t>(p.out_per_group), fused::round_up<acc_t>(p.in_per_group)};
  }
};

// go_planes: grad_output's planes (planes_of), shared with grad_weight_impl.
template <typename scalar_t, typename acc_t>
void grad_input_impl(const DirectProblem& p, const at::Tensor& go_planes, const at::Tensor& w, at::Tensor& gi) {
  const Sizes z = Sizes::of<acc_t>(p);
  const int64_t N = z.N, K = z.K, C = z.C, D = z.D, H = z.H, W = z.W, Ho = z.Ho, Wo = z.Wo, Kp = z.Kp, Cp = z.Cp;
  const auto options = go_planes.options();
  // U = G w' G^T of the flipped weight, [xi][C_out][Cp] (the weight's taps freed before the tiles'
  // buffers are allocated: U is 16/9 of the weight, the workspace's largest part on 512-channel layers).
  at::Tensor u = workspace::empty({16, K, Cp}, options);
  {
    const at::Tensor w_taps = taps_of<scalar_t, acc_t>(w.const_data_ptr<scalar_t>(), K, C, options);
    Pass weight_pass;
    weight_pass.channels = Cp, weight_pass.rows = K, weight_pass.flip = true;
    run_taps(Transform::Weight4, weight_pass, w_taps.const_data_ptr<acc_t>(), u.mutable_data_ptr<acc_t>());
  }
  const int64_t tiles_h = (H + 1) / 2, tiles_w = (W + 1) / 2;
  const Split split(N * D * tiles_h * tiles_w, chunk_tiles(Kp, Cp, sizeof(acc_t), N * D * tiles_h * tiles_w),
                    at::get_num_threads());
  at::Tensor gi_planes = workspace::empty({N * D, H, W, Cp}, options);
  const int64_t offset = 2 - p.padding[1];
  const bool vectors = winograd_gemm().vectors;
  at::parallel_for(0, split.tasks, 1, [&](int64_t begin, int64_t end) {
    at::Tensor v = at::empty({16, split.chunk, Kp}, options), m = at::empty({16, split.chunk, Cp}, options);
    for (int64_t t0 = split.first_tile(begin); t0 < split.first_tile(end); t0 += split.chunk) {
      const int64_t t1 = std::min(split.first_tile(end), t0 + split.chunk), n = t1 - t0;
      at::Tensor vc = n < split.chunk ? at::empty({16, n, Kp}, options) : v;
      at::Tensor mc = n < split.chunk ? at::empty({16, n, Cp}, options) : m;
      run_serial(Transform::Data4, Pass{Ho, Wo, Kp, tiles_h, tiles_w, 2, offset, t0, t1},
                 go_planes.const_data_ptr<acc_t>(), vc.mutable_data_ptr<acc_t>());
      batched_gemm(vectors, vc.narrow(2, 0, K), u, mc, /*accumulate=*/false);
      run_serial(Transform::Output2, Pass{H, W, Cp, tiles_h, tiles_w, 2, 0, t0, t1}, mc.const_data_ptr<acc_t>(),
                 gi_planes.mutable_data_ptr<acc_t>());
    }
  });
  store_planes<scalar_t, acc_t>(gi_planes.const_data_ptr<acc_t>(), N, C, D * H * W, gi.mutable_data_ptr<scalar_t>());
}

template <typename scalar_t, typename acc_t>
void grad_weight_impl(const DirectProblem& p, const at::Tensor& go_planes, const at::Tensor& x, at::Tensor& gw) {
  const Sizes z = Sizes::of<acc_t>(p);
  const int64_t N = z.N, K = z.K, C = z.C, D = z.D, H = z.H, W = z.W, Ho = z.Ho, Wo = z.Wo, Kp = z.Kp, Cp = z.Cp;
  const at::Tensor x_planes = planes_of<scalar_t, acc_t>(x, N, C, D * H * W);
  const int64_t tiles_h = (Ho + 1) / 2, tiles_w = (Wo + 1) / 2;
  // Each task sums its chunks into its own M (16, C_out, Cp); the tasks' sums are added in task order.
  // At most kWeightTasks tasks, whatever the thread count (the same bits at any); tasks beyond the
  // first cost one M each: at most as many as fit in the bytes of the two planes (so the workspace
  // stays proportional to the layer's tensors: a 1024-channel layer on 16x16 planes takes one task,
  // 64 MiB).
  const int64_t sum_bytes = 16 * K * Cp * static_cast<int64_t>(sizeof(acc_t));
  const int64_t planes_bytes = go_planes.nbytes() + x_planes.nbytes();
  const Split split(N * D * tiles_h * tiles_w, chunk_tiles(Kp, Cp, sizeof(acc_t), N * D * tiles_h * tiles_w),
                    std::min(kWeightTasks, 1 + planes_bytes / sum_bytes));
  const auto options = go_planes.options();
  at::Tensor sums = workspace::empty({split.tasks, 16, K, Cp}, options);
  const bool vectors = winograd_gemm().vectors;
  at::parallel_for(0, split.tasks, 1, [&](int64_t begin, int64_t end) {
    at::Tensor h = at::empty({16, split.chunk, Kp}, options), v = at::empty({16, split.chunk, Cp}, options);
    for (int64_t task = begin; task < end; ++task) {
      at::Tensor sum = sums[task];
      for (int64_t t0 = split.first_tile(task); t0 < split.first_tile(task + 1); t0 += split.chunk) {
        const int64_t t1 = std::min(split.first_tile(task + 1), t0 + split.chunk), n = t1 - t0;
        at::Tensor hc = n < split.chunk ? at::empty({16, n, Kp}, options) : h;
        at::Tensor vc = n < split.chunk ? at::empty({16, n, Cp}, options) : v;
        run_serial(Transform::GradOutput4, Pass{Ho, Wo, Kp, tiles_h, tiles_w, 2, 0, t0, t1},
                   go_planes.const_data_ptr<acc_t>(), hc.mutable_data_ptr<acc_t>());
        run_serial(Transform::Data4, Pass{H, W, Cp, tiles_h, tiles_w, 2, p.padding[1], t0, t1},
                   x_planes.const_data_ptr<acc_t>(), vc.mutable_data_ptr<acc_t>());
        const at::Tensor ht = hc.narrow(2, 0, K).transpose(1, 2);
        batched_gemm(vectors, ht, vc, sum, /*accumulate=*/t0 != split.first_tile(task));
      }
    }
  });
  at::Tensor sum = sums[0];
  for (int64_t task = 1; task < split.tasks; ++task) sum.add_(sums[task]);
  at::Tensor taps = at::empty({9, K, Cp}, options);
  Pass taps_pass;
  taps_pass.channels = Cp, taps_pass.rows = K;
  run_taps(Transform::Taps4, taps_pass, sum.const_data_ptr<acc_t>(), taps.mutable_data_ptr<acc_t>());
  store_taps<scalar_t, acc_t>(taps.const_data_ptr<acc_t>(), K, C, gw.mutable_data_ptr<scalar_t>());
}

}  // namespace

std::optional<std::string> winograd_unsupported(const DirectProblem& p) {
  if (p.batch == 0 || p.in_per_group == 0 || p.out_per_group == 0) return "empty (zero batch or channels)";
  if (p.groups != 1) return "grouped (groups > 1)";
  if (p.kernel[0] != 1 || p.kernel[1] != 3 || p.kernel[2] != 3) return "kernel not 3x3 (or 1x3x3)";
  for (int i = 0; i < 3; ++i) {
    if (p.stride[i] != 1) return "strided";
  }
  if (p.dilation[1] != 1 || p.dilation[2] != 1) return "dilated";
  if (p.padding[0] != 0 || p.padding[1] != p.padding[2] || p.padding[1] > 2) {
    return "padding not the same in H and W, at most 2 (none in depth)";
  }
  return std::nullopt;
}

void winograd_backward_cpu(
    const DirectProblem& p, const at::Tensor& grad_output, const at::Tensor& input,
    const at::Tensor& weight, at::Tensor* grad_input, at::Tensor* grad_weight) {
  TORCH_INTERNAL_ASSERT(!winograd_unsupported(p), "winograd_backward_cpu: ", *winograd_unsupported(p));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad_output.scalar_type(), "winograd_backward_cpu", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    // grad_output's [position][channel] planes, transposed once for both gradients
    const at::Tensor go_planes = planes_of<scalar_t, acc_t>(
        grad_output, p.batch, p.out_per_group, p.out[0] * p.out[1] * p.out[2]);
    if (grad_input != nullptr) grad_input_impl<scalar_t, acc_t>(p, go_planes, weight, *grad_input);
    if (grad_weight != nullptr) grad_weight_impl<scalar_t, acc_t>(p, go_planes, input, *grad_weight);
  });
}

}  // namespace aten_override
