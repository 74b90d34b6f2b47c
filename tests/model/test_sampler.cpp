// Sampler: greedy is the argmax (lowest id on ties); temperature sampling follows the softmax
// (checked by frequency), is reproducible from the seed, and top-p keeps only the nucleus.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "kvq/common.hpp"
#include "kvq/sampler.hpp"

namespace kvq {
namespace {

TEST(Sampler, GreedyIsArgmax) {
  Sampler s({});
  const float l[] = {0.5f, 2.0f, -1.0f, 2.0f};
  EXPECT_EQ(s.sample(l, 4), 1);
  const float m[] = {-3.0f, -2.0f, -2.5f};
  EXPECT_EQ(s.sample(m, 3), 1);
}

TEST(Sampler, TemperatureFollowsSoftmaxAndSeed) {
  const float l[] = {0.0f, std::log(2.0f), std::log(3.0f), -30.0f};  // p = 1/6, 2/6, 3/6, ~0
  Sampler a({1.0f, 1.0f, 42}), b({1.0f, 1.0f, 42}), c({1.0f, 1.0f, 43});
  std::vector<int> count(4, 0);
  int same_b = 0, same_c = 0;
  const int n = 60000;
  for (int i = 0; i < n; ++i) {
    const int x = a.sample(l, 4);
    ++count[x];
    same_b += x == b.sample(l, 4);
    same_c += x == c.sample(l, 4);
  }
  EXPECT_EQ(same_b, n);
  EXPECT_LT(same_c, n * 0.6);
  for (int k = 0; k < 3; ++k) EXPECT_NEAR(count[k] / double(n), (k + 1) / 6.0, 0.01) << k;
  EXPECT_EQ(count[3], 0);
}

TEST(Sampler, TopPKeepsTheNucleus) {
  const float l[] = {std::log(0.5f), std::log(0.3f), std::log(0.15f), std::log(0.05f)};
  Sampler s({1.0f, 0.75f, 7});
  std::vector<int> count(4, 0);
  for (int i = 0; i < 20000; ++i) ++count[s.sample(l, 4)];
  EXPECT_EQ(count[2] + count[3], 0);  // 0.5 + 0.3 >= 0.75: two tokens kept
  EXPECT_NEAR(count[0] / 20000.0, 0.5 / 0.8, 0.02);
  EXPECT_THROW(Sampler({1.0f, 0.0f, 0}), Error);
  EXPECT_THROW(Sampler({-1.0f, 1.0f, 0}), Error);
}

}  // namespace
}  // namespace kvq
