// Every decoder layer of a small step in one call (Llama family, CPU):
//
//   decode_layers(hidden, residual?, positions, layer_tensors, kv_caches, slot_mapping,
//                 num_decode_tokens, decode_block_tables?, decode_seq_lens?,
//                 prefill_query_starts?, prefill_query_lens?, prefill_context_lens?,
//                 prefill_block_tables?, cos_cache, sin_cache, num_heads, num_kv_heads,
//                 head_dim, scale, eps, lora_tensors, lora_slots, quant_parts, quant_meta,
//                 onednn_above)
//       -> (hidden, residual)
//
// A step is one of at most the small-batch linear's rows (8; 16 with float32 activations
// and float weights, kvserve.ops.linear.small_batch_max_rows): small decode batches,
// speculative decoding's verification (1 + k tokens of a request), short prefill chunks, or a
// mix; or of any size where every projection has a prepacked copy (FusedDecodeStack.max_rows).
// It is laid out as CPU_ATTN's metadata says (decodes first, then prefill chunks).
//
// Why: at batch 1 a layer's arithmetic outside its four matrix-vector products is tiny, yet the
// Python layer path spent ~0.5-0.7 ms per layer on this AVX2 EPYC (module calls, views, splits,
// empties, wrapper checks; a torch op costs 3-7 us of dispatch here), a third of a decode step.
// This loop calls the very same kernels (small_batch_linear, fused_add_rms_norm, rotary,
// reshape_and_cache, paged_decode_attention / paged_prefill_attention, silu_and_mul) in the
// same order through the dispatcher from C++, so its results are bit-identical to the
// layer-by-layer path: it removes Python, not arithmetic. The tier-specific vector code stays
// in those kernels.
//
// layer_tensors: kSlots per layer, in the order of the Slot enum below (absent ones None).
// A float projection with a prepacked oneDNN copy (its kQkvP .. kDownP slot) runs oneDNN's
// linear on it in steps of more than onednn_above rows, as CpuLinearWeight.matmul does
// (ops.linear.onednn_above_rows: on AVX-512 oneDNN's GEMM overtakes the kernel from ~7 rows).
// Mixture-of-experts layers (Mixtral, Qwen2/3-MoE) carry the router / expert-stack slots
// instead of gate_up / down: their feed-forward block calls the router's small_batch_linear,
// the same torch routing ops as routing.select_experts and moe.cpp's fused_moe kernel
// (moe_mlp), as the layer path does for steps of this size -- bit-identical again.
// hidden / residual [T, hidden] as LlamaDecoderLayer takes them (residual None before the
// first layer); returns the last layer's (mlp output, residual), which the caller normalises.
// The kernels must be loaded (their libraries register the kvserve ops this calls).
//
// Multi-LoRA (kvserve.lora): lora_tensors is empty (no adapter token in the step), or kLora
// per layer, in the order of the LoraSlot enum: per projection (qkv, o, gate_up, down) its
// LoRALinear's A stack [S, n*R, in], B stack [S, out, n*R] and `has` [S] bool (the slots
// whose adapter targets it); lora_slots [T] int64 is the step's token -> slot (-1: base).
// After each projection's small_batch_linear the op calls lora_fused (csrc/lora.cpp) on it
// with the tokens of the slots it targets -- what LoRALinear.apply does on the layer path
// for steps of this size, so the output stays bit-identical to that path.
//
// Packed GGUF weights (kvserve.ops.quant; PackedWeight in ops/cpu_weight.py): quant_parts is
// empty (every projection a float weight in layer_tensors), or kParts tensors per projection
// (qkv, o, gate_up, down) per layer: the weight's parts stacked along its output rows, each a
// packed block tensor or a float [rows, K] one (None past the last part); quant_meta two ints
// per part, (GGML type id, rows), the type -1 for a float part. Each part runs as
// PackedWeight.matmul does it on the layer path (kvserve::quant_linear on float32 x, or
// at::linear), the parts concatenated, then the bias: bit-identical to that path. Why: with
// packed weights a demo decode step spent ~4 ms of Python around ~5 ms of matmuls.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/add.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include <optional>
#include <utility>
#include <string>
#include <tuple>
#include <vector>

namespace {

enum Slot : int64_t {
  kInputNorm, kPostNorm, kQkvW, kQkvB, kOW, kOB, kGateUpW, kGateUpB, kDownW, kDownB,
  kQNorm, kKNorm,
  // Mixture-of-experts layers (absent in dense ones, whose gate_up / down slots are then
  // absent): the router, the expert stacks, [top_k, renormalise] int64, and Qwen2-MoE's
  // shared expert (its gate_up, down and 1-row sigmoid gate), absent where it has none.
  kRouterW, kW13, kW2, kMoeCfg, kSharedGateUpW, kSharedDownW, kSharedGateW,
  // The dense projections' prepacked oneDNN weights (absent where a weight has none).
  kQkvP, kOP, kGateUpP, kDownP, kSlots
};

enum LoraSlot : int64_t {
  kQkvA, kQkvBStack, kQkvHas, kOA, kOBStack, kOHas, kGateUpA, kGateUpBStack, kGateUpHas,
  kDownA, kDownBStack, kDownHas, kLora
};

// Packed weights: parts per projection, and the projections in quant_parts' order.
constexpr int64_t kParts = 3;
enum Proj : int64_t { kPQkv, kPO, kPGateUp, kPDown, kProjections };
constexpr int64_t kFloatPart = -1, kNoPart = -2;

using Opt = std::optional<at::Tensor>;

template <typename Sig>
c10::TypedOperatorHandle<Sig> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

// Looked up once per process, on the first call (after Python has loaded every kernel).
struct Ops {
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const Opt&)> linear =
      find_op<at::Tensor(const at::Tensor&, const at::Tensor&, const Opt&)>(
          "kvserve::small_batch_linear");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, double)> rms_norm =
      find_op<at::Tensor(const at::Tensor&, const at::Tensor&, double)>("kvserve::rms_norm");
  c10::TypedOperatorHandle<void(at::Tensor&, at::Tensor&, const at::Tensor&, double)> add_norm =
      find_op<void(at::Tensor&, at::Tensor&, const at::Tensor&, double)>(
          "kvserve::fused_add_rms_norm");
  c10::TypedOperatorHandle<void(const at::Tensor&, at::Tensor&, at::Tensor&, int64_t,
                                const at::Tensor&, const at::Tensor&)>
      rotary = find_op<void(const at::Tensor&, at::Tensor&, at::Tensor&, int64_t,
                            const at::Tensor&, const at::Tensor&)>("kvserve::rotary_embedding");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&)> silu_and_mul =
      find_op<at::Tensor(const at::Tensor&)>("kvserve::silu_and_mul");
  c10::TypedOperatorHandle<void(const at::Tensor&, const at::Tensor&, at::Tensor&,
                                const at::Tensor&)>
      cache_write = find_op<void(const at::Tensor&, const at::Tensor&, at::Tensor&,
                                 const at::Tensor&)>("kvserve::reshape_and_cache");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const at::Tensor&, double)>
      decode = find_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  const at::Tensor&, double)>("kvserve::paged_decode_attention");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      double)>
      prefill = find_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   double)>("kvserve::paged_prefill_attention");
};

const Ops& ops() {
  static const Ops instance;
  return instance;
}

using LoraSig = void(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                      const at::Tensor&, at::IntArrayRef);

// Looked up on the first LoRA step only: lora.cpp's library is loaded where LoRA is on.
const c10::TypedOperatorHandle<LoraSig>& lora_op() {
  static const auto handle = find_op<LoraSig>("kvserve::lora_fused");
  return handle;
}

using QuantSig = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t);

// Looked up on the first step with packed weights (quant_linear.cpp's library is loaded then).
const c10::TypedOperatorHandle<QuantSig>& quant_op() {
  static const auto handle = find_op<QuantSig>("kvserve::quant_linear");
  return handle;
}

// oneDNN's linear on a prepacked weight: ops.linear.packed_linear's call (boxed: the op's
// schema has a Scalar?[] and a str? that the typed call would have to spell exactly).
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed, const Opt& bias) {
  static const c10::OperatorHandle handle =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, packed, bias, std::string("none"),
                          c10::List<std::optional<at::Scalar>>(), std::string("")};
  handle.callBoxed(&stack);
  return stack[0].toTensor();
}

// One layer's packed projections: kProjections * kParts tensors and their (type, rows) pairs.
struct QuantLayer {
  const Opt* parts;
  const int64_t* meta;
};

// y = x @ W^T + b for projection `p`: PackedWeight.matmul's arithmetic on its packed parts
// where it has some, else CpuLinearWeight.matmul's: the small-batch kernel on the float weight
// in slot `ws`, or for more than `onednn_above` rows its prepacked copy (slot kQkvP + p)
// where it has one.
at::Tensor project(const Ops& op, const at::Tensor& x, const Opt* w, Slot ws, Slot bs,
                   const QuantLayer* q, Proj p, int64_t onednn_above) {
  const int64_t* meta = q == nullptr ? nullptr : q->meta + p * kParts * 2;
  if (meta == nullptr || meta[0] == kNoPart) {
    const Opt& prepacked = w[kQkvP + p];
    if (x.size(0) > onednn_above && prepacked.has_value())
      return onednn_linear(x, *prepacked, w[bs]);
    return op.linear.call(x, *w[ws], w[bs]);
  }
  const Opt* parts = q->parts + p * kParts;
  int64_t n = 0;
  while (n < kParts && meta[2 * n] != kNoPart) ++n;
  const Opt& bias = w[bs];
  // One part: its matmul with the bias (PackedQuantWeight.matmul adds it in float32).
  auto part = [&](int64_t i, bool with_bias) -> at::Tensor {
    const at::Tensor& t = *parts[i];
    if (meta[2 * i] == kFloatPart)
      return at::linear(x, t.to(x.scalar_type()), with_bias ? bias : Opt());
    if (!(with_bias && bias.has_value()))    // bf16 x in, bf16 y out: the kernel converts
      return quant_op().call(x.contiguous(), t, meta[2 * i], meta[2 * i + 1]);
    const at::Tensor y = quant_op().call(x.to(at::kFloat).contiguous(), t, meta[2 * i],
                                         meta[2 * i + 1]);
    return at::add(y, bias->to(at::kFloat)).to(x.scalar_type());
  };
  if (n == 1) return part(0, true);
  std::vector<at::Tensor> ys;
  for (int64_t i = 0; i < n; ++i) ys.push_back(part(i, false));
  at::Tensor y = at::cat(ys, -1);
  return bias.has_value() ? at::add(y, *bias) : y;
}

// The step's adapter tokens (lora_slots), or none.
struct LoraStep {
  const Opt& slots;
};

// y += the LoRA delta of projection `p` (its A, B, has at lw[p], lw[p + 1], lw[p + 2]) for
// the tokens whose slot's adapter targets it: LoRALinear.apply's work on the layer path.
// splits: the fused slices' output sizes (LoRALinear.out_splits), or {} for o / down.
void add_lora(at::Tensor& y, const at::Tensor& x, const Opt* lw, int64_t p, const LoraStep& st,
              at::IntArrayRef splits = {}) {
  if (lw == nullptr || !st.slots.has_value()) return;
  const at::Tensor& slots = *st.slots;
  const bool* has = lw[p + 2]->data_ptr<bool>();
  const int64_t* s = slots.data_ptr<int64_t>();
  const int64_t T = slots.size(0);
  int64_t targeted = 0, others = 0;
  for (int64_t t = 0; t < T; ++t)
    if (s[t] >= 0) (has[s[t]] ? targeted : others) += 1;
  if (targeted == 0) return;
  at::Tensor use = slots;
  if (others > 0) {  // as LoRAGroups.slots_for: the slots outside the targeting ones -> -1
    use = at::empty({T}, slots.options());
    int64_t* u = use.data_ptr<int64_t>();
    for (int64_t t = 0; t < T; ++t) u[t] = s[t] >= 0 && has[s[t]] ? s[t] : -1;
  }
  lora_op().call(y, x, *lw[p], *lw[p + 1], use, splits);
}

using MoeSig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, const at::Tensor&);

// Looked up on the first MoE step only: moe.cpp's library is loaded where a model has experts.
const c10::TypedOperatorHandle<MoeSig>& moe_op() {
  static const auto handle = find_op<MoeSig>("kvserve::fused_moe");
  return handle;
}

using MoePackedSig = at::Tensor(const at::Tensor&, at::TensorList, at::IntArrayRef,
                                const at::Tensor&, int64_t, int64_t, const at::Tensor&,
                                const at::Tensor&);

// GGUF experts kept packed (uint8 stacks; cfg [top_k, renormalise, w13 type, w2 type, inter]).
const c10::TypedOperatorHandle<MoePackedSig>& moe_packed_op() {
  static const auto handle = find_op<MoePackedSig>("kvserve::fused_moe_packed");
  return handle;
}

// A MoE layer's feed-forward block, x [T, hidden] (normed) -> [T, hidden]: MixtralMoE /
// QwenMoE.forward with the same ops in the same order -- the router's small_batch_linear,
// routing.select_experts (float32 softmax over all experts, topk, the optional
// renormalisation), ops.moe.fused_moe_cpu's kernel, then Qwen2-MoE's sigmoid-gated shared
// expert (LlamaMLP's gate_up -> silu_and_mul -> down).
at::Tensor moe_mlp(const Ops& op, const at::Tensor& x, const Opt* w) {
  const Opt none;
  const int64_t* cfg = w[kMoeCfg]->data_ptr<int64_t>();
  const at::Tensor probs = op.linear.call(x, *w[kRouterW], none).to(at::kFloat).softmax(-1);
  auto [weights, ids] = probs.topk(cfg[0], -1);
  if (cfg[1] != 0) weights = weights.div(weights.sum(-1, true));
  at::Tensor out =
      w[kW13]->scalar_type() == at::kByte
          ? moe_packed_op().call(x.to(at::kFloat).contiguous(), {*w[kW13]}, {cfg[2]}, *w[kW2],
                                 cfg[3], cfg[4], weights.contiguous(), ids.contiguous())
                .to(x.scalar_type())
          : moe_op().call(x.contiguous(), *w[kW13], *w[kW2], weights.contiguous(),
                          ids.contiguous());
  if (!w[kSharedGateUpW].has_value()) return out;
  const at::Tensor gate = op.linear.call(x, *w[kSharedGateW], none).sigmoid();
  const at::Tensor act = op.silu_and_mul.call(op.linear.call(x, *w[kSharedGateUpW], none));
  return out.add(gate.mul(op.linear.call(act, *w[kSharedDownW], none)));
}

struct Dims {
  int64_t T, H, Hkv, D;
  double scale, eps;
  int64_t onednn_above;   // project()'s
};

// The step's attention metadata (CPU_ATTN's AttentionMetadata).
struct Meta {
  const at::Tensor& slot_mapping;
  int64_t num_decodes;
  const Opt &decode_tables, &decode_seq_lens;
  const Opt &prefill_starts, &prefill_lens, &prefill_ctxs, &prefill_tables;
};

// CpuAttentionBackend.forward's arithmetic: q [T, H, D] -> [T, H, D]. Prefill chunks in one
// call (its decode rows come back as zeros), then the decode rows.
at::Tensor attend(const Ops& op, const at::Tensor& q3, const at::Tensor& kv_cache,
                  const Meta& m, double scale) {
  at::Tensor out;
  if (m.prefill_starts.has_value())
    out = op.prefill.call(q3, kv_cache, *m.prefill_starts, *m.prefill_lens, *m.prefill_ctxs,
                          *m.prefill_tables, scale);
  if (m.num_decodes > 0) {
    const bool all = m.num_decodes == q3.size(0);
    at::Tensor dec = op.decode.call(all ? q3 : q3.narrow(0, 0, m.num_decodes), kv_cache,
                                    *m.decode_tables, *m.decode_seq_lens, scale);
    if (out.defined()) out.narrow(0, 0, m.num_decodes).copy_(dec);
    else out = dec;
  }
  return out;
}

// Attention of one layer: x [T, hidden] (normed) -> o_proj output [T, hidden].
at::Tensor attention(const Ops& op, const at::Tensor& x, const Opt* w, const QuantLayer* ql,
                     const Opt* lw, const LoraStep& st, const at::Tensor& positions, at::Tensor& kv_cache,
                     const Meta& m, const at::Tensor& cos, const at::Tensor& sin, const Dims& d) {
  at::Tensor qkv = project(op, x, w, kQkvW, kQkvB, ql, kPQkv, d.onednn_above);
  const int64_t q_size = d.H * d.D, kv_size = d.Hkv * d.D;
  add_lora(qkv, x, lw, kQkvA, st, {q_size, kv_size, kv_size});
  at::Tensor q = qkv.narrow(1, 0, q_size);
  at::Tensor k = qkv.narrow(1, q_size, kv_size);
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size);
  if (w[kQNorm].has_value()) {  // Qwen3: RMSNorm over each q / k head before the rotation
    q = op.rms_norm.call(q.reshape({d.T, d.H, d.D}), *w[kQNorm], d.eps).view({d.T, q_size});
    k = op.rms_norm.call(k.reshape({d.T, d.Hkv, d.D}), *w[kKNorm], d.eps).view({d.T, kv_size});
  }
  op.rotary.call(positions, q, k, d.D, cos, sin);
  op.cache_write.call(k.view({d.T, d.Hkv, d.D}), v.view({d.T, d.Hkv, d.D}), kv_cache,
                      m.slot_mapping);
  at::Tensor q3 = q.view({d.T, d.H, d.D});
  const bool cast = q3.scalar_type() != kv_cache.scalar_type();
  if (cast) q3 = q3.to(kv_cache.scalar_type());
  at::Tensor out = attend(op, q3, kv_cache, m, d.scale);
  if (cast) out = out.to(q.scalar_type());
  const at::Tensor o_in = out.view({d.T, q_size});
  at::Tensor o = project(op, o_in, w, kOW, kOB, ql, kPO, d.onednn_above);
  add_lora(o, o_in, lw, kOA, st);
  return o;
}

// The per-layer arguments' shapes: norms present; each weight slot filled, or packed parts
// in its place, or (gate_up / down) a MoE block's router and stacks; the packed parts' types;
// the LoRA stacks and their token slots (none with MoE layers).
void check_layer_args(const std::vector<Opt>& w, const std::vector<Opt>& qparts,
                      at::IntArrayRef quant_meta, const std::vector<Opt>& lora,
                      const Opt& lora_slots, int64_t L, int64_t T) {
  const bool packed = !qparts.empty(), with_lora = !lora.empty();
  const int64_t per_layer = kProjections * kParts;
  TORCH_CHECK(!packed || (static_cast<int64_t>(qparts.size()) == L * per_layer &&
                          static_cast<int64_t>(quant_meta.size()) == 2 * L * per_layer),
              "decode_layers: ", qparts.size(), " packed parts / ", quant_meta.size(),
              " meta ints for ", L, " layers (", per_layer, " parts, 2 ints each)");
  for (int64_t i = 0; packed && i < L * per_layer; ++i) {
    const int64_t t = quant_meta[2 * i];
    TORCH_CHECK(t == kNoPart || (qparts[i].has_value() && t >= kFloatPart),
                "decode_layers: packed part ", i, " (type ", t, ") is missing or malformed");
  }
  TORCH_CHECK(!with_lora || (static_cast<int64_t>(lora.size()) == L * kLora &&
                             lora_slots.has_value() && lora_slots->size(0) == T &&
                             lora_slots->scalar_type() == at::kLong),
              "decode_layers: ", lora.size(), " LoRA tensors for ", L, " layers (", kLora,
              " each) need lora_slots [", T, "] int64");
  for (int64_t i = 0; with_lora && i < L * kLora; ++i)
    TORCH_CHECK(lora[i].has_value() && (i % 3 != 2 || (lora[i]->scalar_type() == at::kBool &&
                                                       lora[i]->is_contiguous())),
                "decode_layers: LoRA tensor ", i, " is missing, or a `has` one not bool");
  const std::pair<Slot, Proj> weights[] = {{kQkvW, kPQkv}, {kOW, kPO}, {kGateUpW, kPGateUp},
                                           {kDownW, kPDown}};
  for (int64_t l = 0; l < L; ++l) {
    const Opt* lw = w.data() + l * kSlots;
    const bool moe = lw[kRouterW].has_value();
    for (Slot s : {kInputNorm, kPostNorm})
      TORCH_CHECK(lw[s].has_value(), "decode_layers: layer ", l, " lacks slot ", s);
    for (const auto& [s, p] : weights)
      TORCH_CHECK(lw[s].has_value() ||
                      (packed && quant_meta[2 * (l * per_layer + p * kParts)] != kNoPart) ||
                      ((s == kGateUpW || s == kDownW) && moe),
                  "decode_layers: layer ", l, " has neither a weight nor packed parts for slot ",
                  s);
    TORCH_CHECK(!moe || (lw[kW13].has_value() && lw[kW2].has_value() && lw[kMoeCfg].has_value() &&
                         lw[kMoeCfg]->scalar_type() == at::kLong &&
                         lw[kMoeCfg]->numel() == (lw[kW13]->scalar_type() == at::kByte ? 5 : 2) &&
                         lw[kMoeCfg]->is_contiguous()),
                "decode_layers: MoE layer ", l, " lacks its expert stacks or [top_k, renormalise"
                "(, w13 type, w2 type, inter: packed)]");
    TORCH_CHECK(!moe || !with_lora, "decode_layers: LoRA on a MoE layer runs layer by layer");
  }
}

std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& hidden_in, const Opt& residual_in, const at::Tensor& positions,
    const c10::List<Opt>& layer_tensors, at::TensorList kv_caches, const at::Tensor& slot_mapping,
    int64_t num_decode_tokens, const Opt& decode_block_tables, const Opt& decode_seq_lens,
    const Opt& prefill_query_starts, const Opt& prefill_query_lens,
    const Opt& prefill_context_lens, const Opt& prefill_block_tables, const at::Tensor& cos_cache,
    const at::Tensor& sin_cache, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    double scale, double eps, const c10::List<Opt>& lora_tensors, const Opt& lora_slots,
    const c10::List<Opt>& quant_parts, at::IntArrayRef quant_meta, int64_t onednn_above) {
  const int64_t L = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(static_cast<int64_t>(layer_tensors.size()) == L * kSlots, "decode_layers: ",
              layer_tensors.size(), " layer tensors for ", L, " layers (", kSlots, " each)");
  TORCH_CHECK(hidden_in.dim() == 2 && hidden_in.is_contiguous(),
              "decode_layers: hidden must be a contiguous [T, hidden] tensor");
  const Ops& op = ops();
  const Dims d{hidden_in.size(0), num_heads, num_kv_heads, head_dim, scale, eps, onednn_above};
  const Meta meta{slot_mapping, num_decode_tokens, decode_block_tables, decode_seq_lens,
                  prefill_query_starts, prefill_query_lens, prefill_context_lens,
                  prefill_block_tables};
  TORCH_CHECK(num_decode_tokens == 0 || (decode_block_tables.has_value() && decode_seq_lens.has_value()),
              "decode_layers: decodes without their block tables / seq_lens");
  TORCH_CHECK(num_decode_tokens == d.T ||
                  (prefill_query_starts.has_value() && prefill_query_lens.has_value() &&
                   prefill_context_lens.has_value() && prefill_block_tables.has_value()),
              "decode_layers: prefill tokens without their chunk metadata");
  std::vector<Opt> w(layer_tensors.begin(), layer_tensors.end());
  std::vector<Opt> qparts(quant_parts.begin(), quant_parts.end());
  const bool packed = !qparts.empty();
  const int64_t per_layer = kProjections * kParts;
  std::vector<Opt> lora(lora_tensors.begin(), lora_tensors.end());
  const bool with_lora = !lora.empty();
  check_layer_args(w, qparts, quant_meta, lora, lora_slots, L, d.T);
  const LoraStep st{lora_slots};

  at::Tensor hidden = hidden_in, residual;
  for (int64_t l = 0; l < L; ++l) {
    const Opt* lw = w.data() + l * kSlots;
    const Opt* ll = with_lora ? lora.data() + l * kLora : nullptr;
    const QuantLayer qlayer{qparts.data() + l * per_layer, quant_meta.data() + 2 * l * per_layer};
    const QuantLayer* ql = packed ? &qlayer : nullptr;
    // The residual add is folded into the next norm, as in LlamaDecoderLayer.forward.
    if (l == 0 && !residual_in.has_value()) {
      residual = hidden;
      hidden = op.rms_norm.call(hidden, *lw[kInputNorm], eps);
    } else {
      if (l == 0) residual = *residual_in;
      op.add_norm.call(hidden, residual, *lw[kInputNorm], eps);
    }
    at::Tensor kv_cache = kv_caches[l];
    hidden = attention(op, hidden, lw, ql, ll, st, positions, kv_cache, meta, cos_cache, sin_cache, d);
    op.add_norm.call(hidden, residual, *lw[kPostNorm], eps);
    if (lw[kRouterW].has_value()) {  // a mixture-of-experts block instead of the dense MLP
      hidden = moe_mlp(op, hidden, lw);
      continue;
    }
    at::Tensor gate_up = project(op, hidden, lw, kGateUpW, kGateUpB, ql, kPGateUp, d.onednn_above);
    const int64_t inter = gate_up.size(1) / 2;
    add_lora(gate_up, hidden, ll, kGateUpA, st, {inter, inter});
    const at::Tensor act = op.silu_and_mul.call(gate_up);
    hidden = project(op, act, lw, kDownW, kDownB, ql, kPDown, d.onednn_above);
    add_lora(hidden, act, ll, kDownA, st);
  }
  return {hidden, residual};
}

std::string isa() { return "composite (each kernel's own tier)"; }

}  // namespace

// A fragment: paged_attention.cpp owns TORCH_LIBRARY(kvserve).
TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("decode_layers(Tensor hidden, Tensor? residual, Tensor positions, Tensor?[] layer_tensors, "
        "Tensor(a!)[] kv_caches, Tensor slot_mapping, int num_decode_tokens, "
        "Tensor? decode_block_tables, Tensor? decode_seq_lens, Tensor? prefill_query_starts, "
        "Tensor? prefill_query_lens, Tensor? prefill_context_lens, Tensor? prefill_block_tables, "
        "Tensor cos_cache, Tensor sin_cache, int num_heads, int num_kv_heads, int head_dim, "
        "float scale, float eps, Tensor?[] lora_tensors, Tensor? lora_slots, Tensor?[] quant_parts, "
        "int[] quant_meta, int onednn_above) -> (Tensor, Tensor)");
  m.def("decode_layers_isa() -> str", &isa);
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("decode_layers", &decode_layers); }
// The prepacked oneDNN weights among layer_tensors are MkldnnCPU tensors, which the dispatcher
// keys the call on.
TORCH_LIBRARY_IMPL(kvserve, MkldnnCPU, m) { m.impl("decode_layers", &decode_layers); }
