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
// of two), lanes_sum_squares over 1, 2, 4 and 8 lanes and on 64 elements over 1, 2 and 4, on rows whose elements
// span 2^-80 .. 2^60
// (subnormal and overflowing squares included) and zero rows, and corrected_norm against the CPU's
// norm / sqrt(c2). A sequential float sum differs from kvq::sum_squares on many of these rows, so a
// kernel that added in another order would fail.
// Host only, before the GPU cases (so it runs without a GPU): the outlier split's segment order
// (kvq::outlier_split_order) against the fast store kernel's staged-row layout (stage.cuh): every gather
// load of the split formats' store takes one shared-memory wavefront (head_dim 64: two).
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
#include "stage.cuh"
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

// One warp: table 0 of the codebook (edges, terms, bits); out[0 .. 15] = its terms T.sq, out[16] = T.sym. Then each
// lane adds the terms of codes[lane * n ..] (n codes) one by one in reverse order into out[17 + lane], and the
// whole warp adds row 0's codes with warp_grid_square_sum into out[49].
__global__ void grid_table_kernel(const float* edges, const float* terms, int bits, int n, const std::uint8_t* codes, float* out) {
  __shared__ kc::StoreTables T;
  const int lane = threadIdx.x;
  kc::build_store_table(T, 0, edges, terms, bits, lane);
  __syncwarp();
  if (lane < 16) out[lane] = T.sq[0][lane];
  if (lane == 0) out[16] = static_cast<float>(T.sym[0]);
  float t = 0.0f;
  for (int i = n - 1; i >= 0; --i) t = __fadd_rn(t, T.sq[0][codes[lane * n + i]]);
  out[17 + lane] = t;
  const float w = kc::warp_grid_square_sum(n, lane, [&](int i) { return T.sq[0][codes[i]]; });
  if (lane == 0) out[49] = w;
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

// The store tables' norm-correction terms (build_store_table, from the host's kvq::grid_squares) and mirror flag, for
// the sphere and Gaussian codebooks of 1-4 bits at the lengths the stores use, and the device sums of random and
// extreme codes, in two orders and by warp_grid_square_sum, equal kvq::grid_square_sum (the CPU's value).
void grid_cases(std::mt19937& rng) {
  using kvq::cudatest::check;
  using kvq::cudatest::download;
  using kvq::cudatest::upload;
  for (int bits = 1; bits <= 4; ++bits)
    for (int n : {32, 64, 128, 256, 512}) {
      for (int g = 0; g < 2; ++g) {
        const kvq::Codebook& cb = g ? kvq::gaussian_codebook(n, bits) : kvq::sphere_codebook(n, bits);
        const std::vector<float> want = kvq::grid_squares(cb.centroids_f, n);
        std::vector<std::uint8_t> codes(static_cast<std::size_t>(32 * n));
        for (std::size_t i = 0; i < codes.size(); ++i)  // lanes 0..15 uniform codes, 16..31 the extremes
          codes[i] = static_cast<std::uint8_t>(i < codes.size() / 2 ? rng() % want.size() : (rng() % 2 ? 0 : want.size() - 1));
        float* d_e = upload(cb.edges_f);
        float* d_c = upload(want);
        std::uint8_t* d_codes = upload(codes);
        float* d_out = upload(std::vector<float>(50, -1.0f));
        grid_table_kernel<<<1, 32>>>(d_e, d_c, bits, n, d_codes, d_out);
        const std::vector<float> out = download(d_out, 50);
        const std::string name = (g ? "gaussian" : "sphere") + std::string(" b") + std::to_string(bits) + " n" + std::to_string(n);
        bool same = true, sym = true;
        for (std::size_t i = 0; i < 16; ++i) {
          const float w = i < want.size() ? want[i] : 0.0f;
          same = same && kvq::f32_bits(out[i]) == kvq::f32_bits(w);
          if (i < want.size()) sym = sym && want[i] == want[want.size() - 1 - i];
        }
        check(same, "table terms equal kvq::grid_squares: " + name);
        check(out[16] == (sym ? 1.0f : 0.0f), "sym flag: " + name);
        bool sums = true;
        for (int l = 0; l < 32; ++l) {
          const float cpu = kvq::grid_square_sum(want.data(), codes.data() + static_cast<std::size_t>(l) * n, n);
          sums = sums && std::isfinite(cpu) && kvq::f32_bits(out[17 + static_cast<std::size_t>(l)]) == kvq::f32_bits(cpu);
        }
        check(sums, "reverse-order lane sums equal kvq::grid_square_sum: " + name);
        const float cpu0 = kvq::grid_square_sum(want.data(), codes.data(), n);
        check(kvq::f32_bits(out[49]) == kvq::f32_bits(cpu0), "warp_grid_square_sum equals kvq::grid_square_sum: " + name);
        cudaFree(d_e);
        cudaFree(d_c);
        cudaFree(d_codes);
        cudaFree(d_out);
      }
    }
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

template <int PS, int E = 32>
void lanes_case(std::mt19937& rng) {
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
    lanes_sumsq_kernel<PS, E><<<1, 32>>>(d_x, d_c2, d_out, d_out + 32);
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
  const std::string name = "lanes_sum_squares<" + std::to_string(PS) + ", " + std::to_string(E) + ">";
  std::printf("  %-44s %d lane results: %d differ, corrected_norm %d differ\n", name.c_str(), cases, wrong, wrong_cn);
  check(wrong == 0, name + " equals kvq::sum_squares bit for bit");
  check(wrong_cn == 0, name + ": corrected_norm equals norm / sqrt(c2) on the CPU");
}

}  // namespace

// Host only (runs without a GPU too): the outlier split's segment order against the fast store kernel's staged
// rows (stage.cuh). Element k of every lane of a warp is one shared-memory load (gather32_masked): lane (g, l),
// g < 32 / P the vector, l < P = D / 32 its lane, reads channel order[32 l + k] (hi then lo) of row g at
// row_base(g) ^ chan_off(c). The load takes as many wavefronts as the most distinct words any bank holds.
template <int D>
int gather_wavefronts(const std::vector<int>& hi, const std::vector<int>& lo, int k) {
  using S = kc::Stage<D>;
  constexpr int P = D / 32, V = 32 / P;
  std::vector<std::vector<std::uint32_t>> words(32);
  for (int l = 0; l < P; ++l) {
    const int c = l < P / 2 ? hi[static_cast<std::size_t>(32 * l + k)] : lo[static_cast<std::size_t>(32 * (l - P / 2) + k)];
    for (int g = 0; g < V; ++g) {
      const std::uint32_t word = (S::row_base(static_cast<std::uint32_t>(g)) ^ S::chan_off(static_cast<std::uint32_t>(c))) >> 2;
      auto& b = words[word & 31u];
      if (std::find(b.begin(), b.end(), word) == b.end()) b.push_back(word);
    }
  }
  std::size_t m = 0;
  for (const auto& b : words) m = std::max(m, b.size());
  return static_cast<int>(m);
}

// Random and skewed outlier sets of D / 2 channels: the order is the two channel sets (hi: the outliers), and
// its loads take one wavefront (D = 64: two, since its 16 rows share 8 bank groups; four where a load's two
// channels share a class), while the ascending order, on the same sets, takes more: the check can fail.
template <int D>
void split_order_case(std::mt19937& rng) {
  int worst = 0, worst_sorted = 0, sets = 0;
  bool perm_ok = true;
  auto one = [&](std::vector<int> out) {
    std::sort(out.begin(), out.end());
    const auto [hi, lo] = kvq::outlier_split_order(D, out);
    std::vector<int> hs = hi, ls = lo, rest;
    std::sort(hs.begin(), hs.end());
    std::sort(ls.begin(), ls.end());
    for (int c = 0; c < D; ++c)
      if (!std::binary_search(out.begin(), out.end(), c)) rest.push_back(c);
    perm_ok = perm_ok && hs == out && ls == rest;
    for (int k = 0; k < 32; ++k) {
      worst = std::max(worst, gather_wavefronts<D>(hi, lo, k));
      worst_sorted = std::max(worst_sorted, gather_wavefronts<D>(out, rest, k));
    }
    ++sets;
  };
  std::vector<int> all(D);
  for (int c = 0; c < D; ++c) all[static_cast<std::size_t>(c)] = c;
  for (int t = 0; t < 200; ++t) {
    std::shuffle(all.begin(), all.end(), rng);
    one(std::vector<int>(all.begin(), all.begin() + D / 2));
  }
  std::vector<int> first, evens, two_classes, high_half;
  for (int c = 0; c < D; ++c) {
    if (c < D / 2) first.push_back(c);
    if (c % 2 == 0) evens.push_back(c);
    if ((c & 7) < 4) two_classes.push_back(c);  // classes 0 and 1 of split_bank_class only
    if (c >= D / 2) high_half.push_back(c);
  }
  for (const auto& v : {first, evens, two_classes, high_half}) one(v);
  const int want = D == 64 ? 2 : 1;
  kvq::cudatest::check(perm_ok, "outlier_split_order d" + std::to_string(D) + ": the two channel sets");
  kvq::cudatest::check(worst == want, "outlier_split_order d" + std::to_string(D) + ": gather loads take " +
                                          std::to_string(worst) + " wavefronts at most over " + std::to_string(sets) +
                                          " sets (want " + std::to_string(want) + ")");
  kvq::cudatest::check(worst_sorted > want, "ascending order d" + std::to_string(D) + ": " + std::to_string(worst_sorted) +
                                                " wavefronts at most (the checker must see conflicts)");
  std::printf("outlier_split_order d%d: %d sets, gather wavefronts <= %d (ascending order: <= %d)\n", D, sets, worst,
              worst_sorted);
}

void split_order_cases() {
  std::mt19937 rng(20261202);
  split_order_case<64>(rng);
  split_order_case<128>(rng);
  split_order_case<256>(rng);
  // Other splits keep ascending channels.
  const auto [h96, l96] = kvq::outlier_split_order(96, {1, 5, 7, 40, 41, 90});
  const auto [h32, l32] = kvq::outlier_split_order(128, {3, 4, 9, 20, 70, 71, 99});
  kvq::cudatest::check(std::is_sorted(h96.begin(), h96.end()) && std::is_sorted(l96.begin(), l96.end()) &&
                           std::is_sorted(h32.begin(), h32.end()) && std::is_sorted(l32.begin(), l32.end()) &&
                           h96.size() == 6 && l96.size() == 90 && h32.size() == 7 && l32.size() == 121,
                       "outlier_split_order: other splits in ascending channel order");
}

int main() {
  split_order_cases();
  if (!kvq::cudatest::gpu_present()) return kvq::cudatest::finish();
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
  grid_cases(rng);
  sum_squares_cases(rng);
  lanes_case<1>(rng);
  lanes_case<2>(rng);
  lanes_case<4>(rng);
  lanes_case<8>(rng);
  lanes_case<1, 64>(rng);
  lanes_case<2, 64>(rng);
  lanes_case<4, 64>(rng);
  return kvq::cudatest::finish();
}
