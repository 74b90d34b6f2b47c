// Format registry: names, families, bytes and compression ratios (vLLM's preset figures at
// head_dim 128, the QuantMLA C4R4 record), zero vectors and non-finite input in every format.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "kvq/common.hpp"
#include "kvq/formats.hpp"
#include "test_util.hpp"

using namespace kvq;

namespace {
CacheGeometry gqa(int hd = 128) {
  CacheGeometry g;
  g.n_layers = 4;
  g.n_kv_heads = 2;
  g.head_dim = hd;
  g.v_head_dim = hd;
  return g;
}
CacheGeometry mla() {
  CacheGeometry g;
  g.n_layers = 4;
  g.mla = true;
  g.d_latent = 512;
  g.d_rope = 64;
  return g;
}
OutlierChannels fake_outliers(const CacheGeometry& g, const FormatSpec& f) {
  OutlierChannels oc;
  const int nk = split_outlier_count(f, g.head_dim), nv = split_outlier_count(f, g.v_head_dim);
  for (int l = 0; l < g.n_layers; ++l) {
    oc.key.emplace_back();
    oc.value.emplace_back();
    for (int h = 0; h < g.n_kv_heads; ++h) {
      std::vector<int> k, v;
      for (int i = 0; i < nk; ++i) k.push_back(i * 2);
      for (int i = 0; i < nv; ++i) v.push_back(i * 2 + 1);
      oc.key.back().push_back(k);
      oc.value.back().push_back(v);
    }
  }
  return oc;
}
}  // namespace

TEST(Formats, VllmPresetCompressionAtHeadDim128) {
  const auto g = gqa();
  const double bf16 = static_cast<double>(bf16_token_bytes(g));
  auto ratio = [&](const char* n) { return bf16 / static_cast<double>(token_bytes(find_format(n), g).per_layer); };
  EXPECT_NEAR(ratio("tq-k8v4"), 2.61, 0.005);
  EXPECT_NEAR(ratio("tq-4bit-nc"), 3.82, 0.005);
  EXPECT_NEAR(ratio("tq-k3v4-nc"), 4.34, 0.005);
  EXPECT_NEAR(ratio("tq-3bit-nc"), 5.02, 0.005);
  // vLLM's slot sizes: 196, 134, 118, 102 bytes per token per head.
  EXPECT_EQ(token_bytes(find_format("tq-k8v4"), g).record, 196u);
  EXPECT_EQ(token_bytes(find_format("tq-4bit-nc"), g).record, 134u);
  EXPECT_EQ(token_bytes(find_format("tq-k3v4-nc"), g).record, 118u);
  EXPECT_EQ(token_bytes(find_format("tq-3bit-nc"), g).record, 102u);
  // Ours: 4-bit keys and values with one fp16 norm each.
  EXPECT_EQ(token_bytes(find_format("tq-4bit"), g).record, 132u);
  EXPECT_EQ(token_bytes(find_format("tq-3bit"), g).record, 100u);
  EXPECT_EQ(token_bytes(find_format("tq-3.5bit"), g).record, 2u * (56u + 4u));
  EXPECT_EQ(token_bytes(find_format("tq-2.5bit"), g).record, 2u * (40u + 4u));
  EXPECT_DOUBLE_EQ(token_bytes(find_format("bf16"), g).bits_per_value, 16.0);
}

TEST(Formats, MlaRecords) {
  const auto g = mla();
  EXPECT_EQ(token_bytes(find_format("c4r4"), g).record, 320u);
  EXPECT_EQ(token_bytes(find_format("c8r8"), g).record, 608u);
  EXPECT_EQ(token_bytes(find_format("c2r4"), g).record, 192u);
  EXPECT_EQ(token_bytes(find_format("c3r4"), g).record, 256u);
  EXPECT_EQ(token_bytes(find_format("c4r8"), g).record, 352u);
  EXPECT_EQ(token_bytes(find_format("bf16"), g).record, 1152u);
  EXPECT_EQ(bf16_token_bytes(g), 1152u);
  EXPECT_EQ(token_bytes(find_format("mla-tq4"), g).record, 400u);  // 256 + 2 + 128 = 386 -> 400
  // 64-token pages: 20,480 bytes for C4R4 and 73,728 for bf16, as the paper counts.
  EXPECT_EQ(64 * token_bytes(find_format("c4r4"), g).record, 20480u);
  EXPECT_EQ(64 * bf16_token_bytes(g), 73728u);
}

TEST(Formats, UnknownAndMismatchedFormats) {
  try {
    find_format("q4_0");
    FAIL();
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("q4_0"), std::string::npos);
    EXPECT_NE(m.find("tq-3bit-nc"), std::string::npos);
    EXPECT_NE(m.find("c4r4"), std::string::npos);
  }
  EXPECT_THROW(make_quantizers(find_format("c4r4"), gqa(), 0, 0), Error);
  EXPECT_THROW(make_quantizers(find_format("tq-3bit"), mla(), 0, 0), Error);
  EXPECT_THROW(make_quantizers(find_format("tq-2.5bit"), gqa(), 0, 0), Error);  // needs calibration
  EXPECT_NO_THROW(make_quantizers(find_format("bf16"), mla(), 0, 0));
  EXPECT_NO_THROW(make_quantizers(find_format("fp8"), gqa(), 0, 0));
}

// Zero vectors round-trip to exact zeros and NaN / Inf are reported, in every format and at
// head dims 64, 96, 128, 256 (96 through the block Hadamard).
TEST(Formats, ZeroVectorsAndNonFiniteEveryFormat) {
  for (const auto& f : all_formats()) {
    std::vector<CacheGeometry> geos;
    if (f.family != FormatFamily::kKV) geos.push_back(mla());
    if (f.family != FormatFamily::kMLA)
      for (int hd : {64, 96, 128, 256}) geos.push_back(gqa(hd));
    for (const auto& g : geos) {
      const auto oc = fake_outliers(g, f);
      const auto q = make_quantizers(f, g, 1, 1, &oc);
      const auto lay = record_layout(token_bytes(f, g));
      const int dk = q.key->dim(), dv = q.value->dim();
      std::vector<float> k(static_cast<std::size_t>(dk), 0.0f), v(static_cast<std::size_t>(dv), 0.0f);
      std::vector<float> k2(k.size(), 1.0f), v2(v.size(), 1.0f);
      std::vector<std::uint8_t> rec(lay.size);
      encode_token_record(q, lay, k.data(), v.data(), rec.data());
      decode_token_record(q, lay, rec.data(), k2.data(), v2.data());
      for (float x : k2) ASSERT_EQ(x, 0.0f) << f.name;
      for (float x : v2) ASSERT_EQ(x, 0.0f) << f.name;
      k[3] = NAN;
      EXPECT_THROW(encode_token_record(q, lay, k.data(), v.data(), rec.data()), Error) << f.name;
      k[3] = 0.0f;
      v[1] = -INFINITY;
      EXPECT_THROW(encode_token_record(q, lay, k.data(), v.data(), rec.data()), Error) << f.name;
    }
  }
}

// Real keys: every format reconstructs the fixture's cache rows with bounded error, and more
// bits never hurt within a family.
TEST(Formats, RealFixtureRowsRoundTrip) {
  const auto g = gqa();
  const auto keys = kvq::testing::fixture_rows("tiny-gqa", "layer2.k", 0, 128);
  const auto vals = kvq::testing::fixture_rows("tiny-gqa", "layer2.v", 0, 128);
  const std::size_t n = keys.size() / 128;
  auto err = [&](const char* name) {
    const auto& f = find_format(name);
    OutlierChannels oc;
    oc.key = {{{}}, {{}}, {{}}};
    oc.value = oc.key;
    oc.key[2][0] = select_outlier_channels(keys.data(), n, 128, split_outlier_count(f, 128));
    oc.value[2][0] = select_outlier_channels(vals.data(), n, 128, split_outlier_count(f, 128));
    const auto q = make_quantizers(f, g, 2, 0, &oc);
    const auto lay = record_layout(token_bytes(f, g));
    std::vector<std::uint8_t> rec(lay.size);
    std::vector<float> kh(keys.size()), vh(vals.size());
    for (std::size_t i = 0; i < n; ++i) {
      encode_token_record(q, lay, &keys[i * 128], &vals[i * 128], rec.data());
      decode_token_record(q, lay, rec.data(), &kh[i * 128], &vh[i * 128]);
    }
    return rel_error(kh.data(), keys.data(), keys.size()) + rel_error(vh.data(), vals.data(), vals.size());
  };
  const double e_bf16 = err("bf16"), e8 = err("fp8"), e4 = err("tq-4bit"), e35 = err("tq-3.5bit"), e3 = err("tq-3bit"),
               e25 = err("tq-2.5bit");
  EXPECT_LT(e_bf16, 0.01);
  EXPECT_LT(e8, 0.1);
  EXPECT_LT(e4, e35);
  EXPECT_LT(e35, e3);
  EXPECT_LT(e3, e25);
  EXPECT_LT(e4, 0.25);
}

TEST(Formats, NamedShapesMatchChapterBudget) {
  // kv_budget.py: Llama-3.1-8B bf16 128 KiB/token, 3-bit + fp16 norm 25 KiB (TurboQuant MSE
  // keys and values at 3 bits = our tq-3bit).
  const auto& s = named_shapes();
  ASSERT_GE(s.size(), 3u);
  const auto& l8 = s[0].geometry;
  EXPECT_EQ(bf16_token_bytes(l8) * static_cast<std::size_t>(l8.n_layers), 128u * 1024u);
  EXPECT_EQ(token_bytes(find_format("tq-3bit"), l8).per_layer * static_cast<std::size_t>(l8.n_layers), 25u * 1024u);
  EXPECT_EQ(token_bytes(find_format("tq-4bit"), l8).per_layer * static_cast<std::size_t>(l8.n_layers), 33u * 1024u);
}

TEST(Formats, PageLayouts) {
  const auto c4 = page_layout(find_format("c4r4"), mla());
  EXPECT_EQ(c4.page_bytes, 20480u);
  EXPECT_EQ(c4.key_code_off, 0u);
  EXPECT_EQ(c4.value_code_off, 64u * 256u);
  EXPECT_EQ(c4.meta_off, 64u * 288u);
  EXPECT_EQ(c4.meta_bytes, 32u);
  EXPECT_EQ(c4.value_meta(0, 5) - c4.key_meta(0, 5), 24u);
  EXPECT_EQ(page_layout(find_format("bf16"), mla()).page_bytes, 73728u);
  const auto t3 = page_layout(find_format("tq-3bit-nc"), gqa());
  EXPECT_EQ(t3.page_bytes, 64u * 2u * 102u);
  EXPECT_EQ(t3.key_code(1, 3), (64u + 3u) * 48u);
  EXPECT_EQ(t3.value_code_off % 16, 0u);
  EXPECT_EQ(t3.meta_off % 16, 0u);
  for (const auto& f : all_formats()) {
    for (const auto& g : {gqa(), mla()}) {
      if ((f.family == FormatFamily::kMLA && !g.mla) || (f.family == FormatFamily::kKV && g.mla)) continue;
      const auto p = page_layout(f, g);
      const auto tb = token_bytes(f, g);
      EXPECT_EQ(p.page_bytes, align_up(64 * tb.per_layer, 16)) << f.name;
    }
  }
}
