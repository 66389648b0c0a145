// The tensors of one mixer call as kernels see them: the device pointers of
// MixerParams that every forward kernel family (chunkwise and decode) reads,
// gathered once so that each family's argument struct extends it instead of
// repeating it.
#pragma once

#include "kernels/mixer_params.h"

namespace statescan::cuda::detail {

struct MixerTensors {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const float* g = nullptr;
  const void* beta = nullptr;
  const float* initial_state = nullptr;
  void* o = nullptr;
  float* final_state = nullptr;
};

inline MixerTensors tensors_of(const MixerParams& p) {
  MixerTensors t;
  t.q = p.q;
  t.k = p.k;
  t.v = p.v;
  t.g = p.g;
  t.beta = p.beta;
  t.initial_state = p.initial_state;
  t.o = p.o;
  t.final_state = p.final_state;
  return t;
}

}  // namespace statescan::cuda::detail
