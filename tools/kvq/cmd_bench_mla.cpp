// kvq bench mla: times the CUDA MLA kernels (absorbed decode over bf16, QuantMLA affine and
// mla-tq4 / mla-tq3 caches, and the fused writer) on the GPU and prints a table or one JSON object
// (bench/results/decode-mla-*.json).
//
// Method (docs/kernels.md): the decode + combine launches are captured once in a CUDA graph and
// replayed; before every timed replay the L2 is flushed (--flush: a read-only pass over 4x L2 by
// default, or the earlier memset; bench_gpu.hpp) and the replay is
// bracketed by CUDA events; median of --reps replays after --warmup. Caches are written by the
// writer kernel (every format) from random bf16 rows, so metadata is realistic. mla-tq rows include
// the pre-kernel that rotates the queries and protected rows.
// GB/s counts every byte the
// kernel must read (whole pages of the packed range, protected bf16 rows, block tables).
// speedup_vs_bf16 divides our bf16 kernel's time for the same batch / context / heads by the
// row's time. speedup_vs_flashmla divides FlashMLA's bf16 decode time for the same batch /
// context / heads (from --peers, the JSON of bench/gpu/peers_mla.py) by the row's time; null
// without a peers file or where FlashMLA did not run.
// copy_gbps: (read + written) / time of a 4 GiB device-to-device copy, in the same run.
#include <fmt/core.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "command.hpp"
#include "kvq/common.hpp"
#include "kvq/formats.hpp"

#if defined(KVQ_WITH_KVQ_CUDA)
#include <cuda_runtime.h>

#include "bench_gpu.hpp"
#include "kvq_cuda.hpp"
#include "kvq_cuda_mla.hpp"
#endif

namespace kvq::cli {
namespace {

struct MlaBenchOptions {
  std::string batches = "8,32", contexts = "4096,32768,131072", heads = "16,128";
  std::string formats = "bf16,c8r8,c4r4,c2r4,mla-tq4", protect = "none,paper";
  int reps = 30, warmup = 3, store_tokens = 1 << 20, warps = 0, splits = 0, d_latent = 512, d_rope = 64, gap_ms = 0;
  unsigned seed = 7;  // page order and queries of each (batch, context): the same for every format
  bool json = false, generic = false;
  std::string kernel = "auto";
  std::string commit = "unknown", command, flush = "read", peers, pages = "random";
};

#if defined(KVQ_WITH_KVQ_CUDA)

using gpu::DevBuf;
using gpu::L2Flush;
using gpu::ok;
using gpu::time_us;
using gpu::wall_seconds;

MlaProtectLayout protect_of(const std::string& name, int dc, int dr) {
  const ProtectionPolicy pp = gpu::bench_protection(name);
  return MlaProtectLayout{pp.sinks, pp.window, dc, dr};
}

void run_mla_bench(const MlaBenchOptions& o) {
  int dev = 0;
  ok(cudaGetDevice(&dev), "cudaGetDevice");
  cudaDeviceProp prop{};
  ok(cudaGetDeviceProperties(&prop, dev), "cudaGetDeviceProperties");
  const std::size_t l2 = static_cast<std::size_t>(prop.l2CacheSize);
  cudaStream_t st;
  ok(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "stream");
  const L2Flush flush(o.flush, l2, st);
  gpu::series_gap_ms = o.gap_ms;
  const double copy_gbps = gpu::copy_gbps(st, flush);
  const int dc = o.d_latent, dr = o.d_rope, D = dc + dr;
  if (!o.peers.empty() && (dc != 512 || dr != 64)) fail("--peers: FlashMLA's rows are for d_c = 512, d_r = 64 only");

  // FlashMLA's times, when a peers file is given; it must use this run's flush method.
  std::map<std::tuple<int, int, int>, double> flashmla_us;
  nlohmann::json peer_info = "not measured: no --peers file (bench/gpu/peers_mla.py)";
  if (!o.peers.empty()) {
    std::ifstream in(o.peers);
    if (!in) fail("cannot open peers file '" + o.peers + "'");
    const nlohmann::json pj = nlohmann::json::parse(in);
    gpu::check_peers_method(pj, o.peers, o.flush, o.gap_ms);
    peer_info = pj.value("versions", nlohmann::json::object());
    for (const auto& r : pj.at("rows"))
      if (r.value("impl", std::string()) == "flashmla" && !r["us"].is_null())
        flashmla_us[{r.at("batch").get<int>(), r.at("context").get<int>(), r.at("heads").get<int>()}] = r["us"].get<double>();
  }

  const std::vector<int> batches = parse_int_list(o.batches), contexts = parse_int_list(o.contexts),
                         heads_list = parse_int_list(o.heads);
  const std::vector<std::string> prots = split_list(o.protect);

  // Random bf16 source rows, reused chunk by chunk to fill the pools.
  const std::size_t src_tokens = static_cast<std::size_t>(o.store_tokens);
  DevBuf src(src_tokens * D * 2), slots(src_tokens * 8);
  ok(cuda::fill_random_bf16(src.as<std::uint16_t>(), src_tokens * D, 1), "fill");
  {
    std::vector<std::int64_t> hs(src_tokens);
    for (std::size_t i = 0; i < src_tokens; ++i) hs[i] = static_cast<std::int64_t>(i);
    ok(cudaMemcpy(slots.p, hs.data(), src_tokens * 8, cudaMemcpyHostToDevice), "copy");
  }
  const std::size_t lat_b = 2 * static_cast<std::size_t>(dc), rope_b = 2 * static_cast<std::size_t>(dr), row_b = lat_b + rope_b;
  DevBuf lat(src_tokens * lat_b), rope(src_tokens * rope_b);
  ok(cudaMemcpy2D(lat.p, lat_b, src.p, row_b, lat_b, src_tokens, cudaMemcpyDeviceToDevice), "split");
  ok(cudaMemcpy2D(rope.p, rope_b, src.as<std::uint8_t>() + lat_b, row_b, rope_b, src_tokens, cudaMemcpyDeviceToDevice), "split");

  nlohmann::json rows = nlohmann::json::array(), store_rows = nlohmann::json::array();
  std::map<std::tuple<int, int, int>, double> bf16_us;
  // Every decode row's pool is carved from one arena allocated here, at its start, so that no row's speed depends on
  // where the allocator put its pool after the rows before it (kvq bench decode does the same:
  // bench/results/decode-gqa-bench-method-2026-12-02.md).
  std::size_t arena_bytes = 0;
  for (const auto& fname : split_list(o.formats)) {
    const std::size_t pb = cuda::mla_format(find_format(fname), dc, dr).page.page_bytes;
    for (int B : batches)
      for (int ctx : contexts)
        arena_bytes = std::max(arena_bytes, static_cast<std::size_t>(B) * static_cast<std::size_t>((ctx + 63) / 64) * pb);
  }
  DevBuf arena(arena_bytes);

  for (const auto& fname : split_list(o.formats)) {
    const cuda::MlaFormat mf = cuda::mla_format(find_format(fname), dc, dr);
    if (!cuda::mla_supported(mf))
      fail(fmt::format("format '{}' has no CUDA kernel at d_c = {}, d_r = {} (multiples of 64, d_c <= 1024, d_r <= 256)",
                       fname, dc, dr));
    const PageLayout& pg = mf.page;
    auto store_params = [&](std::uint8_t* pool, std::size_t n) {
      cuda::MlaStoreParams sp;
      sp.fmt = mf;
      sp.latent = lat.as<std::uint16_t>();
      sp.rope = rope.as<std::uint16_t>();
      sp.slot_mapping = slots.as<std::int64_t>();
      sp.n_tokens = static_cast<int>(n);
      sp.pool = pool;
      sp.generic = o.generic;
      return sp;
    };
    // Writer: src_tokens tokens; bytes = bf16 rows + slot ids read, page records written.
    {
      DevBuf pool((src_tokens / 64 + 1) * pg.page_bytes);
      const cuda::MlaStoreParams sp = store_params(pool.as<std::uint8_t>(), src_tokens);
      const double t_start = wall_seconds();
      const double us =
          time_us(st, flush, o.warmup, std::max(10, o.reps / 2), [&](int) { ok(cuda::mla_store(sp, st), "store"); });
      const double t_end = wall_seconds();
      const double bytes = static_cast<double>(src_tokens) * (static_cast<double>(row_b) + 8.0 + static_cast<double>(pg.page_bytes) / 64.0);
      store_rows.push_back({{"format", fname}, {"tokens", src_tokens}, {"us", us}, {"gbps", bytes / (us * 1e3)},
                            {"fraction_of_copy", bytes / (us * 1e3) / copy_gbps}, {"t_start", t_start}, {"t_end", t_end}});
    }
    for (int B : batches)
      for (int ctx : contexts) {
        const int pages_per_seq = (ctx + 63) / 64;
        const std::size_t n_pages = static_cast<std::size_t>(B) * pages_per_seq;
        if (n_pages * pg.page_bytes > arena_bytes)
          throw Error(fmt::format("bench mla: {}'s pages ({} bytes) are larger than its format said", fname, pg.page_bytes));
        std::uint8_t* const pool = arena.as<std::uint8_t>();
        for (std::size_t t0 = 0; t0 < n_pages * 64; t0 += src_tokens) {
          const std::size_t n = std::min(src_tokens, n_pages * 64 - t0);
          ok(cuda::mla_store(store_params(pool + (t0 / 64) * pg.page_bytes, n), st), "fill pool");
        }
        std::seed_seq sq{o.seed, static_cast<unsigned>(B), static_cast<unsigned>(ctx)};
        std::mt19937 rng(sq);
        std::vector<std::int32_t> ids(n_pages);
        for (std::size_t i = 0; i < n_pages; ++i) ids[i] = static_cast<std::int32_t>(i);
        if (o.pages == "random") std::shuffle(ids.begin(), ids.end(), rng);  // a fragmented pool
        std::vector<std::int32_t> lens(static_cast<std::size_t>(B), ctx);
        DevBuf bt(n_pages * 4), dl(static_cast<std::size_t>(B) * 4);
        ok(cudaMemcpy(bt.p, ids.data(), n_pages * 4, cudaMemcpyHostToDevice), "copy");
        ok(cudaMemcpy(dl.p, lens.data(), lens.size() * 4, cudaMemcpyHostToDevice), "copy");
        const std::size_t prot_elems = static_cast<std::size_t>(B) * 132 * static_cast<std::size_t>(D);
        DevBuf prot_rows(prot_elems * 2);
        ok(cuda::fill_random_bf16(prot_rows.as<std::uint16_t>(), prot_elems, 9), "fill");
        for (int H : heads_list) {
          const std::size_t qn = static_cast<std::size_t>(B) * H * static_cast<std::size_t>(D);
          std::vector<float> hq(qn);
          std::normal_distribution<float> nd(0.0f, 1.0f);
          for (auto& x : hq) x = nd(rng);
          DevBuf q(qn * 4), out(static_cast<std::size_t>(B) * H * static_cast<std::size_t>(dc) * 4);
          ok(cudaMemcpy(q.p, hq.data(), qn * 4, cudaMemcpyHostToDevice), "copy");
          for (const auto& pname : prots) {
            if (mf.content_bits == 16 && pname != "none") continue;  // bf16 rows need no protection
            cuda::MlaDecodeParams p;
            p.fmt = mf;
            p.pool = pool;
            p.block_tables = bt.as<std::int32_t>();
            p.max_pages = pages_per_seq;
            p.seq_lens = dl.as<std::int32_t>();
            p.batch = B;
            p.heads = H;
            p.max_seq_len = ctx;
            p.q = q.as<float>();
            p.out = out.as<float>();
            p.scale = 1.0f / std::sqrt(192.0f);
            p.protect = protect_of(pname, dc, dr);
            p.protect_rows = prot_rows.as<std::uint16_t>();
            p.warps = o.warps;
            p.num_splits = o.splits;
            p.generic = o.generic;
            p.kernel = o.kernel == "fragment" ? cuda::MlaKernel::kFragment : o.kernel == "wgmma" ? cuda::MlaKernel::kWarpgroup : cuda::MlaKernel::kAuto;
            p.workspace_bytes = cuda::mla_decode_workspace_bytes(p);
            DevBuf ws(p.workspace_bytes);
            p.workspace = ws.p;
            ok(cuda::mla_decode(p, st), "decode");  // sets the kernel attributes outside the capture
            ok(cudaStreamSynchronize(st), "decode");
            cudaGraph_t graph;
            cudaGraphExec_t exec;
            ok(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), "capture");
            ok(cuda::mla_decode(p, st), "decode");
            ok(cudaStreamEndCapture(st, &graph), "capture");
            ok(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
            const double t_start = wall_seconds();
            const double us =
                time_us(st, flush, o.warmup, o.reps, [&](int) { ok(cudaGraphLaunch(exec, st), "graph launch"); });
            const double t_end = wall_seconds();
            cudaGraphExecDestroy(exec);
            cudaGraphDestroy(graph);
            const double bytes = static_cast<double>(cuda::mla_decode_bytes_read(mf, lens.data(), B, p.protect));
            if (mf.content_bits == 16) bf16_us[{B, ctx, H}] = us;
            const auto it = bf16_us.find({B, ctx, H});
            const nlohmann::json sp16 = it == bf16_us.end() ? nlohmann::json(nullptr) : nlohmann::json(it->second / us);
            const auto fm = flashmla_us.find({B, ctx, H});
            const nlohmann::json spfm = fm == flashmla_us.end() ? nlohmann::json(nullptr) : nlohmann::json(fm->second / us);
            rows.push_back({{"format", fname},
                            {"batch", B},
                            {"context", ctx},
                            {"heads", H},
                            {"protect", pname},
                            {"us", us},
                            {"gbps", bytes / (us * 1e3)},
                            {"fraction_of_copy", bytes / (us * 1e3) / copy_gbps},
                            {"speedup_vs_bf16", sp16},
                            {"speedup_vs_flashmla", spfm},
                            {"bytes", bytes},
                            {"splits", cuda::mla_decode_splits(p)},
                            {"kernel", cuda::mla_decode_uses_wgmma(p) ? "wgmma" : o.generic || dc != 512 || dr != 64 ? "generic-shape" : "fragment"},
                            {"warps", cuda::mla_decode_uses_wgmma(p) ? 4 : 8},
                            {"t_start", t_start},
                            {"t_end", t_end}});
            if (!o.json)
              fmt::print(stderr, "{:<5} B={:<3} ctx={:<7} H={:<4} {:<6} {:10.1f} us {:7.0f} GB/s  vs bf16 {}  vs FlashMLA {}  {}\n",
                         fname, B, ctx, H, pname, us, bytes / (us * 1e3), sp16.dump(), spfm.dump(), rows.back()["kernel"].get<std::string>());
          }
        }
      }
  }
  // FlashMLA's rows as measured (bf16 cache, no protection), for reference.
  for (const auto& [k, us] : flashmla_us) {
    const auto [B, ctx, H] = k;
    const double bytes = static_cast<double>(B) * ctx * 1152.0 + static_cast<double>(B) * ((ctx + 63) / 64) * 4.0;
    const auto it = bf16_us.find(k);
    rows.push_back({{"format", "peer:flashmla"}, {"batch", B}, {"context", ctx}, {"heads", H}, {"protect", "none"}, {"us", us},
                    {"gbps", bytes / (us * 1e3)}, {"fraction_of_copy", bytes / (us * 1e3) / copy_gbps},
                    {"speedup_vs_bf16", it == bf16_us.end() ? nlohmann::json(nullptr) : nlohmann::json(it->second / us)},
                    {"speedup_vs_flashmla", 1.0}, {"bytes", bytes}});
  }
  nlohmann::json res = {{"gpu", prop.name},
                        {"copy_gbps", copy_gbps},
                        {"commit", o.commit},
                        {"command", o.command},
                        {"sms", prop.multiProcessorCount},
                        {"l2_bytes", l2},
                        {"flashmla", peer_info},
                        {"rows", rows},
                        {"store", store_rows},
                        {"flush", flush.mode()},
                        {"pages", o.pages}, {"seed", o.seed}, {"gap_ms", o.gap_ms},
                        {"d_latent", dc},
                        {"d_rope", dr},
                        {"kernel", o.generic || dc != 512 || dr != 64 ? "generic-shape" : "tuned"}};
  res.update(gpu::host_fields(prop));
  if (o.json) {
    fmt::print("{}\n", res.dump(1));
  } else {
    fmt::print("gpu {} ({})  copy {:.0f} GB/s\n", prop.name, gpu::gpu_uuid(prop), copy_gbps);
    for (const auto& s : store_rows)
      fmt::print("writer {:<5} {:8.1f} us {:7.0f} GB/s ({:.0f}% of copy)\n", s["format"].get<std::string>(),
                 s["us"].get<double>(), s["gbps"].get<double>(), 100 * s["fraction_of_copy"].get<double>());
  }
  cudaStreamDestroy(st);
}
#endif

// Attaches `mla` to the `bench` command of cmd_bench.cpp (registered before this one: commands
// are registered in name order and "bench" < "bench-mla").
void register_bench_mla(CLI::App& app) {
  CLI::App* bench = nullptr;
  try {
    bench = app.get_subcommand("bench");
  } catch (const CLI::OptionNotFound&) {
    bench = app.add_subcommand("bench", "GPU kernel benchmarks");
    bench->require_subcommand(1);
  }
  auto o = std::make_shared<MlaBenchOptions>();
  auto* cmd = bench->add_subcommand("mla", "absorbed MLA decode and the MLA writer: bf16 vs QuantMLA affine and mla-tq caches");
  cmd->add_option("--batch", o->batches, "batch sizes");
  cmd->add_option("--context", o->contexts, "context lengths");
  cmd->add_option("--heads", o->heads, "query heads (1..128; groups of 16 share a tile)");
  cmd->add_option("--formats", o->formats, "cache formats (bf16, c8r8, c4r8, c4r4, c3r4, c2r4, mla-tq4, mla-tq3)");
  cmd->add_option("--protect", o->protect, "protection policies: none, paper (4 sinks + 128 recent rows)")
      ->check(list_of({"none", "paper"}));
  cmd->add_option("--reps", o->reps, "timed replays (median)")->check(CLI::Range(1, 100000));
  cmd->add_option("--warmup", o->warmup, "warm-up replays");
  cmd->add_option("--store-tokens", o->store_tokens, "tokens per writer run");
  cmd->add_option("--seed", o->seed, "seed of each shape's page order and queries (with batch and context)");
  cmd->add_option("--gap-ms", o->gap_ms, "idle GPU before each timed series (ms), as `kvq bench decode --gap-ms` (peers_mla.py too)")
      ->check(CLI::Range(0, 10000));
  cmd->add_option("--splits", o->splits, "splits per sequence (0: the launcher's choice)")->check(CLI::Range(0, 1 << 20));
  cmd->add_option("--warps", o->warps, "accepted for compatibility (the decode kernel runs 8-warp CTAs)");
  cmd->add_option("--commit", o->commit, "commit recorded in the result");
  cmd->add_option("--command-line", o->command, "command recorded in the result");
  cmd->add_option("--peers", o->peers, "JSON written by bench/gpu/peers_mla.py (FlashMLA)");
  cmd->add_option("--flush", o->flush,
                  "L2 flush before every timed replay: read (clean L2), write (memset, dirty L2) or none (a "
                  "diagnostic: what the replay before left in L2 stays)")
      ->check(CLI::IsMember({"read", "write", "none"}));
  cmd->add_option("--pages", o->pages, "page order in the pool: random (default, as FlashMLA's peer script) or sequential")
      ->check(CLI::IsMember({"random", "sequential"}));
  cmd->add_option("--d-latent", o->d_latent, "latent width d_c (multiple of 64; 512: the tuned kernels)")->check(CLI::Range(64, 4096));
  cmd->add_option("--d-rope", o->d_rope, "RoPE key width d_r (multiple of 64)")->check(CLI::Range(64, 4096));
  cmd->add_flag("--generic", o->generic, "run the generic-shape writer and decode kernels even at 512 / 64");
  cmd->add_option("--kernel", o->kernel, "decode kernel where the warpgroup one applies (c4r4, c4r8, c2r4 without protection): auto, fragment, wgmma")
      ->check(CLI::IsMember({"auto", "fragment", "wgmma"}));
  cmd->add_flag("--json", o->json, "print one JSON object");
  cmd->callback([o] {
#if defined(KVQ_WITH_KVQ_CUDA)
    run_mla_bench(*o);
#else
    fail("kvq was built without CUDA (configure with -DKVQ_CUDA=ON)");
#endif
  });
}

KVQ_REGISTER_COMMAND("bench-mla", register_bench_mla);

}  // namespace
}  // namespace kvq::cli
