// Calibration: MLA block derivatives, Cayley, the straight-through quantizer, the path
// objectives' gradients (finite differences), fusion equivalence (and that wrong fusion is
// caught), the online RoPE Hadamard, the driver end to end, and bad input.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "kvq/calibrate.hpp"
#include "kvq/dense_cache.hpp"
#include "kvq/eval.hpp"
#include "kvq/formats.hpp"
#include "kvq/mla_attention.hpp"
#include "kvq/model.hpp"
#include "kvq/rng.hpp"
#include "kvq/safetensors.hpp"

namespace fs = std::filesystem;
using namespace kvq;

namespace {

std::string src(const std::string& rel) { return std::string(KVQ_SOURCE_DIR) + "/" + rel; }

std::vector<double> randn(std::size_t n, std::uint64_t seed, double sd = 1.0) {
  SplitMix64 r(seed);
  std::vector<double> v(n);
  for (auto& x : v) x = r.normal() * sd;
  return v;
}

// A = W - W^T with W's entries N(0, sd^2): a random skew-symmetric matrix [n][n].
std::vector<double> random_skew(int n, std::uint64_t seed, double sd) {
  const auto w = randn(static_cast<std::size_t>(n) * n, seed, sd);
  std::vector<double> a(w.size());
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j) a[static_cast<std::size_t>(i) * n + j] = w[static_cast<std::size_t>(i) * n + j] - w[static_cast<std::size_t>(j) * n + i];
  return a;
}

double rel_err(double a, double b) { return std::fabs(a - b) / std::max({std::fabs(a), std::fabs(b), 1e-12}); }

fs::path temp_dir(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / ("kvq-test-calib-" + name + "-" + std::to_string(::getpid()));
  fs::remove_all(p);
  return p;
}

// Small random MLA layer and sample in double.
struct Small {
  MlaLayerWeights<double> w;
  MlaSample<double> x;
};
Small make_small(int T, std::uint64_t seed, bool with_y = true) {
  Small s;
  const int H = 2, dc = 8, dr = 4, vd = 3, hid = 5;
  s.w.dims = MlaDims{T, H, dc, dr, vd, hid};
  s.w.scale = 0.4;
  s.w.gamma = randn(dc, seed + 1, 0.5);
  for (auto& g : s.w.gamma) g += (g >= 0 ? 0.5 : -0.5);
  s.w.w_uv = randn(static_cast<std::size_t>(H) * vd * dc, seed + 2, 0.5);
  s.w.w_o = randn(static_cast<std::size_t>(hid) * H * vd, seed + 3, 0.5);
  s.x.T = T;
  s.x.u = randn(static_cast<std::size_t>(T) * dc, seed + 4);
  s.x.qa = randn(static_cast<std::size_t>(T) * H * dc, seed + 5, 0.6);
  s.x.qr = randn(static_cast<std::size_t>(T) * H * dr, seed + 6, 0.6);
  s.x.p = randn(static_cast<std::size_t>(T) * dr, seed + 7);
  if (with_y) {
    std::vector<double> C(s.x.u.size());
    for (std::size_t i = 0; i < C.size(); ++i) C[i] = s.x.u[i] * s.w.gamma[i % dc];
    MlaBlock<double> b(s.w.dims, s.w.w_uv.data(), s.w.w_o.data(), s.w.scale);
    s.x.y.resize(static_cast<std::size_t>(T) * hid);
    b.forward(s.x.qa.data(), s.x.qr.data(), C.data(), s.x.p.data(), s.x.y.data());
    // A perturbed teacher so that the loss and its gradient are not zero at the identity.
    const auto n = randn(s.x.y.size(), seed + 8, 0.05);
    for (std::size_t i = 0; i < s.x.y.size(); ++i) s.x.y[i] += n[i];
  }
  return s;
}

// A smooth, coupled stand-in for the quantizer: y_i = x_i + 0.1 sin(3 x_i) + 0.05 mean(x).
struct SmoothOp final : RowOp<double> {
  int d;
  explicit SmoothOp(int d_) : d(d_) {}
  void forward(const double* x, double* y) const override {
    double m = 0;
    for (int i = 0; i < d; ++i) m += x[i];
    m /= d;
    for (int i = 0; i < d; ++i) y[i] = x[i] + 0.1 * std::sin(3 * x[i]) + 0.05 * m;
  }
  void backward(const double* x, const double*, const double* dy, double* dx) const override {
    double s = 0;
    for (int i = 0; i < d; ++i) s += dy[i];
    for (int i = 0; i < d; ++i) dx[i] = dy[i] * (1 + 0.3 * std::cos(3 * x[i])) + 0.05 * s / d;
  }
};

}  // namespace

// ---- MLA block ----------------------------------------------------------------------------------

TEST(MlaBlock, VjpAndJvpMatchFiniteDifferences) {
  Small s = make_small(7, 11);
  const auto& d = s.w.dims;
  std::vector<double> C(s.x.u), P(s.x.p);
  MlaBlock<double> b(d, s.w.w_uv.data(), s.w.w_o.data(), s.w.scale);
  const std::size_t ny = static_cast<std::size_t>(d.T) * d.hidden;
  const auto gy = randn(ny, 99);
  std::vector<double> y(ny), dC(C.size()), dP(P.size());
  b.forward(s.x.qa.data(), s.x.qr.data(), C.data(), P.data(), y.data());
  b.backward(gy.data(), dC.data(), dP.data());
  auto f = [&](const std::vector<double>& Cv, const std::vector<double>& Pv) {
    MlaBlock<double> bb(d, s.w.w_uv.data(), s.w.w_o.data(), s.w.scale);
    std::vector<double> yy(ny);
    bb.forward(s.x.qa.data(), s.x.qr.data(), Cv.data(), Pv.data(), yy.data());
    double v = 0;
    for (std::size_t i = 0; i < ny; ++i) v += gy[i] * yy[i];
    return v;
  };
  const double h = 1e-6;
  for (std::size_t i = 0; i < C.size(); i += 3) {
    auto Cp = C, Cm = C;
    Cp[i] += h, Cm[i] -= h;
    const double fd = (f(Cp, P) - f(Cm, P)) / (2 * h);
    EXPECT_NEAR(dC[i], fd, 1e-6 * std::max(1.0, std::fabs(fd))) << "dC " << i;
  }
  for (std::size_t i = 0; i < P.size(); ++i) {
    auto Pp = P, Pm = P;
    Pp[i] += h, Pm[i] -= h;
    const double fd = (f(C, Pp) - f(C, Pm)) / (2 * h);
    EXPECT_NEAR(dP[i], fd, 1e-6 * std::max(1.0, std::fabs(fd))) << "dP " << i;
  }
  // JVP: <gy, J v> = <J^T gy, v> and J v matches a finite difference of y.
  const auto vC = randn(C.size(), 5), vP = randn(P.size(), 6);
  std::vector<double> jv(ny);
  b.jvp(vC.data(), vP.data(), jv.data());
  double lhs = 0, rhs = 0;
  for (std::size_t i = 0; i < ny; ++i) lhs += gy[i] * jv[i];
  for (std::size_t i = 0; i < C.size(); ++i) rhs += dC[i] * vC[i];
  for (std::size_t i = 0; i < P.size(); ++i) rhs += dP[i] * vP[i];
  EXPECT_LT(rel_err(lhs, rhs), 1e-10);
  auto Cp = C, Cm = C, Pp = P, Pm = P;
  for (std::size_t i = 0; i < C.size(); ++i) Cp[i] += h * vC[i], Cm[i] -= h * vC[i];
  for (std::size_t i = 0; i < P.size(); ++i) Pp[i] += h * vP[i], Pm[i] -= h * vP[i];
  std::vector<double> yp(ny), ym(ny);
  MlaBlock<double> b1(d, s.w.w_uv.data(), s.w.w_o.data(), s.w.scale), b2(d, s.w.w_uv.data(), s.w.w_o.data(), s.w.scale);
  b1.forward(s.x.qa.data(), s.x.qr.data(), Cp.data(), Pp.data(), yp.data());
  b2.forward(s.x.qa.data(), s.x.qr.data(), Cm.data(), Pm.data(), ym.data());
  for (std::size_t i = 0; i < ny; ++i) EXPECT_NEAR(jv[i], (yp[i] - ym[i]) / (2 * h), 1e-6 * std::max(1.0, std::fabs(jv[i])));
}

TEST(MlaBlock, ReproducesTheRuntimeAttentionOutput) {
  const std::string dir = src("models/tiny-mla");
  auto model = Model::load(dir);
  const auto& cfg = model->config();
  const int T = 40, H = cfg.n_heads, dc = cfg.kv_lora_rank, dr = cfg.qk_rope_head_dim, vd = cfg.v_head_dim,
            nope = cfg.qk_nope_head_dim, hid = cfg.hidden_size;
  SafetensorsFile f1(dir + "/model-00001-of-00002.safetensors"), f2(dir + "/model-00002-of-00002.safetensors");
  auto get = [&](const std::string& n) { return (f1.has(n) ? f1 : f2).get(n).to_float(); };
  std::vector<std::int32_t> tokens(T);
  for (int i = 0; i < T; ++i) tokens[static_cast<std::size_t>(i)] = (i * 37 + 5) % cfg.vocab_size;
  int checked = 0;
  model->set_observer([&](const LayerTrace& tr) {
    const std::string p = "model.layers." + std::to_string(tr.layer) + ".self_attn.";
    const auto kvb = get(p + "kv_b_proj.weight");
    const auto wo = get(p + "o_proj.weight");
    std::vector<float> wuv(static_cast<std::size_t>(H) * vd * dc);
    for (int h = 0; h < H; ++h)
      std::copy(kvb.begin() + (static_cast<long>(h) * (nope + vd) + nope) * dc, kvb.begin() + (static_cast<long>(h) * (nope + vd) + nope + vd) * dc,
                wuv.begin() + static_cast<long>(h) * vd * dc);
    std::vector<float> qa(static_cast<std::size_t>(T) * H * dc), qr(static_cast<std::size_t>(T) * H * dr);
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < H; ++h) {
        const float* q = tr.q + (static_cast<std::size_t>(t) * H + h) * (dc + dr);
        std::copy(q, q + dc, qa.begin() + (static_cast<long>(t) * H + h) * dc);
        std::copy(q + dc, q + dc + dr, qr.begin() + (static_cast<long>(t) * H + h) * dr);
      }
    MlaBlock<float> b(MlaDims{T, H, dc, dr, vd, hid}, wuv.data(), wo.data(), tr.scale);
    std::vector<float> y(static_cast<std::size_t>(T) * hid);
    b.forward(qa.data(), qr.data(), tr.k, tr.v, y.data());
    double mx = 0, md = 0;
    for (std::size_t i = 0; i < y.size(); ++i) {
      mx = std::max(mx, std::fabs(static_cast<double>(tr.attn_proj[i])));
      md = std::max(md, std::fabs(static_cast<double>(tr.attn_proj[i]) - y[i]));
    }
    EXPECT_LT(md / mx, 1e-5) << "layer " << tr.layer;
    ++checked;
  });
  auto cache = make_dense_cache(model->cache_geometry(), 1, 0, DenseStorage::kF32);
  model->forward(tokens.data(), T, *cache, 0, nullptr, LogitsMode::kNone);
  EXPECT_EQ(checked, cfg.n_layers);
}

// ---- Cayley -----------------------------------------------------------------------------------

TEST(Cayley, OrthogonalAndBackwardMatchesFiniteDifferences) {
  const int n = 6;
  const auto A = random_skew(n, 3, 0.3);
  std::vector<double> M;
  const auto R = cayley(A, n, &M);
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j) {
      double d = 0;
      for (int k = 0; k < n; ++k) d += R[i * n + k] * R[j * n + k];
      EXPECT_NEAR(d, i == j ? 1.0 : 0.0, 1e-12);
    }
  const auto I = cayley(std::vector<double>(n * n, 0.0), n);
  for (int i = 0; i < n * n; ++i) EXPECT_EQ(I[i], (i % (n + 1) == 0) ? 1.0 : 0.0);
  // L(R) = <G, R>; dL/dA_ij (free parameter, A_ji = -A_ij) by central differences.
  const auto G = randn(n * n, 4);
  const auto dA = cayley_backward(M, R, G, n);
  auto L = [&](const std::vector<double>& a) {
    const auto r = cayley(a, n);
    double v = 0;
    for (int i = 0; i < n * n; ++i) v += G[i] * r[i];
    return v;
  };
  const double h = 1e-6;
  for (int i = 0; i < n; ++i)
    for (int j = i + 1; j < n; ++j) {
      auto ap = A, am = A;
      ap[i * n + j] += h, ap[j * n + i] -= h;
      am[i * n + j] -= h, am[j * n + i] += h;
      EXPECT_NEAR(dA[i * n + j], (L(ap) - L(am)) / (2 * h), 1e-7);
      EXPECT_NEAR(dA[j * n + i], -dA[i * n + j], 1e-12);
    }
}

// ---- Straight-through quantizer ----------------------------------------------------------------

TEST(AffineSte, ForwardIsTheRuntimeQuantizerAndBackwardTheSurrogateGradient) {
  for (auto st : {ScaleType::kBf16, ScaleType::kFp32}) {
    AffineGroup q(128, 4, 64, st);
    AffineSte<double> op(q);
    const auto x = randn(128, 7 + static_cast<int>(st));
    std::vector<double> y(128), yref(128);
    op.forward(x.data(), y.data());
    std::vector<float> xf(x.begin(), x.end()), yf(128);
    std::vector<std::uint8_t> codes(q.code_bytes()), meta(q.meta_bytes());
    q.encode(xf.data(), codes.data(), meta.data());
    q.decode(codes.data(), meta.data(), yf.data());
    for (int i = 0; i < 128; ++i) ASSERT_EQ(y[i], static_cast<double>(yf[i]));
    // Surrogate with the rounding residual frozen: f_j(x) = x_j + s(x) r_j, s = (max - min) / m.
    std::vector<double> xr(xf.begin(), xf.end()), r(128);
    std::vector<double> s0(2);
    for (int g = 0; g < 2; ++g) {
      float lo = xf[g * 64], hi = lo;
      for (int i = 0; i < 64; ++i) lo = std::min(lo, xf[g * 64 + i]), hi = std::max(hi, xf[g * 64 + i]);
      s0[g] = affine_group_scale(lo, hi, 4, st);
      for (int i = 0; i < 64; ++i) r[g * 64 + i] = (y[g * 64 + i] - xr[g * 64 + i]) / s0[g];
    }
    const auto gy = randn(128, 17);
    std::vector<double> gx(128);
    op.backward(xr.data(), y.data(), gy.data(), gx.data());
    auto F = [&](const std::vector<double>& xv) {
      double v = 0;
      for (int g = 0; g < 2; ++g) {
        double lo = xv[g * 64], hi = lo;
        for (int i = 0; i < 64; ++i) lo = std::min(lo, xv[g * 64 + i]), hi = std::max(hi, xv[g * 64 + i]);
        const double s = (hi - lo) / 15.0;
        for (int i = 0; i < 64; ++i) v += gy[g * 64 + i] * (xv[g * 64 + i] + s * r[g * 64 + i]);
      }
      return v;
    };
    const double h = 1e-7;
    for (int i = 0; i < 128; ++i) {
      auto xp = xr, xm = xr;
      xp[i] += h, xm[i] -= h;
      EXPECT_NEAR(gx[i], (F(xp) - F(xm)) / (2 * h), 2e-5) << i;
    }
  }
}

// ---- Objectives ---------------------------------------------------------------------------------

TEST(Objectives, ContentGradientMatchesFiniteDifferences) {
  Small s = make_small(6, 21);
  const int dc = s.w.dims.dc;
  SmoothOp op(dc);
  const auto A = random_skew(dc, 22, 0.2);
  const auto R = cayley(A, dc);
  auto sv = randn(dc, 23, 0.3);
  for (auto& v : sv) v = std::exp(v);
  std::vector<double> dR(dc * dc, 0.0), ds(dc, 0.0);
  const double L0 = content_objective(s.w, s.x, R.data(), sv.data(), &op, dR.data(), ds.data());
  EXPECT_GT(L0, 0.0);
  const double h = 1e-6;
  for (int i = 0; i < dc * dc; i += 5) {
    auto Rp = R, Rm = R;
    Rp[i] += h, Rm[i] -= h;
    const double fd = (content_objective(s.w, s.x, Rp.data(), sv.data(), &op) - content_objective(s.w, s.x, Rm.data(), sv.data(), &op)) / (2 * h);
    EXPECT_NEAR(dR[i], fd, 1e-6 * std::max(1.0, std::fabs(fd))) << "dR " << i;
  }
  for (int j = 0; j < dc; ++j) {
    auto sp = sv, sm = sv;
    sp[j] += h, sm[j] -= h;
    const double fd = (content_objective(s.w, s.x, R.data(), sp.data(), &op) - content_objective(s.w, s.x, R.data(), sm.data(), &op)) / (2 * h);
    EXPECT_NEAR(ds[j], fd, 1e-6 * std::max(1.0, std::fabs(fd))) << "ds " << j;
  }
}

TEST(Objectives, ExactPathsAreInvariantUnderTheTransforms) {
  // With quantization off, the content transform and the RoPE pair transform change nothing.
  Small s = make_small(9, 31, false);
  const int dc = s.w.dims.dc, dr = s.w.dims.dr;
  {
    std::vector<double> C(s.x.u.size());
    for (std::size_t i = 0; i < C.size(); ++i) C[i] = s.x.u[i] * s.w.gamma[i % dc];
    MlaBlock<double> b(s.w.dims, s.w.w_uv.data(), s.w.w_o.data(), s.w.scale);
    s.x.y.resize(static_cast<std::size_t>(9) * s.w.dims.hidden);
    b.forward(s.x.qa.data(), s.x.qr.data(), C.data(), s.x.p.data(), s.x.y.data());
  }
  const auto A = random_skew(dc, 32, 0.4);
  const auto R = cayley(A, dc);
  auto sv = randn(dc, 33, 0.5);
  for (auto& v : sv) v = std::exp(v);
  EXPECT_LT(content_objective<double>(s.w, s.x, R.data(), sv.data(), nullptr), 1e-24);
  const auto ang = randn(dr / 2, 34), sc0 = randn(dr / 2, 35, 0.5);
  std::vector<double> sc(sc0);
  for (auto& v : sc) v = std::exp(v);
  for (bool inter : {true, false}) {
    const RopePairs pp{dr, inter};
    EXPECT_LT(rope_objective<double>(s.x, s.w.dims.H, pp, ang.data(), sc.data(), false, nullptr), 1e-24);
    EXPECT_LT(rope_objective<double>(s.x, s.w.dims.H, pp, nullptr, nullptr, true, nullptr), 1e-24);
    EXPECT_LT(rope_output_objective<double>(s.w, s.x, pp, ang.data(), sc.data(), false, nullptr), 1e-24);
  }
}

TEST(Objectives, RopeGradientMatchesFiniteDifferences) {
  Small s = make_small(8, 41, false);
  const int dr = s.w.dims.dr;
  SmoothOp op(dr);
  for (bool inter : {true, false}) {
    const RopePairs pp{dr, inter};
    auto ang = randn(dr / 2, 42, 0.5);
    auto sc = randn(dr / 2, 43, 0.3);
    for (auto& v : sc) v = std::exp(v);
    std::vector<double> da(dr / 2, 0.0), dsc(dr / 2, 0.0);
    const double L0 = rope_objective(s.x, s.w.dims.H, pp, ang.data(), sc.data(), false, &op, da.data(), dsc.data());
    EXPECT_GT(L0, 0.0);
    const double h = 1e-6;
    for (int i = 0; i < dr / 2; ++i) {
      auto ap = ang, am = ang;
      ap[i] += h, am[i] -= h;
      const double fa = (rope_objective(s.x, s.w.dims.H, pp, ap.data(), sc.data(), false, &op) -
                         rope_objective(s.x, s.w.dims.H, pp, am.data(), sc.data(), false, &op)) / (2 * h);
      EXPECT_NEAR(da[i], fa, 1e-6 * std::max(1.0, std::fabs(fa)));
      auto sp = sc, sm = sc;
      sp[i] += h, sm[i] -= h;
      const double fs = (rope_objective(s.x, s.w.dims.H, pp, ang.data(), sp.data(), false, &op) -
                         rope_objective(s.x, s.w.dims.H, pp, ang.data(), sm.data(), false, &op)) / (2 * h);
      EXPECT_NEAR(dsc[i], fs, 1e-6 * std::max(1.0, std::fabs(fs)));
    }
  }
}

TEST(Objectives, LogScaleClip) {
  EXPECT_DOUBLE_EQ(log_scale_value(3.0), std::exp(2.0));
  EXPECT_DOUBLE_EQ(log_scale_value(-5.0), std::exp(-2.0));
  EXPECT_DOUBLE_EQ(log_scale_grad(2.5), 0.0);
  EXPECT_DOUBLE_EQ(log_scale_grad(0.5), std::exp(0.5));
}

// ---- Fusion -------------------------------------------------------------------------------------

namespace {

enum class Variant { kCorrect, kWrongPairing, kWrongOrder, kNoCompensation };

// Writes tiny-mla in f32 with random transforms fused by the primitives, possibly wrongly.
void write_fused(const fs::path& out, Variant v, std::uint64_t seed, const std::string& calib_json = "") {
  const std::string dir = src("models/tiny-mla");
  const ModelConfig cfg = load_model_config(dir + "/config.json");
  const int dc = cfg.kv_lora_rank, dr = cfg.qk_rope_head_dim, nh = cfg.n_heads, nope = cfg.qk_nope_head_dim,
            vd = cfg.v_head_dim, hid = cfg.hidden_size, qh = nope + dr;
  SafetensorsFile f1(dir + "/model-00001-of-00002.safetensors"), f2(dir + "/model-00002-of-00002.safetensors");
  std::vector<TensorToWrite> ts;
  for (const auto* f : {&f1, &f2})
    for (const auto& [name, view] : f->tensors()) ts.push_back({name, DType::kF32, view.shape, view.to_float()});
  auto find = [&](const std::string& n) -> std::vector<float>& {
    for (auto& t : ts)
      if (t.name == n) return t.values;
    throw std::runtime_error("missing " + n);
  };
  const RopePairs pp{dr, cfg.rope.interleaved}, wrong{dr, !cfg.rope.interleaved};
  for (int l = 0; l < cfg.n_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".self_attn.";
    const auto A = random_skew(dc, seed + 10 * l, 0.05);
    const auto R = cayley(A, dc);
    std::vector<double> Rt(R.size());
    for (int i = 0; i < dc; ++i)
      for (int j = 0; j < dc; ++j) Rt[j * dc + i] = R[i * dc + j];
    auto s = randn(dc, seed + 10 * l + 1, 0.3);
    for (auto& x : s) x = std::exp(x);
    const auto ang = randn(dr / 2, seed + 10 * l + 2);
    auto rs = randn(dr / 2, seed + 10 * l + 3, 0.3);
    for (auto& x : rs) x = std::exp(x);
    auto& kva = find(p + "kv_a_proj_with_mqa.weight");
    auto& norm = find(p + "kv_a_layernorm.weight");
    auto& kvb = find(p + "kv_b_proj.weight");
    auto& q = find(p + "q_proj.weight");
    const std::vector<float> gamma = norm;
    fuse_content_producer(kva.data(), dc, hid, R.data());
    fuse_content_consumer(kvb.data(), nh * (nope + vd), dc, gamma.data(), v == Variant::kWrongOrder ? Rt.data() : R.data(), s.data());
    for (int j = 0; j < dc; ++j) norm[j] = static_cast<float>(s[j]);
    fuse_rope_rows(kva.data() + static_cast<std::size_t>(dc) * hid, dr, hid, pp, ang.data(), rs.data(), false);
    for (int h = 0; h < nh; ++h)
      fuse_rope_rows(q.data() + (static_cast<std::size_t>(h) * qh + nope) * hid, dr, hid,
                     v == Variant::kWrongPairing ? wrong : pp, ang.data(), rs.data(), v != Variant::kNoCompensation);
  }
  fs::create_directories(out);
  write_safetensors((out / "model.safetensors").string(), ts, {{"format", "pt"}});
  fs::copy_file(dir + "/config.json", out / "config.json");
  fs::copy_file(dir + "/tokenizer.json", out / "tokenizer.json");
  if (!calib_json.empty()) std::ofstream(out / "kvq_calibration.json") << calib_json;
}

struct RunOut {
  std::vector<std::vector<float>> layers;  // attn_proj per layer
  std::vector<std::vector<float>> rope_keys;
  double nll = 0;
};
RunOut run_model(const std::string& dir, int T = 96) {
  auto m = Model::load(dir);
  const auto& cfg = m->config();
  std::vector<std::int32_t> tok(T);
  SplitMix64 r(5);
  tok[0] = cfg.bos_token_id;
  for (int i = 1; i < T; ++i) tok[i] = static_cast<std::int32_t>(r.next() % static_cast<std::uint64_t>(cfg.vocab_size));
  RunOut o;
  m->set_observer([&](const LayerTrace& tr) {
    o.layers.emplace_back(tr.attn_proj, tr.attn_proj + static_cast<std::size_t>(tr.n) * cfg.hidden_size);
    o.rope_keys.emplace_back(tr.v, tr.v + static_cast<std::size_t>(tr.n) * tr.v_dim);
  });
  auto cache = make_dense_cache(m->cache_geometry(), 1, 0, DenseStorage::kF32);
  std::vector<float> logits(static_cast<std::size_t>(T) * cfg.vocab_size);
  m->forward(tok.data(), T, *cache, 0, logits.data(), LogitsMode::kAll);
  o.nll = mean_next_token_nll(logits.data(), cfg.vocab_size, tok.data(), T);
  return o;
}

double max_layer_rel_err(const RunOut& a, const RunOut& b) {
  double worst = 0;
  for (std::size_t l = 0; l < a.layers.size(); ++l) {
    double mx = 0, md = 0;
    for (std::size_t i = 0; i < a.layers[l].size(); ++i) {
      mx = std::max(mx, std::fabs(static_cast<double>(a.layers[l][i])));
      md = std::max(md, std::fabs(static_cast<double>(a.layers[l][i]) - b.layers[l][i]));
    }
    worst = std::max(worst, md / mx);
  }
  return worst;
}

}  // namespace

TEST(Fusion, FusedModelMatchesTheOriginalAndWrongFusionIsCaught) {
  const RunOut ref = run_model(src("models/tiny-mla"));
  const fs::path base = temp_dir("fusion");
  struct Case { Variant v; const char* name; };
  for (const Case c : {Case{Variant::kCorrect, "correct"}, Case{Variant::kWrongPairing, "pairing"},
                       Case{Variant::kWrongOrder, "order"}, Case{Variant::kNoCompensation, "compensation"}}) {
    const fs::path d = base / c.name;
    write_fused(d, c.v, 1234);
    const RunOut got = run_model(d.string());
    const double e = max_layer_rel_err(ref, got), drift = std::fabs(got.nll - ref.nll);
    if (c.v == Variant::kCorrect) {
      EXPECT_LE(e, 1e-4) << c.name;
      EXPECT_LE(drift, 1e-4) << c.name;
      // and the cache really holds something else (the transform is not a no-op)
      double diff = 0;
      for (std::size_t i = 0; i < ref.rope_keys[0].size(); ++i) diff = std::max(diff, std::fabs(static_cast<double>(ref.rope_keys[0][i]) - got.rope_keys[0][i]));
      EXPECT_GT(diff, 1e-2);
    } else {
      EXPECT_GT(e, 1e-2) << c.name << ": a wrong fusion must be detected";
    }
  }
  fs::remove_all(base);
}

TEST(Fusion, OnlineRopeHadamardKeepsTheFunctionAndChangesTheCache) {
  const RunOut ref = run_model(src("models/tiny-mla"));
  const fs::path d = temp_dir("hadamard");
  fs::create_directories(d);
  for (const char* f : {"config.json", "tokenizer.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                        "model.safetensors.index.json"})
    fs::copy_file(src("models/tiny-mla/") + f, d / f);
  std::ofstream(d / "kvq_calibration.json") << R"({"online_rope_hadamard": true})";
  const RunOut got = run_model(d.string());
  EXPECT_LE(max_layer_rel_err(ref, got), 1e-5);
  EXPECT_LE(std::fabs(got.nll - ref.nll), 1e-5);
  // The cached key is k H / sqrt(d) (fwht is normalized).
  std::vector<double> k(ref.rope_keys[0].begin(), ref.rope_keys[0].begin() + 64);
  fwht(k.data(), 64);
  double kmax = 0;
  for (int i = 0; i < 64; ++i) {
    EXPECT_NEAR(got.rope_keys[0][i], k[i], 1e-5);
    kmax = std::max(kmax, std::fabs(k[i] - ref.rope_keys[0][i]));
  }
  EXPECT_GT(kmax, 1e-2);
  std::ofstream(d / "kvq_calibration.json") << R"({"online_rope_hadamard": 3})";
  EXPECT_THROW(Model::load(d.string()), kvq::Error);
  std::ofstream(d / "kvq_calibration.json") << "{not json";
  EXPECT_THROW(Model::load(d.string()), kvq::Error);
  fs::remove_all(d);
}

// ---- Driver -------------------------------------------------------------------------------------

namespace {
// Work directories of calibrate left in `dir` (named OUT.kvq-tmp-PID and OUT.f32check.kvq-tmp-PID).
int work_dirs_left(const fs::path& dir) {
  int n = 0;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) n += e.path().filename().string().find(".kvq-tmp-") != std::string::npos;
  return n;
}
CalibOptions small_options(const fs::path& out, CalibMethod m) {
  CalibOptions o;
  o.model_dir = src("models/tiny-mla");
  o.text_file = src("data/validation-tech.txt");
  o.out_dir = out.string();
  o.method = m;
  o.steps = 6;
  o.eval_every = 3;
  o.train_seqs = 4;
  o.heldout_seqs = 2;
  o.seq_len = 64;
  o.batch = 2;
  o.check_seqs = 2;
  return o;
}
}  // namespace

TEST(Calibrate, WritesALoadableFusedModelWithItsRecord) {
  const fs::path base = temp_dir("driver");
  for (auto m : {CalibMethod::kQuantMla, CalibMethod::kSmoothQuant, CalibMethod::kQuaRot}) {
    const fs::path out = base / calib_method_name(m);
    const CalibResult r = calibrate(small_options(out, m));
    ASSERT_TRUE(fs::exists(out / "model.safetensors"));
    EXPECT_EQ(work_dirs_left(base), 0);
    std::ifstream jf(out / "kvq_calibration.json");
    std::stringstream ss;
    ss << jf.rdbuf();
    const auto j = nlohmann::json::parse(ss.str());
    EXPECT_EQ(j.at("method"), calib_method_name(m));
    EXPECT_EQ(j.at("cache"), "c4r4");
    EXPECT_EQ(j.at("online_rope_hadamard").get<bool>(), m == CalibMethod::kQuaRot);
    EXPECT_EQ(j.at("checksums").at("model.safetensors"), "fnv1a64:" + file_checksum((out / "model.safetensors").string()));
    EXPECT_EQ(j.at("layers").size(), 4u);
    EXPECT_LE(r.fusion_max_rel_err, 1e-4);
    EXPECT_LE(std::fabs(r.nll_fused_f32 - r.nll_original), 1e-4);
    EXPECT_LT(std::fabs(r.nll_saved - r.nll_original), 2e-2);
    for (const auto& L : r.layers) {
      EXPECT_TRUE(std::isfinite(L.content.best) && std::isfinite(L.rope.best));
      EXPECT_LE(L.content.best, L.content.init);
      EXPECT_LE(L.rope.best, L.rope.init);
      if (m == CalibMethod::kQuaRot) {
        EXPECT_EQ(L.content.alpha, -1.0);
      }
    }
    auto model = Model::load(out.string());
    EXPECT_EQ(model->config().online_rope_hadamard, m == CalibMethod::kQuaRot);
  }
  fs::remove_all(base);
}

// --paths ablation: one path transformed, the other left at RTN (identity transform, objective unchanged).
TEST(Calibrate, OnePathAloneLeavesTheOtherAtRtn) {
  const fs::path base = temp_dir("paths");
  for (bool content : {true, false}) {
    CalibOptions o = small_options(base / (content ? "content" : "rope"), CalibMethod::kQuantMla);
    o.content_path = content;
    o.rope_path = !content;
    const CalibResult r = calibrate(o);
    for (const auto& L : r.layers) {
      const PathResult& off = content ? L.rope : L.content;
      const PathResult& on = content ? L.content : L.rope;
      EXPECT_EQ(off.best, off.rtn);
      EXPECT_EQ(off.best_step, 0);
      EXPECT_LT(on.best, on.rtn);
    }
    EXPECT_NE(r.json.find(content ? "\"paths\": \"content\"" : "\"paths\": \"rope\""), std::string::npos);
  }
  CalibOptions none = small_options(base / "none", CalibMethod::kQuantMla);
  none.content_path = none.rope_path = false;
  EXPECT_THROW(calibrate(none), kvq::Error);
  fs::remove_all(base);
}

// --rope-seq-len: the RoPE path gets its own, longer sequences; the content path's samples (and
// so its RTN objective) stay those of --seq-len.
TEST(Calibrate, RopeSequenceLengthOnlyChangesTheRopeSamples) {
  const fs::path base = temp_dir("ropelen");
  CalibOptions a = small_options(base / "same", CalibMethod::kQuantMla);
  a.steps = 0;
  CalibOptions b = a;
  b.out_dir = (base / "long").string();
  b.rope_seq_len = 2 * a.seq_len;
  const CalibResult ra = calibrate(a), rb = calibrate(b);
  ASSERT_EQ(ra.layers.size(), rb.layers.size());
  int rope_differs = 0;
  for (std::size_t l = 0; l < ra.layers.size(); ++l) {
    EXPECT_EQ(ra.layers[l].content.rtn, rb.layers[l].content.rtn) << l;
    rope_differs += ra.layers[l].rope.rtn != rb.layers[l].rope.rtn;
  }
  EXPECT_EQ(rope_differs, static_cast<int>(ra.layers.size()));
  EXPECT_NE(rb.json.find("\"rope_seq_len\": " + std::to_string(2 * a.seq_len)), std::string::npos);
  CalibOptions bad = a;
  bad.out_dir = (base / "bad").string();
  bad.rope_seq_len = 3;
  EXPECT_THROW(calibrate(bad), kvq::Error);
  fs::remove_all(base);
}

TEST(Calibrate, SeededRunsAreReproducible) {
  // Same options twice: the same checkpoint bytes, whatever the OpenMP schedule did.
  const fs::path base = temp_dir("repro");
  std::string sums[2];
  for (int r = 0; r < 2; ++r) sums[r] = calibrate(small_options(base / std::to_string(r), CalibMethod::kQuantMla)).checksum;
  EXPECT_EQ(sums[0], sums[1]);
  fs::remove_all(base);
}

TEST(Calibrate, OutputDirectoryIsNeverAnotherDirectory) {
  // check_calib_output writes nothing: the model, a directory holding it and the working directory are
  // refused whatever the flag; names are normalized first ("dir/", "dir/../dir").
  const fs::path base = temp_dir("outcheck");
  const fs::path model = base / "models" / "m";
  fs::create_directories(model);
  std::ofstream(model / "config.json") << "{}";
  auto refused = [&](const std::string& out, bool overwrite, const std::string& needle) {
    try {
      check_calib_output(out, model.string(), overwrite);
      ADD_FAILURE() << out << ": accepted; expected an error mentioning '" << needle << "'";
    } catch (const kvq::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  for (bool ow : {false, true}) {
    refused(model.string(), ow, "model directory");
    refused(model.string() + "/", ow, "model directory");
    refused((model / ".." / "m").string(), ow, "model directory");
    refused((base / "models").string(), ow, "model directory");
    refused(base.string(), ow, "model directory");
    refused("/", ow, "output directory");
  }
  const fs::path cwd = fs::current_path();
  fs::create_directories(base / "work" / "sub");
  fs::current_path(base / "work" / "sub");
  refused(".", true, "working directory");
  refused("..", true, "working directory");
  fs::current_path(cwd);
  std::ofstream(base / "file") << "x";
  refused((base / "file").string(), true, "not a directory");
  EXPECT_EQ(check_calib_output((base / "new").string(), model.string(), false), (base / "new").string());
  EXPECT_EQ(check_calib_output((base / "new" / "").string(), model.string(), false), (base / "new").string());
  fs::create_directories(base / "empty");
  EXPECT_EQ(check_calib_output((base / "empty").string(), model.string(), false), (base / "empty").string());
  EXPECT_TRUE(fs::exists(model / "config.json"));
  fs::remove_all(base);
}

TEST(Calibrate, KeepsWhatIsInTheOutputDirectoryUnlessItReplacesItsOwnOutput) {
  const fs::path base = temp_dir("outdir");
  fs::create_directories(base);
  auto expect_refused = [&](const CalibOptions& o, const std::string& needle) {
    try {
      calibrate(o);
      ADD_FAILURE() << o.out_dir << ": written; expected an error mentioning '" << needle << "'";
    } catch (const kvq::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_EQ(work_dirs_left(base), 0);
  };
  auto read = [](const fs::path& f) {
    std::ifstream in(f);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  };
  // A user's directory: refused with and without --overwrite, its file intact.
  const fs::path user = base / "user";
  fs::create_directories(user);
  std::ofstream(user / "notes.txt") << "mine";
  CalibOptions o = small_options(user, CalibMethod::kQuaRot);
  expect_refused(o, "not empty");
  o.overwrite = true;
  expect_refused(o, "kvq_calibration.json");
  EXPECT_EQ(read(user / "notes.txt"), "mine");
  // An existing empty directory is filled.
  const fs::path out = base / "out";
  fs::create_directories(out);
  o = small_options(out, CalibMethod::kQuaRot);
  calibrate(o);
  ASSERT_TRUE(fs::is_regular_file(out / "kvq_calibration.json"));
  // Its own earlier output: refused without --overwrite, replaced whole with it.
  std::ofstream(out / "stale.txt") << "old";
  expect_refused(o, "not empty");
  EXPECT_TRUE(fs::exists(out / "stale.txt"));
  o.overwrite = true;
  calibrate(o);
  EXPECT_FALSE(fs::exists(out / "stale.txt"));
  EXPECT_TRUE(fs::is_regular_file(out / "model.safetensors"));
  EXPECT_EQ(work_dirs_left(base), 0);
  fs::remove_all(base);
}

TEST(Calibrate, BadInputIsAClearErrorAndLeavesNoDirectory) {
  const fs::path base = temp_dir("bad");
  auto expect_error = [&](CalibOptions o, const std::string& needle) {
    try {
      calibrate(o);
      ADD_FAILURE() << "no error; expected one mentioning '" << needle << "'";
    } catch (const kvq::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_FALSE(fs::exists(o.out_dir)) << o.out_dir;
    EXPECT_EQ(work_dirs_left(base), 0) << o.out_dir;
  };
  CalibOptions o = small_options(base / "gqa", CalibMethod::kQuantMla);
  o.model_dir = src("models/tiny-gqa");
  expect_error(o, "MLA");
  o = small_options(base / "fmt", CalibMethod::kQuantMla);
  o.cache = "mla-tq4";
  expect_error(o, "cXrY");
  o = small_options(base / "fmt2", CalibMethod::kQuantMla);
  o.cache = "c5r9";
  expect_error(o, "c4r4");  // unknown format: the valid ones are listed
  o = small_options("/proc/kvq-cannot-write/out", CalibMethod::kQuantMla);
  try {
    calibrate(o);
    ADD_FAILURE() << "no error for an unwritable output dir";
  } catch (const kvq::Error& e) {
    EXPECT_NE(std::string(e.what()).find("/proc/kvq-cannot-write/out"), std::string::npos) << e.what();
  }
  // NaN activations: a copy of tiny-mla whose layer-1 query projection overflows (finite weights,
  // infinite queries, NaN after RoPE).
  {
    const fs::path d = base / "nan-model";
    fs::create_directories(d);
    const std::string dir = src("models/tiny-mla");
    SafetensorsFile f1(dir + "/model-00001-of-00002.safetensors"), f2(dir + "/model-00002-of-00002.safetensors");
    std::vector<TensorToWrite> ts;
    for (const auto* f : {&f1, &f2})
      for (const auto& [name, view] : f->tensors()) ts.push_back({name, DType::kF32, view.shape, view.to_float()});
    for (auto& t : ts)
      if (t.name == "model.layers.1.self_attn.q_proj.weight")
        for (int k = 0; k < 256; ++k) t.values[static_cast<std::size_t>(64) * 256 + k] = 3e38f;  // head 0, first RoPE row
    write_safetensors((d / "model.safetensors").string(), ts, {{"format", "pt"}});
    fs::copy_file(dir + "/config.json", d / "config.json");
    fs::copy_file(dir + "/tokenizer.json", d / "tokenizer.json");
    o = small_options(base / "nan", CalibMethod::kQuantMla);
    o.model_dir = d.string();
    expect_error(o, "non-finite activation in layer 1");
  }
  fs::remove_all(base);
}
