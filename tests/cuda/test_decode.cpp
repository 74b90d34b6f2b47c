// GPU tests of the GQA store and decode kernels against the scalar references of kvq_quant.
//
// Each case packs a paged cache on the CPU with make_quantizers (the oracle), uploads it, runs
// the decode kernel and compares with attention computed in double over the decoded rows of the
// same packed cache (protected positions from their bf16 rows): output NMSE <= 1e-5 (the error
// budget of docs/kernels.md), NaN never passes, outputs poisoned before every run, the pool
// poisoned with 0xff bytes (NaN in every float type) outside the written records. The store
// kernel packs the same rows on the GPU and must reproduce the CPU bytes, every record (the
// norms add in kvq::sum_squares's order on both sides); records the CPU encoders
// refuse (NaN / inf rows, norms or uniform ranges beyond fp16) must be refused and counted, their
// slots left untouched. Where the fast kernel merges its splits in thread-block clusters, the merge
// through the workspace must give the same bits, and relaunches and graph replays take both. Launched
// programmatically (DecodeParams::programmatic) after a slow writer of its inputs, and right after the store
// kernel that wrote its pages, the decode must give the same bits again.
// Inputs: Gaussian rows with outlier channels and the tiny-gqa fixture keys / values (before RoPE:
// a kernel test needs none). `--small` runs a reduced set (for compute-sanitizer).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "harness.hpp"
#include "kvq/cuda_protect.hpp"
#include "kvq/formats.hpp"
#include "kvq/numeric.hpp"
#include "kvq/quantizers.hpp"
#include "kvq/safetensors.hpp"
#include "kvq_cuda.hpp"

using namespace kvq;
using kvq::cudatest::CapturedCall;
using kvq::cudatest::check;
using kvq::cudatest::download;
using kvq::cudatest::upload;
using kvq::cudatest::upload_into;

namespace {

int g_cluster_cases = 0;  // decode cases whose launch merged its splits in thread-block clusters
int g_cluster_multi = 0;  // ... in clusters of two or more CTAs (the merge by asynchronous stores)
int g_early_sends = 0;    // ... in clusters of two with early sends (the partner's rows armed in the prologue)
int g_sixteen_cases = 0;  // decode cases run in CTAs of more than 8 heads (and again in CTAs of at most 8)
int g_pdl_cases = 0;      // decode cases launched programmatically after a slow writer
int g_pdl_early = 0;      // ... where a probe launched the same way found the writer unfinished

struct Case {
  std::string fmt;
  int d = 128, hq = 32, hkv = 8;
  std::vector<int> lens;
  bool fixture = false;
  int sinks = 0, window = 0;
  int splits = 0;
  bool centered = false;  // per-channel offsets in the rows and calibration means (kvq's own formats)
  // TurboQuant values decoded with twice the value codebook (the device copy doubled before decode, the
  // reference doubled with it; no protection, uncentered). Every TurboQuant-value format uses one codebook for
  // keys and values, so without this a kernel that read key centroids for values, or value pairs for keys,
  // would pass.
  bool values_x2 = false;
  unsigned seed = 1;
};

std::vector<float> fixture_all(const std::string& name) {
  static SafetensorsFile f(std::string(KVQ_SOURCE_DIR) + "/models/tiny-gqa/reference.safetensors");
  return f.get(name).to_float();  // [512][256]
}

// Whether the records of (slot, head) hold the same codes and metadata in two pools.
bool same_record(const PageLayout& pl, const std::vector<std::uint8_t>& a_pool, const std::vector<std::uint8_t>& b_pool,
                 std::int64_t slot, int h) {
  const std::size_t page = static_cast<std::size_t>(slot / 64);
  const int off = static_cast<int>(slot % 64);
  const std::uint8_t* a = a_pool.data() + page * pl.page_bytes;
  const std::uint8_t* b = b_pool.data() + page * pl.page_bytes;
  return std::memcmp(a + pl.key_code(h, off), b + pl.key_code(h, off), pl.key_code_bytes) == 0 &&
         std::memcmp(a + pl.value_code(h, off), b + pl.value_code(h, off), pl.value_code_bytes) == 0 &&
         std::memcmp(a + pl.key_meta(h, off), b + pl.key_meta(h, off), pl.meta_bytes) == 0;
}

// The CPU oracle's record of (slot, head): key and value codes and metadata, metadata padding
// zeroed. Returns the page base.
std::uint8_t* pack_record(const PageLayout& pl, const QuantizerPair& q, const float* k, const float* v,
                          std::vector<std::uint8_t>& pool, std::int64_t slot, int h) {
  std::uint8_t* base = pool.data() + static_cast<std::size_t>(slot / 64) * pl.page_bytes;
  const int off = static_cast<int>(slot % 64);
  q.key->encode(k, base + pl.key_code(h, off), base + pl.key_meta(h, off));
  q.value->encode(v, base + pl.value_code(h, off), base + pl.value_meta(h, off));
  for (std::uint32_t i = pl.key_meta_bytes + pl.value_meta_bytes; i < pl.meta_bytes; ++i) base[pl.key_meta(h, off) + i] = 0;
  return base;
}

// Whether the CPU encoders accept the record (k, v): they refuse non-finite rows, TurboQuant stored
// norms beyond fp16 and uniform values whose min or max is beyond fp16; the GPU store must refuse
// the same records.
bool cpu_accepts(const QuantizerPair& q, const float* k, const float* v) {
  std::vector<std::uint8_t> kc(q.key->code_bytes()), km(q.key->meta_bytes() + 1), vc(q.value->code_bytes()),
      vm(q.value->meta_bytes() + 1);
  try {
    q.key->encode(k, kc.data(), km.data());
    q.value->encode(v, vc.data(), vm.data());
  } catch (const std::exception&) {
    return false;
  }
  return true;
}

double run_case(const Case& c) {
  const FormatSpec& f = find_format(c.fmt);
  CacheGeometry g;
  g.n_layers = 1;
  g.n_kv_heads = c.hkv;
  g.head_dim = c.d;
  g.v_head_dim = c.d;
  const int B = static_cast<int>(c.lens.size()), D = c.d, H = c.hkv, G = c.hq / c.hkv;
  const int maxL = *std::max_element(c.lens.begin(), c.lens.end());
  std::mt19937 rng(c.seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);

  // Rows [b][t][h][D], rounded to bf16 (the kernels' input type).
  std::vector<std::vector<float>> K(B), V(B);
  std::vector<float> fk, fv;
  if (c.fixture) {
    fk = fixture_all("layer1.k");
    fv = fixture_all("layer1.v");
  }
  std::vector<float> chscale(static_cast<std::size_t>(D), 1.0f);
  for (int i = 0; i < D; i += 9) chscale[static_cast<std::size_t>(i)] = 6.0f;
  for (int b = 0; b < B; ++b) {
    const std::size_t n = static_cast<std::size_t>(c.lens[static_cast<std::size_t>(b)]) * H * D;
    K[b].resize(n);
    V[b].resize(n);
    for (std::size_t i = 0; i < n; ++i) {
      const int dd = static_cast<int>(i % D), h = static_cast<int>((i / D) % H);
      const std::size_t t = i / (static_cast<std::size_t>(D) * H);
      if (c.fixture) {
        const std::size_t src = ((t + 37 * static_cast<std::size_t>(b)) % 512) * 256 + static_cast<std::size_t>((h % 2) * 128 + dd);
        K[b][i] = fk[src];
        V[b][i] = fv[src];
      } else {
        K[b][i] = nd(rng) * chscale[static_cast<std::size_t>(dd)] + 0.3f;
        V[b][i] = nd(rng) * (dd % 17 == 0 ? 3.0f : 1.0f);
      }
      if (c.centered && !c.fixture) {  // offsets that centering removes: 1-3x the spread per channel
        K[b][i] += 2.5f * std::sin(0.7f * static_cast<float>(dd + 13 * h));
        V[b][i] += 1.5f * std::cos(0.3f * static_cast<float>(dd + 7 * h));
      }
      K[b][i] = round_bf16(K[b][i]);
      V[b][i] = round_bf16(V[b][i]);
    }
  }
  // Outlier channels for the split formats (from the data itself: a kernel test).
  OutlierChannels oc;
  if (f.kind == FormatKind::kTqSplit) {
    const int cnt = split_outlier_count(f, D);
    oc.key.resize(1);
    oc.value.resize(1);
    for (int h = 0; h < H; ++h) {
      std::vector<float> kr, vr;
      for (int b = 0; b < B; ++b)
        for (int t = 0; t < c.lens[static_cast<std::size_t>(b)]; ++t)
          for (int dd = 0; dd < D; ++dd) {
            kr.push_back(K[b][(static_cast<std::size_t>(t) * H + h) * D + dd]);
            vr.push_back(V[b][(static_cast<std::size_t>(t) * H + h) * D + dd]);
          }
      oc.key[0].push_back(select_outlier_channels(kr.data(), kr.size() / D, D, cnt));
      oc.value[0].push_back(select_outlier_channels(vr.data(), vr.size() / D, D, cnt));
    }
  }
  // Centering means: the per-channel means of the rows themselves (as calibration measures them).
  if (c.centered) {
    check(format_uses_centering(f), c.fmt + ": a centered case needs one of kvq's centered formats");
    oc.key.resize(1);
    oc.value.resize(1);
    oc.key[0].resize(static_cast<std::size_t>(H));
    oc.value[0].resize(static_cast<std::size_t>(H));
    oc.key_mean.assign(1, std::vector<std::vector<float>>(static_cast<std::size_t>(H), std::vector<float>(static_cast<std::size_t>(D), 0.0f)));
    oc.value_mean = oc.key_mean;
    for (int h = 0; h < H; ++h) {
      std::vector<double> ks(static_cast<std::size_t>(D), 0.0), vs(static_cast<std::size_t>(D), 0.0);
      std::size_t n = 0;
      for (int b = 0; b < B; ++b)
        for (int t = 0; t < c.lens[static_cast<std::size_t>(b)]; ++t, ++n)
          for (int dd = 0; dd < D; ++dd) {
            ks[static_cast<std::size_t>(dd)] += K[b][(static_cast<std::size_t>(t) * H + h) * D + dd];
            vs[static_cast<std::size_t>(dd)] += V[b][(static_cast<std::size_t>(t) * H + h) * D + dd];
          }
      for (int dd = 0; dd < D; ++dd) {
        oc.key_mean[0][static_cast<std::size_t>(h)][static_cast<std::size_t>(dd)] = static_cast<float>(ks[static_cast<std::size_t>(dd)] / static_cast<double>(n));
        oc.value_mean[0][static_cast<std::size_t>(h)][static_cast<std::size_t>(dd)] = static_cast<float>(vs[static_cast<std::size_t>(dd)] / static_cast<double>(n));
      }
    }
  }
  std::vector<QuantizerPair> qp;
  for (int h = 0; h < H; ++h) qp.push_back(make_quantizers(f, g, 0, h, &oc));
  const PageLayout pl = page_layout(f, g);

  // Pages: shuffled ids, block tables [B][max_pages].
  const int max_pages = (maxL + 63) / 64;
  int n_pages = 0;
  for (int L : c.lens) n_pages += (L + 63) / 64;
  std::vector<int> ids(static_cast<std::size_t>(n_pages));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  std::vector<std::int32_t> bt(static_cast<std::size_t>(B) * max_pages, -1);
  {
    int k = 0;
    for (int b = 0; b < B; ++b)
      for (int p = 0; p < (c.lens[static_cast<std::size_t>(b)] + 63) / 64; ++p)
        bt[static_cast<std::size_t>(b) * max_pages + p] = ids[static_cast<std::size_t>(k++)];
  }
  std::vector<std::uint8_t> pool(static_cast<std::size_t>(n_pages) * pl.page_bytes, 0xff);
  ProtectLayout pr;
  pr.sinks = c.sinks;
  pr.window = c.window;
  pr.kv_heads = H;
  pr.head_dim = D;
  std::vector<std::uint16_t> prot(pr.enabled() ? pr.elements(B) : 0, 0xffff);
  // Decoded rows for the reference.
  std::vector<std::vector<float>> Kd(B), Vd(B);
  std::vector<std::uint16_t> kbf, vbf;  // store-kernel input [tokens][H][D]
  std::vector<std::int64_t> slots;
  std::vector<std::int32_t> positions, seq_ids;
  for (int b = 0; b < B; ++b) {
    const int L = c.lens[static_cast<std::size_t>(b)];
    Kd[b].resize(K[b].size());
    Vd[b].resize(V[b].size());
    for (int t = 0; t < L; ++t) {
      const int page = bt[static_cast<std::size_t>(b) * max_pages + t / 64], off = t % 64;
      const std::int64_t slot = static_cast<std::int64_t>(page) * 64 + off;
      slots.push_back(slot);
      positions.push_back(t);
      seq_ids.push_back(b);
      for (int h = 0; h < H; ++h) {
        const std::size_t r = (static_cast<std::size_t>(t) * H + h) * D;
        const std::uint8_t* base = pack_record(pl, qp[static_cast<std::size_t>(h)], &K[b][r], &V[b][r], pool, slot, h);
        qp[static_cast<std::size_t>(h)].key->decode(base + pl.key_code(h, off), base + pl.key_meta(h, off), &Kd[b][r]);
        qp[static_cast<std::size_t>(h)].value->decode(base + pl.value_code(h, off), base + pl.value_meta(h, off), &Vd[b][r]);
        for (int dd = 0; dd < D; ++dd) {
          kbf.push_back(float_to_bf16(K[b][r + static_cast<std::size_t>(dd)]));
          vbf.push_back(float_to_bf16(V[b][r + static_cast<std::size_t>(dd)]));
        }
        if (pr.enabled()) {
          const int s = pr.slot(t);
          if (s >= 0)
            for (int dd = 0; dd < D; ++dd) {
              prot[pr.row(b, h, s) + static_cast<std::size_t>(dd)] = float_to_bf16(K[b][r + static_cast<std::size_t>(dd)]);
              prot[pr.row(b, h, s) + static_cast<std::size_t>(D + dd)] = float_to_bf16(V[b][r + static_cast<std::size_t>(dd)]);
            }
        }
      }
    }
  }
  // Queries and the reference in double.
  std::vector<float> q(static_cast<std::size_t>(B) * c.hq * D);
  for (auto& x : q) x = nd(rng);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  std::vector<double> ref(q.size(), 0.0);
  for (int b = 0; b < B; ++b) {
    const int L = c.lens[static_cast<std::size_t>(b)];
    const std::int64_t lo = pr.enabled() ? pr.packed_begin(L) : 0, hi = pr.enabled() ? pr.packed_end(L) : L;
    for (int hh = 0; hh < c.hq; ++hh) {
      const int h = hh / G;
      const float* qq = &q[(static_cast<std::size_t>(b) * c.hq + hh) * D];
      std::vector<double> s(static_cast<std::size_t>(L));
      double mx = -1e300;
      for (int t = 0; t < L; ++t) {
        const bool packed = t >= lo && t < hi;
        const std::size_t r = (static_cast<std::size_t>(t) * H + h) * D;
        const float* kk = packed ? &Kd[b][r] : &K[b][r];
        double acc = 0;
        for (int dd = 0; dd < D; ++dd) acc += static_cast<double>(qq[dd]) * kk[dd];
        s[static_cast<std::size_t>(t)] = acc * scale;
        mx = std::max(mx, s[static_cast<std::size_t>(t)]);
      }
      double sum = 0;
      for (auto& x : s) sum += (x = std::exp(x - mx));
      double* o = &ref[(static_cast<std::size_t>(b) * c.hq + hh) * D];
      for (int t = 0; t < L; ++t) {
        const bool packed = t >= lo && t < hi;
        const std::size_t r = (static_cast<std::size_t>(t) * H + h) * D;
        const float* vv = packed ? &Vd[b][r] : &V[b][r];
        for (int dd = 0; dd < D; ++dd) o[dd] += s[static_cast<std::size_t>(t)] / sum * vv[dd];
      }
    }
  }

  // GPU decode on the CPU-packed cache.
  cuda::LayerTables tabs(f, g, 0, &oc);
  // values_x2: the device value codebook doubled (exact) for the decode checks, restored for the store.
  constexpr std::size_t kCentroids = static_cast<std::size_t>(cuda::kMaxSegments) * cuda::kMaxCodebook;
  float* const dvcent = const_cast<float*>(tabs.desc().value_centroids);
  std::vector<float> vcent;
  if (c.values_x2) {
    check(tabs.desc().value == cuda::ValueCode::kTq && !pr.enabled() && !c.centered,
          c.fmt + ": values_x2 needs TurboQuant values, no protection, no centering");
    vcent = download(dvcent, kCentroids);
    std::vector<float> twice(vcent);
    for (auto& x : twice) x *= 2.0f;
    upload_into(dvcent, twice);
    for (auto& x : ref) x *= 2.0;  // attention is linear in the values
  }
  std::uint8_t* dpool = upload(pool);
  std::int32_t* dbt = upload(bt);
  std::int32_t* dlens = upload(std::vector<std::int32_t>(c.lens.begin(), c.lens.end()));
  float* dq = upload(q);
  std::uint16_t* dprot = upload(prot);
  float* dout = nullptr;
  KVQ_CUDA_OK(cudaMalloc(&dout, q.size() * sizeof(float)));
  cuda::DecodeParams p;
  p.fmt = tabs.desc();
  if (c.values_x2) p.fmt.shared_codebook = false;  // the device value codebook no longer equals the key one
  p.pool = dpool;
  p.block_tables = dbt;
  p.max_pages = max_pages;
  p.seq_lens = dlens;
  p.batch = B;
  p.q_heads = c.hq;
  p.max_seq_len = maxL;
  p.q = dq;
  p.out = dout;
  p.scale = scale;
  p.protect = pr;
  p.protect_rows = pr.enabled() ? dprot : nullptr;
  p.num_splits = c.splits;
  p.workspace_bytes = cuda::decode_workspace_bytes(p);
  KVQ_CUDA_OK(cudaMalloc(&p.workspace, p.workspace_bytes));
  KVQ_CUDA_OK(cudaMemset(p.workspace, 0xff, p.workspace_bytes));
  KVQ_CUDA_OK(cudaMemset(dout, 0xff, q.size() * sizeof(float)));
  const std::string name = c.fmt + " d" + std::to_string(D) + " " + std::to_string(c.hq) + "/" + std::to_string(H) +
                           " B" + std::to_string(B) + " maxL" + std::to_string(maxL) + (c.fixture ? " fixture" : "") +
                           (pr.enabled() ? " S" + std::to_string(c.sinks) + "W" + std::to_string(c.window) : "") +
                           (c.splits ? " splits" + std::to_string(c.splits) : "") + (c.centered ? " centered" : "") +
                           (c.values_x2 ? " values x2" : "");
  check(!c.centered || (p.fmt.key_mean && p.fmt.value_mean), name + ": centered case without means in the tables");
  // The fast kernel serves head_dim 128 (four heads per CTA up to G = 4, eight up to 8, sixteen above) for
  // every format but bf16 (outlier splits included); tq-3bit's reads its value pairs from the key table
  // (FCfg::kValWin), so only with equal codebooks. G > 8 runs in S CTAs per KV head and split, each with G / S heads:
  // S the smallest divisor of G with G / S <= 16 where that leaves more than 8 and the fast kernel serves the launch
  // (its sixteen-head form), else with G / S <= 8.
  const bool want_fast = D == 128 && c.fmt != "bf16" && (c.fmt != "tq-3bit" || p.fmt.shared_codebook);
  check(cuda::decode_uses_fast_kernel(p) == want_fast, name + ": expected the " + (want_fast ? "fast" : "generic") + " kernel");
  auto per_cta = [G](int most) {
    int s = (G + most - 1) / most;
    while (G % s != 0) ++s;
    return G / s;
  };
  const bool want16 = want_fast && G > 8 && per_cta(16) > 8;
  check(cuda::decode_cta_heads(p) == (want16 ? per_cta(16) : per_cta(8)),
        name + ": " + std::to_string(cuda::decode_cta_heads(p)) + " heads per CTA");
  const cudaError_t e = cuda::decode(p);
  check(e == cudaSuccess, name + ": decode launch: " + cudaGetErrorString(e));
  KVQ_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> out = download(dout, q.size());
  double num = 0, den = 0;
  for (std::size_t i = 0; i < out.size(); ++i) {
    const double dlt = static_cast<double>(out[i]) - ref[i];
    num += dlt * dlt;
    den += ref[i] * ref[i];
  }
  const double nmse = num / den;
  check(std::isfinite(nmse) && nmse <= 1e-5, name + ": decode NMSE " + std::to_string(nmse));
  // NMSE against the same reference of what a later launch left in dout.
  auto nmse_now = [&]() {
    const std::vector<float> o = download(dout, q.size());
    double n = 0;
    for (std::size_t i = 0; i < o.size(); ++i) {
      const double dlt = static_cast<double>(o[i]) - ref[i];
      n += dlt * dlt;
    }
    return n / den;
  };
  const bool cluster = cuda::decode_uses_cluster_merge(p);
  check(!cluster || want_fast, name + ": a cluster merge outside the fast kernel");
  check(!cluster || !pr.enabled(), name + ": a cluster merge under protection (split 0 writes two partials)");
  std::printf("  %-58s %-7s splits %3d%s  NMSE %.2e\n", name.c_str(), want_fast ? "fast" : "generic",
              cuda::decode_splits(p), cluster ? " cluster" : "", nmse);
  // Protection: split 0 reads the protected rows after its packed ones, which it takes decode_protect_chunks(p) chunks
  // fewer of. No share may change the result beyond the bound: none (split 0 reads its whole packed share too), half
  // the longest sequence's chunks (the packed range divided between split 0 and the others, as at long context with
  // the default share), and more than the longest sequence (split 0 reads only the protected rows, its packed range
  // empty, as the default share of one chunk per protected row gives the test's short sequences).
  if (pr.enabled()) {
    check(cuda::decode_protect_chunks(p) > 0, name + ": no share of split 0 for the protected rows");
    for (const int share : {0, std::max(1, maxL / 64), maxL / 32 + 2}) {
      cuda::DecodeParams ps = p;
      ps.protect_chunks = share;
      check(cuda::decode_protect_chunks(ps) == share, name + ": protect_chunks not taken");
      ps.workspace_bytes = cuda::decode_workspace_bytes(ps);
      if (ps.workspace_bytes > p.workspace_bytes) KVQ_CUDA_OK(cudaMalloc(&ps.workspace, ps.workspace_bytes));
      KVQ_CUDA_OK(cudaMemset(dout, 0xff, q.size() * sizeof(float)));
      check(cuda::decode(ps) == cudaSuccess, name + ": decode launch with protect_chunks " + std::to_string(share));
      KVQ_CUDA_OK(cudaDeviceSynchronize());
      if (ps.workspace != p.workspace) cudaFree(ps.workspace);
      const double ns = nmse_now();
      check(std::isfinite(ns) && ns <= 1e-5,
            name + ": decode NMSE with protect_chunks " + std::to_string(share) + ": " + std::to_string(ns));
    }
  }
  // Sixteen heads per CTA (query fragments without the fp16 residual; with protection, the protected rows of up to
  // 16 heads): the same launch in CTAs of at most 8 heads must meet the same bound; both errors are printed.
  if (want16) {
    cuda::DecodeParams p8 = p;
    p8.sixteen_heads = false;
    check(cuda::decode_cta_heads(p8) == per_cta(8), name + ": sixteen_heads = false still takes more than 8 per CTA");
    // Other grid rows and split count, so other counters and partials: the workspace is asked for again (decode
    // refuses p's where it is short).
    p8.workspace_bytes = cuda::decode_workspace_bytes(p8);
    if (p8.workspace_bytes > p.workspace_bytes) {
      cuda::DecodeParams short_ws = p8;
      short_ws.workspace_bytes = p.workspace_bytes;
      check(cuda::decode(short_ws) == cudaErrorInvalidValue, name + ": CTAs of 8 heads launched on the workspace of CTAs of 16");
      KVQ_CUDA_OK(cudaMalloc(&p8.workspace, p8.workspace_bytes));
      KVQ_CUDA_OK(cudaMemset(p8.workspace, 0xff, p8.workspace_bytes));
    }
    KVQ_CUDA_OK(cudaMemset(dout, 0xff, q.size() * sizeof(float)));
    check(cuda::decode(p8) == cudaSuccess, name + ": decode launch in CTAs of 8 heads");
    KVQ_CUDA_OK(cudaDeviceSynchronize());
    if (p8.workspace != p.workspace) cudaFree(p8.workspace);
    const double n8 = nmse_now();
    check(std::isfinite(n8) && n8 <= 1e-5, name + ": decode NMSE in CTAs of 8 heads " + std::to_string(n8));
    ++g_sixteen_cases;
    std::printf("  %-58s %d heads per CTA; in CTAs of %d: NMSE %.2e\n", "", per_cta(16), per_cta(8), n8);
  }
  // The same launch merging through the workspace (counters, last CTA): where p merges in clusters,
  // it must give the same bits (the same partials, weighted in the same split order).
  cuda::DecodeParams pw = p;
  pw.cluster_merge = false;
  const bool cluster_multi = cluster && cuda::decode_splits(p) > 1;
  if (cluster) {
    ++g_cluster_cases;
    if (cluster_multi) ++g_cluster_multi;
    const bool early = cuda::decode_uses_early_sends(p);
    check(!early || (cuda::decode_splits(p) == 2 && !p.protect.enabled()),
          name + ": early sends outside a cluster of two without protection");
    if (early) ++g_early_sends;
    check(!cuda::decode_uses_cluster_merge(pw), name + ": cluster_merge = false still merges in clusters");
    KVQ_CUDA_OK(cudaMemset(dout, 0xff, q.size() * sizeof(float)));
    check(cuda::decode(pw) == cudaSuccess, name + ": decode launch without clusters");
    KVQ_CUDA_OK(cudaDeviceSynchronize());
    const std::vector<float> outw = download(dout, q.size());
    check(std::memcmp(outw.data(), out.data(), out.size() * sizeof(float)) == 0,
          name + ": the workspace merge differs from the cluster merge");
  }
  // The splits are merged by the last CTA of each group, counted in through per-group counters in
  // the workspace that every launch tags with its own epoch and leaves at zero: a second launch on
  // the same workspace, and two replays of one captured graph (the same epoch twice), must give
  // the same bits.
  {
    auto again = [&](const std::string& what, auto&& launch) {
      KVQ_CUDA_OK(cudaMemset(dout, 0xff, q.size() * sizeof(float)));
      launch();
      KVQ_CUDA_OK(cudaDeviceSynchronize());
      const std::vector<float> out2 = download(dout, q.size());
      check(std::memcmp(out2.data(), out.data(), out.size() * sizeof(float)) == 0, name + ": " + what + " differs");
    };
    // Eight more launches: a CTA that counted itself in before all its threads had written its
    // partial showed up here, one launch in many (most often under compute-sanitizer racecheck).
    // Where p merges in clusters, every other launch and one captured graph take the workspace merge.
    for (int r = 0; r < 8; ++r)
      again("launch " + std::to_string(r + 2) + " on the same workspace" + (cluster && r % 2 ? " (workspace merge)" : ""),
            [&] { check(cuda::decode(cluster && r % 2 ? pw : p) == cudaSuccess, name + ": relaunch"); });
    // The cluster merge with the sends of the odd ranks held back 20 us: a merge that read its receive
    // buffer before every send had landed (a missing or wrong wait) ran in time without the delay.
    if (cluster_multi) {
      cuda::DecodeParams pd = p;
      pd.test_send_delay_ns = 20000;
      again("launch with delayed cluster sends", [&] { check(cuda::decode(pd) == cudaSuccess, name + ": delayed launch"); });
      pd.test_send_delay_ns = -1;
      check(cuda::decode(pd) == cudaErrorInvalidValue, name + ": a negative send delay accepted");
    }
    for (int k = 0; k < (cluster ? 2 : 1); ++k) {
      const cuda::DecodeParams& pc = k == 0 ? p : pw;
      CapturedCall call([&](cudaStream_t st) { return cuda::decode(pc, st); });
      check(call.launched() == cudaSuccess, name + ": decode under graph capture");
      for (int r = 0; r < 2; ++r)
        again("graph replay " + std::to_string(r + 1) + (k ? " (workspace merge)" : ""), [&] { call.replay(); });
    }
  }
  // Programmatic launch (DecodeParams::programmatic) after a writer that lets it start at once and copies the pool,
  // the query and the protected rows into buffers of 0xff bytes only 30 us later: the decode must wait for the
  // writer and give the same bits (0xff pages decode to NaN). A probe launched the same way after the same writer,
  // which does not wait, counts in g_pdl_early the cases where it found the writer unfinished, i.e. where a decode
  // that read those buffers before its wait would have read 0xff.
  {
    cudaStream_t st = nullptr;
    KVQ_CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    std::uint8_t *wpool = nullptr, *wq = nullptr, *wprot = nullptr, *sent = nullptr;
    int* dflag = nullptr;
    const std::size_t qbytes = q.size() * sizeof(float), pbytes = prot.size() * sizeof(std::uint16_t);
    KVQ_CUDA_OK(cudaMalloc(&wpool, pool.size()));
    KVQ_CUDA_OK(cudaMalloc(&wq, qbytes));
    if (pbytes) KVQ_CUDA_OK(cudaMalloc(&wprot, pbytes));
    KVQ_CUDA_OK(cudaMalloc(&sent, 32));
    KVQ_CUDA_OK(cudaMalloc(&dflag, sizeof(int)));
    KVQ_CUDA_OK(cudaMemset(sent, 0, 16));
    cuda::TestCopies tc;
    auto region = [&](void* dst, const void* src, std::size_t n) {
      tc.dst[tc.n] = dst;
      tc.src[tc.n] = src;
      tc.bytes[tc.n++] = n;
    };
    region(wpool, dpool, pool.size());
    region(wq, dq, qbytes);
    if (pbytes) region(wprot, dprot, pbytes);
    region(sent + 16, sent, 16);
    auto poison = [&] {
      KVQ_CUDA_OK(cudaMemsetAsync(wpool, 0xff, pool.size(), st));
      KVQ_CUDA_OK(cudaMemsetAsync(wq, 0xff, qbytes, st));
      if (pbytes) KVQ_CUDA_OK(cudaMemsetAsync(wprot, 0xff, pbytes, st));
      KVQ_CUDA_OK(cudaMemsetAsync(sent + 16, 0xff, 16, st));
      KVQ_CUDA_OK(cudaMemsetAsync(dout, 0xff, q.size() * sizeof(float), st));
    };
    poison();
    check(cuda::test_delayed_copy(tc, 30000, st) == cudaSuccess, name + ": delayed copy");
    check(cuda::test_stale_probe(sent + 16, 0xff, dflag, st) == cudaSuccess, name + ": stale probe");
    int early = 0;
    KVQ_CUDA_OK(cudaMemcpyAsync(&early, dflag, sizeof(int), cudaMemcpyDeviceToHost, st));
    KVQ_CUDA_OK(cudaStreamSynchronize(st));
    if (early) ++g_pdl_early;
    ++g_pdl_cases;
    for (int k = 0; k < (cluster ? 2 : 1); ++k) {
      cuda::DecodeParams pp = k == 0 ? p : pw;
      pp.programmatic = true;
      pp.pool = wpool;
      pp.q = reinterpret_cast<const float*>(wq);
      pp.protect_rows = pbytes ? reinterpret_cast<const std::uint16_t*>(wprot) : nullptr;
      poison();
      check(cuda::test_delayed_copy(tc, 30000, st) == cudaSuccess, name + ": delayed copy");
      check(cuda::decode(pp, st) == cudaSuccess, name + ": programmatic decode launch");
      KVQ_CUDA_OK(cudaStreamSynchronize(st));
      const std::vector<float> out2 = download(dout, q.size());
      check(std::memcmp(out2.data(), out.data(), out.size() * sizeof(float)) == 0,
            name + ": the programmatic launch after a slow writer differs" + (k ? " (workspace merge)" : ""));
    }
    KVQ_CUDA_OK(cudaStreamDestroy(st));
    cudaFree(wpool);
    cudaFree(wq);
    cudaFree(wprot);
    cudaFree(sent);
    cudaFree(dflag);
  }

  if (c.values_x2)
    upload_into(dvcent, vcent);
  // Store kernel: the same rows packed on the GPU must give the CPU's bytes.
  if (!pr.enabled() || c.sinks > 0) {
    std::vector<std::uint8_t> pool2(pool.size(), 0xff);
    std::uint8_t* dpool2 = upload(pool2);
    std::uint16_t* dk = upload(kbf);
    std::uint16_t* dv = upload(vbf);
    std::int64_t* dslots = upload(slots);
    std::int32_t* dpos = upload(positions);
    std::int32_t* dseq = upload(seq_ids);
    std::vector<std::uint16_t> prot2(prot.size(), 0xffff);
    std::uint16_t* dprot2 = upload(prot2);
    cuda::StoreParams sp;
    sp.fmt = tabs.desc();
    sp.key = dk;
    sp.value = dv;
    sp.slot_mapping = dslots;
    sp.n_tokens = static_cast<int>(slots.size());
    sp.pool = dpool2;
    sp.protect = pr;
    sp.protect_rows = pr.enabled() ? dprot2 : nullptr;
    sp.positions = dpos;
    sp.seq_ids = dseq;
    sp.protect_seq_lens = dlens;
    // The decode step's pair: the decode launched programmatically right after the store, on the pages and protected
    // rows it writes, must give the bits of the decode of the CPU's pages (values_x2 decoded other centroids).
    cudaStream_t st = nullptr;
    KVQ_CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    KVQ_CUDA_OK(cudaMemsetAsync(dout, 0xff, q.size() * sizeof(float), st));
    const cudaError_t se = cuda::store(sp, st);
    check(se == cudaSuccess, name + ": store launch: " + cudaGetErrorString(se));
    if (!c.values_x2) {
      cuda::DecodeParams pp = p;
      pp.programmatic = true;
      pp.pool = dpool2;
      pp.protect_rows = pr.enabled() ? dprot2 : nullptr;
      check(cuda::decode(pp, st) == cudaSuccess, name + ": programmatic decode after the store");
    }
    KVQ_CUDA_OK(cudaStreamSynchronize(st));
    KVQ_CUDA_OK(cudaStreamDestroy(st));
    if (!c.values_x2) {
      const std::vector<float> out2 = download(dout, q.size());
      check(std::memcmp(out2.data(), out.data(), out.size() * sizeof(float)) == 0,
            name + ": the decode launched programmatically after the store differs");
    }
    KVQ_CUDA_OK(cudaMemcpy(pool2.data(), dpool2, pool2.size(), cudaMemcpyDeviceToHost));
    std::size_t records = 0, differ = 0;
    for (std::size_t i = 0; i < slots.size(); ++i)
      for (int h = 0; h < H; ++h) {
        ++records;
        if (!same_record(pl, pool, pool2, slots[i], h)) ++differ;
      }
    check(differ == 0, name + ": store kernel: " + std::to_string(differ) + " of " +
                                        std::to_string(records) + " records differ from the CPU reference");
    if (pr.enabled()) {
      const std::vector<std::uint16_t> got = download(dprot2, prot.size());
      check(got == prot, name + ": store kernel protection rows");
    }
    std::printf("  %-58s store: %zu / %zu records differ\n", "", differ, records);
    // The decode step captured in a CUDA graph: the store, then the decode launched programmatically (a programmatic
    // edge in the graph unless KVQ_NO_PDL=1), replayed twice over pages, protected rows and an output reset to 0xff
    // bytes, must give the launch's bits each time.
    if (!c.values_x2) {
      cuda::DecodeParams pp = p;
      pp.programmatic = true;
      pp.pool = dpool2;
      pp.protect_rows = pr.enabled() ? dprot2 : nullptr;
      CapturedCall call([&](cudaStream_t cs) {
        const cudaError_t es = cuda::store(sp, cs);
        return es != cudaSuccess ? es : cuda::decode(pp, cs);
      });
      check(call.launched() == cudaSuccess, name + ": the decode step under graph capture");
      for (int r = 0; r < 2; ++r) {
        KVQ_CUDA_OK(cudaMemset(dpool2, 0xff, pool2.size()));
        if (pr.enabled()) KVQ_CUDA_OK(cudaMemset(dprot2, 0xff, prot2.size() * sizeof(std::uint16_t)));
        KVQ_CUDA_OK(cudaMemset(dout, 0xff, q.size() * sizeof(float)));
        call.replay();
        const std::vector<float> out3 = download(dout, q.size());
        check(std::memcmp(out3.data(), out.data(), out.size() * sizeof(float)) == 0,
              name + ": graph replay " + std::to_string(r + 1) + " of the store and the programmatic decode differs");
      }
    }
    cudaFree(dpool2);
    cudaFree(dk);
    cudaFree(dv);
    cudaFree(dslots);
    cudaFree(dpos);
    cudaFree(dseq);
    cudaFree(dprot2);
  }
  cudaFree(p.workspace);
  cudaFree(dpool);
  cudaFree(dbt);
  cudaFree(dlens);
  cudaFree(dq);
  cudaFree(dprot);
  cudaFree(dout);
  return nmse;
}

// Uniform values whose quotient (x - lo) / s the fast store route gets wrong on its own: pairs
// (hi, x) with lo = 0 where floor(fma(x, RN(1 / s), 1/2 + 2^-16)) differs from UniformAffine's
// floor(RN(RN(x / s) + 1/2)) (s = RN(hi / m) rounded up, x / (hi / m) exactly k - 1/2), found by
// search over bf16 values. The kernel must send these records down its exact route.
std::vector<std::pair<float, std::vector<float>>> near_half_pairs(int m) {
  std::vector<std::pair<float, std::vector<float>>> out;
  for (std::uint32_t hb = 0x3f80; hb < 0x4000; ++hb) {  // hi in [1, 2)
    const float hi = bf16_to_float(static_cast<std::uint16_t>(hb));
    float s = hi / static_cast<float>(m);
    if (!(s > 1e-8f)) s = 1e-8f;
    const float y = 1.0f / s;
    std::vector<float> xs;
    for (std::uint32_t xb = 0x3b80; xb < hb; ++xb) {  // x in [2^-8, hi)
      const float x = bf16_to_float(static_cast<std::uint16_t>(xb));
      const float ref = std::floor(std::fmin(x / s + 0.5f, static_cast<float>(m) + 0.5f));
      const float fast = std::floor(std::fma(x, y, 0.5f + 0x1p-16f));
      if (ref != fast) xs.push_back(x);
    }
    if (!xs.empty()) out.emplace_back(hi, xs);
  }
  return out;
}

// Store kernel on rows built for the edges of its arithmetic, compared with the CPU encoders
// record by record (no decode): all-zero rows; one-hot keys and constant values (s = 1e-8);
// rows spanning 2^-60 .. 2^8 (squares from 2^-120 to 2^16 in one sum); values on a quarter
// grid with lo = -7.5 and hi = 7.5, so that the uniform quotients (x - lo) / s land exactly on
// k + 1/2 (4-bit: s = 1); values whose quotients fall just below k - 1/2 (near_half_pairs); large
// (x 300) and tiny (x 1e-20) Gaussian rows; TurboQuant rows whose rotation is one spike; typical rows. Tokens
// go to shuffled slots; a stride wider than the row and a token count that leaves the last
// warp partly empty.
// centered: kvq's calibrated formats with per-channel means (bf16 values, so that the zero rows,
// set to the means, center to exactly zero); the other rows keep their patterns.
void test_store_edges(const std::string& fmt, int D, int H, int n_tok, unsigned seed, bool poison = false, bool centered = false) {
  const FormatSpec& f = find_format(fmt);
  check(!centered || format_uses_centering(f), fmt + ": centered edge rows need a centered format");
  auto kmean = [&](int h, int d) { return centered ? round_bf16(2.5f * std::sin(0.7f * static_cast<float>(d + 13 * h)) + 0.3f) : 0.0f; };
  auto vmean = [&](int h, int d) { return centered ? round_bf16(1.5f * std::cos(0.3f * static_cast<float>(d + 7 * h))) : 0.0f; };
  CacheGeometry g;
  g.n_layers = 1;
  g.n_kv_heads = H;
  g.head_dim = D;
  g.v_head_dim = D;
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_int_distribution<int> grid(-30, 30);
  const int vm = f.kind == FormatKind::kTqVllm ? (1 << f.value_bits) - 1 : 15;
  const auto near_half = near_half_pairs(vm);
  check(!near_half.empty(), fmt + ": no near-half uniform quotients found for m = " + std::to_string(vm));
  const int stride = H * D + 8;  // elements between tokens
  OutlierChannels oc;
  if (f.kind == FormatKind::kTqSplit) {
    const int cnt = split_outlier_count(f, D);
    oc.key.resize(1);
    oc.value.resize(1);
    for (int h = 0; h < H; ++h) {
      std::vector<int> ch;
      for (int i = 0; i < cnt; ++i) ch.push_back((i * 7 + h) % D);
      std::sort(ch.begin(), ch.end());
      ch.erase(std::unique(ch.begin(), ch.end()), ch.end());
      for (int i = 0; static_cast<int>(ch.size()) < cnt; ++i)
        if (!std::binary_search(ch.begin(), ch.end(), i)) ch.insert(std::lower_bound(ch.begin(), ch.end(), i), i);
      oc.key[0].push_back(ch);
      oc.value[0].push_back(ch);
    }
  }
  if (centered) {
    oc.key.resize(1);
    oc.value.resize(1);
    oc.key[0].resize(static_cast<std::size_t>(H));
    oc.value[0].resize(static_cast<std::size_t>(H));
    oc.key_mean.assign(1, std::vector<std::vector<float>>(static_cast<std::size_t>(H), std::vector<float>(static_cast<std::size_t>(D))));
    oc.value_mean = oc.key_mean;
    for (int h = 0; h < H; ++h)
      for (int d = 0; d < D; ++d) {
        oc.key_mean[0][static_cast<std::size_t>(h)][static_cast<std::size_t>(d)] = kmean(h, d);
        oc.value_mean[0][static_cast<std::size_t>(h)][static_cast<std::size_t>(d)] = vmean(h, d);
      }
  }
  std::vector<QuantizerPair> qp;
  for (int h = 0; h < H; ++h) qp.push_back(make_quantizers(f, g, 0, h, &oc));
  std::vector<float> K(static_cast<std::size_t>(n_tok) * stride, 0.0f), Vv(K.size(), 0.0f);
  for (int t = 0; t < n_tok; ++t)
    for (int h = 0; h < H; ++h) {
      float* k = &K[static_cast<std::size_t>(t) * stride + static_cast<std::size_t>(h) * D];
      float* v = &Vv[static_cast<std::size_t>(t) * stride + static_cast<std::size_t>(h) * D];
      const int kind = (t * H + h) % 9;
      const auto& nh = near_half[static_cast<std::size_t>(t * H + h) % near_half.size()];
      for (int d = 0; d < D; ++d) {
        float a = nd(rng), b = nd(rng);
        switch (kind) {
          case 0: a = kmean(h, d); b = vmean(h, d); break;
          case 1: a = d == (t % D) ? 1.5f : 0.0f; b = 0.75f; break;
          case 2: {
            const float e = std::ldexp(1.0f + 0.1f * std::fabs(a), -60 + (d * 68) / D);
            a = (d % 3 ? e : -e);
            b = std::ldexp(b, (d * 17) / D - 8);
            break;
          }
          case 3: b = d == 0 ? -7.5f : (d == 1 ? 7.5f : 0.25f * static_cast<float>(grid(rng))); break;
          case 4: a *= 300.0f; b *= 300.0f; break;
          case 5: a *= 1e-20f; b *= 1e-20f; break;
          case 6: b = d == 0 ? 0.0f : (d == 1 ? nh.first : nh.second[static_cast<std::size_t>(d) % nh.second.size()]); break;
          default: break;
        }
        k[d] = round_bf16(a);
        v[d] = round_bf16(b);
      }
      // Kind 7: TurboQuant rows (centered: minus the means) whose rotation is one spike of norm 2 (+-2 at j): the
      // largest FWHT output a unit vector has, |y| = sqrt(D) before the 1 / sqrt(D), far past the last midpoint (the
      // bin tables' saturated range), and zeros up to rounding elsewhere.
      if (kind == 7)
        for (int side = 0; side < 2; ++side) {
          const auto* tq = dynamic_cast<const TurboQuantMse*>(side ? qp[static_cast<std::size_t>(h)].value.get()
                                                                   : qp[static_cast<std::size_t>(h)].key.get());
          if (!tq) continue;
          std::vector<float> y(static_cast<std::size_t>(D), 0.0f), x(static_cast<std::size_t>(D));
          y[static_cast<std::size_t>((t + 5 * h + side) % D)] = (t + side) % 2 ? -2.0f : 2.0f;
          tq->rotation().inverse(y.data(), x.data());
          float* row = side ? v : k;
          for (int d = 0; d < D; ++d) row[d] = round_bf16(x[static_cast<std::size_t>(d)] + (side ? vmean(h, d) : kmean(h, d)));
        }
      // Records the encoders refuse: NaN in the key, +inf in the value, a value of 70000 (beyond
      // fp16: the uniform max, the TurboQuant norm), keys of 8000 (a TurboQuant norm beyond fp16;
      // fp8 keys saturate and keep them).
      const int pk = (t * H + h) % 13;
      if (poison && pk == 2) k[(t + h) % D] = std::numeric_limits<float>::quiet_NaN();
      if (poison && pk == 5) v[(3 * t + h) % D] = std::numeric_limits<float>::infinity();
      if (poison && pk == 7) v[(t + 2 * h) % D] = 70144.0f;  // a bf16 value
      if (poison && pk == 11)
        for (int d = 0; d < D; ++d) k[d] = 8000.0f;
    }
  const PageLayout pl = page_layout(f, g);
  const int n_pages = (n_tok + 63) / 64 + 1;
  std::vector<std::int64_t> slots(static_cast<std::size_t>(n_tok));
  {
    std::vector<std::int64_t> all(static_cast<std::size_t>(n_pages) * 64);
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    for (int t = 0; t < n_tok; ++t) slots[static_cast<std::size_t>(t)] = t % 11 == 5 ? -1 : all[static_cast<std::size_t>(t)];
  }
  std::vector<std::uint8_t> pool(static_cast<std::size_t>(n_pages) * pl.page_bytes, 0xff);
  std::vector<std::uint16_t> kbf(K.size()), vbf(Vv.size());
  for (std::size_t i = 0; i < K.size(); ++i) {
    kbf[i] = float_to_bf16(K[i]);
    vbf[i] = float_to_bf16(Vv[i]);
  }
  // Poisoned runs also keep every token as the sink of its own sequence (protection rows): a
  // refused record must leave its row untouched too.
  const ProtectLayout prot{poison ? 1 : 0, 0, H, D};
  std::vector<std::uint16_t> cprot(poison ? prot.elements(n_tok) : 1, 0xffff);
  std::uint32_t want_rejected = 0;
  for (int t = 0; t < n_tok; ++t) {
    const std::int64_t sl = slots[static_cast<std::size_t>(t)];
    for (int h = 0; h < H; ++h) {
      const std::size_t r = static_cast<std::size_t>(t) * stride + static_cast<std::size_t>(h) * D;
      if (!cpu_accepts(qp[static_cast<std::size_t>(h)], &K[r], &Vv[r])) {
        ++want_rejected;  // counted whether or not the token has a slot; its record keeps the poison
        continue;
      }
      if (sl >= 0) pack_record(pl, qp[static_cast<std::size_t>(h)], &K[r], &Vv[r], pool, sl, h);
      if (poison) {
        std::memcpy(&cprot[prot.row(t, h, 0)], &kbf[r], 2 * static_cast<std::size_t>(D));
        std::memcpy(&cprot[prot.row(t, h, 0) + static_cast<std::size_t>(D)], &vbf[r], 2 * static_cast<std::size_t>(D));
      }
    }
  }
  cuda::LayerTables tabs(f, g, 0, &oc);
  std::vector<std::uint8_t> pool2(pool.size(), 0xff);
  std::uint8_t* dpool = upload(pool2);
  std::uint16_t* dk = upload(kbf);
  std::uint16_t* dv = upload(vbf);
  std::int64_t* dslots = upload(slots);
  cuda::StoreParams sp;
  sp.fmt = tabs.desc();
  sp.key = dk;
  sp.value = dv;
  sp.key_token_stride = stride;
  sp.value_token_stride = stride;
  sp.slot_mapping = dslots;
  sp.n_tokens = n_tok;
  sp.pool = dpool;
  std::uint32_t* drej = upload(std::vector<std::uint32_t>(1, 0));
  sp.rejected = drej;
  std::uint16_t* dprot = upload(std::vector<std::uint16_t>(cprot.size(), 0xffff));
  const std::vector<std::int32_t> pos0(static_cast<std::size_t>(n_tok), 0);
  std::vector<std::int32_t> seqs(static_cast<std::size_t>(n_tok));
  std::iota(seqs.begin(), seqs.end(), 0);
  std::int32_t* dpos = upload(pos0);
  std::int32_t* dseq = upload(seqs);
  if (poison) {
    sp.protect = prot;
    sp.protect_rows = dprot;
    sp.positions = dpos;
    sp.seq_ids = dseq;
  }
  const cudaError_t se = cuda::store(sp);
  const std::string name = fmt + " d" + std::to_string(D) + " H" + std::to_string(H) + (poison ? " poisoned" : "") +
                           (centered ? " centered" : "") + " edge rows";
  check(!centered || (sp.fmt.key_mean && sp.fmt.value_mean), name + ": centered case without means in the tables");
  check(se == cudaSuccess, name + ": store launch: " + cudaGetErrorString(se));
  KVQ_CUDA_OK(cudaDeviceSynchronize());
  KVQ_CUDA_OK(cudaMemcpy(pool2.data(), dpool, pool2.size(), cudaMemcpyDeviceToHost));
  std::size_t records = 0, differ = 0;
  for (int t = 0; t < n_tok; ++t) {
    const std::int64_t sl = slots[static_cast<std::size_t>(t)];
    if (sl < 0) continue;
    for (int h = 0; h < H; ++h) {
      ++records;
      if (!same_record(pl, pool, pool2, sl, h)) {
        if (differ < 3) std::printf("  %s: token %d head %d (row kind %d) differs\n", name.c_str(), t, h, (t * H + h) % 8);
        ++differ;
      }
    }
  }
  // Untouched bytes (skipped tokens, unused slots) must still hold the poison.
  check(differ == 0, name + ": " + std::to_string(differ) + " of " + std::to_string(records) +
                                      " records differ from the CPU reference");
  check(pool2 == pool, name + ": bytes outside the written records changed");
  std::printf("  %-58s store: %zu / %zu records differ\n", name.c_str(), differ, records);
  std::uint32_t got_rejected = 0;
  KVQ_CUDA_OK(cudaMemcpy(&got_rejected, drej, 4, cudaMemcpyDeviceToHost));
  if (got_rejected != want_rejected) std::printf("  %s: %u records refused, the CPU refuses %u\n", name.c_str(), got_rejected, want_rejected);
  check(got_rejected == want_rejected && (!poison || want_rejected > 0), name + ": refuses the records the CPU refuses");
  if (poison) {
    const std::vector<std::uint16_t> gprot = download(dprot, cprot.size());
    check(gprot == cprot, name + ": protection rows (refused records untouched)");
  }
  // The fast kernels copy their setup from the layer's image (FormatDesc::store_image); the same store building it
  // in the kernel must write the same bytes. The image exists wherever a fast kernel with a setup serves the format.
  // (Not for formats without a TurboQuant side, nor for the head_dim-64 paired kernel of tq-4bit / tq-3bit.)
  const cuda::FormatDesc& fd = sp.fmt;
  const bool tq_side = fd.key == cuda::KeyCode::kTq || fd.value == cuda::ValueCode::kTq;
  const bool paired = fd.key == cuda::KeyCode::kTq && fd.value == cuda::ValueCode::kTq && fd.segments == 1 &&
                      fd.key_bits[0] == fd.value_bits[0];
  const bool want_image = (D == 128 || D == 256 || (D == 64 && !paired)) && tq_side;
  check(want_image == (fd.store_image != nullptr), name + (want_image ? ": the layer has no store image" : ": an unexpected store image"));
  check(!fd.store_image || fd.store_image_bytes == cuda::store_image_bytes(fd), name + ": the store image's size");
  if (sp.fmt.store_image) {
    cuda::StoreParams sb = sp;
    sb.fmt.store_image = nullptr;
    KVQ_CUDA_OK(cudaMemset(dpool, 0xff, pool.size()));
    KVQ_CUDA_OK(cudaMemset(dprot, 0xff, cprot.size() * sizeof(std::uint16_t)));
    KVQ_CUDA_OK(cudaMemset(drej, 0, 4));
    check(cuda::store(sb) == cudaSuccess, name + ": store launch without the image");
    KVQ_CUDA_OK(cudaDeviceSynchronize());
    check(download(dpool, pool.size()) == pool2, name + ": the store without its image writes other bytes");
    if (poison) check(download(dprot, cprot.size()) == cprot, name + ": protection rows without the image");
    std::uint32_t rej2 = 0;
    KVQ_CUDA_OK(cudaMemcpy(&rej2, drej, 4, cudaMemcpyDeviceToHost));
    check(rej2 == got_rejected, name + ": refused records without the image");
    // A size other than the format's is refused and writes nothing.
    const std::size_t ib = cuda::store_image_bytes(sp.fmt);
    std::uint8_t* img = nullptr;
    KVQ_CUDA_OK(cudaMalloc(&img, ib + 16));
    check(cuda::build_store_image(sp.fmt, img, ib + 16) == cudaErrorInvalidValue, name + ": an image of a wrong size built");
    check(cuda::build_store_image(sp.fmt, img + 8, ib) == cudaErrorInvalidValue, name + ": a misaligned image built");
    // A rebuilt image is the layer's, byte for byte (the setup is a function of the tables).
    check(cuda::build_store_image(sp.fmt, img, ib) == cudaSuccess, name + ": image build");
    KVQ_CUDA_OK(cudaDeviceSynchronize());
    check(download(img, ib) == download(static_cast<const std::uint8_t*>(sp.fmt.store_image), ib),
          name + ": a rebuilt store image differs from the layer's");
    cudaFree(img);
  }
  cudaFree(drej);
  cudaFree(dprot);
  cudaFree(dpos);
  cudaFree(dseq);
  cudaFree(dpool);
  cudaFree(dk);
  cudaFree(dv);
  cudaFree(dslots);
}

}  // namespace

// decode() refuses a bad launch with cudaErrorInvalidValue and launches nothing: a workspace one
// byte too small or not 16-byte aligned (the arrival counters are 8-byte atomics, the partials
// 16-byte vectors), a missing pointer, query heads that are not a multiple of the KV heads, a workspace
// sized for fewer query heads than the launch has (G = 9: three sub-groups). The same parameters
// with the workspace as asked for decode (the check that the test is not refusing everything).
void test_decode_rejects() {
  const FormatSpec& f = find_format("tq-4bit");
  CacheGeometry g;
  g.n_layers = 1;
  g.n_kv_heads = 2;
  g.head_dim = 128;
  g.v_head_dim = 128;
  cuda::LayerTables tabs(f, g, 0);
  const std::size_t page_bytes = tabs.desc().page.page_bytes;
  std::uint8_t* dpool = upload(std::vector<std::uint8_t>(page_bytes, 0));
  std::int32_t* dbt = upload(std::vector<std::int32_t>{0});
  std::int32_t* dlens = upload(std::vector<std::int32_t>{10});
  float* dq = upload(std::vector<float>(8 * 128, 0.5f));
  float* dout = nullptr;
  KVQ_CUDA_OK(cudaMalloc(&dout, 8 * 128 * sizeof(float)));
  cuda::DecodeParams p;
  p.fmt = tabs.desc();
  p.pool = dpool;
  p.block_tables = dbt;
  p.max_pages = 1;
  p.seq_lens = dlens;
  p.batch = 1;
  p.q_heads = 8;
  p.max_seq_len = 10;
  p.q = dq;
  p.out = dout;
  p.scale = 0.088f;
  p.workspace_bytes = cuda::decode_workspace_bytes(p);
  std::uint8_t* ws = nullptr;
  KVQ_CUDA_OK(cudaMalloc(&ws, p.workspace_bytes + 64));
  p.workspace = ws;
  check(cuda::decode(p) == cudaSuccess, "rejects: the valid launch");
  KVQ_CUDA_OK(cudaDeviceSynchronize());
  auto refused = [&](const std::string& what, cuda::DecodeParams bad) {
    check(cuda::decode(bad) == cudaErrorInvalidValue, "rejects: " + what);
  };
  cuda::DecodeParams bad = p;
  bad.workspace_bytes = p.workspace_bytes - 1;
  refused("workspace one byte short", bad);
  bad = p;
  bad.workspace = ws + 8;  // enough bytes, 8-byte aligned only
  refused("workspace not 16-byte aligned", bad);
  bad = p;
  bad.pool = nullptr;
  refused("no pool", bad);
  bad = p;
  bad.q_heads = 17;  // 2 KV heads
  refused("query heads not a multiple of the KV heads", bad);
  bad = p;
  bad.q_heads = 0;
  refused("no query heads", bad);
  // Nine query heads per KV head (three CTAs of 3 heads per KV head and split): a workspace sized for 4 is too small.
  bad = p;
  bad.q_heads = 18;
  check(cuda::decode_workspace_bytes(bad) > p.workspace_bytes, "rejects: G = 9 needs a larger workspace");
  refused("G = 9 with the workspace of G = 4", bad);
  KVQ_CUDA_OK(cudaGetLastError());
  cudaFree(ws);
  cudaFree(dpool);
  cudaFree(dbt);
  cudaFree(dlens);
  cudaFree(dq);
  cudaFree(dout);
}

// The benchmarks' hold (`--flush none`): the stream is held at least as long as asked, and a longer hold than the
// bound is refused before anything is launched. The hold is timed between two events recorded while the stream is
// busy with a first hold, so that the host's launch of the timed one (and on a first launch the module's loading) is
// not in the interval: timed from an idle stream, a hold that did not wait at all passed.
void test_hold_stream() {
  cudaEvent_t b, c;
  KVQ_CUDA_OK(cudaEventCreate(&b));
  KVQ_CUDA_OK(cudaEventCreate(&c));
  check(cuda::hold_stream(1'000) == cudaSuccess, "hold: 1 us launched");  // the module loaded
  KVQ_CUDA_OK(cudaDeviceSynchronize());
  check(cuda::hold_stream(200'000) == cudaSuccess, "hold: 200 us launched");
  KVQ_CUDA_OK(cudaEventRecord(b));
  check(cuda::hold_stream(200'000) == cudaSuccess, "hold: a second 200 us launched");
  KVQ_CUDA_OK(cudaEventRecord(c));
  KVQ_CUDA_OK(cudaEventSynchronize(c));
  float second = 0;
  KVQ_CUDA_OK(cudaEventElapsedTime(&second, b, c));
  // The events' resolution is about half a microsecond (cudaEventElapsedTime).
  check(second >= 0.199f, "hold: 200 us held at least 199 us (" + std::to_string(1000.0f * second) + " us)");
  check(cuda::hold_stream(cuda::kMaxHoldNs + 1) == cudaErrorInvalidValue, "hold: longer than kMaxHoldNs refused");
  KVQ_CUDA_OK(cudaGetLastError());
  cudaEventDestroy(b);
  cudaEventDestroy(c);
}

int main(int argc, char** argv) {
  if (!kvq::cudatest::gpu_present()) return 0;
  const bool small = argc > 1 && std::string(argv[1]) == "--small";
  const std::vector<std::string> formats = {"bf16",    "tq-k8v4", "tq-4bit-nc", "tq-k3v4-nc", "tq-3bit-nc",
                                            "tq-4bit", "tq-3bit", "tq-3.5bit",  "tq-2.5bit"};
  std::vector<Case> cases;
  unsigned seed = 11;
  // One case per call; the seeds follow the order of the calls.
  auto add = [&](const std::string& fm, bool centered, int d, int hq, int hkv, std::vector<int> lens, bool fix, int s,
                 int w, int splits, bool values_x2 = false) {
    Case c;
    c.fmt = fm;
    c.d = d;
    c.hq = hq;
    c.hkv = hkv;
    c.lens = std::move(lens);
    c.fixture = fix;
    c.sinks = s;
    c.window = w;
    c.splits = splits;
    c.centered = centered;
    c.values_x2 = values_x2;
    c.seed = seed++;
    cases.push_back(c);
  };
  if (small) {
    // A centered single-segment and a centered split format among them.
    for (const char* fm : {"tq-4bit", "tq-4bit-nc", "tq-3bit-nc", "tq-3.5bit", "tq-2.5bit", "tq-3bit"}) {
      const std::string name = fm;
      add(name, name == "tq-3bit" || name == "tq-2.5bit", 128, 8, 2, {70, 33}, false, 4, 8, 0);
    }
    // Eight heads per CTA: G = 8 with protection (fp8 keys, an outlier split), G = 6 unprotected (4- and 3-bit
    // magic values).
    for (const char* fm : {"tq-k8v4", "tq-3.5bit"}) add(fm, false, 128, 16, 2, {70, 33}, false, 4, 8, 0);
    for (const char* fm : {"tq-4bit-nc", "tq-3bit-nc"}) add(fm, false, 128, 12, 2, {95, 40}, false, 0, 0, 0);
    add("tq-3.5bit", false, 128, 8, 2, {70, 33}, false, 0, 0, 0, true);
    // Clusters of several CTAs (forced splits): an empty split (33 tokens in three splits), more CTAs than heads
    // (G = 1: CTAs that merge no row); with protection (eight heads) the same forced splits merge through the
    // workspace, split 0 with the protected rows.
    add("tq-4bit", false, 128, 8, 2, {129, 33}, false, 0, 0, 3);
    add("tq-4bit", false, 128, 8, 2, {129, 33}, false, 0, 0, 2);  // two: early sends, an empty CTA among them
    add("tq-3.5bit", false, 128, 16, 2, {300, 90}, false, 4, 8, 2);
    add("tq-4bit-nc", false, 128, 2, 2, {129, 700}, false, 0, 0, 5);
    // More than 8 query heads per KV head (G = 16: one CTA of 16 that also reads the protected rows of 16 heads; G = 9:
    // one CTA of 9 heads, forced splits, cluster merge with two rows on warp 0; G = 12: 2 x 6 on the generic kernel; G =
    // 16 unprotected: 3-bit keys through byte windows and fp8 keys; G = 32: 2 x 16; every fast case again in CTAs of at
    // most 8, run_case).
    add("tq-4bit-nc", false, 128, 32, 2, {70, 333}, false, 4, 8, 0);
    add("tq-3.5bit", false, 128, 18, 2, {129, 40}, false, 0, 0, 3);
    add("bf16", false, 128, 24, 2, {95, 40}, false, 0, 0, 0);
    add("tq-3bit", false, 128, 32, 2, {70, 333}, false, 0, 0, 0);
    add("tq-k8v4", false, 128, 32, 2, {129, 33}, false, 0, 0, 2);
    add("tq-4bit-nc", false, 128, 64, 2, {95, 40}, false, 0, 0, 0);
    // The generic kernel at head_dim 256, bf16: key and value words in blocks (decode.cuh), partial chunks and
    // protected rows, so that the sanitizers see that path too; head_dim 96 through the block Hadamard.
    add("bf16", false, 256, 8, 2, {70, 33}, false, 4, 8, 0);
    add("tq-4bit", false, 96, 8, 2, {70, 33}, false, 4, 8, 0);
  } else {
    for (const auto& fm : formats) {
      add(fm, false, 128, 32, 8, {1, 100, 257}, false, 0, 0, 0);
      add(fm, false, 128, 4, 2, {512, 300}, true, 0, 0, 0);              // tiny-gqa fixture, G = 2
      add(fm, false, 128, 16, 2, {64, 65, 1000, 7}, false, 0, 0, 0);     // G = 8, mixed lengths
      add(fm, false, 128, 64, 8, {1, 100, 2100}, false, 0, 0, 0);         // G = 8, 8 KV heads (64 / 8)
      add(fm, false, 128, 16, 2, {512, 300}, true, 0, 0, 0);             // fixture, G = 8
      add(fm, false, 128, 12, 2, {129, 3000}, false, 0, 0, 5);            // G = 6, forced splits
      add(fm, false, 128, 16, 2, {2, 40, 333, 1500}, false, 4, 64, 0);   // G = 8 with protection
      add(fm, false, 128, 2, 2, {129, 3000}, false, 0, 0, 5);             // G = 1, forced splits
      add(fm, false, 128, 8, 2, {129, 33, 700}, false, 0, 0, 2);          // two splits: early sends, an empty CTA
      add(fm, false, 128, 8, 2, {2, 40, 333, 1500}, false, 4, 64, 0);    // protection, lengths below and above S + W
      add(fm, false, 128, 4, 2, {511, 200}, true, 4, 32, 3);             // fixture with protection
      add(fm, false, 64, 32, 8, {77, 300}, false, 0, 0, 0);
      add(fm, false, 256, 16, 4, {33, 190}, false, 2, 16, 0);
      add(fm, false, 96, 12, 4, {95, 250}, false, 0, 0, 0);
      add(fm, false, 128, 32, 2, {64, 1000, 7}, false, 0, 0, 0);         // G = 16: one CTA of 16 heads
      add(fm, false, 128, 22, 2, {129, 3000}, false, 0, 0, 5);            // G = 11, forced splits
      add(fm, false, 128, 64, 2, {512, 300}, true, 0, 0, 0);             // fixture, G = 32 (2 x 16)
      add(fm, false, 128, 20, 2, {2, 40, 1500}, false, 4, 64, 0);        // G = 10 with protection (1 x 10, or 2 x 5)
      add(fm, false, 64, 36, 2, {77, 300}, false, 0, 0, 0);              // G = 18 (3 x 6), generic kernel
    }
    // Centered (calibrated) kvq formats: store with the means subtracted, protected rows scored
    // and accumulated in the centered domain, the value mean added once by the split merge.
    for (const char* fm : {"tq-4bit", "tq-3bit", "tq-3.5bit", "tq-2.5bit"}) {
      add(fm, true, 128, 32, 8, {1, 100, 257}, false, 0, 0, 0);
      add(fm, true, 128, 8, 2, {2, 40, 333, 1500}, false, 4, 64, 0);  // protection: the rows that need the means
      add(fm, true, 128, 16, 2, {2, 40, 1500}, false, 4, 64, 0);      // the same with eight heads per CTA
      add(fm, true, 128, 4, 2, {511, 200}, true, 4, 32, 3);          // fixture keys (real channel means)
      add(fm, true, 64, 16, 4, {77, 300}, false, 2, 16, 0);
      add(fm, true, 96, 12, 4, {95, 250}, false, 4, 8, 0);
    }
    // A value codebook unlike the key one: the fast kernel with four and eight heads per CTA, forced splits,
    // the generic kernel (head_dim 64, 96). tq-3bit's fast kernel shares one table for both sides, so its
    // head_dim 128 cases take the generic kernel (want_fast above checks that they do).
    for (const char* fm : {"tq-4bit", "tq-3bit", "tq-3.5bit", "tq-2.5bit"}) {
      add(fm, false, 128, 32, 8, {1, 100, 257}, false, 0, 0, 0, true);
      add(fm, false, 128, 16, 2, {64, 65, 1000, 7}, false, 0, 0, 0, true);
      add(fm, false, 128, 12, 2, {129, 3000}, false, 0, 0, 5, true);
      add(fm, false, 64, 32, 8, {77, 300}, false, 0, 0, 0, true);
      add(fm, false, 96, 12, 4, {95, 250}, false, 0, 0, 0, true);
    }
  }
  for (const auto& c : cases) run_case(c);
  // The fast kernel's launches of these shapes fit the device in clusters (one wave or less).
  check(g_cluster_cases > 0, "no decode case merged its splits in a cluster");
  check(g_cluster_multi > 0, "no decode case merged its splits in a cluster of two or more CTAs");
  check(g_early_sends > 0, "no decode case merged in a cluster with early sends");
  std::printf("  %d decode cases merged in clusters (and matched the workspace merge bit for bit), %d with early sends\n",
              g_cluster_cases, g_early_sends);
  check(g_sixteen_cases > 0, "no decode case ran in CTAs of more than 8 heads");
  std::printf("  %d decode cases in CTAs of more than 8 heads\n", g_sixteen_cases);
  // Programmatic launches: with KVQ_NO_PDL=1 they are ordinary ones, so the probe must never find the writer
  // unfinished; otherwise (outside compute-sanitizer's reduced set) it must at least once, or the checks of the
  // programmatic decode after the slow writer could not have failed.
  const char* no_pdl = std::getenv("KVQ_NO_PDL");
  const bool pdl_off = no_pdl && no_pdl[0] == '1';
  std::printf("  %d decode cases launched programmatically after a slow writer; a probe found it unfinished in %d%s\n",
              g_pdl_cases, g_pdl_early, pdl_off ? " (KVQ_NO_PDL=1)" : "");
  if (pdl_off) check(g_pdl_early == 0, "with KVQ_NO_PDL=1 a launch after the writer started before it ended");
  else if (!small) check(g_pdl_early > 0, "no programmatic launch started before the writer before it ended");
  test_decode_rejects();
  test_hold_stream();
  if (small) {
    test_store_edges("tq-3.5bit", 128, 2, 45, 3);
    test_store_edges("tq-k8v4", 128, 4, 77, 4, true);
    test_store_edges("tq-4bit", 96, 2, 40, 5, true);  // the generic kernel
    test_store_edges("bf16", 128, 2, 40, 6, true);    // the copy kernel
    test_store_edges("tq-3bit", 128, 2, 45, 7, true, true);    // centered, fast kernel
    test_store_edges("tq-2.5bit", 128, 2, 45, 8, false, true);  // centered split, fast kernel
  } else {
    for (const auto& fm : formats) {
      test_store_edges(fm, 128, 8, 777, 21);
      test_store_edges(fm, 128, 8, 301, 25, true);  // refused records
      test_store_edges(fm, 96, 2, 130, 26, true);    // the generic kernel
      test_store_edges(fm, 64, 3, 301, 22);
      test_store_edges(fm, 256, 2, 150, 23);
      test_store_edges(fm, 128, 40, 37, 24);  // 40 heads: sign masks and channel order from global memory
      // More items than the grid has warps (the fast kernels' later rounds; 2,112 warps on an H200), a last block
      // partly empty.
      test_store_edges(fm, 128, 8, 20001, 31);
      test_store_edges(fm, 64, 8, 40003, 32);
      if (format_uses_centering(find_format(fm))) {
        test_store_edges(fm, 128, 8, 301, 27, true, true);  // centered (fast kernel)
        test_store_edges(fm, 64, 3, 150, 28, false, true);
        test_store_edges(fm, 96, 2, 130, 29, true, true);   // centered (generic kernel)
        test_store_edges(fm, 128, 40, 37, 30, false, true);  // centered, tables from global memory
      }
    }
  }
  return kvq::cudatest::finish();
}
