// Helpers for the GPU context-parallel suites: run CpMixer on device tensors
// (in a chosen dtype) on a slice of a ref::Problem and collect its outputs as
// host fp32 vectors (tests/cp_test_util.h's CpOutputs).
#pragma once

#include <cuda_runtime.h>

#include <limits>
#include <memory>
#include <vector>

#include "core/device_buffer.h"
#include "core/dtype.h"
#include "tests/cp_test_util.h"

namespace statescan::test {

// x rounded to what a tensor of dtype `t` holds (kept in double).
inline std::vector<double> round_to_dtype(std::vector<double> x, DType t) {
  for (auto& e : x) e = static_cast<double>(round_to(t, static_cast<float>(e)));
  return x;
}

// Rounds the inputs of p to what the device sees: q, k, v, beta in `dtype`,
// g, h0 and the scale in fp32 (so the fp64 reference and the GPU compute
// from identical values).
inline void round_problem(ref::Problem& p, DType dtype) {
  for (auto* x : {&p.q, &p.k, &p.v, &p.beta}) *x = round_to_dtype(std::move(*x), dtype);
  for (auto* x : {&p.g, &p.h0}) *x = round_f32(std::move(*x));
  p.scale = static_cast<float>(p.scale);
}

// A device tensor holding `host` converted to dtype `t` (empty host: undefined).
class DeviceTensor {
 public:
  DeviceTensor() = default;
  DeviceTensor(const std::vector<float>& host, DType t, Shape shape) {
    if (host.empty()) return;
    std::vector<unsigned char> bytes(host.size() * size_of(t));
    convert_from_float(t, host.data(), bytes.data(), host.size());
    buf_ = std::make_unique<DeviceBuffer<unsigned char>>(bytes);
    view_ = TensorView(buf_->data(), t, std::move(shape), Memory::device);
  }
  // An output of `count` elements poisoned with NaN (all-ones bytes).
  static DeviceTensor poisoned(std::size_t count, DType t, Shape shape) {
    DeviceTensor d;
    if (count == 0) return d;
    d.buf_ = std::make_unique<DeviceBuffer<unsigned char>>(count * size_of(t));
    d.buf_->fill_bytes(0xFF);
    d.view_ = TensorView(d.buf_->data(), t, std::move(shape), Memory::device);
    return d;
  }
  const TensorView& view() const { return view_; }
  std::vector<float> to_host() const {
    if (!buf_) return {};
    const std::vector<unsigned char> bytes = buf_->to_host();
    std::vector<float> out(bytes.size() / size_of(view_.dtype));
    convert_to_float(view_.dtype, bytes.data(), out.data(), out.size());
    return out;
  }

 private:
  std::unique_ptr<DeviceBuffer<unsigned char>> buf_;
  TensorView view_;
};

// Runs forward (and backward when `backward`) of `mixer` on tokens [t0, t1)
// of problem p, every tensor on the device in `dtype` (g and states fp32),
// cotangents d_o (full [B,T,H,Dv]) and dht ([N,H,Dk,Dv] or empty). Outputs
// are poisoned with NaN first so that unwritten elements show. With
// `o_on_error`, an error from the forward leaves o there before it propagates.
inline CpOutputs run_cp_device(CpMixer& mixer, const ref::Problem& p, DType dtype, int64_t t0,
                               int64_t t1, const std::vector<double>& d_o,
                               const std::vector<double>& dht, bool backward,
                               std::vector<float>* o_on_error = nullptr) {
  const int64_t B = p.batch, T = p.seq_len, H = p.heads, Dk = p.dk, Dv = p.dv, L = t1 - t0;
  const int64_t N = p.num_sequences();
  const bool vec = vector_gate(p.variant);
  const Shape qk{B, L, H, Dk}, vo{B, L, H, Dv}, bth{B, L, H}, st{N, H, Dk, Dv};
  const Shape gs = vec ? qk : bth;
  const DeviceTensor q(slice_tokens(p.q, B, T, t0, t1, H * Dk), dtype, qk);
  const DeviceTensor k(slice_tokens(p.k, B, T, t0, t1, H * Dk), dtype, qk);
  const DeviceTensor v(slice_tokens(p.v, B, T, t0, t1, H * Dv), dtype, vo);
  DeviceTensor g, beta, h0, dov, dhtv;
  if (!p.g.empty())
    g = DeviceTensor(slice_tokens(p.g, B, T, t0, t1, vec ? H * Dk : H), DType::f32, gs);
  if (!p.beta.empty()) beta = DeviceTensor(slice_tokens(p.beta, B, T, t0, t1, H), dtype, bth);
  if (!p.h0.empty()) h0 = DeviceTensor(cast(p.h0), DType::f32, st);
  std::unique_ptr<DeviceBuffer<int64_t>> cu;
  if (!p.cu_seqlens.empty()) cu = std::make_unique<DeviceBuffer<int64_t>>(p.cu_seqlens);

  const std::size_t n_qk = static_cast<std::size_t>(B * L * H * Dk);
  const std::size_t n_vo = static_cast<std::size_t>(B * L * H * Dv);
  const std::size_t n_bth = static_cast<std::size_t>(B * L * H);
  const std::size_t n_st = static_cast<std::size_t>(N * H * Dk * Dv);
  DeviceTensor o = DeviceTensor::poisoned(n_vo, dtype, vo);
  DeviceTensor ht = DeviceTensor::poisoned(n_st, DType::f32, st);

  CpForwardArgs fa;
  fa.q = q.view();
  fa.k = k.view();
  fa.v = v.view();
  fa.g = g.view();
  fa.beta = beta.view();
  if (cu)
    fa.cu_seqlens =
        TensorView(cu->data(), DType::i64, {static_cast<int64_t>(cu->size())}, Memory::device);
  fa.initial_state = h0.view();
  fa.o = o.view();
  fa.final_state = ht.view();
  try {
    mixer.forward(fa);
  } catch (...) {
    if (o_on_error != nullptr) *o_on_error = o.to_host();
    throw;
  }

  CpOutputs out;
  out.o = o.to_host();
  out.ht = ht.to_host();
  if (!backward) return out;

  dov = DeviceTensor(slice_tokens(d_o, B, T, t0, t1, H * Dv), dtype, vo);
  if (!dht.empty()) dhtv = DeviceTensor(cast(dht), DType::f32, st);
  DeviceTensor dq = DeviceTensor::poisoned(n_qk, dtype, qk);
  DeviceTensor dk = DeviceTensor::poisoned(n_qk, dtype, qk);
  DeviceTensor dv = DeviceTensor::poisoned(n_vo, dtype, vo);
  DeviceTensor dg = DeviceTensor::poisoned(p.g.empty() ? 0 : (vec ? n_qk : n_bth), DType::f32, gs);
  DeviceTensor dbeta = DeviceTensor::poisoned(p.beta.empty() ? 0 : n_bth, dtype, bth);
  DeviceTensor dh0 = DeviceTensor::poisoned(n_st, DType::f32, st);
  CpBackwardArgs ba;
  ba.d_o = dov.view();
  ba.d_final_state = dhtv.view();
  ba.dq = dq.view();
  ba.dk = dk.view();
  ba.dv = dv.view();
  ba.dg = dg.view();
  ba.dbeta = dbeta.view();
  ba.d_initial_state = dh0.view();
  mixer.backward(ba);
  out.dq = dq.to_host();
  out.dk = dk.to_host();
  out.dv = dv.to_host();
  out.dg = dg.to_host();
  out.dbeta = dbeta.to_host();
  out.dh0 = dh0.to_host();
  return out;
}

}  // namespace statescan::test
