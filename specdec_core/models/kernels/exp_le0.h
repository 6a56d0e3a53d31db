/* e^x for x <= 0 in float32, for kquant.c (the attention's softmax) and step_ops.c (the activation): x = (k + f) ln 2,
   k the nearest integer (a float's rounding, |t| < 2^22), 2^f = e^(f ln 2) by its series to the 7th power
   (|f ln 2| <= 0.35: error under 1e-8). Branch-free, no library call, no conversion to int but the exponent's bits, so
   that it vectorises on any x86 build; built without contraction, every build computes the same bits. */
#ifndef SPECDEC_EXP_LE0_H
#define SPECDEC_EXP_LE0_H
#include <stdint.h>
#include <string.h>

static inline float exp_le0(float x) {
    const float t = (x < -87.f ? -87.f : x) * 1.44269504088896341f, k = (t + 12582912.f) - 12582912.f;
    const float f = (t - k) * 0.693147180559945f;
    float p = 1.f / 5040.f;
    p = p * f + 1.f / 720.f;
    p = p * f + 1.f / 120.f;
    p = p * f + 1.f / 24.f;
    p = p * f + 1.f / 6.f;
    p = p * f + 0.5f;
    p = p * f + 1.f;
    p = p * f + 1.f;
    const int32_t bits = ((int32_t)k + 127) << 23;
    float two_k;
    memcpy(&two_k, &bits, 4);
    return p * two_k;
}

#endif
