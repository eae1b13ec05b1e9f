// The main of every Catch2 test: the cleanup watcher first (support/cleanup_watcher.h), so
// that a test killed by a signal leaves no daemon, directory or shared memory behind.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include "support/cleanup_watcher.h"

int main(int argc, char* argv[]) {
  ckpt::test::StartCleanupWatcher();
  return Catch::Session().run(argc, argv);
}
