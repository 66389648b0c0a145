// The LaCT layer over a communicator group (DESIGN §6): every chunk is split
// evenly across the group's ranks, each rank computes its partial fast-weight
// gradient, one all-reduce sums it, and every rank applies the identical
// update; backward mirrors that with one all-reduce of the update's gradient
// per chunk. Semantics and the sharded token layout: kernels/cpu/lact.h.
//
// Why LaCT shards *inside* each chunk while the linear-attention mixers shard
// contiguously: a LaCT chunk (thousands of tokens up to the whole sequence)
// reads and writes one fast weight, so contiguous shards would leave all but
// one rank idle while that rank's chunks run in sequence order. Splitting every
// chunk keeps all ranks busy on every chunk, and the only traffic is one
// all-reduce of 3 M D values per (batch row, head) per chunk.
//
// Usage (every rank of the group, collective):
//   LactLayer layer(comm, config);
//   layer.forward(fwd_args);      // saves one W and one update per chunk
//   layer.backward(bwd_args);
// Token layout per rank: [B, T/P, H, *] holding slice r of chunk 0, slice r of
// chunk 1, ... (lact_shard / lact_token_range in kernels/cpu/lact.h).
//
// Placement: host fp32 tensors run the CPU template (kernels/cpu/lact.h);
// device tensors (Memory::device, all of them, f32 or bf16, one dtype for the
// whole call) run the GPU path (kernels/cuda/lact_cuda.h, CUDA builds). On the
// GPU the all-reduces take device buffers: over an NCCL communicator they are
// enqueued on its stream, any other communicator stages them through the
// host. forward/backward return when their results are complete.
#pragma once

#include <memory>

#include "comm/communicator.h"
#include "core/tensor.h"
#include "kernels/cpu/lact.h"

namespace statescan {

// The shapes of one rank's LaCT tensors, as LactLayer checks them: tokens
// [B, T_local, H, D] (q, k, v, o, d_o and dq, dk, dv), rates [B, T_local, H]
// (lr0..2 and their gradients), wide [H, M, D] (w0, w2, dw0, dw2) and
// narrow [H, D, M] (w1, dw1).
struct LactShapes {
  Shape tokens, rates, wide, narrow;
  LactShapes(int64_t batch, int64_t local_len, int64_t heads, int64_t dim, int64_t hidden)
      : tokens{batch, local_len, heads, dim},
        rates{batch, local_len, heads},
        wide{heads, hidden, dim},
        narrow{heads, dim, hidden} {}
};

struct LactForwardArgs {
  // Local slices, contiguous, host fp32 or device f32/bf16 (all alike):
  // q, k, v [B, T_local, H, D]; lr0, lr1, lr2 [B, T_local, H] (> 0).
  TensorView q, k, v;
  TensorView lr0, lr1, lr2;
  // Initial fast weights, identical on every rank: w0, w2 [H, M, D]; w1 [H, D, M].
  TensorView w0, w1, w2;
  TensorView o;  // output [B, T_local, H, D]
};

struct LactBackwardArgs {
  TensorView d_o;  // [B, T_local, H, D]
  // Outputs: local slices like q, k, v, lr0..2.
  TensorView dq, dk, dv;
  TensorView dlr0, dlr1, dlr2;
  // Outputs like w0..2, summed over batch rows and ranks (same on every rank).
  TensorView dw0, dw1, dw2;
};

// The fast-weight gradient all-reduces of one forward or backward on this
// rank: how many, their fp32 payload, and the time spent in them. Host
// communicators: wall time of the calls (device buffers include their staging
// copies). NCCL: GPU time between events around each call on the layer's
// stream, which includes waiting for the slowest rank to arrive.
struct LactExchangeStats {
  int64_t calls = 0;
  double bytes = 0;
  double seconds = 0;
};

class LactLayer {
 public:
  // Validates the config (throws naming "chunk", "momentum" or "muon_steps").
  LactLayer(Communicator& comm, LactConfig config);
  ~LactLayer();
  LactLayer(const LactLayer&) = delete;
  LactLayer& operator=(const LactLayer&) = delete;

  // Collective. Validates on every rank (shapes, dtypes, finiteness, learning
  // rates > 0, the same sizes on every rank, chunk divisible by the ranks); a
  // fault on any rank throws the same statescan::Error on all of them before
  // anything is written. Keeps views of the inputs for backward: their memory
  // must stay valid and unchanged until backward returns.
  // A failure on this rank alone after that (a device allocation, a kernel)
  // reaches the peers as a fault notice (Communicator::notify_failure): their
  // calls throw at once, naming this rank and its error, instead of waiting
  // out the timeout, and the communicator is unusable afterwards.
  void forward(const LactForwardArgs& args);
  // Collective. Needs a preceding forward on this layer. Failures as forward.
  void backward(const LactBackwardArgs& args);

  const LactConfig& config() const { return config_; }
  // The all-reduces of the last forward and of the last backward.
  const LactExchangeStats& last_forward_exchange() const { return forward_exchange_; }
  const LactExchangeStats& last_backward_exchange() const { return backward_exchange_; }

 private:
  struct Saved;
  // The GPU path (parallel/lact_layer_cuda.cpp): streams, saved checkpoints.
  struct DeviceState;
  struct DeviceStateDeleter {
    void operator()(DeviceState* state) const;
  };
  LactAllReduce<float> all_reduce(LactExchangeStats& stats);
  // forward() and backward() before a failure is told to the peers.
  void run_forward(const LactForwardArgs& args);
  void run_backward(const LactBackwardArgs& args);
  void forward_device(const LactForwardArgs& args);
  void backward_device(const LactBackwardArgs& args);
  // The communicator the host path agrees on arguments over: comm_, or over
  // NCCL a host-staged view of it (made once), as the GPU path's control
  // plane is; so that a rank whose tensors sit elsewhere than its peers' meets
  // them in the same collectives and the placement check fails on every rank
  // instead of leaving them waiting.
  Communicator& agreement_comm();

  Communicator& comm_;
  LactConfig config_;
  LactExchangeStats forward_exchange_, backward_exchange_;
  std::unique_ptr<Saved> saved_;
  std::unique_ptr<DeviceState, DeviceStateDeleter> device_;
  std::unique_ptr<Communicator> staged_control_;  // agreement_comm() over NCCL
};

}  // namespace statescan
