/* The target's product on the GGUF's own blocks, y = x W^T + bias, and its rows' attention (below).

   A block holds 256 inputs of one output. Q4_K: w = d * sc[j] * q - dmin * m[j], q in 0..15, eight sub-blocks j of 32
   inputs with 6-bit sc and m; Q5_K the same with q in 0..31. Q6_K: w = d * sc[j] * (q - 32), q in 0..63, sixteen
   sub-blocks of 16 with int8 sc. Q8 (kind 8): w = d[j] * q, q in -128..127, eight sub-blocks of 32 each with its own
   float16 d: GGUF's Q8_0 blocks, and its Q4_0 and Q5_0 ones, whose q - 8 and q - 16 are such q with the same d.
   Each row of x is rounded to int8 per block of 256 (xq = rint(x * 127 / amax), dx = amax / 127), so a block's
   contribution is an integer sum, exact in any order, turned into floats by the same few operations for every row:
       Q4_K: acc += (d * float(sum_j sc_j * dot_j) - dmin * float(sum_j m_j * xsum_j)) * dx
       Q6_K: acc += (d * float(sum_j sc_j * dot_j - 32 * sum_j sc_j * xsum_j)) * dx
       Q8:   acc += (((d_0 * float(dot_0)) + d_1 * float(dot_1)) + ... + d_7 * float(dot_7)) * dx
   over the blocks in order, then + bias. A row's output is therefore the same, bit for bit, whatever rows come
   with it: that is what lets a verification pass reproduce a one-token step.

   Layout (kquant_pack): the blocks of 16 outputs side by side, so that a vector lane is an output and an
   activation's 4 bytes are broadcast. Per 16 outputs and block, lossless (the same numbers as the file's):
     Q4_K, 2368 bytes: d[16] fp16, dmin[16] fp16, sc pairs [4][16][2] u8, m pairs [4][16][2] u8,
                       qs [32][16 outputs][4]: byte (o, t) of chunk c holds q[o][8c + t] low, q[o][8c + 4 + t] high.
     Q5_K, 2880 bytes: Q4_K's, then qh [8][16][4]: byte (o, t) of sub-block j holds the fifth bit of q[o][32j + 8i + t]
                       at bit 2i and of q[o][32j + 8i + 4 + t] at bit 2i + 1.
     Q6_K, 3360 bytes: d[16] fp16, sc pairs [8][16][2] int8, the low nibbles as Q4_K's qs,
                       qh [16][16][4]: byte (o, t) of sub-block s holds the high 2 bits of q[o][16s + 4i + t] at 2i.
     Q8,   4352 bytes: d [8][16] fp16, q + 128 as unsigned bytes [64][16 outputs][4]: word c holds q[o][4c..4c + 4).
   Built with AVX-512 VNNI (vpdpbusd: weights as unsigned bytes, activations signed) where the CPU has it, else with
   AVX2 (vpmaddubsw's int16 pairs), else as portable C. All compute the same integers and the same float operations,
   so all give the same bits. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exp_le0.h"

#define QK 256
#define Q4_RAW 144
#define Q5_RAW 176
#define Q6_RAW 210
#define Q8_RAW 272 /* eight Q8_0 blocks of 32: d, 32 int8 */
#define Q4_PACKED 2368
#define Q5_PACKED 2880
#define Q6_PACKED 3360
#define Q8_PACKED 4352
#define ROWS 9
#define AHEAD 2048 /* Q4_K: bytes of weights prefetched ahead: hardware prefetching alone leaves the loads waiting */

/* ---- the file's blocks -> plain values ---- */

static float half_to_float(uint16_t h) {  /* exact */
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31, man = h & 1023, bits;
    if (exp == 0) {
        if (man == 0) bits = sign;
        else {  /* subnormal: normalise */
            exp = 113;
            while (!(man & 1024)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 1023) << 13);
        }
    } else if (exp == 31) bits = sign | 0x7f800000u | (man << 13);
    else bits = sign | ((exp + 112) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static void q4_scales(const uint8_t* b, uint8_t* sc, uint8_t* m) {
    const uint8_t* s = b + 4;
    for (int j = 0; j < 8; j++) {
        if (j < 4) { sc[j] = s[j] & 63; m[j] = s[j + 4] & 63; }
        else {
            sc[j] = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
            m[j] = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
        }
    }
}

static void q4_unpack(const uint8_t* b, uint8_t* q, uint8_t* sc, uint8_t* m) {
    q4_scales(b, sc, m);
    const uint8_t* qs = b + 16;
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l++) {
            q[c * 64 + l] = qs[c * 32 + l] & 15;
            q[c * 64 + 32 + l] = qs[c * 32 + l] >> 4;
        }
}

static void q6_unpack(const uint8_t* b, uint8_t* q, int8_t* sc) {
    const uint8_t *ql = b, *qh = b + 128;
    memcpy(sc, b + 192, 16);
    for (int h = 0; h < 2; h++)
        for (int l = 0; l < 32; l++) {
            const uint8_t lo = ql[h * 64 + l], lo2 = ql[h * 64 + 32 + l], hi = qh[h * 32 + l];
            uint8_t* o = q + h * 128 + l;
            o[0] = (lo & 15) | ((hi & 3) << 4);
            o[32] = (lo2 & 15) | (((hi >> 2) & 3) << 4);
            o[64] = (lo >> 4) | (((hi >> 4) & 3) << 4);
            o[96] = (lo2 >> 4) | (((hi >> 6) & 3) << 4);
        }
}

static uint32_t word(const uint8_t* p) {
    uint32_t w;
    memcpy(&w, p, 4);
    return w;
}

/* Chunk c of the packed nibbles, output o: byte t holds the low 4 bits of values 8c + t (low) and 8c + 4 + t (high).
   Those 8 values are 8 bytes' nibbles in the file, the low ones or the high ones (at `at`); each step below is the
   same for every byte of a word, so 4 values go at once (and the byte order of the machine does not matter). */
static uint32_t nibble_word(const uint8_t* at, int high) {
    const uint32_t a = word(at), b = word(at + 4), low = 0x0F0F0F0Fu;
    return high ? ((a >> 4) & low) | (b & ~low) : (a & low) | ((b & low) << 4);
}

/* Q4_K, or Q5_K (qs: its nibbles' offset in the block, 48; its fifth bits after Q4_K's layout) */
static void pack_q4(const uint8_t* src, int o, uint8_t* dst, int qs) {
    uint8_t sc[8], m[8];
    q4_scales(src, sc, m);
    memcpy(dst + 2 * o, src, 2);            /* d */
    memcpy(dst + 32 + 2 * o, src + 2, 2);   /* dmin */
    for (int p = 0; p < 4; p++) {
        dst[64 + p * 32 + o * 2] = sc[2 * p], dst[64 + p * 32 + o * 2 + 1] = sc[2 * p + 1];
        dst[192 + p * 32 + o * 2] = m[2 * p], dst[192 + p * 32 + o * 2 + 1] = m[2 * p + 1];
    }
    for (int c = 0; c < 32; c++) {  /* values 64g + l: byte l of qs[32g..) low (l < 32), byte l - 32 high */
        const int g = c / 8, l = 8 * (c % 8);
        const uint32_t w = nibble_word(src + qs + 32 * g + l % 32, l >= 32);
        memcpy(dst + 320 + c * 64 + o * 4, &w, 4);
    }
    if (qs == 16) return;
    /* Q5_K's fifth bit of value 64g + 32h + l is bit 2g + h of qh[l] */
    for (int j = 0; j < 8; j++)
        for (int t = 0; t < 4; t++) {
            uint8_t byte = 0;
            for (int i = 0; i < 4; i++)
                for (int h = 0; h < 2; h++) {
                    const int v = 32 * j + 8 * i + 4 * h + t;
                    byte |= ((src[16 + v % 32] >> (2 * (v / 64) + (v % 64) / 32)) & 1) << (2 * i + h);
                }
            dst[Q4_PACKED + j * 64 + o * 4 + t] = byte;
        }
}

static void pack_q8(const uint8_t* src, int o, uint8_t* dst) {
    for (int j = 0; j < 8; j++) {
        memcpy(dst + j * 32 + 2 * o, src + 34 * j, 2);
        for (int k = 0; k < 32; k++) dst[256 + (8 * j + k / 4) * 64 + o * 4 + k % 4] = (uint8_t)((int8_t)src[34 * j + 2 + k] + 128);
    }
}

static void pack_q6(const uint8_t* src, int o, uint8_t* dst) {
    const uint8_t *ql = src, *qh = src + 128;
    memcpy(dst + 2 * o, src + 208, 2);
    for (int p = 0; p < 8; p++) dst[32 + p * 32 + o * 2] = src[192 + 2 * p], dst[32 + p * 32 + o * 2 + 1] = src[192 + 2 * p + 1];
    /* value 128h + 32j + l: ql[64h + 32(j & 1) + l], its low nibble for j < 2, else its high; its top 2 bits are bits
       2j, 2j + 1 of qh[32h + l] */
    for (int c = 0; c < 32; c++) {
        const int h = c / 16, j = (c % 16) / 4, l = 8 * (c % 4);
        const uint32_t w = nibble_word(ql + 64 * h + 32 * (j & 1) + l, j >= 2);
        memcpy(dst + 288 + c * 64 + o * 4, &w, 4);
    }
    for (int s = 0; s < 16; s++) {  /* byte t of sub-block s: the top bits of values 16s + 4i + t at bits 2i */
        const int h = s / 8, j = (s % 8) / 2;
        uint32_t w = 0;
        for (int i = 0; i < 4; i++) w |= ((word(qh + 32 * h + 16 * (s % 2) + 4 * i) >> (2 * j)) & 0x03030303u) << (2 * i);
        memcpy(dst + 2336 + s * 64 + o * 4, &w, 4);
    }
}

static int raw_size(int kind) { return kind == 4 ? Q4_RAW : kind == 5 ? Q5_RAW : kind == 6 ? Q6_RAW : Q8_RAW; }
static int packed_size(int kind) { return kind == 4 ? Q4_PACKED : kind == 5 ? Q5_PACKED : kind == 6 ? Q6_PACKED : Q8_PACKED; }

/* raw: N outputs, each K / 256 blocks in the file's layout; out: the packed layout. kind 4 (Q4_K), 5 (Q5_K),
   6 (Q6_K) or 8 (Q8_0). */
void kquant_pack(const uint8_t* raw, int N, int K, int kind, uint8_t* out) {
    const int nb = K / QK, raw_bytes = raw_size(kind), size = packed_size(kind);
    #pragma omp parallel for schedule(static)
    for (int g = 0; g < N / 16; g++)
        for (int b = 0; b < nb; b++)
            for (int o = 0; o < 16; o++) {
                const uint8_t* src = raw + ((size_t)(g * 16 + o) * nb + b) * raw_bytes;
                uint8_t* dst = out + ((size_t)g * nb + b) * size;
                if (kind == 4 || kind == 5) pack_q4(src, o, dst, kind == 4 ? 16 : 48);
                else if (kind == 6) pack_q6(src, o, dst);
                else pack_q8(src, o, dst);
            }
}

/* ---- a row's activations, rounded per block ---- */

typedef struct {
    int8_t* q;      /* [M][K] */
    float* dx;      /* [M][nb] */
    int32_t* p16;   /* [M][nb][8]: sums of sub-blocks of 16, two int16 a lane (2p low, 2p + 1 high) */
    int32_t* p32;   /* [M][nb][4]: the same over sub-blocks of 32 */
} Rows;

/* a block's 16 sums of sub-blocks of 16 as the two packed forms the products read */
static void put_sums(const int* sums, int32_t* p16, int32_t* p32) {
    for (int p = 0; p < 8; p++)
        p16[p] = (int32_t)((uint32_t)(uint16_t)sums[2 * p] | ((uint32_t)(uint16_t)sums[2 * p + 1] << 16));
    for (int p = 0; p < 4; p++) {
        int a = sums[4 * p] + sums[4 * p + 1], c = sums[4 * p + 2] + sums[4 * p + 3];
        p32[p] = (int32_t)((uint32_t)(uint16_t)a | ((uint32_t)(uint16_t)c << 16));
    }
}

#ifdef __AVX512VNNI__
#include <immintrin.h>

/* the same numbers as the portable loop below: a maximum (any order), then a product and a rounding to nearest
   even for each value, one at a time, and integer sums */
static void round_row(const float* x, int K, int8_t* q, float* dx, int32_t* p16, int32_t* p32) {
    for (int b = 0; b < K / QK; b++) {
        const float* xb = x + b * QK;
        __m512 top = _mm512_setzero_ps();
        for (int k = 0; k < QK; k += 16) top = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(xb + k)), top);
        const float t = _mm512_reduce_max_ps(top), inv = t > 0.f ? 127.f / t : 0.f;
        int sums[16];
        for (int s = 0; s < 16; s++) {
            const __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(xb + 16 * s), _mm512_set1_ps(inv)),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            const __m512i iv = _mm512_cvtps_epi32(v);
            _mm_storeu_si128((__m128i*)(q + b * QK + 16 * s), _mm512_cvtepi32_epi8(iv));
            sums[s] = _mm512_reduce_add_epi32(iv);
        }
        dx[b] = t / 127.f;
        put_sums(sums, p16 + b * 8, p32 + b * 4);
    }
}
#else
static void round_row(const float* x, int K, int8_t* q, float* dx, int32_t* p16, int32_t* p32) {
    for (int b = 0; b < K / QK; b++) {
        const float* xb = x + b * QK;
        float top = 0.f;
        for (int k = 0; k < QK; k++) top = fmaxf(top, fabsf(xb[k]));
        const float inv = top > 0.f ? 127.f / top : 0.f;
        int sums[16];
        for (int s = 0; s < 16; s++) {
            int sum = 0;
            for (int k = 16 * s; k < 16 * s + 16; k++) {
                int v = (int)rintf(xb[k] * inv);
                q[b * QK + k] = (int8_t)v;
                sum += v;
            }
            sums[s] = sum;
        }
        dx[b] = top / 127.f;
        put_sums(sums, p16 + b * 8, p32 + b * 4);
    }
}
#endif

#ifdef __AVX512VNNI__
#define INLINE static inline __attribute__((always_inline))

/* acc += w (16 x 4 unsigned bytes) times the 4 signed bytes at p, broadcast by the instruction itself (m32bcst):
   compilers load a broadcast into a register first, one more instruction for every product of a pass's rows */
INLINE __m512i dpb(__m512i acc, __m512i w, const int32_t* p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*p));
    return acc;
}

/* acc += w (16 x 2 int16) times the 2 int16 at p, broadcast by the instruction */
INLINE __m512i dpw(__m512i acc, __m512i w, const int32_t* p) {
    __asm__("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*p));
    return acc;
}

/* each byte's bit `from` moved to bit 4 (a 16-bit shift: within its byte for these distances), the rest cleared */
INLINE __m512i bit4(__m512i v, const int from) {
    const __m512i fifth = _mm512_set1_epi8(16);
    return _mm512_and_si512(from <= 4 ? _mm512_slli_epi16(v, 4 - from) : _mm512_srli_epi16(v, from - 4), fifth);
}

/* 16 outputs (group g) for `rows` rows from m0 (five: Q5_K, Q4_K's with a fifth bit); acc holds a float vector a row */
INLINE void q4_tile(const uint8_t* w, int nb, const Rows* x, int K, int m0, const int rows, __m512* acc, const int five) {
    const __m512i low = _mm512_set1_epi8(15), half = _mm512_set1_epi32(0xffff);
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++, w += five ? Q5_PACKED : Q4_PACKED) {
        __m512i isum[ROWS];
        for (int r = 0; r < rows; r++) isum[r] = _mm512_setzero_si512();
        for (int p = 0; p < 4; p++) {
            const __m512i scs = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(w + 64 + p * 32)));
            for (int h = 0; h < 2; h++) {
                const int j = 2 * p + h;
                const __m512i sc = h ? _mm512_srli_epi32(scs, 16) : _mm512_and_si512(scs, half);
                __m512i dot[ROWS];
                for (int r = 0; r < rows; r++) dot[r] = _mm512_setzero_si512();
                const __m512i qh = five ? _mm512_loadu_si512(w + Q4_PACKED + j * 64) : _mm512_setzero_si512();
                for (int c = 4 * j; c < 4 * j + 4; c++) {
                    _mm_prefetch((const char*)(w + 320 + c * 64 + AHEAD), _MM_HINT_T0);
                    const __m512i v = _mm512_loadu_si512(w + 320 + c * 64);
                    __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                    if (five) {
                        const int i = c - 4 * j;
                        lo = _mm512_or_si512(lo, bit4(qh, 2 * i));
                        hi = _mm512_or_si512(hi, bit4(qh, 2 * i + 1));
                    }
                    for (int r = 0; r < rows; r++) {
                        const int32_t* xr = (const int32_t*)(x->q + (size_t)(m0 + r) * K + b * QK + 8 * c);
                        dot[r] = dpb(dot[r], lo, xr);
                        dot[r] = dpb(dot[r], hi, xr + 1);
                    }
                }
                for (int r = 0; r < rows; r++) isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(dot[r], sc));
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)w));
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(w + 32)));
        __m512i mins[4];
        for (int p = 0; p < 4; p++) mins[p] = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(w + 192 + p * 32)));
        for (int r = 0; r < rows; r++) {  /* the mins' term: sum_j m_j * xsum_j, two sub-blocks an instruction */
            __m512i msum = _mm512_setzero_si512();
            for (int p = 0; p < 4; p++)
                msum = dpw(msum, mins[p], x->p32 + ((size_t)(m0 + r) * nb + b) * 4 + p);
            const __m512 v = _mm512_sub_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(isum[r])),
                                           _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(msum)));
            acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(v, _mm512_set1_ps(x->dx[(size_t)(m0 + r) * nb + b])));
        }
    }
}

INLINE void q6_tile(const uint8_t* w, int nb, const Rows* x, int K, int m0, const int rows, __m512* acc, const int unused) {
    (void)unused;
    const __m512i low = _mm512_set1_epi8(15), crumbs02 = _mm512_set1_epi8(0x33), crumbs13 = _mm512_set1_epi8((char)0xCC);
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++, w += Q6_PACKED) {
        __m512i isum[ROWS];
        for (int r = 0; r < rows; r++) isum[r] = _mm512_setzero_si512();
        for (int p = 0; p < 8; p++) {
            const __m512i scs = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(w + 32 + p * 32)));
            for (int h = 0; h < 2; h++) {
                const int s = 2 * p + h;
                const __m512i sc = h ? _mm512_srai_epi32(scs, 16) : _mm512_srai_epi32(_mm512_slli_epi32(scs, 16), 16);
                /* the block two ahead, in order, 4 of its lines a sub-block: the low bits and qh are read side by side,
                   2 KB apart, and a fixed distance from each would leave the next block's qh to the hardware, whose
                   prefetch streams the head more slowly */
                for (int i = 0; i < 4; i++) _mm_prefetch((const char*)(w + 2 * Q6_PACKED + (4 * s + i) * 64), _MM_HINT_T0);
                const __m512i qh = _mm512_loadu_si512(w + 2336 + s * 64);
                const __m512i v0 = _mm512_loadu_si512(w + 288 + 2 * s * 64), v1 = _mm512_loadu_si512(w + 288 + (2 * s + 1) * 64);
                /* crumbs 0 and 2 (bits 0-1, 4-5), 1 and 3 (2-3, 6-7) of qh, each moved to bits 4-5 over the nibble:
                   (A & 0x0F) | (B & 0xF0) is one vpternlogd (0xCA: the mask picks A, else B), and what a 16-bit shift brings in stays out */
                const __m512i qa = _mm512_and_si512(qh, crumbs02), qb = _mm512_and_si512(qh, crumbs13);
                const __m512i q[4] = {
                    _mm512_ternarylogic_epi32(low, v0, _mm512_slli_epi16(qa, 4), 0xCA),
                    _mm512_ternarylogic_epi32(low, _mm512_srli_epi16(v0, 4), _mm512_slli_epi16(qb, 2), 0xCA),
                    _mm512_ternarylogic_epi32(low, v1, qa, 0xCA),
                    _mm512_ternarylogic_epi32(low, _mm512_srli_epi16(v1, 4), _mm512_srli_epi16(qb, 2), 0xCA),
                };
                for (int r = 0; r < rows; r++) {
                    const int32_t* xr = (const int32_t*)(x->q + (size_t)(m0 + r) * K + b * QK + 16 * s);
                    __m512i dot = dpb(_mm512_setzero_si512(), q[0], xr);
                    dot = dpb(dot, q[1], xr + 1);
                    dot = dpb(dot, q[2], xr + 2);
                    dot = dpb(dot, q[3], xr + 3);
                    isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(dot, sc));
                }
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)w));
        __m512i scales[8];
        for (int p = 0; p < 8; p++) scales[p] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(w + 32 + p * 32)));
        for (int r = 0; r < rows; r++) {  /* the offset's term: 32 sum_j sc_j * xsum_j, two sub-blocks an instruction */
            __m512i csum = _mm512_setzero_si512();
            for (int p = 0; p < 8; p++)
                csum = dpw(csum, scales[p], x->p16 + ((size_t)(m0 + r) * nb + b) * 8 + p);
            const __m512i total = _mm512_sub_epi32(isum[r], _mm512_slli_epi32(csum, 5));
            const __m512 v = _mm512_mul_ps(d, _mm512_cvtepi32_ps(total));
            acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(v, _mm512_set1_ps(x->dx[(size_t)(m0 + r) * nb + b])));
        }
    }
}

INLINE void q8_tile(const uint8_t* w, int nb, const Rows* x, int K, int m0, const int rows, __m512* acc, const int unused) {
    (void)unused;
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++, w += Q8_PACKED) {
        __m512 block[ROWS];
        for (int r = 0; r < rows; r++) block[r] = _mm512_setzero_ps();
        for (int j = 0; j < 8; j++) {
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(w + j * 32)));
            __m512i dot[ROWS];
            for (int r = 0; r < rows; r++) dot[r] = _mm512_setzero_si512();
            for (int c = 8 * j; c < 8 * j + 8; c++) {
                _mm_prefetch((const char*)(w + 256 + c * 64 + AHEAD), _MM_HINT_T0);
                const __m512i v = _mm512_loadu_si512(w + 256 + c * 64);
                for (int r = 0; r < rows; r++) dot[r] = dpb(dot[r], v, (const int32_t*)(x->q + (size_t)(m0 + r) * K + b * QK + 4 * c));
            }
            for (int r = 0; r < rows; r++) {  /* (q + 128) . x - 128 * sum(x) */
                const int32_t pair = x->p32[((size_t)(m0 + r) * nb + b) * 4 + j / 2];
                const int xsum = (int16_t)(j % 2 ? (uint32_t)pair >> 16 : (uint32_t)pair & 0xffff);
                const __m512i isum = _mm512_sub_epi32(dot[r], _mm512_set1_epi32(128 * xsum));
                block[r] = _mm512_add_ps(block[r], _mm512_mul_ps(d, _mm512_cvtepi32_ps(isum)));
            }
        }
        for (int r = 0; r < rows; r++)
            acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(block[r], _mm512_set1_ps(x->dx[(size_t)(m0 + r) * nb + b])));
    }
}

#define CASE(fn, n, f) case n: fn(w, nb, x, K, m0, n, acc, f); break;
#define TILE(fn, f) switch (rows) { CASE(fn, 1, f) CASE(fn, 2, f) CASE(fn, 3, f) CASE(fn, 4, f) CASE(fn, 5, f) \
                                    CASE(fn, 6, f) CASE(fn, 7, f) CASE(fn, 8, f) default: fn(w, nb, x, K, m0, ROWS, acc, f); }

static void group(const uint8_t* w, int nb, const Rows* x, int K, int M, int kind, const float* bias, float* y, int N, int g) {
    const int tiles = (M + ROWS - 1) / ROWS;  /* as even as they can be: each tile unpacks the weights once */
    for (int t = 0, m0 = 0; t < tiles; t++) {
        const int rows = M / tiles + (t < M % tiles);
        __m512 acc[ROWS];
        if (kind == 4) { TILE(q4_tile, 0) } else if (kind == 5) { TILE(q4_tile, 1) } else if (kind == 6) { TILE(q6_tile, 0) }
        else { TILE(q8_tile, 0) }
        for (int r = 0; r < rows; r++) {
            __m512 v = acc[r];
            if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + g * 16));
            _mm512_storeu_ps(y + (size_t)(m0 + r) * N + g * 16, v);
        }
        m0 += rows;
    }
}

#elif defined(__AVX2__)  /* AVX2 without VNNI: the same integers through vpmaddubsw, then the same float operations */
#include <immintrin.h>
#define INLINE static inline __attribute__((always_inline))
#define ROWS2 4  /* rows of a tile: 16 registers hold fewer than AVX-512's 32 */

/* vpmaddubsw: 8 outputs' 4 unsigned bytes times 4 signed activation bytes, as 16 int16, each the sum of a pair of
   products. A weight here is at most 63 (Q4_K, Q5_K, Q6_K) and an activation at most 127 in magnitude, so a pair (at
   most 16002) never saturates; the tiles below add no more pairs than stay under 32768 */

/* each output's lane holding its sub-block scale in both int16 (from a lane of the even's and the odd's): vpmaddwd
   then scales and widens a lane's two pair sums at once */
INLINE __m256i both(__m256i scs, const int odd) {
    return odd ? _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(scs, 0xF5), 0xF5)
               : _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(scs, 0xA0), 0xA0);
}

INLINE __m256i bit4_2(__m256i v, const int from) {  /* bit4's */
    const __m256i fifth = _mm256_set1_epi8(16);
    return _mm256_and_si256(from <= 4 ? _mm256_slli_epi16(v, 4 - from) : _mm256_srli_epi16(v, from - 4), fifth);
}

/* q4_tile's integers for the group's 16 outputs as two halves of 8 (lanes), then its float operations; acc: a row's
   two halves side by side */
INLINE void q4_tile2(const uint8_t* w, int nb, const Rows* x, int K, int m0, const int rows, __m256* acc, const int five) {
    const __m256i low = _mm256_set1_epi8(15);
    for (int r = 0; r < 2 * rows; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, w += five ? Q5_PACKED : Q4_PACKED) {
        __m256i isum[2 * ROWS2], dot[2 * ROWS2];
        for (int r = 0; r < 2 * rows; r++) isum[r] = dot[r] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            __m256i sc[2], qh[2];
            for (int h = 0; h < 2; h++) {
                sc[h] = both(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(w + 64 + (j / 2) * 32 + 16 * h))), j % 2);
                qh[h] = five ? _mm256_loadu_si256((const __m256i*)(w + Q4_PACKED + j * 64 + 32 * h)) : _mm256_setzero_si256();
            }
            for (int c = 4 * j; c < 4 * j + 4; c++) {
                _mm_prefetch((const char*)(w + 320 + c * 64 + AHEAD), _MM_HINT_T0);
                __m256i lo[2], hi[2];
                for (int h = 0; h < 2; h++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i*)(w + 320 + c * 64 + 32 * h));
                    lo[h] = _mm256_and_si256(v, low), hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                    if (five) {
                        const int i = c - 4 * j;
                        lo[h] = _mm256_or_si256(lo[h], bit4_2(qh[h], 2 * i));
                        hi[h] = _mm256_or_si256(hi[h], bit4_2(qh[h], 2 * i + 1));
                    }
                }
                for (int r = 0; r < rows; r++) {
                    const int32_t* xr = (const int32_t*)(x->q + (size_t)(m0 + r) * K + b * QK + 8 * c);
                    const __m256i x0 = _mm256_set1_epi32(xr[0]), x1 = _mm256_set1_epi32(xr[1]);
                    for (int h = 0; h < 2; h++)
                        dot[2 * r + h] = _mm256_add_epi16(dot[2 * r + h], _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], x0),
                                                                                           _mm256_maddubs_epi16(hi[h], x1)));
                }
                if (five ? c % 2 == 1 : c % 4 == 3)  /* 8 pairs of at most 3810 (Q4_K), 4 of 7874 (Q5_K) */
                    for (int r = 0; r < 2 * rows; r++) {
                        isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(dot[r], sc[r % 2]));
                        dot[r] = _mm256_setzero_si256();
                    }
            }
        }
        for (int h = 0; h < 2; h++) {
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(w + 16 * h)));
            const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(w + 32 + 16 * h)));
            __m256i mins[4];
            for (int p = 0; p < 4; p++) mins[p] = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(w + 192 + p * 32 + 16 * h)));
            for (int r = 0; r < rows; r++) {
                const int32_t* xs = x->p32 + ((size_t)(m0 + r) * nb + b) * 4;
                __m256i msum = _mm256_setzero_si256();
                for (int p = 0; p < 4; p++) msum = _mm256_add_epi32(msum, _mm256_madd_epi16(mins[p], _mm256_set1_epi32(xs[p])));
                const __m256 v = _mm256_sub_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(isum[2 * r + h])),
                                               _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(msum)));
                acc[2 * r + h] = _mm256_add_ps(acc[2 * r + h], _mm256_mul_ps(v, _mm256_set1_ps(x->dx[(size_t)(m0 + r) * nb + b])));
            }
        }
    }
}

INLINE void q6_tile2(const uint8_t* w, int nb, const Rows* x, int K, int m0, const int rows, __m256* acc, const int unused) {
    (void)unused;
    const __m256i low = _mm256_set1_epi8(15), crumbs02 = _mm256_set1_epi8(0x33), crumbs13 = _mm256_set1_epi8((char)0xCC);
    for (int r = 0; r < 2 * rows; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, w += Q6_PACKED) {
        __m256i isum[2 * ROWS2];
        for (int r = 0; r < 2 * rows; r++) isum[r] = _mm256_setzero_si256();
        for (int s = 0; s < 16; s++) {
            for (int i = 0; i < 4; i++) _mm_prefetch((const char*)(w + 2 * Q6_PACKED + (4 * s + i) * 64), _MM_HINT_T0);
            __m256i sc[2], q[2][4];
            for (int h = 0; h < 2; h++) {  /* q6_tile's four: the low nibble, and the crumb moved to bits 4-5 over it */
                sc[h] = both(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + 32 + (s / 2) * 32 + 16 * h))), s % 2);
                const __m256i qh = _mm256_loadu_si256((const __m256i*)(w + 2336 + s * 64 + 32 * h));
                const __m256i v0 = _mm256_loadu_si256((const __m256i*)(w + 288 + 2 * s * 64 + 32 * h));
                const __m256i v1 = _mm256_loadu_si256((const __m256i*)(w + 288 + (2 * s + 1) * 64 + 32 * h));
                const __m256i qa = _mm256_and_si256(qh, crumbs02), qb = _mm256_and_si256(qh, crumbs13);
                q[h][0] = _mm256_or_si256(_mm256_and_si256(v0, low), _mm256_andnot_si256(low, _mm256_slli_epi16(qa, 4)));
                q[h][1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v0, 4), low), _mm256_andnot_si256(low, _mm256_slli_epi16(qb, 2)));
                q[h][2] = _mm256_or_si256(_mm256_and_si256(v1, low), _mm256_andnot_si256(low, qa));
                q[h][3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v1, 4), low), _mm256_andnot_si256(low, _mm256_srli_epi16(qb, 2)));
            }
            for (int r = 0; r < rows; r++) {  /* 2 pairs of at most 16002 a sum */
                const int32_t* xr = (const int32_t*)(x->q + (size_t)(m0 + r) * K + b * QK + 16 * s);
                __m256i xb[4];
                for (int i = 0; i < 4; i++) xb[i] = _mm256_set1_epi32(xr[i]);
                for (int h = 0; h < 2; h++) {
                    const __m256i a = _mm256_add_epi16(_mm256_maddubs_epi16(q[h][0], xb[0]), _mm256_maddubs_epi16(q[h][1], xb[1]));
                    const __m256i c = _mm256_add_epi16(_mm256_maddubs_epi16(q[h][2], xb[2]), _mm256_maddubs_epi16(q[h][3], xb[3]));
                    isum[2 * r + h] = _mm256_add_epi32(isum[2 * r + h], _mm256_add_epi32(_mm256_madd_epi16(a, sc[h]), _mm256_madd_epi16(c, sc[h])));
                }
            }
        }
        for (int h = 0; h < 2; h++) {
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(w + 16 * h)));
            __m256i scales[8];
            for (int p = 0; p < 8; p++) scales[p] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + 32 + p * 32 + 16 * h)));
            for (int r = 0; r < rows; r++) {
                const int32_t* xs = x->p16 + ((size_t)(m0 + r) * nb + b) * 8;
                __m256i csum = _mm256_setzero_si256();
                for (int p = 0; p < 8; p++) csum = _mm256_add_epi32(csum, _mm256_madd_epi16(scales[p], _mm256_set1_epi32(xs[p])));
                const __m256i total = _mm256_sub_epi32(isum[2 * r + h], _mm256_slli_epi32(csum, 5));
                const __m256 v = _mm256_mul_ps(d, _mm256_cvtepi32_ps(total));
                acc[2 * r + h] = _mm256_add_ps(acc[2 * r + h], _mm256_mul_ps(v, _mm256_set1_ps(x->dx[(size_t)(m0 + r) * nb + b])));
            }
        }
    }
}

/* Q8: the weights are q + 128, up to 255, whose pairs could saturate; as |q| times x with q's sign (|q| <= 128), a pair
   is at most 32512, and the sum is q8_tile's (q + 128) . x - 128 * sum(x) */
INLINE void q8_tile2(const uint8_t* w, int nb, const Rows* x, int K, int m0, const int rows, __m256* acc, const int unused) {
    (void)unused;
    const __m256i offset = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    for (int r = 0; r < 2 * rows; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, w += Q8_PACKED) {
        __m256 block[2 * ROWS2];
        for (int r = 0; r < 2 * rows; r++) block[r] = _mm256_setzero_ps();
        for (int j = 0; j < 8; j++) {
            __m256i dot[2 * ROWS2];
            for (int r = 0; r < 2 * rows; r++) dot[r] = _mm256_setzero_si256();
            for (int c = 8 * j; c < 8 * j + 8; c++) {
                _mm_prefetch((const char*)(w + 256 + c * 64 + AHEAD), _MM_HINT_T0);
                __m256i q[2], size[2];
                for (int h = 0; h < 2; h++) {
                    q[h] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(w + 256 + c * 64 + 32 * h)), offset);
                    size[h] = _mm256_abs_epi8(q[h]);
                }
                for (int r = 0; r < rows; r++) {
                    const __m256i xr = _mm256_set1_epi32(*(const int32_t*)(x->q + (size_t)(m0 + r) * K + b * QK + 4 * c));
                    for (int h = 0; h < 2; h++)
                        dot[2 * r + h] = _mm256_add_epi32(dot[2 * r + h], _mm256_madd_epi16(
                            _mm256_maddubs_epi16(size[h], _mm256_sign_epi8(xr, q[h])), ones));
                }
            }
            for (int h = 0; h < 2; h++) {
                const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(w + j * 32 + 16 * h)));
                for (int r = 0; r < rows; r++)
                    block[2 * r + h] = _mm256_add_ps(block[2 * r + h], _mm256_mul_ps(d, _mm256_cvtepi32_ps(dot[2 * r + h])));
            }
        }
        for (int r = 0; r < 2 * rows; r++)
            acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(block[r], _mm256_set1_ps(x->dx[(size_t)(m0 + r / 2) * nb + b])));
    }
}

#define CASE2(fn, n, f) case n: fn(w, nb, x, K, m0, n, acc, f); break;
#define TILE2(fn, f) switch (rows) { CASE2(fn, 1, f) CASE2(fn, 2, f) CASE2(fn, 3, f) default: fn(w, nb, x, K, m0, ROWS2, acc, f); }

static void group(const uint8_t* w, int nb, const Rows* x, int K, int M, int kind, const float* bias, float* y, int N, int g) {
    const int tiles = (M + ROWS2 - 1) / ROWS2;
    for (int t = 0, m0 = 0; t < tiles; t++) {
        const int rows = M / tiles + (t < M % tiles);
        __m256 acc[2 * ROWS2];
        if (kind == 4) { TILE2(q4_tile2, 0) } else if (kind == 5) { TILE2(q4_tile2, 1) } else if (kind == 6) { TILE2(q6_tile2, 0) }
        else { TILE2(q8_tile2, 0) }
        for (int r = 0; r < rows; r++)
            for (int h = 0; h < 2; h++) {
                __m256 v = acc[2 * r + h];
                if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + g * 16 + 8 * h));
                _mm256_storeu_ps(y + (size_t)(m0 + r) * N + g * 16 + 8 * h, v);
            }
        m0 += rows;
    }
}

#else  /* portable C: the same integers and float operations, one output lane at a time */

/* Q8: the same integers and float operations as q8_tile */
static float q8_block(const uint8_t* blk, const int8_t* xq, const int32_t* p32, int o) {
    float v = 0.f;
    for (int j = 0; j < 8; j++) {
        int32_t dot = 0;
        for (int k = 32 * j; k < 32 * j + 32; k++) dot += blk[256 + (k / 4) * 64 + o * 4 + k % 4] * xq[k];
        const int xsum = (int16_t)(j % 2 ? (uint32_t)p32[j / 2] >> 16 : (uint32_t)p32[j / 2] & 0xffff);
        v = v + half_to_float(((const uint16_t*)blk)[j * 16 + o]) * (float)(dot - 128 * xsum);
    }
    return v;
}

static void group(const uint8_t* w, int nb, const Rows* x, int K, int M, int kind, const float* bias, float* y, int N, int g) {
    const int size = packed_size(kind);
    for (int m = 0; m < M; m++) {
        float acc[16] = {0};
        for (int b = 0; b < nb; b++) {
            const uint8_t* blk = w + (size_t)b * size;
            const int8_t* xq = x->q + (size_t)m * K + b * QK;
            const int32_t* p16 = x->p16 + ((size_t)m * nb + b) * 8;
            const int32_t* p32 = x->p32 + ((size_t)m * nb + b) * 4;
            const float dx = x->dx[(size_t)m * nb + b];
            for (int o = 0; o < 16; o++) {
                if (kind == 8) {
                    acc[o] = acc[o] + q8_block(blk, xq, p32, o) * dx;
                    continue;
                }
                int32_t isum = 0, msum = 0;
                const int k_quant = kind != 6;  /* Q4_K or Q5_K */
                const uint8_t* nib = blk + (k_quant ? 320 : 288);
                for (int k = 0; k < QK; k++) {
                    const int c = k / 8, t = k % 4, high = (k % 8) >= 4;
                    int q = (nib[c * 64 + o * 4 + t] >> (4 * high)) & 15;
                    if (kind == 5) q |= ((blk[Q4_PACKED + (k / 32) * 64 + o * 4 + t] >> (2 * ((k % 32) / 8) + high)) & 1) << 4;
                    if (kind == 6) q |= ((blk[2336 + (k / 16) * 64 + o * 4 + t] >> (2 * ((k % 16) / 4))) & 3) << 4;
                    const int j = k_quant ? k / 32 : k / 16;
                    const int sc = k_quant ? blk[64 + (j / 2) * 32 + o * 2 + j % 2] : (int8_t)blk[32 + (j / 2) * 32 + o * 2 + j % 2];
                    isum += sc * q * xq[k];
                }
                if (k_quant) {
                    for (int p = 0; p < 4; p++)
                        msum += blk[192 + p * 32 + o * 2] * (int16_t)(p32[p] & 0xffff) + blk[192 + p * 32 + o * 2 + 1] * (int16_t)(p32[p] >> 16);
                    const float d = half_to_float(((const uint16_t*)blk)[o]), dmin = half_to_float(((const uint16_t*)blk)[16 + o]);
                    const float v = d * (float)isum - dmin * (float)msum;
                    acc[o] = acc[o] + v * dx;
                } else {
                    for (int p = 0; p < 8; p++)
                        msum += (int8_t)blk[32 + p * 32 + o * 2] * (int16_t)(p16[p] & 0xffff)
                              + (int8_t)blk[32 + p * 32 + o * 2 + 1] * (int16_t)(p16[p] >> 16);
                    const float v = half_to_float(((const uint16_t*)blk)[o]) * (float)(isum - 32 * msum);
                    acc[o] = acc[o] + v * dx;
                }
            }
        }
        for (int o = 0; o < 16; o++) y[(size_t)m * N + g * 16 + o] = bias ? acc[o] + bias[g * 16 + o] : acc[o];
    }
}
#endif

/* w: the packed weights [N / 16][K / 256][block]; x [M][K], y [M][N] float32; bias [N] or NULL.
   Returns 0, or -1 when memory for the rounded rows could not be had. */
int kquant_mm(const uint8_t* w, int kind, const float* bias, const float* x, int M, int N, int K, float* y, int threads) {
    const int nb = K / QK, size = packed_size(kind);
    Rows r = {malloc((size_t)M * K), malloc(sizeof(float) * (size_t)M * nb),
              malloc(sizeof(int32_t) * (size_t)M * nb * 8), malloc(sizeof(int32_t) * (size_t)M * nb * 4)};
    if (!r.q || !r.dx || !r.p16 || !r.p32) { free(r.q); free(r.dx); free(r.p16); free(r.p32); return -1; }
    #pragma omp parallel for schedule(static) num_threads(threads) if (M >= 8)
    for (int m = 0; m < M; m++)
        round_row(x + (size_t)m * K, K, r.q + (size_t)m * K, r.dx + (size_t)m * nb, r.p16 + (size_t)m * nb * 8, r.p32 + (size_t)m * nb * 4);
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int g = 0; g < N / 16; g++) group(w + (size_t)g * nb * size, nb, &r, K, M, kind, bias, y, N, g);
    free(r.q); free(r.dx); free(r.p16); free(r.p32);
    return 0;
}

/* ---- each row's attention, alone ----

   q [heads][n][d] float32; keys and values: kv_heads runs of positions [d] floats, `stride` floats apart (a cache's
   buffer, room behind it); query head h reads key/value head h / (heads / kv_heads). Row r sees counts[r] keys: the
   first ones, or (idx not NULL) the positions idx[r][0..counts[r]) in order (a tree node: the cache and its
   ancestors). out [n][heads][d]. A row is computed alone, by the same operations in the same order whatever rows
   come with it and in either build: sums in 16 lanes then a fixed tree, no fused multiply-adds (-ffp-contract=off),
   and an exponential of our own, so a row of a pass is a one-token step's, bit for bit. */

static float lanes_sum(float acc[16]) {
    for (int w = 8; w; w >>= 1)
        for (int l = 0; l < w; l++) acc[l] += acc[l + w];
    return acc[0];
}

static float dot(const float* a, const float* b, int d) {
    float acc[16] = {0};
    for (int t = 0; t < d; t += 16)
        for (int l = 0; l < 16; l++) acc[l] += a[t + l] * b[t + l];
    return lanes_sum(acc);
}

static void attend_row(const float* q, const float* keys, const float* values, int count, const int32_t* idx, int d,
                       float scale, float* s, float* out) {
    float qs[d];
    for (int t = 0; t < d; t++) qs[t] = q[t] * scale;
    float top = -INFINITY;
    for (int j = 0; j < count; j++) {
        s[j] = dot(qs, keys + (size_t)(idx ? idx[j] : j) * d, d);
        top = s[j] > top ? s[j] : top;
    }
    float acc[16] = {0};
    for (int j = 0; j < count; j++) s[j] = exp_le0(s[j] - top);
    for (int j = 0; j < count; j++) acc[j & 15] += s[j];
    const float total = lanes_sum(acc);
    for (int t = 0; t < d; t++) out[t] = 0.f;
    for (int j = 0; j < count; j++) {
        const float* v = values + (size_t)(idx ? idx[j] : j) * d;
        for (int t = 0; t < d; t++) out[t] += s[j] * v[t];
    }
    for (int t = 0; t < d; t++) out[t] /= total;
}

#define GROUP 8  /* the most query heads of one key/value head the vector build takes together */

#ifdef __AVX512VNNI__
/* attend_row's operations, in its order, for the g query heads (q: `q_step` floats apart) of one key/value head, 16
   lanes a vector: each key and value read once for all g heads. A key's 16 lane sums are one register (lane l:
   positions t = l mod 16, in order), their tree as lanes_sum's (halves of 8, 4, 2, 1; a + b is b + a); each head's
   output sums its keys in order, D = d / 16 registers a head. s: g rows of `count` scores. */
INLINE void attend_group_v(const float* q, size_t q_step, const float* keys, const float* values, int count,
                           const int32_t* idx, float scale, int g, float* s, float* out, const int D) {
    __m512 qs[GROUP][D], kv[D];
    float top[GROUP], total[GROUP];
    for (int i = 0; i < g; i++) {
        top[i] = -INFINITY;
        for (int c = 0; c < D; c++) qs[i][c] = _mm512_mul_ps(_mm512_loadu_ps(q + i * q_step + 16 * c), _mm512_set1_ps(scale));
    }
    for (int j = 0; j < count; j++) {
        const float* k = keys + (size_t)(idx ? idx[j] : j) * 16 * D;
        for (int c = 0; c < D; c++) kv[c] = _mm512_loadu_ps(k + 16 * c);
        for (int i = 0; i < g; i++) {
            __m512 acc = _mm512_setzero_ps();
            for (int c = 0; c < D; c++) acc = _mm512_add_ps(acc, _mm512_mul_ps(qs[i][c], kv[c]));
            const __m256 a8 = _mm256_add_ps(_mm512_castps512_ps256(acc), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1)));
            const __m128 a4 = _mm_add_ps(_mm256_castps256_ps128(a8), _mm256_extractf128_ps(a8, 1));
            const __m128 a2 = _mm_add_ps(a4, _mm_movehl_ps(a4, a4));
            const float score = _mm_cvtss_f32(_mm_add_ss(a2, _mm_shuffle_ps(a2, a2, 1)));
            s[(size_t)i * count + j] = score;
            top[i] = score > top[i] ? score : top[i];
        }
    }
    for (int i = 0; i < g; i++) {
        float* si = s + (size_t)i * count, acc[16] = {0};
        for (int j = 0; j < count; j++) si[j] = exp_le0(si[j] - top[i]);
        for (int j = 0; j < count; j++) acc[j & 15] += si[j];
        total[i] = lanes_sum(acc);
    }
    for (int c = 0; c < D; c++) {  /* a head's output, 16 of its numbers at a time over all keys */
        __m512 o[GROUP];
        for (int i = 0; i < g; i++) o[i] = _mm512_setzero_ps();
        for (int j = 0; j < count; j++) {
            const __m512 v = _mm512_loadu_ps(values + (size_t)(idx ? idx[j] : j) * 16 * D + 16 * c);
            for (int i = 0; i < g; i++) o[i] = _mm512_add_ps(o[i], _mm512_mul_ps(_mm512_set1_ps(s[(size_t)i * count + j]), v));
        }
        for (int i = 0; i < g; i++) _mm512_storeu_ps(out + (size_t)i * 16 * D + 16 * c, _mm512_div_ps(o[i], _mm512_set1_ps(total[i])));
    }
}
#endif

/* one row's g query heads of one key/value head; out: their g outputs side by side */
static void attend_group(const float* q, size_t q_step, const float* keys, const float* values, int count,
                         const int32_t* idx, int d, float scale, int g, float* s, float* out) {
#ifdef __AVX512VNNI__
    if (d == 128 && g <= GROUP) { attend_group_v(q, q_step, keys, values, count, idx, scale, g, s, out, 8); return; }
    if (d == 64 && g <= GROUP) { attend_group_v(q, q_step, keys, values, count, idx, scale, g, s, out, 4); return; }
#endif
    for (int i = 0; i < g; i++) attend_row(q + i * q_step, keys, values, count, idx, d, scale, s, out + (size_t)i * d);
}

/* Returns 0, or -1 when memory for the scores could not be had (d: a multiple of 16). */
int rows_attention(const float* q, const float* keys, const float* values, long stride, int n, int heads, int kv_heads,
                   int d, const int32_t* counts, const int32_t* idx, int width, float scale, float* out, int threads) {
    const int g = heads / kv_heads;
    int most = 1, failed = 0;
    for (int r = 0; r < n; r++) most = counts[r] > most ? counts[r] : most;
    #pragma omp parallel num_threads(threads) if (n * kv_heads > 1)
    {
        float* s = malloc(sizeof(float) * (size_t)most * g);
        #pragma omp for schedule(static)
        for (int task = 0; task < n * kv_heads; task++) {
            const int r = task / kv_heads, kv = task % kv_heads;
            if (s)
                attend_group(q + ((size_t)kv * g * n + r) * d, (size_t)n * d, keys + (size_t)kv * stride,
                             values + (size_t)kv * stride, counts[r], idx ? idx + (size_t)r * width : NULL, d, scale, g,
                             s, out + ((size_t)r * heads + (size_t)kv * g) * d);
        }
        if (!s) {
            #pragma omp atomic write
            failed = 1;
        }
        free(s);
    }
    return failed ? -1 : 0;
}

/* the values of one row's blocks (an embedding lookup): raw [K / 256][block], out [K] float32 */
void kquant_row(const uint8_t* raw, int K, int kind, float* out);

/* the rows ids[0..n) of weights raw [N][K / 256 blocks] as out [n][K] float32 */
void kquant_rows(const uint8_t* raw, const int64_t* ids, int n, int K, int kind, float* out) {
    const size_t row = (size_t)(K / QK) * (kind == 4 ? Q4_RAW : Q6_RAW);
    #pragma omp parallel for schedule(static) if (n >= 64)
    for (int i = 0; i < n; i++) kquant_row(raw + (size_t)ids[i] * row, K, kind, out + (size_t)i * K);
}

void kquant_row(const uint8_t* raw, int K, int kind, float* out) {
    uint8_t q[QK];
    for (int b = 0; b < K / QK; b++) {
        float* o = out + b * QK;
        if (kind == 4) {
            const uint8_t* src = raw + (size_t)b * Q4_RAW;
            uint8_t sc[8], m[8];
            q4_unpack(src, q, sc, m);
            const float d = half_to_float(src[0] | src[1] << 8), dmin = half_to_float(src[2] | src[3] << 8);
            for (int k = 0; k < QK; k++) o[k] = d * (float)sc[k / 32] * (float)q[k] - dmin * (float)m[k / 32];
        } else {
            const uint8_t* src = raw + (size_t)b * Q6_RAW;
            int8_t sc[16];
            q6_unpack(src, q, sc);
            const float d = half_to_float(src[208] | src[209] << 8);
            for (int k = 0; k < QK; k++) o[k] = d * (float)sc[k / 16] * (float)((int)q[k] - 32);
        }
    }
}
