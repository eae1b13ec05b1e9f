// FUZZ_CHECK: an invariant of a fuzz target. A violation prints what broke and aborts, which
// libFuzzer reports as a crash (and keeps the input), and which fails the replay test of the
// normal build (replay_main.cc), so the fuzzers find wrong answers as well as crashes.
#pragma once

#include <cstdio>
#include <cstdlib>

#define FUZZ_CHECK(cond, what)                                                                     \
  do {                                                                                             \
    if (!(cond)) {                                                                                 \
      std::fprintf(stderr, "%s:%d: invariant broken: %s (%s)\n", __FILE__, __LINE__, #cond, what); \
      std::abort();                                                                                \
    }                                                                                              \
  } while (0)
