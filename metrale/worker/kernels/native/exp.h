/* exp(x) in plain float arithmetic, so that a loop calling it vectorizes (libm's expf is a call per
 * element, about half of a one-row conv step's time) and gives every element the same bits in the
 * vector body and the scalar tail: only IEEE additions, multiplications, floor and integer shifts, with
 * products left unfused (the library is built with -ffp-contract=off).
 *
 * Cody–Waite range reduction x = n ln2 + r, |r| <= ln2/2, then a degree-6 polynomial for exp(r) (the
 * Cephes coefficients) scaled by 2^n built in the exponent bits. Within 2 ulp of exp over the clamped
 * range [-MET_EXP_LIMIT, MET_EXP_LIMIT].
 *
 * Why the clamp is that narrow: a vectorized caller computes both arms of the clamp for every lane, the
 * clamped arm with exp's constant folded in (SiLU's x / (1 + exp(-x)) becomes x / (1 + exp(LIMIT)) in
 * every lane, then a blend). At the float limits (exp(88.3) = 2e38) those lanes come out denormal, and an
 * Intel core takes a microcode assist on each denormal result: the conv's SiLU cost 13 ns an element on
 * a Xeon against 1.1 ns with this clamp (AMD cores take no assist, which hid it). At +-40, exp(40) = 2e17,
 * so a speculated lane is denormal only for |x| < 1e-21. The callers lose nothing: the KDA decay exp(g)
 * of g < -40 is 4e-18 instead of smaller (invisible beside the state's fp32 update), and SiLU or a
 * sigmoid of |x| > 40 differs from the exact value by less than 2e-16.
 */
#ifndef MET_EXP_H
#define MET_EXP_H

#include <math.h>
#include <stdint.h>

#define MET_EXP_LIMIT 40.0f

static inline float met_expf(float x) {
    x = x < -MET_EXP_LIMIT ? -MET_EXP_LIMIT : x;
    x = x > MET_EXP_LIMIT ? MET_EXP_LIMIT : x;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float r2 = r * r;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r2 + r + 1.0f;
    union {
        int32_t bits;
        float value;
    } scale = {.bits = ((int32_t)n + 127) << 23};
    return p * scale.value;
}

/* SiLU, x * sigmoid(x), as x / (1 + exp(-x)) with met_expf. */
static inline float met_silu(float x) { return x / (1.0f + met_expf(-x)); }

#endif
