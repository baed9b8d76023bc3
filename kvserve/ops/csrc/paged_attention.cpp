// Paged decode attention for CPU: one query token per sequence against its paged KV cache.
//
//   q          [N, H, D]                 float32 | bfloat16
//   kv_cache   [2, NB, BS, Hkv, D]       same dtype as q; K = kv_cache[0], V = kv_cache[1]
//   block_tables [N, MB] int64 (padded; only the first ceil(seq_len / BS) entries are read)
//   seq_lens   [N] int64
//   out        [N, H, D]
//
// Work item = (kv head, sequence). The G = H / Hkv query heads sharing a kv head are handled
// together so every K/V row is loaded once, straight from its block (no gather copy). One pass
// over the blocks with an online softmax (running max m, running sum l, flash-decoding style);
// everything accumulates in float32. Slots past seq_len and padded table entries are never read,
// so whatever they hold (stale values, NaN) cannot reach the result.
//
// Items are ordered kv-head-major so that at::parallel_for's contiguous split gives every thread
// the same kv heads of *all* sequences: the load is balanced however ragged seq_lens are.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

struct Params {
  const void* q;
  void* out;
  const void* k;
  const void* v;
  const int64_t* block_tables;
  const int64_t* seq_lens;
  int64_t num_kv_heads, groups, head_dim, block_size, num_blocks;
  int64_t q_stride_n, q_stride_h, out_stride_n, out_stride_h;
  int64_t kv_stride_block, kv_stride_token, kv_stride_head;  // same for K and V
  int64_t table_stride;
  float scale;
};

// Per-thread scratch, allocated once per parallel chunk.
struct Scratch {
  std::vector<float> q, acc, s, m, l;
  Scratch(int64_t G, int64_t D, int64_t BS) : q(G * D), acc(G * D), s(G * BS), m(G), l(G) {}
};

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

template <typename T>
inline T from_float(float x) { return static_cast<T>(x); }

// Loads q (pre-scaled) and resets the softmax state for the G heads of one work item.
template <typename T>
inline void init_item(const Params& P, int64_t n, int64_t kh, Scratch& sc) {
  const int64_t G = P.groups, D = P.head_dim;
  const T* q = static_cast<const T*>(P.q) + n * P.q_stride_n + kh * G * P.q_stride_h;
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) sc.q[g * D + d] = to_float(q[g * P.q_stride_h + d]) * P.scale;
  std::fill(sc.acc.begin(), sc.acc.end(), 0.f);
  std::fill(sc.m.begin(), sc.m.end(), -std::numeric_limits<float>::infinity());
  std::fill(sc.l.begin(), sc.l.end(), 0.f);
}

template <typename T>
inline void finish_item(const Params& P, int64_t n, int64_t kh, int64_t len, Scratch& sc) {
  const int64_t G = P.groups, D = P.head_dim;
  T* out = static_cast<T*>(P.out) + n * P.out_stride_n + kh * G * P.out_stride_h;
  for (int64_t g = 0; g < G; ++g) {
    // An empty sequence (never scheduled for decode) gives zeros rather than 0/0.
    const float inv = len > 0 ? 1.f / sc.l[g] : 0.f;
    for (int64_t d = 0; d < D; ++d) out[g * P.out_stride_h + d] = from_float<T>(sc.acc[g * D + d] * inv);
  }
}

inline int64_t checked_block(const Params& P, int64_t n, int64_t b) {
  const int64_t blk = P.block_tables[n * P.table_stride + b];
  TORCH_CHECK(blk >= 0 && blk < P.num_blocks, "paged_decode_attention: block id ", blk,
              " out of range [0, ", P.num_blocks, ") for sequence ", n);
  return blk;
}

// ------------------------------------------------------------------------------------------
// Portable path (any head_dim, any ISA): plain loops the compiler may vectorise.

template <typename T>
void attend_generic(const Params& P, int64_t n, int64_t kh, Scratch& sc) {
  const int64_t G = P.groups, D = P.head_dim, BS = P.block_size;
  const int64_t len = P.seq_lens[n];
  init_item<T>(P, n, kh, sc);
  const T* K = static_cast<const T*>(P.k);
  const T* V = static_cast<const T*>(P.v);
  for (int64_t start = 0; start < len; start += BS) {
    const int64_t blk = checked_block(P, n, start / BS);
    const int64_t ntok = std::min(BS, len - start);
    const int64_t base = blk * P.kv_stride_block + kh * P.kv_stride_head;
    for (int64_t j = 0; j < ntok; ++j) {
      const T* kr = K + base + j * P.kv_stride_token;
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = sc.q.data() + g * D;
        float dot = 0.f;
        for (int64_t d = 0; d < D; ++d) dot += qg[d] * to_float(kr[d]);
        sc.s[g * BS + j] = dot;
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      float* sg = sc.s.data() + g * BS;
      float mx = sc.m[g];
      for (int64_t j = 0; j < ntok; ++j) mx = std::max(mx, sg[j]);
      const float alpha = std::exp(sc.m[g] - mx);  // exp(-inf) = 0 on the first block
      sc.m[g] = mx;
      float sum = 0.f;
      for (int64_t j = 0; j < ntok; ++j) {
        sg[j] = std::exp(sg[j] - mx);
        sum += sg[j];
      }
      sc.l[g] = sc.l[g] * alpha + sum;
      float* ag = sc.acc.data() + g * D;
      if (alpha != 1.f)
        for (int64_t d = 0; d < D; ++d) ag[d] *= alpha;
    }
    for (int64_t j = 0; j < ntok; ++j) {
      const T* vr = V + base + j * P.kv_stride_token;
      for (int64_t g = 0; g < G; ++g) {
        const float p = sc.s[g * BS + j];
        float* ag = sc.acc.data() + g * D;
        for (int64_t d = 0; d < D; ++d) ag[d] += p * to_float(vr[d]);
      }
    }
  }
  finish_item<T>(P, n, kh, len, sc);
}

// ------------------------------------------------------------------------------------------
// AVX-512 path: head_dim = 16 * NV, a K/V row lives in NV registers.

#if defined(__AVX512F__)

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  // bfloat16 -> float32 is a 16-bit left shift of the widened bits.
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// exp(x) for x <= 0 (softmax arguments): 2^n * P(r), x = n ln2 + r, |r| <= ln2/2, degree-6
// Taylor polynomial (relative error ~2e-7). Arguments below -100 are clamped (result ~0).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-100.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

inline __mmask16 tail_mask(int64_t remaining) {
  return remaining >= 16 ? static_cast<__mmask16>(0xFFFF)
                         : static_cast<__mmask16>((1u << remaining) - 1u);
}

// Blocks are scattered and a kv head's rows inside one are strided (Hkv * D apart), so the
// hardware prefetchers do not follow them: fetch the next block's rows while this one computes.
template <typename T>
inline void prefetch_rows(const T* p, int64_t rows, int64_t stride, int64_t row_bytes) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t off = 0; off < row_bytes; off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(p + r * stride) + off, _MM_HINT_T0);
}

template <typename T, int NV>
void attend_avx512(const Params& P, int64_t n, int64_t kh, Scratch& sc) {
  constexpr int64_t D = 16 * NV;
  const int64_t G = P.groups, BS = P.block_size;
  const int64_t len = P.seq_lens[n];
  init_item<T>(P, n, kh, sc);
  const T* K = static_cast<const T*>(P.k);
  const T* V = static_cast<const T*>(P.v);
  float* const qf = sc.q.data();
  float* const acc = sc.acc.data();
  float* const s = sc.s.data();
  for (int64_t start = 0; start < len; start += BS) {
    const int64_t blk = checked_block(P, n, start / BS);
    const int64_t ntok = std::min(BS, len - start);
    const int64_t base = blk * P.kv_stride_block + kh * P.kv_stride_head;
    if (start + BS < len) {
      const int64_t next = checked_block(P, n, start / BS + 1) * P.kv_stride_block +
                           kh * P.kv_stride_head;
      const int64_t rows = std::min(BS, len - start - BS);
      prefetch_rows(K + next, rows, P.kv_stride_token, D * sizeof(T));
      prefetch_rows(V + next, rows, P.kv_stride_token, D * sizeof(T));
    }
    // Scores s[g, j] = q_g . k_j (q pre-scaled).
    for (int64_t j = 0; j < ntok; ++j) {
      const T* kr = K + base + j * P.kv_stride_token;
      __m512 kv[NV];
      for (int c = 0; c < NV; ++c) kv[c] = load16(kr + 16 * c);
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = qf + g * D;
        __m512 a = _mm512_mul_ps(kv[0], _mm512_loadu_ps(qg));
        for (int c = 1; c < NV; ++c) a = _mm512_fmadd_ps(kv[c], _mm512_loadu_ps(qg + 16 * c), a);
        s[g * BS + j] = _mm512_reduce_add_ps(a);
      }
    }
    // Online softmax update: new running max, rescale what was accumulated, p = exp(s - m).
    for (int64_t g = 0; g < G; ++g) {
      float* sg = s + g * BS;
      __m512 vmax = _mm512_set1_ps(sc.m[g]);
      for (int64_t j = 0; j < ntok; j += 16)
        vmax = _mm512_mask_max_ps(vmax, tail_mask(ntok - j), vmax,
                                  _mm512_maskz_loadu_ps(tail_mask(ntok - j), sg + j));
      const float mx = _mm512_reduce_max_ps(vmax);
      const float alpha = std::exp(sc.m[g] - mx);  // exp(-inf) = 0 on the first block
      sc.m[g] = mx;
      const __m512 vmx = _mm512_set1_ps(mx);
      __m512 vsum = _mm512_setzero_ps();
      for (int64_t j = 0; j < ntok; j += 16) {
        const __mmask16 mk = tail_mask(ntok - j);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, sg + j), vmx));
        _mm512_mask_storeu_ps(sg + j, mk, e);
        vsum = _mm512_mask_add_ps(vsum, mk, vsum, e);
      }
      sc.l[g] = sc.l[g] * alpha + _mm512_reduce_add_ps(vsum);
      if (alpha != 1.f) {
        const __m512 va = _mm512_set1_ps(alpha);
        float* ag = acc + g * D;
        for (int c = 0; c < NV; ++c)
          _mm512_storeu_ps(ag + 16 * c, _mm512_mul_ps(va, _mm512_loadu_ps(ag + 16 * c)));
      }
    }
    // acc[g] += sum_j p[g, j] * v_j
    if (G == 1) {
      // MHA: keep the accumulator in registers across the block.
      __m512 av[NV];
      for (int c = 0; c < NV; ++c) av[c] = _mm512_loadu_ps(acc + 16 * c);
      for (int64_t j = 0; j < ntok; ++j) {
        const T* vr = V + base + j * P.kv_stride_token;
        const __m512 pj = _mm512_set1_ps(s[j]);
        for (int c = 0; c < NV; ++c) av[c] = _mm512_fmadd_ps(pj, load16(vr + 16 * c), av[c]);
      }
      for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc + 16 * c, av[c]);
    } else {
      for (int64_t j = 0; j < ntok; ++j) {
        const T* vr = V + base + j * P.kv_stride_token;
        __m512 vv[NV];
        for (int c = 0; c < NV; ++c) vv[c] = load16(vr + 16 * c);
        for (int64_t g = 0; g < G; ++g) {
          const __m512 pj = _mm512_set1_ps(s[g * BS + j]);
          float* ag = acc + g * D;
          for (int c = 0; c < NV; ++c)
            _mm512_storeu_ps(ag + 16 * c, _mm512_fmadd_ps(pj, vv[c], _mm512_loadu_ps(ag + 16 * c)));
        }
      }
    }
  }
  finish_item<T>(P, n, kh, len, sc);
}

#endif  // __AVX512F__

template <typename T>
using ItemFn = void (*)(const Params&, int64_t, int64_t, Scratch&);

template <typename T>
ItemFn<T> pick_kernel(int64_t head_dim) {
#if defined(__AVX512F__)
  switch (head_dim) {
    case 32: return &attend_avx512<T, 2>;
    case 64: return &attend_avx512<T, 4>;
    case 128: return &attend_avx512<T, 8>;
    case 256: return &attend_avx512<T, 16>;
    default: break;
  }
#endif
  return &attend_generic<T>;
}

template <typename T>
void run(const Params& P, int64_t num_seqs) {
  const ItemFn<T> fn = pick_kernel<T>(P.head_dim);
  const int64_t items = P.num_kv_heads * num_seqs;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    Scratch sc(P.groups, P.head_dim, P.block_size);
    for (int64_t i = begin; i < end; ++i) fn(P, i % num_seqs, i / num_seqs, sc);
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q_in, const at::Tensor& kv_cache,
                                  const at::Tensor& block_tables_in, const at::Tensor& seq_lens_in,
                                  double scale) {
  TORCH_CHECK(q_in.device().is_cpu() && kv_cache.device().is_cpu(),
              "paged_decode_attention (C++): CPU tensors only");
  TORCH_CHECK(q_in.dim() == 3, "q must be [num_seqs, num_heads, head_dim]");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2,
              "kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim]");
  TORCH_CHECK(q_in.scalar_type() == kv_cache.scalar_type(), "q and kv_cache dtypes differ");
  TORCH_CHECK(kv_cache.stride(4) == 1, "kv_cache's last dimension must be contiguous");
  const int64_t N = q_in.size(0), H = q_in.size(1), D = q_in.size(2);
  const int64_t NB = kv_cache.size(1), BS = kv_cache.size(2), Hkv = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == D, "head_dim mismatch between q and kv_cache");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(block_tables_in.dim() == 2 && block_tables_in.size(0) == N,
              "block_tables must be [num_seqs, max_blocks]");
  TORCH_CHECK(seq_lens_in.dim() == 1 && seq_lens_in.size(0) == N, "seq_lens must be [num_seqs]");
  const at::Tensor q = q_in.stride(2) == 1 ? q_in : q_in.contiguous();
  const at::Tensor block_tables = block_tables_in.to(at::kLong).contiguous();
  const at::Tensor seq_lens = seq_lens_in.to(at::kLong).contiguous();
  const int64_t MB = block_tables.size(1);
  {
    const int64_t* sl = seq_lens.data_ptr<int64_t>();
    for (int64_t i = 0; i < N; ++i)
      TORCH_CHECK(sl[i] >= 0 && sl[i] <= MB * BS, "seq_lens[", i, "] = ", sl[i],
                  " does not fit in ", MB, " blocks of ", BS);
  }
  at::Tensor out = at::empty({N, H, D}, q.options());
  if (N == 0) return out;

  Params P;
  P.q = q.data_ptr();
  P.out = out.data_ptr();
  P.k = kv_cache.select(0, 0).data_ptr();
  P.v = kv_cache.select(0, 1).data_ptr();
  P.block_tables = block_tables.data_ptr<int64_t>();
  P.seq_lens = seq_lens.data_ptr<int64_t>();
  P.num_kv_heads = Hkv;
  P.groups = H / Hkv;
  P.head_dim = D;
  P.block_size = BS;
  P.num_blocks = NB;
  P.q_stride_n = q.stride(0);
  P.q_stride_h = q.stride(1);
  P.out_stride_n = out.stride(0);
  P.out_stride_h = out.stride(1);
  P.kv_stride_block = kv_cache.stride(1);
  P.kv_stride_token = kv_cache.stride(2);
  P.kv_stride_head = kv_cache.stride(3);
  P.table_stride = block_tables.stride(0);
  P.scale = static_cast<float>(scale);

  switch (q.scalar_type()) {
    case at::kFloat: run<float>(P, N); break;
    case at::kBFloat16: run<c10::BFloat16>(P, N); break;
    default: TORCH_CHECK(false, "paged_decode_attention: unsupported dtype ", q.scalar_type());
  }
  return out;
}

// Which vector path this build took (reported by the Python side's log line and tests).
std::string isa() {
#if defined(__AVX512F__)
  return "avx512";
#else
  return "generic";
#endif
}

}  // namespace

TORCH_LIBRARY(kvserve, m) {
  m.def("paged_decode_attention(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, "
        "float scale) -> Tensor");
  m.def("paged_attention_isa() -> str", &isa);
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
