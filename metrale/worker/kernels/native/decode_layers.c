/* A Kimi-Linear model's decoder layers over a forward of decode rows only, in one call
 * (met_decode_layers): per layer the input norm, the KDA or MLA attention, the residual, the post-attention
 * norm, the dense or mixture-of-experts feed-forward and the residual. Issued from Python a step of the
 * bench model made ~320 calls and the layers' glue (module calls, views, residual adds) cost more than a
 * millisecond of its ~6.5 (bench/decode.py --profile).
 *
 * Every piece is the C function the layers' op-by-op path runs on decode rows (met_rms_norm, the KDA layer,
 * the one-order products, met_mla_decode_f32, the router and SwiGLU blocks), on the same values in the same
 * order, and the residual adds are fp32 additions as torch's: a row's bits are the op-by-op path's, so a
 * decode row here is the bitwise twin of the same row verified or decoded beside a prefill (tested). fp32
 * models only; the caller checks.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

void met_rms_norm(const float *x, int64_t x_stride, const float *weight, float *out, int64_t rows, int64_t D,
                  float eps, int threads);
void met_product(const float *x, int64_t x_group, int64_t x_row, const void *w, int64_t w_group, int64_t w_row,
                 int bf16, float *out, int64_t G, int64_t M, int64_t N, int64_t K, int threads);
void met_product_kn(const float *x, int64_t x_group, int64_t x_row, const void *w, int64_t w_group, int64_t w_row,
                    int bf16, float *out, int64_t G, int64_t M, int64_t N, int64_t K, int threads);
int met_mla_decode_f32(const float *q, const float *cache, const int64_t *block_tables, int64_t table_stride,
                       const int64_t *context_lens, float *out, int64_t B, int64_t H, int64_t C, int64_t R,
                       int64_t block_size, float scale, int threads);
int met_kda_decode_layer(const float *x, int64_t B, int64_t D, const float *in_proj, const float *conv_weight,
                         int64_t W, float *conv_pool, const float *f_b, const float *dt_bias, const float *neg_a,
                         const float *g_b, const float *o_norm, float eps, const float *o_proj, float *state_pool,
                         const int64_t *slots, int64_t H, int64_t K, float scale, float *out, int threads);
int met_sigmoid_route(const float *x, int64_t M, int64_t D, const void *router, int router_bf16, const float *bias,
                      int64_t E, int64_t groups, int64_t topk_group, int64_t top_k, int renormalize, float scaling,
                      int64_t *ids, float *weights, int threads);
int met_routed_experts(const float *x, int64_t M, int64_t D, const int64_t *ids, const float *weights,
                       int64_t top_k, const void *experts_gate_up, const void *experts_down, int64_t E, int64_t I,
                       int bf16_weights, int round_bf16, float *out, int threads);
int met_swiglu(const float *x, int64_t M, int64_t D, const void *gate_up, const void *down, int64_t I,
               int bf16_weights, int round_bf16, float *out, int threads);

/* One layer's weights and pools, fp32 and contiguous (decode_layers.py's DecodeLayer, field for field). */
typedef struct {
    const float *input_norm, *post_norm;
    int64_t attention; /* 0: KDA, 1: MLA */
    /* KDA (layers/kda.py) */
    const float *kda_in_proj, *kda_conv_weight, *kda_f_b, *kda_dt_bias, *kda_neg_a, *kda_g_b, *kda_o_norm,
        *kda_o_proj;
    float *conv_pool, *state_pool;
    int64_t kda_heads, kda_head_dim, conv_width;
    float kda_scale, norm_eps;
    /* MLA (layers/mla.py, no q_lora): in_proj [H (Dn + R) + C + R, D], kv_b [H (Dn + Dv), C] */
    const float *mla_in_proj, *mla_kv_norm, *mla_kv_b, *mla_o_proj;
    float *kv_cache;
    int64_t mla_heads, nope_dim, rope_dim, v_dim, kv_rank, block_size;
    float mla_scale, mla_pad;
    /* feed-forward (layers/mlp.py): dense (moe 0) or a mixture (moe 1), whose shared expert is gate_up/down */
    int64_t moe;
    const float *gate_up, *down; /* NULL: a mixture without a shared expert */
    int64_t intermediate;
    const float *router, *router_bias, *experts_gate_up, *experts_down;
    int64_t experts, groups, topk_group, top_k, renormalize, expert_intermediate;
    float scaling, moe_pad;
} DecodeLayer;

/* MLA for B decode rows of normed x [B, D] -> out [B, D] (LatentAttention.forward's decode rows): the
 * latents stored at slot_mapping, the absorbed query per head (met_product_kn over kv_b's key rows), the
 * attention (met_mla_decode_f32), the values per head (met_product over kv_b's value rows), o_proj. */
static int mla_rows(const DecodeLayer *l, const float *x, int64_t B, int64_t D, const int64_t *slot_mapping,
                    const int64_t *block_tables, int64_t table_stride, const int64_t *context_lens, float *out,
                    float *scratch, int threads) {
    int64_t H = l->mla_heads, Dn = l->nope_dim, R = l->rope_dim, Dv = l->v_dim, C = l->kv_rank;
    int64_t Q = H * (Dn + R), P = Q + C + R, width = C + R;
    float *proj = scratch, *q_latent = proj + B * P, *query = q_latent + H * B * C, *o_latent = query + B * H * width;
    float *values = o_latent + B * H * C, *o_rows = values + H * B * Dv;
    met_product(x, 0, D, l->mla_in_proj, 0, D, 0, proj, 1, B, P, D, threads);
    for (int64_t b = 0; b < B; b++) { /* the normed latent and the shared rope key, into the cache */
        float *row = l->kv_cache + slot_mapping[b] * width;
        met_rms_norm(proj + b * P + Q, P, l->mla_kv_norm, row, 1, C, l->norm_eps, 1);
        memcpy(row + C, proj + b * P + Q + C, sizeof(float) * (size_t)R);
    }
    /* q_latent [H, B, C] = q_nope [H, B, Dn] x w_uk [H, Dn, C] */
    met_product_kn(proj, Dn + R, P, l->mla_kv_b, (Dn + Dv) * C, C, 0, q_latent, H, B, C, Dn, threads);
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++) {
            float *to = query + (b * H + h) * width;
            memcpy(to, q_latent + (h * B + b) * C, sizeof(float) * (size_t)C);
            memcpy(to + C, proj + b * P + h * (Dn + R) + Dn, sizeof(float) * (size_t)R);
        }
    int status = met_mla_decode_f32(query, l->kv_cache, block_tables, table_stride, context_lens, o_latent, B, H, C, R,
                                    l->block_size, l->mla_scale, threads);
    if (status != 0) return -2;
    /* values [H, B, Dv] = o_latent [H, B, C] (rows H C apart) x w_uv [H, Dv, C] */
    met_product(o_latent, C, H * C, l->mla_kv_b + Dn * C, (Dn + Dv) * C, C, 0, values, H, B, Dv, C, threads);
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            memcpy(o_rows + b * H * Dv + h * Dv, values + (h * B + b) * Dv, sizeof(float) * (size_t)Dv);
    met_product(o_rows, 0, H * Dv, l->mla_o_proj, 0, H * Dv, 0, out, 1, B, D, H * Dv, threads);
    return 0;
}

/* The feed-forward of normed x [B, D] -> out [B, D] (DenseMLP.forward, MoE.forward's decode rows). */
static int feed_forward(const DecodeLayer *l, const float *x, int64_t B, int64_t D, float *out, float *scratch,
                        int threads) {
    if (!l->moe) return met_swiglu(x, B, D, l->gate_up, l->down, l->intermediate, 0, 0, out, threads);
    int64_t *ids = (int64_t *)scratch;
    float *weights = scratch + 2 * B * l->top_k, *shared = weights + B * l->top_k;
    int status = met_sigmoid_route(x, B, D, l->router, 0, l->router_bias, l->experts, l->groups, l->topk_group,
                                   l->top_k, (int)l->renormalize, l->scaling, ids, weights, threads);
    if (status == 0)
        status = met_routed_experts(x, B, D, ids, weights, l->top_k, l->experts_gate_up, l->experts_down,
                                    l->experts, l->expert_intermediate, 0, 0, out, threads);
    if (status == 0 && l->gate_up != NULL) {
        status = met_swiglu(x, B, D, l->gate_up, l->down, l->intermediate, 0, 0, shared, threads);
        for (int64_t i = 0; i < B * D; i++) out[i] = out[i] + shared[i];
    }
    return status;
}

/* x: fp32 [B, D], one decode row per sequence, advanced in place through `count` layers; slots [B] (the
 * recurrent layers' state slots), slot_mapping [B] (each row's flat latent cache index), block_tables
 * [B, *] int64 rows table_stride apart, context_lens [B]. Returns 0, -1 for a bad expert id, -2 without
 * scratch memory. */
int met_decode_layers(float *x, int64_t B, int64_t D, const DecodeLayer *layers, int64_t count, const int64_t *slots,
                      const int64_t *slot_mapping, const int64_t *block_tables, int64_t table_stride,
                      const int64_t *context_lens, int64_t scratch_floats, int threads) {
    float *normed = malloc(sizeof(float) * (size_t)(2 * B * D + scratch_floats));
    if (normed == NULL) return -2;
    float *block_out = normed + B * D, *scratch = block_out + B * D;
    int status = 0;
    for (int64_t i = 0; i < count && status == 0; i++) {
        const DecodeLayer *l = layers + i;
        met_rms_norm(x, D, l->input_norm, normed, B, D, l->norm_eps, threads);
        if (l->attention == 0)
            status = met_kda_decode_layer(normed, B, D, l->kda_in_proj, l->kda_conv_weight, l->conv_width,
                                          l->conv_pool, l->kda_f_b, l->kda_dt_bias, l->kda_neg_a, l->kda_g_b,
                                          l->kda_o_norm, l->norm_eps, l->kda_o_proj, l->state_pool, slots,
                                          l->kda_heads, l->kda_head_dim, l->kda_scale, block_out, threads);
        else
            status = mla_rows(l, normed, B, D, slot_mapping, block_tables, table_stride, context_lens, block_out,
                              scratch, threads);
        if (status != 0) break;
        for (int64_t j = 0; j < B * D; j++) x[j] = x[j] + block_out[j];
        met_rms_norm(x, D, l->post_norm, normed, B, D, l->norm_eps, threads);
        status = feed_forward(l, normed, B, D, block_out, scratch, threads);
        if (status != 0) break;
        for (int64_t j = 0; j < B * D; j++) x[j] = x[j] + block_out[j];
    }
    free(normed);
    return status;
}
