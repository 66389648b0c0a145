// Device exclusive scan of affine maps (parallel/exchange_cuda.h).
#include "parallel/exchange_cuda.h"

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "core/cuda_check.h"
#include "core/device_pool.h"
#include "core/error.h"
#include "kernels/cuda/cp_kernels.h"
#include "parallel/exchange_internal.h"
#ifdef STATESCAN_HAS_NCCL
#include "comm/collective_check.h"
#include "comm/nccl_communicator.h"
#include "comm/nccl_host_staged.h"
#endif

namespace statescan {
namespace {

using exchange_detail::Order;

// Device buffers over a host communicator (mpi), so that ranks sharing a GPU
// run the same device scans as NCCL ranks (and test them on one GPU): each
// call waits for the stream, stages the message through host memory, and
// copies what arrived back before it returns. The scans use only
// point-to-point and all_gather; the rest is refused.
class DeviceStaged final : public Communicator {
 public:
  DeviceStaged(Communicator& host, cudaStream_t stream) : host_(host), stream_(stream) {}

  int rank() const override { return host_.rank(); }
  int size() const override { return host_.size(); }
  const char* backend() const override { return "device-staged"; }
  void all_gather(const void* send, void* recv, std::size_t count, CommType type) override {
    const std::size_t bytes = count * size_of(type);
    to_host(out_, send, bytes);
    in_.resize(bytes * static_cast<std::size_t>(size()));
    host_.all_gather(out_.data(), in_.data(), count, type);
    to_device(recv, in_);
  }
  void send(const void* data, std::size_t count, CommType type, int peer, int tag) override {
    to_host(out_, data, count * size_of(type));
    host_.send(out_.data(), count, type, peer, tag);
  }
  void recv(void* data, std::size_t count, CommType type, int peer, int tag) override {
    in_.resize(peer >= 0 ? count * size_of(type) : 0);
    host_.recv(in_.data(), count, type, peer, tag);
    if (peer >= 0) to_device(data, in_);  // from nobody: the buffer stays as it is
  }
  void send_recv(const void* send, std::size_t send_count, int dest, void* recv,
                 std::size_t recv_count, int source, CommType type, int tag) override {
    if (dest >= 0) to_host(out_, send, send_count * size_of(type));
    in_.resize(source >= 0 ? recv_count * size_of(type) : 0);
    host_.send_recv(out_.data(), send_count, dest, in_.data(), recv_count, source, type, tag);
    if (source >= 0) to_device(recv, in_);
  }
  void all_reduce_sum(void*, std::size_t, CommType) override { refuse("all_reduce_sum"); }
  void all_reduce_max(void*, std::size_t, CommType) override { refuse("all_reduce_max"); }
  void broadcast(void*, std::size_t, CommType, int) override { refuse("broadcast"); }
  void barrier() override { host_.barrier(); }
  std::unique_ptr<Communicator> split(int, int) override { refuse("split"); }

 private:
  [[noreturn]] static void refuse(const char* op) {
    SS_FAIL("comm", "the device scan's staged transport has no ", op);
  }
  void to_host(std::vector<unsigned char>& host, const void* dev, std::size_t bytes) {
    host.resize(bytes);
    if (bytes > 0)
      SS_CUDA_CHECK(cudaMemcpyAsync(host.data(), dev, bytes, cudaMemcpyDeviceToHost, stream_));
    SS_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  // Waits for the copy: the host buffer is reused by the next call.
  void to_device(void* dev, const std::vector<unsigned char>& host) {
    if (!host.empty())
      SS_CUDA_CHECK(
          cudaMemcpyAsync(dev, host.data(), host.size(), cudaMemcpyHostToDevice, stream_));
    SS_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

  Communicator& host_;
  cudaStream_t stream_;
  std::vector<unsigned char> out_, in_;
};

void copy_d2d(float* dst, const float* src, int64_t count, cudaStream_t stream) {
  if (count > 0)
    SS_CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<std::size_t>(count) * sizeof(float),
                                  cudaMemcpyDeviceToDevice, stream));
}

// NCCL ignores tags (pairs match in posting order); the staged transport's
// host messages carry this one.
constexpr int kTag = 7104;

cuda::DeviceMaps maps_at(const DeviceScanMaps& d, const float* packed) {
  cuda::DeviceMaps m;
  m.maps = d.maps();
  m.dk = d.dk;
  m.dv = d.dv;
  m.diagonal = d.diagonal;
  m.M = packed;
  m.E = packed + d.maps() * d.m_size();
  return m;
}

// Packs [all M | all E] into `out` (device).
void pack(const DeviceScanMaps& d, float* out, cudaStream_t stream) {
  copy_d2d(out, d.M, d.maps() * d.m_size(), stream);
  copy_d2d(out + d.maps() * d.m_size(), d.E, d.maps() * d.dk * d.dv, stream);
}

int64_t scan_allgather(Communicator& comm, const DeviceScanMaps& d, const Order& ord, float* S,
                       cudaStream_t stream) {
  const int64_t n = d.maps() * (d.m_size() + d.dk * d.dv);
  const int64_t state = d.maps() * d.dk * d.dv;
  PoolArray<float> all(static_cast<std::size_t>(n * ord.size), stream), next(state, stream);
  // In place: this rank's maps already sit at their slot of the result.
  float* mine = all.get() + n * comm.rank();
  pack(d, mine, stream);
  comm.all_gather(mine, all.get(), static_cast<std::size_t>(n), CommType::f32);
  SS_CUDA_CHECK(cudaMemsetAsync(S, 0, state * sizeof(float), stream));
  // S_in = predecessors' maps composed in scan order, applied to a zero start.
  for (int p = 0; p < ord.pos(); ++p) {
    const float* packed = all.get() + n * ord.rank_at(p);
    cuda::apply_affine_maps(maps_at(d, packed), p == 0 ? nullptr : S, next.get(), 0, d.dv, stream);
    copy_d2d(S, next.get(), state, stream);
  }
  return n * static_cast<int64_t>(sizeof(float)) * (ord.size - 1);
}

int64_t scan_ring(Communicator& comm, const DeviceScanMaps& d, const Order& ord, float* S,
                  cudaStream_t stream) {
  const int prev = ord.rank_at(ord.pos() - 1), next = ord.rank_at(ord.pos() + 1);
  const int64_t state = d.maps() * d.dk * d.dv;
  SS_CUDA_CHECK(cudaMemsetAsync(S, 0, state * sizeof(float), stream));
  // Blocks along Dv as the host ring's (exchange_detail::ring_block_width):
  // the next rank starts on block j while this one receives and computes
  // block j+1.
  const int64_t width = exchange_detail::ring_block_width(d.dv);
  const int64_t block_max = d.maps() * d.dk * width;
  PoolArray<float> in(block_max, stream), out(block_max, stream);
  cuda::DeviceMaps mine;
  mine.maps = d.maps();
  mine.dk = d.dk;
  mine.dv = d.dv;
  mine.diagonal = d.diagonal;
  mine.M = d.M;
  mine.E = d.E;
  int64_t sent = 0;
  for (int64_t c0 = 0; c0 < d.dv; c0 += width) {
    const int64_t w = std::min(width, d.dv - c0);
    const std::size_t block = static_cast<std::size_t>(d.maps() * d.dk * w);
    if (prev >= 0) {
      comm.recv(in.get(), block, CommType::f32, prev, kTag);
      // Unpack the block ([maps*Dk rows] x w) into columns c0.. of S.
      SS_CUDA_CHECK(cudaMemcpy2DAsync(S + c0, d.dv * sizeof(float), in.get(), w * sizeof(float),
                                      w * sizeof(float), static_cast<std::size_t>(d.maps() * d.dk),
                                      cudaMemcpyDeviceToDevice, stream));
    }
    if (next < 0) continue;
    cuda::apply_affine_maps(mine, prev >= 0 ? in.get() : nullptr, out.get(), c0, w, stream);
    comm.send(out.get(), block, CommType::f32, next, kTag);
    sent += static_cast<int64_t>(block * sizeof(float));
  }
  return sent;
}

// The host scan_tree's exclusive Kogge-Stone scan (parallel/exchange.cpp says
// how it works) on device buffers: ceil(log2 P) rounds, the last one E only.
int64_t scan_tree(Communicator& comm, const DeviceScanMaps& d, const Order& ord, float* S,
                  cudaStream_t stream) {
  const int64_t m_floats = d.maps() * d.m_size(), state = d.maps() * d.dk * d.dv;
  const int64_t n = m_floats + state;
  PoolArray<float> acc(n, stream), excl(n, stream), got(n, stream), scratch(n, stream);
  pack(d, acc.get(), stream);
  int64_t sent = 0;
  for (int dist = 1; dist < ord.size; dist *= 2) {
    const bool last = 2 * dist >= ord.size;
    const int to = ord.rank_at(ord.pos() + dist), from = ord.rank_at(ord.pos() - dist);
    const int64_t count = last ? state : n;
    comm.send_recv(last ? acc.get() + m_floats : acc.get(), static_cast<std::size_t>(count), to,
                   got.get(), static_cast<std::size_t>(count), from, CommType::f32, kTag);
    if (to >= 0) sent += count * static_cast<int64_t>(sizeof(float));
    if (from < 0) continue;
    if (last) {
      // S_in = M_excl E_got + E_excl (E_got alone where nothing came before).
      if (dist > 1)  // excl holds something from the second round on
        cuda::apply_affine_maps(maps_at(d, excl.get()), got.get(), S, 0, d.dv, stream);
      else
        copy_d2d(S, got.get(), state, stream);
      return sent;
    }
    // later <- later composed after what arrived, in place.
    auto extend = [&](float* later) {
      cuda::compose_affine_maps(d.maps(), d.dk, d.dv, d.diagonal, later, later + m_floats,
                                got.get(), got.get() + m_floats, scratch.get(), stream);
    };
    if (ord.rank_at(ord.pos() + 2 * dist) >= 0) extend(acc.get());  // a later round sends acc
    if (dist > 1)
      extend(excl.get());
    else
      copy_d2d(excl.get(), got.get(), n, stream);
  }
  if (ord.pos() > 0)  // excl holds positions 0..pos-1
    copy_d2d(S, excl.get() + m_floats, state, stream);
  else
    SS_CUDA_CHECK(cudaMemsetAsync(S, 0, state * sizeof(float), stream));
  return sent;
}

}  // namespace

int64_t exclusive_scan_device(Communicator& comm, Exchange strategy, const DeviceScanMaps& maps,
                              ScanOrder order, float* incoming, cudaStream_t stream,
                              cudaEvent_t maps_ready, cudaEvent_t started) {
  check_scan_dims(maps.rows, maps.heads, maps.dk, maps.dv);
  SS_CHECK_ARG(maps.M != nullptr && maps.E != nullptr, "maps", "M and E must be device arrays");
  SS_CHECK_ARG(incoming != nullptr, "incoming", "must be a device array");
  SS_CHECK_ARG(strategy != Exchange::automatic, "exchange", "must be resolved before the scan");
  const Order ord{comm.rank(), comm.size(), order == ScanOrder::reverse};
  // Everything waits for the maps, also a ring rank's first receive, which
  // reads none of them: posted earlier, NCCL's kernel would sit on
  // multiprocessors the summary's one wave of clusters needs (header).
  if (maps_ready != nullptr) SS_CUDA_CHECK(cudaStreamWaitEvent(stream, maps_ready, 0));
  if (started != nullptr) SS_CUDA_CHECK(cudaEventRecord(started, stream));
  if (ord.size == 1) {
    SS_CUDA_CHECK(
        cudaMemsetAsync(incoming, 0, maps.maps() * maps.dk * maps.dv * sizeof(float), stream));
    return 0;
  }
  // Host communicators run the same device scans, each message staged
  // through host memory (DeviceStaged).
  std::optional<DeviceStaged> staged;
  Communicator* link = &comm;
#ifdef STATESCAN_HAS_NCCL
  std::optional<NcclStreamScope> swap;
  if (is_nccl(comm)) swap.emplace(static_cast<NcclCommunicator&>(comm), stream);
#endif
  if (!is_nccl(comm)) link = &staged.emplace(comm, stream);
  switch (strategy) {
    case Exchange::allgather:
      return scan_allgather(*link, maps, ord, incoming, stream);
    case Exchange::ring:
      return scan_ring(*link, maps, ord, incoming, stream);
    case Exchange::tree:
      return scan_tree(*link, maps, ord, incoming, stream);
    case Exchange::automatic:
      break;
  }
  SS_FAIL("exchange", "must be resolved before the scan");
}

LinkModel measure_link_device(Communicator& comm, const LinkModel& base) {
#ifdef STATESCAN_HAS_NCCL
  auto* nccl = dynamic_cast<NcclCommunicator*>(&comm);
  if (nccl != nullptr && comm.size() > 1) {
    const int P = comm.size(), r = comm.rank();
    const int next = (r + 1) % P, prev = (r + P - 1) % P;
    // How long the probe holds its stream before a timed shift: well above
    // the time the host takes to queue one send / receive pair (the whole
    // ~0.2 ms an unheld shift took, at most), and short enough that the 18
    // shifts add ~36 ms, once, to the first forward that resolves `auto`.
    constexpr double kProbeHoldSeconds = 2e-3;
    RingProbe probe;
    // 64 MiB, ~0.4 ms of transfer over NVLink: on two H200s (2026-12-01) a
    // shift timed from an idle stream cost ~0.2 ms however small, and 4 MiB
    // (~30 us of transfer) was lost in that noise.
    probe.large = std::size_t{1} << 24;
    float* buffers = nullptr;
    // Agreed over a host-staged view of the communicator: a rank whose GPU
    // has no room for the probe fails every rank, not only itself (its peers
    // would wait in the first shift until the timeout).
    try {
      NcclHostStaged control(*nccl);
      collective_check(
          control, [&] { SS_CUDA_CHECK(cudaMalloc(&buffers, 2 * probe.large * sizeof(float))); });
    } catch (...) {
      (void)cudaFree(buffers);  // a rank whose own allocation succeeded
      throw;
    }
    cudaEvent_t begin = nullptr, end = nullptr;
    auto release = [&] {
      if (begin != nullptr) (void)cudaEventDestroy(begin);
      if (end != nullptr) (void)cudaEventDestroy(end);
      (void)cudaFree(buffers);
    };
    try {
      SS_CUDA_CHECK(cudaEventCreate(&begin));
      SS_CUDA_CHECK(cudaEventCreate(&end));
      SS_CUDA_CHECK(cudaMemsetAsync(buffers, 0, 2 * probe.large * sizeof(float), nccl->stream()));
      // GPU time of the shift: events on the communicator's stream around it,
      // with the stream held (cuda::hold_stream) while the host queues NCCL's
      // calls. Recorded on an idle stream, `begin` would also time that
      // queueing, which a CP step hides (its exchange is queued behind the
      // summary's kernels); the ~0.2 ms a shift that the unheld probe gave on
      // 2026-12-01, for 8 B and 4 MiB alike, may be mostly that.
      probe.shift = [&](std::size_t count) {
        nccl->barrier();  // start together: a late peer is not link time
        cuda::hold_stream(nccl->stream(), kProbeHoldSeconds);
        SS_CUDA_CHECK(cudaEventRecord(begin, nccl->stream()));
        nccl->send_recv(buffers, count, next, buffers + probe.large, count, prev, CommType::f32, 0);
        SS_CUDA_CHECK(cudaEventRecord(end, nccl->stream()));
        nccl->wait();
        float ms = 0.f;
        SS_CUDA_CHECK(cudaEventElapsedTime(&ms, begin, end));
        return 1e-3 * ms;
      };
      // Host-staged, so that the wait for the all-reduce is the watched one:
      // a copy of its result straight into pageable host memory would block
      // the host inside CUDA until the peers arrived, with no timeout.
      NcclHostStaged staged(*nccl);
      probe.agree_max = [&](double* values, int n) {
        staged.all_reduce_max(values, static_cast<std::size_t>(n), CommType::f64);
      };
      const LinkModel m = link_from_ring_probe(probe, base);
      release();
      return m;
    } catch (...) {
      release();
      throw;
    }
  }
#endif
  return measure_link(comm, base);
}

}  // namespace statescan
