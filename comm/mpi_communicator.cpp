#include "comm/mpi_communicator.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "comm/collective_check.h"
#include "core/error.h"

namespace statescan {

namespace detail {
void throw_mpi_error(int code, const char* call, const char* file, int line) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  std::string reason;
  if (MPI_Error_string(code, text, &length) == MPI_SUCCESS) {
    reason.assign(text, static_cast<std::size_t>(std::max(length, 0)));
  } else {
    reason = concat("MPI error code ", code);
  }
  throw Error("mpi", concat(call, " failed: ", reason), file, line);
}
}  // namespace detail

namespace {

constexpr std::size_t kMaxMpiCount = static_cast<std::size_t>(INT_MAX);

// Polling: for the first kSpinPeriod, test back to back (yielding the core)
// as MPI's own blocking calls do, so healthy exchanges, including large
// rendezvous transfers that need this rank's progress, keep their speed; after
// that sleep kPollInterval between tests, so a long wait (a stalled peer, or
// one that will time out) does not burn a core an oversubscribed job needs.
constexpr std::chrono::milliseconds kSpinPeriod{1000};
constexpr std::chrono::microseconds kPollInterval{100};
// How long a cancelled receive may take to report its cancellation.
constexpr std::chrono::milliseconds kCancelGrace{100};
// The tag of fault notices on their own duplicate of the group.
constexpr int kNoticeTag = 0;

MPI_Datatype mpi_type(CommType t) {
  switch (t) {
    case CommType::f32:
      return MPI_FLOAT;
    case CommType::f64:
      return MPI_DOUBLE;
    case CommType::i64:
      return MPI_INT64_T;
    case CommType::u8:
      return MPI_UINT8_T;
  }
  SS_FAIL("type", "unknown CommType value ", static_cast<int>(t));
}

void check_buffer(const void* p, std::size_t count, const char* name) {
  SS_CHECK_ARG(count == 0 || p != nullptr, name, "is null but count is ", count);
}

bool overlaps(const void* a, std::size_t a_bytes, const void* b, std::size_t b_bytes) {
  if (a_bytes == 0 || b_bytes == 0) return false;
  const auto pa = reinterpret_cast<std::uintptr_t>(a), pb = reinterpret_cast<std::uintptr_t>(b);
  return pa < pb + b_bytes && pb < pa + a_bytes;
}

// Number of pieces of at most `max_piece` elements that carry `count`
// elements in a collective (whose counts MPI requires to agree); an empty
// message is still one (empty) piece, so that every rank makes the same calls.
std::size_t piece_count(std::size_t count, std::size_t max_piece) {
  return count == 0 ? 1 : (count - 1) / max_piece + 1;  // no overflow near SIZE_MAX
}

// Number of pieces of a point-to-point message: count / max_piece + 1, the
// last one short and possibly empty, so that counts that differ between the
// sender and the receiver always meet as pieces of different lengths on the
// receiver (which then throws). With whole pieces only, a receive naming
// fewer whole pieces than were sent ended early with the rest unread and no
// error, and one naming more waited for the timeout.
std::size_t message_piece_count(std::size_t count, std::size_t max_piece) {
  return count / max_piece + 1;
}

// The [offset, offset + length) range of piece `i`.
std::pair<std::size_t, std::size_t> piece(std::size_t i, std::size_t count, std::size_t max_piece) {
  const std::size_t offset = i * max_piece;
  return {offset, std::min(max_piece, count - std::min(count, offset))};
}

void* byte_offset(void* p, std::size_t bytes) {
  return static_cast<char*>(p) + bytes;
}
const void* byte_offset(const void* p, std::size_t bytes) {
  return static_cast<const char*>(p) + bytes;
}

// Frees an MPI handle (a derived datatype, a temporary communicator) when the
// scope ends, also when a call throws.
template <typename Handle, int (*Free)(Handle*)>
class ScopedHandle {
 public:
  explicit ScopedHandle(Handle null) : handle_(null), null_(null) {}
  ~ScopedHandle() {
    if (handle_ != null_) Free(&handle_);
  }
  ScopedHandle(const ScopedHandle&) = delete;
  ScopedHandle& operator=(const ScopedHandle&) = delete;
  Handle* out() { return &handle_; }
  Handle get() const { return handle_; }

 private:
  Handle handle_;
  Handle null_;
};

struct ScopedDatatype : ScopedHandle<MPI_Datatype, MPI_Type_free> {
  ScopedDatatype() : ScopedHandle(MPI_DATATYPE_NULL) {}
};
struct ScopedComm : ScopedHandle<MPI_Comm, MPI_Comm_free> {
  ScopedComm() : ScopedHandle(MPI_COMM_NULL) {}
};

// Checks the outcome of a receive: a message longer than the buffer
// (MPI_ERR_TRUNCATE) or shorter than expected is a count mismatch between the
// two ranks, reported on the `count_arg`; any other failure is an MPI error.
void check_received(int rc, const MPI_Status& status, MPI_Datatype type, std::size_t expected,
                    int source, const char* count_arg, const char* call) {
  if (rc != MPI_SUCCESS) {
    int error_class = MPI_SUCCESS;
    if (MPI_Error_class(rc, &error_class) == MPI_SUCCESS && error_class == MPI_ERR_TRUNCATE) {
      SS_FAIL(count_arg, "the message from rank ", source, " is longer than the ", expected,
              " elements expected (", call, ")");
    }
    detail::throw_mpi_error(rc, call, __FILE__, __LINE__);
  }
  if (source == MPI_PROC_NULL) return;
  int received = 0;
  SS_MPI_CHECK(MPI_Get_count(&status, type, &received));
  SS_CHECK_ARG(received != MPI_UNDEFINED && static_cast<std::size_t>(received) == expected,
               count_arg, "received ", received, " elements from rank ", source, ", expected ",
               expected, " (", call, ")");
}

bool mpi_initialised() {
  int initialised = 0, finalised = 0;
  SS_MPI_CHECK(MPI_Initialized(&initialised));
  SS_MPI_CHECK(MPI_Finalized(&finalised));
  return initialised != 0 && finalised == 0;
}

// The node-local rank and size of MPI_COMM_WORLD once a communicator over the
// world's ranks has computed them (they never change for a process).
std::mutex g_world_shape_mutex;
std::optional<std::pair<int, int>> g_world_shape;

void remember_world_local_shape(int local_rank, int local_size) {
  const std::lock_guard<std::mutex> lock(g_world_shape_mutex);
  g_world_shape = std::make_pair(local_rank, local_size);
}

}  // namespace

// ---- MpiEnvironment ------------------------------------------------------------

MpiEnvironment::MpiEnvironment(int* argc, char*** argv) {
  int initialised = 0, finalised = 0;
  SS_MPI_CHECK(MPI_Initialized(&initialised));
  SS_MPI_CHECK(MPI_Finalized(&finalised));
  SS_CHECK_ARG(finalised == 0, "mpi", "MPI was already finalised; it cannot be initialised again");
  int provided = MPI_THREAD_SINGLE;
  if (initialised != 0) {
    // Initialised by the caller: the same terms as below, not silently fewer.
    SS_MPI_CHECK(MPI_Query_thread(&provided));
    SS_CHECK_ARG(provided >= MPI_THREAD_FUNNELED, "mpi", "MPI was initialised at thread level ",
                 provided, ", below MPI_THREAD_FUNNELED (", MPI_THREAD_FUNNELED,
                 "), which the library's worker threads need: initialise it with "
                 "MPI_Init_thread(..., MPI_THREAD_FUNNELED or higher, ...)");
    return;
  }
  SS_MPI_CHECK(MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided));
  if (provided < MPI_THREAD_FUNNELED) {
    // The library runs worker threads beside MPI; without FUNNELED support
    // that is not allowed, so give MPI back rather than run on undefined terms.
    MPI_Finalize();
    SS_FAIL("mpi", "MPI provides thread level ", provided, ", below MPI_THREAD_FUNNELED (",
            MPI_THREAD_FUNNELED, ")");
  }
  initialised_here_ = true;
}

MpiEnvironment::~MpiEnvironment() {
  if (!initialised_here_) return;
  int finalised = 0;
  // A destructor cannot report failure; a failed finalise leaves nothing to
  // clean up anyway.
  if (MPI_Finalized(&finalised) == MPI_SUCCESS && finalised == 0) MPI_Finalize();
}

// ---- MpiCommunicator -----------------------------------------------------------

std::unique_ptr<MpiCommunicator> MpiCommunicator::world() {
  return std::make_unique<MpiCommunicator>(MPI_COMM_WORLD);
}

// The duplicate is made non-blocking and polled, so a rank that never joins
// the construction is reported after the timeout instead of hanging the rest.
MpiCommunicator::MpiCommunicator(MPI_Comm comm)
    : max_piece_elements_(kMaxMpiCount), timeout_(comm_timeout_from_env()) {
  SS_CHECK_ARG(mpi_initialised(), "mpi",
               "MPI is not initialised (or already finalised); create an MpiEnvironment first");
  SS_CHECK_ARG(comm != MPI_COMM_NULL, "comm", "is MPI_COMM_NULL");
  // A duplicate that times out is reported before init_owned runs: this
  // rank and the group's size must already be known for its message.
  int world_rank = 0;
  SS_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank));
  set_error_rank(world_rank);
  SS_MPI_CHECK(MPI_Comm_rank(comm, &rank_));
  SS_MPI_CHECK(MPI_Comm_size(comm, &size_));
  // MPI writes the new handle when the duplicate completes, which after a
  // timeout may be later (a late peer): so not into this object, which the
  // throw destroys, but into a heap cell that is then left to MPI.
  auto duplicate = std::make_unique<MPI_Comm>(MPI_COMM_NULL);
  Pending dup;
  SS_MPI_CHECK(MPI_Comm_idup(comm, duplicate.get(), &dup.request));
  try {
    await(&dup, 1, "MPI_Comm_idup", "MpiCommunicator construction");
  } catch (...) {
    (void)duplicate.release();
    throw;
  }
  if (dup.rc != MPI_SUCCESS) detail::throw_mpi_error(dup.rc, "MPI_Comm_idup", __FILE__, __LINE__);
  comm_ = *duplicate;
  init_owned();
}

// The timeout comes from the parent (split): reading the environment here
// could throw before init_owned, leaking `comm` on this rank alone.
MpiCommunicator::MpiCommunicator(MPI_Comm comm, Adopt, std::chrono::milliseconds timeout)
    : comm_(comm), max_piece_elements_(kMaxMpiCount), timeout_(timeout) {
  init_owned();
}

// Sets up a communicator this object owns: errors come back as codes, the
// group's shape and the node-local shape are cached, and the error rank is
// set so every message names this process. Frees comm_ if anything fails,
// since the destructor will not run for a constructor that throws.
void MpiCommunicator::init_owned() {
  try {
    SS_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
    int world_rank = 0;
    SS_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank));
    set_error_rank(world_rank);
    SS_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
    SS_MPI_CHECK(MPI_Comm_size(comm_, &size_));
    void* tag_ub = nullptr;
    int has_tag_ub = 0;
    SS_MPI_CHECK(MPI_Comm_get_attr(comm_, MPI_TAG_UB, &tag_ub, &has_tag_ub));
    if (has_tag_ub != 0 && tag_ub != nullptr) tag_upper_bound_ = *static_cast<int*>(tag_ub);
    ScopedComm node;
    SS_MPI_CHECK(
        MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, node.out()));
    SS_MPI_CHECK(MPI_Comm_rank(node.get(), &local_rank_));
    SS_MPI_CHECK(MPI_Comm_size(node.get(), &local_size_));
    // Over the world's ranks in the world's order (world() first of all) the
    // node-local shape is the world's: keep it, so that local_rank() needs no
    // collective of its own later.
    int relation = MPI_UNEQUAL;
    SS_MPI_CHECK(MPI_Comm_compare(comm_, MPI_COMM_WORLD, &relation));
    if (relation == MPI_IDENT || relation == MPI_CONGRUENT)
      remember_world_local_shape(local_rank_, local_size_);
    // Every rank is here (the group was just made): a blocking duplicate
    // cannot wait for an absent one.
    SS_MPI_CHECK(MPI_Comm_dup(comm_, &notices_));
    SS_MPI_CHECK(MPI_Comm_set_errhandler(notices_, MPI_ERRORS_RETURN));
  } catch (...) {
    if (notices_ != MPI_COMM_NULL) MPI_Comm_free(&notices_);
    MPI_Comm_free(&comm_);
    throw;
  }
}

MpiCommunicator::~MpiCommunicator() {
  int finalised = 0;
  // Calling MPI after MPI_Finalize is erroneous; a failure here cannot be
  // reported from a destructor and leaks at most one communicator handle.
  if (MPI_Finalized(&finalised) != MPI_SUCCESS || finalised != 0) return;
  // Operations a timeout left behind: free those that completed since (a late
  // peer); the others stay with MPI, which completes them normally even after
  // the communicator is freed.
  for (MPI_Request& request : stranded_) {
    int flag = 0;
    MPI_Test(&request, &flag, MPI_STATUS_IGNORE);
  }
  if (notices_ != MPI_COMM_NULL) MPI_Comm_free(&notices_);
  if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

void MpiCommunicator::set_timeout(std::chrono::milliseconds timeout) {
  check_comm_timeout(timeout, "timeout");
  timeout_ = timeout;
}

void MpiCommunicator::check_usable() const {
  SS_CHECK_ARG(failure_.empty(), "mpi", "this communicator is unusable after an earlier ", failure_,
               "; end the job (MPI cannot take back the operations it left posted)");
}

// Polls every op with MPI_Test until all are done. A request that completes in
// error is done too (its code is in rc, for the caller to judge: a receive's
// truncation is a count mismatch, not an MPI failure).
void MpiCommunicator::await(Pending* ops, int n, const char* call, const char* op) {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point start = Clock::now();
  int remaining = 0;
  for (int i = 0; i < n; ++i) remaining += ops[i].done ? 0 : 1;
  while (remaining > 0) {
    for (int i = 0; i < n; ++i) {
      Pending& p = ops[i];
      if (p.done) continue;
      int flag = 0;
      p.rc = MPI_Test(&p.request, &flag, &p.status);
      if (p.rc != MPI_SUCCESS || flag != 0) {
        p.done = true;
        --remaining;
      }
    }
    if (remaining == 0) break;
    const std::string notice = take_notice();
    if (!notice.empty()) {
      abandon(ops, n);
      Error e("mpi", detail::concat(call, " in ", op, " stopped waiting: ", notice), __FILE__,
              __LINE__);
      throw e.mark_peers_know();
    }
    const auto waited = Clock::now() - start;
    if (timeout_.count() > 0 && waited >= timeout_) break;
    if (waited < kSpinPeriod) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(kPollInterval);
    }
  }
  if (remaining == 0) return;

  const int waited_for = abandon(ops, n);
  const std::string peer_text = waited_for >= 0
                                    ? detail::concat("peer ", waited_for)
                                    : detail::concat("a peer of this group of ", size_,
                                                     " ranks died or did not make the same call");
  failure_ = detail::concat(call, " in ", op, " that timed out after ", timeout_.count(), " ms");
  SS_FAIL("mpi", call, " timed out after ", timeout_.count(), " ms in ", op, " (", peer_text, ")");
}

// Receives can be withdrawn, so their buffers are safe again; everything else
// stays posted (MPI forbids cancelling a collective).
int MpiCommunicator::abandon(Pending* ops, int n) {
  using Clock = std::chrono::steady_clock;
  int waited_for = -1;
  for (int i = 0; i < n; ++i) {
    Pending& p = ops[i];
    if (p.done) continue;
    if (waited_for < 0) waited_for = p.peer;
    if (p.receive && MPI_Cancel(&p.request) == MPI_SUCCESS) {
      const Clock::time_point cancelled = Clock::now();
      int flag = 0;
      while (MPI_Test(&p.request, &flag, MPI_STATUS_IGNORE) == MPI_SUCCESS && flag == 0 &&
             Clock::now() - cancelled < kCancelGrace) {
        std::this_thread::yield();
      }
      if (flag != 0) continue;
    }
    stranded_.push_back(p.request);
  }
  return waited_for;
}

std::string MpiCommunicator::take_notice() {
  if (notices_ == MPI_COMM_NULL || !failure_.empty()) return {};  // constructing, or failed
  int flag = 0;
  MPI_Status status{};
  SS_MPI_CHECK(MPI_Iprobe(MPI_ANY_SOURCE, kNoticeTag, notices_, &flag, &status));
  if (flag == 0) return {};
  int bytes = 0;
  SS_MPI_CHECK(MPI_Get_count(&status, MPI_CHAR, &bytes));
  std::string text(static_cast<std::size_t>(std::max(bytes, 0)), '\0');
  // Probed, so it is here: the receive completes at once.
  SS_MPI_CHECK(MPI_Recv(&text[0], bytes, MPI_CHAR, status.MPI_SOURCE, kNoticeTag, notices_,
                        MPI_STATUS_IGNORE));
  failure_ = detail::concat("fault notice from rank ", status.MPI_SOURCE, " of the group");
  return detail::concat("rank ", status.MPI_SOURCE, " of this group of ", size_,
                        " failed on its own and told its peers. Its error: ", text);
}

void MpiCommunicator::notify_failure(const std::string& what) noexcept {
  try {
    int finalised = 0;
    if (notified_ || size_ == 1 || notices_ == MPI_COMM_NULL ||
        MPI_Finalized(&finalised) != MPI_SUCCESS || finalised != 0)
      return;
    notified_ = true;
    // The buffer lives as long as this communicator (the sends may complete
    // after this returns).
    const std::string clipped = clip_text(what, kNoticeBytes);
    stranded_buffers_.emplace_back(clipped.begin(), clipped.end());
    std::vector<unsigned char>& text = stranded_buffers_.back();
    for (int peer = 0; peer < size_; ++peer) {
      if (peer == rank_) continue;
      MPI_Request request = MPI_REQUEST_NULL;
      if (MPI_Isend(text.data(), static_cast<int>(text.size()), MPI_CHAR, peer, kNoticeTag,
                    notices_, &request) == MPI_SUCCESS)
        stranded_.push_back(request);
    }
    if (failure_.empty()) failure_ = "failure on this rank, which its peers were told of";
  } catch (...) {
    // Best effort: the caller is already on its way out with its own error.
  }
}

void MpiCommunicator::set_max_piece_elements(std::size_t elements) {
  SS_CHECK_ARG(elements >= 1 && elements <= kMaxMpiCount, "elements", "is ", elements,
               ", must be in [1, ", kMaxMpiCount, "]");
  max_piece_elements_ = elements;
}

void MpiCommunicator::check_peer(int peer, bool allow_self, const char* name) const {
  SS_CHECK_ARG(peer >= -1 && peer < size_, name, "is ", peer, ", must be -1 or in [0, ", size_,
               ")");
  SS_CHECK_ARG(allow_self || peer != rank_, name, "is this rank (", rank_,
               "); a blocking send or receive to oneself can deadlock");
}

void MpiCommunicator::check_tag(int tag) const {
  SS_CHECK_ARG(tag >= 0 && tag <= tag_upper_bound_, "tag", "is ", tag, ", must be in [0, ",
               tag_upper_bound_, "]");
}

// Gathers `count` elements from every rank into recv (rank i at i * count).
// Pieces of a large message land at their offset inside each rank's slot: the
// receive type is `n` elements resized to the extent of one whole slot.
void MpiCommunicator::all_gather(const void* send, void* recv, std::size_t count, CommType type) {
  timed_all_gather(send, recv, count, type, "all_gather");
}

void MpiCommunicator::timed_all_gather(const void* send, void* recv, std::size_t count,
                                       CommType type, const char* op) {
  const MPI_Datatype dt = mpi_type(type);
  const std::size_t elem = size_of(type);
  check_usable();
  check_buffer(send, count, "send");
  check_buffer(recv, count, "recv");
  const std::size_t slot_bytes = count * elem;
  const bool in_place = count > 0 && send == byte_offset(recv, rank_ * slot_bytes);
  SS_CHECK_ARG(in_place || !overlaps(send, slot_bytes, recv, size_ * slot_bytes), "send",
               "overlaps recv other than at this rank's slot (the in-place layout)");
  const std::size_t pieces = piece_count(count, max_piece_elements_);
  if (pieces == 1) {
    Pending gather;
    SS_MPI_CHECK(MPI_Iallgather(in_place ? MPI_IN_PLACE : send, static_cast<int>(count), dt, recv,
                                static_cast<int>(count), dt, comm_, &gather.request));
    await(&gather, 1, "MPI_Iallgather", op);
    if (gather.rc != MPI_SUCCESS) {
      detail::throw_mpi_error(gather.rc, "MPI_Iallgather", __FILE__, __LINE__);
    }
    return;
  }
  for (std::size_t i = 0; i < pieces; ++i) {
    const auto [offset, n] = piece(i, count, max_piece_elements_);
    ScopedDatatype run, slot;
    SS_MPI_CHECK(MPI_Type_contiguous(static_cast<int>(n), dt, run.out()));
    SS_MPI_CHECK(
        MPI_Type_create_resized(run.get(), 0, static_cast<MPI_Aint>(slot_bytes), slot.out()));
    SS_MPI_CHECK(MPI_Type_commit(slot.out()));
    // The datatypes must outlive the operation: wait inside the iteration.
    Pending gather;
    SS_MPI_CHECK(MPI_Iallgather(in_place ? MPI_IN_PLACE : byte_offset(send, offset * elem),
                                static_cast<int>(n), dt, byte_offset(recv, offset * elem), 1,
                                slot.get(), comm_, &gather.request));
    await(&gather, 1, "MPI_Iallgather", op);
    if (gather.rc != MPI_SUCCESS) {
      detail::throw_mpi_error(gather.rc, "MPI_Iallgather", __FILE__, __LINE__);
    }
  }
}

void MpiCommunicator::all_reduce_sum(void* data, std::size_t count, CommType type) {
  SS_CHECK_ARG(type != CommType::u8, "type", "all_reduce_sum is not defined for u8");
  all_reduce(data, count, type, MPI_SUM, "all_reduce_sum");
}

void MpiCommunicator::all_reduce_max(void* data, std::size_t count, CommType type) {
  all_reduce(data, count, type, MPI_MAX, "all_reduce_max");
}

// In-place reduction, piece by piece, each piece waited for with the timeout.
void MpiCommunicator::all_reduce(void* data, std::size_t count, CommType type, MPI_Op op,
                                 const char* name) {
  const MPI_Datatype dt = mpi_type(type);
  const std::size_t elem = size_of(type);
  check_usable();
  check_buffer(data, count, "data");
  for (std::size_t i = 0, pieces = piece_count(count, max_piece_elements_); i < pieces; ++i) {
    const auto [offset, n] = piece(i, count, max_piece_elements_);
    Pending reduce;
    SS_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, byte_offset(data, offset * elem), static_cast<int>(n),
                                dt, op, comm_, &reduce.request));
    await(&reduce, 1, "MPI_Iallreduce", name);
    if (reduce.rc != MPI_SUCCESS) {
      detail::throw_mpi_error(reduce.rc, "MPI_Iallreduce", __FILE__, __LINE__);
    }
  }
}

void MpiCommunicator::broadcast(void* data, std::size_t count, CommType type, int root) {
  const MPI_Datatype dt = mpi_type(type);
  const std::size_t elem = size_of(type);
  SS_CHECK_ARG(root >= 0 && root < size_, "root", "is ", root, ", must be in [0, ", size_, ")");
  check_usable();
  check_buffer(data, count, "data");
  for (std::size_t i = 0, pieces = piece_count(count, max_piece_elements_); i < pieces; ++i) {
    const auto [offset, n] = piece(i, count, max_piece_elements_);
    Pending bcast;
    // Everyone waits for the root's data: a missing root is the peer to name.
    if (rank_ != root) bcast.peer = root;
    SS_MPI_CHECK(MPI_Ibcast(byte_offset(data, offset * elem), static_cast<int>(n), dt, root, comm_,
                            &bcast.request));
    await(&bcast, 1, "MPI_Ibcast", "broadcast");
    if (bcast.rc != MPI_SUCCESS) {
      detail::throw_mpi_error(bcast.rc, "MPI_Ibcast", __FILE__, __LINE__);
    }
  }
}

void MpiCommunicator::send(const void* data, std::size_t count, CommType type, int peer, int tag) {
  // message() only reads the buffer when sending.
  message(const_cast<void*>(data), count, type, peer, tag, false);
}

void MpiCommunicator::recv(void* data, std::size_t count, CommType type, int peer, int tag) {
  message(data, count, type, peer, tag, true);
}

void MpiCommunicator::message(void* data, std::size_t count, CommType type, int peer, int tag,
                              bool receive) {
  const MPI_Datatype dt = mpi_type(type);
  const std::size_t elem = size_of(type);
  const char* call = receive ? "MPI_Irecv" : "MPI_Isend";
  check_peer(peer, false, "peer");
  check_tag(tag);
  if (peer == -1) return;
  check_usable();
  check_buffer(data, count, "data");
  for (std::size_t i = 0, pieces = message_piece_count(count, max_piece_elements_); i < pieces;
       ++i) {
    const auto [offset, n] = piece(i, count, max_piece_elements_);
    Pending op;
    op.peer = peer;
    op.receive = receive;
    void* at = byte_offset(data, offset * elem);
    if (receive)
      SS_MPI_CHECK(MPI_Irecv(at, static_cast<int>(n), dt, peer, tag, comm_, &op.request));
    else
      SS_MPI_CHECK(MPI_Isend(at, static_cast<int>(n), dt, peer, tag, comm_, &op.request));
    await(&op, 1, call, receive ? "recv" : "send");
    if (receive)
      check_received(op.rc, op.status, dt, n, peer, "count", call);
    else if (op.rc != MPI_SUCCESS)
      detail::throw_mpi_error(op.rc, call, __FILE__, __LINE__);
  }
}

// Both halves at once, piece by piece: iteration i sends piece i to dest and
// receives piece i from source, so every rank's i-th call matches its peers'
// i-th calls and no rank waits on a later iteration (no deadlock). A half
// with fewer pieces, or a peer of -1, uses MPI_PROC_NULL for the rest. The
// in-place exchange sends from a copy of the piece (there is no non-blocking
// MPI_Sendrecv_replace before MPI-4).
void MpiCommunicator::send_recv(const void* send, std::size_t send_count, int dest, void* recv,
                                std::size_t recv_count, int source, CommType type, int tag) {
  const MPI_Datatype dt = mpi_type(type);
  const std::size_t elem = size_of(type);
  check_peer(dest, true, "dest");
  check_peer(source, true, "source");
  check_tag(tag);
  if (dest != -1) check_buffer(send, send_count, "send");
  if (source != -1) check_buffer(recv, recv_count, "recv");
  const bool both = dest != -1 && source != -1;
  const bool in_place = both && send == recv && send_count == recv_count && send_count > 0;
  SS_CHECK_ARG(!both || in_place || !overlaps(send, send_count * elem, recv, recv_count * elem),
               "recv", "overlaps send (only send == recv with equal counts may share memory)");
  check_usable();
  const std::size_t send_pieces =
      dest == -1 ? 0 : message_piece_count(send_count, max_piece_elements_);
  const std::size_t recv_pieces =
      source == -1 ? 0 : message_piece_count(recv_count, max_piece_elements_);
  std::vector<unsigned char> in_place_copy;
  for (std::size_t i = 0; i < std::max(send_pieces, recv_pieces); ++i) {
    const auto [send_offset, send_n] = piece(i, send_count, max_piece_elements_);
    const auto [recv_offset, recv_n] = piece(i, recv_count, max_piece_elements_);
    const int to = i < send_pieces ? dest : MPI_PROC_NULL;
    const int from = i < recv_pieces ? source : MPI_PROC_NULL;
    const std::size_t send_bytes = (to == MPI_PROC_NULL ? 0 : send_n) * elem;
    const void* send_from = byte_offset(send, send_offset * elem);
    if (in_place && send_bytes > 0) {
      const auto* first = static_cast<const unsigned char*>(send_from);
      in_place_copy.assign(first, first + send_bytes);
      send_from = in_place_copy.data();
    }
    // ops[0] receives, ops[1] sends: the receive is posted first so a
    // message to oneself finds it.
    Pending ops[2];
    ops[0].receive = true;
    ops[0].peer = from;
    ops[1].peer = to;
    SS_MPI_CHECK(MPI_Irecv(byte_offset(recv, recv_offset * elem),
                           static_cast<int>(from == MPI_PROC_NULL ? 0 : recv_n), dt, from, tag,
                           comm_, &ops[0].request));
    SS_MPI_CHECK(MPI_Isend(send_from, static_cast<int>(send_bytes / elem), dt, to, tag, comm_,
                           &ops[1].request));
    try {
      await(ops, 2, "MPI_Irecv/MPI_Isend", "send_recv");
    } catch (...) {
      // The send may still be posted: its copy must outlive this call (a
      // moved vector keeps its storage).
      stranded_buffers_.push_back(std::move(in_place_copy));
      throw;
    }
    check_received(ops[0].rc, ops[0].status, dt, recv_n, from, "recv_count", "MPI_Irecv");
    if (ops[1].rc != MPI_SUCCESS) {
      detail::throw_mpi_error(ops[1].rc, "MPI_Isend", __FILE__, __LINE__);
    }
  }
}

void MpiCommunicator::barrier() {
  timed_barrier("barrier");
}

void MpiCommunicator::timed_barrier(const char* op) {
  check_usable();
  Pending arrived;
  SS_MPI_CHECK(MPI_Ibarrier(comm_, &arrived.request));
  await(&arrived, 1, "MPI_Ibarrier", op);
  if (arrived.rc != MPI_SUCCESS) {
    detail::throw_mpi_error(arrived.rc, "MPI_Ibarrier", __FILE__, __LINE__);
  }
}

std::unique_ptr<Communicator> MpiCommunicator::split(int color, int key) {
  check_usable();
  // MPI_Comm_split has no non-blocking form, so a timed all-gather of every
  // rank's (call, color, key) runs first: the split itself then starts only
  // once every rank is known to be in split, not missing (a timeout here) nor
  // in another collective (a barrier would match a peer's barrier() and leave
  // this rank in MPI_Comm_split for ever), and a bad color on any rank is the
  // same error on every rank instead of a throw that leaves the others waiting.
  constexpr int64_t kSplitCall = 0x5353'73706c6974;  // "SS" "split"
  const std::size_t n = static_cast<std::size_t>(size_);
  // Heap bytes, handed to stranded_buffers_ on a throw: a timed-out gather
  // stays posted and may still write them when a late peer arrives.
  std::vector<unsigned char> gathered((n + 1) * 3 * sizeof(int64_t));
  auto* all = reinterpret_cast<int64_t*>(gathered.data());
  int64_t* mine = all + 3 * n;
  mine[0] = kSplitCall;
  mine[1] = color;
  mine[2] = key;
  try {
    timed_all_gather(mine, all, 3, CommType::i64, "split");
  } catch (...) {
    stranded_buffers_.push_back(std::move(gathered));
    throw;
  }
  for (std::size_t r = 0; r < n; ++r) {
    SS_CHECK_ARG(all[3 * r] == kSplitCall, "split", "rank ", r,
                 " made another collective call where this rank called split");
  }
  for (std::size_t r = 0; r < n; ++r) {
    SS_CHECK_ARG(all[3 * r + 1] >= 0, "color", "is ", all[3 * r + 1], " on rank ", r,
                 ", must be >= 0");
  }
  MPI_Comm group = MPI_COMM_NULL;
  SS_MPI_CHECK(MPI_Comm_split(comm_, color, key, &group));
  std::unique_ptr<MpiCommunicator> sub(new MpiCommunicator(group, Adopt{}, timeout_));
  // The piece size is part of the protocol between ranks; the sub-group keeps it.
  sub->max_piece_elements_ = max_piece_elements_;
  return sub;
}

// ---- node-local shape of MPI_COMM_WORLD ----------------------------------------

namespace {
std::pair<int, int> world_local_shape() {
  {
    const std::lock_guard<std::mutex> lock(g_world_shape_mutex);
    if (g_world_shape) return *g_world_shape;
  }
  // Not known yet: a communicator over the world learns it (collectively)
  // and remembers it. If that throws, the next call tries again.
  const auto world = MpiCommunicator::world();
  return {world->local_rank(), world->local_size()};
}
}  // namespace

int local_rank() {
  return world_local_shape().first;
}
int local_size() {
  return world_local_shape().second;
}

}  // namespace statescan
