// CKPT_API marks what libckpt exports: the classes and functions of the public headers
// (ckpt/client.h, ckpt/level.h). libckpt is built with hidden visibility, so everything
// else in it (its internal classes, the gRPC and protobuf code it carries, the static
// layers it links) stays private to the library and cannot clash with a trainer's own copy
// of those libraries; tests/scripts/exported_symbols.py checks the exported list.
//
// A consumer includes this header through ckpt/client.h; it needs no definition of its own.
#pragma once

// CKPT_HIDDEN marks the private parts of an exported class that its visibility would
// otherwise export with it (Client::Impl, defined inside libckpt).
#if defined(__GNUC__) || defined(__clang__)
#define CKPT_API __attribute__((visibility("default")))
#define CKPT_HIDDEN __attribute__((visibility("hidden")))
#else
#define CKPT_API
#define CKPT_HIDDEN
#endif
