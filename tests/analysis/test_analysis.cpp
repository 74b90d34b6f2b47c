// Sensitivity analysis (kvq/analysis.hpp): on a 32-token slice of tiny-mla the exact Jacobian of
// each cache path (built column by column) agrees with the VJPs and JVPs (1e-6) and with central
// finite differences (1e-3); Hutchinson's trace and diagonal fall within 3 standard errors of the
// exact values; the local relation NMSE_out ~= NMSE_cache ||c||^2 / ||y||^2 G holds within 5% at
// cache NMSE 1e-4; G = T A (1 + O) exactly for random PSD H and e; statistics; the drivers end
// to end and their errors on bad input.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "kvq/analysis.hpp"
#include "kvq/dense_cache.hpp"
#include "kvq/formats.hpp"
#include "kvq/model.hpp"
#include "kvq/quantizers.hpp"
#include "kvq/rng.hpp"
#include "kvq/safetensors.hpp"
#include "kvq/tokenizer.hpp"

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

double norm2(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x * x;
  return s;
}
double rel_dist(const std::vector<double>& a, const std::vector<double>& b) {
  double d = 0;
  for (std::size_t i = 0; i < a.size(); ++i) d += (a[i] - b[i]) * (a[i] - b[i]);
  return std::sqrt(d / norm2(b));
}

// One layer's block inputs (double) on a 32-token slice of data/validation.txt.
struct Slice {
  MlaDims d;
  double scale = 0;
  std::vector<double> w_uv, w_o, qa, qr, C, P;
};

const std::vector<Slice>& real_slices() {
  static const std::vector<Slice> slices = [] {
    const std::string dir = src("models/tiny-mla");
    auto model = Model::load(dir);
    const auto& cfg = model->config();
    const int T = 32, H = cfg.n_heads, dc = cfg.kv_lora_rank, dr = cfg.qk_rope_head_dim, vd = cfg.v_head_dim,
              nope = cfg.qk_nope_head_dim, hid = cfg.hidden_size;
    SafetensorsFile f1(dir + "/model-00001-of-00002.safetensors"), f2(dir + "/model-00002-of-00002.safetensors");
    auto get = [&](const std::string& n) { return (f1.has(n) ? f1 : f2).get(n).to_float(); };
    auto tok = Tokenizer::load(dir + "/tokenizer.json");
    std::ifstream tf(src("data/validation.txt"));
    std::string text(4000, '\0');
    tf.read(text.data(), static_cast<std::streamsize>(text.size()));
    std::vector<std::int32_t> tokens{cfg.bos_token_id};
    const auto enc = tok->encode(text.substr(0, static_cast<std::size_t>(tf.gcount())));
    tokens.insert(tokens.end(), enc.begin(), enc.begin() + (T - 1));
    std::vector<Slice> out(static_cast<std::size_t>(cfg.n_layers));
    model->set_observer([&](const LayerTrace& tr) {
      Slice& s = out[static_cast<std::size_t>(tr.layer)];
      s.d = MlaDims{T, H, dc, dr, vd, hid};
      s.scale = tr.scale;
      const std::string p = "model.layers." + std::to_string(tr.layer) + ".self_attn.";
      const auto kvb = get(p + "kv_b_proj.weight");
      const auto wo = get(p + "o_proj.weight");
      s.w_o.assign(wo.begin(), wo.end());
      s.w_uv.resize(static_cast<std::size_t>(H) * vd * dc);
      for (int h = 0; h < H; ++h)
        std::copy(kvb.begin() + (static_cast<long>(h) * (nope + vd) + nope) * dc,
                  kvb.begin() + (static_cast<long>(h) * (nope + vd) + nope + vd) * dc, s.w_uv.begin() + static_cast<long>(h) * vd * dc);
      s.qa.resize(static_cast<std::size_t>(T) * H * dc);
      s.qr.resize(static_cast<std::size_t>(T) * H * dr);
      for (int t = 0; t < T; ++t)
        for (int h = 0; h < H; ++h) {
          const float* q = tr.q + (static_cast<std::size_t>(t) * H + h) * (dc + dr);
          std::copy(q, q + dc, s.qa.begin() + (static_cast<long>(t) * H + h) * dc);
          std::copy(q + dc, q + dc + dr, s.qr.begin() + (static_cast<long>(t) * H + h) * dr);
        }
      s.C.assign(tr.k, tr.k + static_cast<std::size_t>(T) * dc);
      s.P.assign(tr.v, tr.v + static_cast<std::size_t>(T) * dr);
    });
    auto cache = make_dense_cache(model->cache_geometry(), 1, 0, DenseStorage::kF32);
    model->forward(tokens.data(), T, *cache, 0, nullptr, LogitsMode::kNone);
    return out;
  }();
  return slices;
}

// Streams the exact Jacobian of one path column by column (one JVP per unit vector) and keeps what
// the checks need: J^T u for the given u, J v, diag(H) = column norms^2, and the listed columns.
struct ExactStats {
  std::vector<std::vector<double>> jtu;
  std::vector<double> jv, diag, trace_cols;
  std::vector<std::vector<double>> cols;
  double trace = 0;
};
ExactStats exact_stats(MlaBlock<double>& b, CachePath p, const std::vector<std::vector<double>>& us, const std::vector<double>& v,
                       const std::vector<std::size_t>& keep) {
  const std::size_t D = static_cast<std::size_t>(path_size(b.dims(), p)), N = static_cast<std::size_t>(b.dims().T) * b.dims().hidden;
  ExactStats s;
  s.jtu.assign(us.size(), std::vector<double>(D, 0.0));
  s.jv.assign(N, 0.0);
  s.diag.assign(D, 0.0);
  std::vector<double> e(D, 0.0), col(N);
  std::size_t next = 0;
  for (std::size_t j = 0; j < D; ++j) {
    e[j] = 1.0;
    path_jvp(b, p, e.data(), col.data());
    e[j] = 0.0;
    for (std::size_t k = 0; k < us.size(); ++k) {
      double dot = 0;
      for (std::size_t i = 0; i < N; ++i) dot += col[i] * us[k][i];
      s.jtu[k][j] = dot;
    }
    for (std::size_t i = 0; i < N; ++i) s.jv[i] += col[i] * v[j];
    s.diag[j] = norm2(col);
    s.trace += s.diag[j];
    if (next < keep.size() && keep[next] == j) s.cols.push_back(col), ++next;
  }
  return s;
}

// C or P of a slice, with the other inputs, as a forward call.
void forward_with(MlaBlock<double>& b, const Slice& s, CachePath p, const std::vector<double>& c, std::vector<double>& y) {
  y.resize(static_cast<std::size_t>(s.d.T) * s.d.hidden);
  if (p == CachePath::kContent)
    b.forward(s.qa.data(), s.qr.data(), c.data(), s.P.data(), y.data());
  else
    b.forward(s.qa.data(), s.qr.data(), s.C.data(), c.data(), y.data());
}

void check_exact_jacobian(int layer, CachePath p) {
  const Slice& s = real_slices()[static_cast<std::size_t>(layer)];
  MlaBlock<double> b(s.d, s.w_uv.data(), s.w_o.data(), s.scale);
  std::vector<double> y0(static_cast<std::size_t>(s.d.T) * s.d.hidden);
  b.forward(s.qa.data(), s.qr.data(), s.C.data(), s.P.data(), y0.data());
  const std::size_t D = static_cast<std::size_t>(path_size(s.d, p)), N = y0.size();
  const std::vector<std::vector<double>> us = {randn(N, 11), randn(N, 12), y0};
  const std::vector<double> v = randn(D, 13);
  std::vector<std::size_t> keep;
  for (std::size_t j = 0; j < D; j += D / 24) keep.push_back(j);
  keep.push_back(D - 1);
  const ExactStats ex = exact_stats(b, p, us, v, keep);
  // VJP and JVP against the exact Jacobian.
  for (std::size_t k = 0; k < us.size(); ++k) {
    std::vector<double> ju(D);
    path_vjp(b, p, us[k].data(), ju.data());
    EXPECT_LE(rel_dist(ju, ex.jtu[k]), 1e-6) << "VJP " << k;
  }
  std::vector<double> jv(N);
  path_jvp(b, p, v.data(), jv.data());
  EXPECT_LE(rel_dist(jv, ex.jv), 1e-6) << "JVP";
  // Central finite differences of the listed columns (step 1e-4 of the path's rms value).
  const std::vector<double>& c = p == CachePath::kContent ? s.C : s.P;
  const double h = 1e-4 * std::sqrt(norm2(c) / static_cast<double>(c.size()));
  MlaBlock<double> bf(s.d, s.w_uv.data(), s.w_o.data(), s.scale);
  std::vector<double> yp, ym;
  for (std::size_t k = 0; k < keep.size(); ++k) {
    std::vector<double> cp = c, cm = c;
    cp[keep[k]] += h, cm[keep[k]] -= h;
    forward_with(bf, s, p, cp, yp);
    forward_with(bf, s, p, cm, ym);
    std::vector<double> fd(N);
    for (std::size_t i = 0; i < N; ++i) fd[i] = (yp[i] - ym[i]) / (2 * h);
    ASSERT_GT(norm2(ex.cols[k]), 0.0) << "column " << keep[k];
    EXPECT_LE(rel_dist(fd, ex.cols[k]), 1e-3) << "column " << keep[k];
  }
  // Hutchinson: trace and diagonal within 3 standard errors of the exact values.
  const HutchinsonEstimate hu = hutchinson(b, p, 64, 77 + static_cast<std::uint64_t>(layer));
  ASSERT_TRUE(std::isfinite(hu.trace) && hu.trace_se > 0);
  EXPECT_LE(std::fabs(hu.trace - ex.trace), 3 * hu.trace_se) << "trace " << hu.trace << " exact " << ex.trace << " se " << hu.trace_se;
  std::size_t within = 0;
  for (std::size_t i = 0; i < D; ++i) {
    ASSERT_TRUE(std::isfinite(hu.diag[i]));
    if (std::fabs(hu.diag[i] - ex.diag[i]) <= 3 * hu.diag_se[i] + 1e-12 * ex.diag[i]) ++within;
  }
  // 99.7% for a normal estimate; the estimated standard errors (63 degrees of freedom) widen the tail.
  EXPECT_GE(static_cast<double>(within) / static_cast<double>(D), 0.98) << within << " of " << D;
  // The decomposition with the exact diagonal reproduces the JVP gain of the quantizer direction.
  const std::vector<double> e = randn(D, 99);
  const double G = jvp_gain(b, p, e.data());
  const GainTerms g = decompose_gain(G * norm2(e), ex.diag, ex.trace, e);
  EXPECT_NEAR(g.T * g.A * (1 + g.O), G, 1e-12 * G);
}

}  // namespace

// ---- The decomposition ------------------------------------------------------------------------

TEST(GainDecomposition, ReproducesGExactlyForRandomPsdH) {
  for (std::uint64_t seed = 1; seed <= 20; ++seed) {
    const std::size_t D = 5 + seed * 3, k = 1 + seed % 7;  // rank-deficient H included
    const auto B = randn(D * k, seed * 101);
    std::vector<double> H(D * D, 0.0);
    for (std::size_t i = 0; i < D; ++i)
      for (std::size_t j = 0; j < D; ++j)
        for (std::size_t r = 0; r < k; ++r) H[i * D + j] += B[i * k + r] * B[j * k + r];
    const auto e = randn(D, seed * 103);
    double q = 0, tr = 0, dsum = 0;
    for (std::size_t i = 0; i < D; ++i) {
      tr += H[i * D + i];
      dsum += H[i * D + i] * e[i] * e[i];
      for (std::size_t j = 0; j < D; ++j) q += e[i] * H[i * D + j] * e[j];
    }
    const GainTerms g = decompose_gain_dense(H, e);
    const double G = q / norm2(e);
    ASSERT_TRUE(std::isfinite(g.G) && std::isfinite(g.A) && std::isfinite(g.O));
    EXPECT_NEAR(g.G, G, 1e-12 * G);
    EXPECT_NEAR(g.T, tr / static_cast<double>(D), 1e-12 * tr);
    EXPECT_NEAR(g.A, dsum / (g.T * norm2(e)), 1e-12 * g.A);
    EXPECT_NEAR(g.O, (q - dsum) / dsum, 1e-12 * std::max(1.0, std::fabs(g.O)));
    EXPECT_NEAR(g.T * g.A * (1 + g.O), g.G, 1e-12 * g.G) << "seed " << seed;
    EXPECT_GE(g.O, -1.0);  // H PSD: G >= 0
  }
  // Diagonal H: no off-diagonal coupling; isotropic H: A = 1.
  std::vector<double> Hd(9, 0.0);
  Hd[0] = 1, Hd[4] = 2, Hd[8] = 3;
  const GainTerms gd = decompose_gain_dense(Hd, {1, 1, 1});
  EXPECT_DOUBLE_EQ(gd.O, 0.0);
  EXPECT_DOUBLE_EQ(gd.A, 1.0);
  EXPECT_DOUBLE_EQ(gd.G, 2.0);
}

// ---- Small random block: path_jacobian against the VJP and the dense decomposition ---------

TEST(PathJacobian, SmallBlockMatchesVjpAndDenseGain) {
  const MlaDims d{6, 2, 8, 4, 3, 5};
  const auto w_uv = randn(static_cast<std::size_t>(d.H) * d.vd * d.dc, 1, 0.5), w_o = randn(static_cast<std::size_t>(d.hidden) * d.H * d.vd, 2, 0.5);
  const auto qa = randn(static_cast<std::size_t>(d.T) * d.H * d.dc, 3, 0.6), qr = randn(static_cast<std::size_t>(d.T) * d.H * d.dr, 4, 0.6);
  const auto C = randn(static_cast<std::size_t>(d.T) * d.dc, 5), P = randn(static_cast<std::size_t>(d.T) * d.dr, 6);
  MlaBlock<double> b(d, w_uv.data(), w_o.data(), 0.4);
  std::vector<double> y(static_cast<std::size_t>(d.T) * d.hidden);
  b.forward(qa.data(), qr.data(), C.data(), P.data(), y.data());
  for (CachePath p : {CachePath::kContent, CachePath::kRope}) {
    const std::size_t D = static_cast<std::size_t>(path_size(d, p)), N = y.size();
    const auto J = path_jacobian(b, p);
    ASSERT_EQ(J.size(), N * D);
    for (std::size_t i = 0; i < N; ++i) {
      std::vector<double> u(N, 0.0), ju(D);
      u[i] = 1;
      path_vjp(b, p, u.data(), ju.data());
      for (std::size_t j = 0; j < D; ++j) EXPECT_NEAR(ju[j], J[i * D + j], 1e-12 * std::max(1.0, std::fabs(J[i * D + j])));
    }
    std::vector<double> H(D * D, 0.0);
    for (std::size_t a = 0; a < D; ++a)
      for (std::size_t c = 0; c < D; ++c)
        for (std::size_t i = 0; i < N; ++i) H[a * D + c] += J[i * D + a] * J[i * D + c];
    const auto e = randn(D, 7);
    EXPECT_NEAR(decompose_gain_dense(H, e).G, jvp_gain(b, p, e.data()), 1e-10);
  }
}

// ---- The real 32-token slice --------------------------------------------------------------------

TEST(ExactJacobian, RopePathAllLayers) {
  for (int l = 0; l < static_cast<int>(real_slices().size()); ++l) {
    SCOPED_TRACE("layer " + std::to_string(l));
    check_exact_jacobian(l, CachePath::kRope);
  }
}

TEST(ExactJacobian, ContentPathLayer1) {
  check_exact_jacobian(1, CachePath::kContent);
}

TEST(LocalRelation, HoldsWithinFivePercentAtCacheNmse1em4) {
  const FormatSpec& f = find_format("c4r4");
  auto model = Model::load(src("models/tiny-mla"));
  const QuantizerPair qp = make_quantizers(f, model->cache_geometry(), 0, 0);
  for (std::size_t l = 0; l < real_slices().size(); ++l)
    for (CachePath p : {CachePath::kContent, CachePath::kRope}) {
      const Slice& s = real_slices()[l];
      const bool content = p == CachePath::kContent;
      const VectorQuantizer& q = content ? *qp.key : *qp.value;
      const std::vector<double>& c = content ? s.C : s.P;
      // The quantizer's QDQ error direction, rescaled to cache NMSE 1e-4.
      const int w = q.dim();
      std::vector<double> e(c.size());
      std::vector<float> x(static_cast<std::size_t>(w)), yq(static_cast<std::size_t>(w));
      std::vector<std::uint8_t> codes(q.code_bytes()), meta(q.meta_bytes());
      for (std::size_t t = 0; t < c.size() / static_cast<std::size_t>(w); ++t) {
        for (int j = 0; j < w; ++j) x[static_cast<std::size_t>(j)] = static_cast<float>(c[t * w + j]);
        q.encode(x.data(), codes.data(), meta.data());
        q.decode(codes.data(), meta.data(), yq.data());
        for (int j = 0; j < w; ++j) e[t * w + j] = static_cast<double>(yq[static_cast<std::size_t>(j)]) - x[static_cast<std::size_t>(j)];
      }
      ASSERT_GT(norm2(e), 0.0);
      const double nmse = 1e-4, fct = std::sqrt(nmse * norm2(c) / norm2(e));
      for (auto& v : e) v *= fct;
      MlaBlock<double> b(s.d, s.w_uv.data(), s.w_o.data(), s.scale);
      std::vector<double> y0, y1;
      forward_with(b, s, p, c, y0);
      const double G = jvp_gain(b, p, e.data());
      std::vector<double> cp = c;
      for (std::size_t i = 0; i < c.size(); ++i) cp[i] += e[i];
      forward_with(b, s, p, cp, y1);
      double dy = 0;
      for (std::size_t i = 0; i < y0.size(); ++i) dy += (y1[i] - y0[i]) * (y1[i] - y0[i]);
      const double nmse_out = dy / norm2(y0), local = nmse * norm2(c) / norm2(y0) * G;
      ASSERT_TRUE(std::isfinite(nmse_out) && nmse_out > 0);
      EXPECT_NEAR(nmse_out / local, 1.0, 0.05) << "layer " << l << " " << cache_path_name(p);
    }
}

// ---- Statistics ---------------------------------------------------------------------------------

TEST(Statistics, SpearmanQuantileAndPredictor) {
  EXPECT_DOUBLE_EQ(spearman({1, 2, 3, 4}, {10, 20, 30, 1000}), 1.0);
  EXPECT_DOUBLE_EQ(spearman({1, 2, 3, 4}, {4, 3, 2, 1}), -1.0);
  EXPECT_NEAR(spearman({1, 2, 2, 3}, {1, 2, 3, 4}), 0.9486832980505138, 1e-12);  // ties get average ranks
  EXPECT_TRUE(std::isnan(spearman({1, 2, NAN}, {1, 2, 3})));
  EXPECT_DOUBLE_EQ(quantile({4, 1, 3, 2}, 0.5), 2.5);
  EXPECT_DOUBLE_EQ(quantile({4, 1, 3, 2}, 0.25), 1.75);
  // Target exactly trace + allocation + 0.3: the full predictor is exact and the controls are not.
  std::vector<PredictorPoint> pts;
  for (int i = 0; i < 20; ++i) {
    const double lt = std::sin(i * 1.3), la = 0.5 * std::cos(i * 0.7);
    pts.push_back({lt + la + 0.3, lt, la, i % 2 == 0});
  }
  const auto s = fit_predictors(pts);
  ASSERT_EQ(s.size(), 3u);
  EXPECT_NEAR(s[0].gamma, 0.3, 1e-12);
  EXPECT_NEAR(s[0].rmse, 0.0, 1e-12);
  EXPECT_NEAR(s[0].r2, 1.0, 1e-12);
  EXPECT_GT(s[1].rmse, 0.1);
  EXPECT_GT(s[2].rmse, s[1].rmse);
  EXPECT_TRUE(std::isnan(s[2].pearson));
}

// ---- The drivers --------------------------------------------------------------------------------

TEST(Drivers, ResponseAndJacobianEndToEnd) {
  AnalysisOptions o;
  o.model_dir = src("models/tiny-mla");
  o.texts = {src("data/validation.txt")};
  o.seeds = {0, 1};
  o.seqs = 2;
  o.seq_len = 48;
  const ResponseResult r = analyze_response(o);
  ASSERT_EQ(r.cells.size(), 2u);
  double sc = 0, sp = 0;
  for (const auto& L : r.cells[0].layers) {
    ASSERT_TRUE(std::isfinite(L.r_c) && std::isfinite(L.r_p));
    EXPECT_GT(L.r_c, 0);
    EXPECT_GT(L.r_p, 0);
    EXPECT_LT(L.block_rel_err, 1e-4);
    EXPECT_DOUBLE_EQ(L.ratio, L.r_p / L.r_c);
    sc += L.r_c, sp += L.r_p;
  }
  EXPECT_NEAR(r.cells[0].model_ratio, sp / sc, 1e-12);
  auto jr = nlohmann::json::parse(r.json);
  EXPECT_EQ(jr["options"]["seq_len"], 48);
  EXPECT_EQ(jr["cells"].size(), 2u);

  o.nmse = 1e-3;
  o.seqs = 1;
  o.probes = 8;
  o.permutations = 2;
  const JacobianResult j = analyze_jacobian(o);
  ASSERT_EQ(j.cells.size(), 2u);
  for (const auto& c : j.cells)
    for (const auto& L : c.layers)
      for (const auto* p : {&L.c, &L.p}) {
        ASSERT_TRUE(std::isfinite(p->g.G) && p->g.G > 0);
        EXPECT_NEAR(p->g.T * p->g.A * (1 + p->g.O), p->g.G, 1e-9 * p->g.G);
        // At cache NMSE 1e-3 the finite response follows the linearization closely.
        EXPECT_NEAR(p->r_finite / p->r_local, 1.0, 0.1);
      }
  EXPECT_EQ(j.predictors.size(), 3u);
  EXPECT_EQ(j.fit_points + j.test_points, 8);
  EXPECT_GT(j.spearman, 0.9);
  EXPECT_EQ(j.spearman_n, 2 * 4 * 2 * 4);
}

TEST(Drivers, BadInputIsAClearError) {
  AnalysisOptions o;
  o.model_dir = src("models/tiny-mla");
  o.texts = {src("data/validation.txt")};
  o.seqs = 1;
  o.seq_len = 16;
  auto expect_error = [](const AnalysisOptions& x, const std::string& needle) {
    try {
      analyze_response(x);
      ADD_FAILURE() << "no error for " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  AnalysisOptions a = o;
  a.model_dir = src("models/tiny-gqa");
  expect_error(a, "needs an MLA");
  a = o;
  a.cache = "c4r5x";
  expect_error(a, "c4r5x");
  a = o;
  a.cache = "tq-3bit";
  expect_error(a, "cXrY");
  a = o;
  a.texts = {src("data/no-such-text.txt")};
  expect_error(a, "no-such-text.txt");
  a = o;
  a.model_dir = src("data");
  expect_error(a, "config.json");
  a = o;
  a.seqs = 100000;
  expect_error(a, "needed for");
  a = o;
  a.nmse = 0;
  expect_error(a, "NMSE");
  a = o;
  a.probes = 1;
  EXPECT_THROW(analyze_jacobian(a), Error);
}
