// core/: dtype rounding, tensor checks, errors, option parsing and .npy I/O.
#include <gtest/gtest.h>
#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/cli_parse.h"
#include "core/dtype.h"
#include "core/env_knob.h"
#include "core/error.h"
#include "core/npy.h"
#include "core/options.h"
#include "core/parallel_for.h"
#include "core/tensor.h"
#include "core/text_file.h"
#include "tests/expect_error.h"
#include "tests/scoped_env.h"

namespace statescan {
namespace {

namespace fs = std::filesystem;

float float_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Runs `f`, expects a statescan::Error naming `argument`, returns what().
template <typename F>
std::string expect_error_naming(const std::string& argument, F&& f) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), argument) << e.what();
    EXPECT_NE(std::string(e.what()).find("'" + argument + "'"), std::string::npos) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "no statescan::Error for " << argument;
  return {};
}

// ---- bf16 / f16 round to nearest even --------------------------------------

struct RoundCase {
  const char* name;
  float x;
  uint16_t bits;
};
// Names the case in test listings (ctest names carry the printed parameter;
// the default would print raw bytes, pointers included).
void PrintTo(const RoundCase& c, std::ostream* os) {
  *os << c.name;
}

class Bf16Rounding : public ::testing::TestWithParam<RoundCase> {};

TEST_P(Bf16Rounding, GivesExpectedBits) {
  const RoundCase& c = GetParam();
  EXPECT_EQ(float_to_bf16_bits(c.x), c.bits) << "x = " << c.x;
}

INSTANTIATE_TEST_SUITE_P(
    Cases, Bf16Rounding,
    ::testing::Values(RoundCase{"one", 1.0f, 0x3f80}, RoundCase{"minus_two", -2.0f, 0xc000},
                      RoundCase{"zero", 0.0f, 0x0000}, RoundCase{"minus_zero", -0.0f, 0x8000},
                      // 1 + 2^-8 lies halfway between 1 (even) and 1 + 2^-7: ties go to even.
                      RoundCase{"tie_down_to_even", float_from_bits(0x3f808000u), 0x3f80},
                      // 1 + 3 * 2^-8 lies halfway between 0x3f81 (odd) and 0x3f82 (even).
                      RoundCase{"tie_up_to_even", float_from_bits(0x3f818000u), 0x3f82},
                      RoundCase{"just_above_tie", float_from_bits(0x3f808001u), 0x3f81},
                      RoundCase{"just_below_tie", float_from_bits(0x3f807fffu), 0x3f80},
                      RoundCase{"largest_below_overflow", float_from_bits(0x7f7f7fffu), 0x7f7f},
                      RoundCase{"overflow_to_inf", std::numeric_limits<float>::max(), 0x7f80},
                      RoundCase{"negative_overflow", -std::numeric_limits<float>::max(), 0xff80},
                      RoundCase{"inf", std::numeric_limits<float>::infinity(), 0x7f80},
                      RoundCase{"float_subnormal", float_from_bits(0x00018000u), 0x0002}),
    [](const auto& info) { return std::string(info.param.name); });

class F16Rounding : public ::testing::TestWithParam<RoundCase> {};

TEST_P(F16Rounding, GivesExpectedBits) {
  const RoundCase& c = GetParam();
  EXPECT_EQ(float_to_f16_bits(c.x), c.bits) << "x = " << c.x;
}

INSTANTIATE_TEST_SUITE_P(
    Cases, F16Rounding,
    ::testing::Values(RoundCase{"one", 1.0f, 0x3c00}, RoundCase{"minus_two", -2.0f, 0xc000},
                      RoundCase{"half", 0.5f, 0x3800}, RoundCase{"minus_zero", -0.0f, 0x8000},
                      RoundCase{"largest_finite", 65504.0f, 0x7bff},
                      // 1 + 2^-11 is halfway between 1 (even) and 1 + 2^-10.
                      RoundCase{"tie_down_to_even", 1.0f + std::ldexp(1.0f, -11), 0x3c00},
                      RoundCase{"tie_up_to_even", 1.0f + 3 * std::ldexp(1.0f, -11), 0x3c02},
                      RoundCase{"just_above_tie",
                                std::nextafter(1.0f + std::ldexp(1.0f, -11), 2.0f), 0x3c01},
                      // 65520 is halfway between 65504 and the next (infinite) step.
                      RoundCase{"below_overflow", 65519.0f, 0x7bff},
                      RoundCase{"overflow_at_tie", 65520.0f, 0x7c00},
                      RoundCase{"overflow_far", 1e6f, 0x7c00},
                      RoundCase{"negative_overflow", -1e6f, 0xfc00},
                      RoundCase{"inf", std::numeric_limits<float>::infinity(), 0x7c00},
                      RoundCase{"smallest_subnormal", std::ldexp(1.0f, -24), 0x0001},
                      // Half of the smallest subnormal ties between 0 (even) and 1 unit.
                      RoundCase{"subnormal_tie_to_zero", std::ldexp(1.0f, -25), 0x0000},
                      RoundCase{"subnormal_tie_to_two", 3 * std::ldexp(1.0f, -25), 0x0002},
                      RoundCase{"subnormal_above_tie", std::ldexp(1.0001f, -25), 0x0001},
                      RoundCase{"largest_subnormal", 1023 * std::ldexp(1.0f, -24), 0x03ff},
                      // Halfway between the largest subnormal (odd) and the smallest normal.
                      RoundCase{"subnormal_to_normal_tie", 1023.5f * std::ldexp(1.0f, -24), 0x0400},
                      RoundCase{"smallest_normal", std::ldexp(1.0f, -14), 0x0400},
                      RoundCase{"negative_subnormal", -std::ldexp(1.0f, -24), 0x8001},
                      RoundCase{"underflow_to_zero", std::ldexp(1.0f, -30), 0x0000}),
    [](const auto& info) { return std::string(info.param.name); });

struct HalfFormat {
  const char* name;
  uint16_t (*to_bits)(float);
  float (*from_bits)(uint16_t);
  DType dtype;
};
void PrintTo(const HalfFormat& c, std::ostream* os) {
  *os << c.name;
}

const HalfFormat kHalfFormats[] = {
    {"bf16", float_to_bf16_bits, bf16_bits_to_float, DType::bf16},
    {"f16", float_to_f16_bits, f16_bits_to_float, DType::f16},
};

class HalfFormats : public ::testing::TestWithParam<HalfFormat> {};

TEST_P(HalfFormats, EveryFiniteBitPatternRoundTripsExactly) {
  const HalfFormat& f = GetParam();
  for (uint32_t b = 0; b <= 0xffffu; ++b) {
    const float x = f.from_bits(static_cast<uint16_t>(b));
    if (std::isnan(x)) continue;
    ASSERT_EQ(f.to_bits(x), b) << f.name << " bits 0x" << std::hex << b;
  }
}

TEST_P(HalfFormats, NaNStaysNaN) {
  const HalfFormat& f = GetParam();
  // Payloads only in the low bits would turn into inf under plain truncation.
  for (uint32_t payload : {0x7fc00000u, 0x7f800001u, 0xff800001u, 0x7fffffffu}) {
    const float nan = float_from_bits(payload);
    EXPECT_TRUE(std::isnan(f.from_bits(f.to_bits(nan)))) << std::hex << payload;
  }
}

TEST_P(HalfFormats, RoundingPicksTheNearestRepresentable) {
  const HalfFormat& f = GetParam();
  std::mt19937_64 rng(7);
  std::normal_distribution<float> dist(0.f, 100.f);
  for (int i = 0; i < 10000; ++i) {
    const float x = dist(rng);
    const uint16_t b = f.to_bits(x);
    const float r = f.from_bits(b);
    // Neighbours in the same sign: one bit pattern up and down.
    const float up = f.from_bits(static_cast<uint16_t>(b + 1));
    const float down = f.from_bits(static_cast<uint16_t>(b - 1));
    EXPECT_LE(std::fabs(r - x), std::fabs(up - x)) << x;
    EXPECT_LE(std::fabs(r - x), std::fabs(down - x)) << x;
  }
}

TEST_P(HalfFormats, RoundToAndConversionsAgree) {
  const HalfFormat& f = GetParam();
  std::mt19937_64 rng(11);
  std::normal_distribution<float> dist(0.f, 3.f);
  std::vector<float> x(257);
  for (auto& e : x) e = dist(rng);
  std::vector<uint16_t> stored(x.size());
  convert_from_float(f.dtype, x.data(), stored.data(), x.size());
  std::vector<float> back(x.size());
  convert_to_float(f.dtype, stored.data(), back.data(), x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    EXPECT_EQ(stored[i], f.to_bits(x[i]));
    EXPECT_EQ(back[i], round_to(f.dtype, x[i]));
  }
  EXPECT_EQ(size_of(f.dtype), 2u);
}

INSTANTIATE_TEST_SUITE_P(Formats, HalfFormats, ::testing::ValuesIn(kHalfFormats),
                         [](const auto& info) { return std::string(info.param.name); });

TEST(DType, F32IsIdentity) {
  const float x = 0.1234567f;
  EXPECT_EQ(round_to(DType::f32, x), x);
  EXPECT_EQ(size_of(DType::f32), 4u);
}

TEST(DType, I64IsForIndicesOnly) {
  EXPECT_EQ(size_of(DType::i64), 8u);
  EXPECT_STREQ(to_string(DType::i64), "i64");
  expect_error_naming("dtype", [] { round_to(DType::i64, 1.f); });
  float x = 1.f;
  int64_t y = 0;
  expect_error_naming("dtype", [&] { convert_from_float(DType::i64, &x, &y, 1); });
  expect_error_naming("dtype", [&] { convert_to_float(DType::i64, &y, &x, 1); });
  expect_error_naming("--dtype", [] { parse_dtype("i64", "--dtype"); });
}

// ---- errors ---------------------------------------------------------------

TEST(Error, WhatNamesArgumentRankAndLocation) {
  set_error_rank(5);
  int line = 0;
  bool threw = false;
  try {
    line = __LINE__ + 1;
    SS_FAIL("q", "bad value ", 42);
  } catch (const Error& e) {
    threw = true;
    const std::string what = e.what();
    EXPECT_EQ(e.argument(), "q");
    EXPECT_EQ(e.rank(), 5);
    EXPECT_NE(what.find("argument 'q'"), std::string::npos) << what;
    EXPECT_NE(what.find("[rank 5]"), std::string::npos) << what;
    EXPECT_NE(what.find("bad value 42"), std::string::npos) << what;
    EXPECT_NE(what.find("test_core.cpp:" + std::to_string(line)), std::string::npos) << what;
    EXPECT_EQ(e.message(), "bad value 42");
  }
  set_error_rank(-1);
  EXPECT_TRUE(threw) << "SS_FAIL did not throw";
}

TEST(Error, UnknownRankPrintsQuestionMark) {
  set_error_rank(-1);
  try {
    SS_CHECK_ARG(1 + 1 == 3, "chunk", "arithmetic");
    FAIL() << "SS_CHECK_ARG did not throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("[rank ?]"), std::string::npos) << e.what();
    EXPECT_EQ(e.rank(), -1);
  }
}

TEST(Error, CheckArgPassesWhenConditionHolds) {
  EXPECT_NO_THROW(SS_CHECK_ARG(true, "x", "never"));
}

TEST(Error, RebuiltErrorKeepsTextAndRank) {
  const Error e("beta", "statescan error [rank 3] argument 'beta': nan", 3);
  EXPECT_EQ(e.argument(), "beta");
  EXPECT_EQ(e.rank(), 3);
  EXPECT_STREQ(e.what(), "statescan error [rank 3] argument 'beta': nan");
  EXPECT_EQ(e.message(), e.what());  // the other rank's prefix cannot be told apart
}

// ---- command-line numbers: all of the text, in range, or an error naming the flag

TEST(CliParse, IntegersInRange) {
  EXPECT_EQ(parse_int("42", "--iters", 1, 100), 42);
  EXPECT_EQ(parse_int("-3", "--x", -5, 5), -3);
  EXPECT_EQ(parse_int("1099511627776", "--seq-len", 1, int64_t{1} << 40), int64_t{1} << 40);
  expect_error_naming("--iters", [] { parse_int("0", "--iters", 1, 100); });
  expect_error_naming("--iters", [] { parse_int("101", "--iters", 1, 100); });
  expect_error_naming("-t", [] { parse_int("abc", "-t", 1, 100); });
  expect_error_naming("-t", [] { parse_int("12k", "-t", 1, 100); });  // not a prefix
  expect_error_naming("-t", [] { parse_int("1.5", "-t", 1, 100); });
  expect_error_naming("-t", [] { parse_int("", "-t", 1, 100); });
  expect_error_naming("-t", [] { parse_int("99999999999999999999", "-t", 1, 100); });
}

TEST(CliParse, Numbers) {
  EXPECT_DOUBLE_EQ(parse_number("0", "--overlap"), 0.0);
  EXPECT_DOUBLE_EQ(parse_number("-2.5e-1", "--x"), -0.25);
  EXPECT_DOUBLE_EQ(parse_positive_number("450", "--link-bw-GBps"), 450.0);
  expect_error_naming("--link-bw-GBps", [] { parse_positive_number("fast", "--link-bw-GBps"); });
  expect_error_naming("--link-bw-GBps", [] { parse_positive_number("-3", "--link-bw-GBps"); });
  expect_error_naming("--link-bw-GBps", [] { parse_positive_number("0", "--link-bw-GBps"); });
  expect_error_naming("--link-latency-us", [] { parse_positive_number("", "--link-latency-us"); });
  expect_error_naming("--fwd-ms", [] { parse_positive_number("12ms", "--fwd-ms"); });
  expect_error_naming("--scale", [] { parse_number("inf", "--scale"); });
  expect_error_naming("--scale", [] { parse_number("nan", "--scale"); });
  expect_error_naming("--scale", [] { parse_number("1e999", "--scale"); });
  // strtod's other forms are not decimal numbers; a subnormal value is one.
  expect_error_naming("--scale", [] { parse_number(" 2", "--scale"); });
  expect_error_naming("--scale", [] { parse_number("0x10", "--scale"); });
  expect_error_naming("--scale", [] { parse_number("1e-400", "--scale"); });  // underflows to 0
  EXPECT_GT(parse_number("1e-310", "--scale"), 0.0);
}

// Tensors of up to 2^48 elements pass; one element more is refused, naming
// the flag and the product.
TEST(CliParse, TensorElementsUpTo2To48) {
  check_tensor_elements({{"--seq-len", int64_t{1} << 24}, {"--heads", int64_t{1} << 24}},
                        "--seq-len");
  check_tensor_elements({{"-b", 1}, {"-t", int64_t{1} << 48}}, "-t");
  expect_error_naming("-t", [] {
    check_tensor_elements({{"-b", 1}, {"-t", (int64_t{1} << 48) + 1}}, "-t");
  });
  expect_error_naming("--seq-len", [] {
    check_tensor_elements({{"--seq-len", (int64_t{1} << 24) + 1}, {"--heads", int64_t{1} << 24}},
                          "--seq-len");
  });
}

// ---- environment switches: documented values, else an error ----------------

using test::ScopedEnv;

constexpr const char* kKnob = "STATESCAN_TEST_KNOB";

TEST(EnvKnob, ChoiceIsThePositionOfTheValue) {
  {
    ScopedEnv env(kKnob, "b");
    EXPECT_EQ(env_choice(kKnob, {"a", "b", "c"}), 1);
  }
  {
    ScopedEnv env(kKnob, "a");
    EXPECT_EQ(env_choice(kKnob, {"a", "b", "c"}), 0);
  }
}

TEST(EnvKnob, UnsetOrEmptyChoiceIsMinusOne) {
  {
    ScopedEnv env(kKnob, nullptr);
    EXPECT_EQ(env_choice(kKnob, {"a", "b"}), -1);
  }
  {
    ScopedEnv env(kKnob, "");
    EXPECT_EQ(env_choice(kKnob, {"a", "b"}), -1);
  }
}

// A typo is an error naming the variable and listing the values, not the
// default: `STATESCAN_LINEAR=sacn` must not time the grouped scan silently.
TEST(EnvKnob, UnknownChoiceNamesTheVariableAndTheValues) {
  {
    ScopedEnv env(kKnob, "sacn");
    const std::string what = expect_error_naming(kKnob, [] {
      (void)env_choice(kKnob, {"grouped", "scan"});
    });
    EXPECT_NE(what.find("'grouped', 'scan'"), std::string::npos) << what;
    EXPECT_NE(what.find("'sacn'"), std::string::npos) << what;
  }
  ScopedEnv padded(kKnob, "scan ");  // exact values only
  expect_error_naming(kKnob, [] { (void)env_choice(kKnob, {"grouped", "scan"}); });
}

TEST(EnvKnob, IntegerInRangeOrFallback) {
  {
    ScopedEnv env(kKnob, nullptr);
    EXPECT_EQ(env_int(kKnob, 7, 1, 10), 7);
  }
  {
    ScopedEnv env(kKnob, "10");
    EXPECT_EQ(env_int(kKnob, 7, 1, 10), 10);
  }
  {
    ScopedEnv env(kKnob, "");  // set but empty: unset, as env_choice takes it
    EXPECT_EQ(env_int(kKnob, 7, 1, 10), 7);
  }
  for (const char* bad : {"0", "11", "-3", "4x", "x", "99999999999999999999"}) {
    ScopedEnv env(kKnob, bad);
    expect_error_naming(kKnob, [] { (void)env_int(kKnob, 7, 1, 10); });
  }
}

// ---- tensor checks name the argument ----------------------------------------

TEST(TensorChecks, ShapeMismatchNamesArgument) {
  float buf[24];
  const TensorView t(buf, DType::f32, {2, 3, 4});
  EXPECT_NO_THROW(check_shape(t, {2, -1, 4}, "q"));
  const std::string what = expect_error_naming("q", [&] { check_shape(t, {2, 3, 5}, "q"); });
  EXPECT_NE(what.find("[2, 3, 4]"), std::string::npos) << what;
  expect_error_naming("k", [&] { check_shape(t, {2, 3}, "k"); });
}

TEST(TensorChecks, DtypeMismatchNamesArgument) {
  uint16_t buf[4];
  const TensorView t(buf, DType::bf16, {4});
  EXPECT_NO_THROW(check_dtype(t, DType::bf16, "g"));
  const std::string what = expect_error_naming("g", [&] { check_dtype(t, DType::f32, "g"); });
  EXPECT_NE(what.find("bf16"), std::string::npos) << what;
}

TEST(TensorChecks, NonContiguousNamesArgument) {
  float buf[12];
  TensorView t(buf, DType::f32, {3, 2});
  EXPECT_NO_THROW(check_contiguous(t, "v"));
  t.strides = {4, 1};
  expect_error_naming("v", [&] { check_contiguous(t, "v"); });
  t.strides = {2};  // fewer strides than dimensions
  expect_error_naming("v", [&] { check_contiguous(t, "v"); });
}

// Extent-1 dimensions may carry any stride (the layout is the same; PyTorch's
// rule): a [1, T, H, D] view made by a transpose passes; the other
// dimensions' strides still must be the packed ones.
TEST(TensorChecks, StridesOfExtentOneDimensionsDoNotMatter) {
  float buf[24];
  TensorView t(buf, DType::f32, {1, 3, 1, 8});
  t.strides = {8, 8, 999, 1};
  EXPECT_NO_THROW(check_contiguous(t, "q"));
  t.strides = {8, 9, 999, 1};
  expect_error_naming("q", [&] { check_contiguous(t, "q"); });
}

TEST(TensorChecks, MemoryKindNamesArgument) {
  float buf[2];
  const TensorView t(buf, DType::f32, {2}, Memory::host);
  EXPECT_NO_THROW(check_memory(t, Memory::host, "o"));
  expect_error_naming("o", [&] { check_memory(t, Memory::device, "o"); });
}

TEST(TensorChecks, NonFiniteElementNamesArgumentAndIndex) {
  std::vector<float> x(8, 0.5f);
  EXPECT_NO_THROW(check_finite(x.data(), 8, "g"));
  x[3] = std::numeric_limits<float>::quiet_NaN();
  const std::string what = expect_error_naming("g", [&] { check_finite(x.data(), 8, "g"); });
  EXPECT_NE(what.find("element 3"), std::string::npos) << what;
  x[3] = 0.f;
  x[6] = -std::numeric_limits<float>::infinity();
  expect_error_naming("g", [&] { check_finite(x.data(), 8, "g"); });
}

TEST(TensorChecks, NonFiniteTensorElementNamedByCoordinates) {
  std::vector<float> x(2 * 3 * 2 * 4, -0.25f);
  const TensorView t(x.data(), DType::f32, {2, 3, 2, 4}, Memory::host);
  EXPECT_NO_THROW(check_finite(t, "q"));
  EXPECT_NO_THROW(check_log_gates(t, "g"));
  // Flat 1 * 24 + 2 * 8 + 0 * 4 + 3 = 43: batch row 1, token 2, head 0, dim 3.
  x[43] = std::numeric_limits<float>::infinity();
  std::string what = expect_error_naming("q", [&] { check_finite(t, "q"); });
  EXPECT_NE(what.find("element [1, 2, 0, 3]"), std::string::npos) << what;
  x[43] = -1.f;
  x[9] = 0.5f;  // a positive log gate: [0, 1, 0, 1]
  EXPECT_NO_THROW(check_finite(t, "g"));
  what = expect_error_naming("g", [&] { check_log_gates(t, "g"); });
  EXPECT_NE(what.find("element [0, 1, 0, 1]"), std::string::npos) << what;
  EXPECT_EQ(index_string({5}, 4), "[4]");
  EXPECT_EQ(index_string({2, 3}, 5), "[1, 2]");
}

TEST(TensorChecks, ShapeHelpers) {
  EXPECT_EQ(numel({2, 3, 4}), 24);
  EXPECT_EQ(numel({}), 1);
  EXPECT_EQ(contiguous_strides({2, 3, 4}), (Shape{12, 4, 1}));
  EXPECT_EQ(shape_string({2, 3}), "[2, 3]");
}

// ---- option parsing -----------------------------------------------------------

TEST(Options, EveryVariantNameRoundTrips) {
  for (Variant v : kAllVariants) EXPECT_EQ(parse_variant(to_string(v)), v);
  EXPECT_EQ(spec_of(Variant::kda).decay, Decay::vector);
  EXPECT_EQ(spec_of(Variant::kda).rule, Rule::delta);
  EXPECT_FALSE(has_gate(Variant::deltanet));
  EXPECT_TRUE(has_beta(Variant::gated_deltanet));
  EXPECT_FALSE(vector_gate(Variant::retention));
}

TEST(Options, ExchangeDeviceAndDtypeNamesRoundTrip) {
  for (Exchange e : {Exchange::allgather, Exchange::ring, Exchange::tree, Exchange::automatic})
    EXPECT_EQ(parse_exchange(to_string(e)), e);
  for (DeviceKind d : {DeviceKind::automatic, DeviceKind::cpu, DeviceKind::cuda})
    EXPECT_EQ(parse_device(to_string(d)), d);
  for (DType t : {DType::f32, DType::bf16, DType::f16}) EXPECT_EQ(parse_dtype(to_string(t)), t);
  EXPECT_EQ(parse_dtype("bfloat16"), DType::bf16);
  EXPECT_EQ(parse_dtype("fp16"), DType::f16);
}

struct ParseCase {
  const char* name;
  void (*parse)(const char* text, const char* argument);
  const char* text;
};
void PrintTo(const ParseCase& c, std::ostream* os) {
  *os << c.name;
}

const ParseCase kBadParses[] = {
    {"variant_typo", [](const char* s, const char* a) { parse_variant(s, a); }, "kdaa"},
    {"variant_empty", [](const char* s, const char* a) { parse_variant(s, a); }, ""},
    {"variant_case", [](const char* s, const char* a) { parse_variant(s, a); }, "KDA"},
    {"exchange_unknown", [](const char* s, const char* a) { parse_exchange(s, a); }, "butterfly"},
    {"dtype_unknown", [](const char* s, const char* a) { parse_dtype(s, a); }, "f64"},
    {"dtype_int", [](const char* s, const char* a) { parse_dtype(s, a); }, "int8"},
    {"device_unknown", [](const char* s, const char* a) { parse_device(s, a); }, "tpu"},
};

class BadParse : public ::testing::TestWithParam<ParseCase> {};

TEST_P(BadParse, ThrowsNamingTheArgumentAndTheText) {
  const ParseCase& c = GetParam();
  const std::string what = expect_error_naming("--flag", [&] { c.parse(c.text, "--flag"); });
  EXPECT_NE(what.find("'" + std::string(c.text) + "'"), std::string::npos) << what;
}

INSTANTIATE_TEST_SUITE_P(Cases, BadParse, ::testing::ValuesIn(kBadParses),
                         [](const auto& info) { return std::string(info.param.name); });

TEST(Options, ChunkSizesAndScale) {
  for (int64_t c : {16, 32, 64}) EXPECT_NO_THROW(check_chunk(c));
  for (int64_t c : {0, 8, 48, 128}) expect_error_naming("chunk", [&] { check_chunk(c); });
  MixerConfig config;
  EXPECT_DOUBLE_EQ(config.scale_for(64), 0.125);
  config.scale = 0.5;
  EXPECT_DOUBLE_EQ(config.scale_for(64), 0.5);
}

// ---- .npy ------------------------------------------------------------------------

class NpyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Parametrised test names contain '/': flatten them to one directory level.
    std::string name = ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::replace(name.begin(), name.end(), '/', '_');
    dir_ = fs::temp_directory_path() /
           ("statescan_test_core_" + std::to_string(::getpid()) + "_" + name);
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  // Writes magic + version + header length + header text (+ '\n' padding to
  // 64 bytes as numpy does) + raw bytes.
  std::string write_raw(const std::string& name, int major, const std::string& dict,
                        const std::string& data, const std::string& magic = "\x93NUMPY") {
    const std::size_t len_bytes = major == 1 ? 2 : 4;
    std::string header = dict;
    const std::size_t unpadded = magic.size() + 2 + len_bytes + header.size() + 1;
    header.append((64 - unpadded % 64) % 64, ' ');
    header.push_back('\n');
    std::string bytes = magic;
    bytes.push_back(static_cast<char>(major));
    bytes.push_back(0);
    for (std::size_t i = 0; i < len_bytes; ++i)
      bytes.push_back(static_cast<char>((header.size() >> (8 * i)) & 0xff));
    bytes += header;
    bytes += data;
    std::ofstream(path(name), std::ios::binary)
        .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    return path(name);
  }

  fs::path dir_;
};

template <typename T>
std::string raw_bytes(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

TEST_F(NpyTest, Float32RoundTrip) {
  const Shape shape{2, 3, 4};
  std::vector<float> x(24);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = std::ldexp(static_cast<float>(i) - 7.3f, -3);
  write_npy(path("a.npy"), shape, x.data());
  const NpyArray a = read_npy(path("a.npy"));
  EXPECT_EQ(a.shape, shape);
  EXPECT_EQ(a.descr, "<f4");
  ASSERT_EQ(a.data.size(), x.size());
  for (std::size_t i = 0; i < x.size(); ++i) EXPECT_EQ(a.data[i], static_cast<double>(x[i]));
}

TEST_F(NpyTest, Float64RoundTripKeepsEveryBit) {
  const Shape shape{5};
  const std::vector<double> x{0.1, -1e-300, 1e300, std::numeric_limits<double>::denorm_min(),
                              std::nextafter(1.0, 2.0)};
  write_npy(path("b.npy"), shape, x.data());
  const NpyArray a = read_npy(path("b.npy"));
  EXPECT_EQ(a.shape, shape);
  EXPECT_EQ(a.descr, "<f8");
  EXPECT_EQ(a.data, x);
}

TEST_F(NpyTest, ScalarAndEmptyShapes) {
  const double scalar = 2.5;
  write_npy(path("s.npy"), Shape{}, &scalar);
  const NpyArray s = read_npy(path("s.npy"));
  EXPECT_TRUE(s.shape.empty());
  EXPECT_EQ(s.data, std::vector<double>{2.5});
  write_npy(path("e.npy"), Shape{0, 3}, static_cast<const float*>(nullptr));
  const NpyArray e = read_npy(path("e.npy"));
  EXPECT_EQ(e.shape, (Shape{0, 3}));
  EXPECT_TRUE(e.data.empty());
}

TEST_F(NpyTest, WrittenHeaderIsVersion1AlignedTo64Bytes) {
  const std::vector<float> x(7, 1.f);
  write_npy(path("h.npy"), Shape{7}, x.data());
  std::ifstream in(path("h.npy"), std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_GE(bytes.size(), 10u);
  EXPECT_EQ(bytes.substr(0, 6), "\x93NUMPY");
  EXPECT_EQ(bytes[6], 1);
  EXPECT_EQ(bytes[7], 0);
  const std::size_t header_len =
      static_cast<unsigned char>(bytes[8]) | (static_cast<unsigned char>(bytes[9]) << 8);
  EXPECT_EQ((10 + header_len) % 64, 0u);
  EXPECT_EQ(bytes[10 + header_len - 1], '\n');
  EXPECT_EQ(bytes.size(), 10 + header_len + 7 * 4);
  EXPECT_NE(bytes.find("'shape': (7,)"), std::string::npos) << bytes.substr(10, header_len);
}

TEST_F(NpyTest, OverwriteLeavesNoTemporaryFiles) {
  const std::vector<float> a(3, 1.f), b(5, 2.f);
  write_npy(path("o.npy"), Shape{3}, a.data());
  write_npy(path("o.npy"), Shape{5}, b.data());
  EXPECT_EQ(read_npy(path("o.npy")).data, std::vector<double>(5, 2.0));
  int files = 0;
  for (const auto& entry : fs::directory_iterator(dir_)) {
    ++files;
    EXPECT_EQ(entry.path().filename(), "o.npy");
  }
  EXPECT_EQ(files, 1);
}

TEST_F(NpyTest, WriteIntoMissingDirectoryThrowsNamingPath) {
  const std::vector<float> x(2, 0.f);
  const std::string target = path("no_such_dir/x.npy");
  expect_error_naming(target, [&] { write_npy(target, Shape{2}, x.data()); });
  EXPECT_FALSE(fs::exists(dir_ / "no_such_dir"));
}

TEST_F(NpyTest, HandWrittenInt64Reads) {
  const std::vector<int64_t> offsets{0, 15, 20, 38, 45, -3, int64_t{1} << 52};
  const std::string file = write_raw(
      "i.npy", 1, "{'descr': '<i8', 'fortran_order': False, 'shape': (7,), }", raw_bytes(offsets));
  const NpyArray a = read_npy(file);
  EXPECT_EQ(a.descr, "<i8");
  EXPECT_EQ(a.shape, (Shape{7}));
  ASSERT_EQ(a.data.size(), offsets.size());
  for (std::size_t i = 0; i < offsets.size(); ++i)
    EXPECT_EQ(a.data[i], static_cast<double>(offsets[i]));
}

TEST_F(NpyTest, Versions2And3ReadWithDoubleQuotesAndKeyOrder) {
  const std::vector<float> x{1.f, 2.f, 3.f, 4.f, 5.f, 6.f};
  for (int major : {2, 3}) {
    const std::string file = write_raw(
        "v" + std::to_string(major) + ".npy", major,
        "{\"shape\": (2, 3), \"fortran_order\": False, \"descr\": \"<f4\"}", raw_bytes(x));
    const NpyArray a = read_npy(file);
    EXPECT_EQ(a.shape, (Shape{2, 3})) << major;
    EXPECT_EQ(a.data, (std::vector<double>{1, 2, 3, 4, 5, 6})) << major;
  }
}

TEST_F(NpyTest, MissingFileThrowsNamingPath) {
  const std::string file = path("absent.npy");
  EXPECT_FALSE(npy_exists(file));
  expect_error_naming(file, [&] { read_npy(file); });
  EXPECT_FALSE(npy_exists(dir_.string()));  // a directory is not an array
}

struct MalformedCase {
  const char* name;
  int major;
  const char* dict;
  std::size_t data_bytes;
  const char* message;  // expected in what()
  const char* magic;
};
void PrintTo(const MalformedCase& c, std::ostream* os) {
  *os << c.name;
}

const MalformedCase kMalformed[] = {
    {"fortran_order", 1, "{'descr': '<f4', 'fortran_order': True, 'shape': (2, 2), }", 16,
     "fortran_order", "\x93NUMPY"},
    {"big_endian", 1, "{'descr': '>f4', 'fortran_order': False, 'shape': (4,), }", 16, "big-endian",
     "\x93NUMPY"},
    {"int32", 1, "{'descr': '<i4', 'fortran_order': False, 'shape': (4,), }", 16, "'<i4'",
     "\x93NUMPY"},
    {"float16", 1, "{'descr': '<f2', 'fortran_order': False, 'shape': (4,), }", 8, "'<f2'",
     "\x93NUMPY"},
    {"structured", 1, "{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (1,), }", 4,
     "malformed", "\x93NUMPY"},
    {"truncated_data", 1, "{'descr': '<f8', 'fortran_order': False, 'shape': (3, 4), }", 95,
     "truncated", "\x93NUMPY"},
    {"huge_shape", 1,
     "{'descr': '<f8', 'fortran_order': False, 'shape': (1000000000, 1000000000), }", 8,
     "truncated", "\x93NUMPY"},
    {"missing_shape", 1, "{'descr': '<f4', 'fortran_order': False, }", 4, "'shape'", "\x93NUMPY"},
    {"unknown_key", 1, "{'descr': '<f4', 'fortran_order': False, 'shape': (1,), 'x': 1}", 4,
     "unexpected key", "\x93NUMPY"},
    {"negative_dim", 1, "{'descr': '<f4', 'fortran_order': False, 'shape': (-1,), }", 4,
     "malformed", "\x93NUMPY"},
    {"not_a_dict", 1, "hello", 4, "malformed", "\x93NUMPY"},
    {"bad_magic", 1, "{'descr': '<f4', 'fortran_order': False, 'shape': (1,), }", 4, "bad magic",
     "\x93NUMPX"},
    {"version_4", 4, "{'descr': '<f4', 'fortran_order': False, 'shape': (1,), }", 4, "version 4",
     "\x93NUMPY"},
};

class NpyMalformed : public NpyTest, public ::testing::WithParamInterface<MalformedCase> {};

TEST_P(NpyMalformed, ThrowsNamingThePath) {
  const MalformedCase& c = GetParam();
  const std::string file = write_raw(std::string(c.name) + ".npy", c.major, c.dict,
                                     std::string(c.data_bytes, '\0'), c.magic);
  const std::string what = expect_error_naming(file, [&] { read_npy(file); });
  EXPECT_NE(what.find(c.message), std::string::npos) << what;
}

INSTANTIATE_TEST_SUITE_P(Cases, NpyMalformed, ::testing::ValuesIn(kMalformed),
                         [](const auto& info) { return std::string(info.param.name); });

TEST_F(NpyTest, TruncatedHeaderThrows) {
  const std::string file = path("short.npy");
  std::ofstream(file, std::ios::binary) << std::string("\x93NUMPY\x01\x00\x40", 9);
  expect_error_naming(file, [&] { read_npy(file); });
}

TEST_F(NpyTest, NegativeInt64BeyondDoublePrecisionThrows) {
  const std::vector<int64_t> x{-((int64_t{1} << 53) + 1)};
  const std::string file = write_raw(
      "small.npy", 1, "{'descr': '<i8', 'fortran_order': False, 'shape': (1,), }", raw_bytes(x));
  expect_error_naming(file, [&] { read_npy(file); });
}

TEST_F(NpyTest, Int64BeyondDoublePrecisionThrows) {
  const std::vector<int64_t> x{(int64_t{1} << 53) + 1};
  const std::string file = write_raw(
      "big.npy", 1, "{'descr': '<i8', 'fortran_order': False, 'shape': (1,), }", raw_bytes(x));
  expect_error_naming(file, [&] { read_npy(file); });
}

}  // namespace
}  // namespace statescan

// ---- parallel_for (core/parallel_for.h) -------------------------------------
// Each case runs in a re-executed child (death test, threadsafe style): the
// thread count is read once per process, so the child must set its affinity
// or limits before the first call.
namespace statescan {
namespace {

// Child of ThreadsFollowTheCpuAffinity...: exits 0 when one allowed core
// gives one thread.
[[noreturn]] void one_core_child() {
  ::unsetenv("STATESCAN_NUM_THREADS");
  cpu_set_t allowed;
  if (sched_getaffinity(0, sizeof allowed, &allowed) != 0) std::_Exit(2);
  int first = 0;
  while (!CPU_ISSET(first, &allowed)) ++first;
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(first, &one);
  if (sched_setaffinity(0, sizeof one, &one) != 0) std::_Exit(3);
  std::_Exit(num_threads() == 1 ? 0 : 1);
}

// Child of ThreadsThatCannotStart...: 200 workers asked for under an
// address-space limit a few thread stacks above what the process uses;
// exits 0 when every item ran exactly once.
[[noreturn]] void few_stacks_child() {
  ::setenv("STATESCAN_NUM_THREADS", "200", 1);
  std::ifstream statm("/proc/self/statm");
  long pages = 0;
  statm >> pages;
  const rlim_t used = static_cast<rlim_t>(pages) * static_cast<rlim_t>(sysconf(_SC_PAGESIZE));
  // Room for ~8 thread stacks of the default size (ulimit -s), whatever it is.
  pthread_attr_t attr;
  std::size_t stack = 0;
  if (pthread_attr_init(&attr) != 0 || pthread_attr_getstacksize(&attr, &stack) != 0) std::_Exit(4);
  const rlim_t cap = used + 8 * static_cast<rlim_t>(stack);
  const rlimit limit{cap, cap};
  if (setrlimit(RLIMIT_AS, &limit) != 0) std::_Exit(2);
  std::vector<std::atomic<int>> runs(5000);
  parallel_for(5000, [&](int64_t i) { runs[static_cast<size_t>(i)].fetch_add(1); });
  for (const auto& r : runs)
    if (r.load() != 1) std::_Exit(1);
  std::_Exit(0);
}

TEST(ParallelFor, ThreadsFollowTheCpuAffinityNotTheNodesCores) {
  cpu_set_t allowed;
  ASSERT_EQ(sched_getaffinity(0, sizeof allowed, &allowed), 0);
  if (CPU_COUNT(&allowed) < 2) GTEST_SKIP() << "one core: one thread either way";
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(one_core_child(), ::testing::ExitedWithCode(0), "");
}

// Threads that cannot be created leave their items to the others: all of
// them run, once, and the call returns (it used to std::terminate).
TEST(ParallelFor, ThreadsThatCannotStartLeaveTheirItemsToTheOthers) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(few_stacks_child(), ::testing::ExitedWithCode(0), "");
}

// Child of TheLowestFailingItemsError...: four workers; item 10 fails late
// (after item 40 has failed on another thread); exits 0 when item 10's
// error is the one rethrown, as the serial loop would rethrow it.
[[noreturn]] void lowest_error_child() {
  ::setenv("STATESCAN_NUM_THREADS", "4", 1);
  try {
    parallel_for(64, [](int64_t i) {
      if (i == 10) {
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        SS_FAIL("item", "item 10 failed");
      }
      if (i == 40) SS_FAIL("item", "item 40 failed");
    });
  } catch (const Error& e) {
    std::_Exit(std::string(e.what()).find("item 10 failed") != std::string::npos ? 0 : 1);
  }
  std::_Exit(2);
}

// Which error a failed loop reports does not depend on the threads' timing
// (it was whichever failed first: two runs, or two ranks, could differ).
TEST(ParallelFor, TheLowestFailingItemsErrorIsRethrown) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(lowest_error_child(), ::testing::ExitedWithCode(0), "");
}

TEST(ParallelFor, RethrowsTheBodysErrorOnTheCaller) {
  EXPECT_THROW(parallel_for(64,
                            [](int64_t i) {
                              if (i == 17) SS_FAIL("item", "item 17 failed");
                            }),
               Error);
}

}  // namespace
}  // namespace statescan

// ---- write_file (core/text_file.h) -------------------------------------------
namespace statescan {
namespace {

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

std::filesystem::path fresh_dir(const std::string& name) {
  const auto dir =
      std::filesystem::temp_directory_path() / (name + "." + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

TEST(JsonNumber, NonFiniteValuesAreNullAndFiniteOnesRoundTrip) {
  EXPECT_EQ(json_number(std::numeric_limits<double>::infinity()), "null");
  EXPECT_EQ(json_number(-std::numeric_limits<double>::infinity()), "null");
  EXPECT_EQ(json_number(std::nan("")), "null");
  EXPECT_EQ(json_number(0.0), "0");
  EXPECT_EQ(json_number(-2.5e-3), "-0.0025");
  const double x = 1.0 / 3.0;
  EXPECT_NEAR(std::stod(json_number(x)), x, 1e-9 * x);
}

TEST(WriteFile, WritesThePartsInOrderAndReplacesTheOldFile) {
  const auto dir = fresh_dir("statescan-write-file");
  const std::string path = (dir / "out.bin").string();
  write_text_file(path, "old contents, longer than the new ones", "--json");
  const std::string a = "head|", b(100000, 'x');
  write_file(path, {{a.data(), a.size()}, {nullptr, 0}, {b.data(), b.size()}}, "--json");
  EXPECT_EQ(read_all(path), a + b);
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir), {}), 1) << "a temp file left";
  std::filesystem::remove_all(dir);
}

TEST(WriteFile, AnUnwritablePathNamesTheArgument) {
  const auto dir = fresh_dir("statescan-write-file-missing");
  const std::string path = (dir / "no-such-dir" / "out.json").string();
  test::expect_error([&] { write_text_file(path, "{}", "--json"); }, "--json");
  std::filesystem::remove_all(dir);
}

// Child of AFailedWriteKeepsTheOldFile: a file-size limit below the new
// contents (the write fails with EFBIG, as a full disk fails it with
// ENOSPC); exits 0 when the call threw naming the argument, the old file is
// intact and no temp file is left.
[[noreturn]] void file_size_limit_child(const std::string& dir) {
  const std::string path = dir + "/out.npy";
  const std::string old_text = "the old, complete file";
  write_text_file(path, old_text, "--save");
  std::signal(SIGXFSZ, SIG_IGN);  // EFBIG from write(), not a signal
  const rlimit limit{4096, 4096};
  if (setrlimit(RLIMIT_FSIZE, &limit) != 0) std::_Exit(2);
  const std::string big(100000, 'y');
  try {
    write_text_file(path, big, "--save");
    std::_Exit(3);
  } catch (const Error& e) {
    if (e.argument() != "--save") std::_Exit(4);
  }
  if (read_all(path) != old_text) std::_Exit(5);
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    (void)entry;
    ++files;
  }
  // The threadsafe death test re-runs the test body in the child, which made
  // this directory (named by its own pid): the parent cannot remove it.
  std::filesystem::remove_all(dir);
  std::_Exit(files == 1 ? 0 : 6);
}

TEST(WriteFile, AFailedWriteKeepsTheOldFile) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const auto dir = fresh_dir("statescan-write-file-limit");
  EXPECT_EXIT(file_size_limit_child(dir.string()), ::testing::ExitedWithCode(0), "");
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace statescan
