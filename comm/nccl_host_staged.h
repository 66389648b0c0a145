#pragma once
// Host-buffer collectives over an NCCL communicator, for control planes
// (argument agreement, collective error reports: a few bytes per call) of
// layers whose data path runs on NCCL. Each call copies through a device
// buffer on the NCCL communicator's stream and waits through it, so the
// communicator's timeout and abort watch the wait. Point-to-point and split
// are not needed there and are refused. NCCL builds only.

#include <cstddef>
#include <memory>
#include <string>

#include "comm/communicator.h"
#include "comm/nccl_communicator.h"

namespace statescan {

class NcclHostStaged final : public Communicator {
 public:
  explicit NcclHostStaged(NcclCommunicator& nccl) : nccl_(nccl) {}
  ~NcclHostStaged() override;
  NcclHostStaged(const NcclHostStaged&) = delete;
  NcclHostStaged& operator=(const NcclHostStaged&) = delete;

  int rank() const override { return nccl_.rank(); }
  int size() const override { return nccl_.size(); }
  const char* backend() const override { return "nccl-host-staged"; }
  void all_gather(const void* send, void* recv, std::size_t count, CommType type) override;
  void all_reduce_sum(void* data, std::size_t count, CommType type) override;
  void all_reduce_max(void* data, std::size_t count, CommType type) override;
  void broadcast(void* data, std::size_t count, CommType type, int root) override;
  void send(const void*, std::size_t, CommType, int, int) override { refuse("send"); }
  void recv(void*, std::size_t, CommType, int, int) override { refuse("recv"); }
  void send_recv(const void*, std::size_t, int, void*, std::size_t, int, CommType, int) override {
    refuse("send_recv");
  }
  void barrier() override { nccl_.barrier(); }
  std::unique_ptr<Communicator> split(int, int) override { refuse("split"); }
  void notify_failure(const std::string& what) noexcept override { nccl_.notify_failure(what); }

 private:
  [[noreturn]] static void refuse(const char* op);
  char* reserve(std::size_t bytes);  // the staging buffer, grown on demand
  char* stage_in(const void* host, std::size_t bytes);
  // Host <-> device copies that wait (watched) for the stream first.
  void copy_in(void* dev, const void* host, std::size_t bytes);
  void to_host(void* host, const void* dev, std::size_t bytes);

  NcclCommunicator& nccl_;
  void* buffer_ = nullptr;
  std::size_t capacity_ = 0;
};

}  // namespace statescan
