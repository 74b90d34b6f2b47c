// bench_runtime: CPU throughput of the model runtime with the dense bf16 cache on the fixture
// models: prefill tokens/s (one 2048-token chunk) and decode tokens/s at about 1K and 4K tokens of
// context. Prints a markdown table; timings are medians of repeated runs after one warm-up.
//
// Usage: bench_runtime [--threads N] [--reps R] [MODEL_DIR...]   (default: models/tiny-gqa and
// models/tiny-mla under $KVQ_SOURCE_DIR or the current directory, 2 threads, 3 repetitions)
//
// Wall-clock rates depend on what else runs on the machine; the process CPU seconds per token
// (all threads, getrusage) are printed beside them as the load-independent cost.
#include <omp.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "kvq/dense_cache.hpp"
#include "kvq/model.hpp"

namespace {

using clock_type = std::chrono::steady_clock;

double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_stime.tv_sec + 1e-6 * (u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

struct Timing {
  double wall = 0.0, cpu = 0.0;  // seconds per unit of work
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::vector<std::int32_t> tokens(int n, int vocab) {
  std::vector<std::int32_t> t(n);
  std::uint64_t s = 12345;
  for (auto& x : t) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    x = static_cast<std::int32_t>((s >> 33) % static_cast<std::uint64_t>(vocab - 2)) + 2;
  }
  return t;
}

// Seconds for one prefill of n tokens (fresh cache), median over reps.
Timing time_prefill(kvq::Model& m, int n, int reps) {
  const auto ids = tokens(n, m.config().vocab_size);
  std::vector<float> logits(m.config().vocab_size);
  std::vector<double> t, c;
  for (int r = 0; r <= reps; ++r) {
    auto cache = kvq::make_dense_cache(m.cache_geometry());
    const auto a = clock_type::now();
    const double ca = cpu_seconds();
    m.forward(ids.data(), n, *cache, 0, logits.data(), kvq::LogitsMode::kLast);
    const double s = std::chrono::duration<double>(clock_type::now() - a).count();
    if (r > 0) {  // first run warms up
      t.push_back(s);
      c.push_back(cpu_seconds() - ca);
    }
  }
  return {median(t), median(c)};
}

// Seconds per decoded token after a prefill of `context` tokens, over `steps` steps; median over reps.
Timing time_decode(kvq::Model& m, int context, int steps, int reps) {
  const auto ids = tokens(context + steps, m.config().vocab_size);
  std::vector<float> logits(m.config().vocab_size);
  std::vector<double> t, c;
  for (int r = 0; r < reps; ++r) {
    auto cache = kvq::make_dense_cache(m.cache_geometry());
    m.forward(ids.data(), context, *cache, 0, logits.data(), kvq::LogitsMode::kLast);
    const auto a = clock_type::now();
    const double ca = cpu_seconds();
    for (int i = 0; i < steps; ++i) m.forward(&ids[context + i], 1, *cache, 0, logits.data(), kvq::LogitsMode::kLast);
    t.push_back(std::chrono::duration<double>(clock_type::now() - a).count() / steps);
    c.push_back((cpu_seconds() - ca) / steps);
  }
  return {median(t), median(c)};
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 2, reps = 3;
  std::vector<std::string> dirs;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--threads" && i + 1 < argc) threads = std::atoi(argv[++i]);
    else if (a == "--reps" && i + 1 < argc) reps = std::atoi(argv[++i]);
    else dirs.push_back(a);
  }
  if (dirs.empty()) {
    const char* root = std::getenv("KVQ_SOURCE_DIR");
    const std::string base = root ? std::string(root) + "/" : std::string();
    dirs = {base + "models/tiny-gqa", base + "models/tiny-mla"};
  }
  omp_set_num_threads(threads);
  std::printf("threads %d, repetitions %d (median), dense bf16 cache\n\n", threads, reps);
  double l1 = 0, l5 = 0, l15 = 0;
  if (FILE* f = std::fopen("/proc/loadavg", "r")) {
    if (std::fscanf(f, "%lf %lf %lf", &l1, &l5, &l15) != 3) l1 = l5 = l15 = 0;
    std::fclose(f);
  }
  std::printf("load average at start: %.2f %.2f %.2f\n\n", l1, l5, l15);
  std::printf("| model | weights MB | prefill 2048 tok/s | decode tok/s @1K | decode tok/s @4K | prefill CPU ms/tok | decode CPU ms/tok @1K | @4K |\n");
  std::printf("|---|---:|---:|---:|---:|---:|---:|---:|\n");
  for (const auto& d : dirs) {
    try {
      auto m = kvq::Model::load(d);
      const int maxp = m->config().max_position_embeddings;
      const int steps = 32;
      const Timing pre = time_prefill(*m, 2048, reps);
      const Timing d1 = time_decode(*m, 1024 - steps / 2, steps, reps);
      const int ctx4 = std::min(4096, maxp) - steps;
      const Timing d4 = time_decode(*m, ctx4, steps, reps);
      std::printf("| %s | %.1f | %.0f | %.1f | %.1f | %.3f | %.2f | %.2f |\n", d.substr(d.rfind('/') + 1).c_str(),
                  m->weight_bytes() / 1e6, 2048 / pre.wall, 1.0 / d1.wall, 1.0 / d4.wall, 1e3 * pre.cpu / 2048,
                  1e3 * d1.cpu, 1e3 * d4.cpu);
      std::fflush(stdout);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s: %s\n", d.c_str(), e.what());
      return 1;
    }
  }
  return 0;
}
