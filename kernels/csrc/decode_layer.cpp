// One decoder layer of a decode step as one op: the same kernels the model's Python layer
// calls (add_rms_norm, the AMX linears, rotary_embedding_to_cache, paged_attention,
// silu_and_mul), in the same order on the same tensors, called from here through torch's
// dispatcher. A decode step of a small model spends ~6 % of its time in the Python between
// those calls and more in each call's way from Python into C++ (docs/performance.md §8.8);
// here the layer is one call from Python.
//
// Contract: bf16 rows [tokens, hidden] of single-token decode queries, one a sequence
// (query_starts = 0..tokens-1, query_lens all 1), at most kernels/linear.py's FEW_ROWS; each
// linear's weight as kernels/linear.py Linear multiplies such rows: `bits` 16 for an AMX
// bf16 copy (amx_linear), 4 / 8 for GGUF blocks on AMX (amx_block_linear), 0 for a weight
// prepacked for oneDNN (mkldnn::_linear_pointwise: no AMX, or a shape the tiles do not fit);
// `pending` is the previous layer's MLP output, none for the first layer. `hidden`, the
// residual stream, is added to in place (as the layer's add_rms_norm calls do); returns this
// layer's MLP output not yet added to it, as common/engine/model.py DecoderLayer.forward does.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <string_view>

namespace baton_decode_layer {  // named apart: kernels/native.py compiles several sources as one unit
namespace {

using Linear = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&);
using BlockLinear = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const std::optional<at::Tensor>&);
using Norm = at::Tensor(const at::Tensor&, const at::Tensor&, double);
using AddNorm = at::Tensor(at::Tensor&, const at::Tensor&, const at::Tensor&, double);
using SiluAndMul = at::Tensor(const at::Tensor&);
using RotateAndStore = void(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            at::Tensor&, const at::Tensor&);
using PagedAttention = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, double, at::Tensor&);

using OnednnLinear = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                std::string_view, c10::List<std::optional<at::Scalar>>,
                                std::optional<std::string_view>);

template <typename Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// The ops, looked up once (the first call; the library registers them all at load).
struct Ops {
  c10::TypedOperatorHandle<Linear> linear = op<Linear>("baton::amx_linear");
  c10::TypedOperatorHandle<BlockLinear> block_linear = op<BlockLinear>("baton::amx_block_linear");
  c10::TypedOperatorHandle<Norm> rms_norm = op<Norm>("baton::rms_norm");
  c10::TypedOperatorHandle<AddNorm> add_rms_norm = op<AddNorm>("baton::add_rms_norm");
  c10::TypedOperatorHandle<SiluAndMul> silu_and_mul = op<SiluAndMul>("baton::silu_and_mul");
  c10::TypedOperatorHandle<RotateAndStore> rotate_and_store = op<RotateAndStore>("baton::rotary_embedding_to_cache");
  c10::TypedOperatorHandle<PagedAttention> paged_attention = op<PagedAttention>("baton::paged_attention");
};

const Ops& ops() {
  static const Ops handles;
  return handles;
}

// Looked up on first use: a torch built without oneDNN has no such op, and AMX layers never ask.
const c10::TypedOperatorHandle<OnednnLinear>& onednn_linear() {
  static const auto handle = op<OnednnLinear>("mkldnn::_linear_pointwise");
  return handle;
}

at::Tensor multiply(const Ops& o, const at::Tensor& x, const at::Tensor& weight, int64_t bits,
                    const std::optional<at::Tensor>& bias) {
  if (bits == 16) return o.linear.call(x, weight, bias);
  if (bits == 0) return onednn_linear().call(x, weight, bias, "none", c10::List<std::optional<at::Scalar>>(), "");
  return o.block_linear.call(x, weight, bits, bias);
}

at::Tensor decode_layer(at::Tensor& hidden, const std::optional<at::Tensor>& pending, const at::Tensor& input_norm,
                        const at::Tensor& post_norm, double eps, const at::Tensor& qkv, int64_t qkv_bits,
                        const std::optional<at::Tensor>& qkv_bias, const at::Tensor& o_proj, int64_t o_bits,
                        const std::optional<at::Tensor>& o_bias, const at::Tensor& gate_up, int64_t gate_up_bits,
                        const std::optional<at::Tensor>& gate_up_bias, const at::Tensor& down, int64_t down_bits,
                        const std::optional<at::Tensor>& down_bias, int64_t num_heads, int64_t num_kv_heads,
                        int64_t head_dim, const at::Tensor& positions, const at::Tensor& cos,
                        const at::Tensor& signed_sin, at::Tensor& kv_layer, const at::Tensor& slot_mapping,
                        const at::Tensor& block_table, const at::Tensor& query_starts, const at::Tensor& query_lens,
                        const at::Tensor& context_lens, int64_t block_size, double scale) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kBFloat16, "hidden: expected bf16 [tokens, hidden]");
  TORCH_CHECK(kv_layer.dim() == 4 && kv_layer.size(0) == 2, "kv_layer: expected [2, slots, kv_heads, head_dim]");
  const Ops& o = ops();
  const int64_t tokens = hidden.size(0);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const at::Tensor normed = pending.has_value() ? o.add_rms_norm.call(hidden, *pending, input_norm, eps)
                                                : o.rms_norm.call(hidden, input_norm, eps);
  const at::Tensor mixed = multiply(o, normed, qkv, qkv_bits, qkv_bias);
  at::Tensor query_key = mixed.narrow(1, 0, q_size + kv_size).view({tokens, num_heads + num_kv_heads, head_dim});
  const at::Tensor value = mixed.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads, head_dim});
  o.rotate_and_store.call(query_key, value, positions, cos, signed_sin, kv_layer, slot_mapping);
  const at::Tensor query = query_key.narrow(1, 0, num_heads);
  at::Tensor attended = at::empty(query.sizes(), query.options());
  o.paged_attention.call(query, kv_layer.select(0, 0), kv_layer.select(0, 1), block_table, query_starts, query_lens,
                         context_lens, block_size, scale, attended);
  const at::Tensor projected = multiply(o, attended.view({tokens, q_size}), o_proj, o_bits, o_bias);
  const at::Tensor post = o.add_rms_norm.call(hidden, projected, post_norm, eps);
  const at::Tensor activated = o.silu_and_mul.call(multiply(o, post, gate_up, gate_up_bits, gate_up_bias));
  return multiply(o, activated, down, down_bits, down_bias);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(baton, m) {
  m.def("decode_layer(Tensor(a!) hidden, Tensor? pending, Tensor input_norm, Tensor post_norm, float eps, "
        "Tensor qkv, int qkv_bits, Tensor? qkv_bias, Tensor o_proj, int o_bits, Tensor? o_bias, Tensor gate_up, "
        "int gate_up_bits, Tensor? gate_up_bias, Tensor down, int down_bits, Tensor? down_bias, int num_heads, "
        "int num_kv_heads, int head_dim, Tensor positions, Tensor cos, Tensor signed_sin, Tensor(b!) kv_layer, "
        "Tensor slot_mapping, Tensor block_table, Tensor query_starts, Tensor query_lens, Tensor context_lens, "
        "int block_size, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(baton, CPU, m) { m.impl("decode_layer", &decode_layer); }

// A weight prepacked for oneDNN is an MKLDNN tensor, which sends the call here.
TORCH_LIBRARY_IMPL(baton, MkldnnCPU, m) { m.impl("decode_layer", &decode_layer); }

}  // namespace baton_decode_layer
