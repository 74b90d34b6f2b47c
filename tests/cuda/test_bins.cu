// test_bins.cu: the store's bucketization without a search (src/cuda/bins.cuh) against the CPU's
// kvq::bucketize (the number of edges strictly below y) on the values where a table lookup can go
// wrong: every edge itself and its float neighbours, +-0, subnormals, the saturation range, and
// random values. Both lookups are checked: the (midpoint, base) pairs of the GQA store and the byte
// table of the outlier splits and the mla-tq writer. Codebooks: the sphere codebooks of head_dim 128
// at 1-4 bits, raw and prescaled by 1 / sqrt(128) as the store uses them, and synthetic ones with a
// -0 or +0 midpoint (the sign test of plus_below needs the tables to hold no -0).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "bins.cuh"
#include "harness.hpp"
#include "kvq/codebook.hpp"
#include "kvq/quantizers.hpp"

namespace kc = kvq::cuda::detail;

namespace {

// One warp: builds table 0 from the edges (and centroids), then buckets every y both ways; -1 where
// the table does not work (ok = 0, the kernels' binary-search fallback).
__global__ void bucket_kernel(const float* edges, const float* cents, int bits, const float* ys, int n, int* by_pairs,
                              int* by_bytes, int* ok) {
  __shared__ kc::StoreTables T;
  __shared__ uint2 pairs[kc::kMaxBins];
  const int lane = threadIdx.x;
  kc::build_store_table(T, 0, edges, cents, bits, lane);
  kc::build_bin_pairs(T, 0, pairs, lane);
  __syncwarp();
  if (lane == 0) *ok = T.ok[0];
  for (int i = lane; i < n; i += 32) {
    if (!T.ok[0]) {
      by_pairs[i] = by_bytes[i] = -1;
      continue;
    }
    by_pairs[i] = kc::bin_pair_lookup(T.pair_base[0], T.ba[0], T.bb[0], T.bn[0], ys[i]);
    by_bytes[i] = kc::bin_lookup(T.base[0], T.edges[0], T.ba[0], T.bb[0], T.bn[0], ys[i]);
  }
}

void run_case(const std::string& name, std::vector<float> edges, int bits, std::mt19937& rng) {
  const int ne = (1 << bits) - 1;
  std::vector<float> cents(16, 0.0f);
  for (int i = 0; i < (1 << bits); ++i) cents[static_cast<std::size_t>(i)] = static_cast<float>(i);  // not used by the buckets
  edges.resize(16, INFINITY);
  // The values: each edge and two float steps either side, +-0, the subnormal and normal extremes, values
  // beyond the table's range (the saturating FMA), and random values over and around the edges.
  std::vector<float> ys = {0.0f, -0.0f, 1e-45f, -1e-45f, 1e-40f, -1e-40f, 1.17549435e-38f, -1.17549435e-38f,
                           1.0f, -1.0f, 11.5f, -11.5f, 1e30f, -1e30f, 3.4e38f, -3.4e38f};
  for (int i = 0; i < ne; ++i) {
    float e = edges[static_cast<std::size_t>(i)];
    ys.push_back(e);
    float up = e, dn = e;
    for (int k = 0; k < 2; ++k) {
      up = std::nextafter(up, INFINITY);
      dn = std::nextafter(dn, -INFINITY);
      ys.push_back(up);
      ys.push_back(dn);
    }
  }
  float lo = edges[0], hi = edges[static_cast<std::size_t>(ne - 1)];
  const float span = std::max(hi - lo, 1e-3f);
  std::uniform_real_distribution<float> u(lo - span, hi + span);
  std::uniform_int_distribution<int> pick(0, ne - 1);
  std::uniform_int_distribution<int> step(-3, 3);
  for (int i = 0; i < 20000; ++i) ys.push_back(u(rng));
  for (int i = 0; i < 4000; ++i) {  // within a few float steps of an edge
    float y = edges[static_cast<std::size_t>(pick(rng))];
    const int s = step(rng);
    for (int k = 0; k < (s < 0 ? -s : s); ++k) y = std::nextafter(y, s < 0 ? -INFINITY : INFINITY);
    ys.push_back(y);
  }
  const int n = static_cast<int>(ys.size());
  using kvq::cudatest::download;
  using kvq::cudatest::upload;
  float* d_edges = upload(edges);
  float* d_cents = upload(cents);
  float* d_ys = upload(ys);
  int* d_out = upload(std::vector<int>(2 * ys.size() + 1, 0));  // pairs, byte table, ok
  bucket_kernel<<<1, 32>>>(d_edges, d_cents, bits, d_ys, n, d_out, d_out + n, d_out + 2 * n);
  KVQ_CUDA_OK(cudaGetLastError());
  const std::vector<int> out = download(d_out, 2 * ys.size() + 1);
  cudaFree(d_edges);
  cudaFree(d_cents);
  cudaFree(d_ys);
  cudaFree(d_out);
  const int* by_pairs = out.data();
  const int* by_bytes = out.data() + n;
  const int ok = out[2 * ys.size()];
  if (!kvq::cudatest::check(ok == 1, name + ": the bin table works for this codebook")) return;
  int wrong_pairs = 0, wrong_bytes = 0;
  for (int i = 0; i < n; ++i) {
    const float y = ys[static_cast<std::size_t>(i)];
    const int want = kvq::bucketize(edges.data(), ne, y);
    const bool bp = by_pairs[i] != want, bb = by_bytes[i] != want;
    if ((bp || bb) && wrong_pairs + wrong_bytes < 4) {
      std::uint32_t bits_y = 0;
      std::memcpy(&bits_y, &y, sizeof bits_y);
      std::printf("  %s: y = %.9g (bits %08x): pairs %d, bytes %d, CPU %d\n", name.c_str(), static_cast<double>(y),
                  static_cast<unsigned>(bits_y), by_pairs[i], by_bytes[i], want);
    }
    wrong_pairs += bp;
    wrong_bytes += bb;
  }
  std::printf("  %-44s %6d values: %d / %d differ (pairs / byte table)\n", name.c_str(), n, wrong_pairs, wrong_bytes);
  kvq::cudatest::check(wrong_pairs == 0, name + ": (midpoint, base) pairs equal the CPU's buckets");
  kvq::cudatest::check(wrong_bytes == 0, name + ": byte table equals the CPU's buckets");
}

}  // namespace

int main() {
  if (!kvq::cudatest::gpu_present()) return 0;
  std::mt19937 rng(20261201);
  const float scale = 1.0f / std::sqrt(128.0f);
  for (int bits = 1; bits <= 4; ++bits) {
    const kvq::Codebook& cb = kvq::sphere_codebook(128, bits);
    run_case("sphere d128 b" + std::to_string(bits) + " midpoints", cb.edges_f, bits, rng);
    std::vector<float> pre;
    for (float e : cb.edges_f) pre.push_back(kvq::prescale_threshold(e, scale));
    run_case("sphere d128 b" + std::to_string(bits) + " prescaled thresholds", pre, bits, rng);
  }
  run_case("synthetic, a -0 midpoint", {-0.5f, -0.0f, 0.25f}, 2, rng);
  run_case("synthetic, a +0 midpoint", {-0.25f, 0.0f, 0.125f}, 2, rng);
  return kvq::cudatest::finish();
}
