// Collective argument checking: a bad input seen by one rank must become the
// same statescan::Error on every rank, not a hang of the others in the next
// collective.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "comm/communicator.h"

namespace statescan {

// Runs `check` on every rank, then agrees: if it threw on any rank, every rank
// throws a statescan::Error carrying the lowest failing rank's argument name
// and message (the rank in the message is the one that saw the fault).
// Collective; costs one small all-reduce when nothing failed (plus one
// broadcast of the message when something did).
void collective_check(Communicator& comm, const std::function<void()>& check);

// Runs `body`; when it throws something its peers do not already know of
// (any exception but a statescan::Error with peers_know() set), tells each
// group of `groups` (Communicator::notify_failure; null entries skipped) and
// rethrows, so that peers waiting for this rank fail at once, naming it and
// its error, instead of at their timeout. For a layer's calls between
// collectives: an error collective_check raised is every rank's already.
void tell_peers_on_failure(std::initializer_list<Communicator*> groups,
                           const std::function<void()>& body);

// `text` when it has at most `max_bytes` bytes, else its start cut at a UTF-8
// character boundary (never inside a multi-byte sequence) and marked
// " [truncated]", within `max_bytes` in all: the form in which error texts
// travel to other ranks (collective_check's report, fault notices).
std::string clip_text(const std::string& text, std::size_t max_bytes);

// FNV-1a of `bytes` bytes: lets the ranks confirm with one small all-gather
// that they hold the same array (initial weights, packed-sequence offsets).
int64_t content_hash(const void* data, std::size_t bytes);

// One rank's claim on a device: the host it runs on and the device's identity
// there (a GPU's UUID, say). An empty `device` claims nothing.
struct DeviceClaim {
  std::string host;
  std::string device;
};

// The first two ranks (in the order of the second, then the first) whose
// claims name the same non-empty device on the same host, or nullopt when no
// device is claimed twice. `claims[r]` is rank r's. Local and pure: the rule
// behind shared_device().
std::optional<std::pair<int, int>> find_shared_device(const std::vector<DeviceClaim>& claims);

// All-gathers every rank's claim (its host name and `device`) over `comm`, a
// communicator of host buffers, and describes the first device claimed twice
// (find_shared_device): "" when none is, else "ranks i and j would both use
// <device> on host <host>". Deciding by identity rather than by counting ranks
// and devices per node is what keeps one visible GPU per rank
// (CUDA_VISIBLE_DEVICES) from looking shared. Collective: every rank returns
// the same text.
std::string shared_device(Communicator& comm, const std::string& device);

}  // namespace statescan
