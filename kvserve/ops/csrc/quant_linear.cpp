// Linear layers on GGUF block-quantized weights kept packed: y[M, N] = x[M, K] @ W^T.
//
//   x       [M, K]   float32, contiguous (M small: decode, speculative verification)
//   packed  [ceil(N/8), K/B, 8*T] uint8: GGUF blocks (B weights in T bytes each) of 8 rows at a
//           time, interleaved field by field so that one 32-byte load holds 4 weights of each
//           of the 8 rows (ops/quant/formats.py, packing.py; "the packed layout" below)
//   qtype   the GGML type id: Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q8_0 8, Q2_K 10, Q3_K 11,
//           Q4_K 12, Q5_K 13, Q6_K 14, IQ4_NL 20 (Q4_0's layout; each nibble indexes
//           llama.cpp's kvalues_iq4nl)
//   -> y    [M, N] float32
//
// As llama.cpp does, x is first quantized per block of 32 to int8, as llama.cpp's Q8_0 / Q8_1
// blocks (quantize_x below: a scale per 32 values, plus the sums of q per 32 or 16 that the
// weights' minimums / offsets multiply); each weight block is then an integer
// dot product of its unpacked 4/5/6/8-bit values with the x block, times float scales. The
// integer parts are exact, so the result differs from float64 math on the same quantized
// values only by float32 rounding of the per-block terms (tests: 1e-5 of |x_q| @ |W|^T).
//
// With M small the op is a stream over the packed weight (0.33-1.06 bytes a weight) and x's
// int8 blocks stay in L1. Work items are groups of 8 output rows (chunks_for's chunks of them);
// a group's blocks are one sequential stream, and lane r of every vector is row r, so there are
// no per-row scalar scale conversions and no horizontal sums. x rows are taken 4 at a time while
// the group is in L1, so larger batches run here too, near oneDNN's float32 GEMM on the
// dequantized weight (M = 256-512, one Zen 5 thread: the float path takes 1.05-1.28x this
// kernel's time with VNNI, 0.69-0.84x on AVX2); ops/quant/weight.py sends prompts to the float
// GEMM (why: there).
//
// Paths: AVX2 (avx2 tier and above): maddubs (u8 x s8 -> s16 pairs) and madd (-> s32), signed
// weights through the sign trick (|w| x sign(x, w)); AVX-512 VNNI (the avx512_bf16 tier): the
// same in 512-bit vpdpbusd, two units of the 8 rows a vector, signed weights read as unsigned
// (w + 128, or the stored 4/5-bit values) and that offset times x's block sum taken off
// (QL_VNNI below); the portable path: each row-block decoded, the same integer math in plain
// loops. quant_dequantize gives float32 rows (bit-identical to
// gguf's dequantizer) for the float path (a float32 GEMM on dequantized chunks): on AVX2 a
// group-block at a time from the packed layout (0.2-0.4 ns a weight, 1 thread, Zen 3; the
// portable row decoder, quant_dequantize_generic, takes 1.7-5.5 ns). quant_gemm (quant_gemm.h,
// every tier from avx2; every type, but Q8_0 and IQ4_NL on AVX2): the same int8 x blocks
// against weight panels unpacked once per call, for decode batches of kGemmMinRows+ rows
// (quant_linear hands them over: 16 with VNNI, 64 on AVX2) and K-quant prompts.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "vec_avx2.h"

namespace {

#define QL_INLINE inline __attribute__((always_inline))

constexpr int64_t kGroup = 8;          // output rows per work item (the packed interleave)
// Minimum packed bytes per thread's share: below this the fork/join costs more than it gains.
constexpr int64_t kMinBytesPerTask = 16384;
// Software prefetch distance along the packed stream (the first x pass over a group). 4 KB:
// the 0.85B Q4_K_M file's linears at batch 1, 2 threads, Zen 4, GB/s of packed bytes (medians
// of 15, 3 rounds of processes alternating): 2 KB Q6_K 17-19 / Q4_K 21-23, 4 KB 20-25 /
// 23-28, 8 KB and 16 KB no better; none at all: Q6_K 8-9 (its fields are read out of order).
constexpr int64_t kPrefetchBytes = 4096;

enum QType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ2_K = 10,
                       kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kIQ4_NL = 20 };

// IQ4_NL's 16 weight values (llama.cpp's kvalues_iq4nl), and the same plus 128 as unsigned
// bytes (VNNI's vpdpbusd and the GEMM panels take unsigned weights; the offset is taken off).
constexpr int8_t kIQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                               1,    13,   25,  38,  53,  69,  89,  113};
constexpr uint8_t kIQ4NLu[16] = {1,   24,  45,  63,  79,  93,  106, 118,
                                 129, 141, 153, 166, 181, 197, 217, 241};

// block: weights per block; bytes: per GGUF block; gbytes: per packed group-block of 8 rows.
struct Format { int64_t block, bytes, act_block, sum_group, gbytes; };

Format format_of(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: return {32, 18, 32, 32, 144};
    case kQ4_1: return {32, 20, 32, 32, 160};
    case kQ5_0: return {32, 22, 32, 32, 176};
    case kQ5_1: return {32, 24, 32, 32, 192};
    case kQ8_0: return {32, 34, 32, 32, 272};
    case kQ4_K: return {256, 144, 32, 16, 1184};
    case kQ5_K: return {256, 176, 32, 16, 1440};
    case kQ6_K: return {256, 210, 32, 16, 1680};
    case kIQ4_NL: return {32, 18, 32, 32, 144};
    case kQ3_K: return {256, 110, 32, 16, 912};
    case kQ2_K: return {256, 84, 32, 16, 672};
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

// The quantized activations: q [M, K] int8, d [M, K / 32], s [M, K / sum_group];
// sd [M, K / 32]: d * sum q, which the minimums multiply (Q8_1's fp16 of it for Q4_1 / Q5_1,
// float32 for the K-quants).
struct XQ {
  const int8_t* q;
  const float* d;
  const int32_t* s;
  const float* sd;
  int64_t K, nd, ns;     // row strides of q, d, s (sd: nd)
};

// ------------------------------------------------------------------ threads
// fn(c0, c1) over [begin, end) in chunks of >= grain (about 4 per thread), which the threads
// of one OpenMP region take from an atomic counter: a thread that starts late takes fewer.
// Why OpenMP and not a pool of our own (what this kernel had): the step's other kernels and
// oneDNN run on torch's OpenMP threads, which spin for ~ms after each region, so a second pool's
// worker shared the second core with a spinning one. Demo Q8_0 decode, 2-core Zen 5, one
// process alternating: the pool 193 tok/s, OpenMP 220 (median of 8). The pool did hold up
// better on a loaded machine (two busy processes beside it: 93 vs 73 tok/s), as LoRA's kernel
// found before (lora.cpp); the engine's float kernels run on OpenMP too.
template <typename F>
void chunks_for(int64_t begin, int64_t end, int64_t grain, const F& fn) {
  const int64_t n = end - begin;
  if (n <= 0) return;
  const int threads = at::get_num_threads();
  const int64_t chunk = std::max<int64_t>(grain, (n + 4 * threads - 1) / (4 * threads));
  const int64_t chunks = (n + chunk - 1) / chunk;
  const auto run = [&](int64_t c) { fn(begin + c * chunk, std::min(end, begin + (c + 1) * chunk)); };
  if (chunks <= 1 || threads <= 1 || at::in_parallel_region()) {
    for (int64_t c = 0; c < chunks; ++c) run(c);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(threads, chunks), 1, [&](int64_t, int64_t) {
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < chunks;) run(c);
  });
}

// ------------------------------------------------------------------ activation quantization
// Blocks of 32 values: amax; d = amax / 127; q = round-half-even(x * (127 / amax)) in
// [-127, 127] (quantize_row_q8_0, AVX2 path). Per weight type:
//   Q8_0  (Q4_0, Q5_0, Q8_0 weights)  d rounded to fp16: llama.cpp's activations exactly
//   Q8_1  (Q4_1, Q5_1)  as Q8_0, plus sd = fp16(d * sum q) with d before its fp16 rounding
//   K32   (Q4_K, Q5_K, Q6_K)  d float32, sd = d * sum q, and the sums of each 16. llama.cpp
//         takes Q8_K there (one scale per 256 values): ops/quant/formats.py says why not.
// so that near-ties between logits fall where llama.cpp's do on the same file.
enum XKind { kXQ8_0 = 0, kXQ8_1 = 1, kXK32 = 2 };

QL_INLINE float round_f16(float v) {
  return static_cast<float>(c10::Half(v));
}

// One block of 32 values; s gets one sum (two: values 0-15, 16-31, for K32).
void quantize_block32(const float* x, XKind kind, int8_t* q, float* d, int32_t* s, float* sd) {
  float amax = 0.f;
#if defined(KVS_AVX2)
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 mx = _mm256_setzero_ps();
  for (int64_t i = 0; i < 32; i += 8)
    mx = _mm256_max_ps(mx, _mm256_and_ps(_mm256_loadu_ps(x + i), absmask));
  amax = kvs_avx2::hmax8(mx);
#else
  for (int64_t i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[i]));
#endif
  const float dd = amax / 127.f;
  const float inv = amax != 0.f ? 127.f / amax : 0.f;
  *d = kind == kXK32 ? dd : round_f16(dd);
  int32_t sum_lo = 0, sum_hi = 0;
#if defined(KVS_AVX2)
  const __m256 iv = _mm256_set1_ps(inv);
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i v[4];
  for (int i = 0; i < 4; ++i) {
    const __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * i), iv),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v[i] = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(r), lo), hi);
  }
  const __m256i p01 = _mm256_packs_epi32(v[0], v[1]);   // values 0-15 (lane-shuffled)
  const __m256i p23 = _mm256_packs_epi32(v[2], v[3]);   // values 16-31
  const __m256i b = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23),
                                                _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), b);
  sum_lo = static_cast<int32_t>(kvs_avx2::hsum8(_mm256_cvtepi32_ps(_mm256_madd_epi16(p01, ones))));
  sum_hi = static_cast<int32_t>(kvs_avx2::hsum8(_mm256_cvtepi32_ps(_mm256_madd_epi16(p23, ones))));
#else
  for (int64_t i = 0; i < 32; ++i) {
    const float r = std::nearbyint(x[i] * inv);
    const int vi = static_cast<int>(std::min(127.f, std::max(-127.f, r)));
    q[i] = static_cast<int8_t>(vi);
    (i < 16 ? sum_lo : sum_hi) += vi;
  }
#endif
  const int32_t sum = sum_lo + sum_hi;
  if (kind == kXK32) {
    s[0] = sum_lo;
    s[1] = sum_hi;
    *sd = dd * static_cast<float>(sum);
  } else {
    *s = sum;
    if (kind == kXQ8_1) *sd = round_f16(dd * static_cast<float>(sum));
  }
}

void quantize_x(const float* x, int64_t M, int64_t K, const Format& f, XKind kind, int8_t* q,
                float* d, int32_t* s, float* sd) {
  const int64_t nd = K / 32, ns = K / f.sum_group, per = 32 / f.sum_group;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nd; ++b) {
      const int64_t o = m * K + b * 32;
      quantize_block32(x + o, kind, q + o, d + m * nd + b, s + m * ns + b * per, sd + m * nd + b);
    }
}

// ------------------------------------------------------------------ the packed layout
// A group-block (8 rows x one block) holds each field of the GGUF block in turn as
// [length / width][8 rows][width] (ops/quant/formats.py). Offsets below are of the fields in
// the group-block; `unit(gb, off, w, u, r)` is row r's u-th unit of width w of a field.

QL_INLINE const uint8_t* unit(const uint8_t* gb, int64_t off, int64_t w, int64_t u, int64_t r) {
  return gb + off + (u * kGroup + r) * w;
}

// Field offsets in a group-block (8 x the GGUF field lengths, in formats.py's order).
constexpr int64_t kOffM = 16;                           // _1 types' minimum, K-quants' dmin
constexpr int64_t kLegacyQh = 16;                       // Q5_0 (Q5_1: + 16)
constexpr int64_t legacy_qs(int64_t qt) {
  return qt == kQ4_1 ? 32 : qt == kQ5_0 ? 48 : qt == kQ5_1 ? 64 : 16;
}
// Q4_K / Q5_K: scales [j][row] (64 B), mins [j / 2][row][j % 2] (64 B), then qh, qs.
constexpr int64_t kKScales = 32, kKMins = 96, kK4Qs = 160, kK5Qh = 160, kK5Qs = 416;
constexpr int64_t kQ6Sc = 16, kQ6Ql = 144, kQ6Qh = 1168;
// Q2_K: d, dmin, scales [pair][row][2] (scale: low nibble, minimum: high), qs (Q6_K's qh layout).
constexpr int64_t kQ2Sc = 32, kQ2Qs = 160;
// Q3_K: d, scales as Q6_K's (int8 s - 32, decoded at packing), qs (as Q2_K's), hmask (Q5_K's qh).
constexpr int64_t kQ3Qs = 144, kQ3Hm = 656;
// Where Q2_K's / Q3_K's 2-bit quants (Q6_K's qh layout) start.
constexpr int64_t qs2_at(int64_t qt) { return qt == kQ2_K ? kQ2Qs : kQ3Qs; }

// One row of one group-block decoded: integer weights and their scales.
struct Decoded {
  int8_t q[256];        // Q8_0 / Q4_0 / Q5_0 / Q3_K / Q6_K / IQ4_NL signed (offset applied
                        // or looked up); others unsigned
  float d = 0.f, m = 0.f;   // d; m: the _1 types' minimum, the K-quants' dmin
  int sc[16] = {};      // K-quants: sub-block scales (Q3_K / Q6_K: 16 int8; Q4_K / Q5_K: 8
                        // six-bit; Q2_K: 16 four-bit)
  int mn[16] = {};      // Q4_K / Q5_K: sub-block minimums (8); Q2_K: 16
};

// The 256-weight types; of them, those with a scale per 16 weights (Q2_K: and a minimum), and
// those with a signed int8 one and no minimum.
QL_INLINE bool is_k(int64_t qt) {
  return qt == kQ4_K || qt == kQ5_K || qt == kQ6_K || qt == kQ3_K || qt == kQ2_K;
}
constexpr bool is_q6(int64_t qt) { return qt == kQ6_K || qt == kQ3_K; }
constexpr bool per16(int64_t qt) { return is_q6(qt) || qt == kQ2_K; }

void decode_legacy(int64_t qt, const uint8_t* gb, int64_t r, Decoded& o) {
  o.d = f16(unit(gb, 0, 2, 0, r));
  const bool has_min = qt == kQ4_1 || qt == kQ5_1, five = qt == kQ5_0 || qt == kQ5_1;
  if (has_min) o.m = f16(unit(gb, kOffM, 2, 0, r));
  const int64_t qs = legacy_qs(qt);
  const uint8_t* qh = unit(gb, kLegacyQh + (has_min ? 16 : 0), 4, 0, r);
  for (int k = 0; k < 32; ++k) {
    if (qt == kQ8_0) {
      o.q[k] = static_cast<int8_t>(unit(gb, qs, 4, k / 4, r)[k % 4]);
      continue;
    }
    const uint8_t byte = unit(gb, qs, 4, (k % 16) / 4, r)[k % 4];
    int v = k < 16 ? byte & 0xF : byte >> 4;
    if (qt == kIQ4_NL) {
      o.q[k] = kIQ4NL[v];
      continue;
    }
    if (five) v |= ((qh[k % 4] >> (k / 4)) & 1) << 4;     // chunk k/4's bit of byte k%4
    o.q[k] = static_cast<int8_t>(v - (qt == kQ4_0 ? 8 : qt == kQ5_0 ? 16 : 0));
  }
}

// Row r's 2-bit field of weight k in Q6_K's qh layout at `off` (Q6_K's qh, Q2_K's / Q3_K's qs):
// weight 128h + 32t + l at bits 2t of byte 32h + l.
int two_bit(const uint8_t* gb, int64_t off, int k, int64_t r) {
  const int h = k / 128, t = (k % 128) / 32, l = k % 32;
  return (unit(gb, off, 4, 8 * h + l / 4, r)[l % 4] >> (2 * t)) & 3;
}

void decode_k(int64_t qt, const uint8_t* gb, int64_t r, Decoded& o) {
  o.d = f16(unit(gb, 0, 2, 0, r));
  if (qt == kQ2_K) {
    o.m = f16(unit(gb, kOffM, 2, 0, r));
    for (int g = 0; g < 16; ++g) {
      const uint8_t v = unit(gb, kQ2Sc, 2, g / 2, r)[g % 2];
      o.sc[g] = v & 0xF;
      o.mn[g] = v >> 4;
    }
    for (int k = 0; k < 256; ++k) o.q[k] = static_cast<int8_t>(two_bit(gb, kQ2Qs, k, r));
    return;
  }
  if (is_q6(qt)) {
    for (int g = 0; g < 16; ++g) o.sc[g] = static_cast<int8_t>(unit(gb, kQ6Sc, 2, g / 2, r)[g % 2]);
    for (int k = 0; k < 256; ++k) {
      const int h = k / 128, t = (k % 128) / 32, l = k % 32;
      if (qt == kQ3_K) {     // 2 bits of qs as Q2_K's, bit 4h + t of hmask byte l above them
        const int hi = (unit(gb, kQ3Hm, 4, l / 4, r)[l % 4] >> (4 * h + t)) & 1;
        o.q[k] = static_cast<int8_t>((two_bit(gb, kQ3Qs, k, r) | (hi << 2)) - 4);
        continue;
      }
      const uint8_t lb = unit(gb, kQ6Ql, 4, (2 * h + (t & 1)) * 8 + l / 4, r)[l % 4];
      const int lo = (t < 2 ? lb : lb >> 4) & 0xF;
      o.q[k] = static_cast<int8_t>((lo | (two_bit(gb, kQ6Qh, k, r) << 4)) - 32);
    }
    return;
  }
  o.m = f16(unit(gb, kOffM, 2, 0, r));
  for (int j = 0; j < 8; ++j) {
    o.sc[j] = *unit(gb, kKScales, 1, j, r);
    o.mn[j] = unit(gb, kKMins, 2, j / 2, r)[j % 2];
  }
  const int64_t qs = qt == kQ5_K ? kK5Qs : kK4Qs;
  for (int k = 0; k < 256; ++k) {
    const int j = k / 64, s = k / 32, l = k % 32;
    const uint8_t byte = unit(gb, qs, 4, 8 * j + l / 4, r)[l % 4];
    int v = (s & 1) ? byte >> 4 : byte & 0xF;
    if (qt == kQ5_K) v |= ((unit(gb, kK5Qh, 4, l / 4, r)[l % 4] >> s) & 1) << 4;
    o.q[k] = static_cast<int8_t>(v);
  }
}


void decode(int64_t qt, const uint8_t* gb, int64_t r, Decoded& o) {
  if (is_k(qt)) decode_k(qt, gb, r, o);
  else decode_legacy(qt, gb, r, o);
}

// ------------------------------------------------------------------ portable path
// Each row-block decoded, then integer dot products with x's int8 block, float scales.

float dot_decoded(int64_t qt, const Decoded& w, const XQ& x, int64_t m, int64_t b) {
  if (!is_k(qt)) {
    const float xd = x.d[m * x.nd + b];
    const int8_t* xb = x.q + m * x.K + b * 32;
    int32_t sumi = 0;
    for (int i = 0; i < 32; ++i) sumi += w.q[i] * xb[i];
    float r = w.d * xd * static_cast<float>(sumi);
    if (qt == kQ4_1 || qt == kQ5_1) r += w.m * x.sd[m * x.nd + b];
    return r;
  }
  // Super-block b: x's 32-blocks 8b .. 8b + 7, each with its own scale.
  const int8_t* xb = x.q + m * x.K + b * 256;
  const float* xd = x.d + m * x.nd + b * 8;
  const float* xsd = x.sd + m * x.nd + b * 8;
  const int32_t* xs = x.s + m * x.ns + b * 16;
  float r = 0.f, rm = 0.f;
  for (int j = 0; j < 8; ++j) {
    int32_t sumi = 0, summ = 0;
    for (int h = 0; h < 2; ++h) {      // Q6_K, Q2_K: a scale per 16; Q4_K / Q5_K: per 32
      int32_t part = 0;
      for (int l = 32 * j + 16 * h; l < 32 * j + 16 * h + 16; ++l) part += w.q[l] * xb[l];
      sumi += w.sc[per16(qt) ? 2 * j + h : j] * part;
      if (qt == kQ2_K) summ += w.mn[2 * j + h] * xs[2 * j + h];      // x's sum of the 16
    }
    r += xd[j] * static_cast<float>(sumi);
    if (qt == kQ2_K) rm += xd[j] * static_cast<float>(summ);
    else if (!is_q6(qt)) rm += xsd[j] * static_cast<float>(w.mn[j]);
  }
  return w.d * r - w.m * rm;
}

void run_generic(int64_t qt, const Format& f, const uint8_t* packed, const XQ& x, float* y,
                 int64_t M, int64_t N, int64_t g0, int64_t g1) {
  const int64_t nb = x.K / f.block, gbytes = f.gbytes;
  std::vector<float> acc(static_cast<size_t>(M * kGroup));
  Decoded w;
  for (int64_t g = g0; g < g1; ++g) {
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* gb = packed + (g * nb + b) * gbytes;
      for (int64_t r = 0; r < kGroup; ++r) {
        decode(qt, gb, r, w);
        for (int64_t m = 0; m < M; ++m) acc[m * kGroup + r] += dot_decoded(qt, w, x, m, b);
      }
    }
    for (int64_t r = 0; r < kGroup && g * kGroup + r < N; ++r)
      for (int64_t m = 0; m < M; ++m) y[m * N + g * kGroup + r] = acc[m * kGroup + r];
  }
}

// ------------------------------------------------------------------ AVX2 path
// Lane r of every vector is row r of the group: a 32-byte load of a [unit][row][4] field holds
// 4 consecutive weights of each row; x's 4 matching int8 values are broadcast to all lanes, so
// maddubs + madd leave row r's partial dot product in lane r. Scales of the 8 rows are one
// float16 load (or int8 / 6-bit integers multiplied in). Signed weights (Q8_0, IQ4_NL's
// looked-up values) use the sign trick: |w| (unsigned) times x with w's sign; Q4_0 / Q5_0 go in
// as stored (legacy_offset). x rows are taken MB at a time.
#if defined(KVS_AVX2)

QL_INLINE __m256i load32(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
QL_INLINE __m256 load_f16x8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
QL_INLINE __m256i bcast4(const int8_t* p) {   // x's 4 int8 values at p, in every lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
// AVX-512 VNNI (the avx512_bf16 tier): vpdpbusd adds the 4 u8 x s8 products of each lane
// into an int32 in one instruction, where AVX2 needs maddubs (int16 pair sums), madd and an
// add. The sums are exact integers either way (maddubs never saturates here: |w| x |x| pairs
// stay under 2^15, see kFlush), so both paths give the same bits; sub-block scales multiply
// the int32 sums (mullo) instead of riding in madd's int16 pairs.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define QL_VNNI 1
#endif
#if defined(QL_VNNI)
// x's 8 int8 values at p as 512 bits: the first 4 in every dword of the low half (lanes of
// unit c), the next 4 in the high half (unit c + 1).
QL_INLINE __m512i bcast4x2(const int8_t* p) {
  const __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_permutexvar_epi32(idx, _mm512_castsi128_si512(
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
// Lane r of the low half plus lane r of the high half (row r's sums of units c and c + 1).
QL_INLINE __m256i add_halves(__m512i v) {
  return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}
// (v >> s) << 4 in every 16-bit lane, `mask`'s bits of each byte kept: the high bits of 5- and
// 6-bit weights moved above their low nibbles.
QL_INLINE __m512i high_bits_zmm(__m512i v, int s, __m512i mask) {
  return _mm512_and_si512(_mm512_slli_epi16(_mm512_srli_epi16(v, s), 4), mask);
}
#endif
// (v >> s) << 4 in every 16-bit lane, `mask`'s bits of each byte kept (0x10, 0x30): the high
// bits of 5- and 6-bit weights moved above their low nibbles (high_bits_zmm in 256 bits).
QL_INLINE __m256i high_bits(__m256i v, int s, int mask) {
  return _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(v, s), 4), _mm256_set1_epi8(mask));
}
// IQ4_NL: nibbles (0..15 a byte) -> its weight values (one vpshufb on the 16-byte table in
// each 128-bit lane): signed kIQ4NL, or kIQ4NLu (the value + 128) for unsigned products.
template <bool kUnsigned>
QL_INLINE __m256i iq4nl_values(__m256i nibbles) {
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kUnsigned ? kIQ4NLu
                                    : reinterpret_cast<const uint8_t*>(kIQ4NL)));
  return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(t), nibbles);
}
#if defined(QL_VNNI)
QL_INLINE __m512i iq4nl_values_u_zmm(__m512i nibbles) {
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIQ4NLu));
  return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(t), nibbles);
}
#endif

// One 32-byte unit of stored (unsigned) weights, 4 of each of the 8 rows: chunk c (weights
// 4c .. 4c + 3) of a block, as the dequantizer, Q6_K's small-batch path and quant_gemm.h's
// panels take them.
// Q4_0 / Q4_1 / Q5_0 / Q5_1: the low nibbles of unit c, then the high ones of unit c - 4; the
// 5-bit types' bit c of qh (the block's qh unit) above them.
template <int64_t QT>
QL_INLINE __m256i legacy_chunk(const uint8_t* gb, __m256i qh, int c) {
  const __m256i raw = load32(gb + legacy_qs(QT) + 32 * (c & 3)), m4 = _mm256_set1_epi8(0xF);
  const __m256i v = c < 4 ? _mm256_and_si256(raw, m4)
                          : _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
  if constexpr (QT == kQ5_0 || QT == kQ5_1) return _mm256_or_si256(v, high_bits(qh, c, 0x10));
  return v;
}
// Q4_K / Q5_K: sub-block sb (its weights 32sb + 4c ..), 0..15 / 0..31.
template <int64_t QT>
QL_INLINE __m256i k45_chunk(const uint8_t* gb, int sb, int c) {
  constexpr int64_t kQs = QT == kQ5_K ? kK5Qs : kK4Qs;
  const __m256i raw = load32(gb + kQs + 32 * (8 * (sb / 2) + c)), m4 = _mm256_set1_epi8(0xF);
  const __m256i v = sb % 2 ? _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4)
                           : _mm256_and_si256(raw, m4);
  if constexpr (QT == kQ5_K)
    return _mm256_or_si256(v, high_bits(load32(gb + kK5Qh + 32 * c), sb, 0x10));
  return v;
}
// Q4_K / Q5_K: the 8 rows' 6-bit scale and minimum of sub-block sb, as floats.
QL_INLINE __m256 k45_scale(const uint8_t* gb, int sb) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(gb + kKScales + 8 * sb))));
}
QL_INLINE __m256 k45_min(const uint8_t* gb, int sb) {
  // mins [pair][row][2]: row r's minimum of sub-block sb is byte 2r + sb % 2 of the pair.
  const __m128i mp = _mm_loadu_si128(reinterpret_cast<const __m128i*>(gb + kKMins + 16 * (sb / 2)));
  const __m128i mb = _mm_shuffle_epi8(mp, sb % 2 ? _mm_setr_epi8(1, 3, 5, 7, 9, 11, 13, 15, -1,
                                                                 -1, -1, -1, -1, -1, -1, -1)
                                                 : _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, -1,
                                                                 -1, -1, -1, -1, -1, -1, -1));
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mb));
}
// Q3_K's hmask bytes with bit s of each byte moved to bit 2 (other bits: garbage), one shift.
QL_INLINE __m256i q3k_bit2(__m256i hm, int s) {
  return s >= 2 ? _mm256_srli_epi16(hm, s - 2) : _mm256_slli_epi16(hm, 2 - s);
}
#if defined(QL_VNNI)
QL_INLINE __m512i q3k_bit2(__m512i hm, int s) {
  return s >= 2 ? _mm512_srli_epi16(hm, s - 2) : _mm512_slli_epi16(hm, 2 - s);
}
#endif

// Q6_K: 32-block 4h + t (weights 128h + 32t + 4c ..), 0..63 (the weight plus 32); Q2_K: 0..3
// (qs as Q6_K's qh); Q3_K: 0..7 (the weight plus 4), qs's 2 bits as Q2_K's and hmask's bit
// 4h + t (unit c of it: the same weights' bytes) above them.
template <int64_t QT>
QL_INLINE __m256i q6k_chunk(const uint8_t* gb, int h, int t, int c) {
  if constexpr (QT == kQ2_K || QT == kQ3_K) {
    const __m256i lo = _mm256_and_si256(
        _mm256_srli_epi16(load32(gb + qs2_at(QT) + 32 * (8 * h + c)), 2 * t),
        _mm256_set1_epi8(3));
    if constexpr (QT == kQ2_K) return lo;
    return _mm256_or_si256(lo, _mm256_and_si256(q3k_bit2(load32(gb + kQ3Hm + 32 * c), 4 * h + t),
                                                _mm256_set1_epi8(4)));
  }
  const __m256i lb = load32(gb + kQ6Ql + 32 * ((2 * h + (t & 1)) * 8 + c));
  const __m256i m4 = _mm256_set1_epi8(0xF);
  const __m256i lo = t < 2 ? _mm256_and_si256(lb, m4)
                           : _mm256_and_si256(_mm256_srli_epi16(lb, 4), m4);
  return _mm256_or_si256(lo, high_bits(load32(gb + kQ6Qh + 32 * (8 * h + c)), 2 * t, 0x30));
}

#if defined(QL_VNNI)
// The legacy types' int32 dot products of each row with x's block (lane r), two units per
// 512-bit vpdpbusd (k45_units_zmm says why), of the weights as unsigned (legacy_offset: the
// caller takes the offset off).
template <int64_t QT, int MB>
QL_INLINE void legacy_sums_zmm(const uint8_t* gb, const XQ& x, int64_t m0, int64_t b,
                               __m256i (&sumi)[MB]) {
  constexpr bool kMin = QT == kQ4_1 || QT == kQ5_1, kFive = QT == kQ5_0 || QT == kQ5_1;
  constexpr int64_t kQs = legacy_qs(QT);
  __m512i acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_si512();
  const auto dot = [&](__m512i w, int64_t at) {     // x's values at .. at + 7
    for (int m = 0; m < MB; ++m)
      acc[m] = _mm512_dpbusd_epi32(acc[m], w, bcast4x2(x.q + (m0 + m) * x.K + b * 32 + at));
  };
  if constexpr (QT == kQ8_0) {
#pragma GCC unroll 4
    for (int c = 0; c < 8; c += 2)
      dot(_mm512_xor_si512(_mm512_loadu_si512(gb + kQs + 32 * c), _mm512_set1_epi8(-128)), 4 * c);
  } else {
    const __m512i m4 = _mm512_set1_epi8(0xF), h5 = _mm512_set1_epi8(0x10);
    __m512i qh2 = _mm512_setzero_si512();    // units c, c + 1 take bits c, c + 1: qh, qh >> 1
    if constexpr (kFive) {
      const __m256i qh = load32(gb + kLegacyQh + (kMin ? 16 : 0));
      qh2 = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 1), 1);
    }
    for (int c = 0; c < 4; c += 2) {
      const __m512i raw = _mm512_loadu_si512(gb + kQs + 32 * c);
      __m512i lo = _mm512_and_si512(raw, m4), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
      if constexpr (kFive) {
        lo = _mm512_or_si512(lo, high_bits_zmm(qh2, c, h5));
        hi = _mm512_or_si512(hi, high_bits_zmm(qh2, c + 4, h5));
      }
      if constexpr (QT == kIQ4_NL) {
        lo = iq4nl_values_u_zmm(lo);
        hi = iq4nl_values_u_zmm(hi);
      }
      dot(lo, 4 * c);
      dot(hi, 16 + 4 * c);
    }
  }
  for (int m = 0; m < MB; ++m) sumi[m] = add_halves(acc[m]);
}
#endif

// What the legacy paths add to the signed weights to feed them as unsigned (their integer dot
// products then carry offset x x's block sum, taken off after): Q4_0's / Q5_0's stored 0..15 /
// 0..31 are w + 8 / w + 16; VNNI reads Q8_0 as w ^ 0x80 (w + 128) and IQ4_NL from kIQ4NLu
// (w + 128), where AVX2's maddubs would overflow its int16 pair sums, so AVX2 keeps those two
// signed (the sign trick).
template <int64_t QT>
constexpr int legacy_offset() {
#if defined(QL_VNNI)
  if (QT == kQ8_0 || QT == kIQ4_NL) return 128;
#endif
  return QT == kQ4_0 ? 8 : QT == kQ5_0 ? 16 : 0;
}

template <int64_t QT, int MB>
QL_INLINE void group_block_legacy(const uint8_t* gb, const XQ& x, int64_t m0, int64_t b,
                                  __m256 (&acc)[MB]) {
  constexpr bool kMin = QT == kQ4_1 || QT == kQ5_1, kFive = QT == kQ5_0 || QT == kQ5_1;
  const __m256 d = load_f16x8(gb);
  __m256i sumi[MB];
#if defined(QL_VNNI)
  legacy_sums_zmm<QT, MB>(gb, x, m0, b, sumi);
#else
  // maddubs takes unsigned weights: all but Q8_0's and IQ4_NL's (looked up, signed) go in as
  // stored (legacy_offset).
  constexpr bool kSigned = QT == kQ8_0 || QT == kIQ4_NL;
  constexpr int64_t kQs = legacy_qs(QT);
  __m256i qh = _mm256_setzero_si256();
  if constexpr (kFive) qh = load32(gb + kLegacyQh + (kMin ? 16 : 0));
  // maddubs' int16 pair sums are added in int16 for kFlush chunks, then widened by one madd:
  // w <= 15 (Q4_0, Q4_1) keeps 8 chunks under 2^15 (8 x 2 x 15 x 127), w <= 31 (Q5_0, Q5_1)
  // 4 chunks, Q8_0 and IQ4_NL (|w| <= 128) one.
  constexpr int kFlush = kSigned ? 1 : kFive ? 4 : 8;
  __m256i s16[MB];
  for (int m = 0; m < MB; ++m) sumi[m] = s16[m] = _mm256_setzero_si256();
  const __m256i m4 = _mm256_set1_epi8(0xF);
  auto chunk = [&](__m256i w, int c) {     // weights 4c .. 4c + 3 of each row
    const __m256i u = kSigned ? _mm256_sign_epi8(w, w) : w;
    for (int m = 0; m < MB; ++m) {
      __m256i xv = bcast4(x.q + (m0 + m) * x.K + b * 32 + 4 * c);
      if constexpr (kSigned) xv = _mm256_sign_epi8(xv, w);
      s16[m] = _mm256_add_epi16(s16[m], _mm256_maddubs_epi16(u, xv));
    }
  };
  auto flush = [&]() {
    for (int m = 0; m < MB; ++m) {
      sumi[m] = _mm256_add_epi32(sumi[m], _mm256_madd_epi16(s16[m], _mm256_set1_epi16(1)));
      s16[m] = _mm256_setzero_si256();
    }
  };
  if constexpr (QT == kQ8_0) {
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      chunk(load32(gb + kQs + 32 * c), c);
      flush();
    }
  } else {
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m256i raw = load32(gb + kQs + 32 * c);
      __m256i lo = _mm256_and_si256(raw, m4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
      if constexpr (kFive) {
        lo = _mm256_or_si256(lo, high_bits(qh, c, 0x10));
        hi = _mm256_or_si256(hi, high_bits(qh, c + 4, 0x10));
      }
      if constexpr (QT == kIQ4_NL) {
        chunk(iq4nl_values<false>(lo), c);
        flush();
        chunk(iq4nl_values<false>(hi), c + 4);
        flush();
        continue;
      }
      chunk(lo, c);
      chunk(hi, c + 4);
      if constexpr (kFlush == 4) if (c % 2 == 1) flush();
    }
    if constexpr (kFlush == 8) flush();
  }
#endif
  constexpr int kOff = legacy_offset<QT>();
  if constexpr (kOff != 0)
    for (int m = 0; m < MB; ++m)
      sumi[m] = _mm256_sub_epi32(sumi[m], _mm256_set1_epi32(kOff * x.s[(m0 + m) * x.ns + b]));
  __m256 mv = _mm256_setzero_ps();
  if constexpr (kMin) mv = load_f16x8(gb + kOffM);
  for (int m = 0; m < MB; ++m) {
    const float xd = x.d[(m0 + m) * x.nd + b];
    acc[m] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(xd)), _mm256_cvtepi32_ps(sumi[m]),
                             acc[m]);
    if constexpr (kMin)
      acc[m] = _mm256_fmadd_ps(mv, _mm256_set1_ps(x.sd[(m0 + m) * x.nd + b]), acc[m]);
  }
}

// int16 pairs (v, v) per lane from int32 lanes v (small): madd then scales a pair sum by v.
QL_INLINE __m256i dup16(__m256i v32) { return _mm256_or_si256(v32, _mm256_slli_epi32(v32, 16)); }
QL_INLINE __m256i pair16(int32_t lo, int32_t hi) {    // (lo, hi) int16 in every lane
  return _mm256_set1_epi32(static_cast<int32_t>((static_cast<uint32_t>(hi) << 16) |
                                                (static_cast<uint32_t>(lo) & 0xFFFF)));
}

#if defined(QL_VNNI)
// Sub-blocks 2j (low nibbles) and 2j + 1 (high) of a Q4_K / Q5_K group-block: the int32 dot
// products of each row in lane r, two units (8 weights of each row) per 512-bit vpdpbusd, the
// halves added at the end. Why 512 bits: on a Zen 5 the 256-bit kernel was compute-bound on
// Q4_K (~40 GB/s of packed bytes where Q6_K streams ~49); exact integers, so the same bits.
template <int64_t QT, int MB>
QL_INLINE void k45_units_zmm(const uint8_t* gb, const XQ& x, int64_t m0, int64_t b, int j,
                             __m256i (&slo)[MB], __m256i (&shi)[MB]) {
  constexpr int64_t kQs = QT == kQ5_K ? kK5Qs : kK4Qs;
  const __m512i m4 = _mm512_set1_epi8(0xF);
  __m512i lo_acc[MB], hi_acc[MB];
  for (int m = 0; m < MB; ++m) lo_acc[m] = hi_acc[m] = _mm512_setzero_si512();
#pragma GCC unroll 4
  for (int c = 0; c < 8; c += 2) {
    const __m512i raw = _mm512_loadu_si512(gb + kQs + 32 * (8 * j + c));
    __m512i lo = _mm512_and_si512(raw, m4), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
    if constexpr (QT == kQ5_K) {
      const __m512i qh = _mm512_loadu_si512(gb + kK5Qh + 32 * c);
      const __m512i h = _mm512_set1_epi8(0x10);
      lo = _mm512_or_si512(lo, high_bits_zmm(qh, 2 * j, h));
      hi = _mm512_or_si512(hi, high_bits_zmm(qh, 2 * j + 1, h));
    }
    for (int m = 0; m < MB; ++m) {
      const int8_t* xb = x.q + (m0 + m) * x.K + b * 256 + 64 * j + 4 * c;
      lo_acc[m] = _mm512_dpbusd_epi32(lo_acc[m], lo, bcast4x2(xb));
      hi_acc[m] = _mm512_dpbusd_epi32(hi_acc[m], hi, bcast4x2(xb + 32));
    }
  }
  for (int m = 0; m < MB; ++m) {
    slo[m] = add_halves(lo_acc[m]);
    shi[m] = add_halves(hi_acc[m]);
  }
}
#endif

// Q4_K / Q5_K: madd multiplies each sub-block's pair sums by the lane's scale (int16 pairs),
// leaving one int32 per lane and sub-block, which x's 32-block scale multiplies in float; the
// minimums: the lane's float minimum times x's d * sum (sd) of the sub-block.
template <int64_t QT, int MB>
QL_INLINE void group_block_k45(const uint8_t* gb, const XQ& x, int64_t m0, int64_t b,
                               __m256 (&acc)[MB]) {
  __m256 fs[MB], fm[MB];
  for (int m = 0; m < MB; ++m) fs[m] = fm[m] = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) {
    const auto scale32 = [&](int s) {   // lane r: sub-block s's 6-bit scale of row r
      return _mm256_cvtepu8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(gb + kKScales + 8 * s)));
    };
#if defined(QL_VNNI)
    const __m256i s_lo = scale32(2 * j), s_hi = scale32(2 * j + 1);
#else
    const __m256i s_lo = dup16(scale32(2 * j)), s_hi = dup16(scale32(2 * j + 1));
#endif
    __m256i slo[MB], shi[MB];
#if defined(QL_VNNI)
    k45_units_zmm<QT, MB>(gb, x, m0, b, j, slo, shi);
    for (int m = 0; m < MB; ++m) {
      slo[m] = _mm256_mullo_epi32(slo[m], s_lo);
      shi[m] = _mm256_mullo_epi32(shi[m], s_hi);
    }
#else
    constexpr int64_t kQs = QT == kQ5_K ? kK5Qs : kK4Qs;
    const __m256i m4 = _mm256_set1_epi8(0xF);
    for (int m = 0; m < MB; ++m) slo[m] = shi[m] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      const __m256i raw = load32(gb + kQs + 32 * (8 * j + c));
      __m256i lo = _mm256_and_si256(raw, m4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
      if constexpr (QT == kQ5_K) {
        const __m256i qh = load32(gb + kK5Qh + 32 * c);
        lo = _mm256_or_si256(lo, high_bits(qh, 2 * j, 0x10));
        hi = _mm256_or_si256(hi, high_bits(qh, 2 * j + 1, 0x10));
      }
      for (int m = 0; m < MB; ++m) {
        const int8_t* xb = x.q + (m0 + m) * x.K + b * 256 + 64 * j + 4 * c;
        slo[m] = _mm256_add_epi32(slo[m], _mm256_madd_epi16(_mm256_maddubs_epi16(lo, bcast4(xb)), s_lo));
        shi[m] = _mm256_add_epi32(shi[m], _mm256_madd_epi16(_mm256_maddubs_epi16(hi, bcast4(xb + 32)), s_hi));
      }
    }
#endif
    // mins [pair j][row][2]: lane r holds (min 2j, min 2j + 1) as two int16.
    const __m256i mp = _mm256_cvtepu8_epi16(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(gb + kKMins + 16 * j)));
    const __m256 mn_lo = _mm256_cvtepi32_ps(_mm256_and_si256(mp, _mm256_set1_epi32(0xFFFF)));
    const __m256 mn_hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(mp, 16));
    for (int m = 0; m < MB; ++m) {
      const float* xd = x.d + (m0 + m) * x.nd + b * 8 + 2 * j;
      const float* xsd = x.sd + (m0 + m) * x.nd + b * 8 + 2 * j;
      fs[m] = _mm256_fmadd_ps(_mm256_set1_ps(xd[0]), _mm256_cvtepi32_ps(slo[m]), fs[m]);
      fs[m] = _mm256_fmadd_ps(_mm256_set1_ps(xd[1]), _mm256_cvtepi32_ps(shi[m]), fs[m]);
      fm[m] = _mm256_fmadd_ps(_mm256_set1_ps(xsd[0]), mn_lo, fm[m]);
      fm[m] = _mm256_fmadd_ps(_mm256_set1_ps(xsd[1]), mn_hi, fm[m]);
    }
  }
  const __m256 d = load_f16x8(gb), dmin = load_f16x8(gb + kOffM);
  for (int m = 0; m < MB; ++m) {
    acc[m] = _mm256_fmadd_ps(d, fs[m], acc[m]);
    acc[m] = _mm256_fnmadd_ps(dmin, fm[m], acc[m]);
  }
}

#if defined(QL_VNNI)
// Q6_K's (Q3_K's, Q2_K's) x block p = 4h + t: the int32 dot products of its two 16-weight
// groups (ta: units 0-3, tb: 4-7) in lane r, two units per 512-bit vpdpbusd as in
// k45_units_zmm.
template <int64_t QT, int MB>
QL_INLINE void q6k_units_zmm(const uint8_t* gb, const XQ& x, int64_t m0, int64_t b, int h, int t,
                             __m256i (&ta)[MB], __m256i (&tb)[MB]) {
  const __m512i m4 = _mm512_set1_epi8(0xF), m3 = _mm512_set1_epi8(0x30);
  __m512i za[MB], zb[MB];
  for (int m = 0; m < MB; ++m) za[m] = zb[m] = _mm512_setzero_si512();
#pragma GCC unroll 4
  for (int c = 0; c < 8; c += 2) {
    __m512i q;
    if constexpr (QT == kQ2_K || QT == kQ3_K) {
      q = _mm512_and_si512(_mm512_srli_epi16(_mm512_loadu_si512(
          gb + qs2_at(QT) + 32 * (8 * h + c)), 2 * t), _mm512_set1_epi8(3));
      if constexpr (QT == kQ3_K)     // q | (hmask's bit 4h + t at bit 2 & 4): one ternlog
        q = _mm512_ternarylogic_epi32(q, q3k_bit2(_mm512_loadu_si512(gb + kQ3Hm + 32 * c),
                                                  4 * h + t), _mm512_set1_epi8(4), 0xF8);
    } else {
      const __m512i lb = _mm512_loadu_si512(gb + kQ6Ql + 32 * ((2 * h + (t & 1)) * 8 + c));
      q = t < 2 ? _mm512_and_si512(lb, m4) : _mm512_and_si512(_mm512_srli_epi16(lb, 4), m4);
      if constexpr (QT == kQ6_K)
        q = _mm512_or_si512(q, high_bits_zmm(_mm512_loadu_si512(gb + kQ6Qh + 32 * (8 * h + c)),
                                             2 * t, m3));
    }
    for (int m = 0; m < MB; ++m) {
      const __m512i xv = bcast4x2(x.q + (m0 + m) * x.K + b * 256 + 128 * h + 32 * t + 4 * c);
      if (c < 4) za[m] = _mm512_dpbusd_epi32(za[m], q, xv);
      else zb[m] = _mm512_dpbusd_epi32(zb[m], q, xv);
    }
  }
  for (int m = 0; m < MB; ++m) {
    ta[m] = add_halves(za[m]);
    tb[m] = add_halves(zb[m]);
  }
}
#endif

// Q6_K: q (0..63) with x, each 16-weight group's pair sums scaled by the lane's int8 scale in
// madd; the -32 offset is 32 x (scale, scale) pairs madd x's 16-sums, subtracted per 32-block
// (one (h, t) step), whose int32 x's block scale then multiplies in float. Q3_K: q 0..7,
// offset 4. Q2_K: q 0..3, 4-bit scales, no offset, and its 4-bit minimums the same way as the
// offset: (min, min) pairs madd x's 16-sums, times x's block scale into their own float sum,
// which dmin multiplies at the end.
template <int64_t QT, int MB>
QL_INLINE void group_block_q6k(const uint8_t* gb, const XQ& x, int64_t m0, int64_t b,
                               __m256 (&acc)[MB]) {
  constexpr bool kQ2 = QT == kQ2_K;
  __m256 fs[MB], fm[MB];
  for (int m = 0; m < MB; ++m) fs[m] = fm[m] = _mm256_setzero_ps();
  constexpr int kShift = QT == kQ3_K ? 2 : 5;       // the offset: 4 or 32
  // lane r: (sc[2p][r], sc[2p+1][r]) int16; Q2_K's low nibbles (its minimums: high, `mins`)
  const auto pairs = [&](int p, bool mins = false) {
    const __m128i v =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(gb + (kQ2 ? kQ2Sc : kQ6Sc) + 16 * p));
    if constexpr (!kQ2) return _mm256_cvtepi8_epi16(v);
    const __m128i nib = _mm_and_si128(mins ? _mm_srli_epi16(v, 4) : v, _mm_set1_epi8(0xF));
    return _mm256_cvtepu8_epi16(nib);
  };
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h)
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) {
      const int p = 4 * h + t;                       // x's 32-block; groups 2p and 2p + 1
      const __m256i pr = pairs(p);
      __m256i summ[MB];                              // Q2_K: the minimums' int32 terms
      if constexpr (kQ2) {
        const __m256i mp = pairs(p, true);
        for (int m = 0; m < MB; ++m) {
          const int32_t* bs = x.s + (m0 + m) * x.ns + b * 16 + 2 * p;
          summ[m] = _mm256_madd_epi16(mp, pair16(bs[0], bs[1]));
        }
      }
#if !defined(QL_VNNI)
      const __m256i s_a = _mm256_blend_epi16(pr, _mm256_slli_epi32(pr, 16), 0xAA);
      const __m256i s_b = _mm256_blend_epi16(_mm256_srli_epi32(pr, 16), pr, 0xAA);
#endif
      __m256i sumi[MB];
      for (int m = 0; m < MB; ++m) {
        const int32_t* bs = x.s + (m0 + m) * x.ns + b * 16 + 2 * p;
        sumi[m] = _mm256_setzero_si256();                       // Q2_K: no offset
        if constexpr (!kQ2)
          sumi[m] = _mm256_sub_epi32(sumi[m], _mm256_slli_epi32(
              _mm256_madd_epi16(pr, pair16(bs[0], bs[1])), kShift));
      }
#if defined(QL_VNNI)
      __m256i ta[MB], tb[MB];
      q6k_units_zmm<QT, MB>(gb, x, m0, b, h, t, ta, tb);
      // lane r's int8 scales of groups 2p and 2p + 1, sign-extended from pr's int16 halves
      const __m256i sa = _mm256_srai_epi32(_mm256_slli_epi32(pr, 16), 16);
      const __m256i sb = _mm256_srai_epi32(pr, 16);
      for (int m = 0; m < MB; ++m)
        sumi[m] = _mm256_add_epi32(sumi[m], _mm256_add_epi32(_mm256_mullo_epi32(ta[m], sa),
                                                             _mm256_mullo_epi32(tb[m], sb)));
#else
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) {
        const __m256i q = q6k_chunk<QT>(gb, h, t, c);
        const __m256i sv = c < 4 ? s_a : s_b;
        for (int m = 0; m < MB; ++m)
          sumi[m] = _mm256_add_epi32(sumi[m], _mm256_madd_epi16(_mm256_maddubs_epi16(
              q, bcast4(x.q + (m0 + m) * x.K + b * 256 + 128 * h + 32 * t + 4 * c)), sv));
      }
#endif
      for (int m = 0; m < MB; ++m) {
        const __m256 xd = _mm256_set1_ps(x.d[(m0 + m) * x.nd + b * 8 + p]);
        fs[m] = _mm256_fmadd_ps(xd, _mm256_cvtepi32_ps(sumi[m]), fs[m]);
        if constexpr (kQ2) fm[m] = _mm256_fmadd_ps(xd, _mm256_cvtepi32_ps(summ[m]), fm[m]);
      }
    }
  const __m256 d = load_f16x8(gb);
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_fmadd_ps(d, fs[m], acc[m]);
  if constexpr (kQ2) {
    const __m256 dmin = load_f16x8(gb + kOffM);
    for (int m = 0; m < MB; ++m) acc[m] = _mm256_fnmadd_ps(dmin, fm[m], acc[m]);
  }
}

// One group of 8 rows against x rows m0 .. m0 + MB - 1, every block.
template <int64_t QT, int MB>
__attribute__((noinline)) void pass_avx2(const uint8_t* wg, const XQ& x, int64_t nb,
                                         int64_t gbytes, int64_t m0, float* y, int64_t N,
                                         int64_t n0) {
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* gb = wg + b * gbytes;
    if (m0 == 0)   // the first pass reads memory: keep the stream kPrefetchBytes ahead
      for (int64_t o = 0; o < gbytes; o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(gb) + kPrefetchBytes + o, _MM_HINT_T1);
    if constexpr (QT == kQ4_K || QT == kQ5_K) group_block_k45<QT, MB>(gb, x, m0, b, acc);
    else if constexpr (per16(QT)) group_block_q6k<QT, MB>(gb, x, m0, b, acc);
    else group_block_legacy<QT, MB>(gb, x, m0, b, acc);
  }
  for (int m = 0; m < MB; ++m) {
    float* out = y + (m0 + m) * N + n0;
    if (n0 + kGroup <= N) {
      _mm256_storeu_ps(out, acc[m]);
    } else {
      alignas(32) float tmp[8];
      _mm256_store_ps(tmp, acc[m]);
      for (int64_t r = 0; n0 + r < N; ++r) out[r] = tmp[r];
    }
  }
}

// x rows per pass: the group's bytes stay in L1 between passes.
template <int64_t QT>
constexpr int kPassRows = 4;

template <int64_t QT>
void run_avx2_t(const Format& f, const uint8_t* packed, const XQ& x, float* y, int64_t M,
                int64_t N, int64_t g0, int64_t g1) {
  constexpr int P = kPassRows<QT>;
  const int64_t nb = x.K / f.block, gbytes = f.gbytes;
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* wg = packed + g * nb * gbytes;
    int64_t m0 = 0;
    for (; m0 + P <= M; m0 += P) pass_avx2<QT, P>(wg, x, nb, gbytes, m0, y, N, g * kGroup);
    switch (M - m0) {
      case 3: if constexpr (P > 3) pass_avx2<QT, 3>(wg, x, nb, gbytes, m0, y, N, g * kGroup); break;
      case 2: if constexpr (P > 2) pass_avx2<QT, 2>(wg, x, nb, gbytes, m0, y, N, g * kGroup); break;
      case 1: pass_avx2<QT, 1>(wg, x, nb, gbytes, m0, y, N, g * kGroup); break;
      default: break;
    }
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
    case kIQ4_NL: return run_avx2_t<kIQ4_NL>(f, packed, x, y, M, N, g0, g1);
    case kQ3_K: return run_avx2_t<kQ3_K>(f, packed, x, y, M, N, g0, g1);
    case kQ2_K: return run_avx2_t<kQ2_K>(f, packed, x, y, M, N, g0, g1);
    default: TORCH_CHECK(false, "quant_linear: unsupported GGML type ", qt);
  }
}
#endif  // KVS_AVX2

// ------------------------------------------------------------------ dequantization
// One row of a group-block -> float32 with gguf.quants' float32 operations in its order
// (products of a float16 scale and small integers are exact, so FMA contraction changes no
// bits; the _1 minimum and the K-quants' dmin * min are one rounding each, as there).

void dequant_row(int64_t qt, const uint8_t* gb, int64_t r, float* out) {
  Decoded w;
  decode(qt, gb, r, w);
  if (qt == kQ2_K) {
    for (int k = 0; k < 256; ++k)
      out[k] = (w.d * static_cast<float>(w.sc[k / 16])) * w.q[k] -
               w.m * static_cast<float>(w.mn[k / 16]);
  } else if (is_q6(qt)) {
    for (int k = 0; k < 256; ++k) out[k] = (w.d * static_cast<float>(w.sc[k / 16])) * w.q[k];
  } else if (is_k(qt)) {
    for (int j = 0; j < 8; ++j) {
      const float ds = w.d * static_cast<float>(w.sc[j]), dm = w.m * static_cast<float>(w.mn[j]);
      for (int l = 0; l < 32; ++l) out[32 * j + l] = ds * static_cast<float>(w.q[32 * j + l]) - dm;
    }
  } else if (qt == kQ4_1 || qt == kQ5_1) {
    for (int k = 0; k < 32; ++k) out[k] = w.d * static_cast<float>(w.q[k]) + w.m;
  } else {
    for (int k = 0; k < 32; ++k) out[k] = w.d * static_cast<float>(w.q[k]);
  }
}

// AVX2: a whole group-block (8 rows x one block) at a time, from the packed layout directly.
// Two 4-weight chunks of the 8 rows (a: weights 4c.., b: 4c+4..) are interleaved by 32-bit
// unit (unpacklo / unpackhi_epi32), which puts 8 consecutive weights of one row in 8 bytes;
// each such half is widened to 8 int32 -> float and scaled with the row's broadcast scale
// (and minimum), one 8-float store per row. The products (float16 scale x small integers)
// are exact and an FMA rounds once where gguf's float32 "d * q + m" does, so the bits are
// dequant_row's (tests: every type, against gguf.quants.dequantize).
#if defined(KVS_AVX2)

// The row pointers of a group (rows outside the wanted range point at a scratch block).
struct RowDst { float* p[kGroup]; };

// Lane r of v broadcast to all 8 lanes.
QL_INLINE __m256 lane_bcast(__m256 v, int r) {
  return _mm256_permutevar8x32_ps(v, _mm256_set1_epi32(r));
}

// Bytes 8h .. 8h + 7 of a 128-bit value as 8 floats.
QL_INLINE __m256 bytes_to_f32(__m128i v, int h, bool sign) {
  const __m128i part = h ? _mm_unpackhi_epi64(v, v) : v;
  return _mm256_cvtepi32_ps(sign ? _mm256_cvtepi8_epi32(part) : _mm256_cvtepu8_epi32(part));
}

// kMode 0: s * q; 1: s * q + m; 2: s * q - m. a, b: chunks c, c + 1 (int8 / uint8 per lane);
// the 8 weights go to dst.p[r] + off.
template <int kMode, bool kSigned>
QL_INLINE void store_pair(__m256i a, __m256i b, const __m256 (&s)[kGroup],
                          const __m256 (&m)[kGroup], const RowDst& dst, int64_t off) {
  const __m256i lo = _mm256_unpacklo_epi32(a, b);    // rows 0, 1 | 4, 5
  const __m256i hi = _mm256_unpackhi_epi32(a, b);    // rows 2, 3 | 6, 7
  const __m128i parts[4] = {_mm256_castsi256_si128(lo), _mm256_castsi256_si128(hi),
                            _mm256_extracti128_si256(lo, 1), _mm256_extracti128_si256(hi, 1)};
#pragma GCC unroll 8
  for (int r = 0; r < kGroup; ++r) {
    const __m256 q = bytes_to_f32(parts[(r >> 2) * 2 + ((r >> 1) & 1)], r & 1, kSigned);
    __m256 v;
    if constexpr (kMode == 0) v = _mm256_mul_ps(q, s[r]);
    else if constexpr (kMode == 1) v = _mm256_fmadd_ps(q, s[r], m[r]);
    else v = _mm256_fmsub_ps(q, s[r], m[r]);
    _mm256_storeu_ps(dst.p[r] + off, v);
  }
}

QL_INLINE void bcast_rows(__m256 v, __m256 (&out)[kGroup]) {
  for (int r = 0; r < kGroup; ++r) out[r] = lane_bcast(v, r);
}

template <int64_t QT>
QL_INLINE void dequant_group_legacy(const uint8_t* gb, const RowDst& dst) {
  constexpr bool kMin = QT == kQ4_1 || QT == kQ5_1, kFive = QT == kQ5_0 || QT == kQ5_1;
  constexpr int64_t kQs = legacy_qs(QT);
  __m256 s[kGroup], m[kGroup];
  bcast_rows(load_f16x8(gb), s);
  if constexpr (kMin) bcast_rows(load_f16x8(gb + kOffM), m);
  if constexpr (QT == kQ8_0) {
    for (int c = 0; c < 8; c += 2)
      store_pair<0, true>(load32(gb + kQs + 32 * c), load32(gb + kQs + 32 * (c + 1)), s, m, dst,
                          4 * c);
    return;
  }
  __m256i qh = _mm256_setzero_si256();
  if constexpr (kFive) qh = load32(gb + kLegacyQh + (kMin ? 16 : 0));
  const auto chunk = [&](int c) {
    __m256i v = legacy_chunk<QT>(gb, qh, c);
    if constexpr (QT == kQ4_0) v = _mm256_sub_epi8(v, _mm256_set1_epi8(8));
    if constexpr (QT == kQ5_0) v = _mm256_sub_epi8(v, _mm256_set1_epi8(16));
    if constexpr (QT == kIQ4_NL) v = iq4nl_values<false>(v);
    return v;
  };
#pragma GCC unroll 4
  for (int c = 0; c < 8; c += 2)
    store_pair<kMin ? 1 : 0, !kMin>(chunk(c), chunk(c + 1), s, m, dst, 4 * c);
}

// Q4_K / Q5_K: sub-block j2 (32 weights) scales d * sc, minimums dmin * mn, per row.
template <int64_t QT>
QL_INLINE void dequant_group_k45(const uint8_t* gb, const RowDst& dst) {
  const __m256 d = load_f16x8(gb), dmin = load_f16x8(gb + kOffM);
  for (int sb = 0; sb < 8; ++sb) {
    __m256 s[kGroup], m[kGroup];
    bcast_rows(_mm256_mul_ps(d, k45_scale(gb, sb)), s);
    bcast_rows(_mm256_mul_ps(dmin, k45_min(gb, sb)), m);
#pragma GCC unroll 4
    for (int c = 0; c < 8; c += 2)
      store_pair<2, false>(k45_chunk<QT>(gb, sb, c), k45_chunk<QT>(gb, sb, c + 1), s, m, dst,
                           32 * sb + 4 * c);
  }
}

// Q6_K: weight 128h + 32t + 4c + l; 16-weight group g = 8h + 2t + c / 4 scales it by d * sc_g.
template <int64_t QT>
QL_INLINE void dequant_group_q6k(const uint8_t* gb, const RowDst& dst) {
  constexpr bool kQ2 = QT == kQ2_K;
  const __m256 d = load_f16x8(gb), dmin = kQ2 ? load_f16x8(gb + kOffM) : d;
  const __m256i off = _mm256_set1_epi8(QT == kQ3_K ? 4 : kQ2 ? 0 : 32);
  for (int h = 0; h < 2; ++h)
    for (int t = 0; t < 4; ++t) {
      const auto chunk = [&](int c) { return _mm256_sub_epi8(q6k_chunk<QT>(gb, h, t, c), off); };
      for (int half = 0; half < 2; ++half) {
        const int g = 8 * h + 2 * t + half;
        // scales [pair][row][2]: row r's scale of group g is byte 2r + g % 2 of pair g / 2
        // (Q2_K: its low nibble; the minimum the high one).
        const __m128i sp = _mm_loadu_si128(
            reinterpret_cast<const __m128i*>(gb + (kQ2 ? kQ2Sc : kQ6Sc) + 16 * (g / 2)));
        __m256 s[kGroup], m[kGroup];
        if constexpr (kQ2) {
          const __m128i sb = _mm_srli_epi16(g % 2 ? sp : _mm_slli_epi16(sp, 8), 8);  // u8 each
          const __m128i lo = _mm_and_si128(sb, _mm_set1_epi16(0xF)), hi = _mm_srli_epi16(sb, 4);
          bcast_rows(_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(lo))), s);
          bcast_rows(_mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(hi))), m);
        } else {
          const __m128i sb = _mm_srai_epi16(g % 2 ? sp : _mm_slli_epi16(sp, 8), 8);  // int16 each
          bcast_rows(_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(sb))), s);
        }
#pragma GCC unroll 2
        for (int c = 4 * half; c < 4 * half + 4; c += 2)
          store_pair<kQ2 ? 2 : 0, !kQ2>(chunk(c), chunk(c + 1), s, m, dst,
                                        128 * h + 32 * t + 4 * c);
      }
    }
}

void dequant_group_avx2(int64_t qt, const uint8_t* gb, const RowDst& dst) {
  switch (qt) {
    case kQ4_0: return dequant_group_legacy<kQ4_0>(gb, dst);
    case kQ4_1: return dequant_group_legacy<kQ4_1>(gb, dst);
    case kQ5_0: return dequant_group_legacy<kQ5_0>(gb, dst);
    case kQ5_1: return dequant_group_legacy<kQ5_1>(gb, dst);
    case kQ8_0: return dequant_group_legacy<kQ8_0>(gb, dst);
    case kQ4_K: return dequant_group_k45<kQ4_K>(gb, dst);
    case kQ5_K: return dequant_group_k45<kQ5_K>(gb, dst);
    case kQ6_K: return dequant_group_q6k<kQ6_K>(gb, dst);
    case kIQ4_NL: return dequant_group_legacy<kIQ4_NL>(gb, dst);
    case kQ3_K: return dequant_group_q6k<kQ3_K>(gb, dst);
    case kQ2_K: return dequant_group_q6k<kQ2_K>(gb, dst);
    default: TORCH_CHECK(false, "quant_dequantize: unsupported GGML type ", qt);
  }
}
#endif  // KVS_AVX2

#include "quant_gemm.h"

// ------------------------------------------------------------------ entries

void check_packed(const at::Tensor& packed, const Format& f, int64_t N, int64_t K) {
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte &&
                  packed.is_contiguous() && packed.dim() == 3,
              "quant_linear: packed must be a contiguous uint8 CPU tensor [G, K/B, 8*T]");
  TORCH_CHECK(K % f.block == 0, "quant_linear: K = ", K, " is not a multiple of the block size ",
              f.block);
  TORCH_CHECK(packed.size(0) == (N + kGroup - 1) / kGroup && packed.size(1) == K / f.block &&
                  packed.size(2) == f.gbytes,
              "quant_linear: packed has shape ", packed.sizes(), ", expected [",
              (N + kGroup - 1) / kGroup, ", ", K / f.block, ", ", f.gbytes, "] for N = ", N,
              ", K = ", K);
}

// x of a linear op: a contiguous float32 or bfloat16 [M, K] CPU tensor; whether it is bf16.
bool check_x(const at::Tensor& x, const char* op) {
  const bool bf = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || bf) && x.dim() == 2 &&
                  x.is_contiguous(),
              op, ": x must be a contiguous float32 or bfloat16 [M, K]");
  return bf;
}

QL_INLINE XKind x_kind(int64_t qt) {
  return is_k(qt) ? kXK32 : qt == kQ4_1 || qt == kQ5_1 ? kXQ8_1 : kXQ8_0;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_x_op(const at::Tensor& x,
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
  at::Tensor sd = at::zeros({M, K / f.act_block}, x.options());
  quantize_x(x.data_ptr<float>(), M, K, f, x_kind(qtype), q.data_ptr<int8_t>(),
             d.data_ptr<float>(), s.data_ptr<int32_t>(), sd.data_ptr<float>());
  return {q, d, s, sd};
}

// x's int8 blocks (quantize_x) for the kernels, a float32 or bfloat16 [M, K] x (check_x) widened a
// row at a time (no float32 copy of a whole prompt), rows in parallel chunks of >= `grain`.
struct QuantizedX {
  std::vector<int8_t> q;
  std::vector<float> d, sd;
  std::vector<int32_t> s;
  int64_t K, nd, ns;
  QuantizedX(const at::Tensor& x, const Format& f, int64_t qtype, int64_t grain)
      : q(static_cast<size_t>(x.numel())), K(x.size(1)), nd(x.size(1) / 32),
        ns(x.size(1) / f.sum_group) {
    const int64_t M = x.size(0);
    d.resize(static_cast<size_t>(M * nd));
    sd.resize(static_cast<size_t>(M * nd));
    s.resize(static_cast<size_t>(M * ns));
    const bool bf = x.scalar_type() == at::kBFloat16;
    const float* xp = bf ? nullptr : x.data_ptr<float>();
    const c10::BFloat16* xbp = bf ? x.data_ptr<c10::BFloat16>() : nullptr;
    chunks_for(0, M, std::max<int64_t>(grain, 1), [&](int64_t r0, int64_t r1) {
      std::vector<float> row(bf ? static_cast<size_t>(K) : 0);
      for (int64_t r = r0; r < r1; ++r) {
        if (bf)
          for (int64_t k = 0; k < K; ++k) row[k] = static_cast<float>(xbp[r * K + k]);
        quantize_x(bf ? row.data() : xp + r * K, 1, K, f, x_kind(qtype), q.data() + r * K,
                   d.data() + r * nd, s.data() + r * ns, sd.data() + r * nd);
      }
    });
  }
  XQ view() const { return XQ{q.data(), d.data(), s.data(), sd.data(), K, nd, ns}; }
};

// x of kGemmMinRows rows or more, and prompts on the K-quants (ops/quant/weight.py): int8
// activations into quant_gemm.h's panels.
at::Tensor quant_gemm(const at::Tensor& x, const at::Tensor& packed, int64_t qtype, int64_t N) {
  const Format f = format_of(qtype);
  TORCH_CHECK(gemm_supports(qtype), "quant_gemm: no int8 GEMM for GGML type ", qtype,
              " in this build (the avx2 tier and above have one; Q8_0's and IQ4_NL's on "
              "avx512_bf16 only)");
  const bool bf = check_x(x, "quant_gemm");
  const int64_t M = x.size(0), K = x.size(1);
  check_packed(packed, f, N, K);
  at::Tensor y = at::empty({M, N}, x.options());
#if defined(QL_GEMM)
  if (M == 0 || N == 0) return y;
  const QuantizedX qx(x, f, qtype, 8);
  const XQ xq = qx.view();
  const uint8_t* w = packed.data_ptr<uint8_t>();
  float* yf = bf ? nullptr : y.data_ptr<float>();
  c10::BFloat16* yb = bf ? y.data_ptr<c10::BFloat16>() : nullptr;
  const int64_t G = packed.size(0), nb = K / f.block;
  chunks_for(0, (N + kGemmRows - 1) / kGemmRows, 1, [&](int64_t i0, int64_t i1) {
    run_gemm(qtype, w, xq, yf, yb, M, N, G, nb, i0, i1);
  });
#endif
  return y;
}

// y = x @ W^T: the tier's vector path, or the portable one (`portable`: tests compare the two
// in one process).
at::Tensor linear_impl(const at::Tensor& x, const at::Tensor& packed, int64_t qtype, int64_t N,
                       bool portable) {
  const Format f = format_of(qtype);
  const bool bf = check_x(x, "quant_linear");
  const int64_t M = x.size(0), K = x.size(1);
  check_packed(packed, f, N, K);
#if defined(QL_GEMM)
  if (!portable && M >= kGemmMinRows && gemm_supports(qtype)) return quant_gemm(x, packed, qtype, N);
#endif
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  // bfloat16 x (a bf16 model's decode step): widened by QuantizedX and y rounded once at the
  // end, the bits of x.float() -> this op -> .to(bfloat16) without those two ATen calls (240 a
  // demo decode step: 4 projections x 30 layers). Its rows in one serial pass (grain M).
  std::vector<float> yw(bf ? static_cast<size_t>(M * N) : 0);
  const QuantizedX qx(x, f, qtype, M);
  const XQ xq = qx.view();
  const uint8_t* w = packed.data_ptr<uint8_t>();
  float* out = bf ? yw.data() : y.data_ptr<float>();
  const int64_t group_bytes = (K / f.block) * f.gbytes;
  const int64_t grain = std::max<int64_t>(1, kMinBytesPerTask / group_bytes);
  chunks_for(0, packed.size(0), grain, [&](int64_t g0, int64_t g1) {
#if defined(KVS_AVX2)
    if (!portable) return run_avx2(qtype, f, w, xq, out, M, N, g0, g1);
#endif
    run_generic(qtype, f, w, xq, out, M, N, g0, g1);
  });
  if (bf) {
    c10::BFloat16* yb = y.data_ptr<c10::BFloat16>();
    for (int64_t i = 0; i < M * N; ++i) yb[i] = c10::BFloat16(yw[i]);
  }
  return y;
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, int64_t qtype, int64_t N) {
  return linear_impl(x, packed, qtype, N, false);
}

at::Tensor quant_linear_generic(const at::Tensor& x, const at::Tensor& packed, int64_t qtype,
                                int64_t N) {
  return linear_impl(x, packed, qtype, N, true);
}

// Rows [row0, row1) of the weight as float32 [row1 - row0, K].
at::Tensor dequantize_impl(const at::Tensor& packed, int64_t qtype, int64_t N, int64_t row0,
                           int64_t row1, bool portable) {
  const Format f = format_of(qtype);
  TORCH_CHECK(packed.dim() == 3, "quant_dequantize: packed must be [G, K/B, 8*T]");
  const int64_t K = packed.size(1) * f.block;
  check_packed(packed, f, N, K);
  TORCH_CHECK(0 <= row0 && row0 <= row1 && row1 <= N, "quant_dequantize: rows [", row0, ", ",
              row1, ") outside [0, ", N, ")");
  at::Tensor out = at::empty({row1 - row0, K}, packed.options().dtype(at::kFloat));
  const uint8_t* w = packed.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  const int64_t nb = K / f.block;
  // Work items: groups of 8 rows (the packed interleave), ~64K weights per task at least.
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(kGroup * K, 1));
  chunks_for(row0 / kGroup, (row1 + kGroup - 1) / kGroup, grain, [&](int64_t g0, int64_t g1) {
#if defined(KVS_AVX2)
    if (!portable) {
      float scratch[256];     // rows of the group outside [row0, row1) are written here
      for (int64_t g = g0; g < g1; ++g) {
        const uint8_t* wg = w + g * nb * f.gbytes;
        for (int64_t b = 0; b < nb; ++b) {
          RowDst dst;
          for (int64_t r = 0; r < kGroup; ++r) {
            const int64_t n = g * kGroup + r;
            dst.p[r] = n >= row0 && n < row1 ? o + (n - row0) * K + b * f.block : scratch;
          }
          dequant_group_avx2(qtype, wg + b * f.gbytes, dst);
        }
      }
      return;
    }
#endif
    for (int64_t n = std::max(row0, g0 * kGroup); n < std::min(row1, g1 * kGroup); ++n) {
      const uint8_t* wg = w + (n / kGroup) * nb * f.gbytes;
      for (int64_t b = 0; b < nb; ++b)
        dequant_row(qtype, wg + b * f.gbytes, n % kGroup, o + (n - row0) * K + b * f.block);
    }
  });
  return out;
}

at::Tensor quant_dequantize(const at::Tensor& packed, int64_t qtype, int64_t N, int64_t row0,
                            int64_t row1) {
  return dequantize_impl(packed, qtype, N, row0, row1, false);
}

at::Tensor quant_dequantize_generic(const at::Tensor& packed, int64_t qtype, int64_t N,
                                    int64_t row0, int64_t row1) {
  return dequantize_impl(packed, qtype, N, row0, row1, true);
}

// Rows `ids` of the weight as float32 [len(ids), K] (an embedding lookup): the portable row
// decoder, gguf-exact like quant_dequantize. Why here: the torch-op gather of the same rows
// cost ~0.5 ms a demo decode step (5% of it).
at::Tensor quant_dequantize_ids(const at::Tensor& packed, int64_t qtype, int64_t N,
                                const at::Tensor& ids) {
  const Format f = format_of(qtype);
  TORCH_CHECK(packed.dim() == 3, "quant_dequantize_ids: packed must be [G, K/B, 8*T]");
  const int64_t K = packed.size(1) * f.block;
  check_packed(packed, f, N, K);
  TORCH_CHECK(ids.device().is_cpu() && ids.scalar_type() == at::kLong && ids.dim() == 1,
              "quant_dequantize_ids: ids must be a 1-D int64 CPU tensor");
  const at::Tensor idc = ids.contiguous();
  const int64_t* id = idc.data_ptr<int64_t>();
  const int64_t R = idc.size(0);
  for (int64_t i = 0; i < R; ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < N, "quant_dequantize_ids: row id ", id[i],
                " outside [0, ", N, ")");
  at::Tensor out = at::empty({R, K}, packed.options().dtype(at::kFloat));
  const uint8_t* w = packed.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  const int64_t nb = K / f.block;
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(K, 1));
  chunks_for(0, R, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* wg = w + (id[r] / kGroup) * nb * f.gbytes;
      for (int64_t b = 0; b < nb; ++b)
        dequant_row(qtype, wg + b * f.gbytes, id[r] % kGroup, o + r * K + b * f.block);
    }
  });
  return out;
}

std::string isa() {
#if defined(QL_VNNI)
  return "avx512 vnni (512-bit vpdpbusd int8 dot products, two 8-row units a vector)";
#elif defined(__AVX512F__) && defined(KVS_AVX2)
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
  m.def("quant_quantize_x(Tensor x, int qtype) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("quant_dequantize(Tensor packed, int qtype, int n, int row0, int row1) -> Tensor");
  m.def("quant_dequantize_generic(Tensor packed, int qtype, int n, int row0, int row1) -> Tensor");
  m.def("quant_dequantize_ids(Tensor packed, int qtype, int n, Tensor ids) -> Tensor");
  m.def("quant_gemm(Tensor x, Tensor packed, int qtype, int n) -> Tensor");
  m.def("quant_gemm_supports(int qtype) -> bool", &gemm_supports);
  m.def("quant_gemm_min_rows() -> int", &gemm_min_rows);
  m.def("quant_linear_isa() -> str", &isa);
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("quant_linear_generic", &quant_linear_generic);
  m.impl("quant_quantize_x", &quantize_x_op);
  m.impl("quant_dequantize", &quant_dequantize);
  m.impl("quant_dequantize_generic", &quant_dequantize_generic);
  m.impl("quant_dequantize_ids", &quant_dequantize_ids);
  m.impl("quant_gemm", &quant_gemm);
}
