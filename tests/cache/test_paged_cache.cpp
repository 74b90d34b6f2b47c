// The paged cache: fast attention equals the reference (1e-5 normwise) for every format, with
// and without protection, prefill- and decode-sized; protected rows are bf16 and the rest
// decode from packed copies, tokens age out of the window onto their packed copy; memory
// accounting against the QuantMLA paper; exhausted pools, preemption and recomputation;
// NaN / Inf input; formats that do not fit.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvq/common.hpp"
#include "kvq/numeric.hpp"
#include "kvq/paged_cache.hpp"
#include "kvq/safetensors.hpp"

using namespace kvq;

namespace {

CacheGeometry gqa() {
  CacheGeometry g;
  g.n_layers = 2;
  g.n_kv_heads = 2;
  g.head_dim = 128;
  g.v_head_dim = 128;
  return g;
}
CacheGeometry mla(int layers = 2) {
  CacheGeometry g;
  g.n_layers = layers;
  g.mla = true;
  g.d_latent = 512;
  g.d_rope = 64;
  return g;
}

std::vector<float> randn(std::size_t n, unsigned seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

std::size_t kdim(const CacheGeometry& g) { return g.mla ? static_cast<std::size_t>(g.d_latent) : static_cast<std::size_t>(g.n_kv_heads * g.head_dim); }
std::size_t vdim(const CacheGeometry& g) { return g.mla ? static_cast<std::size_t>(g.d_rope) : static_cast<std::size_t>(g.n_kv_heads * g.v_head_dim); }

// Calibration with outlier channels and channel means (centering formats use the means).
std::shared_ptr<OutlierChannels> fake_outliers(const CacheGeometry& g, const FormatSpec& f) {
  auto oc = std::make_shared<OutlierChannels>();
  for (int l = 0; l < g.n_layers; ++l) {
    oc->key.emplace_back();
    oc->value.emplace_back();
    oc->key_mean.emplace_back();
    oc->value_mean.emplace_back();
    for (int h = 0; h < g.n_kv_heads; ++h) {
      std::vector<int> c;
      for (int i = 0; i < split_outlier_count(f, g.head_dim); ++i) c.push_back(2 * i + (l + h) % 2);
      oc->key.back().push_back(c);
      oc->value.back().push_back(c);
      oc->key_mean.back().push_back(randn(static_cast<std::size_t>(g.head_dim), 70 + static_cast<unsigned>(l * 2 + h), 0.5f));
      oc->value_mean.back().push_back(randn(static_cast<std::size_t>(g.v_head_dim), 90 + static_cast<unsigned>(l * 2 + h), 0.3f));
    }
  }
  return oc;
}

// Appends `len` tokens in the given chunk sizes to every layer; rows are random with channel
// outliers (keys) so that quantization error is visible.
void fill(PagedCache& c, int seq, const std::vector<int>& chunks, unsigned seed) {
  const auto& g = c.geometry();
  for (std::size_t ci = 0; ci < chunks.size(); ++ci) {
    const int n = chunks[ci];
    for (int l = 0; l < g.n_layers; ++l) {
      auto k = randn(static_cast<std::size_t>(n) * kdim(g), seed + static_cast<unsigned>(ci * 31 + static_cast<std::size_t>(l)));
      auto v = randn(static_cast<std::size_t>(n) * vdim(g), seed + 1000 + static_cast<unsigned>(ci * 31 + static_cast<std::size_t>(l)));
      for (std::size_t i = 0; i < k.size(); i += 37) k[i] *= 8.0f;
      c.append(seq, l, n, k.data(), v.data());
    }
  }
}

std::vector<float> attend(const PagedCache& c, int layer, int n_q, int pos0, int n_heads, unsigned seed) {
  const auto& g = c.geometry();
  const int qd = g.mla ? g.d_latent + g.d_rope : g.head_dim;
  const int od = g.mla ? g.d_latent : g.v_head_dim;
  const auto q = randn(static_cast<std::size_t>(n_q) * static_cast<std::size_t>(n_heads) * static_cast<std::size_t>(qd), seed, 0.2f);
  std::vector<float> out(static_cast<std::size_t>(n_q) * static_cast<std::size_t>(n_heads) * static_cast<std::size_t>(od), NAN);
  c.attend(0, layer, n_q, pos0, n_heads, 1.0f / std::sqrt(static_cast<float>(qd)), q.data(), out.data());
  return out;
}

double nrel(const std::vector<float>& a, const std::vector<float>& b) { return rel_error(a.data(), b.data(), a.size()); }

// tiny-mla's real layer-2 latent and RoPE-key rows (the fixture's reference dump).
struct FixtureRows {
  std::vector<float> lat, rope;
};
FixtureRows fixture_layer2() {
  SafetensorsFile f(std::string(KVQ_SOURCE_DIR) + "/models/tiny-mla/reference.safetensors");
  return {f.get("layer2.latent").to_float(), f.get("layer2.k_rope").to_float()};
}
// A one-layer MLA cache of `fmt` with 4 sinks and a 32-token window holding fixture rows
// [0, n0 + n1), appended as two chunks.
std::unique_ptr<PagedCache> fixture_cache(const FixtureRows& r, const char* fmt, int n0, int n1) {
  const auto need = static_cast<std::size_t>(n0 + n1);
  if (r.lat.size() < need * 512 || r.rope.size() < need * 64) throw std::runtime_error("fixture has too few rows");
  CacheOptions o;
  o.format = fmt;
  o.protect = {4, 32, 0};
  auto c = std::make_unique<PagedCache>(mla(1), o);
  c->append(0, 0, n0, r.lat.data(), r.rope.data());
  c->append(0, 0, n1, r.lat.data() + static_cast<std::size_t>(n0) * 512, r.rope.data() + static_cast<std::size_t>(n0) * 64);
  return c;
}

}  // namespace

TEST(PagedCache, FastEqualsReferenceEveryFormat) {
  for (const auto& f : all_formats()) {
    for (bool mla_geo : {false, true}) {
      if ((f.family == FormatFamily::kMLA && !mla_geo) || (f.family == FormatFamily::kKV && mla_geo)) continue;
      const CacheGeometry g = mla_geo ? mla() : gqa();
      for (bool protect : {false, true}) {
        CacheOptions o;
        o.format = f.name;
        if (protect) o.protect = {3, 20, 0};
        if (f.kind == FormatKind::kTqSplit || format_uses_centering(f)) o.outliers = fake_outliers(g, f);
        PagedCache c(g, o);
        fill(c, 0, {70, 45}, 7);  // 115 tokens: two pages, the second chunk prefill-sized
        for (int layer = 0; layer < 2; ++layer) {
          // Prefill-sized queries over the last chunk, then decode-sized ones.
          c.set_attention_path(AttentionPath::kReference);
          const auto ref = attend(c, layer, 45, 70, 4, 99);
          c.set_attention_path(AttentionPath::kFast);
          const auto fast = attend(c, layer, 45, 70, 4, 99);
          ASSERT_LT(nrel(fast, ref), 1e-5) << f.name << " protect=" << protect << " prefill";
        }
        fill(c, 0, {1}, 8);
        for (int layer = 0; layer < 2; ++layer) {
          c.set_attention_path(AttentionPath::kReference);
          const auto ref = attend(c, layer, 1, 115, 4, 5);
          c.set_attention_path(AttentionPath::kFast);
          const auto fast = attend(c, layer, 1, 115, 4, 5);
          ASSERT_LT(nrel(fast, ref), 1e-5) << f.name << " protect=" << protect << " decode";
          for (float x : fast) ASSERT_TRUE(std::isfinite(x));
        }
      }
    }
  }
}

// Protected rows come from bf16 copies, the rest from packed copies; a token leaving the
// window switches to its packed copy (written once at insertion).
TEST(PagedCache, ProtectionAndTokenAging) {
  const auto g = mla(1);
  CacheOptions o;
  o.format = "c2r4";
  o.protect = {2, 5, 0};
  PagedCache c(g, o);
  std::vector<std::vector<float>> K, V;
  const auto q = make_quantizers(find_format("c2r4"), g, 0, 0);
  for (int t = 0; t < 12; ++t) {
    K.push_back(randn(512, 50 + static_cast<unsigned>(t)));
    V.push_back(randn(64, 80 + static_cast<unsigned>(t)));
    c.append(0, 0, 1, K.back().data(), V.back().data());
    // After each step, check every row as the newest query sees it.
    for (int s = 0; s <= t; ++s) {
      std::vector<float> k(512), v(64), kp(512), vp(64);
      c.read_row(0, 0, s, t, k.data(), v.data());
      const bool prot = s < 2 || s > t - 5;
      std::vector<std::uint8_t> kr(q.key->bytes()), vr(q.value->bytes());
      q.key->encode_record(K[static_cast<std::size_t>(s)].data(), kr.data());
      q.value->encode_record(V[static_cast<std::size_t>(s)].data(), vr.data());
      q.key->decode_record(kr.data(), kp.data());
      q.value->decode_record(vr.data(), vp.data());
      for (int i = 0; i < 512; ++i)
        ASSERT_EQ(k[static_cast<std::size_t>(i)], prot ? round_bf16(K[static_cast<std::size_t>(s)][static_cast<std::size_t>(i)]) : kp[static_cast<std::size_t>(i)])
            << "t=" << t << " s=" << s;
      for (int i = 0; i < 64; ++i)
        ASSERT_EQ(v[static_cast<std::size_t>(i)], prot ? round_bf16(V[static_cast<std::size_t>(s)][static_cast<std::size_t>(i)]) : vp[static_cast<std::size_t>(i)]);
    }
  }
  // Prefill: a chunk of 20 appended at once; query 25 sees window [21, 25] in bf16 and 12..20
  // from packed copies, exactly as decode would.
  auto k = randn(20 * 512, 9), v = randn(20 * 64, 10);
  c.append(0, 0, 20, k.data(), v.data());
  std::vector<float> kr(512), vr(64);
  c.read_row(0, 0, 20, 25, kr.data(), vr.data());
  std::vector<std::uint8_t> rec(q.key->bytes());
  q.key->encode_record(&k[8 * 512], rec.data());
  std::vector<float> kp(512);
  q.key->decode_record(rec.data(), kp.data());
  EXPECT_EQ(kr, kp);
  c.read_row(0, 0, 21, 25, kr.data(), vr.data());
  for (int i = 0; i < 512; ++i) ASSERT_EQ(kr[static_cast<std::size_t>(i)], round_bf16(k[9 * 512 + static_cast<std::size_t>(i)]));
}

// A bf16-format cache and the protection policy S = W = everything give identical attention.
TEST(PagedCache, FullProtectionEqualsBf16) {
  const auto g = gqa();
  CacheOptions a, b;
  a.format = "bf16";
  b.format = "tq-2.5bit";
  b.outliers = fake_outliers(g, find_format("tq-2.5bit"));
  b.protect = {0, 1000, 0};
  PagedCache ca(g, a), cb(g, b);
  fill(ca, 0, {100}, 3);
  fill(cb, 0, {100}, 3);
  for (int layer = 0; layer < 2; ++layer) EXPECT_LT(nrel(attend(cb, layer, 100, 0, 4, 1), attend(ca, layer, 100, 0, 4, 1)), 1e-6);
  // Boundary layers: with N = 1 both layers of a 2-layer model are bf16.
  CacheOptions nb = b;
  nb.protect = {0, 0, 1};
  PagedCache cn(g, nb);
  fill(cn, 0, {100}, 3);
  EXPECT_EQ(cn.layer_format(0).name, "bf16");
  EXPECT_EQ(cn.layer_format(1).name, "bf16");
  EXPECT_LT(nrel(attend(cn, 1, 100, 0, 4, 1), attend(ca, 1, 100, 0, 4, 1)), 1e-6);
}

// The QuantMLA paper's accounting at d_c = 512, d_r = 64, 64-token pages, 132 protected rows
// (models/tiny-mla has that shape): C4R4 20,480 bytes per page, bf16 73,728; persistent ratio
// 3.22x at 4K and 3.59x at 128K. Measured on what the pool actually holds for a request.
TEST(PagedCache, MemoryAccountingMatchesPaper) {
  const auto g = mla(4);
  CacheOptions o;
  o.format = "c4r4";
  o.protect = ProtectionPolicy::paper();
  PagedCache c(g, o);
  EXPECT_EQ(c.layer_layout(0).page_bytes, 20480u);
  CacheOptions ob;
  PagedCache cbf(g, ob);
  EXPECT_EQ(cbf.layer_layout(0).page_bytes, 73728u);
  // One random 1024-token chunk, appended repeatedly (the bytes held do not depend on values).
  const auto kc = randn(1024 * 512, 1), vc = randn(1024 * 64, 2);
  auto run = [&](PagedCache& cache, int tokens) {
    cache.reset(0);
    for (int t = 0; t < tokens; t += 1024)
      for (int l = 0; l < 4; ++l) cache.append(0, l, std::min(1024, tokens - t), kc.data(), vc.data());
    return cache.memory(0);
  };
  std::vector<int> lengths = {4096};
#ifndef KVQ_SANITIZE
  lengths.push_back(131072);
#endif
  for (int L : lengths) {
    const auto m = run(c, L);
    const auto mb = run(cbf, L);
    const auto am = PagedCache::account(g, "c4r4", ProtectionPolicy::paper(), L);
    EXPECT_EQ(m.total(), am.total()) << L;
    EXPECT_EQ(m.protection_bytes, 4u * 132u * 576u * 2u);  // 152,064 per layer
    EXPECT_EQ(m.packed_bytes, m.blocks * 4u * 20480u);
    EXPECT_EQ(m.reverse_map_bytes, 4u * 8u * m.blocks);  // 8 bytes per page of each layer
    const double ratio = static_cast<double>(mb.packed_bytes) / static_cast<double>(m.total());
    EXPECT_NEAR(ratio, L == 4096 ? 3.22 : 3.59, 0.005) << L;
  }
  // The analytic formula at 128K, also in sanitizer builds.
  const auto a128 = PagedCache::account(g, "c4r4", ProtectionPolicy::paper(), 131072);
  const auto b128 = PagedCache::account(g, "bf16", ProtectionPolicy{}, 131072);
  EXPECT_NEAR(static_cast<double>(b128.packed_bytes) / static_cast<double>(a128.total()), 3.59, 0.005);
  // An empty request has no pages and no protection rows; impossible arguments are refused, not counted.
  const auto a0 = PagedCache::account(g, "c4r4", ProtectionPolicy::paper(), 0);
  EXPECT_EQ(a0.total(), 0u);
  EXPECT_THROW(PagedCache::account(g, "c4r4", ProtectionPolicy::paper(), -5), Error);
  EXPECT_THROW(PagedCache::account(g, "c4r4", ProtectionPolicy{}, 4096, 0), Error);
  EXPECT_THROW(PagedCache::account(g, "c4r4", ProtectionPolicy{}, 4096, -64), Error);
  ProtectionPolicy neg;
  neg.sinks = -1;
  EXPECT_THROW(PagedCache::account(g, "c4r4", neg, 4096), Error);
}

TEST(PagedCache, ExhaustedPoolPreemptionAndRecompute) {
  const auto g = gqa();
  CacheOptions o;
  o.format = "tq-3bit";
  const std::size_t block = PagedCache(g, o).block_bytes();
  o.pool_bytes = 3 * block;  // 3 blocks of 64 tokens
  {
    PagedCache c(g, o, 2);
    fill(c, 0, {128}, 1);
    try {
      fill(c, 1, {100}, 2);
      FAIL() << "no error on an exhausted pool";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("page pool exhausted"), std::string::npos) << e.what();
    }
    // Sequence 0 is intact.
    EXPECT_EQ(c.length(0), 128);
  }
  o.preempt = true;
  PagedCache c(g, o, 2);
  fill(c, 0, {128}, 1);
  PagedCache ref(g, CacheOptions{o.format, {}, 64, 0, false, nullptr}, 2);
  fill(ref, 0, {128}, 1);
  fill(c, 1, {100}, 2);  // needs 2 blocks: preempts sequence 0
  EXPECT_TRUE(c.preempted(0));
  EXPECT_EQ(c.preemptions(), 1);
  EXPECT_EQ(c.length(1), 100);
  EXPECT_THROW(fill(c, 0, {1}, 3), Error);  // a preempted sequence must be recomputed
  // Finish sequence 1, free it, recompute sequence 0: attention equals a never-preempted run.
  c.reset(1);
  c.reset(0);
  fill(c, 0, {128}, 1);
  c.set_attention_path(AttentionPath::kFast);
  for (int layer = 0; layer < 2; ++layer) EXPECT_EQ(attend(c, layer, 128, 0, 4, 4), attend(ref, layer, 128, 0, 4, 4));
}

TEST(PagedCache, NonFiniteInputNamesLayerAndPosition) {
  const auto g = gqa();
  for (const char* fmt : {"bf16", "tq-3bit", "tq-3bit-nc", "fp8"}) {
    CacheOptions o;
    o.format = fmt;
    PagedCache c(g, o);
    fill(c, 0, {10}, 1);
    auto k = randn(5 * kdim(g), 2), v = randn(5 * vdim(g), 3);
    k[3 * kdim(g) + 130] = NAN;  // token 13, head 1, channel 2
    c.append(0, 0, 5, randn(5 * kdim(g), 4).data(), v.data());
    try {
      c.append(0, 1, 5, k.data(), v.data());
      FAIL();
    } catch (const Error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("layer 1"), std::string::npos) << m;
      EXPECT_NE(m.find("position 13"), std::string::npos) << m;
      EXPECT_NE(m.find("head 1"), std::string::npos) << m;
    }
    EXPECT_EQ(c.length(0), 10);
    k[3 * kdim(g) + 130] = 0.0f;
    v[7] = INFINITY;
    EXPECT_THROW(c.append(0, 1, 5, k.data(), v.data()), Error);
  }
}

TEST(PagedCache, FormatsThatDoNotFit) {
  CacheOptions o;
  o.format = "c4r4";
  EXPECT_THROW(PagedCache(gqa(), o), Error);
  o.format = "tq-3bit";
  EXPECT_THROW(PagedCache(mla(), o), Error);
  o.format = "q4_0";
  EXPECT_THROW(PagedCache(gqa(), o), Error);
  o.format = "tq-3.5bit";  // no calibration
  EXPECT_THROW(PagedCache(gqa(), o), Error);
}

// On the fixture's real cache rows (keys after RoPE are not needed for this check): the fast
// decode path equals the reference.
TEST(PagedCache, RealFixtureRowsFastEqualsReference) {
  const FixtureRows rows = fixture_layer2();
  for (const char* fmt : {"c4r4", "c2r4", "mla-tq4", "fp8"}) {
    auto cache = fixture_cache(rows, fmt, 300, 1);
    PagedCache& c = *cache;
    c.set_attention_path(AttentionPath::kReference);
    const auto ref = attend(c, 0, 1, 300, 16, 3);
    c.set_attention_path(AttentionPath::kFast);
    EXPECT_LT(nrel(attend(c, 0, 1, 300, 16, 3), ref), 1e-5) << fmt;
  }
}

namespace {

// Expanded MLA attention through the cache vs the absorbed reference (double loops) followed
// by W_UV in double: the same rows (bf16 where protected, packed elsewhere), two forms.
struct UpProj {
  int H = 4, nope = 64, vd = 64;
  std::vector<float> wk, wv;
  explicit UpProj(int dc) : wk(randn(static_cast<std::size_t>(H * nope * dc), 501, 0.05f)), wv(randn(static_cast<std::size_t>(H * vd * dc), 502, 0.05f)) {}
  MlaUpProjection view() const { return MlaUpProjection{H, nope, vd, wk.data(), wv.data()}; }
};

// Returns {expanded, absorbed reference} outputs [n_q][H * vd] for queries [pos0, pos0 + n_q).
std::pair<std::vector<float>, std::vector<float>> expanded_vs_absorbed(PagedCache& c, const UpProj& up, int layer, int n_q,
                                                                       int pos0, unsigned seed) {
  const auto& g = c.geometry();
  const int dc = g.d_latent, rd = g.d_rope, qh = up.nope + rd, ad = dc + rd;
  const auto q = randn(static_cast<std::size_t>(n_q * up.H * qh), seed, 0.3f);
  std::vector<float> qabs(static_cast<std::size_t>(n_q * up.H * ad));
  for (int i = 0; i < n_q; ++i)
    for (int h = 0; h < up.H; ++h) {
      const float* qi = &q[static_cast<std::size_t>((i * up.H + h) * qh)];
      float* qa = &qabs[static_cast<std::size_t>((i * up.H + h) * ad)];
      for (int j = 0; j < dc; ++j) {
        double s = 0;
        for (int e = 0; e < up.nope; ++e) s += static_cast<double>(qi[e]) * up.wk[static_cast<std::size_t>((h * up.nope + e) * dc + j)];
        qa[j] = static_cast<float>(s);
      }
      for (int j = 0; j < rd; ++j) qa[dc + j] = qi[up.nope + j];
    }
  const float scale = 1.0f / std::sqrt(static_cast<float>(qh));
  std::vector<float> lat(static_cast<std::size_t>(n_q * up.H * dc));
  c.set_attention_path(AttentionPath::kReference);
  c.attend(0, layer, n_q, pos0, up.H, scale, qabs.data(), lat.data());
  std::vector<float> ref(static_cast<std::size_t>(n_q * up.H * up.vd));
  for (int i = 0; i < n_q; ++i)
    for (int h = 0; h < up.H; ++h)
      for (int e = 0; e < up.vd; ++e) {
        double s = 0;
        for (int j = 0; j < dc; ++j)
          s += static_cast<double>(lat[static_cast<std::size_t>((i * up.H + h) * dc + j)]) * up.wv[static_cast<std::size_t>((h * up.vd + e) * dc + j)];
        ref[static_cast<std::size_t>((i * up.H + h) * up.vd + e)] = static_cast<float>(s);
      }
  std::vector<float> out(ref.size(), NAN);
  EXPECT_FALSE(c.attend_expanded(0, layer, n_q, pos0, scale, up.view(), q.data(), out.data()))
      << "the reference path has no expanded form";
  c.set_attention_path(AttentionPath::kFast);
  EXPECT_TRUE(c.attend_expanded(0, layer, n_q, pos0, scale, up.view(), q.data(), out.data()));
  return {out, ref};
}

}  // namespace

TEST(PagedCache, ExpandedMlaEqualsAbsorbedEveryFormat) {
  const UpProj up(512);
  int checked = 0;
  for (const auto& f : all_formats()) {
    if (f.family == FormatFamily::kKV) continue;
    for (bool protect : {false, true}) {
      CacheOptions o;
      o.format = f.name;
      if (protect) o.protect = {3, 20, 0};
      PagedCache c(mla(), o);
      fill(c, 0, {70, 150}, 11);  // the second chunk spans two query tiles of 128
      for (int layer = 0; layer < 2; ++layer) {
        const auto [got, ref] = expanded_vs_absorbed(c, up, layer, 150, 70, 21 + static_cast<unsigned>(layer));
        for (float x : got) ASSERT_TRUE(std::isfinite(x)) << f.name;
        ASSERT_LT(nrel(got, ref), 1e-5) << f.name << " protect=" << protect << " layer " << layer;
        ++checked;
      }
    }
  }
  EXPECT_GE(checked, 4 * 2 * 2);
  // MHA/GQA caches have no expanded form.
  CacheOptions o;
  o.format = "tq-4bit";
  PagedCache c(gqa(), o);
  fill(c, 0, {10}, 3);
  std::vector<float> q(10 * 4 * 128), out(10 * 4 * 64);
  EXPECT_FALSE(c.attend_expanded(0, 0, 10, 0, 0.1f, up.view(), q.data(), out.data()));
}

// Both attention forms name an unknown sequence or layer instead of reading past their tables.
TEST(PagedCache, AttendRejectsUnknownSequenceOrLayer) {
  const UpProj up(512);
  CacheOptions o;
  o.format = "c4r4";
  PagedCache c(mla(), o, 2);
  fill(c, 0, {10}, 5);
  c.set_attention_path(AttentionPath::kFast);
  std::vector<float> qabs(10 * 4 * 576), lat(10 * 4 * 512), q(10 * 4 * 128), out(10 * 4 * 64);
  // The error must come from the argument check (it names the range), not from a later read.
  auto rejects = [](auto&& call) {
    try {
      call();
    } catch (const Error& e) {
      return std::string(e.what()).find("out of range") != std::string::npos;
    }
    return false;
  };
  for (const auto& [seq, layer] : {std::pair{2, 0}, std::pair{-1, 0}, std::pair{0, 2}, std::pair{0, -1}}) {
    EXPECT_TRUE(rejects([&] { c.attend(seq, layer, 10, 0, 4, 0.1f, qabs.data(), lat.data()); })) << seq << " " << layer;
    EXPECT_TRUE(rejects([&] { c.attend_expanded(seq, layer, 10, 0, 0.1f, up.view(), q.data(), out.data()); }))
        << seq << " " << layer;
  }
  EXPECT_NO_THROW(c.attend(0, 1, 10, 0, 4, 0.1f, qabs.data(), lat.data()));
}

// Real latent rows (tiny-mla layer 2), protection on, two chunks; the band rows of the second
// chunk reach back into the first chunk's window (ring rows).
TEST(PagedCache, ExpandedMlaRealFixtureRows) {
  const FixtureRows rows = fixture_layer2();
  const UpProj up(512);
  for (const char* fmt : {"c4r4", "c2r4", "mla-tq4", "bf16"}) {
    auto c = fixture_cache(rows, fmt, 200, 100);
    const auto [got, ref] = expanded_vs_absorbed(*c, up, 0, 100, 200, 8);
    EXPECT_LT(nrel(got, ref), 1e-5) << fmt;
  }
}
