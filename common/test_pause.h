// A test seam: lets a test stop the daemon at a named point, deterministically, so that it
// can kill it there (a crash in the middle of a flush or a promotion).
//
// CKPTD_TEST_PAUSE=POINT:VERSION:PATH makes the daemon, when it reaches POINT for VERSION
// (0: any), create PATH.reached and wait as long as PATH exists. Points: "capture" (a shard
// is about to be copied out of trainer memory: nothing of it is captured yet), "publish" (a
// shard is written to its .tmp file, not yet renamed), "promote-start" (a shard is about to be
// copied to another tier, a promotion or a prefetch: nothing of it is there yet, and for the
// version's first shard there, not its directory either),
// "promote" (half of a shard is copied to the persistent tier's .tmp file), "retention-delete"
// (retention removed a version's COMMITTED and has not yet looked again for references to it
// nor removed its files). Unset (always,
// outside tests), it costs one branch.
#pragma once

#include <cstdint>
#include <string_view>

namespace ckpt {

void TestPause(std::string_view point, std::uint64_t version);

}  // namespace ckpt
