// NcclCommunicator: the Communicator over NCCL, for device buffers.
//
// Stream-ordered: every operation is *enqueued* on the communicator's CUDA
// stream (the caller's, see create() and set_stream()) and returns at once;
// it is complete when the stream reaches it. So the Communicator interface's
// "blocking" reads here as "ordered on the stream": kernels enqueued after a
// call on the same stream see its result, the host must wait() (or barrier())
// before it reads results or reuses buffers. Buffers must be device (or
// managed) memory of this communicator's GPU; host pointers throw.
//
// Fault handling: NCCL communicators are created non-blocking, which is what
// allows abort-on-timeout. Whenever this object waits, for NCCL to accept an
// operation or for the stream (wait(), barrier(), split(), creation), it
// polls the stream and ncclCommGetAsyncError until done, an error, or
// timeout(); on an error or a timeout it calls ncclCommAbort, which also
// releases this rank's kernels stuck waiting for a peer, and throws
// statescan::Error (argument "nccl") naming the operation and either "timed
// out after X ms" or NCCL's error text. After that the communicator is
// unusable: every later call throws. NCCL expects every active rank to call
// ncclCommAbort, and the abort may wait for the other ranks of the node to
// abort too; they do, each when its own wait fails or times out (or by
// calling abort()). A rank that fails on its own between calls can say so
// with notify_failure: its peers' waits hear it over MPI within milliseconds
// instead of timing out. Synchronising the stream yourself
// (cudaStreamSynchronize) bypasses the watchdog and can hang if a peer died:
// wait through the communicator.
//
// Not thread-safe: one host thread drives a communicator (as with NCCL
// itself, whose groups are per thread).
//
// Usage (every rank, one GPU per rank):
//   statescan::MpiEnvironment env(&argc, &argv);
//   auto mpi = statescan::MpiCommunicator::world();
//   cudaSetDevice(statescan::NcclCommunicator::device_for(*mpi));
//   cudaStream_t stream;  cudaStreamCreate(&stream);             // on that GPU
//   auto nccl = statescan::NcclCommunicator::create(*mpi, stream);
//   nccl->all_reduce_sum(d_grad, n, statescan::CommType::f32);   // enqueued
//   nccl->wait();                                                // host waits, watched
// create() selects the same GPU itself (cudaSetDevice); the stream must be
// one of that GPU. Stream 0 (the default stream) is allowed.
//
// Which GPU: a rank takes its index among the processes of MPI_COMM_WORLD on
// its node (statescan::local_rank()) modulo the number of GPUs it sees, for
// every communicator it creates, whatever group `mpi` is: with a DP x CP split
// each process keeps its own GPU (a group's own node-local numbering starts
// at 0 in every group), and with one visible GPU per rank
// (CUDA_VISIBLE_DEVICES=$LOCAL_RANK, Slurm --gpus-per-task=1) every rank takes
// its device 0. A device the caller made current beforehand is not kept
// (CUDA cannot tell it from the default device 0): bind GPUs through
// CUDA_VISIBLE_DEVICES, or by this rule. Two ranks of one communicator on the
// same GPU (same host, same GPU UUID) are refused by create(), naming them.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstddef>
#include <memory>
#include <optional>
#include <string>

#include "comm/communicator.h"
#include "comm/mpi_communicator.h"
#include "core/error.h"

namespace statescan {

namespace detail {
// Throws statescan::Error (argument "nccl") with ncclGetErrorString's text for
// `code`, the comm's last error text when there is one, and the call's source.
[[noreturn]] void throw_nccl_error(ncclResult_t code, ncclComm_t comm, const char* call,
                                   const char* file, int line);
}  // namespace detail

// Options of NcclCommunicator::create (outside the class so that `= {}` can
// default it).
struct NcclOptions {
  // Unset: STATESCAN_COMM_TIMEOUT_MS, else kDefaultCommTimeout. Zero waits
  // forever.
  std::optional<std::chrono::milliseconds> timeout;
  // Two ranks of the communicator on one GPU (the same GPU UUID on the same
  // host) are refused by default, on every rank, naming both: NCCL does not
  // support it (it rejects it or hangs). Ranks outside the communicator may
  // share GPUs with it freely. True keeps the all-gather (every rank runs the
  // same collectives whatever its options) but not the refusal, leaving the
  // verdict to NCCL.
  bool allow_shared_gpu = false;
};

class NcclCommunicator final : public Communicator {
 public:
  using Options = NcclOptions;

  // The GPU create() will select for this rank (see the file comment): the
  // world's node-local rank, statescan::local_rank(), not mpi.local_rank(),
  // modulo the number of visible GPUs; `mpi` only names the rank in errors.
  // Local once the world's node-local shape is known (see local_rank()).
  static int device_for(const MpiCommunicator& mpi);

  // Why NCCL cannot run over the ranks of `mpi` on the GPUs device_for()
  // picks: "" when every rank would drive a GPU of its own, else a sentence
  // naming the first two ranks (of `mpi`) that would drive the same GPU of the
  // same host. Decided by device identity (host name and GPU UUID), not by
  // counting ranks and visible GPUs per node. Collective over `mpi`: every
  // rank returns the same text, or throws the same error (a rank that sees no
  // GPU).
  static std::string gpu_conflict(MpiCommunicator& mpi);

  // Bootstraps a communicator over the ranks of `mpi`: selects this rank's GPU
  // (cudaSetDevice), rank 0 makes the NCCL unique id and broadcasts it over
  // `mpi`, then every rank joins. Collective over `mpi`; a local failure (too
  // few GPUs) throws the same error on every rank. Operations are enqueued on
  // `stream`.
  static std::unique_ptr<NcclCommunicator> create(MpiCommunicator& mpi, cudaStream_t stream,
                                                  const Options& options = {});

  // Finalises the communicator (waiting, bounded by the timeout, for what was
  // enqueued), or aborts it after an error or when finalising times out.
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* backend() const override { return "nccl"; }

  int device() const { return device_; }
  cudaStream_t stream() const { return stream_; }
  // Later operations are enqueued on `stream` (a stream of device()). Local.
  void set_stream(cudaStream_t stream) { stream_ = stream; }
  ncclComm_t native() const { return comm_; }

  // Enqueued on stream(). all_gather accepts the in-place layout send ==
  // recv + rank() * count. Sum is refused for u8, as on every backend.
  void all_gather(const void* send, void* recv, std::size_t count, CommType type) override;
  void all_reduce_sum(void* data, std::size_t count, CommType type) override;
  void all_reduce_max(void* data, std::size_t count, CommType type) override;
  void broadcast(void* data, std::size_t count, CommType type, int root) override;
  // Point to point, enqueued. NCCL has no tags: `tag` must be >= 0 and is
  // otherwise ignored; messages between one pair match in the order they were
  // posted, and a receive must name the count that was sent (NCCL cannot
  // check it). A peer of -1 is a no-op; to oneself is refused outside a group
  // (it could never complete).
  void send(const void* data, std::size_t count, CommType type, int peer, int tag) override;
  void recv(void* data, std::size_t count, CommType type, int peer, int tag) override;
  // Both halves in one NCCL group. send == recv with equal counts exchanges in
  // place (through a scratch copy of the outgoing data; not inside an open
  // group_start); other overlaps throw.
  void send_recv(const void* send, std::size_t send_count, int dest, void* recv,
                 std::size_t recv_count, int source, CommType type, int tag) override;
  // A one-element all-reduce, then wait(): returns when every rank got here
  // and everything enqueued before it on stream() has completed.
  void barrier() override;
  // ncclCommSplit (collective): a communicator over the new group on the same
  // GPU, stream and timeout. color must be >= 0.
  std::unique_ptr<Communicator> split(int color, int key) override;

  // Grouped calls: operations between group_start() and group_end() are
  // issued together (ncclGroupStart/End), e.g. many sends and receives to
  // different peers at once, including to oneself. Groups nest.
  void group_start();
  void group_end();

  // Blocks the host until everything enqueued on `stream` (default: stream())
  // completed, polling the stream and NCCL's asynchronous error state; aborts
  // and throws on an error or after timeout().
  void wait();
  void wait(cudaStream_t stream);

  // Zero waits forever; negative throws. Local.
  void set_timeout(std::chrono::milliseconds timeout) override;
  std::chrono::milliseconds timeout() const override { return timeout_; }

  // Aborts the communicator at once (e.g. when this rank must give up): its
  // enqueued operations end, its peers' operations with it will fail or time
  // out, and every later call throws. Local; never throws.
  void abort(const std::string& reason);
  bool aborted() const { return !failure_.empty(); }

  // Tells the peers over MPI (the communicator carries a private MPI
  // duplicate of the group it was created over, for fault notices alone),
  // then aborts: a peer's wait polls for notices beside its stream and
  // NCCL's error state, aborts and throws naming this rank and `what`.
  // Notices are sent and polled only on a thread that may call MPI (MPI's
  // main thread; any under MPI_THREAD_MULTIPLE): elsewhere the timeout alone
  // applies.
  void notify_failure(const std::string& what) noexcept override;

 private:
  NcclCommunicator(ncclComm_t comm, int device, cudaStream_t stream,
                   std::chrono::milliseconds timeout);
  // device_for(mpi), agreed on (a failure on one rank throws the same error
  // on every rank), and shared_device()'s verdict on that GPU's identity
  // ("GPU-<uuid>") into `conflict`: "" unless two ranks would drive it.
  // Collective.
  static int claim_gpu(MpiCommunicator& mpi, std::string* conflict);
  // Waits for `comm`'s initialisation and wraps it, inside a collective check
  // over `control`: on every rank, or aborted on every rank.
  static std::unique_ptr<NcclCommunicator> set_up_everywhere(Communicator& control, ncclComm_t comm,
                                                             int device, cudaStream_t stream,
                                                             std::chrono::milliseconds timeout,
                                                             const char* op);
  void check_usable() const;
  void check_device_buffer(const void* p, std::size_t count, const char* name) const;
  void check_peer(int peer, bool allow_self, const char* name) const;
  // After an NCCL call returned `rc`: success passes; ncclInProgress waits
  // (bounded) until NCCL has accepted the call; anything else aborts and
  // throws naming `call` and `op`.
  void settle(ncclResult_t rc, const char* call, const char* op);
  // Polls until the comm's async state leaves ncclInProgress and, when
  // `stream_done` is given, the stream drained; aborts and throws on error or
  // timeout.
  void poll(const char* op, cudaStream_t* stream_done);
  [[noreturn]] void fail(const std::string& message);
  void ensure_scratch(std::size_t bytes);

  ncclComm_t comm_ = nullptr;
  int rank_ = 0, size_ = 1;
  int device_ = 0;
  cudaStream_t stream_ = nullptr;
  std::chrono::milliseconds timeout_;
  int group_depth_ = 0;      // nesting of group_start() on this communicator
  std::string failure_;      // non-empty once aborted: why
  // Fault notices' channel: a duplicate of the MPI group this communicator
  // was created over (create(); split() splits it alike).
  std::unique_ptr<MpiCommunicator> notices_;
  void* scratch_ = nullptr;  // device memory for in-place send_recv's outgoing copy
  std::size_t scratch_bytes_ = 0;
  cudaStream_t scratch_stream_ = nullptr;  // the stream of the scratch's last use
  void* token_ = nullptr;                  // 8 device bytes for barrier()
};

// Enqueues the communicator's operations on `stream` for a scope and restores
// the stream it had when the scope ends (also on throw): for a caller that
// must run a collective on its own stream on a communicator it shares.
class NcclStreamScope {
 public:
  NcclStreamScope(NcclCommunicator& comm, cudaStream_t stream)
      : comm_(comm), previous_(comm.stream()) {
    comm_.set_stream(stream);
  }
  ~NcclStreamScope() { comm_.set_stream(previous_); }
  NcclStreamScope(const NcclStreamScope&) = delete;
  NcclStreamScope& operator=(const NcclStreamScope&) = delete;

 private:
  NcclCommunicator& comm_;
  cudaStream_t previous_;
};

}  // namespace statescan

// Checks an NCCL call that has no communicator-level recovery (ncclGetUniqueId,
// group calls outside a communicator, ...): throws statescan::Error on failure.
// Inside NcclCommunicator, calls go through settle() instead, which also
// handles non-blocking communicators' ncclInProgress and aborts on failure.
#define SS_NCCL_CHECK(call)                                                                   \
  do {                                                                                        \
    const ncclResult_t ss_nccl_rc_ = (call);                                                  \
    if (ss_nccl_rc_ != ncclSuccess) {                                                         \
      ::statescan::detail::throw_nccl_error(ss_nccl_rc_, nullptr, #call, __FILE__, __LINE__); \
    }                                                                                         \
  } while (0)
