/* exp(x) in plain float arithmetic, so that a loop calling it vectorizes (libm's expf is a call per
 * element, about half of a one-row conv step's time) and gives every element the same bits in the
 * vector body and the scalar tail: only IEEE additions, multiplications, floor and integer shifts, with
 * products left unfused (the library is built with -ffp-contract=off).
 *
 * Cody–Waite range reduction x = n ln2 + r, |r| <= ln2/2, then a degree-6 polynomial for exp(r) (the
 * Cephes coefficients) scaled by 2^n built in the exponent bits. Within 2 ulp of exp over the clamped
 * range; inputs are clamped to [-87.3, 88.3], so exp(x) stays a finite normal float (the callers divide
 * by 1 + exp(-x) or multiply by exp(g), where the clamp changes nothing above 1e-37).
 */
#ifndef MET_EXP_H
#define MET_EXP_H

#include <math.h>
#include <stdint.h>

static inline float met_expf(float x) {
    x = x < -87.3f ? -87.3f : x;
    x = x > 88.3f ? 88.3f : x;
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

#endif
