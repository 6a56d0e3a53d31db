/* The small operations of the written-out forwards (step.py), each one call for a layer's rows.

   A step of the 0.5B draft reads its int4 weights in 97 products; between them PyTorch ran some twenty small
   operations a layer (norms, the rotation, the cache writes, the activation, the attention), each a dispatch of a few
   microseconds for a few thousand numbers: a large share of a step on a few cores. Here each run of them is one call.
   Two sets: the draft's activations come and go in bfloat16 (its int4 products' type), the exact target's in
   float32 (its Q4_K/Q6_K products'); sums run in float32, in order, and the residual stream stays in float32.
   Each row is computed alone, the same whatever rows come with it: the target's step and pass agree bit for bit.
   Plain C, without fast-math or contraction: the compiler vectorises the loops (a norm's sum runs in 16 lanes, then
   halves), so any build, AVX-512 or not, computes the same bits. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
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

typedef float floats16 __attribute__((vector_size(64)));  /* 16 floats */
typedef float floats4 __attribute__((vector_size(16)));  /* 4 floats */

static inline floats16 load16(const float* p) {
    floats16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float sum16(floats16 v) {  /* its quarters, then their lanes, in a fixed order */
    floats4 q[4];
    memcpy(q, &v, sizeof v);
    const floats4 a = (q[0] + q[2]) + (q[1] + q[3]);
    return (a[0] + a[2]) + (a[1] + a[3]);
}

/* The draft's attention for one key/value head: its m = n g query vectors qs [m][d] (scaled; vector i n + r is query
   head i's row r), its keys k [length + n][d] and values v (float32) [length + n][d]; row r sees the first
   length + r + 1 positions. A key is read once for all query vectors; maxima and sums run in 16 lanes, and in two
   sums where a vector's products would wait for the one before. s [m][length + n]: scores. row: d floats. out [m][d]. */
static void attend_head(const float* qs, const uint16_t* k, const float* v, int m, int n, int d, int length,
                        float* s, float* row, float* out) {
    const int count = length + n;
    for (int j = 0; j < count; j++) {
        for (int t = 0; t < d; t++) row[t] = from_bf16(k[(size_t)j * d + t]);
        for (int x = 0; x < m; x++) {
            const float* qx = qs + (size_t)x * d;
            floats16 a = {0}, b = {0};
            for (int t = 0; t < d; t += 16) {
                if (t & 16) b += load16(qx + t) * load16(row + t);
                else a += load16(qx + t) * load16(row + t);
            }
            s[(size_t)x * count + j] = j > length + x % n ? -INFINITY : sum16(a + b);  /* a later row's position */
        }
    }
    for (int x = 0; x < m; x++) {
        float* sx = s + (size_t)x * count;
        float top[16], total[16] = {0};
        for (int l = 0; l < 16; l++) top[l] = -INFINITY;
        for (int j0 = 0; j0 < count; j0 += 16)
            for (int l = 0; l < 16 && j0 + l < count; l++) top[l] = sx[j0 + l] > top[l] ? sx[j0 + l] : top[l];
        for (int l = 1; l < 16; l++) top[0] = top[l] > top[0] ? top[l] : top[0];
        for (int j = 0; j < count; j++) sx[j] = exp_le0(sx[j] - top[0]);
        for (int j0 = 0; j0 < count; j0 += 16)
            for (int l = 0; l < 16 && j0 + l < count; l++) total[l] += sx[j0 + l];
        for (int l = 1; l < 16; l++) total[0] += total[l];
        for (int t = 0; t < d; t += 16) {  /* 16 outputs at a time, over the keys two by two */
            floats16 a = {0}, b = {0};
            int j = 0;
            for (; j + 1 < count; j += 2) {
                a += sx[j] * load16(v + (size_t)j * d + t);
                b += sx[j + 1] * load16(v + (size_t)(j + 1) * d + t);
            }
            if (j < count) a += sx[j] * load16(v + (size_t)j * d + t);
            a = (a + b) / total[0];
            memcpy(out + (size_t)x * d + t, &a, sizeof a);
        }
    }
}

/* The draft's attention: q [heads][n][d] (rotate_write's), keys and values [kv_heads][room][d]; row r sees the first
   length + r + 1 positions. out [n][heads][d]. Query head h reads key/value head h / (heads / kv_heads); the key/value
   heads run on `threads` threads. d: a multiple of 16. Returns 0, or -1 where memory for the scores could not be had. */
int grouped_attention(const uint16_t* q, const uint16_t* keys, const uint16_t* values, int n, int heads, int kv_heads,
                      int d, int room, int length, float scale, uint16_t* out, int threads) {
    const int g = heads / kv_heads, m = n * g, count = length + n;
    int failed = 0;
    #pragma omp parallel for schedule(static) num_threads(threads) if (kv_heads > 1)
    for (int h = 0; h < kv_heads; h++) {
        float* v = malloc(sizeof(float) * ((size_t)count * d + 2 * (size_t)m * d + (size_t)m * count + d));
        if (v) {
            float *qs = v + (size_t)count * d, *o = qs + (size_t)m * d, *s = o + (size_t)m * d, *row = s + (size_t)m * count;
            const size_t at = (size_t)h * room * d;
            for (size_t x = 0; x < (size_t)count * d; x++) v[x] = from_bf16(values[at + x]);
            for (size_t x = 0; x < (size_t)m * d; x++) qs[x] = from_bf16(q[(size_t)h * m * d + x]) * scale;
            attend_head(qs, keys + at, v, m, n, d, length, s, row, o);
            for (int x = 0; x < m; x++)
                for (int t = 0; t < d; t++)
                    out[((size_t)(x % n) * heads + (size_t)h * g + x / n) * d + t] = to_bf16(o[(size_t)x * d + t]);
        } else {
            #pragma omp atomic write
            failed = 1;
        }
        free(v);
    }
    return failed ? -1 : 0;
}
