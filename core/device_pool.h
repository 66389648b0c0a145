// statescan's device workspace allocator: every per-call workspace of the GPU
// paths (the mixers' prepare and backward workspaces, CpMixer's buffers,
// LaCT's scratch) is taken with pool_alloc and given back with pool_free,
// both ordered on a stream.
//
// Large blocks (>= 2 MiB) are cudaMalloc'd once and cached for reuse by a
// later pool_alloc of about the same size (at most 1/8 more), on any stream:
// the new user's stream waits for an event recorded where the block was
// freed. Small ones come from a CUDA memory pool of statescan's own
// (cudaMallocFromPoolAsync), which keeps freed memory too.
//
// Why not the stream-ordered pool for everything: served from the device's
// default pool (grown call by call, ~9-11 GB), the same workspaces made the
// kernels reading them run up to twice as slowly in some steps and not in
// others (one H200, KDA at 128K tokens: the backward's prepare stage 4.2 ->
// 10.8 ms, the forward's scan + output 3.2 -> 6.6), also after remapping the
// pool as one piece of its high-water mark; from cudaMalloc'd memory (the plain
// mixer's forward workspace) or a pool first grown to 60 GB they ran at full
// speed every time (PERF_NOTES, twenty-second session). The cause is not
// established; cached cudaMalloc blocks are what measured steady.
//
// The cache only grows (to the most of each size in use at once) until
// pool_release_cached gives its unused blocks back to the driver.
// Exists only in CUDA builds (STATESCAN_HAS_CUDA).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

#include "core/cuda_check.h"

namespace statescan {

// `bytes` of memory on the current device, usable by work queued on `stream`
// from now on. Throws statescan::Error naming "cuda" (and the size) when the device has not
// that much free even after the cache gave its unused blocks back. 0 bytes:
// nullptr.
void* pool_alloc(std::size_t bytes, cudaStream_t stream);

// Gives `ptr` (from pool_alloc, or nullptr) back once the work queued on
// `stream` so far is done; later work on any stream may then reuse it.
// Never throws (errors surface at the next checked CUDA call).
void pool_free(void* ptr, cudaStream_t stream) noexcept;

// Bytes of large blocks the cache holds, in use or not, and those not in use.
std::size_t pool_cached_bytes();
std::size_t pool_idle_bytes();

// The most bytes of large blocks in use at once since the last
// pool_reset_in_use_high (the small ones, each < 2 MiB, come on top), and
// that reset, which restarts the count from what is in use now. A step's
// workspace peak, as statescan-bench --backward --keep-prepared reports it.
std::size_t pool_in_use_high();
void pool_reset_in_use_high();

// Device memory the current device's small-allocation pool holds from the
// driver (in use or kept after a free; cudaMemPoolAttrReservedMemCurrent).
std::size_t pool_small_reserved_bytes();

// Waits for the idle cached blocks' last users and frees them (cudaFree),
// and trims the small allocations' pool to what is still allocated (memory
// whose stream-ordered free has not executed yet stays reserved). The waits
// do not hold the pool: other threads allocate and free meanwhile (so does
// pool_alloc's own release before its second try).
void pool_release_cached();

// `count` elements of T from pool_alloc, given back with pool_free on the same
// stream when the array goes out of scope (also when an exception unwinds) or
// is assigned over. Move-only; an empty one (count 0) holds nullptr.
template <typename T>
class PoolArray {
 public:
  PoolArray() = default;
  PoolArray(std::size_t count, cudaStream_t stream)
      : data_(static_cast<T*>(pool_alloc(count * sizeof(T), stream))),
        stream_(stream),
        count_(count) {}
  ~PoolArray() { pool_free(data_, stream_); }
  PoolArray(const PoolArray&) = delete;
  PoolArray& operator=(const PoolArray&) = delete;
  PoolArray(PoolArray&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)),
        stream_(o.stream_),
        count_(std::exchange(o.count_, 0)) {}
  PoolArray& operator=(PoolArray&& o) noexcept {
    if (this != &o) {
      pool_free(data_, stream_);
      data_ = std::exchange(o.data_, nullptr);
      stream_ = o.stream_;
      count_ = std::exchange(o.count_, 0);
    }
    return *this;
  }

  T* get() const { return data_; }
  std::size_t size() const { return count_; }
  // Zeroes the elements, ordered on the array's stream.
  void zero() {
    if (count_ > 0) SS_CUDA_CHECK(cudaMemsetAsync(data_, 0, count_ * sizeof(T), stream_));
  }

 private:
  T* data_ = nullptr;
  cudaStream_t stream_ = nullptr;
  std::size_t count_ = 0;
};

}  // namespace statescan
