// The copies of an export (export.h): each tensor assembled into its place in an output file
// from the chunks it is made of, every chunk read whole, front to back, through one buffer,
// checked against its item checksum, and written (pwrite) run by run to where each run of
// elements lies in the global tensor. Not part of export.h's interface.
//
// Not thread-safe: one export at a time, on one thread.
#pragma once

#include <csignal>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "tools/ckptctl/export.h"
#include "tools/ckptctl/export_output_dir.h"
#include "tools/ckptctl/export_source.h"

namespace ckptctl::export_internal {

// Writes all `n` bytes at `offset` of `fd`, retrying short writes. IoError naming `path`.
ckpt::Status WriteFully(int fd, const char* buf, std::size_t n, std::uint64_t offset,
                        const std::string& path);

class TensorCopier {
 public:
  // Reads from `shards`; stops with Cancelled once *interrupted (if given) is set.
  TensorCopier(ShardSet& shards, const volatile std::sig_atomic_t* interrupted);

  // Writes tensor `t` at `offset` of `out`: every chunk, or for a replicated tensor the first
  // copy in rank order whose checksum holds. DataLoss naming the shard, item and tensor for a
  // chunk that fails its checksum (for a replicated tensor: when no copy is intact).
  // `warnings` gets a line per replicated copy passed over.
  ckpt::Status Copy(const ExportTensor& t, OutFile& out, std::uint64_t offset,
                    std::vector<std::string>* warnings);

 private:
  ckpt::Status CopyChunk(const ExportTensor& t, const ExportChunk& c, OutFile& out, std::uint64_t offset);

  ShardSet& shards_;
  const volatile std::sig_atomic_t* interrupted_;
  std::vector<char> buf_;
};

}  // namespace ckptctl::export_internal
