// `kvq eval`'s measurements (include/kvq/quality.hpp): paired perplexity / KL / top-1 against
// the bf16 cache, needle retrieval and per-layer attention diagnostics.
#include "kvq/quality.hpp"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <fstream>
#include <limits>
#include <random>
#include <set>
#include <sstream>

#include "kvq/common.hpp"
#include "kvq/eval.hpp"
#include "kvq/numeric.hpp"

namespace kvq {

namespace {

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) fail(path + ": cannot open");
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// log-softmax of one row in double.
void log_softmax(const float* x, int n, std::vector<double>& out) {
  out.resize(static_cast<std::size_t>(n));
  double mx = -std::numeric_limits<double>::infinity();
  for (int i = 0; i < n; ++i) mx = std::max(mx, static_cast<double>(x[i]));
  double z = 0;
  for (int i = 0; i < n; ++i) z += std::exp(static_cast<double>(x[i]) - mx);
  const double lz = mx + std::log(z);
  for (int i = 0; i < n; ++i) out[static_cast<std::size_t>(i)] = static_cast<double>(x[i]) - lz;
}

int argmax(const float* x, int n) { return static_cast<int>(std::max_element(x, x + n) - x); }

std::unique_ptr<PagedCache> make_cache(const CacheGeometry& g, const CacheConfig& c,
                                       const std::shared_ptr<const OutlierChannels>& oc) {
  CacheOptions o;
  o.format = c.format;
  o.protect = c.protect;
  o.outliers = oc;
  return std::make_unique<PagedCache>(g, o);
}

}  // namespace

CacheConfig parse_cache_config(const std::string& spec, const ProtectionPolicy& def) {
  CacheConfig c;
  c.label = spec;
  const auto at = spec.find('@');
  c.format = spec.substr(0, at);
  find_format(c.format);  // validates the name (lists the valid ones)
  c.protect = def;
  if (at == std::string::npos) return c;
  const std::string pol = spec.substr(at + 1);
  if (pol == "paper") {
    c.protect = ProtectionPolicy::paper();
    return c;
  }
  c.protect = ProtectionPolicy{};
  std::stringstream ss(pol);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item.size() < 2) fail("bad protection '" + pol + "' in '" + spec + "' (use @paper or @s4,w128,n1)");
    int v = 0;
    try {
      std::size_t used = 0;
      v = std::stoi(item.substr(1), &used);
      if (used != item.size() - 1 || v < 0) throw std::invalid_argument(item);
    } catch (const std::exception&) {
      fail("bad protection value '" + item + "' in '" + spec + "'");
    }
    switch (item[0]) {
      case 's': c.protect.sinks = v; break;
      case 'w': c.protect.window = v; break;
      case 'n': c.protect.boundary_layers = v; break;
      default: fail("bad protection key '" + item + "' in '" + spec + "' (s = sinks, w = window, n = boundary layers)");
    }
  }
  return c;
}

std::vector<std::string> needle_words(const std::string& text) {
  std::vector<std::string> out;
  std::set<std::string> seen;
  std::string cur;
  auto flush = [&] {
    if (cur.size() >= 4 && cur.size() <= 9 && seen.insert(cur).second) out.push_back(cur);
    cur.clear();
  };
  for (std::size_t i = 0; i <= text.size(); ++i) {
    const char ch = i < text.size() ? text[i] : ' ';
    if (ch >= 'a' && ch <= 'z') {
      cur.push_back(ch);
    } else if ((ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '_' || static_cast<unsigned char>(ch) >= 0x80) {
      // Part of a word that is not lowercase alphabetic: skip the whole word.
      cur.clear();
      while (i + 1 < text.size() && (std::isalnum(static_cast<unsigned char>(text[i + 1])) || text[i + 1] == '_' ||
                                     static_cast<unsigned char>(text[i + 1]) >= 0x80))
        ++i;
    } else {
      flush();
    }
  }
  return out;
}

std::vector<NeedleSample> make_needle_samples(const Tokenizer& tok, const std::vector<std::int32_t>& filler_stream,
                                              const std::vector<std::string>& words, int length, int count,
                                              std::uint64_t seed, std::int32_t bos) {
  require(!words.empty(), "needle: no candidate words");
  std::mt19937_64 rng(seed ^ (static_cast<std::uint64_t>(length) * 0x9e3779b97f4a7c15ull));
  std::vector<NeedleSample> out;
  for (int i = 0; i < count; ++i) {
    const std::string& w = words[rng() % words.size()];
    std::string code;
    for (int d = 0; d < 6; ++d) {
      if (d) code.push_back(' ');
      code.push_back(static_cast<char>('0' + rng() % 10));
    }
    const auto needle = tok.encode(" The secret code for " + w + " is " + code + ". ");
    const auto question = tok.encode(" What is the secret code for " + w + "? The secret code for " + w + " is");
    const auto answer = tok.encode(" " + code + ".");
    const int fixed = 1 + static_cast<int>(needle.size() + question.size() + answer.size());
    const int filler = length - fixed;
    require(filler > 0, "needle: length " + std::to_string(length) + " is too short for the needle");
    require(static_cast<std::size_t>(filler) < filler_stream.size(), "needle: filler stream too short");
    const std::size_t start = rng() % (filler_stream.size() - static_cast<std::size_t>(filler));
    // Depth stratified over deciles: sample i lands in decile i % 10.
    const double u = static_cast<double>(rng() >> 11) * 0x1.0p-53;
    const double depth = (static_cast<double>(i % 10) + u) / 10.0;
    const int at = static_cast<int>(depth * filler);
    NeedleSample s;
    s.length = length;
    s.depth = depth;
    s.tokens.push_back(bos);
    s.tokens.insert(s.tokens.end(), filler_stream.begin() + static_cast<long>(start), filler_stream.begin() + static_cast<long>(start) + at);
    s.tokens.insert(s.tokens.end(), needle.begin(), needle.end());
    s.tokens.insert(s.tokens.end(), filler_stream.begin() + static_cast<long>(start) + at,
                    filler_stream.begin() + static_cast<long>(start) + filler);
    s.tokens.insert(s.tokens.end(), question.begin(), question.end());
    s.answer_start = static_cast<int>(s.tokens.size());
    s.tokens.insert(s.tokens.end(), answer.begin(), answer.end());
    out.push_back(std::move(s));
  }
  return out;
}

bool format_needs_calibration(const FormatSpec& f) {
  return f.kind == FormatKind::kTqSplit || format_uses_centering(f);
}

std::unique_ptr<PagedCache> calibration_stats(Model& model, const Tokenizer& tok, const std::string& text, int tokens,
                                              int ctx) {
  const auto& cfg = model.config();
  const auto stream = ppl_token_stream(text, [&](std::string_view s) { return tok.encode(s); }, cfg.eos_token_ids.at(0));
  CacheOptions o;
  o.format = "bf16";
  auto cache = std::make_unique<PagedCache>(model.cache_geometry(), o);
  cache->collect_channel_stats(true);
  int done = 0;
  for (std::size_t off = 0; done < tokens && off + 2 < stream.size(); off += static_cast<std::size_t>(ctx)) {
    const int n = static_cast<int>(std::min<std::size_t>(static_cast<std::size_t>(std::min(ctx, tokens - done)), stream.size() - off));
    cache->reset(0);
    model.forward(&stream[off], n, *cache, 0, nullptr, LogitsMode::kNone);
    done += n;
  }
  return cache;
}

std::shared_ptr<FormatCalibration> calibrate_format(Model& model, const Tokenizer& tok, const std::string& text,
                                                    const FormatSpec& f, int tokens, int ctx) {
  if (!format_needs_calibration(f)) return nullptr;
  return calibration_stats(model, tok, text, tokens, ctx)->calibration(f);
}

namespace {

// Captured bf16 run of one window for the diagnostics.
struct Capture {
  std::vector<std::vector<float>> q, k, v;
  int n = 0, n_heads = 0, q_dim = 0;
  float scale = 0;
};

// Diagnostics of one layer for one configuration, on sampled query positions.
LayerDiagnostics layer_diag(const CacheGeometry& g, const CacheConfig& cfg, const std::shared_ptr<const OutlierChannels>& oc,
                            const Capture& cap, int layer, const std::vector<int>& queries) {
  auto cache = make_cache(g, cfg, oc);
  const auto& qv = cap.q[static_cast<std::size_t>(layer)];
  const auto& kv = cap.k[static_cast<std::size_t>(layer)];
  const auto& vv = cap.v[static_cast<std::size_t>(layer)];
  cache->append(0, layer, cap.n, kv.data(), vv.data());
  const bool mla = g.mla;
  const int heads = mla ? 1 : g.n_kv_heads;
  const int dk = mla ? g.d_latent : g.head_dim, dv = mla ? g.d_rope : g.v_head_dim;
  const std::size_t rk = static_cast<std::size_t>(heads * dk), rv = static_cast<std::size_t>(heads * dv);
  const int n = cap.n;
  // Packed rows once; reference rows are the bf16-rounded captured rows (the bf16 cache).
  std::vector<float> Kp(static_cast<std::size_t>(n) * rk), Vp(static_cast<std::size_t>(n) * rv);
  for (int t = 0; t < n; ++t) cache->read_row(0, layer, t, -1, &Kp[static_cast<std::size_t>(t) * rk], &Vp[static_cast<std::size_t>(t) * rv]);
  std::vector<float> Kb(kv.size()), Vb(vv.size());
  for (std::size_t i = 0; i < kv.size(); ++i) Kb[i] = round_bf16(kv[i]);
  for (std::size_t i = 0; i < vv.size(); ++i) Vb[i] = round_bf16(vv[i]);
  // Boundary layers store bf16 pages: Kp equals Kb there already.
  const int group = mla ? cap.n_heads : cap.n_heads / heads;
  const int odim = mla ? dk : dv;
  double se = 0, cnt = 0, tv = 0, top8 = 0, on = 0, od = 0, rows = 0;
  for (int p : queries) {
    for (int h = 0; h < cap.n_heads; ++h) {
      const int gi = mla ? 0 : h / group;
      const float* qh = &qv[static_cast<std::size_t>(p) * static_cast<std::size_t>(cap.q_dim) + static_cast<std::size_t>(h) * static_cast<std::size_t>(mla ? dk + dv : dk)];
      std::vector<double> s0(static_cast<std::size_t>(p + 1)), s1(static_cast<std::size_t>(p + 1));
      for (int t = 0; t <= p; ++t) {
        const bool prot = cache->is_protected(t, p) || cache->layer_format(layer).name == "bf16";
        const float* kb = &Kb[static_cast<std::size_t>(t) * rk + static_cast<std::size_t>(gi) * static_cast<std::size_t>(dk)];
        const float* kq = prot ? kb : &Kp[static_cast<std::size_t>(t) * rk + static_cast<std::size_t>(gi) * static_cast<std::size_t>(dk)];
        double a = 0, b = 0;
        for (int c = 0; c < dk; ++c) {
          a += static_cast<double>(qh[c]) * kb[c];
          b += static_cast<double>(qh[c]) * kq[c];
        }
        if (mla) {
          const float* rb = &Vb[static_cast<std::size_t>(t) * rv];
          const float* rq = prot ? rb : &Vp[static_cast<std::size_t>(t) * rv];
          for (int c = 0; c < dv; ++c) {
            a += static_cast<double>(qh[dk + c]) * rb[c];
            b += static_cast<double>(qh[dk + c]) * rq[c];
          }
        }
        s0[static_cast<std::size_t>(t)] = a * cap.scale;
        s1[static_cast<std::size_t>(t)] = b * cap.scale;
        se += (a - b) * (a - b) * cap.scale * cap.scale;
        cnt += 1;
      }
      auto softmax = [](std::vector<double>& s) {
        const double mx = *std::max_element(s.begin(), s.end());
        double z = 0;
        for (auto& x : s) z += (x = std::exp(x - mx));
        for (auto& x : s) x /= z;
      };
      softmax(s0);
      softmax(s1);
      double d = 0;
      for (int t = 0; t <= p; ++t) d += std::fabs(s0[static_cast<std::size_t>(t)] - s1[static_cast<std::size_t>(t)]);
      tv += 0.5 * d;
      const int k = std::min(8, p + 1);
      std::vector<int> i0(static_cast<std::size_t>(p + 1)), i1(static_cast<std::size_t>(p + 1));
      for (int t = 0; t <= p; ++t) i0[static_cast<std::size_t>(t)] = i1[static_cast<std::size_t>(t)] = t;
      std::partial_sort(i0.begin(), i0.begin() + k, i0.end(), [&](int a, int b) { return s0[static_cast<std::size_t>(a)] > s0[static_cast<std::size_t>(b)]; });
      std::partial_sort(i1.begin(), i1.begin() + k, i1.end(), [&](int a, int b) { return s1[static_cast<std::size_t>(a)] > s1[static_cast<std::size_t>(b)]; });
      int common = 0;
      for (int a = 0; a < k; ++a)
        for (int b = 0; b < k; ++b) common += i0[static_cast<std::size_t>(a)] == i1[static_cast<std::size_t>(b)];
      top8 += static_cast<double>(common) / k;
      // Outputs: bf16 values vs the values the quantized cache serves.
      std::vector<double> o0(static_cast<std::size_t>(odim), 0.0), o1(static_cast<std::size_t>(odim), 0.0);
      for (int t = 0; t <= p; ++t) {
        const bool prot = cache->is_protected(t, p) || cache->layer_format(layer).name == "bf16";
        const float* vb = mla ? &Kb[static_cast<std::size_t>(t) * rk] : &Vb[static_cast<std::size_t>(t) * rv + static_cast<std::size_t>(gi) * static_cast<std::size_t>(dv)];
        const float* vq = prot ? vb : (mla ? &Kp[static_cast<std::size_t>(t) * rk] : &Vp[static_cast<std::size_t>(t) * rv + static_cast<std::size_t>(gi) * static_cast<std::size_t>(dv)]);
        for (int c = 0; c < odim; ++c) {
          o0[static_cast<std::size_t>(c)] += s0[static_cast<std::size_t>(t)] * vb[c];
          o1[static_cast<std::size_t>(c)] += s1[static_cast<std::size_t>(t)] * vq[c];
        }
      }
      for (int c = 0; c < odim; ++c) {
        on += (o0[static_cast<std::size_t>(c)] - o1[static_cast<std::size_t>(c)]) * (o0[static_cast<std::size_t>(c)] - o1[static_cast<std::size_t>(c)]);
        od += o0[static_cast<std::size_t>(c)] * o0[static_cast<std::size_t>(c)];
      }
      rows += 1;
    }
  }
  LayerDiagnostics r;
  r.logit_rmse = std::sqrt(se / cnt);
  r.tv = tv / rows;
  r.top8 = top8 / rows;
  r.out_nmse = od > 0 ? on / od : 0;
  return r;
}

}  // namespace

namespace {
// Records every layer's queries and appended rows of the next forward call into `cap`.
void capture_into(Model& model, Capture& cap) {
  cap.q.assign(static_cast<std::size_t>(model.cache_geometry().n_layers), {});
  cap.k = cap.v = cap.q;
  cap.n = 0;
  model.set_observer([&cap](const LayerTrace& t) {
    auto app = [](std::vector<float>& dst, const float* src, std::size_t cnt) { dst.insert(dst.end(), src, src + cnt); };
    app(cap.q[static_cast<std::size_t>(t.layer)], t.q, static_cast<std::size_t>(t.n) * static_cast<std::size_t>(t.q_dim));
    app(cap.k[static_cast<std::size_t>(t.layer)], t.k, static_cast<std::size_t>(t.n) * static_cast<std::size_t>(t.k_dim));
    app(cap.v[static_cast<std::size_t>(t.layer)], t.v, static_cast<std::size_t>(t.n) * static_cast<std::size_t>(t.v_dim));
    cap.n_heads = t.n_heads;
    cap.q_dim = t.q_dim;
    cap.scale = t.scale;
    if (t.layer == 0) cap.n += t.n;
  });
}
}  // namespace

ModelEvalResult evaluate_model(const std::string& model_dir, const std::vector<CacheConfig>& configs,
                               const std::string& text_path, const EvalOptions& opt) {
  auto model = Model::load(model_dir);
  const auto& cfg = model->config();
  require(!cfg.eos_token_ids.empty(), model_dir + "/config.json: no eos_token_id (the protocol appends <|eos|>)");
  require(opt.ctx >= 2 && opt.ctx <= cfg.max_position_embeddings,
          "--ctx must be 2.." + std::to_string(cfg.max_position_embeddings));
  auto tok = Tokenizer::load(model_dir + "/tokenizer.json");
  const CacheGeometry geo = model->cache_geometry();
  for (const auto& c : configs) check_format_fits(find_format(c.format), geo);

  ModelEvalResult res;
  res.model_dir = model_dir;
  res.architecture = cfg.architecture;
  res.geometry = geo;
  std::unique_ptr<Model> base_owner;
  Model* bmodel = model.get();
  if (!opt.baseline_model.empty()) {
    base_owner = Model::load(opt.baseline_model);
    const auto& bc = base_owner->config();
    const CacheGeometry bg = base_owner->cache_geometry();
    if (bc.vocab_size != cfg.vocab_size || bc.bos_token_id != cfg.bos_token_id || bg.n_layers != geo.n_layers ||
        bg.mla != geo.mla || bg.d_latent != geo.d_latent || bg.d_rope != geo.d_rope || bg.n_kv_heads != geo.n_kv_heads ||
        bg.head_dim != geo.head_dim)
      fail("--baseline-model " + opt.baseline_model + " does not match " + model_dir + " (vocabulary, special tokens or cache shape)");
    bmodel = base_owner.get();
    res.baseline_model = opt.baseline_model;
  }

  const std::string text = read_text(text_path);
  const auto stream = ppl_token_stream(text, [&](std::string_view s) { return tok->encode(s); }, cfg.eos_token_ids[0]);
  const int total = ppl_full_windows(stream.size(), opt.ctx);
  require(total > 0, text_path + ": too short for one window of " + std::to_string(opt.ctx) + " tokens");
  const int windows = opt.windows > 0 ? std::min(opt.windows, total) : total;
  res.windows = windows;

  // Outlier calibration on the calibration text (never the evaluation text).
  // One bf16 pass over the calibration text collects the statistics every format draws on.
  std::map<std::string, std::shared_ptr<const OutlierChannels>> outliers;
  std::unique_ptr<PagedCache> stats;
  for (const auto& c : configs) {
    const auto& f = find_format(c.format);
    if (!format_needs_calibration(f) || outliers.count(c.format)) continue;
    require(!opt.calib_text.empty(), "format " + c.format + " needs a calibration text");
    if (!stats) {
      if (opt.progress) opt.progress("calibrating", 0.0);
      stats = calibration_stats(*model, *tok, read_text(opt.calib_text), opt.calib_tokens, opt.ctx);
    }
    outliers[c.format] = stats->calibration(f);
  }
  auto oc_of = [&](const CacheConfig& c) {
    auto it = outliers.find(c.format);
    return it == outliers.end() ? std::shared_ptr<const OutlierChannels>() : it->second;
  };

  res.rows.resize(configs.size());
  for (std::size_t i = 0; i < configs.size(); ++i) {
    auto& r = res.rows[i];
    r.config = configs[i];
    const auto& f = find_format(configs[i].format);
    const auto tb = token_bytes(f, geo);
    r.bits_per_value = tb.bits_per_value;
    // Bytes per token for all layers, boundary layers at bf16.
    double bytes = 0;
    for (int l = 0; l < geo.n_layers; ++l) {
      const bool boundary = l < configs[i].protect.boundary_layers || l >= geo.n_layers - configs[i].protect.boundary_layers;
      bytes += static_cast<double>(boundary ? bf16_token_bytes(geo) : tb.per_layer);
    }
    r.bytes_per_token = bytes;
    r.compression = static_cast<double>(bf16_token_bytes(geo)) * geo.n_layers / bytes;
  }

  // Paired perplexity / KL / top-1, window by window.
  const int vocab = cfg.vocab_size;
  const int n = opt.ctx;
  std::vector<float> ref(static_cast<std::size_t>(n) * static_cast<std::size_t>(vocab)), lg(ref.size());
  std::vector<double> nll_sum(configs.size(), 0.0), kl_sum(configs.size(), 0.0), top1_sum(configs.size(), 0.0),
      secs(configs.size(), 0.0);
  double ref_nll = 0;
  Capture cap;
  std::vector<std::int32_t> win(static_cast<std::size_t>(n));
  CacheOptions bo;
  bo.format = "bf16";
  for (int w = 0; w < windows; ++w) {
    win[0] = cfg.bos_token_id;
    std::copy(stream.begin() + static_cast<long>(w) * n, stream.begin() + static_cast<long>(w) * n + (n - 1), win.begin() + 1);
    if (w == 0 && opt.diagnostics && bmodel != model.get()) {
      // Diagnostics work on the evaluated model's own bf16 rows (its cache coordinates).
      PagedCache c(geo, bo);
      capture_into(*model, cap);
      model->forward(win.data(), n, c, 0, nullptr, LogitsMode::kNone);
      model->set_observer({});
    }
    {
      PagedCache c(geo, bo);
      if (w == 0 && opt.diagnostics && bmodel == model.get()) {
        capture_into(*model, cap);
      }
      bmodel->forward(win.data(), n, c, 0, ref.data(), LogitsMode::kAll);
      model->set_observer({});
    }
    ref_nll += mean_next_token_nll(ref.data(), vocab, win.data(), n);
    for (std::size_t i = 0; i < configs.size(); ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      auto c = make_cache(geo, configs[i], oc_of(configs[i]));
      model->forward(win.data(), n, *c, 0, lg.data(), LogitsMode::kAll);
      secs[i] += seconds_since(t0);
      nll_sum[i] += mean_next_token_nll(lg.data(), vocab, win.data(), n);
      double kl = 0, agree = 0;
#pragma omp parallel for reduction(+ : kl, agree) schedule(static)
      for (int p = 0; p < n - 1; ++p) {
        std::vector<double> lp, lq;
        log_softmax(&ref[static_cast<std::size_t>(p) * static_cast<std::size_t>(vocab)], vocab, lp);
        log_softmax(&lg[static_cast<std::size_t>(p) * static_cast<std::size_t>(vocab)], vocab, lq);
        double k = 0;
        for (int j = 0; j < vocab; ++j) k += std::exp(lp[static_cast<std::size_t>(j)]) * (lp[static_cast<std::size_t>(j)] - lq[static_cast<std::size_t>(j)]);
        kl += k;
        agree += argmax(&ref[static_cast<std::size_t>(p) * static_cast<std::size_t>(vocab)], vocab) ==
                 argmax(&lg[static_cast<std::size_t>(p) * static_cast<std::size_t>(vocab)], vocab);
      }
      kl_sum[i] += kl / (n - 1);
      top1_sum[i] += agree / (n - 1);
      if (opt.progress) opt.progress("perplexity", (w + static_cast<double>(i + 1) / static_cast<double>(configs.size())) / windows);
    }
  }
  res.predictions = static_cast<std::int64_t>(windows) * (n - 1);
  res.bf16_ppl = std::exp(ref_nll / windows);
  res.blas_kernels = blas_kernels();
  for (std::size_t i = 0; i < configs.size(); ++i) {
    auto& r = res.rows[i];
    r.mean_nll = nll_sum[i] / windows;
    r.ppl = std::exp(r.mean_nll);
    r.delta_ppl_pct = 100.0 * (r.ppl / res.bf16_ppl - 1.0);
    r.kl = kl_sum[i] / windows;
    r.top1 = top1_sum[i] / windows;
    r.seconds = secs[i];
  }

  // Needle retrieval, paired samples.
  if (opt.needle_samples > 0) {
    res.needle_samples = opt.needle_samples;
    require(!opt.needle_words_text.empty(), "needle: no word text given");
    const auto words = needle_words(read_text(opt.needle_words_text));
    std::size_t done = 0;
    const std::size_t todo = opt.needle_lengths.size() * (configs.size() + 1);
    for (int len : opt.needle_lengths) {
      require(len <= cfg.max_position_embeddings, "needle length exceeds max_position_embeddings");
      const auto samples = make_needle_samples(*tok, stream, words, len, opt.needle_samples, opt.seed, cfg.bos_token_id);
      auto score = [&](const CacheConfig* c, Model& m_run) {
        std::vector<char> ok(samples.size());
        std::vector<float> logits;
        for (std::size_t s = 0; s < samples.size(); ++s) {
          const auto& smp = samples[s];
          const int m = static_cast<int>(smp.tokens.size()) - 1;  // inputs: all but the last token
          std::unique_ptr<KvCache> cache;
          if (c) cache = make_cache(geo, *c, oc_of(*c));
          else cache = std::make_unique<PagedCache>(geo, bo);
          logits.resize(static_cast<std::size_t>(m) * static_cast<std::size_t>(vocab));
          m_run.forward(smp.tokens.data(), m, *cache, 0, logits.data(), LogitsMode::kAll);
          bool good = true;
          for (int p = smp.answer_start; p <= m && good; ++p)
            good = argmax(&logits[static_cast<std::size_t>(p - 1) * static_cast<std::size_t>(vocab)], vocab) == smp.tokens[static_cast<std::size_t>(p)];
          ok[s] = good;
        }
        return ok;
      };
      // A baseline model's bf16 answers are the same for every evaluated model of this process
      // (same samples): computed once.
      static std::map<std::string, std::vector<char>> baseline_memo;
      const std::string key = opt.baseline_model + "|" + text_path + "|" + opt.needle_words_text + "|" + std::to_string(len) +
                              "|" + std::to_string(opt.needle_samples) + "|" + std::to_string(opt.seed);
      std::vector<char> base;
      if (bmodel != model.get() && baseline_memo.count(key)) {
        base = baseline_memo[key];
      } else {
        base = score(nullptr, *bmodel);
        if (bmodel != model.get()) baseline_memo[key] = base;
      }
      res.bf16_needle[len] = static_cast<double>(std::count(base.begin(), base.end(), 1)) / static_cast<double>(base.size());
      if (opt.progress) opt.progress("needle", static_cast<double>(++done) / static_cast<double>(todo));
      for (std::size_t i = 0; i < configs.size(); ++i) {
        const auto got = score(&configs[i], *model);
        int dis = 0;
        for (std::size_t s = 0; s < got.size(); ++s) dis += got[s] != base[s];
        res.rows[i].needle_acc[len] = static_cast<double>(std::count(got.begin(), got.end(), 1)) / static_cast<double>(got.size());
        res.rows[i].needle_disagree[len] = dis;
        if (opt.progress) opt.progress("needle", static_cast<double>(++done) / static_cast<double>(todo));
      }
    }
  }

  // Attention diagnostics on the first window's bf16 queries and rows, one layer at a time.
  if (opt.diagnostics && cap.n > 0) {
    std::vector<int> queries;
    const int nq = std::min(opt.diag_queries, cap.n);
    for (int i = 0; i < nq; ++i) queries.push_back(static_cast<int>((static_cast<long>(i) + 1) * (cap.n - 1) / nq));
    for (std::size_t i = 0; i < configs.size(); ++i) {
      res.rows[i].layers.resize(static_cast<std::size_t>(geo.n_layers));
#pragma omp parallel for schedule(dynamic)
      for (int l = 0; l < geo.n_layers; ++l)
        res.rows[i].layers[static_cast<std::size_t>(l)] = layer_diag(geo, configs[i], oc_of(configs[i]), cap, l, queries);
      if (opt.progress) opt.progress("diagnostics", static_cast<double>(i + 1) / static_cast<double>(configs.size()));
    }
  }
  return res;
}

}  // namespace kvq
