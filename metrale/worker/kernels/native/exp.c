/* met_expf over an array: exp.h's exp, exported so tests can hold it to exp (tests/worker/kernels/native). */
#include <stdint.h>

#include "exp.h"

void met_exp(const float *restrict x, float *restrict y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = met_expf(x[i]);
}
