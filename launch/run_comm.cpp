#include "launch/run_comm.h"

#include <cstdint>
#include <string>

#include "comm/collective_check.h"
#include "comm/communicator.h"
#include "core/error.h"
#ifdef STATESCAN_HAS_CUDA
#include <cuda_runtime.h>

#include "kernels/cuda/cuda_mixer.h"
#endif
#ifdef STATESCAN_HAS_NCCL
#include "comm/nccl_communicator.h"
#endif

namespace statescan::launch {

DeviceKind agree_device(Communicator& comm, const RunOptions& options) {
  const DeviceKind requested = options.device;
  bool gpu = false;
#ifdef STATESCAN_HAS_CUDA
  gpu = cuda::device_available();
#endif
  // How many ranks see no GPU (a sum: every rank learns the same count).
  int64_t without = gpu ? 0 : 1;
  comm.all_reduce_sum(&without, 1, CommType::i64);
  DeviceKind device = requested;
  collective_check(comm, [&] {
#ifndef STATESCAN_HAS_CUDA
    SS_CHECK_ARG(requested != DeviceKind::cuda, "--device",
                 "cuda requested but this build has no CUDA; use --device cpu");
#endif
    SS_CHECK_ARG(requested != DeviceKind::cuda || gpu, "--device",
                 "cuda requested but no CUDA device is visible; use --device cpu");
    if (requested == DeviceKind::automatic) {
      SS_CHECK_ARG(without == 0 || without == comm.size(), "--device", "auto: ", without, " of ",
                   comm.size(),
                   " ranks see no CUDA device and the others do; pass --device cpu, or give "
                   "every rank a GPU");
      device = without == 0 ? DeviceKind::cuda : DeviceKind::cpu;
    }
    SS_CHECK_ARG(options.cp_comm != RunOptions::CpComm::nccl || device == DeviceKind::cuda,
                 "--cp-comm",
                 "nccl applies to --device cuda only (the CPU path exchanges over MPI)");
  });
  return device;
}

bool exchange_over_nccl(RunOptions::CpComm choice, MpiCommunicator& mpi) {
  using CpComm = RunOptions::CpComm;
  if (mpi.size() == 1 || choice == CpComm::mpi) return false;
#ifdef STATESCAN_HAS_NCCL
  // Whether two ranks would drive one GPU (a test setup), by the rule and the
  // check NcclCommunicator::create() applies: every rank learns the same, so
  // that all of them take the same path or the same error.
  const std::string conflict = NcclCommunicator::gpu_conflict(mpi);
  SS_CHECK_ARG(choice != CpComm::nccl || conflict.empty(), "--cp-comm",
               "nccl needs a GPU per rank, but ", conflict,
               "; --cp-comm mpi runs ranks that share a GPU");
  return conflict.empty();
#else
  SS_CHECK_ARG(choice != CpComm::nccl, "--cp-comm", "nccl requested but this build has no NCCL");
  return false;
#endif
}

}  // namespace statescan::launch
