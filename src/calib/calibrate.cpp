// The calibration driver behind `kvq calibrate` (kvq/calibrate.hpp, docs/calibration.md).
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <sstream>
#include <unistd.h>

#include "kvq/calibrate.hpp"
#include "kvq/common.hpp"
#include "kvq/dense_cache.hpp"
#include "kvq/eval.hpp"
#include "kvq/formats.hpp"
#include "kvq/model.hpp"
#include "kvq/rng.hpp"
#include "kvq/rotation.hpp"
#include "kvq/safetensors.hpp"
#include "kvq/tokenizer.hpp"
#include "../model/ops.hpp"
#include "checkpoint.hpp"

namespace kvq {

namespace fs = std::filesystem;

CalibMethod parse_calib_method(const std::string& name) {
  if (name == "quantmla") return CalibMethod::kQuantMla;
  if (name == "smoothquant") return CalibMethod::kSmoothQuant;
  if (name == "quarot") return CalibMethod::kQuaRot;
  fail("unknown calibration method '" + name + "' (valid: quantmla, smoothquant, quarot)");
}

std::string calib_method_name(CalibMethod m) {
  switch (m) {
    case CalibMethod::kQuantMla: return "quantmla";
    case CalibMethod::kSmoothQuant: return "smoothquant";
    case CalibMethod::kQuaRot: return "quarot";
  }
  return "?";
}

namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

struct LayerData {
  MlaLayerWeights<float> w;
  std::vector<MlaSample<float>> train, held;
  // The RoPE path's own sequences when --rope-seq-len differs from --seq-len (else empty).
  std::vector<MlaSample<float>> rope_train_own, rope_held_own;
  std::vector<float> gamma;
  const std::vector<MlaSample<float>>& rope_train() const { return rope_train_own.empty() ? train : rope_train_own; }
  const std::vector<MlaSample<float>>& rope_held() const { return rope_held_own.empty() ? held : rope_held_own; }
};

// Adam over a flat parameter vector (Kingma & Ba, bias-corrected).
struct Adam {
  std::vector<double> m, v;
  double lr, b1 = 0.9, b2 = 0.999, eps = 1e-8;
  int t = 0;
  Adam(std::size_t n, double lr_) : m(n, 0.0), v(n, 0.0), lr(lr_) {}
  void step(std::vector<double>& p, const std::vector<double>& g) {
    ++t;
    const double c1 = 1.0 - std::pow(b1, t), c2 = 1.0 - std::pow(b2, t);
    for (std::size_t i = 0; i < p.size(); ++i) {
      m[i] = b1 * m[i] + (1 - b1) * g[i];
      v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i];
      p[i] -= lr * (m[i] / c1) / (std::sqrt(v[i] / c2) + eps);
    }
  }
};

std::vector<double> identity(int n) {
  std::vector<double> r(static_cast<std::size_t>(n) * n, 0.0);
  for (int i = 0; i < n; ++i) r[static_cast<std::size_t>(i) * n + i] = 1.0;
  return r;
}

std::vector<float> to_float(const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); }

// 99.9th percentile of |x| per channel over rows [n][d] (nearest rank).
std::vector<double> percentile_abs(const std::vector<const std::vector<float>*>& blocks, int d, double q) {
  std::vector<double> out(static_cast<std::size_t>(d));
  std::vector<float> col;
  for (int j = 0; j < d; ++j) {
    col.clear();
    for (const auto* b : blocks)
      for (std::size_t i = static_cast<std::size_t>(j); i < b->size(); i += static_cast<std::size_t>(d)) col.push_back(std::fabs((*b)[i]));
    const std::size_t k = std::min(col.size() - 1, static_cast<std::size_t>(std::ceil(q * static_cast<double>(col.size()))) - 1);
    std::nth_element(col.begin(), col.begin() + static_cast<std::ptrdiff_t>(k), col.end());
    out[static_cast<std::size_t>(j)] = col[k];
  }
  return out;
}

// s_j = a_j^-alpha / geomean(a^-alpha), a_j = max(stat_j, 1e-8).
std::vector<double> alpha_scales(const std::vector<double>& stat, double alpha) {
  std::vector<double> s(stat.size());
  double lg = 0;
  for (std::size_t j = 0; j < stat.size(); ++j) {
    s[j] = -alpha * std::log(std::max(stat[j], 1e-8));
    lg += s[j];
  }
  lg /= static_cast<double>(stat.size());
  for (auto& v : s) v = std::exp(v - lg);
  return s;
}

// Mean of f(sample) over samples, in parallel (one BLAS thread per OpenMP thread), summed in
// sample order so that the result does not depend on the thread schedule.
template <class F>
double mean_over(const std::vector<MlaSample<float>>& xs, F f) {
  std::vector<double> v(xs.size());
  {
    ops::BlasSingleThread guard;
#pragma omp parallel for schedule(dynamic)
    for (std::size_t i = 0; i < xs.size(); ++i) v[i] = f(xs[i]);
  }
  double sum = 0;
  for (double x : v) sum += x;
  return sum / static_cast<double>(xs.size());
}

// Mean over the minibatch `idx` of two per-sample gradients: f(i, ga, gb) adds sample i's
// gradients to zeroed float buffers of na and nb entries. Samples run in parallel (one BLAS
// thread per OpenMP thread); the sums are taken in double and in minibatch order, so a seeded
// run is reproducible whatever the thread schedule.
template <class F>
std::pair<std::vector<double>, std::vector<double>> minibatch_gradients(const std::vector<int>& idx, std::size_t na,
                                                                        std::size_t nb, F f) {
  std::vector<std::vector<float>> a(idx.size(), std::vector<float>(na, 0.0f)), b(idx.size(), std::vector<float>(nb, 0.0f));
  {
    ops::BlasSingleThread guard;
#pragma omp parallel for schedule(dynamic)
    for (std::size_t k = 0; k < idx.size(); ++k) f(idx[k], a[k].data(), b[k].data());
  }
  std::vector<double> ga(na, 0.0), gb(nb, 0.0);
  for (std::size_t k = 0; k < idx.size(); ++k) {
    for (std::size_t i = 0; i < na; ++i) ga[i] += a[k][i];
    for (std::size_t i = 0; i < nb; ++i) gb[i] += b[k][i];
  }
  const double inv = 1.0 / static_cast<double>(idx.size());
  for (auto& v : ga) v *= inv;
  for (auto& v : gb) v *= inv;
  return {std::move(ga), std::move(gb)};
}

double content_heldout(const LayerData& L, const std::vector<double>& rot, const std::vector<double>& s, const RowOp<float>* op) {
  const std::vector<float> rf = to_float(rot), sf = to_float(s);
  return mean_over(L.held, [&](const MlaSample<float>& x) { return content_objective(L.w, x, rf.data(), sf.data(), op); });
}

double rope_heldout(const LayerData& L, const RopePairs& pp, const std::vector<double>& angle, const std::vector<double>& sc,
                    bool hadamard, const RowOp<float>* op) {
  const std::vector<float> af = to_float(angle), sf = to_float(sc);
  return mean_over(L.rope_held(), [&](const MlaSample<float>& x) {
    return rope_objective(x, L.w.dims.H, pp, af.data(), sf.data(), hadamard, op);
  });
}

double rope_output_heldout(const LayerData& L, const RopePairs& pp, const std::vector<double>& angle,
                           const std::vector<double>& sc, bool hadamard, const RowOp<float>* op) {
  const std::vector<float> af = to_float(angle), sf = to_float(sc);
  return mean_over(L.rope_held(), [&](const MlaSample<float>& x) {
    return rope_output_objective(L.w, x, pp, af.data(), sf.data(), hadamard, op);
  });
}

std::vector<double> exp_scales(const std::vector<double>& l) {
  std::vector<double> s(l.size());
  for (std::size_t i = 0; i < l.size(); ++i) s[i] = log_scale_value(l[i]);
  return s;
}

// Minibatch order: a seeded shuffle of the training set per epoch.
struct Batches {
  std::vector<int> order;
  std::size_t pos = 0;
  SplitMix64 rng;
  int n;
  Batches(int n_, std::uint64_t seed) : rng(seed), n(n_) { reshuffle(); }
  void reshuffle() {
    order.resize(static_cast<std::size_t>(n));
    std::iota(order.begin(), order.end(), 0);
    for (int i = n - 1; i > 0; --i) std::swap(order[static_cast<std::size_t>(i)], order[rng.next() % static_cast<std::uint64_t>(i + 1)]);
    pos = 0;
  }
  std::vector<int> next(int b) {
    std::vector<int> out;
    for (int i = 0; i < b; ++i) {
      if (pos >= order.size()) reshuffle();
      out.push_back(order[pos++]);
    }
    return out;
  }
};

void say(const CalibOptions& o, const std::string& s) {
  if (o.log) o.log(s);
}

}  // namespace

std::vector<MlaLayerWeights<float>> load_mla_layer_weights(const std::string& model_dir) {
  const ModelConfig cfg = load_model_config((fs::path(model_dir) / "config.json").string());
  if (!cfg.mla) fail(model_dir + ": an MLA (DeepSeek-V2/V3) model is needed; this one is " + cfg.architecture);
  const int dc = cfg.kv_lora_rank, dr = cfg.qk_rope_head_dim, H = cfg.n_heads, vd = cfg.v_head_dim,
            nope = cfg.qk_nope_head_dim, hid = cfg.hidden_size;
  // The consumers straight from the checkpoint (the runtime keeps them internal).
  const calib_detail::Checkpoint ck(model_dir);
  auto tensor = [&](const std::string& name) { return ck.get(name).to_float(); };
  std::vector<MlaLayerWeights<float>> out(static_cast<std::size_t>(cfg.n_layers));
  for (int l = 0; l < cfg.n_layers; ++l) {
    auto& w = out[static_cast<std::size_t>(l)];
    const std::string p = "model.layers." + std::to_string(l) + ".self_attn.";
    w.dims = MlaDims{0, H, dc, dr, vd, hid};
    w.scale = cfg.softmax_scale;
    w.gamma = tensor(p + "kv_a_layernorm.weight");
    require(w.gamma.size() == static_cast<std::size_t>(dc), p + "kv_a_layernorm.weight: unexpected size");
    for (float v : w.gamma)
      if (!(std::fabs(v) > 1e-30f)) fail(p + "kv_a_layernorm.weight has a zero channel: the weightless latent cannot be recovered");
    const std::vector<float> kvb = tensor(p + "kv_b_proj.weight");
    require(kvb.size() == static_cast<std::size_t>(H) * (nope + vd) * dc, p + "kv_b_proj.weight: unexpected size");
    w.w_uv.resize(static_cast<std::size_t>(H) * vd * dc);
    for (int h = 0; h < H; ++h)
      std::copy(kvb.begin() + static_cast<std::ptrdiff_t>((static_cast<std::size_t>(h) * (nope + vd) + nope) * dc),
                kvb.begin() + static_cast<std::ptrdiff_t>((static_cast<std::size_t>(h) * (nope + vd) + nope + vd) * dc),
                w.w_uv.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(h) * vd * dc));
    w.w_o = tensor(p + "o_proj.weight");
    require(w.w_o.size() == static_cast<std::size_t>(hid) * H * vd, p + "o_proj.weight: unexpected size");
  }
  return out;
}

std::vector<std::vector<MlaSample<float>>> capture_mla_samples(Model& model, const std::vector<MlaLayerWeights<float>>& w,
                                                               const std::vector<std::vector<std::int32_t>>& seqs) {
  const ModelConfig& cfg = model.config();
  require(cfg.mla, "capture_mla_samples: an MLA model is needed");
  require(w.size() == static_cast<std::size_t>(cfg.n_layers), "capture_mla_samples: one weight set per layer");
  const int dc = cfg.kv_lora_rank, dr = cfg.qk_rope_head_dim, H = cfg.n_heads, hid = cfg.hidden_size;
  std::vector<std::vector<MlaSample<float>>> out(w.size(), std::vector<MlaSample<float>>(seqs.size()));
  const CacheGeometry g = model.cache_geometry();
  for (std::size_t i = 0; i < seqs.size(); ++i) {
    model.set_observer([&](const LayerTrace& tr) {
      const auto& gamma = w[static_cast<std::size_t>(tr.layer)].gamma;
      MlaSample<float>& x = out[static_cast<std::size_t>(tr.layer)][i];
      require(tr.pos0 == 0, "capture_mla_samples: a sequence must run as one chunk");
      x.T = tr.n;
      const std::size_t n = static_cast<std::size_t>(tr.n);
      x.u.resize(n * dc);
      x.qa.resize(n * H * dc);
      x.qr.resize(n * H * dr);
      x.p.assign(tr.v, tr.v + n * dr);
      for (std::size_t t = 0; t < n; ++t) {
        for (int j = 0; j < dc; ++j) x.u[t * dc + j] = tr.k[t * dc + j] / gamma[static_cast<std::size_t>(j)];
        for (int h = 0; h < H; ++h) {
          const float* q = tr.q + (t * H + h) * static_cast<std::size_t>(dc + dr);
          std::copy(q, q + dc, x.qa.begin() + static_cast<std::ptrdiff_t>((t * H + h) * dc));
          std::copy(q + dc, q + dc + dr, x.qr.begin() + static_cast<std::ptrdiff_t>((t * H + h) * dr));
        }
      }
      for (const auto* v : {&x.u, &x.qa, &x.qr, &x.p})
        for (float e : *v)
          if (!std::isfinite(e))
            fail("non-finite activation in layer " + std::to_string(tr.layer) + " of calibration sequence " + std::to_string(i));
    });
    auto cache = make_dense_cache(g, 1, 0, DenseStorage::kF32);
    const auto& sq = seqs[i];
    try {
      model.forward(sq.data(), static_cast<int>(sq.size()), *cache, 0, nullptr, LogitsMode::kNone);
    } catch (...) {
      model.set_observer({});
      throw;
    }
  }
  model.set_observer({});
  // Teacher outputs from the block itself (exact cache), so that a disabled quantizer gives 0.
  for (std::size_t l = 0; l < w.size(); ++l) {
    ops::BlasSingleThread bguard;
#pragma omp parallel for schedule(dynamic)
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      auto& x = out[l][i];
      std::vector<float> C(x.u.size());
      for (std::size_t k = 0; k < C.size(); ++k) C[k] = x.u[k] * w[l].gamma[k % static_cast<std::size_t>(dc)];
      MlaDims d = w[l].dims;
      d.T = x.T;
      MlaBlock<float> blk(d, w[l].w_uv.data(), w[l].w_o.data(), w[l].scale);
      x.y.resize(static_cast<std::size_t>(x.T) * hid);
      blk.forward(x.qa.data(), x.qr.data(), C.data(), x.p.data(), x.y.data());
    }
  }
  return out;
}

std::string check_calib_output(const std::string& out_dir, const std::string& model_dir, bool overwrite) {
  if (out_dir.empty()) fail("kvq calibrate: --out is required");
  std::error_code ec;
  fs::path raw = fs::absolute(out_dir, ec).lexically_normal();
  if (!raw.has_filename()) raw = raw.parent_path();  // "dir/" -> "dir"
  const fs::path out = ec ? fs::path() : fs::weakly_canonical(raw, ec);
  if (ec || out.empty() || !out.has_filename() || out == out.root_path())
    fail(out_dir + ": not a usable output directory" + (ec ? " (" + ec.message() + ")" : std::string()));
  // `inner` lies in `outer` (or is it).
  auto within = [](const fs::path& inner, const fs::path& outer) {
    auto i = inner.begin();
    for (auto p = outer.begin(); p != outer.end(); ++p, ++i)
      if (i == inner.end() || *i != *p) return false;
    return true;
  };
  const fs::path model = fs::weakly_canonical(fs::absolute(model_dir, ec), ec);
  if (!ec && within(model, out))
    fail(out_dir + ": the output directory would replace the model directory " + model_dir + " (or a directory holding it)");
  const fs::path cwd = fs::current_path(ec);
  if (!ec && within(fs::weakly_canonical(cwd, ec), out))
    fail(out_dir + ": the output directory is the working directory or holds it; name a new directory");
  if (!fs::exists(out, ec)) return out.string();
  if (!fs::is_directory(out, ec)) fail(out_dir + ": exists and is not a directory; nothing written");
  if (fs::directory_iterator(out, ec) == fs::directory_iterator()) {
    if (ec) fail(out_dir + ": cannot read the directory (" + ec.message() + ")");
    return out.string();  // empty
  }
  if (!overwrite)
    fail(out_dir + ": exists and is not empty; nothing written (--overwrite replaces an earlier output of kvq calibrate)");
  if (!fs::is_regular_file(out / "kvq_calibration.json", ec))
    fail(out_dir + ": --overwrite replaces only an earlier output of kvq calibrate (a directory with "
         "kvq_calibration.json), and this directory has none; nothing written");
  return out.string();
}

CalibResult calibrate(const CalibOptions& o) {
  const auto t0 = Clock::now();
  CalibResult res;
  // ---- validation (before any work) -------------------------------------------------------------
  const ModelConfig cfg = load_model_config((fs::path(o.model_dir) / "config.json").string());
  if (!cfg.mla)
    fail(o.model_dir + ": kvq calibrate needs an MLA (DeepSeek-V2/V3) model; this one is " + cfg.architecture);
  if (cfg.fp8) fail(o.model_dir + ": fp8 block-scaled checkpoints are not supported by kvq calibrate");
  const FormatSpec& f = find_format(o.cache);
  if (f.kind != FormatKind::kMlaAffine)
    fail("kvq calibrate: --cache must be a cXrY format (group-64 affine content and RoPE caches), not " + f.name);
  require(o.steps >= 0 && o.train_seqs > 0 && o.heldout_seqs > 0 && o.seq_len >= 8 && o.batch > 0 && o.eval_every > 0,
          "kvq calibrate: steps >= 0, train/held-out sequences > 0, seq-len >= 8, batch > 0 and eval-every > 0 required");
  require(o.rope_seq_len == 0 || o.rope_seq_len >= 8, "kvq calibrate: rope-seq-len must be 0 (= seq-len) or >= 8");
  if (!o.content_path && !o.rope_path) fail("kvq calibrate: --paths selects no path (content, rope or both)");
  const fs::path out(check_calib_output(o.out_dir, o.model_dir, o.overwrite));
  // Work directories beside the output, named for this process and created new: no existing path is
  // removed but the output itself, and only once the finished model is in its work directory.
  const std::string tag = ".kvq-tmp-" + std::to_string(static_cast<long long>(::getpid()));
  const fs::path tmp = out.string() + tag;
  const fs::path tmp32 = out.string() + ".f32check" + tag;
  auto make_work_dir = [&](const fs::path& d) {
    std::error_code ec;
    if (fs::exists(d, ec)) fail(d.string() + ": exists; remove it (a work directory of an interrupted run?) and retry");
    fs::create_directories(d.parent_path(), ec);
    if (ec || !fs::create_directory(d, ec) || ec)
      fail(o.out_dir + ": cannot create the work directory " + d.string() + " next to it (" +
           (ec ? ec.message() : "not created") + ")");
  };
  make_work_dir(tmp);
  struct TmpGuard {
    fs::path a, b;
    bool keep = false, made_b = false;
    ~TmpGuard() {
      std::error_code ec;
      if (!keep) fs::remove_all(a, ec);
      if (made_b) fs::remove_all(b, ec);
    }
  } guard{tmp, tmp32};
  {
    std::error_code ec;
    std::ofstream probe(tmp / "probe", std::ios::binary);
    if (!(probe << "x")) fail(o.out_dir + ": output directory is not writable");
    probe.close();
    fs::remove(tmp / "probe", ec);
  }

  auto model = Model::load(o.model_dir);
  const CacheGeometry g = model->cache_geometry();
  const QuantizerPair qp = make_quantizers(f, g, 0, 0, nullptr);
  const auto* qc = dynamic_cast<const AffineGroup*>(qp.key.get());
  const auto* qr = dynamic_cast<const AffineGroup*>(qp.value.get());
  require(qc && qr, "kvq calibrate: the cXrY quantizers must be AffineGroup");
  const AffineSte<float> opc(*qc), opr(*qr);
  const int dc = cfg.kv_lora_rank, dr = cfg.qk_rope_head_dim, H = cfg.n_heads,
            hid = cfg.hidden_size, NL = cfg.n_layers, T = o.seq_len, Tr = o.rope_seq_len > 0 ? o.rope_seq_len : o.seq_len;
  const RopePairs pairs{dr, cfg.rope.interleaved};
  if (o.method == CalibMethod::kQuaRot && ((dc & (dc - 1)) != 0 || (dr & (dr - 1)) != 0))
    fail("kvq calibrate: quarot needs power-of-two kv_lora_rank and qk_rope_head_dim");

  // ---- sequences --------------------------------------------------------------------------------
  std::ifstream tf(o.text_file, std::ios::binary);
  if (!tf) fail(o.text_file + ": cannot open the calibration text");
  std::stringstream ss;
  ss << tf.rdbuf();
  auto tok = Tokenizer::load((fs::path(o.model_dir) / "tokenizer.json").string());
  require(!cfg.eos_token_ids.empty() && cfg.bos_token_id >= 0, "kvq calibrate: the model needs bos and eos token ids");
  const auto stream = ppl_token_stream(ss.str(), [&](std::string_view s) { return tok->encode(s); }, cfg.eos_token_ids[0]);
  const int nseq = o.train_seqs + o.heldout_seqs;
  // nseq windows of T - 1 tokens (after <|bos|>) in a seeded order: the first train_seqs train,
  // the rest are held out.
  auto make_seqs = [&](int T_) {
    const std::size_t need = static_cast<std::size_t>(nseq) * static_cast<std::size_t>(T_ - 1);
    if (stream.size() < need)
      fail(o.text_file + ": " + std::to_string(stream.size()) + " tokens, " + std::to_string(need) + " needed for " +
           std::to_string(nseq) + " sequences of " + std::to_string(T_));
    std::vector<int> win(stream.size() / static_cast<std::size_t>(T_ - 1));
    std::iota(win.begin(), win.end(), 0);
    SplitMix64 rng(mix_seed(o.seed, 0, 0, 0x63616cu));
    for (std::size_t i = win.size() - 1; i > 0; --i) std::swap(win[i], win[rng.next() % (i + 1)]);
    std::vector<std::vector<std::int32_t>> made(static_cast<std::size_t>(nseq));
    for (int i = 0; i < nseq; ++i) {
      auto& q = made[static_cast<std::size_t>(i)];
      q.push_back(cfg.bos_token_id);
      const std::size_t b = static_cast<std::size_t>(win[static_cast<std::size_t>(i)]) * static_cast<std::size_t>(T_ - 1);
      q.insert(q.end(), stream.begin() + static_cast<std::ptrdiff_t>(b), stream.begin() + static_cast<std::ptrdiff_t>(b + T_ - 1));
    }
    return made;
  };
  const std::vector<std::vector<std::int32_t>> seqs = make_seqs(T);
  const std::vector<std::vector<std::int32_t>> rope_seqs = Tr != T && o.rope_path ? make_seqs(Tr) : decltype(seqs){};

  // ---- layer weights and capture (exact fp32 cache) ---------------------------------------------
  std::vector<LayerData> layers(static_cast<std::size_t>(NL));
  {
    auto ws = load_mla_layer_weights(o.model_dir);
    // Per layer: samples [0, train_seqs) to `train`, the rest to `held`.
    auto split = [&](std::vector<std::vector<MlaSample<float>>>& samples, auto train, auto held) {
      for (int l = 0; l < NL; ++l) {
        auto& L = layers[static_cast<std::size_t>(l)];
        auto& sl = samples[static_cast<std::size_t>(l)];
        for (int i = 0; i < nseq; ++i) (i < o.train_seqs ? L.*train : L.*held).push_back(std::move(sl[static_cast<std::size_t>(i)]));
      }
    };
    say(o, "capturing " + std::to_string(nseq) + " sequences of " + std::to_string(T) + " tokens from " + o.text_file);
    auto samples = capture_mla_samples(*model, ws, seqs);
    split(samples, &LayerData::train, &LayerData::held);
    if (!rope_seqs.empty()) {
      say(o, "capturing " + std::to_string(nseq) + " sequences of " + std::to_string(Tr) + " tokens for the RoPE path");
      auto rs = capture_mla_samples(*model, ws, rope_seqs);
      split(rs, &LayerData::rope_train_own, &LayerData::rope_held_own);
    }
    for (int l = 0; l < NL; ++l) {
      auto& L = layers[static_cast<std::size_t>(l)];
      L.w = std::move(ws[static_cast<std::size_t>(l)]);
      L.w.dims.T = T;
      L.gamma = L.w.gamma;
    }
    say(o, "captured in " + std::to_string(static_cast<int>(since(t0))) + " s");
  }

  // ---- per layer, per path ---------------------------------------------------------------------
  const std::vector<double> alphas_qm = {0.0, 0.125, 0.25, 0.5, 0.75, 1.0};
  const std::vector<double> alphas_sq = {0.125, 0.25, 0.5, 0.75, 1.0};
  std::vector<LayerTransform> transforms(static_cast<std::size_t>(NL));
  res.layers.resize(static_cast<std::size_t>(NL));
  const bool hadamard_rope = o.method == CalibMethod::kQuaRot && o.rope_path;
  for (int l = 0; l < NL; ++l) {
    auto& L = layers[static_cast<std::size_t>(l)];
    auto& R = res.layers[static_cast<std::size_t>(l)];
    auto& TR = transforms[static_cast<std::size_t>(l)];
    const std::vector<double> I = identity(dc), gam(L.gamma.begin(), L.gamma.end()), zero_a(static_cast<std::size_t>(dr / 2), 0.0),
                              one_r(static_cast<std::size_t>(dr / 2), 1.0);
    R.content.rtn = content_heldout(L, I, gam, &opc);
    R.rope.rtn = rope_heldout(L, pairs, zero_a, one_r, false, &opr);
    R.rope_output_rtn = rope_output_heldout(L, pairs, zero_a, one_r, false, &opr);
    // Statistics on the training set.
    std::vector<const std::vector<float>*> ub;
    for (const auto& x : L.train) ub.push_back(&x.u);
    const std::vector<double> a_c = percentile_abs(ub, dc, 0.999);
    // RoPE: the pair magnitude sqrt(k_a^2 + k_b^2) (invariant under RoPE), 99.9th percentile.
    std::vector<float> pair_mag;
    pair_mag.reserve(L.rope_train().size() * static_cast<std::size_t>(Tr) * static_cast<std::size_t>(dr / 2));
    for (const auto& x : L.rope_train())
      for (int t = 0; t < x.T; ++t)
        for (int i = 0; i < dr / 2; ++i) {
          const float a = x.p[static_cast<std::size_t>(t) * dr + pairs.first(i)], b = x.p[static_cast<std::size_t>(t) * dr + pairs.second(i)];
          pair_mag.push_back(std::sqrt(a * a + b * b));
        }
    const std::vector<double> a_r = percentile_abs({&pair_mag}, dr / 2, 0.999);
    // ---- content
    std::vector<double> rot = I, s(static_cast<std::size_t>(dc), 1.0);
    if (!o.content_path) {
      R.content.init = R.content.best = R.content.rtn;
    } else if (o.method == CalibMethod::kQuaRot) {
      for (int i = 0; i < dc; ++i) {
        std::vector<double> e(static_cast<std::size_t>(dc), 0.0);
        e[static_cast<std::size_t>(i)] = 1.0;
        fwht(e.data(), dc);  // normalized: row i of H / sqrt(dc)
        for (int j = 0; j < dc; ++j) rot[static_cast<std::size_t>(i) * dc + j] = e[static_cast<std::size_t>(j)];
      }
      R.content.init = R.content.best = content_heldout(L, rot, s, &opc);
    } else {
      const auto& alphas = o.method == CalibMethod::kQuantMla ? alphas_qm : alphas_sq;
      double best = INFINITY;
      for (double al : alphas) {
        const std::vector<double> sa = alpha_scales(a_c, al);
        const double v = content_heldout(L, I, sa, &opc);
        if (v < best) best = v, s = sa, R.content.alpha = al;
      }
      R.content.init = R.content.best = best;
    }
    // ---- RoPE
    std::vector<double> ang = zero_a, rs = one_r;
    if (!o.rope_path) {
      R.rope.init = R.rope.best = R.rope.rtn;
    } else if (o.method == CalibMethod::kQuaRot) {
      R.rope.init = R.rope.best = rope_heldout(L, pairs, ang, rs, true, &opr);
    } else {
      const auto& alphas = o.method == CalibMethod::kQuantMla ? alphas_qm : alphas_sq;
      double best = INFINITY;
      for (double al : alphas) {
        const std::vector<double> sa = alpha_scales(a_r, al);
        const double v = o.method == CalibMethod::kQuantMla ? rope_heldout(L, pairs, zero_a, sa, false, &opr)
                                                            : rope_output_heldout(L, pairs, zero_a, sa, false, &opr);
        if (v < best) best = v, rs = sa, R.rope.alpha = al;
      }
      R.rope.init = R.rope.best = o.method == CalibMethod::kQuantMla ? best : rope_heldout(L, pairs, zero_a, rs, false, &opr);
    }
    say(o, "layer " + std::to_string(l) + ": content RTN " + std::to_string(R.content.rtn) + " init " +
               std::to_string(R.content.init) + " (alpha " + std::to_string(R.content.alpha) + "); RoPE RTN " +
               std::to_string(R.rope.rtn) + " init " + std::to_string(R.rope.init) + " (alpha " + std::to_string(R.rope.alpha) + ")");
    if (o.method == CalibMethod::kQuantMla && o.steps > 0) {
      // Content: A skew (Cayley), l = log s.
      if (o.content_path) {
        std::vector<double> A(static_cast<std::size_t>(dc) * dc, 0.0), lg(static_cast<std::size_t>(dc));
        for (int j = 0; j < dc; ++j) lg[static_cast<std::size_t>(j)] = std::log(s[static_cast<std::size_t>(j)]);
        std::vector<double> bestA = A, bestL = lg;
        Adam adA(A.size(), o.lr_rotation), adL(lg.size(), o.lr_scale);
        Batches bt(static_cast<int>(L.train.size()), mix_seed(o.seed, static_cast<std::uint32_t>(l), 0, 0x636f6eu));
        for (int step = 1; step <= o.steps; ++step) {
          std::vector<double> M;
          const std::vector<double> Rm = cayley(A, dc, &M);
          const std::vector<double> sv = exp_scales(lg);
          const std::vector<float> rf = to_float(Rm), sf = to_float(sv);
          const std::vector<int> idx = bt.next(o.batch);
          auto [gR, gs] = minibatch_gradients(idx, Rm.size(), static_cast<std::size_t>(dc), [&](int i, float* a, float* b) {
            content_objective(L.w, L.train[static_cast<std::size_t>(i)], rf.data(), sf.data(), &opc, a, b);
          });
          std::vector<double> gA = cayley_backward(M, Rm, gR, dc);
          std::vector<double> gl(lg.size());
          for (std::size_t j = 0; j < lg.size(); ++j) gl[j] = gs[j] * log_scale_grad(lg[j]);
          adA.step(A, gA);
          adL.step(lg, gl);
          if (step % o.eval_every == 0 || step == o.steps) {
            const double v = content_heldout(L, cayley(A, dc), exp_scales(lg), &opc);
            if (v < R.content.best) R.content.best = v, R.content.best_step = step, bestA = A, bestL = lg;
            say(o, "layer " + std::to_string(l) + " content step " + std::to_string(step) + ": held-out " + std::to_string(v) +
                       " (best " + std::to_string(R.content.best) + " at " + std::to_string(R.content.best_step) + ")");
          }
        }
        rot = cayley(bestA, dc);
        s = exp_scales(bestL);
      }
      // RoPE: angles and pair log-scales.
      if (o.rope_path) {
        std::vector<double> lg(static_cast<std::size_t>(dr / 2));
        for (std::size_t i = 0; i < lg.size(); ++i) lg[i] = std::log(rs[i]);
        std::vector<double> bestAng = ang, bestL = lg;
        Adam adT(ang.size(), o.lr_angle), adL(lg.size(), o.lr_scale);
        Batches bt(static_cast<int>(L.rope_train().size()), mix_seed(o.seed, static_cast<std::uint32_t>(l), 0, 0x726f70u));
        for (int step = 1; step <= o.steps; ++step) {
          const std::vector<double> sv = exp_scales(lg);
          const std::vector<float> af = to_float(ang), sf = to_float(sv);
          const std::vector<int> idx = bt.next(o.batch);
          auto [ga, gs] = minibatch_gradients(idx, ang.size(), lg.size(), [&](int i, float* a, float* b) {
            rope_objective(L.rope_train()[static_cast<std::size_t>(i)], H, pairs, af.data(), sf.data(), false, &opr, a, b);
          });
          std::vector<double> gl(lg.size());
          for (std::size_t j = 0; j < lg.size(); ++j) gl[j] = gs[j] * log_scale_grad(lg[j]);
          adT.step(ang, ga);
          adL.step(lg, gl);
          if (step % o.eval_every == 0 || step == o.steps) {
            const double v = rope_heldout(L, pairs, ang, exp_scales(lg), false, &opr);
            if (v < R.rope.best) R.rope.best = v, R.rope.best_step = step, bestAng = ang, bestL = lg;
          }
        }
        say(o, "layer " + std::to_string(l) + " RoPE: held-out " + std::to_string(R.rope.init) + " -> " +
                   std::to_string(R.rope.best) + " (step " + std::to_string(R.rope.best_step) + ")");
        ang = bestAng;
        rs = exp_scales(bestL);
      }
    }
    R.rope_output_best = rope_output_heldout(L, pairs, ang, rs, hadamard_rope, &opr);
    TR.rotation = rot;
    TR.scale = s;
    if (!hadamard_rope) {
      TR.angle = ang;
      TR.rope_scale = rs;
    }
    // Layer data is no longer needed.
    L.train.clear();
    L.held.clear();
    L.rope_train_own.clear();
    L.rope_held_own.clear();
  }

  // ---- fusion, checks, output ------------------------------------------------------------------
  nlohmann::json j;
  j["format"] = "kvq-calibration";
  j["version"] = 1;
  j["method"] = calib_method_name(o.method);
  j["cache"] = f.name;
  j["paths"] = o.content_path && o.rope_path ? "both" : o.content_path ? "content" : "rope";
  j["quantizer"] = {{"content", qc->name()}, {"rope", qr->name()},
                    {"rule", "s = round_T((max - min) / (2^b - 1)), z = clamp(rint(-min / s)), q = clamp(rint(x / s) + z), ties to even"},
                    {"gradient", "straight-through rounding, scale gradient to the group max/min"}};
  j["source_model"] = fs::absolute(o.model_dir).string();
  j["calibration_text"] = o.text_file;
  j["seed"] = o.seed;
  j["steps"] = o.method == CalibMethod::kQuantMla ? o.steps : 0;
  j["train_seqs"] = o.train_seqs;
  j["heldout_seqs"] = o.heldout_seqs;
  j["seq_len"] = T;
  j["rope_seq_len"] = Tr;
  j["batch"] = o.batch;
  j["eval_every"] = o.eval_every;
  j["optimizer"] = {{"name", "adam"}, {"lr_rotation", o.lr_rotation}, {"lr_scale", o.lr_scale}, {"lr_angle", o.lr_angle},
                    {"beta1", 0.9}, {"beta2", 0.999}, {"eps", 1e-8}};
  j["online_rope_hadamard"] = hadamard_rope;
  j["dtype"] = o.dtype == FuseDtype::kF32 ? "float32" : "source";
  nlohmann::json jl = nlohmann::json::array();
  for (int l = 0; l < NL; ++l) {
    const auto& R = res.layers[static_cast<std::size_t>(l)];
    auto path = [](const PathResult& p) {
      nlohmann::json x = {{"rtn", p.rtn}, {"init", p.init}, {"best", p.best}, {"best_step", p.best_step}};
      if (p.alpha >= 0) x["alpha"] = p.alpha;
      return x;
    };
    jl.push_back({{"layer", l}, {"content", path(R.content)}, {"rope", path(R.rope)},
                  {"rope_output_nmse", {{"rtn", R.rope_output_rtn}, {"best", R.rope_output_best}}}});
  }
  j["layers"] = jl;

  // Quantization-disabled equivalence: fp32 fused model against the original.
  say(o, "fusion check (fp32, quantization off)");
  make_work_dir(tmp32);
  guard.made_b = true;
  nlohmann::json j32 = {{"online_rope_hadamard", hadamard_rope}};
  fuse_into(o.model_dir, transforms, tmp32.string(), FuseDtype::kF32, j32.dump(2));
  auto run_nll = [&](Model& m, std::vector<std::vector<float>>* outs) {
    double nll = 0;
    const int vocab = cfg.vocab_size;
    for (int c = 0; c < o.check_seqs && c < o.heldout_seqs; ++c) {
      const auto& sq = seqs[static_cast<std::size_t>(o.train_seqs + c)];
      if (outs)
        m.set_observer([&](const LayerTrace& tr) {
          (*outs).emplace_back(tr.attn_proj, tr.attn_proj + static_cast<std::size_t>(tr.n) * hid);
        });
      auto cache = make_dense_cache(g, 1, 0, DenseStorage::kF32);
      std::vector<float> logits(static_cast<std::size_t>(T) * vocab);
      m.forward(sq.data(), T, *cache, 0, logits.data(), LogitsMode::kAll);
      m.set_observer({});
      nll += mean_next_token_nll(logits.data(), vocab, sq.data(), T);
    }
    return nll / std::min(o.check_seqs, o.heldout_seqs);
  };
  std::vector<std::vector<float>> ref_out, fused_out;
  res.nll_original = run_nll(*model, &ref_out);
  {
    auto fm = Model::load(tmp32.string());
    res.nll_fused_f32 = run_nll(*fm, &fused_out);
  }
  require(ref_out.size() == fused_out.size(), "fusion check: layer count differs");
  std::vector<double> per_layer(static_cast<std::size_t>(NL), 0.0);
  for (std::size_t i = 0; i < ref_out.size(); ++i) {
    double mx = 0, md = 0;
    for (std::size_t k = 0; k < ref_out[i].size(); ++k) {
      mx = std::max(mx, std::fabs(static_cast<double>(ref_out[i][k])));
      md = std::max(md, std::fabs(static_cast<double>(ref_out[i][k]) - fused_out[i][k]));
    }
    auto& e = per_layer[i % static_cast<std::size_t>(NL)];
    e = std::max(e, md / std::max(mx, 1e-30));
  }
  res.fusion_max_rel_err = *std::max_element(per_layer.begin(), per_layer.end());
  j["fusion_check"] = {{"sequences", std::min(o.check_seqs, o.heldout_seqs)},
                       {"layer_output_max_rel_err", per_layer},
                       {"nll_original", res.nll_original},
                       {"nll_fused_f32", res.nll_fused_f32},
                       {"nll_drift_f32", res.nll_fused_f32 - res.nll_original}};
  if (!(res.fusion_max_rel_err <= 1e-4) || !(std::fabs(res.nll_fused_f32 - res.nll_original) <= 1e-4))
    fail("kvq calibrate: the fused fp32 model does not reproduce the original (max layer output relative error " +
         std::to_string(res.fusion_max_rel_err) + ", NLL drift " + std::to_string(res.nll_fused_f32 - res.nll_original) +
         "); nothing written");
  // The saved checkpoint (source dtype unless --dtype f32).
  say(o, "writing " + o.out_dir);
  {
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(tmp)) fs::remove_all(e.path(), ec);
  }
  res.checksum = fuse_into(o.model_dir, transforms, tmp.string(), o.dtype, j32.dump(2));  // full record below
  {
    auto sm = Model::load(tmp.string());
    res.nll_saved = run_nll(*sm, nullptr);
  }
  j["fusion_check"]["nll_saved"] = res.nll_saved;
  j["fusion_check"]["nll_drift_saved"] = res.nll_saved - res.nll_original;
  j["checksums"] = {{"model.safetensors", "fnv1a64:" + res.checksum}};
  res.seconds = since(t0);
  j["seconds"] = res.seconds;
  res.json = j.dump(2) + "\n";
  {
    std::ofstream jf(tmp / "kvq_calibration.json", std::ios::binary | std::ios::trunc);
    jf << res.json;
    if (!jf) fail(o.out_dir + ": cannot write kvq_calibration.json");
  }
  std::error_code ec;
  check_calib_output(o.out_dir, o.model_dir, o.overwrite);  // again: the run took minutes
  if (fs::exists(out)) fs::remove_all(out, ec);
  if (ec) {
    guard.keep = true;
    fail(o.out_dir + ": cannot remove the earlier output (" + ec.message() + "); the new model is in " + tmp.string());
  }
  fs::rename(tmp, out, ec);
  if (ec) {
    guard.keep = true;
    fail(o.out_dir + ": cannot move the finished model into place (" + ec.message() + "); it is in " + tmp.string());
  }
  guard.keep = true;
  return res;
}

}  // namespace kvq
