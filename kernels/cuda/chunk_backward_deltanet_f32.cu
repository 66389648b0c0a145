// The fp32 instantiations of the chunkwise backward for variant "deltanet",
// apart from the 16-bit ones in chunk_backward_deltanet.cu so that the two compile
// in parallel (SS_EXTERN_CHUNK_BACKWARD_ELEM in chunk_backward.cuh says why).
#include "kernels/cuda/chunk_backward.cuh"

namespace statescan::cuda::detail {
SS_INSTANTIATE_CHUNK_BACKWARD_ELEM(Decay::none, Rule::delta, float)
}  // namespace statescan::cuda::detail
