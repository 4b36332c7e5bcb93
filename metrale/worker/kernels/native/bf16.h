/* bf16 <-> fp32 as torch converts them: widening is exact (a bf16 value is the top half of an fp32 one);
 * narrowing rounds to nearest, ties to even, and keeps a NaN a (quiet) NaN. */
#ifndef MET_BF16_H
#define MET_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t value) {
    uint32_t bits = (uint32_t)value << 16;
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

static inline uint16_t float_to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x0040u);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* value rounded to the nearest bf16, as fp32. */
static inline float bf16_rounded(float value) { return bf16_to_float(float_to_bf16(value)); }

#endif
