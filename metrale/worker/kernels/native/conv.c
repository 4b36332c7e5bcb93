/* Depthwise causal short convolution with SiLU over a slot-indexed state pool: a decode step for a batch
 * (met_conv_update) and a varlen prefill (met_conv_prefill).
 *
 * A sequence's state is its last W-1 inputs per channel, oldest first: pool[slots[s]] is [D, W-1]. The
 * taps are mixed oldest first, one rounded product at a time and without fused multiply-adds (built
 * with -ffp-contract=off), in the order of the torch reference metrale/worker/kernels/conv.py, so both
 * entry points round a token's output alike. SiLU's exp is exp.h's (vectorized; within 2 ulp of exp),
 * so the output agrees with the reference's to rounding, not bit for bit.
 */
#include <stdint.h>
#include <stdlib.h>

#include "exp.h"

/* The common width, written out so the compiler vectorizes over channels. */
static void step_width4(float *restrict state, const float *restrict x, const float *restrict taps,
                        float *restrict out, int64_t D) {
    for (int64_t d = 0; d < D; d++) {
        float *restrict s = state + 3 * d;
        const float *restrict t = taps + 4 * d;
        float s0 = s[0], s1 = s[1], s2 = s[2], xd = x[d];
        float mixed = s0 * t[0];
        mixed += s1 * t[1];
        mixed += s2 * t[2];
        mixed += xd * t[3];
        s[0] = s1;
        s[1] = s2;
        s[2] = xd;
        out[d] = met_silu(mixed);
    }
}

static void step_any_width(float *restrict state, const float *restrict x, const float *restrict taps,
                           float *restrict out, int64_t D, int64_t W) {
    for (int64_t d = 0; d < D; d++) {
        float *s = state + d * (W - 1);
        const float *t = taps + d * W;
        float mixed = s[0] * t[0];
        for (int64_t i = 1; i < W - 1; i++) mixed += s[i] * t[i];
        mixed += x[d] * t[W - 1];
        for (int64_t i = 0; i < W - 2; i++) s[i] = s[i + 1];
        s[W - 2] = x[d];
        out[d] = met_silu(mixed);
    }
}

/* A decode step spreads over threads only from this many channels in all (B * D): below it, waking a
 * second thread costs more than the step (one stream's step is a few microseconds). */
#define PARALLEL_MIN_CHANNELS 65536

/* x: [B, D] rows x_stride apart; out: [B, D]; weight: [D, W] with W >= 2; pool: [P, D, W-1]; slots: [B]. */
void met_conv_update(float *pool, const int64_t *slots, const float *x, int64_t x_stride, const float *weight,
                     float *out, int64_t B, int64_t D, int64_t W, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (B * D >= PARALLEL_MIN_CHANNELS)
    for (int64_t b = 0; b < B; b++) {
        float *state = pool + slots[b] * D * (W - 1);
        if (W == 4) {
            step_width4(state, x + b * x_stride, weight, out + b * D, D);
        } else {
            step_any_width(state, x + b * x_stride, weight, out + b * D, D, W);
        }
    }
}

/* One sequence: rows [start, end) of x. history [(W-1) * D] holds the inputs before the sequence's first
 * row, oldest first and channel-contiguous; columns [W * D] the taps, tap-major. */
static void prefill_sequence(const float *restrict x, int64_t x_stride, int64_t start, int64_t end,
                             const float *restrict history, const float *restrict columns, float *restrict out,
                             int64_t D, int64_t W) {
    for (int64_t t = start; t < end; t++) {
        float *restrict o = out + t * D;
        for (int64_t w = 0; w < W; w++) {
            int64_t back = t - start - (W - 1) + w; /* the tap's input, relative to the first row */
            const float *restrict input = back >= 0 ? x + (start + back) * x_stride : history + (W - 1 + back) * D;
            const float *restrict column = columns + w * D;
            if (w == 0) {
                for (int64_t d = 0; d < D; d++) o[d] = input[d] * column[d];
            } else {
                for (int64_t d = 0; d < D; d++) o[d] += input[d] * column[d];
            }
        }
        for (int64_t d = 0; d < D; d++) o[d] = met_silu(o[d]);
    }
}

/* x: [N, D] rows x_stride apart, sequence s owning rows cu_seqlens[s] .. cu_seqlens[s+1] (each >= 1);
 * columns: [W, D] (the weight transposed); out: [N, D]; pool: [P, D, W-1]; slots, has_initial_state: [S]. */
int met_conv_prefill(float *pool, const int64_t *slots, const uint8_t *has_initial_state, const int64_t *cu_seqlens,
                     const float *x, int64_t x_stride, const float *columns, float *out, int64_t S, int64_t D,
                     int64_t W, int threads) {
    int failed = 0;
#pragma omp parallel for schedule(dynamic) num_threads(threads) reduction(| : failed)
    for (int64_t s = 0; s < S; s++) {
        float *history = malloc(sizeof(float) * (W - 1) * D);
        if (history == NULL) {
            failed = 1;
            continue;
        }
        float *state = pool + slots[s] * D * (W - 1);
        for (int64_t i = 0; i < W - 1; i++)
            for (int64_t d = 0; d < D; d++) history[i * D + d] = has_initial_state[s] ? state[d * (W - 1) + i] : 0.0f;
        int64_t start = cu_seqlens[s], end = cu_seqlens[s + 1];
        prefill_sequence(x, x_stride, start, end, history, columns, out, D, W);
        for (int64_t i = 0; i < W - 1; i++) { /* the last W-1 inputs, from the rows or still the history */
            int64_t back = end - start - (W - 1) + i;
            const float *input = back >= 0 ? x + (start + back) * x_stride : history + (W - 1 + back) * D;
            for (int64_t d = 0; d < D; d++) state[d * (W - 1) + i] = input[d];
        }
        free(history);
    }
    return failed;
}
