// The C kernels as CPU torch ops, for the compiled decode step: the same schemas as the Python ops of
// metrale/worker/kernels/graph_ops.py (namespace metrale_native instead of metrale) and the same results
// bit for bit, since both call the C kernels of this folder. Called from the graph's C++ wrapper, an op
// costs a dispatcher call (~2 us) where the Python op costs a hop into the interpreter and the ctypes
// call (~40 us each, 14 a step on the bench model). MLA's decode attention has no Python op: without
// this library a graph attends in torch (kernels/mla.py:paged_mla_decode, the whole block table masked).
//
// Padding rows (slot PAD_SLOT = -1) are always the last rows of a batch; an op runs its kernel on the
// real rows only and returns zeros for the padding rows.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

extern "C" {
void met_kda_decode(float *pool, const int64_t *slots, const float *q, const float *k, const float *v,
                    const float *g, const float *beta, float *o, int64_t B, int64_t H, int64_t K, int64_t V,
                    float scale, int threads);
void met_conv_update(float *pool, const int64_t *slots, const float *x, int64_t x_stride, const float *weight,
                     float *out, int64_t B, int64_t D, int64_t W, int threads);
int met_mla_decode_f32(const float *q, const float *cache, const int64_t *block_tables, int64_t table_stride,
                       const int64_t *context_lens, float *out, int64_t B, int64_t H, int64_t C, int64_t R,
                       int64_t block_size, float scale, int threads);
int met_mla_decode_bf16(const float *q, const uint16_t *cache, const int64_t *block_tables, int64_t table_stride,
                        const int64_t *context_lens, float *out, int64_t B, int64_t H, int64_t C, int64_t R,
                        int64_t block_size, float scale, int threads);
}

namespace {

constexpr int64_t PAD_SLOT = -1;

// How many leading entries of slots [B] are real, each checked to index a pool of `pool_rows` rows.
int64_t real_rows(const at::Tensor &slots, int64_t pool_rows) {
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong && slots.is_contiguous(),
              "slots must be a contiguous int64 vector");
  const int64_t *slot = slots.data_ptr<int64_t>();
  int64_t n = slots.size(0);
  while (n > 0 && slot[n - 1] == PAD_SLOT) n--;
  for (int64_t i = 0; i < n; i++) {
    TORCH_CHECK(slot[i] >= 0 && slot[i] < pool_rows, "slot ", slot[i], " is outside the pool of ", pool_rows);
  }
  return n;
}

// The first n rows of x as a contiguous fp32 tensor (no copy when they already are one).
at::Tensor fp32_rows(const at::Tensor &x, int64_t n) { return x.narrow(0, 0, n).to(at::kFloat).contiguous(); }

// An uninitialised [total, ...] tensor whose rows from n on are zero.
at::Tensor with_zero_padding(at::IntArrayRef sizes, const at::TensorOptions &options, int64_t n) {
  at::Tensor out = at::empty(sizes, options);
  if (n < sizes[0]) out.narrow(0, n, sizes[0] - n).zero_();
  return out;
}

// q, k, g: [B, H, K]; v: [B, H, V]; beta: [B, H]; state_pool: fp32 contiguous [P, H, K, V], rows
// state_pool[slots] advanced in place. Returns o [B, H, V] in q's dtype.
at::Tensor kda_decode(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, const at::Tensor &g,
                      const at::Tensor &beta, const at::Tensor &state_pool, const at::Tensor &slots,
                      double scale) {
  TORCH_CHECK(state_pool.scalar_type() == at::kFloat && state_pool.is_contiguous() && state_pool.dim() == 4,
              "state_pool must be a contiguous fp32 [P, H, K, V] tensor");
  const int64_t total = slots.size(0), n = real_rows(slots, state_pool.size(0));
  const int64_t heads = q.size(1), key_dim = q.size(2), value_dim = v.size(2);
  TORCH_CHECK(state_pool.size(1) == heads && state_pool.size(2) == key_dim && state_pool.size(3) == value_dim,
              "state_pool rows must be [H, K, V] = [", heads, ", ", key_dim, ", ", value_dim, "]");
  at::Tensor q32 = fp32_rows(q, n), k32 = fp32_rows(k, n), v32 = fp32_rows(v, n);
  at::Tensor g32 = fp32_rows(g, n), beta32 = fp32_rows(beta, n);
  at::Tensor out = with_zero_padding({total, heads, value_dim}, q.options().dtype(at::kFloat), n);
  met_kda_decode(state_pool.data_ptr<float>(), slots.data_ptr<int64_t>(), q32.data_ptr<float>(),
                 k32.data_ptr<float>(), v32.data_ptr<float>(), g32.data_ptr<float>(), beta32.data_ptr<float>(),
                 out.data_ptr<float>(), n, heads, key_dim, value_dim, static_cast<float>(scale),
                 at::get_num_threads());
  return out.to(q.scalar_type());
}

// x: fp32 [B, D] (rows may be strided); weight: fp32 [D, W], W >= 2; conv_states: fp32 contiguous
// [P, D, W-1], rows conv_states[slots] shifted in place. Returns SiLU(conv) [B, D].
at::Tensor causal_conv1d_update(const at::Tensor &x, const at::Tensor &weight, const at::Tensor &conv_states,
                                const at::Tensor &slots) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat &&
                  conv_states.scalar_type() == at::kFloat,
              "the C short conv runs fp32 only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [B, D] with unit-stride rows");
  TORCH_CHECK(conv_states.is_contiguous() && weight.size(1) >= 2, "conv_states must be contiguous, W >= 2");
  const int64_t total = slots.size(0), n = real_rows(slots, conv_states.size(0));
  const int64_t channels = x.size(1), width = weight.size(1);
  TORCH_CHECK(weight.size(0) == channels && conv_states.size(1) == channels && conv_states.size(2) == width - 1,
              "weight must be [D, W] and conv_states [P, D, W-1]");
  at::Tensor taps = weight.contiguous();
  at::Tensor out = with_zero_padding({total, channels}, x.options(), n);
  met_conv_update(conv_states.data_ptr<float>(), slots.data_ptr<int64_t>(), x.data_ptr<float>(), x.stride(0),
                  taps.data_ptr<float>(), out.data_ptr<float>(), n, channels, width, at::get_num_threads());
  return out;
}

// kv_cache: contiguous [num_blocks, block_size, C + R]; latents: [N, C + R]; slot_mapping: int64 [N].
// Row slot_mapping[i] of the flattened cache becomes latents[i] (in the cache's dtype).
void store_latents(const at::Tensor &kv_cache, const at::Tensor &latents, const at::Tensor &slot_mapping) {
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.dim() == 3, "kv_cache must be contiguous [blocks, size, C+R]");
  const int64_t width = kv_cache.size(2);
  TORCH_CHECK(latents.dim() == 2 && latents.size(1) == width, "latents must be [N, ", width, "]");
  const int64_t n = real_rows(slot_mapping, kv_cache.size(0) * kv_cache.size(1));
  at::Tensor rows = latents.narrow(0, 0, n).to(kv_cache.scalar_type()).contiguous();
  const int64_t row_bytes = width * static_cast<int64_t>(kv_cache.element_size());
  char *cache = static_cast<char *>(kv_cache.data_ptr());
  const char *source = static_cast<const char *>(rows.const_data_ptr());
  const int64_t *slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; i++) std::memcpy(cache + slot[i] * row_bytes, source + i * row_bytes, row_bytes);
}

// q_latent: [B, H, C] (w_uk absorbed); q_rope: [B, H, R]; kv_cache: contiguous fp32 or bf16
// [num_blocks, block_size, C + R]; block_tables: int64 [B, W], unit-stride rows; context_lens: int64 [B].
// Rows with a context are real, the rest (context 0, always the last rows) padding. Returns the softmax-
// weighted sum of each real row's latents c_t [B, H, C] in q_latent's dtype (met_mla_decode_*: the context
// split over the threads), zeros for the padding rows. Every block a real row reads is checked.
at::Tensor mla_decode_latent(const at::Tensor &q_latent, const at::Tensor &q_rope, const at::Tensor &kv_cache,
                             const at::Tensor &block_tables, const at::Tensor &context_lens, double scale) {
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.dim() == 3, "kv_cache must be contiguous [blocks, size, C+R]");
  TORCH_CHECK(kv_cache.scalar_type() == at::kFloat || kv_cache.scalar_type() == at::kBFloat16,
              "the C MLA kernel reads fp32 or bf16 caches");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kLong && block_tables.stride(1) == 1,
              "block_tables must be int64 [B, W] with unit-stride rows");
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.scalar_type() == at::kLong && context_lens.is_contiguous(),
              "context_lens must be a contiguous int64 vector");
  const int64_t total = q_latent.size(0), heads = q_latent.size(1), kv_rank = q_latent.size(2);
  const int64_t rope_dim = q_rope.size(2), block_size = kv_cache.size(1), width = block_tables.size(1);
  TORCH_CHECK(kv_cache.size(2) == kv_rank + rope_dim, "cache rows must hold C + R = ", kv_rank + rope_dim);
  TORCH_CHECK(block_tables.size(0) == total && context_lens.size(0) == total, "one table and length per row");
  const int64_t *length = context_lens.data_ptr<int64_t>();
  int64_t n = total;
  while (n > 0 && length[n - 1] == 0) n--;
  for (int64_t b = 0; b < n; b++) {
    TORCH_CHECK(length[b] >= 1 && length[b] <= width * block_size, "row ", b, "'s context ", length[b],
                " is outside its block table of ", width, " blocks");
    const int64_t *table = block_tables.data_ptr<int64_t>() + b * block_tables.stride(0);
    for (int64_t i = 0; i < (length[b] + block_size - 1) / block_size; i++) {
      TORCH_CHECK(table[i] >= 0 && table[i] < kv_cache.size(0), "block ", table[i], " is outside the cache");
    }
  }
  at::Tensor query = at::cat({q_latent.narrow(0, 0, n), q_rope.narrow(0, 0, n)}, -1).to(at::kFloat).contiguous();
  at::Tensor out = with_zero_padding({total, heads, kv_rank}, q_latent.options().dtype(at::kFloat), n);
  int status = 0;
  if (n > 0 && kv_cache.scalar_type() == at::kFloat) {
    status = met_mla_decode_f32(query.data_ptr<float>(), kv_cache.data_ptr<float>(), block_tables.data_ptr<int64_t>(),
                                block_tables.stride(0), length, out.data_ptr<float>(), n, heads, kv_rank, rope_dim,
                                block_size, static_cast<float>(scale), at::get_num_threads());
  } else if (n > 0) {
    status = met_mla_decode_bf16(query.data_ptr<float>(), static_cast<const uint16_t *>(kv_cache.const_data_ptr()),
                                 block_tables.data_ptr<int64_t>(), block_tables.stride(0), length,
                                 out.data_ptr<float>(), n, heads, kv_rank, rope_dim, block_size,
                                 static_cast<float>(scale), at::get_num_threads());
  }
  TORCH_CHECK(status == 0, "the MLA decode kernel could not allocate its partial sums (", n, " sequences)");
  return out.to(q_latent.scalar_type());
}

}  // namespace

TORCH_LIBRARY(metrale_native, m) {
  m.def("kda_decode(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) state_pool, Tensor slots, "
        "float scale) -> Tensor");
  m.def("causal_conv1d_update(Tensor x, Tensor weight, Tensor(a!) conv_states, Tensor slots) -> Tensor");
  m.def("store_latents(Tensor(a!) kv_cache, Tensor latents, Tensor slot_mapping) -> ()");
  m.def("mla_decode_latent(Tensor q_latent, Tensor q_rope, Tensor kv_cache, Tensor block_tables, "
        "Tensor context_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(metrale_native, CPU, m) {
  m.impl("kda_decode", kda_decode);
  m.impl("causal_conv1d_update", causal_conv1d_update);
  m.impl("store_latents", store_latents);
  m.impl("mla_decode_latent", mla_decode_latent);
}
