// LaCT GPU instantiation: bf16 tokens, fp32 Newton-Schulz (lact_cuda_impl.cuh).
#include "kernels/cuda/lact_cuda_impl.cuh"

namespace statescan::cuda::lact_detail {
template void forward_impl<bf16, float>(const LactCudaParams&, const LactDeviceAllReduce&,
                                        LactCudaSaved*, cudaStream_t);
template void backward_impl<bf16, float>(const LactCudaParams&, const LactCudaGrads&,
                                         const LactCudaSaved&, const LactDeviceAllReduce&,
                                         cudaStream_t);

struct NewtonSchulzBf16::Impl {
  NewtonSchulz<float> ns;
  static Geo geo(int64_t pairs, int64_t M, int64_t D) {
    Geo g{};
    g.pairs = pairs, g.M = M, g.D = D;
    return g;
  }
  Impl(int64_t pairs, int64_t M, int64_t D, int steps, bool keep_iterates, NsGemms mode,
       cudaStream_t stream, bool allow_wgmma)
      : ns(geo(pairs, M, D), steps, keep_iterates, stream, mode, allow_wgmma) {}
};

NewtonSchulzBf16::NewtonSchulzBf16(int64_t pairs, int64_t M, int64_t D, int steps,
                                   bool keep_iterates, NsGemms mode, cudaStream_t stream,
                                   bool allow_wgmma) {
  SS_CHECK_ARG(pairs > 0 && M > 0 && D > 0, "w0", "Newton-Schulz needs pairs, M, D > 0, got ",
               pairs, ", ", M, ", ", D);
  SS_CHECK_ARG(steps > 0, "muon_steps", "Newton-Schulz needs at least one step, got ", steps);
  impl_ = std::make_unique<Impl>(pairs, M, D, steps, keep_iterates, mode, stream, allow_wgmma);
}
NewtonSchulzBf16::~NewtonSchulzBf16() = default;
void NewtonSchulzBf16::forward(const float* P, float* out) {
  impl_->ns.forward(P, out);
}
void NewtonSchulzBf16::backward(const float* P, const float* d_out, float* dP) {
  impl_->ns.backward(P, d_out, dP);
}
int NewtonSchulzBf16::graphs_captured() const {
  return impl_->ns.captures();
}
}  // namespace statescan::cuda::lact_detail
