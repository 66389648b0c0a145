// LaCT on the GPU (lact_cuda.h): argument checks, the device-side data checks
// and the dtype dispatch onto the instantiations in lact_cuda_{f32,bf16}.cu.
#include <cuda_bf16.h>

#include <algorithm>
#include <type_traits>

#include "core/cuda_check.h"
#include "core/device_pool.h"
#include "core/env_knob.h"
#include "core/error.h"
#include "kernels/cuda/lact_cuda.h"
#include "kernels/cuda/lact_hidden.cuh"
#include "kernels/cuda/lact_ns_cluster.cuh"

namespace statescan::cuda {
namespace lact_detail {
using bf16 = __nv_bfloat16;
template <typename T, typename U>
void forward_impl(const LactCudaParams&, const LactDeviceAllReduce&, LactCudaSaved*, cudaStream_t);
template <typename T, typename U>
void backward_impl(const LactCudaParams&, const LactCudaGrads&, const LactCudaSaved&,
                   const LactDeviceAllReduce&, cudaStream_t);

NsGemms ns_gemms_requested() {
  static const NsGemms mode = [] {
    const int choice = env_choice("STATESCAN_LACT_NS", {"bf16x3", "fp32", "fused", "cluster"});
    constexpr NsGemms kModes[] = {NsGemms::bf16x3, NsGemms::fp32, NsGemms::fused, NsGemms::cluster};
    return choice < 0 ? NsGemms::bf16x3 : kModes[choice];  // -1: unset
  }();
  return mode;
}

bool hidden_fused_requested() {
  static const bool fused = env_choice("STATESCAN_LACT_HIDDEN", {"fused", "cublas"}) != 1;
  return fused;
}

bool lact_pdl_requested() {
  static const bool pdl = env_choice("STATESCAN_LACT_PDL", {"0", "1"}) == 1;
  return pdl;
}

bool side_stream_requested() {
  static const bool side = env_choice("STATESCAN_LACT_STREAMS", {"2", "1"}) != 1;
  return side;
}
}  // namespace lact_detail

namespace {

__device__ __forceinline__ float value_of(float x) {
  return x;
}
__device__ __forceinline__ float value_of(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

// first[0] = the smallest index i < n whose value is not finite (or, with
// `positive`, not > 0); stays n when every element passes.
template <typename T>
__global__ void first_bad_kernel(const T* x, int64_t n, bool positive, unsigned long long* first) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float v = value_of(x[i]);
    const bool ok = isfinite(v) && (!positive || v > 0.0f);
    if (!ok) atomicMin(first, static_cast<unsigned long long>(i));
  }
}

// Throws naming `name` when an element of x fails the check (see first_bad_kernel).
template <typename T>
void check_elements(const T* x, int64_t n, bool positive, const char* name, cudaStream_t stream) {
  if (n <= 0) return;
  const PoolArray<unsigned long long> slot(1, stream);
  unsigned long long* first = slot.get();
  const unsigned long long none = static_cast<unsigned long long>(n);
  unsigned long long found = none;
  T bad{};
  cudaError_t rc = cudaMemcpyAsync(first, &none, sizeof(none), cudaMemcpyHostToDevice, stream);
  if (rc == cudaSuccess) {
    const int threads = 256;
    const int64_t blocks = std::min<int64_t>((n + threads - 1) / threads, 4096);
    first_bad_kernel<T>
        <<<static_cast<unsigned>(blocks), threads, 0, stream>>>(x, n, positive, first);
    rc = cudaGetLastError();
  }
  if (rc == cudaSuccess)
    rc = cudaMemcpyAsync(&found, first, sizeof(found), cudaMemcpyDeviceToHost, stream);
  if (rc == cudaSuccess) rc = cudaStreamSynchronize(stream);
  SS_CUDA_CHECK(rc);
  if (found == none) return;
  // On the caller's stream: a plain cudaMemcpy would wait on every blocking
  // stream (and break another thread's graph capture).
  SS_CUDA_CHECK(cudaMemcpyAsync(&bad, x + found, sizeof(T), cudaMemcpyDeviceToHost, stream));
  SS_CUDA_CHECK(cudaStreamSynchronize(stream));
  float value = 0;
  if constexpr (std::is_same<T, float>::value) {
    value = bad;
  } else {
    value = __bfloat162float(bad);
  }
  if (positive)
    SS_FAIL(name, "element ", found, " is ", value, " (learning rates must be finite and > 0)");
  SS_FAIL(name, "element ", found, " is ", value, " (NaN/Inf not allowed)");
}

void check_any(const void* x, DType dtype, int64_t n, bool positive, const char* name,
               cudaStream_t stream) {
  if (dtype == DType::f32) {
    check_elements(static_cast<const float*>(x), n, positive, name, stream);
  } else {
    check_elements(static_cast<const __nv_bfloat16*>(x), n, positive, name, stream);
  }
}

}  // namespace

void lact_cuda_check_sizes(const LactCudaParams& p) {
  lact_check_layout(p);
  SS_CHECK_ARG(p.dtype == DType::f32 || p.dtype == DType::bf16, "dtype",
               "LaCT on the GPU supports f32 and bf16, got ", p.dtype);
  // cuBLAS takes int sizes and leading dimensions (lact_common.cuh's gemm):
  // the token rows' H D; M, 2M and 4M, the widths and leading dimensions of
  // the per-pair intermediates (rows_in: [h0 | h2], [z | dh]); and a chunk's
  // slice of tokens on this rank.
  constexpr int64_t kIntLimit = int64_t(1) << 31;
  SS_CHECK_ARG(p.heads * p.dim < kIntLimit, "q", "H D = ", p.heads, " * ", p.dim,
               " must be < 2^31");
  SS_CHECK_ARG(4 * p.hidden < kIntLimit, "w0", "hidden width M = ", p.hidden,
               " is too large (4 M must be < 2^31)");
  SS_CHECK_ARG(std::min(p.config.chunk, p.seq_len) / p.ranks < kIntLimit,
               p.config.chunk <= p.seq_len ? "chunk" : "q", "a chunk's slice of ",
               std::min(p.config.chunk, p.seq_len) / p.ranks, " tokens per rank must be < 2^31");
}

void lact_cuda_check_data(const LactCudaParams& p, cudaStream_t stream) {
  lact_cuda_check_sizes(p);
  const int64_t tokens = p.batch * p.local_len() * p.heads, weights = p.heads * p.hidden * p.dim;
  check_any(p.q, p.dtype, tokens * p.dim, false, "q", stream);
  check_any(p.k, p.dtype, tokens * p.dim, false, "k", stream);
  check_any(p.v, p.dtype, tokens * p.dim, false, "v", stream);
  check_any(p.lr0, p.dtype, tokens, true, "lr0", stream);
  check_any(p.lr1, p.dtype, tokens, true, "lr1", stream);
  check_any(p.lr2, p.dtype, tokens, true, "lr2", stream);
  check_any(p.w0, p.dtype, weights, false, "w0", stream);
  check_any(p.w1, p.dtype, weights, false, "w1", stream);
  check_any(p.w2, p.dtype, weights, false, "w2", stream);
}

void lact_cuda_check_finite(const void* x, DType dtype, int64_t n, const char* name,
                            cudaStream_t stream) {
  check_any(x, dtype, n, false, name, stream);
}

namespace lact_detail {
const char* ns_gemms_name(NsGemms mode, int64_t dim, int64_t hidden) {
  switch (mode) {
    case NsGemms::fp32:
      return "fp32";
    case NsGemms::fused:
      // The mode, not every call: shapes the fused kernel does not take (M,
      // N or K not a multiple of 16) still run split3 + cuBLAS.
      return "bf16x3-fused";
    case NsGemms::cluster:
      // Per shape: others run the forward's steps on the split path too.
      return ns_cluster_supported(std::min(dim, hidden), std::max(dim, hidden)) ? "bf16x3-cluster"
                                                                                : "bf16x3";
    case NsGemms::bf16x3:
      break;
  }
  return "bf16x3";
}
}  // namespace lact_detail

const char* lact_cuda_ns_gemms(DType dtype, int64_t dim, int64_t hidden) {
  if (dtype == DType::f32) return "fp64";
  return lact_detail::ns_gemms_name(lact_detail::ns_gemms_requested(), dim, hidden);
}

const char* lact_cuda_hidden_path(DType dtype, int64_t dim, int64_t hidden) {
  const bool fused = dtype == DType::bf16 && lact_detail::hidden_fused_requested() &&
                     lact_detail::lact_hidden_supported(dim, hidden);
  return fused ? "fused" : "cublas";
}

namespace {
// A slice of every chunk updates from the whole chunk's gradient only through
// the all-reduce: without one, ranks > 1 would each apply their own partial
// gradient and their fast weights drift apart with no error (the CPU path's
// check_all_reduce).
void check_all_reduce(const LactCudaParams& p, const LactDeviceAllReduce& all_reduce) {
  SS_CHECK_ARG(p.ranks == 1 || static_cast<bool>(all_reduce), "all_reduce",
               "is required when ranks > 1 (ranks = ", p.ranks, ")");
}
}  // namespace

void lact_cuda_forward(const LactCudaParams& p, const LactDeviceAllReduce& all_reduce,
                       LactCudaSaved* saved, cudaStream_t stream) {
  lact_cuda_check_sizes(p);
  check_all_reduce(p, all_reduce);
  if (p.dtype == DType::f32) {
    lact_detail::forward_impl<float, double>(p, all_reduce, saved, stream);
  } else {
    lact_detail::forward_impl<lact_detail::bf16, float>(p, all_reduce, saved, stream);
  }
}

void lact_cuda_backward(const LactCudaParams& p, const LactCudaGrads& g, const LactCudaSaved& saved,
                        const LactDeviceAllReduce& all_reduce, cudaStream_t stream) {
  lact_cuda_check_sizes(p);
  check_all_reduce(p, all_reduce);
  const char* names[] = {"d_o", "dq", "dk", "dv", "dlr0", "dlr1", "dlr2", "dw0", "dw1", "dw2"};
  const void* ptrs[] = {g.d_o, g.dq, g.dk, g.dv, g.dlr0, g.dlr1, g.dlr2, g.dw0, g.dw1, g.dw2};
  for (int i = 0; i < 10; ++i) SS_CHECK_ARG(ptrs[i] != nullptr, names[i], "is required");
  if (p.dtype == DType::f32) {
    lact_detail::backward_impl<float, double>(p, g, saved, all_reduce, stream);
  } else {
    lact_detail::backward_impl<lact_detail::bf16, float>(p, g, saved, all_reduce, stream);
  }
}

}  // namespace statescan::cuda
