// The vector code of fused.h that is shared by several kernels, compiled once for each ISA level.
#include "fused.h"

#include <atomic>

namespace aten_override {
namespace fused {
namespace {
// -1: the CPU's; 0: VecPair; 1: Vec (set_wide_vectors).
std::atomic<int> forced_wide{-1};
}  // namespace

bool wide_vectors() {
  const int forced = forced_wide.load(std::memory_order_relaxed);
  if (forced >= 0) return forced == 1;
#ifdef ATEN_OVERRIDE_AVX512
  return has_avx512();
#else
  return false;
#endif
}

void set_wide_vectors(std::optional<bool> wide) {
  forced_wide.store(wide ? int(*wide) : -1);
}

ATEN_OVERRIDE_CLONES void gemm(
    int64_t m, int64_t n, int64_t k, const float* a, int64_t a_row, int64_t a_col, const float* b, int64_t ldb,
    float* c, int64_t ldc, bool accumulate) {
  if (wide_vectors()) return gemm_add<Vec<float>>(m, n, k, a, a_row, a_col, b, ldb, c, ldc, accumulate);
  gemm_add<VecPair<float>>(m, n, k, a, a_row, a_col, b, ldb, c, ldc, accumulate);
}

ATEN_OVERRIDE_CLONES void gemm(
    int64_t m, int64_t n, int64_t k, const double* a, int64_t a_row, int64_t a_col, const double* b, int64_t ldb,
    double* c, int64_t ldc, bool accumulate) {
  if (wide_vectors()) return gemm_add<Vec<double>>(m, n, k, a, a_row, a_col, b, ldb, c, ldc, accumulate);
  gemm_add<VecPair<double>>(m, n, k, a, a_row, a_col, b, ldb, c, ldc, accumulate);
}

}  // namespace fused
}  // namespace aten_override
