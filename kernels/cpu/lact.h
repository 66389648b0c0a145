// LaCT (large-chunk test-time training, DESIGN §6) on the CPU: the fp64
// reference (T = double) and the fp32 CPU path (T = float), one template.
//
// Semantics, per batch row b and fast-weight head h (column vectors):
//   f_W(x) = W1 (silu(W0 x) ⊙ (W2 x)),  W0, W2: M x D,  W1: D x M.
//   Chunk c = tokens [cC, min((c+1)C, T)); all its tokens see the same W_c.
//   Per-token loss L_t = -<f_{W_c}(k_t), v_t>;
//     G_i = sum_{t in c} lr_{i,t} dL_t/dW_i                        (i = 0, 1, 2)
//   Momentum mu (optional):  P_i <- mu P_i + G_i  (P_i = 0 before chunk 0),
//     else P_i = G_i.
//   Muon (optional, s steps): D_i = NS_s(P_i): X = P / (||P||_F + 1e-7),
//     transposed when rows > cols (the Gram matrix is the smaller side);
//     s times A = X X^T, B = b A + c A A, X = a X + B X with
//     (a, b, c) = (3.4445, -4.7750, 2.0315); transposed back. Else D_i = P_i.
//   W_i <- W_i - D_i; then (renorm) each row of W_i is rescaled to the L2 norm
//     that row had in the initial weights: row / (||row|| + 1e-7) * norm0.
//   apply_then_update: o_t = f_{W_c}(q_t), then W_c -> W_{c+1} (causal).
//   update_then_apply: W_c -> W_{c+1} first, then o_t = f_{W_{c+1}}(q_t).
// The initial weights [H, ...] are shared by all batch rows; every row evolves
// its own copy. Backward returns the gradients of sum <o, d_o> with respect to
// q, k, v, lr0..2 and the initial weights (summed over batch rows; they also
// receive gradient through the renorm target norms).
//
// Memory: forward keeps, per chunk and (b, h), the weights W_c at the chunk
// start and the update matrix P of that chunk (after momentum, before Muon);
// backward recomputes everything inside a chunk from those two. The saved P
// means backward never repeats the forward's all-reduce of G.
//
// Precision: T throughout, except Muon's Newton-Schulz (forward and
// backward), which runs in fp64 for every T: its polynomial amplifies
// rounding by up to a^5 ~ 490 on small singular values, which in fp32 alone
// used up DESIGN §7's 1e-5 budget. With it the fp32 path stays within ~4e-6
// of the fp64 reference on the test shapes (~1.5e-6 at D = 64, M = 128).
//
// Sharding (DESIGN §6): every chunk is split evenly across the P ranks of a
// group; rank r holds slice r of every chunk. Local tensors [B, T/P, H, *]
// hold, in order, slice r of chunk 0, slice r of chunk 1, ... (see
// lact_token_range / lact_shard). Each rank computes its partial G; the
// all-reduce callback sums it over the group; every rank then applies the
// identical update. Backward carries rank-partial adjoints of (W, P) through
// the (linear) backward of the update, all-reduces the partial gradient of G
// once per chunk (the mirror of the forward's all-reduce) and the initial
// weights' gradient once at the end. Unsharded: ranks = 1 and an empty
// callback (identity).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string_view>
#include <vector>

namespace statescan {

enum class LactSchedule { apply_then_update, update_then_apply };
const char* to_string(LactSchedule s);
// "apply_then_update" | "update_then_apply"; throws naming `argument`.
LactSchedule parse_lact_schedule(std::string_view name, const char* argument = "schedule");

// Newton–Schulz coefficients (a, b, c) of the Muon orthogonalisation.
constexpr double kMuonA = 3.4445, kMuonB = -4.7750, kMuonC = 2.0315;
constexpr int kDefaultMuonSteps = 5;
// Guards the Frobenius normalisation of Muon and the row renormalisation.
constexpr double kLactEps = 1e-7;

// The options of one LaCT layer (what statescan-run's --lact-* flags set).
struct LactConfig {
  int64_t chunk = 2048;  // C, tokens per fast-weight update (>= 1)
  LactSchedule schedule = LactSchedule::apply_then_update;
  double momentum = 0.0;               // mu in [0, 1); 0 = no momentum
  int muon_steps = kDefaultMuonSteps;  // Newton–Schulz steps; 0 = no Muon
  bool renorm = true;                  // rescale rows to their initial norms
};

// Throws naming "chunk", "momentum" or "muon_steps" when out of range.
void check_lact_config(const LactConfig& config);

// Muon's orthogonalisation NS_steps(P) of one rows x cols matrix in fp64, as
// the layer runs it (Frobenius normalisation, then the steps on the side
// whose Gram matrix is smaller), and its vector-Jacobian product
// dP = (dNS/dP)^T d_out. The GPU tests' oracle for the Newton-Schulz kernels.
void lact_newton_schulz(const double* P, int64_t rows, int64_t cols, int steps, double* out);
void lact_newton_schulz_backward(const double* P, int64_t rows, int64_t cols, int steps,
                                 const double* d_out, double* dP);

// Sizes, sharding and pointers of one call. Every array is contiguous.
template <typename T>
struct LactParams {
  LactConfig config;
  int64_t batch = 0;    // B
  int64_t seq_len = 0;  // global T (the sum over ranks)
  int64_t heads = 0;    // H fast-weight heads
  int64_t dim = 0;      // D, width of q, k, v, o
  int64_t hidden = 0;   // M, hidden width of the SwiGLU fast weight
  int64_t ranks = 1;    // P, ranks sharing every chunk
  int64_t rank = 0;     // r, this rank's slice of every chunk

  const T* q = nullptr;    // [B, T/P, H, D] local
  const T* k = nullptr;    // [B, T/P, H, D]
  const T* v = nullptr;    // [B, T/P, H, D]
  const T* lr0 = nullptr;  // [B, T/P, H], > 0
  const T* lr1 = nullptr;  // [B, T/P, H]
  const T* lr2 = nullptr;  // [B, T/P, H]
  const T* w0 = nullptr;   // [H, M, D] initial, same on every rank
  const T* w1 = nullptr;   // [H, D, M]
  const T* w2 = nullptr;   // [H, M, D]
  T* o = nullptr;          // [B, T/P, H, D] output

  int64_t local_len() const { return ranks > 0 ? seq_len / ranks : 0; }
};

template <typename T>
struct LactGradParams {
  const T* d_o = nullptr;  // [B, T/P, H, D]
  // Outputs, local: like q, k, v, lr0..2.
  T *dq = nullptr, *dk = nullptr, *dv = nullptr;
  T *dlr0 = nullptr, *dlr1 = nullptr, *dlr2 = nullptr;
  // Outputs, like w0..2: summed over batch rows and ranks (same on every rank).
  T *dw0 = nullptr, *dw1 = nullptr, *dw2 = nullptr;
};

// What forward saves for backward, per chunk c and (b, h), each a block of
// 3 M D values laid out [W0 | W1 | W2]: the weights at the chunk start and the
// chunk's update matrices P (after momentum, before Muon).
template <typename T>
struct LactCheckpoints {
  std::vector<T> weights;  // [chunks, B, H, 3 M D]
  std::vector<T> updates;  // [chunks, B, H, 3 M D]
};

// Sums `count` values at `data` over the group, in place, on every rank. An
// empty function means a group of one (lact_forward and lact_backward refuse
// it, naming "all_reduce", when ranks > 1).
template <typename T>
using LactAllReduce = std::function<void(T* data, std::size_t count)>;

// Validates sizes, sharding, config and data (q, k, v, w finite; learning
// rates finite and > 0). Throws statescan::Error naming the argument ("q",
// "lr1", "chunk", ...). Local: the layer runs it inside collective_check.
template <typename T>
void lact_check_params(const LactParams<T>& p);

// o from the inputs; fills `saved` for backward (may be null when backward is
// not needed). Collective through all_reduce (once per chunk). Validates p
// first.
template <typename T>
void lact_forward(const LactParams<T>& p, const LactAllReduce<T>& all_reduce,
                  LactCheckpoints<T>* saved);

// Gradients (see LactGradParams) from d_o, with `saved` from lact_forward of
// the same p. Collective through all_reduce (once per chunk plus once).
template <typename T>
void lact_backward(const LactParams<T>& p, const LactGradParams<T>& g,
                   const LactCheckpoints<T>& saved, const LactAllReduce<T>& all_reduce);

// ---- the sharded layout ----------------------------------------------------

int64_t lact_num_chunks(int64_t seq_len, int64_t chunk);

// The one rule of the sharded layout, which lact_token_range, lact_check_layout
// (CPU and GPU) and statescan-run all apply: every chunk of a length-seq_len
// sequence, the last (maybe shorter) one too, splits evenly over `ranks`.
// All chunks but the last have `chunk` tokens, so chunk % ranks == 0 matters
// only when there are two or more; a sequence no longer than one chunk is a
// single chunk of seq_len tokens, whose slices start at local row 0 whatever
// chunk is. Given that, the last chunk splits exactly when seq_len % ranks ==
// 0. Throws statescan::Error naming chunk_arg when chunk is at fault, else
// seq_len_arg when seq_len is (no chunk size could split it then).
void lact_check_split(int64_t seq_len, int64_t chunk, int64_t ranks, const char* seq_len_arg,
                      const char* chunk_arg);

// Global tokens [begin, end) of chunk c's slice on rank r when every chunk of
// a length-seq_len sequence is split evenly over `ranks` (lact_check_split's
// rule; throws naming "chunk" or "seq_len" otherwise).
struct LactTokenRange {
  int64_t begin = 0, end = 0;
};
LactTokenRange lact_token_range(int64_t seq_len, int64_t chunk, int64_t ranks, int64_t rank,
                                int64_t c);

// The checks of a call's layout that every LaCT path makes (lact_check_params
// here, lact_cuda_check_sizes on the GPU): the config, positive sizes, the
// rank in range, every chunk (the last one too) split evenly over the ranks
// (lact_check_split, naming "chunk" or, for the sequence length, "q"), and
// the ten arrays q, k, v, lr0, lr1, lr2, w0, w1, w2, o given, in that order.
// Throws statescan::Error naming the argument.
void lact_check_layout(const LactConfig& config, int64_t batch, int64_t seq_len, int64_t heads,
                       int64_t dim, int64_t hidden, int64_t ranks, int64_t rank,
                       const void* const (&arrays)[10]);
// The same from a params struct with those fields (LactParams<T>,
// cuda::LactCudaParams).
template <typename Params>
void lact_check_layout(const Params& p) {
  const void* const arrays[10] = {p.q, p.k, p.v, p.lr0, p.lr1, p.lr2, p.w0, p.w1, p.w2, p.o};
  lact_check_layout(p.config, p.batch, p.seq_len, p.heads, p.dim, p.hidden, p.ranks, p.rank,
                    arrays);
}

// What lact_shard and lact_unshard check before they touch memory (a wrong
// inner or a short vector would read or write out of bounds): positive batch
// and inner, the layout (lact_check_split), global_size == batch seq_len
// inner and, unless kLactLocalUnknown (lact_shard builds local),
// local_size == batch (seq_len / ranks) inner. Throws statescan::Error naming
// the argument ("global", "local" with the expected and actual sizes).
// Returns local's size.
constexpr std::size_t kLactLocalUnknown = static_cast<std::size_t>(-1);
std::size_t lact_check_shard_sizes(int64_t batch, int64_t seq_len, int64_t inner, int64_t chunk,
                                   int64_t ranks, std::size_t global_size,
                                   std::size_t local_size = kLactLocalUnknown);

// Rank r's local tensor [B, T/P, inner] from a global [B, T, inner] one.
template <typename T>
std::vector<T> lact_shard(const std::vector<T>& global, int64_t batch, int64_t seq_len,
                          int64_t inner, int64_t chunk, int64_t ranks, int64_t rank) {
  std::vector<T> local;
  local.reserve(lact_check_shard_sizes(batch, seq_len, inner, chunk, ranks, global.size()));
  const int64_t chunks = lact_num_chunks(seq_len, chunk);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t c = 0; c < chunks; ++c) {
      const LactTokenRange t = lact_token_range(seq_len, chunk, ranks, rank, c);
      local.insert(local.end(), global.begin() + (b * seq_len + t.begin) * inner,
                   global.begin() + (b * seq_len + t.end) * inner);
    }
  return local;
}

// Writes rank r's local tensor back into its places of a global one.
template <typename T>
void lact_unshard(const std::vector<T>& local, int64_t batch, int64_t seq_len, int64_t inner,
                  int64_t chunk, int64_t ranks, int64_t rank, std::vector<T>& global) {
  lact_check_shard_sizes(batch, seq_len, inner, chunk, ranks, global.size(), local.size());
  const int64_t chunks = lact_num_chunks(seq_len, chunk);
  auto src = local.begin();
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t c = 0; c < chunks; ++c) {
      const LactTokenRange t = lact_token_range(seq_len, chunk, ranks, rank, c);
      const int64_t n = (t.end - t.begin) * inner;
      std::copy(src, src + n, global.begin() + (b * seq_len + t.begin) * inner);
      src += n;
    }
}

}  // namespace statescan
