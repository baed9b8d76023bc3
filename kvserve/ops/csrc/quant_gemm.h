// GEMMs on packed GGUF weights with int8 activations, for x of 16+ rows (the avx512_bf16 tier's
// VNNI build; included inside quant_linear.cpp's anonymous namespace, after quantize_x and the
// packed layout's offsets).
//
//   quant_gemm(x [M, K] bf16 or f32, packed, qtype, N) -> y [M, N] in x's dtype
//
// x is quantized per block of 32 exactly as for the small-batch kernel (the type's Q8_0 / Q8_1 /
// K32 blocks: scale dx, int sums, sd = dx * sum), then, for each 32 output rows, the packed
// weight is unpacked once into two 16-row panels of unsigned values, a 64-byte vector per 4
// consecutive k (lane = output row, vpdpbusd's layout), with float32 scales per row and
// 32-block (Q6_K: per 16) and, for the types with a minimum, the minimum. A 4-row x 2-panel
// microkernel then runs the whole of x over them: 8 int32 accumulators take 8 vpdpbusd each
// per 32-block (Q6_K: 4 per half) and are folded into 8 float32 ones (cvt, times dx * scale;
// plus sd * minimum). The signed types' offset (w = u - 8, 16, 32 or 128) starts each int32
// accumulator at -offset * (x's int sum over the scale's span), so it costs nothing. The int
// parts are exact, so against a float64 reference on the same quantized x and weights it
// differs by float32 rounding only (tests: 1e-5 of |x_q| @ |W|^T).
//
// Why: prompts on packed weights otherwise run bf16 GEMMs on dequantized chunks (oneDNN,
// dpbf16: 32 multiply-adds an instruction); vpdpbusd does 64. One Zen 4 thread, the 0.85B
// Llama's 2048 x 2048 and 5632-wide Q4_K layers, 512 rows of bf16 x: 305-317 GOP/s for tiles of
// 4-6 rows x 2 panels, 297-303 at 6-8 x 1, 241-266 at 2 x 4, 199-255 at 3 x 3 (the compiler
// spills there), 244-248 at 3 x 4; the bf16 chunks 178-194. And decode batches: against the
// small-batch kernel, which streams the packed groups without unpacking, from 16 rows on.

#pragma once

#if defined(QL_VNNI) && defined(__AVX512BF16__)
#define QL_GEMM 1

constexpr int kGemmMR = 4;                       // x rows per microkernel call
constexpr int kGemmNR = 2;                       // 16-row panels per call
constexpr int64_t kGemmRows = 16 * kGemmNR;      // output rows of a work item
// quant_linear hands x of this many rows or more to the GEMM: the same int8 blocks of x, in
// less time from here on (0.85B Llama shapes, weights from memory, bf16 x, 2 threads, Zen 4,
// every type: small-batch kernel / GEMM time 1.01-1.51x at 16 rows, 0.72-1.36x at 8).
constexpr int64_t kGemmMinRows = 16;

// Per weight type: H scales per 32-block (Q6_K's per 16: 2), whether a float minimum term
// (wo * sd) follows, and the offset the unsigned values carry (w = u - kOff): folded into the
// int32 accumulators' start, -kOff * (x's int sum over the scale's span), so it costs nothing.
template <int64_t QT> struct GemmType {
  static constexpr int H = QT == kQ6_K ? 2 : 1;
  static constexpr bool kMin = QT == kQ4_1 || QT == kQ5_1 || QT == kQ4_K || QT == kQ5_K;
  static constexpr int kOff = QT == kQ8_0 ? 128 : QT == kQ4_0 ? 8 : QT == kQ5_0 ? 16 : QT == kQ6_K ? 32 : 0;
};

// One work item's weight rows as panels: w [NR][K/32][8 quads][16 rows][4] u8,
// ws [NR][K/32][H][16] float32 (d, or d * scale), wo [NR][K/32][16] (the minimum, -dmin * min).
struct GemmPanels {
  std::vector<uint8_t> w;
  std::vector<float> ws, wo;
  int64_t nt = 0, hs = 1;          // 32-blocks along K; scales per 32-block
  GemmPanels(int64_t K, int64_t h)
      : w(static_cast<size_t>(kGemmRows * K)), ws(static_cast<size_t>(kGemmNR * K / 2 * h)),
        wo(static_cast<size_t>(kGemmNR * K / 2)), nt(K / 32), hs(h) {}
  uint8_t* wq(int p, int64_t t, int c, int h) { return w.data() + ((p * nt + t) * 8 + c) * 64 + h * 32; }
  float* s(int p, int64_t t, int i, int h) { return ws.data() + ((p * nt + t) * hs + i) * 16 + h * 8; }
  float* o(int p, int64_t t, int h) { return wo.data() + (p * nt + t) * 16 + h * 8; }
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
      _mm256_storeu_ps(pn.o(p, t0 + sb, h), _mm256_mul_ps(ndmin, k45_min(gb, sb)));
    }
  } else if constexpr (QT == kQ6_K) {
    for (int hh = 0; hh < 2; ++hh)
      for (int t = 0; t < 4; ++t) {           // 32-block 4hh + t
        for (int c = 0; c < 8; ++c) store32(pn.wq(p, t0 + 4 * hh + t, c, h), q6k_chunk(gb, hh, t, c));
        // scales [pair][row][2]: row r's scales of groups 2p, 2p + 1 (p = 4hh + t), int8 each
        const __m128i sp = _mm_loadu_si128(reinterpret_cast<const __m128i*>(gb + kQ6Sc + 16 * (4 * hh + t)));
        for (int i = 0; i < 2; ++i) {
          const __m128i sb = _mm_srai_epi16(i ? sp : _mm_slli_epi16(sp, 8), 8);
          _mm256_storeu_ps(pn.s(p, t0 + 4 * hh + t, i, h),
                           _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(sb))));
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
      else
        store32(pn.wq(p, t0, c, h), legacy_chunk<QT>(gb, qh, c));
    }
    _mm256_storeu_ps(pn.s(p, t0, 0, h), d);
    if constexpr (kMin) _mm256_storeu_ps(pn.o(p, t0, h), load_f16x8(gb + kOffM));
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
        _mm256_storeu_ps(pn.o(p, t, h), _mm256_setzero_ps());
      }
    }
}

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
  const uint8_t* w = pn.w.data();
  for (int64_t t = 0; t < nt; ++t) {
    for (int i = 0; i < T::H; ++i) {
      __m512i a[MR][kGemmNR];
      for (int m = 0; m < MR; ++m) {
        // x's int sum over this scale's span: Q6_K's 16 values, the legacy types' 32 (the
        // offset-free Q4_K / Q5_K read none)
        const int32_t* xs = x.s + (m0 + m) * x.ns;
        const int32_t span = T::kOff == 0 ? 0 : T::H == 2 ? xs[2 * t + i] : xs[t];
        const __m512i start = _mm512_set1_epi32(-T::kOff * span);
        for (int r = 0; r < kGemmNR; ++r) a[m][r] = start;
      }
#pragma GCC unroll 8
      for (int c = kQuads * i; c < kQuads * (i + 1); ++c) {
        __m512i wv[kGemmNR];
        for (int r = 0; r < kGemmNR; ++r) wv[r] = _mm512_loadu_si512(w + ((r * nt + t) * 8 + c) * 64);
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
          const __m512 ws = _mm512_loadu_ps(pn.ws.data() + ((r * nt + t) * T::H + i) * 16);
          f[m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[m][r]), _mm512_mul_ps(dx, ws), f[m][r]);
        }
      }
    }
    if constexpr (T::kMin)
      for (int m = 0; m < MR; ++m) {
        const __m512 sd = _mm512_set1_ps(x.sd[(m0 + m) * x.nd + t]);
        for (int r = 0; r < kGemmNR; ++r)
          f[m][r] = _mm512_fmadd_ps(_mm512_loadu_ps(pn.wo.data() + (r * nt + t) * 16), sd, f[m][r]);
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

template <int64_t QT>
void gemm_blocks(const uint8_t* packed, const XQ& x, float* yf, c10::BFloat16* yb, int64_t M,
                 int64_t N, int64_t G, int64_t nb, int64_t i0, int64_t i1) {
  GemmPanels pn(x.K, GemmType<QT>::H);
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t n0 = i * kGemmRows;
    unpack_panels<QT>(packed, G, nb, n0, pn);
    int64_t m0 = 0;
    for (; m0 + kGemmMR <= M; m0 += kGemmMR) gemm_tile<QT, kGemmMR>(x, m0, pn, yf, yb, N, n0);
    switch (M - m0) {       // the remainder (kGemmMR <= 4)
      case 3: gemm_tile<QT, 3>(x, m0, pn, yf, yb, N, n0); break;
      case 2: gemm_tile<QT, 2>(x, m0, pn, yf, yb, N, n0); break;
      case 1: gemm_tile<QT, 1>(x, m0, pn, yf, yb, N, n0); break;
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
    case kQ8_0: return gemm_blocks<kQ8_0>(packed, x, yf, yb, M, N, G, nb, i0, i1);
    case kQ4_K: return gemm_blocks<kQ4_K>(packed, x, yf, yb, M, N, G, nb, i0, i1);
    case kQ5_K: return gemm_blocks<kQ5_K>(packed, x, yf, yb, M, N, G, nb, i0, i1);
    case kQ6_K: return gemm_blocks<kQ6_K>(packed, x, yf, yb, M, N, G, nb, i0, i1);
    default: TORCH_CHECK(false, "quant_gemm: unsupported GGML type ", qt);
  }
}
#endif  // QL_VNNI && __AVX512BF16__

bool gemm_supports(int64_t qtype) {
#if defined(QL_GEMM)
  return qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ5_0 || qtype == kQ5_1 || qtype == kQ8_0 ||
         qtype == kQ4_K || qtype == kQ5_K || qtype == kQ6_K;
#else
  (void)qtype;
  return false;
#endif
}
