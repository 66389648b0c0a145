// How statescan-run's ranks exchange on the GPU (--cp-comm), one rule for the
// linear-attention CP job and the LaCT job.
#pragma once

#include "comm/communicator.h"
#include "comm/mpi_communicator.h"
#include "core/options.h"
#include "launch/run_options.h"

namespace statescan::launch {

// The job's device, the same on every rank or the same error on every rank
// (collective): cuda needs a CUDA build and a visible GPU on every rank; auto
// picks cuda where every rank sees a GPU and cpu where none does, and refuses
// a mix (a node without a GPU would otherwise send its ranks down the CPU
// path's collectives while the others run the GPU's). Then --cp-comm against
// it: nccl needs --device cuda (the CPU path exchanges over MPI).
DeviceKind agree_device(Communicator& comm, const RunOptions& options);

// Whether a --device cuda job over `mpi` exchanges over NCCL. Collective: every
// rank returns the same.
//   mpi:  no (staged through host memory; ranks may share a GPU);
//   nccl: yes; refused naming --cp-comm in a build without NCCL or where two
//         ranks would drive the same GPU (NCCL needs a GPU per rank; decided
//         by NcclCommunicator::gpu_conflict, i.e. by GPU identity, so one
//         visible GPU per rank counts as a GPU each);
//   auto: yes when built with NCCL and no two ranks share a GPU, else the
//         MPI staging (the run's header names the exchange it got).
// A single rank exchanges nothing: false.
bool exchange_over_nccl(RunOptions::CpComm choice, MpiCommunicator& mpi);

}  // namespace statescan::launch
