// Clang's thread-safety annotations behind short macros (as in LevelDB and Abseil). With
// `clang++ -Wthread-safety` a field read without the lock that guards it, or a function
// called without the lock it requires, is a compile error; other compilers ignore them.
// Use them with ckpt::Mutex (common/mutex.h): std::mutex itself is not annotated by
// libstdc++.
#pragma once

#if defined(__clang__)
#define CKPT_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define CKPT_THREAD_ANNOTATION(x)
#endif

// A type that is a lock.
#define CAPABILITY(x) CKPT_THREAD_ANNOTATION(capability(x))
// An RAII type that holds a lock for its lifetime.
#define SCOPED_CAPABILITY CKPT_THREAD_ANNOTATION(scoped_lockable)
// The field is read and written only with `x` held.
#define GUARDED_BY(x) CKPT_THREAD_ANNOTATION(guarded_by(x))
// The pointee is read and written only with `x` held.
#define PT_GUARDED_BY(x) CKPT_THREAD_ANNOTATION(pt_guarded_by(x))
// `x` is always taken after (before) these locks, when both are held.
#define ACQUIRED_AFTER(...) CKPT_THREAD_ANNOTATION(acquired_after(__VA_ARGS__))
#define ACQUIRED_BEFORE(...) CKPT_THREAD_ANNOTATION(acquired_before(__VA_ARGS__))
// The caller must hold these locks.
#define REQUIRES(...) CKPT_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
// The caller must not hold these locks (the function takes them).
#define EXCLUDES(...) CKPT_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
// The function takes (releases) these locks and returns with them held (released).
#define ACQUIRE(...) CKPT_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define RELEASE(...) CKPT_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#define TRY_ACQUIRE(...) CKPT_THREAD_ANNOTATION(try_acquire_capability(__VA_ARGS__))
// Tells the analysis that the lock is held here (checked at run time where possible).
#define ASSERT_CAPABILITY(x) CKPT_THREAD_ANNOTATION(assert_capability(x))
// The function returns a reference to the lock `x`.
#define RETURN_CAPABILITY(x) CKPT_THREAD_ANNOTATION(lock_returned(x))
// Opts a function out of the analysis; every use says why in a comment.
#define NO_THREAD_SAFETY_ANALYSIS CKPT_THREAD_ANNOTATION(no_thread_safety_analysis)
