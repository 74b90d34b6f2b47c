// Decode kernels for head_dim 96 (every supported format); see decode.cuh.
#include "decode_launch.cuh"

namespace kvq::cuda::detail {
KVQ_DEFINE_DECODE_D(96)
}  // namespace kvq::cuda::detail
