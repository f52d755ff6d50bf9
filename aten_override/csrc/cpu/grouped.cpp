// The grouped-lanes kernel of the compiled backend: grad_input and grad_weight of grouped
// convolutions with 2 to 64 channels per group on each side (ResNeXt), 1-D/2-D/3-D, any stride,
// padding and dilation (not transposed), on the [position][channel] tiles of cpu/fused.h.
#include "fused.h"

#include <ATen/Dispatch.h>

#include <algorithm>
#include <tuple>
#include <vector>

namespace aten_override {
namespace {
using namespace fused;

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
  GroupedTiles t;
  t.ci_pad = round_up<acc_t>(p.in_per_group);
  t.co_pad = round_up<acc_t>(p.out_per_group);
  t.bytes = ((g.size + 1) * 2 * t.ci_pad + (g.margin + g.size + 1) * t.co_pad) * static_cast<int64_t>(sizeof(acc_t));
  return t;
}

// grad_input sums run over blocks of taps of at most this many terms (taps x output channels of the
// group; at least one tap) in registers, each block's total added to the stored one: a float32 sum
// then has at most kGatherTerms terms at each level. One running sum over all C_out / groups x taps
// terms measured 17-31 eps of the result's scale where native has 2-4 (64 channels per group and 31
// taps; wav2vec2's positional convolution, 48 x 128; test_long_sums_as_accurate_as_native).
constexpr int64_t kGatherTerms = 128;

// grad_input of `NP` positions j, j + step, ... (one stride phase of a row) over `ntaps` taps: the
// tile gp (pitch ci_pad) from gs (grad_output, pitch co_pad, from its margin) and wv ([k][co][ci_pad]).
// Each position sums into NA partial vectors (output channels c % NA), so that even one position
// runs NA independent FMA chains; they are added in a fixed order at the end of each block of taps.
template <int NP, int NA, typename V, typename acc_t>
ATEN_OVERRIDE_INLINE void grouped_gather_block(
    acc_t* gp, const acc_t* gs, const acc_t* wv, const int64_t* taps, int64_t ntaps, const int64_t* offset,
    int64_t co, int64_t co_pad, int64_t ci_pad, int64_t j, int64_t step) {
  constexpr int64_t L = V::size;
  const int64_t block = std::max<int64_t>(1, kGatherTerms / std::max<int64_t>(1, co));
  for (int64_t v = 0; v < ci_pad; v += L) {
    // t0 == 0 runs once even without taps: the positions' zeros are stored.
    for (int64_t t0 = 0; t0 == 0 || t0 < ntaps; t0 += block) {
      typename V::type s[NP][NA];
      for (int i = 0; i < NP; ++i)
        for (int a = 0; a < NA; ++a) s[i][a] = typename V::type{};
      for (int64_t t = t0; t < std::min(ntaps, t0 + block); ++t) {
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
        acc_t* out = gp + (j + i * step) * ci_pad + v;
        V::store(out, t0 == 0 ? s[i][0] : V::load(out) + s[i][0]);
      }
    }
  }
}

// acc[r] (NB vectors of output channels) += sum over the output positions opos[0 .. count) of
// gs[j][v .. v + L) * xt[j * ci_pad + xoff[r]] (xoff: offset[k] * ci_pad + ci of pair r),
// kLanesChunk positions at a time.
template <int NB, typename V, typename acc_t>
ATEN_OVERRIDE_INLINE void grouped_correlate_block(
    acc_t* acc, const acc_t* gs, const acc_t* xt, const int64_t* xoff, const int64_t* opos, int64_t count,
    int64_t co_pad, int64_t ci_pad, int64_t v) {
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

template <typename V, typename acc_t>
struct GroupedCorrelateOp {
  acc_t* acc;
  const acc_t* gs;
  const acc_t* xt;
  const int64_t* xoff;
  const int64_t* opos;
  int64_t count, co_pad, ci_pad, v;
  template <int NB>
  ATEN_OVERRIDE_INLINE void run(int64_t first, int64_t) const {
    grouped_correlate_block<NB, V>(acc + first * V::size, gs, xt, xoff + first, opos, count, co_pad, ci_pad, v);
  }
};

// grad_input tile of one group and sample: every interior position, by row and stride phase.
template <typename V, typename acc_t>
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
        const int64_t cls = g.phase_class(t, h, phase);
        const int64_t begin = phases.class_begin[cls], ntaps = phases.class_begin[cls + 1] - begin;
        const int64_t* taps = phases.class_taps.data() + begin;
        const int64_t j0 = g.row(t, h) + c0;
        int64_t i = 0;
        for (; i + 4 <= count; i += 4) {
          grouped_gather_block<4, 1, V>(gp, gs, wv, taps, ntaps, offset, co, co_pad, ci_pad, j0 + i * g.stride_w, g.stride_w);
        }
        const int64_t j = j0 + i * g.stride_w;
        switch (count - i) {
          case 3: grouped_gather_block<3, 2, V>(gp, gs, wv, taps, ntaps, offset, co, co_pad, ci_pad, j, g.stride_w); break;
          case 2: grouped_gather_block<2, 2, V>(gp, gs, wv, taps, ntaps, offset, co, co_pad, ci_pad, j, g.stride_w); break;
          case 1: grouped_gather_block<1, 4, V>(gp, gs, wv, taps, ntaps, offset, co, co_pad, ci_pad, j, g.stride_w); break;
          default: break;
        }
      }
    }
  }
}

// grad_weight sums (acc: [co vector][pair][L]) of one group and sample.
template <typename V, typename acc_t>
ATEN_OVERRIDE_INLINE void grouped_correlate_plane(
    acc_t* acc, const acc_t* gs, const acc_t* xt, const int64_t* xoff, int64_t pairs, const int64_t* opos,
    int64_t count, int64_t co_pad, int64_t ci_pad) {
  constexpr int64_t L = Vec<acc_t>::size;
  for (int64_t v = 0; v < co_pad; v += L) {
    for_tap_blocks(pairs, GroupedCorrelateOp<V, acc_t>{acc + v / L * pairs * L, gs, xt, xoff, opos, count, co_pad, ci_pad, v});
  }
}

ATEN_OVERRIDE_CLONES void grouped_gather_f(
    const Plane& g, const PhaseTaps& ph, const int64_t* o, float* gp, const float* gs, const float* wv, int64_t co,
    int64_t co_pad, int64_t ci_pad) {
  if (wide_vectors()) return grouped_gather_plane<Vec<float>>(g, ph, o, gp, gs, wv, co, co_pad, ci_pad);
  grouped_gather_plane<VecPair<float>>(g, ph, o, gp, gs, wv, co, co_pad, ci_pad);
}
ATEN_OVERRIDE_CLONES void grouped_gather_d(
    const Plane& g, const PhaseTaps& ph, const int64_t* o, double* gp, const double* gs, const double* wv, int64_t co,
    int64_t co_pad, int64_t ci_pad) {
  if (wide_vectors()) return grouped_gather_plane<Vec<double>>(g, ph, o, gp, gs, wv, co, co_pad, ci_pad);
  grouped_gather_plane<VecPair<double>>(g, ph, o, gp, gs, wv, co, co_pad, ci_pad);
}
ATEN_OVERRIDE_CLONES void grouped_correlate_f(
    float* acc, const float* gs, const float* xt, const int64_t* xoff, int64_t pairs, const int64_t* opos,
    int64_t count, int64_t co_pad, int64_t ci_pad) {
  if (wide_vectors()) return grouped_correlate_plane<Vec<float>>(acc, gs, xt, xoff, pairs, opos, count, co_pad, ci_pad);
  grouped_correlate_plane<VecPair<float>>(acc, gs, xt, xoff, pairs, opos, count, co_pad, ci_pad);
}
ATEN_OVERRIDE_CLONES void grouped_correlate_d(
    double* acc, const double* gs, const double* xt, const int64_t* xoff, int64_t pairs, const int64_t* opos,
    int64_t count, int64_t co_pad, int64_t ci_pad) {
  if (wide_vectors()) return grouped_correlate_plane<Vec<double>>(acc, gs, xt, xoff, pairs, opos, count, co_pad, ci_pad);
  grouped_correlate_plane<VecPair<double>>(acc, gs, xt, xoff, pairs, opos, count, co_pad, ci_pad);
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
#ifdef ATEN_OVERRIDE_AVX512
  const bool stream = gi_bytes >= kStreamBytes && streaming_stores().streaming;
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

// Largest channels per group (input or output side) the grouped kernel takes; larger groups are
// GEMMs that im2col serves well. Its tiles per thread must stay in this machine's L2 (1 MiB where
// the size cannot be read).
constexpr int64_t kGroupedMaxChannels = 64;
int64_t grouped_max_tile_bytes() {
  const int64_t l2 = cache_bytes(2);
  return l2 > 0 ? l2 : int64_t{1} << 20;
}

std::optional<std::string> grouped_lanes_unsupported(const DirectProblem& p, at::ScalarType dtype) {
  if (p.groups < 2 || p.in_per_group < 2 || p.in_per_group > kGroupedMaxChannels ||
      p.out_per_group > kGroupedMaxChannels) {
    return c10::str("not grouped with 2-", kGroupedMaxChannels, " channels per group");
  }
  if (dtype == at::kHalf) return "float16: not built";
  const Plane g = make_plane(p, 1);
  const int64_t bytes = dtype == at::kDouble ? grouped_tiles<double>(p, g).bytes : grouped_tiles<float>(p, g).bytes;
  if (bytes > grouped_max_tile_bytes()) {
    return c10::str(
        "a plane's tiles (", bytes >> 10, " KiB) are over the L2 (", grouped_max_tile_bytes() >> 10, " KiB)");
  }
  return std::nullopt;
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

}  // namespace aten_override
