// Kernel launches with checked errors: a raised dynamic shared memory limit,
// clusters (sm_90), the occupancy of a cluster shape, and cached per-device
// shape checks. Shared by the chunk kernels (chunk_forward.cuh) and LaCT's
// kernels (lact_ns_cluster.cu, lact_hidden.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>

#include "core/cuda_check.h"

namespace statescan::cuda::detail {

// Launches `kernel` on `stream` with `smem` bytes of dynamic shared memory
// (raising the kernel's limit to that first: above 48 KB it must be asked
// for) and checks the launch, naming `name` in the error.
template <typename Kernel, typename... Args>
void launch_kernel(Kernel kernel, dim3 grid, int threads, size_t smem, cudaStream_t stream,
                   const char* name, const Args&... args) {
  const cudaError_t raised = cudaFuncSetAttribute(
      kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (raised != cudaSuccess) {  // e.g. more than the device's opt-in limit: say which kernel
    (void)cudaGetLastError();
    SS_FAIL("cuda", name, " cannot have ", smem,
            " bytes of dynamic shared memory: ", cudaGetErrorString(raised));
  }
  kernel<<<grid, threads, smem, stream>>>(args...);
  SS_LAUNCH_CHECK(name);
}

// A launch configuration for cudaLaunchKernelEx with `kernel`'s dynamic
// shared memory limit raised to `smem`, and at most one attribute: a
// cluster shape or a programmatic dependency (non-copyable: the
// configuration points at its own attribute).
struct LaunchConfig {
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  template <typename Kernel>
  LaunchConfig(Kernel kernel, dim3 grid, int threads, size_t smem, cudaStream_t stream) {
    SS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem)));
    cfg.gridDim = grid;
    cfg.blockDim = dim3(static_cast<unsigned>(threads));
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cfg.attrs = attr;
  }
  LaunchConfig(const LaunchConfig&) = delete;
  LaunchConfig& operator=(const LaunchConfig&) = delete;
  // Clusters of `cluster` CTAs along x.
  LaunchConfig& clusters(unsigned cluster) {
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = cluster;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.numAttrs = 1;
    return *this;
  }
  // A programmatic dependent launch (launch_kernel_dependent).
  LaunchConfig& dependent() {
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.numAttrs = 1;
    return *this;
  }
};

// launch_kernel as a programmatic dependent launch (sm_90): the kernel may
// start while the stream's previous kernel still runs (its CTAs on the SMs
// that kernel's CTAs leave), so that its prologue (barriers, loads of inputs
// nobody writes) overlaps that kernel's tail. The kernel must run
// grid_dependency_wait() (cluster_copy.cuh) before it reads anything the
// previous kernel writes or writes anything it reads. Only where the
// stream's previous operation is a kernel: an event wait in between is a
// dependency griddepcontrol.wait does not see.
template <typename Kernel, typename... Args>
void launch_kernel_dependent(Kernel kernel, dim3 grid, int threads, size_t smem,
                             cudaStream_t stream, const char* name, const Args&... args) {
  LaunchConfig launch(kernel, grid, threads, smem, stream);
  SS_CUDA_CHECK(cudaLaunchKernelEx(&launch.dependent().cfg, kernel, args...));
  SS_LAUNCH_CHECK(name);
}

// launch_kernel_dependent where `dependent`, else launch_kernel: the kernels
// whose dependent launch is a per-call choice (LactHiddenParams::dependent).
template <typename Kernel, typename... Args>
void launch_kernel_maybe_dependent(bool dependent, Kernel kernel, dim3 grid, int threads,
                                   size_t smem, cudaStream_t stream, const char* name,
                                   const Args&... args) {
  if (dependent)
    launch_kernel_dependent(kernel, grid, threads, smem, stream, name, args...);
  else
    launch_kernel(kernel, grid, threads, smem, stream, name, args...);
}

// launch_kernel in clusters of `cluster` CTAs along x.
template <typename Kernel, typename... Args>
void launch_kernel_cluster(Kernel kernel, dim3 grid, int threads, size_t smem, unsigned cluster,
                           cudaStream_t stream, const char* name, const Args&... args) {
  LaunchConfig launch(kernel, grid, threads, smem, stream);
  SS_CUDA_CHECK(cudaLaunchKernelEx(&launch.clusters(cluster).cfg, kernel, args...));
  SS_LAUNCH_CHECK(name);
}

// Clusters that fit on the device at once for `kernel` (0 when the shape
// cannot be clustered at all), from the occupancy API.
template <typename Kernel>
int active_clusters(Kernel kernel, int threads, size_t smem, unsigned cluster) {
  LaunchConfig launch(kernel, dim3(cluster), threads, smem, nullptr);
  int n = 0;
  if (cudaOccupancyMaxActiveClusters(&n, kernel, &launch.clusters(cluster).cfg) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

// Whether `device` runs this build's warpgroup-MMA kernels (wgmma.cuh): the
// build has sm_90a code (STATESCAN_CUDA_SM90A) and the device is compute
// capability 9.0; elsewhere those kernels trap, so the host must not pick them.
inline bool wgmma_device(int device) {
#ifdef STATESCAN_CUDA_SM90A
  int major = 0, minor = 0;
  SS_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  SS_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  return major == 9 && minor == 0;
#else
  (void)device;
  return false;
#endif
}

// fits(device, a, b) for the current device, evaluated once per (device, a,
// b) and cached, thread-safe: the kernels' shape checks, which query device
// attributes and the occupancy API, or a count from that API (the value has
// fits' type). Tag (the kernel's tile type) keeps each kernel's cache apart:
// two checks with the same signature would otherwise share one.
template <typename Tag, typename Fits>
auto cached_device_check(int64_t a, int64_t b, Fits&& fits) {
  using Value = decltype(fits(0, a, b));
  static std::mutex mutex;
  static std::map<std::tuple<int, int64_t, int64_t>, Value> cache;
  int device = 0;
  SS_CUDA_CHECK(cudaGetDevice(&device));
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_tuple(device, a, b);
  const auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  const Value value = fits(device, a, b);
  cache.emplace(key, value);
  return value;
}

// Whether a pointer is 16-byte aligned (vector loads, tensor maps).
inline bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// A caller's workspace: its regions lie at multiples of 256 bytes from its
// start and the fp32 paths load them with wmma, which needs 32-byte aligned
// pointers (a misaligned load is a sticky error: the context is lost).
inline bool workspace_aligned(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 32 == 0;
}

}  // namespace statescan::cuda::detail
