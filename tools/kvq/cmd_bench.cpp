// kvq bench decode: times the CUDA decode kernels (ours: bf16 and every TurboQuant-family format)
// and the store kernel on the GPU, and merges the peers' timings (bench/gpu/peers.py: PyTorch
// SDPA with the FlashAttention backend on a bf16 cache, vLLM's Triton TurboQuant decode) into
// one table or JSON object (bench/results/decode-gqa-*.json).
//
// Method (docs/kernels.md): CUDA events around each decode launch (one kernel: the last CTA of
// each group merges the splits), warm-up, median of --reps runs, L2 flushed before every run
// (--flush: a read-only pass by default, bench_gpu.hpp), and enough copies of the cache that the
// inputs rotated over are >= 4x L2. GB/s counts every byte the format must read
// (codes, metadata, block tables). copy_gbps: (read + written) / time of a 4 GiB device copy; gpu_uuid names the
// host, cuda_driver the CUDA version its driver supports. --protect none,paper times every row also with the
// paper's protected rows (4 sinks + 128 recent rows in bf16, read by the decode's protected split); rows carry
// "protect".
#include <fmt/core.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "command.hpp"
#include "kvq/common.hpp"
#include "kvq/formats.hpp"

#if defined(KVQ_WITH_KVQ_CUDA)
#include <cuda_runtime.h>

#include "bench_gpu.hpp"
#include "kvq_cuda.hpp"
#endif

namespace kvq::cli {
namespace {

struct BenchOptions {
  std::string batches = "8,32", contexts = "4096,16384,65536";
  std::string formats = "bf16,tq-k8v4,tq-4bit-nc,tq-k3v4-nc,tq-3bit-nc,tq-4bit,tq-3.5bit,tq-3bit";
  int q_heads = 32, kv_heads = 8, head_dim = 128, reps = 60, warmup = 5, store_tokens = 0, splits = 0, gap_ms = 0;
  int arena_pad_mib = 0;  // device memory allocated before the arena: moves the pools' physical placement
  int protect_chunks = -1;  // DecodeParams::protect_chunks (-1: the launcher's estimate)
  unsigned seed = 7;  // page order and query of each (batch, context): the same for every format
  bool json = false, centered = false, no_cluster_merge = false, eight_heads = false, step = false;
  std::string pages = "random";  // page order in the pool
  std::string peers, commit = "unknown", command, flush = "read";
  std::string protect = "none";  // protection policies, each row once per policy (bf16 rows: none only)
};

#if defined(KVQ_WITH_KVQ_CUDA)

using gpu::DevBuf;
using gpu::L2Flush;
using gpu::ok;
using gpu::time_us;
using gpu::wall_seconds;

using PeerKey = std::tuple<std::string, int, int>;  // impl (+ format), batch, context

// The --protect policy's rows per sequence and KV head, read by the decode's protected split (the packed range
// shrinks by as many).
ProtectLayout protect_of(const std::string& name, int kv_heads, int head_dim) {
  const ProtectionPolicy pp = gpu::bench_protection(name);
  return ProtectLayout{pp.sinks, pp.window, kv_heads, head_dim};
}

void run_decode_bench(const BenchOptions& o) {
  int dev = 0;
  ok(cudaGetDevice(&dev), "cudaGetDevice");
  cudaDeviceProp prop{};
  ok(cudaGetDeviceProperties(&prop, dev), "cudaGetDeviceProperties");
  const std::size_t l2 = static_cast<std::size_t>(prop.l2CacheSize);
  const L2Flush flush(o.flush, l2, nullptr);
  gpu::series_gap_ms = o.gap_ms;
  const double copy_gbps = gpu::copy_gbps(nullptr, flush);

  std::map<PeerKey, double> peer_us;
  nlohmann::json peer_info = nullptr;
  if (!o.peers.empty()) {
    std::ifstream in(o.peers);
    if (!in) fail("cannot open peers file '" + o.peers + "'");
    nlohmann::json pj = nlohmann::json::parse(in);
    peer_info = pj.value("versions", nlohmann::json::object());
    gpu::check_peers_method(pj, o.peers, o.flush, o.gap_ms, o.arena_pad_mib);
    for (const auto& r : pj["rows"]) {
      if (r["us"].is_null()) continue;
      std::string impl = r["impl"].get<std::string>();
      if (r.contains("format") && !r["format"].is_null()) impl += ":" + r["format"].get<std::string>();
      peer_us[{impl, r["batch"].get<int>(), r["context"].get<int>()}] = r["us"].get<double>();
    }
  }
  auto peer = [&](const std::string& impl, int b, int ctx) -> nlohmann::json {
    auto it = peer_us.find({impl, b, ctx});
    if (it == peer_us.end()) return nullptr;
    return it->second;
  };

  const std::vector<int> batches = parse_int_list(o.batches), contexts = parse_int_list(o.contexts);
  const std::vector<std::string> prots = split_list(o.protect);  // names checked by the option (list_of)
  CacheGeometry g;
  g.n_layers = 1;
  g.n_kv_heads = o.kv_heads;
  g.head_dim = o.head_dim;
  g.v_head_dim = o.head_dim;
  nlohmann::json rows = nlohmann::json::array(), store_rows = nlohmann::json::array();

  // Every decode row's pool is carved from one arena allocated here, at its start. A pool allocated per row landed
  // wherever the allocator put it after the rows before it: tq-k8v4 at 8 x 16K read 1.10x slower (65.8 against
  // 59.6 us) after bf16's 32 x 64K pool had been freed than before, whatever the page order
  // (bench/results/decode-gqa-bench-method-2026-12-02.md).
  const auto pool_need = [&](std::size_t page_bytes, int B, int ctx) {
    const std::size_t pool_bytes = static_cast<std::size_t>(B) * static_cast<std::size_t>((ctx + 63) / 64) * page_bytes;
    const std::size_t copies = std::clamp<std::size_t>((4 * l2 + pool_bytes - 1) / pool_bytes, 1, 64);
    return std::pair{pool_bytes, copies};
  };
  std::size_t arena_bytes = 0;
  for (const auto& fname : split_list(o.formats)) {
    const std::size_t pb = page_layout(find_format(fname), g).page_bytes;
    for (int B : batches)
      for (int ctx : contexts) {
        const auto [pool_bytes, copies] = pool_need(pb, B, ctx);
        arena_bytes = std::max(arena_bytes, pool_bytes * copies);
      }
  }
  // --arena-pad: an allocation held before the arena, so that a run can place the pools elsewhere in physical memory
  // (the same code reads at different speeds from different placements: bench/gpu/variants.sh's PADS).
  std::optional<DevBuf> pad;  // none at 0: the default run allocates as before the option existed
  if (o.arena_pad_mib > 0) pad.emplace(static_cast<std::size_t>(o.arena_pad_mib) << 20);
  DevBuf arena(arena_bytes);
  // --step: a decode step (the store of each sequence's newest token, then the decode) timed on its own stream,
  // flushed on that stream; a blocking stream, so it is ordered with the legacy stream's work too.
  cudaStream_t sst = nullptr;
  std::unique_ptr<L2Flush> sflush;
  if (o.step) {
    ok(cudaStreamCreate(&sst), "stream");
    sflush = std::make_unique<L2Flush>(o.flush, l2, sst);
  }

  for (const auto& fname : split_list(o.formats)) {
    const FormatSpec& f = find_format(fname);
    OutlierChannels oc;
    if (f.kind == FormatKind::kTqSplit) {  // evenly spaced channels: sizes and speed do not depend on which
      const int cnt = split_outlier_count(f, o.head_dim);
      std::vector<int> ch;
      for (int i = 0; i < cnt; ++i) ch.push_back(i * o.head_dim / cnt);
      oc.key.assign(1, std::vector<std::vector<int>>(static_cast<std::size_t>(o.kv_heads), ch));
      oc.value = oc.key;
    }
    if (o.centered && format_uses_centering(f)) {  // calibrated kvq formats: per-channel means (values do not matter)
      oc.key.resize(1);
      oc.value.resize(1);
      oc.key[0].resize(static_cast<std::size_t>(o.kv_heads));
      oc.value[0].resize(static_cast<std::size_t>(o.kv_heads));
      std::vector<float> m(static_cast<std::size_t>(o.head_dim));
      for (int d = 0; d < o.head_dim; ++d) m[static_cast<std::size_t>(d)] = 0.25f * std::sin(0.7f * static_cast<float>(d));
      oc.key_mean.assign(1, std::vector<std::vector<float>>(static_cast<std::size_t>(o.kv_heads), m));
      oc.value_mean = oc.key_mean;
    }
    cuda::LayerTables tabs(f, g, 0, &oc);
    const cuda::FormatDesc& fd = tabs.desc();
    const PageLayout& pg = fd.page;

    // Store kernel: store_tokens tokens x kv_heads rows from random bf16 keys / values; by default
    // the smallest power of two whose key and value rows fill 4x L2 (65,536 tokens on the H200 at
    // 8 x 128), like the decode pools.
    {
      std::size_t n = static_cast<std::size_t>(o.store_tokens);
      if (n == 0) {
        const std::size_t row = static_cast<std::size_t>(o.kv_heads) * static_cast<std::size_t>(o.head_dim) * 4;
        for (n = 1024; n * row < 4 * l2; n *= 2) {
        }
      }
      const std::size_t elems = n * static_cast<std::size_t>(o.kv_heads) * static_cast<std::size_t>(o.head_dim);
      DevBuf k(elems * 2), v(elems * 2), slots(n * 8), pool((n / 64 + 1) * pg.page_bytes);
      ok(cuda::fill_random_bf16(k.as<std::uint16_t>(), elems, 1), "fill");
      ok(cuda::fill_random_bf16(v.as<std::uint16_t>(), elems, 2), "fill");
      std::vector<std::int64_t> hs(n);
      for (std::size_t i = 0; i < n; ++i) hs[i] = static_cast<std::int64_t>(i);
      ok(cudaMemcpy(slots.p, hs.data(), n * 8, cudaMemcpyHostToDevice), "copy");
      cuda::StoreParams sp;
      sp.fmt = fd;
      sp.key = k.as<std::uint16_t>();
      sp.value = v.as<std::uint16_t>();
      sp.slot_mapping = slots.as<std::int64_t>();
      sp.n_tokens = static_cast<int>(n);
      sp.pool = pool.as<std::uint8_t>();
      const double t_start = wall_seconds();
      const double us =
          time_us(nullptr, flush, o.warmup, std::max(20, o.reps / 3), [&](int) { ok(cuda::store(sp), "store"); });
      const double t_end = wall_seconds();
      const double bytes = static_cast<double>(elems) * 4.0 + static_cast<double>(n) * o.kv_heads *
                                                                  (pg.key_code_bytes + pg.value_code_bytes + pg.meta_bytes) +
                           static_cast<double>(n) * 8.0;
      store_rows.push_back({{"format", fname}, {"tokens", n}, {"kv_heads", o.kv_heads}, {"head_dim", o.head_dim},
                            {"us", us}, {"gbps", bytes / (us * 1e3)}, {"fraction_of_copy", bytes / (us * 1e3) / copy_gbps},
                            {"centered", fd.key_mean != nullptr}, {"t_start", t_start}, {"t_end", t_end}});
    }

    for (int B : batches) {
      for (int ctx : contexts) {
        const int pages_per_seq = (ctx + 63) / 64;
        const std::size_t n_pages = static_cast<std::size_t>(B) * pages_per_seq;
        const auto [pool_bytes, copies] = pool_need(pg.page_bytes, B, ctx);
        if (pool_bytes * copies > arena_bytes)
          throw Error(fmt::format("bench decode: {}'s pages ({} bytes) are larger than its format's page layout said",
                                  fname, pg.page_bytes));
        std::uint8_t* const pool = arena.as<std::uint8_t>();
        ok(cuda::fill_random_pages(fd, pool, n_pages * copies, 3), "fill pages");
        // The page order and the query of a shape depend on (seed, batch, context) only, so every format at that
        // shape reads the same permutation and no row depends on which other rows ran.
        std::seed_seq sq{o.seed, static_cast<unsigned>(B), static_cast<unsigned>(ctx)};
        std::mt19937 rng(sq);
        std::vector<std::int32_t> ids(n_pages);
        for (std::size_t i = 0; i < n_pages; ++i) ids[i] = static_cast<std::int32_t>(i);
        if (o.pages == "random") std::shuffle(ids.begin(), ids.end(), rng);  // a fragmented pool
        std::vector<std::int32_t> lens(static_cast<std::size_t>(B), ctx);
        DevBuf bt(n_pages * 4), dl(static_cast<std::size_t>(B) * 4);
        ok(cudaMemcpy(bt.p, ids.data(), n_pages * 4, cudaMemcpyHostToDevice), "copy");
        ok(cudaMemcpy(dl.p, lens.data(), lens.size() * 4, cudaMemcpyHostToDevice), "copy");
        const std::size_t qn = static_cast<std::size_t>(B) * o.q_heads * o.head_dim;
        std::vector<float> hq(qn);
        std::normal_distribution<float> nd(0.0f, 1.0f);
        for (auto& x : hq) x = nd(rng);
        DevBuf q(qn * 4), out(qn * 4);
        ok(cudaMemcpy(q.p, hq.data(), qn * 4, cudaMemcpyHostToDevice), "copy");
        for (const auto& pname : prots) {
          if (f.kind == FormatKind::kBf16 && pname != "none") continue;  // bf16 rows need no protection
          const ProtectLayout prot = protect_of(pname, o.kv_heads, o.head_dim);
          const std::size_t prot_elems = prot.enabled() ? static_cast<std::size_t>(prot.elements(B)) : 0;
          std::optional<DevBuf> prot_rows;  // none without protection: the default rows allocate as before
          if (prot.enabled()) {
            prot_rows.emplace(prot_elems * 2);
            ok(cuda::fill_random_bf16(prot_rows->as<std::uint16_t>(), prot_elems, 9), "fill");
          }
          cuda::DecodeParams p;
          p.fmt = fd;
          p.block_tables = bt.as<std::int32_t>();
          p.max_pages = pages_per_seq;
          p.seq_lens = dl.as<std::int32_t>();
          p.batch = B;
          p.q_heads = o.q_heads;
          p.max_seq_len = ctx;
          p.q = q.as<float>();
          p.out = out.as<float>();
          p.scale = 1.0f / std::sqrt(static_cast<float>(o.head_dim));
          p.cluster_merge = !o.no_cluster_merge;
          p.sixteen_heads = !o.eight_heads;
          p.num_splits = o.splits;
          p.protect_chunks = o.protect_chunks;
          p.protect = prot;
          p.protect_rows = prot.enabled() ? prot_rows->as<std::uint16_t>() : nullptr;
          p.workspace_bytes = cuda::decode_workspace_bytes(p);
          DevBuf ws(p.workspace_bytes);
          p.workspace = ws.p;
          const double t_start = wall_seconds();
          const double us = time_us(nullptr, flush, o.warmup, o.reps, [&](int rep) {
            p.pool = pool + static_cast<std::size_t>(rep % static_cast<int>(copies)) * pool_bytes;
            ok(cuda::decode(p), "decode");
          });
          const double t_end = wall_seconds();
          // The decode step: the store of each sequence's newest token (position ctx - 1: its slot in the pages of the
          // copy the run reads) and the decode after it, timed together; the decode launched as usual, then
          // programmatically (DecodeParams::programmatic: its CTAs start while the store runs).
          nlohmann::json step_us = nullptr, step_pdl_us = nullptr;
          if (o.step) {
            const std::size_t ne = static_cast<std::size_t>(B) * static_cast<std::size_t>(o.kv_heads) * static_cast<std::size_t>(o.head_dim);
            DevBuf nk(ne * 2), nv(ne * 2), nslot(static_cast<std::size_t>(B) * 8);
            ok(cuda::fill_random_bf16(nk.as<std::uint16_t>(), ne, 11), "fill");
            ok(cuda::fill_random_bf16(nv.as<std::uint16_t>(), ne, 12), "fill");
            std::vector<std::int64_t> hs(static_cast<std::size_t>(B));
            for (int b = 0; b < B; ++b)
              hs[static_cast<std::size_t>(b)] =
                  static_cast<std::int64_t>(ids[static_cast<std::size_t>(b) * pages_per_seq + (ctx - 1) / 64]) * 64 + (ctx - 1) % 64;
            ok(cudaMemcpy(nslot.p, hs.data(), hs.size() * 8, cudaMemcpyHostToDevice), "copy");
            cuda::StoreParams sp;
            sp.fmt = fd;
            sp.key = nk.as<std::uint16_t>();
            sp.value = nv.as<std::uint16_t>();
            sp.slot_mapping = nslot.as<std::int64_t>();
            sp.n_tokens = B;
            std::optional<DevBuf> npos, nseq;
            if (prot.enabled()) {  // the newest token is in the window: its bf16 rows go to the protection buffer too
              std::vector<std::int32_t> hp(static_cast<std::size_t>(B), ctx - 1), hb(static_cast<std::size_t>(B));
              for (int b = 0; b < B; ++b) hb[static_cast<std::size_t>(b)] = b;
              npos.emplace(hp.size() * 4);
              nseq.emplace(hb.size() * 4);
              ok(cudaMemcpy(npos->p, hp.data(), hp.size() * 4, cudaMemcpyHostToDevice), "copy");
              ok(cudaMemcpy(nseq->p, hb.data(), hb.size() * 4, cudaMemcpyHostToDevice), "copy");
              sp.protect = prot;
              sp.protect_rows = prot_rows->as<std::uint16_t>();
              sp.positions = npos->as<std::int32_t>();
              sp.seq_ids = nseq->as<std::int32_t>();
            }
            for (const bool pdl : {false, true}) {
              cuda::DecodeParams ps = p;
              ps.programmatic = pdl;
              const double t = time_us(sst, *sflush, o.warmup, o.reps, [&](int rep) {
                std::uint8_t* const base = pool + static_cast<std::size_t>(rep % static_cast<int>(copies)) * pool_bytes;
                sp.pool = base;
                ps.pool = base;
                ok(cuda::store(sp, sst), "store");
                ok(cuda::decode(ps, sst), "decode");
              });
              (pdl ? step_pdl_us : step_us) = t;
            }
          }
          const double bytes = static_cast<double>(cuda::decode_bytes_read(fd, lens.data(), B, prot));
          const nlohmann::json flash = peer("sdpa_flash", B, ctx);
          const std::string vpair = f.kind == FormatKind::kTqVllm ? fname : f.pair;
          const nlohmann::json vllm = vpair.empty() ? nlohmann::json(nullptr) : peer("vllm_triton:" + vpair, B, ctx);
          nlohmann::json row = {{"format", fname},
                                {"batch", B},
                                {"context", ctx},
                                {"q_heads", o.q_heads},
                                {"kv_heads", o.kv_heads},
                                {"head_dim", o.head_dim},
                                {"protect", pname},
                                {"us", us},
                                {"gbps", bytes / (us * 1e3)},
                                {"speedup_vs_bf16_flash", flash.is_null() ? nlohmann::json(nullptr) : nlohmann::json(flash.get<double>() / us)},
                                {"speedup_vs_vllm_triton", vllm.is_null() ? nlohmann::json(nullptr) : nlohmann::json(vllm.get<double>() / us)},
                                {"bytes", bytes},
                                {"splits", cuda::decode_splits(p)},
                                {"protect_chunks", cuda::decode_protect_chunks(p)},
                                {"cluster_merge", cuda::decode_uses_cluster_merge(p)},
                                {"cta_heads", cuda::decode_cta_heads(p)},
                                {"kernel", cuda::decode_uses_fast_kernel(p) ? "fast" : "generic"},
                                {"compression_vs_bf16", static_cast<double>(bf16_token_bytes(g)) /
                                                            static_cast<double>(fd.kv_heads * (pg.key_code_bytes + pg.value_code_bytes + pg.meta_bytes))},
                                {"vllm_pair", vpair.empty() ? nlohmann::json(nullptr) : nlohmann::json(vpair)},
                                {"centered", fd.key_mean != nullptr},
                                {"t_start", t_start},
                                {"t_end", t_end}};
          if (o.step) {
            row["step_us"] = step_us;
            row["step_programmatic_us"] = step_pdl_us;
          }
          rows.push_back(row);
          const std::string tag = pname == "none" ? "" : " protect=" + pname;
          if (!o.json)
            fmt::print(stderr, "{:<11} B={:<3} ctx={:<6}{} {:9.1f} us {:7.0f} GB/s  vs flash {}  vs vllm {}  ({} kernel)\n", fname, B,
                       ctx, tag, us, bytes / (us * 1e3), row["speedup_vs_bf16_flash"].dump(), row["speedup_vs_vllm_triton"].dump(),
                       row["kernel"].get<std::string>());
          if (!o.json && o.step)
            fmt::print(stderr, "{:<11} B={:<3} ctx={:<6}{} step (store + decode) {:9.1f} us, decode launched programmatically {:9.1f} us\n",
                       fname, B, ctx, tag, step_us.get<double>(), step_pdl_us.get<double>());
        }
      }
    }
  }
  // Peer rows as measured, for reference.
  for (const auto& [k, us] : peer_us) {
    rows.push_back({{"format", "peer:" + std::get<0>(k)}, {"batch", std::get<1>(k)}, {"context", std::get<2>(k)},
                    {"q_heads", o.q_heads}, {"kv_heads", o.kv_heads}, {"head_dim", o.head_dim}, {"us", us},
                    {"gbps", nullptr}, {"speedup_vs_bf16_flash", nullptr}, {"speedup_vs_vllm_triton", nullptr}});
  }
  if (sst) {
    sflush.reset();
    cudaStreamDestroy(sst);
  }
  nlohmann::json res = {{"gpu", prop.name},     {"copy_gbps", copy_gbps}, {"commit", o.commit},
                        {"command", o.command}, {"sms", prop.multiProcessorCount}, {"l2_bytes", l2},
                        {"peers", peer_info},   {"rows", rows},           {"store", store_rows},
                        {"flush", flush.mode()}, {"pages", o.pages}, {"seed", o.seed}, {"gap_ms", o.gap_ms},
                        {"arena_pad_mib", o.arena_pad_mib}};
  res.update(gpu::host_fields(prop));
  if (o.json) {
    fmt::print("{}\n", res.dump(1));
  } else {
    fmt::print("gpu {} ({})  copy {:.0f} GB/s\n", prop.name, gpu::gpu_uuid(prop), copy_gbps);
    for (const auto& s : store_rows)
      fmt::print("store {:<11} {:8.1f} us {:7.0f} GB/s ({:.0f}% of copy)\n", s["format"].get<std::string>(),
                 s["us"].get<double>(), s["gbps"].get<double>(), 100 * s["fraction_of_copy"].get<double>());
  }
}
#endif

void register_bench(CLI::App& app) {
  auto* bench = app.add_subcommand("bench", "GPU kernel benchmarks");
  bench->require_subcommand(1);
  auto o = std::make_shared<BenchOptions>();
  auto* dec = bench->add_subcommand("decode", "decode attention over GQA caches: ours vs bf16 FlashAttention and vLLM");
  dec->add_option("--batch", o->batches, "batch sizes");
  dec->add_option("--context", o->contexts, "context lengths");
  dec->add_option("--formats", o->formats, "cache formats");
  dec->add_option("--q-heads", o->q_heads, "query heads");
  dec->add_option("--kv-heads", o->kv_heads, "KV heads");
  dec->add_option("--head-dim", o->head_dim, "head dim");
  dec->add_option("--reps", o->reps, "timed runs (median)")->check(CLI::Range(1, 100000));
  dec->add_option("--warmup", o->warmup, "warm-up runs");
  dec->add_option("--store-tokens", o->store_tokens, "tokens per store-kernel run (0: rows of 4x L2)")->check(CLI::Range(0, 1 << 24));
  dec->add_option("--peers", o->peers, "JSON written by bench/gpu/peers.py");
  dec->add_option("--commit", o->commit, "commit recorded in the result");
  dec->add_option("--command-line", o->command, "command recorded in the result");
  dec->add_option("--flush", o->flush,
                  "L2 flush before every timed run: read (clean L2), write (memset, dirty L2) or none (a "
                  "diagnostic: what the run before left in L2 stays)")
      ->check(CLI::IsMember({"read", "write", "none"}));
  dec->add_option("--pages", o->pages, "page order in the pool: random (default) or sequential")
      ->check(CLI::IsMember({"random", "sequential"}));
  dec->add_option("--gap-ms", o->gap_ms,
                  "idle GPU before each timed series (ms), so that no row starts under the power state the rows before it "
                  "left (bench/gpu/peers.py takes the same option)")
      ->check(CLI::Range(0, 10000));
  dec->add_option("--seed", o->seed, "seed of each shape's page order and query (with batch and context)");
  dec->add_option("--arena-pad", o->arena_pad_mib,
                  "MiB of device memory allocated before the rows' arena, to measure a row at another physical placement")
      ->check(CLI::Range(0, 1 << 16));
  dec->add_option("--splits", o->splits, "splits per sequence and KV head (0: the launcher's choice)")
      ->check(CLI::Range(0, 256));
  dec->add_option("--protect-chunks", o->protect_chunks,
                  "with protection, the 32-token chunks of split 0's packed range that the protected rows replace (-1: "
                  "the launcher's estimate)")
      ->check(CLI::Range(-1, 1 << 20));
  dec->add_flag("--json", o->json, "print one JSON object");
  dec->add_flag("--no-cluster-merge", o->no_cluster_merge,
                "merge the fast kernel's splits through the workspace even where they fit in thread-block clusters");
  dec->add_flag("--eight-heads", o->eight_heads,
                "more than 8 query heads per KV head in CTAs of at most 8 (not the fast kernel's sixteen-head CTAs)");
  dec->add_flag("--step", o->step,
                "also time each row's decode step: the store of every sequence's newest token, then the decode, launched "
                "as usual and programmatically (step_us, step_programmatic_us)");
  dec->add_option("--protect", o->protect,
                  "protection policies, each row once per policy: none, paper (4 sinks + 128 recent rows in bf16; not for "
                  "bf16 rows)")
      ->check(list_of({"none", "paper"}));
  dec->add_flag("--centered", o->centered, "kvq's calibrated formats (tq-4bit, tq-3bit, tq-3.5bit, tq-2.5bit) with per-channel means");
  dec->callback([o] {
#if defined(KVQ_WITH_KVQ_CUDA)
    run_decode_bench(*o);
#else
    fail("kvq was built without CUDA (configure with -DKVQ_CUDA=ON)");
#endif
  });
}

KVQ_REGISTER_COMMAND("bench", register_bench);

}  // namespace
}  // namespace kvq::cli
