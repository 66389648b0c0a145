// Pieces of CpMixer shared by its host path (cp_mixer.cpp) and its GPU path
// (cp_mixer_cuda.cpp): the shard geometry, its agreement across ranks and the
// local segments. Private to parallel/ (not installed).
#pragma once

#include <cstdint>
#include <vector>

#include "comm/communicator.h"
#include "core/options.h"
#include "core/tensor.h"
#include "kernels/mixer_params.h"
#include "parallel/cp_mixer.h"

namespace statescan::cp_detail {

// One piece of a sequence that lies in this rank's shard. Without cu_seqlens
// each batch row is one sequence spanning every shard.
struct LocalSegment {
  int64_t seq;         // global sequence index n (batch row without cu_seqlens)
  int64_t row;         // batch row of the local tensors
  int64_t begin, end;  // local token range
  bool from_prev;      // the sequence started on an earlier rank
  bool to_next;        // the sequence continues on a later rank
};

// Sizes of this rank's problem, checked against the other ranks'.
struct Geometry {
  int64_t batch = 0, local_len = 0, heads = 0, dk = 0, dv = 0;
  int64_t sequences = 0;    // N
  int64_t global_len = 0;   // sum of shard lengths
  int64_t shard_begin = 0;  // global offset of this shard
};

// Where and in which element type the tensors of a call live. The host path
// is fp32 host memory with finiteness checked on the host; the GPU path
// checks finiteness on the device itself (values_checked = false here).
struct TensorRules {
  Memory memory = Memory::host;
  DType dtype = DType::f32;  // q, k, v, beta, o (and the gradients of those)
  bool check_values = true;  // host finiteness checks of inputs
};

// Local checks of forward: shapes, dtypes, memory, (host) finiteness.
// a.cu_seqlens must be host memory here (the GPU path passes a host copy).
Geometry check_forward_local(const CpForwardArgs& a, const MixerConfig& cfg,
                             const TensorRules& rules);

// The ranks' values of `n` fields, gathered [rank][field] by one all_gather;
// then, in a collective_check, every rank throws naming the first of the
// first `checked` fields on which some rank differs. Collective.
std::vector<int64_t> agree_fields(Communicator& comm, const char* const* names, const int64_t* mine,
                                  int64_t n, int64_t checked);

// Agrees the geometry across ranks (same B, H, Dk, Dv, N, options, exchange,
// memory kind, cu_seqlens (by content) and the same optional outputs
// everywhere; shard lengths summing to the packed length) and fills the
// global fields. Collective, errors collective.
void agree_geometry(Communicator& comm, const CpForwardArgs& a, const MixerConfig& cfg,
                    Exchange exchange, bool on_device, Geometry& g);

// Backward: every rank asks for d_initial_state or none does (its all-reduce
// is collective). Collective, errors collective.
void agree_backward_outputs(Communicator& comm, const CpBackwardArgs& a);

std::vector<LocalSegment> local_segments(const CpForwardArgs& a, const Geometry& g);

// The local mixer's sizes and options for this rank's shard: MixerParams
// without the dtype, pointers and segments, which each path sets itself.
MixerParams local_mixer_params(const MixerConfig& cfg, const Geometry& g);

// True when the shard's last segment of `row` is its only segment there and
// continues from the previous rank: only then does the carry depend on the
// incoming state (else the summary's M must be zero, DESIGN §5).
bool single_continuing(const std::vector<LocalSegment>& segs, int64_t row);

}  // namespace statescan::cp_detail
