#include "core/options.h"

#include <cmath>

#include "core/error.h"

namespace statescan {

VariantSpec spec_of(Variant v) {
  switch (v) {
    case Variant::linear: return {Decay::none, Rule::additive};
    case Variant::retention: return {Decay::scalar, Rule::additive};
    case Variant::gla: return {Decay::vector, Rule::additive};
    case Variant::deltanet: return {Decay::none, Rule::delta};
    case Variant::gated_deltanet: return {Decay::scalar, Rule::delta};
    case Variant::kda: return {Decay::vector, Rule::delta};
  }
  return {Decay::none, Rule::additive};
}

const char* to_string(Variant v) {
  switch (v) {
    case Variant::linear: return "linear";
    case Variant::retention: return "retention";
    case Variant::gla: return "gla";
    case Variant::deltanet: return "deltanet";
    case Variant::gated_deltanet: return "gated_deltanet";
    case Variant::kda: return "kda";
  }
  return "?";
}

Variant parse_variant(std::string_view s, const char* argument) {
  for (Variant v : kAllVariants)
    if (s == to_string(v)) return v;
  SS_FAIL(argument, "unknown variant '", std::string(s),
          "' (expected linear, retention, gla, deltanet, gated_deltanet or kda)");
}

const char* to_string(Exchange e) {
  switch (e) {
    case Exchange::allgather: return "allgather";
    case Exchange::ring: return "ring";
    case Exchange::tree: return "tree";
    case Exchange::automatic: return "auto";
  }
  return "?";
}

Exchange parse_exchange(std::string_view s, const char* argument) {
  if (s == "allgather") return Exchange::allgather;
  if (s == "ring") return Exchange::ring;
  if (s == "tree") return Exchange::tree;
  if (s == "auto") return Exchange::automatic;
  SS_FAIL(argument, "unknown exchange '", std::string(s),
          "' (expected allgather, ring, tree or auto)");
}

const char* to_string(DeviceKind d) {
  switch (d) {
    case DeviceKind::automatic: return "auto";
    case DeviceKind::cpu: return "cpu";
    case DeviceKind::cuda: return "cuda";
  }
  return "?";
}

DeviceKind parse_device(std::string_view s, const char* argument) {
  if (s == "auto") return DeviceKind::automatic;
  if (s == "cpu") return DeviceKind::cpu;
  if (s == "cuda") return DeviceKind::cuda;
  SS_FAIL(argument, "unknown device '", std::string(s), "' (expected auto, cpu or cuda)");
}

double MixerConfig::scale_for(int64_t dk) const {
  return scale < 0 ? 1.0 / std::sqrt(static_cast<double>(dk)) : scale;
}

void check_chunk(int64_t chunk) {
  SS_CHECK_ARG(chunk == 16 || chunk == 32 || chunk == 64, "chunk", "chunk size ", chunk,
               " is not supported (expected 16, 32 or 64)");
}

}  // namespace statescan
