/* The int4 draft's product on x86 CPUs with AVX-512 VNNI, or AVX2: y = x W^T, W in int4 with a step and a minimum per
   group of 32 inputs (w = low + q step, q in 0..15), each row of x rounded to int8 per group of 32. The two builds
   compute the same integers and the same float operations, so the same bits.

   A draft step waits on memory: it reads 309 MB of weights for one token. This kernel streams them faster than
   PyTorch's int4 one, because it prefetches its weights ahead of the arithmetic and multiplies bytes with vpdpbusd
   instead of widening each weight to float. Rounding the activations moves a draft's logits a little more than
   bfloat16 ones would; the draft only changes how many drafts are accepted, never the output.

   Layout (pack in int4_vnni.py): [N / 4][K / 128] tiles of 320 bytes, for 4 outputs and 128 inputs: 256 bytes
   of weights, four 64-byte vectors L = 0..3 of 16 lanes (lane = output * 4 + group of 32), each lane's four
   bytes holding inputs 4 L .. 4 L + 3 of its group in the low nibbles and 4 L + 16 .. in the high ones; then 16
   half-precision steps and 16 minimums, in lane order. A row's int8 inputs are laid out to match (prepare). */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define AHEAD 1024    /* bytes of weights prefetched ahead of the arithmetic (how far: docs/benchmarks.md) */
#define TILE 320
#define ROWS 8        /* rows per pass over the weights */

static inline float from_bf16(uint16_t v) {  /* the 16 bits moved up */
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
   Inputs past K (Kp is K rounded up to 128) are 0. A group of 32 is rounded in two vectors of 16, by the same float
   operations, in any order the same bits: a maximum, a product, a rounding to nearest even. */
#ifdef __AVX512VNNI__
static void prepare(const uint16_t* x, int M, int K, int Kp, int8_t* xq, float* scale, float* total) {
    for (int m = 0; m < M; m++)
        for (int grp = 0; grp < Kp / 32; grp++) {
            int k0 = grp * 32, left = K - k0 < 0 ? 0 : K - k0 > 32 ? 32 : K - k0;
            const uint16_t* src = x + (size_t)m * K + k0;
            __m512 v[2];
            for (int h = 0; h < 2; h++) {  /* bfloat16 -> float32: the 16 bits moved up; inputs past K read as 0 */
                int n = left - 16 * h < 0 ? 0 : left - 16 * h > 16 ? 16 : left - 16 * h;
                __m256i raw = _mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1), src + 16 * h);
                v[h] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
            }
            float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
            __m512 inv = _mm512_set1_ps(top > 0 ? 127.f / top : 0.f);
            __m512i q[2];
            for (int h = 0; h < 2; h++)
                q[h] = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(v[h], inv),
                                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q[0], q[1]));
            uint32_t bytes[8];  /* four inputs a word, in order */
            _mm_storeu_si128((__m128i*)bytes, _mm512_cvtepi32_epi8(q[0]));
            _mm_storeu_si128((__m128i*)(bytes + 4), _mm512_cvtepi32_epi8(q[1]));
            int8_t* block = xq + (size_t)m * Kp + (grp / 4) * 128 + (grp % 4) * 4;
            for (int c = 0; c < 8; c++) memcpy(block + c * 16, bytes + c, 4);
            scale[(size_t)m * (Kp / 32) + grp] = top / 127.f;
            total[(size_t)m * (Kp / 32) + grp] = top / 127.f * (float)sum;
        }
}
#else
static void prepare(const uint16_t* x, int M, int K, int Kp, int8_t* xq, float* scale, float* total) {
    for (int m = 0; m < M; m++)
        for (int grp = 0; grp < Kp / 32; grp++) {  /* the vector build's operations, one value at a time */
            const int k0 = grp * 32, left = K - k0 < 0 ? 0 : K - k0 > 32 ? 32 : K - k0;
            float v[32], top = 0.f;
            for (int i = 0; i < 32; i++) {
                v[i] = i < left ? from_bf16(x[(size_t)m * K + k0 + i]) : 0.f;
                top = fabsf(v[i]) > top ? fabsf(v[i]) : top;
            }
            const float inv = top > 0 ? 127.f / top : 0.f;
            int sum = 0;
            int8_t* block = xq + (size_t)m * Kp + (grp / 4) * 128 + (grp % 4) * 4;
            for (int i = 0; i < 32; i++) {
                const int q = (int)rintf(v[i] * inv);
                block[(i / 4) * 16 + i % 4] = (int8_t)q;
                sum += q;
            }
            scale[(size_t)m * (Kp / 32) + grp] = top / 127.f;
            total[(size_t)m * (Kp / 32) + grp] = top / 127.f * (float)sum;
        }
}
#endif

#ifdef __AVX512VNNI__
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
#else
/* quad's integers and float operations, each 64-byte vector as two halves of 8 lanes (outputs 0-1, 2-3); acc[2 r + h]
   is half h of row r's. A pair of byte products is at most 2 * 15 * 127 and a sum adds 8 pairs: within int16. */
static inline void quad(const uint8_t* t, int nb, const int8_t* xq, const float* scale, const float* total, int Kp,
                        int rows, __m256* acc) {
    const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    for (int r = 0; r < 2 * rows; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, t += TILE) {
        for (int c = 0; c < TILE; c += 64) _mm_prefetch((const char*)(t + AHEAD + c), _MM_HINT_T0);
        __m256i lo[8], hi[8];
        for (int L = 0; L < 4; L++)
            for (int h = 0; h < 2; h++) {
                const __m256i w = _mm256_loadu_si256((const __m256i*)(t + L * 64 + 32 * h));
                lo[2 * L + h] = _mm256_and_si256(w, nibble);
                hi[2 * L + h] = _mm256_and_si256(_mm256_srli_epi16(w, 4), nibble);
            }
        __m256 step[2], low[2];
        for (int h = 0; h < 2; h++) {
            step[h] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(t + 256 + 16 * h)));
            low[h] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(t + 288 + 16 * h)));
        }
        for (int r = 0; r < rows; r++) {
            const int8_t* xb = xq + (size_t)r * Kp + b * 128;
            __m256i s[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
            for (int L = 0; L < 4; L++) {
                const __m256i xl = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(xb + L * 16)));
                const __m256i xh = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(xb + (L + 4) * 16)));
                for (int h = 0; h < 2; h++)
                    s[h] = _mm256_add_epi16(s[h], _mm256_add_epi16(_mm256_maddubs_epi16(lo[2 * L + h], xl),
                                                                   _mm256_maddubs_epi16(hi[2 * L + h], xh)));
            }
            const __m256 sc = _mm256_broadcast_ps((const __m128*)(scale + (size_t)r * (Kp / 32) + b * 4));
            const __m256 tt = _mm256_broadcast_ps((const __m128*)(total + (size_t)r * (Kp / 32) + b * 4));
            for (int h = 0; h < 2; h++) {
                const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(s[h], ones));
                acc[2 * r + h] = _mm256_fmadd_ps(_mm256_mul_ps(dot, step[h]), sc, acc[2 * r + h]);
                acc[2 * r + h] = _mm256_fmadd_ps(low[h], tt, acc[2 * r + h]);
            }
        }
    }
}
#endif

/* x [M][K] bfloat16, tiles for Np = N rounded up to 4 outputs and Kp = K rounded up to 128 inputs; bias [N]
   bfloat16 (NULL: none), added before the rounding; y [M][N] bfloat16. Returns 0, or -1 when memory for the rounded
   rows could not be had. */
int int4_vnni_mm(const uint8_t* tiles, const uint16_t* x, int M, int N, int K, const uint16_t* bias, uint16_t* y,
                 int threads) {
    int Kp = (K + 127) / 128 * 128, nb = Kp / 128, quads = (N + 3) / 4;
    int8_t* xq = malloc((size_t)M * Kp);
    float* scale = malloc(sizeof(float) * (size_t)M * (Kp / 32));
    float* total = malloc(sizeof(float) * (size_t)M * (Kp / 32));
    if (!xq || !scale || !total) { free(xq); free(scale); free(total); return -1; }
    prepare(x, M, K, Kp, xq, scale, total);
    #pragma omp parallel for schedule(guided) num_threads(threads)
    for (int q = 0; q < quads; q++) {
        for (int m0 = 0; m0 < M; m0 += ROWS) {
            int rows = M - m0 < ROWS ? M - m0 : ROWS;
            float lanes[ROWS][16];
            {
#ifdef __AVX512VNNI__
                __m512 acc[ROWS];
                quad(tiles + (size_t)q * nb * TILE, nb, xq + (size_t)m0 * Kp, scale + (size_t)m0 * (Kp / 32),
                     total + (size_t)m0 * (Kp / 32), Kp, rows, acc);
                for (int r = 0; r < rows; r++) _mm512_storeu_ps(lanes[r], acc[r]);
#else
                __m256 acc[2 * ROWS];
                quad(tiles + (size_t)q * nb * TILE, nb, xq + (size_t)m0 * Kp, scale + (size_t)m0 * (Kp / 32),
                     total + (size_t)m0 * (Kp / 32), Kp, rows, acc);
                for (int r = 0; r < 2 * rows; r++) _mm256_storeu_ps(lanes[r / 2] + 8 * (r % 2), acc[r]);
#endif
            }
            for (int r = 0; r < rows; r++) {
                for (int o = 0; o < 4 && q * 4 + o < N; o++) {
                    const float b = bias ? from_bf16(bias[q * 4 + o]) : 0.f;
                    y[(size_t)(m0 + r) * N + q * 4 + o] =
                        to_bf16(lanes[r][o * 4] + lanes[r][o * 4 + 1] + lanes[r][o * 4 + 2] + lanes[r][o * 4 + 3] + b);
                }
            }
        }
    }
    free(xq);
    free(scale);
    free(total);
    return 0;
}
