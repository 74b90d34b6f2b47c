// Decode kernels for head_dim 64 (every supported format); see decode.cuh.
#include "decode_launch.cuh"

namespace kvq::cuda::detail {
KVQ_DEFINE_DECODE_D(64)
}  // namespace kvq::cuda::detail
