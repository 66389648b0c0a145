// Instantiations of the chunkwise backward for variant "kda" (decay vector,
// rule delta): dtype in {bf16, f16} (f32: chunk_backward_kda_f32.cu) x Dk == Dv in {64, 128} x
// l2norm.
#include "kernels/cuda/chunk_backward.cuh"

namespace statescan::cuda::detail {
SS_EXTERN_CHUNK_BACKWARD_ELEM(Decay::vector, Rule::delta, float)  // chunk_backward_kda_f32.cu
SS_INSTANTIATE_CHUNK_BACKWARD(Decay::vector, Rule::delta)
}  // namespace statescan::cuda::detail
