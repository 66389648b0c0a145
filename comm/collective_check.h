// Collective argument checking: a bad input seen by one rank must become the
// same statescan::Error on every rank, not a hang of the others in the next
// collective.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

#include "comm/communicator.h"

namespace statescan {

// Runs `check` on every rank, then agrees: if it threw on any rank, every rank
// throws a statescan::Error carrying the lowest failing rank's argument name
// and message (the rank in the message is the one that saw the fault).
// Collective; costs one small all-reduce when nothing failed (plus one
// broadcast of the message when something did).
void collective_check(Communicator& comm, const std::function<void()>& check);

// FNV-1a of `bytes` bytes: lets the ranks confirm with one small all-gather
// that they hold the same array (initial weights, packed-sequence offsets).
int64_t content_hash(const void* data, std::size_t bytes);

}  // namespace statescan
