// Clang's thread-safety annotations behind short macros (as in LevelDB and Abseil). With
// `clang++ -Wthread-safety` a field read without the lock that guards it, or a function
// called without the lock it requires, is a compile error; other compilers ignore them.
// Use them with ckpt::Mutex (common/mutex.h): std::mutex itself is not annotated by
// libstdc++.
#pragma once

// gRPC brings in Abseil's legacy annotations, which define some of the same names with the
// same attributes; they come first, and each name below is defined only if still missing.
#if __has_include(<absl/base/internal/thread_annotations.h>)
#include <absl/base/internal/thread_annotations.h>
#endif

#if defined(__clang__)
#define CKPT_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define CKPT_THREAD_ANNOTATION(x)
#endif

// A type that is a lock.
#ifndef CAPABILITY
#define CAPABILITY(x) CKPT_THREAD_ANNOTATION(capability(x))
#endif
// An RAII type that holds a lock for its lifetime.
#ifndef SCOPED_CAPABILITY
#define SCOPED_CAPABILITY CKPT_THREAD_ANNOTATION(scoped_lockable)
#endif
// The field is read and written only with `x` held.
#ifndef GUARDED_BY
#define GUARDED_BY(x) CKPT_THREAD_ANNOTATION(guarded_by(x))
#endif
// The pointee is read and written only with `x` held.
#ifndef PT_GUARDED_BY
#define PT_GUARDED_BY(x) CKPT_THREAD_ANNOTATION(pt_guarded_by(x))
#endif
// `x` is always taken after (before) these locks, when both are held.
#ifndef ACQUIRED_AFTER
#define ACQUIRED_AFTER(...) CKPT_THREAD_ANNOTATION(acquired_after(__VA_ARGS__))
#endif
#ifndef ACQUIRED_BEFORE
#define ACQUIRED_BEFORE(...) CKPT_THREAD_ANNOTATION(acquired_before(__VA_ARGS__))
#endif
// The caller must hold these locks.
#ifndef REQUIRES
#define REQUIRES(...) CKPT_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#endif
// The caller must not hold these locks (the function takes them).
#ifndef EXCLUDES
#define EXCLUDES(...) CKPT_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
#endif
// The function takes (releases) these locks and returns with them held (released).
#ifndef ACQUIRE
#define ACQUIRE(...) CKPT_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#endif
#ifndef RELEASE
#define RELEASE(...) CKPT_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#endif
#ifndef TRY_ACQUIRE
#define TRY_ACQUIRE(...) CKPT_THREAD_ANNOTATION(try_acquire_capability(__VA_ARGS__))
#endif
// Tells the analysis that the lock is held here (checked at run time where possible).
#ifndef ASSERT_CAPABILITY
#define ASSERT_CAPABILITY(x) CKPT_THREAD_ANNOTATION(assert_capability(x))
#endif
// The function returns a reference to the lock `x`.
#ifndef RETURN_CAPABILITY
#define RETURN_CAPABILITY(x) CKPT_THREAD_ANNOTATION(lock_returned(x))
#endif
// Opts a function out of the analysis; every use says why in a comment.
#ifndef NO_THREAD_SAFETY_ANALYSIS
#define NO_THREAD_SAFETY_ANALYSIS CKPT_THREAD_ANNOTATION(no_thread_safety_analysis)
#endif
