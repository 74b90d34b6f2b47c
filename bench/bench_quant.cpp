// Encode / decode throughput of every format on one core, in GB/s of bf16 input, scalar and
// SIMD paths (Google Benchmark). Input: the real cache rows of the fixture dumps (tiny-gqa keys
// and values at head_dim 128; tiny-mla latent 512 + RoPE key 64), tiled to 8192 tokens.
// Encode time includes the bf16 -> fp32 conversion of the input rows.
// After the runs a markdown table is printed (bench/results/cpu-quant-DATE.md keeps one).
#include <benchmark/benchmark.h>

#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "../src/quant/simd.hpp"
#include "kvq/formats.hpp"
#include "kvq/numeric.hpp"
#include "kvq/safetensors.hpp"

using namespace kvq;

namespace {

constexpr std::size_t kTokens = 8192;

struct Input {
  int dk = 0, dv = 0;
  std::vector<std::uint16_t> k, v;  // bf16 rows
};

Input load_input(bool mla) {
  const std::string root = KVQ_SOURCE_DIR;
  SafetensorsFile f(root + (mla ? "/models/tiny-mla/reference.safetensors" : "/models/tiny-gqa/reference.safetensors"));
  Input in;
  in.dk = mla ? 512 : 128;
  in.dv = mla ? 64 : 128;
  auto take = [&](const std::string& name, int d, std::vector<std::uint16_t>& out) {
    const auto& t = f.get(name);
    const std::size_t n = static_cast<std::size_t>(t.shape[0]), w = static_cast<std::size_t>(t.shape[1]);
    const auto* p = reinterpret_cast<const std::uint16_t*>(t.data);
    out.resize(kTokens * static_cast<std::size_t>(d));
    for (std::size_t i = 0; i < kTokens; ++i)
      for (int c = 0; c < d; ++c) out[i * static_cast<std::size_t>(d) + static_cast<std::size_t>(c)] = p[(i % n) * w + static_cast<std::size_t>(c)];
  };
  take(mla ? "layer1.latent" : "layer1.k", in.dk, in.k);
  take(mla ? "layer1.k_rope" : "layer1.v", in.dv, in.v);
  return in;
}

CacheGeometry geometry(bool mla) {
  CacheGeometry g;
  g.n_layers = 1;
  if (mla) {
    g.mla = true;
    g.d_latent = 512;
    g.d_rope = 64;
  } else {
    g.n_kv_heads = 1;
    g.head_dim = 128;
    g.v_head_dim = 128;
  }
  return g;
}

OutlierChannels outliers_for(const FormatSpec& f, const Input& in) {
  OutlierChannels oc;
  if (f.kind != FormatKind::kTqSplit) return oc;
  std::vector<float> k(in.k.size()), v(in.v.size());
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = bf16_to_float(in.k[i]);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = bf16_to_float(in.v[i]);
  oc.key = {{select_outlier_channels(k.data(), kTokens, in.dk, split_outlier_count(f, in.dk))}};
  oc.value = {{select_outlier_channels(v.data(), kTokens, in.dv, split_outlier_count(f, in.dv))}};
  return oc;
}

constexpr std::size_t kChunk = 64;

// The fixture rows of the format's family, loaded once for every benchmark.
const Input& input_for(const std::string& name) {
  static std::map<bool, Input> inputs;
  const bool mla = find_format(name).family == FormatFamily::kMLA;
  if (!inputs.count(mla)) inputs[mla] = load_input(mla);
  return inputs[mla];
}

QuantizerPair quantizers_for(const std::string& name, const Input& in) {
  const auto& f = find_format(name);
  const auto oc = outliers_for(f, in);
  return make_quantizers(f, geometry(f.family == FormatFamily::kMLA), 0, 0, &oc);
}

void BM_Encode(benchmark::State& st, std::string name, bool use_simd) {
  const Input& in = input_for(name);
  const auto q = quantizers_for(name, in);
  simd::set_enabled(use_simd);
  std::vector<float> kf(kChunk * static_cast<std::size_t>(in.dk)), vf(kChunk * static_cast<std::size_t>(in.dv));
  std::vector<std::uint8_t> kr(kTokens * q.key->bytes()), vr(kTokens * q.value->bytes());
  for (auto _ : st) {
    for (std::size_t t0 = 0; t0 < kTokens; t0 += kChunk) {
      // The input conversion counts: AVX2 on the SIMD path, scalar on the scalar one.
      const std::uint16_t* ks = &in.k[t0 * static_cast<std::size_t>(in.dk)];
      const std::uint16_t* vs = &in.v[t0 * static_cast<std::size_t>(in.dv)];
      if (!simd::bf16_to_float(ks, kf.size(), kf.data()))
        for (std::size_t i = 0; i < kf.size(); ++i) kf[i] = bf16_to_float(ks[i]);
      if (!simd::bf16_to_float(vs, vf.size(), vf.data()))
        for (std::size_t i = 0; i < vf.size(); ++i) vf[i] = bf16_to_float(vs[i]);
      q.key->encode_batch(kf.data(), kChunk, &kr[t0 * q.key->bytes()]);
      q.value->encode_batch(vf.data(), kChunk, &vr[t0 * q.value->bytes()]);
    }
    benchmark::DoNotOptimize(kr.data());
    benchmark::DoNotOptimize(vr.data());
  }
  st.SetBytesProcessed(static_cast<std::int64_t>(st.iterations() * kTokens * 2 * static_cast<std::size_t>(in.dk + in.dv)));
  simd::set_enabled(true);
}

void BM_Decode(benchmark::State& st, std::string name, bool use_simd) {
  const Input& in = input_for(name);
  const auto q = quantizers_for(name, in);
  std::vector<float> kf(kTokens * static_cast<std::size_t>(in.dk)), vf(kTokens * static_cast<std::size_t>(in.dv));
  for (std::size_t i = 0; i < kf.size(); ++i) kf[i] = bf16_to_float(in.k[i]);
  for (std::size_t i = 0; i < vf.size(); ++i) vf[i] = bf16_to_float(in.v[i]);
  std::vector<std::uint8_t> kr(kTokens * q.key->bytes()), vr(kTokens * q.value->bytes());
  q.key->encode_batch(kf.data(), kTokens, kr.data());
  q.value->encode_batch(vf.data(), kTokens, vr.data());
  simd::set_enabled(use_simd);
  for (auto _ : st) {
    q.key->decode_batch(kr.data(), kTokens, kf.data());
    q.value->decode_batch(vr.data(), kTokens, vf.data());
    benchmark::DoNotOptimize(kf.data());
    benchmark::DoNotOptimize(vf.data());
  }
  st.SetBytesProcessed(static_cast<std::int64_t>(st.iterations() * kTokens * 2 * static_cast<std::size_t>(in.dk + in.dv)));
  simd::set_enabled(true);
}

// Collects results to print one markdown table at the end.
class TableReporter : public benchmark::ConsoleReporter {
 public:
  std::map<std::string, std::map<std::string, double>> gbps;  // format -> column -> GB/s
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const auto& r : runs) {
      const std::string n = r.benchmark_name();  // Encode/<fmt>/<path>
      const auto a = n.find('/'), b = n.rfind('/');
      if (a == std::string::npos || b == a) continue;
      const auto it = r.counters.find("bytes_per_second");
      if (it == r.counters.end()) continue;
      gbps[n.substr(a + 1, b - a - 1)][n.substr(0, a) + " " + n.substr(b + 1)] = it->second.value / 1e9;
    }
  }
};

}  // namespace

int main(int argc, char** argv) {
  for (const auto& f : all_formats()) {
    for (bool s : {false, true}) {
      const std::string path = s ? "simd" : "scalar";
      benchmark::RegisterBenchmark(("Encode/" + f.name + "/" + path).c_str(), BM_Encode, f.name, s)->Unit(benchmark::kMicrosecond);
      benchmark::RegisterBenchmark(("Decode/" + f.name + "/" + path).c_str(), BM_Decode, f.name, s)->Unit(benchmark::kMicrosecond);
    }
  }
  benchmark::Initialize(&argc, argv);
  TableReporter rep;
  benchmark::RunSpecifiedBenchmarks(&rep);
  std::printf("\n| format | encode scalar GB/s | encode SIMD GB/s | decode scalar GB/s | decode SIMD GB/s |\n|:--|--:|--:|--:|--:|\n");
  for (const auto& f : all_formats()) {
    auto& m = rep.gbps[f.name];
    if (m.empty()) continue;
    auto cell = [&](const char* k) { return m.count(k) ? std::to_string(m[k]).substr(0, 5) : std::string("-"); };
    std::printf("| %s | %s | %s | %s | %s |\n", f.name.c_str(), cell("Encode scalar").c_str(), cell("Encode simd").c_str(),
                cell("Decode scalar").c_str(), cell("Decode simd").c_str());
  }
  benchmark::Shutdown();
  return 0;
}
