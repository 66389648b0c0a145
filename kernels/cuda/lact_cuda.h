// LaCT (DESIGN §6) on the GPU: forward and backward of one layer with the
// semantics, memory plan and sharded layout of the CPU template
// (kernels/cpu/lact.h, read its header comment first).
//
// Every token-level product is a cuBLAS GEMM batched over the heads of a batch
// row (cublasGemmStridedBatchedEx); elementwise work (SwiGLU and its
// derivatives, learning-rate weighting, momentum, renorm, the Newton-Schulz
// polynomial) runs in fused kernels. Precision:
//   f32:  fp32 GEMMs without TF32; Muon's Newton-Schulz in fp64 (as the CPU).
//   bf16: tokens, learning rates and GEMM operands bf16, fp32 accumulation and
//         intermediates, fast weights kept as fp32 master copies; Newton-Schulz
//         on fp32 values, its products as bf16 tensor-core GEMMs of two-part
//         (hi + lo) operands, ~fp32 accurate (STATESCAN_LACT_NS=fp32: fp32
//         CUDA-core GEMMs; lact_newton_schulz.cuh).
// All pointers are device pointers; all tensors of one call share `dtype`.
// Work is enqueued on `stream`; scratch comes from statescan's workspace
// allocator (core/device_pool.h).
// The all-reduce callback receives device fp32 buffers and must sum them over
// the group in stream order (NCCL on the same stream, or a host round trip).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include "core/device_buffer.h"
#include "core/dtype.h"
#include "kernels/cpu/lact.h"

namespace statescan::cuda {

// Sizes, sharding and device pointers of one call, laid out as LactParams.
struct LactCudaParams {
  LactConfig config;
  DType dtype = DType::f32;  // f32 or bf16, for every tensor below
  int64_t batch = 0, seq_len = 0, heads = 0, dim = 0, hidden = 0;
  int64_t ranks = 1, rank = 0;
  const void *q = nullptr, *k = nullptr, *v = nullptr;        // [B, T/P, H, D]
  const void *lr0 = nullptr, *lr1 = nullptr, *lr2 = nullptr;  // [B, T/P, H]
  const void *w0 = nullptr, *w1 = nullptr, *w2 = nullptr;     // [H,M,D], [H,D,M], [H,M,D]
  void* o = nullptr;                                          // [B, T/P, H, D]

  int64_t local_len() const { return ranks > 0 ? seq_len / ranks : 0; }
};

struct LactCudaGrads {
  const void* d_o = nullptr;
  void *dq = nullptr, *dk = nullptr, *dv = nullptr;
  void *dlr0 = nullptr, *dlr1 = nullptr, *dlr2 = nullptr;
  void *dw0 = nullptr, *dw1 = nullptr, *dw2 = nullptr;  // summed over batch rows and ranks
};

// What forward saves for backward (fp32 for every dtype): per chunk and
// (b, h) the weights at the chunk start and the chunk's update P, each a block
// of 3 M D values laid out [W0 | W2 | W1] (the CPU's LactCheckpoints use
// [W0 | W1 | W2]; on the GPU W0 and W2 are adjacent so that products pairing
// them are single GEMMs).
struct LactCudaSaved {
  DeviceBuffer<float> weights;  // [chunks, B, H, 3 M D]
  DeviceBuffer<float> updates;  // [chunks, B, H, 3 M D]
};

// Sums `count` device floats at `data` over the group, in place, ordered on
// `stream`. Empty: a group of one.
using LactDeviceAllReduce = std::function<void(float* data, std::size_t count, cudaStream_t)>;

// Sizes, sharding, config and pointers (no data reads). Throws statescan::Error
// naming the argument, as lact_check_params.
void lact_cuda_check_sizes(const LactCudaParams& p);
// The data checks of lact_check_params on the device: q, k, v, w finite,
// learning rates finite and > 0. Synchronises `stream`; throws naming the
// first faulty tensor and element.
void lact_cuda_check_data(const LactCudaParams& p, cudaStream_t stream);
// How a layer of `dtype` with head dim `dim` and hidden width `hidden` runs
// Muon's Newton-Schulz products, for reports: "fp64" (f32 layers), and for
// bf16: "bf16x3" (two-part bf16 operands through split3 + cuBLAS),
// "bf16x3-cluster" (STATESCAN_LACT_NS=cluster where the shape and device
// allow: the forward's steps in one clustered launch, lact_ns_cluster.cuh;
// opt-in), "bf16x3-fused" (the same products in one kernel,
// STATESCAN_LACT_NS=fused; opt-in) or "fp32" (STATESCAN_LACT_NS=fp32).
const char* lact_cuda_ns_gemms(DType dtype, int64_t dim, int64_t hidden);
// How a layer of `dtype`, `dim`, `hidden` forms its hidden layer, forward and
// backward (h0 = x W0^T, h2 = x W2^T, e = -v W1 and the elementwise steps
// after them; in the backward also dgate = d_o W1 and the update gradient's
// u = k dG^T rows),
// for reports: "fused" (bf16 layers with dim a multiple of 64 up to 256 and
// hidden a multiple of 64, on a 9.0 device of an sm_90a build: one kernel
// that writes only gate and z, and in the backward gate, dh and the update
// gradient's rows, lact_hidden.cuh; token arrays not 16-byte
// aligned, and problems past its addressing (lact_hidden_addressable: more
// than 65535 (batch, head) pairs), take the cuBLAS path) or "cublas" (cuBLAS
// GEMMs into fp32 h and e,
// then the elementwise kernels; f32 layers, other shapes, and
// STATESCAN_LACT_HIDDEN=cublas).
const char* lact_cuda_hidden_path(DType dtype, int64_t dim, int64_t hidden);
// d_o finite (synchronises `stream`).
void lact_cuda_check_finite(const void* x, DType dtype, int64_t n, const char* name,
                            cudaStream_t stream);

// o from the inputs; fills `saved` (may be null when no backward follows).
// Collective through all_reduce (once per chunk). Checks sizes, not data.
void lact_cuda_forward(const LactCudaParams& p, const LactDeviceAllReduce& all_reduce,
                       LactCudaSaved* saved, cudaStream_t stream);

// Gradients from d_o with `saved` from lact_cuda_forward of the same p.
// Collective through all_reduce (once per chunk plus once).
void lact_cuda_backward(const LactCudaParams& p, const LactCudaGrads& g, const LactCudaSaved& saved,
                        const LactDeviceAllReduce& all_reduce, cudaStream_t stream);

namespace lact_detail {
// STATESCAN_LACT_NS picks how bf16 layers run their Newton-Schulz products
// (lact_newton_schulz.cuh, NewtonSchulz), read once per process: unset or
// "bf16x3" two-part bf16 operands through split3_kernel + one cuBLAS GEMM
// (on a 9.0 device the products whose operands would take two split
// launches in ns_gemm_wgmma_kernel instead: NewtonSchulz::routes_fused);
// "fp32" fp32 GEMMs; "fused" the two-part products formed from the fp32
// operands inside the GEMM, ns_gemm_wgmma_kernel on a 9.0 device and
// ns_gemm_fused_kernel elsewhere (opt-in: passes the GPU suite but measured
// ~8 % slower than bf16x3 on an H100, 2026-12-05; shapes they do not take
// fall back to the split path per call);
// "cluster" the forward's steps (also the backward's recomputation of them)
// in ns_cluster_kernel where ns_cluster_supported (lact_ns_cluster.cuh)
// holds for the layer's shape, everything else as bf16x3 (opt-in: passes the
// GPU suite, on par with bf16x3 on an H200, 2026-12-04; README). Any other
// value is an error naming the variable.
enum class NsGemms { bf16x3, fp32, fused, cluster };
NsGemms ns_gemms_requested();

// STATESCAN_LACT_HIDDEN: unset or "fused" lets bf16 layers take the fused
// hidden-layer kernel where it fits (lact_cuda_hidden_path), "cublas" keeps
// them on cuBLAS; read once per process, any other value an error naming it.
bool hidden_fused_requested();

// STATESCAN_LACT_STREAMS: unset or "2" lets a layer on the fused hidden layer
// run each chunk's output side (the apply, the backward's apply and dq) on a
// second stream beside the update chain (the same kernels, and every sum in
// the same order, as on one stream); "1" keeps all of it on the caller's
// stream. (A third stream for the pairs of token-contracted weight GEMMs was
// measured slower: PERF_NOTES, forty-fourth session.)
// Read once per process, any other value an error naming it.
bool side_stream_requested();

// STATESCAN_LACT_PDL: "1" launches the fused hidden-layer kernels that run
// on the caller's stream as programmatic dependents of the kernel before
// them (their token loads overlap its tail; LactHiddenParams::dependent);
// unset or "0" does not. Opt-in: on an H200 at the benchmark's shape it
// passed the tests and measured no gain (fwd+bwd within 0.3 ms of the
// default in two A/B pairs; PERF_NOTES, thirty-fourth session). Read once
// per process, any other value an error naming it.
bool lact_pdl_requested();

// What lact_cuda_ns_gemms reports for a bf16 layer run in `mode`.
const char* ns_gemms_name(NsGemms mode, int64_t dim, int64_t hidden);

// Muon's Newton-Schulz alone, as a bf16 layer runs it (NewtonSchulz<float> in
// lact_newton_schulz.cuh), in a given mode: for the tests and statescan-bench
// --lact-ns, which compare the modes in one process. P, out, d_out, dP are
// [pairs, 3 M D] fp32 device arrays of blocks [W0 | W2 | W1] (M x D, M x D,
// D x M); out = NS_steps of every matrix of P. backward() needs
// keep_iterates and follows a forward() of the same P: dP = (dNS/dP)^T d_out.
// Ordered on `stream`; repeated calls on the same pointers replay one CUDA
// graph, as in the layer. `allow_wgmma` false: no product on the wgmma
// kernel, as on a device without it (NewtonSchulz).
class NewtonSchulzBf16 {
 public:
  NewtonSchulzBf16(int64_t pairs, int64_t M, int64_t D, int steps, bool keep_iterates, NsGemms mode,
                   cudaStream_t stream, bool allow_wgmma = true);
  ~NewtonSchulzBf16();
  NewtonSchulzBf16(const NewtonSchulzBf16&) = delete;
  NewtonSchulzBf16& operator=(const NewtonSchulzBf16&) = delete;
  void forward(const float* P, float* out);
  void backward(const float* P, const float* d_out, float* dP);
  // CUDA graphs captured so far (none on the legacy default stream).
  int graphs_captured() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};
}  // namespace lact_detail

}  // namespace statescan::cuda
