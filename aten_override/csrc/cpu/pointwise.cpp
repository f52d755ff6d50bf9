// The pointwise kernel of the compiled backend: grad_input and grad_weight of 1x1 layers (stride 1,
// no padding, groups == 1, float32 / float64) in one pass over grad_output, chunk by chunk of each
// sample's positions, with our own vector micro-kernels instead of BLAS.
//
// Why: these layers (MobileNetV2's and EfficientNet's expand / project convolutions: 16-384 channels
// on 14x14-112x112 planes) are skinny GEMMs: grad_input = weight^T (C_in x C_out) @ grad_output
// (C_out x H*W) has few rows, grad_weight = grad_output @ input^T a long reduction into a small
// matrix. MKL (native's Slow2d at one thread, and our gemm-im2col) runs them at 30-50 GFLOP/s on an
// AVX-512 core that reaches ~100 in a square GEMM, and reads grad_output from memory once per gradient.
//
// How: a chunk is a run of one sample's positions whose grad_output and input rows fit a quarter of the
// L2 (half without grad_input; read from the machine), asked for into L2 while the thread's previous
// chunk computes (rows a plane apart defeat the hardware prefetchers). Per chunk:
//   grad_input[ci, p] = sum_co weight[co, ci] * grad_output[co, p]: fused::Rows channels x fused::Cols
//     vectors of positions per micro-kernel, a broadcast weight times a grad_output vector per FMA;
//   grad_weight[co, ci] += sum_p grad_output[co, p] * input[ci, p]: the chunk's input transposed to
//     [position][channel] (fused.h's 16x16 tiles) a panel of positions at a time (panel_positions),
//     then fused::gemm_add's micro-kernels (Rows output channels x Cols vectors of input channels, a
//     broadcast grad_output element times an input vector per FMA). Both in the register blocks of the
//     CPU's vector type (fused::wide_vectors(): AVX-512 or AVX2 registers).
// Every float32 sum runs over blocks of at most kGiBlock / kGemmBlock terms in registers, then their
// totals (within twice native's error; one running sum was 4-7x native's on long sums).
// The chunk's grad_output is read from memory once and serves both gradients from the cache.
//
// Threads and bits: the (sample, chunk) tasks are split into at most fused::kMaxSlabs slabs, a number that
// does not depend on the thread count; each slab sums its chunks' grad_weight into its own partial,
// and the partials are added in slab order. grad_input's elements are each written by one task. So
// any thread count gives the same bits, run to run, on one machine (the chunk size follows its L2).
// No atomics.
#include "../convolution_backward.h"
#include "fused.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <limits>
#include <memory>
#include <vector>

namespace aten_override {
namespace {

using fused::Cols;
using fused::Rows;
using fused::Vec;
using fused::VecPair;

// Terms summed in registers before they are added to the stored total: grad_input's C_out channels
// (up to 128 in one pass: MobileNetV2's and EfficientNet's expand layers); grad_weight's positions:
// fused::kGemmBlock.
constexpr int64_t kGiBlock = 128;

// grad_input[i * ld_gi + p] = sum_co wp[co * Rows<V> + i] * go[co * ld_go + p] for i < rows and the
// NV vectors of positions from p = 0. The sum runs over blocks of kGiBlock channels in registers, each
// added to the stored total: a float32 sum then has at most kGiBlock terms at each level (one running
// sum over 2,048 channels measured 14-22 eps of grad_input where native's GEMM has 3-5).
template <typename V, int NV, typename acc_t, typename Tick>
ATEN_OVERRIDE_INLINE void gi_tile(
    const acc_t* go, int64_t ld_go, const acc_t* wp, int64_t c_out, acc_t* gi, int64_t ld_gi, int rows, Tick&& tick) {
  constexpr int64_t L = V::size;
  constexpr int kRows = Rows<V>;
  for (int64_t c0 = 0; c0 < c_out; c0 += kGiBlock) {
    // Every index of acc a constant (unrolled loops, `rows` tested inside): with a variable one GCC kept
    // acc in memory, zeroed per call by a 1.5 KB `rep stos` (6% of the kernel's time, perf).
    typename V::type acc[kRows][NV];
    ATEN_OVERRIDE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      ATEN_OVERRIDE_UNROLL
      for (int v = 0; v < NV; ++v) acc[i][v] = typename V::type{};
    }
    const acc_t* g_row = go + c0 * ld_go;
    const acc_t* w_row = wp + c0 * kRows;
    for (int64_t co = c0; co < std::min(c_out, c0 + kGiBlock); ++co, g_row += ld_go, w_row += kRows) {
      tick();
      typename V::type g[NV];
      ATEN_OVERRIDE_UNROLL
      for (int v = 0; v < NV; ++v) g[v] = V::load(g_row + v * L);
      ATEN_OVERRIDE_UNROLL
      for (int i = 0; i < kRows; ++i) {
        ATEN_OVERRIDE_UNROLL
        for (int v = 0; v < NV; ++v) acc[i][v] += w_row[i] * g[v];
      }
    }
    ATEN_OVERRIDE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      if (i >= rows) break;
      ATEN_OVERRIDE_UNROLL
      for (int v = 0; v < NV; ++v) {
        acc_t* out = gi + i * ld_gi + v * L;
        V::store(out, c0 == 0 ? acc[i][v] : V::load(out) + acc[i][v]);
      }
    }
  }
}

// One chunk: positions [0, n) from go / x / gi, whose channel rows are `plane` elements apart.
// wp: the weight packed for gi_tile (null: no grad_input); gw: this slab's partial (null: no grad_weight).
struct Chunk {
  const void* go;
  const void* x;
  const void* wp;
  void* gi;
  void* gw;  // (C_out, ci_pad)
  void* xt;  // a panel of the chunk's input as [position][ci_pad] (this thread's buffer)
  void* tail;  // grad_input's last positions: (C_out + Rows) x L (this thread's buffer)
  const int64_t* index;  // 0, 1, 2, ... (positions, for fused::load_tiles)
  int64_t n, plane, c_in, c_out, ci_pad;
  int64_t panel;  // positions of input transposed at a time: see panel_positions
  bool wide;  // Vec or VecPair (fused::wide_vectors(), read once per call: wp's blocks follow it)
  bool prefetched;  // the task before this one, on this thread, asked for this chunk's rows
  // the next task's chunk on this thread (next_go null: none): its rows are asked for while this one computes
  const void* next_go;
  const void* next_x;
  int64_t next_n;
};

// The next chunk's grad_output and input rows, asked for into L2 while the current chunk computes, spread
// evenly over the chunk's micro-kernel steps (a channel of grad_input, a position of grad_weight): a few
// lines every `interval` steps. Asked for in bursts (a few hundred lines per step of grad_input
// positions), they filled the core's line fill buffers: the prefetch instructions then took a quarter of
// the kernel's cycles (perf) and the memory and the arithmetic did not overlap.
template <typename acc_t>
class Ahead {
 public:
  // steps: how many times the chunk's micro-kernels will call the Ahead.
  Ahead(const Chunk& k, int64_t steps) {
    if (!k.next_go) return;
    go_ = static_cast<const char*>(k.next_go);
    x_ = static_cast<const char*>(k.next_x);
    row_bytes_ = k.plane * int64_t(sizeof(acc_t));
    go_rows_ = k.c_out;
    rows_ = k.c_out + (x_ ? k.c_in : 0);
    run_bytes_ = k.next_n * int64_t(sizeof(acc_t));
    const int64_t lines = rows_ * ((run_bytes_ + 63) / 64);
    // kBurst lines every `interval_` steps (every step where there are more lines than steps: the rest
    // in finish())
    interval_ = std::max<int64_t>(1, steps * kBurst / std::max<int64_t>(1, lines));
    countdown_ = interval_;
    start_row();
  }
  // One step.
  ATEN_OVERRIDE_INLINE void operator()() {
    if (--countdown_ > 0) return;
    countdown_ = interval_;
    for (int i = 0; i < kBurst; ++i) next_line();
  }
  // Asks for whatever is left.
  void finish() {
    while (row_ < rows_) next_line();
  }

 private:
  static constexpr int kBurst = 2;
  ATEN_OVERRIDE_INLINE void start_row() {
    if (row_ >= rows_) return;
    line_ = row_ < go_rows_ ? go_ + row_ * row_bytes_ : x_ + (row_ - go_rows_) * row_bytes_;
    end_ = line_ + run_bytes_;
  }
  ATEN_OVERRIDE_INLINE void next_line() {
    if (row_ >= rows_) return;
    __builtin_prefetch(line_, 0, 2);
    line_ += 64;
    if (line_ >= end_) ++row_, start_row();
  }

  const char* go_ = nullptr;
  const char* x_ = nullptr;
  const char* line_ = nullptr;
  const char* end_ = nullptr;
  int64_t row_bytes_ = 0, go_rows_ = 0, rows_ = 0, run_bytes_ = 0, row_ = 0;
  int64_t interval_ = std::numeric_limits<int64_t>::max(), countdown_ = std::numeric_limits<int64_t>::max();
};

template <typename V, typename acc_t>
ATEN_OVERRIDE_INLINE void run_chunk(const Chunk& k) {
  constexpr int64_t L = V::size, step = Cols<V> * L;
  constexpr int kRows = Rows<V>;
  const acc_t* go = static_cast<const acc_t*>(k.go);
  // Rows a plane apart defeat the hardware prefetchers (one stream per channel): a thread's first chunk
  // asks for its grad_output and input rows up front, each a contiguous run, and every chunk asks for
  // the next one's while it computes (Ahead: a few lines every few micro-kernel steps).
  if (!k.prefetched) {
    for (int64_t c = 0; c < k.c_out; ++c) fused::prefetch(go + c * k.plane, k.n);
    if (k.gw) {
      for (int64_t c = 0; c < k.c_in; ++c) fused::prefetch(static_cast<const acc_t*>(k.x) + c * k.plane, k.n);
    }
  }
  // the micro-kernels' steps: a channel of a grad_input block, a position of a grad_weight block
  const int64_t gi_steps = k.wp ? k.n / step * ((k.c_in + kRows - 1) / kRows) * k.c_out : 0;
  const int64_t gw_steps = k.gw ? (k.c_out + kRows - 1) / kRows * ((k.ci_pad + step - 1) / step) * k.n : 0;
  Ahead<acc_t> ahead(k, gi_steps + gw_steps);
  if (k.wp) {
    const acc_t* wp = static_cast<const acc_t*>(k.wp);
    acc_t* gi = static_cast<acc_t*>(k.gi);
    // Positions outer: a block of grad_output (C_out x step) stays in L1 across the channel blocks.
    int64_t p = 0;
    for (; p + step <= k.n; p += step) {
      for (int64_t c = 0; c < k.c_in; c += kRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kRows, k.c_in - c));
        gi_tile<V, Cols<V>>(go + p, k.plane, wp + c * k.c_out, k.c_out, gi + c * k.plane + p, k.plane, rows, ahead);
      }
    }
    for (; p + L <= k.n; p += L) {
      for (int64_t c = 0; c < k.c_in; c += kRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kRows, k.c_in - c));
        gi_tile<V, 1>(go + p, k.plane, wp + c * k.c_out, k.c_out, gi + c * k.plane + p, k.plane, rows, fused::NoTick{});
      }
    }
    if (p < k.n) {
      // The last positions (fewer than a vector: a 14x14 plane's 4 after 4 steps of 48) through gi_tile on a
      // zero-padded copy of their grad_output columns: the other positions' arithmetic, sums in the same
      // order. A scalar loop, one position at a time, took as long as the plane's other 192 (grad_input of
      // EfficientNet's 80 -> 480 at 14x14 1.8x native's time, 0.94x at 16x12), and its results differed
      // from the vector code's in the last place.
      const int64_t rem = k.n - p;
      acc_t* padded = static_cast<acc_t*>(k.tail);  // C_out x L, then the micro-kernel's rows x L
      acc_t* out = padded + k.c_out * L;
      for (int64_t co = 0; co < k.c_out; ++co) {
        std::copy_n(go + co * k.plane + p, rem, padded + co * L);
        std::fill(padded + co * L + rem, padded + (co + 1) * L, acc_t(0));
      }
      for (int64_t c = 0; c < k.c_in; c += kRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kRows, k.c_in - c));
        gi_tile<V, 1>(padded, L, wp + c * k.c_out, k.c_out, out, L, rows, fused::NoTick{});
        for (int i = 0; i < rows; ++i) std::copy_n(out + i * L, rem, gi + (c + i) * k.plane + p);
      }
    }
  }
  if (k.gw) {
    const acc_t* x = static_cast<const acc_t*>(k.x);
    acc_t* xt = static_cast<acc_t*>(k.xt);
    acc_t* gw = static_cast<acc_t*>(k.gw);
    // grad_weight (C_out x ci_pad) += grad_output rows (C_out x n) @ xt (n x ci_pad), panel by panel of
    // positions (Chunk::panel): the panel's input transposed into xt, then the micro-kernels, rows outer.
    // Without a next chunk (grad_weight alone, the last task) no tick: its count in the loop cost 3-6%.
    auto product = [&](auto&& tick) ATEN_OVERRIDE_ALWAYS_INLINE {
      for (int64_t p = 0; p < k.n; p += k.panel) {
        const int64_t n = std::min(k.panel, k.n - p);
        for (int64_t c = 0; c < k.c_in; c += L) {
          fused::load_tiles(x + c * k.plane + p, k.plane, std::min(L, k.c_in - c), k.index, n, xt + c, k.ci_pad);
        }
        for (int64_t r = 0; r < k.c_out; r += kRows) {
          const int rows = static_cast<int>(std::min<int64_t>(kRows, k.c_out - r));
          for (int64_t c = 0; c < k.ci_pad; c += Cols<V> * L) {
            const int vecs = static_cast<int>(std::min<int64_t>(Cols<V>, (k.ci_pad - c) / L));
            fused::gemm_block<V>(go + r * k.plane + p, k.plane, 1, xt + c, k.ci_pad, n, gw + r * k.ci_pad + c, k.ci_pad,
                                 rows, vecs, /*accumulate=*/true, tick);
          }
        }
      }
    };
    if (k.next_go) {
      product(ahead);
    } else {
      product(fused::NoTick{});
    }
  }
  ahead.finish();
}

// The vector code, compiled for each ISA level (target_clones reaches only these non-template
// functions, not the parallel_for lambdas that call them), in the CPU's vector type.
ATEN_OVERRIDE_CLONES void run_chunk_f(const Chunk& k) {
  if (k.wide) return run_chunk<Vec<float>, float>(k);
  run_chunk<VecPair<float>, float>(k);
}
ATEN_OVERRIDE_CLONES void run_chunk_d(const Chunk& k) {
  if (k.wide) return run_chunk<Vec<double>, double>(k);
  run_chunk<VecPair<double>, double>(k);
}

// Positions per chunk: grad_output and input rows of a chunk within half the L2 (a quarter where grad_input
// is computed: the next chunk's rows arrive meanwhile), a whole number of grad_input micro-kernels, at
// least one, at most the plane.
template <typename acc_t>
int64_t chunk_positions(const DirectProblem& p, int64_t plane, bool wide, bool gi) {
  constexpr int64_t element_size = sizeof(acc_t);
  const int64_t step = fused::cols_of<acc_t>(wide) * Vec<acc_t>::size;
  const int64_t l2 = l2_bytes();
  const int64_t n = l2 / (gi ? 4 : 2) / ((p.in_per_group + p.out_per_group) * element_size) / step * step;
  return std::min(plane, std::max(step, n));
}

// Positions of a chunk's input that grad_weight transposes at a time (Chunk::panel). With grad_input the
// chunk is in L2 before it is read (Ahead): panels whose transpose fits half the L1, so that its stores
// and the micro-kernels' reads of it hit L1, in whole blocks of fused::kGemmBlock (each micro-kernel's
// sums then start where they did over the whole chunk: the same bits). Transposed whole, a chunk's input
// (~1 MB) lived in L2, every store of the transpose missed L1, and the transpose took as long as the
// products (perf). In panels, both gradients of MobileNetV2's / EfficientNet's / ResNet-50's 1x1 layers
// take 0.84-0.97x their time with whole chunks (one thread; 0.83-1.01x with the caches flushed).
// Without grad_input the rows stream from memory, fetched by the hardware prefetchers, which follow a
// few rows read in order but not every row a panel at a time (grad_weight alone took up to 1.5x longer
// with the caches flushed): one panel, the whole chunk. At most per_chunk.
template <typename acc_t>
int64_t panel_positions(int64_t per_chunk, int64_t ci_pad, bool gi) {
  if (!gi) return per_chunk;
  const int64_t fit = l1_bytes() / 2 / (ci_pad * int64_t(sizeof(acc_t)));
  return std::min(per_chunk, std::max(fused::kGemmBlock, fit / fused::kGemmBlock * fused::kGemmBlock));
}

template <typename acc_t>
void pointwise_backward_typed(
    const DirectProblem& p, const at::Tensor& go, const at::Tensor& x, const at::Tensor& w, at::Tensor* gi,
    at::Tensor* gw) {
  const int64_t c_in = p.in_per_group, c_out = p.out_per_group, plane = p.in[0] * p.in[1] * p.in[2];
  const bool wide = fused::wide_vectors();
  const int64_t per_chunk = chunk_positions<acc_t>(p, plane, wide, gi != nullptr);
  const int64_t chunks = (plane + per_chunk - 1) / per_chunk, tasks = p.batch * chunks;
  // weight packed for gi_tile: wp[c / rows][co][c % rows] = weight[co, c], zeros past C_in, in blocks of
  // the micro-kernel's rows.
  std::vector<acc_t> wp;
  if (gi) {
    const int64_t rows = fused::rows_of<acc_t>(wide), blocks = (c_in + rows - 1) / rows;
    wp.assign(blocks * c_out * rows, acc_t(0));
    const acc_t* wd = w.const_data_ptr<acc_t>();
    for (int64_t co = 0; co < c_out; ++co) {
      for (int64_t c = 0; c < c_in; ++c) wp[(c / rows * c_out + co) * rows + c % rows] = wd[co * c_in + c];
    }
  }
  const int64_t ci_pad = fused::round_up<acc_t>(c_in);
  const int64_t panel = panel_positions<acc_t>(per_chunk, ci_pad, gi != nullptr);
  const int64_t slabs = fused::slab_count(tasks, gw ? c_out * ci_pad * int64_t(sizeof(acc_t)) : 0);
  at::Tensor partial = gw ? at::zeros({slabs, c_out, ci_pad}, go.options()) : at::Tensor();
  std::vector<int64_t> index(per_chunk);
  for (int64_t i = 0; i < per_chunk; ++i) index[i] = i;
  const acc_t* go_d = go.const_data_ptr<acc_t>();
  const acc_t* x_d = gw ? x.const_data_ptr<acc_t>() : nullptr;
  acc_t* gi_d = gi ? gi->mutable_data_ptr<acc_t>() : nullptr;
  acc_t* part_d = gw ? partial.mutable_data_ptr<acc_t>() : nullptr;
  // Serial below one GEMM-sized problem: a thread's start costs more than the chunk.
  const int64_t grain = plane * (c_in + c_out) * p.batch < fused::kSerialElements ? slabs : 1;
  at::parallel_for(0, slabs, grain, [&](int64_t begin, int64_t end) {
    // (not zeroed: every panel's positions are written before they are read)
    std::unique_ptr<acc_t[]> xt(gw ? new acc_t[panel * ci_pad] : nullptr);
    std::vector<acc_t> tail(gi ? (c_out + fused::rows_of<acc_t>(wide)) * Vec<acc_t>::size : 0);
    for (int64_t s = begin; s < end; ++s) {
      const int64_t slab_end = (s + 1) * tasks / slabs;
      for (int64_t t = s * tasks / slabs; t < slab_end; ++t) {
        const int64_t n = t / chunks, first = t % chunks * per_chunk;
        Chunk k;
        // (grad_weight alone: no grad_input steps to spread the next chunk's rows over)
        k.prefetched = gi && (s != begin || t != s * tasks / slabs);
        k.next_go = k.next_x = nullptr;
        k.next_n = 0;
        const int64_t next = !gi ? -1 : t + 1 < slab_end ? t + 1 : s + 1 < end ? slab_end : -1;
        if (next >= 0) {
          const int64_t next_n = next / chunks, next_first = next % chunks * per_chunk;
          k.next_go = go_d + next_n * c_out * plane + next_first;
          k.next_x = x_d ? x_d + next_n * c_in * plane + next_first : nullptr;
          k.next_n = std::min(per_chunk, plane - next_first);
        }
        k.go = go_d + n * c_out * plane + first;
        k.x = x_d ? x_d + n * c_in * plane + first : nullptr;
        k.wp = gi ? wp.data() : nullptr;
        k.gi = gi_d ? gi_d + n * c_in * plane + first : nullptr;
        k.gw = part_d ? part_d + s * c_out * ci_pad : nullptr;
        k.xt = xt.get();
        k.tail = tail.data();
        k.index = index.data();
        k.n = std::min(per_chunk, plane - first);
        k.panel = panel;
        k.plane = plane, k.c_in = c_in, k.c_out = c_out, k.ci_pad = ci_pad, k.wide = wide;
        if constexpr (std::is_same_v<acc_t, float>) {
          run_chunk_f(k);
        } else {
          run_chunk_d(k);
        }
      }
    }
  });
  if (gw) {
    // The slabs' partials added in slab order.
    fused::sum_slabs(part_d, slabs, c_out, c_in, ci_pad, gw->mutable_data_ptr<acc_t>());
  }
}

}  // namespace

std::optional<std::string> pointwise_unsupported(const DirectProblem& p, at::ScalarType dtype) {
  if (p.groups != 1) return "grouped (groups > 1)";
  for (int i = 0; i < 3; ++i) {
    if (p.kernel[i] != 1 || p.stride[i] != 1 || p.padding[i] != 0) return "not 1x1 with stride 1 and no padding";
  }
  if (dtype != at::kFloat && dtype != at::kDouble) {
    return "float16 / bfloat16: native's oneDNN keeps them in one GEMM (pointwise-bf16 computes bfloat16)";
  }
  if (p.batch == 0 || p.in_per_group == 0 || p.out_per_group == 0 || p.in[0] * p.in[1] * p.in[2] == 0) {
    return "empty";
  }
  return std::nullopt;
}

void pointwise_backward_cpu(
    const DirectProblem& p, const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    at::Tensor* grad_input, at::Tensor* grad_weight) {
  TORCH_INTERNAL_ASSERT(!pointwise_unsupported(p, grad_output.scalar_type()));
  if (grad_output.scalar_type() == at::kFloat) {
    pointwise_backward_typed<float>(p, grad_output, input, weight, grad_input, grad_weight);
  } else {
    pointwise_backward_typed<double>(p, grad_output, input, weight, grad_input, grad_weight);
  }
}

}  // namespace aten_override
