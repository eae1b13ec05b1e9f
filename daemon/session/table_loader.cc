#include "daemon/session/table_loader.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <map>
#include <set>

#include "common/names.h"
#include "daemon/io/shm_importer.h"

namespace ckpt {
namespace {

// The size of a trainer's release words (client/release_words.h): one page.
constexpr std::size_t kTrainerReleaseWordsBytes = 4096;

}  // namespace

Result<std::shared_ptr<ImportedRegion>> TableLoader::OpenTable(const std::string& name, uid_t uid) {
  auto table = importer_.Import(name, uid, sizeof(TableHeader));
  if (!table.ok()) return table.status().With("descriptor table");
  return table;
}

Status TableLoader::Load(Session& s, const ItemLayouts* layouts) {
  auto size = s.table->CurrentSize();
  if (!size.ok()) return size.status();
  auto read = [&](std::uint64_t off, void* dst, std::size_t len) { return s.table->ReadAt(off, dst, len); };
  std::uint64_t generation = 0;
  auto items = ReadDescriptorTable(read, size.value(), &generation);
  if (!items.ok()) return items.status();
  std::map<std::string, std::uint64_t> needed;  // region -> bytes its items need
  std::set<std::string> names;
  std::uint64_t total = 0;
  std::vector<ShardItem> shard_items;
  shard_items.reserve(items->size());
  for (const auto& it : items.value()) {
    if (std::string err = CheckItemName(it.name); !err.empty()) return InvalidArgument(err);
    if (!names.insert(it.name).second) return AlreadyExists("duplicate item name " + QuoteName(it.name));
    ShardItem item;
    item.name = it.name;
    item.kind = ItemKind::kTensor;
    item.dtype = it.dtype;
    item.shape = it.shape;
    item.length = it.length;
    if (Status st = CheckItemShape(item); !st.ok()) return st;
    shard_items.push_back(std::move(item));
    if (it.offset > UINT64_MAX - it.length) {
      return InvalidArgument("item " + QuoteName(it.name) + ": offset + length overflows");
    }
    // Items may overlap and a sparse region may be huge: the sum is bounded before it is
    // taken, so it can never wrap (2^17 items of 2^47 bytes sum to exactly 2^64).
    if (it.length > kMaxShardDataBytes - total) {
      return InvalidArgument("items total more than " + std::to_string(kMaxShardDataBytes) +
                             " bytes (at item " + QuoteName(it.name) + "): not one rank's state");
    }
    std::uint64_t& need = needed[it.region];
    need = std::max(need, it.offset + it.length);
    total += it.length;
  }
  // Layouts are checked before any region is imported: a bad one costs no mapping.
  const ItemLayouts& wanted = layouts ? *layouts : s.layouts;
  {
    std::map<std::string_view, std::size_t> by_name;
    for (std::size_t i = 0; i < shard_items.size(); ++i) by_name.emplace(shard_items[i].name, i);
    std::set<std::string_view> laid_out;
    for (const auto& [name, layout] : wanted) {
      auto it = by_name.find(name);
      if (it == by_name.end()) {
        return InvalidArgument("layout for item " + QuoteName(name) +
                               ", which is no tensor item of the registration (blobs have no layout)");
      }
      if (!laid_out.insert(name).second)
        return InvalidArgument("item " + QuoteName(name) + " has two layouts");
      ShardItem& item = shard_items[it->second];
      GlobalLayout resolved = layout;
      if (Status st = ResolveLayout(item.name, item.shape, &resolved); !st.ok()) return st;
      if (!resolved.replicated) item.blocks.block_bytes = kBlockBytes;
      item.layout = std::move(resolved);
    }
  }
  std::map<std::string, std::shared_ptr<ImportedRegion>> fresh;
  for (const auto& [name, need] : needed) {
    // Opened afresh on every (re-)registration: the name may now refer to a new object.
    const bool device_region = backend_ && backend_->Owns(name);
    if (!device_region && name.starts_with("cuda:")) {
      return FailedPrecondition("region " + name.substr(0, 40) +
                                "... is GPU memory, but this daemon has no CUDA backend (" +
                                no_backend_reason_ + ")");
    }
    auto imported =
        device_region ? backend_->Import(name, s.peer.pid, 0) : importer_.Import(name, s.peer.uid, 0);
    if (!imported.ok()) return imported.status();
    std::shared_ptr<ImportedRegion> region = std::move(imported).value();
    auto cur = region->CurrentSize();
    if (!cur.ok()) return cur.status();
    if (cur.value() < need) {
      for (const auto& it : items.value()) {
        if (it.region == name && it.offset + it.length > cur.value()) {
          return InvalidArgument("item " + QuoteName(it.name) + " needs bytes [" + std::to_string(it.offset) +
                                 ", " + std::to_string(it.offset + it.length) + ") of region " + name +
                                 ", which is only " + std::to_string(cur.value()) + " bytes");
        }
      }
    }
    fresh[name] = std::move(region);
  }
  int device = -1;
  for (const auto& [name, region] : fresh) {
    if (region->device() < 0) continue;
    if (device >= 0 && region->device() != device) {
      return InvalidArgument("tensors of one registration are on two GPUs (daemon devices " +
                             std::to_string(device) + " and " + std::to_string(region->device()) +
                             "); register one rank's GPU only");
    }
    device = region->device();
  }
  if (s.events && device >= 0 && device != s.events->device()) {
    return FailedPrecondition("the tensors moved to another GPU than the session's; register again");
  }
  // The last check: nothing after it can fail, so the budget always matches the table held.
  if (Status st = items_.Resize(s.peer.uid, s.id, items->size()); !st.ok()) return st;
  s.device = device;
  s.items = std::move(items).value();
  s.item_regions.clear();
  auto tensors = std::make_shared<TensorSet>();
  for (const auto& it : s.items) {
    s.item_regions.push_back(fresh.at(it.region));
    tensors->sources.push_back(ItemSource{s.item_regions.back(), it.offset, nullptr});
  }
  tensors->items = std::move(shard_items);
  tensors->bytes = total;
  s.tensors = std::move(tensors);
  s.item_names.clear();
  for (const auto& it : s.items) s.item_names.insert(it.name);
  s.tensor_bytes = total;
  s.table_generation = generation;
  if (layouts) s.layouts = *layouts;
  {
    MutexLock lock(s.regions_mu);
    s.regions.clear();
    for (auto& [name, region] : fresh) s.regions.push_back(std::move(region));
  }
  return Status::Ok();
}

Status TableLoader::AttachDevice(Session& s, const DeviceRegistration& device,
                                 std::vector<std::string>* daemon_events) {
  if (s.device < 0) return Status::Ok();
  if (!device.present || device.trainer_events.empty()) {
    return InvalidArgument(
        "GPU tensors need the registration's CUDA session (device UUID and trainer events)");
  }
  if (!s.events) {
    // The release words are optional: a trainer's object the daemon cannot map leaves the
    // session on events only, and the reply says so.
    TrainerReleaseWords words;
    if (!device.release_words.empty()) {
      auto mapped = MapShmObject(device.release_words, s.peer.uid, kTrainerReleaseWordsBytes);
      if (mapped.ok()) {
        words = TrainerReleaseWords{mapped.value()->data(), kTrainerReleaseWordsBytes, device.release_base,
                                    std::move(mapped).value()};
      } else {
        spdlog::info("session {}: release words not used: {}", s.id, mapped.status().message());
      }
    }
    auto events =
        backend_->OpenSession(s.peer.pid, device.device_uuid, device.trainer_events,
                              words.keep ? &words : nullptr);
    if (!events.ok()) return events.status().With("open the trainer's CUDA events");
    if (events.value()->device() != s.device) {
      return InvalidArgument("the registration names GPU " + device.device_uuid +
                             " but its tensors are on another GPU");
    }
    s.events = std::move(events).value();
  }
  *daemon_events = s.events->daemon_handles();
  return Status::Ok();
}

}  // namespace ckpt
