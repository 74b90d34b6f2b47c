// SIMD batch paths against the scalar references: the records must be byte-identical and the
// decoded vectors bit-identical (same operations in the same order, no contraction), on random
// vectors and on the fixture cache dumps. Skips the comparison where the CPU lacks AVX2.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <vector>

#include "kvq/quantizers.hpp"
#include "kvq/rng.hpp"
#include "../../src/quant/simd.hpp"
#include "test_util.hpp"

using namespace kvq;

namespace {
void compare(const VectorQuantizer& q, const std::vector<float>& x, const char* what) {
  const std::size_t d = static_cast<std::size_t>(q.dim()), n = x.size() / d, b = q.bytes();
  std::vector<std::uint8_t> fast(n * b), ref(n * b);
  q.encode_batch(x.data(), n, fast.data());
  for (std::size_t i = 0; i < n; ++i) q.encode_record(&x[i * d], &ref[i * b]);
  // encode_record may itself dispatch to nothing but the reference; compare batch vs per-vector.
  ASSERT_EQ(0, std::memcmp(fast.data(), ref.data(), fast.size())) << q.name() << " " << what;
  std::vector<float> yf(n * d), yr(n * d);
  q.decode_batch(ref.data(), n, yf.data());
  for (std::size_t i = 0; i < n; ++i) q.decode_record(&ref[i * b], &yr[i * d]);
  ASSERT_EQ(0, std::memcmp(yf.data(), yr.data(), yf.size() * 4)) << q.name() << " " << what;
}
}  // namespace

TEST(Simd, BatchPathsEqualReference) {
  if (!simd::available()) GTEST_SKIP() << "no AVX2/FMA/F16C on this CPU (or KVQ_NO_SIMD set): nothing to compare";
  const auto real_k = kvq::testing::fixture_rows("tiny-gqa", "layer0.k", 0, 128);
  const auto real_v = kvq::testing::fixture_rows("tiny-gqa", "layer3.v", 1, 128);
  const auto lat = kvq::testing::fixture_rows("tiny-mla", "layer1.latent", 0, 512);
  const auto rope = kvq::testing::fixture_rows("tiny-mla", "layer1.k_rope", 0, 64);
  for (int d : {64, 128, 256}) {
    for (int b : {2, 3, 4}) {
      for (bool signs : {false, true}) {
        TurboQuantMse q(d, b, std::make_shared<HadamardRotation>(d, signs, 5), true);
        compare(q, kvq::testing::gaussian(static_cast<std::size_t>(d) * 333, 1), "gaussian");
        if (d == 128) compare(q, real_k, "tiny-gqa keys");
        TurboQuantMse qc(d, b, std::make_shared<HadamardRotation>(d, signs, 5), true, nullptr,
                         kvq::testing::gaussian(static_cast<std::size_t>(d), 9, 0.7f));
        compare(qc, kvq::testing::gaussian(static_cast<std::size_t>(d) * 100, 4), "gaussian, centered");
      }
    }
  }
  for (int b : {3, 4}) {
    UniformAffine u(128, b);
    compare(u, kvq::testing::gaussian(128 * 333, 2), "gaussian");
    compare(u, real_v, "tiny-gqa values");
  }
  for (int b : {2, 3, 4, 8}) {
    AffineGroup c(512, b, 64, ScaleType::kBf16);
    compare(c, kvq::testing::gaussian(512 * 100, 3), "gaussian");
    compare(c, lat, "tiny-mla latent");
    AffineGroup r(64, b, 64, ScaleType::kFp32);
    compare(r, rope, "tiny-mla rope");
  }
}
