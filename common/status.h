// Status: the result of an operation on the data path, as a value.
//
// Errors are values here, never exceptions thrown across threads (see STYLE.md): engines
// hand a Status from worker to waiter, and the service turns it into a gRPC status at the
// edge. A Status is cheap to copy when ok() and immutable once made.
#pragma once

#include <string>
#include <utility>

namespace ckpt {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,     // the caller sent something malformed
  kNotFound,            // a named thing (session, version, file, region) does not exist
  kAlreadyExists,       // a conflicting thing exists (second registration, committed version)
  kFailedPrecondition,  // the request is well formed but the state does not allow it
  kDataLoss,            // stored bytes do not match their checksum or format
  kResourceExhausted,   // no space left, too large
  kPermissionDenied,    // the peer may not do this
  kDeadlineExceeded,    // a wait ran out of time
  kCancelled,           // the caller went away before the work was done
  kIoError,             // the operating system failed an I/O call
  kInternal,            // a bug
  kAborted,             // a version given up on purpose: its memory changed during its copy
};

class Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }
  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

  // Returns a copy whose message is prefixed with `context: `.
  Status With(const std::string& context) const {
    if (ok()) return *this;
    return Status(code_, context + ": " + message_);
  }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status InvalidArgument(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
inline Status NotFound(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
inline Status AlreadyExists(std::string m) { return {StatusCode::kAlreadyExists, std::move(m)}; }
inline Status FailedPrecondition(std::string m) { return {StatusCode::kFailedPrecondition, std::move(m)}; }
inline Status DataLoss(std::string m) { return {StatusCode::kDataLoss, std::move(m)}; }
inline Status ResourceExhausted(std::string m) { return {StatusCode::kResourceExhausted, std::move(m)}; }
inline Status PermissionDenied(std::string m) { return {StatusCode::kPermissionDenied, std::move(m)}; }
inline Status DeadlineExceeded(std::string m) { return {StatusCode::kDeadlineExceeded, std::move(m)}; }
inline Status Cancelled(std::string m) { return {StatusCode::kCancelled, std::move(m)}; }
inline Status Internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }
inline Status Aborted(std::string m) { return {StatusCode::kAborted, std::move(m)}; }

// An I/O failure with errno `err`, described as "`what`: strerror(err)". ENOSPC and EDQUOT
// map to kResourceExhausted so callers can tell a full disk from a broken one.
Status IoError(const std::string& what, int err);

// The gRPC status code (its standard number, grpc::StatusCode) that reports `code`; the
// daemon's replies, the client's errors and the Python module's all use this one mapping.
// kIoError is UNKNOWN (2).
int GrpcCodeNumber(StatusCode code);

// Value-or-error, for functions that produce something.
template <typename T>
class Result {
 public:
  Result(T value) : value_(std::move(value)) {}          // NOLINT: implicit by design
  Result(Status status) : status_(std::move(status)) {}  // NOLINT: implicit by design

  bool ok() const { return status_.ok(); }
  const Status& status() const { return status_; }
  T& value() & { return value_; }
  T&& value() && { return std::move(value_); }
  const T& value() const& { return value_; }
  T* operator->() { return &value_; }
  const T* operator->() const { return &value_; }
  // The value, or `fallback` when there is none.
  T value_or(T fallback) const& { return ok() ? value_ : std::move(fallback); }

 private:
  Status status_;
  T value_{};
};

}  // namespace ckpt
