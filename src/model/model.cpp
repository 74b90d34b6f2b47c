// The forward pass of Llama-family and DeepSeek-V2/V3 models on the CPU, in fp32.
//
// Per chunk of tokens: embeddings, then per layer RMSNorm -> attention -> residual -> RMSNorm ->
// MLP or MoE -> residual, final RMSNorm and the LM head. Projections run as OpenBLAS sgemm on
// fused weights (q|k|v, gate|up, q|kv_a); element-wise work runs under OpenMP. Attention always
// goes through KvCache (append, then attend), except the optional expanded MLA prefill used to
// check the absorbed form.
//
// MLA (DeepSeek-V2 paper, sec. 2.1.2-2.1.3): c_KV = RMSNorm(W_DKV h) is the cached latent, k_R =
// RoPE(W_KR h) the cached rope key. kv_b_proj holds, per head, W_UK [nope x d_c] then
// W_UV [v x d_c]. Absorbed: q_nope^T (W_UK c) = (W_UK^T q_nope)^T c, so the query sent to the
// cache is [W_UK^T q_nope | q_rope] and the cache returns sum_t p_t c_t, to which W_UV is applied.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "kvq/common.hpp"
#include "kvq/model.hpp"
#include "kvq/numeric.hpp"
#include "kvq/rotation.hpp"
#include "ops.hpp"
#include "weights.hpp"

extern "C" {
// OpenBLAS DYNAMIC_ARCH entry points (weak: absent from single-target builds).
void gotoblas_dynamic_init(void) __attribute__((weak));
void gotoblas_dynamic_quit(void) __attribute__((weak));
char* openblas_get_corename(void) __attribute__((weak));
}

namespace kvq {

namespace ops {
const char* select_blas_kernels() {
  static const char* name = [] {
    const char* current = openblas_get_corename ? openblas_get_corename() : "unknown";
    openblas_set_num_threads(1);
    if (std::getenv("OPENBLAS_CORETYPE") || !gotoblas_dynamic_init || !gotoblas_dynamic_quit || !openblas_get_corename)
      return current;
    const std::string cur = current;
    if (cur != "Prescott" && cur != "Core2" && cur != "Nehalem" && cur != "Penryn" && cur != "Dunnington") return current;
    const char* want = nullptr;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512dq"))
      want = "SkylakeX";
    else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
      want = "Haswell";
    if (!want) return current;
    ::setenv("OPENBLAS_CORETYPE", want, 0);
    gotoblas_dynamic_quit();
    gotoblas_dynamic_init();
    ::unsetenv("OPENBLAS_CORETYPE");
    return static_cast<const char*>(openblas_get_corename());
  }();
  return name;
}
}  // namespace ops

namespace {

struct Linear {
  std::vector<float> w;  // [out x in]
  std::vector<float> b;  // [out] or empty
  int out = 0, in = 0;
  void apply(const float* x, int n, float* y) const {
    ops::gemm_nt(n, out, in, x, in, w.data(), in, y, out);
    if (!b.empty()) {
      for (int i = 0; i < n; ++i)
        for (int j = 0; j < out; ++j) y[static_cast<std::size_t>(i) * out + j] += b[j];
    }
  }
};

struct Expert {
  Linear gate_up;  // [2I x H]: gate rows then up rows
  Linear down;     // [H x I]
};

struct Layer {
  std::vector<float> in_norm, post_norm;
  // GQA
  Linear qkv, o;
  std::vector<float> q_norm, k_norm;
  // MLA
  Linear q_kva;  // [q_proj or q_a_proj ; kv_a_proj_with_mqa] fused
  std::vector<float> q_a_norm, kv_a_norm;
  Linear q_b;
  std::vector<float> w_uk;  // [H][nope][d_c]
  std::vector<float> w_uv;  // [H][v][d_c]
  // MLP
  bool moe = false;
  Expert dense;
  Linear router;
  std::vector<float> corr_bias;
  std::vector<Expert> experts;
  bool has_shared = false;
  Expert shared;
};

void swiglu(const Expert& e, const float* x, int n, std::vector<float>& gu, float* y) {
  const int inter = e.down.in;
  gu.resize(static_cast<std::size_t>(n) * 2 * inter);
  e.gate_up.apply(x, n, gu.data());
#pragma omp parallel for schedule(static) if (n > 8)
  for (int i = 0; i < n; ++i) {
    float* row = gu.data() + static_cast<std::size_t>(i) * 2 * inter;
    for (int j = 0; j < inter; ++j) row[j] = ops::silu(row[j]) * row[inter + j];
  }
  ops::gemm_nt(n, e.down.out, inter, gu.data(), 2 * inter, e.down.w.data(), inter, y, e.down.out);
  if (!e.down.b.empty())
    for (int i = 0; i < n; ++i)
      for (int j = 0; j < e.down.out; ++j) y[static_cast<std::size_t>(i) * e.down.out + j] += e.down.b[j];
}

class ModelImpl final : public Model {
 public:
  ModelImpl(const std::string& dir);

  const ModelConfig& config() const override { return cfg_; }
  CacheGeometry cache_geometry() const override {
    CacheGeometry g;
    g.n_layers = cfg_.n_layers;
    g.mla = cfg_.mla;
    if (cfg_.mla) {
      g.d_latent = cfg_.kv_lora_rank;
      g.d_rope = cfg_.qk_rope_head_dim;
    } else {
      g.n_kv_heads = cfg_.n_kv_heads;
      g.head_dim = cfg_.head_dim;
      g.v_head_dim = cfg_.head_dim;
    }
    return g;
  }
  void forward(const std::int32_t* tokens, int n, KvCache& cache, int seq, float* logits, LogitsMode mode) override;
  void set_observer(LayerObserver observer) override { observer_ = std::move(observer); }
  void set_mla_prefill(MlaPrefill mode) override { mla_prefill_ = mode; }
  void set_max_chunk(int tokens) override {
    require(tokens > 0, "max chunk must be positive");
    max_chunk_ = tokens;
  }
  int max_chunk() const override { return max_chunk_; }
  std::size_t weight_bytes() const override { return weight_bytes_; }

 private:
  void forward_chunk(const std::int32_t* tokens, int n, int pos0, KvCache& cache, int seq, float* logits,
                     LogitsMode mode);
  void attention_gqa(int l, const float* h, int n, int pos0, KvCache& cache, int seq, float* out);
  void attention_mla(int l, const float* h, int n, int pos0, KvCache& cache, int seq, float* out);
  void mlp(int l, const float* h, int n, float* out);
  void rope_tables(int pos0, int n);

  Linear linear(detail::WeightStore& ws, const std::string& name, int out, int in, bool bias);
  std::vector<float> vec(detail::WeightStore& ws, const std::string& name, int n);

  ModelConfig cfg_;
  std::vector<float> embed_;  // [V x H]
  std::vector<float> final_norm_;
  Linear lm_head_;            // empty w when tied
  std::vector<Layer> layers_;
  std::vector<float> inv_freq_;
  std::vector<float> cos_, sin_;  // [n][rope.dim/2] for the current chunk
  LayerObserver observer_;
  MlaPrefill mla_prefill_ = MlaPrefill::kAuto;
  int max_chunk_ = 2048;
  std::size_t weight_bytes_ = 0;
};

Linear ModelImpl::linear(detail::WeightStore& ws, const std::string& name, int out, int in, bool bias) {
  Linear L;
  L.out = out;
  L.in = in;
  L.w = ws.load(name + ".weight", {out, in});
  if (bias) L.b = ws.load(name + ".bias", {out});
  weight_bytes_ += (L.w.size() + L.b.size()) * sizeof(float);
  return L;
}

std::vector<float> ModelImpl::vec(detail::WeightStore& ws, const std::string& name, int n) {
  auto v = ws.load(name, {n});
  weight_bytes_ += v.size() * sizeof(float);
  return v;
}

// Stacks linears that read the same input into one [sum(out) x in] matrix.
Linear fuse(std::vector<Linear> parts) {
  Linear f;
  f.in = parts.at(0).in;
  bool any_bias = false;
  for (const auto& p : parts) any_bias |= !p.b.empty();
  for (auto& p : parts) {
    f.out += p.out;
    f.w.insert(f.w.end(), p.w.begin(), p.w.end());
    if (any_bias) {
      if (p.b.empty()) f.b.insert(f.b.end(), p.out, 0.0f);
      else f.b.insert(f.b.end(), p.b.begin(), p.b.end());
    }
    std::vector<float>().swap(p.w);
  }
  return f;
}

ModelImpl::ModelImpl(const std::string& dir) {
  namespace fs = std::filesystem;
  ops::select_blas_kernels();
  if (!fs::is_directory(dir)) fail(dir + ": not a model directory");
  cfg_ = load_model_config((fs::path(dir) / "config.json").string());
  apply_calibration_file(dir, cfg_);
  detail::WeightStore ws(dir, cfg_);
  const int H = cfg_.hidden_size, V = cfg_.vocab_size;
  embed_ = ws.load("model.embed_tokens.weight", {V, H});
  weight_bytes_ += embed_.size() * sizeof(float);
  final_norm_ = vec(ws, "model.norm.weight", H);
  if (!cfg_.tie_word_embeddings) lm_head_ = linear(ws, "lm_head", V, H, false);
  inv_freq_ = rope_inv_freq(cfg_.rope);
  layers_.resize(cfg_.n_layers);
  for (int l = 0; l < cfg_.n_layers; ++l) {
    Layer& L = layers_[l];
    const std::string p = "model.layers." + std::to_string(l) + ".";
    L.in_norm = vec(ws, p + "input_layernorm.weight", H);
    L.post_norm = vec(ws, p + "post_attention_layernorm.weight", H);
    if (!cfg_.mla) {
      const int hd = cfg_.head_dim, nh = cfg_.n_heads, nkv = cfg_.n_kv_heads;
      L.qkv = fuse({linear(ws, p + "self_attn.q_proj", nh * hd, H, cfg_.qkv_bias),
                    linear(ws, p + "self_attn.k_proj", nkv * hd, H, cfg_.qkv_bias),
                    linear(ws, p + "self_attn.v_proj", nkv * hd, H, cfg_.qkv_bias)});
      L.o = linear(ws, p + "self_attn.o_proj", H, nh * hd, cfg_.o_bias);
      if (cfg_.qk_norm) {
        L.q_norm = vec(ws, p + "self_attn.q_norm.weight", hd);
        L.k_norm = vec(ws, p + "self_attn.k_norm.weight", hd);
      }
    } else {
      const int nh = cfg_.n_heads, nope = cfg_.qk_nope_head_dim, rd = cfg_.qk_rope_head_dim, vd = cfg_.v_head_dim;
      const int dc = cfg_.kv_lora_rank;
      Linear q = cfg_.q_lora_rank > 0 ? linear(ws, p + "self_attn.q_a_proj", cfg_.q_lora_rank, H, false)
                                      : linear(ws, p + "self_attn.q_proj", nh * (nope + rd), H, false);
      L.q_kva = fuse({std::move(q), linear(ws, p + "self_attn.kv_a_proj_with_mqa", dc + rd, H, false)});
      if (cfg_.q_lora_rank > 0) {
        L.q_a_norm = vec(ws, p + "self_attn.q_a_layernorm.weight", cfg_.q_lora_rank);
        L.q_b = linear(ws, p + "self_attn.q_b_proj", nh * (nope + rd), cfg_.q_lora_rank, false);
      }
      L.kv_a_norm = vec(ws, p + "self_attn.kv_a_layernorm.weight", dc);
      Linear kvb = linear(ws, p + "self_attn.kv_b_proj", nh * (nope + vd), dc, false);
      L.w_uk.resize(static_cast<std::size_t>(nh) * nope * dc);
      L.w_uv.resize(static_cast<std::size_t>(nh) * vd * dc);
      for (int h = 0; h < nh; ++h) {
        const float* base = kvb.w.data() + static_cast<std::size_t>(h) * (nope + vd) * dc;
        std::copy(base, base + static_cast<std::size_t>(nope) * dc, L.w_uk.data() + static_cast<std::size_t>(h) * nope * dc);
        std::copy(base + static_cast<std::size_t>(nope) * dc, base + static_cast<std::size_t>(nope + vd) * dc,
                  L.w_uv.data() + static_cast<std::size_t>(h) * vd * dc);
      }
      L.o = linear(ws, p + "self_attn.o_proj", H, nh * vd, false);
    }
    L.moe = cfg_.is_moe_layer(l);
    if (!L.moe) {
      const int I = cfg_.intermediate_size;
      L.dense.gate_up = fuse({linear(ws, p + "mlp.gate_proj", I, H, cfg_.mlp_bias), linear(ws, p + "mlp.up_proj", I, H, cfg_.mlp_bias)});
      L.dense.down = linear(ws, p + "mlp.down_proj", H, I, cfg_.mlp_bias);
    } else {
      const MoeConfig& m = cfg_.moe;
      const int E = m.n_routed_experts, I = m.moe_intermediate_size;
      L.router = linear(ws, p + "mlp.gate", E, H, false);
      if (m.correction_bias) L.corr_bias = vec(ws, p + "mlp.gate.e_score_correction_bias", E);
      L.experts.resize(E);
      if (ws.has(p + "mlp.experts.gate_up_proj")) {
        // transformers 5's fused layout: gate_up [E, 2I, H], down [E, H, I].
        const auto gu = ws.load(p + "mlp.experts.gate_up_proj", {E, 2 * I, H});
        const auto dn = ws.load(p + "mlp.experts.down_proj", {E, H, I});
        for (int e = 0; e < E; ++e) {
          Expert& x = L.experts[e];
          x.gate_up.out = 2 * I;
          x.gate_up.in = H;
          x.gate_up.w.assign(gu.begin() + static_cast<std::size_t>(e) * 2 * I * H, gu.begin() + static_cast<std::size_t>(e + 1) * 2 * I * H);
          x.down.out = H;
          x.down.in = I;
          x.down.w.assign(dn.begin() + static_cast<std::size_t>(e) * H * I, dn.begin() + static_cast<std::size_t>(e + 1) * H * I);
        }
        weight_bytes_ += (gu.size() + dn.size()) * sizeof(float);
      } else {
        for (int e = 0; e < E; ++e) {
          const std::string q = p + "mlp.experts." + std::to_string(e) + ".";
          L.experts[e].gate_up = fuse({linear(ws, q + "gate_proj", I, H, false), linear(ws, q + "up_proj", I, H, false)});
          L.experts[e].down = linear(ws, q + "down_proj", H, I, false);
        }
      }
      if (m.n_shared_experts > 0) {
        const int SI = I * m.n_shared_experts;
        L.has_shared = true;
        L.shared.gate_up = fuse({linear(ws, p + "mlp.shared_experts.gate_proj", SI, H, false),
                                 linear(ws, p + "mlp.shared_experts.up_proj", SI, H, false)});
        L.shared.down = linear(ws, p + "mlp.shared_experts.down_proj", H, SI, false);
      }
    }
  }
}

void ModelImpl::rope_tables(int pos0, int n) {
  const int half = cfg_.rope.dim / 2;
  cos_.resize(static_cast<std::size_t>(n) * half);
  sin_.resize(static_cast<std::size_t>(n) * half);
  const float af = static_cast<float>(cfg_.rope.attention_factor);
  for (int i = 0; i < n; ++i) {
    // transformers: freqs = inv_freq (fp32) * position (fp32), then cos/sin in fp32.
    const float pos = static_cast<float>(pos0 + i);
    for (int j = 0; j < half; ++j) {
      const float a = inv_freq_[j] * pos;
      cos_[static_cast<std::size_t>(i) * half + j] = static_cast<float>(std::cos(static_cast<double>(a))) * af;
      sin_[static_cast<std::size_t>(i) * half + j] = static_cast<float>(std::sin(static_cast<double>(a))) * af;
    }
  }
}

void ModelImpl::forward(const std::int32_t* tokens, int n, KvCache& cache, int seq, float* logits, LogitsMode mode) {
  if (n <= 0) fail("forward: no tokens (empty input)");
  const int pos0 = cache.length(seq);
  if (static_cast<std::int64_t>(pos0) + n > cfg_.max_position_embeddings)
    fail("input of " + std::to_string(n) + " tokens at position " + std::to_string(pos0) +
         " exceeds max_position_embeddings (" + std::to_string(cfg_.max_position_embeddings) + ")");
  for (int i = 0; i < n; ++i)
    if (tokens[i] < 0 || tokens[i] >= cfg_.vocab_size)
      fail("token id " + std::to_string(tokens[i]) + " at index " + std::to_string(i) + " is outside the vocabulary (" +
           std::to_string(cfg_.vocab_size) + ")");
  for (int c0 = 0; c0 < n; c0 += max_chunk_) {
    const int m = std::min(max_chunk_, n - c0);
    const bool last = c0 + m == n;
    float* out = nullptr;
    LogitsMode cm = LogitsMode::kNone;
    if (mode == LogitsMode::kAll) {
      out = logits + static_cast<std::size_t>(c0) * cfg_.vocab_size;
      cm = LogitsMode::kAll;
    } else if (mode == LogitsMode::kLast && last) {
      out = logits;
      cm = LogitsMode::kLast;
    }
    forward_chunk(tokens + c0, m, pos0 + c0, cache, seq, out, cm);
  }
}

void ModelImpl::forward_chunk(const std::int32_t* tokens, int n, int pos0, KvCache& cache, int seq, float* logits,
                              LogitsMode mode) {
  const int H = cfg_.hidden_size;
  std::vector<float> x(static_cast<std::size_t>(n) * H), h(x.size()), y(x.size());
  for (int i = 0; i < n; ++i)
    std::memcpy(x.data() + static_cast<std::size_t>(i) * H, embed_.data() + static_cast<std::size_t>(tokens[i]) * H,
                H * sizeof(float));
  rope_tables(pos0, n);
  for (int l = 0; l < cfg_.n_layers; ++l) {
    const Layer& L = layers_[l];
#pragma omp parallel for schedule(static) if (n > 8)
    for (int i = 0; i < n; ++i)
      ops::rmsnorm(x.data() + static_cast<std::size_t>(i) * H, L.in_norm.data(), cfg_.rms_norm_eps, H,
                   h.data() + static_cast<std::size_t>(i) * H);
    if (cfg_.mla) attention_mla(l, h.data(), n, pos0, cache, seq, y.data());
    else attention_gqa(l, h.data(), n, pos0, cache, seq, y.data());
    for (std::size_t i = 0; i < x.size(); ++i) x[i] += y[i];
#pragma omp parallel for schedule(static) if (n > 8)
    for (int i = 0; i < n; ++i)
      ops::rmsnorm(x.data() + static_cast<std::size_t>(i) * H, L.post_norm.data(), cfg_.rms_norm_eps, H,
                   h.data() + static_cast<std::size_t>(i) * H);
    mlp(l, h.data(), n, y.data());
    for (std::size_t i = 0; i < x.size(); ++i) x[i] += y[i];
  }
  if (mode == LogitsMode::kNone) return;
  const int first = mode == LogitsMode::kLast ? n - 1 : 0;
  const int rows = n - first;
#pragma omp parallel for schedule(static) if (rows > 8)
  for (int i = first; i < n; ++i)
    ops::rmsnorm(x.data() + static_cast<std::size_t>(i) * H, final_norm_.data(), cfg_.rms_norm_eps, H,
                 h.data() + static_cast<std::size_t>(i) * H);
  const float* W = cfg_.tie_word_embeddings ? embed_.data() : lm_head_.w.data();
  ops::gemm_nt(rows, cfg_.vocab_size, H, h.data() + static_cast<std::size_t>(first) * H, H, W, H, logits,
               cfg_.vocab_size);
}

void ModelImpl::attention_gqa(int l, const float* h, int n, int pos0, KvCache& cache, int seq, float* out) {
  const Layer& L = layers_[l];
  const int hd = cfg_.head_dim, nh = cfg_.n_heads, nkv = cfg_.n_kv_heads, H = cfg_.hidden_size;
  const int qd = nh * hd, kd = nkv * hd, tot = qd + 2 * kd;
  std::vector<float> qkv(static_cast<std::size_t>(n) * tot);
  L.qkv.apply(h, n, qkv.data());
  std::vector<float> q(static_cast<std::size_t>(n) * qd), k(static_cast<std::size_t>(n) * kd), v(k.size());
  const int half = cfg_.rope.dim / 2;
#pragma omp parallel for schedule(static) if (n > 8)
  for (int i = 0; i < n; ++i) {
    const float* row = qkv.data() + static_cast<std::size_t>(i) * tot;
    float* qi = q.data() + static_cast<std::size_t>(i) * qd;
    float* ki = k.data() + static_cast<std::size_t>(i) * kd;
    std::memcpy(qi, row, qd * sizeof(float));
    std::memcpy(ki, row + qd, kd * sizeof(float));
    std::memcpy(v.data() + static_cast<std::size_t>(i) * kd, row + qd + kd, kd * sizeof(float));
    const float* cs = cos_.data() + static_cast<std::size_t>(i) * half;
    const float* sn = sin_.data() + static_cast<std::size_t>(i) * half;
    for (int hh = 0; hh < nh; ++hh) {
      float* x = qi + hh * hd;
      if (cfg_.qk_norm) ops::rmsnorm(x, L.q_norm.data(), cfg_.rms_norm_eps, hd, x);
      ops::rope_apply(x, hd, false, cs, sn);
    }
    for (int hh = 0; hh < nkv; ++hh) {
      float* x = ki + hh * hd;
      if (cfg_.qk_norm) ops::rmsnorm(x, L.k_norm.data(), cfg_.rms_norm_eps, hd, x);
      ops::rope_apply(x, hd, false, cs, sn);
    }
  }
  cache.append(seq, l, n, k.data(), v.data());
  std::vector<float> att(static_cast<std::size_t>(n) * qd);
  cache.attend(seq, l, n, pos0, nh, cfg_.softmax_scale, q.data(), att.data());
  if (observer_) {
    LayerTrace t;
    t.layer = l;
    t.seq = seq;
    t.pos0 = pos0;
    t.n = n;
    t.n_heads = nh;
    t.scale = cfg_.softmax_scale;
    t.q = q.data();
    t.q_dim = qd;
    t.k = k.data();
    t.k_dim = kd;
    t.v = v.data();
    t.v_dim = kd;
    t.attn_out = att.data();
    t.out_dim = qd;
    L.o.apply(att.data(), n, out);
    t.attn_proj = out;
    observer_(t);
    return;
  }
  (void)H;
  L.o.apply(att.data(), n, out);
}

namespace {
// x <- x H / sqrt(d) (normalized Sylvester Hadamard; symmetric and orthogonal; fwht normalizes).
void online_hadamard(float* x, int d) { fwht(x, d); }
}  // namespace

void ModelImpl::attention_mla(int l, const float* h, int n, int pos0, KvCache& cache, int seq, float* out) {
  const Layer& L = layers_[l];
  const int nh = cfg_.n_heads, nope = cfg_.qk_nope_head_dim, rd = cfg_.qk_rope_head_dim, vd = cfg_.v_head_dim;
  const int dc = cfg_.kv_lora_rank, qh = nope + rd;
  const int qa = cfg_.q_lora_rank > 0 ? cfg_.q_lora_rank : nh * qh;
  const int tot = qa + dc + rd;
  const std::size_t N = static_cast<std::size_t>(n);
  std::vector<float> t(N * tot);
  L.q_kva.apply(h, n, t.data());
  std::vector<float> q(N * nh * qh), lat(N * dc), kr(N * rd);
  if (cfg_.q_lora_rank > 0) {
    std::vector<float> qn(N * qa);
#pragma omp parallel for schedule(static) if (n > 8)
    for (int i = 0; i < n; ++i)
      ops::rmsnorm(t.data() + i * static_cast<std::size_t>(tot), L.q_a_norm.data(), cfg_.rms_norm_eps, qa,
                   qn.data() + i * static_cast<std::size_t>(qa));
    L.q_b.apply(qn.data(), n, q.data());
  } else {
    for (int i = 0; i < n; ++i)
      std::memcpy(q.data() + i * static_cast<std::size_t>(nh * qh), t.data() + i * static_cast<std::size_t>(tot),
                  static_cast<std::size_t>(nh) * qh * sizeof(float));
  }
  const int half = rd / 2;
#pragma omp parallel for schedule(static) if (n > 8)
  for (int i = 0; i < n; ++i) {
    const float* row = t.data() + i * static_cast<std::size_t>(tot);
    ops::rmsnorm(row + qa, L.kv_a_norm.data(), cfg_.rms_norm_eps, dc, lat.data() + i * static_cast<std::size_t>(dc));
    float* ki = kr.data() + i * static_cast<std::size_t>(rd);
    std::memcpy(ki, row + qa + dc, rd * sizeof(float));
    const float* cs = cos_.data() + static_cast<std::size_t>(i) * half;
    const float* sn = sin_.data() + static_cast<std::size_t>(i) * half;
    ops::rope_apply(ki, rd, cfg_.rope.interleaved, cs, sn);
    if (cfg_.online_rope_hadamard) online_hadamard(ki, rd);
    for (int hh = 0; hh < nh; ++hh) {
      float* qr = q.data() + (i * static_cast<std::size_t>(nh) + hh) * qh + nope;
      ops::rope_apply(qr, rd, cfg_.rope.interleaved, cs, sn);
      if (cfg_.online_rope_hadamard) online_hadamard(qr, rd);
    }
  }
  cache.append(seq, l, n, lat.data(), kr.data());
  std::vector<float> o(N * nh * vd), qabs, olat;
  LayerTrace tr;
  tr.layer = l; tr.seq = seq; tr.pos0 = pos0; tr.n = n; tr.n_heads = nh; tr.scale = cfg_.softmax_scale;
  tr.k = lat.data(); tr.k_dim = dc; tr.v = kr.data(); tr.v_dim = rd;
  if (mla_prefill_ == MlaPrefill::kExpanded && pos0 == 0) {
    // Expanded form over the chunk's own fp32 rows: k_h = [W_UK_h c | k_R], v_h = W_UV_h c,
    // plain causal softmax attention per head.
    const std::vector<float>& latr = lat;
    const std::vector<float>& krr = kr;
    std::vector<float> kh(N * qh), vh(N * vd), qhv(N * qh), s(N * N);
    for (int hh = 0; hh < nh; ++hh) {
      ops::gemm_nt(n, nope, dc, latr.data(), dc, L.w_uk.data() + static_cast<std::size_t>(hh) * nope * dc, dc, kh.data(), qh);
      for (int i = 0; i < n; ++i) std::memcpy(kh.data() + i * static_cast<std::size_t>(qh) + nope, krr.data() + i * static_cast<std::size_t>(rd), rd * sizeof(float));
      ops::gemm_nt(n, vd, dc, latr.data(), dc, L.w_uv.data() + static_cast<std::size_t>(hh) * vd * dc, dc, vh.data(), vd);
      ops::gemm_nt(n, n, qh, q.data() + static_cast<std::size_t>(hh) * qh, nh * qh, kh.data(), qh, s.data(), n);
      for (int i = 0; i < n; ++i) {
        float* r = s.data() + i * N;
        float mx = -INFINITY;
        for (int j = 0; j <= i; ++j) mx = std::max(mx, r[j] * cfg_.softmax_scale);
        double sum = 0.0;
        for (int j = 0; j <= i; ++j) {
          r[j] = std::exp(r[j] * cfg_.softmax_scale - mx);
          sum += r[j];
        }
        for (int j = 0; j <= i; ++j) r[j] = static_cast<float>(r[j] / sum);
        for (int j = i + 1; j < n; ++j) r[j] = 0.0f;
      }
      ops::gemm_nn(n, vd, n, s.data(), n, vh.data(), vd, o.data() + static_cast<std::size_t>(hh) * vd, nh * vd);
    }
    tr.q = q.data(); tr.q_dim = nh * qh; tr.attn_out = o.data(); tr.out_dim = nh * vd;
  } else if (mla_prefill_ == MlaPrefill::kAuto && !observer_ && n >= kMlaExpandedMinChunk &&
             cache.attend_expanded(seq, l, n, pos0, cfg_.softmax_scale,
                                   MlaUpProjection{nh, nope, vd, L.w_uk.data(), L.w_uv.data()}, q.data(), o.data())) {
    // Expanded form through the cache (o holds the per-head outputs); no trace is taken here.
  } else {
    const int ad = dc + rd;
    qabs.resize(N * nh * ad);
    olat.resize(N * nh * dc);
    for (int hh = 0; hh < nh; ++hh)
      ops::gemm_nn(n, dc, nope, q.data() + static_cast<std::size_t>(hh) * qh, nh * qh,
                   L.w_uk.data() + static_cast<std::size_t>(hh) * nope * dc, dc, qabs.data() + static_cast<std::size_t>(hh) * ad,
                   nh * ad);
    for (int i = 0; i < n; ++i)
      for (int hh = 0; hh < nh; ++hh)
        std::memcpy(qabs.data() + (i * static_cast<std::size_t>(nh) + hh) * ad + dc,
                    q.data() + (i * static_cast<std::size_t>(nh) + hh) * qh + nope, rd * sizeof(float));
    cache.attend(seq, l, n, pos0, nh, cfg_.softmax_scale, qabs.data(), olat.data());
    tr.q = qabs.data(); tr.q_dim = nh * ad; tr.attn_out = olat.data(); tr.out_dim = nh * dc;
    for (int hh = 0; hh < nh; ++hh)
      ops::gemm_nt(n, vd, dc, olat.data() + static_cast<std::size_t>(hh) * dc, nh * dc,
                   L.w_uv.data() + static_cast<std::size_t>(hh) * vd * dc, dc, o.data() + static_cast<std::size_t>(hh) * vd,
                   nh * vd);
  }
  L.o.apply(o.data(), n, out);
  if (observer_) {
    tr.attn_proj = out;
    observer_(tr);
  }
}

void ModelImpl::mlp(int l, const float* h, int n, float* out) {
  const Layer& L = layers_[l];
  const int H = cfg_.hidden_size;
  std::vector<float> gu;
  if (!L.moe) {
    swiglu(L.dense, h, n, gu, out);
    return;
  }
  const MoeConfig& m = cfg_.moe;
  const int E = m.n_routed_experts, K = m.top_k;
  std::vector<float> logits(static_cast<std::size_t>(n) * E);
  L.router.apply(h, n, logits.data());
  std::vector<int> idx(static_cast<std::size_t>(n) * K);
  std::vector<float> wt(idx.size());
  for (int i = 0; i < n; ++i)
    moe_route(m, logits.data() + static_cast<std::size_t>(i) * E, L.corr_bias.empty() ? nullptr : L.corr_bias.data(),
              idx.data() + static_cast<std::size_t>(i) * K, wt.data() + static_cast<std::size_t>(i) * K);
  std::vector<std::vector<std::pair<int, float>>> routed(E);
  for (int i = 0; i < n; ++i)
    for (int k = 0; k < K; ++k) routed[idx[static_cast<std::size_t>(i) * K + k]].push_back({i, wt[static_cast<std::size_t>(i) * K + k]});
  std::fill(out, out + static_cast<std::size_t>(n) * H, 0.0f);
  std::vector<float> xin, yout;
  for (int e = 0; e < E; ++e) {
    const auto& r = routed[e];
    if (r.empty()) continue;
    const int m_e = static_cast<int>(r.size());
    xin.resize(static_cast<std::size_t>(m_e) * H);
    yout.resize(xin.size());
    for (int j = 0; j < m_e; ++j)
      std::memcpy(xin.data() + static_cast<std::size_t>(j) * H, h + static_cast<std::size_t>(r[j].first) * H, H * sizeof(float));
    swiglu(L.experts[e], xin.data(), m_e, gu, yout.data());
    for (int j = 0; j < m_e; ++j) {
      float* dst = out + static_cast<std::size_t>(r[j].first) * H;
      const float* src = yout.data() + static_cast<std::size_t>(j) * H;
      const float w = r[j].second;
      for (int d = 0; d < H; ++d) dst[d] += src[d] * w;
    }
  }
  if (L.has_shared) {
    yout.resize(static_cast<std::size_t>(n) * H);
    swiglu(L.shared, h, n, gu, yout.data());
    for (std::size_t i = 0; i < yout.size(); ++i) out[i] += yout[i];
  }
}

}  // namespace

void moe_route(const MoeConfig& m, const float* logits, const float* bias, int* idx, float* weight) {
  const int E = m.n_routed_experts, K = m.top_k;
  std::vector<float> score(E), choice(E);
  if (m.scoring == MoeScoring::kSoftmax) {
    float mx = -INFINITY;
    for (int e = 0; e < E; ++e) mx = std::max(mx, logits[e]);
    double sum = 0.0;
    for (int e = 0; e < E; ++e) sum += std::exp(static_cast<double>(logits[e] - mx));
    for (int e = 0; e < E; ++e) score[e] = static_cast<float>(std::exp(static_cast<double>(logits[e] - mx)) / sum);
  } else {
    for (int e = 0; e < E; ++e) score[e] = 1.0f / (1.0f + std::exp(-logits[e]));
  }
  for (int e = 0; e < E; ++e) choice[e] = score[e] + (bias && m.topk_method == TopkMethod::kNoauxTc ? bias[e] : 0.0f);
  std::vector<char> allowed(E, 1);
  if (m.topk_method != TopkMethod::kGreedy && m.n_group > 1) {
    const int G = m.n_group, per = E / G;
    std::vector<float> gs(G);
    for (int g = 0; g < G; ++g) {
      const float* c = choice.data() + g * per;
      if (m.topk_method == TopkMethod::kGroupLimitedGreedy) {
        gs[g] = *std::max_element(c, c + per);
      } else {  // noaux_tc: sum of the two largest in the group
        float a = -INFINITY, b = -INFINITY;
        for (int j = 0; j < per; ++j) {
          if (c[j] > a) { b = a; a = c[j]; }
          else if (c[j] > b) b = c[j];
        }
        gs[g] = a + b;
      }
    }
    std::vector<int> order(G);
    for (int g = 0; g < G; ++g) order[g] = g;
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return gs[a] > gs[b]; });
    std::fill(allowed.begin(), allowed.end(), 0);
    for (int t = 0; t < m.topk_group; ++t)
      for (int j = 0; j < per; ++j) allowed[order[t] * per + j] = 1;
  }
  std::vector<int> cand;
  for (int e = 0; e < E; ++e)
    if (allowed[e]) cand.push_back(e);
  std::stable_sort(cand.begin(), cand.end(), [&](int a, int b) { return choice[a] > choice[b]; });
  double sum = 0.0;
  for (int k = 0; k < K; ++k) {
    idx[k] = cand[k];
    weight[k] = score[cand[k]];
    sum += weight[k];
  }
  // DeepSeek-V2 normalizes only when top_k > 1; for top_k == 1 both give the same weight.
  if (m.norm_topk_prob) {
    const float denom = static_cast<float>(sum) + 1e-20f;
    for (int k = 0; k < K; ++k) weight[k] /= denom;
  }
  for (int k = 0; k < K; ++k) weight[k] *= m.routed_scaling_factor;
}

std::unique_ptr<Model> Model::load(const std::string& dir) { return std::make_unique<ModelImpl>(dir); }

const char* blas_kernels() { return ops::select_blas_kernels(); }

}  // namespace kvq
