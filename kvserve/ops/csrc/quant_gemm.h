// GEMMs on packed GGUF weights with int8 activations, for larger x (decode batches from
// kGemmMinRows rows, K-quant prompts): every tier from avx2 up; included inside
// quant_linear.cpp's anonymous namespace, after quantize_x and the packed layout's offsets.
//
//   quant_gemm(x [M, K] bf16 or f32, packed, qtype, N) -> y [M, N] in x's dtype
//
// x is quantized per block of 32 exactly as for the small-batch kernel (the type's Q8_0 / Q8_1 /
// K32 blocks: scale dx, int sums, sd = dx * sum), then, for each 32 output rows, the packed weight
// is unpacked once into two 16-row panels of unsigned values, a 64-byte vector per 4 consecutive k
// (lane = output row, vpdpbusd's layout), with float32 scales per row and 32-block (Q6_K, Q3_K,
// Q2_K: per 16) and, for the types with a minimum, the minimum (Q2_K: per 16 too). A microkernel
// then runs the whole of x over them. VNNI (the avx512_bf16 tier), 4 rows x 2 panels: 8 int32
// accumulators take 8 vpdpbusd each per 32-block (per 16: 4 per half) and are folded into 8 float32
// ones (cvt, times dx * scale; plus sd * minimum, Q2_K's dx * x's int sum of the 16 * minimum).
// AVX2 (avx2 and avx512 tiers), 4 rows x one panel's two 8-row halves at a time: maddubs pair sums
// gathered in int16 lanes, then madd into the int32 ones (GemmType::kI16); no Q8_0 or IQ4_NL there
// (their unsigned values overflow maddubs's pairs), nor Q2_K (it ran 0.85-0.87x the small-batch
// kernel at 64-128 rows, and only 1.00-1.17x the float32 chunks at 512: 190-199 GOP/s). The signed
// types' offset (w = u - 8, 16, 32 or 128) starts each int32 accumulator at -offset * (x's int sum
// over the scale's span), so it costs nothing. The int parts are exact, so both microkernels give
// the same bits, and against a float64 reference on the same quantized x and weights they differ by
// float32 rounding only (tests: 1e-5 of |x_q| @ |W|^T).
//
// Why: prompts on packed weights otherwise run GEMMs on dequantized chunks: bf16 ones (oneDNN,
// dpbf16: 32 multiply-adds an instruction) where vpdpbusd does 64, float32 ones on AVX2 (8 an
// FMA) where maddubs + an int16 add do 32. One Zen 4 thread, the 0.85B Llama's 2048 x 2048 and
// 5632-wide Q4_K layers, 512 rows of bf16 x: 305-317 GOP/s for tiles of 4-6 rows x 2 panels,
// 297-303 at 6-8 x 1, 241-266 at 2 x 4, 199-255 at 3 x 3 (the compiler spills there), 244-248
// at 3 x 4; the bf16 chunks 178-194. On the avx2 tier (float32 x, 2 threads): Q4_K 298-318
// GOP/s, 1.65-1.85x the float32 chunks' speed; Q6_K 235-244, 1.35-1.52x. And decode batches:
// against the small-batch kernel, which streams the packed groups without unpacking, from
// kGemmMinRows rows on.

#pragma once

#if defined(KVS_AVX2)
#define QL_GEMM 1
#if defined(QL_VNNI) && defined(__AVX512BF16__)
#define QL_GEMM_VNNI 1
#endif

constexpr int kGemmNR = 2;                       // 16-row panels per work item
constexpr int64_t kGemmRows = 16 * kGemmNR;      // output rows of a work item
#if defined(QL_GEMM_VNNI)
constexpr int kGemmMR = 4;                       // x rows per microkernel call
// quant_linear hands x of this many rows or more to the GEMM: the same int8 blocks of x, in
// less time from here on (0.85B Llama shapes, weights from memory, bf16 x, 2 threads, Zen 4,
// every type: small-batch kernel / GEMM time 1.01-1.51x at 16 rows, 0.72-1.36x at 8).
constexpr int64_t kGemmMinRows = 16;
#else
// 4 x rows by one 16-row panel (its two 8-row halves) a call: 8 int16 and 8 float
// accumulators. The 0.85B Llama's Q4_K / Q6_K layers, 512 rows of float32 x, 2 threads, Zen 4
// on the avx2 tier, GOP/s: 298-318 / 235-244 at 4 x 2; 282-314 / 226-244 at 3 x 2, 273-301 /
// 223-230 at 5 x 2, 249-272 / 198-229 at 2 x 4, 254-283 / 214-220 at 4 x 1, 260-289 /
// 198-202 at 6 x 1.
constexpr int kGemmMR = 4;
// The small-batch kernel, which takes x 4 rows at a time over a group in L1, keeps up with
// this GEMM longer on AVX2 (same shapes and host, small-batch / GEMM time: 0.58-0.98x at 8
// rows, 0.72-1.02x at 16, 0.92-1.08x at 32, 0.98-1.18x at 64, 1.04-1.22x at 128).
constexpr int64_t kGemmMinRows = 64;
#endif

// Per weight type: H scales per 32-block (the per-16 types: 2), whether a float minimum term
// (wo * sd) follows, and the offset the unsigned values carry (w = u - kOff): folded into the
// int32 accumulators' start, -kOff * (x's int sum over the scale's span), so it costs nothing.
template <int64_t QT> struct GemmType {
  static constexpr int H = per16(QT) ? 2 : 1;
  static constexpr bool kMin = QT == kQ4_1 || QT == kQ5_1 || QT == kQ4_K || QT == kQ5_K ||
                               QT == kQ2_K;
  static constexpr int kOff = QT == kQ8_0 || QT == kIQ4_NL ? 128 : QT == kQ4_0 ? 8 :
                              QT == kQ5_0 ? 16 : QT == kQ6_K ? 32 : QT == kQ3_K ? 4 : 0;
  // The largest unsigned value, and so the quads whose maddubs pairs (|u0 x0 + u1 x1| <=
  // 2 * 127 * umax) an int16 lane can sum without saturating (the AVX2 microkernel): 8 for the
  // 4-bit types, 4 for the 5-bit ones, 2 for Q6_K. Q8_0's 255 and IQ4_NL's 241 (kIQ4NLu)
  // allow none (no AVX2 GEMM for them).
  static constexpr int kMaxU = QT == kQ8_0 ? 255 : QT == kIQ4_NL ? 241 : QT == kQ6_K ? 63 :
                               QT == kQ3_K ? 7 : QT == kQ2_K ? 3 :
                               QT == kQ5_0 || QT == kQ5_1 || QT == kQ5_K ? 31 : 15;
  static constexpr int kFit = 32767 / (2 * 127 * kMaxU);
  static constexpr int kI16 = kFit >= 8 ? 8 : kFit >= 4 ? 4 : 2;
};

// One work item's weight rows as panels: w [NR][K/32][8 quads][16 rows][4] u8,
// ws [NR][K/32][H][16] float32 (d, or d * scale), wo [NR][K/32][H][16] (the minimum, -dmin *
// min; Q2_K has one per 16 weights, as its scales).
struct GemmPanels {
  std::vector<uint8_t> w;
  std::vector<float> ws, wo;
  int64_t nt = 0, hs = 1;          // 32-blocks along K; scales per 32-block
  GemmPanels(int64_t K, int64_t h)
      : w(static_cast<size_t>(kGemmRows * K)), ws(static_cast<size_t>(kGemmNR * K / 2 * h)),
        wo(static_cast<size_t>(kGemmNR * K / 2 * h)), nt(K / 32), hs(h) {}
  // Panel p, 32-block t, quad c / scale i, 8-row half h (the microkernels read 16 rows from h 0).
  size_t wq_at(int p, int64_t t, int c, int h) const { return ((p * nt + t) * 8 + c) * 64 + h * 32; }
  size_t s_at(int p, int64_t t, int i, int h) const { return ((p * nt + t) * hs + i) * 16 + h * 8; }
  size_t o_at(int p, int64_t t, int i, int h) const { return s_at(p, t, i, h); }
  uint8_t* wq(int p, int64_t t, int c, int h) { return w.data() + wq_at(p, t, c, h); }
  float* s(int p, int64_t t, int i, int h) { return ws.data() + s_at(p, t, i, h); }
  float* o(int p, int64_t t, int i, int h) { return wo.data() + o_at(p, t, i, h); }
  const uint8_t* wq(int p, int64_t t, int c, int h) const { return w.data() + wq_at(p, t, c, h); }
  const float* s(int p, int64_t t, int i, int h) const { return ws.data() + s_at(p, t, i, h); }
  const float* o(int p, int64_t t, int i, int h) const { return wo.data() + o_at(p, t, i, h); }
};

QL_INLINE void store32(uint8_t* dst, __m256i v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), v);
}

// Group-block gb (8 rows x one GGUF block) into half h of panel p, 32-blocks from t0.
template <int64_t QT>
void unpack_block(const uint8_t* gb, int p, int h, int64_t t0, GemmPanels& pn) {
  const __m256 d = load_f16x8(gb);
  if constexpr (QT == kQ4_K || QT == kQ5_K) {
    for (int sb = 0; sb < 8; ++sb)
      for (int c = 0; c < 8; ++c) store32(pn.wq(p, t0 + sb, c, h), k45_chunk<QT>(gb, sb, c));
    const __m256 ndmin = _mm256_sub_ps(_mm256_setzero_ps(), load_f16x8(gb + kOffM));
    for (int sb = 0; sb < 8; ++sb) {
      _mm256_storeu_ps(pn.s(p, t0 + sb, 0, h), _mm256_mul_ps(d, k45_scale(gb, sb)));
      _mm256_storeu_ps(pn.o(p, t0 + sb, 0, h), _mm256_mul_ps(ndmin, k45_min(gb, sb)));
    }
  } else if constexpr (per16(QT)) {             // Q6_K, Q3_K, Q2_K: a scale per 16 weights
    constexpr bool kQ2 = QT == kQ2_K;             // and Q2_K a minimum per 16
    const __m256 ndmin = kQ2 ? _mm256_sub_ps(_mm256_setzero_ps(), load_f16x8(gb + kOffM)) : d;
    const auto as_ps = [](__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(v)); };
    for (int hh = 0; hh < 2; ++hh)
      for (int t = 0; t < 4; ++t) {           // 32-block tb = t0 + 4hh + t
        const int64_t tb = t0 + 4 * hh + t;
        for (int c = 0; c < 8; ++c) store32(pn.wq(p, tb, c, h), q6k_chunk<QT>(gb, hh, t, c));
        // scales [pair][row][2]: row r's bytes of groups 2p, 2p + 1 (p = 4hh + t): an int8
        // scale each (Q6_K, Q3_K), or (Q2_K) the scale's low nibble and the minimum's high one
        const __m128i sp = _mm_loadu_si128(
            reinterpret_cast<const __m128i*>(gb + (kQ2 ? kQ2Sc : kQ6Sc) + 16 * (4 * hh + t)));
        for (int i = 0; i < 2; ++i) {
          if constexpr (kQ2) {
            const __m128i b = i ? _mm_srli_epi16(sp, 8) : _mm_and_si128(sp, _mm_set1_epi16(0xFF));
            _mm256_storeu_ps(pn.s(p, tb, i, h),
                             _mm256_mul_ps(d, as_ps(_mm_and_si128(b, _mm_set1_epi16(0xF)))));
            _mm256_storeu_ps(pn.o(p, tb, i, h), _mm256_mul_ps(ndmin, as_ps(_mm_srli_epi16(b, 4))));
          } else {
            const __m128i sb = _mm_srai_epi16(i ? sp : _mm_slli_epi16(sp, 8), 8);
            _mm256_storeu_ps(pn.s(p, tb, i, h), _mm256_mul_ps(d, as_ps(sb)));
          }
        }
      }
  } else {                                      // the legacy types: one 32-block
    constexpr bool kMin = GemmType<QT>::kMin, kFive = QT == kQ5_0 || QT == kQ5_1;
    __m256i qh = _mm256_setzero_si256();
    if constexpr (kFive) qh = load32(gb + kLegacyQh + (kMin ? 16 : 0));
    for (int c = 0; c < 8; ++c) {
      if constexpr (QT == kQ8_0)                // w + 128 (w ^ 0x80): unsigned
        store32(pn.wq(p, t0, c, h), _mm256_xor_si256(load32(gb + legacy_qs(QT) + 32 * c),
                                                     _mm256_set1_epi8(-128)));
      else if constexpr (QT == kIQ4_NL)         // w + 128, looked up
        store32(pn.wq(p, t0, c, h), iq4nl_values<true>(legacy_chunk<QT>(gb, qh, c)));
      else
        store32(pn.wq(p, t0, c, h), legacy_chunk<QT>(gb, qh, c));
    }
    _mm256_storeu_ps(pn.s(p, t0, 0, h), d);
    if constexpr (kMin) _mm256_storeu_ps(pn.o(p, t0, 0, h), load_f16x8(gb + kOffM));
  }
}

// Output rows [n0, n0 + kGemmRows) of the packed weight as panels. Groups past the weight's end
// get zero values and scales; the padding rows of the last group keep whatever scales they
// have (NaN in the tests): their lanes are masked off at the store.
template <int64_t QT>
void unpack_panels(const uint8_t* packed, int64_t G, int64_t nb, int64_t n0, GemmPanels& pn) {
  const Format f = format_of(QT);
  const int64_t tpb = f.block / 32;             // 32-blocks per GGUF block
  for (int p = 0; p < kGemmNR; ++p)
    for (int h = 0; h < 2; ++h) {
      const int64_t g = n0 / kGroup + 2 * p + h;
      if (g < G) {
        for (int64_t b = 0; b < nb; ++b)
          unpack_block<QT>(packed + (g * nb + b) * f.gbytes, p, h, b * tpb, pn);
        continue;
      }
      for (int64_t t = 0; t < pn.nt; ++t) {
        for (int c = 0; c < 8; ++c) store32(pn.wq(p, t, c, h), _mm256_setzero_si256());
        for (int i = 0; i < pn.hs; ++i) _mm256_storeu_ps(pn.s(p, t, i, h), _mm256_setzero_ps());
        for (int i = 0; i < pn.hs; ++i) _mm256_storeu_ps(pn.o(p, t, i, h), _mm256_setzero_ps());
      }
    }
}

// An int32 accumulator's start for x row `row`, 32-block t, scale i: -offset * x's int sum over
// the scale's span (Q6_K's 16 values, the legacy types' 32; the offset-free types read none).
template <int64_t QT>
QL_INLINE int32_t offset_term(const XQ& x, int64_t row, int64_t t, int i) {
  using T = GemmType<QT>;
  if constexpr (T::kOff == 0) return 0;
  const int32_t* xs = x.s + row * x.ns;
  return -T::kOff * (T::H == 2 ? xs[2 * t + i] : xs[t]);
}

// What the minimum wo of x row `row`, 32-block t, span i multiplies: dx * x's int sum over the
// minimum's span (Q2_K's 16 values; the others' one minimum per 32-block: sd).
template <int64_t QT>
QL_INLINE float min_term(const XQ& x, int64_t row, int64_t t, int i) {
  if constexpr (GemmType<QT>::H == 2)
    return x.d[row * x.nd + t] * static_cast<float>(x.s[row * x.ns + 2 * t + i]);
  return x.sd[row * x.nd + t];
}

#if defined(QL_GEMM_VNNI)
// y rows [m0, m0 + MR) x the panels' columns from n0 (the valid ones: N - n0 of them).
template <int64_t QT, int MR>
__attribute__((noinline)) void gemm_tile(const XQ& x, int64_t m0, const GemmPanels& pn,
                                         float* yf, c10::BFloat16* yb, int64_t N, int64_t n0) {
  using T = GemmType<QT>;
  constexpr int kQuads = 8 / T::H;              // quads under one scale
  const int64_t nt = pn.nt;
  __m512 f[MR][kGemmNR];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < kGemmNR; ++r) f[m][r] = _mm512_setzero_ps();
  for (int64_t t = 0; t < nt; ++t) {
    for (int i = 0; i < T::H; ++i) {
      __m512i a[MR][kGemmNR];
      for (int m = 0; m < MR; ++m) {
        const __m512i start = _mm512_set1_epi32(offset_term<QT>(x, m0 + m, t, i));
        for (int r = 0; r < kGemmNR; ++r) a[m][r] = start;
      }
#pragma GCC unroll 8
      for (int c = kQuads * i; c < kQuads * (i + 1); ++c) {
        __m512i wv[kGemmNR];
        for (int r = 0; r < kGemmNR; ++r) wv[r] = _mm512_loadu_si512(pn.wq(r, t, c, 0));
        for (int m = 0; m < MR; ++m) {
          int32_t quad;
          std::memcpy(&quad, x.q + (m0 + m) * x.K + t * 32 + 4 * c, sizeof(quad));
          const __m512i xb = _mm512_set1_epi32(quad);
          for (int r = 0; r < kGemmNR; ++r) a[m][r] = _mm512_dpbusd_epi32(a[m][r], wv[r], xb);
        }
      }
      for (int m = 0; m < MR; ++m) {
        const __m512 dx = _mm512_set1_ps(x.d[(m0 + m) * x.nd + t]);
        for (int r = 0; r < kGemmNR; ++r) {
          const __m512 ws = _mm512_loadu_ps(pn.s(r, t, i, 0));
          f[m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[m][r]), _mm512_mul_ps(dx, ws), f[m][r]);
        }
      }
    }
    if constexpr (T::kMin)
      for (int i = 0; i < T::H; ++i)
        for (int m = 0; m < MR; ++m) {
          const __m512 sd = _mm512_set1_ps(min_term<QT>(x, m0 + m, t, i));
          for (int r = 0; r < kGemmNR; ++r)
            f[m][r] = _mm512_fmadd_ps(_mm512_loadu_ps(pn.o(r, t, i, 0)), sd, f[m][r]);
        }
  }
  for (int r = 0; r < kGemmNR; ++r) {
    const int64_t valid = std::min<int64_t>(16, N - (n0 + 16 * r));
    if (valid <= 0) break;
    const __mmask16 k = static_cast<__mmask16>((1u << valid) - 1u);
    for (int m = 0; m < MR; ++m) {
      const int64_t at = (m0 + m) * N + n0 + 16 * r;
      if (yb != nullptr)
        _mm256_mask_storeu_epi16(yb + at, k, (__m256i)_mm512_cvtneps_pbh(f[m][r]));
      else
        _mm512_mask_storeu_ps(yf + at, k, f[m][r]);
    }
  }
}

#else
// y[at, at + min(8, valid)) = v's lanes (bf16: rounded to nearest even, as vcvtneps2bf16);
// the padding rows' lanes past them are dropped.
QL_INLINE void store_valid(__m256 v, int64_t at, int64_t valid, float* yf, c10::BFloat16* yb) {
  alignas(32) float out[8];
  _mm256_store_ps(out, v);
  for (int64_t j = 0; j < std::min<int64_t>(8, valid); ++j) {
    if (yb != nullptr) yb[at + j] = c10::BFloat16(out[j]);
    else yf[at + j] = out[j];
  }
}

// The AVX2 microkernel: the same panels, a 16-row panel read as two 8-row halves (vectors h).
// maddubs (u8 weights x s8 x -> int16 pair sums) into int16 lanes for kI16 quads, then madd
// (x 1 -> int32). The int32 sums are the VNNI path's exactly, so the bits are the same. Rows
// [m0, m0 + MR) x panel p.
template <int64_t QT, int MR>
__attribute__((noinline)) void gemm_tile(const XQ& x, int64_t m0, int p, const GemmPanels& pn,
                                         float* yf, c10::BFloat16* yb, int64_t N, int64_t n0) {
  constexpr int VN = 2;                         // the panel's halves
  using T = GemmType<QT>;
  static_assert(T::kFit >= 2, "maddubs pairs of u8 weights would saturate");
  constexpr int kQuads = 8 / T::H;              // quads under one scale
  constexpr int kRun = T::kI16 < kQuads ? T::kI16 : kQuads;
  const int64_t nt = pn.nt;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 f[MR][VN];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < VN; ++v) f[m][v] = _mm256_setzero_ps();
  for (int64_t t = 0; t < nt; ++t) {
    for (int i = 0; i < T::H; ++i) {
      __m256i a[MR][VN];
      for (int m = 0; m < MR; ++m) {
        const __m256i start = _mm256_set1_epi32(offset_term<QT>(x, m0 + m, t, i));
        for (int v = 0; v < VN; ++v) a[m][v] = start;
      }
      for (int c0 = kQuads * i; c0 < kQuads * (i + 1); c0 += kRun) {
        __m256i s16[MR][VN];
        for (int m = 0; m < MR; ++m)
          for (int v = 0; v < VN; ++v) s16[m][v] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int c = c0; c < c0 + kRun; ++c) {
          __m256i wv[VN];
          for (int v = 0; v < VN; ++v) wv[v] = load32(pn.wq(p, t, c, v));
          for (int m = 0; m < MR; ++m) {
            const __m256i xb = bcast4(x.q + (m0 + m) * x.K + t * 32 + 4 * c);
            for (int v = 0; v < VN; ++v)
              s16[m][v] = _mm256_add_epi16(s16[m][v], _mm256_maddubs_epi16(wv[v], xb));
          }
        }
        for (int m = 0; m < MR; ++m)
          for (int v = 0; v < VN; ++v)
            a[m][v] = _mm256_add_epi32(a[m][v], _mm256_madd_epi16(s16[m][v], ones));
      }
      for (int m = 0; m < MR; ++m) {
        const __m256 dx = _mm256_set1_ps(x.d[(m0 + m) * x.nd + t]);
        for (int v = 0; v < VN; ++v)
          f[m][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[m][v]),
                                    _mm256_mul_ps(dx, _mm256_loadu_ps(pn.s(p, t, i, v))),
                                    f[m][v]);
      }
    }
    if constexpr (T::kMin)
      for (int i = 0; i < T::H; ++i)
        for (int m = 0; m < MR; ++m) {
          const __m256 sd = _mm256_set1_ps(min_term<QT>(x, m0 + m, t, i));
          for (int v = 0; v < VN; ++v)
            f[m][v] = _mm256_fmadd_ps(_mm256_loadu_ps(pn.o(p, t, i, v)), sd, f[m][v]);
        }
  }
  for (int v = 0; v < VN; ++v) {
    const int64_t col = n0 + 16 * p + 8 * v;
    if (col >= N) break;
    for (int m = 0; m < MR; ++m) store_valid(f[m][v], (m0 + m) * N + col, N - col, yf, yb);
  }
}
#endif

// All of x against the panels of output rows [n0, n0 + kGemmRows).
template <int64_t QT, int MR>
QL_INLINE void gemm_rows(const XQ& x, int64_t m0, const GemmPanels& pn, float* yf,
                         c10::BFloat16* yb, int64_t N, int64_t n0) {
#if defined(QL_GEMM_VNNI)
  gemm_tile<QT, MR>(x, m0, pn, yf, yb, N, n0);
#else
  for (int p = 0; p < kGemmNR; ++p) gemm_tile<QT, MR>(x, m0, p, pn, yf, yb, N, n0);
#endif
}

template <int64_t QT>
void gemm_blocks(const uint8_t* packed, const XQ& x, float* yf, c10::BFloat16* yb, int64_t M,
                 int64_t N, int64_t G, int64_t nb, int64_t i0, int64_t i1) {
  GemmPanels pn(x.K, GemmType<QT>::H);
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t n0 = i * kGemmRows;
    unpack_panels<QT>(packed, G, nb, n0, pn);
    int64_t m0 = 0;
    for (; m0 + kGemmMR <= M; m0 += kGemmMR) gemm_rows<QT, kGemmMR>(x, m0, pn, yf, yb, N, n0);
    static_assert(kGemmMR <= 4, "the remainder's cases");
    switch (M - m0) {       // the remainder
      case 3: gemm_rows<QT, 3>(x, m0, pn, yf, yb, N, n0); break;
      case 2: gemm_rows<QT, 2>(x, m0, pn, yf, yb, N, n0); break;
      case 1: gemm_rows<QT, 1>(x, m0, pn, yf, yb, N, n0); break;
      default: break;
    }
  }
}

void run_gemm(int64_t qt, const uint8_t* packed, const XQ& x, float* yf, c10::BFloat16* yb,
              int64_t M, int64_t N, int64_t G, int64_t nb, int64_t i0, int64_t i1) {
  switch (qt) {
    case kQ4_0: return gemm_blocks<kQ4_0>(packed, x, yf, yb, M, N, G, nb, i0, i1);
    case kQ4_1: return gemm_blocks<kQ4_1>(packed, x, yf, yb, M, N, G, nb, i0, i1);
    case kQ5_0: return gemm_blocks<kQ5_0>(packed, x, yf, yb, M, N, G, nb, i0, i1);
    case kQ5_1: return gemm_blocks<kQ5_1>(packed, x, yf, yb, M, N, G, nb, i0, i1);
#if defined(QL_GEMM_VNNI)
    case kQ8_0: return gemm_blocks<kQ8_0>(packed, x, yf, yb, M, N, G, nb, i0, i1);
    case kIQ4_NL: return gemm_blocks<kIQ4_NL>(packed, x, yf, yb, M, N, G, nb, i0, i1);
    case kQ2_K: return gemm_blocks<kQ2_K>(packed, x, yf, yb, M, N, G, nb, i0, i1);
#endif
    case kQ4_K: return gemm_blocks<kQ4_K>(packed, x, yf, yb, M, N, G, nb, i0, i1);
    case kQ5_K: return gemm_blocks<kQ5_K>(packed, x, yf, yb, M, N, G, nb, i0, i1);
    case kQ6_K: return gemm_blocks<kQ6_K>(packed, x, yf, yb, M, N, G, nb, i0, i1);
    case kQ3_K: return gemm_blocks<kQ3_K>(packed, x, yf, yb, M, N, G, nb, i0, i1);
    default: TORCH_CHECK(false, "quant_gemm: unsupported GGML type ", qt);
  }
}
#endif  // KVS_AVX2

// The rows from which quant_linear hands x to the GEMM (0: no GEMM in this build).
int64_t gemm_min_rows() {
#if defined(QL_GEMM)
  return kGemmMinRows;
#else
  return 0;
#endif
}

bool gemm_supports(int64_t qtype) {
#if defined(QL_GEMM)
#if defined(QL_GEMM_VNNI)
  if (qtype == kQ8_0 || qtype == kIQ4_NL || qtype == kQ2_K) return true;
#endif
  return qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ5_0 || qtype == kQ5_1 ||
         qtype == kQ4_K || qtype == kQ5_K || qtype == kQ6_K || qtype == kQ3_K;
#else
  (void)qtype;
  return false;
#endif
}
