// MoE routing (kvq::moe_route) against a brute-force reference that enumerates every group
// subset and every expert subset and keeps the one that is a valid top-k (nothing excluded beats
// anything chosen). Covers greedy, group_limited_greedy (group score = max), noaux_tc (group score
// = best pair, chosen by score + e_score_correction_bias, weighted by the plain score), softmax
// and sigmoid scoring, norm_topk_prob and routed_scaling_factor.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "kvq/model.hpp"

namespace kvq {
namespace {

// All k-subsets of [0, n) as index lists.
void subsets(int n, int k, int start, std::vector<int>& cur, std::vector<std::vector<int>>& out) {
  if (static_cast<int>(cur.size()) == k) {
    out.push_back(cur);
    return;
  }
  for (int i = start; i < n; ++i) {
    cur.push_back(i);
    subsets(n, k, i + 1, cur, out);
    cur.pop_back();
  }
}

// Picks the subset of `items` of size k whose every member scores >= every non-member.
std::vector<int> brute_topk(const std::vector<int>& items, const std::vector<double>& score, int k) {
  std::vector<std::vector<int>> all;
  std::vector<int> cur;
  subsets(static_cast<int>(items.size()), k, 0, cur, all);
  for (const auto& s : all) {
    double lo = INFINITY, hi = -INFINITY;
    std::vector<char> in(items.size(), 0);
    for (int i : s) in[i] = 1;
    for (std::size_t i = 0; i < items.size(); ++i) {
      if (in[i]) lo = std::min(lo, score[items[i]]);
      else hi = std::max(hi, score[items[i]]);
    }
    if (lo >= hi) {
      std::vector<int> r;
      for (int i : s) r.push_back(items[i]);
      return r;
    }
  }
  ADD_FAILURE() << "no valid top-k";
  return {};
}

void brute_route(const MoeConfig& m, const std::vector<float>& logits, const std::vector<float>& bias,
                 std::vector<int>& idx, std::vector<double>& w) {
  const int E = m.n_routed_experts;
  std::vector<double> score(E), choice(E);
  if (m.scoring == MoeScoring::kSoftmax) {
    double z = 0.0;
    for (int e = 0; e < E; ++e) z += std::exp(static_cast<double>(logits[e]));
    for (int e = 0; e < E; ++e) score[e] = std::exp(static_cast<double>(logits[e])) / z;
  } else {
    for (int e = 0; e < E; ++e) score[e] = 1.0 / (1.0 + std::exp(-static_cast<double>(logits[e])));
  }
  for (int e = 0; e < E; ++e) choice[e] = score[e] + (m.topk_method == TopkMethod::kNoauxTc ? bias[e] : 0.0);
  std::vector<int> allowed;
  if (m.topk_method == TopkMethod::kGreedy || m.n_group == 1) {
    for (int e = 0; e < E; ++e) allowed.push_back(e);
  } else {
    const int G = m.n_group, per = E / G;
    std::vector<double> gs(G, -INFINITY);
    for (int g = 0; g < G; ++g) {
      for (int i = 0; i < per; ++i) {
        if (m.topk_method == TopkMethod::kGroupLimitedGreedy) gs[g] = std::max(gs[g], choice[g * per + i]);
        else
          for (int j = i + 1; j < per; ++j) gs[g] = std::max(gs[g], choice[g * per + i] + choice[g * per + j]);
      }
    }
    std::vector<int> groups(G);
    for (int g = 0; g < G; ++g) groups[g] = g;
    for (int g : brute_topk(groups, gs, m.topk_group))
      for (int i = 0; i < per; ++i) allowed.push_back(g * per + i);
  }
  idx = brute_topk(allowed, choice, m.top_k);
  std::sort(idx.begin(), idx.end());
  w.clear();
  double sum = 0.0;
  for (int e : idx) {
    w.push_back(score[e]);
    sum += score[e];
  }
  for (auto& x : w) {
    if (m.norm_topk_prob) x /= sum;
    x *= m.routed_scaling_factor;
  }
}

struct Variant {
  const char* name;
  MoeConfig m;
};

MoeConfig make(int E, int K, int G, int TG, TopkMethod method, MoeScoring sc, bool norm, float scale) {
  MoeConfig m;
  m.n_routed_experts = E;
  m.top_k = K;
  m.n_group = G;
  m.topk_group = TG;
  m.topk_method = method;
  m.scoring = sc;
  m.norm_topk_prob = norm;
  m.routed_scaling_factor = scale;
  m.correction_bias = method == TopkMethod::kNoauxTc;
  return m;
}

TEST(MoeRouting, EqualsBruteForce) {
  const Variant variants[] = {
      {"greedy softmax (DeepSeek-V2-Lite)", make(8, 2, 1, 1, TopkMethod::kGreedy, MoeScoring::kSoftmax, false, 1.0f)},
      {"greedy softmax, normalized, scaled", make(12, 3, 1, 1, TopkMethod::kGreedy, MoeScoring::kSoftmax, true, 2.0f)},
      {"group_limited_greedy softmax", make(16, 4, 4, 2, TopkMethod::kGroupLimitedGreedy, MoeScoring::kSoftmax, false, 16.0f)},
      {"group_limited_greedy softmax, 8 groups", make(16, 3, 8, 3, TopkMethod::kGroupLimitedGreedy, MoeScoring::kSoftmax, true, 1.0f)},
      {"noaux_tc sigmoid + bias (DeepSeek-V3)", make(16, 4, 4, 2, TopkMethod::kNoauxTc, MoeScoring::kSigmoid, true, 2.5f)},
      {"noaux_tc sigmoid + bias, one group", make(8, 2, 1, 1, TopkMethod::kNoauxTc, MoeScoring::kSigmoid, true, 1.0f)},
      {"noaux_tc sigmoid + bias, unnormalized", make(12, 3, 3, 2, TopkMethod::kNoauxTc, MoeScoring::kSigmoid, false, 1.5f)},
  };
  std::mt19937 rng(1234);
  std::normal_distribution<float> nd(0.0f, 1.5f);
  std::uniform_real_distribution<float> ud(-0.3f, 0.3f);
  int checked = 0;
  for (const auto& v : variants) {
    const int E = v.m.n_routed_experts, K = v.m.top_k;
    for (int trial = 0; trial < 300; ++trial) {
      std::vector<float> logits(E), bias(E);
      for (auto& x : logits) x = nd(rng);
      for (auto& x : bias) x = ud(rng);
      std::vector<int> idx(K);
      std::vector<float> w(K);
      moe_route(v.m, logits.data(), bias.data(), idx.data(), w.data());
      std::vector<int> ref_idx;
      std::vector<double> ref_w;
      brute_route(v.m, logits, bias, ref_idx, ref_w);
      std::vector<std::pair<int, float>> got;
      for (int k = 0; k < K; ++k) got.push_back({idx[k], w[k]});
      std::sort(got.begin(), got.end());
      ASSERT_EQ(static_cast<int>(ref_idx.size()), K) << v.name;
      for (int k = 0; k < K; ++k) {
        ASSERT_EQ(got[k].first, ref_idx[k]) << v.name << " trial " << trial;
        ASSERT_NEAR(got[k].second, ref_w[k], 1e-5 * std::max(1.0, std::fabs(ref_w[k]))) << v.name << " trial " << trial;
      }
      ++checked;
    }
  }
  EXPECT_EQ(checked, 7 * 300);
}

// Group limiting must change the answer sometimes, or the variants above test nothing extra.
TEST(MoeRouting, GroupLimitChangesSelections) {
  MoeConfig g = make(16, 4, 4, 1, TopkMethod::kGroupLimitedGreedy, MoeScoring::kSoftmax, false, 1.0f);
  MoeConfig f = g;
  f.topk_method = TopkMethod::kGreedy;
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  int differ = 0;
  for (int t = 0; t < 100; ++t) {
    std::vector<float> logits(16);
    for (auto& x : logits) x = nd(rng);
    std::vector<int> a(4), b(4);
    std::vector<float> wa(4), wb(4);
    moe_route(g, logits.data(), nullptr, a.data(), wa.data());
    moe_route(f, logits.data(), nullptr, b.data(), wb.data());
    std::sort(a.begin(), a.end());
    std::sort(b.begin(), b.end());
    differ += a != b;
  }
  EXPECT_GT(differ, 50);
}

}  // namespace
}  // namespace kvq
