// The compiled backend of aten::convolution_backward: argument checks (mirroring
// ops/convolution_backward/args.py), the per-layer-class kernel choice, upstream's output layout,
// the fallback to the original kernel with recorded reasons, the C++ registration at the CPU and
// CUDA dispatch keys, and the Python bindings (module aten_override._C).
//
// No Python runs on the per-call path once register_kernels() has been called.
#include "convolution_backward.h"
#include "cpu/workspace.h"

#include <ATen/ATen.h>
#include <ATen/cpu/Utils.h>
#include <ATen/native/ConvUtils.h>
#include <ATen/ops/convolution_backward_compositeexplicitautograd_dispatch.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/GradMode.h>
#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#if defined(__linux__)
#include <sys/mman.h>
#endif
#include <vector>

#include <unistd.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#define ATEN_OVERRIDE_CLFLUSHOPT 1
#endif

namespace aten_override {

int64_t cache_bytes(int level) {
  static std::array<std::atomic<int64_t>, 5> known{-1, -1, -1, -1, -1};
  if (level < 1 || level > 4) return 0;
  int64_t bytes = known[level].load(std::memory_order_relaxed);
  if (bytes >= 0) return bytes;
  bytes = 0;
  for (int i = 0; i < 16 && bytes == 0; ++i) {
    const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i) + "/";
    std::ifstream level_file(dir + "level"), type_file(dir + "type"), size_file(dir + "size");
    int found = 0;
    std::string type, text;
    if (!(level_file >> found) || !(type_file >> type) || !(size_file >> text)) continue;
    if (found != level || type == "Instruction") continue;
    char* unit = nullptr;
    int64_t value = std::strtoll(text.c_str(), &unit, 10);
    if (*unit == 'K') value <<= 10;
    if (*unit == 'M') value <<= 20;
    bytes = std::max<int64_t>(value, 0);
  }
  long reported = 0;
#if defined(_SC_LEVEL1_DCACHE_SIZE) && defined(_SC_LEVEL2_CACHE_SIZE) && defined(_SC_LEVEL3_CACHE_SIZE)
  if (bytes == 0 && level <= 3) {
    reported = sysconf(level == 1 ? _SC_LEVEL1_DCACHE_SIZE : level == 2 ? _SC_LEVEL2_CACHE_SIZE : _SC_LEVEL3_CACHE_SIZE);
  }
#endif
  if (bytes == 0 && reported > 0) bytes = reported;
  known[level].store(bytes, std::memory_order_relaxed);
  return bytes;
}

namespace {

using Result = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using Mask = std::array<bool, 3>;

#define CHECK_ARG(cond, ...) TORCH_CHECK(cond, "convolution_backward[compiled]: ", __VA_ARGS__)

// --- layer classes: which kernel serves what, and why (mirrored in compiled.py's docs) ---------

enum class LayerClass : int {
  Empty = 0,
  Depthwise,
  Grouped,
  OneChannel,
  SmallPlanes,
  Dense,
  Transposed,
  BiasOnly,
  Pointwise,
  GroupedGemm,
  Kn2row3d,
  Im2col3d,
  Kn2row,
  DeadTaps,
  GroupedLanes,
  Count
};

struct LayerClassInfo {
  const char* name;
  const char* kernel;  // "direct" (cpu/direct.cpp), "gemm" (cpu/gemm.cpp), "zeros", "sum", "native" (the original
                       // kernel) or "upcast" (the original kernel in float32)
  const char* why;
};

constexpr LayerClassInfo kLayerClasses[] = {
    {"empty", "zeros",
     "zero batch or zero input channels (upstream's Empty backend): zeros; bias_sizes=None gives zeros(C_out) "
     "instead of upstream's abort"},
    {"depthwise", "direct",
     "groups == C_in (channel multiplier C_out / C_in >= 1), any plane size: native's depthwise paths reach 1-6% "
     "of FLOP peak; fused kernel (cpu/depthwise.cpp), one pass over grad_output and input: plane by plane, or "
     "with channels in the vector lanes on small or strided planes (MobileNetV2's 7x7 and stride-2 stages); the lanes walks "
     "keep a kernel row's taps in registers at stride 1 and read / write channels-last tensors in place"},
    {"grouped", "direct",
     "1 < groups < C_in with (C_in / groups) * (C_out / groups) <= 64 (ResNeXt layer1): native reaches 7-13% of peak; "
     "direct kernel per group"},
    {"one-channel", "direct",
     "groups == 1 and C_in == 1 (wav2vec2's first layer): native reaches 3% of peak; direct kernel"},
    {"small-planes", "native",
     "grouped / one-channel with under 64 output elements per channel: the direct kernel's per-plane overhead "
     "loses to native there (use native); depthwise small planes (MobileNetV2's 7x7 stages) stay depthwise"},
    {"dense", "native",
     "dense 1-D / 2-D layers, and the layers the GEMM classes below leave to native (float16; bfloat16 but "
     "pointwise; pointwise and 3-D layers native does not send to oneDNN / Slow3d): native's oneDNN / GEMM "
     "paths are near the hardware limit there, or as fast (use native). The autotuner also measures winograd on 3x3 "
     "stride-1 layers (cpu/winograd.cpp: 2.25x fewer multiplications; grad_input 0.66-0.88x, grad_weight "
     "0.57-0.84x native on ResNet-50's stride-1 3x3 layers at one thread, which the table does not assume), and "
     "pointwise-fused on 1x1 stride-1 float32 / float64 layers (cpu/pointwise.cpp: both gradients in one pass "
     "over grad_output; 0.5-0.7x native's Slow2d on few-channel layers with large planes, MobileNetV2's and "
     "EfficientNet's expand convolutions, at one thread; slower than native on small planes), pointwise-bf16 on "
     "1x1 stride-1 bfloat16 layers where the CPU has AVX512_BF16 (cpu/pointwise_bf16.cpp: the same plan with "
     "bfloat16 dot products; 0.5-0.8x native's oneDNN on few-channel layers, one thread, Zen 4), and kn2row-lanes "
     "on float32 / float64 layers of 1-D shape, any stride (cpu/kn2row.cpp), and gemm-kn2row on bfloat16 "
     "layers, any stride, groups 1 or (stride 1) taps in one dim (cpu/gemm.cpp: oneDNN's bfloat16 GEMMs on "
     "zero-padded channel-major copies, strided grad_input phase by phase, each output rounded once; "
     "0.22-0.58x native's oneDNN on ResNet-50's stride-1 1x1 layers in its bfloat16 step, one thread; 0.42x "
     "on wav2vec2's 512-channel stride-2 conv_layers.1; 1.5-1.9x on ResNet's 3x3 layers)"},
    {"transposed", "native", "transposed layers: no compiled kernel yet; native's oneDNN paths serve them (use native)"},
    {"bias-only", "sum",
     "output_mask asks for neither grad_input nor grad_weight: grad_bias is grad_output's sum over every dim but 1 "
     "(or nothing is computed), whatever the weight; upstream's oneDNN paths create a convolution primitive for it "
     "and fail on zero output channels or a zero kernel size"},
    {"pointwise", "gemm",
     "1x1, no padding, groups == 1, where native picks oneDNN: its backward reaches 4-17% of peak (bfloat16 "
     "4% of AMX); plain GEMMs on input / grad_input views (strided: one gather); measured 0.26-0.5x native "
     "(ResNet-50). bfloat16 only where the whole batch is one AMX GEMM per output (in float32 it measured "
     "1.3-1.6x). Where native picks Slow2d (itself GEMMs) it stays dense: 1.03x. The autotuner also measures "
     "pointwise-fused on both (see dense)"},
    {"grouped-gemm", "gemm",
     "float32 / float64, 1 < groups < C_in with (C_in / groups) * (C_out / groups) > 64, some stride > 1, "
     "where grouped-lanes does not apply (over 64 channels per group): native's oneDNN backward is weak on "
     "strided grouped layers; im2col + GEMM group by group in L2-sized chunks, measured 0.63-0.87x. At stride 1 "
     "native is faster (1.2-2.4x ours): dense. bfloat16 stays dense (in float32 it measured 1.8x native's time "
     "and memory)"},
    {"kn2row-3d", "gemm",
     "3-D, groups == 1, stride 1, taps in one dim only (R(2+1)D's 3x1x1), where native picks Slow3d (7% of "
     "peak): one GEMM per tap on shifted views, no copies; measured 0.35-0.38x native. Also where native picks "
     "oneDNN, from 2^18 grad_output elements: 0.59-0.99x its time, 0.41-0.84x its peak memory (it maps fresh "
     "pages per call)"},
    {"im2col-3d", "gemm",
     "other 3-D layers with groups == 1 where native picks Slow3d (C3D's first layer: 6% of peak): vol2col + "
     "GEMM in bounded chunks, measured 0.30-0.33x. Where native picks oneDNN (near the limit: 43-57% of peak, "
     "ResNet3D-18) it stays dense: vol2col + GEMM measured 1.2x"},
    {"kn2row", "native",
     "1-D / 2-D, groups == 1, stride 1, taps in one dim only (HiFi-GAN's k7 d3): kn2row measured 1.08-1.14x "
     "native, whose oneDNN path runs at MKL's GEMM rate there (use native)"},
    {"dead-taps", "upcast",
     "bfloat16 / float16 on the CPU where native picks oneDNN and a kernel tap only ever meets padding (e.g. "
     "padding >= the dilated kernel on a short dim): torch 2.13's oneDNN path leaves that tap of grad_weight "
     "uninitialised (bfloat16: garbage values that change run to run) and segfaults computing grad_input of "
     "such transposed layers; also transposed layers whose input has width 1 under a wider kernel (e.g. "
     "(N, C, 8, 1), kernel 3x3, stride 2: most of grad_input unwritten, no dead tap); and padded regular 3-D "
     "layers with a dim shorter than the dilated kernel (parts of both gradients unwritten, heap "
     "corruption); bfloat16 3-D layers asking for grad_weight on a CPU with AMX-BF16 (grad_weight off by up "
     "to half its scale on larger planes: those that fold into a 2-D call, a 1x1 spatial kernel (R(2+1)D's "
     "3x1x1) or kernel depth 1 without depth padding (its 1xkxk), are computed as that 2-D call in bfloat16 "
     "(fold-2d), where native's oneDNN path is right); and bfloat16 2-D depthwise layers, regular or "
     "transposed, with a dilation and a channels-last input (grad_weight NaN or unwritten). Otherwise computed in float32 (correct "
     "there) by the compiled backend's own choice for the float32 call (native, or a kernel measured "
     "faster: gemm-kn2row on R(2+1)D's 3x1x1 layers) and rounded once, into native's layout; where the dead "
     "taps are the kernel's ends, the call without them, in its own dtype (kernel live-taps: R(2+1)D's 3x1x1 "
     "layers at one frame). Where amx_3d_weight is the only defect the autotuner measures the candidates "
     "against fold-2d: gemm-kn2row in bfloat16 on R(2+1)D's 3x1x1 layers (0.45-0.5x fold-2d's time on its "
     "144 -> 64 layer at 56x56, one or two threads). Also 3-D layers on oneDNN, any dtype but float64, with padding > stride in depth "
     "and no row there meeting the whole kernel (transposed: no input position writing inside the output; "
     "regular: no output position reading inside the input, e.g. depth 3, kernel 9, stride 4, padding 7): "
     "oneDNN's float32 gradients were wrong, hung or corrupted the heap on some; computed in float64 the "
     "same way (no oneDNN there)"},
    {"grouped-lanes", "direct",
     "float32 / float64 / bfloat16, 1 < groups, 2 to 64 channels per group on each side, (C_in / groups) * "
     "(C_out / groups) > 64, some stride > 1, at least 2^20 grad_output elements, each group's tiles within "
     "L2 (ResNeXt's stride-2 layers): native's oneDNN reaches 8-12% of peak there and im2col + GEMM (K = "
     "C_out / groups) is memory-bound on its columns; each group's planes are transposed to [position][channel] "
     "tiles and both gradients computed from them, no columns (cpu/grouped.cpp): measured 0.4-0.6x native"},
};
static_assert(sizeof(kLayerClasses) / sizeof(kLayerClasses[0]) == static_cast<size_t>(LayerClass::Count));

// The kernels a call can be served by (a layer class names the static choice; see choose_kernel).
enum class Kernel : int {
  Native = 0,    // the original kernel
  Zeros,         // upstream's Empty backend (empty_backward)
  Sum,           // grad_bias alone
  Upcast,        // float32 / float64 copies, served by this backend's choice for them (the dead-taps class)
  LiveTaps,      // the call without its dead taps, in its own dtype (the dead-taps class, where exact)
  DepthwisePlane,  // cpu/depthwise.cpp, plane by plane
  DepthwiseLanes,  // cpu/depthwise.cpp, channels in the vector lanes
  DepthwiseBands,  // cpu/depthwise.cpp, channels in the vector lanes, in bands of rows sized to L2
  Direct,        // cpu/direct.cpp (grouped, one-channel; depthwise on CUDA)
  GroupedLanes,  // cpu/grouped.cpp
  GemmIm2col,    // cpu/gemm.cpp, im2col + GEMM
  GemmKn2row,    // cpu/gemm.cpp, one GEMM per tap
  Winograd,      // cpu/winograd.cpp, grad_input F(2x2, 3x3), grad_weight F(3x3, 2x2)
  PointwiseFused,  // cpu/pointwise.cpp, 1x1 stride 1: both gradients in one pass, vector micro-kernels
  Kn2rowLanes,   // cpu/kn2row.cpp, 1-D stride 1: per tap over the positions it meets, vector micro-kernels
  PointwiseBf16,  // cpu/pointwise_bf16.cpp, bfloat16 1x1 stride 1: both gradients in one pass, bfloat16 dot products
  Kn2rowPlanes,  // cpu/gemm.cpp, gemm-kn2row's products on the vector micro-kernels, in the tensors' layout
  Fold2d,        // a 3-D call served as the 2-D call it folds into, by this backend's choice for that call
  Test,          // a fake candidate for the autotuner's tests (set_test_candidate); never otherwise
  Count
};

constexpr const char* kKernelNames[] = {"native",          "zeros",           "sum",             "upcast",
                                        "live-taps",
                                        "depthwise-plane", "depthwise-lanes", "depthwise-bands", "direct",
                                        "grouped-lanes",   "gemm-im2col",     "gemm-kn2row",   "winograd",
                                        "pointwise-fused", "kn2row-lanes",    "pointwise-bf16",  "kn2row-planes",
                                        "fold-2d",         "test"};
static_assert(sizeof(kKernelNames) / sizeof(kKernelNames[0]) == static_cast<size_t>(Kernel::Count));


// Largest (C_in / groups) * (C_out / groups) the direct kernel takes for grouped layers. It does no
// register blocking over channels, so its cost grows with the channel pairs while native's GEMM paths
// get better: measured on ResNeXt-50, 4x4 pairs run at 0.27x native's time, 16x16 at 4.7x.
constexpr int64_t kDirectMaxChannelPairs = 64;

// Fewest grad_output elements per channel the direct kernel takes: below, its fixed cost per plane
// (packing, zeroing, tap blocks) dominates; measured on MobileNetV2's 7x7 depthwise stage at ~2x
// native's time. Depthwise layers take the fused kernel instead, whose per-plane cost is small.
constexpr int64_t kDirectMinPlane = 64;

// Fewest grad_output elements for which the pointwise / 3-D GEMM classes ask which path native would
// take (select_conv_backend, about 1 us a call): smaller layers stay dense, there is nothing to gain
// from GEMMs that small, and the per-call cost on tiny convolutions stays that of the dense class.
constexpr int64_t kGemmMinOutputs = 512;

// Fewest grad_output elements for which grouped-lanes takes a strided layer (fewer: dense). Measured
// on ResNeXt-50's grouped layers (one thread): stride 2 with 2^20 to 2^22 elements 0.5-0.6x native's
// time, 2^19 1.1x; at stride 1 native's oneDNN path is as fast or faster (0.6-1.9x ours), so
// stride-1 grouped layers stay dense, as do stride-1 layers grouped-gemm used to take (1.2-2.4x).
constexpr int64_t kGroupedLanesMinOutputs = int64_t(1) << 20;

// Fewest grad_output elements for which kn2row-3d takes a layer native would send to oneDNN: R(2+1)D's
// 3x1x1 layers (2^18 to 2^20 elements) measured 0.59-0.99x native's time and 0.41-0.84x its peak
// memory; a 2^16-element one 1.09x.
constexpr int64_t kKn2rowOnednnMinOutputs = int64_t(1) << 18;

// --- counters (merged into aten_override.stats()) ----------------------------------------------

struct Counters {
  std::atomic<int64_t> layer_class[static_cast<int>(LayerClass::Count)] = {};
  std::atomic<int64_t> kernel[static_cast<int>(Kernel::Count)] = {};  // calls each kernel served
  // calls a split choice served: [grad_input's kernel][grad_weight's kernel]
  std::atomic<int64_t> split[static_cast<int>(Kernel::Count)][static_cast<int>(Kernel::Count)] = {};
  std::atomic<int64_t> served{0};    // calls the registered C++ kernel served in the compiled backend
  std::atomic<int64_t> fallback{0};  // calls it handed to the original kernel
  std::atomic<int64_t> rescaled{0};  // served calls computed on operands x 2^k (serve_rescaled)
  std::atomic<int64_t> declined{0};  // calls a chosen kernel of ours declined (inf / NaN): reference_kernel's
  std::atomic<int64_t> skipped{0};   // calls sent to reference_kernel unoffered (Declining, below)
  std::mutex reasons_mutex;
  std::map<std::string, int64_t> fallback_reasons;
};

Counters& counters() {
  static Counters c;
  return c;
}

// --- arguments ----------------------------------------------------------------------------------

// Python's names (torch.float64), as the python backend's messages print them.
std::string py_name(at::ScalarType t) {
  switch (t) {
    case at::kDouble: return "torch.float64";
    case at::kFloat: return "torch.float32";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kLong: return "torch.int64";
    case at::kInt: return "torch.int32";
    case at::kShort: return "torch.int16";
    case at::kChar: return "torch.int8";
    case at::kByte: return "torch.uint8";
    case at::kBool: return "torch.bool";
    case at::kComplexFloat: return "torch.complex64";
    case at::kComplexDouble: return "torch.complex128";
    default: return c10::str("torch.", t);
  }
}

std::string py_name(at::Layout l) {
  switch (l) {
    case at::kStrided: return "torch.strided";
    case at::kSparse: return "torch.sparse_coo";
    case at::kSparseCsr: return "torch.sparse_csr";
    case at::kSparseCsc: return "torch.sparse_csc";
    case at::kSparseBsr: return "torch.sparse_bsr";
    case at::kSparseBsc: return "torch.sparse_bsc";
    case at::kMkldnn: return "torch._mkldnn";
    default: return c10::str("torch.", l);
  }
}

struct Args {
  const at::Tensor& grad_output;
  const at::Tensor& input;
  const at::Tensor& weight;
  at::OptionalIntArrayRef bias_sizes;
  at::IntArrayRef stride, padding, dilation;
  bool transposed;
  at::IntArrayRef output_padding;
  int64_t groups;
  Mask output_mask;
};

// A length-1 list broadcasts to every spatial dim (upstream's expand_param_if_needed).
std::vector<int64_t> expand(at::IntArrayRef values, int64_t dims) {
  return values.size() == 1 ? std::vector<int64_t>(dims, values[0]) : values.vec();
}

struct Expanded {
  int64_t dims;
  std::vector<int64_t> stride, padding, dilation, output_padding;
  int64_t c_in, c_out;
};

// Whether upstream serves the call with its Empty backend (a zero batch or zero input channels): zeros,
// reading nothing of grad_output but its number of dims. Mirrors args.is_empty_call.
bool is_empty_call(const at::Tensor& input) {
  return input.dim() >= 2 && (input.size(0) == 0 || input.size(1) == 0);
}

// Whether output_mask asks for grad_input or grad_weight; when not, the call needs only grad_output.
// Mirrors args.needs_weight_or_input.
bool needs_weight_or_input(const Args& a) {
  return a.output_mask[0] || a.output_mask[1];
}

// Mirrors args.check_args: upstream's checks in its order (ConvParams, check_shape_backward, dims,
// output_padding), then nothing more for an Empty call, then the checks upstream leaves to the backend.
Expanded check_args(const Args& a) {
  const auto &go = a.grad_output, &x = a.input, &w = a.weight;
  const int64_t k = w.dim();
  CHECK_ARG(k >= 3, "weight should have at least three dimensions, got weight of size ", w.sizes());
  CHECK_ARG(
      x.dim() == k && go.dim() == k, "expected input and grad_output to be ", k, "-dimensional like weight ",
      w.sizes(), ", got input of size ", x.sizes(), " and grad_output of size ", go.sizes());
  Expanded e;
  e.dims = k - 2;
  const std::pair<const char*, at::IntArrayRef> lists[] = {
      {"stride", a.stride}, {"padding", a.padding}, {"dilation", a.dilation}, {"output_padding", a.output_padding}};
  for (const auto& [name, values] : lists) {
    CHECK_ARG(
        values.size() == 1 || static_cast<int64_t>(values.size()) == e.dims, "expected ", name,
        " to be a single integer value or a list of ", e.dims, " values to match the convolution dimensions, but got ",
        name, "=", values);
  }
  e.stride = expand(a.stride, e.dims);
  e.padding = expand(a.padding, e.dims);
  e.dilation = expand(a.dilation, e.dims);
  e.output_padding = expand(a.output_padding, e.dims);
  for (auto s : e.stride) CHECK_ARG(s > 0, "non-positive stride is not supported, got stride=", at::IntArrayRef(e.stride));
  for (auto d : e.dilation)
    CHECK_ARG(d > 0, "dilation should be greater than zero, got dilation=", at::IntArrayRef(e.dilation));
  for (auto p : e.padding)
    CHECK_ARG(p >= 0, "negative padding is not supported, got padding=", at::IntArrayRef(e.padding));
  for (auto p : e.output_padding)
    CHECK_ARG(p >= 0, "negative output_padding is not supported, got output_padding=", at::IntArrayRef(e.output_padding));
  const int64_t groups = a.groups;
  CHECK_ARG(groups > 0, "expected groups to be greater than 0, but got groups=", groups);
  const char* role = a.transposed ? "C_in" : "C_out";
  CHECK_ARG(
      w.size(0) >= groups, role, " (", w.size(0), ") = weight.size(0) of weight ", w.sizes(),
      " must be at least groups (", groups, ")");
  CHECK_ARG(
      w.size(0) % groups == 0, "groups (", groups, ") must divide ", role, " (", w.size(0),
      ") = weight.size(0) of weight ", w.sizes());
  e.c_in = x.size(1);
  if (!a.transposed) {
    CHECK_ARG(
        e.c_in == w.size(1) * groups, "input has C_in (", e.c_in, ") channels but weight ", w.sizes(),
        " with groups=", groups, " expects weight.size(1) * groups = ", w.size(1) * groups,
        e.c_in % groups ? c10::str("; groups (", groups, ") must divide C_in (", e.c_in, ")") : std::string());
    for (int64_t i = 0; i < e.dims; ++i) {
      const int64_t padded = x.size(i + 2) + 2 * e.padding[i], kernel = e.dilation[i] * (w.size(i + 2) - 1) + 1;
      CHECK_ARG(
          padded >= kernel, "calculated padded input size per channel: ", padded, " (dim ", i,
          "), dilated kernel size: ", kernel, "; kernel size can't be greater than actual input size");
    }
    for (auto p : e.output_padding)
      CHECK_ARG(
          p == 0, "output_padding is not supported for non-transposed convolutions; got output_padding=",
          at::IntArrayRef(e.output_padding));
    e.c_out = w.size(0);
  } else {
    CHECK_ARG(
        e.c_in == w.size(0), "transposed: input has C_in (", e.c_in, ") channels but weight ", w.sizes(),
        " expects weight.size(0) = ", w.size(0));
    e.c_out = w.size(1) * groups;
  }
  if (is_empty_call(x)) {
    if (a.output_mask[2] && a.bias_sizes.has_value()) {
      for (auto b : *a.bias_sizes) CHECK_ARG(b >= 0, "bias_sizes must be non-negative, got bias_sizes=", *a.bias_sizes);
    }
    return e;
  }
  CHECK_ARG(
      go.scalar_type() == x.scalar_type() && x.scalar_type() == w.scalar_type(),
      "grad_output, input and weight must have the same dtype, got ", py_name(go.scalar_type()), ", ",
      py_name(x.scalar_type()), " and ", py_name(w.scalar_type()));
  CHECK_ARG(
      go.device() == x.device() && x.device() == w.device(),
      "grad_output, input and weight must be on the same device, got ", go.device(), ", ", x.device(), " and ",
      w.device());
  for (int64_t i = 0; i < e.dims; ++i) {
    CHECK_ARG(
        x.size(i + 2) != 0, "input ", x.sizes(),
        " has a zero spatial size; only zero batch or zero channel inputs are supported");
  }
  if (!needs_weight_or_input(a)) return e;
  bool zero_kernel = false;
  for (int64_t i = 0; i < e.dims; ++i) zero_kernel |= w.size(i + 2) == 0;
  CHECK_ARG(
      e.c_out != 0 && !zero_kernel, "weight ", w.sizes(),
      " has zero output channels or a zero kernel size; with a non-empty input ", x.sizes(),
      " only grad_bias can be computed (output_mask=[", a.output_mask[0] ? "True" : "False", ", ",
      a.output_mask[1] ? "True" : "False", ", ", a.output_mask[2] ? "True" : "False", "])");
  if (a.transposed) {
    for (int64_t i = 0; i < e.dims; ++i) {
      CHECK_ARG(
          e.output_padding[i] < e.stride[i] || e.output_padding[i] < e.dilation[i],
          "output padding must be smaller than either stride or dilation, but got output_padding=",
          at::IntArrayRef(e.output_padding), ", stride=", at::IntArrayRef(e.stride),
          ", dilation=", at::IntArrayRef(e.dilation), " (dim ", i, ")");
    }
  }
  CHECK_ARG(
      go.size(0) == x.size(0), "grad_output batch size (", go.size(0), ") does not match input batch size (",
      x.size(0), ")");
  CHECK_ARG(
      go.size(1) == e.c_out, "grad_output has ", go.size(1), " channels, expected C_out = ", e.c_out, " for weight ",
      w.sizes());
  std::vector<int64_t> expected(e.dims);
  for (int64_t i = 0; i < e.dims; ++i) {
    const int64_t in = x.size(i + 2), kk = w.size(i + 2);
    const int64_t s = e.stride[i], p = e.padding[i], d = e.dilation[i];
    expected[i] = a.transposed ? (in - 1) * s - 2 * p + d * (kk - 1) + e.output_padding[i] + 1
                               : (in + 2 * p - d * (kk - 1) - 1) / s + 1;
  }
  for (auto v : expected) {  // 0 only for a transposed layer (an empty output, as native's forward allows)
    CHECK_ARG(
        v >= 0, "computed output size ", at::IntArrayRef(expected), " is too small for input ", x.sizes(),
        " and weight ", w.sizes());
  }
  CHECK_ARG(
      go.sizes().slice(2) == at::IntArrayRef(expected), "grad_output spatial size ", go.sizes().slice(2),
      " does not match the convolution's output size ", at::IntArrayRef(expected), " (grad_output ", go.sizes(),
      ", input ", x.sizes(), ", weight ", w.sizes(), ", stride=", at::IntArrayRef(e.stride),
      ", padding=", at::IntArrayRef(e.padding), ", dilation=", at::IntArrayRef(e.dilation),
      ", transposed=", a.transposed ? "True" : "False", ", output_padding=", at::IntArrayRef(e.output_padding), ")");
  return e;
}

// --- CUDA kernels (cuda/direct.cu) ---------------------------------------------------------------

// Built with ATEN_OVERRIDE_WITH_CUDA (setup.py, when torch has CUDA). They have not run on hardware
// yet, so they serve calls only when ATEN_OVERRIDE_CUDA_KERNELS=1 at import; otherwise CUDA calls go to
// the original kernel with the reason recorded.
enum class CudaKernels { NotBuilt, Disabled, Enabled };

CudaKernels cuda_kernels() {
#ifdef ATEN_OVERRIDE_WITH_CUDA
  static const CudaKernels state = [] {
    const char* value = std::getenv("ATEN_OVERRIDE_CUDA_KERNELS");
    return value != nullptr && std::string(value) == "1" ? CudaKernels::Enabled : CudaKernels::Disabled;
  }();
  return state;
#else
  return CudaKernels::NotBuilt;
#endif
}

const char* cuda_kernels_name() {
  switch (cuda_kernels()) {
    case CudaKernels::NotBuilt: return "not built";
    case CudaKernels::Disabled: return "built, disabled";
    case CudaKernels::Enabled: return "enabled";
  }
  TORCH_INTERNAL_ASSERT(false, "convolution_backward[compiled]: unhandled CUDA kernel state");
}

// Why CUDA calls go to the original kernel, or nullopt when the compiled backend serves them.
std::optional<std::string> cuda_unsupported_reason() {
  switch (cuda_kernels()) {
    case CudaKernels::NotBuilt: return "no CUDA kernels in this build";
    case CudaKernels::Disabled:
      return "CUDA kernels built but not enabled (unverified on hardware; set ATEN_OVERRIDE_CUDA_KERNELS=1)";
    case CudaKernels::Enabled: return std::nullopt;
  }
  TORCH_INTERNAL_ASSERT(false, "convolution_backward[compiled]: unhandled CUDA kernel state");
}

// Why the compiled backend hands this call to the original kernel, or nullopt when it serves it.
std::optional<std::string> unsupported_reason(const at::Tensor& go, const at::Tensor& x, const at::Tensor& w) {
  const auto dtype = go.scalar_type();
  if (dtype != at::kDouble && dtype != at::kFloat && dtype != at::kBFloat16 && dtype != at::kHalf) {
    return c10::str("dtype ", py_name(dtype), " is not supported (only float64/float32/bfloat16/float16)");
  }
  const std::pair<const char*, const at::Tensor*> tensors[] = {{"grad_output", &go}, {"input", &x}, {"weight", &w}};
  for (const auto& [name, t] : tensors) {
    if (t->layout() != at::kStrided) {
      return c10::str(name, " has layout ", py_name(t->layout()), "; only strided tensors are supported");
    }
  }
  if (go.is_cuda()) {
    return cuda_unsupported_reason();
  }
  if (!go.is_cpu()) {
    return c10::str("device ", go.device(), " is not supported");
  }
  return std::nullopt;
}

DirectProblem direct_problem(const Args& a, const Expanded& e);
at::native::ConvBackend native_backend(const Args& a);

// Whether some stride is > 1.
bool strided(const Expanded& e) {
  for (int64_t i = 0; i < e.dims; ++i) {
    if (e.stride[i] > 1) return true;
  }
  return false;
}

// The GEMM class of a dense or large-group layer (not transposed, C_out > 0), or Dense. Pointwise and
// 3-D layers only where the native path they would take is the one the GEMM kernels were measured
// to beat (see kLayerClasses); native's Slow2d is itself im2col + GEMM.
LayerClass gemm_class(const Args& a, const Expanded& e) {
  // Measured for float32 / float64, and for bfloat16 pointwise layers computed in bfloat16 (in float32
  // they lose to native's oneDNN); float16: not measured.
  const auto dtype = a.grad_output.scalar_type();
  const DirectProblem p = direct_problem(a, e);
  bool pointwise = a.groups == 1;
  for (int64_t i = 0; i < e.dims; ++i) pointwise &= a.weight.size(i + 2) == 1 && e.padding[i] == 0;
  if (dtype == at::kHalf) return LayerClass::Dense;
  if (dtype == at::kBFloat16 &&
      !(pointwise && gemm_keeps_reduced_dtype(GemmAlgorithm::Im2col, p, a.grad_output.element_size()))) {
    return LayerClass::Dense;
  }
  if (a.groups > 1) return strided(e) ? LayerClass::GroupedGemm : LayerClass::Dense;
  if ((pointwise || e.dims == 3) && a.grad_output.numel() < kGemmMinOutputs) return LayerClass::Dense;
  if (pointwise) {
    return native_backend(a) == at::native::ConvBackend::Mkldnn ? LayerClass::Pointwise : LayerClass::Dense;
  }
  if (e.dims == 3) {
    const auto backend = native_backend(a);
    if (kn2row_applies(p) &&
        (backend == at::native::ConvBackend::Slow3d ||
         (backend == at::native::ConvBackend::Mkldnn && a.grad_output.numel() >= kKn2rowOnednnMinOutputs))) {
      return LayerClass::Kn2row3d;
    }
    return backend == at::native::ConvBackend::Slow3d ? LayerClass::Im2col3d : LayerClass::Dense;
  }
  return kn2row_applies(p) ? LayerClass::Kn2row : LayerClass::Dense;
}

LayerClass classify_layer(const Args& a, const Expanded& e) {
  if (is_empty_call(a.input)) return LayerClass::Empty;
  if (!needs_weight_or_input(a)) return LayerClass::BiasOnly;
  if (a.transposed) return LayerClass::Transposed;
  const int64_t in_per_group = e.c_in / a.groups, out_per_group = e.c_out / a.groups;
  LayerClass direct = LayerClass::Dense;
  if (a.groups == 1 && e.c_in == 1) {
    direct = LayerClass::OneChannel;
  } else if (in_per_group == 1 && a.groups > 1) {
    direct = LayerClass::Depthwise;
  } else if (a.groups > 1 && in_per_group * out_per_group <= kDirectMaxChannelPairs) {
    direct = LayerClass::Grouped;
  } else if (a.groups > 1 && strided(e) &&
             !grouped_lanes_unsupported(direct_problem(a, e), a.grad_output.scalar_type())) {
    return a.grad_output.numel() >= kGroupedLanesMinOutputs ? LayerClass::GroupedLanes : LayerClass::Dense;
  }
  if ((direct == LayerClass::Grouped || direct == LayerClass::OneChannel) &&
      a.grad_output[0][0].numel() < kDirectMinPlane) {
    return LayerClass::SmallPlanes;
  }
  if (direct == LayerClass::Dense) return gemm_class(a, e);
  return direct;
}

// Whether some kernel tap meets no valid position in some spatial dim: regular, tap j of output o
// reads input o*s - p + j*d; transposed, input i writes output i*s - p + j*d. Such a tap's gradient
// is exactly zero.
bool has_dead_tap(const Args& a, const Expanded& e) {
  for (int64_t i = 0; i < e.dims; ++i) {
    const int64_t k = a.weight.size(2 + i), s = e.stride[i], p = e.padding[i], d = e.dilation[i];
    const int64_t strided = a.transposed ? a.input.size(2 + i) : a.grad_output.size(2 + i);
    const int64_t other = a.transposed ? a.grad_output.size(2 + i) : a.input.size(2 + i);
    for (int64_t j = 0; j < k; ++j) {
      const int64_t lo = p - j * d;  // the tap is valid at t where lo <= t*s <= other - 1 + lo
      const int64_t t = lo <= 0 ? 0 : (lo + s - 1) / s;
      if (t >= strided || t * s > other - 1 + lo) return true;
    }
  }
  return false;
}

// Whether a transposed layer's input has width 1 (its last spatial dim) under a kernel more than one
// tap wide there, and more than one spatial position in all: on x86 with AMX, 2.13's oneDNN bfloat16
// path leaves most of grad_input unwritten there, with no dead tap. Mirrors args.width_one_transposed.
bool width_one_transposed(const Args& a) {
  const int64_t last = a.input.dim() - 1;
  if (!a.transposed || last < 2) return false;
  int64_t positions = 1;
  for (int64_t i = 2; i <= last; ++i) positions *= a.input.size(i);
  return a.input.size(last) == 1 && a.weight.size(last) > 1 && positions > 1;
}

// Whether a 3-D layer has padding > stride in its depth dim and no row there that meets the whole
// kernel: transposed, no input i whose taps all land inside the output (input i writes output
// i*s - p + j*d); regular, no output o whose taps all read inside the input (output o reads input
// o*s - p + j*d). Where 2.13's oneDNN float32 path has computed wrong gradients, hung, or corrupted
// the heap (regular: e.g. input (2, 16, 3, 1, 1), kernel (9, 1, 1), stride 4, padding 7). Mirrors
// args.depth_without_full_row.
bool depth_without_full_row(const Args& a, const Expanded& e) {
  if (e.dims != 3) return false;
  const int64_t s = e.stride[0], p = e.padding[0], d = e.dilation[0], k = a.weight.size(2);
  if (p <= s) return false;
  // the strided side's positions t cover t*s - p + j*d on the other side
  const int64_t strided = a.transposed ? a.input.size(2) : a.grad_output.size(2);
  const int64_t other = a.transposed ? a.grad_output.size(2) : a.input.size(2);
  for (int64_t t = 0; t < strided; ++t) {
    if (t * s - p >= 0 && t * s - p + (k - 1) * d < other) return false;
  }
  return true;
}

// Whether a regular 3-D layer has padding and, in some dim, an input shorter than the dilated kernel:
// 2.13's oneDNN bfloat16 backward leaves parts of grad_weight / grad_input of such layers unwritten
// (e.g. input (2, 16, 2, 2, 2), kernel 3, padding 1). Every defective call of two targeted sweeps
// (750 small padded 3-D layers, 13 defective) and a random one (783 padded 3-D calls, 2) had such a
// dim; none of the 461 targeted calls without one was wrong, nor R(2+1)D's 18 layer geometries.
// Mirrors args.padded_3d.
bool padded_3d(const Args& a, const Expanded& e) {
  if (a.transposed || e.dims != 3) return false;
  bool padded = false, short_dim = false;
  for (int64_t i = 0; i < 3; ++i) {
    padded |= e.padding[i] > 0;
    short_dim |= a.input.size(2 + i) < e.dilation[i] * (a.weight.size(2 + i) - 1) + 1;
  }
  return padded && short_dim;
}

// Whether the CPU has the capability `name` (at::cpu::get_cpu_capabilities' key, cpuinfo's reading of
// CPUID: "avx2", "avx512_f", "amx_bf16", ...). Mirrors args.cpu_capability.
bool cpu_capability(const char* name) {
  const auto caps = at::cpu::get_cpu_capabilities();
  const auto it = caps.find(name);
  return it != caps.end() && it->second.isBool() && it->second.toBool();
}

// Whether the CPU has AMX-BF16. Mirrors args.cpu_has_amx_bf16.
bool cpu_has_amx_bf16() {
  static const bool has = cpu_capability("amx_bf16");
  return has;
}

// Whether a bfloat16 3-D call asks for grad_weight on a CPU with AMX-BF16: there 2.13's oneDNN weight
// gradient (brgconv_bwd_w:avx10_1_512_amx) is off by 12-52% of its scale on larger planes, regular
// and transposed, the same on every run (e.g. input (2, 64, 4, 56, 56), kernel 1x3x3, padding
// [0, 1, 1], and a 1x1x1 kernel at depth 1; 2-D layers, float16 and grad_input were right). No size
// bound separates the wrong calls found from the right ones (input channels x plane from 1e5 to 9e5
// elements among the wrong, to 3e6 among the right), so every such call counts. Mirrors
// args.amx_3d_weight.
bool amx_3d_weight(const Args& a, const Expanded& e) {
  return e.dims == 3 && a.grad_output.scalar_type() == at::kBFloat16 && a.output_mask[1] && cpu_has_amx_bf16();
}

// Whether a bfloat16 2-D depthwise call (groups == C_in > 1), regular or transposed, with a dilation > 1
// and a channels-last input asks for grad_weight: 2.13's oneDNN grad_weight there was NaN, unwritten
// (a dilated tap left as the heap's values) or off by more than its scale (e.g. transposed input
// (2, 4, 3, 64) channels-last, weight (4, 1, 3, 1), dilation [2, 1]; regular input (1, 2, 3, 40)
// channels-last, weight (2, 1, 2, 1), dilation [2, 1]; inputs at least 30 wide; found by helpers'
// fuzzes on Sapphire Rapids). Right were: float16, a channel multiplier of 2, stride 2, a contiguous
// input, dilation in width only; the predicate keeps the wider set. Mirrors args.depthwise_dilated.
bool depthwise_dilated(const Args& a, const Expanded& e) {
  if (e.dims != 2 || a.grad_output.scalar_type() != at::kBFloat16 || !a.output_mask[1]) return false;
  if (a.groups <= 1 || a.groups != e.c_in) return false;
  if (a.input.suggest_memory_format() != at::MemoryFormat::ChannelsLast) return false;
  return e.dilation[0] > 1 || e.dilation[1] > 1;
}

// Whether oneDNN runs its AVX2 kernels here: a CPU with AVX2 but not all of AVX-512 F, BW, VL and DQ
// (oneDNN's avx512_core; at::cpu::get_cpu_capabilities), or ONEDNN_MAX_CPU_ISA / DNNL_MAX_CPU_ISA
// capping oneDNN at an AVX2 ISA (AVX2, AVX2_VNNI, AVX2_VNNI_2). Read once, as oneDNN reads them. Mirrors
// args.onednn_avx2.
bool onednn_avx2() {
  static const bool yes = [] {
    const bool avx512_core = cpu_capability("avx512_f") && cpu_capability("avx512_bw") &&
                             cpu_capability("avx512_vl") && cpu_capability("avx512_dq");
    if (!cpu_capability("avx2")) return false;
    for (const char* var : {"ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"}) {
      const char* value = std::getenv(var);
      if (value == nullptr) continue;
      std::string isa(value);
      for (auto& c : isa) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
      return isa.rfind("AVX2", 0) == 0 || !avx512_core;
    }
    return !avx512_core;
  }();
  return yes;
}

// Whether a 2-D call asks for grad_weight of an ungrouped, unpadded, strided 1x1 layer on channels-last
// tensors (at::native::mkldnn_conv_use_channels_last) whose oneDNN source (a regular call's input, a
// transposed call's grad_output) has fewer than 8 channels, where oneDNN runs its AVX2 kernels: there
// 2.13's jit_avx2_1x1_convolution_bwd_weights_t, any dtype that reaches it (float32 on such CPUs), returns
// a wrong grad_weight at two threads, hangs (an endless loop in it), or at one thread writes past a buffer
// ("free(): invalid next size"). E.g. transposed input (2, 4, 8, 8) channels-last, weight (4, 6, 1, 1),
// stride 2, output_padding 1: wrong in 8 of 8 calls (Zen 3, 2 threads); regular input (10, 4, 8, 8),
// weight (6, 4, 1, 1), stride 2: 1-4 of 8. Found on a Zen 3 VM (AVX2 only) by sweeps of 1x1 layers
// (scripts/sweep_native_defects.py --strided-1x1): every wrong or hanging call had a source of 1-7
// channels, no padding, stride > 1, groups 1 and a source exactly stride x the other side in every dim
// (a transposed call's output_padding = stride - 1, a regular call's input divisible); 8-24 channels,
// padding 1, groups 2, contiguous tensors, 3-D layers and stride 1 were right. The predicate keeps the
// wider set (any size). Mirrors args.strided_1x1_avx2.
bool strided_1x1_avx2(const Args& a, const Expanded& e) {
  // upstream's mkldnn_convolution_backward runs the weight-gradient primitive for grad_bias too
  if (e.dims != 2 || a.groups != 1 || !(a.output_mask[1] || a.output_mask[2]) || !strided(e)) return false;
  if (a.weight.size(2) != 1 || a.weight.size(3) != 1 || e.padding[0] != 0 || e.padding[1] != 0) return false;
  if ((a.transposed ? e.c_out : e.c_in) >= 8) return false;
  return at::native::mkldnn_conv_use_channels_last(a.input, a.weight) && onednn_avx2();
}

// Whether native's oneDNN path is known wrong on this call in float32 too (so a stand-in computes in
// float64): depth_without_full_row or strided_1x1_avx2.
bool float32_defect(const Args& a, const Expanded& e) {
  return depth_without_full_row(a, e) || strided_1x1_avx2(a, e);
}

// Whether 2.13's oneDNN convolutions are known wrong on this call in bfloat16 / float16. Mirrors
// args.onednn_defect.
bool onednn_defect(const Args& a, const Expanded& e) {
  return has_dead_tap(a, e) || padded_3d(a, e) || width_one_transposed(a) || amx_3d_weight(a, e) ||
      depthwise_dilated(a, e);
}

// Whether native would serve the call on a oneDNN path known to be wrong there, or to crash: a CPU
// call with a float32_defect (any dtype but float64), or a bfloat16 / float16 one with a oneDNN defect,
// that native hands to oneDNN. The backend is asked only where a predicate holds.
bool native_defective(const Args& a, const Expanded& e) {
  const auto dtype = a.grad_output.scalar_type();
  const bool reduced = dtype == at::kBFloat16 || dtype == at::kHalf;
  if (!a.grad_output.is_cpu() || dtype == at::kDouble ||
      !((reduced && onednn_defect(a, e)) || float32_defect(a, e))) {
    return false;
  }
  const auto backend = native_backend(a);
  return backend == at::native::ConvBackend::Mkldnn || backend == at::native::ConvBackend::MkldnnTranspose;
}

// The class of a call: its layer class, unless native would serve it on a path known to be wrong
// there (the dead-taps class). A class of our own kernels keeps its class on such a call; native's
// stand-in there (the autotuner's reference, a declining kernel's fallback) is reference_kernel's.
LayerClass classify(const Args& a, const Expanded& e) {
  const LayerClass cls = classify_layer(a, e);
  const bool native = cls == LayerClass::Dense || cls == LayerClass::Transposed || cls == LayerClass::SmallPlanes ||
      cls == LayerClass::Kn2row;
  return native && native_defective(a, e) ? LayerClass::DeadTaps : cls;
}

// --- kernels ------------------------------------------------------------------------------------

Result call_original(const Args& a) {
  // The kernel the CPU key computes to (CompositeExplicitAutograd); CUDA's own kernel is the same
  // at::native::convolution_backward behind a device guard.
  c10::OptionalDeviceGuard guard(a.grad_output.device());
  return at::compositeexplicitautograd::convolution_backward(
      a.grad_output, a.input, a.weight, a.bias_sizes, a.stride, a.padding, a.dilation, a.transposed,
      a.output_padding, a.groups, a.output_mask);
}

at::ScalarType compute_dtype(at::ScalarType t) {
  return (t == at::kHalf || t == at::kBFloat16) ? at::kFloat : t;
}

// grad_output's sum over every dim but 1. For a contiguous bfloat16 / float16 grad_output ATen's sum
// would first upcast all of it to float32 (twice grad_output's bytes: 1.5x native's peak memory on
// ResNeXt's bfloat16 layers); each (sample, channel) plane is summed here instead, in float32 chunks
// of 32 elements added in double, channel by channel (the same bits for any thread count).
at::Tensor grad_bias(const at::Tensor& go) {
  const auto dtype = go.scalar_type();
  if ((dtype == at::kBFloat16 || dtype == at::kHalf) && go.is_cpu() && go.is_contiguous() && go.numel() > 0) {
    const int64_t batch = go.size(0), channels = go.size(1), plane = go.numel() / (batch * channels);
    at::Tensor out = at::empty({channels}, go.options());
    AT_DISPATCH_REDUCED_FLOATING_TYPES(dtype, "grad_bias", [&] {
      const scalar_t* src = go.const_data_ptr<scalar_t>();
      scalar_t* dst = out.mutable_data_ptr<scalar_t>();
      at::parallel_for(0, channels, 1, [&](int64_t begin, int64_t end) {
        for (int64_t c = begin; c < end; ++c) {
          double total = 0;
          for (int64_t n = 0; n < batch; ++n) {
            const scalar_t* p = src + (n * channels + c) * plane;
            for (int64_t i = 0; i < plane; i += 32) {
              float chunk = 0;
              const int64_t stop = std::min<int64_t>(plane, i + 32);
              for (int64_t j = i; j < stop; ++j) chunk += static_cast<float>(p[j]);
              total += chunk;
            }
          }
          dst[c] = static_cast<scalar_t>(total);
        }
      });
    });
    return out;
  }
  std::vector<int64_t> dims{0};
  for (int64_t d = 2; d < go.dim(); ++d) dims.push_back(d);
  return at::sum(go, dims, /*keepdim=*/false, compute_dtype(go.scalar_type())).to(go.scalar_type());
}

// Upstream's Empty backend: zeros shaped like input, weight and bias_sizes (grad_output may have 0
// channels where bias_sizes is [C_out]); 1-D calls on input.contiguous() / weight viewed as 2-D (view4d).
// bias_sizes=None gives zeros(C_out) where upstream aborts. Mirrors python_impl._empty_backward.
Result empty_backward(const Args& a, const Expanded& e) {
  const bool one_d = a.weight.dim() == 3;
  const auto zeros_like = [one_d](const at::Tensor& t) {
    return one_d ? at::zeros_like(t.unsqueeze(2)).squeeze(2) : at::zeros_like(t);
  };
  at::Tensor gi, gw, gb;
  if (a.output_mask[0]) gi = zeros_like(one_d ? a.input.contiguous() : a.input);
  if (a.output_mask[1]) gw = zeros_like(a.weight);
  if (a.output_mask[2]) {
    gb = at::zeros(a.bias_sizes.has_value() ? a.bias_sizes->vec() : std::vector<int64_t>{e.c_out}, a.weight.options());
  }
  return {gi, gw, gb};
}

// Upstream's layout of grad_input / grad_weight: _determine_backend_memory_format of the backend
// select_conv_backend picks; 1-D layers are computed as 2-D on contiguous input.unsqueeze(2).
struct OutputLayout {
  at::MemoryFormat fmt;
  at::native::ConvBackend backend;
};

// The backend at::native::convolution_backward picks for the call.
at::native::ConvBackend native_backend(const Args& a) {
  c10::AutoGradMode grad_mode(true);  // need_backward, as at::native::convolution_backward sees it
  return at::native::select_conv_backend(
      a.input, a.weight, std::nullopt, c10::fromIntArrayRefSlow(a.stride), c10::fromIntArrayRefSlow(a.padding),
      c10::fromIntArrayRefSlow(a.dilation), a.transposed, c10::fromIntArrayRefSlow(a.output_padding),
      c10::SymInt(a.groups),
      a.bias_sizes.has_value() ? at::OptionalSymIntArrayRef(c10::fromIntArrayRefSlow(*a.bias_sizes)) : std::nullopt);
}

OutputLayout output_layout(const Args& a) {
  const auto backend = native_backend(a);
  if (a.weight.dim() == 3) {
    // Only the strides of input.contiguous() matter; a fresh contiguous tensor of its sizes has them
    // (and works for stride-0 placeholders without materialising them).
    const at::Tensor x = a.input.is_contiguous() ? a.input : at::empty(a.input.sizes(), a.input.options());
    return {at::native::_determine_backend_memory_format(x.unsqueeze(2), a.weight.unsqueeze(2), backend), backend};
  }
  return {at::native::_determine_backend_memory_format(a.input, a.weight, backend), backend};
}

// `t` (freshly allocated, not yet written), its whole 2 MiB pages hinted to be transparent huge pages
// where it is over 32 MiB: its first touch then costs one page fault per 2 MiB instead of one per 4 KiB
// (as c10's THP_MEM_ALLOC_ENABLE does for every large CPU allocation; it is off by default). glibc
// maps an allocation over 32 MiB afresh on most calls (unless free heap space can serve it) and unmaps
// it when freed, so without the hint such calls pay those faults again. Zen 3 VM, one thread,
// allocating and filling: 38.5 MiB 21.7 -> 3.9 ms, 100 MiB 61.6 -> 11.4 ms. Smaller outputs are not
// hinted: glibc serves them from its heap, faulted in by the first calls (a 16-25 MiB fill measured
// 0.4 ms faster hinted), and the flag would outlive the tensor on the heap's pages, for whatever is
// allocated there next; c10's THP_MEM_ALLOC_ENABLE=1 is the switch that flags those. The grad_input of
// MobileNetV2's 112x112 depthwise layers, wav2vec2's second feature-encoder layer and R(2+1)D's first
// stages (batch 8) are over 32 MiB. A hint: errors are ignored.
at::Tensor on_huge_pages(at::Tensor t) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHugePage = uintptr_t(1) << 21;
  const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
  if (!t.is_cpu() || bytes <= (int64_t{32} << 20)) return t;
  const auto data = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t begin = (data + kHugePage - 1) & ~(kHugePage - 1), end = (data + bytes) & ~(kHugePage - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#endif
  return t;
}

// An uninitialised grad_input with upstream's strides (on_huge_pages); 1-D outputs are allocated 4-D
// and squeezed.
at::Tensor empty_like_native(at::IntArrayRef sizes, const at::TensorOptions& options, at::MemoryFormat fmt) {
  if (sizes.size() == 3) {
    return on_huge_pages(at::empty({sizes[0], sizes[1], 1, sizes[2]}, options.memory_format(fmt))).squeeze(2);
  }
  return on_huge_pages(at::empty(sizes, options.memory_format(fmt)));
}

// An uninitialised grad_weight with upstream's strides. The THNN Slow2d / SlowTranspose2d paths
// allocate empty_like(weight.contiguous(fmt)): where the layout is ambiguous (a size-1 channel or
// kernel dim) weight's own strides survive. Mirrors args.empty_like_native.
at::Tensor empty_like_native_weight(const at::Tensor& weight, const OutputLayout& layout) {
  const bool one_d = weight.dim() == 3;
  const at::Tensor w = one_d ? weight.unsqueeze(2) : weight;
  const bool preserving = layout.backend == at::native::ConvBackend::Slow2d ||
      layout.backend == at::native::ConvBackend::SlowTranspose2d;
  at::Tensor out = preserving && w.is_contiguous(layout.fmt)
      ? at::empty_strided(w.sizes(), w.strides(), w.options())
      : at::empty(w.sizes(), w.options().memory_format(layout.fmt));
  return one_d ? out.squeeze(2) : out;
}

// The strides at::empty(sizes, fmt) gives, with no allocation (contiguous strides count a size-0 dim as
// 1, c10's get_channels_last_strides_2d / _3d as 0). Mirrors args.canonical_strides. Inline storage: it
// runs per call for every tensor with a size-1 dim (restrides()), so no heap allocation.
using Strides = c10::SmallVector<int64_t, 5>;
Strides canonical_strides(at::IntArrayRef sizes, at::MemoryFormat fmt) {
  const int64_t dims = static_cast<int64_t>(sizes.size());
  Strides order;  // innermost dim first
  if (fmt == at::MemoryFormat::ChannelsLast) order = {1, 3, 2, 0};
  else if (fmt == at::MemoryFormat::ChannelsLast3d) order = {1, 4, 3, 2, 0};
  const bool channels_last = !order.empty();
  TORCH_INTERNAL_ASSERT_DEBUG_ONLY(!channels_last || static_cast<int64_t>(order.size()) == dims);
  if (!channels_last) for (int64_t d = dims - 1; d >= 0; --d) order.push_back(d);
  Strides strides(dims);
  int64_t step = 1;
  for (const int64_t d : order) {
    strides[d] = step;
    step *= channels_last ? sizes[d] : std::max<int64_t>(sizes[d], 1);
  }
  return strides;
}

// Whether t is contiguous in fmt (a channels-last format only for a tensor of its dims).
bool contiguous_in(const at::Tensor& t, at::MemoryFormat fmt) {
  const int64_t dims = fmt == at::MemoryFormat::ChannelsLast ? 4 : fmt == at::MemoryFormat::ChannelsLast3d ? 5 : t.dim();
  return dims == t.dim() && t.is_contiguous(fmt);
}

// t, or a view of the same elements with canonical_strides' strides in a memory format t is contiguous in
// (`preferred` first, then contiguous, then the channels-last format of its dims), where t is contiguous
// in a format but has the canonical strides of none: strides that differ only on size-1 dims (no copy:
// a size-1 dim's stride never moves a pointer). A tensor with the canonical strides of any of its formats
// (a 1x1 weight, an (N, C, 1, 1) activation) is left as it is. torch counts the others as contiguous and
// ordinary code makes them (a batch of one from an HWC image, hwc.permute(2, 0, 1).unsqueeze(0): strides
// (C, 1, W*C, C)); 2.13's grouped channels-last grad_weight reads the odd stride and is off by more than
// its scale (float64, bfloat16). Mirrors args.canonical_size1_strides.
//
// size1_restride_format: the format whose canonical strides that view takes, nullopt where t is left as
// it is. Whether it is nullopt does not depend on `preferred` (restrides() asks it so, with no view made).
std::optional<at::MemoryFormat> size1_restride_format(const at::Tensor& t, at::MemoryFormat preferred) {
  if (t.numel() == 0) return std::nullopt;
  const auto sizes = t.sizes();
  if (std::find(sizes.begin(), sizes.end(), 1) == sizes.end()) return std::nullopt;  // canonical if contiguous
  const int64_t dims = t.dim();
  const auto own = dims == 4 ? at::MemoryFormat::ChannelsLast
      : dims == 5            ? at::MemoryFormat::ChannelsLast3d
                             : at::MemoryFormat::Contiguous;
  std::optional<at::MemoryFormat> first;
  for (const auto fmt : {preferred, at::MemoryFormat::Contiguous, own}) {
    if (!contiguous_in(t, fmt)) continue;
    if (t.strides().equals(canonical_strides(sizes, fmt))) return std::nullopt;
    if (!first) first = fmt;
  }
  return first;
}

at::Tensor canonical_size1_strides(const at::Tensor& t, at::MemoryFormat preferred) {
  const std::optional<at::MemoryFormat> fmt = size1_restride_format(t, preferred);
  return fmt ? t.as_strided(t.sizes(), canonical_strides(t.sizes(), *fmt), t.storage_offset()) : t;
}

// The call's grad_output, input and weight as canonical_size1_strides views, preferring the memory format
// upstream gives its outputs (`layout`: output_layout of the call as given), for a call restrides() says
// changes (the Python mirror checks that itself: it returns the call where none changes). The same values: a caller computes on them and lays the results out as upstream lays
// out the call as given (restriding can change that layout: an odd stride can decide
// suggest_memory_format, and weight's own strides survive into the THNN paths' grad_weight). Mirrors
// args.canonical_call.
struct CanonicalCall {
  at::Tensor grad_output, input, weight;
  OutputLayout layout;
  // `a` (the call as given) on these views: what the compiled backend computes, tunes and plans.
  Args args(const Args& a) const {
    return Args{grad_output, input, weight, a.bias_sizes, a.stride, a.padding, a.dilation, a.transposed,
                a.output_padding, a.groups, a.output_mask};
  }
};

// Whether canonical_call changes the call: not for calls that read no convolution (is_empty_call: zeros
// like input and weight, their own strides; grad_bias alone). Which tensors restride does not depend on
// the preferred format, so this needs no select_conv_backend: a few cached flags and integer compares,
// only for tensors with a size-1 dim.
bool restrides(const Args& a) {
  if (is_empty_call(a.input) || !needs_weight_or_input(a)) return false;
  for (const at::Tensor* t : {&a.grad_output, &a.input, &a.weight}) {
    if (size1_restride_format(*t, at::MemoryFormat::Contiguous)) return true;
  }
  return false;
}

CanonicalCall canonical_call(const Args& a) {
  const OutputLayout layout = output_layout(a);
  return CanonicalCall{canonical_size1_strides(a.grad_output, layout.fmt), canonical_size1_strides(a.input, layout.fmt),
                       canonical_size1_strides(a.weight, layout.fmt), layout};
}

// result's grad_input / grad_weight in the strides upstream gives the call `a` (`layout`: output_layout(a)),
// copied where they differ.
void lay_out_as_native(const Args& a, const OutputLayout& layout, Result& result) {
  at::Tensor& gi = std::get<0>(result);
  if (gi.defined()) {
    at::Tensor out = empty_like_native(a.input.sizes(), gi.options(), layout.fmt);
    if (out.strides() != gi.strides()) gi = out.copy_(gi);
  }
  at::Tensor& gw = std::get<1>(result);
  if (gw.defined()) {
    at::Tensor out = empty_like_native_weight(a.weight, layout);
    if (out.strides() != gw.strides()) gw = out.copy_(gw);
  }
}

DirectProblem direct_problem(const Args& a, const Expanded& e) {
  DirectProblem p;
  p.batch = a.input.size(0);
  p.groups = a.groups;
  p.in_per_group = e.c_in / a.groups;
  p.out_per_group = e.c_out / a.groups;
  const int64_t offset = 3 - e.dims;
  for (int64_t i = 0; i < e.dims; ++i) {
    p.in[offset + i] = a.input.size(i + 2);
    p.out[offset + i] = a.grad_output.size(i + 2);
    p.kernel[offset + i] = a.weight.size(i + 2);
    p.stride[offset + i] = e.stride[i];
    p.padding[offset + i] = e.padding[i];
    p.dilation[offset + i] = e.dilation[i];
  }
  return p;
}

// Whether the direct kernel computes a call of a direct class (depthwise, grouped, one-channel) on its
// device: always on CPU; on CUDA only the depthwise class, when the CUDA kernels are enabled (cuDNN
// serves the other classes).
bool direct_kernel_serves(LayerClass cls, const at::Tensor& grad_output) {
  if (grad_output.is_cpu()) return true;
  return grad_output.is_cuda() && cls == LayerClass::Depthwise && cuda_kernels() == CudaKernels::Enabled;
}

void direct_grad_input(const DirectProblem& p, const at::Tensor& go, const at::Tensor& w, at::Tensor& gi) {
#ifdef ATEN_OVERRIDE_WITH_CUDA
  if (gi.is_cuda()) return direct_grad_input_cuda(p, go, w, gi);
#endif
  direct_grad_input_cpu(p, go, w, gi);
}

void direct_grad_weight(const DirectProblem& p, const at::Tensor& go, const at::Tensor& x, at::Tensor& gw) {
#ifdef ATEN_OVERRIDE_WITH_CUDA
  if (gw.is_cuda()) return direct_grad_weight_cuda(p, go, x, gw);
#endif
  direct_grad_weight_cpu(p, go, x, gw);
}

// `out` itself when it is contiguous, else a contiguous tensor of its sizes and options to compute
// into (copied into `out` afterwards).
at::Tensor contiguous_buffer(const at::Tensor& out) {
  return out.is_contiguous()
      ? out
      : on_huge_pages(at::empty(out.sizes(), out.options().memory_format(at::MemoryFormat::Contiguous)));
}

// Runs `compute(out)` into `out` directly when it is contiguous, else into a contiguous buffer copied over.
template <typename F>
at::Tensor compute_into(at::Tensor out, F compute) {
  at::Tensor buffer = contiguous_buffer(out);
  compute(buffer);
  if (!buffer.is_same(out)) out.copy_(buffer);
  return out;
}

// Depthwise: grad_input, grad_weight and grad_bias in one fused pass (cpu/depthwise.cpp). The lanes
// walks read grad_output and input, and write grad_input, in place when they are NCHW or channels-last
// (ConvNeXt's depthwise layers get all three channels-last); other layouts, and the plane walk, get
// contiguous copies.
Result depthwise_backward(const Args& a, const OutputLayout& layout, const DirectProblem& p, DepthwiseWalk walk) {
  const auto readable = [&](const at::Tensor& t) {
    return walk != DepthwiseWalk::Plane && depthwise_lanes_layout(t) ? t : t.contiguous();
  };
  const auto writable = [&](const at::Tensor& out) {
    return walk != DepthwiseWalk::Plane && depthwise_lanes_layout(out) ? out : contiguous_buffer(out);
  };
  at::Tensor gi, gw, gb, gi_buffer, gw_buffer;
  const at::Tensor go = readable(a.grad_output);
  if (a.output_mask[0]) gi_buffer = writable(gi = empty_like_native(a.input.sizes(), a.input.options(), layout.fmt));
  if (a.output_mask[1]) gw_buffer = contiguous_buffer(gw = empty_like_native_weight(a.weight, layout));
  if (a.output_mask[2]) gb = at::empty({go.size(1)}, go.options());
  depthwise_backward_cpu(
      p, walk, go, a.output_mask[1] ? readable(a.input) : at::Tensor(), a.output_mask[0] ? a.weight.contiguous() : at::Tensor(),
      gi.defined() ? &gi_buffer : nullptr, gw.defined() ? &gw_buffer : nullptr, gb.defined() ? &gb : nullptr);
  if (gi.defined() && !gi.is_same(gi_buffer)) gi.copy_(gi_buffer);
  if (gw.defined() && !gw.is_same(gw_buffer)) gw.copy_(gw_buffer);
  return {gi, gw, gb};
}

// walk: the depthwise kernel's walk, for depthwise calls on the CPU.
Result direct_backward(const Args& a, const Expanded& e, DepthwiseWalk walk = DepthwiseWalk::Plane) {
  const OutputLayout layout = output_layout(a);
  const DirectProblem p = direct_problem(a, e);
  // Depthwise on the CPU: the fused kernel (cpu/depthwise.cpp); on CUDA the direct kernels below.
  if (p.in_per_group == 1 && p.groups > 1 && a.grad_output.is_cpu()) return depthwise_backward(a, layout, p, walk);
  const at::Tensor go = a.grad_output.contiguous();
  at::Tensor gi, gw, gb;
  if (a.output_mask[0]) {
    const at::Tensor w = a.weight.contiguous();
    gi = compute_into(empty_like_native(a.input.sizes(), a.input.options(), layout.fmt), [&](at::Tensor& out) {
      direct_grad_input(p, go, w, out);
    });
  }
  if (a.output_mask[1]) {
    const at::Tensor x = a.input.contiguous();
    gw = compute_into(empty_like_native_weight(a.weight, layout), [&](at::Tensor& out) {
      direct_grad_weight(p, go, x, out);
    });
  }
  if (a.output_mask[2]) gb = grad_bias(a.grad_output);
  return {gi, gw, gb};
}

// The result of a kernel that computes into contiguous buffers from contiguous tensors, in upstream's
// layout: compute(grad_output, input, weight, grad_input*, grad_weight*) (input is only read for
// grad_weight, weight only for grad_input; a pointer is null when the mask leaves its output out).
template <typename Compute>
Result contiguous_kernel_backward(const Args& a, Compute compute) {
  const OutputLayout layout = output_layout(a);
  at::Tensor gi, gw, gb, gi_buffer, gw_buffer;
  if (a.output_mask[0]) gi_buffer = contiguous_buffer(gi = empty_like_native(a.input.sizes(), a.input.options(), layout.fmt));
  if (a.output_mask[1]) gw_buffer = contiguous_buffer(gw = empty_like_native_weight(a.weight, layout));
  compute(
      a.grad_output.contiguous(), a.output_mask[1] ? a.input.contiguous() : at::Tensor(),
      a.output_mask[0] ? a.weight.contiguous() : at::Tensor(), gi.defined() ? &gi_buffer : nullptr,
      gw.defined() ? &gw_buffer : nullptr);
  if (gi.defined() && !gi.is_same(gi_buffer)) gi.copy_(gi_buffer);
  if (gw.defined() && !gw.is_same(gw_buffer)) gw.copy_(gw_buffer);
  if (a.output_mask[2]) gb = grad_bias(a.grad_output);
  return {gi, gw, gb};
}

Result grouped_lanes_backward(const Args& a, const Expanded& e) {
  return contiguous_kernel_backward(a, [&](auto&&... t) { grouped_lanes_backward_cpu(direct_problem(a, e), t...); });
}

// The GEMM kernels' result, in upstream's layout.
Result gemm_backward(const Args& a, const Expanded& e, GemmAlgorithm algorithm) {
  return contiguous_kernel_backward(a, [&](auto&&... t) { gemm_backward_cpu(algorithm, direct_problem(a, e), t...); });
}

// The fused pointwise kernel's result, in upstream's layout (cpu/pointwise.cpp).
Result pointwise_fused_backward(const Args& a, const Expanded& e) {
  return contiguous_kernel_backward(a, [&](auto&&... t) { pointwise_backward_cpu(direct_problem(a, e), t...); });
}

// The bfloat16 pointwise kernel's result, in upstream's layout (cpu/pointwise_bf16.cpp).
Result pointwise_bf16_backward(const Args& a, const Expanded& e) {
  return contiguous_kernel_backward(a, [&](auto&&... t) { pointwise_bf16_backward_cpu(direct_problem(a, e), t...); });
}

// The kn2row-lanes kernel's result, in upstream's layout (cpu/kn2row.cpp).
Result kn2row_lanes_backward(const Args& a, const Expanded& e) {
  return contiguous_kernel_backward(a, [&](auto&&... t) { kn2row_lanes_backward_cpu(direct_problem(a, e), t...); });
}

// The Winograd kernel's result, in upstream's layout (cpu/winograd.cpp).
Result winograd_backward(const Args& a, const Expanded& e) {
  return contiguous_kernel_backward(a, [&](auto&&... t) { winograd_backward_cpu(direct_problem(a, e), t...); });
}

Result serve_derived_call(const Args& f);

// A regular call whose dead taps (has_dead_tap: kernel taps that only ever meet padding) lie at the
// ends of the kernel in each dim, so that cutting them off and lowering the padding by as many dilated
// taps gives the same outputs reading the same inputs: that call, whose grad_input is the whole call's
// and whose grad_weight is the whole call's on the live taps (zero on the dead ones, exactly). nullopt
// where no tap is dead, a dim has none live, the live taps are not one run, or the output sizes would
// differ. E.g. R(2+1)D-18's temporal 3x1x1 layers at one frame (padding 1): kernel 1x1x1, padding 0.
struct LiveTaps {
  at::Tensor weight;              // a view of the live taps
  std::vector<int64_t> padding;   // lowered by the dilated taps cut off before the live ones
  std::vector<int64_t> first;     // per spatial dim, the first live tap
  Args call(const Args& a, const at::Tensor& w) const {
    return Args{a.grad_output, a.input, w, a.bias_sizes, a.stride, padding, a.dilation, a.transposed,
                a.output_padding, a.groups, a.output_mask};
  }
};

std::optional<LiveTaps> live_taps(const Args& a, const Expanded& e) {
  if (a.transposed || !has_dead_tap(a, e)) return std::nullopt;
  LiveTaps out;
  out.padding = e.padding;
  out.weight = a.weight;
  for (int64_t i = 0; i < e.dims; ++i) {
    const int64_t k = a.weight.size(2 + i), s = e.stride[i], p = e.padding[i], d = e.dilation[i];
    const int64_t in = a.input.size(2 + i), n_out = a.grad_output.size(2 + i);
    int64_t lo = -1, hi = -1;
    for (int64_t j = 0; j < k; ++j) {
      bool live = false;  // some output o reads input o*s - p + j*d inside [0, in)
      for (int64_t o = 0; o < n_out && !live; ++o) live = o * s - p + j * d >= 0 && o * s - p + j * d < in;
      if (!live) continue;
      if (hi >= 0 && hi != j - 1) return std::nullopt;  // a dead tap between live ones
      if (lo < 0) lo = j;
      hi = j;
    }
    if (lo < 0 || lo * d > p) return std::nullopt;
    const int64_t p2 = p - lo * d, k2 = hi - lo + 1;
    if ((in + 2 * p2 - d * (k2 - 1) - 1) / s + 1 != n_out) return std::nullopt;
    out.padding[i] = p2;
    out.first.push_back(lo);
    out.weight = out.weight.narrow(2 + i, lo, k2);
  }
  return out;
}

Kernel defect_stand_in(const Args& a, const Expanded& e);

// Whether the live-taps kernel serves a dead-taps call: its dead taps can be cut off (live_taps), and
// the call without them is computed in its own dtype: native is not known wrong on it, or it folds
// into a 2-D call native is right on (fold-2d; on AMX, R(2+1)D's temporal layers at one frame).
bool live_taps_serve(const Args& a, const LiveTaps& live) {
  const Args f = live.call(a, live.weight);
  const Expanded fe = check_args(f);
  return classify(f, fe) != LayerClass::DeadTaps || defect_stand_in(f, fe) == Kernel::Fold2d;
}

bool live_taps_serve(const Args& a, const Expanded& e) {
  const auto live = live_taps(a, e);
  return live && live_taps_serve(a, *live);
}

// The live-taps kernel: the call without its dead taps, in its own dtype, served by this backend's
// choice for it; grad_weight zero on the dead taps; native's layouts. nullopt where live_taps_serve
// does not hold.
std::optional<Result> live_taps_backward(const Args& a, const Expanded& e) {
  const auto live = live_taps(a, e);
  if (!live || !live_taps_serve(a, *live)) return std::nullopt;
  const at::Tensor w = live->weight.contiguous(a.weight.suggest_memory_format());
  const OutputLayout layout = output_layout(a);
  auto [gi_live, gw_live, gb_live] = serve_derived_call(live->call(a, w));
  at::Tensor gi, gw;
  if (a.output_mask[0]) gi = empty_like_native(a.input.sizes(), a.input.options(), layout.fmt).copy_(gi_live);
  if (a.output_mask[1]) {
    gw = empty_like_native_weight(a.weight, layout).zero_();
    at::Tensor taps = gw;
    for (int64_t i = 0; i < e.dims; ++i) taps = taps.narrow(2 + i, live->first[i], w.size(2 + i));
    taps.copy_(gw_live);
  }
  return Result{gi, gw, a.output_mask[2] ? gb_live : at::Tensor()};
}

// The dead-taps class: the call computed in `compute` (float32; float64 where native's float32
// oneDNN path is wrong too) by the compiled backend's own choice for that call (measured, or the
// table's: e.g. gemm-kn2row for R(2+1)D's padded 3x1x1 layers, where native's float32 path is its
// slow 3-D one), rounded once into native's layout for the call's own dtype. Only what the mask asks
// for is converted (a stride-0 placeholder for the unused tensor stays a placeholder).
Result upcast_backward(const Args& a, at::ScalarType compute) {
  const OutputLayout layout = output_layout(a);
  const auto up = [compute](const at::Tensor& t, bool needed) {
    return needed ? t.to(compute) : at::empty({}, t.options().dtype(compute)).expand(t.sizes());
  };
  const at::Tensor go = a.grad_output.to(compute);
  const at::Tensor x = up(a.input, a.output_mask[1]);
  const at::Tensor w = up(a.weight, a.output_mask[0]);
  const Args f{go, x, w, a.bias_sizes, a.stride, a.padding, a.dilation, a.transposed, a.output_padding, a.groups,
               a.output_mask};
  auto [gi_up, gw_up, gb_up] = serve_derived_call(f);
  at::Tensor gi, gw, gb;
  if (a.output_mask[0]) gi = empty_like_native(a.input.sizes(), a.input.options(), layout.fmt).copy_(gi_up);
  if (a.output_mask[1]) gw = empty_like_native_weight(a.weight, layout).copy_(gw_up);
  if (a.output_mask[2]) gb = gb_up.to(a.grad_output.scalar_type());
  return {gi, gw, gb};
}

// How a 3-D call folds into a 2-D one: not at all; its plane into one row (a 1x1 spatial kernel, no
// spatial padding, spatial stride 1, no spatial output_padding: (N, C, D, H, W) is (N, C, D, H * W),
// a view where H and W merge, kernel (k_d, 1)); or its depth into the batch (kernel depth 1, no depth
// padding, no depth output_padding, and for transposed calls depth stride 1: each depth slice the
// stride samples is a 2-D problem of its own, (N * D_out, C, H, W)). R(2+1)D's temporal 3x1x1 and
// spatial 1xkxk layers fold.
enum class Fold { None, PlaneIntoRow, DepthIntoBatch };

Fold fold_of(const Args& a, const Expanded& e) {
  if (e.dims != 3) return Fold::None;
  const auto& op = e.output_padding;  // zeros for regular calls
  if (a.weight.size(3) == 1 && a.weight.size(4) == 1 && e.padding[1] == 0 && e.padding[2] == 0 && e.stride[1] == 1 &&
      e.stride[2] == 1 && op[1] == 0 && op[2] == 0) {
    return Fold::PlaneIntoRow;
  }
  if (a.weight.size(2) == 1 && e.padding[0] == 0 && op[0] == 0 && (!a.transposed || e.stride[0] == 1)) {
    return Fold::DepthIntoBatch;
  }
  return Fold::None;
}

// Whether fold-2d computes a CPU call: it folds, has none of the defects its 2-D call would carry over
// (dead taps, width_one_transposed; padded_3d's short dims and depth_without_full_row, kept out to be
// safe), and its 2-D call needs no dilation: a dim of one tap takes dilation 1 (the same convolution),
// where its output_padding allows (transposed: below the stride); a dim of more taps must have
// dilation 1. Native's 2-D bfloat16 path corrupted the heap on folded calls keeping a dilation on a
// one-tap dim, and gave NaN on a transposed depthwise one dilated in its tapped dim (depthwise_dilated
// since), both with a channels-last input (found by a helper's fuzz; native's 3-D path was right).
bool fold_2d_applies(const Args& a, const Expanded& e) {
  if (!a.grad_output.is_cpu() || fold_of(a, e) == Fold::None || has_dead_tap(a, e) || padded_3d(a, e) ||
      width_one_transposed(a) || depth_without_full_row(a, e)) {
    return false;
  }
  for (int64_t i = 0; i < 3; ++i) {
    if (e.dilation[i] > 1 && (a.weight.size(2 + i) > 1 || e.output_padding[i] >= e.stride[i])) return false;
  }
  return true;
}

// The fold-2d kernel: a 3-D call computed as the 2-D call it folds into (fold_of), served by
// this backend's choice for that call, in the call's own dtype, and put back into native's layout for
// the 3-D call. It stands in for native where only amx_3d_weight makes native wrong: its 2-D oneDNN
// path is right there, at native's bfloat16 speed (the float32 copies of the upcast took 3-7x
// native's time on R(2+1)D's layers). Depth into the batch copies grad_output and input once, into
// channels-last 2-D tensors (as a view where they are channels-last-3d); input positions the depth
// stride skips get zero grad_input.
Result fold_2d_backward(const Args& a, const Expanded& e) {
  const Fold fold = fold_of(a, e);
  TORCH_INTERNAL_ASSERT(fold != Fold::None, "convolution_backward[compiled]: fold-2d on a call that does not fold");
  const OutputLayout layout = output_layout(a);
  const int64_t d_out = a.grad_output.size(2), s_d = e.stride[0];
  at::Tensor go, x, w;
  std::vector<int64_t> stride, padding, output_padding;
  const std::vector<int64_t> dilation{1, 1};  // fold_2d_applies: no dilation the 2-D call needs
  if (fold == Fold::PlaneIntoRow) {
    // channels-last copies (none where the tensors are channels-last-3d already): native's 2-D bfloat16
    // path on R(2+1)D's 144 -> 64 temporal layer (8 frames of 56x56, batch 8, two threads) took 47 ms
    // channels-last against 141 contiguous, the copies ~35
    go = a.grad_output.flatten(3).contiguous(at::MemoryFormat::ChannelsLast);
    x = a.input.flatten(3).contiguous(at::MemoryFormat::ChannelsLast);
    w = a.weight.flatten(3);
    stride = {s_d, 1};
    padding = {e.padding[0], 0};
    output_padding = {e.output_padding[0], 0};
  } else {
    // (N, C, D, H, W) -> (N * D, C, H, W) channels-last: one copy (none where t is channels-last-3d),
    // the layout of native's fast 2-D bfloat16 path (R(2+1)D's stride-2 1x3x3 layer, 64 -> 230 channels,
    // 8 frames of 56x56, batch 8, two threads: the 2-D call 21 ms channels-last, 50 ms contiguous)
    const auto batch = [](const at::Tensor& t) {
      return t.permute({0, 2, 3, 4, 1}).contiguous().flatten(0, 1).permute({0, 3, 1, 2});
    };
    go = batch(a.grad_output);
    x = batch(a.input.slice(2, 0, (d_out - 1) * s_d + 1, s_d));
    w = a.weight.squeeze(2);
    stride = {e.stride[1], e.stride[2]};
    padding = {e.padding[1], e.padding[2]};
    output_padding = {e.output_padding[1], e.output_padding[2]};
  }
  const Args f{go, x, w, a.bias_sizes, stride, padding, dilation, a.transposed, output_padding, a.groups,
               a.output_mask};
  auto [gi2, gw2, gb] = serve_derived_call(f);
  at::Tensor gi, gw;
  if (a.output_mask[0]) {
    gi = empty_like_native(a.input.sizes(), a.input.options(), layout.fmt);
    if (fold == Fold::PlaneIntoRow) {
      gi.copy_(gi2.unflatten(3, {a.input.size(3), a.input.size(4)}));
    } else {
      const at::Tensor unfolded = gi2.unflatten(0, {a.input.size(0), d_out}).transpose(1, 2);
      if (s_d == 1) {
        gi.copy_(unfolded);
      } else {
        gi.zero_().slice(2, 0, (d_out - 1) * s_d + 1, s_d).copy_(unfolded);
      }
    }
  }
  if (a.output_mask[1]) gw = empty_like_native_weight(a.weight, layout).copy_(gw2.view(a.weight.sizes()));
  return {gi, gw, gb};
}

// Whether no element of data[0 .. n) has the all-ones exponent of inf / NaN: `bits` is the unsigned
// integer of the element's width, `exponent` its exponent mask. An OR reduction over integers, which
// the compiler vectorizes (a float sum of x * 0 would need reassociation), reading each element once.
template <typename bits, bits exponent>
bool no_inf_nan(const void* data, int64_t n) {
  const auto* bytes = static_cast<const char*>(data);
  bits bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    bits u;
    std::memcpy(&u, bytes + i * sizeof(bits), sizeof(bits));
    bad |= static_cast<bits>((u & exponent) == exponent);
  }
  return bad == 0;
}

// Whether every element of `t` is finite. On CPU one pass over its memory with no temporaries:
// at::isfinite(t).all() allocates a bool tensor and an abs copy, measured at 6.8 ms on a 512x512x3x3
// weight (one thread), and runs on weight and grad_weight of every call our kernels serve.
bool all_finite(const at::Tensor& t) {
  const auto dtype = t.scalar_type();
  const bool scannable = dtype == at::kFloat || dtype == at::kDouble || dtype == at::kBFloat16 || dtype == at::kHalf;
  if (!t.is_cpu() || !scannable) return at::isfinite(t).all().item<bool>();
  const at::Tensor c = t.contiguous();
  const char* data = static_cast<const char*>(c.const_data_ptr());
  const int64_t element = c.element_size();
  std::atomic<bool> finite{true};
  at::parallel_for(0, c.numel(), int64_t{1} << 16, [&](int64_t begin, int64_t end) {
    if (!finite.load(std::memory_order_relaxed)) return;
    const void* first = data + begin * element;
    const bool ok = dtype == at::kFloat ? no_inf_nan<uint32_t, 0x7f800000u>(first, end - begin)
        : dtype == at::kDouble          ? no_inf_nan<uint64_t, 0x7ff0000000000000ull>(first, end - begin)
        : dtype == at::kBFloat16        ? no_inf_nan<uint16_t, 0x7f80u>(first, end - begin)
                                        : no_inf_nan<uint16_t, 0x7c00u>(first, end - begin);
    if (!ok) finite.store(false, std::memory_order_relaxed);
  });
  return finite.load();
}

// --- kernels: the candidates that can serve a call -------------------------------------------------
//
// A layer class (classify) names the static choice; the kernels below are what can compute a call.
// With autotune on (the default; off under torch.use_deterministic_algorithms(True)), the first call
// of a signature times every candidate that applies on the call's own tensors, checks each against
// native, and remembers the winner; later calls of that signature take it after one hash lookup.

// The name the tracer, stats and results files show.
std::string kernel_name(Kernel k) {
  return kKernelNames[static_cast<int>(k)];
}

// What serves a call: one kernel for all its outputs, or a *split*: grad_input (and grad_bias) from
// one kernel and grad_weight from another, each run with its part of output_mask (the autotuner
// measures the two gradients separately: native's oneDNN grad_input and a GEMM grad_weight, say).
struct Choice {
  Kernel gi, gw;
  static Choice whole(Kernel k) { return {k, k}; }
  bool split() const { return gi != gw; }
};

// "kernel", or "gi_kernel+gw_kernel" for a split.
std::string choice_name(Choice c) {
  return c.split() ? kernel_name(c.gi) + "+" + kernel_name(c.gw) : kernel_name(c.gi);
}

std::optional<Kernel> parse_kernel(const std::string& name) {
  for (int i = 0; i < static_cast<int>(Kernel::Count); ++i) {
    if (name == kKernelNames[i]) return static_cast<Kernel>(i);
  }
  return std::nullopt;
}

// choice_name's inverse; nullopt for an unknown name.
std::optional<Choice> parse_choice(const std::string& name) {
  const size_t plus = name.find('+');
  if (plus == std::string::npos) {
    auto k = parse_kernel(name);
    return k ? std::optional<Choice>(Choice::whole(*k)) : std::nullopt;
  }
  auto gi = parse_kernel(name.substr(0, plus)), gw = parse_kernel(name.substr(plus + 1));
  if (!gi || !gw || *gi == *gw) return std::nullopt;
  return Choice{*gi, *gw};
}

// What computes a call native is known wrong on, in the call's own dtype where that is exact: fold-2d
// where amx_3d_weight is the only defect and the call folds (native's 2-D path is right there);
// live-taps where the dead taps are the kernel's ends and the call without them is served so; else the
// upcast.
Kernel defect_stand_in(const Args& a, const Expanded& e) {
  if (amx_3d_weight(a, e) && fold_2d_applies(a, e)) return Kernel::Fold2d;
  return live_taps_serve(a, e) ? Kernel::LiveTaps : Kernel::Upcast;
}

// What stands for native on a call: native, or where native_defective holds defect_stand_in (the
// upcast (native there segfaults, corrupts the heap or hangs: e.g. a one-channel float32
// Conv3d(1, 16, (9, 1, 1), stride (2, 1, 1), padding (5, 0, 0)) on a depth of 5). The autotuner's
// reference, its baseline and a declining kernel's fallback all run this kernel.
Kernel reference_kernel(const Args& a, const Expanded& e) {
  return native_defective(a, e) ? defect_stand_in(a, e) : Kernel::Native;
}

// The table's kernel for a layer class, before reference_kernel stands in for native.
Kernel table_kernel(LayerClass cls, const Args& a, const Expanded& e) {
  switch (cls) {
    case LayerClass::Empty: return Kernel::Zeros;
    case LayerClass::BiasOnly: return Kernel::Sum;
    case LayerClass::DeadTaps: return defect_stand_in(a, e);
    case LayerClass::Depthwise:
      if (!direct_kernel_serves(cls, a.grad_output)) return Kernel::Native;
      if (!a.grad_output.is_cpu()) return Kernel::Direct;
      return depthwise_table_walk(direct_problem(a, e), a.grad_output.scalar_type()) == DepthwiseWalk::Lanes
          ? Kernel::DepthwiseLanes
          : Kernel::DepthwisePlane;
    case LayerClass::Grouped:
    case LayerClass::OneChannel: return a.grad_output.is_cpu() ? Kernel::Direct : Kernel::Native;
    case LayerClass::GroupedLanes: return a.grad_output.is_cpu() ? Kernel::GroupedLanes : Kernel::Native;
    case LayerClass::Pointwise:
    case LayerClass::GroupedGemm:
    case LayerClass::Im2col3d: return a.grad_output.is_cpu() ? Kernel::GemmIm2col : Kernel::Native;
    case LayerClass::Kn2row3d: return a.grad_output.is_cpu() ? Kernel::GemmKn2row : Kernel::Native;
    case LayerClass::SmallPlanes:
    case LayerClass::Kn2row:
    case LayerClass::Dense:
    case LayerClass::Transposed: return Kernel::Native;
    case LayerClass::Count: break;
  }
  TORCH_INTERNAL_ASSERT(false, "convolution_backward[compiled]: unhandled layer class ", static_cast<int>(cls));
}

// The static choice of a layer class.
Kernel static_kernel(LayerClass cls, const Args& a, const Expanded& e) {
  const Kernel k = table_kernel(cls, a, e);
  return k == Kernel::Native ? reference_kernel(a, e) : k;
}

// The autotuner's tests inject a candidate: Slow (native's result, then as long again busy), Wrong
// (zeros: faster than any kernel, and wrong).
enum class TestCandidate : int { Off = 0, Slow, Wrong };

std::atomic<TestCandidate>& test_candidate() {
  static std::atomic<TestCandidate> mode{TestCandidate::Off};
  return mode;
}

// Why `k` cannot compute this call (a CPU call of a class the autotuner may choose for), or nullopt.
// The predicates are what each kernel computes correctly, narrowed where a kernel is known to be far
// from a win (the direct kernel on many channel pairs), so that tuning stays cheap.
std::optional<std::string> candidate_unsupported(Kernel k, const Args& a, const Expanded& e) {
  const auto dtype = a.grad_output.scalar_type();
  const DirectProblem p = direct_problem(a, e);
  const bool full = dtype == at::kFloat || dtype == at::kDouble;
  switch (k) {
    case Kernel::Native: return std::nullopt;
    case Kernel::DepthwisePlane:
      if (p.in_per_group == 1 && p.groups > 1) return std::nullopt;
      return "not depthwise (groups == C_in > 1)";
    case Kernel::DepthwiseLanes:
      if (p.in_per_group != 1 || p.groups == 1) return "not depthwise (groups == C_in > 1)";
      if (!depthwise_lanes_fits(p, dtype)) return "a plane's channels-in-lanes tiles exceed 16 MiB";
      return std::nullopt;
    case Kernel::DepthwiseBands: return depthwise_bands_unsupported(p, dtype);
    case Kernel::Direct:
      if ((p.groups > 1 && p.in_per_group > 1 && p.in_per_group * p.out_per_group <= kDirectMaxChannelPairs) ||
          (p.groups == 1 && e.c_in == 1)) {
        return std::nullopt;
      }
      return c10::str("not grouped with <= ", kDirectMaxChannelPairs, " channel pairs, nor one input channel");
    case Kernel::GroupedLanes:
      return grouped_lanes_unsupported(p, dtype);
    case Kernel::GemmIm2col: {
      bool pointwise = p.groups == 1;
      for (int64_t i = 0; i < 3; ++i) pointwise &= p.kernel[i] == 1 && p.padding[i] == 0;
      if (full || (dtype == at::kBFloat16 && pointwise && gemm_keeps_reduced_dtype(GemmAlgorithm::Im2col, p, 2))) {
        return std::nullopt;
      }
      return "reduced precision outside one-GEMM pointwise layers (float32 copies: twice native's memory)";
    }
    case Kernel::GemmKn2row:
      if (dtype == at::kBFloat16) return kn2row_bf16_unsupported(p);
      if (full && kn2row_applies(p)) return std::nullopt;
      return "not stride 1 with taps in one dim, or float16";
    case Kernel::Winograd: return winograd_unsupported(p);
    case Kernel::PointwiseFused: return pointwise_unsupported(p, dtype);
    case Kernel::Kn2rowLanes: return kn2row_lanes_unsupported(p, dtype);
    case Kernel::PointwiseBf16: return pointwise_bf16_unsupported(p, dtype);
    case Kernel::Kn2rowPlanes:
      if ((dtype == at::kFloat || dtype == at::kDouble) && kn2row_applies(p)) return std::nullopt;
      return "not stride 1 with taps in one dim, or not float32 / float64";
    case Kernel::Test:
      if (test_candidate().load() != TestCandidate::Off) return std::nullopt;
      return "test candidate off";
    case Kernel::Zeros:
    case Kernel::Sum:
    case Kernel::Upcast:
    case Kernel::Fold2d:
    case Kernel::LiveTaps:
    case Kernel::Count: break;
  }
  return "not a tunable kernel";
}

// Whether the autotuner may choose for a call of this class: a CPU call computing grad_input or
// grad_weight of a regular convolution on a path native computes correctly, or one whose only defect
// is amx_3d_weight, against fold-2d (native's right 2-D path) as the reference.
bool tunable(LayerClass cls, const Args& a, const Expanded& e) {
  switch (cls) {
    case LayerClass::Empty:
    case LayerClass::BiasOnly:
    case LayerClass::Transposed: return false;
    case LayerClass::DeadTaps:
      return a.grad_output.is_cpu() && !a.transposed && defect_stand_in(a, e) == Kernel::Fold2d;
    default: return a.grad_output.is_cpu();
  }
}

// Runs kernel `k`; nullopt when it declines the call. Our kernels sum over zero-padded planes or
// im2col columns, so an inf times a padding zero is NaN where native skips the term: a non-finite
// weight (grad_input of the direct kernels) is declined up front, and a non-finite grad_weight
// (input or grad_output had inf / NaN) is declined after the fact, so such calls get native's values
// whichever kernel the table or the autotuner chose.
std::optional<Result> run_kernel(Kernel k, const Args& a, const Expanded& e) {
  const bool cpu = a.grad_output.is_cpu();
  switch (k) {
    case Kernel::Native: {
      // Some native paths compute (and return) outputs the mask did not ask for: drop them.
      auto [gi, gw, gb] = call_original(a);
      return Result{a.output_mask[0] ? gi : at::Tensor(), a.output_mask[1] ? gw : at::Tensor(),
                    a.output_mask[2] ? gb : at::Tensor()};
    }
    case Kernel::Zeros: return empty_backward(a, e);
    case Kernel::Sum:
      return Result{at::Tensor(), at::Tensor(), a.output_mask[2] ? grad_bias(a.grad_output) : at::Tensor()};
    case Kernel::Upcast: return upcast_backward(a, float32_defect(a, e) ? at::kDouble : at::kFloat);
    case Kernel::Fold2d: return fold_2d_backward(a, e);
    case Kernel::LiveTaps: return live_taps_backward(a, e);
    case Kernel::DepthwisePlane:
    case Kernel::DepthwiseLanes:
    case Kernel::DepthwiseBands:
    case Kernel::Direct:
    case Kernel::GroupedLanes:
    case Kernel::GemmIm2col:
    case Kernel::GemmKn2row:
    case Kernel::Winograd:
    case Kernel::PointwiseFused:
    case Kernel::PointwiseBf16:
    case Kernel::Kn2rowPlanes:
    case Kernel::Kn2rowLanes: {
      const bool gemm = k == Kernel::GemmIm2col || k == Kernel::GemmKn2row || k == Kernel::Kn2rowPlanes;
      const bool winograd = k == Kernel::Winograd;
      // (bfloat16 gemm-kn2row too: its stacked grad_output has zeros where a tap meets no output)
      const bool stacked = k == Kernel::GemmKn2row && a.grad_output.scalar_type() == at::kBFloat16;
      if (cpu && (!gemm || stacked) && a.output_mask[0] && !all_finite(a.weight)) return std::nullopt;
      // The kn2row kernels form only the products of positions where a tap meets the input: an inf / NaN
      // in grad_output at an output position that only padding meets (native: inf x 0 = NaN in that
      // tap's grad_weight) would vanish from grad_weight, so such calls get native's result.
      if (cpu && a.output_mask[1] && (k == Kernel::Kn2rowLanes || k == Kernel::GemmKn2row || k == Kernel::Kn2rowPlanes) &&
          !all_finite(a.grad_output)) {
        return std::nullopt;
      }
      auto result = winograd                  ? winograd_backward(a, e)
          : k == Kernel::GroupedLanes         ? grouped_lanes_backward(a, e)
          : k == Kernel::PointwiseFused       ? pointwise_fused_backward(a, e)
          : k == Kernel::PointwiseBf16        ? pointwise_bf16_backward(a, e)
          : k == Kernel::Kn2rowLanes          ? kn2row_lanes_backward(a, e)
          : k == Kernel::GemmIm2col           ? gemm_backward(a, e, GemmAlgorithm::Im2col)
          : k == Kernel::GemmKn2row           ? gemm_backward(a, e, GemmAlgorithm::Kn2row)
          : k == Kernel::Kn2rowPlanes         ? gemm_backward(a, e, GemmAlgorithm::Kn2rowPlanes)
          : k == Kernel::DepthwiseLanes       ? direct_backward(a, e, DepthwiseWalk::Lanes)
          : k == Kernel::DepthwiseBands       ? direct_backward(a, e, DepthwiseWalk::Bands)
                                              : direct_backward(a, e, DepthwiseWalk::Plane);
      if (cpu && a.output_mask[1] && !all_finite(std::get<1>(result))) return std::nullopt;
      // A Winograd tile mixes its positions: one inf in grad_output is NaN across the tile (inf - inf)
      // where native has finite values, so such calls get native's result.
      if (winograd && a.output_mask[0] && !all_finite(std::get<0>(result))) return std::nullopt;
      return result;
    }
    case Kernel::Test: {
      if (test_candidate().load() == TestCandidate::Wrong) {
        return Result{a.output_mask[0] ? at::zeros_like(a.input) : at::Tensor(),
                      a.output_mask[1] ? at::zeros_like(a.weight) : at::Tensor(),
                      a.output_mask[2] ? at::zeros({e.c_out}, a.weight.options()) : at::Tensor()};
      }
      const auto start = std::chrono::steady_clock::now();
      auto result = run_kernel(reference_kernel(a, e), a, e);
      const auto spent = std::chrono::steady_clock::now() - start;
      while (std::chrono::steady_clock::now() - start < 2 * spent) {
      }
      return result;
    }
    case Kernel::Count: break;
  }
  TORCH_INTERNAL_ASSERT(false, "convolution_backward[compiled]: unhandled kernel ", static_cast<int>(k));
}

// The part of a call's output_mask a split runs on each kernel: grad_input and grad_bias, or grad_weight.
Mask grad_input_part(const Mask& m) {
  return {m[0], false, m[2]};
}
Mask grad_weight_part(const Mask& m) {
  return {false, m[1], false};
}

Args with_mask(const Args& a, const Mask& mask) {
  return Args{a.grad_output, a.input, a.weight, a.bias_sizes, a.stride, a.padding, a.dilation, a.transposed,
              a.output_padding, a.groups, mask};
}

// Runs a choice; nullopt when a kernel of it declines the call.
std::optional<Result> run_choice(Choice c, const Args& a, const Expanded& e) {
  if (!c.split()) return run_kernel(c.gi, a, e);
  auto gi = run_kernel(c.gi, with_mask(a, grad_input_part(a.output_mask)), e);
  if (!gi) return std::nullopt;
  auto gw = run_kernel(c.gw, with_mask(a, grad_weight_part(a.output_mask)), e);
  if (!gw) return std::nullopt;
  return Result{std::get<0>(*gi), std::get<1>(*gw), std::get<2>(*gi)};
}

// --- autotune -----------------------------------------------------------------------------------

// A call's signature: everything a kernel's speed or eligibility depends on. Serialised as
// comma-separated integers (results files).
using Signature = std::vector<int64_t>;

Signature signature(const Args& a) {
  Signature s;
  s.reserve(64);
  s.push_back(static_cast<int64_t>(a.grad_output.device().type()));
  s.push_back(static_cast<int64_t>(a.grad_output.scalar_type()));
  s.push_back(a.weight.dim());
  for (const at::Tensor* t : {&a.grad_output, &a.input, &a.weight}) {
    for (auto v : t->sizes()) s.push_back(v);
    for (auto v : t->strides()) s.push_back(v);
  }
  for (const at::IntArrayRef* l : {&a.stride, &a.padding, &a.dilation, &a.output_padding}) {
    s.push_back(static_cast<int64_t>(l->size()));
    for (auto v : *l) s.push_back(v);
  }
  s.push_back(a.transposed);
  s.push_back(a.groups);
  s.push_back(a.output_mask[0] | (a.output_mask[1] << 1) | (a.output_mask[2] << 2));
  s.push_back(a.bias_sizes.has_value());
  s.push_back(at::get_num_threads());
  return s;
}

struct SignatureHash {
  size_t operator()(const Signature& s) const noexcept {
    uint64_t h = 1469598103934665603ull;
    for (auto v : s) h = (h ^ static_cast<uint64_t>(v)) * 1099511628211ull;
    return static_cast<size_t>(h);
  }
};

struct Tuned {
  Choice choice;
  std::vector<std::pair<std::string, double>> times_us;  // candidate -> fastest run, microseconds (tuned here)
  std::vector<std::pair<std::string, std::string>> rejected;  // candidate -> why it could not win
  double tune_us = 0;                                     // what tuning cost, microseconds (0: loaded)
  // a candidate declined the call's values (inf / NaN): it could not be timed; or a requested result
  // of native's is all zeros: a candidate's could not be checked
  bool inconclusive = false;
};

// Tunings of a signature that are not stored while a candidate declines its calls' values: a first call
// with an inf (a bad batch, loss scaling) would otherwise leave every later, finite call of the signature
// on the baseline (native, or the upcast where native is known to crash: 1.4-4x slower than the layer
// class's own kernel). After this many, the choice is kept, so that a signature whose calls are never
// finite stops paying for tunings.
constexpr int kInconclusiveTunings = 3;

struct Autotuner {
  std::atomic<bool> enabled{true};
  std::shared_mutex table_mutex;
  std::unordered_map<Signature, Tuned, SignatureHash> table;
  // One tuning at a time: concurrent first calls tune once, timings undisturbed. Recursive: where
  // native is known to crash, a tuning's reference is the upcast (reference_kernel), whose float64
  // copy is served, and tuned, by this thread inside the outer tuning.
  std::recursive_mutex tuning_mutex;
  std::atomic<int64_t> tunings{0};
  std::atomic<int64_t> tune_us_total{0};
  std::atomic<int64_t> evicted_bytes{0};  // CacheFlush's evictions (tuning runs' tensors)
  std::unordered_map<Signature, int, SignatureHash> inconclusive;  // under tuning_mutex
};

Autotuner& autotuner() {
  static Autotuner t;
  return t;
}

// What the last call of this thread ran (the tracer reads it right after the call).
struct LastCall {
  std::string kernel;
  bool tuned = false;  // this call tuned its signature
  int rescale_exponent = 0;  // k > 0: computed on operands x 2^k (serve_rescaled)
  std::vector<std::pair<std::string, double>> times_us;
  std::vector<std::pair<std::string, std::string>> rejected;
};
thread_local LastCall last_call;

double elapsed_us(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
}


// How far a candidate's result may be from native's, relative to the result's largest magnitude.
double relative_tolerance(at::ScalarType dtype) {
  return dtype == at::kDouble ? 1e-10 : dtype == at::kFloat ? 1e-4 : dtype == at::kHalf ? 4e-3 : 3e-2;
}

// grad_input, grad_weight, grad_bias of a result, indexable as its output_mask is.
std::array<const at::Tensor*, 3> result_parts(const Result& r) {
  return {&std::get<0>(r), &std::get<1>(r), &std::get<2>(r)};
}

// Why `ours` is not native's result (shape, strides of dims > 1, or values beyond rtol of the result's
// largest magnitude, room for a different summation order, and beyond `atol`), or nullopt. Any NaN
// fails.
std::optional<std::string> differs(const Result& ours, const Result& native, const Mask& mask, double atol = 0) {
  const auto o = result_parts(ours), n = result_parts(native);
  const char* names[] = {"grad_input", "grad_weight", "grad_bias"};
  for (int i = 0; i < 3; ++i) {
    if (!mask[i]) continue;
    if (!o[i]->defined() || !n[i]->defined()) return c10::str(names[i], " missing");
    if (o[i]->sizes() != n[i]->sizes() || o[i]->scalar_type() != n[i]->scalar_type()) {
      return c10::str(names[i], " shape or dtype differs");
    }
    for (int64_t d = 0; d < o[i]->dim(); ++d) {
      if (o[i]->size(d) > 1 && o[i]->stride(d) != n[i]->stride(d)) return c10::str(names[i], " strides differ");
    }
    if (o[i]->numel() == 0) continue;
    const auto dtype = o[i]->scalar_type();
    const double rtol = relative_tolerance(dtype);
    // Relative to the result's own scale (no floor: gradients of a mean-reduced loss are tiny, and a
    // candidate returning zeros must not pass as "within 1e-4").
    const at::Tensor ref = n[i]->to(at::kDouble);
    const double scale = ref.abs().max().item<double>();
    const double err = (o[i]->to(at::kDouble) - ref).abs().max().item<double>();
    if (!(err <= std::max(atol, rtol * scale))) {
      return c10::str(names[i], " max error ", err, " > ", rtol, " x scale ", scale);
    }
  }
  return std::nullopt;
}

// A power-of-two rescaled copy of `t` whose largest magnitude is in [0.5, 1), with t's sizes and
// strides (kernels choose their path by layout); `t` itself where it is all zeros. Undefined where
// that cannot be made exactly: non-dense strides, non-finite values, or values so far below the
// largest that the rescaled copy would round them (a range wider than the dtype's).
at::Tensor normalized_copy(const at::Tensor& t) {
  if (!t.is_non_overlapping_and_dense()) return {};
  if (t.numel() == 0) return t;
  const at::Tensor wide = t.to(at::kDouble);
  const double max = wide.abs().max().item<double>();
  if (!std::isfinite(max)) return {};
  if (max == 0) return t;
  int exponent = 0;
  std::frexp(max, &exponent);
  // the factor in float64: 2^-exponent can be out of the dtype's own range (float32 below 2^-126)
  at::Tensor copy = at::empty_strided(t.sizes(), t.strides(), t.options());
  copy.copy_(wide.mul(std::ldexp(1.0, -exponent)));
  if (!copy.to(at::kDouble).mul_(std::ldexp(1.0, exponent)).equal(wide)) return {};
  return copy;
}

// Checks a candidate's result against native's (`differs`), with one exception: where the call's
// values reach the bottom of the dtype's range, results that differ by no more than underflow can
// explain. Each term of a convolution backward's reductions holds a different grad_output element, so
// a result sums at most grad_output.numel() products, and each product or partial sum below the
// smallest normal number (finfo.tiny) loses up to tiny (flushed to zero under FTZ/DAZ, rounded to a
// subnormal otherwise). Random-init EfficientNet-B0's squeeze-excite gradients are ~1e-37: each kernel
// sums them in its own order, its grad_weight differs from native's by 4% of its largest magnitude, and
// every candidate was rejected as wrong. Such a difference is accepted only if the same kernel then
// matches native within the dtype's rtol on a power-of-two rescaled copy of the call (largest
// magnitudes in [0.5, 1), the same layout; the gradients scale exactly), so a kernel that returns
// zeros, or anything else wrong, still fails. Where no exact copy exists (a tensor whose values span
// more than the dtype's range: rescaled, its small values would round to zero, and native's result
// with them) the difference stays a rejection.
class Verifier {
 public:
  Verifier(const Args& a, const Expanded& e, Kernel base, const Result& reference)
      : a_(a), e_(e), base_(base), reference_(reference) {}

  std::optional<std::string> operator()(Kernel k, const Result& ours, const Mask& mask) {
    auto why = differs(ours, reference_, mask);
    if (!why || differs(ours, reference_, mask, underflow_bound())) return why;
    if (!rescale()) {
      return *why + "; the call cannot be rescaled exactly (non-dense strides, non-finite values, or a tensor's "
                    "values spanning more than the dtype's range)";
    }
    if (!rescaled_->reference) return *why + "; native declined the rescaled call";
    const Args scaled = with_mask(*rescaled_->args, mask);
    auto result = run_kernel(k, scaled, e_);
    if (!result) return *why + "; declined the rescaled call";
    if (auto scaled_why = differs(*result, *rescaled_->reference, mask)) {
      return *why + "; on the call rescaled out of the underflow range: " + *scaled_why;
    }
    return std::nullopt;
  }

 private:
  // Whether the rescaled call exists (made on first need, tried once).
  bool rescale() {
    if (!rescale_tried_) {
      rescale_tried_ = true;
      make_rescaled();
    }
    return rescaled_.has_value();
  }

  struct Rescaled {
    at::Tensor grad_output, input, weight;
    std::optional<Args> args;
    std::optional<Result> reference;
  };

  // How far underflow can take a result from native's: grad_output.numel() terms, each losing up to
  // finfo.tiny twice (its product, its partial sum). float16 / bfloat16 kernels accumulate in float32:
  // float32's tiny (a float16 result near its own subnormal range is judged by rtol alone).
  double underflow_bound() const {
    const double tiny = a_.grad_output.scalar_type() == at::kDouble ? std::numeric_limits<double>::min()
                                                                     : std::numeric_limits<float>::min();
    return 2.0 * static_cast<double>(a_.grad_output.numel()) * tiny;
  }

  void make_rescaled() {
    at::Tensor grad_output = normalized_copy(a_.grad_output), input = normalized_copy(a_.input),
               weight = normalized_copy(a_.weight);
    if (!grad_output.defined() || !input.defined() || !weight.defined()) return;
    rescaled_.emplace(Rescaled{std::move(grad_output), std::move(input), std::move(weight), {}, {}});
    rescaled_->args.emplace(Args{rescaled_->grad_output, rescaled_->input, rescaled_->weight, a_.bias_sizes,
                                 a_.stride, a_.padding, a_.dilation, a_.transposed, a_.output_padding, a_.groups,
                                 a_.output_mask});
    rescaled_->reference = run_kernel(base_, *rescaled_->args, e_);
  }

  const Args& a_;
  const Expanded& e_;
  Kernel base_;
  const Result& reference_;
  bool rescale_tried_ = false;
  std::optional<Rescaled> rescaled_;
};

// A candidate that is not this much faster than native does not win (timing noise).
constexpr double kWinMargin = 0.97;
// Every candidate runs once (checked against native) and once more in an interleaved round; one whose
// faster run takes over kSlowCutoff x the fastest candidate's is then dropped, the others run
// kRounds - 1 more interleaved rounds. The decision takes each candidate's fastest run: on a shared
// machine interference only adds time, and a single disturbed run (another process's burst, a
// page-fault storm) must not drop the kernel that wins. Tuning costs two runs of native, two of each
// candidate and kRounds - 1 of native and of the close ones.
constexpr int kRounds = 3;
constexpr double kSlowCutoff = 2.0;
// A call whose fastest run (after the first round) takes this long is decided on those two runs of
// each candidate and one round per gradient for a split: a VM's disturbances (a page-fault storm, a
// neighbour's burst) cost a few ms, a small part of such a run, and the extra rounds made most of the
// tuning time: R(2+1)D-18's first bfloat16 step took 67 s (native's: 7.7), its layers' calls 30-600 ms
// each.
constexpr double kLongCallUs = 20000;

// Tuning times a call's kernels on the call's own tensors, over and over; in a training step the
// call's tensors arrive from memory, its caches full of other layers' data. Where the tensors would
// otherwise stay cached between runs, each timed run starts with them evicted from every cache level,
// and each run's results are evicted before they are freed (their memory holds the next run's
// results, cold in a step): measured warm, gemm-im2col beat native's Slow2d on MobileNetV2's 56x56
// 1x1 layers and lost to it by 10-17% in the step.
// Evicting exactly those lines (clflushopt) costs what the tensors' size costs. Writing a buffer twice
// the last-level cache before every run (at most 128 MiB; kept where the CPU has no clflushopt) took
// ~10 ms a run on a VM that reports a 480 MiB L3: ~0.3 s per tuned signature however small its call,
// and EfficientNet-B0's first bfloat16 step took 22 s (native's: 1.9 s).
class CacheFlush {
 public:
  explicit CacheFlush(const Args& a) {
    int64_t bytes = 2 * a.grad_output.nbytes();
    for (const at::Tensor* t : {&a.input, &a.weight}) bytes += 2 * t->nbytes();
    if (bytes >= cache_limit()) return;  // the call's own tensors do not fit the caches
    if (!evicts_lines()) {
      buffer_.resize(cache_limit());
      return;
    }
    for (const at::Tensor* t : {&a.grad_output, &a.input, &a.weight}) tensors_.push_back(*t);
  }
  // Before a timed run: the call's tensors out of every cache level.
  void operator()() {
    if (!buffer_.empty()) std::memset(buffer_.data(), ++fill_, buffer_.size());
    if (tensors_.empty()) return;
    for (const at::Tensor& t : tensors_) evict(t);
    fence();
  }
  // After a timed run, before its results are freed.
  void operator()(const std::optional<Result>& result) {
    if (tensors_.empty() || !result) return;
    for (const at::Tensor* t : result_parts(*result)) {
      if (t->defined()) evict(*t);
    }
  }

 private:
  // Twice the last-level cache (at least 32 MiB, at most 128 MiB).
  static int64_t cache_limit() {
    static const int64_t bytes =
        std::clamp<int64_t>(2 * std::max(cache_bytes(3), cache_bytes(2)), int64_t{32} << 20, int64_t{128} << 20);
    return bytes;
  }
#ifdef ATEN_OVERRIDE_CLFLUSHOPT
  static bool evicts_lines() {
    static const bool yes = [] {
      unsigned a = 0, b = 0, c = 0, d = 0;
      return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (b & (1u << 23));  // CPUID.(7,0):EBX[23] CLFLUSHOPT
    }();
    return yes;
  }
  // The lines of t's elements (from its first to its last, strides non-negative as ATen's are).
  __attribute__((target("clflushopt"))) static void evict(const at::Tensor& t) {
    if (t.numel() == 0) return;
    int64_t last = 0;
    for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * std::max<int64_t>(0, t.stride(d));
    const char* begin = static_cast<const char*>(t.const_data_ptr());
    const char* end = begin + (last + 1) * static_cast<int64_t>(t.element_size());
    for (const char* p = begin - reinterpret_cast<uintptr_t>(begin) % 64; p < end; p += 64) _mm_clflushopt(const_cast<char*>(p));
    autotuner().evicted_bytes.fetch_add(end - begin, std::memory_order_relaxed);
  }
  static void fence() { _mm_mfence(); }
#else
  static bool evicts_lines() { return false; }
  static void evict(const at::Tensor&) {}
  static void fence() {}
#endif
  std::vector<at::Tensor> tensors_;  // the call's, where lines are evicted (else none)
  std::vector<unsigned char> buffer_;
  unsigned char fill_ = 0;
};

// A call asking for both gradients: each still-alive candidate is timed on grad_input alone (with
// grad_bias) and on grad_weight alone, `rounds` times each (2, or 1 for a long call), interleaved; when
// the fastest grad_input kernel and the fastest grad_weight kernel differ and together beat `best` (the
// whole-call winner's fastest run, or native's less kWinMargin), the split wins. Each part is checked
// against native's result.
void tune_split(
    const Args& a, const Expanded& e, const std::vector<Kernel>& candidates, const std::vector<bool>& alive,
    Verifier& verify, double best, int rounds, CacheFlush& flush, Tuned& out) {
  const Mask parts[2] = {grad_input_part(a.output_mask), grad_weight_part(a.output_mask)};
  const char* labels[2] = {"grad_input:", "grad_weight:"};
  size_t alive_count = 0;
  for (bool x : alive) alive_count += x;
  if (alive_count < 2) return;
  std::vector<double> fastest[2] = {std::vector<double>(candidates.size(), INFINITY),
                                    std::vector<double>(candidates.size(), INFINITY)};
  for (int round = 0; round < rounds; ++round) {
    for (size_t j = 0; j < candidates.size(); ++j) {
      const size_t i = round % 2 ? candidates.size() - 1 - j : j;
      if (!alive[i]) continue;
      for (int part = 0; part < 2; ++part) {
        const Args sub = with_mask(a, parts[part]);
        flush();
        const auto t0 = std::chrono::steady_clock::now();
        auto result = run_kernel(candidates[i], sub, e);
        const double t = elapsed_us(t0);
        const bool wrong = round == 0 && (!result || verify(candidates[i], *result, parts[part]));
        flush(result);  // (after the check, which reads it)
        if (wrong) {
          fastest[part][i] = NAN;  // never chosen for this part
          continue;
        }
        if (!std::isnan(fastest[part][i])) fastest[part][i] = std::min(fastest[part][i], t);
      }
    }
  }
  size_t pick[2] = {0, 0};
  for (int part = 0; part < 2; ++part) {
    for (size_t i = 0; i < candidates.size(); ++i) {
      if (!alive[i] || std::isnan(fastest[part][i])) continue;
      out.times_us.emplace_back(labels[part] + kernel_name(candidates[i]), fastest[part][i]);
      if (std::isnan(fastest[part][pick[part]]) || fastest[part][i] < fastest[part][pick[part]]) pick[part] = i;
    }
  }
  if (pick[0] == pick[1] || std::isnan(fastest[0][pick[0]]) || std::isnan(fastest[1][pick[1]])) return;
  if (fastest[0][pick[0]] + fastest[1][pick[1]] < best) out.choice = Choice{candidates[pick[0]], candidates[pick[1]]};
}

Tuned tune(const Args& a, const Expanded& e, Kernel static_choice) {
  const auto start = std::chrono::steady_clock::now();
  // native, or its stand-in where native is known to crash (reference_kernel): candidates[0]
  const Kernel base = reference_kernel(a, e);
  std::vector<Kernel> candidates{base};
  Tuned out;
  for (int k = 0; k < static_cast<int>(Kernel::Count); ++k) {
    const Kernel kernel = static_cast<Kernel>(k);
    if (kernel == Kernel::Native || kernel == base) continue;
    // the table's choice always competes
    if (kernel == static_choice || !candidate_unsupported(kernel, a, e)) candidates.push_back(kernel);
  }
  std::vector<std::vector<double>> times(candidates.size());
  std::vector<bool> alive(candidates.size(), true);
  // Native's (base's) first run is the reference and is not timed: it pays oneDNN's primitive
  // creation, which would make a warm native look slow. Base is timed in every round, never dropped.
  const Result reference = *run_kernel(base, a, e);
  // A requested result that is all zeros (an all-zero grad_output: below a zero-initialised head, on
  // the first step) tells a right kernel from one that returns zeros no better than nothing: the
  // choice serves this call but does not pin the signature (tuned again on the next call, as a call
  // with non-finite values is).
  const auto parts = result_parts(reference);
  for (int i = 0; i < 3; ++i) {
    if (a.output_mask[i] && parts[i]->defined() && parts[i]->numel() > 0 && !parts[i]->any().item<bool>()) {
      out.inconclusive = true;
    }
  }
  Verifier verify(a, e, base, reference);
  CacheFlush flush(a);
  flush();
  auto t0 = std::chrono::steady_clock::now();
  {
    const auto result = run_kernel(base, a, e);
    times[0].push_back(elapsed_us(t0));
    flush(result);
  }
  for (size_t i = 1; i < candidates.size(); ++i) {
    const std::string name = kernel_name(candidates[i]);
    flush();
    t0 = std::chrono::steady_clock::now();
    auto result = run_kernel(candidates[i], a, e);
    const double t = elapsed_us(t0);
    if (!result) {
      alive[i] = false;
      out.rejected.emplace_back(name, "declined the call (non-finite values)");
      out.inconclusive = true;
    } else if (auto why = verify(candidates[i], *result, a.output_mask)) {
      alive[i] = false;
      out.rejected.emplace_back(name, "wrong: " + *why);
    } else {
      times[i].push_back(t);
    }
    flush(result);
  }
  const auto timed_round = [&](int round) {
    for (size_t j = 0; j < candidates.size(); ++j) {
      const size_t i = round % 2 ? j : candidates.size() - 1 - j;  // every other round in reverse order
      if (!alive[i]) continue;
      flush();
      t0 = std::chrono::steady_clock::now();
      const auto result = run_kernel(candidates[i], a, e);
      times[i].push_back(elapsed_us(t0));
      flush(result);
    }
  };
  const auto fastest_run = [&](size_t i) { return *std::min_element(times[i].begin(), times[i].end()); };
  timed_round(0);
  // Only candidates within kSlowCutoff of the fastest are timed again.
  double fastest = fastest_run(0);
  for (size_t i = 1; i < candidates.size(); ++i) {
    if (alive[i]) fastest = std::min(fastest, fastest_run(i));
  }
  for (size_t i = 1; i < candidates.size(); ++i) {
    if (alive[i] && fastest_run(i) > kSlowCutoff * fastest) {
      alive[i] = false;
      out.rejected.emplace_back(
          kernel_name(candidates[i]), c10::str("slow: ", fastest_run(i), " us vs ", fastest, " us (fastest runs)"));
    }
  }
  const bool long_call = fastest >= kLongCallUs;
  for (int round = 1; round < (long_call ? 1 : kRounds); ++round) timed_round(round);
  // Native (base) wins unless a candidate beats it by kWinMargin.
  out.choice = Choice::whole(base);
  double best = fastest_run(0) * kWinMargin;
  for (size_t i = 0; i < candidates.size(); ++i) {
    if (!alive[i]) continue;
    const double us = fastest_run(i);
    out.times_us.emplace_back(kernel_name(candidates[i]), us);
    if (i > 0 && us < best) {
      best = us;
      out.choice = Choice::whole(candidates[i]);
    }
  }
  if (a.output_mask[0] && a.output_mask[1]) tune_split(a, e, candidates, alive, verify, best, long_call ? 1 : 2, flush, out);
  out.tune_us = elapsed_us(start);
  return out;
}

// Whether the table decides for a call of class `cls` (autotune off, deterministic mode, or a class
// the autotuner does not choose for).
bool static_choice_only(LayerClass cls, const Args& a, const Expanded& e) {
  return !autotuner().enabled.load(std::memory_order_relaxed) || !tunable(cls, a, e) ||
      at::globalContext().deterministicAlgorithms();
}

std::optional<Choice> tuned_choice(const Signature& key) {
  auto& tuner = autotuner();
  std::shared_lock<std::shared_mutex> lock(tuner.table_mutex);
  auto it = tuner.table.find(key);
  if (it == tuner.table.end()) return std::nullopt;
  return it->second.choice;
}

// `tuned` if it can compute the call, else the table's choice: an entry loaded from a results file
// names kernels, and one that cannot compute this call (a tampered file) is never run; a split needs
// a call asking for both gradients.
Choice usable_choice(Choice tuned, Kernel static_choice, const Args& a, const Expanded& e) {
  // (reference_kernel only for an entry naming native or its stand-ins: this runs on every tuned call)
  const auto can = [&](Kernel k) {
    if (k == Kernel::Native || k == Kernel::Upcast || k == Kernel::Fold2d || k == Kernel::LiveTaps) {
      return k == reference_kernel(a, e);
    }
    return k == static_choice || !candidate_unsupported(k, a, e);
  };
  const bool ok = can(tuned.gi) && can(tuned.gw) && (!tuned.split() || (a.output_mask[0] && a.output_mask[1]));
  return ok ? tuned : Choice::whole(static_choice);
}

bool operands_finite(const Args& a);

// What serves a call of class `cls`: the table's kernel, or the tuned choice (tuning it first). A call
// of an untuned signature with an inf / NaN in its operands is not tuned: our kernels would decline it
// (they cannot be timed on it), so reference_kernel serves it and the signature waits for a finite
// call (a float16 GradScaler's first, overflowing steps left every signature on native before: three
// inconclusive tunings in a row were stored).
Choice choose_kernel(const Args& a, const Expanded& e, LayerClass cls) {
  const Kernel static_choice = static_kernel(cls, a, e);
  if (static_choice_only(cls, a, e)) return Choice::whole(static_choice);
  auto& tuner = autotuner();
  const Signature key = signature(a);
  const auto usable = [&](Choice c) { return usable_choice(c, static_choice, a, e); };
  if (auto choice = tuned_choice(key)) return usable(*choice);
  if (!operands_finite(a)) return Choice::whole(reference_kernel(a, e));
  std::lock_guard<std::recursive_mutex> tuning(tuner.tuning_mutex);
  if (auto choice = tuned_choice(key)) return usable(*choice);  // another thread tuned it meanwhile
  Tuned tuned = tune(a, e, static_choice);
  tuner.tunings.fetch_add(1, std::memory_order_relaxed);
  tuner.tune_us_total.fetch_add(static_cast<int64_t>(tuned.tune_us), std::memory_order_relaxed);
  last_call.tuned = true;
  last_call.times_us = tuned.times_us;
  last_call.rejected = tuned.rejected;
  const Choice choice = tuned.choice;
  if (tuned.inconclusive && ++tuner.inconclusive[key] < kInconclusiveTunings) return choice;  // tune again
  tuner.inconclusive.erase(key);
  std::unique_lock<std::shared_mutex> lock(tuner.table_mutex);
  tuner.table.emplace(key, std::move(tuned));
  return choice;
}

// --- calls with inf / NaN ------------------------------------------------------------------------
// Whether run_kernel(k) may decline a CPU call's values: our computing kernels; native and the kernels
// that stand on it (upcast, fold-2d, live-taps) never do.
bool may_decline(Kernel k) {
  switch (k) {
    case Kernel::Native:
    case Kernel::Zeros:
    case Kernel::Sum:
    case Kernel::Upcast:
    case Kernel::Fold2d:
    case Kernel::LiveTaps:
    case Kernel::Test:
      return false;
    default:
      return true;
  }
}

// Signatures whose last call a kernel of ours declined. A non-finite grad_weight (or Winograd's
// grad_input) is only found after the kernel computed it, and reference_kernel then computes the call
// again: twice its time, on every layer of every step whose backward carries an inf / NaN (a float16
// GradScaler's overflowing steps, a diverging run). The next calls of such a signature first read
// their operands (all_finite: one pass, memory speed) and go to reference_kernel unoffered while an
// inf / NaN is there; a finite call runs the choice and clears the mark. The operands' test is wider
// than a decline (an inf no tap reads declines nothing): such a call gets native's result, so under
// torch.use_deterministic_algorithms(True), where a call's bits must not depend on what ran before,
// nothing is marked or skipped. Calls whose finite operands overflow (float16) are still computed
// twice. `count` keeps every other call free of the lookup (no signature is computed while it is 0);
// autotune_clear() forgets the marks.
struct Declining {
  static constexpr size_t kMaxSignatures = 1024;  // a bound on memory: past it the marks start over
  std::mutex mutex;
  std::unordered_set<Signature, SignatureHash> signatures;
  std::atomic<int64_t> count{0};

  bool marked(const Signature& key) {
    std::lock_guard<std::mutex> lock(mutex);
    return signatures.count(key) > 0;
  }
  void mark(Signature key) {
    std::lock_guard<std::mutex> lock(mutex);
    if (signatures.size() >= kMaxSignatures) signatures.clear();
    signatures.insert(std::move(key));
    count.store(static_cast<int64_t>(signatures.size()), std::memory_order_relaxed);
  }
  void unmark(const Signature& key) {
    std::lock_guard<std::mutex> lock(mutex);
    signatures.erase(key);
    count.store(static_cast<int64_t>(signatures.size()), std::memory_order_relaxed);
  }
  void clear() {
    std::lock_guard<std::mutex> lock(mutex);
    signatures.clear();
    count.store(0, std::memory_order_relaxed);
  }
};

Declining& declining() {
  static Declining d;
  return d;
}

// Whether the operands a call's requested results read are free of inf / NaN.
bool operands_finite(const Args& a) {
  return all_finite(a.grad_output) && (!a.output_mask[0] || all_finite(a.weight)) &&
      (!a.output_mask[1] || all_finite(a.input));
}

// The choice for a checked call of class `cls` and its result (reference_kernel's: native's, where the
// choice declines the call's values, or where its signature's last call was declined and the call's
// operands are not finite: Declining, not in deterministic mode).
std::pair<Choice, Result> choose_and_run(const Args& a, const Expanded& e, LayerClass cls) {
  Choice choice = choose_kernel(a, e, cls);
  std::optional<Result> result;
  bool offered = true;
  const bool checked = a.grad_output.is_cpu() && (may_decline(choice.gi) || may_decline(choice.gw));
  if (checked && !at::globalContext().deterministicAlgorithms()) {
    auto& d = declining();
    std::optional<Signature> key;
    bool marked = false;
    if (d.count.load(std::memory_order_relaxed) > 0) {
      key = signature(a);
      marked = d.marked(*key);
      offered = !marked || operands_finite(a);
    }
    if (offered) result = run_choice(choice, a, e);
    if (offered && !result) {
      d.mark(key ? std::move(*key) : signature(a));
      counters().declined.fetch_add(1, std::memory_order_relaxed);
    } else if (offered && marked) {
      d.unmark(*key);
    }
  } else {
    result = run_choice(choice, a, e);
    if (checked && !result) counters().declined.fetch_add(1, std::memory_order_relaxed);
  }
  if (!result) {
    if (!offered) counters().skipped.fetch_add(1, std::memory_order_relaxed);
    choice = Choice::whole(reference_kernel(a, e));
    result = run_kernel(choice.gi, a, e);
  }
  return {choice, std::move(*result)};
}

// The call a dead-taps call stands on (its upcast copies, the 2-D call it folds into, or the call
// without its dead taps), served like any call (the upcast's class cannot be dead-taps again: float32
// only where float32_defect does not hold, float64 never; the folded call is 2-D, with the 3-D call's
// taps, dead-taps only where float32_defect holds (strided_1x1_avx2), whose upcast is float64; the call
// without dead taps is dead-taps only where it folds), but counted as part
// of the outer call: stats() and the tracer name the outer call's class and kernel ("upcast",
// "fold-2d", "live-taps"; its tuning record, when it tuned, is this computation's).
Result serve_derived_call(const Args& f) {
  const Expanded e = check_args(f);
  const LayerClass cls = classify(f, e);
  TORCH_INTERNAL_ASSERT(
      cls != LayerClass::DeadTaps || defect_stand_in(f, e) == Kernel::Fold2d ||
          (float32_defect(f, e) && f.grad_output.scalar_type() != at::kDouble),
      "convolution_backward[compiled]: derived call is dead-taps again");
  return choose_and_run(f, e, cls).second;
}

// --- gradients at the bottom of the dtype's range --------------------------------------------------
//
// Arithmetic whose operand or result is subnormal takes a microcode assist on Intel CPUs, ~100x the
// instruction's time, in every library's kernels and ours (unless the thread flushes them: FTZ / DAZ,
// torch.set_flush_denormal(True)). A random-init EfficientNet-B0's gradients shrink layer by layer
// towards its stem (largest magnitudes 2^-11 at its head, 2^-106 at its stem, float32): their products
// with weights and activations are subnormal, and native's float32 1x1 layers ran at 1.4 GFLOP/s
// (144 -> 24 channels at 56x56, batch 8, one thread: 244 ms; 5.9 ms with grad_output x 2^87), the whole
// convolution backward of a step 1706 ms against 371 ms on power-of-two rescaled grad_outputs.
// A convolution backward is linear in grad_output and, for each gradient, in the other operand:
// grad_input from grad_output and weight x 2^k, grad_weight from grad_output and input x 2^k (or both
// from grad_output x 2^k, where input and weight are larger or not dense) are 2^k times the call's, exactly where
// nothing underflows, and their products stay out of the subnormal range; the results x 2^-k round once
// where they are subnormal, where natively every underflowing product and partial sum rounds: the same
// values where nothing underflows, closer to the exact ones where something does (grad_bias, a sum of
// grad_output, has no products: scaled with grad_output or not at all). Serving rescales where the
// thread does not flush, the machine pays for subnormals (measured once per process, subnormal_cost()),
// and a sample of grad_output's values lies below kRescaleBelow (float32: 2^-32; the EfficientNet-B0
// layers whose largest magnitude was 2^-36 and below gained, those at 2^-29 and above did not); k takes
// the sample's largest magnitude into [0.5, 1). It costs one pass over the copied operand and one over
// the results; a copy or a result that is not finite (a value the sample missed) serves the call as it is.
// The kernel that serves the rescaled call is the signature's own (tuned on rescaled values, the ones
// kernels are fast on).

// The largest sampled grad_output magnitudes below which serving rescales (float32, float64).
constexpr double kRescaleBelowFloat = 0x1p-32;
constexpr double kRescaleBelowDouble = 0x1p-256;
// How many grad_output values the per-call check reads, spread over the tensor (for a large one, one
// cache line every few pages).
constexpr int64_t kRescaleSamples = 1024;

// Whether this thread flushes subnormal operands and results to zero (x86 MXCSR DAZ and FTZ, as
// torch.set_flush_denormal(True) sets them).
bool flushes_subnormals() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  constexpr unsigned kFlushToZero = 0x8000, kDenormalsAreZero = 0x0040;
  return (_mm_getcsr() & (kFlushToZero | kDenormalsAreZero)) == (kFlushToZero | kDenormalsAreZero);
#else
  return false;
#endif
}

struct SubnormalCost {
  double normal_us = 0, subnormal_us = 0;  // fastest runs, microseconds
  bool rescale = false;                    // serving rescales (subject to the call's values)
  bool forced = false;                     // set_subnormal_rescale forced `rescale`
};

// -1: measured; 0: never rescale; 1: rescale whatever the machine (set_subnormal_rescale).
std::atomic<int> forced_rescale{-1};

// What a float32 GEMM costs on this machine when its products are subnormal: at::mm of 128 x 128
// matrices of 2^-70 (every product 2^-140) against matrices of 0.5, fastest of five runs each,
// interleaved, on one thread (task 0 of a parallel region), measured once per process where a call
// first needs it. A machine at under twice the normal time does not rescale.
SubnormalCost subnormal_cost() {
  static const SubnormalCost measured = [] {
    SubnormalCost out;
    at::parallel_for(0, std::max(1, at::get_num_threads()), 1, [&](int64_t begin, int64_t) {
      if (begin != 0) return;
      // constant operands: a user's seeded random stream must not depend on whether this ran
      const at::Tensor normal = at::full({128, 128}, 0.5f), tiny = at::full({128, 128}, 0x1p-70f);
      at::Tensor c = at::empty({128, 128});
      double best[2] = {INFINITY, INFINITY};
      for (int run = 0; run < 6; ++run) {
        for (int i = 0; i < 2; ++i) {
          const at::Tensor& m = i ? tiny : normal;
          const auto start = std::chrono::steady_clock::now();
          at::mm_out(c, m, m);
          if (run > 0) best[i] = std::min(best[i], elapsed_us(start));  // run 0 warms both up
        }
      }
      out.normal_us = best[0];
      out.subnormal_us = best[1];
    });
    out.rescale = out.subnormal_us > 2 * out.normal_us;
    return out;
  }();
  SubnormalCost out = measured;
  const int forced = forced_rescale.load(std::memory_order_relaxed);
  if (forced >= 0) {
    out.rescale = forced == 1;
    out.forced = true;
  }
  return out;
}

// The largest magnitude among kRescaleSamples of a dense tensor's values (its numel() elements from
// data_ptr(), in some order); NaN if one is NaN.
template <typename T>
double sampled_max_magnitude(const at::Tensor& t) {
  const T* data = t.const_data_ptr<T>();
  const int64_t n = t.numel(), step = std::max<int64_t>(1, n / kRescaleSamples);
  double max = 0;
  for (int64_t i = 0; i < n; i += step) {
    const double v = std::abs(static_cast<double>(data[i]));
    max = v > max || std::isnan(v) ? v : max;
  }
  return max;
}

// The k > 0 for which serving computes the call on operands x 2^k (above); 0 where it does not.
int rescale_exponent(const Args& a, LayerClass cls) {
  const at::Tensor& go = a.grad_output;
  const auto dtype = go.scalar_type();
  if ((dtype != at::kFloat && dtype != at::kDouble) || cls == LayerClass::Empty || cls == LayerClass::BiasOnly ||
      go.numel() == 0 ||
      !go.is_non_overlapping_and_dense() || forced_rescale.load(std::memory_order_relaxed) == 0 ||
      flushes_subnormals()) {
    return 0;
  }
  const double max = dtype == at::kFloat ? sampled_max_magnitude<float>(go) : sampled_max_magnitude<double>(go);
  if (!(max > 0 && max < (dtype == at::kFloat ? kRescaleBelowFloat : kRescaleBelowDouble))) return 0;
  if (!subnormal_cost().rescale) return 0;
  int exponent = 0;
  std::frexp(max, &exponent);
  // float64's 2^k ends at 2^1023: a float64 grad_output this far down is left as it is
  return exponent > -1000 ? -exponent : 0;
}

// out = in x 2^k over n values; false if a result is not finite. In float64 where 2^k is not a normal
// float32 (a float32 grad_output whose values are all subnormal): rounded once either way.
template <typename T>
bool scale_values(const T* in, T* out, int64_t n, int k) {
  using Bits = std::conditional_t<std::is_same_v<T, float>, uint32_t, uint64_t>;
  constexpr Bits exponent_bits = std::is_same_v<T, float> ? Bits(0x7f800000u) : Bits(0x7ff0000000000000ull);
  const bool in_range = std::is_same_v<T, double> || std::abs(k) < 126;
  std::atomic<bool> finite{true};
  at::parallel_for(0, n, 1 << 16, [&](int64_t begin, int64_t end) {
    Bits non_finite = 0;
    if (in_range) {
      const T factor = static_cast<T>(std::ldexp(1.0, k));
      for (int64_t i = begin; i < end; ++i) {
        const T v = in[i] * factor;
        Bits bits;
        std::memcpy(&bits, &v, sizeof(T));
        non_finite |= (bits & exponent_bits) == exponent_bits;
        out[i] = v;
      }
    } else {
      const double factor = std::ldexp(1.0, k);
      for (int64_t i = begin; i < end; ++i) {
        const T v = static_cast<T>(static_cast<double>(in[i]) * factor);
        non_finite |= !std::isfinite(v);
        out[i] = v;
      }
    }
    if (non_finite) finite.store(false, std::memory_order_relaxed);
  });
  return finite.load();
}

// t x 2^k with t's sizes and strides (exact for k > 0 where finite), or undefined where a value is not
// finite.
at::Tensor scaled_copy(const at::Tensor& t, int k) {
  at::Tensor out = at::empty_strided(t.sizes(), t.strides(), t.options());
  const bool finite = AT_DISPATCH_FLOATING_TYPES(t.scalar_type(), "scaled_copy", [&] {
    return scale_values(t.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(), t.numel(), k);
  });
  return finite ? out : at::Tensor();
}

// t x 2^k in place (t dense); false if a result is not finite.
bool scale_in_place(at::Tensor& t, int k) {
  return AT_DISPATCH_FLOATING_TYPES(t.scalar_type(), "scale_in_place", [&] {
    return scale_values(t.const_data_ptr<scalar_t>(), t.mutable_data_ptr<scalar_t>(), t.numel(), k);
  });
}

// The compiled backend's result for a call computed on operands x 2^k (above), each result x 2^-k, or
// nullopt where that is not finite. input (for grad_weight) and weight (for grad_input) are copied where
// those copies are smaller than grad_output's, dense (a copy keeps the call's strides, so its signature,
// kernel and output layout) and finite (2^k x their largest magnitude within the dtype's range); else
// grad_output is (finite unless a value is not, which the sample missed, and then so are the results).
std::optional<Result> serve_rescaled(const Args& a, const Expanded& e, LayerClass cls, int k, Choice& choice) {
  const bool want_gi = a.output_mask[0], want_gw = a.output_mask[1];
  const bool operands_dense = (!want_gw || a.input.is_non_overlapping_and_dense()) &&
      (!want_gi || a.weight.is_non_overlapping_and_dense());
  const int64_t operands = (want_gw ? a.input.numel() : 0) + (want_gi ? a.weight.numel() : 0);
  bool scale_go = !operands_dense || operands >= a.grad_output.numel();
  const auto copy = [&](const at::Tensor& t, bool scale) { return scale ? scaled_copy(t, k) : t; };
  at::Tensor go = copy(a.grad_output, scale_go), x = copy(a.input, want_gw && !scale_go),
             w = copy(a.weight, want_gi && !scale_go);
  if (!scale_go && (!x.defined() || !w.defined())) {
    scale_go = true;
    go = copy(a.grad_output, true), x = a.input, w = a.weight;
  }
  if (!go.defined()) return std::nullopt;
  const Args s{go, x, w, a.bias_sizes, a.stride, a.padding, a.dilation, a.transposed, a.output_padding, a.groups,
               a.output_mask};
  auto [served, result] = choose_and_run(s, e, cls);
  choice = served;
  std::array<at::Tensor*, 3> parts{&std::get<0>(result), &std::get<1>(result), &std::get<2>(result)};
  for (int i = 0; i < 3; ++i) {
    at::Tensor& t = *parts[i];
    // grad_bias sums grad_output alone: scaled only with it
    if (!t.defined() || t.numel() == 0 || (i == 2 && !scale_go)) continue;
    // (kernels return dense results: one that is not is served as it is, its layout unchanged)
    if (!t.is_non_overlapping_and_dense() || !scale_in_place(t, -k)) return std::nullopt;
  }
  return result;
}

Result compiled_backward_canonical(const Args& a);

// The compiled backend's result for a call it serves (unsupported_reason() was nullopt): computed on
// canonical_call's views where the call has an odd size-1 stride, laid out as upstream lays out the call.
Result compiled_backward(const Args& a) {
  if (!restrides(a)) return compiled_backward_canonical(a);
  check_args(a);  // errors name the call as given (canonical_call runs select_conv_backend)
  const CanonicalCall c = canonical_call(a);
  Result result = compiled_backward_canonical(c.args(a));
  lay_out_as_native(a, c.layout, result);
  return result;
}

// compiled_backward of a call on canonical size-1 strides.
Result compiled_backward_canonical(const Args& a) {
  const Expanded e = check_args(a);
  const LayerClass cls = classify(a, e);
  counters().layer_class[static_cast<int>(cls)].fetch_add(1, std::memory_order_relaxed);
  last_call.tuned = false;
  last_call.times_us.clear();
  last_call.rejected.clear();
  auto& c = counters();
  Choice choice;
  Result result;
  const int k = rescale_exponent(a, cls);
  std::optional<Result> rescaled = k ? serve_rescaled(a, e, cls, k, choice) : std::nullopt;
  last_call.rescale_exponent = rescaled ? k : 0;
  if (rescaled) {
    result = std::move(*rescaled);
    c.rescaled.fetch_add(1, std::memory_order_relaxed);
  } else {
    std::tie(choice, result) = choose_and_run(a, e, cls);
  }
  (choice.split() ? c.split[static_cast<int>(choice.gi)][static_cast<int>(choice.gw)]
                  : c.kernel[static_cast<int>(choice.gi)])
      .fetch_add(1, std::memory_order_relaxed);
  last_call.kernel = choice_name(choice);
  return result;
}

// --- the registered kernel ---------------------------------------------------------------------

void record_fallback(const std::string& reason) {
  auto& c = counters();
  c.fallback.fetch_add(1, std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(c.reasons_mutex);
  ++c.fallback_reasons[reason];
}

std::string planned_kernel_name(const Args& a);

Result registered_kernel(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    at::OptionalSymIntArrayRef bias_sizes, c10::SymIntArrayRef stride, c10::SymIntArrayRef padding,
    c10::SymIntArrayRef dilation, bool transposed, c10::SymIntArrayRef output_padding, c10::SymInt groups,
    Mask output_mask) {
  std::optional<at::IntArrayRef> bias;
  if (bias_sizes.has_value()) bias = C10_AS_INTARRAYREF_SLOW(*bias_sizes);
  const Args a{grad_output, input, weight, bias, C10_AS_INTARRAYREF_SLOW(stride), C10_AS_INTARRAYREF_SLOW(padding),
               C10_AS_INTARRAYREF_SLOW(dilation), transposed, C10_AS_INTARRAYREF_SLOW(output_padding),
               groups.expect_int(), output_mask};
  if (auto reason = unsupported_reason(grad_output, input, weight)) {
    record_fallback(*reason);
    return call_original(a);
  }
  counters().served.fetch_add(1, std::memory_order_relaxed);
  // While a profiler records, the call is a range named as the Python path names it (that path, used
  // under trace() and install(), opens its own); otherwise this costs one check of a flag.
  std::string range_name;
  at::RecordFunction range(at::RecordScope::USER_SCOPE);
  if (range.isActive()) {
    range_name = "aten_override::convolution_backward[compiled/" + planned_kernel_name(a) + "]";
    range.before(std::string_view(range_name));
  }
  return compiled_backward(a);
}

std::mutex registration_mutex;
std::unique_ptr<torch::Library> registration;

void register_kernels() {
  std::lock_guard<std::mutex> lock(registration_mutex);
  if (registration) return;
  auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", std::nullopt, __FILE__, __LINE__);
  lib->impl("convolution_backward", torch::dispatch(c10::DispatchKey::CPU, TORCH_FN(registered_kernel)));
  lib->impl("convolution_backward", torch::dispatch(c10::DispatchKey::CUDA, TORCH_FN(registered_kernel)));
  registration = std::move(lib);
}

void deregister_kernels() {
  std::lock_guard<std::mutex> lock(registration_mutex);
  registration.reset();
}

bool kernels_registered() {
  std::lock_guard<std::mutex> lock(registration_mutex);
  return registration != nullptr;
}

// --- Python bindings ----------------------------------------------------------------------------

using IntList = std::vector<int64_t>;

// A Python-callable taking the aten arguments (lists as Python lists) and calling f(Args).
template <typename F>
auto with_aten_args(F f) {
  return [f](const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
             std::optional<IntList> bias_sizes, IntList stride, IntList padding, IntList dilation, bool transposed,
             IntList output_padding, int64_t groups, Mask output_mask) {
    const Args a{grad_output, input, weight,
                 bias_sizes.has_value() ? at::OptionalIntArrayRef(*bias_sizes) : std::nullopt,
                 stride, padding, dilation, transposed, output_padding, groups, output_mask};
    return f(a);
  };
}

// f(a) on the call as compiled_backward computes it: canonical_call's views where restrides(a), after
// checking the call as given (its errors name that call). The queries below (kernel, layer class,
// depthwise walk) answer for the call that runs: on the call as given, whose signature is never the
// one tuned, planned_kernel_name said "tuning" for every call with an odd size-1 stride, and so did its
// profiler range and the tracer.
template <typename F>
auto as_computed(const Args& a, F&& f) {
  check_args(a);
  return f(canonical_call(a).args(a));
}

// The kernel a call will run, without running or tuning it: the table's, the tuned one, or "tuning"
// when its signature is not tuned yet. (A direct kernel may still hand a call with non-finite
// values to native.)
std::string planned_kernel_name(const Args& a) {
  if (restrides(a)) return as_computed(a, planned_kernel_name);
  const Expanded e = check_args(a);
  const LayerClass cls = classify(a, e);
  const Kernel static_choice = static_kernel(cls, a, e);
  if (static_choice_only(cls, a, e)) return kernel_name(static_choice);
  const auto choice = tuned_choice(signature(a));
  return choice ? choice_name(usable_choice(*choice, static_choice, a, e)) : "tuning";
}

// Runs one named candidate kernel on a call (tests and benchmarks compare the candidates): raises
// ValueError when the kernel cannot compute the call (with why), returns None when it declines it
// (non-finite values).
std::optional<Result> run_named_kernel(const std::string& name, const Args& a) {
  const Expanded e = check_args(a);
  const LayerClass cls = classify(a, e);
  const auto choice = parse_choice(name);
  if (!choice) throw py::value_error("unknown kernel " + name);
  if (choice->split() && !(a.output_mask[0] && a.output_mask[1])) {
    throw py::value_error(name + " is a split: it needs a call asking for grad_input and grad_weight");
  }
  const Kernel table = static_kernel(cls, a, e);
  const Kernel reference = reference_kernel(a, e);
  for (Kernel k : {choice->gi, choice->gw}) {
    if (k == Kernel::Native && reference != Kernel::Native) {
      throw py::value_error(
          "native cannot compute this call: torch 2.13's oneDNN path native takes is known to crash or be wrong on "
          "it (the dead-taps conditions); '" + std::string(kernel_name(reference)) + "' stands in for it");
    }
    if (k == table || k == reference) continue;
    if (k == Kernel::Fold2d) {  // not tuned: run by name wherever it applies
      if (fold_2d_applies(a, e)) continue;
      throw py::value_error(
          "fold-2d cannot compute this call: it needs a 3-D CPU call that folds into a 2-D one (a 1x1 spatial kernel "
          "with no spatial padding, stride or output_padding; or kernel depth 1 with no depth padding or "
          "output_padding, and depth stride 1 if transposed), no dilation on a dim of more than one tap, and no "
          "dead tap, short padded dim, or depth without a full row");
    }
    if (!tunable(cls, a, e)) {
      throw py::value_error(c10::str("a call of class ", kLayerClasses[static_cast<int>(cls)].name, " is served by ",
                                     kernel_name(table), " only"));
    }
    if (auto why = candidate_unsupported(k, a, e)) throw py::value_error(kernel_name(k) + " cannot compute this call: " + *why);
  }
  return run_choice(*choice, a, e);
}

std::string layer_class_name(const Args& a) {
  if (restrides(a)) return as_computed(a, layer_class_name);
  return kLayerClasses[static_cast<int>(classify(a, check_args(a)))].name;
}

// Which CPU kernel of cpu/depthwise.cpp computes a call of the depthwise class; nullopt otherwise.
std::optional<std::string> depthwise_kernel_name(const Args& a) {
  if (restrides(a)) return as_computed(a, depthwise_kernel_name);
  const Expanded e = check_args(a);
  if (classify(a, e) != LayerClass::Depthwise || !a.grad_output.is_cpu()) return std::nullopt;
  return std::string(depthwise_table_walk(direct_problem(a, e), a.grad_output.scalar_type()) == DepthwiseWalk::Lanes
                         ? "channels-in-lanes"
                         : "per-plane");
}

py::dict py_stats() {
  auto& c = counters();
  py::dict out, classes, reasons;
  for (int i = 0; i < static_cast<int>(LayerClass::Count); ++i) {
    const int64_t n = c.layer_class[i].load();
    if (n) classes[kLayerClasses[i].name] = n;
  }
  {
    std::lock_guard<std::mutex> lock(c.reasons_mutex);
    for (const auto& [reason, n] : c.fallback_reasons) reasons[py::str(reason)] = n;
  }
  out["served"] = c.served.load();
  out["fallback"] = c.fallback.load();
  out["rescaled"] = c.rescaled.load();
  out["declined"] = c.declined.load();
  out["skipped"] = c.skipped.load();
  out["fallback_reasons"] = reasons;
  out["layer_classes"] = classes;
  py::dict kernels;
  for (int i = 0; i < static_cast<int>(Kernel::Count); ++i) {
    const int64_t n = c.kernel[i].load();
    if (n) kernels[kKernelNames[i]] = n;
    for (int j = 0; j < static_cast<int>(Kernel::Count); ++j) {
      const int64_t m = c.split[i][j].load();
      if (m) kernels[py::str(choice_name(Choice{static_cast<Kernel>(i), static_cast<Kernel>(j)}))] = m;
    }
  }
  out["kernels"] = kernels;
  out["tunings"] = autotuner().tunings.load();
  out["tune_us"] = autotuner().tune_us_total.load();
  out["evicted_bytes"] = autotuner().evicted_bytes.load();
  return out;
}

void py_reset_stats() {
  auto& c = counters();
  for (auto& n : c.layer_class) n.store(0);
  for (auto& n : c.kernel) n.store(0);
  for (auto& row : c.split) {
    for (auto& n : row) n.store(0);
  }
  autotuner().tunings.store(0);
  autotuner().tune_us_total.store(0);
  autotuner().evicted_bytes.store(0);
  c.served.store(0);
  c.fallback.store(0);
  c.rescaled.store(0);
  c.declined.store(0);
  c.skipped.store(0);
  std::lock_guard<std::mutex> lock(c.reasons_mutex);
  c.fallback_reasons.clear();
}

// --- autotune bindings: the results table as data (the Python side reads and writes the file) ---

std::string signature_string(const Signature& key) {
  std::string out;
  for (size_t i = 0; i < key.size(); ++i) {
    if (i) out += ',';
    out += std::to_string(key[i]);
  }
  return out;
}

// {name: value} of a list of (name, value) pairs.
template <typename T>
py::dict to_dict(const std::vector<std::pair<std::string, T>>& pairs) {
  py::dict out;
  for (const auto& [name, value] : pairs) out[py::str(name)] = value;
  return out;
}

py::list py_autotune_entries() {
  py::list out;
  auto& tuner = autotuner();
  std::shared_lock<std::shared_mutex> lock(tuner.table_mutex);
  for (const auto& [key, tuned] : tuner.table) {
    out.append(py::make_tuple(signature_string(key), choice_name(tuned.choice),
                              to_dict(tuned.times_us), to_dict(tuned.rejected), tuned.tune_us));
  }
  return out;
}

// Adds (signature, kernel name) entries, as autotune_entries() gives them; returns how many were taken
// (an unknown kernel name or a malformed signature is skipped). A signature the table already holds
// (tuned in this process, or read from a file before: re-entering enable(autotune=path) reads the file
// again) keeps the table's choice and counts as taken: it is no unusable entry.
int64_t py_autotune_load(const std::vector<std::pair<std::string, std::string>>& entries) {
  auto& tuner = autotuner();
  int64_t taken = 0;
  std::unique_lock<std::shared_mutex> lock(tuner.table_mutex);
  for (const auto& [text, name] : entries) {
    const auto choice = parse_choice(name);
    if (!choice) continue;
    Signature key;
    size_t pos = 0;
    bool ok = !text.empty();
    while (ok && pos <= text.size()) {
      const size_t comma = std::min(text.find(',', pos), text.size());
      try {
        size_t used = 0;
        key.push_back(std::stoll(text.substr(pos, comma - pos), &used));
        ok = used == comma - pos;
      } catch (const std::exception&) {
        ok = false;
      }
      pos = comma + 1;
    }
    if (!ok) continue;
    Tuned tuned;
    tuned.choice = *choice;
    tuner.table.emplace(std::move(key), std::move(tuned));
    ++taken;
  }
  return taken;
}

void py_autotune_clear() {
  auto& tuner = autotuner();
  std::lock_guard<std::recursive_mutex> tuning(tuner.tuning_mutex);  // the order choose_kernel takes them in
  tuner.inconclusive.clear();
  declining().clear();
  std::unique_lock<std::shared_mutex> lock(tuner.table_mutex);
  tuner.table.clear();
}

py::dict py_last_call() {
  py::dict out;
  out["kernel"] = last_call.kernel;
  out["tuned"] = last_call.tuned;
  out["rescale_exponent"] = last_call.rescale_exponent;
  out["times_us"] = to_dict(last_call.times_us);
  out["rejected"] = to_dict(last_call.rejected);
  return out;
}

py::list py_layer_classes() {
  py::list out;
  for (const auto& info : kLayerClasses) {
    out.append(py::make_tuple(info.name, info.kernel, info.why));
  }
  return out;
}

}  // namespace
}  // namespace aten_override

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace aten_override;
  m.doc() =
      "aten_override's compiled backend of aten::convolution_backward (CPU kernels; CUDA kernels for the depthwise "
      "class when built and enabled, see cuda_kernels())";
  cuda_kernels();  // reads ATEN_OVERRIDE_CUDA_KERNELS once, at import
  const char* args_doc =
      "(grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, "
      "output_mask)";
  m.def("convolution_backward", with_aten_args(compiled_backward),
        (std::string("The compiled backend's (grad_input, grad_weight, grad_bias) for the aten arguments ") + args_doc +
         "; None where output_mask is False. Raises RuntimeError 'convolution_backward[compiled]: ...'.").c_str(),
        py::call_guard<py::gil_scoped_release>());
  m.def("planned_kernel", with_aten_args(planned_kernel_name),
        "The kernel a call will run (the table's or the tuned one; 'tuning' before its signature is tuned), "
        "after checking its arguments; runs nothing.");
  m.def("run_kernel",
        [](const std::string& name, const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
           std::optional<IntList> bias_sizes, IntList stride, IntList padding, IntList dilation, bool transposed,
           IntList output_padding, int64_t groups, Mask output_mask) {
          return with_aten_args([&](const Args& a) { return run_named_kernel(name, a); })(
              grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups,
              output_mask);
        },
        "run_kernel(name, *aten_args): the result of candidate kernel `name` (kernel_names()) on a call, None when "
        "it declines the call (non-finite values); ValueError when it cannot compute the call.");
  m.def("cache_bytes", &cache_bytes,
        "cache_bytes(level): bytes of cpu0's level-`level` data or unified cache (/sys, else sysconf), 0 if unknown; "
        "what the kernels size their tiles and the autotuner its cache flush by.");
  m.def("layer_class", with_aten_args(layer_class_name), "The layer class (see layer_classes()) of a call, after checking its arguments.");
  m.def("depthwise_kernel", with_aten_args(depthwise_kernel_name),
        "'channels-in-lanes' or 'per-plane': the CPU kernel (cpu/depthwise.cpp) that computes a call of the depthwise "
        "class; None for other classes and devices.");
  m.def("unsupported_reason", &unsupported_reason,
        "unsupported_reason(grad_output, input, weight) -> why the call goes to the original kernel, or None.");
  m.def("cuda_kernels", &cuda_kernels_name,
        "The CUDA kernels (cuda/direct.cu, depthwise class): 'not built', 'built, disabled' (CUDA calls go to the "
        "original kernel) or 'enabled' (ATEN_OVERRIDE_CUDA_KERNELS=1 at import).");
  m.def("cuda_unsupported_reason", &cuda_unsupported_reason,
        "Why CUDA calls go to the original kernel in this process, or None when the compiled backend serves them.");
  m.def("layer_classes", &py_layer_classes, "[(class, kernel, why)]: which kernel serves each layer class.");
  m.def("register_kernels", &register_kernels,
        "Register the C++ kernel at aten::convolution_backward's CPU and CUDA keys (idempotent). Only "
        "aten_override._registration calls it.");
  m.def("deregister_kernels", &deregister_kernels, "Undo register_kernels(): the dispatcher is as before.");
  m.def("kernels_registered", &kernels_registered);
  m.def("stats", &py_stats,
        "{'served': n, 'fallback': n, 'fallback_reasons': {reason: n}, 'layer_classes': {class: n}, 'kernels': "
        "{kernel: n}, 'tunings': n, 'tune_us': t, 'evicted_bytes': b}; served and fallback count calls of the "
        "registered C++ kernel, layer_classes and kernels every call the backend computed, tunings / tune_us the "
        "signatures tuned and what that cost (microseconds), evicted_bytes the bytes tuning evicted from the caches "
        "before and after its timed runs (clflushopt).");
  m.def("reset_stats", &py_reset_stats);
  m.def(
      "workspace",
      []() {
        const workspace::Stats s = workspace::stats();
        py::dict out;
        out["kept_bytes"] = s.kept_bytes;
        out["limit_bytes"] = s.limit_bytes;
        out["hits"] = s.hits;
        out["misses"] = s.misses;
        return out;
      },
      "workspace() -> {'kept_bytes', 'limit_bytes', 'hits', 'misses'}: the kernels' temporaries of 1 MiB or more "
      "come from blocks kept between calls (cpu/workspace.h): the bytes kept now, the most that may be kept, and "
      "how many requests a kept block served (hits) or allocated anew (misses).");
  m.def("set_workspace_limit", &workspace::set_limit, py::arg("bytes"),
        "The most bytes of blocks kept between calls (default 256 MiB; 0 keeps none). Frees the kept blocks "
        "over it, largest first.");
  m.def("release_workspace", &workspace::release,
        "Free every kept block; returns their bytes. The registration calls it when our kernel leaves the "
        "dispatcher.");
  m.def("set_autotune", [](bool on) { autotuner().enabled.store(on); },
        "Whether the first call of each signature times the candidate kernels (else the layer-class table "
        "decides); torch.use_deterministic_algorithms(True) makes the table decide either way.");
  m.def("autotune", []() { return autotuner().enabled.load(); });
  m.def("set_test_candidate", [](const std::string& mode) {
        TORCH_CHECK(mode == "off" || mode == "slow" || mode == "wrong", "set_test_candidate: off, slow or wrong");
        test_candidate().store(mode == "slow" ? TestCandidate::Slow : mode == "wrong" ? TestCandidate::Wrong
                                                                                      : TestCandidate::Off);
      },
      "For the autotuner's tests: add a fake candidate 'test' to every tuning, 'slow' (native's result, taking "
      "twice as long) or 'wrong' (zeros, fast); 'off' removes it.");
  m.def("kernel_names", []() { return std::vector<std::string>(std::begin(kKernelNames), std::end(kKernelNames)); });
  m.def(
      "winograd_gemm",
      []() {
        const WinogradGemm g = winograd_gemm();
        py::dict out;
        out["engine"] = g.vectors ? "vectors" : "library";
        out["library_us"] = g.library_us;
        out["vectors_us"] = g.vectors_us;
        out["forced"] = g.forced;
        return out;
      },
      "winograd_gemm() -> {'engine': 'library' | 'vectors', 'library_us': float, 'vectors_us': float}: which code "
      "runs the winograd kernel's 16 GEMMs per chunk, measured once per process on a chunk-sized float32 problem "
      "(16 x (64 x 256) @ (256 x 256), one thread): the library's bmm (MKL) or our vector micro-kernels "
      "(fused::gemm_add), each one's fastest run in microseconds, and whether set_winograd_gemm forced the engine");
  m.def(
      "set_winograd_gemm",
      [](std::optional<std::string> engine) {
        if (!engine) return set_winograd_gemm(std::nullopt);
        if (*engine != "library" && *engine != "vectors") {
          throw py::value_error("set_winograd_gemm: engine must be 'library', 'vectors' or None, got '" + *engine + "'");
        }
        set_winograd_gemm(*engine == "vectors");
      },
      py::arg("engine"),
      "set_winograd_gemm(engine): force the winograd kernel's GEMM engine ('library' or 'vectors'; tests run both "
      "on any machine), or None for the measured one. Raises ValueError for another name");
  m.def(
      "streaming_stores",
      []() {
        const StreamingStores s = streaming_stores();
        py::dict out;
        out["streaming"] = s.streaming;
        out["direct_us"] = s.direct_us;
        out["streamed_us"] = s.streamed_us;
        out["forced"] = s.forced;
        return out;
      },
      "streaming_stores() -> {'streaming', 'direct_us', 'streamed_us', 'forced'}: whether the depthwise walks and "
      "grouped-lanes write a grad_input of at least 8 MiB through an L2 staging buffer with non-temporal stores "
      "(streaming) or with ordinary stores, measured once per process on one thread on the kernel itself (grad_input "
      "of a 16-channel 3x3 stride-2 depthwise layer at 112x112, twice the L3: 64-256 MiB), each way's fastest of "
      "three runs in microseconds (0 where the CPU has no streaming stores), and whether set_streaming_stores "
      "forced the choice");
  m.def(
      "set_streaming_stores",
      [](std::optional<bool> streaming) { set_streaming_stores(streaming); },
      py::arg("streaming"),
      "set_streaming_stores(streaming): force large grad_input writes streamed (True; where the CPU has streaming "
      "stores) or ordinary (False) so that tests run both ways on any machine, or None for the measured way");
  m.def(
      "vector_type", []() { return fused::wide_vectors() ? "wide" : "pair"; },
      "vector_type() -> 'wide' | 'pair': what the CPU kernels' vector code computes in: 64-byte vectors in AVX-512 "
      "registers ('wide', the default where the CPU has AVX-512) or pairs of 32-byte AVX2 vectors ('pair', "
      "elsewhere), each with its own register blocks (cpu/fused.h)");
  m.def(
      "set_vector_type",
      [](std::optional<std::string> type) {
        if (type && *type != "wide" && *type != "pair") {
          throw py::value_error("set_vector_type: type must be 'wide', 'pair' or None, got '" + *type + "'");
        }
        fused::set_wide_vectors(type ? std::optional<bool>(*type == "wide") : std::nullopt);
      },
      py::arg("type"),
      "set_vector_type(type): force the vector code's type ('wide' or 'pair'; both are built for every ISA level, so "
      "tests run both on any machine), or None for the CPU's. Raises ValueError for another name");
  m.def(
      "bf16_dot", []() { return bf16_dot(); },
      "bf16_dot() -> 'avx512_bf16' | 'emulated' | 'none': the bfloat16 dot products pointwise-bf16 runs: the CPU's "
      "AVX512_BF16 instruction (vdpbf16ps), the same sums in scalar code (forced by set_bf16_dot), or none (this "
      "CPU has no AVX512_BF16: the kernel declines)");
  m.def(
      "set_bf16_dot",
      [](std::optional<std::string> kind) {
        if (kind && *kind != "avx512_bf16" && *kind != "emulated") {
          throw py::value_error("set_bf16_dot: kind must be 'avx512_bf16', 'emulated' or None, got '" + *kind + "'");
        }
        set_bf16_dot(kind ? std::optional<bool>(*kind == "avx512_bf16") : std::nullopt);
      },
      py::arg("kind"),
      "set_bf16_dot(kind): force pointwise-bf16's dot products ('emulated' runs on any CPU, so tests run the kernel "
      "everywhere; 'avx512_bf16' raises RuntimeError on a CPU without it), or None for the CPU's. Raises ValueError "
      "for another name");
  m.def("autotune_entries", &py_autotune_entries,
        "[(signature, kernel, {candidate: fastest run us}, {candidate: why it could not win}, tuning us)] of the "
        "results table; times and tuning cost are empty / 0 for loaded entries.");
  m.def("autotune_load", &py_autotune_load,
        "Add [(signature, kernel)] entries to the results table; returns how many were taken.");
  m.def("autotune_clear", &py_autotune_clear,
        "Forget every tuned signature (and which signatures' last call a kernel declined).");
  m.def("last_call", &py_last_call,
        "What the last compiled call of this thread ran: {'kernel', 'tuned', 'times_us', 'rejected', "
        "'rescale_exponent'} (k > 0: computed on grad_output, or input and weight, x 2^k, its results x 2^-k).");
  m.def(
      "subnormal_cost",
      []() {
        const SubnormalCost c = subnormal_cost();
        py::dict out;
        out["normal_us"] = c.normal_us;
        out["subnormal_us"] = c.subnormal_us;
        out["rescale"] = c.rescale;
        out["forced"] = c.forced;
        return out;
      },
      "subnormal_cost() -> {'normal_us', 'subnormal_us', 'rescale', 'forced'}: a float32 128 x 128 at::mm's fastest "
      "run (microseconds, one thread, measured once per process) on operands whose products are subnormal and on "
      "normal ones, and whether serving rescales float32 / float64 calls whose grad_output lies below 2^-32 / "
      "2^-256 (computed on grad_output x 2^k, or on input and weight x 2^k, k putting grad_output's largest "
      "magnitude in [0.5, 1), the results x 2^-k: exact where nothing underflows, one rounding where natively "
      "every underflowing product rounds): where the subnormal run took over twice the normal one, or as "
      "set_subnormal_rescale forced it. Threads that flush subnormals (torch.set_flush_denormal(True)) never "
      "rescale");
  m.def(
      "set_subnormal_rescale",
      [](std::optional<bool> on) { forced_rescale.store(on ? (*on ? 1 : 0) : -1); },
      py::arg("on"),
      "set_subnormal_rescale(on): force serving to rescale underflowing calls (True: tests run it on any machine) "
      "or never to (False), or None for the measured choice (subnormal_cost())");
}
