// Single-process tests of comm/: CommType sizes, SingleRankCommunicator
// semantics (a group of one) and collective_check on a group of one.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "comm/collective_check.h"
#include "comm/communicator.h"
#include "core/error.h"
#include "tests/comm_test_util.h"

namespace statescan {
namespace {

using namespace statescan::test;  // NOLINT: shared comm test helpers

// `count` random elements of `type`, as raw bytes (never all zeros, so a copy
// that did nothing cannot pass).
Bytes random_elements(CommType type, std::size_t count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Bytes out(count * size_of(type));
  for (std::size_t i = 0; i < count; ++i) {
    unsigned char* at = out.data() + i * size_of(type);
    switch (type) {
      case CommType::f32: {
        const float x = std::normal_distribution<float>(0.f, 1.f)(rng) + 10.f;
        std::memcpy(at, &x, sizeof x);
        break;
      }
      case CommType::f64: {
        const double x = std::normal_distribution<double>(0.0, 1.0)(rng) + 10.0;
        std::memcpy(at, &x, sizeof x);
        break;
      }
      case CommType::i64: {
        const int64_t x = static_cast<int64_t>(rng() >> 1) | 1;
        std::memcpy(at, &x, sizeof x);
        break;
      }
      case CommType::u8:
        *at = static_cast<unsigned char>(1 + rng() % 255);
        break;
    }
  }
  return out;
}

// ---- CommType ------------------------------------------------------------------

struct TypeSize {
  CommType type;
  std::size_t bytes;
};

void PrintTo(const TypeSize& t, std::ostream* os) {
  *os << t.type << "_" << t.bytes << "B";
}

class CommTypeSize : public ::testing::TestWithParam<TypeSize> {};

TEST_P(CommTypeSize, MatchesTheElementWidth) {
  EXPECT_EQ(size_of(GetParam().type), GetParam().bytes);
}

INSTANTIATE_TEST_SUITE_P(AllTypes, CommTypeSize,
                         ::testing::Values(TypeSize{CommType::f32, sizeof(float)},
                                           TypeSize{CommType::f64, sizeof(double)},
                                           TypeSize{CommType::i64, sizeof(int64_t)},
                                           TypeSize{CommType::u8, 1}),
                         [](const auto& p) { return type_name(p.param.type); });

TEST(CommTypeSize, RejectsAnInvalidValue) {
  expect_error([] { size_of(static_cast<CommType>(42)); }, "type");
}

// ---- SingleRankCommunicator, per element type -------------------------------------

class SingleRankTyped : public ::testing::TestWithParam<CommType> {
 protected:
  SingleRankCommunicator comm_;
  const std::size_t count_ = 37;
  uint64_t seed() const {
    return std::hash<std::string>()(
        ::testing::UnitTest::GetInstance()->current_test_info()->name());
  }
};

TEST_P(SingleRankTyped, AllGatherCopiesTheContribution) {
  const Bytes send = random_elements(GetParam(), count_, seed());
  Bytes recv(send.size(), 0);
  comm_.all_gather(send.data(), recv.data(), count_, GetParam());
  EXPECT_EQ(recv, send);
}

TEST_P(SingleRankTyped, AllGatherInPlaceKeepsTheData) {
  Bytes data = random_elements(GetParam(), count_, seed());
  const Bytes expected = data;
  comm_.all_gather(data.data(), data.data(), count_, GetParam());
  EXPECT_EQ(data, expected);
}

TEST_P(SingleRankTyped, AllReduceMaxIsTheIdentity) {
  Bytes data = random_elements(GetParam(), count_, seed());
  const Bytes expected = data;
  comm_.all_reduce_max(data.data(), count_, GetParam());
  EXPECT_EQ(data, expected);
}

TEST_P(SingleRankTyped, AllReduceSumIsTheIdentityOrRejectsBytes) {
  Bytes data = random_elements(GetParam(), count_, seed());
  const Bytes expected = data;
  if (GetParam() == CommType::u8) {
    expect_error([&] { comm_.all_reduce_sum(data.data(), count_, GetParam()); }, "type");
  } else {
    comm_.all_reduce_sum(data.data(), count_, GetParam());
  }
  EXPECT_EQ(data, expected);
}

TEST_P(SingleRankTyped, BroadcastFromRootZeroKeepsTheData) {
  Bytes data = random_elements(GetParam(), count_, seed());
  const Bytes expected = data;
  comm_.broadcast(data.data(), count_, GetParam(), 0);
  EXPECT_EQ(data, expected);
}

TEST_P(SingleRankTyped, SendRecvToSelfCopies) {
  const Bytes send = random_elements(GetParam(), count_, seed());
  Bytes recv(send.size(), 0);
  comm_.send_recv(send.data(), count_, 0, recv.data(), count_, 0, GetParam(), 3);
  EXPECT_EQ(recv, send);
}

TEST_P(SingleRankTyped, SendRecvWithNoPeersLeavesRecvAlone) {
  const Bytes send = random_elements(GetParam(), count_, seed());
  const Bytes before = random_elements(GetParam(), count_, seed() + 1);
  Bytes recv = before;
  comm_.send_recv(send.data(), count_, -1, recv.data(), count_, -1, GetParam(), 3);
  EXPECT_EQ(recv, before);
}

INSTANTIATE_TEST_SUITE_P(AllTypes, SingleRankTyped, ::testing::ValuesIn(kAllTypes),
                         [](const auto& p) { return type_name(p.param); });

// ---- SingleRankCommunicator, shape and argument checks -----------------------------

TEST(SingleRank, IsAGroupOfOne) {
  SingleRankCommunicator comm;
  EXPECT_EQ(comm.rank(), 0);
  EXPECT_EQ(comm.size(), 1);
  EXPECT_STREQ(comm.backend(), "single");
  comm.barrier();
}

// Host tensors over NCCL are refused by name, whichever owner asks; a host
// communicator takes them. (A stand-in that only says "nccl": the check
// must not call it.)
TEST(HostTensors, NeedAHostCommunicator) {
  struct NamedNccl final : Communicator {
    int rank() const override { return 0; }
    int size() const override { return 1; }
    const char* backend() const override { return "nccl"; }
    void all_gather(const void*, void*, std::size_t, CommType) override { ADD_FAILURE(); }
    void all_reduce_sum(void*, std::size_t, CommType) override { ADD_FAILURE(); }
    void all_reduce_max(void*, std::size_t, CommType) override { ADD_FAILURE(); }
    void broadcast(void*, std::size_t, CommType, int) override { ADD_FAILURE(); }
    void send(const void*, std::size_t, CommType, int, int) override { ADD_FAILURE(); }
    void recv(void*, std::size_t, CommType, int, int) override { ADD_FAILURE(); }
    void send_recv(const void*, std::size_t, int, void*, std::size_t, int, CommType, int) override {
      ADD_FAILURE();
    }
    void barrier() override { ADD_FAILURE(); }
    std::unique_ptr<Communicator> split(int, int) override { return nullptr; }
  };
  SingleRankCommunicator single;
  EXPECT_FALSE(is_nccl(single));
  EXPECT_NO_THROW(check_host_tensors_allowed(single, "q", "mixer"));
  NamedNccl nccl;
  EXPECT_TRUE(is_nccl(nccl));
  try {
    check_host_tensors_allowed(nccl, "q", "layer");
    ADD_FAILURE() << "host tensors over NCCL were not refused";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "q");
    EXPECT_NE(std::string(e.what()).find("this layer's is NCCL: pass device tensors"),
              std::string::npos)
        << e.what();
  }
}

TEST(SingleRank, BroadcastFromAnotherRootThrows) {
  SingleRankCommunicator comm;
  double x = 1.5;
  expect_error([&] { comm.broadcast(&x, 1, CommType::f64, 1); }, "root");
  EXPECT_EQ(x, 1.5);
}

TEST(SingleRank, SendToAPeerThrows) {
  SingleRankCommunicator comm;
  float x = 2.f;
  expect_error([&] { comm.send(&x, 1, CommType::f32, 0, 0); }, "peer");
  expect_error([&] { comm.send(&x, 1, CommType::f32, 1, 0); }, "peer");
}

TEST(SingleRank, RecvFromAPeerThrows) {
  SingleRankCommunicator comm;
  float x = 2.f;
  expect_error([&] { comm.recv(&x, 1, CommType::f32, 0, 0); }, "peer");
  expect_error([&] { comm.recv(&x, 1, CommType::f32, 1, 0); }, "peer");
  EXPECT_EQ(x, 2.f);
}

TEST(SingleRank, SendAndRecvWithPeerMinusOneDoNothing) {
  SingleRankCommunicator comm;
  float x = 2.f;
  comm.send(&x, 1, CommType::f32, -1, 0);
  comm.recv(&x, 1, CommType::f32, -1, 0);
  EXPECT_EQ(x, 2.f);
}

// A bad peer is named as the argument it came in: "dest" or "source".
TEST(SingleRank, SendRecvToAnotherPeerThrows) {
  SingleRankCommunicator comm;
  float a = 1.f, b = 2.f;
  expect_error([&] { comm.send_recv(&a, 1, 1, &b, 1, -1, CommType::f32, 0); }, "dest");
  expect_error([&] { comm.send_recv(&a, 1, -1, &b, 1, 1, CommType::f32, 0); }, "source");
  // Sending to self with nobody receiving (or the reverse) cannot complete.
  expect_error([&] { comm.send_recv(&a, 1, 0, &b, 1, -1, CommType::f32, 0); }, "source");
  expect_error([&] { comm.send_recv(&a, 1, -1, &b, 1, 0, CommType::f32, 0); }, "source");
  EXPECT_EQ(b, 2.f);
}

TEST(SingleRank, SendRecvToSelfWithMismatchedCountsThrows) {
  SingleRankCommunicator comm;
  float a[2] = {1.f, 2.f}, b[3] = {0.f, 0.f, 0.f};
  expect_error([&] { comm.send_recv(a, 2, 0, b, 3, 0, CommType::f32, 0); }, "recv_count");
  // More sent than the receive buffer holds: refused, nothing copied past it.
  float c[3] = {1.f, 2.f, 3.f}, d[3] = {0.f, 0.f, 9.f};
  expect_error([&] { comm.send_recv(c, 3, 0, d, 2, 0, CommType::f32, 0); }, "recv_count");
  EXPECT_EQ(d[2], 9.f);
}

TEST(SingleRank, NegativeTagThrows) {
  SingleRankCommunicator comm;
  float a = 1.f, b = 0.f;
  expect_error([&] { comm.send_recv(&a, 1, 0, &b, 1, 0, CommType::f32, -1); }, "tag");
}

TEST(SingleRank, NullBufferWithElementsThrows) {
  SingleRankCommunicator comm;
  float x = 0.f;
  expect_error([&] { comm.all_gather(nullptr, &x, 1, CommType::f32); }, "send");
  expect_error([&] { comm.all_gather(&x, nullptr, 1, CommType::f32); }, "recv");
  expect_error([&] { comm.all_reduce_sum(nullptr, 1, CommType::f32); }, "data");
  expect_error([&] { comm.broadcast(nullptr, 1, CommType::f32, 0); }, "data");
  // An empty message may be null, as in MPI.
  comm.all_gather(nullptr, nullptr, 0, CommType::f32);
}

TEST(SingleRank, SplitGivesAnotherGroupOfOne) {
  SingleRankCommunicator comm;
  const auto sub = comm.split(3, -7);
  ASSERT_NE(sub, nullptr);
  EXPECT_EQ(sub->rank(), 0);
  EXPECT_EQ(sub->size(), 1);
  EXPECT_STREQ(sub->backend(), "single");
  expect_error([&] { comm.split(-1, 0); }, "color");
}

// ---- collective_check on a group of one ------------------------------------------

TEST(CollectiveCheckSingle, PassesSilentlyWhenTheCheckPasses) {
  SingleRankCommunicator comm;
  bool ran = false;
  EXPECT_NO_THROW(collective_check(comm, [&] { ran = true; }));
  EXPECT_TRUE(ran);
}

TEST(CollectiveCheckSingle, RethrowsTheArgumentAndMessage) {
  SingleRankCommunicator comm;
  std::string original;
  try {
    collective_check(comm, [&] {
      try {
        SS_FAIL("q", "has ", 3, " heads, expected 4");
      } catch (const Error& e) {
        original = e.what();
        throw;
      }
    });
    ADD_FAILURE() << "collective_check did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "q");
    EXPECT_EQ(std::string(e.what()), original);
    EXPECT_NE(original.find("has 3 heads, expected 4"), std::string::npos) << original;
    // No rank was set in this process: the failing rank's index in the group.
    EXPECT_EQ(e.rank(), 0);
  }
}

TEST(CollectiveCheckSingle, OtherExceptionsBecomeUnknown) {
  SingleRankCommunicator comm;
  try {
    collective_check(comm, [] { throw std::out_of_range("index 9 of 4"); });
    ADD_FAILURE() << "collective_check did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "unknown");
    EXPECT_NE(std::string(e.what()).find("index 9 of 4"), std::string::npos) << e.what();
  }
}

TEST(CollectiveCheckSingle, NonStandardExceptionsBecomeUnknown) {
  SingleRankCommunicator comm;
  expect_error([&] { collective_check(comm, [] { throw 17; }); }, "unknown");
}

TEST(CollectiveCheckSingle, LongMessagesAreTruncatedAtACharacterBoundary) {
  SingleRankCommunicator comm;
  // Two-byte UTF-8 characters, so an unaligned cut would split one.
  std::string long_text;
  for (int i = 0; i < 3000; ++i) long_text += "\xC3\xA9";
  try {
    collective_check(comm, [&] { SS_FAIL("k", long_text); });
    ADD_FAILURE() << "collective_check did not throw";
  } catch (const Error& e) {
    const std::string text = e.what();
    EXPECT_EQ(e.argument(), "k");
    EXPECT_LT(text.size(), 2048u);
    EXPECT_NE(text.find("argument 'k'"), std::string::npos);
    const std::string marker = " [truncated]";
    ASSERT_GT(text.size(), marker.size());
    EXPECT_EQ(text.substr(text.size() - marker.size()), marker);
    // Everything before the marker is whole characters: the last byte of the
    // kept text ends a two-byte sequence.
    const std::string kept = text.substr(0, text.size() - marker.size());
    EXPECT_EQ(static_cast<unsigned char>(kept.back()), 0xA9u);
    EXPECT_EQ(static_cast<unsigned char>(kept[kept.size() - 2]), 0xC3u);
  }
}

// Text that exactly fills its field (the argument's holds 127 bytes) comes
// through whole, with no truncation marker; one byte more is truncated.
TEST(CollectiveCheckSingle, TextThatExactlyFitsIsNotTruncated) {
  SingleRankCommunicator comm;
  for (const std::size_t length : {std::size_t{127}, std::size_t{128}}) {
    const std::string argument(length, 'a');
    try {
      collective_check(comm, [&] { SS_FAIL(argument, "bad"); });
      ADD_FAILURE() << "collective_check did not throw";
    } catch (const Error& e) {
      if (length == 127) {
        EXPECT_EQ(e.argument(), argument);
      } else {
        EXPECT_EQ(e.argument(), std::string(115, 'a') + " [truncated]");
      }
    }
  }
}

// ---- find_shared_device / shared_device: one GPU claimed by two ranks ----------------

// The DP x CP layout of a 4-GPU node: each rank on the GPU of its world
// node-local rank. Sharing is by identity, so nothing is shared.
TEST(FindSharedDevice, DistinctDevicesOfOneHostAreNotShared) {
  const std::vector<DeviceClaim> claims = {
      {"node0", "GPU-a"}, {"node0", "GPU-b"}, {"node0", "GPU-c"}, {"node0", "GPU-d"}};
  EXPECT_FALSE(find_shared_device(claims).has_value());
}

// One visible GPU per rank (CUDA_VISIBLE_DEVICES=$LOCAL_RANK): every rank
// uses its device 0, but the UUIDs differ, so this is no sharing (counting
// 4 ranks against 1 visible device refused it).
TEST(FindSharedDevice, OneVisibleGpuPerRankIsNotShared) {
  std::vector<DeviceClaim> claims;
  for (int r = 0; r < 4; ++r) claims.push_back({"node0", "GPU-" + std::to_string(r)});
  EXPECT_FALSE(find_shared_device(claims).has_value());
}

// The same device identity on two hosts (PCI bus ids repeat across nodes) is
// two GPUs.
TEST(FindSharedDevice, TheSameDeviceNameOnTwoHostsIsNotShared) {
  const std::vector<DeviceClaim> claims = {{"node0", "PCI 0000:1b:00.0"},
                                           {"node1", "PCI 0000:1b:00.0"}};
  EXPECT_FALSE(find_shared_device(claims).has_value());
}

// Ranks 2 and 3 of a sub-group moved onto GPUs 0 and 1 (the group's own
// node-local rank modulo 4): the first duplicate is reported, by rank.
TEST(FindSharedDevice, NamesTheFirstPairOnOneDeviceOfOneHost) {
  const std::vector<DeviceClaim> claims = {
      {"node0", "GPU-a"}, {"node0", "GPU-b"}, {"node0", "GPU-a"}, {"node0", "GPU-b"}};
  const auto shared = find_shared_device(claims);
  ASSERT_TRUE(shared.has_value());
  EXPECT_EQ(*shared, std::make_pair(0, 2));
}

TEST(FindSharedDevice, PairsAcrossOtherHostsAndOrdersByTheSecondRank) {
  const std::vector<DeviceClaim> claims = {
      {"node0", "GPU-a"}, {"node1", "GPU-x"}, {"node0", "GPU-b"}, {"node1", "GPU-x"}};
  EXPECT_EQ(find_shared_device(claims), std::make_optional(std::make_pair(1, 3)));
}

// A rank without a device claims nothing and shares nothing.
TEST(FindSharedDevice, EmptyClaimsNeverConflict) {
  const std::vector<DeviceClaim> claims = {{"node0", ""}, {"node0", ""}, {"node0", "GPU-a"}};
  EXPECT_FALSE(find_shared_device(claims).has_value());
  EXPECT_FALSE(find_shared_device({}).has_value());
}

// A group of one never shares; the gather goes through the communicator.
TEST(SharedDeviceSingle, AGroupOfOneSharesNothing) {
  SingleRankCommunicator comm;
  EXPECT_EQ(shared_device(comm, "GPU-a"), "");
  EXPECT_EQ(shared_device(comm, ""), "");
}

}  // namespace
}  // namespace statescan
