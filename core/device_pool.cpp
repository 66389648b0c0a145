#include "core/device_pool.h"

#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "core/cuda_check.h"
#include "core/error.h"

namespace statescan {
namespace {

constexpr std::size_t kLargeBytes = std::size_t{2} << 20;  // cached cudaMalloc blocks from here

struct Block {
  void* ptr = nullptr;
  std::size_t bytes = 0;
  int device = 0;
  bool in_use = false;
  cudaEvent_t freed = nullptr;  // recorded on the stream that gave it back
  bool has_event = false;       // `freed` recorded at least once
};

struct State {
  std::mutex mutex;
  std::unordered_map<void*, std::unique_ptr<Block>> blocks;  // every cached block
  std::vector<cudaMemPool_t> small_pools;                    // per device, made on demand
  std::size_t in_use = 0, in_use_high = 0;                   // bytes of large blocks
};

void count_in_use(State& s, std::size_t add) {
  s.in_use += add;
  if (s.in_use > s.in_use_high) s.in_use_high = s.in_use;
}

// Never destroyed: blocks freed at exit could outlive the driver.
State& state() {
  static State* s = new State();
  return *s;
}

int current_device() {
  int device = 0;
  SS_CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

cudaMemPool_t small_pool(State& s, int device) {
  if (s.small_pools.empty()) {
    int count = 0;
    SS_CUDA_CHECK(cudaGetDeviceCount(&count));
    s.small_pools.assign(static_cast<std::size_t>(count), nullptr);
  }
  SS_CHECK_ARG(device >= 0 && static_cast<std::size_t>(device) < s.small_pools.size(), "device",
               "current device ", device, " outside the ", s.small_pools.size(), " devices seen");
  cudaMemPool_t& pool = s.small_pools[static_cast<std::size_t>(device)];
  if (pool == nullptr) {
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    SS_CUDA_CHECK(cudaMemPoolCreate(&pool, &props));
    uint64_t keep = UINT64_MAX;  // keep freed memory instead of unmapping it at each sync
    SS_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
  }
  return pool;
}

// Takes the idle blocks of `device` (all devices when < 0) out of the cache
// and trims the small allocations' pools. Caller holds the lock; the blocks
// are freed by free_blocks after it lets go.
std::vector<std::unique_ptr<Block>> take_idle(State& s, int device) {
  // The small allocations' pool keeps what was freed into it (its release
  // threshold is all of it): give that back too, or an out-of-memory after a
  // phase of many small allocations finds it still reserved. Only memory
  // whose stream-ordered free has executed goes back (no synchronisation
  // here: a stream stuck in a collective must not hang the allocator).
  // First: should it throw, no block has left the cache yet.
  for (std::size_t d = 0; d < s.small_pools.size(); ++d)
    if (s.small_pools[d] != nullptr && (device < 0 || static_cast<int>(d) == device))
      SS_CUDA_CHECK(cudaMemPoolTrimTo(s.small_pools[d], 0));
  std::vector<std::unique_ptr<Block>> idle;
  for (auto it = s.blocks.begin(); it != s.blocks.end();) {
    if (it->second->in_use || (device >= 0 && it->second->device != device)) {
      ++it;
      continue;
    }
    idle.push_back(std::move(it->second));
    it = s.blocks.erase(it);
  }
  return idle;
}

// Waits for each block's last user and frees it. Called without the lock: a
// block's last user may be a stream that waits a long time (a collective
// waiting for a peer), and other threads' allocations and frees must go on
// meanwhile. A failure still frees the rest, then throws the first error.
void free_blocks(std::vector<std::unique_ptr<Block>> blocks) {
  if (blocks.empty()) return;
  const int previous = current_device();  // cudaFree runs on the block's own device
  cudaError_t first = cudaSuccess;
  for (const auto& b : blocks) {
    cudaError_t rc = cudaSetDevice(b->device);
    if (rc == cudaSuccess && b->has_event) rc = cudaEventSynchronize(b->freed);
    if (rc == cudaSuccess) rc = cudaFree(b->ptr);
    (void)cudaEventDestroy(b->freed);  // every cached block has one
    if (first == cudaSuccess) first = rc;
  }
  (void)cudaSetDevice(previous);
  SS_CUDA_CHECK(first);
}

// Gives the cache of `device` (all when < 0) back to the driver: the idle
// blocks taken under `lock`, which is let go while they are freed and held
// again on return.
void release_idle(std::unique_lock<std::mutex>& lock, State& s, int device) {
  std::vector<std::unique_ptr<Block>> idle = take_idle(s, device);
  lock.unlock();
  struct Relock {
    std::unique_lock<std::mutex>& lock;
    ~Relock() { lock.lock(); }
  } relock{lock};
  free_blocks(std::move(idle));
}

// Named "cuda", as every device failure is: one rank's out-of-memory is no
// agreed input fault (ranks may need different amounts: uneven shards,
// kept tiles, a shared GPU), so statescan-run aborts the job on it rather
// than leaving the peers waiting in the next collective.
[[noreturn]] void out_of_memory(std::size_t bytes, cudaError_t rc) {
  (void)cudaGetLastError();  // an allocation failure is not sticky; clear it
  SS_FAIL("cuda", "cannot allocate ", bytes, " bytes of device memory: ", cudaGetErrorString(rc));
}

}  // namespace

void* pool_alloc(std::size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return nullptr;
  State& s = state();
  const int device = current_device();
  std::unique_lock<std::mutex> lock(s.mutex);
  if (bytes < kLargeBytes) {
    void* ptr = nullptr;
    cudaError_t rc = cudaMallocFromPoolAsync(&ptr, bytes, small_pool(s, device), stream);
    if (rc != cudaSuccess) {
      (void)cudaGetLastError();
      release_idle(lock, s, device);  // the cache may hold what the device lacks
      rc = cudaMallocFromPoolAsync(&ptr, bytes, small_pool(s, device), stream);
      if (rc != cudaSuccess) out_of_memory(bytes, rc);
    }
    return ptr;
  }
  // Best fit among idle blocks of this device no more than 1/8 larger.
  Block* best = nullptr;
  for (auto& [ptr, b] : s.blocks)
    if (!b->in_use && b->device == device && b->bytes >= bytes && b->bytes - bytes <= bytes / 8 &&
        (best == nullptr || b->bytes < best->bytes))
      best = b.get();
  if (best != nullptr) {
    if (best->has_event) SS_CUDA_CHECK(cudaStreamWaitEvent(stream, best->freed, 0));
    best->in_use = true;
    count_in_use(s, best->bytes);
    return best->ptr;
  }
  void* ptr = nullptr;
  cudaError_t rc = cudaMalloc(&ptr, bytes);
  if (rc != cudaSuccess) {
    (void)cudaGetLastError();
    release_idle(lock, s, device);  // give the cache back, then try once more
    rc = cudaMalloc(&ptr, bytes);
    if (rc != cudaSuccess) out_of_memory(bytes, rc);
  }
  auto b = std::make_unique<Block>();
  b->ptr = ptr;
  b->bytes = bytes;
  b->device = device;
  b->in_use = true;
  const cudaError_t ev = cudaEventCreateWithFlags(&b->freed, cudaEventDisableTiming);
  if (ev != cudaSuccess) {
    (void)cudaFree(ptr);
    SS_CUDA_CHECK(ev);
  }
  s.blocks.emplace(ptr, std::move(b));
  count_in_use(s, bytes);
  return ptr;
}

void pool_free(void* ptr, cudaStream_t stream) noexcept {
  if (ptr == nullptr) return;
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  const auto it = s.blocks.find(ptr);
  if (it == s.blocks.end()) {
    (void)cudaFreeAsync(ptr, stream);  // a small one, from the stream-ordered pool
    return;
  }
  Block& b = *it->second;
  b.has_event = cudaEventRecord(b.freed, stream) == cudaSuccess;
  if (!b.has_event) (void)cudaStreamSynchronize(stream);  // no event: order by waiting
  b.in_use = false;
  s.in_use -= b.bytes;
}

std::size_t pool_cached_bytes() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  std::size_t total = 0;
  for (const auto& [ptr, b] : s.blocks) total += b->bytes;
  return total;
}

std::size_t pool_idle_bytes() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  std::size_t total = 0;
  for (const auto& [ptr, b] : s.blocks)
    if (!b->in_use) total += b->bytes;
  return total;
}

std::size_t pool_in_use_high() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  return s.in_use_high;
}

void pool_reset_in_use_high() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.in_use_high = s.in_use;
}

std::size_t pool_small_reserved_bytes() {
  State& s = state();
  const int device = current_device();
  std::lock_guard<std::mutex> lock(s.mutex);
  std::uint64_t reserved = 0;
  SS_CUDA_CHECK(
      cudaMemPoolGetAttribute(small_pool(s, device), cudaMemPoolAttrReservedMemCurrent, &reserved));
  return static_cast<std::size_t>(reserved);
}

void pool_release_cached() {
  State& s = state();
  std::unique_lock<std::mutex> lock(s.mutex);
  release_idle(lock, s, -1);
}

}  // namespace statescan
