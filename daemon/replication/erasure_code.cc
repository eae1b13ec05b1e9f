#include "daemon/replication/erasure_code.h"

#include <isa-l/erasure_code.h>

#include <algorithm>
#include <cstring>
#include <limits>

#include "format/checksum.h"

namespace ckpt {

namespace {

// ec_encode_data takes an int length: longer fragments go through in pieces of this size (a
// multiple of kFragmentAlignment, so every piece but the last keeps the SIMD kernels on whole
// vectors).
constexpr std::uint64_t kMaxCallBytes = std::uint64_t{1} << 30;
static_assert(kMaxCallBytes % kFragmentAlignment == 0);
static_assert(kMaxCallBytes <= static_cast<std::uint64_t>(std::numeric_limits<int>::max()));

// Runs ec_encode_data over `bytes` bytes of each source and output, in pieces.
void EncodeInPieces(unsigned k, unsigned rows, const unsigned char* tables, const std::uint8_t* const* src,
                    std::uint8_t* const* dst, std::uint64_t bytes) {
  unsigned char* src_at[kMaxErasureFragments];
  unsigned char* dst_at[kMaxErasureFragments];
  for (std::uint64_t done = 0; done < bytes;) {
    const std::uint64_t piece = std::min(kMaxCallBytes, bytes - done);
    // ISA-L's prototype is not const-correct; it never writes its sources or tables.
    for (unsigned i = 0; i < k; ++i) src_at[i] = const_cast<unsigned char*>(src[i] + done);
    for (unsigned i = 0; i < rows; ++i) dst_at[i] = dst[i] + done;
    ec_encode_data(static_cast<int>(piece), static_cast<int>(k), static_cast<int>(rows),
                   const_cast<unsigned char*>(tables), src_at, dst_at);
    done += piece;
  }
}

// EncodeStripe's piece of each fragment: the k + m pieces of the largest code stay within
// a core's share of the last-level cache. A multiple of kFragmentAlignment.
constexpr std::uint64_t kStripePieceBytes = 64 << 10;
static_assert(kStripePieceBytes % kFragmentAlignment == 0);

std::string NameList(const std::vector<unsigned>& fragments, unsigned k) {
  std::string text;
  for (unsigned i : fragments) {
    if (!text.empty()) text += ", ";
    text += FragmentName(i, k);
  }
  return text;
}

std::string CodeName(unsigned k, unsigned m) {
  return "erasure code k=" + std::to_string(k) + " m=" + std::to_string(m);
}

}  // namespace

ErasureCode::ErasureCode(unsigned k, unsigned m)
    : k_(k), m_(m), matrix_((k + m) * k), parity_tables_(32 * k * m) {
  gf_gen_cauchy1_matrix(matrix_.data(), static_cast<int>(k + m), static_cast<int>(k));
  ec_init_tables(static_cast<int>(k), static_cast<int>(m), matrix_.data() + k * k, parity_tables_.data());
}

Result<ErasureCode> ErasureCode::Create(unsigned k, unsigned m) {
  if (k < 1) return InvalidArgument(CodeName(k, m) + ": needs at least one data fragment (k >= 1)");
  if (m < 1) return InvalidArgument(CodeName(k, m) + ": needs at least one parity fragment (m >= 1)");
  if (k + m > kMaxErasureFragments) {
    return InvalidArgument(CodeName(k, m) + ": k + m = " + std::to_string(k + m) + " fragments, at most " +
                           std::to_string(kMaxErasureFragments));
  }
  return ErasureCode(k, m);
}

Status ErasureCode::Encode(std::span<const std::uint8_t* const> data, std::span<std::uint8_t* const> parity,
                           std::uint64_t fragment_bytes) const {
  if (k_ == 0) return InvalidArgument("Encode on an empty erasure code");
  if (data.size() != k_ || parity.size() != m_) {
    return InvalidArgument(CodeName(k_, m_) + ": Encode takes " + std::to_string(k_) + " data and " +
                           std::to_string(m_) + " parity fragments, got " + std::to_string(data.size()) +
                           " and " + std::to_string(parity.size()));
  }
  if (std::find(data.begin(), data.end(), nullptr) != data.end() ||
      std::find(parity.begin(), parity.end(), nullptr) != parity.end()) {
    return InvalidArgument(CodeName(k_, m_) + ": Encode needs every fragment, got a null one");
  }
  EncodeInPieces(k_, m_, parity_tables_.data(), data.data(), parity.data(), fragment_bytes);
  return Status::Ok();
}

Status ErasureCode::Accumulate(unsigned index, unsigned row, const std::uint8_t* data, std::uint8_t* parity,
                               std::uint64_t bytes) const {
  if (k_ == 0) return InvalidArgument("Accumulate on an empty erasure code");
  if (index >= k_ || row >= m_) {
    return InvalidArgument(CodeName(k_, m_) + ": no data fragment " + std::to_string(index) + " or parity row " +
                           std::to_string(row));
  }
  if (bytes % kFragmentAlignment != 0) {
    return InvalidArgument(CodeName(k_, m_) + ": Accumulate over " + std::to_string(bytes) +
                           " bytes, not a multiple of " + std::to_string(kFragmentAlignment));
  }
  if (bytes > 0 && (data == nullptr || parity == nullptr)) return InvalidArgument("Accumulate on a null fragment");
  // The tables of one parity row are 32 bytes per data fragment, rows one after another.
  unsigned char* tables = const_cast<unsigned char*>(parity_tables_.data()) + std::size_t{32} * k_ * row;
  for (std::uint64_t done = 0; done < bytes;) {
    const std::uint64_t piece = std::min(kMaxCallBytes, bytes - done);
    unsigned char* dst = parity + done;
    ec_encode_data_update(static_cast<int>(piece), static_cast<int>(k_), 1, static_cast<int>(index), tables,
                          const_cast<unsigned char*>(data + done), &dst);
    done += piece;
  }
  return Status::Ok();
}

Status ErasureCode::Rebuild(std::span<const std::uint8_t* const> fragments,
                            std::span<std::uint8_t* const> out, std::uint64_t fragment_bytes) const {
  const unsigned n = k_ + m_;
  if (k_ == 0) return InvalidArgument("Rebuild on an empty erasure code");
  if (fragments.size() != n || out.size() != n) {
    return InvalidArgument(CodeName(k_, m_) + ": Rebuild takes " + std::to_string(n) +
                           " fragments and outputs, got " + std::to_string(fragments.size()) + " and " +
                           std::to_string(out.size()));
  }
  std::vector<unsigned> sources;
  std::vector<unsigned> missing;
  std::vector<unsigned> wanted;
  for (unsigned i = 0; i < n; ++i) {
    if (fragments[i] == nullptr) {
      missing.push_back(i);
      if (out[i] != nullptr) wanted.push_back(i);
    } else if (out[i] != nullptr) {
      return InvalidArgument(CodeName(k_, m_) + ": asked to rebuild fragment " + FragmentName(i, k_) +
                             ", which is present");
    } else if (sources.size() < k_) {
      sources.push_back(i);
    }
  }
  if (sources.size() < k_) {
    return DataLoss(CodeName(k_, m_) + ": " + std::to_string(sources.size()) + " fragments present, " +
                    std::to_string(k_) + " needed; missing " + NameList(missing, k_));
  }
  if (wanted.empty()) return Status::Ok();

  // The rows of the surviving sources form B (source = B * data); its inverse gives each data
  // fragment from the sources, and a parity row p gives its fragment as (p * B^-1) * sources.
  std::vector<unsigned char> b(k_ * k_);
  std::vector<unsigned char> b_inv(k_ * k_);
  for (unsigned r = 0; r < k_; ++r) {
    std::memcpy(&b[r * k_], &matrix_[sources[r] * k_], k_);
  }
  if (gf_invert_matrix(b.data(), b_inv.data(), static_cast<int>(k_)) != 0) {
    // A Cauchy generator has no singular square submatrix: reaching this is a bug.
    return Internal(CodeName(k_, m_) + ": the submatrix of fragments " + NameList(sources, k_) +
                    " is singular");
  }
  std::vector<unsigned char> rows(wanted.size() * k_);
  for (std::size_t w = 0; w < wanted.size(); ++w) {
    unsigned char* row = &rows[w * k_];
    const unsigned i = wanted[w];
    if (i < k_) {
      std::memcpy(row, &b_inv[i * k_], k_);
      continue;
    }
    for (unsigned c = 0; c < k_; ++c) {
      unsigned char sum = 0;
      for (unsigned j = 0; j < k_; ++j) sum ^= gf_mul(matrix_[i * k_ + j], b_inv[j * k_ + c]);
      row[c] = sum;
    }
  }
  std::vector<unsigned char> tables(32 * k_ * wanted.size());
  ec_init_tables(static_cast<int>(k_), static_cast<int>(wanted.size()), rows.data(), tables.data());
  const std::uint8_t* src[kMaxErasureFragments];
  std::uint8_t* dst[kMaxErasureFragments];
  for (unsigned r = 0; r < k_; ++r) src[r] = fragments[sources[r]];
  for (std::size_t w = 0; w < wanted.size(); ++w) dst[w] = out[wanted[w]];
  EncodeInPieces(k_, static_cast<unsigned>(wanted.size()), tables.data(), src, dst, fragment_bytes);
  return Status::Ok();
}

std::uint64_t StripeFragmentBytes(std::uint64_t length, unsigned k) {
  if (k == 0) return 0;
  const std::uint64_t share = length / k + (length % k != 0 ? 1 : 0);
  return (share + kFragmentAlignment - 1) / kFragmentAlignment * kFragmentAlignment;
}

std::string FragmentName(unsigned i, unsigned k) {
  return std::to_string(i) + (i < k ? " (data)" : " (parity)");
}

Result<EncodedStripe> EncodeStripe(const ErasureCode& code, const void* data, std::uint64_t length) {
  if (code.k() == 0) return InvalidArgument("EncodeStripe with an empty erasure code");
  if (data == nullptr && length != 0) return InvalidArgument("EncodeStripe of a null buffer");
  const unsigned k = code.k();
  const unsigned m = code.m();
  const std::uint64_t f = StripeFragmentBytes(length, k);
  // Data fragments [0, whole) lie inside the buffer; [whole, k) are padded copies in tail_.
  const std::uint64_t whole = f == 0 ? k : std::min<std::uint64_t>(k, length / f);
  const auto* bytes = static_cast<const std::uint8_t*>(data);

  EncodedStripe e;
  e.stripe_ = Stripe{k, m, length, f, std::vector<std::uint64_t>(k + m)};
  e.tail_.assign((k - whole) * f, 0);
  if (whole < k) std::memcpy(e.tail_.data(), bytes + whole * f, length - whole * f);
  e.parity_.resize(m * f);
  e.fragments_.resize(k + m);
  for (unsigned i = 0; i < k; ++i)
    e.fragments_[i] = i < whole ? bytes + i * f : e.tail_.data() + (i - whole) * f;
  std::vector<std::uint8_t*> parity(m);
  for (unsigned p = 0; p < m; ++p) {
    parity[p] = e.parity_.data() + p * f;
    e.fragments_[k + p] = parity[p];
  }
  // Encoded and hashed a piece of every fragment at a time, so that the hash reads the
  // parity (and the data) while it is still in cache instead of in a second pass over memory.
  std::vector<Checksum> sums(k + m);
  std::vector<const std::uint8_t*> data_at(k);
  std::vector<std::uint8_t*> parity_at(m);
  for (std::uint64_t done = 0; done < f; done += kStripePieceBytes) {
    const std::uint64_t piece = std::min(kStripePieceBytes, f - done);
    for (unsigned i = 0; i < k; ++i) data_at[i] = e.fragments_[i] + done;
    for (unsigned p = 0; p < m; ++p) parity_at[p] = parity[p] + done;
    Status st = code.Encode(data_at, parity_at, piece);
    if (!st.ok()) return st;
    for (unsigned i = 0; i < k + m; ++i) sums[i].Update(e.fragments_[i] + done, piece);
  }
  for (unsigned i = 0; i < k + m; ++i) e.stripe_.checksums[i] = sums[i].Digest();
  return e;
}

Result<StripeDamage> ReconstructStripe(const ErasureCode& code, const Stripe& stripe,
                                       std::span<const std::uint8_t* const> fragments, void* out) {
  const unsigned k = stripe.k;
  const unsigned n = stripe.k + stripe.m;
  if (code.k() == 0 || code.k() != stripe.k || code.m() != stripe.m) {
    return InvalidArgument("stripe of k=" + std::to_string(stripe.k) + " m=" + std::to_string(stripe.m) +
                           " handed to an " + CodeName(code.k(), code.m()));
  }
  const std::uint64_t f = stripe.fragment_bytes;
  if (f != StripeFragmentBytes(stripe.length, k) || stripe.checksums.size() != n) {
    return InvalidArgument("inconsistent stripe: " + std::to_string(stripe.length) +
                           " bytes in fragments of " + std::to_string(f) + " bytes (expected " +
                           std::to_string(StripeFragmentBytes(stripe.length, k)) + "), " +
                           std::to_string(stripe.checksums.size()) + " checksums for " + std::to_string(n) +
                           " fragments");
  }
  if (fragments.size() != n) {
    return InvalidArgument(CodeName(k, stripe.m) + ": " + std::to_string(fragments.size()) +
                           " fragment pointers for " + std::to_string(n) + " fragments");
  }
  if (out == nullptr && stripe.length != 0) return InvalidArgument("ReconstructStripe into a null buffer");

  StripeDamage damage;
  std::vector<const std::uint8_t*> intact(fragments.begin(), fragments.end());
  for (unsigned i = 0; i < n; ++i) {
    if (intact[i] == nullptr) {
      damage.missing.push_back(i);
    } else if (Checksum::Of(intact[i], f) != stripe.checksums[i]) {
      damage.corrupt.push_back(i);
      intact[i] = nullptr;
    }
  }
  const auto good = static_cast<unsigned>(n - damage.missing.size() - damage.corrupt.size());
  if (good < k) {
    std::string what;
    if (!damage.missing.empty()) what += "; missing " + NameList(damage.missing, k);
    if (!damage.corrupt.empty()) what += "; checksum mismatch in " + NameList(damage.corrupt, k);
    return DataLoss(CodeName(k, stripe.m) + ": " + std::to_string(good) + " intact fragments, " +
                    std::to_string(k) + " needed" + what);
  }

  auto* dst = static_cast<std::uint8_t*>(out);
  // Bytes of data fragment i that belong to the buffer.
  auto share = [&](unsigned i) -> std::uint64_t {
    const std::uint64_t begin = std::uint64_t{i} * f;
    return begin >= stripe.length ? 0 : std::min(f, stripe.length - begin);
  };
  // Lost data fragments are rebuilt straight into `out` where they fit whole, else (the
  // padded tail) into scratch, then cut to their share.
  std::vector<std::uint8_t*> rebuilt(n, nullptr);
  std::vector<std::uint8_t> scratch;
  std::vector<unsigned> lost_data;
  for (unsigned i = 0; i < k; ++i) {
    if (intact[i] == nullptr) lost_data.push_back(i);
  }
  unsigned scratch_slots = 0;
  for (unsigned i : lost_data) scratch_slots += share(i) < f ? 1 : 0;
  scratch.resize(scratch_slots * f);
  unsigned slot = 0;
  for (unsigned i : lost_data) rebuilt[i] = share(i) == f ? dst + i * f : scratch.data() + f * slot++;
  if (!lost_data.empty() && f != 0) {
    Status st = code.Rebuild(intact, rebuilt, f);
    if (!st.ok()) return st;
  }
  for (unsigned i : lost_data) {
    if (Checksum::Of(rebuilt[i], f) != stripe.checksums[i]) {
      return Internal(CodeName(k, stripe.m) + ": rebuilt fragment " + FragmentName(i, k) +
                      " does not match its checksum");
    }
  }
  for (unsigned i = 0; i < k; ++i) {
    const std::uint8_t* from = intact[i] != nullptr ? intact[i] : rebuilt[i];
    const std::uint64_t bytes = share(i);
    if (bytes != 0 && from != dst + i * f) std::memcpy(dst + i * f, from, bytes);
  }
  return damage;
}

}  // namespace ckpt
