/* The small operations of the written-out forwards (step.py), each one call for a layer's rows.

   A step of the 0.5B draft reads its int4 weights in 97 products; between them PyTorch ran some twenty small
   operations a layer (norms, the rotation, the cache writes, the activation), each a dispatch of a few
   microseconds for a few thousand numbers: a large share of a step on a few cores. Here each run of them is one call.
   Two sets: the draft's activations come and go in bfloat16 (its int4 products' type), the exact target's in
   float32 (its Q4_K/Q6_K products'); sums run in float32, in order, and the residual stream stays in float32.
   Each row is computed alone, the same whatever rows come with it: the target's step and pass agree bit for bit.
   Plain C, without fast-math or contraction: the compiler vectorises the loops (a norm's sum runs in 16 lanes, then
   halves), so any build, AVX-512 or not, computes the same bits. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "exp_le0.h"

static inline float from_bf16(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t to_bf16(float f) {  /* round to nearest even; the values here are finite */
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

static inline float from_f32(float v) { return v; }
static inline float to_f32(float f) { return f; }

/* h [n][dim] float32 += add [n][dim] (NULL: nothing to add); out [n][dim] = rmsnorm(h) * weight */
#define ADD_NORM(name, T, from, to)                                                                                  \
void name(float* h, const T* add, const T* weight, int n, int dim, float eps, T* out) {                              \
    for (int r = 0; r < n; r++) {                                                                                    \
        float* row = h + (size_t)r * dim;                                                                            \
        if (add) {                                                                                                   \
            const T* a = add + (size_t)r * dim;                                                                      \
            for (int i = 0; i < dim; i++) row[i] += from(a[i]);                                                      \
        }                                                                                                            \
        float lanes[16] = {0};  /* in 16 lanes, then halves: the compiler may vectorise a sum in this order */       \
        for (int i = 0; i < dim; i++) lanes[i & 15] += row[i] * row[i];                                              \
        for (int w = 8; w; w >>= 1)                                                                                  \
            for (int l = 0; l < w; l++) lanes[l] += lanes[l + w];                                                    \
        float inv = 1.f / sqrtf(lanes[0] / dim + eps);                                                               \
        for (int i = 0; i < dim; i++) out[(size_t)r * dim + i] = to(row[i] * inv * from(weight[i]));                 \
    }                                                                                                                \
}

/* qkv [n][(heads + 2 kv_heads) d]: the rows' queries, keys and values, head after head. cos, sin [n][d] float32: each
   row's rotation (the two halves of a head rotate together). Writes q [heads][n][d], rotated, and each row's key
   (rotated) and value at position length + row of keys, values [kv_heads][room][d]. Nothing written overlaps qkv
   (restrict: so the rotation vectorises for float32 too). */
#define ROTATE_WRITE(name, T, from, to)                                                                              \
void name(const T* restrict qkv, const float* cos, const float* sin, int n, int heads, int kv_heads, int d,          \
          T* restrict q, T* restrict keys, T* values, int room, int length) {                                        \
    int width = (heads + 2 * kv_heads) * d, half = d / 2;                                                            \
    for (int r = 0; r < n; r++) {                                                                                    \
        const T* row = qkv + (size_t)r * width;                                                                      \
        const float *c = cos + (size_t)r * d, *s = sin + (size_t)r * d;                                              \
        for (int h = 0; h < heads + kv_heads; h++) {                                                                 \
            const T* x = row + (size_t)h * d;                                                                        \
            T* dst = h < heads ? q + ((size_t)h * n + r) * d : keys + ((size_t)(h - heads) * room + length + r) * d; \
            for (int i = 0; i < half; i++) {                                                                         \
                float a = from(x[i]), b = from(x[i + half]);                                                         \
                dst[i] = to(a * c[i] - b * s[i]);                                                                    \
                dst[i + half] = to(b * c[i + half] + a * s[i + half]);                                               \
            }                                                                                                        \
        }                                                                                                            \
        for (int h = 0; h < kv_heads; h++)                                                                           \
            memcpy(values + ((size_t)h * room + length + r) * d, row + (size_t)(heads + kv_heads + h) * d,           \
                   sizeof(T) * (size_t)d);                                                                           \
    }                                                                                                                \
}

/* gate_up [n][2 inter] (gate, then up) -> out [n][inter] = silu(gate) * up */
#define SILU_MUL(name, T, from, to)                                                                                  \
void name(const T* gate_up, int n, int inter, T* out) {                                                              \
    for (int r = 0; r < n; r++) {                                                                                    \
        const T *g = gate_up + (size_t)r * 2 * inter, *u = g + inter;                                                \
        for (int i = 0; i < inter; i++) {                                                                            \
            float x = from(g[i]);                                                                                    \
            float e = exp_le0(-fabsf(x));  /* silu(x) = x sigmoid(x), sigmoid from e^-|x| without overflow */        \
            float sig = (x >= 0 ? 1.f : e) / (1.f + e);                                                              \
            out[(size_t)r * inter + i] = to(x * sig * from(u[i]));                                                   \
        }                                                                                                            \
    }                                                                                                                \
}

ADD_NORM(add_norm, uint16_t, from_bf16, to_bf16)
ROTATE_WRITE(rotate_write, uint16_t, from_bf16, to_bf16)
SILU_MUL(silu_mul, uint16_t, from_bf16, to_bf16)
ADD_NORM(add_norm_f32, float, from_f32, to_f32)
ROTATE_WRITE(rotate_write_f32, float, from_f32, to_f32)
SILU_MUL(silu_mul_f32, float, from_f32, to_f32)
