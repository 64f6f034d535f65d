/* Block matmuls of 4- and 8-bit groups of 32 (GGUF's Q4_0, Q4_1, Q8_0 and the packed int4/int8
 * weights): the integer dot products per ISA tier, the int8 rounding of the activations, and
 * `block_matmul`, the call cpu_native.py binds.
 *
 * cpu_native.c includes this after cpu_native_attention.h (whose AVX2/NEON helpers it shares the
 * includes of), and cpu_native_kquants.h after it.
 */

/* ---- Block matmuls with int8 activations: llama.cpp's method for 4- and 8-bit groups ----
 *
 * torch's packed int4 kernel multiplies in fp32 and is bound by the cores' FMA rate, not by
 * memory. Here each group of 32 activations is rounded to int8 with its own scale (ggml's
 * Q8_0), and products of the weights' unsigned integers with them are integer instructions
 * (vpdpbusd: u8 x s8 summed in fours into int32; on plain AVX2 vpmaddubsw + vpmaddwd):
 *   sum_i (d q_i + m) (dx qx_i) = d dx sum_i q_i qx_i + m (dx sum_i qx_i).
 *
 * Layout (quantized.BlockWeight writes it): a weight row [k] is chunks of G groups of 32,
 * G = 8 while 8 are left, then 4, 2, 1 as the rest needs. In a chunk, value 4 s + i of group
 * j (step s of 8, i of 4) sits at byte 4 (G s + j) + i (8 bits); for 4 bits, the chunk's
 * 16 G bytes hold the first half of that order in their low nibbles and the second half in
 * their high ones. So each 32-byte load (or nibble half of one) is four values of each of
 * the chunk's groups: int32 lane l sums group l % G, and a chunk ends as one vector scaled by
 * its groups' scales (repeated 8 / G times) in one multiply-add, no horizontal sums. The
 * activations are quantized into the same order (that of 8 bits). Scale d and min m are
 * fp16 [n, k / 32]. */
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define BLOCK_DOT 1

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DOT_ISA 3
static inline __m256i dot_acc(__m256i acc, __m256i w, __m256i x) { return _mm256_dpbusd_epi32(acc, w, x); }
#elif defined(__AVXVNNI__)
#define DOT_ISA 2
static inline __m256i dot_acc(__m256i acc, __m256i w, __m256i x) { return _mm256_dpbusd_avx_epi32(acc, w, x); }
#else
#define DOT_ISA 1
/* (u8 x s8 pairs summed to int16 saturate past 32767: exact for weights below 2^7) */
static inline __m256i dot_acc(__m256i acc, __m256i w, __m256i x) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
}
#endif

static inline __m256i load32(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* 8-bit weights as dot_acc takes them: whole bytes, or on plain AVX2 16 high + low nibbles */
static inline __m256i dot_acc8(__m256i acc, __m256i w, __m256i x) {
#if DOT_ISA == 1
    __m256i low = _mm256_set1_epi8(0x0f);
    __m256i hi = dot_acc(_mm256_setzero_si256(), _mm256_and_si256(_mm256_srli_epi16(w, 4), low), x);
    return dot_acc(_mm256_add_epi32(acc, _mm256_slli_epi32(hi, 4)), _mm256_and_si256(w, low), x);
#else
    return dot_acc(acc, w, x);
#endif
}

/* A chunk's lane sums (G a constant where it is inlined); two chains so the adds overlap. */
static inline __m256i chunk_dot(const uint8_t *q, const int8_t *x, int bits, int G) {
    __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256(), low = _mm256_set1_epi8(0x0f);
    if (bits == 8)
        for (int l = 0; l < G; l += 2) {
            a = dot_acc8(a, load32(q + 32 * l), load32(x + 32 * l));
            if (l + 1 < G) b = dot_acc8(b, load32(q + 32 * l + 32), load32(x + 32 * l + 32));
        }
    else if (G == 1) { /* 16 bytes: both nibble halves in one vector */
        __m128i v = _mm_loadu_si128((const __m128i *)q), low4 = _mm_set1_epi8(0x0f);
        a = dot_acc(a, _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low4), _mm_and_si128(v, low4)), load32(x));
    } else if (DOT_ISA == 1) {
        /* Plain AVX2: the u8 x s8 pair sums stay int16 over the chunk and widen once (one
         * vpmaddwd a chunk, not one a load). Exact: an int16 lane sums at most 8 pairs of
         * 15 x 127 (the activations' int8 stay within +-127), 30480 < 32767. */
        for (int l = 0; l < G / 2; l++) {
            __m256i w = load32(q + 32 * l);
            a = _mm256_add_epi16(a, _mm256_maddubs_epi16(_mm256_and_si256(w, low), load32(x + 32 * l)));
            b = _mm256_add_epi16(b, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(w, 4), low),
                                                         load32(x + 16 * G + 32 * l)));
        }
        return _mm256_madd_epi16(_mm256_add_epi16(a, b), _mm256_set1_epi16(1));
    } else
        for (int l = 0; l < G / 2; l++) {
            __m256i w = load32(q + 32 * l);
            a = dot_acc(a, _mm256_and_si256(w, low), load32(x + 32 * l));
            b = dot_acc(b, _mm256_and_si256(_mm256_srli_epi16(w, 4), low), load32(x + 16 * G + 32 * l));
        }
    return _mm256_add_epi32(a, b);
}

/* d[j] * xd[j] for the chunk's G groups, lane l holding group l % G's. */
static inline __m256 chunk_scales(const uint16_t *d, const float *xd, int G) {
    if (G == 8) return _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)d)), _mm256_loadu_ps(xd));
    if (G == 1) return _mm256_set1_ps(_cvtsh_ss(d[0]) * xd[0]);
    float s[4];
    for (int j = 0; j < G; j++) s[j] = _cvtsh_ss(d[j]) * xd[j];
    if (G == 4) return _mm256_set_m128(_mm_loadu_ps(s), _mm_loadu_ps(s));
    return _mm256_setr_ps(s[0], s[1], s[0], s[1], s[0], s[1], s[0], s[1]);
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* The tail of a row's dot past its whole chunks of 8 groups (g of them done), and its sum. */
static inline float row_dot_finish(__m256 acc, __m256 mins, const uint8_t *q, const uint16_t *d, const uint16_t *m,
                                   const int8_t *xq, const float *xd, const float *xs, int g, int groups, int bits) {
    float rest = 0.0f;
    for (int G = 4; G >= 1; G /= 2) /* unrolled by the compiler: each G a constant */
        if ((groups - g) & G) {
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(chunk_dot(q, xq, bits, G)), chunk_scales(d + g, xd + g, G), acc);
            for (int j = g; j < g + G; j++) rest += _cvtsh_ss(m[j]) * xs[j];
            g += G, q += 4 * bits * G, xq += 32 * G;
        }
    return hsum8(_mm256_add_ps(acc, mins)) + rest;
}

/* Tokens a row's chunk is unpacked once for (block_matmul_to's prefill): as many as the registers hold
 * (its 8 weight registers and two accumulators a token) — AVX-512's 32, AVX2's 16. */
#if defined(__AVX512VL__)
#define ROW_TOKENS 4
#else
#define ROW_TOKENS 2
#endif

/* A chunk of 8 groups' weights as chunk_dot loads them: 4-bit, the low nibbles' 4 registers then the high's;
 * 8-bit, its 8 loads. */
static inline void chunk_weights(const uint8_t *q, int bits, __m256i w[8]) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    for (int l = 0; l < (bits == 8 ? 8 : 4); l++) {
        __m256i v = load32(q + 32 * l);
        if (bits == 8)
            w[l] = v;
        else
            w[l] = _mm256_and_si256(v, low), w[4 + l] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    }
}

/* chunk_dot(q, x, bits, 8) from its weights unpacked by chunk_weights: the same lane sums. */
static inline __m256i chunk_dot_w(const __m256i w[8], const int8_t *x, int bits) {
    __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256();
    if (bits == 8)
        for (int l = 0; l < 8; l += 2) {
            a = dot_acc8(a, w[l], load32(x + 32 * l));
            b = dot_acc8(b, w[l + 1], load32(x + 32 * l + 32));
        }
    else if (DOT_ISA == 1) {
        for (int l = 0; l < 4; l++) {
            a = _mm256_add_epi16(a, _mm256_maddubs_epi16(w[l], load32(x + 32 * l)));
            b = _mm256_add_epi16(b, _mm256_maddubs_epi16(w[4 + l], load32(x + 128 + 32 * l)));
        }
        return _mm256_madd_epi16(_mm256_add_epi16(a, b), _mm256_set1_epi16(1));
    } else
        for (int l = 0; l < 4; l++) {
            a = dot_acc(a, w[l], load32(x + 32 * l));
            b = dot_acc(b, w[4 + l], load32(x + 128 + 32 * l));
        }
    return _mm256_add_epi32(a, b);
}

#if DOT_ISA == 3 && defined(__AVX512BW__)
/* A 4-bit chunk's weights in 512-bit registers (AVX-512 VNNI): w[0], w[1] the low nibbles of its 64-byte halves,
 * w[2], w[3] the high ones; its dot in 4 vpdpbusd, not 8. Lane i of the low 256 bits and lane i of the high sum
 * what lane i of chunk_dot's 256-bit sums holds (the products of its loads 2j and 2j + 1): folded, the same
 * integers. */
#define CHUNK_WIDE 1
static inline void chunk_weights4_wide(const uint8_t *q, __m512i w[4]) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int j = 0; j < 2; j++) {
        __m512i v = _mm512_loadu_si512((const void *)(q + 64 * j));
        w[j] = _mm512_and_si512(v, low), w[2 + j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
}

static inline __m256i chunk_dot4_wide(const __m512i w[4], const int8_t *x) {
    __m512i a = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], _mm512_loadu_si512((const void *)x));
    __m512i b = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[2], _mm512_loadu_si512((const void *)(x + 128)));
    a = _mm512_dpbusd_epi32(a, w[1], _mm512_loadu_si512((const void *)(x + 64)));
    b = _mm512_dpbusd_epi32(b, w[3], _mm512_loadu_si512((const void *)(x + 192)));
    __m512i s = _mm512_add_epi32(a, b);
    return _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
}

#define GROUP_TILES 1 /* prefill: 16 rows unpacked once for every token */
#include "cpu_native_groups_tiles.h"
#endif
#include "cpu_native_vec16.h"
#include "cpu_native_groups_rows16.h" /* decode: 16 rows interleaved at load */

/* One weight row against T tokens (T <= ROW_TOKENS, a constant where inlined; token t's rows at xq + t k,
 * xd + t groups, xs + t groups): each chunk's weights unpacked once for all of them, each token's operations those
 * of a one-token call (T = 1), in its order: the same bits as one token at a time. */
static inline __attribute__((always_inline)) void row_dot_tokens(const uint8_t *q, const uint16_t *d,
                                                                 const uint16_t *m, const int8_t *xq, const float *xd,
                                                                 const float *xs, int groups, int bits, int64_t k,
                                                                 int T, float *out) {
    __m256 acc[ROW_TOKENS], mins[ROW_TOKENS];
    for (int t = 0; t < T; t++) acc[t] = mins[t] = _mm256_setzero_ps();
    int g = 0;
    const uint8_t *qc = q;
    for (; g + 8 <= groups; g += 8, qc += 32 * bits) {
        __m256i w[8];
#ifdef CHUNK_WIDE
        __m512i wide[4];
        if (bits == 4)
            chunk_weights4_wide(qc, wide);
        else
#endif
            chunk_weights(qc, bits, w);
        __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + g)));
        __m256 mv = m ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(m + g))) /* (NULL: symmetric, interleaved) */
                      : _mm256_mul_ps(dv, _mm256_set1_ps(-(float)(1 << (bits - 1))));
        for (int t = 0; t < T; t++) {
#ifdef CHUNK_WIDE
            __m256i sums = bits == 4 ? chunk_dot4_wide(wide, xq + t * k + 32 * g) : chunk_dot_w(w, xq + t * k + 32 * g, bits);
#else
            __m256i sums = chunk_dot_w(w, xq + t * k + 32 * g, bits);
#endif
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(dv, _mm256_loadu_ps(xd + t * groups + g)),
                                     acc[t]);
            mins[t] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(xs + t * groups + g), mins[t]);
        }
    }
    for (int t = 0; t < T; t++)
        out[t] = row_dot_finish(acc[t], mins[t], qc, d, m, xq + t * k + 32 * g, xd + t * groups, xs + t * groups, g,
                                groups, bits);
}

static void row_dot_some(const uint8_t *q, const uint16_t *d, const uint16_t *m, const int8_t *xq, const float *xd,
                         const float *xs, int groups, int bits, int64_t k, int T, float *out) {
    switch (T) { /* (each T its own unrolled copy) */
    case 1: row_dot_tokens(q, d, m, xq, xd, xs, groups, bits, k, 1, out); return;
    case 2: row_dot_tokens(q, d, m, xq, xd, xs, groups, bits, k, 2, out); return;
#if ROW_TOKENS > 2
    case 3: row_dot_tokens(q, d, m, xq, xd, xs, groups, bits, k, 3, out); return;
    case 4: row_dot_tokens(q, d, m, xq, xd, xs, groups, bits, k, 4, out); return;
#endif
    }
}
#elif defined(__aarch64__) && defined(__ARM_NEON)
/* row_dot, BLOCK_DOT and DOT_ISA (4 neon, 5 neon-dotprod, 6 neon-i8mm): cpu_native_arm.h, included above;
 * block_matmul_to calls its row_dot a token at a time (row_dot_some below), and the interleaved rows' kernel
 * as x86 does (4 rows a NEON register) */
#include "cpu_native_vec16.h"
#include "cpu_native_groups_rows16.h"
#else
#define BLOCK_DOT 0
#define DOT_ISA 0
#endif

#if BLOCK_DOT && !defined(ROW_TOKENS)
/* (a build whose row_dot takes one token at a time: ARM's) */
#define ROW_TOKENS 1
static void row_dot_some(const uint8_t *q, const uint16_t *d, const uint16_t *m, const int8_t *xq, const float *xd,
                         const float *xs, int groups, int bits, int64_t k, int T, float *out) {
    (void)k, (void)T;
    out[0] = row_dot(q, d, m, xq, xd, xs, groups, bits);
}
#endif

#ifndef PREFETCH_ROWS
#define PREFETCH_ROWS 8
#endif

/* The rows a group of block_matmul's interleaved layout holds for `bits`-bit weights (cpu_native_groups_rows16.h;
 * BlockWeight.interleave in nanoinfer/quant/grouped.py writes it), or 0 where this build reads the file's layout
 * only. */
int block_interleave_rows(int bits) {
#ifdef GROUP_ROWS16
    return bits == 4 || bits == 8 ? GROUP_ROWS16 : 0;
#else
    (void)bits;
    return 0;
#endif
}

/* Which group dot product this build has: 3 AVX-512 VNNI, 2 AVX-VNNI, 1 AVX2, 6 NEON i8mm,
 * 5 NEON dotprod, 4 NEON, 0 none (block_matmul is then not to be called). */
int block_dot_isa(void) { return DOT_ISA; }

/* The same, as a user reads it (`nanoinfer env`, the log line at start). */
const char *block_dot_name(void) {
    switch (DOT_ISA) {
    case 3: return "avx512-vnni";
    case 2: return "avx-vnni";
    case 1: return "avx2";
    case 4: return "neon";
    case 5: return "neon-dotprod";
    case 6: return "neon-i8mm";
    default: return "none";
    }
}

/* x [rows, k] bf16 to ggml's Q8_0 per group of 32, in the chunk order above: xq = round(x / dx)
 * with dx = max|x| / 127; xd = dx and xs = dx * sum(xq) (what the weights' mins multiply)
 * [rows, k / 32]. */
#if !(defined(__aarch64__) && defined(__ARM_NEON)) /* (ARM's, the same bits: cpu_native_arm.h) */
void quantize_groups_q8(const uint16_t *x, int rows, int k, int8_t *xq, float *xd, float *xs) {
    int groups = k / 32;
    for (int64_t r = 0; r < rows; r++)
        for (int start = 0, G = 8; start < groups; start += G) {
            while (start + G > groups) G /= 2;
            for (int j = 0; j < G; j++) {
                /* (the max, the round and the sum in SIMD loops, as quantize_q8k's: they ran scalar, 2.4% of a
                 * Q4_0 decode step on the calling thread; a max and an integer sum come out the same in any order) */
                int g = start + j;
                const uint16_t *xg = x + r * k + g * 32;
                float v[32], amax = 0.0f;
#pragma omp simd reduction(max : amax)
                for (int i = 0; i < 32; i++) {
                    v[i] = bf16_to_f32(xg[i]);
                    amax = fabsf(v[i]) > amax ? fabsf(v[i]) : amax;
                }
                float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
                int8_t q[32];
                int sum = 0;
                /* nearbyintf's round-half-even by the 1.5 * 2^23 trick (exact below 2^22, which |v inv| <= 127 is) */
#pragma omp simd reduction(+ : sum)
                for (int i = 0; i < 32; i++) {
                    int qi = (int)((v[i] * inv + 12582912.0f) - 12582912.0f);
                    q[i] = (int8_t)qi;
                    sum += qi;
                }
                int8_t *chunk = xq + r * k + start * 32;
                for (int i = 0; i < 32; i += 4) memcpy(chunk + 4 * (G * (i / 4) + j), q + i, 4);
                xd[r * groups + g] = amax / 127.0f;
                xs[r * groups + g] = amax / 127.0f * (float)sum;
            }
        }
}
#endif

/* y [rows, n] = x [rows, k] bf16 @ w.T, w [n, k] as above (`interleaved`: its rows in groups of that many,
 * block_interleave_rows, and m may then be NULL: a symmetric format's -2^(bits - 1) d): bf16, or fp32 where
 * y_f32 (a tensor-parallel rank's partial sum, rounded only once the ranks' parts are added). Returns 0, -1 when there was no memory for the quantized x (rows * k * 5 / 4 bytes),
 * -2 for a layout this build does not read. */
static int block_matmul_to(const uint16_t *x, int rows, int k, const uint8_t *q, const uint16_t *d, const uint16_t *m,
                           int bits, int interleaved, int n, void *y, int64_t ldy, int y_f32, int threads) {
    if (interleaved ? interleaved != block_interleave_rows(bits) || k % 256 : !m) return -2;
#if BLOCK_DOT
    int groups = k / 32;
    int64_t row_bytes = (int64_t)k * bits / 8;
    int8_t *xq = malloc((size_t)rows * k * 5 / 4);
    if (!xq) return -1;
    float *xd = (float *)(xq + (int64_t)rows * k), *xs = xd + (int64_t)rows * groups;
    quantize_groups_q8(x, rows, k, xq, xd, xs);
    int done = 0; /* the columns computed by the tiles */
#ifdef GROUP_TILES
    if (rows >= GROUP_TILE_MIN_TOKENS && n >= GROUP_TILE_ROWS && groups % 8 == 0) {
        done = n / GROUP_TILE_ROWS * GROUP_TILE_ROWS;
        if (groups_tiles_to(q, d, m, bits, interleaved, groups, rows, xq, xd, xs, k, done, y, ldy, y_f32, threads)) {
            free(xq);
            return -1;
        }
    }
#endif
#ifdef GROUP_ROWS16
    if (interleaved && !done) {
        done = n / GROUP_ROWS16 * GROUP_ROWS16;
        groups_rows16_to(q, d, m, bits, groups, rows, xq, xd, xs, k, done, y, ldy, y_f32, threads);
    }
#endif
    /* Tokens in tiles whose activations stay in L2 (~256 KiB) while every row runs over them (each tile reads
     * the weights once), ROW_TOKENS of them sharing each unpacked chunk of a row. */
    int tile = (int)(262144 / k) > ROW_TOKENS ? (int)(262144 / k) : ROW_TOKENS;
    for (int t0 = 0; t0 < rows && done < n; t0 += tile) {
        int t1 = t0 + tile < rows ? t0 + tile : rows;
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int r = done; r < n; r++) {
            /* a few rows ahead: the hardware prefetcher alone left a core's stream at ~60% of its bandwidth */
            const uint8_t *ahead = q + (int64_t)(r + PREFETCH_ROWS < n ? r + PREFETCH_ROWS : r) * row_bytes;
            for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(ahead + b, 0, 3);
            for (int t = t0; t < t1; t += ROW_TOKENS) {
                int T = t1 - t < ROW_TOKENS ? t1 - t : ROW_TOKENS;
                float v[ROW_TOKENS];
                row_dot_some(q + r * row_bytes, d + (int64_t)r * groups, m ? m + (int64_t)r * groups : NULL,
                             xq + (int64_t)t * k, xd + (int64_t)t * groups, xs + (int64_t)t * groups, groups, bits, k,
                             T, v);
                for (int u = 0; u < T; u++) {
                    if (y_f32)
                        ((float *)y)[(int64_t)(t + u) * ldy + r] = v[u];
                    else
                        ((uint16_t *)y)[(int64_t)(t + u) * ldy + r] = f32_to_bf16(v[u]);
                }
            }
        }
    }
    free(xq);
#endif
    return 0;
}

/* block_matmul_to over y [rows, n] (what cpu_native.py binds) */
int block_matmul(const uint16_t *x, int rows, int k, const uint8_t *q, const uint16_t *d, const uint16_t *m, int bits,
                 int interleaved, int n, void *y, int y_f32, int threads) {
    return block_matmul_to(x, rows, k, q, d, m, bits, interleaved, n, y, n, y_f32, threads);
}

