// GPU tests of the MLA writer and decode kernels (bf16, c8r8, c4r8, c4r4, c3r4, c2r4, mla-tq4,
// mla-tq3) against the scalar references of kvq_quant.
//
// Writer: the GPU packs rows into a pool poisoned with 0xff and must reproduce, byte for byte,
// the pool that the CPU builds with make_quantizers (AffineGroup; TurboQuantMse with the layer's
// rotation) and the page layout; tokens are appended in several calls through a shuffled slot
// mapping, and the bf16 protection ring must match the CPU's after every call (rows leaving the
// window are overwritten). Rows the CPU quantizers refuse (NaN / inf; affine: a group range beyond
// float32; mla-tq: a norm beyond fp16) must be refused and counted by the GPU writer too, leaving
// their slots and ring rows untouched. Decode: the cache is
// packed on the CPU (the oracle), and the kernel's output is compared with absorbed-MLA attention
// in double over the decoded rows of the same packed cache (protected positions from their bf16
// rows): output NMSE <= 1e-5, NaN never passes. Inputs: Gaussian rows with outlier channels and
// constant groups, and the tiny-mla fixture's latent / k_rope rows; mixed lengths, 8 to 128
// heads (also counts that are not a multiple of 16), forced split counts, protection on and off, rows scaled up along the sequence (the
// running maximum keeps moving); mla-tq formats also with another layer's sign diagonal. Other
// widths (multiples of 64, the generic-shape kernels) for every format, and the generic kernels at
// 512 / 64 against the same references; shapes outside the kernels must be refused.
// `--small` runs a reduced set (for compute-sanitizer).
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "harness.hpp"
#include "kvq/cuda_protect.hpp"
#include "kvq/formats.hpp"
#include "kvq/numeric.hpp"
#include "kvq/quantizers.hpp"
#include "kvq/safetensors.hpp"
#include "kvq_cuda_mla.hpp"

using namespace kvq;
using kvq::cudatest::CapturedCall;
using kvq::cudatest::check;
using kvq::cudatest::download;
using kvq::cudatest::upload;
using kvq::cudatest::upload_into;

namespace {

// The shape of the fixture and of DeepSeek-V2/V3 (the tuned kernels); other multiples of 64 run the
// generic-shape kernels.
constexpr int kDc = 512, kDr = 64;

// n token rows [n][dc + dr] of bf16 values (latent then rope), as bf16 bits. Fixture rows of other
// widths repeat the fixture's dims (latent dim d from fixture dim d % 512, RoPE d from d % 64).
std::vector<std::uint16_t> make_rows(int n, bool fixture, unsigned seed, int dc = kDc, int dr = kDr) {
  const int D = dc + dr;
  std::vector<std::uint16_t> r(static_cast<std::size_t>(n) * D);
  if (fixture) {
    static SafetensorsFile f(std::string(KVQ_SOURCE_DIR) + "/models/tiny-mla/reference.safetensors");
    static std::vector<std::vector<float>> lat, rope;
    if (lat.empty())
      for (int l = 0; l < 4; ++l) {
        lat.push_back(f.get("layer" + std::to_string(l) + ".latent").to_float());  // [512][512]
        rope.push_back(f.get("layer" + std::to_string(l) + ".k_rope").to_float());  // [512][64]
      }
    for (int i = 0; i < n; ++i) {
      const int l = (i / 512) % 4, j = i % 512;
      for (int d = 0; d < dc; ++d)
        r[static_cast<std::size_t>(i) * D + d] = float_to_bf16(lat[l][static_cast<std::size_t>(j) * kDc + d % kDc]);
      for (int d = 0; d < dr; ++d)
        r[static_cast<std::size_t>(i) * D + dc + d] = float_to_bf16(rope[l][static_cast<std::size_t>(j) * kDr + d % kDr]);
    }
    return r;
  }
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int i = 0; i < n; ++i) {
    std::uint16_t* row = r.data() + static_cast<std::size_t>(i) * D;
    for (int d = 0; d < D; ++d) {
      float x = nd(rng);
      if (d % 97 == 5) x *= 12.0f;  // outlier channels
      if (d >= dc) x *= 3.0f;
      row[d] = float_to_bf16(x);
    }
    if (i % 13 == 3)
      for (int d = 128 % dc; d < 128 % dc + 64; ++d) row[d] = float_to_bf16(0.75f);  // constant group
    if (i % 17 == 4)
      for (int d = 256 % dc; d < 256 % dc + 64; ++d) row[d] = 0;  // all-zero group
  }
  return r;
}

// Rows for the edges of the writer's arithmetic (content bits cb, RoPE bits rb): per group, a
// half-step grid on [-m/2, m/2] (scale exactly 1: quotients exactly on k + 1/2, ties to even),
// the same grid times 2^-3, values in [64, 72) and (-72, -64] (every code clamped high / low),
// tiny values near FLT_MIN (subnormal bf16: the per-element division path) and values near
// 1e37; the RoPE key alternates a half-step grid on [-(2^rb - 1)/2, (2^rb - 1)/2] and Gaussians.
std::vector<std::uint16_t> make_edge_rows(int n, int cb, int rb, unsigned seed, int dc = kDc, int dr = kDr) {
  const int D = dc + dr;
  std::vector<std::uint16_t> r(static_cast<std::size_t>(n) * D);
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int m = (1 << cb) - 1, mr = (1 << rb) - 1;
  for (int i = 0; i < n; ++i) {
    std::uint16_t* row = r.data() + static_cast<std::size_t>(i) * D;
    for (int g = 0; g < dc / 64; ++g) {
      const int kind = (i + g) % 6;
      for (int d = 0; d < 64; ++d) {
        const int half = static_cast<int>(rng() % static_cast<unsigned>(m + 1)) * 2 - m;  // -m .. m, odd steps
        float x;
        switch (kind) {
          case 0: x = d == 0 ? -0.5f * m : (d == 1 ? 0.5f * m : 0.5f * (d % 5 ? half : half + (half < 0 ? 1 : -1))); break;
          case 1: x = 0.125f * (d == 0 ? -0.5f * m : (d == 1 ? 0.5f * m : 0.5f * half)); break;
          case 2: x = 64.0f + 0.5f * static_cast<float>(rng() % 16); break;
          case 3: x = -64.0f - 0.5f * static_cast<float>(rng() % 16); break;
          case 4: x = nd(rng) * 2e-38f; break;
          default: x = nd(rng) * 1e37f; break;
        }
        row[g * 64 + d] = float_to_bf16(x);
      }
    }
    for (int d = 0; d < dr; ++d) {
      const float x = i % 2 ? 0.5f * static_cast<float>(static_cast<int>(rng() % static_cast<unsigned>(mr + 1)) - mr / 2)
                            : nd(rng) * 3.0f;
      row[dc + d] = float_to_bf16(d % 64 == 0 && i % 2 ? -0.5f * mr : (d % 64 == 1 && i % 2 ? 0.5f * mr : x));
    }
  }
  return r;
}

// Rows for the edges of the mla-tq writer's arithmetic (mf: the format, for its sign diagonal): per
// row i by i % 8, an all-zero latent (norm 0), a one-hot latent, powers of two from 2^-60 to 2^8 (68
// binades in one row; the squares below the norm's last bit vanish), Gaussians times 1e-30, Gaussians times
// 1500 (stored norms near the top of fp16), D times a Hadamard row in the first block (the rotated
// vector is one-hot: exact zeros meet the midpoints), a constant row, and Gaussians with outliers.
std::vector<std::uint16_t> make_tq_edge_rows(int n, const cuda::MlaFormat& mf, unsigned seed) {
  const int dc = mf.d_latent, dr = mf.d_rope, D = dc + dr;
  std::vector<std::uint16_t> r(static_cast<std::size_t>(n) * D);
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  int bs = 1;
  while (2 * bs <= dc) bs *= 2;  // the first (largest) Hadamard block
  for (int i = 0; i < n; ++i) {
    std::uint16_t* row = r.data() + static_cast<std::size_t>(i) * D;
    const int k = static_cast<int>(rng() % static_cast<unsigned>(bs));
    for (int d = 0; d < dc; ++d) {
      const bool neg = (mf.tq_signs[d / 32] >> (d % 32)) & 1u;
      float x;
      switch (i % 8) {
        case 0: x = 0.0f; break;
        case 1: x = d == (i * 37) % dc ? (i % 16 == 1 ? -3.0f : 0.5f) : 0.0f; break;
        case 2: x = std::ldexp(d % 2 ? -1.0f : 1.0f, -60 + (d * 68) / dc); break;
        case 3: x = nd(rng) * 1e-30f; break;
        case 4: x = nd(rng) * 1500.0f; break;
        case 5: x = d < bs ? ((__builtin_popcount(static_cast<unsigned>(k & d)) & 1) != neg ? -1.0f : 1.0f) : 0.0f; break;
        case 6: x = 0.75f; break;
        default: x = nd(rng) * (d % 97 == 5 ? 12.0f : 1.0f); break;
      }
      row[d] = float_to_bf16(x);
    }
    for (int d = 0; d < dr; ++d) row[dc + d] = float_to_bf16(i % 8 == 0 ? 0.0f : nd(rng) * 3.0f);
  }
  return r;
}

// Rows the writers must refuse, in place: a NaN in the latent, an infinity in the RoPE key, -inf in
// the latent, a latent of 8192s (refused by mla-tq only: a stored norm beyond fp16), a latent group
// and a RoPE group spanning -3.3e38 .. 3.3e38 (max - min overflows float32: refused by the affine
// formats; mla-tq refuses the latent one, whose norm overflows, and keeps the bf16 RoPE one).
void poison_rows(std::vector<std::uint16_t>& rows, int dc, int dr) {
  const int D = dc + dr, n = static_cast<int>(rows.size() / static_cast<std::size_t>(D));
  for (int i = 0; i < n; ++i) {
    std::uint16_t* row = rows.data() + static_cast<std::size_t>(i) * D;
    if (i % 29 == 7) row[(i * 13) % dc] = 0x7fc0;           // NaN
    if (i % 29 == 19) row[dc + (i * 5) % dr] = 0x7f80;      // +inf
    if (i % 29 == 24) row[dc - 1 - i % dc] = 0xff80;        // -inf
    if (i % 29 == 13)
      for (int d = 0; d < dc; ++d) row[d] = float_to_bf16(8192.0f);
    if (i % 29 == 2) {
      row[64 * (i % (dc / 64)) + 5] = 0x7f78;  // 3.3e38
      row[64 * (i % (dc / 64)) + 9] = 0xff78;  // -3.3e38
    }
    if (i % 29 == 27) {
      row[dc + 64 * (i % (dr / 64)) + 1] = 0x7f78;
      row[dc + 64 * (i % (dr / 64)) + 2] = 0xff78;
    }
  }
}

struct Cpu {
  FormatSpec f;
  int dc, dr, D;
  cuda::MlaFormat mf;
  QuantizerPair q;
  explicit Cpu(const std::string& name, int layer = 0, int dc_ = kDc, int dr_ = kDr)
      : f(find_format(name)), dc(dc_), dr(dr_), D(dc_ + dr_), mf(cuda::mla_format(f, dc_, dr_, layer)) {
    CacheGeometry g;
    g.n_layers = layer + 1;
    g.mla = true;
    g.d_latent = dc;
    g.d_rope = dr;
    q = make_quantizers(f, g, layer, 0);
  }
  // Writes one token into its page slot exactly as the CPU paged cache lays it out. Returns false,
  // writing nothing, when the CPU quantizers refuse the row (non-finite values; affine: a group
  // range beyond float32; mla-tq: a norm beyond fp16), which the GPU writer must refuse too.
  bool put(std::vector<std::uint8_t>& pool, std::int64_t slot, const std::uint16_t* row) const {
    const PageLayout& L = mf.page;
    std::uint8_t* page = pool.data() + static_cast<std::size_t>(slot / L.tokens) * L.page_bytes;
    const int off = static_cast<int>(slot % L.tokens);
    std::vector<float> x(static_cast<std::size_t>(D));
    for (int d = 0; d < D; ++d) x[static_cast<std::size_t>(d)] = bf16_to_float(row[d]);
    std::vector<std::uint8_t> kc(q.key->code_bytes()), vc(q.value->code_bytes()), km(q.key->meta_bytes() + 1),
        vm(q.value->meta_bytes() + 1);
    try {
      q.key->encode(x.data(), kc.data(), km.data());
      q.value->encode(x.data() + dc, vc.data(), vm.data());
    } catch (const std::exception&) {
      return false;
    }
    std::memcpy(page + L.key_code(0, off), kc.data(), kc.size());
    std::memcpy(page + L.value_code(0, off), vc.data(), vc.size());
    if (L.meta_bytes) {
      std::uint8_t* meta = page + L.key_meta(0, off);
      std::memset(meta, 0, L.meta_bytes);
      std::memcpy(meta, km.data(), q.key->meta_bytes());
      std::memcpy(meta + q.key->meta_bytes(), vm.data(), q.value->meta_bytes());
    }
    return true;
  }
  void get(const std::vector<std::uint8_t>& pool, std::int64_t slot, double* out) const {
    const PageLayout& L = mf.page;
    const std::uint8_t* page = pool.data() + static_cast<std::size_t>(slot / L.tokens) * L.page_bytes;
    const int off = static_cast<int>(slot % L.tokens);
    std::vector<float> x(static_cast<std::size_t>(D));
    const std::uint8_t* meta = page + L.key_meta(0, off);
    q.key->decode(page + L.key_code(0, off), meta, x.data());
    q.value->decode(page + L.value_code(0, off), meta + q.key->meta_bytes(), x.data() + dc);
    for (int d = 0; d < D; ++d) out[d] = x[static_cast<std::size_t>(d)];
  }
};

// ---- writer ------------------------------------------------------------------------------
void test_writer(const std::string& fmt, bool fixture, int sinks, int window, bool edge = false, int dc = kDc, int dr = kDr,
                 bool generic = false, int layer = 0, bool poison = false) {
  const Cpu cpu(fmt, layer, dc, dr);
  const int D = dc + dr;
  const PageLayout& L = cpu.mf.page;
  const std::vector<int> lens = {1, 70, 300, 131};
  const int B = static_cast<int>(lens.size());
  int total = 0, pages = 0;
  for (int l : lens) {
    total += l;
    pages += (l + 63) / 64;
  }
  std::vector<std::uint16_t> rows = edge ? (cpu.mf.tq ? make_tq_edge_rows(total, cpu.mf, 13)
                                                     : make_edge_rows(total, cpu.mf.content_bits, cpu.mf.rope_bits, 13, dc, dr))
                                          : make_rows(total, fixture, 11, dc, dr);
  if (poison) poison_rows(rows, dc, dr);
  std::uint32_t* drej = upload(std::vector<std::uint32_t>(1, 0));
  std::uint32_t want_rejected = 0;
  // Block tables: a shuffled page order per sequence.
  std::vector<int> perm(static_cast<std::size_t>(pages));
  for (int i = 0; i < pages; ++i) perm[static_cast<std::size_t>(i)] = i;
  std::mt19937 rng(5);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<std::vector<int>> bt(static_cast<std::size_t>(B));
  std::vector<int> row0(static_cast<std::size_t>(B));
  for (int b = 0, k = 0, r = 0; b < B; ++b) {
    row0[static_cast<std::size_t>(b)] = r;
    r += lens[static_cast<std::size_t>(b)];
    for (int p = 0; p < (lens[static_cast<std::size_t>(b)] + 63) / 64; ++p) bt[static_cast<std::size_t>(b)].push_back(perm[static_cast<std::size_t>(k++)]);
  }
  MlaProtectLayout prot{sinks, window, dc, dr};
  const std::size_t pool_bytes = static_cast<std::size_t>(pages) * L.page_bytes;
  std::vector<std::uint8_t> cpool(pool_bytes, 0xff);
  std::vector<std::uint16_t> cprot(std::max<std::size_t>(prot.elements(B), 1), 0xffff);
  std::uint8_t* dpool = upload(cpool);
  std::uint16_t* dprot = upload(cprot);
  // Appends in 3 calls: each call writes the next chunk of every sequence.
  std::vector<int> done(static_cast<std::size_t>(B), 0);
  bool ok_pool = true, ok_prot = true;
  for (int call = 0; call < 3; ++call) {
    std::vector<std::uint16_t> lat, rop;
    std::vector<std::int64_t> slots;
    std::vector<std::int32_t> pos, seq, after(static_cast<std::size_t>(B));
    std::vector<bool> refused_row(static_cast<std::size_t>(total), false);
    for (int b = 0; b < B; ++b) {
      const int l = lens[static_cast<std::size_t>(b)];
      const int upto = call == 2 ? l : std::min(l, (call + 1) * (l / 3 + 1));
      for (int i = done[static_cast<std::size_t>(b)]; i < upto; ++i) {
        const std::uint16_t* row = rows.data() + static_cast<std::size_t>(row0[static_cast<std::size_t>(b)] + i) * D;
        lat.insert(lat.end(), row, row + dc);
        rop.insert(rop.end(), row + dc, row + D);
        const std::int64_t slot = static_cast<std::int64_t>(bt[static_cast<std::size_t>(b)][static_cast<std::size_t>(i / 64)]) * 64 + i % 64;
        slots.push_back(slot);
        pos.push_back(i);
        seq.push_back(b);
        if (!cpu.put(cpool, slot, row)) {
          refused_row[static_cast<std::size_t>(row0[static_cast<std::size_t>(b)] + i)] = true;
          ++want_rejected;
        }
      }
      after[static_cast<std::size_t>(b)] = upto;
      // CPU ring: a position is kept if it is a sink or among the last `window` after this call.
      for (int i = done[static_cast<std::size_t>(b)]; i < upto; ++i) {
        const int s = prot.slot(i);
        if (s < 0 || (i >= sinks && i < upto - window) || refused_row[static_cast<std::size_t>(row0[static_cast<std::size_t>(b)] + i)])
          continue;
        std::memcpy(cprot.data() + prot.row(b, s), rows.data() + static_cast<std::size_t>(row0[static_cast<std::size_t>(b)] + i) * D, D * 2);
      }
      done[static_cast<std::size_t>(b)] = upto;
    }
    if (slots.empty()) continue;
    // Shuffle the tokens of the call (the kernel must not depend on order).
    std::vector<std::size_t> order(slots.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<std::uint16_t> lat2(lat.size()), rop2(rop.size());
    std::vector<std::int64_t> slots2(slots.size());
    std::vector<std::int32_t> pos2(pos.size()), seq2(seq.size());
    for (std::size_t i = 0; i < order.size(); ++i) {
      const std::size_t o = order[i];
      std::memcpy(&lat2[i * dc], &lat[o * dc], dc * 2);
      std::memcpy(&rop2[i * dr], &rop[o * dr], dr * 2);
      slots2[i] = slots[o];
      pos2[i] = pos[o];
      seq2[i] = seq[o];
    }
    cuda::MlaStoreParams sp;
    sp.fmt = cpu.mf;
    sp.latent = upload(lat2);
    sp.rope = upload(rop2);
    sp.slot_mapping = upload(slots2);
    sp.n_tokens = static_cast<int>(slots2.size());
    sp.pool = dpool;
    sp.protect = prot;
    sp.protect_rows = prot.enabled() ? dprot : nullptr;
    sp.positions = upload(pos2);
    sp.seq_ids = upload(seq2);
    sp.protect_seq_lens = upload(after);
    sp.generic = generic;
    sp.rejected = drej;
    KVQ_CUDA_OK(cuda::mla_store(sp));
    KVQ_CUDA_OK(cudaDeviceSynchronize());
    const std::vector<std::uint8_t> gpool = download(dpool, pool_bytes);
    std::size_t bad = 0;
    for (std::size_t i = 0; i < pool_bytes; ++i) bad += gpool[i] != cpool[i];
    if (bad) std::printf("  %s call %d: %zu pool bytes differ\n", fmt.c_str(), call, bad);
    ok_pool = ok_pool && bad == 0;
    if (prot.enabled()) {
      const std::vector<std::uint16_t> gprot = download(dprot, cprot.size());
      ok_prot = ok_prot && gprot == cprot;
    }
    cudaFree(const_cast<std::uint16_t*>(sp.latent));
    cudaFree(const_cast<std::uint16_t*>(sp.rope));
    cudaFree(const_cast<std::int64_t*>(sp.slot_mapping));
    cudaFree(const_cast<std::int32_t*>(sp.positions));
    cudaFree(const_cast<std::int32_t*>(sp.seq_ids));
    cudaFree(const_cast<std::int32_t*>(sp.protect_seq_lens));
  }
  const std::string what = fmt + (edge ? " edge" : fixture ? " fixture" : " random") + (poison ? " poisoned" : "") + " S=" +
                           std::to_string(sinks) + " W=" + std::to_string(window) + " d_c=" + std::to_string(dc) +
                           " d_r=" + std::to_string(dr) + (generic ? " generic" : "") + (layer ? " layer=" + std::to_string(layer) : "");
  check(ok_pool, "writer bytes identical to the CPU reference: " + what);
  if (prot.enabled()) check(ok_prot, "writer protection ring identical: " + what);
  const std::uint32_t got_rejected = download(drej, 1)[0];
  if (got_rejected != want_rejected) std::printf("  %s: %u tokens refused, CPU refuses %u\n", what.c_str(), got_rejected, want_rejected);
  check(got_rejected == want_rejected && (!poison || want_rejected > 0), "writer refuses the rows the CPU refuses: " + what);
  cudaFree(drej);
  cudaFree(dpool);
  cudaFree(dprot);
}

// ---- decode ------------------------------------------------------------------------------
struct Case {
  std::string fmt;
  int heads = 16;
  std::vector<int> lens;
  bool fixture = false;
  int sinks = 0, window = 0;
  int splits = 0;
  unsigned seed = 1;
  bool ramp = false;  // rows scaled up along the sequence: the running maximum keeps moving
  int layer = 0;      // mla-tq: whose sign diagonal
  int dc = kDc, dr = kDr;
  bool generic = false;  // the generic-shape kernel at 512 / 64
};

void test_decode(const Case& c) {
  const Cpu cpu(c.fmt, c.layer, c.dc, c.dr);
  const int dc = c.dc, dr = c.dr, D = dc + dr;
  const PageLayout& L = cpu.mf.page;
  const int B = static_cast<int>(c.lens.size()), H = c.heads;
  int maxlen = 0, total = 0;
  for (int l : c.lens) {
    maxlen = std::max(maxlen, l);
    total += l;
  }
  const int max_pages = std::max(1, (maxlen + 63) / 64);
  std::vector<std::uint16_t> rows = make_rows(total, c.fixture, c.seed, dc, dr);
  std::vector<int> row0(static_cast<std::size_t>(B));
  for (int b = 0, r = 0; b < B; ++b) {
    row0[static_cast<std::size_t>(b)] = r;
    r += c.lens[static_cast<std::size_t>(b)];
  }
  if (c.ramp)
    for (int b = 0; b < B; ++b)
      for (int i = 0; i < c.lens[static_cast<std::size_t>(b)]; ++i) {
        std::uint16_t* row = rows.data() + static_cast<std::size_t>(row0[static_cast<std::size_t>(b)] + i) * D;
        const float f = 0.25f + 4.0f * static_cast<float>(i) / static_cast<float>(c.lens[static_cast<std::size_t>(b)]);
        for (int d = 0; d < D; ++d) row[d] = float_to_bf16(bf16_to_float(row[d]) * f);
      }
  const int pages = B * max_pages;
  std::vector<int> perm(static_cast<std::size_t>(pages));
  for (int i = 0; i < pages; ++i) perm[static_cast<std::size_t>(i)] = i;
  std::mt19937 rng(c.seed * 7 + 1);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<std::int32_t> bt(perm.begin(), perm.end());
  std::vector<std::uint8_t> pool(static_cast<std::size_t>(pages) * L.page_bytes, 0xff);
  MlaProtectLayout prot{c.sinks, c.window, dc, dr};
  std::vector<std::uint16_t> prow(std::max<std::size_t>(prot.elements(B), 1), 0xffff);
  for (int b = 0; b < B; ++b)
    for (int i = 0; i < c.lens[static_cast<std::size_t>(b)]; ++i) {
      const std::uint16_t* row = rows.data() + static_cast<std::size_t>(row0[static_cast<std::size_t>(b)] + i) * D;
      cpu.put(pool, static_cast<std::int64_t>(bt[static_cast<std::size_t>(b * max_pages + i / 64)]) * 64 + i % 64, row);
      const int s = prot.slot(i);
      if (s >= 0) std::memcpy(prow.data() + prot.row(b, s), row, D * 2);  // in order: the ring keeps the last W
    }
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> q(static_cast<std::size_t>(B) * H * D);
  for (auto& x : q) x = nd(rng);
  const float scale = c.fixture ? 0.06f : 2.0f / std::sqrt(static_cast<float>(D));

  // Reference in double.
  const bool use_prot = cpu.mf.content_bits != 16 && prot.enabled();
  std::vector<double> ref(static_cast<std::size_t>(B) * H * dc, 0.0);
  for (int b = 0; b < B; ++b) {
    const int len = c.lens[static_cast<std::size_t>(b)];
    const std::int64_t pb = use_prot ? prot.packed_begin(len) : 0, pe = use_prot ? prot.packed_end(len) : len;
    std::vector<double> kv(static_cast<std::size_t>(len) * D);
    for (int i = 0; i < len; ++i) {
      double* dst = kv.data() + static_cast<std::size_t>(i) * D;
      if (i < pb || i >= pe) {
        const std::uint16_t* r = prow.data() + prot.row(b, prot.slot(i));
        for (int d = 0; d < D; ++d) dst[d] = bf16_to_float(r[d]);
      } else {
        cpu.get(pool, static_cast<std::int64_t>(bt[static_cast<std::size_t>(b * max_pages + i / 64)]) * 64 + i % 64, dst);
      }
    }
    for (int h = 0; h < H; ++h) {
      const float* qh = q.data() + (static_cast<std::size_t>(b) * H + h) * D;
      std::vector<double> s(static_cast<std::size_t>(len));
      double mx = -INFINITY;
      for (int i = 0; i < len; ++i) {
        double a = 0;
        for (int d = 0; d < D; ++d) a += static_cast<double>(qh[d]) * kv[static_cast<std::size_t>(i) * D + d];
        s[static_cast<std::size_t>(i)] = a * scale;
        mx = std::max(mx, s[static_cast<std::size_t>(i)]);
      }
      double den = 0;
      double* o = ref.data() + (static_cast<std::size_t>(b) * H + h) * dc;
      for (int i = 0; i < len; ++i) {
        const double p = std::exp(s[static_cast<std::size_t>(i)] - mx);
        den += p;
        for (int d = 0; d < dc; ++d) o[d] += p * kv[static_cast<std::size_t>(i) * D + d];
      }
      if (den > 0)
        for (int d = 0; d < dc; ++d) o[d] /= den;
    }
  }

  cuda::MlaDecodeParams p;
  p.fmt = cpu.mf;
  p.pool = upload(pool);
  p.block_tables = upload(bt);
  p.max_pages = max_pages;
  p.seq_lens = upload(std::vector<std::int32_t>(c.lens.begin(), c.lens.end()));
  p.batch = B;
  p.heads = H;
  p.max_seq_len = maxlen;
  p.q = upload(q);
  std::vector<float> poison(static_cast<std::size_t>(B) * H * dc, NAN);
  p.out = upload(poison);
  p.scale = scale;
  p.protect = prot;
  p.protect_rows = upload(prow);
  p.num_splits = c.splits;
  p.generic = c.generic;
  p.workspace_bytes = cuda::mla_decode_workspace_bytes(p);
  KVQ_CUDA_OK(cudaMalloc(&p.workspace, p.workspace_bytes));
  // c4r4 / c4r8 / c2r4 at 512 / 64 without protection can run the warpgroup kernel: each such case runs
  // it (kWarpgroup) and the register-fragment kernel (kFragment) against the same reference.
  const bool wg_expected = !c.generic && !use_prot && dc == kDc && dr == kDr &&
                           (c.fmt == "c4r4" || c.fmt == "c4r8" || c.fmt == "c2r4");
  {
    // kAuto: the warpgroup kernel only with at least kMlaWgMinPages pages per split.
    const bool auto_wg = wg_expected && max_pages >= cuda::kMlaWgMinPages * cuda::mla_decode_splits(p);
    p.kernel = cuda::MlaKernel::kAuto;
    check(cuda::mla_decode_uses_wgmma(p) == auto_wg, "decode: kAuto picks the warpgroup kernel where expected: " + c.fmt);
    p.kernel = cuda::MlaKernel::kWarpgroup;
    check(cuda::mla_decode_uses_wgmma(p) == wg_expected, "decode: the warpgroup kernel wherever it applies: " + c.fmt);
  }
  for (int kern = 0; kern < (wg_expected ? 2 : 1); ++kern)
  for (int warps : {16, 8}) {  // both accepted values of MlaDecodeParams::warps (same kernel)
    p.kernel = kern == 1 ? cuda::MlaKernel::kFragment : cuda::MlaKernel::kWarpgroup;
    p.warps = warps;
    upload_into(p.out, poison);
    KVQ_CUDA_OK(cuda::mla_decode(p));
    KVQ_CUDA_OK(cudaDeviceSynchronize());
    const std::vector<float> out = download(p.out, poison.size());
    double num = 0, den = 0;
    bool finite = true;
    for (std::size_t i = 0; i < out.size(); ++i) {
      finite = finite && std::isfinite(out[i]);
      const double e = out[i] - ref[i];
      num += e * e;
      den += ref[i] * ref[i];
    }
    const double nmse = den > 0 ? num / den : num;
    std::string lens;
    for (int l : c.lens) lens += std::to_string(l) + ",";
    const std::string what = c.fmt + " H=" + std::to_string(H) + " lens=" + lens + (c.fixture ? " fixture" : c.ramp ? " ramp" : " random") +
                             " S=" + std::to_string(c.sinks) + " W=" + std::to_string(c.window) + " splits=" +
                             std::to_string(cuda::mla_decode_splits(p)) + " warps=" + std::to_string(warps) +
                             (c.layer ? " layer=" + std::to_string(c.layer) : "") +
                             (dc != kDc || dr != kDr ? " d_c=" + std::to_string(dc) + " d_r=" + std::to_string(dr) : "") +
                             (c.generic ? " generic" : "") + (wg_expected ? (kern ? " fragment" : " wgmma") : "");
    std::printf("  %-52s nmse %.3g\n", what.c_str(), nmse);
    check(finite && nmse <= 1e-5, "decode NMSE <= 1e-5: " + what);
    if (warps != 8) continue;
    // The same call captured in a CUDA graph (its kernels are programmatic launches unless
    // KVQ_NO_PDL=1) and replayed twice on another stream, over a workspace filled with 0xff and a
    // poisoned output, must give this launch's bits again.
    KVQ_CUDA_OK(cudaMemset(p.workspace, 0xff, p.workspace_bytes));
    upload_into(p.out, poison);
    CapturedCall call([&](cudaStream_t st) { return cuda::mla_decode(p, st); });
    KVQ_CUDA_OK(call.launched());
    bool same = true;
    for (int r = 0; r < 2; ++r) {
      call.replay();
      const std::vector<float> again = download(p.out, poison.size());
      same = same && std::memcmp(again.data(), out.data(), out.size() * sizeof(float)) == 0;
    }
    check(same, "decode: graph replays give the launch's bits: " + what);
  }
  for (const void* v : {static_cast<const void*>(p.pool), static_cast<const void*>(p.block_tables),
                        static_cast<const void*>(p.seq_lens), static_cast<const void*>(p.q), static_cast<const void*>(p.out),
                        static_cast<const void*>(p.protect_rows), static_cast<const void*>(p.workspace)})
    cudaFree(const_cast<void*>(v));
}

// Shapes outside the kernels are refused with cudaErrorInvalidValue before anything is read.
void test_rejects() {
  struct Bad {
    const char* fmt;
    int dc, dr;
  };
  for (const Bad& x : {Bad{"c4r4", 1088, 64}, Bad{"c2r4", 512, 320}, Bad{"bf16", 2048, 64}, Bad{"mla-tq4", 512, 320}}) {
    const cuda::MlaFormat mf = cuda::mla_format(find_format(x.fmt), x.dc, x.dr);
    const std::string what = std::string(x.fmt) + " d_c=" + std::to_string(x.dc) + " d_r=" + std::to_string(x.dr);
    check(!cuda::mla_supported(mf), "unsupported shape reported: " + what);
    cuda::MlaDecodeParams p;
    p.fmt = mf;
    p.batch = 1;
    p.heads = 16;
    check(cuda::mla_decode(p) == cudaErrorInvalidValue, "decode refuses " + what);
    cuda::MlaStoreParams sp;
    sp.fmt = mf;
    sp.n_tokens = 1;
    check(cuda::mla_store(sp) == cudaErrorInvalidValue, "writer refuses " + what);
  }
  for (int heads : {0, 129}) {  // head counts outside 1..128
    cuda::MlaDecodeParams p;
    p.fmt = cuda::mla_format(find_format("c4r4"));
    p.batch = 1;
    p.heads = heads;
    check(cuda::mla_decode(p) == cudaErrorInvalidValue, "decode refuses heads=" + std::to_string(heads));
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (!cudatest::gpu_present()) return 0;
  const bool small = argc > 1 && std::string(argv[1]) == "--small";
  if (small) {
    test_writer("c4r4", false, 2, 8);
    test_writer("c3r4", false, 0, 0, true);
    test_decode({"c4r4", 16, {5, 130}, false, 2, 8, 0, 3});
    test_decode({"bf16", 16, {70}, false, 0, 0, 0, 4});
    test_decode({"mla-tq4", 16, {5, 130}, false, 2, 8, 0, 3});
    test_decode({"mla-tq3", 32, {70}, false, 0, 0, 0, 4});
    test_writer("c3r4", false, 2, 8, false, 576, 128);
    test_writer("mla-tq4", false, 2, 8, false, kDc, kDr, false, 0, true);
    test_writer("c4r4", false, 2, 8, false, kDc, kDr, false, 0, true);
    test_writer("mla-tq3", false, 0, 0, true, 576, 128);
    test_decode({"c4r4", 16, {5, 130}, false, 2, 8, 0, 3, false, 0, 576, 128});
    test_decode({"bf16", 16, {70}, false, 0, 0, 0, 4, false, 0, kDc, kDr, true});
    test_decode({"mla-tq4", 16, {5, 130}, false, 2, 8, 0, 3, false, 1, 576, 128});
    test_decode({"c2r4", 16, {5, 130}, false, 2, 8, 0, 3, false, 0, 256, 64});  // 32-token tiles
    test_decode({"bf16", 16, {70}, false, 0, 0, 0, 4, false, 0, 256, 64});
    test_decode({"c4r4", 8, {5, 130}, false, 2, 8, 0, 3});  // a partial head group
    test_decode({"c4r4", 24, {5, 130, 64}, false, 0, 0, 0, 3});  // warpgroup kernel, a partial head group
    test_decode({"c2r4", 16, {70}, true, 0, 0, 2, 4});
    test_decode({"c2r4", 24, {70}, false, 0, 0, 0, 4, false, 0, 256, 64});
    test_rejects();
    return cudatest::finish();
  }
  const std::vector<std::string> fmts = {"bf16", "c8r8", "c4r8", "c4r4", "c3r4", "c2r4"};
  for (const auto& f : fmts) {
    test_writer(f, false, 0, 0);
    test_writer(f, false, 4, 32);
    test_writer(f, true, 4, 16);
    if (f != "bf16") test_writer(f, false, 0, 0, true);
  }
  for (const auto& f : fmts) test_writer(f, false, 4, 32, false, kDc, kDr, false, 0, true);  // refused rows
  test_writer("c4r4", false, 4, 32, false, 576, 128, false, 0, true);
  test_writer("c2r4", false, 4, 32, false, kDc, kDr, true, 0, true);
  // mla-tq4 / mla-tq3 writer: TurboQuantMse of the latent at every width (block Hadamard 576 = 512 + 64,
  // 192 = 128 + 64), other layers' sign diagonals, edge rows and refused rows.
  for (const auto& f : {"mla-tq4", "mla-tq3"}) {
    test_writer(f, false, 0, 0);
    test_writer(f, false, 4, 32);
    test_writer(f, true, 4, 16);
    test_writer(f, false, 0, 0, true);
    test_writer(f, false, 4, 32, false, kDc, kDr, false, 3);
    test_writer(f, false, 0, 0, true, kDc, kDr, false, 2);
    test_writer(f, false, 4, 32, false, kDc, kDr, false, 0, true);
    for (const auto& sh : {std::array<int, 2>{256, 64}, {64, 128}, {576, 64}, {1024, 256}, {192, 128}, {448, 64}}) {
      test_writer(f, false, 4, 32, false, sh[0], sh[1], false, 1);
      test_writer(f, false, 0, 0, true, sh[0], sh[1]);
    }
    test_writer(f, false, 4, 32, false, 320, 64, false, 0, true);
  }
  for (const auto& f : fmts) {
    test_decode({f, 16, {1, 64, 65, 700, 2500}, false, 0, 0, 0, 1});
    test_decode({f, 32, {1000, 3, 129}, true, 4, 64, 0, 2});
    test_decode({f, 16, {4, 20, 100, 1300}, false, 4, 16, 5, 3});  // token aging: 20 and 100 have rows that left the window
  }
  test_decode({"c4r4", 128, {900, 64}, true, 4, 128, 0, 4});
  test_decode({"c2r4", 128, {2049}, false, 4, 128, 3, 5});
  test_decode({"bf16", 128, {1500, 17}, true, 0, 0, 0, 6});
  test_decode({"c4r4", 64, {0, 300}, false, 0, 0, 0, 7});
  // The warpgroup kernel (c4r4, c4r8, c2r4 without protection): fixture rows, 128 heads, partial head groups,
  // empty sequences, a moving maximum, one split and many.
  for (const auto& f : {"c4r4", "c4r8", "c2r4"}) {
    test_decode({f, 32, {1000, 3, 129}, true, 0, 0, 0, 41});
    test_decode({f, 128, {900, 64, 1}, true, 0, 0, 0, 42});
    test_decode({f, 40, {0, 300, 64}, false, 0, 0, 0, 43});
    test_decode({f, 16, {3000, 777}, false, 0, 0, 2, 44, true});  // moving maximum
    test_decode({f, 8, {4100, 63}, false, 0, 0, 1, 45, true});
    test_decode({f, 16, {2500, 129}, false, 0, 0, 40, 46});
  }
  for (const auto& f : {"bf16", "c4r4", "c2r4"}) test_decode({f, 16, {3000, 777}, false, 4, 16, 2, 8, true});  // moving maximum
  // mla-tq4 / mla-tq3 decode (the pages come from the CPU quantizers, which the writer tests above
  // show the GPU writer reproduces byte for byte).
  for (const auto& f : {"mla-tq4", "mla-tq3"}) {
    test_decode({f, 16, {1, 64, 65, 700, 2500}, false, 0, 0, 0, 1});
    test_decode({f, 32, {1000, 3, 129}, true, 4, 64, 0, 2});
    test_decode({f, 16, {4, 20, 100, 1300}, false, 4, 16, 5, 3});  // token aging
    test_decode({f, 16, {3000, 777}, false, 4, 16, 2, 8, true});   // moving maximum
    test_decode({f, 128, {900, 64}, true, 4, 128, 0, 4, false, 3});  // layer 3's sign diagonal
    test_decode({f, 64, {0, 300}, false, 0, 0, 0, 7, false, 1});
  }
  // Other widths (multiples of 64: the generic-shape writer and decode), and the generic path at
  // 512 / 64 against the same references as the tuned kernels.
  const int shapes[][2] = {{256, 64}, {64, 128}, {576, 64}, {1024, 256}, {192, 128}};
  for (const auto& f : fmts) {
    for (const auto& sh : shapes) {
      test_writer(f, false, 4, 32, false, sh[0], sh[1]);
      if (f != "bf16") test_writer(f, false, 0, 0, true, sh[0], sh[1]);
    }
    test_writer(f, true, 4, 16, false, kDc, kDr, true);
  }
  for (const auto& f : fmts) {
    test_decode({f, 16, {1, 64, 65, 700}, false, 0, 0, 0, 11, false, 0, 256, 64});
    test_decode({f, 32, {1000, 3, 129}, true, 4, 64, 0, 12, false, 0, 1024, 256});
    test_decode({f, 16, {4, 20, 100, 1300}, false, 4, 16, 5, 13, false, 0, 576, 64});  // token aging
    test_decode({f, 16, {300, 17}, false, 0, 0, 0, 14, false, 0, 64, 128});
    test_decode({f, 16, {1, 64, 65, 700, 2500}, true, 4, 16, 0, 15, false, 0, kDc, kDr, true});
  }
  for (const auto& f : {"mla-tq4", "mla-tq3"}) {  // block Hadamard rotations: 576 = 512 + 64, 192 = 128 + 64
    test_decode({f, 16, {1, 64, 65, 700}, false, 0, 0, 0, 21, false, 0, 256, 64});
    test_decode({f, 32, {1000, 3, 129}, true, 4, 64, 0, 22, false, 2, 576, 128});
    test_decode({f, 16, {4, 20, 100, 1300}, false, 4, 16, 5, 23, false, 0, 1024, 64});  // token aging
    test_decode({f, 16, {300, 17}, false, 0, 0, 0, 25, false, 3, 192, 128});
    test_decode({f, 16, {1, 64, 65, 700, 2500}, true, 4, 16, 0, 24, false, 1, kDc, kDr, true});
  }
  test_decode({"c4r4", 128, {900, 64}, true, 4, 128, 0, 16, false, 0, 192, 128});
  test_decode({"c2r4", 64, {0, 300}, false, 0, 0, 0, 18, false, 0, 320, 64});
  for (const auto& f : {"bf16", "c4r4"}) test_decode({f, 16, {3000, 777}, false, 4, 16, 2, 17, true, 0, 256, 64});  // moving maximum
  // Head counts that are not a multiple of 16 (the last group of 16 is partial): TP-split DeepSeek / Kimi (8 heads)
  // and others, in the tuned and the generic kernels.
  test_decode({"c4r4", 8, {1, 64, 700, 2500}, false, 4, 16, 0, 31});
  test_decode({"bf16", 24, {1000, 3}, true, 0, 0, 0, 32});
  test_decode({"mla-tq4", 40, {300, 129}, false, 4, 16, 0, 33});
  test_decode({"c2r4", 8, {700, 65}, true, 4, 16, 0, 34, false, 0, 256, 64});
  test_decode({"mla-tq3", 20, {500}, false, 0, 0, 0, 35, false, 1, 576, 64});
  // Odd batch x heads x splits: the mla-tq section of the workspace must still be 16-byte aligned.
  test_decode({"mla-tq4", 7, {300}, false, 4, 16, 3, 36});
  test_decode({"mla-tq3", 5, {200}, false, 4, 16, 3, 37, false, 0, 256, 64});
  test_rejects();
  return cudatest::finish();
}
