// Fuzz target: ckptd's config-file parser (daemon/base/config.h, ParseConfigText: what
// `--config FILE` reads, CLI11's INI/TOML reader and every option's check).
//
// Invariants checked on every file that parses: each value is within the range its option
// allows, and the checks across options (pool holds 4 chunks, --local differs from --root,
// node id spelling) hold. A file that does not parse must say so with exit code 2.
#include <cctype>
#include <cstdint>
#include <iostream>
#include <string>

#include "daemon/base/config.h"
#include "fuzz_check.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // CLI11 prints each error to std::cerr: silenced (libFuzzer's and the sanitizers' reports
  // do not go through iostreams).
  std::cout.rdbuf(nullptr);
  std::cerr.rdbuf(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::string text(reinterpret_cast<const char*>(data), size);
  int exit_code = -1;
  auto c = ckpt::ParseConfigText(text, &exit_code);
  if (!c) {
    FUZZ_CHECK(exit_code == 2, "a rejected file exits 2");
    return 0;
  }
  FUZZ_CHECK(exit_code == 0, "an accepted file exits 0");
  FUZZ_CHECK(c->socket_mode <= 07777, "socket mode is permission bits");
  FUZZ_CHECK(c->local_keep >= 1 && c->local_keep <= (1u << 20), "local-keep range");
  FUZZ_CHECK(c->memory_versions <= 64, "memory-versions range");
  FUZZ_CHECK(c->pool_mib >= 16 && c->pool_mib <= (1u << 22), "pool-mib range");
  FUZZ_CHECK(c->chunk_mib >= 1 && c->chunk_mib <= 1024, "chunk-mib range");
  FUZZ_CHECK(c->chunk_mib * 4 <= c->pool_mib, "the pool holds 4 chunks");
  FUZZ_CHECK(c->writers >= 1 && c->writers <= 64, "writers range");
  FUZZ_CHECK(c->copiers >= 1 && c->copiers <= 64, "copiers range");
  FUZZ_CHECK(c->copy_streams >= 1 && c->copy_streams <= 16, "copy-streams range");
  FUZZ_CHECK(c->local_dir.empty() || c->local_dir != c->root, "--local differs from --root");
  FUZZ_CHECK(!c->node_id.empty(), "a node id");
  for (char ch : c->node_id) {
    FUZZ_CHECK(std::isalnum(static_cast<unsigned char>(ch)) || ch == '-' || ch == '_', "node id spelling");
  }
  FUZZ_CHECK(c->log_level == "trace" || c->log_level == "debug" || c->log_level == "info" ||
                 c->log_level == "warn" || c->log_level == "error",
             "log level");
  return 0;
}
