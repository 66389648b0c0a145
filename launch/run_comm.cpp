#include "launch/run_comm.h"

#include <cstdint>

#include "comm/communicator.h"
#include "core/error.h"
#ifdef STATESCAN_HAS_CUDA
#include <cuda_runtime.h>
#endif

namespace statescan::launch {

void check_cp_comm(const RunOptions& options, DeviceKind device) {
  SS_CHECK_ARG(options.cp_comm != RunOptions::CpComm::nccl || device == DeviceKind::cuda,
               "--cp-comm", "nccl applies to --device cuda only (the CPU path exchanges over MPI)");
}

bool exchange_over_nccl(RunOptions::CpComm choice, MpiCommunicator& mpi) {
  using CpComm = RunOptions::CpComm;
  if (mpi.size() == 1 || choice == CpComm::mpi) return false;
#ifdef STATESCAN_HAS_NCCL
  // Whether some node has more ranks than GPUs (a test setup): every rank
  // learns it, so that all of them take the same path or the same error.
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) devices = 0;
  int64_t short_of_gpus = mpi.local_size() > devices ? 1 : 0;
  mpi.all_reduce_max(&short_of_gpus, 1, CommType::i64);
  SS_CHECK_ARG(choice != CpComm::nccl || short_of_gpus == 0, "--cp-comm",
               "nccl needs a GPU per rank, but a node has more ranks than visible GPUs; "
               "--cp-comm mpi runs ranks that share a GPU");
  return short_of_gpus == 0;
#else
  SS_CHECK_ARG(choice != CpComm::nccl, "--cp-comm", "nccl requested but this build has no NCCL");
  return false;
#endif
}

}  // namespace statescan::launch
