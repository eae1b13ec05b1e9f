#include "support/trainer_state.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <stdexcept>

#include "common/unique_fd.h"
#include "format/shard_format.h"

namespace ckpt::test {
namespace {

std::uint64_t Base(std::uint64_t seed, std::size_t t, std::uint64_t version) {
  std::uint64_t x = seed * 0x9E3779B97F4A7C15ull ^ (std::uint64_t{t} << 40) ^ version;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

constexpr std::uint64_t kStep = 0xD6E8FEB86659FD93ull;

}  // namespace

TrainerState::TrainerState(std::size_t tensors, std::size_t tensor_bytes, std::uint64_t seed)
    : tensors_(tensors), tensor_bytes_(tensor_bytes), seed_(seed) {
  if (tensor_bytes % 8 != 0) throw std::invalid_argument("tensor_bytes must be a multiple of 8");
  region_ = SharedRegion::create(tensors * tensor_bytes);
}

std::vector<TensorItem> TrainerState::Items(const std::string& prefix) const {
  std::vector<TensorItem> items;
  for (std::size_t t = 0; t < tensors_; ++t) {
    items.push_back({prefix + std::to_string(t),
                     DType::kF32,
                     {static_cast<std::int64_t>(tensor_bytes_ / 4)},
                     region_,
                     t * tensor_bytes_});
  }
  return items;
}

void TrainerState::Fill(std::uint64_t version) {
  auto* words = static_cast<std::uint64_t*>(region_->data());
  const std::size_t n = tensor_bytes_ / 8;
  for (std::size_t t = 0; t < tensors_; ++t) {
    std::uint64_t base = Base(seed_, t, version);
    for (std::size_t i = 0; i < n; ++i) words[t * n + i] = base + i * kStep;
  }
}

int TrainerState::FirstMismatch(std::uint64_t version) const {
  const auto* words = static_cast<const std::uint64_t*>(region_->data());
  const std::size_t n = tensor_bytes_ / 8;
  for (std::size_t t = 0; t < tensors_; ++t) {
    std::uint64_t base = Base(seed_, t, version);
    for (std::size_t i = 0; i < n; ++i) {
      if (words[t * n + i] != base + i * kStep) return static_cast<int>(t);
    }
  }
  return -1;
}

std::string TrainerState::Expected(std::size_t t, std::uint64_t version) const {
  std::string out(tensor_bytes_, '\0');
  auto* words = reinterpret_cast<std::uint64_t*>(out.data());
  std::uint64_t base = Base(seed_, t, version);
  for (std::size_t i = 0; i < tensor_bytes_ / 8; ++i) words[i] = base + i * kStep;
  return out;
}

std::string ReadShardItem(const std::string& shard_path, const std::string& name) {
  auto info = ReadShardHeader(shard_path);
  if (!info.ok()) throw std::runtime_error(info.status().message());
  for (const auto& item : info->items) {
    if (item.name != name) continue;
    UniqueFd fd(::open(shard_path.c_str(), O_RDONLY | O_CLOEXEC));
    std::string out(item.length, '\0');
    std::size_t done = 0;
    while (done < out.size()) {
      ssize_t r = ::pread(fd.get(), out.data() + done, out.size() - done,
                          static_cast<off_t>(info->data_start + item.offset + done));
      if (r <= 0) throw std::runtime_error("short read of " + shard_path);
      done += static_cast<std::size_t>(r);
    }
    return out;
  }
  throw std::runtime_error("no item " + name + " in " + shard_path);
}

}  // namespace ckpt::test
