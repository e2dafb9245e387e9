// See int8_sdpa_core.h. Built with -mavx2 -mfma where the compiler and CPU have them (the Makefile decides), else the
// portable scalar loops below; both compute the same sums (the SIMD path in another order of additions).
#include "int8_sdpa_core.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define EDGEKV_AVX2 1
#else
#define EDGEKV_AVX2 0
#endif

namespace edgekv_native {

namespace {

// n int8 codes -> fp32
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

inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#if EDGEKV_AVX2
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
  }
  for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
  s0 = _mm256_add_ps(s0, s1);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s0), _mm256_extractf128_ps(s0, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
  s = _mm_cvtss_f32(h);
#endif
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y += a * x
inline void axpy(float a, const float* x, float* y, int64_t n) {
  int64_t i = 0;
#if EDGEKV_AVX2
  __m256 av = _mm256_set1_ps(a);
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
  for (; i < n; ++i) y[i] += a * x[i];
}

inline void scale_by(float a, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] *= a;
}

}  // namespace

int int8_sdpa_simd() { return EDGEKV_AVX2; }

void int8_sdpa(const float* q, const int8_t* k, const int8_t* v, const float* ks_tok, const float* vs_tok,
               const float* ks_ch, const float* vs_ch, int64_t hkv, int64_t c, int64_t g, int64_t d, int64_t t,
               int64_t start, float scale, float* out) {
  // keys per block: the block's keys and values in fp32 (2 * kb * d floats) stay within about 32 KiB (L1)
  const int64_t kb = std::max<int64_t>(8, 4096 / std::max<int64_t>(d, 1));
  const int64_t qt = 16;  // tokens per tile: each converted block serves qt * g query rows
  const float neg_inf = -std::numeric_limits<float>::infinity();
  std::vector<float> kf(kb * d), vf(kb * d), s(kb);
  std::vector<float> qr(qt * g * d), acc(qt * g * d), m(qt * g), l(qt * g);
  for (int64_t h = 0; h < hkv; ++h) {
    const int8_t* kh = k + h * t * d;
    const int8_t* vh = v + h * t * d;
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
      for (int64_t b0 = 0; b0 < n; b0 += kb) {
        const int64_t nb = std::min(n, b0 + kb) - b0;
        to_float(kh + b0 * d, kf.data(), nb * d);
        to_float(vh + b0 * d, vf.data(), nb * d);
        for (int64_t ci = c0; ci < c1; ++ci) {
          const int64_t e = std::min(nb, start + ci + 1 - b0);  // this token's keys in the block
          if (e <= 0) continue;
          for (int64_t gi = 0; gi < g; ++gi) {
            const int64_t r = (ci - c0) * g + gi;
            const float* qrow = qr.data() + r * d;
            float* arow = acc.data() + r * d;
            float mx = neg_inf;
            for (int64_t j = 0; j < e; ++j) {
              float x = dot(qrow, kf.data() + j * d, d);
              if (kst) x *= kst[b0 + j];
              s[j] = x;
              mx = std::max(mx, x);
            }
            const float mnew = std::max(m[r], mx);
            if (m[r] != neg_inf && m[r] != mnew) {
              const float corr = std::exp(m[r] - mnew);
              scale_by(corr, arow, d);
              l[r] *= corr;
            }
            float lsum = 0.f;
            for (int64_t j = 0; j < e; ++j) {
              const float p = std::exp(s[j] - mnew);
              lsum += p;
              axpy(vst ? p * vst[b0 + j] : p, vf.data() + j * d, arow, d);
            }
            l[r] += lsum;
            m[r] = mnew;
          }
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

}  // namespace edgekv_native
