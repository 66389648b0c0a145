#include "monitoring/flop_model.h"

#include "core/error.h"

namespace statescan {

namespace {

void check_shape(const FlopShape& s) {
  SS_CHECK_ARG(s.tokens >= 0, "tokens", "is ", s.tokens);
  SS_CHECK_ARG(s.heads >= 0, "heads", "is ", s.heads);
  SS_CHECK_ARG(s.dk >= 0, "dk", "is ", s.dk);
  SS_CHECK_ARG(s.dv >= 0, "dv", "is ", s.dv);
  SS_CHECK_ARG(s.chunk > 0, "chunk", "is ", s.chunk);
}

double token_heads(const FlopShape& s) {
  return static_cast<double>(s.tokens) * static_cast<double>(s.heads);
}

}  // namespace

double chunkwise_forward_flops(const FlopShape& s) {
  check_shape(s);
  const double c = static_cast<double>(s.chunk), dk = static_cast<double>(s.dk),
               dv = static_cast<double>(s.dv);
  double per_token = c * (dk + dv) + 4 * dk * dv;
  if (has_beta(s.variant)) per_token += c * dk + c * (dk + dv) + 2 * dk * dv;
  return per_token * token_heads(s);
}

double chunkwise_backward_flops(const FlopShape& s) {
  check_shape(s);
  const double c = static_cast<double>(s.chunk), dk = static_cast<double>(s.dk),
               dv = static_cast<double>(s.dv);
  double per_token = c * (3 * dk + 2 * dv) + 8 * dk * dv;
  if (has_beta(s.variant)) per_token += c * (6 * dk + 3 * dv) + 6 * dk * dv;
  return per_token * token_heads(s);
}

double chunkwise_step_flops(const FlopShape& shape, bool with_backward) {
  const double forward = chunkwise_forward_flops(shape);
  return with_backward ? forward + chunkwise_backward_flops(shape) : forward;
}

double lact_step_flops(int64_t token_heads, int64_t dim, int64_t hidden, bool with_backward) {
  SS_CHECK_ARG(token_heads >= 0, "tokens", "is ", token_heads);
  SS_CHECK_ARG(dim >= 0, "dim", "is ", dim);
  SS_CHECK_ARG(hidden >= 0, "hidden", "is ", hidden);
  const double mdt =
      static_cast<double>(hidden) * static_cast<double>(dim) * static_cast<double>(token_heads);
  return (with_backward ? 64.0 : 18.0) * mdt;
}

}  // namespace statescan
