// The context-parallel mixer (DESIGN §5): each rank holds a contiguous shard
// of the sequence; a distributed scan over the communicator carries the
// boundary state forward and its gradient backward.
//
// Forward per call: summary (M_r, E_r) of the shard -> exclusive scan across
// ranks (allgather | ring | tree) giving the true incoming state -> local
// chunkwise forward from it. Backward: pre-pass D_r = dS_in with zero
// downstream gradient -> reverse exclusive scan of (M_r^T, D_r) -> local
// backward with the true dS_out. The user's initial state enters where each
// sequence starts; its final state leaves where it ends.
//
// Packed sequences (B == 1, cu_seqlens over the *global* sequence, identical on
// every rank) may start and end anywhere, on and across rank boundaries.
//
// Usage (every rank, collective):
//   CpMixer mixer(comm, config, Exchange::automatic);
//   mixer.forward(fwd_args);      // saves what backward needs
//   mixer.backward(bwd_args);
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "comm/communicator.h"
#include "core/options.h"
#include "core/tensor.h"
#include "parallel/exchange.h"
#include "parallel/observer.h"

namespace statescan {

// Host or GPU: with every tensor in host memory (fp32) the CPU kernels run;
// with every tensor in device memory (CUDA builds) the CUDA kernels run, in
// the dtype of q (f32, bf16 or f16: q, k, v, beta, o and their gradients;
// g and all states stay fp32), with cu_seqlens a device int64 array too.
// Mixing host and device tensors is an error naming the first odd argument.
// The GPU path's streams are the mixer's own (blocking w.r.t. the legacy
// default stream, so inputs written there are seen); forward/backward return
// once the outputs are complete.
struct CpForwardArgs {
  // Local shard, host fp32 or device: [B, T_local, H, *].
  TensorView q, k, v;
  TensorView g;     // [B,T_local,H] or [B,T_local,H,Dk]; undefined iff no decay
  TensorView beta;  // [B,T_local,H]; undefined iff additive
  // Global packed-sequence offsets [N+1] (int64, same on every rank) or undefined.
  TensorView cu_seqlens;
  // [N,H,Dk,Dv] fp32, same on every rank; undefined = zeros.
  TensorView initial_state;
  // Outputs. o: [B,T_local,H,Dv]. final_state [N,H,Dk,Dv]: on return every
  // rank holds every sequence's final state (undefined = not returned).
  TensorView o;
  TensorView final_state;
};

struct CpBackwardArgs {
  TensorView d_o;            // [B,T_local,H,Dv]
  TensorView d_final_state;  // [N,H,Dk,Dv], same on every rank; undefined = zero
  // Outputs, local shard. dg/dbeta defined exactly when g/beta were.
  TensorView dq, dk, dv, dg, dbeta;
  // [N,H,Dk,Dv]: on return every rank holds every sequence's dh0 (undefined =
  // not returned).
  TensorView d_initial_state;
};

// What the last forward/backward call spent, on this rank.
struct CpStepStats {
  double summary_s = 0, exchange_s = 0, merge_s = 0, local_s = 0, total_s = 0;
  // GPU path: the state-independent prepare stage's share of the above (in
  // forward part of local_s; in backward part of summary_s, the pre-pass, or
  // on the rank without one run while it waits for the exchange). 0 on the
  // host path.
  double prepare_s = 0;
  int64_t exchange_bytes = 0;               // bytes this rank sent in the exchange
  Exchange exchange = Exchange::allgather;  // the strategy used (auto resolved)
  // GPU path: how much of exchange_s other work on this rank's GPU ran
  // under (CUDA events; 0 on the host path, where nothing overlaps).
  double hidden_s = 0;
  double hidden_fraction() const { return exchange_s > 0 ? hidden_s / exchange_s : 0.0; }
  bool on_device = false;  // the call ran the CUDA kernels
};

class CpMixer {
 public:
  CpMixer(Communicator& comm, MixerConfig config, Exchange exchange,
          CpObserver* observer = nullptr);
  ~CpMixer();
  CpMixer(const CpMixer&) = delete;
  CpMixer& operator=(const CpMixer&) = delete;

  // Collective. Validates the arguments on every rank (a fault on any rank
  // throws the same statescan::Error on all of them, before anything is
  // written). Keeps the inputs' views and the chunk states for backward: the
  // input memory must stay valid and unchanged until backward returns.
  // A failure on this rank alone after that (a device allocation, a kernel,
  // the observer) reaches the peers as a fault notice on the mixer's
  // communicators (Communicator::notify_failure): their calls throw at once,
  // naming this rank and its error, instead of waiting out the timeout, and
  // the communicators are unusable afterwards, as after a timeout.
  void forward(const CpForwardArgs& args);
  // Collective. Needs a preceding forward on this mixer. Failures as forward.
  void backward(const CpBackwardArgs& args);

  // The GPU path over NCCL agrees on arguments and errors (a few host bytes,
  // several times a call) through a device buffer on the NCCL communicator
  // by default, ~0.2 ms a collective on NVLink. `control` (e.g. the
  // MpiCommunicator the NCCL one was created from: microseconds within a node)
  // carries that traffic instead; it must span the same ranks in the same
  // order and outlive the mixer. Not collective; null restores the default.
  void set_control(Communicator* control);

  const CpStepStats& last_forward_stats() const { return fwd_stats_; }
  const CpStepStats& last_backward_stats() const { return bwd_stats_; }
  // Collective. With the exchange `auto` on more than one rank, measures the
  // link now (over NCCL with device buffers, else through the host), which
  // the first forward would otherwise do inside its own time: statescan-run
  // calls it before its timed steps, so that a run without warm-up does not
  // count the probe as exchange time. A no-op otherwise, or once measured.
  void measure_link_now();

  // The link `auto` resolved the exchange with, measured at the first forward
  // or by measure_link_now (measure_link; over NCCL measure_link_device);
  // null before either, with an explicit exchange, or on one rank.
  const LinkModel* auto_link() const { return auto_link_ ? &*auto_link_ : nullptr; }

 private:
  struct Saved;
  // The GPU path (parallel/cp_mixer_cuda.cpp): its saved tensors and streams.
  struct DeviceState;
  struct DeviceStateDeleter {
    void operator()(DeviceState* state) const;
  };
  // forward() and backward() before a failure is told to the peers.
  void run_forward(const CpForwardArgs& args);
  void run_backward(const CpBackwardArgs& args);
  void forward_device(const CpForwardArgs& args);
  void backward_device(const CpBackwardArgs& args);
  // The communicator both paths agree on arguments over: control_, else
  // comm_, or over NCCL a host-staged view of it (made once). The host path
  // uses it too, so that a rank whose tensors sit elsewhere than its peers'
  // meets them in the same collectives and the placement check ("memory")
  // fails on every rank instead of leaving them waiting.
  Communicator& agreement_comm();
  // The exchange this forward uses: exchange_ unless automatic, else the
  // cost model's pick on the link measure_link_now measured (collective when
  // it measures).
  Exchange resolve(int64_t map_bytes, int64_t state_bytes, int64_t apply_flops);
  // One call's phases to the observer (if any), host or GPU path alike;
  // `total` is Phase::fwd or Phase::bwd.
  void report_to_observer(const CpStepStats& s, Phase total) const;

  Communicator& comm_;
  Communicator* control_ = nullptr;  // set_control; null: comm_ or its staged view
  MixerConfig config_;
  Exchange exchange_;
  CpObserver* observer_;
  std::unique_ptr<Saved> saved_;
  std::unique_ptr<DeviceState, DeviceStateDeleter> device_;
  std::unique_ptr<Communicator> staged_control_;  // agreement_comm() over NCCL
  bool saved_on_device_ = false;  // the last forward ran the GPU path
  CpStepStats fwd_stats_, bwd_stats_;
  std::optional<LinkModel> auto_link_;
};

}  // namespace statescan
