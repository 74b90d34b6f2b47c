// Internal helpers of the model runtime: GEMM wrappers over OpenBLAS, RMSNorm, RoPE, SiLU and the
// guard that keeps OpenBLAS single-threaded inside OpenMP regions (the pthread OpenBLAS build
// would otherwise start its own threads from every OpenMP thread and oversubscribe the cores).
#pragma once

#include <cblas.h>
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <vector>

namespace kvq::ops {

// While alive, OpenBLAS runs single-threaded; for code that calls sgemm from OpenMP threads.
class BlasSingleThread {
 public:
  BlasSingleThread() : saved_(openblas_get_num_threads()) {
    if (saved_ != 1) openblas_set_num_threads(1);
  }
  ~BlasSingleThread() {
    if (saved_ != 1) openblas_set_num_threads(saved_);
  }
  BlasSingleThread(const BlasSingleThread&) = delete;
  BlasSingleThread& operator=(const BlasSingleThread&) = delete;

 private:
  int saved_;
};

// Debian's OpenBLAS (0.3.21, DYNAMIC_ARCH) does not know recent Xeons (e.g. family 6 model 207)
// and falls back to its SSE3 "Prescott" kernels, 3-4x slower than the AVX2/AVX-512 ones the CPU
// runs. Unless the user set OPENBLAS_CORETYPE, this re-selects the kernel set from the CPU's
// features (SkylakeX with AVX-512, Haswell with AVX2+FMA) through OpenBLAS's own dynamic-arch
// entry points. Called once, before the first BLAS call; returns the core name in use.
const char* select_blas_kernels();

// kvq keeps OpenBLAS itself single-threaded (select_blas_kernels sets it) and parallelizes
// large products with OpenMP over row (or column) blocks, so one thread pool serves the whole
// runtime and no BLAS threads spin against OpenMP ones. Inside an OpenMP region the product runs
// on the calling thread.
inline int gemm_threads(int m, int n, int k) {
  if (omp_in_parallel()) return 1;
  const double flops = 2.0 * m * n * k;
  if (flops < 4e6) return 1;
  return omp_get_max_threads();
}

// C[m x n] (ldc) = A[m x k] (lda) * B^T where B is [n x k] (ldb), row-major: y = x W^T for an
// nn.Linear weight W [out x in].
inline void gemm_nt(int m, int n, int k, const float* a, int lda, const float* b, int ldb, float* c, int ldc,
                    float beta = 0.0f) {
  const int nt = gemm_threads(m, n, k);
  if (m == 1 && beta == 0.0f) {
    if (nt <= 1) {
      cblas_sgemv(CblasRowMajor, CblasNoTrans, n, k, 1.0f, b, ldb, a, 1, 0.0f, c, 1);
      return;
    }
#pragma omp parallel num_threads(nt)
    {
      const int t = omp_get_thread_num(), T = omp_get_num_threads();
      const int c0 = static_cast<int>(static_cast<long>(n) * t / T), c1 = static_cast<int>(static_cast<long>(n) * (t + 1) / T);
      if (c1 > c0) cblas_sgemv(CblasRowMajor, CblasNoTrans, c1 - c0, k, 1.0f, b + static_cast<std::size_t>(c0) * ldb, ldb, a, 1, 0.0f, c + c0, 1);
    }
    return;
  }
  if (nt <= 1) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0f, a, lda, b, ldb, beta, c, ldc);
    return;
  }
#pragma omp parallel num_threads(nt)
  {
    const int t = omp_get_thread_num(), T = omp_get_num_threads();
    if (m >= 16 * T) {
      const int r0 = m * t / T, r1 = m * (t + 1) / T;
      if (r1 > r0)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, r1 - r0, n, k, 1.0f, a + static_cast<std::size_t>(r0) * lda, lda, b,
                    ldb, beta, c + static_cast<std::size_t>(r0) * ldc, ldc);
    } else {
      const int c0 = static_cast<int>(static_cast<long>(n) * t / T), c1 = static_cast<int>(static_cast<long>(n) * (t + 1) / T);
      if (c1 > c0)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, c1 - c0, k, 1.0f, a, lda, b + static_cast<std::size_t>(c0) * ldb, ldb,
                    beta, c + c0, ldc);
    }
  }
}

// C[m x n] = A[m x k] * B[k x n], row-major.
inline void gemm_nn(int m, int n, int k, const float* a, int lda, const float* b, int ldb, float* c, int ldc,
                    float beta = 0.0f) {
  const int nt = gemm_threads(m, n, k);
  if (nt <= 1) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, k, 1.0f, a, lda, b, ldb, beta, c, ldc);
    return;
  }
#pragma omp parallel num_threads(nt)
  {
    const int t = omp_get_thread_num(), T = omp_get_num_threads();
    if (m >= 16 * T) {
      const int r0 = m * t / T, r1 = m * (t + 1) / T;
      if (r1 > r0)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, r1 - r0, n, k, 1.0f, a + static_cast<std::size_t>(r0) * lda, lda, b,
                    ldb, beta, c + static_cast<std::size_t>(r0) * ldc, ldc);
    } else {
      const int c0 = static_cast<int>(static_cast<long>(n) * t / T), c1 = static_cast<int>(static_cast<long>(n) * (t + 1) / T);
      if (c1 > c0)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, c1 - c0, k, 1.0f, a, lda, b + c0, ldb, beta, c + c0, ldc);
    }
  }
}

// y = w * x / sqrt(mean(x^2) + eps), as transformers' RMSNorm in float32.
inline void rmsnorm(const float* x, const float* w, float eps, int d, float* y) {
  double ss = 0.0;
  for (int i = 0; i < d; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float inv = 1.0f / std::sqrt(static_cast<float>(ss / d) + eps);
  for (int i = 0; i < d; ++i) y[i] = w[i] * (x[i] * inv);
}

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }

// Rotates one head vector x[dim] in place at angle pos * inv_freq[i] for pair i; cos/sin are
// precomputed for the position ([dim/2] each, attention factor included).
inline void rope_apply(float* x, int dim, bool interleaved, const float* cs, const float* sn) {
  const int half = dim / 2;
  if (interleaved) {
    for (int i = 0; i < half; ++i) {
      const float a = x[2 * i], b = x[2 * i + 1];
      x[2 * i] = a * cs[i] - b * sn[i];
      x[2 * i + 1] = b * cs[i] + a * sn[i];
    }
  } else {
    for (int i = 0; i < half; ++i) {
      const float a = x[i], b = x[i + half];
      x[i] = a * cs[i] - b * sn[i];
      x[i + half] = b * cs[i] + a * sn[i];
    }
  }
}

}  // namespace kvq::ops
