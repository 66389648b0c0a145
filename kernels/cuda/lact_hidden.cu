// lact_hidden_kernel (lact_hidden.cuh): LaCT's hidden layer on the token side,
// products and elementwise step in one kernel.
//
// One CTA per 128 tokens of a (batch row, head) pair: two consumer
// warpgroups of 64 token rows and a producer warpgroup (one thread issues the
// copies; the others hand their registers to the consumers, setmaxnreg). The CTA's tokens (x, and v
// on the key side) are loaded once by TMA and stay in shared memory; the
// weights stream through a pipeline of stages (6 for the apply, 4 on the key
// side, whose resident k and v take 128 KB at D = 256), one stage per 64
// hidden columns j and 64 of D kb: W0's and W2's rows j, adjacent, as one
// 128-row K-major operand, and a 64 x 64 block of W1 (on the key side its
// columns j, MN-major; in the apply its columns j - 1 for the o product). For
// each j a warpgroup runs the products over all of D with both operands from
// shared memory (wgmma m64n128 for [h0 | h2], m64n64 for e), fp32
// accumulators, then writes that 64 x 64 block of z and gate in bf16 from
// the registers, 32 contiguous bytes a lane after two quad butterflies (the
// apply keeps gate in registers for o instead; see below). The
// warpgroups take turns at issuing their products (ping-pong), so that one's
// epilogue runs beside the other's MMAs.
//
// Measured (H200, ncu, 4,096-token slices, H 4, D 256, M 512; 2026-12-04,
// thirty-first session): apply 24.4 us (8.6 GFLOP, 352 TFLOP/s), key side
// 49.3 us (12.9 GFLOP, 262 TFLOP/s), apply_backward 42.8 us (12.9 GFLOP),
// lact_hidden_grad_kernel 93.1 us (25.8 GFLOP, 277 TFLOP/s). v1 (m64n64
// products, 4 stages, no turns, 4-byte stores from the accumulator layout)
// took 47 / 78 us for the first two: the epilogue ran beside nothing, and
// the low terms' stores, 4 bytes into each of 8 rows per instruction,
// doubled the key side. What bounds them now is the epilogue: ~2,000
// instructions a warp a pass on the key side, issued by one warp per
// scheduler at ~0.5 IPC, against ~1,500 cycles of the other warpgroup's
// MMAs (PERF_NOTES, thirty-first session). Tried and dropped: two
// accumulator sets for the apply without turns (24.9 -> 30.5 us). The key
// side's 4 stages are one pass of D = 256, so its turns wait on refills.
//
// The apply also forms o = gate W1^T (thirty-third session): gate stays in
// registers as the A operand of the next pass's o product, which streams W1's
// blocks in the stages a pass behind; apply + cuBLAS o GEMM 24.4 + 13.8 us ->
// 28.3 us a chunk (ncu), the layer's forward 29.6 -> 26.6 ms.

#include <cuda.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "core/cuda_check.h"
#include "core/env_knob.h"
#include "core/error.h"
#include "kernels/cuda/cluster_copy.cuh"
#include "kernels/cuda/lact_hidden.cuh"
#include "kernels/cuda/lact_math.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/quad_store.cuh"
#include "kernels/cuda/tensor_map.cuh"
#include "kernels/cuda/warp_mma.cuh"
#include "kernels/cuda/wgmma.cuh"

namespace statescan::cuda::lact_detail {
namespace {

using bf16 = __nv_bfloat16;

struct HiddenTile {
  static constexpr int kRows = 128;  // tokens per CTA: two warpgroups of 64
  static constexpr int kCols = 64;   // hidden columns per pass (h0 | h2: one m64n128)
  static constexpr int kK = 64;      // D per stage: one 128-byte swizzle row
  static constexpr int kMaxD = 256;
  static constexpr int kConsumers = 256;
  // + a producer warpgroup, of which one thread issues the copies: launched
  // at 65536 / 384 = 168 registers a thread, the producer gives up all but
  // kProducerRegs and the consumers take kConsumerRegs (2 x 128 x 240 +
  // 128 x 24 = 64512, the launch's 384 x 168: fits_register_pool; 240, not 232, for the apply's o,
  // hh and gate fragments: 208 live accumulator and operand registers). With a producer warp alone
  // (288 threads) ptxas capped every thread at 168: the key side sat at the cap and the gradient
  // kernel's 96 accumulators spilled.
  static constexpr int kThreads = kConsumers + 128;
  static constexpr int kConsumerRegs = 240, kProducerRegs = 24;
  static constexpr int kConsumerWarps = kConsumers / 32;
  static constexpr size_t kTokenBox = size_t{kRows} * kK * 2;   // 16 KB
  static constexpr size_t kWeightBox = size_t{kCols} * kK * 2;  // 8 KB

  // Whether the mode has a second token operand (v, or d_o) and W1's product.
  static constexpr bool two_products(LactHiddenMode mode) { return mode != LactHiddenMode::apply; }
  static constexpr int token_arrays(LactHiddenMode mode) { return two_products(mode) ? 2 : 1; }
  // A stage, in every mode: W0's and W2's 64 rows (adjacent: one 128-row
  // K-major B operand) and a 64 x 64 block of W1: on the key side (and
  // apply_backward) its columns j, rows kb (the MN-major B of e's product);
  // in the apply its columns j - 1, rows kb (the K-major B of the previous
  // pass's o product).
  static constexpr size_t kStageBytes = 3 * kWeightBox;
  // As many stages as shared memory holds beside the resident tokens: the
  // apply's 6 are a pass of D = 256 and half the next, so that the warpgroup
  // a turn behind holds fewer of the next pass's refills; the key side's
  // resident k and v leave room for one pass.
  static constexpr int stages(LactHiddenMode mode) { return two_products(mode) ? 4 : 6; }
  // Passes over the hidden columns: the apply has one more, for the last
  // pass's o product alone.
  static constexpr int passes(LactHiddenMode mode, int js) {
    return mode == LactHiddenMode::apply ? js + 1 : js;
  }
  static constexpr size_t tokens_bytes(LactHiddenMode mode, int D) {
    return token_arrays(mode) * (D / kK) * kTokenBox;
  }
  // + full, empty per stage and the tokens' barrier, + 1 KB to align the base
  // to the swizzle's 1024 bytes.
  static constexpr size_t smem_bytes(LactHiddenMode mode, int D) {
    return tokens_bytes(mode, D) + stages(mode) * kStageBytes + 8 * (2 * stages(mode) + 1) + 1024;
  }
};
static_assert(detail::fits_register_pool(HiddenTile::kThreads, 2, HiddenTile::kConsumerRegs,
                                         HiddenTile::kProducerRegs),
              "lact_hidden_kernel: the warpgroups' register budgets exceed the launch's pool");
static_assert(HiddenTile::smem_bytes(LactHiddenMode::key_side, HiddenTile::kMaxD) <= 227 * 1024 &&
                  HiddenTile::smem_bytes(LactHiddenMode::apply_backward, HiddenTile::kMaxD) <=
                      227 * 1024 &&
                  HiddenTile::smem_bytes(LactHiddenMode::apply, HiddenTile::kMaxD) <= 227 * 1024,
              "lact_hidden_kernel exceeds shared memory at the largest D");
// The warpgroup a turn behind still reads the previous pass's stages while
// the other's next pass waits on its refills: fewer stages than one pass over
// D would deadlock the turns.
static_assert(HiddenTile::stages(LactHiddenMode::key_side) >= HiddenTile::kMaxD / HiddenTile::kK &&
                  HiddenTile::stages(LactHiddenMode::apply_backward) >=
                      HiddenTile::kMaxD / HiddenTile::kK &&
                  HiddenTile::stages(LactHiddenMode::apply) >= HiddenTile::kMaxD / HiddenTile::kK,
              "lact_hidden_kernel needs a pass of D in stages");

// f(std::integral_constant<int, 1 + I>{}) for each I, in order.
template <typename F, int... I>
__device__ __forceinline__ void for_each_from_1(F&& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, 1 + I>{}), ...);
}

// The weight-stage pipeline both kernels run: kStages stages in shared
// memory, filled by the producer thread in (pass, kb) order through `full`
// (one arrival + the copies' bytes) and handed back through `empty` by each
// of the eight consumer warps; `tokens_full` for the CTA's resident tokens.
// The consumers take a pass at a time in turns (ping-pong, named barriers
// kTurn + wg): a warpgroup issues a pass's products only in its turn and
// hands the turn over once they are issued, so that the tensor pipe runs one
// warpgroup's products while the other computes and stores its epilogue (left
// alone, the two wait on the same stages and run their epilogues at the same
// time, the pipe idle).
template <int kStages>
struct StagePipe {
  static constexpr int kTurn = 1;
  uint64_t* full;  // [kStages], then empty [kStages], then tokens_full
  __device__ __forceinline__ uint64_t* empty() const { return full + kStages; }
  __device__ __forceinline__ uint64_t* tokens_full() const { return full + 2 * kStages; }

  // By one thread, before a __syncthreads.
  __device__ __forceinline__ void init() const {
    for (int st = 0; st < kStages; ++st) {
      detail::mbarrier_init(full + st, 1);
      detail::mbarrier_init(empty() + st, HiddenTile::kConsumerWarps);
    }
    detail::mbarrier_init(tokens_full(), 1);
    detail::fence_mbarrier_init();
  }

  // Producer: stage i's slot once its previous fill has been handed back,
  // armed for `bytes`; returns the barrier its copies complete on.
  __device__ __forceinline__ uint64_t* acquire(int i, uint32_t bytes) const {
    const int st = i % kStages;
    if (i >= kStages) detail::mbarrier_wait_cta(empty() + st, (i / kStages - 1) & 1);
    detail::mbarrier_arrive_expect_tx(full + st, bytes);
    return full + st;
  }

  // Consumers, warpgroup wg: warpgroup 0 takes the first turn.
  __device__ __forceinline__ void start_turns(int wg) const {
    if (wg == 1) pass_turn(wg);
  }
  __device__ __forceinline__ void pass_turn(int wg) const {
    detail::named_barrier_arrive(kTurn + 1 - wg, HiddenTile::kConsumers);
  }
  // This warp is done reading stage st (its products waited on).
  __device__ __forceinline__ void release(int st, int lane) const {
    __syncwarp();
    if (lane == 0) detail::mbarrier_arrive(empty() + st);
  }

  // One pass of warpgroup wg in its turn: stages i .. i + kbs - 1 (i
  // advances), products(st, kb, first) issuing stage st's wgmmas (first: the
  // pass's first, which overwrites the accumulators), one commit group a
  // stage, each stage handed back once the next one's products are issued;
  // returns with the pass's products complete. hand_over: pass the turn on
  // (warpgroup 1's last turn does not: warpgroup 0 has had its last). The
  // first stage is peeled off the loop rather than branched to: behind a
  // branch ptxas serialises the wgmmas. kKbs > 0: kbs is kKbs and kb reaches
  // products as a std::integral_constant (unrolled), for products that pick
  // an accumulator block by kb.
  template <int kKbs = 0, typename Products>
  __device__ __forceinline__ void pass(int& i, int kbs, int wg, int lane, bool hand_over,
                                       Products&& products) const {
    detail::named_barrier_sync(kTurn + wg, HiddenTile::kConsumers);
    auto step = [&](auto kb, auto first) {
      const int st = i % kStages;
      detail::mbarrier_wait_cta(full + st, (i / kStages) & 1);
      detail::wgmma_fence();
      products(st, kb, first);
      detail::wgmma_commit();
      ++i;
    };
    // The previous stage's products are done once at most the last group is
    // pending: hand that stage back while these run.
    auto next = [&](auto kb) {
      step(kb, std::false_type{});
      detail::wgmma_wait<1>();
      release((i - 2) % kStages, lane);
    };
    step(std::integral_constant<int, 0>{}, std::true_type{});
    if constexpr (kKbs > 0)
      for_each_from_1(next, std::make_integer_sequence<int, kKbs - 1>{});
    else
      for (int kb = 1; kb < kbs; ++kb) next(kb);
    // Issued: the other warpgroup's products may queue behind these.
    if (hand_over) pass_turn(wg);
    detail::wgmma_wait<0>();
    release((i - 1) % kStages, lane);
  }
};

// The tensor maps: x and v as [B * local_len][H * D] boxes of 128 rows x 64;
// the weights twice over the same bytes, as rows of D (W0, W2: boxes of 64
// rows x 64) and as rows of M (W1: 64 of its D rows x 64 columns).
struct HiddenMaps {
  CUtensorMap x, v, w02, w1;
};

// kKbs: D / 64 where the mode needs it at compile time (the apply, whose o
// accumulators are picked by kb), 0 where it is read from p.D. kLo: the key
// side's low terms (z_lo, gate_lo: Muon's two-part update) at compile time,
// so that the epilogue without them is straight-line code: as a run-time
// branch per store it split the epilogue into ~20 blocks (and a divergence
// check before each exchange) that ptxas scheduled one by one.
template <LactHiddenMode kMode, int kKbs, bool kLo = false>
__global__ void __launch_bounds__(HiddenTile::kThreads, 1)
    lact_hidden_kernel(const __grid_constant__ LactHiddenParams p,
                       const __grid_constant__ HiddenMaps maps) {
  using Tile = HiddenTile;
  using detail::wgmma_desc_sw128;
  constexpr bool kKey = kMode == LactHiddenMode::key_side;
  constexpr bool kApply = kMode == LactHiddenMode::apply;
  constexpr bool kTwo = Tile::two_products(kMode);
  constexpr size_t kStageBytes = Tile::kStageBytes;
  constexpr int kStages = Tile::stages(kMode);
  static_assert(kApply == (kKbs > 0), "kKbs is the apply's");
  static_assert(kKey || !kLo, "kLo is the key side's");
  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* base = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  const int D = kApply ? kKbs * Tile::kK : static_cast<int>(p.D), M = static_cast<int>(p.M);
  const int kbs = D / Tile::kK, js = M / Tile::kCols, passes = Tile::passes(kMode, js);
  const int steps = passes * kbs;
  const size_t token_bytes = size_t(kbs) * Tile::kTokenBox;
  unsigned char* xs = base;
  unsigned char* vs = base + token_bytes;  // key side only
  unsigned char* stages = base + Tile::tokens_bytes(kMode, D);
  const StagePipe<kStages> pipe{reinterpret_cast<uint64_t*>(stages + kStages * kStageBytes)};

  const int tid = threadIdx.x;
  const int64_t pair = blockIdx.y, b = pair / p.H, h = pair % p.H;
  const int row0 = blockIdx.x * Tile::kRows;  // first token of the tile in the slice
  if (tid == 0) pipe.init();
  __syncthreads();  // barriers initialised before any copy completes on them

  if (tid >= Tile::kConsumers) {
    // Producer: the tokens once, then the weights' stages in the consumers'
    // order (j outer, kb inner), each stage refilled once both warpgroups'
    // eight warps have handed it back.
    detail::setmaxnreg_dec<Tile::kProducerRegs>();
    if (tid != Tile::kConsumers) return;
    const int token_row = static_cast<int>(b * p.local_len + p.t0 + row0);
    const int token_col = static_cast<int>(h * D);
    uint64_t* tokens_full = pipe.tokens_full();
    detail::mbarrier_arrive_expect_tx(tokens_full,
                                      static_cast<uint32_t>(Tile::tokens_bytes(kMode, D)));
    for (int kb = 0; kb < kbs; ++kb) {
      detail::tensor_copy_to_shared(xs + kb * Tile::kTokenBox, &maps.x, token_col + Tile::kK * kb,
                                    token_row, tokens_full);
      if constexpr (kTwo)
        detail::tensor_copy_to_shared(vs + kb * Tile::kTokenBox, &maps.v, token_col + Tile::kK * kb,
                                      token_row, tokens_full);
    }
    // The weights may be the previous kernel's output (a dependent launch).
    if (p.dependent) detail::grid_dependency_wait();
    const int w_row = static_cast<int>(pair * 3 * M);           // W0's first row (rows of D)
    const int w1_row = static_cast<int>(pair * 3 * D + 2 * D);  // W1's first row (rows of M)
    for (int i = 0; i < steps; ++i) {
      const int j = i / kbs, kb = i % kbs;
      // The apply's W1 block trails by a pass (the o product of pass j - 1
      // runs in pass j) and its last pass carries nothing else.
      const bool w02 = j < js, w1 = !kApply || j > 0;
      const int w1_col = Tile::kCols * (kApply ? j - 1 : j);
      uint64_t* filled =
          pipe.acquire(i, static_cast<uint32_t>(((w02 ? 2 : 0) + (w1 ? 1 : 0)) * Tile::kWeightBox));
      unsigned char* s = stages + (i % kStages) * kStageBytes;
      if (w02) {
        detail::tensor_copy_to_shared(s, &maps.w02, Tile::kK * kb, w_row + Tile::kCols * j, filled);
        detail::tensor_copy_to_shared(s + Tile::kWeightBox, &maps.w02, Tile::kK * kb,
                                      w_row + M + Tile::kCols * j, filled);
      }
      if (w1)
        detail::tensor_copy_to_shared(s + 2 * Tile::kWeightBox, &maps.w1, w1_col,
                                      w1_row + Tile::kK * kb, filled);
    }
    return;
  }

  detail::setmaxnreg_inc<Tile::kConsumerRegs>();
  // Consumers: warpgroup wg owns the tile's token rows 64 wg .. 64 wg + 63;
  // this thread's accumulator rows are r and r + 8, its columns
  // 8 c8 + 2 (lane % 4) (+1) of each pass (the m64nN layout).
  // wg through a shuffle: ptxas then knows it warp-uniform and keeps the
  // descriptors built from it in uniform registers (CUTLASS's canonical
  // warpgroup index); from tid / 128 the apply's unrolled passes held 16
  // token descriptors in ordinary registers and spilled them.
  const int wg = __shfl_sync(0xffffffffu, tid / 128, 0), warp = (tid % 128) / 32, lane = tid % 32;
  const int r = row0 + 64 * wg + 16 * warp + lane / 4;
  float l0[2] = {0.f, 0.f}, l1[2] = {0.f, 0.f}, l2[2] = {0.f, 0.f};
  if constexpr (kKey)
    for (int e = 0; e < 2; ++e)
      if (r + 8 * e < p.n) {
        l0[e] = lr_at(p.lr0, pair, r + 8 * e, p.H, p.local_len, p.t0);
        l1[e] = lr_at(p.lr1, pair, r + 8 * e, p.H, p.local_len, p.t0);
        l2[e] = lr_at(p.lr2, pair, r + 8 * e, p.H, p.local_len, p.t0);
      }

  // hh = [h0 | h2] (m64n128: columns 0-63 h0, 64-127 h2), ev = v W1 (m64n64).
  float hh[64], ev[kTwo ? 32 : 1];
  // A: this warpgroup's 64 rows of a token box, k16 slice kk 32 bytes into
  // the 128-byte rows (8-row atoms 1024 bytes apart; the hardware applies the
  // swizzle). W0 | W2 as one 128-row B, K-major the same way; W1 MN-major
  // (rows = D, a k16 step is 16 of its 128-byte rows).
  // Descriptors from three bases (this warpgroup's rows of x and v, the
  // stages), advanced by byte offsets.
  const uint64_t x_desc = wgmma_desc_sw128(xs + wg * 64 * 128, 1024);
  const uint64_t v_desc = wgmma_desc_sw128(vs + wg * 64 * 128, 1024);
  const uint64_t stage_desc = wgmma_desc_sw128(stages, 1024);
  auto token_desc = [&](uint64_t tokens, int kb, int kk) {
    return detail::wgmma_desc_advance(tokens, kb * uint32_t{Tile::kTokenBox} + 32 * kk);
  };
  // The k16 slice kk of the products of the stage `so` bytes into the
  // stages; kFirst overwrites the accumulators (scale-d 0: the pass's first
  // slice).
  auto slice = [&](uint32_t so, int kb, int kk, auto first) {
    constexpr bool kFirst = decltype(first)::value;
    detail::wgmma_m64n128k16_ss_bf16<kFirst>(hh, token_desc(x_desc, kb, kk),
                                             detail::wgmma_desc_advance(stage_desc, so + 32 * kk));
    if constexpr (kTwo)
      detail::wgmma_m64n64k16_ss<true, true, kFirst>(
          ev, token_desc(v_desc, kb, kk),
          detail::wgmma_desc_advance(stage_desc, so + 2 * Tile::kWeightBox + 2048 * kk));
  };
  // Stage st's products (all of its four k16 slices).
  auto products = [&](int st, int kb, auto first) {
    const uint32_t s = st * uint32_t{kStageBytes};
    slice(s, kb, 0, first);
#pragma unroll
    for (int kk = 1; kk < 4; ++kk) slice(s, kb, kk, std::false_type{});
  };
  pipe.start_turns(wg);

  detail::mbarrier_wait_cta(pipe.tokens_full(), 0);
  if constexpr (kApply) {
    // o = gate W1^T, accumulated over the passes: pass j's gate, rounded to
    // bf16 as the cuBLAS path's gate array is, stays in registers as the A
    // operand (wgmma's RS form: the k16 column slice kk of the m64n64 block
    // is the fragment ga[4 kk ..]) of the o product that pass j + 1 issues
    // beside its own h products, against the stage's W1 block (D rows kb,
    // hidden columns j: K-major). Why: the separate o GEMM took ~14 us a
    // chunk and gate's 17 MB a round trip (PERF_NOTES, thirty-third session).
    float ob[kKbs][32];  // o's 64-column blocks of D
#pragma unroll
    for (int kb = 0; kb < kKbs; ++kb)
#pragma unroll
      for (int a = 0; a < 32; ++a) ob[kb][a] = 0.f;
    uint32_t ga[16];
    auto o_product = [&](uint32_t so, auto kb) {
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        detail::wgmma_m64n64k16_rs<true, false>(
            ob[decltype(kb)::value], ga + 4 * kk,
            detail::wgmma_desc_advance(stage_desc, so + 2 * Tile::kWeightBox + 32 * kk));
    };
    auto h_and_o = [&](int st, auto kb, auto first) {
      products(st, kb, first);
      o_product(st * uint32_t{kStageBytes}, kb);
    };
    auto o_only = [&](int st, auto kb, auto) { o_product(st * uint32_t{kStageBytes}, kb); };
    // gate of the pass just done, from the accumulators into ga (element
    // 4 c8 + 2 e + u of h0, + 32 of h2: row r + 8 e, column 8 c8 + 2 q + u).
    auto gate_fragments = [&] {
#pragma unroll
      for (int c8 = 0; c8 < 8; ++c8)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int a = 4 * c8 + 2 * e;
          const SiluFast s0(hh[a]), s1(hh[a + 1]);
          ga[4 * (c8 / 2) + 2 * (c8 % 2) + e] =
              detail::pack2<bf16>(s0.value * hh[a + 32], s1.value * hh[a + 33]);
        }
    };
    int i = 0;
    pipe.template pass<kKbs>(i, kbs, wg, lane, true, products);
    gate_fragments();
    for (int j = 1; j < js; ++j) {
      pipe.template pass<kKbs>(i, kbs, wg, lane, true, h_and_o);
      gate_fragments();
    }
    pipe.template pass<kKbs>(i, kbs, wg, lane, wg == 0, o_only);

    // o's rows (token-major, as x): block kb's element 4 c8 + 2 e + u is row
    // r + 8 e, column 64 kb + 8 c8 + 2 q + u of this head's D.
    const int q = lane % 4;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int t = r + 8 * e;
      bf16* o_row = p.o + ((b * p.local_len + p.t0 + t) * p.H + h) * D;
#pragma unroll
      for (int kb = 0; kb < kKbs; ++kb) {
        uint32_t w[8];
#pragma unroll
        for (int c8 = 0; c8 < 8; ++c8)
          w[c8] = detail::pack2<bf16>(ob[kb][4 * c8 + 2 * e], ob[kb][4 * c8 + 2 * e + 1]);
        detail::store_quad_row(o_row + Tile::kK * kb, w, q, t < p.n);
      }
    }
  } else {
    for (int j = 0, i = 0; j < js; ++j) {
      pipe.pass(i, kbs, wg, lane, wg == 0 || j + 1 < js, products);

      // The 64 x 64 block of columns 64 j .. from the accumulators: element
      // 4 c8 + 2 e + u of h0 (+ 32: h2; ev) is row r + 8 e, column
      // 8 c8 + 2 q + u of the pass (q = lane % 4). Rows past the slice are computed (the quad
      // shuffles need every lane) but not stored.
      const int q = lane % 4;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int t = r + 8 * e;
        const bool valid = t < p.n;
        const int64_t row = pair * p.n + t, col = int64_t{Tile::kCols} * j;
        if constexpr (kMode == LactHiddenMode::apply_backward) {
          // apply_backward_kernel's formulas, dgate = d_o W1.
          uint32_t gw[8], d0[8], d2[8];
#pragma unroll
          for (int c8 = 0; c8 < 8; ++c8) {
            float g2[2], a0[2], a2[2];
#pragma unroll
            for (int u = 0; u < 2; ++u) {
              const int a = 4 * c8 + 2 * e + u;
              const SiluFast s(hh[a]);
              const float hv = hh[a + 32], dg = ev[a];
              g2[u] = s.value * hv;
              a0[u] = dg * hv * s.d1;
              a2[u] = dg * s.value;
            }
            gw[c8] = detail::pack2<bf16>(g2[0], g2[1]);
            d0[c8] = detail::pack2<bf16>(a0[0], a0[1]);
            d2[c8] = detail::pack2<bf16>(a2[0], a2[1]);
          }
          detail::store_quad_row(p.gate + row * M + col, gw, q, valid);
          detail::store_quad_row(p.dh + row * 2 * M + col, d0, q, valid);
          detail::store_quad_row(p.dh + row * 2 * M + M + col, d2, q, valid);
        } else {
          // key_side_kernel's formulas, e = -v W1.
          float z0[16], z2[16], gt[16];
#pragma unroll
          for (int c8 = 0; c8 < 8; ++c8)
#pragma unroll
            for (int u = 0; u < 2; ++u) {
              const int a = 4 * c8 + 2 * e + u;
              const SiluFast s(hh[a]);
              const float evu = -ev[a], hv = hh[a + 32];
              z0[2 * c8 + u] = l0[e] * evu * hv * s.d1;
              z2[2 * c8 + u] = l2[e] * evu * s.value;
              gt[2 * c8 + u] = l1[e] * s.value * hv;
            }
          auto store = [&](const float* x, bf16* hi_row, bf16* lo_row) {
            uint32_t hi[8], lo[8];
#pragma unroll
            for (int c8 = 0; c8 < 8; ++c8) {
              if constexpr (kLo)
                detail::split_bf16x2(x[2 * c8], x[2 * c8 + 1], hi[c8], lo[c8]);
              else
                hi[c8] = detail::pack2<bf16>(x[2 * c8], x[2 * c8 + 1]);
            }
            detail::store_quad_row(hi_row, hi, q, valid);
            if constexpr (kLo) detail::store_quad_row(lo_row, lo, q, valid);
          };
          store(z0, p.z + row * 2 * M + col, kLo ? p.z_lo + row * 2 * M + col : nullptr);
          store(z2, p.z + row * 2 * M + M + col, kLo ? p.z_lo + row * 2 * M + M + col : nullptr);
          store(gt, p.gate + row * M + col, kLo ? p.gate_lo + row * M + col : nullptr);
        }
      }
    }
  }
}

// ---- the backward's update-gradient rows ----------------------------------------

// lact_hidden_grad_kernel: one CTA per 128 tokens of a pair, as
// lact_hidden_kernel's key side (k and v resident, weights streamed, two
// consumer warpgroups in turns, a producer warpgroup), but four products a pass:
// [h0 | h2 | u0 | u2] = k [W0; W2; dG0; dG2]_j^T (m64n128) and
// [v W1 | u1] = v [W1^T; dG1^T]_j^T (m64n64) over 32 hidden columns j, 96
// accumulator registers (64 columns would need 192). W1 and dG1 come
// transposed (lact_hidden_pack_operands) so that every B operand is K-major in
// the 128-byte swizzle: a stage is six 32-row boxes, 24 KB.
struct GradTile {
  static constexpr int kRows = HiddenTile::kRows, kK = HiddenTile::kK;
  static constexpr int kCols = 32;
  static constexpr int kStages = 4;
  static constexpr int kConsumers = HiddenTile::kConsumers, kThreads = HiddenTile::kThreads;
  static constexpr size_t kTokenBox = HiddenTile::kTokenBox;
  static constexpr size_t kBox = size_t{kCols} * kK * 2;  // 4 KB
  static constexpr size_t kStageBytes = 6 * kBox;
  static constexpr size_t tokens_bytes(int D) { return 2 * (D / kK) * kTokenBox; }
  static constexpr size_t smem_bytes(int D) {
    return tokens_bytes(D) + kStages * kStageBytes + 8 * (2 * kStages + 1) + 1024;
  }
};
static_assert(GradTile::smem_bytes(HiddenTile::kMaxD) <= 227 * 1024 &&
                  GradTile::kStages >= HiddenTile::kMaxD / GradTile::kK,
              "lact_hidden_grad_kernel: shared memory, or fewer stages than a pass of D");

// k, v boxes of 128 rows x 64; W0, W2 (and dG0, dG2) as rows of D in boxes of
// 32 rows x 64; W1^T and dG1^T ([pairs * M][D]) the same.
struct GradMaps {
  CUtensorMap k, v, w, dg, w1t, dg1t;
};

// kWide: the rows in 16-byte pieces (detail::store_quad_row16), else 8
// (detail::store_quad_row), each 8-byte piece stored as the compiler makes it
// (store_quad_row<4, false>: half of them as two 4-byte stores). Why not store_vector as the key
// side: in the layer (H100, fifty-first session, three rounds alternating) vector pieces here cost
// ~0.5 ms a forward + backward (99.00 against 98.51 ms), the kernel alone 89.4 against 87.2 us at D
// 256. Why not TMA stores (fifty-fourth session, 3e50b6b: rows staged by stmatrix, one thread a
// warpgroup storing the boxes, v's operand in registers to free the staging): bit-identical but
// slower, 90.7-93.8 against 85.7-86.1 us at D 256 and 100.3 against 99.5 ms in the layer (H100);
// the same stores into an L2-resident window take 68-70 us and none at all 56-58, so most of
// their cost is the writes' trip to DRAM, not the store instructions (PERF_NOTES). Nor is it the
// rows' power-of-two pitch (fifty-fifth session): padded pitches were no faster alone and slower in
// the layer; a pitch off 32-byte sectors (16 or 48 bytes of padding) doubled the kernel, so row
// pitches must keep the pieces' sectors whole (the layer's, 2M and 4M bf16, always do).
template <bool kWide>
__global__ void __launch_bounds__(GradTile::kThreads, 1)
    lact_hidden_grad_kernel(const __grid_constant__ LactHiddenGradParams p,
                            const __grid_constant__ GradMaps maps) {
  using Tile = GradTile;
  using detail::wgmma_desc_sw128;
  constexpr int kStages = Tile::kStages;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* base = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  const int D = static_cast<int>(p.D), M = static_cast<int>(p.M);
  const int kbs = D / Tile::kK, js = M / Tile::kCols, steps = js * kbs;
  unsigned char* ks = base;
  unsigned char* vs = base + size_t(kbs) * Tile::kTokenBox;
  unsigned char* stages = base + Tile::tokens_bytes(D);
  const StagePipe<kStages> pipe{reinterpret_cast<uint64_t*>(stages + kStages * Tile::kStageBytes)};

  const int tid = threadIdx.x;
  const int64_t pair = blockIdx.y, b = pair / p.H, h = pair % p.H;
  const int row0 = blockIdx.x * Tile::kRows;
  if (tid == 0) pipe.init();
  __syncthreads();

  if (tid >= Tile::kConsumers) {
    detail::setmaxnreg_dec<HiddenTile::kProducerRegs>();
    if (tid != Tile::kConsumers) return;
    const int token_row = static_cast<int>(b * p.local_len + p.t0 + row0);
    const int token_col = static_cast<int>(h * D);
    uint64_t* tokens_full = pipe.tokens_full();
    detail::mbarrier_arrive_expect_tx(tokens_full, static_cast<uint32_t>(Tile::tokens_bytes(D)));
    for (int kb = 0; kb < kbs; ++kb) {
      detail::tensor_copy_to_shared(ks + kb * Tile::kTokenBox, &maps.k, token_col + Tile::kK * kb,
                                    token_row, tokens_full);
      detail::tensor_copy_to_shared(vs + kb * Tile::kTokenBox, &maps.v, token_col + Tile::kK * kb,
                                    token_row, tokens_full);
    }
    if (p.dependent) detail::grid_dependency_wait();       // the weights: the previous kernel's
    const int w_row = static_cast<int>(pair * p.w_pitch);  // W0's (dG0's) first row, rows of D
    const int t_row = static_cast<int>(pair * p.t_pitch);  // W1^T's (dG1^T's) first row
    for (int i = 0; i < steps; ++i) {
      const int j = i / kbs, kb = i % kbs;
      uint64_t* filled = pipe.acquire(i, static_cast<uint32_t>(Tile::kStageBytes));
      unsigned char* s = stages + (i % kStages) * Tile::kStageBytes;
      const int c = Tile::kK * kb, r = Tile::kCols * j;
      detail::tensor_copy_to_shared(s, &maps.w, c, w_row + r, filled);
      detail::tensor_copy_to_shared(s + Tile::kBox, &maps.w, c, w_row + M + r, filled);
      detail::tensor_copy_to_shared(s + 2 * Tile::kBox, &maps.dg, c, w_row + r, filled);
      detail::tensor_copy_to_shared(s + 3 * Tile::kBox, &maps.dg, c, w_row + M + r, filled);
      detail::tensor_copy_to_shared(s + 4 * Tile::kBox, &maps.w1t, c, t_row + r, filled);
      detail::tensor_copy_to_shared(s + 5 * Tile::kBox, &maps.dg1t, c, t_row + r, filled);
    }
    return;
  }

  detail::setmaxnreg_inc<HiddenTile::kConsumerRegs>();
  // wg by shuffle, as lact_hidden_kernel's (uniform descriptors).
  const int wg = __shfl_sync(0xffffffffu, tid / 128, 0), warp = (tid % 128) / 32, lane = tid % 32,
            q = lane % 4;
  const int r = row0 + 64 * wg + 16 * warp + lane / 4;
  float l0[2] = {0.f, 0.f}, l1[2] = {0.f, 0.f}, l2[2] = {0.f, 0.f};
  for (int e = 0; e < 2; ++e)
    if (r + 8 * e < p.n) {
      l0[e] = lr_at(p.lr0, pair, r + 8 * e, p.H, p.local_len, p.t0);
      l1[e] = lr_at(p.lr1, pair, r + 8 * e, p.H, p.local_len, p.t0);
      l2[e] = lr_at(p.lr2, pair, r + 8 * e, p.H, p.local_len, p.t0);
    }
  // dlr sums of rows r and r + 8, this lane's columns; the quad adds them up
  // at the end.
  float s0[2] = {0.f, 0.f}, s1[2] = {0.f, 0.f}, s2[2] = {0.f, 0.f};

  // ak = [h0 | h2 | u0 | u2] (8 columns each per c8 block of 4), av = [v W1 | u1].
  float ak[64], av[32];
  const uint64_t k_desc = wgmma_desc_sw128(ks + wg * 64 * 128, 1024);
  const uint64_t v_desc = wgmma_desc_sw128(vs + wg * 64 * 128, 1024);
  const uint64_t stage_desc = wgmma_desc_sw128(stages, 1024);
  auto token_desc = [&](uint64_t tokens, int kb, int kk) {
    return detail::wgmma_desc_advance(tokens, kb * uint32_t{Tile::kTokenBox} + 32 * kk);
  };
  auto slice = [&](uint32_t so, int kb, int kk, auto first) {
    constexpr bool kFirst = decltype(first)::value;
    detail::wgmma_m64n128k16_ss_bf16<kFirst>(ak, token_desc(k_desc, kb, kk),
                                             detail::wgmma_desc_advance(stage_desc, so + 32 * kk));
    detail::wgmma_m64n64k16_ss<true, false, kFirst>(
        av, token_desc(v_desc, kb, kk),
        detail::wgmma_desc_advance(stage_desc, so + 4 * Tile::kBox + 32 * kk));
  };
  auto products = [&](int st, int kb, auto first) {
    const uint32_t s = st * uint32_t{Tile::kStageBytes};
    slice(s, kb, 0, first);
#pragma unroll
    for (int kk = 1; kk < 4; ++kk) slice(s, kb, kk, std::false_type{});
  };
  pipe.start_turns(wg);

  detail::mbarrier_wait_cta(pipe.tokens_full(), 0);
  auto store_row = [q](bf16* row, uint32_t(&w)[4], bool valid) {
    if constexpr (kWide)
      detail::store_quad_row16(row, w, q, valid);
    else
      detail::store_quad_row<4, false>(row, w, q, valid);
  };
  for (int j = 0, i = 0; j < js; ++j) {
    pipe.pass(i, kbs, wg, lane, wg == 0 || j + 1 < js, products);

    // Element a = 4 c8 + 2 e + u (c8 = 0..3) of each 32-column block is row
    // r + 8 e, column 32 j + 8 c8 + 2 q + u: h0 ak[a], h2 ak[a + 16],
    // u0 ak[a + 32], u2 ak[a + 48], v W1 av[a], u1 av[a + 16].
    // gradients_backward_rows_kernel's formulas.
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int t = r + 8 * e;
      const bool valid = t < p.n;
      const int64_t row = pair * p.n + t, col = int64_t{Tile::kCols} * j;
      uint32_t wz0[4], wz2[4], wg1[4], wde[4], wd0[4], wd2[4];
#pragma unroll
      for (int c8 = 0; c8 < 4; ++c8) {
        float z0o[2], z2o[2], go[2], deo[2], dh0o[2], dh2o[2];
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const int a = 4 * c8 + 2 * e + u;
          const GradRowsOut g =
              grad_rows_element(SiluFast(ak[a]), ak[a + 16], -av[a], ak[a + 32], ak[a + 48],
                                av[a + 16], l0[e], l1[e], l2[e], s0[e], s1[e], s2[e]);
          z0o[u] = g.z0;
          z2o[u] = g.z2;
          go[u] = g.gate;
          deo[u] = g.de;
          dh0o[u] = g.dh0;
          dh2o[u] = g.dh2;
        }
        wz0[c8] = detail::pack2<bf16>(z0o[0], z0o[1]);
        wz2[c8] = detail::pack2<bf16>(z2o[0], z2o[1]);
        wg1[c8] = detail::pack2<bf16>(go[0], go[1]);
        wde[c8] = detail::pack2<bf16>(deo[0], deo[1]);
        wd0[c8] = detail::pack2<bf16>(dh0o[0], dh0o[1]);
        wd2[c8] = detail::pack2<bf16>(dh2o[0], dh2o[1]);
      }
      store_row(p.z + row * p.z_ld + col, wz0, valid);
      store_row(p.z + row * p.z_ld + M + col, wz2, valid);
      store_row(p.gate + row * p.gate_ld + col, wg1, valid);
      store_row(p.de + row * p.de_ld + col, wde, valid);
      store_row(p.dh + row * p.dh_ld + col, wd0, valid);
      store_row(p.dh + row * p.dh_ld + M + col, wd2, valid);
    }
  }
  // The rows' sums over all M columns: this lane's, then the quad's.
#pragma unroll
  for (int e = 0; e < 2; ++e) {
#pragma unroll
    for (int o = 1; o <= 2; o <<= 1) {
      s0[e] += __shfl_xor_sync(0xffffffffu, s0[e], o);
      s1[e] += __shfl_xor_sync(0xffffffffu, s1[e], o);
      s2[e] += __shfl_xor_sync(0xffffffffu, s2[e], o);
    }
    const int t = r + 8 * e;
    if (q == 0 && t < p.n) {
      const int64_t idx = (b * p.local_len + p.t0 + t) * p.H + h;
      p.dlr0[idx] = __float2bfloat16_rn(s0[e]);
      p.dlr1[idx] = __float2bfloat16_rn(s1[e]);
      p.dlr2[idx] = __float2bfloat16_rn(s2[e]);
    }
  }
}

// lact_hidden_pack_operands' kernel; blockIdx.y is the pair. Blocks below
// 2 copy_blocks write kw: kPackPer elements a thread of [dG0; dG2] (rounded
// to bf16) or of [W0; W2]; the rest transpose 32 x 32 tiles of dG1 or W1
// (D x M) into t1 through shared memory.
constexpr int kPackThreads = 256, kPackPer = 8;
__global__ void __launch_bounds__(kPackThreads)
    pack_operands_kernel(const float* __restrict__ dg, const bf16* __restrict__ w, int64_t M,
                         int64_t D, int64_t copy_blocks, bf16* __restrict__ kw,
                         bf16* __restrict__ t1) {
  __shared__ float tile[32][33];
  const int64_t md = M * D, pair = blockIdx.y, block = pair * 3 * md;
  int64_t blk = blockIdx.x;
  if (blk < 2 * copy_blocks) {
    const bool from_w = blk >= copy_blocks;
    const int64_t e = ((from_w ? blk - copy_blocks : blk) * kPackThreads + threadIdx.x) * kPackPer;
    if (e >= 2 * md) return;
    uint4* out = reinterpret_cast<uint4*>(kw + pair * 4 * md + (from_w ? 2 * md : 0) + e);
    if (from_w) {
      *out = *reinterpret_cast<const uint4*>(w + block + e);
    } else {
      const float4* in = reinterpret_cast<const float4*>(dg + block + e);
      const float4 x = in[0], y = in[1];
      const __nv_bfloat162 o[4] = {__floats2bfloat162_rn(x.x, x.y), __floats2bfloat162_rn(x.z, x.w),
                                   __floats2bfloat162_rn(y.x, y.y),
                                   __floats2bfloat162_rn(y.z, y.w)};
      *out = *reinterpret_cast<const uint4*>(o);
    }
    return;
  }
  blk -= 2 * copy_blocks;
  const int64_t tm = (M + 31) / 32, tiles = tm * ((D + 31) / 32);
  const bool from_w = blk >= tiles;
  if (from_w) blk -= tiles;
  const int64_t m0 = (blk % tm) * 32, d0 = (blk / tm) * 32, src = block + 2 * md;
  const int tx = threadIdx.x % 32, ty = threadIdx.x / 32;
  for (int y = ty; y < 32; y += kPackThreads / 32) {
    const int64_t d = d0 + y, m = m0 + tx;
    if (d < D && m < M)
      tile[y][tx] = from_w ? __bfloat162float(w[src + d * M + m]) : dg[src + d * M + m];
  }
  __syncthreads();
  bf16* o = t1 + pair * 2 * md + (from_w ? md : 0);  // M x D
  for (int y = ty; y < 32; y += kPackThreads / 32) {
    const int64_t m = m0 + y, d = d0 + tx;
    if (m < M && d < D) o[m * D + d] = __float2bfloat16_rn(tile[tx][y]);
  }
}

// The kernel for the mode (and for the apply, D: a multiple of 64 up to
// 256, as lact_hidden_supported checked).
template <typename F>
void with_hidden_kernel(LactHiddenMode mode, int64_t D, bool lo, F&& f) {
  static_assert(HiddenTile::kMaxD == 4 * HiddenTile::kK, "the apply's instances below");
  if (mode == LactHiddenMode::key_side && lo)
    f(lact_hidden_kernel<LactHiddenMode::key_side, 0, true>);
  else if (mode == LactHiddenMode::key_side)
    f(lact_hidden_kernel<LactHiddenMode::key_side, 0>);
  else if (mode == LactHiddenMode::apply_backward)
    f(lact_hidden_kernel<LactHiddenMode::apply_backward, 0>);
  else if (D == HiddenTile::kK)
    f(lact_hidden_kernel<LactHiddenMode::apply, 1>);
  else if (D == 2 * HiddenTile::kK)
    f(lact_hidden_kernel<LactHiddenMode::apply, 2>);
  else if (D == 3 * HiddenTile::kK)
    f(lact_hidden_kernel<LactHiddenMode::apply, 3>);
  else
    f(lact_hidden_kernel<LactHiddenMode::apply, 4>);
}

// The uncached check of lact_hidden_supported on `device`.
bool hidden_fits(int device, int64_t D, int64_t M) {
  if (D <= 0 || D % HiddenTile::kK != 0 || D > HiddenTile::kMaxD || M <= 0 ||
      M % HiddenTile::kCols != 0 || !detail::wgmma_device(device))
    return false;
  int smem_optin = 0;
  SS_CUDA_CHECK(
      cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  return HiddenTile::smem_bytes(LactHiddenMode::key_side, static_cast<int>(D)) <=
         static_cast<size_t>(smem_optin);
}

}  // namespace

void lact_hidden_pack_operands(const float* dg, const __nv_bfloat16* w, int64_t pairs, int64_t M,
                               int64_t D, __nv_bfloat16* kw, __nv_bfloat16* t1,
                               cudaStream_t stream) {
  SS_CHECK_ARG(pairs >= 0 && pairs <= 65535, "heads",
               "lact_hidden_pack_operands takes at most 65535 pairs, not ", pairs);
  SS_CHECK_ARG(M > 0 && D > 0 && (M * D) % kPackPer == 0, "dim",
               "lact_hidden_pack_operands: M D = ", M * D, " is not a positive multiple of ",
               kPackPer);
  SS_CHECK_ARG(lact_hidden_aligned(dg, w, kw) && lact_hidden_aligned(t1, t1, t1), "w",
               "lact_hidden_pack_operands needs 16-byte aligned arrays");
  if (pairs == 0) return;
  const int64_t copy_blocks = (2 * M * D + kPackThreads * kPackPer - 1) / (kPackThreads * kPackPer);
  const int64_t blocks = 2 * copy_blocks + 2 * ((M + 31) / 32) * ((D + 31) / 32);
  SS_CHECK_ARG(blocks < (int64_t{1} << 31), "dim", "lact_hidden_pack_operands: M = ", M,
               ", D = ", D, " need more blocks than a grid holds");
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(pairs));
  pack_operands_kernel<<<grid, kPackThreads, 0, stream>>>(dg, w, M, D, copy_blocks, kw, t1);
  SS_LAUNCH_CHECK("pack_operands_kernel");
}

void lact_hidden_grad_launch(const LactHiddenGradParams& given, cudaStream_t stream) {
  using Tile = GradTile;
  LactHiddenGradParams p = given;
  // Pitches: 0 is the width; else at least the width, in whole 16 bytes.
  auto pitch = [](int64_t& ld, int64_t width, const char* name) {
    if (ld == 0) ld = width;
    SS_CHECK_ARG(ld >= width && ld % 8 == 0, name, "lact_hidden_grad_kernel: row pitch ", ld,
                 " of ", name, " is under its width ", width, " or not a multiple of 8");
  };
  pitch(p.z_ld, 2 * p.M, "z");
  pitch(p.gate_ld, p.M, "gate");
  pitch(p.de_ld, p.M, "de");
  pitch(p.dh_ld, 2 * p.M, "dh");
  if (p.t_pitch == 0) p.t_pitch = p.M;
  SS_CHECK_ARG(p.t_pitch >= p.M, "w1t", "lact_hidden_grad_kernel: W1^T's pairs ", p.t_pitch,
               " rows apart overlap (M = ", p.M, ")");
  if (p.w_pitch == 0) p.w_pitch = 3 * p.M;
  SS_CHECK_ARG(p.w_pitch >= 2 * p.M, "w", "lact_hidden_grad_kernel: W0's pairs ", p.w_pitch,
               " rows apart overlap (W0 and W2: 2M = ", 2 * p.M, " rows)");
  SS_CHECK_ARG(lact_hidden_supported(p.D, p.M), "dim",
               "lact_hidden_grad_kernel cannot run D = ", p.D, ", M = ", p.M, " on this device");
  SS_CHECK_ARG(lact_hidden_aligned(p.k, p.v, p.w) && lact_hidden_aligned(p.dg, p.w1t, p.dg1t), "k",
               "lact_hidden_grad_kernel needs 16-byte aligned token and weight arrays");
  SS_CHECK_ARG(lact_hidden_aligned(p.z, p.gate, p.de) && lact_hidden_aligned(p.dh, p.dh, p.dh), "z",
               "lact_hidden_grad_kernel needs 16-byte aligned outputs");
  const int64_t token_rows = p.B * p.local_len, pairs = p.B * p.H;
  SS_CHECK_ARG(lact_hidden_addressable(pairs, token_rows, p.D, p.M), "seq_len",
               "lact_hidden_grad_kernel cannot address ", pairs, " (batch, head) pairs of ",
               token_rows, " token rows (at most 65535 pairs, 32-bit tensor coordinates)");
  if (p.n <= 0) return;
  GradMaps maps{};
  const auto swz = CU_TENSOR_MAP_SWIZZLE_128B;
  maps.k = detail::tile_map_2d(p.k, token_rows, p.H * p.D, Tile::kK, Tile::kRows, swz, "k");
  maps.v = detail::tile_map_2d(p.v, token_rows, p.H * p.D, Tile::kK, Tile::kRows, swz, "v");
  // Rows up to the last pair's last one (pairs w_pitch, t_pitch apart).
  const int64_t w_rows = (pairs - 1) * p.w_pitch + 2 * p.M;
  SS_CHECK_ARG(w_rows < (int64_t{1} << 31), "w", "lact_hidden_grad_kernel: ", w_rows,
               " rows of W0 and W2 are past 32-bit tensor coordinates");
  maps.w = detail::tile_map_2d(p.w, w_rows, p.D, Tile::kK, Tile::kCols, swz, "w0");
  maps.dg = detail::tile_map_2d(p.dg, w_rows, p.D, Tile::kK, Tile::kCols, swz, "w0");
  const int64_t t_rows = (pairs - 1) * p.t_pitch + p.M;
  SS_CHECK_ARG(t_rows < (int64_t{1} << 31), "w1t", "lact_hidden_grad_kernel: ", t_rows,
               " rows of W1^T are past 32-bit tensor coordinates");
  maps.w1t = detail::tile_map_2d(p.w1t, t_rows, p.D, Tile::kK, Tile::kCols, swz, "w1");
  maps.dg1t = detail::tile_map_2d(p.dg1t, t_rows, p.D, Tile::kK, Tile::kCols, swz, "w1");
  const dim3 grid(static_cast<unsigned>((p.n + Tile::kRows - 1) / Tile::kRows),
                  static_cast<unsigned>(pairs));
  const size_t smem = Tile::smem_bytes(static_cast<int>(p.D));
  // STATESCAN_LACT_ROW_STORE: the rows in 16-byte pieces up to D 128 and 8
  // above (auto, the default; quad_store.cuh's store_quad_row16 has the
  // kernel's figures), or always 8 or 16. In the layer (H100, `--muon-steps
  // 0`, two rounds alternating), 16 at D 128: 75.31 -> 74.58 ms forward +
  // backward.
  static const int width = env_choice("STATESCAN_LACT_ROW_STORE", {"auto", "8", "16"});
  const bool wide = width == 2 || (width <= 0 && p.D <= 128);
  detail::launch_kernel_maybe_dependent(
      p.dependent, wide ? lact_hidden_grad_kernel<true> : lact_hidden_grad_kernel<false>, grid,
      Tile::kThreads, smem, stream, "lact_hidden_grad_kernel", p, maps);
}

bool lact_hidden_supported(int64_t D, int64_t M) {
  return detail::cached_device_check<HiddenTile>(D, M, hidden_fits);
}

bool lact_hidden_aligned(const void* q, const void* k, const void* v) {
  return detail::aligned16(q) && detail::aligned16(k) && detail::aligned16(v);
}

bool lact_hidden_addressable(int64_t pairs, int64_t token_rows, int64_t D, int64_t M) {
  constexpr int64_t kCoord = int64_t{1} << 31;
  return pairs <= 65535 && token_rows < kCoord && pairs * 3 * std::max(M, D) < kCoord;
}

void lact_hidden_launch(const LactHiddenParams& p, cudaStream_t stream) {
  using Tile = HiddenTile;
  const bool key = p.mode == LactHiddenMode::key_side, two = HiddenTile::two_products(p.mode);
  const char* x_name = key ? "k" : "q";
  const char* v_name = key ? "v" : "d_o";
  if (p.mode == LactHiddenMode::apply)
    SS_CHECK_ARG(p.o != nullptr && detail::aligned16(p.o), "o",
                 "lact_hidden_kernel's apply needs a 16-byte aligned output o");
  if (key)
    SS_CHECK_ARG((p.z_lo == nullptr) == (p.gate_lo == nullptr), "gate_lo",
                 "lact_hidden_kernel's key side writes both low terms or neither (z_lo ",
                 p.z_lo == nullptr ? "null" : "given", ", gate_lo ",
                 p.gate_lo == nullptr ? "null" : "given", ")");
  SS_CHECK_ARG(lact_hidden_supported(p.D, p.M), "dim", "lact_hidden_kernel cannot run D = ", p.D,
               ", M = ", p.M, " on this device");
  SS_CHECK_ARG(lact_hidden_aligned(p.x, two ? p.v : p.x, p.w), two ? v_name : x_name,
               "lact_hidden_kernel needs 16-byte aligned token and weight arrays");
  const int64_t token_rows = p.B * p.local_len, pairs = p.B * p.H;
  SS_CHECK_ARG(lact_hidden_addressable(pairs, token_rows, p.D, p.M), "seq_len",
               "lact_hidden_kernel cannot address ", pairs, " (batch, head) pairs of ", token_rows,
               " token rows (at most 65535 pairs, 32-bit tensor coordinates)");
  if (p.n <= 0) return;
  HiddenMaps maps{};
  const auto swz = CU_TENSOR_MAP_SWIZZLE_128B;
  maps.x = detail::tile_map_2d(p.x, token_rows, p.H * p.D, Tile::kK, Tile::kRows, swz, x_name);
  maps.v = two ? detail::tile_map_2d(p.v, token_rows, p.H * p.D, Tile::kK, Tile::kRows, swz, v_name)
               : maps.x;
  maps.w02 = detail::tile_map_2d(p.w, pairs * 3 * p.M, p.D, Tile::kK, Tile::kCols, swz, "w0");
  maps.w1 = detail::tile_map_2d(p.w, pairs * 3 * p.D, p.M, Tile::kCols, Tile::kK, swz, "w1");
  const int64_t tiles = (p.n + Tile::kRows - 1) / Tile::kRows;
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(pairs));
  const size_t smem = Tile::smem_bytes(p.mode, static_cast<int>(p.D));
  with_hidden_kernel(p.mode, p.D, key && p.z_lo != nullptr, [&](auto kernel) {
    detail::launch_kernel_maybe_dependent(p.dependent, kernel, grid, Tile::kThreads, smem, stream,
                                          "lact_hidden_kernel", p, maps);
  });
}

}  // namespace statescan::cuda::lact_detail
