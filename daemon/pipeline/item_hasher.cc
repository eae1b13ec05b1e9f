#include "daemon/pipeline/item_hasher.h"

#include <algorithm>

namespace ckpt {

ItemHasher::ItemHasher(std::vector<ShardItem>& items) : items_(items) {
  for (auto& item : items_) {
    if (item.length == 0) item.checksum = Checksum::Of(nullptr, 0);
  }
}

void ItemHasher::HashBlocks(ShardItem& item, std::uint64_t in_item, const char* p, std::uint64_t n,
                            Checksum* sum, std::unique_ptr<Checksum>& block) {
  const std::uint64_t bs = item.blocks.block_bytes;
  std::uint64_t done = 0;
  while (done < n) {
    const std::uint64_t at = in_item + done;
    const std::uint64_t index = at / bs;
    const std::uint64_t block_end = std::min((index + 1) * bs, item.length);
    const std::uint64_t take = std::min(block_end - at, n - done);
    const char* piece = p + done;
    if (sum) sum->Update(piece, take);
    if (at % bs == 0 && at + take == block_end) {
      item.blocks.sums[index] = Checksum::Of(piece, take);
    } else {
      if (at % bs == 0) block = std::make_unique<Checksum>();
      block->Update(piece, take);
      if (at + take == block_end) {
        item.blocks.sums[index] = block->Digest();
        block.reset();
      }
    }
    done += take;
  }
}

bool ItemHasher::Hash(std::uint64_t data_off, const char* p, std::uint64_t len) {
  const std::uint64_t end = data_off + len;
  // The first item that ends after data_off (items are packed in file order).
  auto it = std::upper_bound(
      items_.begin(), items_.end(), data_off,
      [](std::uint64_t off, const ShardItem& item) { return off < item.offset + item.length; });
  for (; it != items_.end() && it->offset < end; ++it) {
    if (it->length == 0) continue;
    const std::uint64_t from = std::max(data_off, it->offset);
    const std::uint64_t to = std::min(end, it->offset + it->length);
    const char* piece = p + (from - data_off);
    if (from == it->offset && to == it->offset + it->length) {
      {
        MutexLock lock(mu_);
        if (aborted_) return false;
      }
      if (it->blocks.block_bytes == 0) {
        it->checksum = Checksum::Of(piece, to - from);
      } else {
        Checksum sum;
        std::unique_ptr<Checksum> block;
        HashBlocks(*it, 0, piece, to - from, &sum, block);
        it->checksum = sum.Digest();
      }
      continue;
    }
    if (!HashPiece(static_cast<std::size_t>(it - items_.begin()), from - it->offset, piece, to - from)) {
      return false;
    }
  }
  return true;
}

bool ItemHasher::HashPiece(std::size_t item, std::uint64_t in_item, const char* p, std::uint64_t n) {
  Checksum* sum = nullptr;
  std::unique_ptr<Checksum>* block = nullptr;
  {
    MutexLock lock(mu_);
    if (aborted_) return false;
    if (in_item == 0) {
      Open& o = open_[item];
      o.sum = std::make_unique<Checksum>();
      sum = o.sum.get();
      block = &o.block;
    } else {
      for (;;) {
        auto o = open_.find(item);
        if (o != open_.end() && o->second.hashed == in_item) {
          sum = o->second.sum.get();
          block = &o->second.block;
          break;
        }
        turn_.Wait(mu_);
        if (aborted_) return false;
      }
    }
  }
  // Only this thread touches the entry's states until `hashed` moves on (std::map nodes stay put).
  if (items_[item].blocks.block_bytes == 0) {
    sum->Update(p, n);
  } else {
    HashBlocks(items_[item], in_item, p, n, sum, *block);
  }
  {
    MutexLock lock(mu_);
    Open& o = open_[item];
    o.hashed += n;
    if (o.hashed == items_[item].length) {
      items_[item].checksum = o.sum->Digest();
      open_.erase(item);
    }
  }
  turn_.SignalAll();
  return true;
}

void ItemHasher::Abort() {
  {
    MutexLock lock(mu_);
    aborted_ = true;
  }
  turn_.SignalAll();
}

}  // namespace ckpt
