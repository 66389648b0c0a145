// LaCT GPU instantiation: bf16 tokens, fp32 Newton-Schulz (lact_cuda_impl.cuh).
#include "kernels/cuda/lact_cuda_impl.cuh"

namespace statescan::cuda::lact_detail {
template void forward_impl<bf16, float>(const LactCudaParams&, const LactDeviceAllReduce&,
                                        LactCudaSaved*, cudaStream_t);
template void backward_impl<bf16, float>(const LactCudaParams&, const LactCudaGrads&,
                                         const LactCudaSaved&, const LactDeviceAllReduce&,
                                         cudaStream_t);

void newton_schulz_bf16_layer(const float* P, int64_t pairs, int64_t M, int64_t D, int steps,
                              float* out, const float* d_out, float* dP, cudaStream_t stream) {
  Geo g{};
  g.pairs = pairs, g.M = M, g.D = D;
  NewtonSchulz<float> ns(g, steps, d_out != nullptr, stream);
  ns.forward(P, out);
  if (d_out != nullptr) ns.backward(P, d_out, dP);
}
}  // namespace statescan::cuda::lact_detail
