// TrainerState: a test trainer's tensors in one shared-memory region, filled with a
// pattern that depends on (seed, version), so any byte read back can be checked.
#pragma once

#include <ckpt/client.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace ckpt::test {

class TrainerState {
 public:
  // `tensors` float32 tensors of `tensor_bytes` each (a multiple of 8).
  TrainerState(std::size_t tensors, std::size_t tensor_bytes, std::uint64_t seed = 1);

  std::vector<TensorItem> Items(const std::string& prefix = "t") const;
  // Overwrites every tensor with the content of `version`.
  void Fill(std::uint64_t version);
  // Index of the first tensor whose bytes differ from `version`'s content, or -1.
  int FirstMismatch(std::uint64_t version) const;
  // The bytes tensor `t` holds at `version`.
  std::string Expected(std::size_t t, std::uint64_t version) const;

  const std::shared_ptr<SharedRegion>& region() const { return region_; }
  std::size_t tensors() const { return tensors_; }
  std::size_t tensor_bytes() const { return tensor_bytes_; }
  std::uint64_t total_bytes() const { return tensors_ * tensor_bytes_; }

 private:
  std::size_t tensors_, tensor_bytes_;
  std::uint64_t seed_;
  std::shared_ptr<SharedRegion> region_;
};

// Reads the bytes of item `name` from a shard file (using the format library's header
// parser), or throws.
std::string ReadShardItem(const std::string& shard_path, const std::string& name);

}  // namespace ckpt::test
