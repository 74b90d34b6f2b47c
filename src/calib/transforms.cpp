// Cayley rotations, the straight-through quantizer, the two path objectives with hand-written
// gradients, and the fusion primitives (kvq/calibrate.hpp).
#include <cblas.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <vector>

#include "kvq/calibrate.hpp"
#include "kvq/common.hpp"
#include "kvq/rotation.hpp"

namespace kvq {

// ---- Cayley ---------------------------------------------------------------------------------

namespace {
// LU with partial pivoting of a [n][n] (row-major, in place); piv[i] = row swapped into i.
void lu_factor(std::vector<double>& a, int n, std::vector<int>& piv) {
  piv.resize(static_cast<std::size_t>(n));
  for (int k = 0; k < n; ++k) {
    int p = k;
    double best = std::fabs(a[static_cast<std::size_t>(k) * n + k]);
    for (int i = k + 1; i < n; ++i) {
      const double v = std::fabs(a[static_cast<std::size_t>(i) * n + k]);
      if (v > best) best = v, p = i;
    }
    if (!(best > 0)) fail("cayley: I - A is singular");
    piv[static_cast<std::size_t>(k)] = p;
    if (p != k)
      std::swap_ranges(a.begin() + static_cast<std::ptrdiff_t>(k) * n, a.begin() + static_cast<std::ptrdiff_t>(k + 1) * n,
                       a.begin() + static_cast<std::ptrdiff_t>(p) * n);
    const double* rk = a.data() + static_cast<std::size_t>(k) * n;
    const double inv = 1.0 / rk[k];
    for (int i = k + 1; i < n; ++i) {
      double* ri = a.data() + static_cast<std::size_t>(i) * n;
      const double f = (ri[k] *= inv);
      if (f != 0.0)
        for (int j = k + 1; j < n; ++j) ri[j] -= f * rk[j];
    }
  }
}
}  // namespace

std::vector<double> cayley(const std::vector<double>& a, int n, std::vector<double>* m) {
  require(n > 0 && a.size() == static_cast<std::size_t>(n) * n, "cayley: A must be n x n");
  const std::size_t nn = static_cast<std::size_t>(n) * n;
  std::vector<double> lu(nn), inv(nn, 0.0);
  for (std::size_t i = 0; i < nn; ++i) lu[i] = -a[i];
  for (int i = 0; i < n; ++i) lu[static_cast<std::size_t>(i) * n + i] += 1.0;
  std::vector<int> piv;
  lu_factor(lu, n, piv);
  // Solve (I - A) X = I: permute the identity, then unit-lower and upper triangular solves.
  for (int i = 0; i < n; ++i) inv[static_cast<std::size_t>(i) * n + i] = 1.0;
  for (int k = 0; k < n; ++k)
    if (piv[static_cast<std::size_t>(k)] != k)
      std::swap_ranges(inv.begin() + static_cast<std::ptrdiff_t>(k) * n, inv.begin() + static_cast<std::ptrdiff_t>(k + 1) * n,
                       inv.begin() + static_cast<std::ptrdiff_t>(piv[static_cast<std::size_t>(k)]) * n);
  cblas_dtrsm(CblasRowMajor, CblasLeft, CblasLower, CblasNoTrans, CblasUnit, n, n, 1.0, lu.data(), n, inv.data(), n);
  cblas_dtrsm(CblasRowMajor, CblasLeft, CblasUpper, CblasNoTrans, CblasNonUnit, n, n, 1.0, lu.data(), n, inv.data(), n);
  // R = M (I + A) = M + M A
  std::vector<double> r(inv);
  gemm<double>(false, false, n, n, n, 1.0, inv.data(), n, a.data(), n, 1.0, r.data(), n);
  if (m) *m = std::move(inv);
  return r;
}

std::vector<double> cayley_backward(const std::vector<double>& m, const std::vector<double>& r,
                                    const std::vector<double>& g, int n) {
  // dR = M dA (R + I)  =>  dL/dA = M^T g (R + I)^T
  const std::size_t nn = static_cast<std::size_t>(n) * n;
  std::vector<double> t(nn), rp(r), ga(nn);
  for (int i = 0; i < n; ++i) rp[static_cast<std::size_t>(i) * n + i] += 1.0;
  gemm<double>(true, false, n, n, n, 1.0, m.data(), n, g.data(), n, 0.0, t.data(), n);
  gemm<double>(false, true, n, n, n, 1.0, t.data(), n, rp.data(), n, 0.0, ga.data(), n);
  std::vector<double> out(nn);
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j)
      out[static_cast<std::size_t>(i) * n + j] = ga[static_cast<std::size_t>(i) * n + j] - ga[static_cast<std::size_t>(j) * n + i];
  return out;
}

double log_scale_value(double l) { return std::exp(std::clamp(l, -2.0, 2.0)); }
double log_scale_grad(double l) { return (l > -2.0 && l < 2.0) ? std::exp(l) : 0.0; }

// ---- AffineSte ------------------------------------------------------------------------------

template <class R>
void AffineSte<R>::forward(const R* x, R* y) const {
  const int d = q_.dim();
  std::vector<float> xf(static_cast<std::size_t>(d)), yf(static_cast<std::size_t>(d));
  for (int i = 0; i < d; ++i) xf[static_cast<std::size_t>(i)] = static_cast<float>(x[i]);
  std::vector<std::uint8_t> codes(q_.code_bytes()), meta(q_.meta_bytes());
  q_.encode(xf.data(), codes.data(), meta.data());
  q_.decode(codes.data(), meta.data(), yf.data());
  for (int i = 0; i < d; ++i) y[i] = static_cast<R>(yf[static_cast<std::size_t>(i)]);
}

template <class R>
void AffineSte<R>::backward(const R* x, const R* y, const R* dy, R* dx) const {
  const int gsz = q_.group(), m = (1 << q_.bits()) - 1;
  for (int g = 0; g < q_.groups(); ++g) {
    const int o = g * gsz;
    int imax = o, imin = o;
    float lo = static_cast<float>(x[o]), hi = lo;
    for (int i = o + 1; i < o + gsz; ++i) {
      const float v = static_cast<float>(x[i]);
      if (v > hi) hi = v, imax = i;
      if (v < lo) lo = v, imin = i;
    }
    const double s = affine_group_scale(lo, hi, q_.bits(), q_.scale_type());
    double ds = 0;  // dL/ds
    for (int i = o; i < o + gsz; ++i) {
      const double r = (static_cast<double>(y[i]) - static_cast<double>(static_cast<float>(x[i]))) / s;
      if (std::fabs(r) <= 0.5 + 1e-3) {
        dx[i] = dy[i];
        ds += static_cast<double>(dy[i]) * r;
      } else {  // clipped: y = s k
        dx[i] = 0;
        ds += static_cast<double>(dy[i]) * (static_cast<double>(y[i]) / s);
      }
    }
    if (hi > lo && s > FLT_MIN) {
      dx[imax] += static_cast<R>(ds / m);
      dx[imin] -= static_cast<R>(ds / m);
    }
  }
}

template class AffineSte<float>;
template class AffineSte<double>;

// ---- Objectives ---------------------------------------------------------------------------------

namespace {
constexpr double kEnergyFloor = 1e-8;

template <class R>
double normalized_error(const std::vector<R>& yh, const std::vector<R>& y, std::vector<R>* dy) {
  double err = 0, en = 0;
  for (std::size_t i = 0; i < y.size(); ++i) {
    const double e = static_cast<double>(yh[i]) - static_cast<double>(y[i]);
    err += e * e;
    en += static_cast<double>(y[i]) * y[i];
  }
  const double den = std::max(en / static_cast<double>(y.size()), kEnergyFloor) * static_cast<double>(y.size());
  if (dy) {
    dy->resize(y.size());
    for (std::size_t i = 0; i < y.size(); ++i)
      (*dy)[i] = static_cast<R>(2.0 * (static_cast<double>(yh[i]) - static_cast<double>(y[i])) / den);
  }
  return err / den;
}

template <class R>
MlaBlock<R> make_block(const MlaLayerWeights<R>& w, int T) {
  MlaDims d = w.dims;
  d.T = T;
  return MlaBlock<R>(d, w.w_uv.data(), w.w_o.data(), w.scale);
}

// Pair transform of rows x [T][stride] (dr dims at offset 0 of each row... given via pointer
// arithmetic by the caller): y = f Rot(theta) x per pair.
template <class R>
void pair_transform(const R* x, R* y, const RopePairs& pp, const R* angle, const R* scale, bool inverse) {
  for (int i = 0; i < pp.dr / 2; ++i) {
    const int a = pp.first(i), b = pp.second(i);
    const R c = std::cos(angle ? angle[i] : R(0)), s = std::sin(angle ? angle[i] : R(0));
    R f = scale ? scale[i] : R(1);
    if (inverse) f = R(1) / f;
    const R xa = x[a], xb = x[b];
    y[a] = f * (c * xa - s * xb);
    y[b] = f * (s * xa + c * xb);
  }
}

template <class R>
void hadamard_row(const R* x, R* y, int d) {
  std::vector<double> t(x, x + d);
  fwht(t.data(), d);  // normalized: x H / sqrt(d)
  for (int i = 0; i < d; ++i) y[i] = static_cast<R>(t[static_cast<std::size_t>(i)]);
}

// k~ [T][dr] and q~ [T][H][dr] of the RoPE transform.
template <class R>
void rope_transform(const MlaSample<R>& x, int H, const RopePairs& pp, const R* angle, const R* scale, bool hadamard,
                    std::vector<R>& kt, std::vector<R>& qt) {
  const int T = x.T, dr = pp.dr;
  kt.resize(static_cast<std::size_t>(T) * dr);
  qt.resize(static_cast<std::size_t>(T) * H * dr);
  for (int t = 0; t < T; ++t) {
    const R* k = x.p.data() + static_cast<std::size_t>(t) * dr;
    R* ko = kt.data() + static_cast<std::size_t>(t) * dr;
    if (hadamard) hadamard_row(k, ko, dr); else pair_transform(k, ko, pp, angle, scale, false);
    for (int h = 0; h < H; ++h) {
      const R* q = x.qr.data() + (static_cast<std::size_t>(t) * H + h) * dr;
      R* qo = qt.data() + (static_cast<std::size_t>(t) * H + h) * dr;
      if (hadamard) hadamard_row(q, qo, dr); else pair_transform(q, qo, pp, angle, scale, true);
    }
  }
}
}  // namespace

template <class R>
double content_objective(const MlaLayerWeights<R>& w, const MlaSample<R>& x, const R* rot, const R* s,
                         const RowOp<R>* op, R* drot, R* ds) {
  const int T = x.T, dc = w.dims.dc;
  const std::size_t TD = static_cast<std::size_t>(T) * dc;
  // Y = u R; z = Y diag(s); xh = op(z); X = xh diag(1/s); C = (X R^T) diag(gamma)
  std::vector<R> Y(TD), z(TD), xh(TD), X(TD), C(TD);
  gemm<R>(false, false, T, dc, dc, R(1), x.u.data(), dc, rot, dc, R(0), Y.data(), dc);
  for (std::size_t i = 0; i < TD; ++i) z[i] = Y[i] * s[i % static_cast<std::size_t>(dc)];
  for (int t = 0; t < T; ++t) {
    const std::size_t o = static_cast<std::size_t>(t) * dc;
    if (op) op->forward(z.data() + o, xh.data() + o); else std::copy(z.begin() + static_cast<std::ptrdiff_t>(o), z.begin() + static_cast<std::ptrdiff_t>(o + dc), xh.begin() + static_cast<std::ptrdiff_t>(o));
  }
  for (std::size_t i = 0; i < TD; ++i) X[i] = xh[i] / s[i % static_cast<std::size_t>(dc)];
  gemm<R>(false, true, T, dc, dc, R(1), X.data(), dc, rot, dc, R(0), C.data(), dc);
  for (std::size_t i = 0; i < TD; ++i) C[i] *= w.gamma[i % static_cast<std::size_t>(dc)];
  MlaBlock<R> blk = make_block(w, T);
  std::vector<R> yh(static_cast<std::size_t>(T) * w.dims.hidden);
  blk.forward(x.qa.data(), x.qr.data(), C.data(), x.p.data(), yh.data());
  if (!drot && !ds) return normalized_error<R>(yh, x.y, nullptr);
  std::vector<R> dy;
  const double loss = normalized_error(yh, x.y, &dy);
  std::vector<R> dC(TD), dP(static_cast<std::size_t>(T) * w.dims.dr);
  blk.backward(dy.data(), dC.data(), dP.data());
  // G = dC diag(gamma); dX = G R; dR += G^T X
  for (std::size_t i = 0; i < TD; ++i) dC[i] *= w.gamma[i % static_cast<std::size_t>(dc)];
  std::vector<R> dX(TD), dz(TD);
  gemm<R>(false, false, T, dc, dc, R(1), dC.data(), dc, rot, dc, R(0), dX.data(), dc);
  if (drot) gemm<R>(true, false, dc, dc, T, R(1), dC.data(), dc, X.data(), dc, R(1), drot, dc);
  // X = xh / s: dxh = dX / s; ds -= sum_t dX xh / s^2
  std::vector<R> dxh(TD);
  std::vector<double> dsl(static_cast<std::size_t>(dc), 0.0);
  for (std::size_t i = 0; i < TD; ++i) {
    const std::size_t j = i % static_cast<std::size_t>(dc);
    dxh[i] = dX[i] / s[j];
    dsl[j] -= static_cast<double>(dX[i]) * xh[i] / (static_cast<double>(s[j]) * s[j]);
  }
  for (int t = 0; t < T; ++t) {
    const std::size_t o = static_cast<std::size_t>(t) * dc;
    if (op) op->backward(z.data() + o, xh.data() + o, dxh.data() + o, dz.data() + o);
    else std::copy(dxh.begin() + static_cast<std::ptrdiff_t>(o), dxh.begin() + static_cast<std::ptrdiff_t>(o + dc), dz.begin() + static_cast<std::ptrdiff_t>(o));
  }
  // z = Y diag(s): ds += sum_t dz Y; dY = dz diag(s); dR += u^T dY
  for (std::size_t i = 0; i < TD; ++i) {
    const std::size_t j = i % static_cast<std::size_t>(dc);
    dsl[j] += static_cast<double>(dz[i]) * Y[i];
    dz[i] *= s[j];
  }
  if (drot) gemm<R>(true, false, dc, dc, T, R(1), x.u.data(), dc, dz.data(), dc, R(1), drot, dc);
  if (ds)
    for (int j = 0; j < dc; ++j) ds[j] += static_cast<R>(dsl[static_cast<std::size_t>(j)]);
  return loss;
}

template <class R>
double rope_objective(const MlaSample<R>& x, int H, const RopePairs& pp, const R* angle, const R* scale, bool hadamard,
                      const RowOp<R>* op, R* dangle, R* dscale) {
  const int T = x.T, dr = pp.dr;
  std::vector<R> kt, qt;
  rope_transform(x, H, pp, angle, scale, hadamard, kt, qt);
  std::vector<R> kh(kt.size());
  for (int t = 0; t < T; ++t) {
    const std::size_t o = static_cast<std::size_t>(t) * dr;
    if (op) op->forward(kt.data() + o, kh.data() + o); else std::copy(kt.begin() + static_cast<std::ptrdiff_t>(o), kt.begin() + static_cast<std::ptrdiff_t>(o + dr), kh.begin() + static_cast<std::ptrdiff_t>(o));
  }
  // Z0 = q k^T (teacher), Zh = q~ kh^T, per head, causal.
  const std::size_t TT = static_cast<std::size_t>(T) * T;
  std::vector<R> Z0(TT), Zh(TT);
  std::vector<R> dZ(static_cast<std::size_t>(H) * TT);
  double err = 0, en = 0;
  for (int h = 0; h < H; ++h) {
    gemm<R>(false, true, T, T, dr, R(1), x.qr.data() + static_cast<std::size_t>(h) * dr, H * dr, x.p.data(), dr, R(0), Z0.data(), T);
    gemm<R>(false, true, T, T, dr, R(1), qt.data() + static_cast<std::size_t>(h) * dr, H * dr, kh.data(), dr, R(0), Zh.data(), T);
    R* d = dZ.data() + static_cast<std::size_t>(h) * TT;
    for (int t = 0; t < T; ++t)
      for (int s = 0; s < T; ++s) {
        const std::size_t i = static_cast<std::size_t>(t) * T + s;
        if (s <= t) {
          const double e = static_cast<double>(Zh[i]) - Z0[i];
          err += e * e;
          en += static_cast<double>(Z0[i]) * Z0[i];
          d[i] = static_cast<R>(e);
        } else {
          d[i] = 0;
        }
      }
  }
  const double den = std::max(en, kEnergyFloor);
  const double loss = err / den;
  if (hadamard || (!dangle && !dscale)) return loss;
  for (auto& v : dZ) v = static_cast<R>(2.0 * v / den);
  // dq~_h = dZ_h kh; dkh = sum_h dZ_h^T q~_h
  std::vector<R> dq(qt.size()), dkh(kh.size(), R(0)), dkt(kt.size());
  for (int h = 0; h < H; ++h) {
    const R* d = dZ.data() + static_cast<std::size_t>(h) * TT;
    gemm<R>(false, false, T, dr, T, R(1), d, T, kh.data(), dr, R(0), dq.data() + static_cast<std::size_t>(h) * dr, H * dr);
    gemm<R>(true, false, T, dr, T, R(1), d, T, qt.data() + static_cast<std::size_t>(h) * dr, H * dr, R(1), dkh.data(), dr);
  }
  for (int t = 0; t < T; ++t) {
    const std::size_t o = static_cast<std::size_t>(t) * dr;
    if (op) op->backward(kt.data() + o, kh.data() + o, dkh.data() + o, dkt.data() + o);
    else std::copy(dkh.begin() + static_cast<std::ptrdiff_t>(o), dkh.begin() + static_cast<std::ptrdiff_t>(o + dr), dkt.begin() + static_cast<std::ptrdiff_t>(o));
  }
  // y = f Rot(theta) x: dtheta = dy . (-y_b, y_a); df = dy . y / f; key f = sigma, query f = 1/sigma.
  auto accum = [&](const R* y, const R* dyv, bool inverse) {
    for (int i = 0; i < dr / 2; ++i) {
      const int a = pp.first(i), b = pp.second(i);
      const double ya = y[a], yb = y[b], ga = dyv[a], gb = dyv[b];
      if (dangle) dangle[i] += static_cast<R>(-ga * yb + gb * ya);
      if (dscale) {
        const double sig = scale ? static_cast<double>(scale[i]) : 1.0;
        const double dot = ga * ya + gb * yb;  // = df * f
        // key: f = sigma -> dsigma = dot / sigma; query: f = 1/sigma -> dsigma = -dot / sigma
        dscale[i] += static_cast<R>((inverse ? -dot : dot) / sig);
      }
    }
  };
  for (int t = 0; t < T; ++t) {
    accum(kt.data() + static_cast<std::size_t>(t) * dr, dkt.data() + static_cast<std::size_t>(t) * dr, false);
    for (int h = 0; h < H; ++h) {
      const std::size_t o = (static_cast<std::size_t>(t) * H + h) * dr;
      accum(qt.data() + o, dq.data() + o, true);
    }
  }
  return loss;
}

template <class R>
double rope_output_objective(const MlaLayerWeights<R>& w, const MlaSample<R>& x, const RopePairs& pp,
                             const R* angle, const R* scale, bool hadamard, const RowOp<R>* op) {
  const int T = x.T, dr = pp.dr, dc = w.dims.dc;
  std::vector<R> kt, qt;
  rope_transform(x, w.dims.H, pp, angle, scale, hadamard, kt, qt);
  std::vector<R> kh(kt.size()), C(static_cast<std::size_t>(T) * dc);
  for (int t = 0; t < T; ++t) {
    const std::size_t o = static_cast<std::size_t>(t) * dr;
    if (op) op->forward(kt.data() + o, kh.data() + o); else std::copy(kt.begin() + static_cast<std::ptrdiff_t>(o), kt.begin() + static_cast<std::ptrdiff_t>(o + dr), kh.begin() + static_cast<std::ptrdiff_t>(o));
  }
  for (std::size_t i = 0; i < C.size(); ++i) C[i] = x.u[i] * w.gamma[i % static_cast<std::size_t>(dc)];
  MlaBlock<R> blk = make_block(w, T);
  std::vector<R> yh(static_cast<std::size_t>(T) * w.dims.hidden);
  blk.forward(x.qa.data(), qt.data(), C.data(), kh.data(), yh.data());
  return normalized_error<R>(yh, x.y, nullptr);
}

#define KVQ_CALIB_INSTANTIATE(R)                                                                                     \
  template double content_objective<R>(const MlaLayerWeights<R>&, const MlaSample<R>&, const R*, const R*,         \
                                       const RowOp<R>*, R*, R*);                                                    \
  template double rope_objective<R>(const MlaSample<R>&, int, const RopePairs&, const R*, const R*, bool,           \
                                    const RowOp<R>*, R*, R*);                                                       \
  template double rope_output_objective<R>(const MlaLayerWeights<R>&, const MlaSample<R>&, const RopePairs&,        \
                                           const R*, const R*, bool, const RowOp<R>*);
KVQ_CALIB_INSTANTIATE(float)
KVQ_CALIB_INSTANTIATE(double)
#undef KVQ_CALIB_INSTANTIATE

// ---- Fusion primitives ------------------------------------------------------------------------

void fuse_content_producer(float* w, int dc, int in, const double* rot) {
  // w' = R^T w, computed in double
  std::vector<double> src(w, w + static_cast<std::size_t>(dc) * in), dst(src.size());
  gemm<double>(true, false, dc, in, dc, 1.0, rot, dc, src.data(), in, 0.0, dst.data(), in);
  for (std::size_t i = 0; i < dst.size(); ++i) w[i] = static_cast<float>(dst[i]);
}

void fuse_content_consumer(float* w, int rows, int dc, const float* gamma, const double* rot, const double* s) {
  std::vector<double> src(static_cast<std::size_t>(rows) * dc), dst(src.size());
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < dc; ++j)
      src[static_cast<std::size_t>(r) * dc + j] = static_cast<double>(w[static_cast<std::size_t>(r) * dc + j]) * gamma[j];
  gemm<double>(false, false, rows, dc, dc, 1.0, src.data(), dc, rot, dc, 0.0, dst.data(), dc);
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < dc; ++j)
      w[static_cast<std::size_t>(r) * dc + j] = static_cast<float>(dst[static_cast<std::size_t>(r) * dc + j] / s[j]);
}

void fuse_rope_rows(float* w, int dr, int in, const RopePairs& pp, const double* angle, const double* scale,
                    bool inverse_scale) {
  for (int i = 0; i < dr / 2; ++i) {
    const int a = pp.first(i), b = pp.second(i);
    const double c = std::cos(angle ? angle[i] : 0.0), s = std::sin(angle ? angle[i] : 0.0);
    double f = scale ? scale[i] : 1.0;
    if (inverse_scale) f = 1.0 / f;
    float* ra = w + static_cast<std::size_t>(a) * in;
    float* rb = w + static_cast<std::size_t>(b) * in;
    for (int k = 0; k < in; ++k) {
      const double xa = ra[k], xb = rb[k];
      ra[k] = static_cast<float>(f * (c * xa - s * xb));
      rb[k] = static_cast<float>(f * (s * xa + c * xb));
    }
  }
}

}  // namespace kvq
