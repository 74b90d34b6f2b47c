// The dense bf16 KV cache (kvq::make_dense_cache): the baseline cache and the oracle for the
// quantized ones. Rows are rounded to bf16 once, at append; attention is exact fp32 softmax.
//
// Two attention paths over the same rows:
//  - prefill (many queries): the visible rows are widened to fp32 once per call, then per
//    (query head, tile of 64 queries) one sgemm for the scores, a causal softmax and one sgemm for
//    the weighted values; OpenMP over the work items, OpenBLAS single-threaded inside;
//  - decode (a few queries): dot products and axpys straight from the bf16 rows (AVX2 + FMA when
//    the CPU has them, else scalar), OpenMP over key ranges with a max/sum merge.
// GQA keys/values are per KV head; an MLA cache is one shared "head" whose key is the row
// [latent | rope key] and whose value is the latent.
#include "kvq/dense_cache.hpp"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kvq/common.hpp"
#include "kvq/numeric.hpp"
#include "ops.hpp"
#include "vexp.hpp"

namespace kvq {

namespace {

inline float bf16f(std::uint16_t h) { return bf16_to_float(h); }

float dot_bf16_scalar(const float* q, const std::uint16_t* k, int n) {
  float s = 0.0f;
  for (int i = 0; i < n; ++i) s += q[i] * bf16f(k[i]);
  return s;
}
void axpy_bf16_scalar(float* y, float a, const std::uint16_t* x, int n) {
  for (int i = 0; i < n; ++i) y[i] += a * bf16f(x[i]);
}

[[gnu::target("avx2,fma")]] inline __m256 load_bf16x8(const std::uint16_t* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

[[gnu::target("avx2,fma")]] float dot_bf16_avx2(const float* q, const std::uint16_t* k, int n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load_bf16x8(k + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), load_bf16x8(k + i + 8), a1);
  }
  for (; i + 8 <= n; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load_bf16x8(k + i), a0);
  a0 = _mm256_add_ps(a0, a1);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a0), _mm256_extractf128_ps(a0, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  float r = _mm_cvtss_f32(s);
  for (; i < n; ++i) r += q[i] * bf16f(k[i]);
  return r;
}

[[gnu::target("avx2,fma")]] void axpy_bf16_avx2(float* y, float a, const std::uint16_t* x, int n) {
  const __m256 va = _mm256_set1_ps(a);
  int i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, load_bf16x8(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += a * bf16f(x[i]);
}

[[gnu::target("avx2,fma")]] float dot_f32_avx2(const float* q, const float* k, int n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), _mm256_loadu_ps(k + i + 8), a1);
  }
  for (; i + 8 <= n; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + i), a0);
  a0 = _mm256_add_ps(a0, a1);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a0), _mm256_extractf128_ps(a0, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  float r = _mm_cvtss_f32(s);
  for (; i < n; ++i) r += q[i] * k[i];
  return r;
}

[[gnu::target("avx2,fma")]] void axpy_f32_avx2(float* y, float a, const float* x, int n) {
  const __m256 va = _mm256_set1_ps(a);
  int i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += a * x[i];
}

bool cpu_has_avx2_fma() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
}

inline float dot_bf16(const float* q, const std::uint16_t* k, int n) {
  return cpu_has_avx2_fma() ? dot_bf16_avx2(q, k, n) : dot_bf16_scalar(q, k, n);
}
inline void axpy_bf16(float* y, float a, const std::uint16_t* x, int n) {
  if (cpu_has_avx2_fma()) axpy_bf16_avx2(y, a, x, n);
  else axpy_bf16_scalar(y, a, x, n);
}
inline float dot_row(const float* q, const std::uint16_t* k, int n) { return dot_bf16(q, k, n); }
inline void axpy_row(float* y, float a, const std::uint16_t* x, int n) { axpy_bf16(y, a, x, n); }
inline float dot_row(const float* q, const float* k, int n) {
  if (cpu_has_avx2_fma()) return dot_f32_avx2(q, k, n);
  float s = 0.0f;
  for (int i = 0; i < n; ++i) s += q[i] * k[i];
  return s;
}
inline void axpy_row(float* y, float a, const float* x, int n) {
  if (cpu_has_avx2_fma()) return axpy_f32_avx2(y, a, x, n);
  for (int i = 0; i < n; ++i) y[i] += a * x[i];
}

[[gnu::target("avx2,fma")]] void widen_bf16_avx2(const std::uint16_t* src, float* dst, int n) {
  int i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load_bf16x8(src + i));
  for (; i < n; ++i) dst[i] = bf16f(src[i]);
}
// dst[0..n) = src[0..n) as fp32.
inline void widen_row(const std::uint16_t* src, float* dst, int n) {
  if (cpu_has_avx2_fma()) return widen_bf16_avx2(src, dst, n);
  for (int i = 0; i < n; ++i) dst[i] = bf16f(src[i]);
}
inline void widen_row(const float* src, float* dst, int n) { std::memcpy(dst, src, sizeof(float) * n); }

class DenseCache final : public KvCache {
 public:
  DenseCache(const CacheGeometry& g, int max_seqs, int max_tokens, DenseStorage storage, int decode_rows_per_thread)
      : g_(g), max_tokens_(max_tokens), f32_(storage == DenseStorage::kF32), decode_rows_per_thread_(decode_rows_per_thread) {
    require(g.n_layers > 0, "dense cache: n_layers must be positive");
    require(max_seqs > 0, "dense cache: max_seqs must be positive");
    if (g.mla) {
      require(g.d_latent > 0 && g.d_rope > 0, "dense cache: MLA geometry needs d_latent and d_rope");
      kw_ = g.d_latent;
      vw_ = g.d_rope;
    } else {
      require(g.n_kv_heads > 0 && g.head_dim > 0 && g.v_head_dim > 0, "dense cache: GQA geometry needs heads and dims");
      kw_ = g.n_kv_heads * g.head_dim;
      vw_ = g.n_kv_heads * g.v_head_dim;
    }
    seqs_.resize(max_seqs);
    for (auto& s : seqs_) {
      s.layer_len.assign(g.n_layers, 0);
      s.k.resize(g.n_layers);
      s.v.resize(g.n_layers);
      s.k32.resize(g.n_layers);
      s.v32.resize(g.n_layers);
    }
  }

  const CacheGeometry& geometry() const override { return g_; }
  int length(int seq) const override { return at(seq).length; }

  void append(int seq, int layer, int n, const float* k, const float* v) override {
    Seq& s = at(seq);
    require(layer >= 0 && layer < g_.n_layers, "dense cache: layer " + std::to_string(layer) + " out of range");
    require(n > 0, "dense cache: append of no rows");
    require(s.layer_len[layer] == s.length,
            "dense cache: layer " + std::to_string(layer) + " appended twice before the last layer advanced the length");
    const int new_len = s.length + n;
    if (max_tokens_ > 0 && new_len > max_tokens_)
      fail("dense cache: sequence " + std::to_string(seq) + " full (" + std::to_string(max_tokens_) + " tokens)");
    for (int i = 0; i < n; ++i) {
      for (int d = 0; d < kw_; ++d)
        if (!std::isfinite(k[static_cast<std::size_t>(i) * kw_ + d]))
          fail("dense cache: NaN/Inf in " + std::string(g_.mla ? "latent" : "key") + " row at layer " +
               std::to_string(layer) + ", position " + std::to_string(s.length + i));
      for (int d = 0; d < vw_; ++d)
        if (!std::isfinite(v[static_cast<std::size_t>(i) * vw_ + d]))
          fail("dense cache: NaN/Inf in " + std::string(g_.mla ? "rope key" : "value") + " row at layer " +
               std::to_string(layer) + ", position " + std::to_string(s.length + i));
    }
    if (f32_) {
      s.k32[layer].insert(s.k32[layer].end(), k, k + static_cast<std::size_t>(n) * kw_);
      s.v32[layer].insert(s.v32[layer].end(), v, v + static_cast<std::size_t>(n) * vw_);
    } else {
      auto& K = s.k[layer];
      auto& V = s.v[layer];
      const std::size_t k0 = K.size(), v0 = V.size();
      K.resize(k0 + static_cast<std::size_t>(n) * kw_);
      V.resize(v0 + static_cast<std::size_t>(n) * vw_);
      for (std::size_t i = 0; i < static_cast<std::size_t>(n) * kw_; ++i) K[k0 + i] = float_to_bf16(k[i]);
      for (std::size_t i = 0; i < static_cast<std::size_t>(n) * vw_; ++i) V[v0 + i] = float_to_bf16(v[i]);
    }
    s.layer_len[layer] = new_len;
    if (layer == g_.n_layers - 1) {
      for (int l = 0; l < g_.n_layers; ++l)
        require(s.layer_len[l] == new_len, "dense cache: layer " + std::to_string(l) + " was not appended before the last layer");
      s.length = new_len;
    }
  }

  void attend(int seq, int layer, int n_q, int pos0, int n_heads, float scale, const float* q,
              float* out) const override {
    const Seq& s = at(seq);
    require(layer >= 0 && layer < g_.n_layers, "dense cache: layer " + std::to_string(layer) + " out of range");
    require(n_q > 0 && pos0 >= 0, "dense cache: attend needs n_q > 0 and pos0 >= 0");
    require(pos0 + n_q <= s.layer_len[layer], "dense cache: attend past the rows stored for layer " + std::to_string(layer));
    Shape sh;
    if (g_.mla) {
      sh.groups = 1;
      sh.hq = n_heads;
      sh.kd = g_.d_latent + g_.d_rope;
      sh.vd = g_.d_latent;
    } else {
      require(n_heads % g_.n_kv_heads == 0, "dense cache: n_heads must be a multiple of n_kv_heads");
      sh.groups = g_.n_kv_heads;
      sh.hq = n_heads / g_.n_kv_heads;
      sh.kd = g_.head_dim;
      sh.vd = g_.v_head_dim;
    }
    sh.n_heads = n_heads;
    if (f32_) {
      if (n_q <= 4) attend_decode(s.k32[layer].data(), s.v32[layer].data(), n_q, pos0, sh, scale, q, out);
      else attend_prefill(s.k32[layer].data(), s.v32[layer].data(), n_q, pos0, sh, scale, q, out);
    } else {
      if (n_q <= 4) attend_decode(s.k[layer].data(), s.v[layer].data(), n_q, pos0, sh, scale, q, out);
      else attend_prefill(s.k[layer].data(), s.v[layer].data(), n_q, pos0, sh, scale, q, out);
    }
  }

  void reset(int seq) override {
    Seq& s = at(seq);
    s.length = 0;
    std::fill(s.layer_len.begin(), s.layer_len.end(), 0);
    for (auto& x : s.k) std::vector<std::uint16_t>().swap(x);
    for (auto& x : s.v) std::vector<std::uint16_t>().swap(x);
    for (auto& x : s.k32) std::vector<float>().swap(x);
    for (auto& x : s.v32) std::vector<float>().swap(x);
  }

  std::string describe() const override {
    if (f32_) return "dense fp32 cache";
    if (g_.mla)
      return "dense bf16 cache (MLA: latent " + std::to_string(g_.d_latent) + " + rope " + std::to_string(g_.d_rope) +
             ", " + std::to_string(2 * (g_.d_latent + g_.d_rope)) + " bytes per token per layer)";
    return "dense bf16 cache (" + std::to_string(g_.n_kv_heads) + " KV heads x " + std::to_string(g_.head_dim) + ", " +
           std::to_string(2 * (kw_ + vw_)) + " bytes per token per layer)";
  }

 private:
  struct Seq {
    int length = 0;
    std::vector<int> layer_len;
    std::vector<std::vector<std::uint16_t>> k, v;
    std::vector<std::vector<float>> k32, v32;
  };
  struct Shape {
    int groups = 1, hq = 1, kd = 0, vd = 0, n_heads = 0;
  };

  const Seq& at(int seq) const {
    if (seq < 0 || seq >= static_cast<int>(seqs_.size()))
      fail("dense cache: sequence " + std::to_string(seq) + " out of range (" + std::to_string(seqs_.size()) + ")");
    return seqs_[seq];
  }
  Seq& at(int seq) { return const_cast<Seq&>(static_cast<const DenseCache*>(this)->at(seq)); }

  // Widens rows [0, L) of group g into fp32: key [L x kd], value [L x vd] (MLA: value = key's
  // first d_latent columns, vf left empty).
  template <typename T>
  void widen(const T* K, const T* V, int g, int L, const Shape& sh, std::vector<float>& kf, std::vector<float>& vf) const {
    kf.resize(static_cast<std::size_t>(L) * sh.kd);
    if (g_.mla) {
      const int dc = g_.d_latent, dr = g_.d_rope;
#pragma omp parallel for schedule(static)
      for (int j = 0; j < L; ++j) {
        float* dst = kf.data() + static_cast<std::size_t>(j) * sh.kd;
        widen_row(K + static_cast<std::size_t>(j) * dc, dst, dc);
        widen_row(V + static_cast<std::size_t>(j) * dr, dst + dc, dr);
      }
    } else {
      vf.resize(static_cast<std::size_t>(L) * sh.vd);
#pragma omp parallel for schedule(static)
      for (int j = 0; j < L; ++j) {
        widen_row(K + static_cast<std::size_t>(j) * kw_ + static_cast<std::size_t>(g) * sh.kd,
                  kf.data() + static_cast<std::size_t>(j) * sh.kd, sh.kd);
        widen_row(V + static_cast<std::size_t>(j) * vw_ + static_cast<std::size_t>(g) * sh.vd,
                  vf.data() + static_cast<std::size_t>(j) * sh.vd, sh.vd);
      }
    }
  }

  template <typename T>
  void attend_prefill(const T* K, const T* V, int n_q, int pos0, const Shape& sh, float scale, const float* q,
                      float* out) const {
    constexpr int kTile = 64;
    const int L = pos0 + n_q;
    const int tiles = (n_q + kTile - 1) / kTile;
    const int qs = sh.n_heads * sh.kd, os = sh.n_heads * sh.vd;
    std::vector<float> kf, vf;
    for (int g = 0; g < sh.groups; ++g) {
      widen(K, V, g, L, sh, kf, vf);
      const float* vbase = g_.mla ? kf.data() : vf.data();
      const int vld = g_.mla ? sh.kd : sh.vd;
      const int items = sh.hq * tiles;
      ops::BlasSingleThread single;
#pragma omp parallel
      {
        std::vector<float> sc(static_cast<std::size_t>(kTile) * L);
#pragma omp for schedule(dynamic, 1)
        for (int it = 0; it < items; ++it) {
          // Larger tiles first (later tiles see more keys) for a better dynamic balance.
          const int tile = tiles - 1 - it / sh.hq;
          const int h = g * sh.hq + it % sh.hq;
          const int t0 = tile * kTile, t1 = std::min(n_q, t0 + kTile), m = t1 - t0;
          const int lk = pos0 + t1;
          ops::gemm_nt(m, lk, sh.kd, q + static_cast<std::size_t>(t0) * qs + static_cast<std::size_t>(h) * sh.kd, qs,
                       kf.data(), sh.kd, sc.data(), lk);
          for (int r = 0; r < m; ++r) {
            float* row = sc.data() + static_cast<std::size_t>(r) * lk;
            const int p = pos0 + t0 + r;
            vexp::softmax(row, p + 1, scale);
            std::fill(row + p + 1, row + lk, 0.0f);
          }
          ops::gemm_nn(m, sh.vd, lk, sc.data(), lk, vbase, vld,
                       out + static_cast<std::size_t>(t0) * os + static_cast<std::size_t>(h) * sh.vd, os);
        }
      }
    }
  }

  // Decode-sized calls: per query, the visible rows are cut into blocks of 64 and split between
  // threads (at least decode_rows_per_thread / 64 blocks each); each thread widens a block to fp32, scores it for all query
  // heads of a KV group with one small sgemm, and folds it into a running max / sum / output
  // (online softmax); the threads' partial results are merged at the end.
  template <typename T>
  void attend_decode(const T* K, const T* V, int n_q, int pos0, const Shape& sh, float scale, const float* q,
                     float* out) const {
    constexpr int kBlock = 64;
    // A thread gets at least decode_rows_per_thread_ rows (4096 by default): below that a decode
    // step's attention is well under a millisecond, less than waking a thread costs when busy.
    const int kMinBlocksPerThread = std::max(1, decode_rows_per_thread_ / kBlock);
    const int qs = sh.n_heads * sh.kd, os = sh.n_heads * sh.vd, nh = sh.n_heads;
    const int dc = g_.d_latent, dr = g_.d_rope;
    for (int i = 0; i < n_q; ++i) {
      const int L = pos0 + i + 1;
      const int nblocks = (L + kBlock - 1) / kBlock;
      const int nthreads = std::max(1, std::min(omp_get_max_threads(), nblocks / kMinBlocksPerThread));
      std::vector<float> part_m(static_cast<std::size_t>(nthreads) * nh, -INFINITY), part_s(part_m.size(), 0.0f);
      std::vector<float> part_o(static_cast<std::size_t>(nthreads) * nh * sh.vd, 0.0f);
      const float* qi = q + static_cast<std::size_t>(i) * qs;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
      {
        const int t = omp_get_thread_num();
        const int nt = omp_get_num_threads();
        const int b0 = static_cast<int>(static_cast<std::int64_t>(nblocks) * t / nt);
        const int b1 = static_cast<int>(static_cast<std::int64_t>(nblocks) * (t + 1) / nt);
        std::vector<float> kf(static_cast<std::size_t>(kBlock) * sh.kd), vf(g_.mla ? 0 : static_cast<std::size_t>(kBlock) * sh.vd);
        std::vector<float> sc(static_cast<std::size_t>(sh.hq) * kBlock);
        for (int g = 0; g < sh.groups; ++g) {
          float* m = part_m.data() + static_cast<std::size_t>(t) * nh + static_cast<std::size_t>(g) * sh.hq;
          float* sum = part_s.data() + static_cast<std::size_t>(t) * nh + static_cast<std::size_t>(g) * sh.hq;
          float* o = part_o.data() + (static_cast<std::size_t>(t) * nh + static_cast<std::size_t>(g) * sh.hq) * sh.vd;
          const float* qg = qi + static_cast<std::size_t>(g) * sh.hq * sh.kd;
          for (int b = b0; b < b1; ++b) {
            const int r0 = b * kBlock, nr = std::min(kBlock, L - r0);
            for (int r = 0; r < nr; ++r) {
              const std::size_t j = static_cast<std::size_t>(r0 + r);
              float* kd = kf.data() + static_cast<std::size_t>(r) * sh.kd;
              if (g_.mla) {
                widen_row(K + j * dc, kd, dc);
                widen_row(V + j * dr, kd + dc, dr);
              } else {
                widen_row(K + j * kw_ + static_cast<std::size_t>(g) * sh.kd, kd, sh.kd);
                widen_row(V + j * vw_ + static_cast<std::size_t>(g) * sh.vd, vf.data() + static_cast<std::size_t>(r) * sh.vd, sh.vd);
              }
            }
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, sh.hq, nr, sh.kd, scale, qg, sh.kd, kf.data(), sh.kd,
                        0.0f, sc.data(), kBlock);
            for (int h = 0; h < sh.hq; ++h) {
              float* row = sc.data() + static_cast<std::size_t>(h) * kBlock;
              float mb = -INFINITY;
              for (int r = 0; r < nr; ++r) mb = std::max(mb, row[r]);
              const float mn = std::max(m[h], mb);
              const float f = m[h] == -INFINITY ? 0.0f : std::exp(m[h] - mn);
              const float add = vexp::exp_shift_sum(row, nr, mn);
              sum[h] = sum[h] * f + add;
              m[h] = mn;
              float* oh = o + static_cast<std::size_t>(h) * sh.vd;
              for (int d = 0; d < sh.vd; ++d) oh[d] *= f;
            }
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, sh.hq, sh.vd, nr, 1.0f, sc.data(), kBlock,
                        g_.mla ? kf.data() : vf.data(), g_.mla ? sh.kd : sh.vd, 1.0f, o, sh.vd);
          }
        }
      }
      for (int h = 0; h < nh; ++h) {
        float mx = -INFINITY;
        for (int t = 0; t < nthreads; ++t) mx = std::max(mx, part_m[static_cast<std::size_t>(t) * nh + h]);
        float sum = 0.0f;
        float* o = out + static_cast<std::size_t>(i) * os + static_cast<std::size_t>(h) * sh.vd;
        std::fill(o, o + sh.vd, 0.0f);
        for (int t = 0; t < nthreads; ++t) {
          const float pm = part_m[static_cast<std::size_t>(t) * nh + h];
          if (pm == -INFINITY) continue;
          const float w = std::exp(pm - mx);
          sum += w * part_s[static_cast<std::size_t>(t) * nh + h];
          const float* po = part_o.data() + (static_cast<std::size_t>(t) * nh + h) * sh.vd;
          for (int d = 0; d < sh.vd; ++d) o[d] += w * po[d];
        }
        const float inv = 1.0f / sum;
        for (int d = 0; d < sh.vd; ++d) o[d] *= inv;
      }
    }
  }

  CacheGeometry g_;
  int max_tokens_ = 0;
  bool f32_ = false;
  int decode_rows_per_thread_ = 4096;
  int kw_ = 0, vw_ = 0;
  std::vector<Seq> seqs_;
};

}  // namespace

std::unique_ptr<KvCache> make_dense_cache(const CacheGeometry& geometry, int max_seqs, int max_tokens,
                                          DenseStorage storage, int decode_rows_per_thread) {
  return std::make_unique<DenseCache>(geometry, max_seqs, max_tokens, storage, decode_rows_per_thread);
}

}  // namespace kvq
