/* A KDA layer's decode rows in one call (met_kda_decode_layer): the input projection, the short conv, the
 * forget gate's decay, beta, the recurrence, the output gate, the gated norm and the output projection.
 * One stream's decode step issued these as ~50 torch operators a layer, whose dispatch cost more than the
 * layer's reads of its weights and state (bench/decode.py --profile).
 *
 * Every piece is the one the layer's op-by-op path (layers/kda.py, fp32) runs on decode rows — the
 * one-order products (met_product), met_conv_update, met_kda_decode, met_gated_rms_norm, and the gates'
 * element-wise functions below, which that path calls too (met_softplus_decay, met_sigmoid) — in the same
 * order on the same values, so a row gets the same bits through either: a decode row here is the bitwise
 * twin of the same row verified by speculation or decoded beside prefill chunks, which take the op-by-op
 * path.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "exp.h"

void met_product(const float *x, int64_t x_group, int64_t x_row, const void *w, int64_t w_group, int64_t w_row,
                 int bf16, float *out, int64_t G, int64_t M, int64_t N, int64_t K, int threads);
void met_conv_update(float *pool, const int64_t *slots, const float *x, int64_t x_stride, const float *weight,
                     float *out, int64_t B, int64_t D, int64_t W, int threads);
void met_kda_decode(float *pool, const int64_t *slots, const float *q, const float *k, const float *v,
                    const float *g, const float *beta, float *o, int64_t B, int64_t H, int64_t K, int64_t V,
                    float scale, int threads);
void met_gated_rms_norm(const float *x, int64_t x_stride, const float *gate, int64_t gate_stride,
                        const float *weight, float *out, int64_t rows, int64_t D, float eps, int threads);

/* torch's softplus with threshold 20: x above it stays x, else log1p(exp(x)) (exp.h's exp, libm's log1p). */
static inline float softplus(float x) { return x > 20.0f ? x : log1pf(met_expf(x)); }

/* f: [rows, H * K] rows f_stride apart; dt_bias: [H * K]; neg_a: [H] (-exp(A_log)); out: [rows, H * K].
 * out[r, h * K + c] = neg_a[h] * softplus(f[r, h * K + c] + dt_bias[h * K + c]): KDA's per-channel log
 * decay (layers/kda.py's _log_decay). */
void met_softplus_decay(const float *f, int64_t f_stride, const float *dt_bias, const float *neg_a, float *out,
                        int64_t rows, int64_t H, int64_t K) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < H * K; i++) out[r * H * K + i] = neg_a[i / K] * softplus(f[r * f_stride + i] + dt_bias[i]);
}

/* x: fp32 [B, D] contiguous, one decode row per sequence; the layer's fp32 weights, contiguous:
 * in_proj [3L + 2K + H, D] (q, k, v, forget-gate down, output-gate down, beta; L = H * K), conv_weight
 * [3L, W], f_b [L, K], dt_bias [L], neg_a [H], g_b [L, K], o_norm [K], o_proj [D, L]; conv_pool
 * [P, 3L, W - 1] and state_pool [P, H, K, K] advanced in place at slots [B]; out: fp32 [B, D].
 * Returns 0, or -2 without scratch memory. */
int met_kda_decode_layer(const float *x, int64_t B, int64_t D, const float *in_proj, const float *conv_weight,
                         int64_t W, float *conv_pool, const float *f_b, const float *dt_bias, const float *neg_a,
                         const float *g_b, const float *o_norm, float eps, const float *o_proj, float *state_pool,
                         const int64_t *slots, int64_t H, int64_t K, float scale, float *out, int threads) {
    int64_t L = H * K, P = 3 * L + 2 * K + H;
    float *scratch = malloc(sizeof(float) * (size_t)(B * (P + 10 * L + H))); /* the rows below */
    if (scratch == NULL) return -2;
    float *proj = scratch, *qkv = proj + B * P, *q = qkv + B * 3 * L, *k = q + B * L, *v = k + B * L;
    float *decay = v + B * L, *beta = decay + B * L, *gate = beta + B * H, *core = gate + B * L,
          *normed = core + B * L;
    met_product(x, 0, D, in_proj, 0, D, 0, proj, 1, B, P, D, threads);
    met_conv_update(conv_pool, slots, proj, P, conv_weight, qkv, B, 3 * L, W, threads);
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < L; i++) {
            q[b * L + i] = qkv[b * 3 * L + i];
            k[b * L + i] = qkv[b * 3 * L + L + i];
            v[b * L + i] = qkv[b * 3 * L + 2 * L + i];
        }
    met_product(proj + 3 * L, 0, P, f_b, 0, K, 0, gate, 1, B, L, K, threads); /* f, before its decay */
    met_softplus_decay(gate, L, dt_bias, neg_a, decay, B, H, K);
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++) beta[b * H + h] = 1.0f / (1.0f + met_expf(-proj[b * P + 3 * L + 2 * K + h]));
    met_kda_decode(state_pool, slots, q, k, v, decay, beta, core, B, H, K, K, scale, threads);
    met_product(proj + 3 * L + K, 0, P, g_b, 0, K, 0, gate, 1, B, L, K, threads);
    met_gated_rms_norm(core, K, gate, K, o_norm, normed, B * H, K, eps, threads);
    met_product(normed, 0, L, o_proj, 0, L, 0, out, 1, B, D, L, threads);
    free(scratch);
    return 0;
}
