/* met_sigmoid over an array: 1 / (1 + exp(-x)) with exp.h's exp. Every element gets the same bits in the
 * vector body and the scalar tail (exp.h's promise), so an element's result does not depend on its place
 * in the array — torch's CPU sigmoid computes its vector body and its scalar tail differently, so a row's
 * sigmoid there changes in its last bits with the number of rows before it. */
#include <stdint.h>

#include "exp.h"

void met_sigmoid(const float *restrict x, float *restrict y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = 1.0f / (1.0f + met_expf(-x[i]));
}
