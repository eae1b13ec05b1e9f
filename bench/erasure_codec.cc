// ckpt-erasure-bench: what the Reed-Solomon code of peer redundancy
// (daemon/replication/erasure_code.h) costs, next to a single-thread memcpy of the same bytes
// in the same run. For each code (k=4 m=1, k=4 m=2) over a buffer of --mib MiB, all on one
// thread, the median of --repeats runs of:
//   encode              ErasureCode::Encode: the m parity fragments of the k data fragments
//   decode              ErasureCode::Rebuild of the worst case, m data fragments lost
//   stripe encode       EncodeStripe: encode plus a checksum of every fragment
//   stripe reconstruct  ReconstructStripe with m data fragments lost: checksums of the
//                       survivors, rebuild, checksums of the rebuilt, copy into the output
//   memcpy              the buffer copied into another, both already touched
// Figures are GB/s (1e9 bytes/s) of the buffer's data bytes. --out FILE writes them as JSON.
// Everything lives in process memory; nothing is written but --out.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "daemon/replication/erasure_code.h"

using namespace ckpt;

namespace {

// A buffer of `bytes`, every page touched so that no page fault is timed.
std::unique_ptr<std::uint8_t[]> Touched(std::size_t bytes, std::uint8_t value) {
  auto p = std::make_unique_for_overwrite<std::uint8_t[]>(bytes);
  std::memset(p.get(), value, bytes);
  return p;
}

// GB/s of `bytes` moved per run of `op`, the median of `repeats` runs; 0 if a run failed.
double MedianGbps(std::size_t bytes, unsigned repeats, const std::function<bool()>& op) {
  std::vector<double> gbps;
  for (unsigned r = 0; r < repeats; ++r) {
    const auto start = std::chrono::steady_clock::now();
    if (!op()) return 0;
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    gbps.push_back(static_cast<double>(bytes) / s / 1e9);
  }
  std::sort(gbps.begin(), gbps.end());
  return gbps.size() % 2 == 1 ? gbps[gbps.size() / 2]
                              : (gbps[gbps.size() / 2 - 1] + gbps[gbps.size() / 2]) / 2;
}

struct Figures {
  unsigned k, m;
  double encode, decode, stripe_encode, stripe_reconstruct, memcpy;
};

bool Fail(const char* what, const Status& st) {
  std::fprintf(stderr, "ckpt-erasure-bench: %s: %s\n", what, st.message().c_str());
  return false;
}

bool Measure(unsigned k, unsigned m, std::size_t bytes, unsigned repeats, Figures* fig) {
  Result<ErasureCode> created = ErasureCode::Create(k, m);
  if (!created.ok()) return Fail("Create", created.status());
  const ErasureCode& code = created.value();
  auto data = Touched(bytes, 0);
  for (std::size_t i = 0; i < bytes; ++i) data[i] = static_cast<std::uint8_t>(i * 2654435761u >> 13);
  const std::uint64_t f = StripeFragmentBytes(bytes, k);

  // The codec alone: data fragments in place in the buffer (its tail padded in a copy when
  // the buffer is not a multiple of k * 64), parity and rebuilt fragments preallocated.
  auto padded = Touched(k * f, 0);
  std::memcpy(padded.get(), data.get(), bytes);
  const std::uint8_t* in = bytes == k * f ? data.get() : padded.get();
  std::vector<const std::uint8_t*> frags(k + m);
  for (unsigned i = 0; i < k; ++i) frags[i] = in + i * f;
  auto parity_buf = Touched(m * f, 0);
  std::vector<std::uint8_t*> parity(m);
  for (unsigned p = 0; p < m; ++p) frags[k + p] = parity[p] = parity_buf.get() + p * f;
  Status st;
  fig->encode = MedianGbps(bytes, repeats, [&] {
    st = code.Encode(std::span(frags).first(k), parity, f);
    return st.ok() || Fail("Encode", st);
  });

  auto rebuilt_buf = Touched(m * f, 0);
  std::vector<const std::uint8_t*> survivors = frags;
  std::vector<std::uint8_t*> out(k + m, nullptr);
  for (unsigned i = 0; i < m; ++i) {
    survivors[i] = nullptr;
    out[i] = rebuilt_buf.get() + i * f;
  }
  fig->decode = MedianGbps(bytes, repeats, [&] {
    st = code.Rebuild(survivors, out, f);
    return st.ok() || Fail("Rebuild", st);
  });
  if (std::memcmp(rebuilt_buf.get(), in, m * f) != 0) {
    std::fprintf(stderr, "ckpt-erasure-bench: k=%u m=%u: rebuilt fragments differ from the data\n", k, m);
    return false;
  }
  parity_buf.reset();
  rebuilt_buf.reset();
  padded.reset();

  // The stripe layer, checksums included.
  Result<EncodedStripe> encoded = Internal("EncodeStripe not run");
  fig->stripe_encode = MedianGbps(bytes, repeats, [&] {
    encoded = EncodeStripe(code, data.get(), bytes);
    return encoded.ok() || Fail("EncodeStripe", encoded.status());
  });
  if (!encoded.ok()) return false;
  std::vector<const std::uint8_t*> stripe_frags(encoded->fragments().begin(), encoded->fragments().end());
  for (unsigned i = 0; i < m; ++i) stripe_frags[i] = nullptr;
  auto restored = Touched(bytes, 0);
  fig->stripe_reconstruct = MedianGbps(bytes, repeats, [&] {
    Result<StripeDamage> damage = ReconstructStripe(code, encoded->stripe(), stripe_frags, restored.get());
    return damage.ok() || Fail("ReconstructStripe", damage.status());
  });
  if (std::memcmp(restored.get(), data.get(), bytes) != 0) {
    std::fprintf(stderr, "ckpt-erasure-bench: k=%u m=%u: reconstructed buffer differs\n", k, m);
    return false;
  }

  fig->memcpy = MedianGbps(bytes, repeats, [&] {
    std::memcpy(restored.get(), data.get(), bytes);
    return true;
  });
  fig->k = k;
  fig->m = m;
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ckpt-erasure-bench: Reed-Solomon encode and rebuild (ISA-L) against memcpy"};
  std::size_t mib = 256;
  unsigned repeats = 5;
  std::string out;
  app.add_option("--mib", mib, "Buffer size, in MiB")->capture_default_str()->check(CLI::Range(1, 1 << 16));
  app.add_option("--repeats", repeats, "Runs of each measurement; the median counts")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  app.add_option("--out", out, "JSON file for the figures");
  CLI11_PARSE(app, argc, argv);

  const std::size_t bytes = mib << 20;
  std::vector<Figures> all;
  for (auto [k, m] : {std::pair{4u, 1u}, std::pair{4u, 2u}}) {
    Figures fig{};
    if (!Measure(k, m, bytes, repeats, &fig)) return 1;
    all.push_back(fig);
  }

  std::printf("buffer %zu MiB, median of %u runs, one thread, GB/s of data bytes\n", mib, repeats);
  std::printf("%-6s %8s %8s %14s %19s %8s\n", "code", "encode", "decode", "stripe encode",
              "stripe reconstruct", "memcpy");
  for (const Figures& f : all) {
    const std::string name = std::to_string(f.k) + "+" + std::to_string(f.m);
    std::printf("%-6s %8.2f %8.2f %14.2f %19.2f %8.2f\n", name.c_str(), f.encode, f.decode, f.stripe_encode,
                f.stripe_reconstruct, f.memcpy);
  }
  if (!out.empty()) {
    nlohmann::json j = {{"bench", "erasure_codec"}, {"mib", mib},
                        {"repeats", repeats},       {"threads", 1},
                        {"statistic", "median"},    {"unit", "GB/s of data bytes"}};
    for (const Figures& f : all) {
      j["codes"].push_back({{"k", f.k},
                            {"m", f.m},
                            {"decode_lost", "data fragments 0.." + std::to_string(f.m - 1)},
                            {"encode_gbps", f.encode},
                            {"decode_gbps", f.decode},
                            {"stripe_encode_gbps", f.stripe_encode},
                            {"stripe_reconstruct_gbps", f.stripe_reconstruct},
                            {"memcpy_gbps", f.memcpy}});
    }
    std::ofstream file(out);
    file << j.dump(2) << "\n";
    if (!file.good()) {
      std::fprintf(stderr, "ckpt-erasure-bench: cannot write %s\n", out.c_str());
      return 1;
    }
  }
  return 0;
}
