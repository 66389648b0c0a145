// Helpers for the GPU LaCT suites: device copies of a problem in f32 or bf16,
// and runs of the GPU kernel (unsharded) and of LactLayer on device tensors
// (one rank's slices) that return every output as doubles. Outputs are
// poisoned with NaN first so that unwritten elements show.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "core/device_buffer.h"
#include "core/dtype.h"
#include "kernels/cuda/lact_cuda.h"
#include "tests/lact_test_util.h"

namespace statescan::test {

// A device array of n values of `dtype`.
struct DeviceTensor {
  DType dtype = DType::f32;
  std::size_t count = 0;
  DeviceBuffer<unsigned char> bytes;

  DeviceTensor(std::size_t n, DType t) : dtype(t), count(n), bytes(n * size_of(t)) {
    bytes.fill_bytes(0xFF);  // NaN in f32 and bf16
  }
  DeviceTensor(const std::vector<double>& host, DType t) : DeviceTensor(host.size(), t) {
    std::vector<float> f(host.begin(), host.end());
    std::vector<unsigned char> raw(count * size_of(t));
    convert_from_float(t, f.data(), raw.data(), count);
    bytes.copy_from_host(raw);
  }
  void* data() { return bytes.data(); }
  std::vector<double> read() const {
    const std::vector<unsigned char> raw = bytes.to_host();
    std::vector<float> f(count);
    convert_to_float(dtype, raw.data(), f.data(), count);
    return std::vector<double>(f.begin(), f.end());
  }
  TensorView view(const Shape& shape) {
    return TensorView(bytes.data(), dtype, shape, Memory::device);
  }
};

// Every input rounded to `dtype` (then exactly representable in it), so that
// the fp64 reference sees what the GPU sees.
inline LactProblem rounded_to(LactProblem p, DType dtype) {
  for (auto* x : {&p.q, &p.k, &p.v, &p.lr0, &p.lr1, &p.lr2, &p.w0, &p.w1, &p.w2, &p.d_o})
    for (double& e : *x) e = round_to(dtype, static_cast<float>(e));
  return p;
}

// The device tensors of one rank's slices of a problem plus its outputs.
struct DeviceLactRun {
  DeviceTensor q, k, v, lr0, lr1, lr2, w0, w1, w2, d_o;
  DeviceTensor o, dq, dk, dv, dlr0, dlr1, dlr2, dw0, dw1, dw2;

  DeviceLactRun(const LactProblem& local, DType t)
      : q(local.q, t),
        k(local.k, t),
        v(local.v, t),
        lr0(local.lr0, t),
        lr1(local.lr1, t),
        lr2(local.lr2, t),
        w0(local.w0, t),
        w1(local.w1, t),
        w2(local.w2, t),
        d_o(local.d_o, t),
        o(local.q.size(), t),
        dq(local.q.size(), t),
        dk(local.q.size(), t),
        dv(local.q.size(), t),
        dlr0(local.lr0.size(), t),
        dlr1(local.lr0.size(), t),
        dlr2(local.lr0.size(), t),
        dw0(local.w0.size(), t),
        dw1(local.w0.size(), t),
        dw2(local.w0.size(), t) {}

  LactResult<double> result(bool backward) const {
    LactResult<double> r;
    r.o = o.read();
    if (!backward) return r;
    r.dq = dq.read();
    r.dk = dk.read();
    r.dv = dv.read();
    r.dlr0 = dlr0.read();
    r.dlr1 = dlr1.read();
    r.dlr2 = dlr2.read();
    r.dw0 = dw0.read();
    r.dw1 = dw1.read();
    r.dw2 = dw2.read();
    return r;
  }
};

// The GPU kernel (lact_cuda_forward/backward) on the whole problem.
inline LactResult<double> run_lact_gpu_kernel(const LactProblem& pr, const LactConfig& cfg,
                                              DType dtype, bool backward = true) {
  DeviceLactRun d(pr, dtype);
  cuda::LactCudaParams p;
  p.config = cfg;
  p.dtype = dtype;
  p.batch = pr.s.batch;
  p.seq_len = pr.s.seq_len;
  p.heads = pr.s.heads;
  p.dim = pr.s.dim;
  p.hidden = pr.s.hidden;
  p.q = d.q.data();
  p.k = d.k.data();
  p.v = d.v.data();
  p.lr0 = d.lr0.data();
  p.lr1 = d.lr1.data();
  p.lr2 = d.lr2.data();
  p.w0 = d.w0.data();
  p.w1 = d.w1.data();
  p.w2 = d.w2.data();
  p.o = d.o.data();
  cuda::LactCudaSaved saved;
  cuda::lact_cuda_forward(p, {}, backward ? &saved : nullptr, nullptr);
  if (backward) {
    cuda::LactCudaGrads g;
    g.d_o = d.d_o.data();
    g.dq = d.dq.data();
    g.dk = d.dk.data();
    g.dv = d.dv.data();
    g.dlr0 = d.dlr0.data();
    g.dlr1 = d.dlr1.data();
    g.dlr2 = d.dlr2.data();
    g.dw0 = d.dw0.data();
    g.dw1 = d.dw1.data();
    g.dw2 = d.dw2.data();
    cuda::lact_cuda_backward(p, g, saved, {}, nullptr);
  }
  // A failed run is a test failure here, not only an empty result for the
  // caller's comparison to notice (or, comparing two runs, not to).
  const cudaError_t rc = cudaDeviceSynchronize();
  if (rc != cudaSuccess) {
    ADD_FAILURE() << "the GPU run failed: " << cudaGetErrorString(rc);
    return {};
  }
  return d.result(backward);
}

// LactLayer forward + backward on device tensors holding rank `rank`'s
// slices (of `ranks`). o, dq, ... are local slices; dw0..2 are full.
inline LactResult<double> run_lact_gpu_layer(LactLayer& layer, const LactProblem& pr, int ranks,
                                             int rank, DType dtype) {
  const LactSizes& s = pr.s;
  const int64_t Tl = s.seq_len / ranks;
  DeviceLactRun d(ranks == 1 ? pr : shard_problem(pr, layer.config().chunk, ranks, rank), dtype);
  const Shape tokens{s.batch, Tl, s.heads, s.dim}, rates{s.batch, Tl, s.heads};
  const Shape wide{s.heads, s.hidden, s.dim}, narrow{s.heads, s.dim, s.hidden};
  LactForwardArgs fa;
  fa.q = d.q.view(tokens);
  fa.k = d.k.view(tokens);
  fa.v = d.v.view(tokens);
  fa.lr0 = d.lr0.view(rates);
  fa.lr1 = d.lr1.view(rates);
  fa.lr2 = d.lr2.view(rates);
  fa.w0 = d.w0.view(wide);
  fa.w1 = d.w1.view(narrow);
  fa.w2 = d.w2.view(wide);
  fa.o = d.o.view(tokens);
  layer.forward(fa);
  LactBackwardArgs ba;
  ba.d_o = d.d_o.view(tokens);
  ba.dq = d.dq.view(tokens);
  ba.dk = d.dk.view(tokens);
  ba.dv = d.dv.view(tokens);
  ba.dlr0 = d.dlr0.view(rates);
  ba.dlr1 = d.dlr1.view(rates);
  ba.dlr2 = d.dlr2.view(rates);
  ba.dw0 = d.dw0.view(wide);
  ba.dw1 = d.dw1.view(narrow);
  ba.dw2 = d.dw2.view(wide);
  layer.backward(ba);
  return d.result(true);
}

}  // namespace statescan::test
