// See int8_sdpa_core.h. Built with -mavx2 -mfma where the compiler and CPU have them (native/__init__.py decides),
// else the portable loops below (plain C++, which the compiler may vectorize itself, e.g. NEON on arm64); both compute
// the same sums, in another order of additions.
//
// Per KV head, per tile of tokens, per block of keys, per token of the tile, all G query heads of that token at once:
//   scores  s[g][j] = q_g . k_j        register tiles of 4 heads x 2 keys: each key's codes are loaded once for the
//                                      4 heads (GQA: a KV head's codes are read once for all its query heads)
//   softmax online (running max m, sum l per head): a block's exp in one vectorized pass
//   values  acc_g += sum_j p[g][j] v_j register tiles of 4 heads x 16 dimensions held over the block's keys
// A tile of one token (every decode step) reads the int8 codes directly (converted to fp32 in registers); a tile of
// several tokens (prefill) converts the block to fp32 once and reuses it for each of its tokens.
#include "int8_sdpa_core.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define EDGEKV_AVX2 1
#else
#define EDGEKV_AVX2 0
#endif

namespace edgekv_native {

namespace {

inline float ld(const float* p) { return *p; }
inline float ld(const int8_t* p) { return static_cast<float>(*p); }
inline float ld(const half_bits* p) { return half_to_float(p->bits); }

// n int8 codes (or fp16 values) -> fp32
inline void to_float(const int8_t* src, float* dst, int64_t n) {
  int64_t i = 0;
#if EDGEKV_AVX2
  for (; i + 8 <= n; i += 8) {
    __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

inline void to_float(const half_bits* src, float* dst, int64_t n) {
  int64_t i = 0;
#if EDGEKV_AVX2
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = ld(src + i);
}

#if EDGEKV_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
// 8 fp16 values -> fp32 (F16C's vcvtph2ps: exact, every fp16 value is an fp32 value)
inline __m256 load8(const half_bits* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline float hsum(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
  return _mm_cvtss_f32(h);
}

// exp(x) for x <= 0 (x - the running max): Cephes' expf as in avx_mathfun (range reduction by ln 2 in two parts, a
// degree-5 polynomial, the exponent added to the bits), relative error about 2e-7; below -87 it gives about 1e-38
// where std::exp gives a smaller number or 0, which no sum of probabilities of at least 1 can tell apart
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

// s[gi * ss + n] = q[gi] . k[n] for NG query rows (stride d) and NK keys (stride d)
template <int NG, int NK, class T>
inline void qk_tile(const float* q, const T* k, int64_t d, float* s, int64_t ss) {
  int64_t i = 0;
  float part[NG][NK];
#if EDGEKV_AVX2
  __m256 acc[NG][NK];
  for (int g = 0; g < NG; ++g)
    for (int n = 0; n < NK; ++n) acc[g][n] = _mm256_setzero_ps();
  for (; i + 8 <= d; i += 8) {
    __m256 kv[NK];
    for (int n = 0; n < NK; ++n) kv[n] = load8(k + n * d + i);
    for (int g = 0; g < NG; ++g) {
      const __m256 qv = _mm256_loadu_ps(q + g * d + i);
      for (int n = 0; n < NK; ++n) acc[g][n] = _mm256_fmadd_ps(qv, kv[n], acc[g][n]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int n = 0; n < NK; ++n) part[g][n] = hsum(acc[g][n]);
#else
  // 8 partial sums per (head, key), as the SIMD path keeps them: plain loops a compiler can vectorize
  float lane[NG][NK][8] = {};
  for (; i + 8 <= d; i += 8)
    for (int g = 0; g < NG; ++g)
      for (int n = 0; n < NK; ++n)
        for (int l = 0; l < 8; ++l) lane[g][n][l] += q[g * d + i + l] * ld(k + n * d + i + l);
  for (int g = 0; g < NG; ++g)
    for (int n = 0; n < NK; ++n) {
      float x = 0.f;
      for (int l = 0; l < 8; ++l) x += lane[g][n][l];
      part[g][n] = x;
    }
#endif
  for (int g = 0; g < NG; ++g)
    for (int n = 0; n < NK; ++n) {
      float x = part[g][n];
      for (int64_t t = i; t < d; ++t) x += q[g * d + t] * ld(k + n * d + t);
      s[g * ss + n] = x;
    }
}

// s[gi * ss + j] = q[gi] . k[j] for ng query rows, e keys
template <class T>
void scores(const float* q, int64_t ng, const T* k, int64_t e, int64_t d, float* s, int64_t ss) {
  int64_t g = 0;
  for (; g + 4 <= ng; g += 4) {
    int64_t j = 0;
    for (; j + 2 <= e; j += 2) qk_tile<4, 2>(q + g * d, k + j * d, d, s + g * ss + j, ss);
    for (; j < e; ++j) qk_tile<4, 1>(q + g * d, k + j * d, d, s + g * ss + j, ss);
  }
  for (; g < ng; ++g) {
    int64_t j = 0;
    for (; j + 4 <= e; j += 4) qk_tile<1, 4>(q + g * d, k + j * d, d, s + g * ss + j, ss);
    for (; j < e; ++j) qk_tile<1, 1>(q + g * d, k + j * d, d, s + g * ss + j, ss);
  }
}

// acc[gi] += sum_j p[gi * ps + j] * v[j] for NG accumulator rows (stride d), e keys; dimensions in tiles of 16
template <int NG, class T>
inline void pv_rows(const float* p, int64_t ps, const T* v, int64_t e, int64_t d, float* acc) {
  int64_t i = 0;
#if EDGEKV_AVX2
  for (; i + 16 <= d; i += 16) {
    __m256 a[NG][2];
    for (int g = 0; g < NG; ++g) {
      a[g][0] = _mm256_loadu_ps(acc + g * d + i);
      a[g][1] = _mm256_loadu_ps(acc + g * d + i + 8);
    }
    for (int64_t j = 0; j < e; ++j) {
      const __m256 v0 = load8(v + j * d + i), v1 = load8(v + j * d + i + 8);
      for (int g = 0; g < NG; ++g) {
        const __m256 pb = _mm256_broadcast_ss(p + g * ps + j);
        a[g][0] = _mm256_fmadd_ps(pb, v0, a[g][0]);
        a[g][1] = _mm256_fmadd_ps(pb, v1, a[g][1]);
      }
    }
    for (int g = 0; g < NG; ++g) {
      _mm256_storeu_ps(acc + g * d + i, a[g][0]);
      _mm256_storeu_ps(acc + g * d + i + 8, a[g][1]);
    }
  }
#else
  for (; i + 16 <= d; i += 16) {
    float a[NG][16];
    for (int g = 0; g < NG; ++g)
      for (int l = 0; l < 16; ++l) a[g][l] = acc[g * d + i + l];
    for (int64_t j = 0; j < e; ++j)
      for (int g = 0; g < NG; ++g) {
        const float pj = p[g * ps + j];
        for (int l = 0; l < 16; ++l) a[g][l] += pj * ld(v + j * d + i + l);
      }
    for (int g = 0; g < NG; ++g)
      for (int l = 0; l < 16; ++l) acc[g * d + i + l] = a[g][l];
  }
#endif
  for (; i < d; ++i)
    for (int g = 0; g < NG; ++g) {
      float x = acc[g * d + i];
      for (int64_t j = 0; j < e; ++j) x += p[g * ps + j] * ld(v + j * d + i);
      acc[g * d + i] = x;
    }
}

template <class T>
void values(const float* p, int64_t ng, int64_t ps, const T* v, int64_t e, int64_t d, float* acc) {
  int64_t g = 0;
  for (; g + 4 <= ng; g += 4) pv_rows<4>(p + g * ps, ps, v, e, d, acc + g * d);
  for (; g + 2 <= ng; g += 2) pv_rows<2>(p + g * ps, ps, v, e, d, acc + g * d);
  for (; g < ng; ++g) pv_rows<1>(p + g * ps, ps, v, e, d, acc + g * d);
}

// y[j] = exp(x[j] - m) for j < n; returns their sum
inline float exp_minus(const float* x, float m, int64_t n, float* y) {
  int64_t j = 0;
  float sum = 0.f;
#if EDGEKV_AVX2
  const __m256 mv = _mm256_set1_ps(m);
  __m256 sv = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + j), mv));
    _mm256_storeu_ps(y + j, p);
    sv = _mm256_add_ps(sv, p);
  }
  sum = hsum(sv);
#endif
  for (; j < n; ++j) {
    y[j] = std::exp(x[j] - m);
    sum += y[j];
  }
  return sum;
}

inline void scale_by(float a, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] *= a;
}

// One token's G heads over keys b0..b0+e-1 of this KV head (codes or converted floats at kb_, vb_): scores, the
// online softmax update of m, l, and the values into acc.
template <class T>
void attend_block(const float* qrows, const T* kb_, const T* vb_, const float* kst, const float* vst, int64_t b0,
                  int64_t e, int64_t g, int64_t d, int64_t ss, float* s, float* p, float* acc, float* m, float* l) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  scores(qrows, g, kb_, e, d, s, ss);
  for (int64_t gi = 0; gi < g; ++gi) {
    float* srow = s + gi * ss;
    float* prow = p + gi * ss;
    if (kst)
      for (int64_t j = 0; j < e; ++j) srow[j] *= kst[b0 + j];
    float mx = neg_inf;
    for (int64_t j = 0; j < e; ++j) mx = std::max(mx, srow[j]);
    const float mnew = std::max(m[gi], mx);
    if (m[gi] != neg_inf && m[gi] != mnew) {
      const float corr = std::exp(m[gi] - mnew);
      scale_by(corr, acc + gi * d, d);
      l[gi] *= corr;
    }
    l[gi] += exp_minus(srow, mnew, e, prow);
    m[gi] = mnew;
    if (vst)
      for (int64_t j = 0; j < e; ++j) prow[j] *= vst[b0 + j];
  }
  values(p, g, ss, vb_, e, d, acc);
}

// keys b0..b0+nb-1 of KV head h of a packed cache, dequantized to fp32 [nb, D] as edgekv.quant.dequantize does it
// (code * scale + zero per group of channels)
template <int BITS>
void unpack_rows(const Packed& pk, int64_t h, int64_t t, int64_t d, int64_t b0, int64_t nb, float* dst) {
  constexpr int per = 8 / BITS, mask = (1 << BITS) - 1;
  const int64_t row = d / per, ng = d / pk.group;
  for (int64_t j = 0; j < nb; ++j) {
    const int64_t slot = h * t + b0 + j;
    const uint8_t* src = pk.codes + slot * row;
    const uint16_t* sc = pk.scale + slot * ng;
    const uint16_t* zp = pk.zero + slot * ng;
    float* o = dst + j * d;
    for (int64_t gi = 0; gi < ng; ++gi) {
      const float s = half_to_float(sc[gi]), z = half_to_float(zp[gi]);
      int64_t ch = gi * pk.group;
      const int64_t end = ch + pk.group;
#if EDGEKV_AVX2
      if (BITS == 4) {  // 8 channels from 4 bytes: low and high nibbles interleaved back into channel order
        const __m256 sv = _mm256_set1_ps(s), zv = _mm256_set1_ps(z);
        const __m128i low4 = _mm_set1_epi8(0x0f);
        for (; ch + 8 <= end; ch += 8) {
          int32_t word;
          std::memcpy(&word, src + ch / 2, 4);
          const __m128i x = _mm_cvtsi32_si128(word);
          const __m128i lo = _mm_and_si128(x, low4), hi = _mm_and_si128(_mm_srli_epi16(x, 4), low4);
          const __m256 codes = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)));
          _mm256_storeu_ps(o + ch, _mm256_fmadd_ps(codes, sv, zv));
        }
      }
#endif
      for (; ch < end; ++ch) o[ch] = static_cast<float>((src[ch / per] >> ((ch % per) * BITS)) & mask) * s + z;
    }
  }
}

inline void unpack_rows(const Packed& pk, int64_t h, int64_t t, int64_t d, int64_t b0, int64_t nb, float* dst) {
  if (pk.bits == 4)
    unpack_rows<4>(pk, h, t, d, b0, nb, dst);
  else
    unpack_rows<2>(pk, h, t, d, b0, nb, dst);
}

// the attention over a cache of element type T (int8 codes with their scales, or fp16 values with none), or over a
// packed cache (pk, pv: k and v unused), whose blocks are always dequantized to fp32 first
template <class T>
void cache_sdpa(const float* q, const T* k, const T* v, const float* ks_tok, const float* vs_tok, const float* ks_ch,
                const float* vs_ch, int64_t hkv, int64_t c, int64_t g, int64_t d, int64_t t, int64_t start,
                float scale, float* out, const Packed* pk = nullptr, const Packed* pv = nullptr) {
  // keys per block. Converted (a tile of several tokens): the block's keys and values in fp32 (2 * kb * d floats)
  // stay within about 32 KiB (L1). Read in place (one token): 16 KiB of codes, so the running max and sum are
  // updated once per 64 keys at Gemma 3's head size 256.
  const int64_t kb_conv = std::max<int64_t>(8, 4096 / std::max<int64_t>(d, 1));
  const int64_t kb_direct = std::max<int64_t>(16, 16384 / std::max<int64_t>(d, 1));
  const int64_t kbm = std::max(kb_conv, kb_direct);
  const int64_t qt = 16;  // tokens per tile: each converted block serves qt * g query rows
  const float neg_inf = -std::numeric_limits<float>::infinity();
  std::vector<float> kf(kb_conv * d), vf(kb_conv * d), s(g * kbm), p(g * kbm);
  std::vector<float> qr(qt * g * d), acc(qt * g * d), m(qt * g), l(qt * g);
  for (int64_t h = 0; h < hkv; ++h) {
    const T* kh = k ? k + h * t * d : nullptr;
    const T* vh = v ? v + h * t * d : nullptr;
    const float* kst = ks_tok ? ks_tok + h * t : nullptr;
    const float* vst = vs_tok ? vs_tok + h * t : nullptr;
    for (int64_t c0 = 0; c0 < c; c0 += qt) {
      const int64_t c1 = std::min(c, c0 + qt), rows = (c1 - c0) * g;
      for (int64_t r = 0; r < rows; ++r) {
        const float* src = q + ((h * c + c0) * g + r) * d;  // rows of a tile are contiguous in [Hkv, C, G, D]
        float* dst = qr.data() + r * d;
        for (int64_t i = 0; i < d; ++i) dst[i] = src[i] * scale * (ks_ch ? ks_ch[h * d + i] : 1.f);
      }
      std::fill(acc.begin(), acc.begin() + rows * d, 0.f);
      std::fill(m.begin(), m.begin() + rows, neg_inf);
      std::fill(l.begin(), l.begin() + rows, 0.f);
      const int64_t n = std::min(t, start + c1);  // the tile's last token attends slots 0..start+c1-1
      const bool direct = !pk && c1 - c0 == 1;
      const int64_t kb = direct ? kb_direct : kb_conv;
      for (int64_t b0 = 0; b0 < n; b0 += kb) {
        const int64_t nb = std::min(n, b0 + kb) - b0;
        if (pk) {
          unpack_rows(*pk, h, t, d, b0, nb, kf.data());
          unpack_rows(*pv, h, t, d, b0, nb, vf.data());
        } else if (!direct) {
          to_float(kh + b0 * d, kf.data(), nb * d);
          to_float(vh + b0 * d, vf.data(), nb * d);
        }
        for (int64_t ci = c0; ci < c1; ++ci) {
          const int64_t e = std::min(nb, start + ci + 1 - b0);  // this token's keys in the block
          if (e <= 0) continue;
          const int64_t r = (ci - c0) * g;
          if (direct)
            attend_block(qr.data() + r * d, kh + b0 * d, vh + b0 * d, kst, vst, b0, e, g, d, kbm, s.data(),
                         p.data(), acc.data() + r * d, m.data() + r, l.data() + r);
          else
            attend_block<float>(qr.data() + r * d, kf.data(), vf.data(), kst, vst, b0, e, g, d, kbm, s.data(),
                                p.data(), acc.data() + r * d, m.data() + r, l.data() + r);
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        float* dst = out + ((h * c + c0) * g + r) * d;
        const float* arow = acc.data() + r * d;
        const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
        for (int64_t i = 0; i < d; ++i) dst[i] = arow[i] * inv * (vs_ch ? vs_ch[h * d + i] : 1.f);
      }
    }
  }
}

}  // namespace

int int8_sdpa_simd() { return EDGEKV_AVX2; }

void int8_sdpa(const float* q, const int8_t* k, const int8_t* v, const float* ks_tok, const float* vs_tok,
               const float* ks_ch, const float* vs_ch, int64_t hkv, int64_t c, int64_t g, int64_t d, int64_t t,
               int64_t start, float scale, float* out) {
  cache_sdpa(q, k, v, ks_tok, vs_tok, ks_ch, vs_ch, hkv, c, g, d, t, start, scale, out);
}

void fp16_sdpa(const float* q, const uint16_t* k, const uint16_t* v, int64_t hkv, int64_t c, int64_t g, int64_t d,
               int64_t t, int64_t start, float scale, float* out) {
  cache_sdpa(q, reinterpret_cast<const half_bits*>(k), reinterpret_cast<const half_bits*>(v), nullptr, nullptr,
             nullptr, nullptr, hkv, c, g, d, t, start, scale, out);
}

void packed_sdpa(const float* q, const Packed& k, const Packed& v, int64_t hkv, int64_t c, int64_t g, int64_t d,
                 int64_t t, int64_t start, float scale, float* out) {
  cache_sdpa<int8_t>(q, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, hkv, c, g, d, t, start, scale, out, &k,
                     &v);
}

}  // namespace edgekv_native
