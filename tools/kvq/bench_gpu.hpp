// Pieces shared by the GPU benchmarks (`kvq bench decode`, `kvq bench mla`): checked CUDA calls,
// device buffers, the L2 flush before every timed run, and event timing (median of the runs).
//
// L2 flush (docs/kernels.md, "Method"): `read` (the default) streams a buffer of
// max(4 x L2, 256 MiB) through the L2 with a read-only kernel, so the timed launch starts with a
// cold L2 that holds only clean lines; `write` is the earlier method, a memset of the same
// buffer, which leaves up to a whole L2 of dirty lines whose write-back (~15-20 us on the H200)
// then overlaps the timed launch. bench/gpu/peers.py takes the same --flush option.
#pragma once

#if defined(KVQ_WITH_KVQ_CUDA)
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "command.hpp"
#include "kvq/paged_cache.hpp"
#include "kvq_cuda.hpp"

namespace kvq::cli::gpu {

// A bench command's --protect policy (the names its list_of check admits): none, or the paper's 4 attention sinks +
// 128 recent rows kept in bf16 (ProtectionPolicy::paper(), the CPU cache's preset; 132 protected rows per sequence).
inline ProtectionPolicy bench_protection(const std::string& name) {
  if (name == "none") return {};
  if (name == "paper") return ProtectionPolicy::paper();
  fail("--protect: 'none' or 'paper', got '" + name + "'");
}

inline void ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail(std::string(what) + ": " + cudaGetErrorString(e));
}

struct DevBuf {
  void* p = nullptr;
  explicit DevBuf(std::size_t n) { ok(cudaMalloc(&p, std::max<std::size_t>(n, 16)), "cudaMalloc"); }
  ~DevBuf() { cudaFree(p); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  template <class T>
  T* as() const { return static_cast<T*>(p); }
};

// Host wall-clock seconds since the epoch. The benchmarks record it around each timed row ("t_start", "t_end"), so
// that the GPU clocks sampled meanwhile (scripts/gpu-bench, bench/gpu/monitor.py --rows) can be matched to the row.
inline double wall_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

class L2Flush {
 public:
  // mode: "read", "write" or "none" (anything else is an error); l2_bytes: the device's L2 size. "none" flushes
  // nothing: whatever the run before left in L2 (its code, parameters and tables, and the pages it read where they
  // fit) stays there. A diagnostic, for telling cold-cache costs from the rest; results are taken with a flush. Its
  // buffer is allocated all the same, so that the pools allocated after it land where they do with a flush, and it
  // holds the stream for kHoldNs instead (cuda::hold_stream), as long as a flush would, so that the timed launch is
  // already queued when the device records the start event (without it the time includes the host's launch).
  L2Flush(const std::string& mode, std::size_t l2_bytes, cudaStream_t stream) : stream_(stream) {
    if (mode == "read") mode_ = Mode::kRead;
    else if (mode == "write") mode_ = Mode::kWrite;
    else if (mode == "none") mode_ = Mode::kNone;
    else fail("--flush must be 'read', 'write' or 'none', not '" + mode + "'");
    bytes_ = std::max<std::size_t>(4 * l2_bytes, std::size_t{256} << 20);
    ok(cudaMalloc(&buf_, bytes_), "cudaMalloc (flush)");
    ok(cudaMemsetAsync(buf_, 0, bytes_, stream_), "flush init");
  }
  ~L2Flush() { cudaFree(buf_); }
  L2Flush(const L2Flush&) = delete;
  L2Flush& operator=(const L2Flush&) = delete;

  void operator()(int rep) const {
    if (mode_ == Mode::kWrite) ok(cudaMemsetAsync(buf_, rep & 0xff, bytes_, stream_), "flush (memset)");
    else if (mode_ == Mode::kRead) ok(cuda::flush_l2_read(static_cast<std::uint8_t*>(buf_), bytes_, stream_), "flush (read)");
    else ok(cuda::hold_stream(kHoldNs, stream_), "flush (none: hold)");
  }
  static constexpr unsigned kHoldNs = 50'000;  // a read flush (256 MiB on an H100 or H200) takes 60-80 us
  const char* mode() const { return mode_ == Mode::kWrite ? "write" : mode_ == Mode::kNone ? "none" : "read"; }

 private:
  cudaStream_t stream_;
  enum class Mode { kRead, kWrite, kNone } mode_ = Mode::kRead;
  std::size_t bytes_ = 0;
  void* buf_ = nullptr;
};

// Milliseconds of idle GPU before each timed series (`--gap-ms`): the device is synchronized and the host sleeps, so
// that a series does not start under the power state that the series before it (a heavy row, a pool fill, the L2
// flushes) left. 0: none. docs/kernels.md (benchmark method) measures what it changes.
inline int series_gap_ms = 0;

// Median microseconds of `reps` runs of launch(rep) on `stream`, each after flush(rep), timed by
// CUDA events recorded on the same stream; `warmup` untimed runs first, after series_gap_ms of idle GPU.
template <class F>
double time_us(cudaStream_t stream, const L2Flush& flush, int warmup, int reps, F&& launch) {
  if (series_gap_ms > 0) {
    ok(cudaDeviceSynchronize(), "gap");
    std::this_thread::sleep_for(std::chrono::milliseconds(series_gap_ms));
  }
  cudaEvent_t a, b;
  ok(cudaEventCreate(&a), "event");
  ok(cudaEventCreate(&b), "event");
  for (int i = 0; i < warmup; ++i) launch(i);
  ok(cudaStreamSynchronize(stream), "warm-up");
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    flush(i);
    ok(cudaEventRecord(a, stream), "record");
    launch(warmup + i);
    ok(cudaEventRecord(b, stream), "record");
    ok(cudaEventSynchronize(b), "sync");
    float ms = 0;
    ok(cudaEventElapsedTime(&ms, a, b), "elapsed");
    t.push_back(1000.0 * ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return median(t);
}

// A peers file (bench/gpu/peers.py, peers_mla.py) timed another way than this run is not comparable: refuses one whose
// L2 flush (files without the key predate the option and used the memset), idle gap before each series (files
// without the key had none) or arena pad (`kvq bench decode --arena-pad`; files without the key had none) differs.
inline void check_peers_method(const nlohmann::json& pj, const std::string& path, const std::string& flush, int gap_ms,
                               int arena_pad_mib = 0) {
  const std::string peer_flush = pj.value("flush", std::string("write"));
  if (peer_flush != flush)
    fail("peers file '" + path + "' was measured with --flush " + peer_flush + ", this run uses --flush " + flush);
  const int peer_gap = pj.value("gap_ms", 0);
  if (peer_gap != gap_ms)
    fail("peers file '" + path + "' was measured with --gap-ms " + std::to_string(peer_gap) + ", this run uses --gap-ms " +
         std::to_string(gap_ms));
  const int peer_pad = pj.value("arena_pad_mib", 0);
  if (peer_pad != arena_pad_mib)
    fail("peers file '" + path + "' was measured with --arena-pad " + std::to_string(peer_pad) +
         ", this run uses --arena-pad " + std::to_string(arena_pad_mib));
}

// Copy bandwidth as docs/kernels.md defines it: (read + written) / time of a 4 GiB
// device-to-device copy, in GB/s.
inline double copy_gbps(cudaStream_t stream, const L2Flush& flush) {
  const std::size_t n = std::size_t{4} << 30;
  DevBuf src(n), dst(n);
  ok(cudaMemsetAsync(src.p, 1, n, stream), "memset");
  const double us = time_us(stream, flush, 2, 10, [&](int) {
    ok(cudaMemcpyAsync(dst.p, src.p, n, cudaMemcpyDeviceToDevice, stream), "copy");
  });
  return 2.0 * static_cast<double>(n) / (us * 1e3);
}

// The device's UUID as nvidia-smi prints it (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx): the host a result came from,
// since the same build's times differ between hosts by more than between runs.
inline std::string gpu_uuid(const cudaDeviceProp& prop) {
  static const char* hex = "0123456789abcdef";
  std::string s = "GPU-";
  for (int i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) s += '-';
    const auto b = static_cast<unsigned char>(prop.uuid.bytes[i]);
    s += hex[b >> 4];
    s += hex[b & 15];
  }
  return s;
}

// What identifies the machine in a result file beside prop.name: the GPU's UUID and the CUDA version its driver
// supports.
inline nlohmann::json host_fields(const cudaDeviceProp& prop) {
  int driver = 0;
  ok(cudaDriverGetVersion(&driver), "cudaDriverGetVersion");
  return {{"gpu_uuid", gpu_uuid(prop)}, {"cuda_driver", driver}};
}

}  // namespace kvq::cli::gpu

#endif
