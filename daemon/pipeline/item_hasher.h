// ItemHasher: the checksums of one shard's items (xxh3-64 of each item's bytes, as the
// shard header stores them), computed by the flush engine's writers from the chunks they
// write, off the copy thread.
//
// In: the shard's data section in ranges (one per chunk), given to the writers in file
// order (their queue is first in, first out) and hashed by several of them at once. Out:
// each item's checksum, stored in the layout's item once its last byte is hashed; every
// item's is known once every range is hashed. Items with block checksums (format 3: a
// tensor with a global layout) get those in the same pass: each block of the item
// (blocks.block_bytes, counted from the item's first byte) is hashed right after the item
// hash took it in, while it is in cache, so the data is read from memory once.
//
// xxh3-64 is a streaming hash that cannot be computed in parts and combined, and the
// format stores one per item, so the pieces of one item are hashed in file order. An item
// that lies wholly in one range is hashed at once, whatever the other writers do; a piece
// of an item that began in an earlier range waits until that range's piece is hashed. The
// earlier range was taken from the queue before this one, by a thread that waits only for
// ranges earlier still, so the waits end. The hashing of a shard thus spreads over the
// writers by items, and one item is hashed at the speed of one core.
//
// Thread-safe. A thread that will not hash its range (its write failed, the shard failed)
// must call Abort(), which ends every wait: the checksums are then incomplete and the
// shard must not be published.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "common/mutex.h"
#include "format/checksum.h"
#include "format/shard_format.h"

namespace ckpt {

class ItemHasher {
 public:
  // `items` (planned: packed, in file order) must outlive the hasher and not be resized.
  // Empty items get their checksum here.
  explicit ItemHasher(std::vector<ShardItem>& items);

  // Hashes the `len` bytes at `p`, which are the data section's bytes from `data_off` on.
  // Returns false, having hashed nothing more, once Abort() was called.
  bool Hash(std::uint64_t data_off, const char* p, std::uint64_t len) EXCLUDES(mu_);
  // The shard will not be published: ends every wait, and every later Hash returns false.
  void Abort() EXCLUDES(mu_);

 private:
  // An item hashed in several pieces: the bytes hashed so far and the running state. Only
  // the thread whose piece is next (starts at `hashed`) touches `sum`.
  struct Open {
    std::uint64_t hashed = 0;
    std::unique_ptr<Checksum> sum;
    std::unique_ptr<Checksum> block;  // the block that began in an earlier piece
  };
  // Feeds `n` bytes at `p`, the item's bytes from `in_item` on, to `sum` (if given) and to the
  // item's block checksums; `block` holds the state of a block that began before `in_item`.
  static void HashBlocks(ShardItem& item, std::uint64_t in_item, const char* p, std::uint64_t n,
                         Checksum* sum, std::unique_ptr<Checksum>& block);
  bool HashPiece(std::size_t item, std::uint64_t in_item, const char* p, std::uint64_t n) EXCLUDES(mu_);

  std::vector<ShardItem>& items_;
  Mutex mu_;
  CondVar turn_;
  bool aborted_ GUARDED_BY(mu_) = false;
  std::map<std::size_t, Open> open_ GUARDED_BY(mu_);
};

}  // namespace ckpt
