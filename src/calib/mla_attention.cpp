// MLA attention block in the absorbed form with VJP and JVP (see kvq/mla_attention.hpp).
#include "kvq/mla_attention.hpp"

#include <cblas.h>

#include <algorithm>
#include <cmath>

#include "kvq/common.hpp"

namespace kvq {

template <>
void gemm<float>(bool ta, bool tb, int m, int n, int k, float alpha, const float* a, int lda, const float* b, int ldb,
                 float beta, float* c, int ldc) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, m, n, k, alpha, a, lda, b,
              ldb, beta, c, ldc);
}
template <>
void gemm<double>(bool ta, bool tb, int m, int n, int k, double alpha, const double* a, int lda, const double* b,
                  int ldb, double beta, double* c, int ldc) {
  cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, m, n, k, alpha, a, lda, b,
              ldb, beta, c, ldc);
}

template <class R>
MlaBlock<R>::MlaBlock(const MlaDims& d, const R* w_uv, const R* w_o, R scale)
    : d_(d), w_uv_(w_uv), w_o_(w_o), scale_(scale) {
  require(d.T > 0 && d.H > 0 && d.dc > 0 && d.dr > 0 && d.vd > 0 && d.hidden > 0, "MlaBlock: empty dimension");
}

template <class R>
void MlaBlock<R>::forward(const R* qa, const R* qr, const R* C, const R* P, R* y) {
  const int T = d_.T, H = d_.H, dc = d_.dc, dr = d_.dr, vd = d_.vd;
  qa_ = qa, qr_ = qr, C_ = C, P_ = P;
  prob_.assign(static_cast<std::size_t>(H) * T * T, R(0));
  std::vector<R> o(static_cast<std::size_t>(T) * dc), v(static_cast<std::size_t>(T) * H * vd);
  for (int h = 0; h < H; ++h) {
    R* S = prob_.data() + static_cast<std::size_t>(h) * T * T;
    gemm<R>(false, true, T, T, dc, scale_, qa + static_cast<std::size_t>(h) * dc, H * dc, C, dc, R(0), S, T);
    gemm<R>(false, true, T, T, dr, scale_, qr + static_cast<std::size_t>(h) * dr, H * dr, P, dr, R(1), S, T);
    for (int t = 0; t < T; ++t) {
      R* r = S + static_cast<std::size_t>(t) * T;
      R mx = r[0];
      for (int s = 1; s <= t; ++s) mx = std::max(mx, r[s]);
      R sum = 0;
      for (int s = 0; s <= t; ++s) sum += (r[s] = std::exp(r[s] - mx));
      const R inv = R(1) / sum;
      for (int s = 0; s <= t; ++s) r[s] *= inv;
      for (int s = t + 1; s < T; ++s) r[s] = 0;
    }
    gemm<R>(false, false, T, dc, T, R(1), S, T, C, dc, R(0), o.data(), dc);
    gemm<R>(false, true, T, vd, dc, R(1), o.data(), dc, w_uv_ + static_cast<std::size_t>(h) * vd * dc, dc, R(0),
            v.data() + static_cast<std::size_t>(h) * vd, H * vd);
  }
  gemm<R>(false, true, T, d_.hidden, H * vd, R(1), v.data(), H * vd, w_o_, H * vd, R(0), y, d_.hidden);
}

template <class R>
void MlaBlock<R>::backward(const R* dy, R* dC, R* dP, R* dqa, R* dqr) {
  require(qa_ != nullptr, "MlaBlock::backward before forward");
  const int T = d_.T, H = d_.H, dc = d_.dc, dr = d_.dr, vd = d_.vd;
  std::vector<R> dv(static_cast<std::size_t>(T) * H * vd), dO(static_cast<std::size_t>(T) * dc),
      dS(static_cast<std::size_t>(T) * T);
  gemm<R>(false, false, T, H * vd, d_.hidden, R(1), dy, d_.hidden, w_o_, H * vd, R(0), dv.data(), H * vd);
  std::fill(dC, dC + static_cast<std::size_t>(T) * dc, R(0));
  std::fill(dP, dP + static_cast<std::size_t>(T) * dr, R(0));
  for (int h = 0; h < H; ++h) {
    const R* A = prob_.data() + static_cast<std::size_t>(h) * T * T;
    gemm<R>(false, false, T, dc, vd, R(1), dv.data() + static_cast<std::size_t>(h) * vd, H * vd,
            w_uv_ + static_cast<std::size_t>(h) * vd * dc, dc, R(0), dO.data(), dc);
    // dC += A^T dO (values route); dA = dO C^T
    gemm<R>(true, false, T, dc, T, R(1), A, T, dO.data(), dc, R(1), dC, dc);
    gemm<R>(false, true, T, T, dc, R(1), dO.data(), dc, C_, dc, R(0), dS.data(), T);
    for (int t = 0; t < T; ++t) {
      const R* a = A + static_cast<std::size_t>(t) * T;
      R* g = dS.data() + static_cast<std::size_t>(t) * T;
      R dot = 0;
      for (int s = 0; s <= t; ++s) dot += a[s] * g[s];
      for (int s = 0; s <= t; ++s) g[s] = a[s] * (g[s] - dot) * scale_;
      for (int s = t + 1; s < T; ++s) g[s] = 0;
    }
    // scores route: dC += dS^T qa_h, dP += dS^T qr_h
    gemm<R>(true, false, T, dc, T, R(1), dS.data(), T, qa_ + static_cast<std::size_t>(h) * dc, H * dc, R(1), dC, dc);
    gemm<R>(true, false, T, dr, T, R(1), dS.data(), T, qr_ + static_cast<std::size_t>(h) * dr, H * dr, R(1), dP, dr);
    if (dqa) gemm<R>(false, false, T, dc, T, R(1), dS.data(), T, C_, dc, R(0), dqa + static_cast<std::size_t>(h) * dc, H * dc);
    if (dqr) gemm<R>(false, false, T, dr, T, R(1), dS.data(), T, P_, dr, R(0), dqr + static_cast<std::size_t>(h) * dr, H * dr);
  }
}

template <class R>
void MlaBlock<R>::jvp(const R* dC, const R* dP, R* dy) {
  require(qa_ != nullptr, "MlaBlock::jvp before forward");
  const int T = d_.T, H = d_.H, dc = d_.dc, dr = d_.dr, vd = d_.vd;
  std::vector<R> dS(static_cast<std::size_t>(T) * T), dO(static_cast<std::size_t>(T) * dc),
      dv(static_cast<std::size_t>(T) * H * vd);
  for (int h = 0; h < H; ++h) {
    const R* A = prob_.data() + static_cast<std::size_t>(h) * T * T;
    std::fill(dS.begin(), dS.end(), R(0));
    if (dC) gemm<R>(false, true, T, T, dc, scale_, qa_ + static_cast<std::size_t>(h) * dc, H * dc, dC, dc, R(0), dS.data(), T);
    if (dP) gemm<R>(false, true, T, T, dr, scale_, qr_ + static_cast<std::size_t>(h) * dr, H * dr, dP, dr, R(1), dS.data(), T);
    for (int t = 0; t < T; ++t) {
      const R* a = A + static_cast<std::size_t>(t) * T;
      R* g = dS.data() + static_cast<std::size_t>(t) * T;
      R dot = 0;
      for (int s = 0; s <= t; ++s) dot += a[s] * g[s];
      for (int s = 0; s <= t; ++s) g[s] = a[s] * (g[s] - dot);
      for (int s = t + 1; s < T; ++s) g[s] = 0;
    }
    // dO = dA C + A dC
    gemm<R>(false, false, T, dc, T, R(1), dS.data(), T, C_, dc, R(0), dO.data(), dc);
    if (dC) gemm<R>(false, false, T, dc, T, R(1), A, T, dC, dc, R(1), dO.data(), dc);
    gemm<R>(false, true, T, vd, dc, R(1), dO.data(), dc, w_uv_ + static_cast<std::size_t>(h) * vd * dc, dc, R(0),
            dv.data() + static_cast<std::size_t>(h) * vd, H * vd);
  }
  gemm<R>(false, true, T, d_.hidden, H * vd, R(1), dv.data(), H * vd, w_o_, H * vd, R(0), dy, d_.hidden);
}

template class MlaBlock<float>;
template class MlaBlock<double>;

}  // namespace kvq
