// harness.hpp: the tiny test harness of the GPU tests (no GoogleTest on the GPU host). CHECK
// counts a result and prints failures; finish() prints "N passed, M failed" as the last line and
// returns the exit status. A process without a usable GPU prints why and exits 0 (skip).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace kvq::cudatest {

struct Counter {
  int passed = 0, failed = 0;
};
inline Counter& counter() {
  static Counter c;
  return c;
}
inline bool check(bool ok, const std::string& what) {
  if (ok) {
    ++counter().passed;
  } else {
    ++counter().failed;
    std::printf("FAILED: %s\n", what.c_str());
  }
  return ok;
}
inline int finish() {
  std::printf("%d passed, %d failed\n", counter().passed, counter().failed);
  return counter().failed == 0 ? 0 : 1;
}
inline bool gpu_present() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    std::printf("no CUDA device (%s): GPU tests skipped\n", e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
    return false;
  }
  return true;
}
// Aborts the test binary on a CUDA API failure (later results would be meaningless).
#define KVQ_CUDA_OK(expr)                                                                                \
  do {                                                                                                   \
    const cudaError_t kvq_e_ = (expr);                                                                   \
    if (kvq_e_ != cudaSuccess) {                                                                         \
      std::printf("FAILED: %s -> %s (%s:%d)\n", #expr, cudaGetErrorString(kvq_e_), __FILE__, __LINE__); \
      ++::kvq::cudatest::counter().failed;                                                               \
      std::exit(::kvq::cudatest::finish());                                                              \
    }                                                                                                    \
  } while (0)

// v copied into the device buffer p (v.size() values); a device copy of v (at least 16 bytes allocated,
// so that an empty vector gives a valid pointer); a host copy of n device values. All abort the test
// binary on a CUDA failure.
template <class T>
void upload_into(T* p, const std::vector<T>& v) {
  if (!v.empty()) KVQ_CUDA_OK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
}
template <class T>
T* upload(const std::vector<T>& v) {
  void* p = nullptr;
  KVQ_CUDA_OK(cudaMalloc(&p, std::max<std::size_t>(v.size() * sizeof(T), 16)));
  upload_into(static_cast<T*>(p), v);
  return static_cast<T*>(p);
}
template <class T>
std::vector<T> download(const T* p, std::size_t n) {
  std::vector<T> v(n);
  KVQ_CUDA_OK(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

// A call captured once into a CUDA graph on a stream of its own, replayed on demand (the GPU tests
// require a replay to give the eager launch's bits). `launch(stream)` returns the launcher's error.
class CapturedCall {
 public:
  template <class Launch>
  explicit CapturedCall(Launch&& launch) {
    KVQ_CUDA_OK(cudaStreamCreate(&stream_));
    KVQ_CUDA_OK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    launched_ = launch(stream_);
    KVQ_CUDA_OK(cudaStreamEndCapture(stream_, &graph_));
    if (launched_ == cudaSuccess) KVQ_CUDA_OK(cudaGraphInstantiate(&exec_, graph_, 0));
  }
  CapturedCall(const CapturedCall&) = delete;
  CapturedCall& operator=(const CapturedCall&) = delete;
  ~CapturedCall() {
    if (exec_) cudaGraphExecDestroy(exec_);
    if (graph_) cudaGraphDestroy(graph_);
    if (stream_) cudaStreamDestroy(stream_);
  }
  // The launcher's result under capture; replay() is a no-op when it failed.
  cudaError_t launched() const { return launched_; }
  // One replay, waited for.
  void replay() {
    if (!exec_) return;
    KVQ_CUDA_OK(cudaGraphLaunch(exec_, stream_));
    KVQ_CUDA_OK(cudaStreamSynchronize(stream_));
  }

 private:
  cudaStream_t stream_ = nullptr;
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
  cudaError_t launched_ = cudaErrorNotReady;
};

}  // namespace kvq::cudatest
