// Communicator: the collective and point-to-point operations that context
// parallelism needs, over one group of ranks in sequence order.
//
// Implementations: SingleRankCommunicator (size 1, no dependencies),
// MpiCommunicator (host buffers, comm/mpi_communicator.h) and, in CUDA builds,
// the NCCL communicator (device buffers, stream-ordered). Every call is
// collective over the group unless it says otherwise; every failure throws
// statescan::Error. Counts are in elements of `type`.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <ostream>
#include <string>

namespace statescan {

enum class CommType { f32, f64, i64, u8 };
std::size_t size_of(CommType t);
const char* to_string(CommType t);
inline std::ostream& operator<<(std::ostream& os, CommType t) { return os << to_string(t); }

// How long a communicator waits for its peers by default: 10 minutes, long
// enough for any healthy exchange of a training step, short enough that a job
// whose peer died fails with an error instead of burning its allocation.
constexpr std::chrono::milliseconds kDefaultCommTimeout{10 * 60 * 1000};

// The longest timeout a communicator takes: 30 days. The waits compare
// against clocks in nanoseconds, and a count of milliseconds past ~9.2e12
// would overflow there and time out at once.
constexpr std::chrono::milliseconds kMaxCommTimeout{30LL * 24 * 3600 * 1000};

// Throws statescan::Error naming `argument` unless 0 <= timeout <=
// kMaxCommTimeout (0 waits forever).
void check_comm_timeout(std::chrono::milliseconds timeout, const char* argument);

// The timeout communicators start with: STATESCAN_COMM_TIMEOUT_MS when set (a
// non-negative integer; 0 waits forever), else kDefaultCommTimeout. Throws
// statescan::Error naming STATESCAN_COMM_TIMEOUT_MS when it is malformed or
// out of range.
std::chrono::milliseconds comm_timeout_from_env();

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const char* backend() const = 0;  // "single", "mpi", "nccl"

  // recv holds size() * count elements, rank i's contribution at offset i*count.
  virtual void all_gather(const void* send, void* recv, std::size_t count, CommType type) = 0;
  // Element-wise sum (f32, f64, i64) or max (all types) over the group, in place.
  virtual void all_reduce_sum(void* data, std::size_t count, CommType type) = 0;
  virtual void all_reduce_max(void* data, std::size_t count, CommType type) = 0;
  virtual void broadcast(void* data, std::size_t count, CommType type, int root) = 0;
  // Point to point (not collective). Blocking; messages between one pair with
  // one tag arrive in order.
  virtual void send(const void* data, std::size_t count, CommType type, int peer, int tag) = 0;
  virtual void recv(void* data, std::size_t count, CommType type, int peer, int tag) = 0;
  // Sends to `dest` and receives from `source` at once (no deadlock when every
  // rank does both); a peer of -1 skips that half.
  virtual void send_recv(const void* send, std::size_t send_count, int dest, void* recv,
                         std::size_t recv_count, int source, CommType type, int tag) = 0;
  virtual void barrier() = 0;
  // Ranks with the same color form a new group, ordered by key then old rank.
  // Collective over this group. Lets a trainer build DP x CP grids.
  virtual std::unique_ptr<Communicator> split(int color, int key) = 0;

  // The longest one call waits for its peers before it throws statescan::Error
  // ("... timed out after X ms in <op>") instead of hanging forever on a peer
  // that died or diverged; zero waits forever. Local to this rank, but every
  // rank of a group should use the same value. A communicator that timed out
  // is unusable (later calls throw): the application should end the job.
  // Backends that never wait for anyone (SingleRankCommunicator) ignore it.
  virtual void set_timeout(std::chrono::milliseconds timeout) { (void)timeout; }
  virtual std::chrono::milliseconds timeout() const { return std::chrono::milliseconds::zero(); }

  // Fault notices. A rank whose own work fails between two calls of the group
  // (after the ranks last agreed: an allocation, a kernel, a callback) calls
  // this before it gives up, so that its peers do not wait for it until their
  // timeout: each peer's call that waits for this rank, pending or next, then
  // throws statescan::Error naming this rank and `what` (Error::peers_know()
  // set) within milliseconds. Not collective; never blocks; never throws.
  // Afterwards the communicator is unusable on this rank, and on each peer
  // once it has heard (collectives stand half done). Errors every rank raised
  // alike (collective_check) need no notice. Default: nobody to tell (a
  // group of one, or a backend with no channel for it).
  virtual void notify_failure(const std::string& what) noexcept { (void)what; }
};

// A group of one: collectives copy; send and recv take only peer -1 (nobody),
// send_recv also itself (0), whose message it copies.
class SingleRankCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  const char* backend() const override { return "single"; }
  void all_gather(const void* send, void* recv, std::size_t count, CommType type) override;
  void all_reduce_sum(void* data, std::size_t count, CommType type) override;
  void all_reduce_max(void* data, std::size_t count, CommType type) override;
  void broadcast(void* data, std::size_t count, CommType type, int root) override;
  void send(const void* data, std::size_t count, CommType type, int peer, int tag) override;
  void recv(void* data, std::size_t count, CommType type, int peer, int tag) override;
  void send_recv(const void* send, std::size_t send_count, int dest, void* recv,
                 std::size_t recv_count, int source, CommType type, int tag) override;
  void barrier() override {}
  std::unique_ptr<Communicator> split(int color, int key) override;
};

// Whether `comm` is an NCCL communicator (backend() "nccl": device buffers,
// stream-ordered).
bool is_nccl(const Communicator& comm);

// Host tensors take host collectives: throws statescan::Error naming
// `argument` where `comm` is NCCL ("this <owner>'s is NCCL: pass device
// tensors"). Local; callers reach it on every rank alike (the ranks have
// agreed on where their tensors live and share the communicator's kind), so
// its error has Error::peers_know() set.
void check_host_tensors_allowed(const Communicator& comm, const char* argument, const char* owner);

// `comm` for host-buffer collectives (control planes: argument agreement,
// collective error reports): `comm` itself, or where it is an NCCL
// communicator a host-staged view of it (NcclHostStaged), made at the first
// call into `slot`, which the caller keeps for the next calls.
Communicator& host_collectives(Communicator& comm, std::unique_ptr<Communicator>& slot);

}  // namespace statescan
