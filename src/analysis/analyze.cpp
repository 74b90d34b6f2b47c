// The drivers behind `kvq analyze response` and `kvq analyze jacobian` (kvq/analysis.hpp,
// docs/analysis.md). Per cell (text x seed), sequences are captured from the runtime with an
// exact fp32 cache (the block inputs of every layer: absorbed queries, the cached latent C and
// the cached RoPE key P), the MLA block is rebuilt from the checkpoint's kv_b_proj value rows
// and o_proj, checked against the runtime's o_proj output, and perturbed one path at a time
// along the quantize-dequantize error of the chosen cXrY quantizer, rescaled to a fixed cache
// NMSE.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <sstream>

#include "../model/ops.hpp"
#include "kvq/analysis.hpp"
#include "kvq/calibrate.hpp"
#include "kvq/common.hpp"
#include "kvq/dense_cache.hpp"
#include "kvq/eval.hpp"
#include "kvq/formats.hpp"
#include "kvq/model.hpp"
#include "kvq/quantizers.hpp"
#include "kvq/rng.hpp"
#include "kvq/safetensors.hpp"
#include "kvq/tokenizer.hpp"

namespace kvq {

namespace fs = std::filesystem;

namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

struct LayerWeights {
  std::vector<float> w_uv, w_o;  // [H][vd][dc], [hidden][H * vd]
};

// One captured (sequence, layer): the block inputs and the runtime's output after o_proj.
struct Capture {
  std::vector<float> qa, qr, C, P, y_rt;
};

struct Setup {
  ModelConfig cfg;
  std::unique_ptr<Model> model;
  std::unique_ptr<Tokenizer> tok;
  std::vector<LayerWeights> w;
  std::unique_ptr<VectorQuantizer> qc, qr;  // content, RoPE quantizers
  std::string cache;
  std::map<std::string, std::vector<std::int32_t>> streams;
  MlaDims dims(int T) const {
    return MlaDims{T, cfg.n_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.hidden_size};
  }
};

void say(const AnalysisOptions& o, const std::string& s) {
  if (o.log) o.log(s);
}

std::string fmt_cell(const std::string& text, std::uint64_t seed) {
  return fs::path(text).filename().string() + " seed " + std::to_string(seed);
}

std::unique_ptr<Setup> setup(const AnalysisOptions& o, const char* who) {
  const std::string cmd = std::string("kvq analyze ") + who;
  if (o.model_dir.empty()) fail(cmd + ": --model is required");
  if (o.texts.empty()) fail(cmd + ": at least one --text is required");
  if (o.seeds.empty()) fail(cmd + ": at least one seed is required");
  require(o.seqs > 0 && o.seq_len >= 8, cmd + ": sequences > 0 and seq-len >= 8 required");
  require(o.nmse > 0 && o.nmse < 1, cmd + ": the cache NMSE must lie in (0, 1)");
  const fs::path cfgp = fs::path(o.model_dir) / "config.json";
  if (!fs::exists(cfgp)) fail(o.model_dir + ": no config.json (not a Hugging Face model directory)");
  auto s = std::make_unique<Setup>();
  s->cfg = load_model_config(cfgp.string());
  if (!s->cfg.mla) fail(o.model_dir + ": " + cmd + " needs an MLA (DeepSeek-V2/V3) model; this one is " + s->cfg.architecture);
  if (s->cfg.fp8) fail(o.model_dir + ": fp8 block-scaled checkpoints are not supported by " + cmd);
  const FormatSpec& f = find_format(o.cache);
  if (f.kind != FormatKind::kMlaAffine)
    fail(cmd + ": --cache must be a cXrY format (group-64 affine content and RoPE caches), not " + f.name);
  s->cache = f.name;
  for (const auto& t : o.texts)
    if (!fs::is_regular_file(t)) fail(t + ": cannot open the analysis text");
  s->model = Model::load(o.model_dir);
  const CacheGeometry g = s->model->cache_geometry();
  QuantizerPair qp = make_quantizers(f, g, 0, 0, nullptr);
  s->qc = std::move(qp.key);
  s->qr = std::move(qp.value);
  require(s->qc->dim() == s->cfg.kv_lora_rank && s->qr->dim() == s->cfg.qk_rope_head_dim,
          cmd + ": quantizer dimensions do not match the model's cache");
  s->tok = Tokenizer::load((fs::path(o.model_dir) / "tokenizer.json").string());
  require(!s->cfg.eos_token_ids.empty() && s->cfg.bos_token_id >= 0, cmd + ": the model needs bos and eos token ids");

  // The consumers straight from the checkpoint (the calibration's loader).
  for (auto& lw : load_mla_layer_weights(o.model_dir)) s->w.push_back({std::move(lw.w_uv), std::move(lw.w_o)});
  return s;
}

// Captures `o.seqs` non-overlapping windows of `T` tokens (<|bos|> + T - 1 text tokens) from the
// text, chosen by the seed: [seq][layer].
std::vector<std::vector<Capture>> capture_cell(Setup& s, const AnalysisOptions& o, const std::string& text,
                                               std::uint64_t seed, int T) {
  auto it = s.streams.find(text);
  if (it == s.streams.end()) {
    std::ifstream tf(text, std::ios::binary);
    if (!tf) fail(text + ": cannot open the analysis text");
    std::stringstream ss;
    ss << tf.rdbuf();
    it = s.streams
             .emplace(text, ppl_token_stream(ss.str(), [&](std::string_view x) { return s.tok->encode(x); },
                                             s.cfg.eos_token_ids[0]))
             .first;
  }
  const auto& stream = it->second;
  const std::size_t need = static_cast<std::size_t>(o.seqs) * static_cast<std::size_t>(T - 1);
  if (stream.size() < need)
    fail(text + ": " + std::to_string(stream.size()) + " tokens, " + std::to_string(need) + " needed for " +
         std::to_string(o.seqs) + " sequences of " + std::to_string(T));
  std::vector<std::size_t> win(stream.size() / static_cast<std::size_t>(T - 1));
  std::iota(win.begin(), win.end(), std::size_t{0});
  SplitMix64 rng(mix_seed(seed, 0, 0, 0x616e61u));
  for (std::size_t i = win.size() - 1; i > 0; --i) std::swap(win[i], win[rng.next() % (i + 1)]);
  const int NL = s.cfg.n_layers, H = s.cfg.n_heads, dc = s.cfg.kv_lora_rank, dr = s.cfg.qk_rope_head_dim,
            hid = s.cfg.hidden_size;
  std::vector<std::vector<Capture>> out(static_cast<std::size_t>(o.seqs), std::vector<Capture>(static_cast<std::size_t>(NL)));
  for (int i = 0; i < o.seqs; ++i) {
    std::vector<std::int32_t> sq{s.cfg.bos_token_id};
    const std::size_t b = win[static_cast<std::size_t>(i)] * static_cast<std::size_t>(T - 1);
    sq.insert(sq.end(), stream.begin() + static_cast<std::ptrdiff_t>(b), stream.begin() + static_cast<std::ptrdiff_t>(b + T - 1));
    int seen = 0;
    s.model->set_observer([&](const LayerTrace& tr) {
      require(tr.n == T && tr.pos0 == 0, "kvq analyze: the forward pass was split into chunks");
      require(tr.q_dim == H * (dc + dr) && tr.k_dim == dc && tr.v_dim == dr, "kvq analyze: unexpected MLA trace shapes");
      auto& c = out[static_cast<std::size_t>(i)][static_cast<std::size_t>(tr.layer)];
      const std::size_t n = static_cast<std::size_t>(tr.n);
      c.qa.resize(n * H * dc);
      c.qr.resize(n * H * dr);
      for (std::size_t t = 0; t < n; ++t)
        for (int h = 0; h < H; ++h) {
          const float* q = tr.q + (t * H + static_cast<std::size_t>(h)) * static_cast<std::size_t>(dc + dr);
          std::copy(q, q + dc, c.qa.begin() + static_cast<std::ptrdiff_t>((t * H + h) * dc));
          std::copy(q + dc, q + dc + dr, c.qr.begin() + static_cast<std::ptrdiff_t>((t * H + h) * dr));
        }
      c.C.assign(tr.k, tr.k + n * dc);
      c.P.assign(tr.v, tr.v + n * dr);
      c.y_rt.assign(tr.attn_proj, tr.attn_proj + n * hid);
      for (const auto* v : {&c.qa, &c.qr, &c.C, &c.P, &c.y_rt})
        for (float e : *v)
          if (!std::isfinite(e))
            fail("kvq analyze: non-finite activation in layer " + std::to_string(tr.layer) + " of " + text);
      ++seen;
    });
    auto cache = make_dense_cache(s.model->cache_geometry(), 1, 0, DenseStorage::kF32);
    s.model->set_max_chunk(std::max(s.model->max_chunk(), T));
    s.model->forward(sq.data(), T, *cache, 0, nullptr, LogitsMode::kNone);
    s.model->set_observer({});
    require(seen == NL, "kvq analyze: the observer did not see every layer");
  }
  return out;
}

double sq_norm(const std::vector<float>& v) {
  double s = 0;
  for (float x : v) s += static_cast<double>(x) * x;
  return s;
}
double sq_dist(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    s += d * d;
  }
  return s;
}

// The quantizer's QDQ error on rows [T][d], rescaled to cache NMSE `nmse` (||e||^2 / ||c||^2);
// nmse <= 0 keeps the quantizer's own error.
std::vector<float> qdq_error(const VectorQuantizer& q, const std::vector<float>& c, double nmse, const std::string& what) {
  const int d = q.dim();
  const std::size_t n = c.size() / static_cast<std::size_t>(d);
  std::vector<std::uint8_t> codes(q.code_bytes()), meta(q.meta_bytes());
  std::vector<float> e(c.size());
  for (std::size_t t = 0; t < n; ++t) {
    const float* x = c.data() + t * d;
    float* y = e.data() + t * d;
    q.encode(x, codes.data(), meta.data());
    q.decode(codes.data(), meta.data(), y);
    for (int j = 0; j < d; ++j) y[j] -= x[j];
  }
  const double ee = sq_norm(e), cc = sq_norm(c);
  if (!(ee > 0) || !std::isfinite(ee))
    fail("kvq analyze: the " + what + " quantizer leaves no (or a non-finite) error to rescale");
  if (nmse <= 0) return e;
  const float f = static_cast<float>(std::sqrt(nmse * cc / ee));
  for (auto& v : e) v *= f;
  return e;
}

std::vector<float> add(const std::vector<float>& a, const std::vector<float>& b) {
  std::vector<float> r(a.size());
  for (std::size_t i = 0; i < a.size(); ++i) r[i] = a[i] + b[i];
  return r;
}

// y(c + e) with the other path exact.
std::vector<float> perturbed_output(MlaBlock<float>& blk, const Capture& x, CachePath p, const std::vector<float>& e) {
  const MlaDims& d = blk.dims();
  std::vector<float> y(static_cast<std::size_t>(d.T) * d.hidden);
  if (p == CachePath::kContent) {
    const std::vector<float> c = add(x.C, e);
    blk.forward(x.qa.data(), x.qr.data(), c.data(), x.P.data(), y.data());
  } else {
    const std::vector<float> c = add(x.P, e);
    blk.forward(x.qa.data(), x.qr.data(), x.C.data(), c.data(), y.data());
  }
  return y;
}

std::vector<float> forward_exact(MlaBlock<float>& blk, const Capture& x) {
  const MlaDims& d = blk.dims();
  std::vector<float> y(static_cast<std::size_t>(d.T) * d.hidden);
  blk.forward(x.qa.data(), x.qr.data(), x.C.data(), x.P.data(), y.data());
  return y;
}

double rel_err(const std::vector<float>& a, const std::vector<float>& ref) {
  return std::sqrt(sq_dist(a, ref) / std::max(sq_norm(ref), 1e-30));
}

// The block's output must reproduce the runtime's o_proj output: the capture is what we analyse.
constexpr double kBlockTolerance = 1e-3;

nlohmann::json nan_null(double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr); }

nlohmann::json options_json(const AnalysisOptions& o, const Setup& s) {
  return {{"model", fs::absolute(o.model_dir).string()}, {"texts", o.texts},   {"seeds", o.seeds},
          {"cache", s.cache},                             {"seqs_per_cell", o.seqs}, {"seq_len", o.seq_len},
          {"cache_nmse", o.nmse}, {"layers", s.cfg.n_layers}, {"threads", omp_get_max_threads()}};
}

}  // namespace

// ---- response -----------------------------------------------------------------------------------

ResponseResult analyze_response(const AnalysisOptions& o) {
  const auto t0 = Clock::now();
  auto s = setup(o, "response");
  const int NL = s->cfg.n_layers, T = o.seq_len;
  ResponseResult res;
  res.n_layers = NL;
  for (const auto& text : o.texts)
    for (std::uint64_t seed : o.seeds) {
      const auto cap = capture_cell(*s, o, text, seed, T);
      ResponseCell cell;
      cell.text = text;
      cell.seed = seed;
      cell.layers.resize(static_cast<std::size_t>(NL));
      const std::size_t ntask = static_cast<std::size_t>(o.seqs) * NL;
      std::vector<double> rc(ntask), rp(ntask), be(ntask), qcc(ntask), qcp(ntask), qoc(ntask), qop(ntask);
      {
        ops::BlasSingleThread guard;
#pragma omp parallel for schedule(dynamic)
        for (std::size_t k = 0; k < ntask; ++k) {
          const std::size_t i = k / static_cast<std::size_t>(NL), l = k % static_cast<std::size_t>(NL);
          const Capture& x = cap[i][l];
          MlaBlock<float> blk(s->dims(T), s->w[l].w_uv.data(), s->w[l].w_o.data(), s->cfg.softmax_scale);
          const std::vector<float> y0 = forward_exact(blk, x);
          be[k] = rel_err(y0, x.y_rt);
          const double yy = sq_norm(y0);
          for (CachePath p : {CachePath::kContent, CachePath::kRope}) {
            const bool content = p == CachePath::kContent;
            const std::vector<float>& c = content ? x.C : x.P;
            const std::vector<float> e = qdq_error(content ? *s->qc : *s->qr, c, o.nmse, cache_path_name(p));
            const std::vector<float> cp = add(c, e);
            const double nmse_cache = sq_dist(cp, c) / sq_norm(c);
            const std::vector<float> y1 = perturbed_output(blk, x, p, e);
            (content ? rc : rp)[k] = (sq_dist(y1, y0) / yy) / nmse_cache;
            // The quantizer's own error, not rescaled.
            const std::vector<float> eq = qdq_error(content ? *s->qc : *s->qr, c, 0.0, cache_path_name(p));
            const std::vector<float> y2 = perturbed_output(blk, x, p, eq);
            (content ? qcc : qcp)[k] = sq_norm(eq) / sq_norm(c);
            (content ? qoc : qop)[k] = sq_dist(y2, y0) / yy;
          }
        }
      }
      double sc = 0, sp = 0;
      for (int l = 0; l < NL; ++l) {
        auto& L = cell.layers[static_cast<std::size_t>(l)];
        for (int i = 0; i < o.seqs; ++i) {
          const std::size_t k = static_cast<std::size_t>(i) * NL + l;
          if (!(be[k] <= kBlockTolerance))
            fail("kvq analyze: the rebuilt MLA block does not reproduce the runtime's attention output in layer " +
                 std::to_string(l) + " (relative error " + std::to_string(be[k]) + ")");
          if (!std::isfinite(rc[k]) || !std::isfinite(rp[k])) fail("kvq analyze: non-finite response in layer " + std::to_string(l));
          L.r_c += rc[k] / o.seqs;
          L.r_p += rp[k] / o.seqs;
          L.block_rel_err = std::max(L.block_rel_err, be[k]);
          L.q_cache_c += qcc[k] / o.seqs, L.q_cache_p += qcp[k] / o.seqs;
          L.q_out_c += qoc[k] / o.seqs, L.q_out_p += qop[k] / o.seqs;
        }
        L.ratio = L.r_p / L.r_c;
        sc += L.r_c;
        sp += L.r_p;
      }
      cell.model_ratio = sp / sc;
      say(o, fmt_cell(cell.text, seed) + ": model ratio " + std::to_string(cell.model_ratio) + " (" +
                 std::to_string(static_cast<int>(since(t0))) + " s)");
      res.cells.push_back(std::move(cell));
    }
  // Envelopes and summaries.
  std::vector<double> all_ratios, model_ratios;
  for (int l = 0; l < NL; ++l) {
    std::vector<double> c, p, r;
    for (const auto& cell : res.cells) {
      const auto& L = cell.layers[static_cast<std::size_t>(l)];
      c.push_back(L.r_c), p.push_back(L.r_p), r.push_back(L.ratio), all_ratios.push_back(L.ratio);
    }
    res.rc_min.push_back(*std::min_element(c.begin(), c.end()));
    res.rc_max.push_back(*std::max_element(c.begin(), c.end()));
    res.rp_min.push_back(*std::min_element(p.begin(), p.end()));
    res.rp_max.push_back(*std::max_element(p.begin(), p.end()));
    res.ratio_median.push_back(quantile(r, 0.5));
    res.ratio_q1.push_back(quantile(r, 0.25));
    res.ratio_q3.push_back(quantile(r, 0.75));
  }
  for (const auto& cell : res.cells) model_ratios.push_back(cell.model_ratio);
  res.ratio_median_all = quantile(all_ratios, 0.5);
  res.ratio_q1_all = quantile(all_ratios, 0.25);
  res.ratio_q3_all = quantile(all_ratios, 0.75);
  res.model_ratio_mean = std::accumulate(model_ratios.begin(), model_ratios.end(), 0.0) / static_cast<double>(model_ratios.size());
  res.model_ratio_min = *std::min_element(model_ratios.begin(), model_ratios.end());
  res.model_ratio_max = *std::max_element(model_ratios.begin(), model_ratios.end());
  res.seconds = since(t0);

  nlohmann::json j;
  j["analysis"] = "response";
  j["options"] = options_json(o, *s);
  j["definition"] = "R_b = NMSE_out / NMSE_cache, QDQ error of the cache quantizer rescaled to the cache NMSE, one path at a time; "
                    "layer ratio r_l = mean R_P / mean R_C over the cell's sequences; model ratio = mean_l R_P / mean_l R_C";
  nlohmann::json jc = nlohmann::json::array();
  for (const auto& cell : res.cells) {
    nlohmann::json jl = nlohmann::json::array();
    for (int l = 0; l < NL; ++l) {
      const auto& L = cell.layers[static_cast<std::size_t>(l)];
      jl.push_back({{"layer", l}, {"r_c", L.r_c}, {"r_p", L.r_p}, {"ratio", L.ratio}, {"block_rel_err", L.block_rel_err},
                    {"quantizer", {{"cache_nmse_c", L.q_cache_c}, {"cache_nmse_p", L.q_cache_p},
                                   {"out_nmse_c", L.q_out_c}, {"out_nmse_p", L.q_out_p}}}});
    }
    jc.push_back({{"text", cell.text}, {"seed", cell.seed}, {"model_ratio", cell.model_ratio}, {"layers", jl}});
  }
  j["cells"] = jc;
  j["per_layer"] = {{"r_c_min", res.rc_min},         {"r_c_max", res.rc_max},     {"r_p_min", res.rp_min},
                    {"r_p_max", res.rp_max},         {"ratio_median", res.ratio_median},
                    {"ratio_q1", res.ratio_q1},      {"ratio_q3", res.ratio_q3}};
  j["summary"] = {{"model_ratio_mean", res.model_ratio_mean}, {"model_ratio_min", res.model_ratio_min},
                  {"model_ratio_max", res.model_ratio_max},   {"layer_ratio_median", res.ratio_median_all},
                  {"layer_ratio_q1", res.ratio_q1_all},       {"layer_ratio_q3", res.ratio_q3_all}};
  j["seconds"] = res.seconds;
  res.json = j.dump(2) + "\n";
  return res;
}

// ---- jacobian -----------------------------------------------------------------------------------

namespace {

struct PathObs {
  JacobianPath r;
  std::vector<double> perm_changes;
  double norm_c2 = 0;
};

PathObs analyze_path(MlaBlock<float>& blk, const Capture& x, CachePath p, const VectorQuantizer& q, const AnalysisOptions& o,
                     std::uint64_t seed, const std::vector<float>& y0) {
  PathObs ob;
  auto& r = ob.r;
  const bool content = p == CachePath::kContent;
  const MlaDims& d = blk.dims();
  const int width = content ? d.dc : d.dr;
  const std::vector<float>& c = content ? x.C : x.P;
  const std::vector<float> e = qdq_error(q, c, o.nmse, cache_path_name(p));
  const double ee = sq_norm(e), cc = sq_norm(c), yy = sq_norm(y0);
  ob.norm_c2 = cc;
  // Everything that needs the linearization at c first (the block holds the exact forward).
  blk.forward(x.qa.data(), x.qr.data(), x.C.data(), x.P.data(), std::vector<float>(y0.size()).data());
  const double G = jvp_gain(blk, p, e.data());
  const HutchinsonEstimate h = hutchinson(blk, p, o.probes, mix_seed(seed, 0, static_cast<std::uint32_t>(p), 0x687574u));
  std::vector<double> ed(e.begin(), e.end());
  r.g = decompose_gain(G * ee, h.diag, h.trace, ed);
  r.trace_rel_se = h.trace_se / h.trace;
  r.r_local = cc / yy * G;
  // Equal-energy interventions.
  SplitMix64 rng(mix_seed(seed, 1, static_cast<std::uint32_t>(p), 0x696e74u));
  std::vector<float> es(e.size()), eiso(e.size());
  for (std::size_t i = 0; i < e.size(); ++i) es[i] = (rng.next() & 1u) ? e[i] : -e[i];
  double ni = 0;
  for (auto& v : eiso) v = static_cast<float>(rng.normal()), ni += static_cast<double>(v) * v;
  const float fi = static_cast<float>(std::sqrt(ee / ni));
  for (auto& v : eiso) v *= fi;
  std::vector<std::vector<float>> perms;
  for (int k = 0; k < o.permutations; ++k) {
    std::vector<int> pi(static_cast<std::size_t>(d.T));
    std::iota(pi.begin(), pi.end(), 0);
    for (int i = d.T - 1; i > 0; --i) std::swap(pi[static_cast<std::size_t>(i)], pi[rng.next() % static_cast<std::uint64_t>(i + 1)]);
    std::vector<float> ep(e.size());
    for (int t = 0; t < d.T; ++t)
      std::copy(e.begin() + static_cast<std::ptrdiff_t>(pi[static_cast<std::size_t>(t)]) * width,
                e.begin() + static_cast<std::ptrdiff_t>(pi[static_cast<std::size_t>(t)] + 1) * width,
                ep.begin() + static_cast<std::ptrdiff_t>(t) * width);
    perms.push_back(std::move(ep));
  }
  r.sign_gain = jvp_gain(blk, p, es.data());
  r.iso_gain = jvp_gain(blk, p, eiso.data());
  for (const auto& ep : perms) ob.perm_changes.push_back(jvp_gain(blk, p, ep.data()) / G);
  r.perm_gain = perms.empty() ? 0 : ob.perm_changes[0] * G;
  r.sign_change = r.sign_gain / G;
  r.iso_change = r.iso_gain / G;
  r.perm_change = quantile(ob.perm_changes, 0.5);
  // Finite perturbations (each forward replaces the linearization point; nothing linear follows).
  auto finite = [&](const std::vector<float>& dir) {
    const std::vector<float> y1 = perturbed_output(blk, x, p, dir);
    return sq_dist(y1, y0) / sq_norm(dir);
  };
  r.finite_gain = finite(e);
  r.r_finite = r.finite_gain * cc / yy;
  r.sign_finite = finite(es);
  r.iso_finite = finite(eiso);
  r.perm_finite = perms.empty() ? 0 : finite(perms[0]);
  return ob;
}

void accumulate(JacobianPath& a, const JacobianPath& b, double w) {
  a.g.G += w * b.g.G, a.g.T += w * b.g.T, a.g.A += w * b.g.A, a.g.O += w * b.g.O;
  a.trace_rel_se += w * b.trace_rel_se;
  a.finite_gain += w * b.finite_gain, a.r_local += w * b.r_local, a.r_finite += w * b.r_finite;
  a.sign_change += w * b.sign_change, a.perm_change += w * b.perm_change, a.iso_change += w * b.iso_change;
  a.sign_finite += w * b.sign_finite, a.perm_finite += w * b.perm_finite, a.iso_finite += w * b.iso_finite;
  a.sign_gain += w * b.sign_gain, a.perm_gain += w * b.perm_gain, a.iso_gain += w * b.iso_gain;
}

nlohmann::json path_json(const JacobianPath& p) {
  return {{"G", p.g.G},
          {"T", p.g.T},
          {"A", p.g.A},
          {"O", p.g.O},
          {"trace_rel_se", p.trace_rel_se},
          {"finite_gain", p.finite_gain},
          {"R_local", p.r_local},
          {"R_finite", p.r_finite},
          {"interventions",
           {{"sign", {{"change", p.sign_change}, {"jvp_gain", p.sign_gain}, {"finite_gain", p.sign_finite}}},
            {"permutation", {{"change_median", p.perm_change}, {"jvp_gain", p.perm_gain}, {"finite_gain", p.perm_finite}}},
            {"isotropic", {{"change", p.iso_change}, {"jvp_gain", p.iso_gain}, {"finite_gain", p.iso_finite}}}}}};
}

}  // namespace

JacobianResult analyze_jacobian(const AnalysisOptions& o) {
  const auto t0 = Clock::now();
  require(o.probes >= 2, "kvq analyze jacobian: --probes must be >= 2");
  require(o.permutations >= 1, "kvq analyze jacobian: --permutations must be >= 1");
  auto s = setup(o, "jacobian");
  const int NL = s->cfg.n_layers, T = o.seq_len;
  JacobianResult res;
  res.n_layers = NL;
  std::vector<double> jvp_g, fin_g, perm_c, perm_p, sign_c, sign_p, iso_c, iso_p;
  for (const auto& text : o.texts)
    for (std::uint64_t seed : o.seeds) {
      const auto cap = capture_cell(*s, o, text, seed, T);
      JacobianCell cell;
      cell.text = text;
      cell.seed = seed;
      cell.layers.resize(static_cast<std::size_t>(NL));
      const std::size_t ntask = static_cast<std::size_t>(o.seqs) * NL;
      std::vector<PathObs> oc(ntask), op(ntask);
      std::vector<double> be(ntask);
      {
        ops::BlasSingleThread guard;
#pragma omp parallel for schedule(dynamic)
        for (std::size_t k = 0; k < ntask; ++k) {
          const std::size_t i = k / static_cast<std::size_t>(NL), l = k % static_cast<std::size_t>(NL);
          const Capture& x = cap[i][l];
          MlaBlock<float> blk(s->dims(T), s->w[l].w_uv.data(), s->w[l].w_o.data(), s->cfg.softmax_scale);
          const std::vector<float> y0 = forward_exact(blk, x);
          be[k] = rel_err(y0, x.y_rt);
          const std::uint64_t ks = mix_seed(seed, static_cast<std::uint32_t>(l), static_cast<std::uint32_t>(i), 0x6a6163u);
          oc[k] = analyze_path(blk, x, CachePath::kContent, *s->qc, o, ks, y0);
          op[k] = analyze_path(blk, x, CachePath::kRope, *s->qr, o, ks, y0);
        }
      }
      for (int l = 0; l < NL; ++l) {
        auto& L = cell.layers[static_cast<std::size_t>(l)];
        for (int i = 0; i < o.seqs; ++i) {
          const std::size_t k = static_cast<std::size_t>(i) * NL + l;
          if (!(be[k] <= kBlockTolerance))
            fail("kvq analyze: the rebuilt MLA block does not reproduce the runtime's attention output in layer " +
                 std::to_string(l) + " (relative error " + std::to_string(be[k]) + ")");
          for (const auto* ob : {&oc[k], &op[k]}) {
            const auto& r = ob->r;
            for (double v : {r.g.G, r.g.T, r.g.A, r.g.O, r.finite_gain, r.sign_gain, r.iso_gain, r.perm_gain})
              if (!std::isfinite(v)) fail("kvq analyze jacobian: non-finite diagnostic in layer " + std::to_string(l));
            const bool content = ob == &oc[k];
            for (double v : ob->perm_changes) (content ? perm_c : perm_p).push_back(v);
            (content ? sign_c : sign_p).push_back(r.sign_change);
            (content ? iso_c : iso_p).push_back(r.iso_change);
            for (auto [a, b] : {std::pair{r.g.G, r.finite_gain}, std::pair{r.sign_gain, r.sign_finite},
                                std::pair{r.perm_gain, r.perm_finite}, std::pair{r.iso_gain, r.iso_finite}})
              jvp_g.push_back(a), fin_g.push_back(b);
          }
          accumulate(L.c, oc[k].r, 1.0 / o.seqs);
          accumulate(L.p, op[k].r, 1.0 / o.seqs);
        }
      }
      say(o, fmt_cell(cell.text, seed) + " done (" + std::to_string(static_cast<int>(since(t0))) + " s)");
      res.cells.push_back(std::move(cell));
    }
  // The cross-layer predictor: (layer, cell) points split in two halves by a seeded shuffle.
  std::vector<PredictorPoint> pts;
  for (const auto& cell : res.cells)
    for (const auto& L : cell.layers)
      pts.push_back({std::log(L.p.g.G / L.c.g.G), std::log(L.p.g.T / L.c.g.T), std::log(L.p.g.A / L.c.g.A), false});
  {
    std::vector<std::size_t> idx(pts.size());
    std::iota(idx.begin(), idx.end(), std::size_t{0});
    SplitMix64 rng(mix_seed(0x707265u, 0, 0, 0));
    for (std::size_t i = idx.size() - 1; i > 0; --i) std::swap(idx[i], idx[rng.next() % (i + 1)]);
    for (std::size_t i = 0; i < idx.size() / 2; ++i) pts[idx[i]].fit = true;
  }
  res.fit_points = static_cast<int>(pts.size() / 2);
  res.test_points = static_cast<int>(pts.size() - pts.size() / 2);
  if (res.test_points >= 2 && res.fit_points >= 1) res.predictors = fit_predictors(pts);
  res.spearman = spearman(jvp_g, fin_g);
  res.spearman_n = static_cast<int>(jvp_g.size());
  res.perm_change_median_c = quantile(perm_c, 0.5);
  res.perm_change_median_p = quantile(perm_p, 0.5);
  res.sign_change_median_c = quantile(sign_c, 0.5);
  res.sign_change_median_p = quantile(sign_p, 0.5);
  res.iso_change_median_c = quantile(iso_c, 0.5);
  res.iso_change_median_p = quantile(iso_p, 0.5);
  res.seconds = since(t0);

  nlohmann::json j;
  j["analysis"] = "jacobian";
  j["options"] = options_json(o, *s);
  j["options"]["probes"] = o.probes;
  j["options"]["permutations"] = o.permutations;
  j["definition"] = "G = e^T H e / ||e||^2 (JVP), T = tr(H) / D, A = sum H_ii e_i^2 / (T ||e||^2), O = offdiag / diag, "
                    "tr(H) and diag(H) by Hutchinson (Rademacher, JVP then VJP); e = cache quantizer's QDQ error at the "
                    "cache NMSE; means over the cell's sequences";
  nlohmann::json jc = nlohmann::json::array();
  for (const auto& cell : res.cells) {
    nlohmann::json jl = nlohmann::json::array();
    for (int l = 0; l < NL; ++l) {
      const auto& L = cell.layers[static_cast<std::size_t>(l)];
      jl.push_back({{"layer", l}, {"content", path_json(L.c)}, {"rope", path_json(L.p)}});
    }
    jc.push_back({{"text", cell.text}, {"seed", cell.seed}, {"layers", jl}});
  }
  j["cells"] = jc;
  nlohmann::json jp = nlohmann::json::array();
  for (const auto& p : res.predictors)
    jp.push_back({{"name", p.name}, {"gamma", p.gamma}, {"test_rmse", p.rmse}, {"test_r2", nan_null(p.r2)}, {"test_pearson", nan_null(p.pearson)}});
  nlohmann::json jpts = nlohmann::json::array();
  for (const auto& p : pts) jpts.push_back({{"log_g", p.log_g}, {"log_t", p.log_t}, {"log_a", p.log_a}, {"fit", p.fit}});
  j["predictor"] = {{"target", "log(G_P / G_C)"}, {"fit_points", res.fit_points}, {"test_points", res.test_points},
                    {"models", jp}, {"points", jpts}};
  j["jvp_vs_finite"] = {{"spearman", nan_null(res.spearman)}, {"n", res.spearman_n},
                        {"observations", "cell x layer x path x direction (quantizer, sign, first permutation, isotropic)"}};
  j["interventions"] = {{"content", {{"sign_median", res.sign_change_median_c}, {"permutation_median", res.perm_change_median_c},
                                     {"isotropic_median", res.iso_change_median_c}}},
                        {"rope", {{"sign_median", res.sign_change_median_p}, {"permutation_median", res.perm_change_median_p},
                                  {"isotropic_median", res.iso_change_median_p}}}};
  j["seconds"] = res.seconds;
  res.json = j.dump(2) + "\n";
  return res;
}

}  // namespace kvq
