// The vector code of fused.h that is shared by several kernels, compiled once for each ISA level.
#include "fused.h"

namespace aten_override {
namespace fused {

ATEN_OVERRIDE_CLONES void gemm(
    int64_t m, int64_t n, int64_t k, const float* a, int64_t a_row, int64_t a_col, const float* b, int64_t ldb,
    float* c, int64_t ldc, bool accumulate) {
  gemm_add(m, n, k, a, a_row, a_col, b, ldb, c, ldc, accumulate);
}

ATEN_OVERRIDE_CLONES void gemm(
    int64_t m, int64_t n, int64_t k, const double* a, int64_t a_row, int64_t a_col, const double* b, int64_t ldb,
    double* c, int64_t ldc, bool accumulate) {
  gemm_add(m, n, k, a, a_row, a_col, b, ldb, c, ldc, accumulate);
}

}  // namespace fused
}  // namespace aten_override
