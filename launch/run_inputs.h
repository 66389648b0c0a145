// Inputs of statescan-run: synthetic ones from --seed, or the .npy files of
// --load. Either source hands out any token range [t0, t1) of every batch row
// in the layouts of DESIGN §2, so that each rank takes its shard and rank 0
// can take the whole sequence for --check.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/options.h"
#include "launch/run_options.h"

namespace statescan::launch {

// Global sizes of the problem.
struct Dims {
  int64_t batch = 0, seq_len = 0, heads = 0, dk = 0, dv = 0;
  int64_t sequences = 0;  // N: batch rows, or packed sequences with cu_seqlens
};

// Tokens [t_begin, t_end) of every batch row. Token tensors are [B, L, H, *]
// fp32 holding values rounded to the run's dtype (g stays fp32); states and
// cu_seqlens are global.
struct TokenRange {
  int64_t t_begin = 0, t_end = 0;
  std::vector<float> q, k, v;       // [B,L,H,Dk], [B,L,H,Dk], [B,L,H,Dv]
  std::vector<float> g;             // [B,L,H] or [B,L,H,Dk]; empty iff no decay
  std::vector<float> beta;          // [B,L,H]; empty iff additive
  std::vector<float> d_o;           // [B,L,H,Dv]; empty iff no backward
  std::vector<float> h0, dht;       // [N,H,Dk,Dv] or empty
  std::vector<int64_t> cu_seqlens;  // [N+1] or empty

  int64_t length() const { return t_end - t_begin; }
};

class InputSource {
 public:
  // Synthetic inputs, the same on every rank and for every rank count: each
  // element is a function of (seed, tensor, global index). q, k, v, do ~ N(0,1)
  // (q, k unit vectors for delta rules unless --l2norm), g = logsigmoid(N(0,1)
  // + 4), beta = sigmoid(N(0,1)); no h0, dht or cu_seqlens.
  static InputSource synthetic(const RunOptions& options);
  // Reads and cross-checks the files of options.load_dir (errors name the
  // file). Every rank calls it.
  static InputSource from_directory(const RunOptions& options);

  const Dims& dims() const { return dims_; }
  bool has_backward() const { return has_do_; }
  bool has_h0() const { return has_h0_; }
  bool packed() const { return packed_; }
  // "synthetic (seed 0)" or "loaded from DIR".
  std::string description() const;

  TokenRange tokens(int64_t t_begin, int64_t t_end) const;

 private:
  InputSource() = default;
  TokenRange synthesize(int64_t t_begin, int64_t t_end) const;

  RunOptions options_;
  Dims dims_;
  bool loaded_ = false;
  bool has_do_ = false, has_h0_ = false, packed_ = false;
  TokenRange full_;  // loaded inputs, whole sequence
};

// ---- LaCT (--variant lact) --------------------------------------------------------

struct LactDims {
  int64_t batch = 0, seq_len = 0, heads = 0, dim = 0, hidden = 0;
};

// The whole LaCT problem, fp32, every rank holding all of it: q, k, v, d_o
// [B, T, H, D] (rounded to the run's dtype), lr0..2 [B, T, H], w0, w2
// [H, M, D], w1 [H, D, M] (fp32). d_o empty: forward only.
struct LactData {
  LactDims dims;
  std::vector<float> q, k, v, lr0, lr1, lr2, w0, w1, w2, d_o;
  std::string description;  // "synthetic (seed 0)" or "loaded from DIR"
};

// Synthetic LaCT inputs, each element a function of (seed, tensor, index) as
// for the mixers: q, k unit vectors per head, v and do ~ N(0, 1); learning
// rates 0.01 + 0.1 sigmoid(N(0, 1)), in (0.01, 0.11); W0, W2 ~ N(0, 1) (with
// unit k the SwiGLU pre-activations are O(1), where silu is curved),
// W1 ~ N(0, 1/M) (outputs O(1)). M = options.lact_hidden_for(D).
LactData lact_synthetic(const RunOptions& options);
// q.npy k.npy v.npy lr0.npy lr1.npy lr2.npy w0.npy w1.npy w2.npy and, when
// present, do.npy from options.load_dir (float32/float64); B, T, H, D come from
// q.npy and M from w0.npy. Errors name the file.
LactData lact_from_directory(const RunOptions& options);

// Shard boundaries: P + 1 offsets, rank r holding [offsets[r], offsets[r+1]).
// Explicit --shards must have one entry per rank and sum to T (argument
// "--shards"); the default split needs T >= P.
std::vector<int64_t> shard_offsets(const RunOptions& options, int64_t seq_len, int ranks);

// With --load, a note on stderr naming the shape flags given, which the files
// override (`shape_files`: where the shapes come from, e.g. "q.npy and v.npy").
void note_ignored_shape_flags(const RunOptions& options, const char* shape_files);

}  // namespace statescan::launch
