/* Kimi's mixture-of-experts router over a forward's decode rows in one call (layers/mlp.py's MoE.route, the
 * torch twin, issues ~15 operators for a handful of numbers a row): sigmoid scores of the router product,
 * the experts chosen on score + bias within the best groups, their scores renormalized and scaled.
 *
 * The scores are the twin's bits (met_product's one-order product, met_sigmoid's formula), and so is the
 * choice, but for ties: an equal score goes to the lower expert id here, where torch's topk leaves the
 * choice to its implementation. A row's ids come out in ascending expert order and its weights are summed
 * in that order when renormalized (the twin sums them in topk's order: the same bits for top_k <= 2).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "exp.h"

void met_product(const float *x, int64_t x_group, int64_t x_row, const void *w, int64_t w_group, int64_t w_row,
                 int bf16, float *out, int64_t G, int64_t M, int64_t N, int64_t K, int threads);

/* The index of the largest value of v[0..n) not yet taken (taken[i] = 1), the lower index on ties; -1 when
 * every index is taken. -inf values are candidates like any other (a masked expert can still fill top_k). */
static int64_t largest_free(const float *v, const unsigned char *taken, int64_t n) {
    int64_t best = -1;
    for (int64_t i = 0; i < n; i++)
        if (!taken[i] && (best < 0 || v[i] > v[best])) best = i;
    return best;
}

/* x: fp32 [M, D] contiguous; router: [E, D] fp32 or bf16 (router_bf16); bias: fp32 [E]. E experts in
 * `groups` groups of E / groups, of which the topk_group with the largest sums of their two best choices
 * are kept. ids: int64 [M, top_k] (ascending), weights: fp32 [M, top_k] = the chosen experts' scores,
 * divided by their sum + 1e-20 when renormalize, times scaling. Returns 0, or -2 without memory. */
int met_sigmoid_route(const float *x, int64_t M, int64_t D, const void *router, int router_bf16, const float *bias,
                      int64_t E, int64_t groups, int64_t topk_group, int64_t top_k, int renormalize, float scaling,
                      int64_t *ids, float *weights, int threads) {
    float *scores = malloc(sizeof(float) * (size_t)(M * E * 2 + groups));
    unsigned char *taken = malloc((size_t)(E + groups));
    if (scores == NULL || taken == NULL) {
        free(scores);
        free(taken);
        return -2;
    }
    float *choice = scores + M * E, *group_score = choice + M * E;
    met_product(x, 0, D, router, 0, D, router_bf16, scores, 1, M, E, D, threads);
    int64_t per_group = E / groups;
    for (int64_t m = 0; m < M; m++) {
        float *s = scores + m * E, *c = choice + m * E;
        for (int64_t e = 0; e < E; e++) {
            s[e] = 1.0f / (1.0f + met_expf(-s[e]));
            c[e] = s[e] + bias[e];
        }
        if (topk_group < groups) {
            for (int64_t g = 0; g < groups; g++) {
                const float *in_group = c + g * per_group;
                for (int64_t i = 0; i < per_group; i++) taken[i] = 0;
                int64_t first = largest_free(in_group, taken, per_group);
                taken[first] = 1;
                group_score[g] = in_group[first] + in_group[largest_free(in_group, taken, per_group)];
            }
            unsigned char *kept = taken + E;
            for (int64_t g = 0; g < groups; g++) kept[g] = 0;
            for (int64_t j = 0; j < topk_group; j++) kept[largest_free(group_score, kept, groups)] = 1;
            for (int64_t g = 0; g < groups; g++)
                if (!kept[g])
                    for (int64_t i = 0; i < per_group; i++) c[g * per_group + i] = -INFINITY;
        }
        for (int64_t e = 0; e < E; e++) taken[e] = 0;
        for (int64_t j = 0; j < top_k; j++) taken[largest_free(c, taken, E)] = 1;
        int64_t *row_ids = ids + m * top_k;
        float *w = weights + m * top_k;
        float sum = 0.0f;
        for (int64_t e = 0, j = 0; e < E; e++)
            if (taken[e]) {
                row_ids[j] = e;
                w[j] = s[e];
                sum = sum + s[e];
                j++;
            }
        for (int64_t j = 0; j < top_k; j++) w[j] = (renormalize ? w[j] / (sum + 1e-20f) : w[j]) * scaling;
    }
    free(scores);
    free(taken);
    return 0;
}
