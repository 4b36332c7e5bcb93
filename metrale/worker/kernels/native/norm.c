/* RMS norms over the rows of a matrix (fp32): met_rms_norm and met_gated_rms_norm (the KDA output's norm,
 * with a sigmoid gate), and met_rms_norm_bf16 (the layers' norms of a bf16 model). One pass over each row's
 * sum of squares, one pass writing it out.
 *
 * A row's sum of squares is taken in one fixed order, whatever the row's place in the batch or the
 * thread count: 16 partial sums (lane j adds x[j], x[j+16], ...; the compiler makes them one vector
 * register), folded pairwise (8+8, 4+4, 2+2, 1+1), then the tail. Built with -ffp-contract=off, so no
 * product is fused into a sum. The results agree with the torch references (metrale/worker/kernels/norm.py)
 * to rounding, not bit for bit: torch sums in another order, and the gate's sigmoid takes exp.h's exp.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "exp.h"

#define LANES 16

/* Rows are spread over threads only from this many elements in all (a decode step's [64, 512] is 32K). */
#define PARALLEL_MIN_ELEMENTS (1 << 17)

static float sum_of_squares(const float *restrict x, int64_t D) {
    float partial[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= D; i += LANES) {
        for (int j = 0; j < LANES; j++) partial[j] += x[i + j] * x[i + j];
    }
    for (int width = LANES / 2; width >= 1; width /= 2) {
        for (int j = 0; j < width; j++) partial[j] += partial[j + width];
    }
    float sum = partial[0];
    for (; i < D; i++) sum += x[i] * x[i];
    return sum;
}

static float inverse_rms(const float *restrict x, int64_t D, float eps) {
    return 1.0f / sqrtf(sum_of_squares(x, D) / (float)D + eps);
}

/* x: [rows, D], rows x_stride apart; weight: [D]; out: [rows, D] contiguous.
 * out = (x * rsqrt(mean(x^2) + eps)) * weight. */
void met_rms_norm(const float *x, int64_t x_stride, const float *weight, float *out, int64_t rows, int64_t D,
                  float eps, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * D >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *restrict row = x + r * x_stride;
        float *restrict o = out + r * D;
        float inv = inverse_rms(row, D, eps);
        for (int64_t d = 0; d < D; d++) o[d] = (row[d] * inv) * weight[d];
    }
}

/* x, gate: [rows, D], rows x_stride and gate_stride apart; weight: [D]; out: [rows, D] contiguous.
 * out = ((x * rsqrt(mean(x^2) + eps)) * weight) * sigmoid(gate). */
void met_gated_rms_norm(const float *x, int64_t x_stride, const float *gate, int64_t gate_stride,
                        const float *weight, float *out, int64_t rows, int64_t D, float eps, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * D >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *restrict row = x + r * x_stride;
        const float *restrict g = gate + r * gate_stride;
        float *restrict o = out + r * D;
        float inv = inverse_rms(row, D, eps);
        for (int64_t d = 0; d < D; d++) o[d] = ((row[d] * inv) * weight[d]) * (1.0f / (1.0f + met_expf(-g[d])));
    }
}

/* x: bf16 [rows, D], rows x_stride apart; weight: bf16 [D]; out: bf16 [rows, D] contiguous.
 * out = bf16(bf16(x * rsqrt(mean(x^2) + eps)) * weight): the normalised value is rounded to bf16 before the
 * weight multiplies it, as kernels/norm.py:rms_norm does in bf16 (the mean as met_rms_norm takes it). */
void met_rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *weight, uint16_t *out, int64_t rows,
                       int64_t D, float eps, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * D >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *restrict row = x + r * x_stride;
        uint16_t *restrict o = out + r * D;
        float wide[D];
        for (int64_t d = 0; d < D; d++) wide[d] = bf16_to_float(row[d]);
        float inv = inverse_rms(wide, D, eps);
        for (int64_t d = 0; d < D; d++) {
            float normed = bf16_to_float(float_to_bf16(wide[d] * inv));
            o[d] = float_to_bf16(normed * bf16_to_float(weight[d]));
        }
    }
}
