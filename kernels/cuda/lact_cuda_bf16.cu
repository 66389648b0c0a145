// LaCT GPU instantiation: bf16 tokens, fp32 Newton-Schulz (lact_cuda_impl.cuh).
#include "kernels/cuda/lact_cuda_impl.cuh"

namespace statescan::cuda::lact_detail {
template void forward_impl<bf16, float>(const LactCudaParams&, const LactDeviceAllReduce&,
                                        LactCudaSaved*, cudaStream_t);
template void backward_impl<bf16, float>(const LactCudaParams&, const LactCudaGrads&,
                                         const LactCudaSaved&, const LactDeviceAllReduce&,
                                         cudaStream_t);
}  // namespace statescan::cuda::lact_detail
