/* One depthwise causal short-conv step (with SiLU) per sequence over a slot-indexed state pool.
 *
 * A sequence's state is its last W-1 inputs per channel, oldest first: pool[slots[b]] is [D, W-1].
 * The taps are mixed oldest first, one rounded product at a time and without fused multiply-adds
 * (built with -ffp-contract=off), in the order of the torch reference metrale/worker/kernels/conv.py.
 */
#include <math.h>
#include <stdint.h>

static inline float silu(float x) { return x / (1.0f + expf(-x)); }

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
        out[d] = silu(mixed);
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
        out[d] = silu(mixed);
    }
}

/* x, out: [B, D]; weight: [D, W] with W >= 2; pool: [P, D, W-1]; slots: [B]; all contiguous fp32. */
void met_conv_update(float *pool, const int64_t *slots, const float *x, const float *weight, float *out, int64_t B,
                     int64_t D, int64_t W, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b = 0; b < B; b++) {
        float *state = pool + slots[b] * D * (W - 1);
        if (W == 4) {
            step_width4(state, x + b * D, weight, out + b * D, D);
        } else {
            step_any_width(state, x + b * D, weight, out + b * D, D, W);
        }
    }
}
