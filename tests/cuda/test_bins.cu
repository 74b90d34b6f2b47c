// test_bins.cu: the store's bucketization without a search (src/cuda/bins.cuh) against the CPU's
// kvq::bucketize (the number of edges strictly below y) on the values where a table lookup can go
// wrong: every edge itself and its float neighbours, +-0, subnormals, the saturation range, and
// random values. Both lookups are checked: the (midpoint, base) pairs of the GQA store (16 copies per
// bin, each lane reading its own, and one copy per bin) and the byte table of the mla-tq writer.
// Codebooks: the sphere codebooks of head_dim 128 at 1-4 bits, raw and prescaled by 1 / sqrt(128) as
// the store uses them, and synthetic ones with a -0 or +0 midpoint (the sign test of plus_below needs
// the tables to hold no -0).
// Also the norm sums of bins.cuh against kvq::sum_squares (include/kvq/numeric.hpp), bit for bit:
// warp_sum_squares at lengths 1..1024 (partial blocks and chains, block counts that are not powers
// of two), lanes_sum_squares over 1, 2, 4 and 8 lanes and on 64 elements over 1, 2 and 4, lane_halves_tree
// (the paired store's blocks after its half exchange) over 2 and 4, on rows whose elements span 2^-80 .. 2^60
// (subnormal and overflowing squares included) and zero rows, and corrected_norm against the CPU's
// norm / sqrt(c2). A sequential float sum differs from kvq::sum_squares on many of these rows, so a
// kernel that added in another order would fail.
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
#include "kvq/numeric.hpp"
#include "kvq/quantizers.hpp"

namespace kc = kvq::cuda::detail;

namespace {

// One warp: builds table 0 from the edges (and centroids), its (midpoint, base) pairs in `cap` entries
// (16 copies per bin where they fit, as in the store; each lane reads its own copy), then buckets every
// y both ways; -1 where the table does not work (ok = 0, the kernels' binary-search fallback). info[0]:
// ok, info[1]: the pairs' row stride in bytes.
__global__ void bucket_kernel(const float* edges, const float* cents, int bits, const float* ys, int n, int cap, int* by_pairs,
                              int* by_bytes, int* info) {
  __shared__ kc::StoreTables T;
  __shared__ uint2 pairs[2 * kc::kMaxBins];
  const int lane = threadIdx.x;
  kc::build_store_table(T, 0, edges, cents, bits, lane);
  kc::build_bin_pairs(T, 0, pairs, cap, lane);
  __syncwarp();
  if (lane == 0) {
    info[0] = T.ok[0];
    info[1] = static_cast<int>(T.pair_stride[0]);
  }
  const std::uint32_t pbase = kc::pair_lane_base(T, 0, lane);
  for (int i = lane; i < n; i += 32) {
    if (!T.ok[0]) {
      by_pairs[i] = by_bytes[i] = -1;
      continue;
    }
    by_pairs[i] = kc::bin_pair_lookup(pbase, T.pair_stride[0], T.ba[0], T.bb[0], T.bn[0], ys[i]);
    by_bytes[i] = kc::bin_lookup(T.base[0], T.edges[0], T.ba[0], T.bb[0], T.bn[0], ys[i]);
  }
}

// One warp per row: warp_sum_squares over rows[r] (n floats at rows + 1024 r) into out[32 r + lane].
__global__ void warp_sumsq_kernel(const float* rows, int n, float* out) {
  const float* x = rows + 1024 * blockIdx.x;
  out[32 * blockIdx.x + threadIdx.x] = kc::warp_sum_squares(n, threadIdx.x, [&](int b, int k) { return x[32 * b + k]; });
}
// One warp, 32 / PS vectors of E PS floats (E = 32 or 64 per lane); lane l holds elements E (l % PS) ..
// + E - 1 of vector l / PS. out[lane] = lanes_sum_squares<PS> (E = 32: the store's fast kernel, 64: its
// paired kernel); cn[lane] = corrected_norm(sqrt(out), c2[lane]).
template <int PS, int E>
__global__ void lanes_sumsq_kernel(const float* x, const float* c2, float* out, float* cn) {
  const int lane = threadIdx.x;
  float v[E];
#pragma unroll
  for (int k = 0; k < E; ++k) v[k] = x[E * lane + k];
  const float ss = kc::lanes_sum_squares<PS>(v);
  out[lane] = ss;
  cn[lane] = kc::corrected_norm(__fsqrt_rn(ss), c2[lane]);
}

// The paired store's layout after its half exchange (tq_rotate's kHalves): lane l (ls = l % PS) holds blocks
// q1 = 4 (ls >> 1) + (ls & 1) and q1 + 2 of vector l / PS (64 PS floats), four FMA chains each; out[lane] =
// lane_halves_tree<PS>, cn[lane] as in lanes_sumsq_kernel.
template <int PS>
__global__ void halves_sumsq_kernel(const float* x, const float* c2, float* out, float* cn) {
  const int lane = threadIdx.x, ls = lane % PS, q1 = kc::halves_first_block(ls);
  const float* v = x + 64 * PS * (lane / PS);
  float s[8] = {};
  for (int h = 0; h < 2; ++h)
    for (int k = 0; k < 32; ++k) {
      const float a = v[32 * (q1 + 2 * h) + k];
      s[4 * h + (k & 3)] = __fmaf_rn(a, a, s[4 * h + (k & 3)]);
    }
  const float ss = kc::lane_halves_tree<PS>(s);
  out[lane] = ss;
  cn[lane] = kc::corrected_norm(__fsqrt_rn(ss), c2[lane]);
}

// expect_copies: the sphere codebooks' tables must get 16 copies per bin in the store's 512 entries (the
// conflict-free layout is what the store is tuned for; a table grown past 32 bins would silently lose it).
void run_case(const std::string& name, std::vector<float> edges, int bits, std::mt19937& rng, bool expect_copies = false) {
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
  // Pair capacities: the store's 512 entries (16 copies per bin up to 32 bins), and 256, with which tables of
  // more than 16 bins (the 4-bit codebooks) keep one copy per bin: both layouts are checked.
  for (const int cap : {2 * kc::kMaxBins, kc::kMaxBins}) {
    int* d_out = upload(std::vector<int>(2 * ys.size() + 2, 0));  // pairs, byte table, ok, stride
    bucket_kernel<<<1, 32>>>(d_edges, d_cents, bits, d_ys, n, cap, d_out, d_out + n, d_out + 2 * n);
    KVQ_CUDA_OK(cudaGetLastError());
    const std::vector<int> out = download(d_out, 2 * ys.size() + 2);
    cudaFree(d_out);
    const int* by_pairs = out.data();
    const int* by_bytes = out.data() + n;
    const int ok = out[2 * ys.size()], stride = out[2 * ys.size() + 1];
    const std::string label = name + (stride == 8 ? " [1 copy]" : " [16 copies]");
    if (!kvq::cudatest::check(ok == 1, name + ": the bin table works for this codebook")) break;
    kvq::cudatest::check(stride == 8 || stride == 8 * kc::kPairCopies, label + ": pair row stride 8 or 128 bytes");
    if (expect_copies && cap == 2 * kc::kMaxBins)
      kvq::cudatest::check(stride == 8 * kc::kPairCopies, label + ": 16 copies per bin in the store's capacity");
    int wrong_pairs = 0, wrong_bytes = 0;
    for (int i = 0; i < n; ++i) {
      const float y = ys[static_cast<std::size_t>(i)];
      const int want = kvq::bucketize(edges.data(), ne, y);
      const bool bp = by_pairs[i] != want, bb = by_bytes[i] != want;
      if ((bp || bb) && wrong_pairs + wrong_bytes < 4) {
        std::uint32_t bits_y = 0;
        std::memcpy(&bits_y, &y, sizeof bits_y);
        std::printf("  %s: y = %.9g (bits %08x): pairs %d, bytes %d, CPU %d\n", label.c_str(), static_cast<double>(y),
                    static_cast<unsigned>(bits_y), by_pairs[i], by_bytes[i], want);
      }
      wrong_pairs += bp;
      wrong_bytes += bb;
    }
    std::printf("  %-56s %6d values: %d / %d differ (pairs / byte table)\n", label.c_str(), n, wrong_pairs, wrong_bytes);
    kvq::cudatest::check(wrong_pairs == 0, label + ": (midpoint, base) pairs equal the CPU's buckets");
    kvq::cudatest::check(wrong_bytes == 0, label + ": byte table equals the CPU's buckets");
  }
  cudaFree(d_edges);
  cudaFree(d_cents);
  cudaFree(d_ys);
}


// Gaussian values times 2^e with e uniform in [lo, hi] per element.
std::vector<float> wide_row(int n, int lo, int hi, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_int_distribution<int> ex(lo, hi);
  std::vector<float> r(static_cast<std::size_t>(n));
  for (float& v : r) v = std::ldexp(nd(rng), ex(rng));
  return r;
}
float sequential_sum(const std::vector<float>& x, int n) {
  float s = 0.0f;
  for (int i = 0; i < n; ++i) s = std::fma(x[static_cast<std::size_t>(i)], x[static_cast<std::size_t>(i)], s);
  return s;
}

void sum_squares_cases(std::mt19937& rng) {
  using kvq::cudatest::check;
  using kvq::cudatest::download;
  using kvq::cudatest::upload;
  const int kRows = 48;
  int order_matters = 0, wrong = 0, cases = 0;
  for (int n : {1, 2, 3, 5, 31, 32, 33, 36, 64, 96, 100, 128, 192, 255, 256, 320, 512, 576, 1000, 1024}) {
    std::vector<float> rows(static_cast<std::size_t>(1024 * kRows), 0.0f);
    std::vector<std::vector<float>> host;
    for (int r = 0; r < kRows; ++r) {
      // Row kinds: moderate range, wide range, tiny (subnormal squares), huge (squares overflow), zero.
      std::vector<float> x = r % 8 == 7 ? std::vector<float>(static_cast<std::size_t>(n), 0.0f)
                             : r % 8 == 6 ? wide_row(n, 55, 66, rng)
                             : r % 8 == 5 ? wide_row(n, -80, -60, rng)
                             : r % 8 >= 3 ? wide_row(n, -40, 20, rng)
                                          : wide_row(n, -3, 3, rng);
      std::copy(x.begin(), x.end(), rows.begin() + 1024 * r);
      host.push_back(std::move(x));
    }
    float* d_rows = upload(rows);
    float* d_out = upload(std::vector<float>(static_cast<std::size_t>(32 * kRows), -1.0f));
    warp_sumsq_kernel<<<kRows, 32>>>(d_rows, n, d_out);
    KVQ_CUDA_OK(cudaGetLastError());
    const std::vector<float> out = download(d_out, static_cast<std::size_t>(32 * kRows));
    cudaFree(d_rows);
    cudaFree(d_out);
    for (int r = 0; r < kRows; ++r) {
      const float want = kvq::sum_squares(host[static_cast<std::size_t>(r)].data(), n);
      order_matters += kvq::f32_bits(sequential_sum(host[static_cast<std::size_t>(r)], n)) != kvq::f32_bits(want);
      for (int l = 0; l < 32; ++l) {
        ++cases;
        const float got = out[static_cast<std::size_t>(32 * r + l)];
        if (kvq::f32_bits(got) != kvq::f32_bits(want)) {
          if (wrong < 4) std::printf("  warp_sum_squares n %d row %d lane %d: %.9g, CPU %.9g\n", n, r, l, static_cast<double>(got), static_cast<double>(want));
          ++wrong;
        }
      }
    }
  }
  std::printf("  warp_sum_squares: %d lane results, %d differ from kvq::sum_squares (a sequential sum differs on %d rows)\n",
              cases, wrong, order_matters);
  check(wrong == 0, "warp_sum_squares equals kvq::sum_squares bit for bit");
  check(order_matters > 100, "the rows tell the summation orders apart");
}

template <int PS, int E = 32, bool kHalves = false>
void lanes_case(std::mt19937& rng) {
  static_assert(!kHalves || (E == 64 && PS >= 2), "the half-exchange layout: 64 per lane, lane pairs");
  using kvq::cudatest::check;
  using kvq::cudatest::download;
  using kvq::cudatest::upload;
  int wrong = 0, wrong_cn = 0, cases = 0;
  for (int rep = 0; rep < 64; ++rep) {
    std::vector<float> x(32 * E), c2(32);
    for (int g = 0; g < 32 / PS; ++g) {
      const int kind = (rep + g) % 6;
      const std::vector<float> v = kind == 5 ? std::vector<float>(static_cast<std::size_t>(E * PS), 0.0f)
                                   : kind == 4 ? wide_row(E * PS, -80, -60, rng)
                                   : kind == 3 ? wide_row(E * PS, -40, 20, rng)
                                               : wide_row(E * PS, -3, 3, rng);
      std::copy(v.begin(), v.end(), x.begin() + E * PS * g);
    }
    std::uniform_real_distribution<float> uc(0.5f, 2.0f);
    for (float& c : c2) c = uc(rng);
    float* d_x = upload(x);
    float* d_c2 = upload(c2);
    float* d_out = upload(std::vector<float>(64, -1.0f));
    if constexpr (kHalves) halves_sumsq_kernel<PS><<<1, 32>>>(d_x, d_c2, d_out, d_out + 32);
    else lanes_sumsq_kernel<PS, E><<<1, 32>>>(d_x, d_c2, d_out, d_out + 32);
    KVQ_CUDA_OK(cudaGetLastError());
    const std::vector<float> out = download(d_out, 64);
    cudaFree(d_x);
    cudaFree(d_c2);
    cudaFree(d_out);
    for (int l = 0; l < 32; ++l) {
      ++cases;
      const int g = l / PS;
      const float want = kvq::sum_squares(x.data() + E * PS * g, E * PS);
      const float norm = std::sqrt(want);
      const float want_cn = norm > 0 ? norm / std::sqrt(c2[static_cast<std::size_t>(l)]) : norm;
      wrong += kvq::f32_bits(out[static_cast<std::size_t>(l)]) != kvq::f32_bits(want);
      wrong_cn += kvq::f32_bits(out[static_cast<std::size_t>(32 + l)]) != kvq::f32_bits(want_cn);
    }
  }
  const std::string name = kHalves ? "lane_halves_tree<" + std::to_string(PS) + ">"
                                   : "lanes_sum_squares<" + std::to_string(PS) + ", " + std::to_string(E) + ">";
  std::printf("  %-44s %d lane results: %d differ, corrected_norm %d differ\n", name.c_str(), cases, wrong, wrong_cn);
  check(wrong == 0, name + " equals kvq::sum_squares bit for bit");
  check(wrong_cn == 0, name + ": corrected_norm equals norm / sqrt(c2) on the CPU");
}

}  // namespace

int main() {
  if (!kvq::cudatest::gpu_present()) return 0;
  std::mt19937 rng(20261201);
  const float scale = 1.0f / std::sqrt(128.0f);
  for (int bits = 1; bits <= 4; ++bits) {
    const kvq::Codebook& cb = kvq::sphere_codebook(128, bits);
    run_case("sphere d128 b" + std::to_string(bits) + " midpoints", cb.edges_f, bits, rng, true);
    std::vector<float> pre;
    for (float e : cb.edges_f) pre.push_back(kvq::prescale_threshold(e, scale));
    run_case("sphere d128 b" + std::to_string(bits) + " prescaled thresholds", pre, bits, rng, true);
  }
  run_case("synthetic, a -0 midpoint", {-0.5f, -0.0f, 0.25f}, 2, rng);
  run_case("synthetic, a +0 midpoint", {-0.25f, 0.0f, 0.125f}, 2, rng);
  sum_squares_cases(rng);
  lanes_case<1>(rng);
  lanes_case<2>(rng);
  lanes_case<4>(rng);
  lanes_case<8>(rng);
  lanes_case<1, 64>(rng);
  lanes_case<2, 64>(rng);
  lanes_case<4, 64>(rng);
  lanes_case<2, 64, true>(rng);
  lanes_case<4, 64, true>(rng);
  return kvq::cudatest::finish();
}
