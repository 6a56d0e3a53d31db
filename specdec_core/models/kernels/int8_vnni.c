/* The int8 target's product on x86 CPUs with AVX-512 VNNI: y = x W^T, W int8 [N, K] with a scale per output,
   each row of x rounded to int8 against its own largest magnitude.

   A row's output is the same, bit for bit, whatever rows come with it: each row is rounded alone, its integer
   dot products are exact in any order, and each output gets the same float operations (its integer sum, times
   its weight scale times the row's scale, plus its bias). That is what lets a verification pass reproduce a
   one-token step. The product reads each weight once for up to ROWS rows, so a pass of a few rows costs little
   more than a step, which waits on memory.

   Layout (int8_vnni_pack): N padded to a multiple of 32, [N / 16][K / 4][16 outputs][4 inputs]. vpdpbusd
   multiplies unsigned bytes by signed ones, so a row goes in as its int8 values plus 128, and 128 times each
   output's weight sum (colsum) is taken off the integer sum. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ROWS 6        /* rows per register tile: 2 x ROWS accumulators, two weight vectors, one broadcast */
#define AHEAD 4096    /* bytes of weights prefetched ahead: the loads of a tile come late behind its arithmetic */
#define INLINE static inline __attribute__((always_inline))

/* 32 outputs (w0, w1: 16 each) times `rows` rows of x (u8, K each) */
INLINE void tile(const int8_t* w0, const int8_t* w1, const uint8_t* x, int K, const int rows, __m512i* acc) {
    for (int r = 0; r < 2 * rows; r++) acc[r] = _mm512_setzero_si512();
    for (int k = 0; k < K / 4; k++) {
        _mm_prefetch((const char*)(w0 + (size_t)k * 64 + AHEAD), _MM_HINT_T0);
        _mm_prefetch((const char*)(w1 + (size_t)k * 64 + AHEAD), _MM_HINT_T0);
        __m512i a = _mm512_loadu_si512(w0 + (size_t)k * 64), b = _mm512_loadu_si512(w1 + (size_t)k * 64);
        for (int r = 0; r < rows; r++) {
            __m512i xv = _mm512_set1_epi32(*(const int32_t*)(x + (size_t)r * K + k * 4));
            acc[2 * r] = _mm512_dpbusd_epi32(acc[2 * r], xv, a);
            acc[2 * r + 1] = _mm512_dpbusd_epi32(acc[2 * r + 1], xv, b);
        }
    }
}

/* one row: two chains per output block, so that the adds do not wait on each other */
INLINE void tile1(const int8_t* w0, const int8_t* w1, const uint8_t* x, int K, __m512i* acc) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, b0 = a0, b1 = a0;
    const int32_t* xi = (const int32_t*)x;
    int k = 0;
    for (; k + 1 < K / 4; k += 2) {
        _mm_prefetch((const char*)(w0 + (size_t)k * 64 + AHEAD), _MM_HINT_T0);
        _mm_prefetch((const char*)(w1 + (size_t)k * 64 + AHEAD), _MM_HINT_T0);
        __m512i x0 = _mm512_set1_epi32(xi[k]), x1 = _mm512_set1_epi32(xi[k + 1]);
        a0 = _mm512_dpbusd_epi32(a0, x0, _mm512_loadu_si512(w0 + (size_t)k * 64));
        b0 = _mm512_dpbusd_epi32(b0, x0, _mm512_loadu_si512(w1 + (size_t)k * 64));
        a1 = _mm512_dpbusd_epi32(a1, x1, _mm512_loadu_si512(w0 + (size_t)(k + 1) * 64));
        b1 = _mm512_dpbusd_epi32(b1, x1, _mm512_loadu_si512(w1 + (size_t)(k + 1) * 64));
    }
    if (k < K / 4) {
        __m512i x0 = _mm512_set1_epi32(xi[k]);
        a0 = _mm512_dpbusd_epi32(a0, x0, _mm512_loadu_si512(w0 + (size_t)k * 64));
        b0 = _mm512_dpbusd_epi32(b0, x0, _mm512_loadu_si512(w1 + (size_t)k * 64));
    }
    acc[0] = _mm512_add_epi32(a0, a1);
    acc[1] = _mm512_add_epi32(b0, b1);
}

/* q [N][K] int8 (N a multiple of 32) -> w in the layout above, and each output's weight sum */
void int8_vnni_pack(const int8_t* q, int N, int K, int8_t* w, int32_t* colsum, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int n = 0; n < N; n++) {
        const int8_t* row = q + (size_t)n * K;
        int8_t* out = w + (size_t)(n / 16) * 16 * K + (n % 16) * 4;
        int32_t sum = 0;
        for (int k = 0; k < K; k += 4) {
            memcpy(out + (size_t)k * 16, row + k, 4);
            sum += row[k] + row[k + 1] + row[k + 2] + row[k + 3];
        }
        colsum[n] = sum;
    }
}

/* the largest magnitude in a row (a maximum: the same whatever the order) */
static float largest(const float* row, int K) {
    __m512 top = _mm512_setzero_ps();
    int k = 0;
    for (; k + 16 <= K; k += 16) top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_loadu_ps(row + k)));
    float t = _mm512_reduce_max_ps(top);
    for (; k < K; k++) { float v = row[k] < 0 ? -row[k] : row[k]; if (v > t) t = v; }
    return t;
}

/* x [M][K] float32, y [M][N] float32 (N padded); scale, bias [N] float32 (bias may be NULL), colsum [N] int32.
   Returns 0, or -1 when memory for the rounded rows could not be had. */
int int8_vnni_mm(const int8_t* w, const int32_t* colsum, const float* scale, const float* bias, const float* x,
                 int M, int N, int K, float* y, int threads) {
    uint8_t* xq = malloc((size_t)M * K);
    float* xs = malloc(sizeof(float) * (size_t)M);
    if (!xq || !xs) { free(xq); free(xs); return -1; }
    #pragma omp parallel for schedule(static) num_threads(threads) if (M >= 8)
    for (int m = 0; m < M; m++) {
        const float* row = x + (size_t)m * K;
        float top = largest(row, K);
        float inv = top > 0 ? 127.f / top : 0.f;
        for (int k = 0; k < K; k++) xq[(size_t)m * K + k] = (uint8_t)((int)__builtin_rintf(row[k] * inv) + 128);
        xs[m] = top / 127.f;
    }
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int pair = 0; pair < N / 32; pair++) {
        const int8_t* w0 = w + (size_t)pair * 32 * K;
        const int8_t* w1 = w0 + (size_t)16 * K;
        for (int m0 = 0; m0 < M; m0 += ROWS) {
            int rows = M - m0 < ROWS ? M - m0 : ROWS;
            const uint8_t* xr = xq + (size_t)m0 * K;
            __m512i acc[2 * ROWS];
            switch (rows) {  /* constant row counts, so that the accumulators stay in registers */
                case 1: tile1(w0, w1, xr, K, acc); break;
                case 2: tile(w0, w1, xr, K, 2, acc); break;
                case 3: tile(w0, w1, xr, K, 3, acc); break;
                case 4: tile(w0, w1, xr, K, 4, acc); break;
                case 5: tile(w0, w1, xr, K, 5, acc); break;
                default: tile(w0, w1, xr, K, ROWS, acc); break;
            }
            for (int r = 0; r < rows; r++)
                for (int h = 0; h < 2; h++) {
                    int n = pair * 32 + h * 16;
                    __m512i sum = _mm512_sub_epi32(acc[2 * r + h], _mm512_slli_epi32(_mm512_loadu_si512(colsum + n), 7));
                    __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(sum),
                                             _mm512_mul_ps(_mm512_loadu_ps(scale + n), _mm512_set1_ps(xs[m0 + r])));
                    if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n));
                    _mm512_storeu_ps(y + (size_t)(m0 + r) * N + n, v);
                }
        }
    }
    free(xq);
    free(xs);
    return 0;
}
