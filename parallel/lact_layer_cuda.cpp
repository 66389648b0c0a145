// The GPU path of LactLayer (parallel/lact_layer.h): device tensors run
// kernels/cuda/lact_cuda.h with the same checks, agreement and collective
// errors as the host path. The fast-weight all-reduces take device buffers:
// over NCCL they are enqueued on the communicator's stream (the layer computes
// on that stream too, so no cross-stream waits are needed); any other
// communicator is staged through the host. The control plane (argument
// agreement, error broadcast) is small host data; over NCCL it is staged
// through a device buffer.
#include <cuda_runtime.h>

#include <memory>
#include <vector>

#include "comm/collective_check.h"
#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/cuda/lact_cuda.h"
#include "parallel/lact_layer.h"
#include "parallel/lact_layer_internal.h"
#ifdef STATESCAN_HAS_NCCL
#include "comm/nccl_communicator.h"
#endif

namespace statescan {
namespace {

#ifdef STATESCAN_HAS_NCCL
// The NCCL communicator behind `comm`, or null (every caller sits behind the
// same guard: without NCCL every communicator is a host one).
NcclCommunicator* as_nccl(Communicator& comm) {
  return dynamic_cast<NcclCommunicator*>(&comm);
}
#endif

}  // namespace

// Streams and the state forward saves for backward.
struct LactLayer::DeviceState {
  cudaStream_t stream = nullptr;
  bool owns_stream = false;
  lact_detail::LocalSizes sizes;
  lact_detail::Placement where;
  cuda::LactCudaParams params;
  cuda::LactCudaSaved saved;

  explicit DeviceState(Communicator& comm) {
#ifdef STATESCAN_HAS_NCCL
    if (NcclCommunicator* nccl = as_nccl(comm)) {
      stream = nccl->stream();
      return;
    }
#endif
    (void)comm;
    // A blocking stream: it waits for work the caller queued on the legacy
    // default stream, so inputs written there are complete when we start.
    SS_CUDA_CHECK(cudaStreamCreate(&stream));
    owns_stream = true;
  }
  ~DeviceState() {
    // Saved buffers are plain cudaMalloc; the stream's scratch frees on it.
    if (stream != nullptr) (void)cudaStreamSynchronize(stream);
    for (cudaEvent_t e : events) (void)cudaEventDestroy(e);
    if (owns_stream) (void)cudaStreamDestroy(stream);
  }
  DeviceState(const DeviceState&) = delete;
  DeviceState& operator=(const DeviceState&) = delete;

  // Waits until everything enqueued on the stream is done, through NCCL's
  // watchdog when the communicator is NCCL (a collective queued there may
  // wait for a peer).
  void drain(Communicator& comm) {
#ifdef STATESCAN_HAS_NCCL
    if (NcclCommunicator* nccl = as_nccl(comm)) {
      nccl->wait(stream);
      return;
    }
#endif
    (void)comm;
    SS_CUDA_CHECK(cudaStreamSynchronize(stream));
  }

  // drain(), then adds the GPU time of the pass's NCCL all-reduces to `stats`.
  void finish(Communicator& comm, LactExchangeStats& stats) {
    drain(comm);
    for (std::size_t i = 0; i + 1 < events_used; i += 2) {
      float ms = 0;
      SS_CUDA_CHECK(cudaEventElapsedTime(&ms, events[i], events[i + 1]));
      stats.seconds += 1e-3 * ms;
    }
    events_used = 0;
  }

  // Hash of a device tensor's bytes as the layer's stream sees them: after
  // the work queued there (a trainer's weight update on a non-blocking
  // stream, which a copy on the legacy default stream would not wait for).
  // Once per forward; the weights are H M D values, small next to the tokens.
  int64_t hash(Communicator& comm, const TensorView& t) {
    const std::size_t bytes = static_cast<std::size_t>(t.numel()) * size_of(t.dtype);
    std::vector<unsigned char> host(bytes);
    drain(comm);  // watched: the copy below then waits for nothing but itself
    SS_CUDA_CHECK(cudaMemcpyAsync(host.data(), t.data, bytes, cudaMemcpyDeviceToHost, stream));
    SS_CUDA_CHECK(cudaStreamSynchronize(stream));
    return content_hash(host.data(), bytes);
  }

  // The all-reduce of device fp32 buffers over `comm`, counted into `stats`.
  cuda::LactDeviceAllReduce all_reduce(Communicator& comm, LactExchangeStats& stats) {
    if (comm.size() == 1) return {};
    events_used = 0;  // a pass that threw may have left some behind
#ifdef STATESCAN_HAS_NCCL
    if (NcclCommunicator* nccl = as_nccl(comm)) {
      // Stream-ordered on the pass's stream `s` (the trainer may have moved
      // the shared communicator to another stream since forward): bracketed
      // by events, read back in finish().
      return [this, nccl, &stats](float* data, std::size_t count, cudaStream_t s) {
        const NcclStreamScope on_pass_stream(*nccl, s);
        SS_CUDA_CHECK(cudaEventRecord(next_event(), s));
        nccl->all_reduce_sum(data, count, CommType::f32);
        SS_CUDA_CHECK(cudaEventRecord(next_event(), s));
        stats.bytes += static_cast<double>(count * sizeof(float));
        ++stats.calls;
      };
    }
#endif
    // Host communicators: through the host, in stream order.
    return [&comm, &stats](float* data, std::size_t count, cudaStream_t s) {
      std::vector<float> host(count);
      SS_CUDA_CHECK(
          cudaMemcpyAsync(host.data(), data, count * sizeof(float), cudaMemcpyDeviceToHost, s));
      SS_CUDA_CHECK(cudaStreamSynchronize(s));
      lact_detail::timed_all_reduce(comm, host.data(), count, stats);
      SS_CUDA_CHECK(
          cudaMemcpyAsync(data, host.data(), count * sizeof(float), cudaMemcpyHostToDevice, s));
      SS_CUDA_CHECK(cudaStreamSynchronize(s));
    };
  }

 private:
  // Timing events for the NCCL all-reduces, reused from pass to pass.
  std::vector<cudaEvent_t> events;
  std::size_t events_used = 0;
  cudaEvent_t next_event() {
    if (events_used == events.size()) {
      cudaEvent_t e = nullptr;
      SS_CUDA_CHECK(cudaEventCreate(&e));
      events.push_back(e);
    }
    return events[events_used++];
  }
};

void LactLayer::DeviceStateDeleter::operator()(DeviceState* state) const {
  delete state;
}

void LactLayer::forward_device(const LactForwardArgs& a) {
  std::unique_ptr<DeviceState, DeviceStateDeleter> state(new DeviceState(comm_));
  Communicator& control = agreement_comm();
  lact_detail::Placement& where = state->where;
  where.memory = Memory::device;
  where.dtype = a.q.dtype;
  lact_detail::LocalSizes& s = state->sizes;
  collective_check(control, [&] {
    SS_CHECK_ARG(where.dtype == DType::f32 || where.dtype == DType::bf16, "q",
                 "LaCT on the GPU takes f32 or bf16 tensors, got ", where.dtype);
    s = lact_detail::check_forward_shapes(a, where);
  });
  lact_detail::agree_on_problem(control, s, config_, where, a,
                                [&](const TensorView& t) { return state->hash(comm_, t); });

  cuda::LactCudaParams& p = state->params;
  p.config = config_;
  p.dtype = where.dtype;
  p.batch = s.batch;
  p.seq_len = s.local_len * comm_.size();
  p.heads = s.heads;
  p.dim = s.dim;
  p.hidden = s.hidden;
  p.ranks = comm_.size();
  p.rank = comm_.rank();
  p.q = a.q.data;
  p.k = a.k.data;
  p.v = a.v.data;
  p.lr0 = a.lr0.data;
  p.lr1 = a.lr1.data;
  p.lr2 = a.lr2.data;
  p.w0 = a.w0.data;
  p.w1 = a.w1.data;
  p.w2 = a.w2.data;
  p.o = a.o.data;
  collective_check(control, [&] { cuda::lact_cuda_check_data(p, state->stream); });

  forward_exchange_ = {};
  cuda::lact_cuda_forward(p, state->all_reduce(comm_, forward_exchange_), &state->saved,
                          state->stream);
  state->finish(comm_, forward_exchange_);
  device_ = std::move(state);
}

void LactLayer::backward_device(const LactBackwardArgs& a) {
  if (device_ == nullptr) {
    // No device state: agree on the error over the layer's control plane.
    collective_check(agreement_comm(), [] {
      SS_FAIL("forward", "backward needs a preceding forward (on device tensors) on this layer");
    });
    return;
  }
  DeviceState& state = *device_;
#ifdef STATESCAN_HAS_NCCL
  // Over NCCL the pass runs on the communicator's stream as it is now: the
  // trainer may have moved it since forward (whose work is complete), and
  // d_o was written there.
  if (NcclCommunicator* nccl = as_nccl(comm_); nccl != nullptr && !state.owns_stream)
    state.stream = nccl->stream();
#endif
  collective_check(agreement_comm(), [&] {
    lact_detail::check_backward_shapes(a, state.sizes, state.where);
    cuda::lact_cuda_check_finite(a.d_o.data, state.where.dtype, a.d_o.numel(), "d_o", state.stream);
  });
  cuda::LactCudaGrads g;
  g.d_o = a.d_o.data;
  g.dq = a.dq.data;
  g.dk = a.dk.data;
  g.dv = a.dv.data;
  g.dlr0 = a.dlr0.data;
  g.dlr1 = a.dlr1.data;
  g.dlr2 = a.dlr2.data;
  g.dw0 = a.dw0.data;
  g.dw1 = a.dw1.data;
  g.dw2 = a.dw2.data;
  backward_exchange_ = {};
  cuda::lact_cuda_backward(state.params, g, state.saved,
                           state.all_reduce(comm_, backward_exchange_), state.stream);
  state.finish(comm_, backward_exchange_);
}

}  // namespace statescan
