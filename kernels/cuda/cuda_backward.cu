// placeholder: the chunkwise CUDA backward (issue 4) is being written; until
// then these entry points refuse, so that callers link and fail loudly.
#include "core/error.h"
#include "kernels/cuda/cuda_mixer.h"

namespace statescan::cuda {

size_t backward_workspace_bytes(const MixerParams&) {
  SS_FAIL("device", "the CUDA backward has not landed yet");
}
void mixer_backward(const MixerBwdParams&, void*, size_t, cudaStream_t) {
  SS_FAIL("device", "the CUDA backward has not landed yet");
}
void mixer_backward(const MixerBwdParams&, cudaStream_t) {
  SS_FAIL("device", "the CUDA backward has not landed yet");
}

}  // namespace statescan::cuda
