// Instantiations of the chunkwise backward for variant "kda" (decay vector,
// rule delta): dtype in {f32, bf16, f16} x Dk == Dv in {64, 128} x l2norm.
#include "kernels/cuda/chunk_backward.cuh"

namespace statescan::cuda::detail {
SS_INSTANTIATE_CHUNK_BACKWARD(Decay::vector, Rule::delta)
}  // namespace statescan::cuda::detail
