// Fused elementwise CPU ops of the decoder layer, named after vLLM's custom ops:
//
//   rms_norm(x, weight, eps) -> out                       x [..., D] (rows may be strided)
//   fused_add_rms_norm(x!, residual!, weight, eps)         residual = x + residual;
//                                                          x = rms_norm(residual)  (in place)
//   rotary_embedding(positions, q!, k!, head_size, cos_cache, sin_cache)
//                                                          neox rotation of q [T, Hq*D] and
//                                                          k [T, Hk*D] in place
//   silu_and_mul(x [T, 2I]) -> [T, I]                      silu(x[:, :I]) * x[:, I:]
//   reshape_and_cache(k, v, kv_cache!, slot_mapping)       K/V [T, Hkv, D] into
//                                                          kv_cache [2, NB, BS, Hkv, D]
//
// Each replaces 2-15 torch ops (and as many temporaries) with one pass over the data. At batch
// 1 the torch ops cost more in dispatch than in arithmetic, so a kernel stays single-threaded
// below kParallelMinElems elements; above that rows are split with at::parallel_for.
//
// Numerics: float32 and bfloat16 (anything else is the Python side's torch fallback). The
// arithmetic is float32 and follows torch's reference code (kvserve/ops/fused.py) step by
// step, including where that code rounds to bfloat16 (weight * (h * rsqrt).to(bf16), the
// bf16 cos/sin tables and bf16 products of rotary, bf16 silu before the multiply): bf16
// results then equal the torch path's except where the row's sum of squares is summed in a
// different order (one bf16 ulp, rarely). float32 agrees with torch to a few float32 ulps.
//
// Vector path: AVX-512 (F + BW + VL; AVX512_BF16 for the float -> bf16 rounding where present),
// 16 lanes at a time with a masked tail, so odd sizes need no scalar loop. AVX2 (+ FMA, F16C):
// 8 lanes, the tail through a small buffer (vec_avx2.h). Everything else: plain loops.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KVS_AVX512 1
#endif
#include "vec_avx2.h"

namespace {

#define KVS_INLINE inline __attribute__((always_inline))
// The vector code of each op lives in its own (never inlined) function, called only after the
// op's entry has validated every input: no error is thrown from a frame with vector spills
// and a realigned stack (GCC 12 realigned every entry point when the loops were inlined), or
// from inside a parallel region. The bad-input tests crashed with SIGSEGV instead of raising
// on a Sapphire Rapids host (tier avx512_bf16); an error unwinds through these frames.
#define KVS_NOINLINE __attribute__((noinline))

using bf16 = c10::BFloat16;

// Below this many elements an op runs on the calling thread: the fork/join of a parallel
// region costs several microseconds, more than a batch-1 op's whole run time (benchmarks/
// fused_ops.py: 768-wide rows take ~0.1 us each).
constexpr int64_t kParallelMinElems = 32768;

inline int64_t grain_rows(int64_t elems_per_row) {
  return std::max<int64_t>(1, kParallelMinElems / std::max<int64_t>(1, elems_per_row));
}

KVS_INLINE float to_f(float v) { return v; }
KVS_INLINE float to_f(bf16 v) { return static_cast<float>(v); }
// The value a float has once stored as T (torch rounds to nearest even, as c10::BFloat16 does).
template <typename T>
KVS_INLINE float round_as(float v) { return static_cast<float>(static_cast<T>(v)); }

// ------------------------------------------------------------------------------------------
// 16-lane loads / stores as float32, for float and bf16 storage.

#if defined(KVS_AVX512)
KVS_INLINE __mmask16 tail_mask(int64_t n) { return static_cast<__mmask16>((1u << n) - 1); }

KVS_INLINE __m512 load(const float* p) { return _mm512_loadu_ps(p); }
KVS_INLINE __m512 load(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
KVS_INLINE void store(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
KVS_INLINE void store(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }

KVS_INLINE __m512 widen(__m256i h) {  // 16 bf16 -> 16 float32: the bits shifted up
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
KVS_INLINE __m256i narrow(__m512 v) {  // 16 float32 -> 16 bf16, round to nearest even
#if defined(__AVX512BF16__)
  return (__m256i)_mm512_cvtneps_pbh(v);
#else
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  // NaN -> a quiet NaN, as c10::BFloat16 does (the rounding add could carry it to infinity).
  r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
#endif
}
KVS_INLINE __m512 load(const bf16* p) {
  return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
KVS_INLINE __m512 load(const bf16* p, __mmask16 m) { return widen(_mm256_maskz_loadu_epi16(m, p)); }
KVS_INLINE void store(bf16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), narrow(v));
}
KVS_INLINE void store(bf16* p, __m512 v, __mmask16 m) { _mm256_mask_storeu_epi16(p, m, narrow(v)); }

// v rounded to T's precision and back (identity for float).
template <typename T>
KVS_INLINE __m512 vround(__m512 v) {
  if constexpr (std::is_same<T, bf16>::value) return widen(narrow(v));
  return v;
}

// exp(x) for float32: Cephes' expf polynomial after reducing x by n * ln2 (about 1 ulp), and
// scalef for the 2^n, which handles overflow (inf) and underflow (denormals, 0) itself.
KVS_INLINE __m512 vexp(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(89.f)), _mm512_set1_ps(-104.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500E-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}
#endif

// ------------------------------------------------------------------------------------------
// RMSNorm. Reference (fused.py): h = x.float(); y = (h * rsqrt(mean(h^2) + eps)).to(T);
// out = weight * y (a T multiply: rounded to T again).

// Rows of a [A, B, D] view whose last dim is contiguous: row r = (r / B, r % B).
struct Rows {
  int64_t B, s0, s1;
  KVS_INLINE int64_t offset(int64_t r) const { return (r / B) * s0 + (r % B) * s1; }
};

inline Rows rows_of(const at::Tensor& t) {
  if (t.dim() == 1) return {1, 0, 0};
  if (t.dim() == 2) return {1, t.stride(0), 0};
  return {t.size(1), t.stride(0), t.stride(1)};
}

template <typename T>
KVS_INLINE float sum_squares(const T* x, int64_t D) {
#if defined(KVS_AVX512)
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= D; i += 32) {
    const __m512 u = load(x + i), v = load(x + i + 16);
    a0 = _mm512_fmadd_ps(u, u, a0);
    a1 = _mm512_fmadd_ps(v, v, a1);
  }
  for (; i + 16 <= D; i += 16) {
    const __m512 u = load(x + i);
    a0 = _mm512_fmadd_ps(u, u, a0);
  }
  if (i < D) {
    const __m512 u = load(x + i, tail_mask(D - i));
    a1 = _mm512_fmadd_ps(u, u, a1);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
#elif defined(KVS_AVX2)
  using namespace kvs_avx2;
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= D; i += 16) {
    const __m256 u = load8(x + i), v = load8(x + i + 8);
    a0 = _mm256_fmadd_ps(u, u, a0);
    a1 = _mm256_fmadd_ps(v, v, a1);
  }
  for (; i < D; i += 8) {
    const __m256 u = i + 8 <= D ? load8(x + i) : load8(x + i, D - i);
    a0 = _mm256_fmadd_ps(u, u, a0);
  }
  return hsum8(_mm256_add_ps(a0, a1));
#else
  float acc = 0.f;
  for (int64_t i = 0; i < D; ++i) acc += to_f(x[i]) * to_f(x[i]);
  return acc;
#endif
}

// out[i] = w[i] * round_T(x[i] * inv), rounded to T.
template <typename T>
KVS_INLINE void scale_row(const T* x, const T* w, T* out, int64_t D, float inv) {
#if defined(KVS_AVX512)
  const __m512 s = _mm512_set1_ps(inv);
  int64_t i = 0;
  for (; i + 16 <= D; i += 16)
    store(out + i, _mm512_mul_ps(load(w + i), vround<T>(_mm512_mul_ps(load(x + i), s))));
  if (i < D) {
    const __mmask16 m = tail_mask(D - i);
    store(out + i, _mm512_mul_ps(load(w + i, m), vround<T>(_mm512_mul_ps(load(x + i, m), s))), m);
  }
#elif defined(KVS_AVX2)
  using namespace kvs_avx2;
  const __m256 s = _mm256_set1_ps(inv);
  int64_t i = 0;
  for (; i + 8 <= D; i += 8)
    store8(out + i, _mm256_mul_ps(load8(w + i), round8<T>(_mm256_mul_ps(load8(x + i), s))));
  if (i < D) {
    const int64_t n = D - i;
    store8(out + i, _mm256_mul_ps(load8(w + i, n), round8<T>(_mm256_mul_ps(load8(x + i, n), s))), n);
  }
#else
  for (int64_t i = 0; i < D; ++i) out[i] = static_cast<T>(to_f(w[i]) * round_as<T>(to_f(x[i]) * inv));
#endif
}

// r[i] = round_T(x[i] + r[i]); returns the sum of squares of the rounded sums.
template <typename T>
KVS_INLINE float add_rows(const T* x, T* r, int64_t D) {
#if defined(KVS_AVX512)
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= D; i += 32) {
    const __m512 u = vround<T>(_mm512_add_ps(load(x + i), load(r + i)));
    const __m512 v = vround<T>(_mm512_add_ps(load(x + i + 16), load(r + i + 16)));
    store(r + i, u);
    store(r + i + 16, v);
    a0 = _mm512_fmadd_ps(u, u, a0);
    a1 = _mm512_fmadd_ps(v, v, a1);
  }
  for (; i + 16 <= D; i += 16) {
    const __m512 u = vround<T>(_mm512_add_ps(load(x + i), load(r + i)));
    store(r + i, u);
    a0 = _mm512_fmadd_ps(u, u, a0);
  }
  if (i < D) {
    const __mmask16 m = tail_mask(D - i);
    const __m512 u = vround<T>(_mm512_add_ps(load(x + i, m), load(r + i, m)));
    store(r + i, u, m);
    a1 = _mm512_fmadd_ps(u, u, a1);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
#elif defined(KVS_AVX2)
  using namespace kvs_avx2;
  __m256 a0 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= D; i += 8) {
    const __m256 u = round8<T>(_mm256_add_ps(load8(x + i), load8(r + i)));
    store8(r + i, u);
    a0 = _mm256_fmadd_ps(u, u, a0);
  }
  if (i < D) {
    const int64_t n = D - i;
    const __m256 u = round8<T>(_mm256_add_ps(load8(x + i, n), load8(r + i, n)));
    store8(r + i, u, n);
    a0 = _mm256_fmadd_ps(u, u, a0);
  }
  return hsum8(a0);
#else
  float acc = 0.f;
  for (int64_t i = 0; i < D; ++i) {
    const float s = round_as<T>(to_f(x[i]) + to_f(r[i]));
    r[i] = static_cast<T>(s);
    acc += s * s;
  }
  return acc;
#endif
}

KVS_INLINE float inv_rms(float sum_sq, int64_t D, float eps) {
  return 1.f / std::sqrt(sum_sq / static_cast<float>(D) + eps);
}

template <typename T>
KVS_NOINLINE void rms_norm_impl(const at::Tensor& x, const at::Tensor& w, at::Tensor& out, double eps) {
  const int64_t D = x.size(-1), N = x.numel() / D;
  const Rows xr = rows_of(x);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, N, grain_rows(D), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* row = xp + xr.offset(r);
      scale_row<T>(row, wp, op + r * D, D, inv_rms(sum_squares<T>(row, D), D, e));
    }
  });
}

template <typename T>
KVS_NOINLINE void fused_add_rms_norm_impl(at::Tensor& x, at::Tensor& res, const at::Tensor& w, double eps) {
  const int64_t D = x.size(-1), N = x.numel() / D;
  const Rows xr = rows_of(x), rr = rows_of(res);
  T* xp = x.data_ptr<T>();
  T* rp = res.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, N, grain_rows(D), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      T* xrow = xp + xr.offset(r);
      T* rrow = rp + rr.offset(r);
      const float ss = add_rows<T>(xrow, rrow, D);
      scale_row<T>(rrow, wp, xrow, D, inv_rms(ss, D, e));
    }
  });
}

// A 1-3-D tensor whose rows (last dim) are contiguous can be used in place; anything else is
// copied first.
inline bool rows_usable(const at::Tensor& t) {
  return t.dim() >= 1 && t.dim() <= 3 && t.stride(-1) == 1;
}

void check_norm_args(const char* op, const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), op, " (C++): CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": float32 or bfloat16 only, got ", x.scalar_type());
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), op, ": weight dtype ", w.scalar_type(),
              " differs from the input's ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, op, ": input must have a non-empty last dim");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(-1), op, ": weight must be [",
              x.size(-1), "], got ", w.sizes());
}

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& w_in, double eps) {
  check_norm_args("rms_norm", x_in, w_in);
  const at::Tensor x = rows_usable(x_in) ? x_in : x_in.contiguous();
  const at::Tensor w = w_in.contiguous();
  at::Tensor out = at::empty(x_in.sizes(), x_in.options());
  if (out.numel() == 0) return out;
  if (x.scalar_type() == at::kFloat) rms_norm_impl<float>(x, w, out, eps);
  else rms_norm_impl<bf16>(x, w, out, eps);
  return out;
}

void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& w_in, double eps) {
  check_norm_args("fused_add_rms_norm", x, w_in);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() &&
                  residual.device().is_cpu(),
              "fused_add_rms_norm: residual must match the input (", x.sizes(), " ",
              x.scalar_type(), "), got ", residual.sizes(), " ", residual.scalar_type());
  if (x.numel() == 0) return;
  const at::Tensor w = w_in.contiguous();
  // Both are written in place; odd layouts go through contiguous copies.
  at::Tensor xc = rows_usable(x) ? x : x.contiguous();
  at::Tensor rc = rows_usable(residual) ? residual : residual.contiguous();
  if (x.scalar_type() == at::kFloat) fused_add_rms_norm_impl<float>(xc, rc, w, eps);
  else fused_add_rms_norm_impl<bf16>(xc, rc, w, eps);
  if (!xc.is_same(x)) x.copy_(xc);
  if (!rc.is_same(residual)) residual.copy_(rc);
}

// ------------------------------------------------------------------------------------------
// Rotary embedding, neox style. Per head, with the halves x1 = x[:D/2], x2 = x[D/2:] and
// c, s = cos/sin_cache[pos] (float32, rounded to T as the reference does: .to(q.dtype)):
//   x1' = x1 * c - x2 * s,   x2' = x2 * c + x1 * s   (each product and sum rounded to T).

template <typename T>
KVS_INLINE void rotate_head(T* x, const float* cos, const float* sin, int64_t half) {
  T* x2p = x + half;
#if defined(KVS_AVX512)
  int64_t i = 0;
  auto step = [&](int64_t j, __mmask16 m) {
    const __m512 c = vround<T>(_mm512_maskz_loadu_ps(m, cos + j));
    const __m512 s = vround<T>(_mm512_maskz_loadu_ps(m, sin + j));
    const __m512 x1 = load(x + j, m), x2 = load(x2p + j, m);
    const __m512 o1 = _mm512_sub_ps(vround<T>(_mm512_mul_ps(x1, c)), vround<T>(_mm512_mul_ps(x2, s)));
    const __m512 o2 = _mm512_add_ps(vround<T>(_mm512_mul_ps(x2, c)), vround<T>(_mm512_mul_ps(x1, s)));
    store(x + j, o1, m);
    store(x2p + j, o2, m);
  };
  for (; i + 16 <= half; i += 16) step(i, static_cast<__mmask16>(0xFFFF));
  if (i < half) step(i, tail_mask(half - i));
#elif defined(KVS_AVX2)
  using namespace kvs_avx2;
  auto step = [&](int64_t j, int64_t n) {  // n < 8: a partial tail
    const bool full = n == 8;
    const __m256 c = round8<T>(full ? load8(cos + j) : load8(cos + j, n));
    const __m256 s = round8<T>(full ? load8(sin + j) : load8(sin + j, n));
    const __m256 x1 = full ? load8(x + j) : load8(x + j, n);
    const __m256 x2 = full ? load8(x2p + j) : load8(x2p + j, n);
    const __m256 o1 = _mm256_sub_ps(round8<T>(_mm256_mul_ps(x1, c)), round8<T>(_mm256_mul_ps(x2, s)));
    const __m256 o2 = _mm256_add_ps(round8<T>(_mm256_mul_ps(x2, c)), round8<T>(_mm256_mul_ps(x1, s)));
    if (full) {
      store8(x + j, o1);
      store8(x2p + j, o2);
    } else {
      store8(x + j, o1, n);
      store8(x2p + j, o2, n);
    }
  };
  int64_t i = 0;
  for (; i + 8 <= half; i += 8) step(i, 8);
  if (i < half) step(i, half - i);
#else
  for (int64_t i = 0; i < half; ++i) {
    const float c = round_as<T>(cos[i]), s = round_as<T>(sin[i]);
    const float x1 = to_f(x[i]), x2 = to_f(x2p[i]);
    const float o1 = round_as<T>(x1 * c) - round_as<T>(x2 * s);
    const float o2 = round_as<T>(x2 * c) + round_as<T>(x1 * s);
    x[i] = static_cast<T>(o1);
    x2p[i] = static_cast<T>(o2);
  }
#endif
}

// A [T, H*D] or [T, H, D] tensor as per-token / per-head strides (last dim contiguous).
struct Heads {
  int64_t H, st, sh;
};

inline Heads heads_of(const at::Tensor& t, int64_t D, const char* name) {
  TORCH_CHECK(t.dim() == 2 || t.dim() == 3, "rotary_embedding: ", name,
              " must be [T, H*D] or [T, H, D], got ", t.sizes());
  if (t.dim() == 2) {
    TORCH_CHECK(t.size(1) % D == 0, "rotary_embedding: ", name, "'s last dim ", t.size(1),
                " is not a multiple of head_size ", D);
    return {t.size(1) / D, t.stride(0), D};
  }
  TORCH_CHECK(t.size(2) == D, "rotary_embedding: ", name, "'s head dim ", t.size(2),
              " is not head_size ", D);
  return {t.size(1), t.stride(0), t.stride(1)};
}

template <typename T>
KVS_NOINLINE void rotary_impl(const int64_t* pos, at::Tensor& q, at::Tensor& k, int64_t D,
                 const float* cos, const float* sin) {
  const int64_t T_ = q.size(0), half = D / 2;
  const Heads hq = heads_of(q, D, "query"), hk = heads_of(k, D, "key");
  T* qp = q.data_ptr<T>();
  T* kp = k.data_ptr<T>();
  at::parallel_for(0, T_, grain_rows((hq.H + hk.H) * D), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* c = cos + pos[t] * half;
      const float* s = sin + pos[t] * half;
      for (int64_t h = 0; h < hq.H; ++h) rotate_head<T>(qp + t * hq.st + h * hq.sh, c, s, half);
      for (int64_t h = 0; h < hk.H; ++h) rotate_head<T>(kp + t * hk.st + h * hk.sh, c, s, half);
    }
  });
}

void rotary_embedding(const at::Tensor& positions_in, at::Tensor& query, at::Tensor& key,
                      int64_t head_size, const at::Tensor& cos_in, const at::Tensor& sin_in) {
  TORCH_CHECK(query.device().is_cpu() && key.device().is_cpu() && positions_in.device().is_cpu() &&
                  cos_in.device().is_cpu() && sin_in.device().is_cpu(),
              "rotary_embedding (C++): CPU tensors only");
  TORCH_CHECK(query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16,
              "rotary_embedding: float32 or bfloat16 only, got ", query.scalar_type());
  TORCH_CHECK(key.scalar_type() == query.scalar_type(), "rotary_embedding: query and key dtypes differ");
  TORCH_CHECK(head_size > 0 && head_size % 2 == 0, "rotary_embedding: head_size must be even, got ",
              head_size);
  const int64_t half = head_size / 2;
  TORCH_CHECK(cos_in.scalar_type() == at::kFloat && sin_in.scalar_type() == at::kFloat &&
                  cos_in.dim() == 2 && cos_in.size(1) == half && sin_in.sizes() == cos_in.sizes(),
              "rotary_embedding: cos/sin caches must be float32 [max_position, ", half, "], got ",
              cos_in.sizes(), " ", cos_in.scalar_type());
  TORCH_CHECK(positions_in.dim() == 1 && positions_in.size(0) == query.size(0) &&
                  key.size(0) == query.size(0),
              "rotary_embedding: positions [T], query [T, ...] and key [T, ...] disagree on T: ",
              positions_in.sizes(), ", ", query.sizes(), ", ", key.sizes());
  const int64_t T_ = query.size(0);
  if (T_ == 0) return;
  const at::Tensor positions = positions_in.to(at::kLong).contiguous();
  const at::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t max_pos = cos.size(0);
  for (int64_t t = 0; t < T_; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "rotary_embedding: position ", pos[t],
                " outside the cos/sin cache [0, ", max_pos, ")");
  at::Tensor qc = query.stride(-1) == 1 ? query : query.contiguous();
  at::Tensor kc = key.stride(-1) == 1 ? key : key.contiguous();
  if (query.scalar_type() == at::kFloat)
    rotary_impl<float>(pos, qc, kc, head_size, cos.data_ptr<float>(), sin.data_ptr<float>());
  else
    rotary_impl<bf16>(pos, qc, kc, head_size, cos.data_ptr<float>(), sin.data_ptr<float>());
  if (!qc.is_same(query)) query.copy_(qc);
  if (!kc.is_same(key)) key.copy_(kc);
}

// ------------------------------------------------------------------------------------------
// SiLU and multiply. Reference: F.silu(gate) * up, silu(g) = g / (1 + exp(-g)) in float32,
// rounded to T, then a T multiply.

template <typename T>
KVS_INLINE void silu_mul_row(const T* g, const T* u, T* out, int64_t I) {
#if defined(KVS_AVX512)
  const __m512 one = _mm512_set1_ps(1.f);
  auto step = [&](int64_t j, __mmask16 m) {
    const __m512 x = load(g + j, m);
    const __m512 silu = vround<T>(_mm512_div_ps(x, _mm512_add_ps(one, vexp(_mm512_sub_ps(_mm512_setzero_ps(), x)))));
    store(out + j, _mm512_mul_ps(silu, load(u + j, m)), m);
  };
  int64_t i = 0;
  for (; i + 16 <= I; i += 16) step(i, static_cast<__mmask16>(0xFFFF));
  if (i < I) step(i, tail_mask(I - i));
#elif defined(KVS_AVX2)
  using namespace kvs_avx2;
  const __m256 one = _mm256_set1_ps(1.f);
  auto silu = [&](__m256 x) {
    return round8<T>(_mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x)))));
  };
  int64_t i = 0;
  for (; i + 8 <= I; i += 8) store8(out + i, _mm256_mul_ps(silu(load8(g + i)), load8(u + i)));
  if (i < I) {
    const int64_t n = I - i;
    store8(out + i, _mm256_mul_ps(silu(load8(g + i, n)), load8(u + i, n)), n);
  }
#else
  for (int64_t i = 0; i < I; ++i) {
    const float x = to_f(g[i]);
    out[i] = static_cast<T>(round_as<T>(x / (1.f + std::exp(-x))) * to_f(u[i]));
  }
#endif
}

template <typename T>
KVS_NOINLINE void silu_and_mul_impl(const at::Tensor& x, at::Tensor& out) {
  const int64_t I = out.size(-1), N = out.numel() / std::max<int64_t>(I, 1);
  const int64_t sx = x.dim() == 1 ? 0 : x.stride(0);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, N, grain_rows(3 * I), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) silu_mul_row<T>(xp + r * sx, xp + r * sx + I, op + r * I, I);
  });
}

at::Tensor silu_and_mul(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.device().is_cpu(), "silu_and_mul (C++): CPU tensors only");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16,
              "silu_and_mul: float32 or bfloat16 only, got ", x_in.scalar_type());
  TORCH_CHECK(x_in.dim() >= 1 && x_in.size(-1) % 2 == 0,
              "silu_and_mul: the last dim must be even (gate | up), got ", x_in.sizes());
  const bool flat_rows = x_in.dim() <= 2 && x_in.stride(-1) == 1;
  const at::Tensor x = flat_rows ? x_in : x_in.contiguous().view({-1, x_in.size(-1)});
  auto sizes = x_in.sizes().vec();
  sizes.back() /= 2;
  at::Tensor out = at::empty(sizes, x_in.options());
  if (out.numel() == 0) return out;
  if (x.scalar_type() == at::kFloat) silu_and_mul_impl<float>(x, out);
  else silu_and_mul_impl<bf16>(x, out);
  return out;
}

// ------------------------------------------------------------------------------------------
// reshape_and_cache: kv_cache[0 / 1, slot / BS, slot % BS] = k[t] / v[t] for slot =
// slot_mapping[t]. Every slot is checked before anything is written.

template <typename T>
KVS_NOINLINE void cache_impl(const at::Tensor& k, const at::Tensor& v, at::Tensor& cache, const int64_t* slots,
                int64_t T_) {
  const int64_t H = k.size(1), D = k.size(2), BS = cache.size(2);
  const int64_t sc0 = cache.stride(0), sc1 = cache.stride(1), sc2 = cache.stride(2),
                sc3 = cache.stride(3);
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* cp = cache.data_ptr<T>();
  const int64_t sk0 = k.stride(0), sk1 = k.stride(1), sv0 = v.stride(0), sv1 = v.stride(1);
  at::parallel_for(0, T_, grain_rows(2 * H * D), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      T* dst = cp + (slots[t] / BS) * sc1 + (slots[t] % BS) * sc2;
      const T* ks = kp + t * sk0;
      const T* vs = vp + t * sv0;
      if (sk1 == D && sv1 == D && sc3 == D) {  // heads packed: one copy per row
        std::memcpy(dst, ks, H * D * sizeof(T));
        std::memcpy(dst + sc0, vs, H * D * sizeof(T));
      } else {
        for (int64_t h = 0; h < H; ++h) {
          std::memcpy(dst + h * sc3, ks + h * sk1, D * sizeof(T));
          std::memcpy(dst + sc0 + h * sc3, vs + h * sv1, D * sizeof(T));
        }
      }
    }
  });
}

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                       const at::Tensor& slot_mapping_in) {
  TORCH_CHECK(key.device().is_cpu() && value.device().is_cpu() && kv_cache.device().is_cpu() &&
                  slot_mapping_in.device().is_cpu(),
              "reshape_and_cache (C++): CPU tensors only");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2,
              "reshape_and_cache: kv_cache must be [2, num_blocks, block_size, num_kv_heads, "
              "head_dim], got ", kv_cache.sizes());
  TORCH_CHECK(kv_cache.scalar_type() == at::kFloat || kv_cache.scalar_type() == at::kBFloat16,
              "reshape_and_cache: float32 or bfloat16 cache only, got ", kv_cache.scalar_type());
  TORCH_CHECK(kv_cache.stride(4) == 1, "reshape_and_cache: kv_cache's last dim must be contiguous");
  const int64_t NB = kv_cache.size(1), BS = kv_cache.size(2), H = kv_cache.size(3),
                D = kv_cache.size(4);
  TORCH_CHECK(key.dim() == 3 && key.size(1) == H && key.size(2) == D && value.sizes() == key.sizes(),
              "reshape_and_cache: key and value must be [T, ", H, ", ", D, "], got ", key.sizes(),
              " and ", value.sizes());
  TORCH_CHECK(slot_mapping_in.dim() == 1 && slot_mapping_in.size(0) == key.size(0),
              "reshape_and_cache: slot_mapping must be [T] with T = ", key.size(0), ", got ",
              slot_mapping_in.sizes());
  const int64_t T_ = key.size(0);
  if (T_ == 0) return;
  const at::Tensor slot_mapping = slot_mapping_in.to(at::kLong).contiguous();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T_; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < NB * BS, "reshape_and_cache: slot ", slots[t],
                " (token ", t, ") outside the cache's ", NB * BS, " slots");
  // K/V in the cache's dtype (as the reference's .to(kv_cache.dtype)), head rows contiguous.
  auto prep = [&](const at::Tensor& t) {
    at::Tensor c = t.scalar_type() == kv_cache.scalar_type() ? t : t.to(kv_cache.scalar_type());
    return c.stride(2) == 1 ? c : c.contiguous();
  };
  const at::Tensor k = prep(key), v = prep(value);
  if (kv_cache.scalar_type() == at::kFloat) cache_impl<float>(k, v, kv_cache, slots, T_);
  else cache_impl<bf16>(k, v, kv_cache, slots, T_);
}

// Which vector path this build took (logged by the Python side).
std::string isa() {
#if defined(KVS_AVX512) && defined(__AVX512BF16__)
  return "avx512 (bf16 rounding: avx512_bf16)";
#elif defined(KVS_AVX512)
  return "avx512";
#elif defined(KVS_AVX2)
  return "avx2 (fma, f16c)";
#else
  return "generic";
#endif
}

}  // namespace

// A fragment: paged_attention.cpp owns TORCH_LIBRARY(kvserve).
TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("rms_norm(Tensor input, Tensor weight, float epsilon) -> Tensor");
  m.def("fused_add_rms_norm(Tensor(a!) input, Tensor(b!) residual, Tensor weight, "
        "float epsilon) -> ()");
  m.def("rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!) key, int head_size, "
        "Tensor cos_cache, Tensor sin_cache) -> ()");
  m.def("silu_and_mul(Tensor input) -> Tensor");
  m.def("reshape_and_cache(Tensor key, Tensor value, Tensor(a!) kv_cache, "
        "Tensor slot_mapping) -> ()");
  m.def("fused_isa() -> str", &isa);
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("reshape_and_cache", &reshape_and_cache);
}
