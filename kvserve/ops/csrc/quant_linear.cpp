// Linear layers on GGUF block-quantized weights kept packed: y[M, N] = x[M, K] @ W^T.
//
//   x       [M, K]   float32, contiguous (M small: decode, speculative verification)
//   packed  [ceil(N/4), K/B, 4, T] uint8: GGUF blocks (B weights in T bytes each, stored as
//           llama.cpp stores them), rows interleaved by 4 (ops/quant/formats.py, packing.py)
//   qtype   the GGML type id: Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q8_0 8, Q4_K 12, Q5_K 13, Q6_K 14
//   -> y    [M, N] float32
//
// As llama.cpp does, x is first quantized per block to int8 (quantize_x: d = amax / 127 per
// block of 32, or 256 for the K-quants, q = round-half-even(x / d), plus the sums of q per 32
// or 16 that the weights' minimums / offsets multiply); each weight block is then an integer
// dot product of its unpacked 4/5/6/8-bit values with the x block, times float scales. The
// integer parts are exact, so the result differs from float64 math on the same quantized
// values only by float32 rounding of the per-block terms (tests: 1e-5 of |x_q| @ |W|^T).
//
// With M small the op is a stream over the packed weight (0.56-1.06 bytes a weight) and x's
// int8 blocks stay in L1. Work items are groups of 4 output rows (at::parallel_for over them);
// a group's blocks are one sequential stream. x rows are taken MB at a time (MB <= 2 on AVX2,
// so that the 4 x MB float accumulators stay in registers) while the group is in L1.
//
// Paths: AVX2 (avx2 tier and above): maddubs (u8 x s8 -> s16 pairs) and madd (-> s32), signed
// weights through the sign trick (|w| x sign(x, w)); the portable path: the same integer math
// in plain loops. quant_dequantize gives float32 rows (bit-identical to gguf's dequantizer) for
// the large-batch path, which feeds them to a float32 GEMM (ops/quant/weight.py).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "vec_avx2.h"

namespace {

#define QL_INLINE inline __attribute__((always_inline))

constexpr int64_t kGroup = 4;          // output rows per work item (the packed interleave)
// Minimum packed bytes per thread's share: below this the fork/join costs more than it gains.
constexpr int64_t kMinBytesPerTask = 16384;

enum QType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8,
                       kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

struct Format { int64_t block, bytes, act_block, sum_group; };

Format format_of(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: return {32, 18, 32, 32};
    case kQ4_1: return {32, 20, 32, 32};
    case kQ5_0: return {32, 22, 32, 32};
    case kQ5_1: return {32, 24, 32, 32};
    case kQ8_0: return {32, 34, 32, 32};
    case kQ4_K: return {256, 144, 256, 16};
    case kQ5_K: return {256, 176, 256, 16};
    case kQ6_K: return {256, 210, 256, 16};
    default: TORCH_CHECK(false, "quant_linear: unsupported GGML type ", qtype);
  }
  return {};
}

QL_INLINE float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(KVS_AVX2)
  return _cvtsh_ss(h);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

// Q4_K / Q5_K: 8 six-bit scales and mins from 12 bytes (llama.cpp's get_scale_min_k4).
QL_INLINE void scale_min_k4(const uint8_t* s, uint8_t* sc, uint8_t* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    mn[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 0xF) | ((s[j] >> 6) << 4);
    mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
  }
}

// The quantized activations: q [M, K] int8, d [M, K / act_block], s [M, K / sum_group].
struct XQ {
  const int8_t* q;
  const float* d;
  const int32_t* s;
  int64_t K, nd, ns;     // row strides of q, d, s
};

// ------------------------------------------------------------------ activation quantization

// One block of n (32 or 256) values: scale, int8 values, sums of each `group` (16 or 32).
void quantize_block(const float* x, int64_t n, int64_t group, int8_t* q, float* d,
                    int32_t* s) {
  float amax = 0.f;
#if defined(KVS_AVX2)
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 mx = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8)
    mx = _mm256_max_ps(mx, _mm256_and_ps(_mm256_loadu_ps(x + i), absmask));
  amax = kvs_avx2::hmax8(mx);
#else
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
#endif
  const float dd = amax / 127.f;
  const float inv = dd > 0.f ? 1.f / dd : 0.f;
  *d = dd;
#if defined(KVS_AVX2)
  const __m256 iv = _mm256_set1_ps(inv);
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t c = 0; c < n; c += 32) {
    __m256i v[4];
    for (int i = 0; i < 4; ++i) {
      const __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + c + 8 * i), iv),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      v[i] = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(r), lo), hi);
    }
    const __m256i p01 = _mm256_packs_epi32(v[0], v[1]);   // values 0-15 (lane-shuffled)
    const __m256i p23 = _mm256_packs_epi32(v[2], v[3]);   // values 16-31
    const __m256i b = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23),
                                                  _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + c), b);
    const __m256i s01 = _mm256_madd_epi16(p01, ones), s23 = _mm256_madd_epi16(p23, ones);
    const int32_t a = static_cast<int32_t>(kvs_avx2::hsum8(_mm256_cvtepi32_ps(s01)));
    const int32_t e = static_cast<int32_t>(kvs_avx2::hsum8(_mm256_cvtepi32_ps(s23)));
    if (group == 16) {
      s[c / 16] = a;
      s[c / 16 + 1] = e;
    } else {
      s[c / 32] = a + e;
    }
  }
#else
  for (int64_t g = 0; g < n / group; ++g) {
    int32_t sum = 0;
    for (int64_t i = g * group; i < (g + 1) * group; ++i) {
      const float r = std::nearbyint(x[i] * inv);
      const int v = static_cast<int>(std::min(127.f, std::max(-127.f, r)));
      q[i] = static_cast<int8_t>(v);
      sum += v;
    }
    s[g] = sum;
  }
#endif
}

void quantize_x(const float* x, int64_t M, int64_t K, const Format& f, int8_t* q, float* d,
                int32_t* s) {
  const int64_t nd = K / f.act_block, ns = K / f.sum_group;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nd; ++b)
      quantize_block(x + m * K + b * f.act_block, f.act_block, f.sum_group,
                     q + m * K + b * f.act_block, d + m * nd + b,
                     s + m * ns + b * (f.act_block / f.sum_group));
}

// ------------------------------------------------------------------ portable path
// One weight block against one x row's block b: its float contribution.

float dot_generic(int64_t qt, const uint8_t* w, const XQ& x, int64_t m, int64_t b) {
  const int8_t* xq = x.q + m * x.K;
  const float xd = x.d[m * x.nd + b];
  const int32_t* xs = x.s + m * x.ns;
  if (qt == kQ8_0 || qt == kQ4_0 || qt == kQ4_1 || qt == kQ5_0 || qt == kQ5_1) {
    const int8_t* xb = xq + b * 32;
    const bool has_min = qt == kQ4_1 || qt == kQ5_1;
    const uint8_t* qs = w + (has_min ? 4 : 2) + ((qt == kQ5_0 || qt == kQ5_1) ? 4 : 0);
    uint32_t qh = 0;
    if (qt == kQ5_0 || qt == kQ5_1) std::memcpy(&qh, w + (has_min ? 4 : 2), 4);
    int32_t sumi = 0;
    for (int i = 0; i < 32; ++i) {
      int v;
      if (qt == kQ8_0) {
        v = static_cast<int8_t>(w[2 + i]);
      } else {
        v = i < 16 ? (qs[i] & 0xF) : (qs[i - 16] >> 4);
        if (qt == kQ5_0 || qt == kQ5_1) v |= ((qh >> i) & 1) << 4;
        if (qt == kQ4_0) v -= 8;
        if (qt == kQ5_0) v -= 16;
      }
      sumi += v * xb[i];
    }
    float r = f16(w) * xd * static_cast<float>(sumi);
    if (has_min) r += f16(w + 2) * xd * static_cast<float>(xs[b]);
    return r;
  }
  const int8_t* xb = xq + b * 256;
  const int32_t* bs = xs + b * 16;
  if (qt == kQ6_K) {
    const uint8_t* ql = w;
    const uint8_t* qh = w + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(w + 192);
    int32_t sumi = 0;
    for (int h = 0; h < 2; ++h)
      for (int t = 0; t < 4; ++t)
        for (int l = 0; l < 32; ++l) {
          const uint8_t lb = ql[64 * h + 32 * (t & 1) + l];
          const int lo = (t < 2 ? lb : lb >> 4) & 0xF;
          const int v = (lo | (((qh[32 * h + l] >> (2 * t)) & 3) << 4)) - 32;
          const int i = 128 * h + 32 * t + l;
          sumi += sc[i / 16] * v * xb[i];
        }
    return f16(w + 208) * xd * static_cast<float>(sumi);
  }
  uint8_t sc[8], mn[8];
  scale_min_k4(w + 4, sc, mn);
  const uint8_t* qs = w + (qt == kQ5_K ? 48 : 16);
  int32_t sumi = 0, msum = 0;
  for (int j = 0; j < 8; ++j) {
    int32_t part = 0;
    for (int l = 0; l < 32; ++l) {
      const uint8_t byte = qs[32 * (j / 2) + l];
      int v = (j & 1) ? byte >> 4 : byte & 0xF;
      if (qt == kQ5_K) v |= ((w[16 + l] >> j) & 1) << 4;
      part += v * xb[32 * j + l];
    }
    sumi += sc[j] * part;
    msum += mn[j] * (bs[2 * j] + bs[2 * j + 1]);
  }
  return f16(w) * xd * static_cast<float>(sumi) - f16(w + 2) * xd * static_cast<float>(msum);
}

void run_generic(int64_t qt, const Format& f, const uint8_t* packed, const XQ& x, float* y,
                 int64_t M, int64_t N, int64_t g0, int64_t g1) {
  const int64_t nb = x.K / f.block;
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* wg = packed + g * nb * kGroup * f.bytes;
    for (int64_t r = 0; r < kGroup && g * kGroup + r < N; ++r)
      for (int64_t m = 0; m < M; ++m) {
        float acc = 0.f;
        for (int64_t b = 0; b < nb; ++b)
          acc += dot_generic(qt, wg + (b * kGroup + r) * f.bytes, x, m, b);
        y[m * N + g * kGroup + r] = acc;
      }
  }
}

// ------------------------------------------------------------------ AVX2 path
#if defined(KVS_AVX2)

// Accumulators of one pass: acc[r * MB + m] (8 float lanes) and accs[r * MB + m] (scalar terms:
// the minimums' products).
template <int MB>
struct Acc {
  __m256 v[kGroup * MB];
  float s[kGroup * MB];
};

QL_INLINE __m256i nibbles32(const uint8_t* p) {      // 16 bytes -> 32 values (low, then high)
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0xF));
}

QL_INLINE __m256i bits32(const uint8_t* p) {          // u32 -> 0x10 in byte i where bit i is set
  uint32_t v;
  std::memcpy(&v, p, 4);
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                         0x0101010101010101, 0x0000000000000000);
  __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(v)), shuf);
  b = _mm256_or_si256(b, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_and_si256(_mm256_cmpeq_epi8(b, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(0x10));
}

QL_INLINE __m256i dot_u8s8(__m256i u, __m256i s) {   // 8 int32 partial sums of u * s
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

// The 32-blocks: w unpacked once per row, then each x row of the pass.
template <int64_t QT, int MB>
QL_INLINE void block32(const uint8_t* w, const XQ& x, int64_t m0, int64_t b, int r, Acc<MB>& a) {
  constexpr bool kMin = QT == kQ4_1 || QT == kQ5_1;
  constexpr bool kSigned = !kMin;
  const float dw = f16(w);
  __m256i q;
  if constexpr (QT == kQ8_0) {
    q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 2));
  } else if constexpr (QT == kQ4_0 || QT == kQ4_1) {
    q = nibbles32(w + (kMin ? 4 : 2));
  } else {
    q = _mm256_or_si256(nibbles32(w + (kMin ? 8 : 6)), bits32(w + (kMin ? 4 : 2)));
  }
  if constexpr (QT == kQ4_0) q = _mm256_sub_epi8(q, _mm256_set1_epi8(8));
  if constexpr (QT == kQ5_0) q = _mm256_sub_epi8(q, _mm256_set1_epi8(16));
  const __m256i u = kSigned ? _mm256_sign_epi8(q, q) : q;
  for (int m = 0; m < MB; ++m) {
    __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + (m0 + m) * x.K + b * 32));
    if constexpr (kSigned) xv = _mm256_sign_epi8(xv, q);
    const float xd = x.d[(m0 + m) * x.nd + b];
    a.v[r * MB + m] = _mm256_fmadd_ps(_mm256_set1_ps(dw * xd),
                                      _mm256_cvtepi32_ps(dot_u8s8(u, xv)), a.v[r * MB + m]);
    if constexpr (kMin)
      a.s[r * MB + m] += f16(w + 2) * xd * static_cast<float>(x.s[(m0 + m) * x.ns + b]);
  }
}

// Q4_K / Q5_K: 8 sub-blocks of 32 with 6-bit scales (integer, in madd) and mins (via the sums).
template <int64_t QT, int MB>
QL_INLINE void block_k45(const uint8_t* w, const XQ& x, int64_t m0, int64_t b, int r,
                         Acc<MB>& a) {
  uint8_t sc[8], mn[8];
  scale_min_k4(w + 4, sc, mn);
  const uint8_t* qs = w + (QT == kQ5_K ? 48 : 16);
  __m256i qh = _mm256_setzero_si256();
  if constexpr (QT == kQ5_K) qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16));
  __m256i sumi[MB];
  for (int m = 0; m < MB; ++m) sumi[m] = _mm256_setzero_si256();
  const __m256i m4 = _mm256_set1_epi8(0xF);
  for (int j = 0; j < 4; ++j) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
    __m256i lo = _mm256_and_si256(raw, m4);
    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
    if constexpr (QT == kQ5_K) {
      const __m256i h5 = _mm256_set1_epi8(0x10);
      lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(qh, 2 * j), 4), h5));
      hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(qh, 2 * j + 1), 4), h5));
    }
    const __m256i s_lo = _mm256_set1_epi16(sc[2 * j]), s_hi = _mm256_set1_epi16(sc[2 * j + 1]);
    for (int m = 0; m < MB; ++m) {
      const int8_t* xb = x.q + (m0 + m) * x.K + b * 256 + 64 * j;
      const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb));
      const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 32));
      const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, x0), s_lo);
      const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, x1), s_hi);
      sumi[m] = _mm256_add_epi32(sumi[m], _mm256_add_epi32(p0, p1));
    }
  }
  const float d = f16(w), dmin = f16(w + 2);
  for (int m = 0; m < MB; ++m) {
    const int32_t* bs = x.s + (m0 + m) * x.ns + b * 16;
    int32_t msum = 0;
    for (int j = 0; j < 8; ++j) msum += mn[j] * (bs[2 * j] + bs[2 * j + 1]);
    const float xd = x.d[(m0 + m) * x.nd + b];
    a.v[r * MB + m] = _mm256_fmadd_ps(_mm256_set1_ps(d * xd), _mm256_cvtepi32_ps(sumi[m]),
                                      a.v[r * MB + m]);
    a.s[r * MB + m] -= dmin * xd * static_cast<float>(msum);
  }
}

// Q6_K: 16 groups of 16 with int8 scales; q - 32 as q (unsigned, maddubs) minus 32 * the sums.
template <int MB>
QL_INLINE void block_q6k(const uint8_t* w, const XQ& x, int64_t m0, int64_t b, int r,
                         Acc<MB>& a) {
  const int8_t* sc = reinterpret_cast<const int8_t*>(w + 192);
  __m256i sumi[MB];
  for (int m = 0; m < MB; ++m) sumi[m] = _mm256_setzero_si256();
  const __m256i m4 = _mm256_set1_epi8(0xF), m3 = _mm256_set1_epi8(0x30);
  for (int h = 0; h < 2; ++h) {
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 128 + 32 * h));
    const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * h));
    const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * h + 32));
    for (int t = 0; t < 4; ++t) {
      const __m256i lb = (t & 1) ? l1 : l0;
      const __m256i lo = t < 2 ? _mm256_and_si256(lb, m4)
                               : _mm256_and_si256(_mm256_srli_epi16(lb, 4), m4);
      const __m256i hb = _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(qh, 2 * t), 4), m3);
      const __m256i q = _mm256_or_si256(lo, hb);
      const int g = 8 * h + 2 * t;
      const __m256i s = _mm256_set_m128i(_mm_set1_epi16(sc[g + 1]), _mm_set1_epi16(sc[g]));
      for (int m = 0; m < MB; ++m) {
        const __m256i xv = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(x.q + (m0 + m) * x.K + b * 256 + 128 * h + 32 * t));
        sumi[m] = _mm256_add_epi32(sumi[m], _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), s));
      }
    }
  }
  const float d = f16(w + 208);
  for (int m = 0; m < MB; ++m) {
    const int32_t* bs = x.s + (m0 + m) * x.ns + b * 16;
    int32_t off = 0;
    for (int g = 0; g < 16; ++g) off += sc[g] * bs[g];
    // The offset joins the integer sum (lane 0), so one float product per block.
    const __m256i total = _mm256_add_epi32(sumi[m], _mm256_setr_epi32(-32 * off, 0, 0, 0, 0, 0, 0, 0));
    const float xd = x.d[(m0 + m) * x.nd + b];
    a.v[r * MB + m] = _mm256_fmadd_ps(_mm256_set1_ps(d * xd), _mm256_cvtepi32_ps(total),
                                      a.v[r * MB + m]);
  }
}

template <int64_t QT, int MB>
QL_INLINE void block_any(const uint8_t* w, const XQ& x, int64_t m0, int64_t b, int r, Acc<MB>& a) {
  if constexpr (QT == kQ4_K || QT == kQ5_K) block_k45<QT, MB>(w, x, m0, b, r, a);
  else if constexpr (QT == kQ6_K) block_q6k<MB>(w, x, m0, b, r, a);
  else block32<QT, MB>(w, x, m0, b, r, a);
}

// One group of 4 rows against x rows m0 .. m0 + MB - 1.
template <int64_t QT, int MB>
__attribute__((noinline)) void pass_avx2(const uint8_t* wg, const XQ& x, int64_t nb,
                                         int64_t bytes, int64_t block, int64_t m0, float* y,
                                         int64_t N, int64_t n0) {
  Acc<MB> a;
  for (int i = 0; i < kGroup * MB; ++i) {
    a.v[i] = _mm256_setzero_ps();
    a.s[i] = 0.f;
  }
  (void)block;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb = wg + b * kGroup * bytes;
    _mm_prefetch(reinterpret_cast<const char*>(wb) + 1024, _MM_HINT_T0);
    for (int r = 0; r < kGroup; ++r) block_any<QT, MB>(wb + r * bytes, x, m0, b, r, a);
  }
  for (int r = 0; r < kGroup && n0 + r < N; ++r)
    for (int m = 0; m < MB; ++m)
      y[(m0 + m) * N + n0 + r] = kvs_avx2::hsum8(a.v[r * MB + m]) + a.s[r * MB + m];
}

template <int64_t QT>
void run_avx2_t(const Format& f, const uint8_t* packed, const XQ& x, float* y, int64_t M,
                int64_t N, int64_t g0, int64_t g1) {
  const int64_t nb = x.K / f.block;
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* wg = packed + g * nb * kGroup * f.bytes;
    int64_t m0 = 0;
    for (; m0 + 2 <= M; m0 += 2) pass_avx2<QT, 2>(wg, x, nb, f.bytes, f.block, m0, y, N, g * kGroup);
    if (m0 < M) pass_avx2<QT, 1>(wg, x, nb, f.bytes, f.block, m0, y, N, g * kGroup);
  }
}

void run_avx2(int64_t qt, const Format& f, const uint8_t* packed, const XQ& x, float* y,
              int64_t M, int64_t N, int64_t g0, int64_t g1) {
  switch (qt) {
    case kQ4_0: return run_avx2_t<kQ4_0>(f, packed, x, y, M, N, g0, g1);
    case kQ4_1: return run_avx2_t<kQ4_1>(f, packed, x, y, M, N, g0, g1);
    case kQ5_0: return run_avx2_t<kQ5_0>(f, packed, x, y, M, N, g0, g1);
    case kQ5_1: return run_avx2_t<kQ5_1>(f, packed, x, y, M, N, g0, g1);
    case kQ8_0: return run_avx2_t<kQ8_0>(f, packed, x, y, M, N, g0, g1);
    case kQ4_K: return run_avx2_t<kQ4_K>(f, packed, x, y, M, N, g0, g1);
    case kQ5_K: return run_avx2_t<kQ5_K>(f, packed, x, y, M, N, g0, g1);
    case kQ6_K: return run_avx2_t<kQ6_K>(f, packed, x, y, M, N, g0, g1);
    default: TORCH_CHECK(false, "quant_linear: unsupported GGML type ", qt);
  }
}
#endif  // KVS_AVX2

// ------------------------------------------------------------------ dequantization
// One block -> float32, the same float32 operations as gguf.quants (products of a float16
// scale and small integers are exact, so FMA contraction changes no bits).

void dequant_block(int64_t qt, const uint8_t* w, float* out) {
  if (qt == kQ6_K) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(w + 192);
    const float d = f16(w + 208);
    for (int h = 0; h < 2; ++h)
      for (int t = 0; t < 4; ++t)
        for (int l = 0; l < 32; ++l) {
          const uint8_t lb = w[64 * h + 32 * (t & 1) + l];
          const int lo = (t < 2 ? lb : lb >> 4) & 0xF;
          const int v = (lo | (((w[128 + 32 * h + l] >> (2 * t)) & 3) << 4)) - 32;
          const int i = 128 * h + 32 * t + l;
          out[i] = (d * static_cast<float>(sc[i / 16])) * static_cast<float>(v);
        }
    return;
  }
  if (qt == kQ4_K || qt == kQ5_K) {
    uint8_t sc[8], mn[8];
    scale_min_k4(w + 4, sc, mn);
    const float d = f16(w), dmin = f16(w + 2);
    const uint8_t* qs = w + (qt == kQ5_K ? 48 : 16);
    for (int j = 0; j < 8; ++j) {
      const float ds = d * static_cast<float>(sc[j]), dm = dmin * static_cast<float>(mn[j]);
      for (int l = 0; l < 32; ++l) {
        const uint8_t byte = qs[32 * (j / 2) + l];
        int v = (j & 1) ? byte >> 4 : byte & 0xF;
        if (qt == kQ5_K) v |= ((w[16 + l] >> j) & 1) << 4;
        out[32 * j + l] = ds * static_cast<float>(v) - dm;
      }
    }
    return;
  }
  const float d = f16(w);
  if (qt == kQ8_0) {
    for (int i = 0; i < 32; ++i) out[i] = static_cast<float>(static_cast<int8_t>(w[2 + i])) * d;
    return;
  }
  const bool has_min = qt == kQ4_1 || qt == kQ5_1, five = qt == kQ5_0 || qt == kQ5_1;
  const float mv = has_min ? f16(w + 2) : 0.f;
  const uint8_t* qs = w + (has_min ? 4 : 2) + (five ? 4 : 0);
  uint32_t qh = 0;
  if (five) std::memcpy(&qh, w + (has_min ? 4 : 2), 4);
  const int off = qt == kQ4_0 ? 8 : qt == kQ5_0 ? 16 : 0;
  for (int i = 0; i < 32; ++i) {
    int v = i < 16 ? (qs[i] & 0xF) : (qs[i - 16] >> 4);
    if (five) v |= ((qh >> i) & 1) << 4;
    out[i] = has_min ? d * static_cast<float>(v) + mv : d * static_cast<float>(v - off);
  }
}

// ------------------------------------------------------------------ entries

void check_packed(const at::Tensor& packed, const Format& f, int64_t N, int64_t K) {
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte &&
                  packed.is_contiguous() && packed.dim() == 4,
              "quant_linear: packed must be a contiguous uint8 CPU tensor [G, K/B, 4, T]");
  TORCH_CHECK(K % f.block == 0, "quant_linear: K = ", K, " is not a multiple of the block size ",
              f.block);
  TORCH_CHECK(packed.size(0) == (N + kGroup - 1) / kGroup && packed.size(1) == K / f.block &&
                  packed.size(2) == kGroup && packed.size(3) == f.bytes,
              "quant_linear: packed has shape ", packed.sizes(), ", expected [",
              (N + kGroup - 1) / kGroup, ", ", K / f.block, ", 4, ", f.bytes, "] for N = ", N,
              ", K = ", K);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_x_op(const at::Tensor& x,
                                                             int64_t qtype) {
  const Format f = format_of(qtype);
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.is_contiguous(), "quant_quantize_x: x must be a contiguous float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % f.act_block == 0, "quant_quantize_x: K = ", K, " is not a multiple of ",
              f.act_block);
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({M, K / f.act_block}, x.options());
  at::Tensor s = at::empty({M, K / f.sum_group}, x.options().dtype(at::kInt));
  quantize_x(x.data_ptr<float>(), M, K, f, q.data_ptr<int8_t>(), d.data_ptr<float>(),
             s.data_ptr<int32_t>());
  return {q, d, s};
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, int64_t qtype, int64_t N) {
  const Format f = format_of(qtype);
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.is_contiguous(), "quant_linear: x must be a contiguous float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  check_packed(packed, f, N, K);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  std::vector<int8_t> q(static_cast<size_t>(M * K));
  std::vector<float> d(static_cast<size_t>(M * (K / f.act_block)));
  std::vector<int32_t> s(static_cast<size_t>(M * (K / f.sum_group)));
  quantize_x(x.data_ptr<float>(), M, K, f, q.data(), d.data(), s.data());
  const XQ xq{q.data(), d.data(), s.data(), K, K / f.act_block, K / f.sum_group};
  const uint8_t* w = packed.data_ptr<uint8_t>();
  float* out = y.data_ptr<float>();
  const int64_t groups = packed.size(0);
  const int64_t group_bytes = kGroup * (K / f.block) * f.bytes;
  const int64_t grain = std::max<int64_t>(1, kMinBytesPerTask / group_bytes);
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
#if defined(KVS_AVX2)
    run_avx2(qtype, f, w, xq, out, M, N, g0, g1);
#else
    run_generic(qtype, f, w, xq, out, M, N, g0, g1);
#endif
  });
  return y;
}

// The portable path on any build (tests compare it with the vector path in one process).
at::Tensor quant_linear_generic(const at::Tensor& x, const at::Tensor& packed, int64_t qtype,
                                int64_t N) {
  const Format f = format_of(qtype);
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.is_contiguous(), "quant_linear: x must be a contiguous float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  check_packed(packed, f, N, K);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  auto [q, d, s] = quantize_x_op(x, qtype);
  const XQ xq{q.data_ptr<int8_t>(), d.data_ptr<float>(), s.data_ptr<int32_t>(), K,
              K / f.act_block, K / f.sum_group};
  run_generic(qtype, f, packed.data_ptr<uint8_t>(), xq, y.data_ptr<float>(), M, N, 0,
              packed.size(0));
  return y;
}

// Rows [row0, row1) of the weight as float32 [row1 - row0, K].
at::Tensor quant_dequantize(const at::Tensor& packed, int64_t qtype, int64_t N, int64_t row0,
                            int64_t row1) {
  const Format f = format_of(qtype);
  TORCH_CHECK(packed.dim() == 4, "quant_dequantize: packed must be [G, K/B, 4, T]");
  const int64_t K = packed.size(1) * f.block;
  check_packed(packed, f, N, K);
  TORCH_CHECK(0 <= row0 && row0 <= row1 && row1 <= N, "quant_dequantize: rows [", row0, ", ",
              row1, ") outside [0, ", N, ")");
  at::Tensor out = at::empty({row1 - row0, K}, packed.options().dtype(at::kFloat));
  const uint8_t* w = packed.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  const int64_t nb = K / f.block;
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(K, 1));
  at::parallel_for(row0, row1, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t n = r0; n < r1; ++n) {
      const uint8_t* wg = packed.data_ptr<uint8_t>() + (n / kGroup) * nb * kGroup * f.bytes;
      for (int64_t b = 0; b < nb; ++b)
        dequant_block(qtype, wg + (b * kGroup + n % kGroup) * f.bytes,
                      o + (n - row0) * K + b * f.block);
    }
  });
  (void)w;
  return out;
}

std::string isa() {
#if defined(__AVX512F__) && defined(KVS_AVX2)
  return "avx512 tier (int8 dot products on the avx2 maddubs/madd path)";
#elif defined(KVS_AVX2)
  return "avx2 (maddubs/madd int8 dot products)";
#else
  return "generic";
#endif
}

}  // namespace

// A fragment: paged_attention.cpp owns TORCH_LIBRARY(kvserve).
TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("quant_linear(Tensor x, Tensor packed, int qtype, int n) -> Tensor");
  m.def("quant_linear_generic(Tensor x, Tensor packed, int qtype, int n) -> Tensor");
  m.def("quant_quantize_x(Tensor x, int qtype) -> (Tensor, Tensor, Tensor)");
  m.def("quant_dequantize(Tensor packed, int qtype, int n, int row0, int row1) -> Tensor");
  m.def("quant_linear_isa() -> str", &isa);
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("quant_linear_generic", &quant_linear_generic);
  m.impl("quant_quantize_x", &quantize_x_op);
  m.impl("quant_dequantize", &quant_dequantize);
}
