// SHA-256 (FIPS 180-4), written for optfuse: the disk cache's keys and its entries' checksums.
// Checked against the FIPS 180-2 example vectors in tests/cpu/test_sha256.cpp.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace optfuse {

class Sha256 {
 public:
  using Digest = std::array<uint8_t, 32>;
  Sha256();
  void update(const void* data, size_t size);
  void update(const std::string& s) { update(s.data(), s.size()); }
  Digest finish();  // the object must not be updated again afterwards

 private:
  void blocks(const uint8_t* p, size_t n);  // n blocks of 64 bytes
  void block(const uint8_t* p);             // the portable code
  uint32_t h_[8];
  uint8_t buf_[64];
  size_t buffered_ = 0;
  uint64_t total_ = 0;  // bytes
};

Sha256::Digest sha256(const void* data, size_t size);

// Whether the x86 SHA extensions are used (chosen once from CPUID). Tests switch to compare both
// implementations; returns false (and changes nothing) if asked for extensions the CPU lacks.
bool sha256_accelerated();
bool sha256_use_accelerated(bool on);
std::string to_hex(const Sha256::Digest& d);
inline std::string sha256_hex(const std::string& s) { return to_hex(sha256(s.data(), s.size())); }

}  // namespace optfuse
