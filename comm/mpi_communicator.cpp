#include "comm/mpi_communicator.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>
#include <utility>

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
// elements; an empty message is still one (empty) piece, so that both sides
// of a transfer make the same calls.
std::size_t piece_count(std::size_t count, std::size_t max_piece) {
  return count == 0 ? 1 : (count - 1) / max_piece + 1;  // no overflow near SIZE_MAX
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

// Frees a derived datatype when the scope ends, also when a call throws.
class ScopedDatatype {
 public:
  ScopedDatatype() = default;
  ~ScopedDatatype() {
    if (type_ != MPI_DATATYPE_NULL) MPI_Type_free(&type_);
  }
  ScopedDatatype(const ScopedDatatype&) = delete;
  ScopedDatatype& operator=(const ScopedDatatype&) = delete;
  MPI_Datatype* out() { return &type_; }
  MPI_Datatype get() const { return type_; }

 private:
  MPI_Datatype type_ = MPI_DATATYPE_NULL;
};

// Frees a temporary communicator when the scope ends, also when a call throws.
class ScopedComm {
 public:
  ScopedComm() = default;
  ~ScopedComm() {
    if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
  }
  ScopedComm(const ScopedComm&) = delete;
  ScopedComm& operator=(const ScopedComm&) = delete;
  MPI_Comm* out() { return &comm_; }
  MPI_Comm get() const { return comm_; }

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
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

}  // namespace

// ---- MpiEnvironment ------------------------------------------------------------

MpiEnvironment::MpiEnvironment(int* argc, char*** argv) {
  int initialised = 0, finalised = 0;
  SS_MPI_CHECK(MPI_Initialized(&initialised));
  SS_MPI_CHECK(MPI_Finalized(&finalised));
  SS_CHECK_ARG(finalised == 0, "mpi", "MPI was already finalised; it cannot be initialised again");
  if (initialised != 0) return;
  int provided = MPI_THREAD_SINGLE;
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

MpiCommunicator::MpiCommunicator(MPI_Comm comm) : max_piece_elements_(kMaxMpiCount) {
  SS_CHECK_ARG(mpi_initialised(), "mpi",
               "MPI is not initialised (or already finalised); create an MpiEnvironment first");
  SS_CHECK_ARG(comm != MPI_COMM_NULL, "comm", "is MPI_COMM_NULL");
  SS_MPI_CHECK(MPI_Comm_dup(comm, &comm_));
  init_owned();
}

MpiCommunicator::MpiCommunicator(MPI_Comm comm, Adopt)
    : comm_(comm), max_piece_elements_(kMaxMpiCount) {
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
  } catch (...) {
    MPI_Comm_free(&comm_);
    throw;
  }
}

MpiCommunicator::~MpiCommunicator() {
  if (comm_ == MPI_COMM_NULL) return;
  int finalised = 0;
  // Freeing after MPI_Finalize is erroneous; a failure here cannot be
  // reported from a destructor and leaks at most one communicator handle.
  if (MPI_Finalized(&finalised) == MPI_SUCCESS && finalised == 0) MPI_Comm_free(&comm_);
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
  const MPI_Datatype dt = mpi_type(type);
  const std::size_t elem = size_of(type);
  check_buffer(send, count, "send");
  check_buffer(recv, count, "recv");
  const std::size_t slot_bytes = count * elem;
  const bool in_place = count > 0 && send == byte_offset(recv, rank_ * slot_bytes);
  SS_CHECK_ARG(in_place || !overlaps(send, slot_bytes, recv, size_ * slot_bytes), "send",
               "overlaps recv other than at this rank's slot (the in-place layout)");
  const std::size_t pieces = piece_count(count, max_piece_elements_);
  if (pieces == 1) {
    SS_MPI_CHECK(MPI_Allgather(in_place ? MPI_IN_PLACE : send, static_cast<int>(count), dt, recv,
                               static_cast<int>(count), dt, comm_));
    return;
  }
  for (std::size_t i = 0; i < pieces; ++i) {
    const auto [offset, n] = piece(i, count, max_piece_elements_);
    ScopedDatatype run, slot;
    SS_MPI_CHECK(MPI_Type_contiguous(static_cast<int>(n), dt, run.out()));
    SS_MPI_CHECK(
        MPI_Type_create_resized(run.get(), 0, static_cast<MPI_Aint>(slot_bytes), slot.out()));
    SS_MPI_CHECK(MPI_Type_commit(slot.out()));
    SS_MPI_CHECK(MPI_Allgather(in_place ? MPI_IN_PLACE : byte_offset(send, offset * elem),
                               static_cast<int>(n), dt, byte_offset(recv, offset * elem), 1,
                               slot.get(), comm_));
  }
}

void MpiCommunicator::all_reduce_sum(void* data, std::size_t count, CommType type) {
  SS_CHECK_ARG(type != CommType::u8, "type", "all_reduce_sum is not defined for u8");
  const MPI_Datatype dt = mpi_type(type);
  const std::size_t elem = size_of(type);
  check_buffer(data, count, "data");
  for (std::size_t i = 0, pieces = piece_count(count, max_piece_elements_); i < pieces; ++i) {
    const auto [offset, n] = piece(i, count, max_piece_elements_);
    SS_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, byte_offset(data, offset * elem), static_cast<int>(n),
                               dt, MPI_SUM, comm_));
  }
}

void MpiCommunicator::all_reduce_max(void* data, std::size_t count, CommType type) {
  const MPI_Datatype dt = mpi_type(type);
  const std::size_t elem = size_of(type);
  check_buffer(data, count, "data");
  for (std::size_t i = 0, pieces = piece_count(count, max_piece_elements_); i < pieces; ++i) {
    const auto [offset, n] = piece(i, count, max_piece_elements_);
    SS_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, byte_offset(data, offset * elem), static_cast<int>(n),
                               dt, MPI_MAX, comm_));
  }
}

void MpiCommunicator::broadcast(void* data, std::size_t count, CommType type, int root) {
  const MPI_Datatype dt = mpi_type(type);
  const std::size_t elem = size_of(type);
  SS_CHECK_ARG(root >= 0 && root < size_, "root", "is ", root, ", must be in [0, ", size_, ")");
  check_buffer(data, count, "data");
  for (std::size_t i = 0, pieces = piece_count(count, max_piece_elements_); i < pieces; ++i) {
    const auto [offset, n] = piece(i, count, max_piece_elements_);
    SS_MPI_CHECK(MPI_Bcast(byte_offset(data, offset * elem), static_cast<int>(n), dt, root, comm_));
  }
}

void MpiCommunicator::send(const void* data, std::size_t count, CommType type, int peer, int tag) {
  const MPI_Datatype dt = mpi_type(type);
  const std::size_t elem = size_of(type);
  check_peer(peer, false, "peer");
  check_tag(tag);
  if (peer == -1) return;
  check_buffer(data, count, "data");
  for (std::size_t i = 0, pieces = piece_count(count, max_piece_elements_); i < pieces; ++i) {
    const auto [offset, n] = piece(i, count, max_piece_elements_);
    SS_MPI_CHECK(
        MPI_Send(byte_offset(data, offset * elem), static_cast<int>(n), dt, peer, tag, comm_));
  }
}

void MpiCommunicator::recv(void* data, std::size_t count, CommType type, int peer, int tag) {
  const MPI_Datatype dt = mpi_type(type);
  const std::size_t elem = size_of(type);
  check_peer(peer, false, "peer");
  check_tag(tag);
  if (peer == -1) return;
  check_buffer(data, count, "data");
  for (std::size_t i = 0, pieces = piece_count(count, max_piece_elements_); i < pieces; ++i) {
    const auto [offset, n] = piece(i, count, max_piece_elements_);
    MPI_Status status;
    const int rc = MPI_Recv(byte_offset(data, offset * elem), static_cast<int>(n), dt, peer, tag,
                            comm_, &status);
    check_received(rc, status, dt, n, peer, "count", "MPI_Recv");
  }
}

// Both halves at once, piece by piece: iteration i sends piece i to dest and
// receives piece i from source, so every rank's i-th call matches its peers'
// i-th calls and no rank waits on a later iteration (no deadlock). A half
// with fewer pieces, or a peer of -1, uses MPI_PROC_NULL for the rest.
void MpiCommunicator::send_recv(const void* send, std::size_t send_count, int dest, void* recv,
                                std::size_t recv_count, int source, CommType type, int tag) {
  const MPI_Datatype dt = mpi_type(type);
  const std::size_t elem = size_of(type);
  check_peer(dest, true, "peer");
  check_peer(source, true, "peer");
  check_tag(tag);
  if (dest != -1) check_buffer(send, send_count, "send");
  if (source != -1) check_buffer(recv, recv_count, "recv");
  const bool both = dest != -1 && source != -1;
  const bool in_place = both && send == recv && send_count == recv_count && send_count > 0;
  SS_CHECK_ARG(!both || in_place || !overlaps(send, send_count * elem, recv, recv_count * elem),
               "recv", "overlaps send (only send == recv with equal counts may share memory)");
  const std::size_t send_pieces = dest == -1 ? 0 : piece_count(send_count, max_piece_elements_);
  const std::size_t recv_pieces = source == -1 ? 0 : piece_count(recv_count, max_piece_elements_);
  for (std::size_t i = 0; i < std::max(send_pieces, recv_pieces); ++i) {
    const auto [send_offset, send_n] = piece(i, send_count, max_piece_elements_);
    const auto [recv_offset, recv_n] = piece(i, recv_count, max_piece_elements_);
    const int to = i < send_pieces ? dest : MPI_PROC_NULL;
    const int from = i < recv_pieces ? source : MPI_PROC_NULL;
    MPI_Status status;
    if (in_place) {
      const int rc =
          MPI_Sendrecv_replace(byte_offset(recv, recv_offset * elem), static_cast<int>(recv_n), dt,
                               to, tag, from, tag, comm_, &status);
      check_received(rc, status, dt, recv_n, from, "recv_count", "MPI_Sendrecv_replace");
    } else {
      const int rc = MPI_Sendrecv(
          byte_offset(send, send_offset * elem), static_cast<int>(to == MPI_PROC_NULL ? 0 : send_n),
          dt, to, tag, byte_offset(recv, recv_offset * elem),
          static_cast<int>(from == MPI_PROC_NULL ? 0 : recv_n), dt, from, tag, comm_, &status);
      check_received(rc, status, dt, recv_n, from, "recv_count", "MPI_Sendrecv");
    }
  }
}

void MpiCommunicator::barrier() {
  SS_MPI_CHECK(MPI_Barrier(comm_));
}

std::unique_ptr<Communicator> MpiCommunicator::split(int color, int key) {
  SS_CHECK_ARG(color >= 0, "color", "is ", color, ", must be >= 0");
  MPI_Comm group = MPI_COMM_NULL;
  SS_MPI_CHECK(MPI_Comm_split(comm_, color, key, &group));
  std::unique_ptr<MpiCommunicator> sub(new MpiCommunicator(group, Adopt{}));
  // The piece size is part of the protocol between ranks; the sub-group keeps it.
  sub->max_piece_elements_ = max_piece_elements_;
  return sub;
}

// ---- node-local shape of MPI_COMM_WORLD ----------------------------------------

namespace {
std::pair<int, int> world_local_shape() {
  // A function-local static: computed once (collectively), then cached. If the
  // first attempt throws, the next call tries again.
  static const std::pair<int, int> shape = [] {
    const auto world = MpiCommunicator::world();
    return std::make_pair(world->local_rank(), world->local_size());
  }();
  return shape;
}
}  // namespace

int local_rank() {
  return world_local_shape().first;
}
int local_size() {
  return world_local_shape().second;
}

}  // namespace statescan
