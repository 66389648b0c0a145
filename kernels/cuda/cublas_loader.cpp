// cuBLAS, loaded on first use instead of linked.
//
// Why: libcublasLt carries ~94 KB of static TLS. A library linked at start-up
// puts its static TLS on the stack of every thread the process creates, and
// threads that ask for small stacks then fail to start: civetweb's (the
// Prometheus exporter's HTTP server) 100 KB worker stacks do, so every CUDA
// build of statescan-run lost its metrics port. dlopen'ed libraries use
// dynamic TLS, allocated per thread on first access, which has no such
// effect. So nothing links libcublas; these definitions of the cuBLAS entry
// points that statescan calls forward to the real ones, resolved once from
// libcublas.so.<major> (the loader's search path first, then the CUDA
// toolkit's library directory this build was configured with).
//
// A missing library or symbol throws statescan::Error naming "cublas" (the
// callers are C++, so the exception passes through these extern "C" frames).
#include <cublas_v2.h>
#include <dlfcn.h>

#include <mutex>
#include <string>

#include "core/error.h"

#ifndef STATESCAN_CUDA_LIBDIR
#define STATESCAN_CUDA_LIBDIR ""
#endif

namespace statescan::cuda::detail {
namespace {

// The library handle, opened once; throws when neither location has it.
void* cublas_library() {
  static void* handle = nullptr;
  static std::string failure;
  static std::once_flag once;
  std::call_once(once, [] {
    const std::string name = "libcublas.so." + std::to_string(CUBLAS_VER_MAJOR);
    handle = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      failure = dlerror();
      const std::string dir = STATESCAN_CUDA_LIBDIR;
      if (!dir.empty()) {
        handle = dlopen((dir + "/" + name).c_str(), RTLD_NOW | RTLD_LOCAL);
        if (handle == nullptr) failure += std::string("; ") + dlerror();
      }
    }
  });
  SS_CHECK_ARG(handle != nullptr, "cublas", "cannot load cuBLAS: ", failure);
  return handle;
}

// The real entry point `name`, resolved once per call site's type.
template <typename Fn>
Fn resolve(const char* name) {
  void* symbol = dlsym(cublas_library(), name);
  SS_CHECK_ARG(symbol != nullptr, "cublas", "libcublas has no symbol ", name);
  return reinterpret_cast<Fn>(symbol);
}

}  // namespace
}  // namespace statescan::cuda::detail

using statescan::cuda::detail::resolve;

extern "C" {

cublasStatus_t CUBLASWINAPI cublasCreate_v2(cublasHandle_t* handle) {
  static const auto real = resolve<decltype(&cublasCreate_v2)>("cublasCreate_v2");
  return real(handle);
}

cublasStatus_t CUBLASWINAPI cublasDestroy_v2(cublasHandle_t handle) {
  static const auto real = resolve<decltype(&cublasDestroy_v2)>("cublasDestroy_v2");
  return real(handle);
}

cublasStatus_t CUBLASWINAPI cublasSetStream_v2(cublasHandle_t handle, cudaStream_t stream) {
  static const auto real = resolve<decltype(&cublasSetStream_v2)>("cublasSetStream_v2");
  return real(handle, stream);
}

cublasStatus_t CUBLASWINAPI cublasSetMathMode(cublasHandle_t handle, cublasMath_t mode) {
  static const auto real = resolve<decltype(&cublasSetMathMode)>("cublasSetMathMode");
  return real(handle, mode);
}

cublasStatus_t CUBLASWINAPI cublasGemmStridedBatchedEx(
    cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n, int k,
    const void* alpha, const void* A, cudaDataType Atype, int lda, long long int strideA,
    const void* B, cudaDataType Btype, int ldb, long long int strideB, const void* beta, void* C,
    cudaDataType Ctype, int ldc, long long int strideC, int batchCount,
    cublasComputeType_t computeType, cublasGemmAlgo_t algo) {
  using Fn = cublasStatus_t(CUBLASWINAPI*)(
      cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const void*,
      const void*, cudaDataType, int, long long int, const void*, cudaDataType, int,
      long long int, const void*, void*, cudaDataType, int, long long int, int,
      cublasComputeType_t, cublasGemmAlgo_t);
  static const auto real = resolve<Fn>("cublasGemmStridedBatchedEx");
  return real(handle, transa, transb, m, n, k, alpha, A, Atype, lda, strideA, B, Btype, ldb,
              strideB, beta, C, Ctype, ldc, strideC, batchCount, computeType, algo);
}

cublasStatus_t CUBLASWINAPI cublasGemmBatchedEx(
    cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n, int k,
    const void* alpha, const void* const Aarray[], cudaDataType Atype, int lda,
    const void* const Barray[], cudaDataType Btype, int ldb, const void* beta,
    void* const Carray[], cudaDataType Ctype, int ldc, int batchCount,
    cublasComputeType_t computeType, cublasGemmAlgo_t algo) {
  using Fn = cublasStatus_t(CUBLASWINAPI*)(
      cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const void*,
      const void* const*, cudaDataType, int, const void* const*, cudaDataType, int, const void*,
      void* const*, cudaDataType, int, int, cublasComputeType_t, cublasGemmAlgo_t);
  static const auto real = resolve<Fn>("cublasGemmBatchedEx");
  return real(handle, transa, transb, m, n, k, alpha, Aarray, Atype, lda, Barray, Btype, ldb,
              beta, Carray, Ctype, ldc, batchCount, computeType, algo);
}

}  // extern "C"
