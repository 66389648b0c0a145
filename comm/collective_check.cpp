#include "comm/collective_check.h"

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/error.h"

namespace statescan {
namespace {

// Fixed-size fields of the broadcast that carries the failure, so every rank
// knows the message size without a second collective.
constexpr std::size_t kRankBytes = sizeof(int64_t);
constexpr std::size_t kArgumentBytes = 128;
constexpr std::size_t kMessageBytes = 2048;
constexpr std::size_t kPayloadBytes = kRankBytes + kArgumentBytes + kMessageBytes;

// Fixed-size fields of a device claim in shared_device()'s all-gather. Linux
// host names have at most 64 bytes (HOST_NAME_MAX), a GPU UUID in
// nvidia-smi's form 40.
constexpr std::size_t kHostBytes = 256;
constexpr std::size_t kDeviceBytes = 128;
constexpr std::size_t kClaimBytes = kHostBytes + kDeviceBytes;

// Writes `text` NUL-terminated into `out[0, capacity)`, clipped (clip_text)
// to capacity - 1 bytes.
void pack_text(const std::string& text, unsigned char* out, std::size_t capacity) {
  std::memset(out, 0, capacity);
  const std::string clipped = clip_text(text, capacity - 1);
  std::memcpy(out, clipped.data(), clipped.size());
}

std::string unpack_text(const unsigned char* in, std::size_t capacity) {
  const auto* begin = reinterpret_cast<const char*>(in);
  return std::string(begin, std::find(begin, begin + capacity, '\0'));
}

struct Failure {
  bool failed = false;
  std::string argument;
  std::string what_text;
  int64_t rank = -1;  // the rank the raising Error recorded; -1 if none was set
};

// Runs `check`, turning whatever it throws into a Failure. Exceptions that are
// not statescan::Error get the argument "unknown" and the usual message form.
Failure run_check(const std::function<void()>& check) {
  Failure f;
  try {
    check();
    return f;
  } catch (const Error& e) {
    f.argument = e.argument();
    f.what_text = e.what();
    f.rank = e.rank();
  } catch (const std::exception& e) {
    f.argument = "unknown";
    f.what_text =
        Error("unknown", detail::concat("unexpected exception: ", e.what()), nullptr, 0).what();
    f.rank = error_rank();
  } catch (...) {
    f.argument = "unknown";
    f.what_text = Error("unknown", "unexpected non-standard exception", nullptr, 0).what();
    f.rank = error_rank();
  }
  f.failed = true;
  return f;
}

}  // namespace

std::string clip_text(const std::string& text, std::size_t max_bytes) {
  if (text.size() <= max_bytes) return text;
  static constexpr char kMarker[] = " [truncated]";
  const std::size_t marker = sizeof(kMarker) - 1;
  const bool marked = max_bytes >= marker;  // else no room for the mark
  std::size_t keep = marked ? max_bytes - marker : max_bytes;
  // Continuation bytes look like 10xxxxxx; back off to the start of the
  // character so the cut never splits one.
  while (keep > 0 && (static_cast<unsigned char>(text[keep]) & 0xC0u) == 0x80u) --keep;
  return text.substr(0, keep) + (marked ? kMarker : "");
}

// Agreement takes one all-reduce when every rank passed, plus one broadcast
// when any failed; both are issued by every rank whatever its outcome, so the
// ranks always make the same collective calls and nobody is left waiting.
void collective_check(Communicator& comm, const std::function<void()>& check) {
  const Failure mine = run_check(check);

  // The two collectives' buffers are on the heap: a collective that times
  // out stays posted (MPI cannot cancel one) and may still write its buffer
  // when a late peer arrives, so on a throw the buffer is handed to it, not
  // freed (bytes, on a path that ends the job).
  auto keep_on_throw = [](auto& buffer, auto&& call) {
    try {
      call();
    } catch (...) {
      (void)buffer.release();
      throw;
    }
  };

  // Max of (size - rank) over failing ranks picks the lowest failing rank.
  auto lowest =
      std::make_unique<int64_t>(mine.failed ? static_cast<int64_t>(comm.size() - comm.rank()) : 0);
  keep_on_throw(lowest, [&] { comm.all_reduce_max(lowest.get(), 1, CommType::i64); });
  if (*lowest == 0) return;
  const int failing = comm.size() - static_cast<int>(*lowest);

  auto payload = std::make_unique<unsigned char[]>(kPayloadBytes);  // zeroed
  unsigned char* bytes = payload.get();
  if (comm.rank() == failing) {
    // Report the rank the error named (the world rank in MPI jobs); when none
    // was set, the failing rank's index in this group.
    const int64_t reported = mine.rank >= 0 ? mine.rank : failing;
    std::memcpy(bytes, &reported, kRankBytes);
    pack_text(mine.argument, bytes + kRankBytes, kArgumentBytes);
    pack_text(mine.what_text, bytes + kRankBytes + kArgumentBytes, kMessageBytes);
  }
  keep_on_throw(payload, [&] { comm.broadcast(bytes, kPayloadBytes, CommType::u8, failing); });

  int64_t reported = 0;
  std::memcpy(&reported, bytes, kRankBytes);
  Error agreed(unpack_text(bytes + kRankBytes, kArgumentBytes),
               unpack_text(bytes + kRankBytes + kArgumentBytes, kMessageBytes),
               static_cast<int>(reported));
  throw agreed.mark_peers_know();
}

void tell_peers_on_failure(std::initializer_list<Communicator*> groups,
                           const std::function<void()>& body) {
  auto tell = [&](const std::string& what) {
    for (Communicator* group : groups)
      if (group != nullptr) group->notify_failure(what);
  };
  try {
    body();
  } catch (const Error& e) {
    if (!e.peers_know()) tell(e.what());
    throw;
  } catch (const std::exception& e) {
    tell(detail::concat("unexpected exception: ", e.what()));
    throw;
  } catch (...) {
    tell("unexpected non-standard exception");
    throw;
  }
}

int64_t content_hash(const void* data, std::size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t h = 1469598103934665603ull;
  for (std::size_t i = 0; i < bytes; ++i) {
    h ^= p[i];
    h *= 1099511628211ull;
  }
  int64_t out = 0;
  std::memcpy(&out, &h, sizeof(out));
  return out;
}

std::optional<std::pair<int, int>> find_shared_device(const std::vector<DeviceClaim>& claims) {
  // The first rank seen on each (host, device); a NUL joins the two, since
  // neither a host name nor a device identity contains one.
  std::unordered_map<std::string, int> first;
  for (std::size_t r = 0; r < claims.size(); ++r) {
    if (claims[r].device.empty()) continue;
    const auto [it, inserted] =
        first.emplace(claims[r].host + '\0' + claims[r].device, static_cast<int>(r));
    if (!inserted) return std::make_pair(it->second, static_cast<int>(r));
  }
  return std::nullopt;
}

std::string shared_device(Communicator& comm, const std::string& device) {
  char host[kHostBytes] = {};
  // A failure leaves the name empty: such ranks then count as one host, which
  // can only report sharing where there is none, never hide it.
  if (gethostname(host, sizeof host - 1) != 0) host[0] = '\0';
  // Every rank's claim, then this rank's outgoing copy, in one heap block
  // that is handed over on a throw, as in collective_check: a timed-out
  // all-gather stays posted and may still read and write it.
  const auto size = static_cast<std::size_t>(comm.size());
  auto all = std::make_unique<unsigned char[]>((size + 1) * kClaimBytes);
  unsigned char* mine = all.get() + size * kClaimBytes;
  pack_text(host, mine, kHostBytes);
  pack_text(device, mine + kHostBytes, kDeviceBytes);
  try {
    comm.all_gather(mine, all.get(), kClaimBytes, CommType::u8);
  } catch (...) {
    (void)all.release();
    throw;
  }
  std::vector<DeviceClaim> claims(size);
  for (std::size_t r = 0; r < size; ++r) {
    const unsigned char* claim = all.get() + r * kClaimBytes;
    claims[r] = {unpack_text(claim, kHostBytes), unpack_text(claim + kHostBytes, kDeviceBytes)};
  }
  const auto shared = find_shared_device(claims);
  if (!shared) return "";
  const DeviceClaim& c = claims[static_cast<std::size_t>(shared->second)];
  return detail::concat("ranks ", shared->first, " and ", shared->second, " would both use ",
                        c.device, " on host ", c.host.empty() ? "?" : c.host);
}

}  // namespace statescan
