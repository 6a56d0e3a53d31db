/* The small operations of the draft's decoding step (step.py), each one call for a layer's rows.

   A step of the 0.5B draft reads its int4 weights in 97 products; between them PyTorch ran some twenty small
   operations a layer (norms, the rotation, the cache writes, the activation), each a dispatch of a few
   microseconds for a few thousand numbers: a quarter of a step on two cores. Here each run of them is one call.
   Activations come and go in bfloat16 (the int4 products' type); sums run in float32 and the residual stream
   stays in float32. Plain C: the compiler vectorises it for the CPU it is built on. */
#include <math.h>
#include <stdint.h>
#include <string.h>

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

/* e^x for x <= 0 in float32: 2^i times a polynomial for 2^f, f in [0, 1). Branch-free, so that it vectorises. */
static inline float exp_neg(float x) {
    float t = fmaxf(x, -87.f) * 1.44269504088896341f;
    float i = floorf(t), f = t - i;
    float p = 1.53533e-4f;
    p = p * f + 1.339887e-3f;
    p = p * f + 9.618437e-3f;
    p = p * f + 5.550332e-2f;
    p = p * f + 2.402264e-1f;
    p = p * f + 6.931472e-1f;
    p = p * f + 1.f;
    int32_t bits = ((int32_t)i + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

/* h [n][dim] float32 += add [n][dim] bfloat16 (NULL: nothing to add); out [n][dim] = rmsnorm(h) * weight */
void add_norm(float* h, const uint16_t* add, const uint16_t* weight, int n, int dim, float eps, uint16_t* out) {
    for (int r = 0; r < n; r++) {
        float* row = h + (size_t)r * dim;
        float sum = 0.f;
        if (add) {
            const uint16_t* a = add + (size_t)r * dim;
            for (int i = 0; i < dim; i++) row[i] += from_bf16(a[i]);
        }
        for (int i = 0; i < dim; i++) sum += row[i] * row[i];
        float inv = 1.f / sqrtf(sum / dim + eps);
        for (int i = 0; i < dim; i++) out[(size_t)r * dim + i] = to_bf16(row[i] * inv * from_bf16(weight[i]));
    }
}

/* qkv [n][(heads + 2 kv_heads) d] bfloat16: the rows' queries, keys and values, head after head. cos, sin [n][d]
   float32: each row's rotation (the two halves of a head rotate together). Writes q [heads][n][d], rotated, and
   each row's key (rotated) and value at position length + row of keys, values [kv_heads][room][d]. */
void rotate_write(const uint16_t* qkv, const float* cos, const float* sin, int n, int heads, int kv_heads, int d,
                  uint16_t* q, uint16_t* keys, uint16_t* values, int room, int length) {
    int width = (heads + 2 * kv_heads) * d, half = d / 2;
    for (int r = 0; r < n; r++) {
        const uint16_t* row = qkv + (size_t)r * width;
        const float *c = cos + (size_t)r * d, *s = sin + (size_t)r * d;
        for (int h = 0; h < heads + kv_heads; h++) {
            const uint16_t* x = row + (size_t)h * d;
            uint16_t* dst = h < heads ? q + ((size_t)h * n + r) * d
                                      : keys + ((size_t)(h - heads) * room + length + r) * d;
            for (int i = 0; i < half; i++) {
                float a = from_bf16(x[i]), b = from_bf16(x[i + half]);
                dst[i] = to_bf16(a * c[i] - b * s[i]);
                dst[i + half] = to_bf16(b * c[i + half] + a * s[i + half]);
            }
        }
        for (int h = 0; h < kv_heads; h++)
            memcpy(values + ((size_t)h * room + length + r) * d, row + (size_t)(heads + kv_heads + h) * d, 2 * (size_t)d);
    }
}

/* gate_up [n][2 inter] bfloat16 (gate, then up) -> out [n][inter] = silu(gate) * up */
void silu_mul(const uint16_t* gate_up, int n, int inter, uint16_t* out) {
    for (int r = 0; r < n; r++) {
        const uint16_t *g = gate_up + (size_t)r * 2 * inter, *u = g + inter;
        for (int i = 0; i < inter; i++) {
            float x = from_bf16(g[i]);
            float e = exp_neg(-fabsf(x));  /* silu(x) = x sigmoid(x), sigmoid from e^-|x| without overflow */
            float sig = x >= 0 ? 1.f / (1.f + e) : e / (1.f + e);
            out[(size_t)r * inter + i] = to_bf16(x * sig * from_bf16(u[i]));
        }
    }
}
