// Pieces of LactLayer shared by its host path (lact_layer.cpp) and its GPU
// path (lact_layer_cuda.cpp): argument checks and the agreement of all ranks
// on one problem. Private to parallel/ (not installed).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

#include "comm/communicator.h"
#include "core/tensor.h"
#include "parallel/lact_layer.h"

namespace statescan::lact_detail {

// Where and in which element type the tensors of a call live: host fp32 for
// the CPU path, device f32 or bf16 for the GPU path.
struct Placement {
  Memory memory = Memory::host;
  DType dtype = DType::f32;
};

// This rank's sizes; checked against every other rank's.
struct LocalSizes {
  int64_t batch = 0, local_len = 0, heads = 0, dim = 0, hidden = 0;
};

// Shapes, dtypes and placement of the forward arguments (no data reads).
LocalSizes check_forward_shapes(const LactForwardArgs& a, const Placement& where);
// The same for backward, against the forward's sizes.
void check_backward_shapes(const LactBackwardArgs& a, const LocalSizes& s, const Placement& where);

// comm.all_reduce_sum of `count` host floats, counted and timed into `stats`.
void timed_all_reduce(Communicator& comm, float* data, std::size_t count,
                      LactExchangeStats& stats);

// Collective over `control` (host buffers): every rank must pass the same
// sizes, options, placement and initial weights (compared by their content
// hashes, `hash` of a.w0, a.w1, a.w2: the host's or the device's; a hash that
// fails on one rank fails every rank). Throws the same statescan::Error on
// every rank otherwise.
void agree_on_problem(Communicator& control, const LocalSizes& s, const LactConfig& config,
                      const Placement& where, const LactForwardArgs& a,
                      const std::function<int64_t(const TensorView&)>& hash);

}  // namespace statescan::lact_detail
