/* SwiGLU feed-forward blocks over a forward's decode rows, each in one call: a dense MLP (met_swiglu) and a
 * mixture's routed experts (met_routed_experts). A decode step alone runs a few small products per block,
 * and issued one torch operator at a time their glue (the split, SiLU, the product, each expert's
 * weighting and sum) cost more than the products' reads of the weights (bench/decode.py --profile).
 *
 * The products are met_product's (product.c): every element summed in one order fixed by its length, so a
 * row's result depends on that row and the weights alone — the same bits for a lone decode row and the same
 * row among any number of others, which the routed experts keep by gathering each expert's rows and
 * multiplying them together. SiLU is exp.h's (met_silu), so a row agrees with the torch reference
 * (layers/mlp.py) to rounding, not bit for bit. round_bf16 (a bf16 model's rows): every intermediate is
 * rounded to bf16 where the reference's bf16 tensors round it — the products' outputs, SiLU, its product
 * with the up half, and each expert's output before its routing weight multiplies it in fp32.
 */
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "exp.h"

void met_product(const float *x, int64_t x_group, int64_t x_row, const void *w, int64_t w_group, int64_t w_row,
                 int bf16, float *out, int64_t G, int64_t M, int64_t N, int64_t K, int threads);

static inline float as_activation(float value, int round_bf16) { return round_bf16 ? bf16_rounded(value) : value; }

/* out [M, D] = down(silu(gate) * up) for x [M, D], with [gate | up] = gate_up(x) [M, 2I] in `gated` and
 * the hidden rows [M, I] in `hidden` (scratch, both). */
static void swiglu(const float *x, int64_t M, int64_t D, const void *gate_up, const void *down, int64_t I,
                   int bf16_weights, int round_bf16, float *gated, float *hidden, float *out, int threads) {
    met_product(x, 0, D, gate_up, 0, D, bf16_weights, gated, 1, M, 2 * I, D, threads);
    for (int64_t m = 0; m < M; m++) {
        const float *gate = gated + m * 2 * I, *up = gate + I;
        float *h = hidden + m * I;
        for (int64_t i = 0; i < I; i++) {
            float g = as_activation(gate[i], round_bf16), u = as_activation(up[i], round_bf16);
            h[i] = as_activation(as_activation(met_silu(g), round_bf16) * u, round_bf16);
        }
    }
    met_product(hidden, 0, I, down, 0, I, bf16_weights, out, 1, M, D, I, threads);
}

/* x: fp32 [M, D] contiguous; gate_up: [2I, D], down: [D, I], both fp32 or bf16 (bf16_weights), contiguous;
 * out: fp32 [M, D] (not rounded: the caller casts it to the model's dtype). Returns 0, or -2 when scratch
 * memory cannot be had. */
int met_swiglu(const float *x, int64_t M, int64_t D, const void *gate_up, const void *down, int64_t I,
               int bf16_weights, int round_bf16, float *out, int threads) {
    float *gated = malloc(sizeof(float) * (size_t)(M * 3 * I));
    if (gated == NULL) return -2;
    swiglu(x, M, D, gate_up, down, I, bf16_weights, round_bf16, gated, gated + M * 2 * I, out, threads);
    free(gated);
    return 0;
}

/* x: fp32 [M, D] contiguous; ids: int64 [M, top_k] (distinct in a row), weights: fp32 [M, top_k];
 * experts_gate_up: [E, 2I, D], experts_down: [E, D, I], fp32 or bf16, contiguous; out: fp32 [M, D].
 * out[m] = sum over j of weights[m, j] * expert_{ids[m, j]}(x[m]), the terms added to 0 in expert order
 * (layers/mlp.py's RoutedExperts._routed_experts: its pairs sorted by expert, then index_add_). Each
 * expert multiplies all its rows at once. Returns 0; -1 for an id outside [0, E); -2 without memory. */
int met_routed_experts(const float *x, int64_t M, int64_t D, const int64_t *ids, const float *weights,
                       int64_t top_k, const void *experts_gate_up, const void *experts_down, int64_t E, int64_t I,
                       int bf16_weights, int round_bf16, float *out, int threads) {
    for (int64_t p = 0; p < M * top_k; p++)
        if (ids[p] < 0 || ids[p] >= E) return -1;
    size_t floats = (size_t)(M * (2 * D + 3 * I));
    float *scratch = malloc(sizeof(float) * floats);
    int64_t *pairs = malloc(sizeof(int64_t) * (size_t)M);
    if (scratch == NULL || pairs == NULL) {
        free(scratch);
        free(pairs);
        return -2;
    }
    float *rows = scratch, *gated = rows + M * D, *hidden = gated + M * 2 * I, *expert_out = hidden + M * I;
    int64_t element = bf16_weights ? 2 : 4;
    for (int64_t p = 0; p < M * D; p++) out[p] = 0.0f;
    for (int64_t e = 0; e < E; e++) {
        int64_t count = 0;
        for (int64_t p = 0; p < M * top_k; p++)
            if (ids[p] == e) pairs[count++] = p;
        if (count == 0) continue;
        for (int64_t r = 0; r < count; r++) {
            const float *source = x + (pairs[r] / top_k) * D;
            for (int64_t d = 0; d < D; d++) rows[r * D + d] = source[d];
        }
        const char *gate_up = (const char *)experts_gate_up + e * 2 * I * D * element;
        const char *down = (const char *)experts_down + e * D * I * element;
        swiglu(rows, count, D, gate_up, down, I, bf16_weights, round_bf16, gated, hidden, expert_out, threads);
        for (int64_t r = 0; r < count; r++) {
            float weight = weights[pairs[r]];
            float *o = out + (pairs[r] / top_k) * D;
            const float *y = expert_out + r * D;
            for (int64_t d = 0; d < D; d++) o[d] = o[d] + as_activation(y[d], round_bf16) * weight;
        }
    }
    free(scratch);
    free(pairs);
    return 0;
}
