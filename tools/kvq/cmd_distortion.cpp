// `kvq distortion`: the TurboQuant chapter's experiments, on its synthetic inputs and on the
// real cache dumps of the fixture models (models/*/reference.safetensors), per layer.
//  - vs_naive (section 5, tq_vs_naive.py): 3-bit keys; key relative MSE, logit RMSE and top-1
//    agreement of six schemes.
//  - prod (section 6, tq_prod.py): inner-product slope and residual of MSE vs MSE+QJL; a
//    peaked softmax with a needle: p(needle), TV distance, output error.
//  - signs (section 8, tq_signs.py): H x against H D x on ordinary and Walsh-aligned inputs.
// Real keys are rotated by RoPE first (the cache stores keys after RoPE); the dumps hold no
// queries, so logits on real data use the layer's own later keys (positions 256..511) as
// queries against the first 256 keys: a stand-in, stated in the output.
#include <fmt/core.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>

#include "command.hpp"
#include "kvq/baselines.hpp"
#include "kvq/quantizers.hpp"
#include "kvq/rng.hpp"
#include "kvq/safetensors.hpp"
#include "table.hpp"

namespace {

using Mat = std::vector<float>;  // row-major n x d
using kvq::cli::Table;

struct Rng {
  std::mt19937_64 g;
  std::normal_distribution<double> nd;
  explicit Rng(std::uint64_t s) : g(s) {}
  double normal() { return nd(g); }
};

Mat qdq_with(const kvq::VectorQuantizer& q, const Mat& x, std::size_t n) {
  const std::size_t d = static_cast<std::size_t>(q.dim());
  Mat y(x.size());
  std::vector<std::uint8_t> rec(n * q.bytes());
  q.encode_batch(x.data(), n, rec.data());
  q.decode_batch(rec.data(), n, y.data());
  (void)d;
  return y;
}

struct LogitStats {
  double key_rel_mse, logit_rmse, top1;
};

LogitStats logit_stats(const Mat& k, const Mat& kh, const Mat& q, std::size_t nk, std::size_t nq, int d) {
  double e = 0, s = 0;
  for (std::size_t i = 0; i < k.size(); ++i) {
    e += (static_cast<double>(k[i]) - kh[i]) * (static_cast<double>(k[i]) - kh[i]);
    s += static_cast<double>(k[i]) * k[i];
  }
  double se = 0;
  int agree = 0;
  const double inv = 1.0 / std::sqrt(static_cast<double>(d));
  for (std::size_t a = 0; a < nq; ++a) {
    std::size_t best = 0, besth = 0;
    double bv = -1e300, bh = -1e300;
    for (std::size_t b = 0; b < nk; ++b) {
      double l = 0, lh = 0;
      for (int c = 0; c < d; ++c) {
        l += static_cast<double>(q[a * static_cast<std::size_t>(d) + static_cast<std::size_t>(c)]) * k[b * static_cast<std::size_t>(d) + static_cast<std::size_t>(c)];
        lh += static_cast<double>(q[a * static_cast<std::size_t>(d) + static_cast<std::size_t>(c)]) * kh[b * static_cast<std::size_t>(d) + static_cast<std::size_t>(c)];
      }
      l *= inv;
      lh *= inv;
      se += (l - lh) * (l - lh);
      if (l > bv) bv = l, best = b;
      if (lh > bh) bh = lh, besth = b;
    }
    agree += best == besth;
  }
  return {e / s, std::sqrt(se / static_cast<double>(nq * nk)), static_cast<double>(agree) / static_cast<double>(nq)};
}

// The six 3-bit schemes of tq_vs_naive.py.
std::vector<std::pair<std::string, Mat>> six_schemes(const Mat& k, std::size_t n, int d, int bits, std::uint64_t seed) {
  std::vector<std::pair<std::string, Mat>> r;
  r.emplace_back("per-token absmax", kvq::qdq_per_token_absmax(k, n, d, bits));
  r.emplace_back("per-token min-max", kvq::qdq_per_token_minmax(k, n, d, bits));
  r.emplace_back("per-channel min-max", kvq::qdq_per_channel_minmax(k, n, d, bits));
  r.emplace_back("RHT + per-token min-max", kvq::qdq_rht_per_token_minmax(k, n, d, bits, kvq::mix_seed(seed, 0, 0, 1)));
  auto rot = std::make_shared<kvq::HadamardRotation>(d, true, kvq::mix_seed(seed, 0, 0, 2));
  r.emplace_back("TurboQuant-MSE", qdq_with(kvq::TurboQuantMse(d, bits, rot, false), k, n));
  r.emplace_back("TurboQuant-MSE + norm fix", qdq_with(kvq::TurboQuantMse(d, bits, rot, true), k, n));
  return r;
}

// Llama rotate-half RoPE (pairs i, i + d/2) or DeepSeek's interleaved pairs (2i, 2i+1).
void apply_rope(Mat& x, std::size_t n, int d, bool interleaved, double theta = 10000.0) {
  for (std::size_t t = 0; t < n; ++t) {
    for (int i = 0; i < d / 2; ++i) {
      const double ang = static_cast<double>(t) * std::pow(theta, -2.0 * i / d);
      const double c = std::cos(ang), s = std::sin(ang);
      const std::size_t a = t * static_cast<std::size_t>(d) + static_cast<std::size_t>(interleaved ? 2 * i : i);
      const std::size_t b = t * static_cast<std::size_t>(d) + static_cast<std::size_t>(interleaved ? 2 * i + 1 : i + d / 2);
      const double xa = x[a], xb = x[b];
      x[a] = static_cast<float>(xa * c - xb * s);
      x[b] = static_cast<float>(xb * c + xa * s);
    }
  }
}

nlohmann::json vs_naive_synthetic(Table& t) {
  // n = 4096 keys, d = 128, 3 bits; hot channels 3, 17, 64, 101 and a per-channel offset;
  // 64 queries leaning on the same channels.
  const int d = 128, bits = 3;
  const std::size_t n = 4096, nq = 64;
  Rng rng(1);
  std::vector<double> scale(d, 1.0);
  scale[3] = 18;
  scale[17] = 12;
  scale[64] = 9;
  scale[101] = 15;
  Mat k(n * d), q(nq * d);
  for (std::size_t i = 0; i < n; ++i)
    for (int c = 0; c < d; ++c) k[i * d + static_cast<std::size_t>(c)] = static_cast<float>(rng.normal() * scale[static_cast<std::size_t>(c)] + 0.5 * scale[static_cast<std::size_t>(c)]);
  for (std::size_t i = 0; i < nq; ++i)
    for (int c = 0; c < d; ++c) q[i * d + static_cast<std::size_t>(c)] = static_cast<float>(rng.normal() * std::sqrt(scale[static_cast<std::size_t>(c)]));
  nlohmann::json rows = nlohmann::json::array();
  for (const auto& [name, kh] : six_schemes(k, n, d, bits, 11)) {
    const auto st = logit_stats(k, kh, q, n, nq, d);
    t.add({"synthetic", "-", name, fmt::format("{:.4f}", st.key_rel_mse), fmt::format("{:.3f}", st.logit_rmse), fmt::format("{:.2f}%", 100 * st.top1)});
    rows.push_back({{"input", "synthetic"}, {"scheme", name}, {"key_rel_mse", st.key_rel_mse}, {"logit_rmse", st.logit_rmse}, {"top1", st.top1}});
  }
  return rows;
}

// Real dumps: per layer and head, 3-bit schemes on post-RoPE keys (tiny-gqa), the latent and
// the post-RoPE rope key (tiny-mla).
nlohmann::json vs_naive_real(Table& t, const std::string& root) {
  nlohmann::json rows = nlohmann::json::array();
  struct Src { std::string model, tensor; int heads, d; bool rope, interleaved; };
  const std::vector<Src> srcs = {{"tiny-gqa", "k", 2, 128, true, false}, {"tiny-gqa", "v", 2, 128, false, false},
                                 {"tiny-mla", "latent", 1, 512, false, false}, {"tiny-mla", "k_rope", 1, 64, true, true}};
  for (const auto& s : srcs) {
    kvq::SafetensorsFile f(root + "/models/" + s.model + "/reference.safetensors");
    for (int layer = 0; layer < 4; ++layer) {
      const auto& tv = f.get("layer" + std::to_string(layer) + "." + s.tensor);
      const auto all = tv.to_float();
      const std::size_t n = static_cast<std::size_t>(tv.shape[0]), w = static_cast<std::size_t>(tv.shape[1]);
      for (int h = 0; h < s.heads; ++h) {
        Mat x(n * static_cast<std::size_t>(s.d));
        for (std::size_t i = 0; i < n; ++i)
          for (int c = 0; c < s.d; ++c) x[i * static_cast<std::size_t>(s.d) + static_cast<std::size_t>(c)] = all[i * w + static_cast<std::size_t>(h * s.d + c)];
        if (s.rope) apply_rope(x, n, s.d, s.interleaved);
        const std::size_t nk = n / 2, nq = n - nk;
        Mat keys(x.begin(), x.begin() + static_cast<long>(nk * static_cast<std::size_t>(s.d)));
        Mat qs(x.begin() + static_cast<long>(nk * static_cast<std::size_t>(s.d)), x.end());
        const std::string where = fmt::format("{} L{} {}{}", s.model, layer, s.tensor, s.heads > 1 ? fmt::format(" h{}", h) : "");
        for (const auto& [name, kh] : six_schemes(keys, nk, s.d, 3, 11 + static_cast<std::uint64_t>(layer))) {
          const auto st = logit_stats(keys, kh, qs, nk, nq, s.d);
          t.add({where, "later keys", name, fmt::format("{:.4f}", st.key_rel_mse), fmt::format("{:.3f}", st.logit_rmse),
                 fmt::format("{:.2f}%", 100 * st.top1)});
          rows.push_back({{"input", s.model + "." + s.tensor}, {"layer", layer}, {"head", h}, {"scheme", name},
                          {"key_rel_mse", st.key_rel_mse}, {"logit_rmse", st.logit_rmse}, {"top1", st.top1}});
        }
      }
    }
  }
  return rows;
}

nlohmann::json prod_experiment(Table& slopes, Table& att, int trials) {
  const int d = 128;
  const std::size_t n = 4096;
  nlohmann::json out;
  // Part 1: 512 correlated (q, k) pairs of unit vectors.
  Rng rng(2);
  Mat k(n * d);
  for (std::size_t i = 0; i < n; ++i) {
    double s = 0;
    for (int c = 0; c < d; ++c) {
      k[i * d + static_cast<std::size_t>(c)] = static_cast<float>(rng.normal());
      s += std::pow(k[i * d + static_cast<std::size_t>(c)], 2);
    }
    for (int c = 0; c < d; ++c) k[i * d + static_cast<std::size_t>(c)] /= static_cast<float>(std::sqrt(s));
  }
  const std::size_t np = 512;
  Mat q(np * d);
  std::vector<double> truth(np);
  for (std::size_t i = 0; i < np; ++i) {
    double s = 0;
    for (int c = 0; c < d; ++c) {
      q[i * d + static_cast<std::size_t>(c)] = k[i * d + static_cast<std::size_t>(c)] + static_cast<float>(0.6 * rng.normal() / std::sqrt(d));
      s += std::pow(q[i * d + static_cast<std::size_t>(c)], 2);
    }
    double t = 0;
    for (int c = 0; c < d; ++c) {
      q[i * d + static_cast<std::size_t>(c)] /= static_cast<float>(std::sqrt(s));
      t += static_cast<double>(q[i * d + static_cast<std::size_t>(c)]) * k[i * d + static_cast<std::size_t>(c)];
    }
    truth[i] = t;
  }
  out["inner_products"] = nlohmann::json::array();
  Mat kp(k.begin(), k.begin() + static_cast<long>(np * d));
  for (int bits : {2, 3, 4}) {
    auto rot = std::make_shared<kvq::HadamardRotation>(d, true, kvq::mix_seed(5, 0, static_cast<std::uint32_t>(bits), 1));
    std::vector<std::pair<std::string, std::unique_ptr<kvq::VectorQuantizer>>> qs;
    qs.emplace_back(fmt::format("MSE {}-bit", bits), std::make_unique<kvq::TurboQuantMse>(d, bits, rot, false));
    qs.emplace_back(fmt::format("MSE {}-bit + QJL", bits - 1), std::make_unique<kvq::TurboQuantProd>(d, bits, rot, kvq::mix_seed(5, 1, static_cast<std::uint32_t>(bits), 3)));
    for (auto& [name, qz] : qs) {
      const Mat kh = qdq_with(*qz, kp, np);
      double num = 0, den = 0;
      std::vector<double> est(np);
      for (std::size_t i = 0; i < np; ++i) {
        double e = 0;
        for (int c = 0; c < d; ++c) e += static_cast<double>(q[i * d + static_cast<std::size_t>(c)]) * kh[i * d + static_cast<std::size_t>(c)];
        est[i] = e;
        num += e * truth[i];
        den += truth[i] * truth[i];
      }
      const double slope = num / den;
      double m = 0, v = 0;
      for (std::size_t i = 0; i < np; ++i) m += est[i] - slope * truth[i];
      m /= static_cast<double>(np);
      for (std::size_t i = 0; i < np; ++i) v += std::pow(est[i] - slope * truth[i] - m, 2);
      const double sd = std::sqrt(v / static_cast<double>(np));
      slopes.add({name, fmt::format("{:.3f}", slope), fmt::format("{:.4f}", sd)});
      out["inner_products"].push_back({{"quantizer", name}, {"slope", slope}, {"resid_std", sd}});
    }
  }
  // Part 2: one needle key with logit ~ 9 above 4095 others; 3 bits per key coordinate.
  auto rot3 = std::make_shared<kvq::HadamardRotation>(d, true, kvq::mix_seed(6, 0, 0, 1));
  kvq::TurboQuantMse mse3(d, 3, rot3, false);
  kvq::TurboQuantProd prod3(d, 3, rot3, kvq::mix_seed(6, 0, 0, 3));
  const kvq::VectorQuantizer* quants[3] = {nullptr, &mse3, &prod3};
  const char* names[3] = {"fp32", "MSE 3-bit", "MSE 2-bit + QJL"};
  double acc[3][3] = {};
  Rng r2(3);
  for (int trial = 0; trial < trials; ++trial) {
    Mat K(n * d), V(n * d);
    std::vector<double> qv(d);
    for (auto& x : K) x = static_cast<float>(r2.normal());
    for (auto& x : V) x = static_cast<float>(r2.normal());
    double qq = 0;
    for (auto& x : qv) {
      x = r2.normal();
      qq += x * x;
    }
    for (int c = 0; c < d; ++c) K[7 * d + static_cast<std::size_t>(c)] = static_cast<float>(9.0 * std::sqrt(d) * qv[static_cast<std::size_t>(c)] / qq + 0.3 * K[7 * d + static_cast<std::size_t>(c)]);
    std::vector<double> pref(n), oref(d);
    for (int s = 0; s < 3; ++s) {
      const Mat Kh = quants[s] ? qdq_with(*quants[s], K, n) : K;
      std::vector<double> logits(n), p(n), o(d, 0.0);
      double mx = -1e300;
      for (std::size_t i = 0; i < n; ++i) {
        double l = 0;
        for (int c = 0; c < d; ++c) l += Kh[i * d + static_cast<std::size_t>(c)] * qv[static_cast<std::size_t>(c)];
        logits[i] = l / std::sqrt(d);
        mx = std::max(mx, logits[i]);
      }
      double z = 0;
      for (std::size_t i = 0; i < n; ++i) z += p[i] = std::exp(logits[i] - mx);
      for (std::size_t i = 0; i < n; ++i) {
        p[i] /= z;
        for (int c = 0; c < d; ++c) o[static_cast<std::size_t>(c)] += p[i] * V[i * d + static_cast<std::size_t>(c)];
      }
      if (s == 0) pref = p, oref = o;
      double tv = 0, on = 0, od = 0;
      for (std::size_t i = 0; i < n; ++i) tv += std::fabs(p[i] - pref[i]);
      for (int c = 0; c < d; ++c) {
        on += std::pow(o[static_cast<std::size_t>(c)] - oref[static_cast<std::size_t>(c)], 2);
        od += std::pow(oref[static_cast<std::size_t>(c)], 2);
      }
      acc[s][0] += p[7];
      acc[s][1] += 0.5 * tv;
      acc[s][2] += std::sqrt(on / od);
    }
  }
  out["attention"] = nlohmann::json::array();
  for (int s = 0; s < 3; ++s) {
    att.add({names[s], fmt::format("{:.3f}", acc[s][0] / trials), fmt::format("{:.3f}", acc[s][1] / trials), fmt::format("{:.3f}", acc[s][2] / trials)});
    out["attention"].push_back({{"keys", names[s]}, {"p_needle", acc[s][0] / trials}, {"tv", acc[s][1] / trials}, {"output_rel_err", acc[s][2] / trials}});
  }
  out["trials"] = trials;
  return out;
}

double signs_err(const Mat& x, std::size_t n, int d, bool randomize) {
  kvq::TurboQuantMse q(d, 3, std::make_shared<kvq::HadamardRotation>(d, randomize, kvq::mix_seed(4, 0, 0, 1)), false);
  Mat u(x.size());
  for (std::size_t i = 0; i < n; ++i) {
    double s = 0;
    for (int c = 0; c < d; ++c) s += std::pow(x[i * static_cast<std::size_t>(d) + static_cast<std::size_t>(c)], 2);
    for (int c = 0; c < d; ++c) u[i * static_cast<std::size_t>(d) + static_cast<std::size_t>(c)] = static_cast<float>(x[i * static_cast<std::size_t>(d) + static_cast<std::size_t>(c)] / std::sqrt(s));
  }
  const Mat uh = qdq_with(q, u, n);
  double e = 0;
  for (std::size_t i = 0; i < u.size(); ++i) e += std::pow(static_cast<double>(u[i]) - uh[i], 2);
  return e / static_cast<double>(n);
}

nlohmann::json signs_experiment(Table& t, const std::string& root) {
  const int d = 128;
  const std::size_t n = 4096;
  Rng rng(4);
  std::vector<double> scale(d, 1.0);
  scale[3] = 18;
  scale[17] = 12;
  scale[64] = 9;
  scale[101] = 15;
  Mat ordinary(n * d), walshy(n * d);
  std::mt19937 pick(4);
  for (std::size_t i = 0; i < n; ++i) {
    const unsigned row = pick() % d;
    for (int c = 0; c < d; ++c) {
      ordinary[i * d + static_cast<std::size_t>(c)] = static_cast<float>(rng.normal() * scale[static_cast<std::size_t>(c)]);
      walshy[i * d + static_cast<std::size_t>(c)] = static_cast<float>(((__builtin_popcount(row & static_cast<unsigned>(c)) & 1) ? -3.0 : 3.0) + 0.3 * rng.normal());
    }
  }
  nlohmann::json rows = nlohmann::json::array();
  auto add = [&](const std::string& name, const Mat& x, std::size_t nn) {
    const double a = signs_err(x, nn, d, false), b = signs_err(x, nn, d, true);
    t.add({name, fmt::format("{:.4f}", a), fmt::format("{:.4f}", b)});
    rows.push_back({{"input", name}, {"hx", a}, {"hdx", b}});
  };
  add("Gaussian + outlier channels", ordinary, n);
  add("near Walsh rows", walshy, n);
  kvq::SafetensorsFile f(root + "/models/tiny-gqa/reference.safetensors");
  for (int layer = 0; layer < 4; ++layer) {
    const auto& tv = f.get("layer" + std::to_string(layer) + ".k");
    const auto all = tv.to_float();
    const std::size_t nn = static_cast<std::size_t>(tv.shape[0]);
    Mat x(nn * d);
    for (std::size_t i = 0; i < nn; ++i)
      for (int c = 0; c < d; ++c) x[i * d + static_cast<std::size_t>(c)] = all[i * 256 + static_cast<std::size_t>(c)];
    apply_rope(x, nn, d, false);
    add(fmt::format("tiny-gqa L{} keys h0", layer), x, nn);
  }
  return rows;
}

void run(const std::string& only, int trials, bool json) {
  const std::string root = kvq::cli::resolve_path(".");
  std::string models_root = kvq::cli::resolve_path("models");
  models_root = models_root.substr(0, models_root.size() - std::string("models").size());
  if (models_root.empty()) models_root = ".";
  nlohmann::json out;
  const bool all = only.empty();
  if (all || only == "vs_naive") {
    Table t({"input", "queries", "scheme", "key rel. MSE", "logit RMSE", "top-1 match"});
    out["vs_naive"] = vs_naive_synthetic(t);
    out["vs_naive_real"] = vs_naive_real(t, models_root);
    if (!json) {
      fmt::print("== vs_naive: 3 bits per coordinate (synthetic: n=4096 keys, d=128, hot channels; real: first 256 keys of each dump, queries = keys 256..511)\n");
      t.print(stdout, 3);
    }
  }
  if (all || only == "prod") {
    Table s({"quantizer", "slope", "resid std"}), a({"keys", "p(needle)", "TV distance", "output rel err"});
    out["prod"] = prod_experiment(s, a, trials);
    if (!json) {
      fmt::print("\n== prod: inner products, 512 correlated (q, k) pairs\n");
      s.print();
      fmt::print("\n== prod: attention, 3 bits per key coordinate, {} trials\n", trials);
      a.print();
    }
  }
  if (all || only == "signs") {
    Table t({"input", "H x", "H D x"});
    out["signs"] = signs_experiment(t, models_root);
    if (!json) {
      fmt::print("\n== signs: 3-bit relative error (model {:.4f})\n", kvq::sphere_codebook(128, 3).mse);
      t.print();
    }
  }
  if (json) fmt::print("{}\n", out.dump(1));
  (void)root;
}

void register_cmd(CLI::App& app) {
  auto* cmd = app.add_subcommand("distortion", "The TurboQuant chapter's distortion experiments, synthetic and on the fixture caches");
  auto only = std::make_shared<std::string>();
  auto trials = std::make_shared<int>(200);
  auto json = std::make_shared<bool>(false);
  cmd->add_option("--experiment", *only, "one of vs_naive, prod, signs (default: all)")
      ->check(CLI::IsMember({"vs_naive", "prod", "signs"}));
  cmd->add_option("--trials", *trials, "attention trials of the prod experiment")->check(CLI::Range(1, 100000));
  cmd->add_flag("--json", *json, "print one JSON object");
  cmd->callback([=] { run(*only, *trials, *json); });
}

}  // namespace

KVQ_REGISTER_COMMAND("distortion", register_cmd);
