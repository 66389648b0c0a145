// lact_hidden_probe: times one of the fused LaCT hidden-layer kernels alone
// (lact_hidden.cu) at the layer benchmark's chunk slice, for A/B runs of
// kernel variants (scripts/kernel-probe.sh links this main against a variant
// of lact_hidden.cu; each probe is ~0.4 MB packed, where statescan-bench is
// 35 MB of the 64 MiB a device call carries).
//
//   lact_hidden_probe MODE [D] [LABEL]
//   MODE: grad (lact_hidden_grad_kernel), key (key side), apply_backward
//
// Inputs are uniform random (fixed seeds), outputs are not checked: the
// suite (test_cuda_lact) is the correctness oracle. Prints the median and the
// minimum of 50 launches (CUDA events, 10 warm-up launches) and the rate of
// the kernel's products. PROBE_DUMP=FILE writes the outputs' bytes (poisoned
// with 0xff before the first launch) to FILE, so that two store paths of the
// same kernel (STATESCAN_LACT_ROW_STORE) can be compared with cmp.
// PROBE_PAD=E pads the gradient kernel's output rows by E elements (a
// multiple of 8): their pitch is then not a power of two.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "core/cuda_check.h"
#include "kernels/cuda/lact_hidden.cuh"

namespace {

using bf16 = __nv_bfloat16;
using namespace statescan::cuda::lact_detail;

std::vector<void*> g_buffers;

bf16* random_bf16(int64_t n, float scale, unsigned seed) {
  std::vector<bf16> host(static_cast<size_t>(n));
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-scale, scale);
  for (auto& x : host) x = __float2bfloat16(dist(gen));
  bf16* dev = nullptr;
  SS_CUDA_CHECK(cudaMalloc(&dev, n * sizeof(bf16)));
  SS_CUDA_CHECK(cudaMemcpy(dev, host.data(), n * sizeof(bf16), cudaMemcpyHostToDevice));
  g_buffers.push_back(dev);
  return dev;
}

std::vector<std::pair<bf16*, int64_t>> g_outputs;

bf16* output(int64_t n) {
  bf16* dev = nullptr;
  SS_CUDA_CHECK(cudaMalloc(&dev, n * sizeof(bf16)));
  SS_CUDA_CHECK(cudaMemset(dev, 0xff, n * sizeof(bf16)));
  g_buffers.push_back(dev);
  g_outputs.emplace_back(dev, n);
  return dev;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s grad|key|apply_backward [D] [LABEL]\n", argv[0]);
    return 2;
  }
  const std::string mode = argv[1];
  const int64_t H = 4, D = argc > 2 ? std::atoi(argv[2]) : 256, M = 512, n = 4096;
  const std::string label = argc > 3 ? argv[3] : "";
  try {
    const bf16* k = random_bf16(n * H * D, 1.f, 1);
    const bf16* v = random_bf16(n * H * D, 1.f, 2);
    const bf16* w = random_bf16(H * 3 * M * D, 0.05f, 3);
    const bf16 *lr0 = random_bf16(n * H, 0.5f, 7), *lr1 = random_bf16(n * H, 0.5f, 8),
               *lr2 = random_bf16(n * H, 0.5f, 9);
    double flop = 0;
    LactHiddenGradParams g;
    LactHiddenParams h;
    if (mode == "grad") {
      g.B = 1, g.H = H, g.D = D, g.M = M, g.local_len = n, g.n = n;
      g.k = k, g.v = v, g.w = w, g.dg = random_bf16(H * 3 * M * D, 0.05f, 4);
      g.w1t = random_bf16(H * M * D, 0.05f, 5), g.dg1t = random_bf16(H * M * D, 0.05f, 6);
      g.lr0 = lr0, g.lr1 = lr1, g.lr2 = lr2;
      const char* pad_env = std::getenv("PROBE_PAD");
      const int64_t pad = pad_env != nullptr ? std::atoll(pad_env) : 0;
      g.z_ld = g.dh_ld = 2 * M + pad, g.gate_ld = g.de_ld = M + pad;
      g.z = output(n * H * g.z_ld), g.dh = output(n * H * g.dh_ld);
      g.gate = output(n * H * g.gate_ld), g.de = output(n * H * g.de_ld);
      g.dlr0 = output(n * H), g.dlr1 = output(n * H), g.dlr2 = output(n * H);
      flop = 2.0 * n * H * D * 6 * M;  // [h0 | h2 | u0 | u2] and [v W1 | u1]
    } else if (mode == "key" || mode == "apply_backward") {
      h.mode = mode == "key" ? LactHiddenMode::key_side : LactHiddenMode::apply_backward;
      h.B = 1, h.H = H, h.D = D, h.M = M, h.local_len = n, h.n = n;
      h.x = k, h.v = v, h.w = w, h.lr0 = lr0, h.lr1 = lr1, h.lr2 = lr2;
      h.z = output(n * H * 2 * M), h.gate = output(n * H * M), h.dh = output(n * H * 2 * M);
      flop = 2.0 * n * H * D * 3 * M;  // [h0 | h2] and e (dgate)
    } else {
      std::fprintf(stderr, "lact_hidden_probe: MODE is grad, key or apply_backward, not %s\n",
                   mode.c_str());
      return 2;
    }
    cudaEvent_t start, stop;
    SS_CUDA_CHECK(cudaEventCreate(&start));
    SS_CUDA_CHECK(cudaEventCreate(&stop));
    std::vector<float> us;
    for (int i = 0; i < 60; ++i) {
      SS_CUDA_CHECK(cudaEventRecord(start));
      if (mode == "grad")
        lact_hidden_grad_launch(g, nullptr);
      else
        lact_hidden_launch(h, nullptr);
      SS_CUDA_CHECK(cudaEventRecord(stop));
      SS_CUDA_CHECK(cudaEventSynchronize(stop));
      float ms = 0;
      SS_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
      if (i >= 10) us.push_back(1000 * ms);
    }
    std::sort(us.begin(), us.end());
    const double median = us[us.size() / 2];
    std::printf("%-16s %-14s D %3lld  median %7.1f us  min %7.1f  %4.0f TFLOP/s\n", label.c_str(),
                mode.c_str(), static_cast<long long>(D), median, us.front(), flop / median * 1e-6);
    SS_CUDA_CHECK(cudaEventDestroy(start));
    SS_CUDA_CHECK(cudaEventDestroy(stop));
    if (const char* dump = std::getenv("PROBE_DUMP")) {
      FILE* f = std::fopen(dump, "wb");
      if (f == nullptr) throw std::runtime_error(std::string("cannot write ") + dump);
      for (const auto& [dev, count] : g_outputs) {
        std::vector<bf16> host(static_cast<size_t>(count));
        SS_CUDA_CHECK(cudaMemcpy(host.data(), dev, count * sizeof(bf16), cudaMemcpyDeviceToHost));
        std::fwrite(host.data(), sizeof(bf16), host.size(), f);
      }
      std::fclose(f);
    }
    for (void* p : g_buffers) SS_CUDA_CHECK(cudaFree(p));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lact_hidden_probe: %s\n", e.what());
    return 1;
  }
  return 0;
}
