#include "comm/nccl_communicator.h"

#include <algorithm>
#include <cstdint>
#include <thread>

#include "comm/collective_check.h"
#include "comm/nccl_host_staged.h"
#include "core/cuda_check.h"

namespace statescan {

namespace detail {
void throw_nccl_error(ncclResult_t code, ncclComm_t comm, const char* call, const char* file,
                      int line) {
  std::string text = concat(call, " failed: ", ncclGetErrorString(code));
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && *last != '\0') text += concat(" (", last, ")");
  throw Error("nccl", text, file, line);
}
}  // namespace detail

namespace {

// Whether this thread may call MPI for the notices' channel: any thread under
// MPI_THREAD_MULTIPLE, else only MPI's main thread (FUNNELED, the level
// MpiEnvironment asks for; SERIALIZED alike, since the main thread may be in
// MPI at the same moment). A trainer may drive the communicator from another
// thread (an autograd worker): there the timeout alone applies.
bool mpi_callable_here() noexcept {
  int finalised = 1, provided = MPI_THREAD_SINGLE, main_thread = 0;
  if (MPI_Finalized(&finalised) != MPI_SUCCESS || finalised != 0) return false;
  if (MPI_Query_thread(&provided) != MPI_SUCCESS) return false;
  if (provided == MPI_THREAD_MULTIPLE) return true;
  return MPI_Is_thread_main(&main_thread) == MPI_SUCCESS && main_thread != 0;
}

using Clock = std::chrono::steady_clock;

// Polling as in MpiCommunicator: back to back (yielding) for the first
// kSpinPeriod, as cudaStreamSynchronize would spin, then sleep between polls
// so a long wait does not burn a core.
constexpr std::chrono::milliseconds kSpinPeriod{1000};
constexpr std::chrono::microseconds kPollInterval{100};

ncclDataType_t nccl_type(CommType t) {
  switch (t) {
    case CommType::f32:
      return ncclFloat32;
    case CommType::f64:
      return ncclFloat64;
    case CommType::i64:
      return ncclInt64;
    case CommType::u8:
      return ncclUint8;
  }
  SS_FAIL("type", "unknown CommType value ", static_cast<int>(t));
}

bool overlaps(const void* a, std::size_t a_bytes, const void* b, std::size_t b_bytes) {
  if (a_bytes == 0 || b_bytes == 0) return false;
  const auto pa = reinterpret_cast<std::uintptr_t>(a), pb = reinterpret_cast<std::uintptr_t>(b);
  return pa < pb + b_bytes && pb < pa + a_bytes;
}

// A communicator config that makes every NCCL call return at once
// (ncclInProgress while it works), so the host can watch the clock.
ncclConfig_t nonblocking_config() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  return config;
}

// Waits, bounded by `timeout` (zero: forever), until a freshly created
// communicator has finished initialising. Aborts it and throws on failure.
void await_init(ncclComm_t comm, std::chrono::milliseconds timeout, const char* op) {
  const Clock::time_point start = Clock::now();
  for (;;) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t rc = ncclCommGetAsyncError(comm, &state);
    if (rc != ncclSuccess) state = rc;
    if (state == ncclSuccess) return;
    if (state != ncclInProgress) {
      const std::string last = ncclGetLastError(comm);
      ncclCommAbort(comm);
      SS_FAIL("nccl", op, " failed: ", ncclGetErrorString(state), last.empty() ? "" : " (", last,
              last.empty() ? "" : ")");
    }
    const auto waited = Clock::now() - start;
    if (timeout.count() > 0 && waited >= timeout) {
      ncclCommAbort(comm);
      SS_FAIL("nccl", op, " timed out after ", timeout.count(),
              " ms (a peer died or did not make the same call)");
    }
    if (waited < kSpinPeriod) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(kPollInterval);
    }
  }
}

// `device`'s identity across the job: its UUID in nvidia-smi's form
// ("GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"), the same whatever
// CUDA_VISIBLE_DEVICES numbers it; its PCI bus id where the UUID reads as
// zeros (unique on its host, which shared_device() compares too).
std::string gpu_identity(int device) {
  cudaDeviceProp prop{};
  SS_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  const auto* bytes = reinterpret_cast<const unsigned char*>(prop.uuid.bytes);
  if (std::all_of(bytes, bytes + sizeof prop.uuid.bytes, [](unsigned char b) { return b == 0; })) {
    char bus[32] = {};
    SS_CUDA_CHECK(cudaDeviceGetPCIBusId(bus, sizeof bus, device));
    return detail::concat("PCI ", bus);
  }
  static constexpr char kHex[] = "0123456789abcdef";
  std::string id = "GPU-";
  for (std::size_t i = 0; i < sizeof prop.uuid.bytes; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) id += '-';
    id += kHex[bytes[i] >> 4];
    id += kHex[bytes[i] & 0xFu];
  }
  return id;
}

}  // namespace

// ---- creation --------------------------------------------------------------------

int NcclCommunicator::device_for(const MpiCommunicator& mpi) {
  // First: its first call is a collective over MPI_COMM_WORLD, which a rank
  // must not skip by throwing below (no GPU) while its peers enter it.
  const int local = statescan::local_rank();
  int devices = 0;
  SS_CUDA_CHECK(cudaGetDeviceCount(&devices));
  SS_CHECK_ARG(devices > 0, "device", "no CUDA device is visible to rank ", mpi.rank());
  return local % devices;
}

int NcclCommunicator::claim_gpu(MpiCommunicator& mpi, std::string* conflict) {
  int device = -1;
  std::string identity;
  collective_check(mpi, [&] {
    device = device_for(mpi);
    identity = gpu_identity(device);
  });
  // Every rank runs this all-gather, whatever its caller makes of the text.
  *conflict = shared_device(mpi, identity);
  return device;
}

std::string NcclCommunicator::gpu_conflict(MpiCommunicator& mpi) {
  std::string conflict;
  (void)claim_gpu(mpi, &conflict);
  return conflict;
}

// Order matters: the GPU is chosen (and agreed to be valid on every rank)
// before the id is broadcast, so a rank that cannot take part makes every
// rank throw the same error instead of leaving the others in ncclCommInit.
std::unique_ptr<NcclCommunicator> NcclCommunicator::create(MpiCommunicator& mpi,
                                                           cudaStream_t stream,
                                                           const Options& options) {
  // Checked on every rank at once: one rank's bad timeout (or environment
  // variable, read only where no timeout is given) is every rank's error.
  std::chrono::milliseconds timeout{0};
  collective_check(mpi, [&] {
    timeout = options.timeout ? *options.timeout : comm_timeout_from_env();
    check_comm_timeout(timeout, "timeout");
  });
  // The identity all-gather runs on every rank whatever its allow_shared_gpu
  // (a per-rank option: skipping the collective on some ranks would pair
  // their next one with it). The same text on every rank; the refusal is
  // agreed too, since ranks may differ in the option.
  std::string conflict;
  const int device = claim_gpu(mpi, &conflict);
  collective_check(mpi, [&] {
    SS_CHECK_ARG(options.allow_shared_gpu || conflict.empty(), "device", conflict,
                 "; NCCL needs a GPU per rank: run one rank per GPU (or set "
                 "Options::allow_shared_gpu)");
    SS_CUDA_CHECK(cudaSetDevice(device));
  });

  // Rank 0's failure here (no usable network interface, say) must reach the
  // others now, not after they time out in the broadcast.
  ncclUniqueId id{};
  collective_check(mpi, [&] {
    if (mpi.rank() == 0) SS_NCCL_CHECK(ncclGetUniqueId(&id));
  });
  mpi.broadcast(&id, sizeof id, CommType::u8, 0);

  ncclConfig_t config = nonblocking_config();
  ncclComm_t comm = nullptr;
  const ncclResult_t rc = ncclCommInitRankConfig(&comm, mpi.size(), id, mpi.rank(), &config);
  // A rank whose call failed at once tells the others, which abort their
  // half-made communicators instead of waiting out the timeout in await_init.
  try {
    collective_check(mpi, [&] {
      if (rc != ncclSuccess && rc != ncclInProgress)
        detail::throw_nccl_error(rc, nullptr, "ncclCommInitRankConfig", __FILE__, __LINE__);
    });
  } catch (...) {
    if (comm != nullptr) ncclCommAbort(comm);
    throw;
  }
  auto made = set_up_everywhere(mpi, comm, device, stream, timeout, "ncclCommInitRankConfig");
  made->notices_ = std::make_unique<MpiCommunicator>(mpi.native());  // collective, timed
  made->notices_->set_timeout(timeout);
  return made;
}

// Initialised and set up on every rank, or aborted on every rank: a rank
// whose init or set-up failed alone would leave its peers a communicator
// whose first call waits out the timeout and reports something else.
std::unique_ptr<NcclCommunicator> NcclCommunicator::set_up_everywhere(
    Communicator& control, ncclComm_t comm, int device, cudaStream_t stream,
    std::chrono::milliseconds timeout, const char* op) {
  std::unique_ptr<NcclCommunicator> made;
  try {
    collective_check(control, [&] {
      SS_CHECK_ARG(comm != nullptr, "nccl", op, " returned no communicator");
      await_init(comm, timeout, op);                                    // aborts on failure
      made.reset(new NcclCommunicator(comm, device, stream, timeout));  // aborts on failure
    });
  } catch (...) {
    if (made) made->abort(detail::concat("a peer failed to set up its part of ", op));
    throw;
  }
  return made;
}

// Takes an initialised communicator; aborts it if anything here fails, since
// the destructor will not run for a constructor that throws.
NcclCommunicator::NcclCommunicator(ncclComm_t comm, int device, cudaStream_t stream,
                                   std::chrono::milliseconds timeout)
    : comm_(comm), device_(device), stream_(stream), timeout_(timeout) {
  try {
    SS_NCCL_CHECK(ncclCommUserRank(comm_, &rank_));
    SS_NCCL_CHECK(ncclCommCount(comm_, &size_));
    SS_CUDA_CHECK(cudaSetDevice(device_));
    SS_CUDA_CHECK(cudaMalloc(&token_, sizeof(int64_t)));
    // Zero, so barrier()'s sums of it stay zero forever.
    SS_CUDA_CHECK(cudaMemset(token_, 0, sizeof(int64_t)));
  } catch (...) {
    if (token_ != nullptr) cudaFree(token_);
    ncclCommAbort(comm_);
    throw;
  }
}

// Finalising flushes what was enqueued; it is bounded by the timeout like
// every wait, and abort is the fallback (a destructor cannot throw).
NcclCommunicator::~NcclCommunicator() {
  if (comm_ != nullptr && failure_.empty()) {
    bool finalised = false;
    if (group_depth_ == 0) {
      ncclResult_t rc = ncclCommFinalize(comm_);
      const Clock::time_point start = Clock::now();
      while (rc == ncclInProgress) {
        if (timeout_.count() > 0 && Clock::now() - start >= timeout_) break;
        std::this_thread::sleep_for(kPollInterval);
        ncclResult_t state = ncclSuccess;
        rc = ncclCommGetAsyncError(comm_, &state);
        if (rc == ncclSuccess) rc = state;
      }
      finalised = rc == ncclSuccess;
    }
    if (finalised) {
      ncclCommDestroy(comm_);
    } else {
      ncclCommAbort(comm_);
      // As in abort(): NCCL's group depth is per thread, and a group left
      // open would hold back this thread's later calls on other communicators.
      for (; group_depth_ > 0; --group_depth_) (void)ncclGroupEnd();
    }
  }
  comm_ = nullptr;
  // Aborted or finalised: nothing of ours is in flight any more.
  if (token_ != nullptr) cudaFree(token_);
  if (scratch_ != nullptr) cudaFree(scratch_);
}

// ---- checks ----------------------------------------------------------------------

void NcclCommunicator::check_usable() const {
  SS_CHECK_ARG(failure_.empty(), "nccl", "this communicator was aborted after ", failure_,
               "; it cannot be used again");
}

// NCCL reads and writes buffers from its kernels: a host pointer would fault
// on the GPU (a sticky error that kills the context), so refuse it here.
void NcclCommunicator::check_device_buffer(const void* p, std::size_t count,
                                           const char* name) const {
  if (count == 0) return;
  SS_CHECK_ARG(p != nullptr, name, "is null but count is ", count);
  cudaPointerAttributes attributes{};
  SS_CUDA_CHECK(cudaPointerGetAttributes(&attributes, p));
  SS_CHECK_ARG(attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged,
               name, "is not device memory (cudaMemoryType ", static_cast<int>(attributes.type),
               "); the NCCL communicator works on device buffers");
  SS_CHECK_ARG(attributes.type == cudaMemoryTypeManaged || attributes.device == device_, name,
               "is memory of GPU ", attributes.device, ", not of this communicator's GPU ",
               device_);
}

void NcclCommunicator::check_peer(int peer, bool allow_self, const char* name) const {
  SS_CHECK_ARG(peer >= -1 && peer < size_, name, "is ", peer, ", must be -1 or in [0, ", size_,
               ")");
  SS_CHECK_ARG(allow_self || peer != rank_, name, "is this rank (", rank_,
               "); a send or receive to oneself completes only inside group_start/group_end");
}

void NcclCommunicator::set_timeout(std::chrono::milliseconds timeout) {
  check_comm_timeout(timeout, "timeout");
  timeout_ = timeout;
}

// ---- the watchdog ------------------------------------------------------------------

void NcclCommunicator::abort(const std::string& reason) {
  if (!failure_.empty() || comm_ == nullptr) return;
  failure_ = reason.empty() ? std::string("abort()") : reason;
  ncclCommAbort(comm_);
  comm_ = nullptr;
  // NCCL's group state is per thread: a group left open here would hold back
  // every later NCCL call of this thread, on other communicators too.
  for (; group_depth_ > 0; --group_depth_) (void)ncclGroupEnd();
}

// The notice goes first: aborting may wait for the node's other ranks to
// abort too, which they do once they hear it.
void NcclCommunicator::notify_failure(const std::string& what) noexcept {
  if (!failure_.empty() || comm_ == nullptr) return;
  if (notices_ && mpi_callable_here()) notices_->notify_failure(what);
  abort("this rank's own failure, which its peers were told of");
}

// Aborting releases this rank's kernels that wait for a peer, so the stream
// drains and the process can go on to report the error.
void NcclCommunicator::fail(const std::string& message) {
  abort(message);
  SS_FAIL("nccl", message);
}

void NcclCommunicator::settle(ncclResult_t rc, const char* call, const char* op) {
  if (rc == ncclSuccess) return;
  if (rc == ncclInProgress) {
    poll(op, nullptr);
    return;
  }
  const char* last = ncclGetLastError(comm_);
  fail(detail::concat(call, " in ", op, " failed: ", ncclGetErrorString(rc),
                      last != nullptr && *last != '\0' ? detail::concat(" (", last, ")") : ""));
}

void NcclCommunicator::poll(const char* op, cudaStream_t* stream_done) {
  const Clock::time_point start = Clock::now();
  const bool notices = notices_ && mpi_callable_here();
  bool accepted = false;
  for (;;) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t rc = ncclCommGetAsyncError(comm_, &state);
    if (rc != ncclSuccess) state = rc;
    if (state != ncclSuccess && state != ncclInProgress) {
      const char* last = ncclGetLastError(comm_);
      fail(detail::concat(op, " failed: NCCL reports ", ncclGetErrorString(state),
                          last != nullptr && *last != '\0' ? detail::concat(" (", last, ")") : "",
                          " (an error on a peer or on this rank's network)"));
    }
    if (notices) {
      const std::string notice = notices_->take_notice();
      if (!notice.empty()) {
        abort(notice);
        Error e("nccl", detail::concat(op, " stopped waiting: ", notice), __FILE__, __LINE__);
        throw e.mark_peers_know();
      }
    }
    accepted = state == ncclSuccess;
    if (accepted) {
      if (stream_done == nullptr) return;
      const cudaError_t query = cudaStreamQuery(*stream_done);
      if (query == cudaSuccess) return;
      if (query != cudaErrorNotReady) {
        fail(detail::concat(op, ": the stream failed: ", cudaGetErrorName(query), " (",
                            cudaGetErrorString(query), ")"));
      }
    }
    const auto waited = Clock::now() - start;
    if (timeout_.count() > 0 && waited >= timeout_) {
      fail(detail::concat(op, " timed out after ", timeout_.count(), " ms (",
                          accepted ? "the stream did not drain" : "NCCL did not accept the call",
                          "; a peer died, stalled or did not make the same call)"));
    }
    if (waited < kSpinPeriod) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(kPollInterval);
    }
  }
}

void NcclCommunicator::wait() {
  wait(stream_);
}

void NcclCommunicator::wait(cudaStream_t stream) {
  check_usable();
  SS_CHECK_ARG(group_depth_ == 0, "wait", "called inside group_start/group_end: the grouped ",
               "operations are only issued at group_end");
  poll("wait", &stream);
}

// ---- operations --------------------------------------------------------------------

void NcclCommunicator::all_gather(const void* send, void* recv, std::size_t count, CommType type) {
  const ncclDataType_t dt = nccl_type(type);
  const std::size_t elem = size_of(type);
  check_usable();
  check_device_buffer(send, count, "send");
  check_device_buffer(recv, count * size_, "recv");
  const std::size_t slot_bytes = count * elem;
  const bool in_place = count > 0 && send == static_cast<const char*>(recv) +
                                                 static_cast<std::size_t>(rank_) * slot_bytes;
  SS_CHECK_ARG(in_place || !overlaps(send, slot_bytes, recv, size_ * slot_bytes), "send",
               "overlaps recv other than at this rank's slot (the in-place layout)");
  settle(ncclAllGather(send, recv, count, dt, comm_, stream_), "ncclAllGather", "all_gather");
}

void NcclCommunicator::all_reduce_sum(void* data, std::size_t count, CommType type) {
  SS_CHECK_ARG(type != CommType::u8, "type", "all_reduce_sum is not defined for u8");
  const ncclDataType_t dt = nccl_type(type);
  check_usable();
  check_device_buffer(data, count, "data");
  settle(ncclAllReduce(data, data, count, dt, ncclSum, comm_, stream_), "ncclAllReduce",
         "all_reduce_sum");
}

void NcclCommunicator::all_reduce_max(void* data, std::size_t count, CommType type) {
  const ncclDataType_t dt = nccl_type(type);
  check_usable();
  check_device_buffer(data, count, "data");
  settle(ncclAllReduce(data, data, count, dt, ncclMax, comm_, stream_), "ncclAllReduce",
         "all_reduce_max");
}

void NcclCommunicator::broadcast(void* data, std::size_t count, CommType type, int root) {
  const ncclDataType_t dt = nccl_type(type);
  SS_CHECK_ARG(root >= 0 && root < size_, "root", "is ", root, ", must be in [0, ", size_, ")");
  check_usable();
  check_device_buffer(data, count, "data");
  settle(ncclBroadcast(data, data, count, dt, root, comm_, stream_), "ncclBroadcast", "broadcast");
}

void NcclCommunicator::send(const void* data, std::size_t count, CommType type, int peer, int tag) {
  const ncclDataType_t dt = nccl_type(type);
  check_peer(peer, group_depth_ > 0, "peer");
  SS_CHECK_ARG(tag >= 0, "tag", "is ", tag, ", must be >= 0");
  if (peer == -1) return;
  check_usable();
  check_device_buffer(data, count, "data");
  settle(ncclSend(data, count, dt, peer, comm_, stream_), "ncclSend", "send");
}

void NcclCommunicator::recv(void* data, std::size_t count, CommType type, int peer, int tag) {
  const ncclDataType_t dt = nccl_type(type);
  check_peer(peer, group_depth_ > 0, "peer");
  SS_CHECK_ARG(tag >= 0, "tag", "is ", tag, ", must be >= 0");
  if (peer == -1) return;
  check_usable();
  check_device_buffer(data, count, "data");
  settle(ncclRecv(data, count, dt, peer, comm_, stream_), "ncclRecv", "recv");
}

// Grows the scratch buffer to at least `bytes`. cudaFree synchronises the
// device, which is what makes replacing a buffer still read by an earlier
// exchange safe; it happens only when a larger exchange comes along.
// The scratch may still be read by an in-place exchange queued on the stream
// it was last used on: before it is overwritten from another stream, or freed
// (cudaFree synchronises the device, outside the watchdog: for ever if a peer
// died with that exchange queued), that stream is drained through wait().
void NcclCommunicator::ensure_scratch(std::size_t bytes) {
  if (scratch_ != nullptr && (bytes > scratch_bytes_ || scratch_stream_ != stream_))
    wait(scratch_stream_);
  scratch_stream_ = stream_;
  if (bytes <= scratch_bytes_) return;
  if (scratch_ != nullptr) {
    SS_CUDA_CHECK(cudaFree(scratch_));
    scratch_ = nullptr;
    scratch_bytes_ = 0;
  }
  SS_CUDA_CHECK(cudaMalloc(&scratch_, bytes));
  scratch_bytes_ = bytes;
}

// One group holds both halves, so every rank posting both never deadlocks.
// In place, the outgoing data is copied first (stream-ordered), since NCCL
// may write the receive while it still reads the send.
void NcclCommunicator::send_recv(const void* send, std::size_t send_count, int dest, void* recv,
                                 std::size_t recv_count, int source, CommType type, int tag) {
  const ncclDataType_t dt = nccl_type(type);
  const std::size_t elem = size_of(type);
  check_peer(dest, true, "dest");
  check_peer(source, true, "source");
  SS_CHECK_ARG(tag >= 0, "tag", "is ", tag, ", must be >= 0");
  check_usable();
  if (dest != -1) check_device_buffer(send, send_count, "send");
  if (source != -1) check_device_buffer(recv, recv_count, "recv");
  const bool both = dest != -1 && source != -1;
  const bool in_place = both && send == recv && send_count == recv_count && send_count > 0;
  SS_CHECK_ARG(!both || in_place || !overlaps(send, send_count * elem, recv, recv_count * elem),
               "recv", "overlaps send (only send == recv with equal counts may share memory)");
  if (dest == -1 && source == -1) return;
  const void* outgoing = send;
  if (in_place) {
    // Inside an open group the copy would be sent only at group_end, and a
    // second in-place exchange of the group would overwrite it first.
    SS_CHECK_ARG(group_depth_ == 0, "recv",
                 "send == recv (in place) inside group_start/group_end: its outgoing copy would "
                 "be reused before the group is issued; pass separate buffers");
    ensure_scratch(send_count * elem);
    SS_CUDA_CHECK(
        cudaMemcpyAsync(scratch_, send, send_count * elem, cudaMemcpyDeviceToDevice, stream_));
    outgoing = scratch_;
  }
  // A failure in the group aborts (settle), and abort() closes the group.
  group_start();
  if (dest != -1)
    settle(ncclSend(outgoing, send_count, dt, dest, comm_, stream_), "ncclSend", "send_recv");
  if (source != -1)
    settle(ncclRecv(recv, recv_count, dt, source, comm_, stream_), "ncclRecv", "send_recv");
  group_end();
}

void NcclCommunicator::group_start() {
  check_usable();
  SS_NCCL_CHECK(ncclGroupStart());
  ++group_depth_;
}

void NcclCommunicator::group_end() {
  check_usable();
  SS_CHECK_ARG(group_depth_ > 0, "group_end", "called without a matching group_start");
  --group_depth_;
  settle(ncclGroupEnd(), "ncclGroupEnd", "group_end");
}

// A one-element all-reduce is enough to synchronise the ranks: nobody's
// reduction completes before everyone contributed. Then the stream is waited
// for, under the watchdog.
void NcclCommunicator::barrier() {
  check_usable();
  SS_CHECK_ARG(group_depth_ == 0, "barrier", "called inside group_start/group_end");
  settle(ncclAllReduce(token_, token_, 1, ncclInt64, ncclSum, comm_, stream_), "ncclAllReduce",
         "barrier");
  poll("barrier", &stream_);
}

std::unique_ptr<Communicator> NcclCommunicator::split(int color, int key) {
  check_usable();
  SS_CHECK_ARG(group_depth_ == 0, "split", "called inside group_start/group_end");
  // The color is agreed over this communicator first: a rank that threw alone
  // would leave the others in ncclCommSplit until the timeout, which then
  // aborts this (the parent) communicator on all of them.
  NcclHostStaged control(*this);
  collective_check(control,
                   [&] { SS_CHECK_ARG(color >= 0, "color", "is ", color, ", must be >= 0"); });
  ncclConfig_t config = nonblocking_config();
  ncclComm_t sub = nullptr;
  const ncclResult_t rc = ncclCommSplit(comm_, color, key, &sub, &config);
  if (rc != ncclSuccess && rc != ncclInProgress) {
    const char* last = ncclGetLastError(comm_);
    fail(detail::concat("ncclCommSplit in split failed: ", ncclGetErrorString(rc),
                        last != nullptr && *last != '\0' ? detail::concat(" (", last, ")") : ""));
  }
  // The parent is busy until the split is done, the child until it is
  // initialised; both are watched. A failed parent leaves a half-made child,
  // which NCCL expects every rank to abort too.
  try {
    poll("split", nullptr);
  } catch (...) {
    if (sub != nullptr) ncclCommAbort(sub);
    throw;
  }
  // Agreed over the parent, which is idle again.
  auto child = set_up_everywhere(control, sub, device_, stream_, timeout_, "ncclCommSplit");
  if (notices_) {
    // The same groups over MPI (collective over the parent's ranks, as the
    // NCCL split was) carry the child's notices.
    std::unique_ptr<Communicator> channel = notices_->split(color, key);
    child->notices_.reset(static_cast<MpiCommunicator*>(channel.release()));
  }
  return child;
}

}  // namespace statescan
