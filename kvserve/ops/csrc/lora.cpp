// Multi-LoRA delta for CPU decode batches, punica's shrink then expand in one op:
//
//   y[t] += B[slot(t)] (A[slot(t)] x[t])      for every token t with slot(t) >= 0
//
//   y            [T, N]       x's dtype (float32 | bfloat16), last dim contiguous; in place
//   x            [T, K]       float32 | bfloat16, contiguous
//   a_stack      [S, R, K]    float32 | bfloat16, contiguous (R = fused slices x max rank)
//   b_stack      [S, N, R]    a_stack's dtype, contiguous (the LoRA scaling folded in)
//   token_slots  [T]          int64, -1 = no adapter (the row of y is not touched)
//
// The tokens are grouped by slot first, so each adapter's A and B are streamed once per
// group, not once per token. Shrink: per group and block of 8 rows of A, every token of the
// group takes 8 dot products over K (one accumulator each) into a float32 buffer s [T, R].
// Expand: per group and block of 8 rows of B, every token takes 8 dot products over R with
// its s row, added to y. Eight accumulators are reduced together (hsum8x8: 7 shuffles for 8
// sums). Work items (group, block) are split over threads with at::parallel_for once there
// is enough work to pay for the fork. Everything accumulates in float32; a bfloat16 y is
// rounded once after the add.
//
// AVX2 (+FMA, F16C; the avx2 tier and every tier above: AVX-512 builds take the same code):
// 8 lanes, bf16 widened in registers (vec_avx2.h). generic: plain loops the compiler may
// vectorise.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "vec_avx2.h"

namespace {

using bf16 = c10::BFloat16;
constexpr int64_t kRows = 8;                 // weight rows per block (one accumulator each)
// Minimum multiply-adds per thread's share: below this the fork/join costs more than the
// second core gains. 2M keeps decode-sized calls (<= 16 tokens on the 110M Llama's shapes,
// 0.6-2.1M MACs a region) on one thread: a decode step makes two regions per projection
// (~96 a step), and on a 2-core Zen 3 shared with other jobs a region whose second thread is
// descheduled waited 18-28 ms (median of 200 calls, 16 tokens, 4 adapters) against 0.07-0.6 ms
// on one thread; the larger regions of 64-token calls (4x the MACs) still split.
constexpr int64_t kMinMacsPerTask = int64_t{1} << 21;

inline float to_f(float v) { return v; }
inline float to_f(bf16 v) { return static_cast<float>(v); }

#if defined(KVS_AVX2)
using namespace kvs_avx2;

// [sum(v[0]), ..., sum(v[7])] in one vector.
inline __attribute__((always_inline)) __m256 hsum8x8(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

// out[j] = w[j] . v over n values for the 8 rows w[j] (the caller repeats a valid row where
// a block has fewer than 8).
template <typename TW, typename TV>
void dot8rows(const TW* const* w, const TV* v, int64_t n, float* out) {
  __m256 acc[kRows];
  for (int j = 0; j < kRows; ++j) acc[j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    const __m256 xv = load8(v + k);
    for (int j = 0; j < kRows; ++j) acc[j] = _mm256_fmadd_ps(load8(w[j] + k), xv, acc[j]);
  }
  if (k < n) {
    const __m256 xv = load8(v + k, n - k);
    for (int j = 0; j < kRows; ++j) acc[j] = _mm256_fmadd_ps(load8(w[j] + k, n - k), xv, acc[j]);
  }
  _mm256_storeu_ps(out, hsum8x8(acc));
}
#else
template <typename TW, typename TV>
void dot8rows(const TW* const* w, const TV* v, int64_t n, float* out) {
  for (int j = 0; j < kRows; ++j) {
    const TW* wj = w[j];
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int64_t k = 0; k < n; ++k) acc += to_f(wj[k]) * to_f(v[k]);
    out[j] = acc;
  }
}
#endif

struct Group {
  int64_t slot, begin, end;   // tokens order[begin:end] use this slot
};

// The 8 row pointers of block `blk` of a [rows, n] matrix; a short last block repeats its
// last row (computed, then dropped).
template <typename TW>
inline void block_rows(const TW* base, int64_t blk, int64_t rows, int64_t n, const TW** w) {
  for (int j = 0; j < kRows; ++j) w[j] = base + std::min(blk * kRows + j, rows - 1) * n;
}

template <typename TX, typename TW>
void run(TX* y, int64_t y_stride, const TX* x, const TW* a, const TW* b,
         const std::vector<int64_t>& order, const std::vector<Group>& groups, int64_t T, int64_t K,
         int64_t R, int64_t N) {
  const int64_t G = static_cast<int64_t>(groups.size());
  const int64_t tokens_per_group = std::max<int64_t>(1, T / std::max<int64_t>(G, 1));
  std::vector<float> s(static_cast<size_t>(T * R));
  const int64_t r_blocks = (R + kRows - 1) / kRows;
  at::parallel_for(0, G * r_blocks,
                   std::max<int64_t>(1, kMinMacsPerTask / (kRows * K * tokens_per_group)),
                   [&](int64_t i0, int64_t i1) {
    const TW* w[kRows];
    float out[kRows];
    for (int64_t i = i0; i < i1; ++i) {
      const Group& g = groups[i / r_blocks];
      const int64_t blk = i % r_blocks, r0 = blk * kRows, nr = std::min(kRows, R - r0);
      block_rows(a + g.slot * R * K, blk, R, K, w);
      for (int64_t p = g.begin; p < g.end; ++p) {
        const int64_t t = order[p];
        dot8rows(w, x + t * K, K, out);
        std::copy(out, out + nr, s.data() + t * R + r0);
      }
    }
  });
  const int64_t n_blocks = (N + kRows - 1) / kRows;
  at::parallel_for(0, G * n_blocks,
                   std::max<int64_t>(1, kMinMacsPerTask / (kRows * R * tokens_per_group)),
                   [&](int64_t i0, int64_t i1) {
    const TW* w[kRows];
    float out[kRows];
    for (int64_t i = i0; i < i1; ++i) {
      const Group& g = groups[i / n_blocks];
      const int64_t blk = i % n_blocks, n0 = blk * kRows, nn = std::min(kRows, N - n0);
      block_rows(b + g.slot * N * R, blk, N, R, w);
      for (int64_t p = g.begin; p < g.end; ++p) {
        const int64_t t = order[p];
        dot8rows(w, s.data() + t * R, R, out);
        TX* yt = y + t * y_stride + n0;
        for (int64_t j = 0; j < nn; ++j) yt[j] = static_cast<TX>(to_f(yt[j]) + out[j]);
      }
    }
  });
}

void lora_fused(at::Tensor& y, const at::Tensor& x, const at::Tensor& a_stack,
                const at::Tensor& b_stack, const at::Tensor& token_slots) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && a_stack.dim() == 3 && b_stack.dim() == 3 &&
                  token_slots.dim() == 1,
              "lora_fused: expected y [T, N], x [T, K], a_stack [S, R, K], b_stack [S, N, R], "
              "token_slots [T]");
  const int64_t T = x.size(0), K = x.size(1), S = a_stack.size(0), R = a_stack.size(1);
  const int64_t N = b_stack.size(1);
  TORCH_CHECK(y.size(0) == T && y.size(1) == N && token_slots.size(0) == T &&
                  a_stack.size(2) == K && b_stack.size(0) == S && b_stack.size(2) == R,
              "lora_fused: shapes do not match: y ", y.sizes(), ", x ", x.sizes(), ", a_stack ",
              a_stack.sizes(), ", b_stack ", b_stack.sizes(), ", token_slots ", token_slots.sizes());
  TORCH_CHECK(x.is_contiguous() && a_stack.is_contiguous() && b_stack.is_contiguous() &&
                  y.stride(1) == 1 && token_slots.scalar_type() == at::kLong,
              "lora_fused: x, a_stack, b_stack must be contiguous, y's rows contiguous, "
              "token_slots int64");
  TORCH_CHECK(y.scalar_type() == x.scalar_type() && a_stack.scalar_type() == b_stack.scalar_type(),
              "lora_fused: y must have x's dtype and b_stack a_stack's");
  if (T == 0 || R == 0 || N == 0) return;
  // Tokens sorted by slot (stable), grouped; slot -1 dropped.
  const int64_t* slots = token_slots.data_ptr<int64_t>();
  std::vector<int64_t> order;
  order.reserve(T);
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(slots[t] >= -1 && slots[t] < S, "lora_fused: token ", t, " has slot ", slots[t],
                ", the stacks have ", S);
    if (slots[t] >= 0) order.push_back(t);
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t i, int64_t j) { return slots[i] < slots[j]; });
  std::vector<Group> groups;
  for (int64_t p = 0; p < static_cast<int64_t>(order.size()); ++p) {
    if (p == 0 || slots[order[p]] != slots[order[p - 1]]) groups.push_back({slots[order[p]], p, p});
    groups.back().end = p + 1;
  }
  if (groups.empty()) return;
  const auto xt = x.scalar_type(), wt = a_stack.scalar_type();
  const int64_t ys = y.stride(0);
  if (xt == at::kFloat && wt == at::kFloat)
    run(y.data_ptr<float>(), ys, x.data_ptr<float>(), a_stack.data_ptr<float>(),
        b_stack.data_ptr<float>(), order, groups, T, K, R, N);
  else if (xt == at::kFloat && wt == at::kBFloat16)
    run(y.data_ptr<float>(), ys, x.data_ptr<float>(), a_stack.data_ptr<bf16>(),
        b_stack.data_ptr<bf16>(), order, groups, T, K, R, N);
  else if (xt == at::kBFloat16 && wt == at::kBFloat16)
    run(y.data_ptr<bf16>(), ys, x.data_ptr<bf16>(), a_stack.data_ptr<bf16>(),
        b_stack.data_ptr<bf16>(), order, groups, T, K, R, N);
  else
    TORCH_CHECK(false, "lora_fused: unsupported dtypes x ", xt, ", stacks ", wt);
}

std::string isa() {
#if defined(KVS_AVX2)
  return "avx2 (fma, 8 rows per pass; bf16 widened in registers)";
#else
  return "generic";
#endif
}

}  // namespace

// A fragment: paged_attention.cpp owns TORCH_LIBRARY(kvserve).
TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("lora_fused(Tensor(a!) y, Tensor x, Tensor a_stack, Tensor b_stack, "
        "Tensor token_slots) -> ()");
  m.def("lora_isa() -> str", &isa);
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("lora_fused", &lora_fused); }
