#include "shm/descriptor_table.h"

#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstring>

namespace ckpt {
namespace {

std::atomic_ref<std::uint64_t> Gen(TableHeader* h) { return std::atomic_ref<std::uint64_t>(h->generation); }

ItemDescriptor* Slots(TableHeader* h) { return reinterpret_cast<ItemDescriptor*>(h + 1); }

}  // namespace

Result<DescriptorTable> DescriptorTable::Create(std::string name, std::uint32_t capacity) {
  if (capacity == 0 || capacity > kMaxTableItems) {
    return InvalidArgument("descriptor table capacity must be 1.." + std::to_string(kMaxTableItems));
  }
  auto region = ShmRegion::Create(std::move(name), sizeof(TableHeader) + capacity * sizeof(ItemDescriptor));
  if (!region.ok()) return region.status();
  DescriptorTable table;
  table.region_ = std::move(region).value();
  TableHeader* h = table.header();
  std::memcpy(h->magic, kTableMagic, sizeof kTableMagic);
  h->capacity = capacity;
  h->item_count = 0;
  Gen(h).store(2, std::memory_order_release);
  return table;
}

std::uint32_t DescriptorTable::capacity() const { return header()->capacity; }

std::uint64_t DescriptorTable::generation() const { return Gen(header()).load(std::memory_order_acquire); }

Status DescriptorTable::Write(const std::vector<TableItem>& items) {
  TableHeader* h = header();
  if (items.size() > h->capacity) {
    return InvalidArgument(std::to_string(items.size()) + " items do not fit a table of " +
                           std::to_string(h->capacity));
  }
  for (const auto& it : items) {
    if (it.name.size() > kMaxNameBytes) {
      return InvalidArgument("item name longer than " + std::to_string(kMaxNameBytes) + " bytes");
    }
    if (it.region.size() > kMaxRegionNameBytes) {
      return InvalidArgument("region name of item '" + it.name + "' is too long");
    }
    if (it.shape.size() > kMaxDims) {
      return InvalidArgument("item '" + it.name + "' has more than " + std::to_string(kMaxDims) +
                             " dimensions");
    }
  }
  std::uint64_t g = Gen(h).load(std::memory_order_relaxed);
  Gen(h).store(g + 1, std::memory_order_release);
  std::atomic_thread_fence(std::memory_order_release);
  ItemDescriptor* slots = Slots(h);
  for (std::size_t i = 0; i < items.size(); ++i) {
    const TableItem& it = items[i];
    ItemDescriptor d{};
    d.offset = it.offset;
    d.length = it.length;
    d.generation = it.generation;
    d.dtype = static_cast<std::uint8_t>(it.dtype);
    d.ndim = static_cast<std::uint8_t>(it.shape.size());
    for (std::size_t k = 0; k < it.shape.size(); ++k) d.shape[k] = it.shape[k];
    d.name_len = static_cast<std::uint16_t>(it.name.size());
    std::memcpy(d.name, it.name.data(), it.name.size());
    d.region_len = static_cast<std::uint16_t>(it.region.size());
    std::memcpy(d.region, it.region.data(), it.region.size());
    slots[i] = d;
  }
  h->item_count = static_cast<std::uint32_t>(items.size());
  Gen(h).store(g + 2, std::memory_order_release);
  return Status::Ok();
}

Result<std::uint64_t> ReadTableGeneration(const TableReadFn& read) {
  TableHeader h{};
  if (Status s = read(0, &h, sizeof h); !s.ok()) return s;
  if (std::memcmp(h.magic, kTableMagic, sizeof kTableMagic) != 0) {
    return DataLoss("descriptor table has a bad magic (not a ckpt descriptor table)");
  }
  return h.generation;
}

Result<std::vector<TableItem>> ReadDescriptorTable(const TableReadFn& read, std::uint64_t size,
                                                   std::uint64_t* generation) {
  for (int attempt = 0; attempt < 100; ++attempt) {
    TableHeader h{};
    if (size < sizeof h) {
      return DataLoss("descriptor table is smaller than its header");
    }
    if (Status s = read(0, &h, sizeof h); !s.ok()) return s;
    if (std::memcmp(h.magic, kTableMagic, sizeof kTableMagic) != 0) {
      return DataLoss("descriptor table has a bad magic (not a ckpt descriptor table)");
    }
    if (h.generation % 2 == 1) continue;  // writer mid-update
    if (h.item_count > h.capacity || h.capacity > kMaxTableItems ||
        sizeof h + std::uint64_t{h.capacity} * sizeof(ItemDescriptor) > size) {
      return DataLoss("descriptor table header is inconsistent with its size");
    }
    std::vector<ItemDescriptor> raw(h.item_count);
    if (Status s = read(sizeof h, raw.data(), raw.size() * sizeof(ItemDescriptor)); !s.ok()) {
      return s;
    }
    auto again = ReadTableGeneration(read);
    if (!again.ok()) return again.status();
    if (again.value() != h.generation) continue;
    std::vector<TableItem> items;
    items.reserve(raw.size());
    for (std::size_t i = 0; i < raw.size(); ++i) {
      const ItemDescriptor& d = raw[i];
      if (d.name_len > kMaxNameBytes || d.region_len > kMaxRegionNameBytes || d.ndim > kMaxDims ||
          !IsValidDType(d.dtype)) {
        return DataLoss("descriptor table slot " + std::to_string(i) + " is malformed");
      }
      TableItem it;
      it.name.assign(d.name, d.name_len);
      it.region.assign(d.region, d.region_len);
      it.dtype = static_cast<DType>(d.dtype);
      it.shape.assign(d.shape, d.shape + d.ndim);
      it.offset = d.offset;
      it.length = d.length;
      it.generation = d.generation;
      items.push_back(std::move(it));
    }
    *generation = h.generation;
    return items;
  }
  return DataLoss("descriptor table kept changing while it was read");
}

}  // namespace ckpt
