// The distributed scan of DESIGN §5 on device maps: the same exclusive scan
// as parallel/exchange.h (same strategies, same fp32 result, same bytes_sent
// definitions as predicted_exchange_bytes), with M, E and the result in GPU
// memory and the work queued on a CUDA stream.
//
// With an NCCL communicator (backend() == "nccl") the maps never leave the
// GPU: allgather is one ncclAllGather then local composition, ring hands the
// state on in blocks along Dv (each block is sent as soon as it is computed,
// so the next rank starts while this one works on the next block), tree is an
// exclusive Kogge-Stone scan with grouped send/recv. The communicator's
// stream is set to `stream` for the call (and restored), so everything is
// stream-ordered; the call returns once the operations are queued.
// With a host communicator (mpi: ranks may share a GPU) the same device scans
// run and each message is staged through host memory (the host waits for
// `stream` around every message; the last step, the result into `incoming`,
// is still queued on `stream` when the call returns, as over NCCL), so one
// GPU tests the scans the NCCL path runs.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "comm/communicator.h"
#include "core/options.h"
#include "parallel/exchange.h"

namespace statescan {

struct DeviceScanMaps {
  int64_t rows = 0, heads = 0, dk = 0, dv = 0;
  bool diagonal = false;     // M holds Dk floats per (row, head)
  const float* M = nullptr;  // device [rows, heads, Dk(, Dk)]
  const float* E = nullptr;  // device [rows, heads, Dk, Dv]

  int64_t m_size() const { return diagonal ? dk : dk * dk; }
  int64_t maps() const { return rows * heads; }
};

// Collective over `comm`. Writes S_in of this rank to `incoming` (device,
// [rows, heads, Dk, Dv]; zeros for the first rank in scan order) and returns
// the bytes this rank sent. `strategy` must be resolved.
//
// `maps_ready` (optional): `stream` waits for it before any of the
// exchange's work, the ring's first receive included, although that reads
// none of M and E. Posted while the summary that makes them runs, an NCCL
// receive keeps its kernel resident (640 threads at 96 registers: a whole
// multiprocessor a block) beside a summary that is one wave of clusters of
// two sized to the GPCs, with two multiprocessors to spare: on an H100,
// three taken before it launched made Gated DeltaNet's summary 1.78 ms
// instead of 1.00 (PERF_NOTES, sixty-sixth session). `started` (optional)
// is recorded on `stream` where the exchange's own work begins.
int64_t exclusive_scan_device(Communicator& comm, Exchange strategy, const DeviceScanMaps& maps,
                              ScanOrder order, float* incoming, cudaStream_t stream,
                              cudaEvent_t maps_ready = nullptr, cudaEvent_t started = nullptr);

// measure_link (parallel/exchange.h) for an NCCL communicator: the same ring
// shifts of device buffers, timed on the GPU by events around each shift on
// the communicator's stream; the ranks agree on the slowest figures. Other
// communicators fall back to measure_link. Collective.
LinkModel measure_link_device(Communicator& comm, const LinkModel& base);

}  // namespace statescan
