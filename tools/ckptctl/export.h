// `ckptctl export`: one committed version of a checkpoint tree, consolidated into Hugging Face
// safetensors files (docs/export.md).
//
//   ROOT/JOB/vNNNNNNNNNN/index.json + rank-*.safetensors     (what the daemon wrote)
//     -> LoadExportSource: the tensors to export, each with the chunks it is made of
//        (export_source.cc)
//     -> SelectTensors (--filter, --blobs), CheckTiling, PackFiles (--max-shard-size)
//        (export_plan.cc)
//     -> the writer (RunExport, export.cc; the copies in export_copy.cc, the directory in
//        export_output_dir.cc): DIR/model-00001-of-0000N.safetensors ... + the index
//
// Each global tensor is exported whole under its global name, a replicated one once; a
// rank-private item as "rank<R>/<name>"; a blob (only with --blobs) as the U8 tensor
// "rank<R>/__blob__/<name>". Files are named and filled the way huggingface_hub splits a state
// dict: tensors in order, a new file when the next one would pass the limit, a tensor larger
// than the limit alone in its own file; a single file is "model.safetensors".
//
// Nothing holds a whole checkpoint in memory: one global tensor at a time is assembled into
// its place in an output file, its chunks read whole, front to back, through one buffer and
// written (pwrite) run by run to where each run of elements lies in the global tensor. Every
// item read is checked against the checksum of its shard's header (itself covered by the
// header checksum) before the export is renamed into place; files are written under a
// temporary directory inside DIR and renamed at the end, so a failed export leaves DIR as it
// was. Errors are Status values whose message names what is wrong (the job, version, tensor,
// chunk, shard or path); the ckptctl command (export_cmd.cc) maps their codes to its exit codes.
//
// Not thread-safe: one export per call, on the calling thread.
#pragma once

#include <csignal>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "format/dtype.h"

namespace ckptctl {

// Where one piece of an exported tensor lies: an item of one rank's shard, and the box of the
// tensor it fills (offsets and shape per dimension; for a replicated tensor or a rank-private
// item, the whole tensor).
struct ExportChunk {
  std::uint32_t rank = 0;
  std::string file;  // the shard's file name in the version directory
  std::string key;   // the item's key in that shard's safetensors header
  std::vector<std::int64_t> offsets;
  std::vector<std::int64_t> shape;
};

// One tensor of the export.
struct ExportTensor {
  enum class Kind { kGlobal, kPrivate, kBlob };
  std::string name;  // in the exported files
  Kind kind = Kind::kGlobal;
  ckpt::DType dtype = ckpt::DType::kU8;
  std::vector<std::int64_t> shape;
  // Every chunk holds the whole tensor; the first whose checksum holds is exported.
  bool replicated = false;
  std::vector<ExportChunk> chunks;

  std::uint64_t bytes() const;
};

// What a committed version holds, as LoadExportSource found it.
struct ExportSource {
  std::string job;
  std::uint64_t version = 0;
  std::uint32_t world_size = 0;
  bool from_index = false;  // false: no index.json; the index was rebuilt from the shard headers
  std::string version_dir;
  // Global tensors by name, then private items by rank (in shard order), then blobs by rank.
  std::vector<ExportTensor> tensors;
};

// The tensors of `version` of `job` under `root` (0: the newest committed version), from its
// index.json, or from its shard headers (format/version_index.h) when it has none. NotFound
// for an unknown job, a version that is not there or not committed, a job without any committed
// version; DataLoss for an index or shard header that is malformed or disagrees with the shards
// (a missing key, another dtype or shape). Reads the index and the shard headers, no data.
ckpt::Result<ExportSource> LoadExportSource(const std::string& root, const std::string& job,
                                            std::uint64_t version);

// Keeps the tensors whose name `filter` finds (ECMAScript regex_search; empty: all), blobs
// only if `blobs`. InvalidArgument for a regex that does not compile; NotFound when nothing is
// left (naming the filter). `skipped_blobs` counts the blobs left out because `blobs` is false.
ckpt::Status SelectTensors(std::vector<ExportTensor>& tensors, const std::string& filter, bool blobs,
                           std::size_t* skipped_blobs);

// Checks that the chunks of `t` make it exactly: for a replicated tensor, that each holds it
// whole; otherwise that every box lies within the shape and the boxes cover it with no gap and
// no overlap. DataLoss naming the tensor and the chunks at fault.
ckpt::Status CheckTiling(const ExportTensor& t);

// A size as Hugging Face's tooling writes it: a byte count ("5000000000"), or a number with a
// decimal unit KB/MB/GB/TB (10^3...) or a binary one KiB/MiB/GiB/TiB (2^10...), in any case,
// optionally with a fraction ("1.5GB") and spaces before the unit. "5Gb" (lower-case b) is
// refused: transformers reads it as gigabits, huggingface_hub as gigabytes. InvalidArgument,
// saying what is accepted, for anything else or a size of 0.
ckpt::Result<std::uint64_t> ParseByteSize(std::string_view text);

// One exported file: its name and the tensors it holds (indices into the list given).
struct ExportFile {
  std::string name;
  std::vector<std::size_t> tensors;
  std::uint64_t data_bytes = 0;
};

// Splits tensors of these sizes, in order, into files of at most `max_bytes` of data each, as
// huggingface_hub's split_state_dict_into_shards does: a tensor that does not fit the current
// file starts the next one, a tensor larger than `max_bytes` gets a file of its own. Names
// them with ExportFileName. No tensors: no files.
std::vector<ExportFile> PackFiles(const std::vector<std::uint64_t>& sizes, std::uint64_t max_bytes);

// "model.safetensors" when `count` is 1, else "model-00002-of-00005.safetensors" (index 1 of 5).
std::string ExportFileName(std::size_t index, std::size_t count);

inline constexpr std::string_view kExportIndexName = "model.safetensors.index.json";
inline constexpr std::uint64_t kDefaultMaxShardBytes = 5'000'000'000;  // "5GB", as in transformers

struct ExportOptions {
  std::string root;
  std::string job;
  std::uint64_t version = 0;  // 0: the newest committed
  std::string out;
  std::string filter;  // empty: every tensor
  std::uint64_t max_shard_bytes = kDefaultMaxShardBytes;
  bool blobs = false;  // export blobs as U8 tensors too
  bool force = false;  // write into a directory that already has files in it
  // Set (by a signal handler) to stop: the export fails with Cancelled and leaves DIR as it was.
  const volatile std::sig_atomic_t* interrupted = nullptr;
};

struct ExportReport {
  std::string job;
  std::uint64_t version = 0;
  std::uint32_t world_size = 0;
  bool from_index = false;
  std::string out;
  std::vector<ExportFile> files;
  std::vector<std::string> tensor_names;  // indexed by ExportFile::tensors
  std::uint64_t total_size = 0;           // the index's metadata.total_size: data bytes of all files
  std::size_t skipped_blobs = 0;
  std::vector<std::string> warnings;  // a replicated copy that failed its checksum and was passed over
};

// The whole export: load, select, check, pack, write (see the top of this file). DIR is
// created if missing (with its parents); AlreadyExists if it holds anything and !force;
// IoError or ResourceExhausted naming the path when it cannot be written.
ckpt::Result<ExportReport> RunExport(const ExportOptions& options);

}  // namespace ckptctl
