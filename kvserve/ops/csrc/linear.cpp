// Small-batch linear for CPU: out = x @ weight^T + bias, for the few rows of a decode step.
//
//   x       [M, K]   float32 | bfloat16, contiguous
//   weight  [N, K]   same dtype, contiguous (nn.Linear layout)
//   bias    [N]      same dtype, optional
//   out     [M, N]   same dtype; everything accumulates in float32
//
// With M small the op is a stream over the weight (N * K elements read once) and the x rows
// stay in L1, so the speed is the memory bandwidth. Each thread takes a contiguous run of
// output rows (at::parallel_for over groups of 4 weight rows); for each group it computes the
// M x 4 dot products with one register accumulator each, several weight rows at once so the
// FMA / dpbf16 chains are independent (one chain is latency-bound). bfloat16 uses
// _mm512_dpbf16_ps straight on the stored bf16 pairs (no widening); float32 uses FMA. K need
// not be a multiple of the vector width: the tail is a masked (zero-filled) load. Batches
// above 8 rows are done in chunks of 8 while the weight group is still in L1. Horizontal sums
// are done four accumulators at a time (hsums), and chunks of 3+ rows prefetch the weight.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

#define KVS_INLINE inline __attribute__((always_inline))

constexpr int64_t kGroupRows = 4;     // weight rows per work item
constexpr int64_t kMaxChunk = 8;      // x rows per pass over a weight group
// Minimum weight elements per thread's share: below this the fork/join costs more than the
// second core gains.
constexpr int64_t kMinElemsPerTask = 32768;
// Software prefetch along each weight row, this many bytes ahead, for chunks of at least
// kPrefetchMinRows x rows. Measured on a 49 MB weight, one thread: with 4-8 x rows the loop
// is dense enough that the hardware prefetcher falls behind (bf16 M=8: 11 -> 15 GB/s, f32 M=8:
// 12 -> 16 GB/s); with 1-2 rows it already keeps up and the extra instructions cost ~10%.
constexpr int64_t kPrefetchBytes = 1024;
constexpr int kPrefetchMinRows = 3;

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }

// ------------------------------------------------------------------------------------------
// Portable path: plain loops (any ISA, and bf16 without AVX512_BF16).

template <typename T, int MB, int R>
KVS_INLINE void dots_generic(const T* x, const T* w, int64_t K, float (&res)[MB][R]) {
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) {
      float acc = 0.f;
      const T* xr = x + m * K;
      const T* wr = w + r * K;
      for (int64_t k = 0; k < K; ++k) acc += to_float(xr[k]) * to_float(wr[k]);
      res[m][r] = acc;
    }
}

// ------------------------------------------------------------------------------------------
// AVX-512 paths. Accumulator (m, r) is acc[m * R + r].

#if defined(__AVX512F__)
// Horizontal sums of C accumulators, four at a time: 128-bit lanes are folded across the four
// vectors first, so four sums cost about as many shuffles as one _mm512_reduce_add_ps. With
// K = 768 a group's dot products are only 24 vector steps long, so the reductions matter.
template <int C>
KVS_INLINE void hsums(const __m512 (&acc)[C], float* res) {
  int i = 0;
  for (; i + 4 <= C; i += 4) {
    const __m512 a = acc[i], b = acc[i + 1], c = acc[i + 2], d = acc[i + 3];
    // [a0+a2, a1+a3, b0+b2, b1+b3] (128-bit lanes), likewise for c, d
    const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
    // [a, b, c, d] each folded to one 128-bit lane
    __m512 u = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
    u = _mm512_add_ps(u, _mm512_permute_ps(u, 0x4E));
    u = _mm512_add_ps(u, _mm512_permute_ps(u, 0xB1));
    alignas(64) float tmp[16];
    _mm512_store_ps(tmp, u);
    res[i] = tmp[0];
    res[i + 1] = tmp[4];
    res[i + 2] = tmp[8];
    res[i + 3] = tmp[12];
  }
  for (; i < C; ++i) res[i] = _mm512_reduce_add_ps(acc[i]);
}
#endif


#if defined(__AVX512F__)
template <int MB, int R>
KVS_INLINE void dots_avx512(const float* x, const float* w, int64_t K, float (&res)[MB][R]) {
  __m512 acc[MB * R];
  for (int i = 0; i < MB * R; ++i) acc[i] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    if constexpr (MB >= kPrefetchMinRows)
      for (int r = 0; r < R; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(w + r * K + k) + kPrefetchBytes, _MM_HINT_T0);
    __m512 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = _mm512_loadu_ps(w + r * K + k);
    for (int m = 0; m < MB; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * K + k);
      for (int r = 0; r < R; ++r) acc[m * R + r] = _mm512_fmadd_ps(xv, wv[r], acc[m * R + r]);
    }
  }
  if (k < K) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (K - k)) - 1);
    __m512 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = _mm512_maskz_loadu_ps(mask, w + r * K + k);
    for (int m = 0; m < MB; ++m) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + m * K + k);
      for (int r = 0; r < R; ++r) acc[m * R + r] = _mm512_fmadd_ps(xv, wv[r], acc[m * R + r]);
    }
  }
  hsums<MB * R>(acc, &res[0][0]);
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define KVS_HAVE_DPBF16 1
// dpbf16: lane i += a[2i] * b[2i] + a[2i+1] * b[2i+1], products exact in float32. The pairs'
// order does not matter for a dot product, so 32 stored bf16 values feed one instruction.
template <int MB, int R>
KVS_INLINE void dots_avx512(const c10::BFloat16* x, const c10::BFloat16* w, int64_t K,
                            float (&res)[MB][R]) {
  __m512 acc[MB * R];
  for (int i = 0; i < MB * R; ++i) acc[i] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    if constexpr (MB >= kPrefetchMinRows)
      for (int r = 0; r < R; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(w + r * K + k) + kPrefetchBytes, _MM_HINT_T0);
    __m512bh wv[R];
    for (int r = 0; r < R; ++r) wv[r] = (__m512bh)_mm512_loadu_si512(w + r * K + k);
    for (int m = 0; m < MB; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * K + k);
      for (int r = 0; r < R; ++r) acc[m * R + r] = _mm512_dpbf16_ps(acc[m * R + r], xv, wv[r]);
    }
  }
  if (k < K) {
    const __mmask32 mask = static_cast<__mmask32>((1ull << (K - k)) - 1);
    __m512bh wv[R];
    for (int r = 0; r < R; ++r) wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + r * K + k);
    for (int m = 0; m < MB; ++m) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * K + k);
      for (int r = 0; r < R; ++r) acc[m * R + r] = _mm512_dpbf16_ps(acc[m * R + r], xv, wv[r]);
    }
  }
  hsums<MB * R>(acc, &res[0][0]);
}
#endif

template <typename T>
constexpr bool has_vector_path() {
#if defined(KVS_HAVE_DPBF16)
  return true;
#elif defined(__AVX512F__)
  return std::is_same<T, float>::value;
#else
  return false;
#endif
}

// R weight rows [n, n + R) against x rows [0, MB): write out[m, n + r] (+ bias).
template <typename T, int MB, int R>
KVS_INLINE void rows(const T* x, const T* w, const T* bias, T* out, int64_t n, int64_t N,
                     int64_t K) {
  float res[MB][R];
  if constexpr (has_vector_path<T>()) {
#if defined(__AVX512F__)
    dots_avx512<MB, R>(x, w + n * K, K, res);
#endif
  } else {
    dots_generic<T, MB, R>(x, w + n * K, K, res);
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) {
      const float b = bias != nullptr ? to_float(bias[n + r]) : 0.f;
      out[m * N + n + r] = static_cast<T>(res[m][r] + b);
    }
}

// Weight rows [n0, n1) against an MB-row chunk of x. Up to 4 x rows: 4 weight rows at a time
// (<= 16 accumulators); 5-8 x rows: 2 at a time (<= 16), leaving registers for the loads.
template <typename T, int MB>
void chunk(const T* x, const T* w, const T* bias, T* out, int64_t n0, int64_t n1, int64_t N,
           int64_t K) {
  constexpr int R = MB <= 4 ? 4 : 2;
  int64_t n = n0;
  for (; n + R <= n1; n += R) rows<T, MB, R>(x, w, bias, out, n, N, K);
  for (; n < n1; ++n) rows<T, MB, 1>(x, w, bias, out, n, N, K);
}

template <typename T>
void run(const T* x, const T* w, const T* bias, T* out, int64_t M, int64_t N, int64_t K) {
  using ChunkFn = void (*)(const T*, const T*, const T*, T*, int64_t, int64_t, int64_t, int64_t);
  static constexpr ChunkFn kChunks[kMaxChunk] = {chunk<T, 1>, chunk<T, 2>, chunk<T, 3>,
                                                 chunk<T, 4>, chunk<T, 5>, chunk<T, 6>,
                                                 chunk<T, 7>, chunk<T, 8>};
  const int64_t groups = (N + kGroupRows - 1) / kGroupRows;
  const int64_t grain = std::max<int64_t>(1, kMinElemsPerTask / (kGroupRows * std::max<int64_t>(K, 1)));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n0 = g * kGroupRows, n1 = std::min(N, n0 + kGroupRows);
      // All x chunks against this group while its rows are in L1.
      for (int64_t m0 = 0; m0 < M; m0 += kMaxChunk) {
        const int64_t mb = std::min(kMaxChunk, M - m0);
        kChunks[mb - 1](x + m0 * K, w, bias, out + m0 * N, n0, n1, N, K);
      }
    }
  });
}

at::Tensor small_batch_linear(const at::Tensor& x, const at::Tensor& weight,
                              const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(),
              "small_batch_linear (C++): CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "x must be [M, K] and weight [N, K]");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "x and weight dtypes differ");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "x and weight must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K, "in_features mismatch: x has ", K, ", weight has ",
              weight.size(1));
  const void* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous() &&
                    bias->scalar_type() == x.scalar_type() && bias->device().is_cpu(),
                "bias must be a contiguous [N] CPU tensor of x's dtype");
    bias_ptr = bias->data_ptr();
  }
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  if (K == 0) return bias_ptr != nullptr ? out.copy_(bias->unsqueeze(0).expand({M, N}))
                                         : out.zero_();
  switch (x.scalar_type()) {
    case at::kFloat:
      run<float>(x.data_ptr<float>(), weight.data_ptr<float>(),
                 static_cast<const float*>(bias_ptr), out.data_ptr<float>(), M, N, K);
      break;
    case at::kBFloat16:
      run<c10::BFloat16>(x.data_ptr<c10::BFloat16>(), weight.data_ptr<c10::BFloat16>(),
                         static_cast<const c10::BFloat16*>(bias_ptr),
                         out.data_ptr<c10::BFloat16>(), M, N, K);
      break;
    default: TORCH_CHECK(false, "small_batch_linear: unsupported dtype ", x.scalar_type());
  }
  return out;
}

// Which vector path this build took, per dtype (logged by the Python side).
std::string isa() {
#if defined(KVS_HAVE_DPBF16)
  return "avx512 (f32 fma, bf16 dpbf16)";
#elif defined(__AVX512F__)
  return "avx512 (f32 fma, bf16 generic)";
#else
  return "generic";
#endif
}

}  // namespace

// A fragment: paged_attention.cpp owns TORCH_LIBRARY(kvserve), and a namespace may have only
// one of those per process.
TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("small_batch_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("small_batch_linear_isa() -> str", &isa);
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("small_batch_linear", &small_batch_linear); }
