// MpiCommunicator: the Communicator over MPI, for host buffers.
//
// It works on its own duplicate of the caller's MPI communicator, so the
// library's messages can never match the caller's receives (and the other way
// round), and sets MPI_ERRORS_RETURN on it so that an MPI failure becomes a
// statescan::Error naming the call instead of aborting the job. Every MPI call
// goes through SS_MPI_CHECK.
//
// Usage (every rank):
//   statescan::MpiEnvironment mpi(&argc, &argv);   // MPI_Init unless already done
//   auto world = statescan::MpiCommunicator::world();
//   auto cp = world->split(world->rank() / cp_size, world->rank());
//
// Counts above INT_MAX elements are sent in pieces of at most INT_MAX
// elements, so no size is truncated. Point-to-point receives must name the
// exact count that was sent: a shorter or longer message throws on the
// receiver, also across pieces (a point-to-point message of a multiple of
// INT_MAX elements ends with an empty piece, so that two counts never split
// into the same whole pieces).
//
// Timeouts: every operation is posted non-blocking and polled until it
// completes or timeout() passes (default: STATESCAN_COMM_TIMEOUT_MS, else
// 10 minutes; see Communicator::set_timeout), so a peer that died or skipped a
// call becomes a statescan::Error ("... timed out after X ms in <op>") on every
// rank that waits for it instead of a silent hang. MPI cannot cancel a
// collective: after a timeout the operation stays posted, the buffers given to
// the timed-out call may still be written if the peer turns up late, and this
// communicator refuses every later call. The application should then end the
// job (MPI_Abort) or at least abandon the communicator.
//
// Fault notices: a rank that fails on its own between calls (after the ranks
// last agreed) can say so with notify_failure; every wait polls for notices
// beside its operations, so a peer waiting for that rank throws at once
// ("<call> in <op> stopped waiting: rank r of this group of P failed on its
// own and told its peers. Its error: ...") instead of after the timeout, and
// the communicator is unusable after that as after a timeout. CpMixer and
// LactLayer send one whenever their call fails on this rank alone.
#pragma once

// Leave out the deprecated MPI-2 C++ bindings: Open MPI's declare a global
// `enum CommType` that makes statescan::CommType ambiguous under
// `using namespace statescan`. (Only effective when no <mpi.h> came earlier.)
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"

namespace statescan {

namespace detail {
// Throws statescan::Error (argument "mpi") with MPI_Error_string's text for
// `code` and the failed call's source text.
[[noreturn]] void throw_mpi_error(int code, const char* call, const char* file, int line);
}  // namespace detail

// Owns MPI's lifetime for a main(): initialises MPI (MPI_THREAD_FUNNELED: only
// the thread that initialised MPI calls it; worker threads never do) unless
// the caller already did, and finalises it on destruction only if it
// initialised it here.
class MpiEnvironment {
 public:
  MpiEnvironment() : MpiEnvironment(nullptr, nullptr) {}
  MpiEnvironment(int* argc, char*** argv);
  ~MpiEnvironment();
  MpiEnvironment(const MpiEnvironment&) = delete;
  MpiEnvironment& operator=(const MpiEnvironment&) = delete;

  // True when this object called MPI_Init_thread (and so will finalise).
  bool initialised_here() const { return initialised_here_; }

 private:
  bool initialised_here_ = false;
};

class MpiCommunicator final : public Communicator {
 public:
  // A communicator over all processes (a duplicate of MPI_COMM_WORLD).
  // Collective over MPI_COMM_WORLD.
  static std::unique_ptr<MpiCommunicator> world();

  // Duplicates `comm` (collective over it); the duplicate is freed on
  // destruction, `comm` stays the caller's.
  explicit MpiCommunicator(MPI_Comm comm);
  ~MpiCommunicator() override;
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* backend() const override { return "mpi"; }

  // Ranks of this group on the same node (shared memory domain): this rank's
  // index among them and their number. Computed once at construction. Not for
  // picking GPUs in a sub-group (a DP x CP split numbers each group's ranks
  // from 0 on every node): that takes the world's, statescan::local_rank().
  int local_rank() const { return local_rank_; }
  int local_size() const { return local_size_; }

  // The duplicate this object works on (e.g. to bootstrap NCCL over it).
  MPI_Comm native() const { return comm_; }

  // Splits every message into pieces of at most `elements` (default INT_MAX,
  // MPI's count limit). Lets tests exercise the piecewise path with small
  // buffers; every rank of the group must use the same value.
  void set_max_piece_elements(std::size_t elements);

  // all_gather accepts MPI's in-place layout: send == recv + rank() * count
  // elements. Any other overlap of send and recv throws.
  void all_gather(const void* send, void* recv, std::size_t count, CommType type) override;
  void all_reduce_sum(void* data, std::size_t count, CommType type) override;
  void all_reduce_max(void* data, std::size_t count, CommType type) override;
  void broadcast(void* data, std::size_t count, CommType type, int root) override;
  // A peer of -1 is a no-op (MPI_PROC_NULL); a peer equal to rank() throws
  // (a blocking send to oneself can deadlock).
  void send(const void* data, std::size_t count, CommType type, int peer, int tag) override;
  void recv(void* data, std::size_t count, CommType type, int peer, int tag) override;
  // send == recv with equal counts is allowed (in-place exchange); any other
  // overlap throws.
  void send_recv(const void* send, std::size_t send_count, int dest, void* recv,
                 std::size_t recv_count, int source, CommType type, int tag) override;
  void barrier() override;
  // Returns an MpiCommunicator over the new group (color must be >= 0 on
  // every rank: a bad one is the same error on all). The sub-group inherits
  // this communicator's timeout. A timed all-gather of every rank's call and
  // color runs first, so a rank that never calls split, or makes another
  // collective call instead, is reported instead of hanging the others.
  std::unique_ptr<Communicator> split(int color, int key) override;

  // Zero waits forever; negative throws. See the file comment.
  void set_timeout(std::chrono::milliseconds timeout) override;
  std::chrono::milliseconds timeout() const override { return timeout_; }

  // Fault notices (Communicator::notify_failure) travel on a private
  // duplicate of the group, so they never meet the caller's messages or the
  // collectives: a short message (`what` clipped to kNoticeBytes, clip_text) to
  // every peer, sent without waiting. Every wait of this communicator polls
  // for them beside its own operations.
  void notify_failure(const std::string& what) noexcept override;
  // When a peer's fault notice has arrived: marks this communicator failed
  // and returns a sentence naming the peer and its error; else "" at once.
  // A notice does not say which operations its sender joined before it
  // failed, so a peer polling one the sender had joined (it would complete)
  // gives that call up too: the failure is reported one call early, never
  // missed.
  // For a caller that waits on something else for work its peers feed
  // (NcclCommunicator polls it while it waits for its stream).
  std::string take_notice();
  static constexpr std::size_t kNoticeBytes = 1024;

 private:
  // One posted non-blocking operation of a call and how it ended.
  struct Pending {
    MPI_Request request = MPI_REQUEST_NULL;
    MPI_Status status{};
    int rc = MPI_SUCCESS;  // MPI_Test's return code once done
    bool done = false;
    bool receive = false;  // receives can be cancelled on timeout
    int peer = -1;         // the rank waited for; -1 for a collective
  };

  struct Adopt {};
  // Takes ownership of `comm` without duplicating it (used by split()).
  MpiCommunicator(MPI_Comm comm, Adopt, std::chrono::milliseconds timeout);
  void init_owned();
  void check_peer(int peer, bool allow_self, const char* name) const;
  void check_tag(int tag) const;
  // Throws if an earlier call timed out (the communicator is then unusable).
  void check_usable() const;
  void all_reduce(void* data, std::size_t count, CommType type, MPI_Op op, const char* name);
  // send (receive false, data only read) and recv: the message in pieces,
  // each posted and waited for with the timeout.
  void message(void* data, std::size_t count, CommType type, int peer, int tag, bool receive);
  void timed_barrier(const char* op);
  // all_gather, its waits and errors named `op` (split gathers every rank's call first).
  void timed_all_gather(const void* send, void* recv, std::size_t count, CommType type,
                        const char* op);
  // Polls `ops` until every one completed or the timeout passed; on timeout
  // cancels the receives, keeps the rest in stranded_, marks this
  // communicator failed and throws naming `call`, `op` and the peer.
  void await(Pending* ops, int n, const char* call, const char* op);
  // Cancels the receives of `ops` that are not done and strands the rest (a
  // call that gives up); returns the peer of the first one, or -1.
  int abandon(Pending* ops, int n);

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  int local_rank_ = 0, local_size_ = 1;
  int tag_upper_bound_ = 32767;  // the MPI standard's guaranteed minimum
  std::size_t max_piece_elements_;
  std::chrono::milliseconds timeout_;
  MPI_Comm notices_ = MPI_COMM_NULL;   // a duplicate of comm_ for fault notices alone
  bool notified_ = false;              // this rank sent its notice
  std::string failure_;                // non-empty after a timeout or a notice: what failed
  std::vector<MPI_Request> stranded_;  // posted operations a timeout left behind
  // Internal buffers of those operations (send_recv's in-place copy): MPI may
  // still read them, so they live as long as this communicator.
  std::vector<std::vector<unsigned char>> stranded_buffers_;
};

// Node-local rank and number of ranks of MPI_COMM_WORLD (shared memory
// domain), for one-GPU-per-rank selection (NcclCommunicator::device_for)
// whatever group a rank later works in. Local once an MpiCommunicator over
// the world's ranks (MpiCommunicator::world()) exists in this process, which
// records them; otherwise the first call makes one: collective over
// MPI_COMM_WORLD, so then call them on every rank.
int local_rank();
int local_size();

}  // namespace statescan

// Checks the return code of an MPI call; throws statescan::Error on failure.
#define SS_MPI_CHECK(call)                                                         \
  do {                                                                             \
    const int ss_mpi_rc_ = (call);                                                 \
    if (ss_mpi_rc_ != MPI_SUCCESS) {                                               \
      ::statescan::detail::throw_mpi_error(ss_mpi_rc_, #call, __FILE__, __LINE__); \
    }                                                                              \
  } while (0)
