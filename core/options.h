// Variant and option types (DESIGN §3): one recurrence, six variants, named by
// their decay and their update rule.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <string_view>

namespace statescan {

enum class Decay { none, scalar, vector };
enum class Rule { additive, delta };

enum class Variant { linear, retention, gla, deltanet, gated_deltanet, kda };

struct VariantSpec {
  Decay decay;
  Rule rule;
};

VariantSpec spec_of(Variant v);
const char* to_string(Variant v);
// Accepts the CLI names of DESIGN §3; throws statescan::Error naming `argument`.
Variant parse_variant(std::string_view name, const char* argument = "variant");
inline bool has_gate(Variant v) { return spec_of(v).decay != Decay::none; }
inline bool has_beta(Variant v) { return spec_of(v).rule == Rule::delta; }
inline bool vector_gate(Variant v) { return spec_of(v).decay == Decay::vector; }

constexpr Variant kAllVariants[] = {Variant::linear,   Variant::retention,
                                    Variant::gla,      Variant::deltanet,
                                    Variant::gated_deltanet, Variant::kda};

// How the boundary state crosses ranks (DESIGN §5).
enum class Exchange { allgather, ring, tree, automatic };
const char* to_string(Exchange e);
Exchange parse_exchange(std::string_view name, const char* argument = "exchange");

enum class DeviceKind { automatic, cpu, cuda };
const char* to_string(DeviceKind d);
DeviceKind parse_device(std::string_view name, const char* argument = "device");

// Printable by name (logs, and readable parameter names in parametrised tests).
inline std::ostream& operator<<(std::ostream& os, Variant v) { return os << to_string(v); }
inline std::ostream& operator<<(std::ostream& os, Exchange e) { return os << to_string(e); }
inline std::ostream& operator<<(std::ostream& os, DeviceKind d) { return os << to_string(d); }

// Options shared by every mixer implementation.
struct MixerConfig {
  Variant variant = Variant::kda;
  int64_t chunk = 64;        // 16, 32 or 64
  double scale = -1.0;       // < 0 means Dk^-1/2
  bool l2norm_qk = false;    // L2-normalise q and k per head inside the op
  // Keep no fp32 chunk states from forward to backward (4*Dk*Dv/chunk bytes
  // per token and head); backward recomputes them with one more state scan.
  bool recompute_chunk_states = false;
  // GPU path: keep the forward's prepare-stage workspace (the state-independent
  // tiles Q^, K_, W, U, A and decays, with the forward's V' and 16-bit chunk
  // states beside them: ~1.9 KB per token and head at D = 128 in bf16) until
  // backward, which then skips its prepare stage (a quarter of a KDA backward).
  // Under context parallelism the first rank keeps nothing: its backward
  // prepares while it waits for the exchange anyway. Needs saved chunk states
  // (not recompute_chunk_states). The host path has no such stage.
  bool keep_prepared = false;
  // GPU path, delta rules without a vector gate (DeltaNet, Gated DeltaNet)
  // with bf16/f16 inputs: the forward also saves T = (I + diag(beta) KK)^{-1}
  // of every chunk (two 16-bit parts, 4*chunk bytes per token and head: 256 B
  // at chunk 64, a quarter of the fp32 chunk states) and the backward's
  // prepare re-run reads it instead of forming KK and solving again (bitwise
  // the same gradients; DeltaNet forward + backward ~3 % faster, as FLA's
  // default saves its inverse). Other variants and dtypes have no T: nothing
  // is saved. false: those bytes are not kept (cuda::saved_t_supported).
  bool save_t = true;
  // CpMixer: scan the inputs (forward: q, k, v, g, beta, initial_state;
  // backward: do, d_final_state) for NaN/Inf, and g for log gates > 0
  // (DESIGN §2), and refuse them on every rank before anything is written or
  // sent. On the GPU with 16-bit inputs the forward's prepare stage tests q,
  // k, v, g, beta as it reads them (one host sync after it); fp32 inputs,
  // linear attention without the L2 norm and the backward's do take one more
  // read of the array. Together ~2 % of a KDA forward + backward at 128K
  // tokens, H = 16, D = 128 on an H200 (README, P = 1). A trainer that
  // already guards its steps (its own anomaly detection, or loss scaling that
  // skips non-finite steps) may turn it off; NaN/Inf (and, on the GPU, log
  // gates > 0: their check needs the same host sync) then flow into the
  // outputs as in any kernel. Host tensors' gates are checked either way.
  // Every rank of a group must agree on it.
  bool check_finite = true;

  double scale_for(int64_t dk) const;
};

// Throws naming "chunk" unless chunk is 16, 32 or 64.
void check_chunk(int64_t chunk);

}  // namespace statescan
