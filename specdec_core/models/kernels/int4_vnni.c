/* The int4 draft's product on x86 CPUs with AVX-512 VNNI: y = x W^T, W in int4 with a step and a minimum per
   group of 32 inputs (w = low + q step, q in 0..15), each row of x rounded to int8 per group of 32.

   A draft step waits on memory: it reads 309 MB of weights for one token. This kernel streams them faster than
   PyTorch's int4 one, because it prefetches its weights ahead of the arithmetic and multiplies bytes with vpdpbusd
   instead of widening each weight to float. Rounding the activations moves a draft's logits a little more than
   bfloat16 ones would; the draft only changes how many drafts are accepted, never the output.

   Layout (pack in int4_vnni.py): [N / 4][K / 128] tiles of 320 bytes, for 4 outputs and 128 inputs: 256 bytes
   of weights, four 64-byte vectors L = 0..3 of 16 lanes (lane = output * 4 + group of 32), each lane's four
   bytes holding inputs 4 L .. 4 L + 3 of its group in the low nibbles and 4 L + 16 .. in the high ones; then 16
   half-precision steps and 16 minimums, in lane order. A row's int8 inputs are laid out to match (prepare). */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define AHEAD 4096    /* bytes of weights prefetched ahead of the arithmetic */
#define TILE 320
#define ROWS 8        /* rows per pass over the weights */

static inline float from_bf16(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

/* x [M][K] bfloat16 -> xq [M][Kp] int8 in the tiles' input order, scale [M][Kp / 32] (a group's largest magnitude
   / 127) and total [M][Kp / 32] (scale times the group's sum of int8 values: its sum, as the products see it).
   Inputs past K (Kp is K rounded up to 128) are 0. */
static void prepare(const uint16_t* x, int M, int K, int Kp, int8_t* xq, float* scale, float* total) {
    for (int m = 0; m < M; m++)
        for (int grp = 0; grp < Kp / 32; grp++) {
            float v[32], top = 0.f;
            for (int i = 0; i < 32; i++) {
                int k = grp * 32 + i;
                v[i] = k < K ? from_bf16(x[(size_t)m * K + k]) : 0.f;
                float a = v[i] < 0 ? -v[i] : v[i];
                top = a > top ? a : top;
            }
            float inv = top > 0 ? 127.f / top : 0.f;
            int sum = 0;
            int8_t* block = xq + (size_t)m * Kp + (grp / 4) * 128;
            for (int i = 0; i < 32; i++) {
                int q = (int)__builtin_rintf(v[i] * inv);
                sum += q;
                block[(i / 4) * 16 + (grp % 4) * 4 + i % 4] = (int8_t)q;
            }
            scale[(size_t)m * (Kp / 32) + grp] = top / 127.f;
            total[(size_t)m * (Kp / 32) + grp] = top / 127.f * (float)sum;
        }
}

/* 4 outputs (one row of tiles, nb of them) times `rows` rows: acc[r] holds 16 lanes (output * 4 + group) */
static inline void quad(const uint8_t* t, int nb, const int8_t* xq, const float* scale, const float* total, int Kp,
                        int rows, __m512* acc) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++, t += TILE) {
        for (int c = 0; c < TILE; c += 64) _mm_prefetch((const char*)(t + AHEAD + c), _MM_HINT_T0);
        __m512i lo[4], hi[4];
        for (int L = 0; L < 4; L++) {
            __m512i w = _mm512_loadu_si512(t + L * 64);
            lo[L] = _mm512_and_si512(w, nibble);
            hi[L] = _mm512_and_si512(_mm512_srli_epi16(w, 4), nibble);
        }
        __m512 step = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(t + 256)));
        __m512 low = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(t + 288)));
        for (int r = 0; r < rows; r++) {
            const int8_t* xb = xq + (size_t)r * Kp + b * 128;
            __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
            for (int L = 0; L < 4; L++) {
                s0 = _mm512_dpbusd_epi32(s0, lo[L], _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(xb + L * 16))));
                s1 = _mm512_dpbusd_epi32(s1, hi[L], _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(xb + (L + 4) * 16))));
            }
            const float* sc = scale + (size_t)r * (Kp / 32) + b * 4;
            const float* tt = total + (size_t)r * (Kp / 32) + b * 4;
            __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dot, step), _mm512_broadcast_f32x4(_mm_loadu_ps(sc)), acc[r]);
            acc[r] = _mm512_fmadd_ps(low, _mm512_broadcast_f32x4(_mm_loadu_ps(tt)), acc[r]);
        }
    }
}

/* x [M][K] bfloat16, tiles for Np = N rounded up to 4 outputs and Kp = K rounded up to 128 inputs; y [M][N]
   bfloat16. Returns 0, or -1 when memory for the rounded rows could not be had. */
int int4_vnni_mm(const uint8_t* tiles, const uint16_t* x, int M, int N, int K, uint16_t* y, int threads) {
    int Kp = (K + 127) / 128 * 128, nb = Kp / 128, quads = (N + 3) / 4;
    int8_t* xq = malloc((size_t)M * Kp);
    float* scale = malloc(sizeof(float) * (size_t)M * (Kp / 32));
    float* total = malloc(sizeof(float) * (size_t)M * (Kp / 32));
    if (!xq || !scale || !total) { free(xq); free(scale); free(total); return -1; }
    prepare(x, M, K, Kp, xq, scale, total);
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int q = 0; q < quads; q++) {
        for (int m0 = 0; m0 < M; m0 += ROWS) {
            int rows = M - m0 < ROWS ? M - m0 : ROWS;
            __m512 acc[ROWS];
            quad(tiles + (size_t)q * nb * TILE, nb, xq + (size_t)m0 * Kp, scale + (size_t)m0 * (Kp / 32),
                 total + (size_t)m0 * (Kp / 32), Kp, rows, acc);
            for (int r = 0; r < rows; r++) {
                float lanes[16];
                _mm512_storeu_ps(lanes, acc[r]);
                for (int o = 0; o < 4 && q * 4 + o < N; o++)
                    y[(size_t)(m0 + r) * N + q * 4 + o] =
                        to_bf16(lanes[o * 4] + lanes[o * 4 + 1] + lanes[o * 4 + 2] + lanes[o * 4 + 3]);
            }
        }
    }
    free(xq);
    free(scale);
    free(total);
    return 0;
}
