// The paged packed KV cache (include/kvq/paged_cache.hpp): page pool, block tables, reverse
// map, protection rows (sinks, recent window, staging of the chunk being appended), attention
// over packed pages (reference and fast paths) and memory accounting.
//
// Window rows: the ring holds the bf16 rows of the last W tokens *before* the chunk most
// recently appended to a layer, and the staging buffer holds that chunk's bf16 rows. A query
// at position p >= chunk start needs window rows [p + 1 - W, p], which lie in ring + staging.
// The staging buffer is committed to the ring at the layer's next append; it is workspace, not
// persistent storage (the ring is the persistent W rows).
#include "kvq/paged_cache.hpp"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "kvq/common.hpp"
#include "kvq/numeric.hpp"

namespace kvq {

namespace {

class BlasOneThread {
 public:
  BlasOneThread() : saved_(openblas_get_num_threads()) {
    if (saved_ != 1) openblas_set_num_threads(1);
  }
  ~BlasOneThread() {
    if (saved_ != 1) openblas_set_num_threads(saved_);
  }

 private:
  int saved_;
};

void to_bf16(const float* x, std::size_t n, std::uint16_t* out) {
  for (std::size_t i = 0; i < n; ++i) out[i] = float_to_bf16(x[i]);
}
void from_bf16(const std::uint16_t* x, std::size_t n, float* out) {
  for (std::size_t i = 0; i < n; ++i) out[i] = bf16_to_float(x[i]);
}

// The arguments a paged cache and its analytic accounting share: layers, page size, protection sizes, and the
// format fitting the geometry. `who` prefixes the messages.
const FormatSpec& check_cache_args(const char* who, const CacheGeometry& g, const std::string& format, int page_tokens,
                                   const ProtectionPolicy& p) {
  require(g.n_layers > 0, std::string(who) + ": geometry has no layers");
  require(page_tokens > 0 && page_tokens <= 4096,
          std::string(who) + ": page_tokens must be 1..4096, got " + std::to_string(page_tokens));
  require(p.sinks >= 0 && p.window >= 0 && p.boundary_layers >= 0, "protection sizes must be non-negative");
  const FormatSpec& f = find_format(format);
  check_format_fits(f, g);
  return f;
}

}  // namespace

struct PagedCache::Impl {
  struct Layer {
    const FormatSpec* fmt = nullptr;
    PageLayout lay;
    std::vector<QuantizerPair> q;  // per KV head (MLA: one)
    std::vector<std::uint8_t> pages;
  };
  struct Prot {
    std::vector<std::uint16_t> sink, ring, staging;  // bf16 rows [key part | value part]
    int staging_start = 0, staging_n = 0;
  };
  struct Seq {
    int length = 0;
    std::vector<int> layer_len;
    std::vector<int> blocks;
    std::vector<Prot> prot;
    bool preempted = false;
  };

  int heads = 1, dk = 0, dv = 0;  // per head dims (MLA: heads = 1, dk = d_latent, dv = d_rope)
  std::size_t rk = 0, rv = 0;     // floats per token per layer: heads * dk, heads * dv
  std::vector<Layer> layers;
  std::vector<Seq> seqs;
  std::vector<int> free_blocks;
  // Reverse page map of every layer's pool: physical block -> (seq << 32) | logical block.
  // Each layer's pages form their own pool (the kernels work one layer at a time), so each
  // keeps its own 8-byte entries, as the QuantMLA paper's per-layer accounting counts them.
  std::vector<std::vector<std::uint64_t>> reverse;
  std::size_t n_blocks = 0;
  std::vector<std::vector<std::vector<double>>> kabs, vabs;  // [layer][head][dim] sums of |x|
  std::vector<std::vector<std::vector<double>>> ksum, vsum;  // [layer][head][dim] sums of x
  std::vector<std::vector<std::vector<double>>> ksq, vsq;    // [layer][head][dim] sums of x^2
  std::vector<std::size_t> stat_rows;                       // rows accumulated per layer

  std::size_t row_floats() const { return rk + rv; }
};

PagedCache::PagedCache(const CacheGeometry& g, CacheOptions opt, int max_seqs)
    : geo_(g), opt_(std::move(opt)), impl_(std::make_unique<Impl>()) {
  require(max_seqs > 0, "PagedCache: max_seqs must be positive");
  const FormatSpec& fmt = check_cache_args("PagedCache", g, opt_.format, opt_.page_tokens, opt_.protect);
  const auto& p = opt_.protect;
  auto& im = *impl_;
  im.heads = g.mla ? 1 : g.n_kv_heads;
  im.dk = g.mla ? g.d_latent : g.head_dim;
  im.dv = g.mla ? g.d_rope : g.v_head_dim;
  im.rk = static_cast<std::size_t>(im.heads) * static_cast<std::size_t>(im.dk);
  im.rv = static_cast<std::size_t>(im.heads) * static_cast<std::size_t>(im.dv);
  im.layers.resize(static_cast<std::size_t>(g.n_layers));
  for (int l = 0; l < g.n_layers; ++l) {
    auto& L = im.layers[static_cast<std::size_t>(l)];
    const bool boundary = l < p.boundary_layers || l >= g.n_layers - p.boundary_layers;
    L.fmt = boundary ? &find_format("bf16") : &fmt;
    L.lay = page_layout(*L.fmt, g, opt_.page_tokens);
    for (int h = 0; h < im.heads; ++h) L.q.push_back(make_quantizers(*L.fmt, g, l, h, opt_.outliers.get()));
    block_bytes_ += L.lay.page_bytes;
  }
  max_blocks_ = opt_.pool_bytes ? opt_.pool_bytes / block_bytes_ : 0;
  if (opt_.pool_bytes && max_blocks_ == 0)
    fail("page pool budget of " + std::to_string(opt_.pool_bytes) + " bytes is smaller than one block (" +
         std::to_string(block_bytes_) + " bytes for " + std::to_string(opt_.page_tokens) + " tokens of every layer)");
  im.seqs.resize(static_cast<std::size_t>(max_seqs));
  for (auto& s : im.seqs) {
    s.layer_len.assign(static_cast<std::size_t>(g.n_layers), 0);
    s.prot.resize(static_cast<std::size_t>(g.n_layers));
  }
  im.kabs.assign(static_cast<std::size_t>(g.n_layers),
                 std::vector<std::vector<double>>(static_cast<std::size_t>(im.heads), std::vector<double>(static_cast<std::size_t>(im.dk), 0.0)));
  im.vabs.assign(static_cast<std::size_t>(g.n_layers),
                 std::vector<std::vector<double>>(static_cast<std::size_t>(im.heads), std::vector<double>(static_cast<std::size_t>(im.dv), 0.0)));
  im.ksum = im.ksq = im.kabs;
  im.vsum = im.vsq = im.vabs;
  im.stat_rows.assign(static_cast<std::size_t>(g.n_layers), 0);
  im.reverse.resize(static_cast<std::size_t>(g.n_layers));
}

PagedCache::~PagedCache() = default;

const FormatSpec& PagedCache::layer_format(int layer) const { return *impl_->layers.at(static_cast<std::size_t>(layer)).fmt; }
const PageLayout& PagedCache::layer_layout(int layer) const { return impl_->layers.at(static_cast<std::size_t>(layer)).lay; }

int PagedCache::length(int seq) const {
  require(seq >= 0 && seq < static_cast<int>(impl_->seqs.size()), "PagedCache: sequence " + std::to_string(seq) + " out of range");
  return impl_->seqs[static_cast<std::size_t>(seq)].length;
}

bool PagedCache::preempted(int seq) const { return impl_->seqs.at(static_cast<std::size_t>(seq)).preempted; }

std::string PagedCache::describe() const {
  const auto& p = opt_.protect;
  return opt_.format + " (pages of " + std::to_string(opt_.page_tokens) + " tokens, sinks " + std::to_string(p.sinks) +
         ", window " + std::to_string(p.window) + ", boundary layers " + std::to_string(p.boundary_layers) + ")";
}

void PagedCache::reset(int seq) {
  auto& im = *impl_;
  require(seq >= 0 && seq < static_cast<int>(im.seqs.size()), "PagedCache: sequence " + std::to_string(seq) + " out of range");
  auto& s = im.seqs[static_cast<std::size_t>(seq)];
  for (int b : s.blocks) {
    im.free_blocks.push_back(b);
    for (auto& r : im.reverse) r[static_cast<std::size_t>(b)] = ~0ull;
  }
  s.blocks.clear();
  s.length = 0;
  std::fill(s.layer_len.begin(), s.layer_len.end(), 0);
  for (auto& pr : s.prot) pr = Impl::Prot{};
  s.preempted = false;
}

void PagedCache::append(int seq, int layer, int n, const float* k, const float* v) {
  auto& im = *impl_;
  require(seq >= 0 && seq < static_cast<int>(im.seqs.size()), "PagedCache: sequence " + std::to_string(seq) + " out of range");
  require(layer >= 0 && layer < geo_.n_layers, "PagedCache: layer " + std::to_string(layer) + " out of range");
  require(n >= 0, "PagedCache: negative row count");
  auto& s = im.seqs[static_cast<std::size_t>(seq)];
  if (s.preempted)
    fail("sequence " + std::to_string(seq) + " was preempted (its pages were reclaimed); reset it and recompute its tokens");
  const int t0 = s.length;
  require(s.layer_len[static_cast<std::size_t>(layer)] == t0,
          "PagedCache: layer " + std::to_string(layer) + " appended twice before the other layers");
  if (n == 0) return;
  const int T = opt_.page_tokens;
  // Blocks for tokens [t0, t0 + n), allocated once per step (the first layer to need them).
  const std::size_t need = static_cast<std::size_t>((t0 + n + T - 1) / T);
  while (s.blocks.size() < need) {
    int b;
    if (!im.free_blocks.empty()) {
      b = im.free_blocks.back();
      im.free_blocks.pop_back();
    } else if (max_blocks_ == 0 || im.n_blocks < max_blocks_) {
      b = static_cast<int>(im.n_blocks++);
      for (auto& L : im.layers) L.pages.resize(im.n_blocks * L.lay.page_bytes);
      for (auto& r : im.reverse) r.push_back(~0ull);
    } else {
      // Exhausted. With preemption, evict the other sequence holding the most blocks.
      int victim = -1;
      std::size_t most = 0;
      for (std::size_t i = 0; i < im.seqs.size(); ++i)
        if (static_cast<int>(i) != seq && im.seqs[i].blocks.size() > most) most = im.seqs[i].blocks.size(), victim = static_cast<int>(i);
      if (!opt_.preempt || victim < 0)
        fail("page pool exhausted: budget " + std::to_string(opt_.pool_bytes) + " bytes = " + std::to_string(max_blocks_) +
             " blocks of " + std::to_string(block_bytes_) + " bytes (" + std::to_string(T) + " tokens, all layers); sequence " +
             std::to_string(seq) + " needs " + std::to_string(need) + " blocks for " + std::to_string(t0 + n) +
             " tokens" + (opt_.preempt ? " and no other sequence can be preempted" : " (use --preempt to evict other sequences)"));
      reset(victim);
      im.seqs[static_cast<std::size_t>(victim)].preempted = true;
      ++preemptions_;
      continue;
    }
    for (auto& r : im.reverse) r[static_cast<std::size_t>(b)] = (static_cast<std::uint64_t>(seq) << 32) | static_cast<std::uint32_t>(s.blocks.size());
    s.blocks.push_back(b);
  }
  auto& L = im.layers[static_cast<std::size_t>(layer)];
  auto& pr = s.prot[static_cast<std::size_t>(layer)];
  const int S = opt_.protect.sinks, W = opt_.protect.window;
  const std::size_t rf = im.row_floats();
  // Commit the previous chunk's bf16 rows to the ring.
  if (W > 0) {
    if (pr.ring.empty()) pr.ring.assign(static_cast<std::size_t>(W) * rf, 0);
    for (int i = 0; i < pr.staging_n; ++i) {
      const int t = pr.staging_start + i;
      if (t < t0 - W) continue;
      std::memcpy(&pr.ring[static_cast<std::size_t>(t % W) * rf], &pr.staging[static_cast<std::size_t>(i) * rf], rf * 2);
    }
  }
  // Packed copies of every token, head by head (batched encode, then scattered into pages).
  for (int h = 0; h < im.heads; ++h) {
    const auto& qp = L.q[static_cast<std::size_t>(h)];
    const std::size_t kb = qp.key->bytes(), vb = qp.value->bytes();
    std::vector<float> kx(static_cast<std::size_t>(n) * static_cast<std::size_t>(im.dk)), vx(static_cast<std::size_t>(n) * static_cast<std::size_t>(im.dv));
    for (int i = 0; i < n; ++i) {
      std::memcpy(&kx[static_cast<std::size_t>(i) * static_cast<std::size_t>(im.dk)], k + static_cast<std::size_t>(i) * im.rk + static_cast<std::size_t>(h) * static_cast<std::size_t>(im.dk), static_cast<std::size_t>(im.dk) * 4);
      std::memcpy(&vx[static_cast<std::size_t>(i) * static_cast<std::size_t>(im.dv)], v + static_cast<std::size_t>(i) * im.rv + static_cast<std::size_t>(h) * static_cast<std::size_t>(im.dv), static_cast<std::size_t>(im.dv) * 4);
    }
    std::vector<std::uint8_t> krec(static_cast<std::size_t>(n) * kb), vrec(static_cast<std::size_t>(n) * vb);
    auto encode = [&](const VectorQuantizer& q, const std::vector<float>& x, int d, std::vector<std::uint8_t>& rec, const char* what) {
      try {
        q.encode_batch(x.data(), static_cast<std::size_t>(n), rec.data());
      } catch (const Error& e) {
        // Find the offending row to name its position.
        for (int i = 0; i < n; ++i)
          for (int c = 0; c < d; ++c)
            if (!std::isfinite(x[static_cast<std::size_t>(i) * static_cast<std::size_t>(d) + static_cast<std::size_t>(c)]))
              fail("non-finite " + std::string(what) + " in the KV cache input: layer " + std::to_string(layer) + ", position " +
                   std::to_string(t0 + i) + ", head " + std::to_string(h) + ", channel " + std::to_string(c) + " (" +
                   std::to_string(x[static_cast<std::size_t>(i) * static_cast<std::size_t>(d) + static_cast<std::size_t>(c)]) + ")");
        fail("layer " + std::to_string(layer) + ", head " + std::to_string(h) + ", positions " + std::to_string(t0) + ".." +
             std::to_string(t0 + n - 1) + ": " + e.what());
      }
    };
    encode(*qp.key, kx, im.dk, krec, geo_.mla ? "latent" : "key");
    encode(*qp.value, vx, im.dv, vrec, geo_.mla ? "rope key" : "value");
    for (int i = 0; i < n; ++i) {
      const int t = t0 + i;
      std::uint8_t* page = &L.pages[static_cast<std::size_t>(s.blocks[static_cast<std::size_t>(t / T)]) * L.lay.page_bytes];
      const int off = t % T;
      const std::uint8_t* kr = &krec[static_cast<std::size_t>(i) * kb];
      const std::uint8_t* vr = &vrec[static_cast<std::size_t>(i) * vb];
      std::memcpy(page + L.lay.key_code(h, off), kr, qp.key->code_bytes());
      std::memcpy(page + L.lay.value_code(h, off), vr, qp.value->code_bytes());
      std::uint8_t* meta = page + L.lay.key_meta(h, off);
      std::memcpy(meta, kr + qp.key->code_bytes(), qp.key->meta_bytes());
      std::memcpy(meta + qp.key->meta_bytes(), vr + qp.value->code_bytes(), qp.value->meta_bytes());
      std::memset(meta + qp.key->meta_bytes() + qp.value->meta_bytes(), 0,
                  L.lay.meta_bytes - qp.key->meta_bytes() - qp.value->meta_bytes());
    }
    if (stats_) {
      auto& ka = im.kabs[static_cast<std::size_t>(layer)][static_cast<std::size_t>(h)];
      auto& va = im.vabs[static_cast<std::size_t>(layer)][static_cast<std::size_t>(h)];
      auto& ks = im.ksum[static_cast<std::size_t>(layer)][static_cast<std::size_t>(h)];
      auto& vs = im.vsum[static_cast<std::size_t>(layer)][static_cast<std::size_t>(h)];
      auto& kq2 = im.ksq[static_cast<std::size_t>(layer)][static_cast<std::size_t>(h)];
      auto& vq2 = im.vsq[static_cast<std::size_t>(layer)][static_cast<std::size_t>(h)];
      for (int i = 0; i < n; ++i) {
        for (int c = 0; c < im.dk; ++c) {
          const float x = kx[static_cast<std::size_t>(i) * static_cast<std::size_t>(im.dk) + static_cast<std::size_t>(c)];
          ka[static_cast<std::size_t>(c)] += std::fabs(x);
          ks[static_cast<std::size_t>(c)] += x;
          kq2[static_cast<std::size_t>(c)] += static_cast<double>(x) * x;
        }
        for (int c = 0; c < im.dv; ++c) {
          const float x = vx[static_cast<std::size_t>(i) * static_cast<std::size_t>(im.dv) + static_cast<std::size_t>(c)];
          va[static_cast<std::size_t>(c)] += std::fabs(x);
          vs[static_cast<std::size_t>(c)] += x;
          vq2[static_cast<std::size_t>(c)] += static_cast<double>(x) * x;
        }
      }
    }
  }
  if (stats_) im.stat_rows[static_cast<std::size_t>(layer)] += static_cast<std::size_t>(n);
  // bf16 protection rows: sinks, and the chunk staged for the window.
  if (S > 0 && t0 < S) {
    if (pr.sink.empty()) pr.sink.assign(static_cast<std::size_t>(S) * rf, 0);
    for (int i = 0; i < n && t0 + i < S; ++i) {
      to_bf16(k + static_cast<std::size_t>(i) * im.rk, im.rk, &pr.sink[static_cast<std::size_t>(t0 + i) * rf]);
      to_bf16(v + static_cast<std::size_t>(i) * im.rv, im.rv, &pr.sink[static_cast<std::size_t>(t0 + i) * rf + im.rk]);
    }
  }
  if (W > 0) {
    pr.staging.resize(static_cast<std::size_t>(n) * rf);
    for (int i = 0; i < n; ++i) {
      to_bf16(k + static_cast<std::size_t>(i) * im.rk, im.rk, &pr.staging[static_cast<std::size_t>(i) * rf]);
      to_bf16(v + static_cast<std::size_t>(i) * im.rv, im.rv, &pr.staging[static_cast<std::size_t>(i) * rf + im.rk]);
    }
    pr.staging_start = t0;
    pr.staging_n = n;
  }
  s.layer_len[static_cast<std::size_t>(layer)] = t0 + n;
  bool all = true;
  for (int x : s.layer_len) all = all && x == t0 + n;
  if (all) s.length = t0 + n;
}

// ---- reading rows ----------------------------------------------------------------------------

namespace {

struct RowSource {
  const PagedCache::Impl* im;
  const PagedCache::Impl::Layer* L;
  const PagedCache::Impl::Seq* s;
  const PagedCache::Impl::Prot* pr;
  int S, W, T;

  // bf16 protected row of token t (key part of head h, value part of head h) or nullptr.
  const std::uint16_t* protected_row(int t) const {
    const std::size_t rf = im->row_floats();
    if (t < S) return pr->sink.empty() ? nullptr : &pr->sink[static_cast<std::size_t>(t) * rf];
    if (W <= 0) return nullptr;
    if (t >= pr->staging_start && t < pr->staging_start + pr->staging_n)
      return &pr->staging[static_cast<std::size_t>(t - pr->staging_start) * rf];
    return &pr->ring[static_cast<std::size_t>(t % W) * rf];
  }
  bool is_protected(int t, int p) const { return t < S || t > p - W; }
  const std::uint8_t* page(int t) const {
    return &L->pages[static_cast<std::size_t>(s->blocks[static_cast<std::size_t>(t / T)]) * L->lay.page_bytes];
  }
  // Decoded packed row of head h (key dk floats, value dv floats).
  void packed(int t, int h, float* kout, float* vout) const {
    const std::uint8_t* pg = page(t);
    const int off = t % T;
    const auto& q = L->q[static_cast<std::size_t>(h)];
    const std::uint8_t* meta = pg + L->lay.key_meta(h, off);
    if (kout) q.key->decode(pg + L->lay.key_code(h, off), meta, kout);
    if (vout) q.value->decode(pg + L->lay.value_code(h, off), meta + q.key->meta_bytes(), vout);
  }
  // Rows [0, n) of head h decoded from packed copies into K [n][dk], V [n][dv] (batched).
  void packed_all(int n, int h, float* K, float* V) const {
    const auto& q = L->q[static_cast<std::size_t>(h)];
    const std::size_t kb = q.key->bytes(), vb = q.value->bytes();
    std::vector<std::uint8_t> kr(static_cast<std::size_t>(T) * kb), vr(static_cast<std::size_t>(T) * vb);
    for (int t0 = 0; t0 < n; t0 += T) {
      const int m = std::min(T, n - t0);
      const std::uint8_t* pg = page(t0);
      for (int i = 0; i < m; ++i) {
        const std::uint8_t* meta = pg + L->lay.key_meta(h, i);
        std::memcpy(&kr[static_cast<std::size_t>(i) * kb], pg + L->lay.key_code(h, i), q.key->code_bytes());
        std::memcpy(&kr[static_cast<std::size_t>(i) * kb + q.key->code_bytes()], meta, q.key->meta_bytes());
        std::memcpy(&vr[static_cast<std::size_t>(i) * vb], pg + L->lay.value_code(h, i), q.value->code_bytes());
        std::memcpy(&vr[static_cast<std::size_t>(i) * vb + q.value->code_bytes()], meta + q.key->meta_bytes(), q.value->meta_bytes());
      }
      q.key->decode_batch(kr.data(), static_cast<std::size_t>(m), K + static_cast<std::size_t>(t0) * static_cast<std::size_t>(im->dk));
      q.value->decode_batch(vr.data(), static_cast<std::size_t>(m), V + static_cast<std::size_t>(t0) * static_cast<std::size_t>(im->dv));
    }
  }
};

}  // namespace

void PagedCache::read_row(int seq, int layer, int t, int as_of, float* k, float* v) const {
  const auto& im = *impl_;
  const auto& s = im.seqs.at(static_cast<std::size_t>(seq));
  require(t >= 0 && t < s.layer_len.at(static_cast<std::size_t>(layer)) && as_of < s.layer_len.at(static_cast<std::size_t>(layer)) &&
              (as_of < 0 || t <= as_of),
          "read_row: position out of range");
  RowSource src{&im, &im.layers[static_cast<std::size_t>(layer)], &s, &s.prot[static_cast<std::size_t>(layer)],
                opt_.protect.sinks, opt_.protect.window, opt_.page_tokens};
  for (int h = 0; h < im.heads; ++h) {
    float* kh = k + static_cast<std::size_t>(h) * static_cast<std::size_t>(im.dk);
    float* vh = v + static_cast<std::size_t>(h) * static_cast<std::size_t>(im.dv);
    if (as_of >= 0 && src.is_protected(t, as_of)) {
      const std::uint16_t* r = src.protected_row(t);
      from_bf16(r + static_cast<std::size_t>(h) * static_cast<std::size_t>(im.dk), static_cast<std::size_t>(im.dk), kh);
      from_bf16(r + im.rk + static_cast<std::size_t>(h) * static_cast<std::size_t>(im.dv), static_cast<std::size_t>(im.dv), vh);
    } else {
      src.packed(t, h, kh, vh);
    }
  }
}

// ---- attention -----------------------------------------------------------------------------

namespace {

// Calls f(t) for every row that query position p reads from bf16: sinks [0, S) and the window
// [p + 1 - W, p] (each row once).
template <class F>
void for_protected(int p, int S, int W, F&& f) {
  const int s_end = std::min(S, p + 1);
  for (int t = 0; t < s_end; ++t) f(t);
  for (int t = std::max(s_end, p + 1 - W); t <= p; ++t) f(t);
}

// In place: row[0..p] <- softmax(row[0..p]), row[p+1..cols) <- 0 (causal mask of query p).
void causal_softmax(float* row, int p, int cols) {
  float mx = row[0];
  for (int t = 1; t <= p; ++t) mx = std::max(mx, row[t]);
  double z = 0;
  for (int t = 0; t <= p; ++t) z += (row[t] = std::exp(row[t] - mx));
  const float inv = static_cast<float>(1.0 / z);
  for (int t = 0; t <= p; ++t) row[t] *= inv;
  for (int t = p + 1; t < cols; ++t) row[t] = 0.0f;
}

// Argument checks shared by attend() and attend_expanded(): the sequence and the layer exist
// (before their rows are looked up), then the query positions (check_attend).
void check_seq_layer(const PagedCache::Impl& im, int n_layers, int seq, int layer) {
  require(seq >= 0 && seq < static_cast<int>(im.seqs.size()), "PagedCache: sequence " + std::to_string(seq) + " out of range");
  require(layer >= 0 && layer < n_layers, "PagedCache: layer out of range");
}

void check_attend(const PagedCache::Impl::Seq& s, const PagedCache::Impl::Prot& pr, int layer, int n_q, int pos0, int W) {
  require(pos0 >= 0 && pos0 + n_q <= s.layer_len[static_cast<std::size_t>(layer)],
          "PagedCache::attend: queries past the rows appended to layer " + std::to_string(layer));
  if (W > 0 && pr.staging_n > 0)
    require(pos0 >= pr.staging_start, "PagedCache::attend: queries must belong to the chunk appended last (window rows)");
}

}  // namespace

void PagedCache::attend(int seq, int layer, int n_q, int pos0, int n_heads, float scale, const float* q,
                        float* out) const {
  const auto& im = *impl_;
  check_seq_layer(im, geo_.n_layers, seq, layer);
  const auto& s = im.seqs[static_cast<std::size_t>(seq)];
  const auto& L = im.layers[static_cast<std::size_t>(layer)];
  const auto& pr = s.prot[static_cast<std::size_t>(layer)];
  if (n_q <= 0) return;
  const int W = opt_.protect.window;
  check_attend(s, pr, layer, n_q, pos0, W);
  require(geo_.mla || (n_heads % im.heads == 0), "PagedCache::attend: query heads must be a multiple of KV heads");
  const RowSource src{&im, &L, &s, &pr, opt_.protect.sinks, W, opt_.page_tokens};
  const int dk = im.dk, dv = im.dv;
  const bool mla = geo_.mla;
  // Per query head: key part of q is dk floats (MLA: + dv rope floats); output is dk (MLA) or dv.
  const int qstride = mla ? n_heads * (dk + dv) : n_heads * dk;
  const int odim = mla ? dk : dv;
  const int ostride = n_heads * odim;
  const int group = mla ? n_heads : n_heads / im.heads;
  const int n_rows = pos0 + n_q;

  if (path_ == AttentionPath::kReference) {
    // Decode every row once (packed and protected versions), then plain loops in double.
    for (int g = 0; g < im.heads; ++g) {
      std::vector<float> Kp(static_cast<std::size_t>(n_rows) * static_cast<std::size_t>(dk)), Vp(static_cast<std::size_t>(n_rows) * static_cast<std::size_t>(dv));
      for (int t = 0; t < n_rows; ++t) src.packed(t, g, &Kp[static_cast<std::size_t>(t) * static_cast<std::size_t>(dk)], &Vp[static_cast<std::size_t>(t) * static_cast<std::size_t>(dv)]);
      std::vector<float> kb(static_cast<std::size_t>(dk)), vbuf(static_cast<std::size_t>(dv));
      for (int hh = 0; hh < group; ++hh) {
        const int h = g * group + hh;
        for (int i = 0; i < n_q; ++i) {
          const int p = pos0 + i;
          const float* qh = q + static_cast<std::size_t>(i) * static_cast<std::size_t>(qstride) + static_cast<std::size_t>(h) * static_cast<std::size_t>(mla ? dk + dv : dk);
          std::vector<double> sc(static_cast<std::size_t>(p + 1));
          double mx = -std::numeric_limits<double>::infinity();
          for (int t = 0; t <= p; ++t) {
            const float* kr = &Kp[static_cast<std::size_t>(t) * static_cast<std::size_t>(dk)];
            const float* vr = &Vp[static_cast<std::size_t>(t) * static_cast<std::size_t>(dv)];
            if (src.is_protected(t, p)) {
              const std::uint16_t* r = src.protected_row(t);
              from_bf16(r + static_cast<std::size_t>(g) * static_cast<std::size_t>(dk), static_cast<std::size_t>(dk), kb.data());
              from_bf16(r + im.rk + static_cast<std::size_t>(g) * static_cast<std::size_t>(dv), static_cast<std::size_t>(dv), vbuf.data());
              kr = kb.data();
              vr = vbuf.data();
            }
            double d = 0;
            for (int c = 0; c < dk; ++c) d += static_cast<double>(qh[c]) * kr[c];
            if (mla)
              for (int c = 0; c < dv; ++c) d += static_cast<double>(qh[dk + c]) * vr[c];
            sc[static_cast<std::size_t>(t)] = d * scale;
            mx = std::max(mx, sc[static_cast<std::size_t>(t)]);
          }
          double z = 0;
          for (auto& x : sc) z += (x = std::exp(x - mx));
          std::vector<double> o(static_cast<std::size_t>(odim), 0.0);
          for (int t = 0; t <= p; ++t) {
            const double w = sc[static_cast<std::size_t>(t)] / z;
            const float* src_row;
            if (src.is_protected(t, p)) {
              const std::uint16_t* r = src.protected_row(t);
              if (mla) from_bf16(r, static_cast<std::size_t>(dk), kb.data());
              else from_bf16(r + im.rk + static_cast<std::size_t>(g) * static_cast<std::size_t>(dv), static_cast<std::size_t>(dv), vbuf.data());
              src_row = mla ? kb.data() : vbuf.data();
            } else {
              src_row = mla ? &Kp[static_cast<std::size_t>(t) * static_cast<std::size_t>(dk)] : &Vp[static_cast<std::size_t>(t) * static_cast<std::size_t>(dv)];
            }
            for (int c = 0; c < odim; ++c) o[static_cast<std::size_t>(c)] += w * src_row[c];
          }
          float* oh = out + static_cast<std::size_t>(i) * static_cast<std::size_t>(ostride) + static_cast<std::size_t>(h) * static_cast<std::size_t>(odim);
          for (int c = 0; c < odim; ++c) oh[c] = static_cast<float>(o[static_cast<std::size_t>(c)]);
        }
      }
    }
    return;
  }

  if (n_q >= 8) {
    // Prefill-sized: dequantize the rows once per KV head, attend with GEMMs over query tiles,
    // then correct the protected band exactly (bf16 rows in place of the packed ones).
    BlasOneThread one;
    const int tile = 128;
    const int n_tiles = (n_q + tile - 1) / tile;
    std::vector<std::vector<float>> Kd(static_cast<std::size_t>(im.heads)), Vd(static_cast<std::size_t>(im.heads));
#pragma omp parallel for schedule(static)
    for (int g = 0; g < im.heads; ++g) {
      Kd[static_cast<std::size_t>(g)].resize(static_cast<std::size_t>(n_rows) * static_cast<std::size_t>(dk));
      Vd[static_cast<std::size_t>(g)].resize(static_cast<std::size_t>(n_rows) * static_cast<std::size_t>(dv));
      src.packed_all(n_rows, g, Kd[static_cast<std::size_t>(g)].data(), Vd[static_cast<std::size_t>(g)].data());
    }
    const int jobs = n_heads * n_tiles;
#pragma omp parallel for schedule(dynamic)
    for (int job = 0; job < jobs; ++job) {
      const int h = job / n_tiles, tq = job % n_tiles;
      const int g = mla ? 0 : h / group;
      const int i0 = tq * tile, m = std::min(tile, n_q - i0);
      const int cols = pos0 + i0 + m;  // rows visible to the last query of the tile
      const float* K = Kd[static_cast<std::size_t>(g)].data();
      const float* V = Vd[static_cast<std::size_t>(g)].data();
      std::vector<float> P(static_cast<std::size_t>(m) * static_cast<std::size_t>(cols));
      const float* Q = q + static_cast<std::size_t>(i0) * static_cast<std::size_t>(qstride) + static_cast<std::size_t>(h) * static_cast<std::size_t>(mla ? dk + dv : dk);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, cols, dk, scale, Q, qstride, K, dk, 0.0f, P.data(), cols);
      if (mla) cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, cols, dv, scale, Q + dk, qstride, V, dv, 1.0f, P.data(), cols);
      std::vector<float> kb(static_cast<std::size_t>(dk)), vb(static_cast<std::size_t>(dv));
      std::vector<float> corr;  // per row of the tile: protected band weights * (bf16 - packed)
      for (int i = 0; i < m; ++i) {
        const int p = pos0 + i0 + i;
        float* row = &P[static_cast<std::size_t>(i) * static_cast<std::size_t>(cols)];
        const float* qh = Q + static_cast<std::size_t>(i) * static_cast<std::size_t>(qstride);
        auto fix = [&](int t) {
          const std::uint16_t* r = src.protected_row(t);
          from_bf16(r + static_cast<std::size_t>(g) * static_cast<std::size_t>(dk), static_cast<std::size_t>(dk), kb.data());
          float d = 0;
          for (int c = 0; c < dk; ++c) d += qh[c] * kb[static_cast<std::size_t>(c)];
          if (mla) {
            from_bf16(r + im.rk, static_cast<std::size_t>(dv), vb.data());
            for (int c = 0; c < dv; ++c) d += qh[dk + c] * vb[static_cast<std::size_t>(c)];
          }
          row[t] = d * scale;
        };
        for_protected(p, opt_.protect.sinks, W, fix);
        causal_softmax(row, p, cols);
      }
      float* O = out + static_cast<std::size_t>(i0) * static_cast<std::size_t>(ostride) + static_cast<std::size_t>(h) * static_cast<std::size_t>(odim);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, odim, cols, 1.0f, P.data(), cols, mla ? K : V, mla ? dk : dv,
                  0.0f, O, ostride);
      // Protected rows: add w * (bf16 value - packed value).
      for (int i = 0; i < m; ++i) {
        const int p = pos0 + i0 + i;
        const float* row = &P[static_cast<std::size_t>(i) * static_cast<std::size_t>(cols)];
        float* oh = O + static_cast<std::size_t>(i) * static_cast<std::size_t>(ostride);
        auto add = [&](int t) {
          const std::uint16_t* r = src.protected_row(t);
          const float w = row[t];
          if (mla) {
            from_bf16(r, static_cast<std::size_t>(dk), kb.data());
            const float* kp = K + static_cast<std::size_t>(t) * static_cast<std::size_t>(dk);
            for (int c = 0; c < dk; ++c) oh[c] += w * (kb[static_cast<std::size_t>(c)] - kp[c]);
          } else {
            from_bf16(r + im.rk + static_cast<std::size_t>(g) * static_cast<std::size_t>(dv), static_cast<std::size_t>(dv), vb.data());
            const float* vp = V + static_cast<std::size_t>(t) * static_cast<std::size_t>(dv);
            for (int c = 0; c < dv; ++c) oh[c] += w * (vb[static_cast<std::size_t>(c)] - vp[c]);
          }
        };
        for_protected(p, opt_.protect.sinks, W, add);
      }
    }
    return;
  }

  // Decode-sized: scores straight from packed codes (rotated query, centroid lookups / fused
  // group dequantization), values accumulated in the quantizer's domain, protected rows in
  // bf16, one online softmax over both, one finish() per head.
#pragma omp parallel for schedule(dynamic) collapse(2) if (n_heads * n_q > 1)
  for (int h = 0; h < n_heads; ++h) {
    for (int i = 0; i < n_q; ++i) {
      const int g = mla ? 0 : h / group;
      const auto& qz = L.q[static_cast<std::size_t>(g)];
      const VectorQuantizer& kq = *qz.key;
      const VectorQuantizer& vq = *qz.value;
      const VectorQuantizer& accq = mla ? kq : vq;  // the quantizer of the accumulated rows
      const int p = pos0 + i;
      const float* qh = q + static_cast<std::size_t>(i) * static_cast<std::size_t>(qstride) + static_cast<std::size_t>(h) * static_cast<std::size_t>(mla ? dk + dv : dk);
      std::vector<float> qk(static_cast<std::size_t>(kq.query_dim())), qr(static_cast<std::size_t>(mla ? vq.query_dim() : 0));
      kq.prepare_query(qh, qk.data());
      if (mla) vq.prepare_query(qh + dk, qr.data());
      std::vector<float> acc_packed(static_cast<std::size_t>(accq.acc_dim()), 0.0f), acc_plain(static_cast<std::size_t>(odim), 0.0f);
      std::vector<float> kb(static_cast<std::size_t>(dk)), vb(static_cast<std::size_t>(dv));
      double m = -std::numeric_limits<double>::infinity(), l = 0;
      for (int t = 0; t <= p; ++t) {
        double sc;
        const std::uint16_t* r = nullptr;
        const std::uint8_t *pg = nullptr, *meta = nullptr;
        const int off = t % opt_.page_tokens;
        if (src.is_protected(t, p)) {
          r = src.protected_row(t);
          from_bf16(r + static_cast<std::size_t>(g) * static_cast<std::size_t>(dk), static_cast<std::size_t>(dk), kb.data());
          double d = 0;
          for (int c = 0; c < dk; ++c) d += static_cast<double>(qh[c]) * kb[static_cast<std::size_t>(c)];
          if (mla) {
            from_bf16(r + im.rk, static_cast<std::size_t>(dv), vb.data());
            for (int c = 0; c < dv; ++c) d += static_cast<double>(qh[dk + c]) * vb[static_cast<std::size_t>(c)];
          }
          sc = d;
        } else {
          pg = src.page(t);
          meta = pg + L.lay.key_meta(g, off);
          sc = kq.score(qk.data(), pg + L.lay.key_code(g, off), meta);
          if (mla) sc += vq.score(qr.data(), pg + L.lay.value_code(g, off), meta + kq.meta_bytes());
        }
        sc *= scale;
        if (sc > m) {
          const float f = static_cast<float>(std::exp(m - sc));
          for (auto& x : acc_packed) x *= f;
          for (auto& x : acc_plain) x *= f;
          l *= f;
          m = sc;
        }
        const float w = static_cast<float>(std::exp(sc - m));
        l += w;
        if (r) {
          if (mla) {
            for (int c = 0; c < dk; ++c) acc_plain[static_cast<std::size_t>(c)] += w * kb[static_cast<std::size_t>(c)];
          } else {
            from_bf16(r + im.rk + static_cast<std::size_t>(g) * static_cast<std::size_t>(dv), static_cast<std::size_t>(dv), vb.data());
            for (int c = 0; c < dv; ++c) acc_plain[static_cast<std::size_t>(c)] += w * vb[static_cast<std::size_t>(c)];
          }
        } else if (mla) {
          kq.accumulate(w, pg + L.lay.key_code(g, off), meta, acc_packed.data());
        } else {
          vq.accumulate(w, pg + L.lay.value_code(g, off), meta + kq.meta_bytes(), acc_packed.data());
        }
      }
      std::vector<float> fin(static_cast<std::size_t>(odim));
      accq.finish(acc_packed.data(), fin.data());
      float* oh = out + static_cast<std::size_t>(i) * static_cast<std::size_t>(ostride) + static_cast<std::size_t>(h) * static_cast<std::size_t>(odim);
      const float inv = static_cast<float>(1.0 / l);
      for (int c = 0; c < odim; ++c) oh[c] = (fin[static_cast<std::size_t>(c)] + acc_plain[static_cast<std::size_t>(c)]) * inv;
    }
  }
}

// ---- accounting --------------------------------------------------------------------------

bool PagedCache::attend_expanded(int seq, int layer, int n_q, int pos0, float scale, const MlaUpProjection& up,
                                 const float* q, float* out) const {
  if (!geo_.mla || path_ == AttentionPath::kReference) return false;
  const auto& im = *impl_;
  check_seq_layer(im, geo_.n_layers, seq, layer);
  require(up.n_heads > 0 && up.nope > 0 && up.v_dim > 0 && up.w_uk && up.w_uv,
          "PagedCache::attend_expanded: empty up-projection");
  const auto& s = im.seqs[static_cast<std::size_t>(seq)];
  const auto& L = im.layers[static_cast<std::size_t>(layer)];
  const auto& pr = s.prot[static_cast<std::size_t>(layer)];
  if (n_q <= 0) return true;
  const int S = opt_.protect.sinks, W = opt_.protect.window;
  check_attend(s, pr, layer, n_q, pos0, W);
  const RowSource src{&im, &L, &s, &pr, S, W, opt_.page_tokens};
  const int dc = im.dk, rd = im.dv, H = up.n_heads, nope = up.nope, vd = up.v_dim;
  const int n_rows = pos0 + n_q;
  const auto Z = [](int a) { return static_cast<std::size_t>(a); };
  BlasOneThread one;

  // Every row decoded from its packed copy, and the bf16 copies of the rows some query of the
  // chunk reads from bf16: the sinks and the window band [pos0 + 1 - W, n_rows).
  std::vector<float> C(Z(n_rows) * Z(dc)), R(Z(n_rows) * Z(rd));
  src.packed_all(n_rows, 0, C.data(), R.data());
  const int s_end = std::min(S, n_rows);
  const int b0 = W > 0 ? std::max(s_end, pos0 + 1 - W) : n_rows;
  const int nb = s_end + (n_rows - b0);
  const auto slot = [&](int t) { return t < s_end ? t : s_end + (t - b0); };
  std::vector<float> Cb(Z(nb) * Z(dc)), Rb(Z(nb) * Z(rd));
  const auto fetch = [&](int t) {
    const std::uint16_t* r = src.protected_row(t);
    from_bf16(r, Z(dc), &Cb[Z(slot(t)) * Z(dc)]);
    from_bf16(r + im.rk, Z(rd), &Rb[Z(slot(t)) * Z(rd)]);
  };
  for (int t = 0; t < s_end; ++t) fetch(t);
  for (int t = b0; t < n_rows; ++t) fetch(t);

  // Up-projection per head: K_h = C W_UK_h^T [n_rows][nope], V_h = C W_UV_h^T [n_rows][vd],
  // and the same for the bf16 copies.
  std::vector<std::vector<float>> Kh(Z(H)), Vh(Z(H)), Kbh(Z(H)), Vbh(Z(H));
#pragma omp parallel for schedule(static)
  for (int h = 0; h < H; ++h) {
    const float* wk = up.w_uk + Z(h) * Z(nope) * Z(dc);
    const float* wv = up.w_uv + Z(h) * Z(vd) * Z(dc);
    auto project = [&](const std::vector<float>& X, int rows, const float* w, int od, std::vector<float>& Y) {
      Y.resize(Z(rows) * Z(od));
      if (rows > 0)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, od, dc, 1.0f, X.data(), dc, w, dc, 0.0f, Y.data(), od);
    };
    project(C, n_rows, wk, nope, Kh[Z(h)]);
    project(C, n_rows, wv, vd, Vh[Z(h)]);
    project(Cb, nb, wk, nope, Kbh[Z(h)]);
    project(Cb, nb, wv, vd, Vbh[Z(h)]);
  }

  const int qstride = H * (nope + rd), ostride = H * vd;
  const int tile = 128;
  const int n_tiles = (n_q + tile - 1) / tile;
#pragma omp parallel for schedule(dynamic)
  for (int job = 0; job < H * n_tiles; ++job) {
    const int h = job / n_tiles, tq = job % n_tiles;
    const int i0 = tq * tile, m = std::min(tile, n_q - i0);
    const int cols = pos0 + i0 + m;
    const float* K = Kh[Z(h)].data();
    const float* V = Vh[Z(h)].data();
    const float* Kb = Kbh[Z(h)].data();
    const float* Vb = Vbh[Z(h)].data();
    const float* Q = q + Z(i0) * Z(qstride) + Z(h) * Z(nope + rd);
    std::vector<float> P(Z(m) * Z(cols));
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, cols, nope, scale, Q, qstride, K, nope, 0.0f, P.data(), cols);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, cols, rd, scale, Q + nope, qstride, R.data(), rd, 1.0f, P.data(), cols);
    for (int i = 0; i < m; ++i) {
      const int p = pos0 + i0 + i;
      float* row = &P[Z(i) * Z(cols)];
      const float* qn = Q + Z(i) * Z(qstride);
      for_protected(p, S, W, [&](int t) {
        const float* kb = Kb + Z(slot(t)) * Z(nope);
        const float* rb = &Rb[Z(slot(t)) * Z(rd)];
        float d = 0;
        for (int c = 0; c < nope; ++c) d += qn[c] * kb[c];
        for (int c = 0; c < rd; ++c) d += qn[nope + c] * rb[c];
        row[t] = d * scale;
      });
      causal_softmax(row, p, cols);
    }
    float* O = out + Z(i0) * Z(ostride) + Z(h) * Z(vd);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, vd, cols, 1.0f, P.data(), cols, V, vd, 0.0f, O, ostride);
    for (int i = 0; i < m; ++i) {
      const int p = pos0 + i0 + i;
      const float* row = &P[Z(i) * Z(cols)];
      float* oh = O + Z(i) * Z(ostride);
      for_protected(p, S, W, [&](int t) {
        const float w = row[t];
        const float* vb = Vb + Z(slot(t)) * Z(vd);
        const float* vp = V + Z(t) * Z(vd);
        for (int c = 0; c < vd; ++c) oh[c] += w * (vb[c] - vp[c]);
      });
    }
  }
  return true;
}

CacheMemory PagedCache::memory(int seq) const {
  const auto& im = *impl_;
  const auto& s = im.seqs.at(static_cast<std::size_t>(seq));
  CacheMemory m;
  m.blocks = s.blocks.size();
  m.packed_bytes = m.blocks * block_bytes_;
  m.reverse_map_bytes = 8 * m.blocks * impl_->reverse.size();
  for (const auto& pr : s.prot) m.protection_bytes += 2 * (pr.sink.size() + pr.ring.size());
  return m;
}

CacheMemory PagedCache::memory_total() const {
  CacheMemory m;
  for (std::size_t i = 0; i < impl_->seqs.size(); ++i) {
    const auto x = memory(static_cast<int>(i));
    m.blocks += x.blocks;
    m.packed_bytes += x.packed_bytes;
    m.protection_bytes += x.protection_bytes;
    m.reverse_map_bytes += x.reverse_map_bytes;
  }
  return m;
}

CacheMemory PagedCache::account(const CacheGeometry& g, const std::string& format, const ProtectionPolicy& p, int tokens,
                                int page_tokens) {
  require(tokens >= 0, "account: tokens must be non-negative, got " + std::to_string(tokens));
  const FormatSpec& f = check_cache_args("account", g, format, page_tokens, p);
  CacheMemory m;
  m.blocks = static_cast<std::size_t>((tokens + page_tokens - 1) / page_tokens);
  std::size_t block = 0;
  for (int l = 0; l < g.n_layers; ++l) {
    const bool boundary = l < p.boundary_layers || l >= g.n_layers - p.boundary_layers;
    block += page_layout(boundary ? find_format("bf16") : f, g, page_tokens).page_bytes;
  }
  m.packed_bytes = m.blocks * block;
  m.reverse_map_bytes = 8 * m.blocks * static_cast<std::size_t>(g.n_layers);
  const std::size_t row = bf16_token_bytes(g);
  const std::size_t rows = static_cast<std::size_t>(p.sinks > 0 && tokens > 0 ? p.sinks : 0) + static_cast<std::size_t>(p.window > 0 && tokens > 0 ? p.window : 0);
  m.protection_bytes = rows * row * static_cast<std::size_t>(g.n_layers);
  return m;
}

std::shared_ptr<FormatCalibration> PagedCache::calibration(const FormatSpec& f) const {
  const auto& im = *impl_;
  auto oc = std::make_shared<FormatCalibration>();
  for (int l = 0; l < geo_.n_layers; ++l) {
    const std::size_t rows = im.stat_rows[static_cast<std::size_t>(l)];
    require(rows > 0, "calibration: no rows collected for layer " + std::to_string(l));
    oc->key.emplace_back();
    oc->value.emplace_back();
    oc->key_mean.emplace_back();
    oc->value_mean.emplace_back();
    for (int h = 0; h < im.heads; ++h) {
      auto mean = [&](const std::vector<double>& s) {
        std::vector<float> m(s.size());
        for (std::size_t i = 0; i < s.size(); ++i) m[i] = static_cast<float>(s[i] / static_cast<double>(rows));
        return m;
      };
      if (format_uses_centering(f)) {
        oc->key_mean.back().push_back(mean(im.ksum[static_cast<std::size_t>(l)][static_cast<std::size_t>(h)]));
        oc->value_mean.back().push_back(mean(im.vsum[static_cast<std::size_t>(l)][static_cast<std::size_t>(h)]));
      }
      if (f.kind != FormatKind::kTqSplit) {
        oc->key.back().emplace_back();
        oc->value.back().emplace_back();
        continue;
      }
      auto pick = [&](const std::vector<double>& a, int count) {
        std::vector<int> idx(a.size());
        for (std::size_t i = 0; i < idx.size(); ++i) idx[i] = static_cast<int>(i);
        std::stable_sort(idx.begin(), idx.end(), [&](int x, int y) { return a[static_cast<std::size_t>(x)] > a[static_cast<std::size_t>(y)]; });
        idx.resize(static_cast<std::size_t>(count));
        std::sort(idx.begin(), idx.end());
        return idx;
      };
      // Outliers: the channels with the largest spread around the mean that centering removes
      // (E[(x - mu)^2]); without centering, the chapter's largest mean |x|.
      auto spread = [&](const std::vector<double>& sum, const std::vector<double>& sq, const std::vector<double>& ab) {
        std::vector<double> r(sum.size());
        for (std::size_t i = 0; i < r.size(); ++i) {
          const double m = sum[i] / static_cast<double>(rows);
          r[i] = format_uses_centering(f) ? sq[i] / static_cast<double>(rows) - m * m : ab[i];
        }
        return r;
      };
      const std::size_t L = static_cast<std::size_t>(l), H = static_cast<std::size_t>(h);
      oc->key.back().push_back(pick(spread(im.ksum[L][H], im.ksq[L][H], im.kabs[L][H]), split_outlier_count(f, im.dk)));
      oc->value.back().push_back(pick(spread(im.vsum[L][H], im.vsq[L][H], im.vabs[L][H]), split_outlier_count(f, im.dv)));
    }
  }
  return oc;
}

}  // namespace kvq
