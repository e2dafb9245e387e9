// Attention over int8 KV codes (or an fp16 cache) read in place, fp32 queries (no query rounding), online softmax.
//
// Shapes (row-major, contiguous):
//   q    [Hkv, C, G, D] fp32: C tokens at positions start..start+C-1, G query heads per KV head (GQA)
//   k, v [Hkv, T, D]    int8 codes, the cache's T slots (one per position)
//   ks_tok, vs_tok      [Hkv, T] fp32 per-token scales (kv-int8), or null
//   ks_ch,  vs_ch       [Hkv, D] fp32 static per-channel scales (kv-int8c), or null
//   out  [Hkv, C, G, D] fp32
// Token c attends slots 0..start+c (causal). key = k * ks (per token or per channel), value likewise, as edgekv's
// eager layer dequantizes them (edgekv.quant: symmetric codes, zero point 0):
//   per token:   q.key_t = ks_t * (q . k_t);        sum_t p_t value_t = sum_t (p_t * vs_t) v_t
//   per channel: q.key_t = (q * ks) . k_t;          sum_t p_t value_t = vs * sum_t p_t v_t
// fp16_sdpa: the same attention over an fp16 cache (k, v [Hkv, T, D] as IEEE half bits), no scales: each value is
// converted to fp32 exactly (F16C's vcvtph2ps in the AVX2 build), so it computes what custom_sdpa computes on the
// cache cast to fp32, without the cast's copy.
// Keys are taken in blocks: a block of codes is converted to fp32 once and dotted with every query row of a tile of
// tokens (all G heads of each), so each code is converted once per tile, not once per query head.
#pragma once
#include <cstdint>
#include <cstring>

namespace edgekv_native {

// one IEEE fp16 value as stored (ExecuTorch's Half is these 16 bits)
struct half_bits {
  uint16_t bits;
};

// fp16 bits -> fp32, exact for every value (subnormals renormalized, inf and NaN kept)
inline float half_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: renormalize
      int e = -1;
      uint32_t m = man;
      do {
        ++e;
        m <<= 1;
      } while ((m & 0x400u) == 0);
      bits = sign | ((127 - 15 - e) << 23) | ((m & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

void int8_sdpa(const float* q, const int8_t* k, const int8_t* v, const float* ks_tok, const float* vs_tok,
               const float* ks_ch, const float* vs_ch, int64_t hkv, int64_t c, int64_t g, int64_t d, int64_t t,
               int64_t start, float scale, float* out);

void fp16_sdpa(const float* q, const uint16_t* k, const uint16_t* v, int64_t hkv, int64_t c, int64_t g, int64_t d,
               int64_t t, int64_t start, float scale, float* out);

// packed_sdpa: a packed int4 / int2 cache (edgekv.quant: asymmetric codes, 8 / bits a byte with the lowest channel in
// the low bits, an fp16 scale and zero per group of channels, per token and head), each block of keys dequantized to
// fp32 in the kernel's own small buffers (code * scale + zero, as edgekv.quant.dequantize), never the whole cache.
struct Packed {
  const uint8_t* codes;   // [Hkv, T, D * bits / 8]
  const uint16_t* scale;  // [Hkv, T, D / group] fp16 bits
  const uint16_t* zero;   // [Hkv, T, D / group] fp16 bits
  int64_t bits, group;    // 4 or 2; group divides D
};

void packed_sdpa(const float* q, const Packed& k, const Packed& v, int64_t hkv, int64_t c, int64_t g, int64_t d,
                 int64_t t, int64_t start, float scale, float* out);

// 1 when this build took the AVX2+FMA path, 0 for the portable scalar one
int int8_sdpa_simd();

}  // namespace edgekv_native
