// How statescan-run's ranks exchange on the GPU (--cp-comm), one rule for the
// linear-attention CP job and the LaCT job.
#pragma once

#include "comm/mpi_communicator.h"
#include "core/options.h"
#include "launch/run_options.h"

namespace statescan::launch {

// --cp-comm against the device the job resolved to: nccl needs --device cuda
// (the CPU path exchanges over MPI). Same result on every rank (argv is).
void check_cp_comm(const RunOptions& options, DeviceKind device);

// Whether a --device cuda job over `mpi` exchanges over NCCL. Collective: every
// rank returns the same.
//   mpi:  no (staged through host memory; ranks may share a GPU);
//   nccl: yes; refused naming --cp-comm in a build without NCCL or where a
//         node has more ranks than visible GPUs (NCCL needs a GPU per rank);
//   auto: yes when built with NCCL and every node has a GPU per rank, else the
//         MPI staging (the run's header names the exchange it got).
// A single rank exchanges nothing: false.
bool exchange_over_nccl(RunOptions::CpComm choice, MpiCommunicator& mpi);

}  // namespace statescan::launch
