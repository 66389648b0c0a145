#include "comm/communicator.h"

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>

#include "core/error.h"
#ifdef STATESCAN_HAS_NCCL
#include "comm/nccl_host_staged.h"
#endif

namespace statescan {

const char* to_string(CommType t) {
  switch (t) {
    case CommType::f32:
      return "f32";
    case CommType::f64:
      return "f64";
    case CommType::i64:
      return "i64";
    case CommType::u8:
      return "u8";
  }
  return "invalid";
}

std::size_t size_of(CommType t) {
  switch (t) {
    case CommType::f32:
      return 4;
    case CommType::f64:
      return 8;
    case CommType::i64:
      return 8;
    case CommType::u8:
      return 1;
  }
  SS_FAIL("type", "unknown CommType value ", static_cast<int>(t));
}

// Parsed on every call (not cached) so that tests and launchers may set the
// variable before creating each communicator.
std::chrono::milliseconds comm_timeout_from_env() {
  const char* text = std::getenv("STATESCAN_COMM_TIMEOUT_MS");
  if (text == nullptr || *text == '\0') return kDefaultCommTimeout;
  errno = 0;
  char* end = nullptr;
  const long long ms = std::strtoll(text, &end, 10);
  SS_CHECK_ARG(errno == 0 && end != text && *end == '\0' && ms >= 0, "STATESCAN_COMM_TIMEOUT_MS",
               "is '", text,
               "', must be a non-negative integer number of milliseconds (0: no timeout)");
  check_comm_timeout(std::chrono::milliseconds(ms), "STATESCAN_COMM_TIMEOUT_MS");
  return std::chrono::milliseconds(ms);
}

void check_comm_timeout(std::chrono::milliseconds timeout, const char* argument) {
  SS_CHECK_ARG(timeout.count() >= 0 && timeout <= kMaxCommTimeout, argument, "is ", timeout.count(),
               " ms, must be in [0, ", kMaxCommTimeout.count(),
               "] (0: wait forever; at most 30 days)");
}

namespace {

// A non-empty buffer must exist; an empty one may be null (as in MPI).
void check_buffer(const void* p, std::size_t count, const char* name) {
  SS_CHECK_ARG(count == 0 || p != nullptr, name, "is null but count is ", count);
}

// Rejects a CommType outside the enum (size_of throws on it).
void check_type(CommType type) {
  (void)size_of(type);
}

}  // namespace

// A group of one gathers its own contribution: a copy (memmove, since the
// caller may pass the in-place layout where send points into recv).
void SingleRankCommunicator::all_gather(const void* send, void* recv, std::size_t count,
                                        CommType type) {
  const std::size_t elem = size_of(type);
  check_buffer(send, count, "send");
  check_buffer(recv, count, "recv");
  if (count > 0) std::memmove(recv, send, count * elem);
}

// Sum over one rank is the identity. Sum on u8 is refused as on every backend
// (bytes would wrap), so code that works here also works under MPI.
void SingleRankCommunicator::all_reduce_sum(void* data, std::size_t count, CommType type) {
  SS_CHECK_ARG(type != CommType::u8, "type", "all_reduce_sum is not defined for u8");
  check_buffer(data, count, "data");
}

void SingleRankCommunicator::all_reduce_max(void* data, std::size_t count, CommType type) {
  check_type(type);
  check_buffer(data, count, "data");
}

void SingleRankCommunicator::broadcast(void* data, std::size_t count, CommType type, int root) {
  check_type(type);
  SS_CHECK_ARG(root == 0, "root", "is ", root, " in a group of one");
  check_buffer(data, count, "data");
}

// Blocking point-to-point to oneself could never complete in a real
// implementation, so only the no-op peer -1 is accepted.
void SingleRankCommunicator::send(const void* data, std::size_t count, CommType type, int peer,
                                  int tag) {
  check_type(type);
  SS_CHECK_ARG(peer == -1, "peer", "is ", peer, "; a group of one can only send to -1 (nobody)");
  SS_CHECK_ARG(tag >= 0, "tag", "is ", tag, ", must be >= 0");
  check_buffer(data, count, "data");
}

void SingleRankCommunicator::recv(void* data, std::size_t count, CommType type, int peer, int tag) {
  check_type(type);
  SS_CHECK_ARG(peer == -1, "peer", "is ", peer,
               "; a group of one can only receive from -1 (nobody)");
  SS_CHECK_ARG(tag >= 0, "tag", "is ", tag, ", must be >= 0");
  check_buffer(data, count, "data");
}

// Either both halves are skipped (-1) or both talk to self (0): then the
// message is copied, as MPI_Sendrecv to self would deliver it.
void SingleRankCommunicator::send_recv(const void* send, std::size_t send_count, int dest,
                                       void* recv, std::size_t recv_count, int source,
                                       CommType type, int tag) {
  const std::size_t elem = size_of(type);
  SS_CHECK_ARG(dest == -1 || dest == 0, "dest", "is ", dest, " in a group of one");
  SS_CHECK_ARG(source == -1 || source == 0, "source", "is ", source, " in a group of one");
  SS_CHECK_ARG(dest == source, "source", "is ", source, " but dest is ", dest,
               ": both must be 0 (self) or both -1 in a group of one");
  SS_CHECK_ARG(tag >= 0, "tag", "is ", tag, ", must be >= 0");
  if (dest == -1) return;
  check_buffer(send, send_count, "send");
  check_buffer(recv, recv_count, "recv");
  // Counts must match exactly, as MpiCommunicator requires: a shorter message
  // would leave part of recv stale without anyone noticing.
  SS_CHECK_ARG(send_count == recv_count, "recv_count", "is ", recv_count,
               " but the message sent to self has ", send_count, " elements");
  if (send_count > 0) std::memmove(recv, send, send_count * elem);
}

std::unique_ptr<Communicator> SingleRankCommunicator::split(int color, int key) {
  (void)key;
  SS_CHECK_ARG(color >= 0, "color", "is ", color, ", must be >= 0");
  return std::make_unique<SingleRankCommunicator>();
}

bool is_nccl(const Communicator& comm) {
  return std::strcmp(comm.backend(), "nccl") == 0;
}

void check_host_tensors_allowed(const Communicator& comm, const char* argument, const char* owner) {
  if (!is_nccl(comm)) return;
  // Every rank throws this alike (see the header): no peer needs a notice.
  Error e(argument,
          detail::concat("host tensors need a host communicator (MPI or a single rank); this ",
                         owner, "'s is NCCL: pass device tensors"),
          __FILE__, __LINE__);
  throw e.mark_peers_know();
}

Communicator& host_collectives(Communicator& comm, std::unique_ptr<Communicator>& slot) {
#ifdef STATESCAN_HAS_NCCL
  if (is_nccl(comm)) {
    if (!slot) slot = std::make_unique<NcclHostStaged>(static_cast<NcclCommunicator&>(comm));
    return *slot;
  }
#endif
  (void)slot;
  return comm;
}

}  // namespace statescan
