// Shared by the CUDA forward and backward suites (test_cuda_forward.cpp,
// test_cuda_backward.cpp; test_cuda_cp.cpp takes the sizes fill and the
// sync check): a reference problem's inputs rounded to what the
// device holds and uploaded, the MixerParams that read them, and the suites'
// common parametrisation (variant x dtype x head dim). Both suites compare
// against the fp64 reference on the exact values the kernels see, so the
// rounding must be the same in both: one copy of it.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "core/device_buffer.h"
#include "core/dtype.h"
#include "kernels/cpu/reference.h"
#include "kernels/cuda/cuda_mixer.h"
#include "kernels/mixer_params.h"
#include "tests/test_util.h"

namespace statescan::test {

// Rounds x to what a tensor of dtype `t` holds; returns the storage bytes.
inline std::vector<unsigned char> to_storage(DType t, std::vector<double>& x) {
  std::vector<float> f(x.begin(), x.end());
  std::vector<unsigned char> bytes(f.size() * size_of(t));
  convert_from_float(t, f.data(), bytes.data(), f.size());
  convert_to_float(t, bytes.data(), f.data(), f.size());
  x.assign(f.begin(), f.end());
  return bytes;
}

inline std::vector<double> from_storage(DType t, const std::vector<unsigned char>& bytes) {
  std::vector<float> f(bytes.size() / size_of(t));
  convert_to_float(t, bytes.data(), f.data(), f.size());
  return std::vector<double>(f.begin(), f.end());
}

inline std::vector<double> to_double(const std::vector<float>& x) {
  return std::vector<double>(x.begin(), x.end());
}

// Waits for the device and fails the test (not the process) on an error.
inline void check_device_sync() {
  const cudaError_t status = cudaDeviceSynchronize();
  ASSERT_EQ(status, cudaSuccess) << cudaGetErrorString(status);
}

// The sizes and options of `p` as MixerParams in `dtype` with chunks of
// `chunk`; no tensors (the caller points it at them and at cu_seqlens).
inline MixerParams mixer_sizes(const ref::Problem& p, DType dtype, int64_t chunk) {
  MixerParams m;
  m.variant = p.variant;
  m.batch = p.batch;
  m.seq_len = p.seq_len;
  m.heads = p.heads;
  m.dk = p.dk;
  m.dv = p.dv;
  m.chunk = chunk;
  m.scale = static_cast<float>(p.scale);
  m.l2norm_qk = p.l2norm_qk;
  m.dtype = dtype;
  m.num_segments = p.num_sequences();
  return m;
}

// A reference problem's inputs on the device. The constructor rounds `p` in
// place to what the device sees (dtype for q, k, v and beta; fp32 for the
// scale, g and h0), so the reference run afterwards computes from identical
// values. Keeps a reference to `p`: the problem must outlive it.
class DeviceInputs {
 public:
  DeviceInputs(ref::Problem& p, DType dtype, int64_t chunk)
      : ref_(p), dtype_(dtype), chunk_(chunk) {
    p.scale = static_cast<float>(p.scale);
    for (auto* g : {&p.g, &p.h0})
      for (auto& e : *g) e = static_cast<float>(e);
    q_ = DeviceBuffer<unsigned char>(to_storage(dtype, p.q));
    k_ = DeviceBuffer<unsigned char>(to_storage(dtype, p.k));
    v_ = DeviceBuffer<unsigned char>(to_storage(dtype, p.v));
    if (!p.beta.empty()) beta_ = DeviceBuffer<unsigned char>(to_storage(dtype, p.beta));
    if (!p.g.empty()) g_ = DeviceBuffer<float>(std::vector<float>(p.g.begin(), p.g.end()));
    if (!p.h0.empty()) h0_ = DeviceBuffer<float>(std::vector<float>(p.h0.begin(), p.h0.end()));
    if (!p.cu_seqlens.empty()) cu_seqlens_ = DeviceBuffer<int64_t>(p.cu_seqlens);
    MixerParams host = params();
    host.cu_seqlens = p.cu_seqlens.empty() ? nullptr : p.cu_seqlens.data();
    num_chunks_ = count_chunks(host);
  }

  // The problem's sizes and inputs; no outputs.
  MixerParams params() const {
    MixerParams m = mixer_sizes(ref_, dtype_, chunk_);
    m.cu_seqlens = cu_seqlens_.size() ? cu_seqlens_.data() : nullptr;
    m.q = q_.data();
    m.k = k_.data();
    m.v = v_.data();
    m.g = g_.size() ? g_.data() : nullptr;
    m.beta = beta_.size() ? beta_.data() : nullptr;
    m.initial_state = h0_.size() ? h0_.data() : nullptr;
    return m;
  }

  const ref::Problem& problem() const { return ref_; }
  DType dtype() const { return dtype_; }
  int64_t num_chunks() const { return num_chunks_; }
  // Elements of one (sequence or chunk) state: heads x dk x dv.
  std::size_t state_size() const {
    return static_cast<std::size_t>(ref_.heads * ref_.dk * ref_.dv);
  }

 private:
  const ref::Problem& ref_;
  DType dtype_;
  int64_t chunk_;
  int64_t num_chunks_ = 0;
  DeviceBuffer<unsigned char> q_, k_, v_, beta_;
  DeviceBuffer<float> g_, h0_;
  DeviceBuffer<int64_t> cu_seqlens_;
};

using MixerTestParam = std::tuple<Variant, DType, int64_t>;

// The suites' fixture: every variant x dtype x head dim, skipped without a
// device, with the small problem both suites start from (two full chunks of
// 64 and a partial one) and a seed per (test, parameter).
class CudaMixerTest : public ::testing::TestWithParam<MixerTestParam> {
 protected:
  void SetUp() override {
    if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  }
  Variant variant() const { return std::get<0>(GetParam()); }
  DType dtype() const { return std::get<1>(GetParam()); }
  int64_t dim() const { return std::get<2>(GetParam()); }

  ProblemSpec spec() const {
    ProblemSpec s;
    s.variant = variant();
    s.batch = 2;
    s.seq_len = 150;
    s.heads = 3;
    s.dk = s.dv = dim();
    return s;
  }
  uint64_t seed(uint64_t salt) const {
    return 1000003ull * salt + 7919ull * static_cast<uint64_t>(variant()) +
           101ull * static_cast<uint64_t>(dtype()) + static_cast<uint64_t>(dim());
  }
};

inline std::string mixer_param_name(const ::testing::TestParamInfo<MixerTestParam>& info) {
  return variant_name(std::get<0>(info.param)) + "_" + to_string(std::get<1>(info.param)) + "_d" +
         std::to_string(std::get<2>(info.param));
}

// Every variant, f32 / bf16 / f16, head dims 64 and 128.
inline auto all_mixer_params() {
  return ::testing::Combine(::testing::ValuesIn(kAllVariants),
                            ::testing::Values(DType::f32, DType::bf16, DType::f16),
                            ::testing::Values<int64_t>(64, 128));
}

// Sizes of a small DeltaNet problem with aligned stand-ins for its tensors
// (never read): for the checks that refuse arguments before any pointer is
// read or any device call, which then run without a device (CI).
inline MixerParams sizes_only() {
  MixerParams p;
  p.variant = Variant::deltanet;
  p.dtype = DType::bf16;
  p.batch = 1;
  p.seq_len = 100;
  p.heads = 2;
  p.dk = p.dv = 64;
  p.num_segments = 1;
  p.chunk = 64;
  auto* fake = reinterpret_cast<void*>(uintptr_t{1} << 20);
  p.q = p.k = p.v = p.beta = fake;
  p.o = fake;
  return p;
}

}  // namespace statescan::test
