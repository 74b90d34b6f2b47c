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

// C[m x n] (ldc) = A[m x k] (lda) * B^T where B is [n x k] (ldb), row-major: y = x W^T for an
// nn.Linear weight W [out x in].
inline void gemm_nt(int m, int n, int k, const float* a, int lda, const float* b, int ldb, float* c, int ldc,
                    float beta = 0.0f) {
  if (m == 1 && beta == 0.0f) {
    cblas_sgemv(CblasRowMajor, CblasNoTrans, n, k, 1.0f, b, ldb, a, 1, 0.0f, c, 1);
    return;
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0f, a, lda, b, ldb, beta, c, ldc);
}

// C[m x n] = A[m x k] * B[k x n], row-major.
inline void gemm_nn(int m, int n, int k, const float* a, int lda, const float* b, int ldb, float* c, int ldc,
                    float beta = 0.0f) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, k, 1.0f, a, lda, b, ldb, beta, c, ldc);
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
