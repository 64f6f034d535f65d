/* K-quant matmuls: GGUF's Q4_K, Q5_K and Q6_K super-blocks multiplied as the file stores them.
 *
 * cpu_native.c includes this after its group block matmul. The weights are ggml's block_q4_K,
 * block_q5_K and block_q6_K rows (nanoinfer/quant/kquants.py's KQuantWeight); the activations are
 * rounded per 256 to int8 with one fp32 scale (llama.cpp's Q8_K: xd = amax / 127), and the
 * per-16 sums of those int8 kept for the mins (Q4_K, Q5_K) and Q6_K's offset of 32:
 *   Q4_K/Q5_K: sum_i (d sc_j q_i - dmin m_j) xd x_i = xd d sum_j sc_j (q_j . x_j) - xd dmin sum_j m_j sum x_j
 *   Q6_K:      sum_i d sc_s (q_i - 32) xd x_i      = xd d sum_s sc_s (q_s . x_s - 32 sum x_s)
 * A super-block's sums are integers (exact in any order, so every tier gets the same ones),
 * then per super-block in order acc += (xd d) sumi - (xd dmin) summ in fp32, unfused:
 * kquants.reference_kquant_matmul is the same computation in torch ops, bit for bit.
 *
 * On x86 with AVX2 and on ARM with NEON the super-blocks are dotted as stored, their values
 * taken out in registers (cpu_native_kquants_x86.h, several rows a pass, and
 * cpu_native_kquants_arm.h: at one token that is what sets the speed). Elsewhere (plain C)
 * each super-block of a row is first unpacked into bytes (q, 0..63, plain loops the compiler
 * vectorizes; once for all of a call's tokens), then dotted with the activations in plain
 * loops; the tests hold that path, the plain tier, to the same reference.
 */

#define QK_K 256

static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    if (exp == 0x1f)
        u = sign | 0x7f800000u | (man << 13);
    else if (exp)
        u = sign | ((exp + 112) << 23) | (man << 13);
    else if (!man)
        u = sign;
    else { /* subnormal: normalize */
        int e = -1;
        do e++, man <<= 1; while (!(man & 0x400u));
        u = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* sum_j sc[j] (q_j . x_j) over n sub-blocks of `width` values, in plain loops (the unpacking path's dot) */
static inline int scaled_dots(const uint8_t *q, const int8_t *x, const int32_t *sc, int n, int width) {
    int total = 0;
    for (int j = 0; j < n; j++) {
        int s = 0;
        for (int i = 0; i < width; i++) s += (int)q[width * j + i] * (int)x[width * j + i];
        total += sc[j] * s;
    }
    return total;
}

/* x [rows, k] bf16 to Q8_K: xq [rows, k] int8, xd [rows, k / 256] fp32, bsum [rows, k / 16] int32, on
 * `threads` (each super-block by itself: the same bits on any) */
static void quantize_q8k_on(const uint16_t *x, int rows, int k, int8_t *xq, float *xd, int32_t *bsum, int threads) {
    int64_t all = (int64_t)rows * k / QK_K;
#pragma omp parallel for schedule(static) num_threads(threads) if (all >= 64)
    for (int64_t b = 0; b < all; b++) {
        /* (both loops vectorized, scalar before: a decode step's 80 calls took 1.5% of a Q4_K_M token on a Zen 4;
         * a max and a sum of integers come out the same in any order) */
        float v[QK_K], amax = 0.0f;
#pragma omp simd reduction(max : amax)
        for (int i = 0; i < QK_K; i++) {
            v[i] = bf16_to_f32(x[b * QK_K + i]);
            amax = fabsf(v[i]) > amax ? fabsf(v[i]) : amax;
        }
        float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int8_t *q = xq + b * QK_K;
        /* nearbyintf's round-half-even by the 1.5 * 2^23 trick (exact below 2^22, which |v inv| <= 127 is; GCC
         * leaves nearbyintf scalar) */
#pragma omp simd
        for (int i = 0; i < QK_K; i++) q[i] = (int8_t)(int)((v[i] * inv + 12582912.0f) - 12582912.0f);
        for (int s = 0; s < QK_K / 16; s++) {
            int sum = 0;
#pragma omp simd reduction(+ : sum)
            for (int i = 16 * s; i < 16 * s + 16; i++) sum += q[i];
            bsum[b * 16 + s] = sum;
        }
        xd[b] = amax / 127.0f;
    }
}

void quantize_q8k(const uint16_t *x, int rows, int k, int8_t *xq, float *xd, int32_t *bsum) {
    quantize_q8k_on(x, rows, k, xq, xd, bsum, 1);
}

/* Q4_K's and Q5_K's 6-bit scales and mins (ggml's get_scale_min_k4) */
static inline void scale_min_k4(const uint8_t *s, int32_t *sc, int32_t *m) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63, m[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 15) | (s[j] >> 6) << 4;
        m[j + 4] = (s[j + 8] >> 4) | (s[j + 4] >> 6) << 4;
    }
}

/* A super-block unpacked: values as bytes (0..63), scales (and Q4_K's/Q5_K's mins), factors. */
typedef struct {
    uint8_t q[QK_K];
    int32_t sc[16], m[8];
    float d, dmin;
} kq_block;

static inline void kquant_unpack(const uint8_t *b, int type, kq_block *u) {
    uint8_t *q = u->q;
    if (type == 14) { /* Q6_K: ql[128], qh[64], scales[16] int8, d */
        const uint8_t *ql = b, *qh = b + 128;
        for (int h = 0; h < 2; h++, ql += 64, qh += 32)
            for (int l = 0; l < 32; l++) {
                uint8_t *o = q + 128 * h + l;
                o[0] = (ql[l] & 15) | (qh[l] & 3) << 4;
                o[32] = (ql[l + 32] & 15) | (qh[l] >> 2 & 3) << 4;
                o[64] = (ql[l] >> 4) | (qh[l] >> 4 & 3) << 4;
                o[96] = (ql[l + 32] >> 4) | (qh[l] >> 6) << 4;
            }
        for (int s = 0; s < 16; s++) u->sc[s] = (int8_t)b[192 + s];
        u->d = half_to_float((uint16_t)(b[208] | b[209] << 8));
        return;
    }
    /* Q4_K: d, dmin, scales[12], qs[128]; Q5_K: the same with qh[32] before qs */
    const uint8_t *qs = b + (type == 12 ? 16 : 48), *qh = b + 16;
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l++) {
            q[64 * c + l] = qs[32 * c + l] & 15;
            q[64 * c + 32 + l] = qs[32 * c + l] >> 4;
        }
    if (type == 13)
        for (int j = 0; j < 8; j++)
            for (int l = 0; l < 32; l++) q[32 * j + l] |= (qh[l] >> j & 1) << 4;
    scale_min_k4(b + 4, u->sc, u->m);
    u->d = half_to_float((uint16_t)(b[0] | b[1] << 8)), u->dmin = half_to_float((uint16_t)(b[2] | b[3] << 8));
}

/* An unpacked super-block against one of the activations: its fp32 contribution. */
static inline float kquant_block_dot(const kq_block *u, int type, const int8_t *xq, float xd, const int32_t *bsum) {
    if (type == 14) {
        int offset = 0;
        for (int s = 0; s < 16; s++) offset += u->sc[s] * bsum[s];
        int sumi = scaled_dots(u->q, xq, u->sc, 16, 16) - 32 * offset;
        return (xd * u->d) * (float)sumi;
    }
    int summ = 0;
    for (int j = 0; j < 8; j++) summ += u->m[j] * (bsum[2 * j] + bsum[2 * j + 1]);
    int sumi = scaled_dots(u->q, xq, u->sc, 8, 32);
    return (xd * u->d) * (float)sumi - (xd * u->dmin) * (float)summ;
}

static int block_bytes(int type) { return type == 12 ? 144 : type == 13 ? 176 : type == 14 ? 210 : 0; }

/* Rows ids[0 .. n) of w (K-quant rows of `type` in the file's layout, `blocks` super-blocks each) to fp32 out
 * [n, blocks * 256]: an embedding's lookup, which in torch ops (kquants.dequantize, its reference: the same
 * products in the same order, so the same bits) took ~0.3 ms of a decode step. Returns -2 for a type it does not
 * take. */
int kquant_dequantize_rows(const uint8_t *w, int type, int blocks, const int64_t *ids, int n, float *out) {
    int bytes = block_bytes(type);
    if (!bytes) return -2;
    for (int r = 0; r < n; r++)
        for (int b = 0; b < blocks; b++) {
            kq_block u;
            kquant_unpack(w + (ids[r] * blocks + b) * bytes, type, &u);
            float *o = out + ((int64_t)r * blocks + b) * QK_K;
            if (type == 14)
                for (int s = 0; s < 16; s++) {
                    float scale = u.d * (float)u.sc[s];
                    for (int i = 0; i < 16; i++) o[16 * s + i] = scale * (float)((int)u.q[16 * s + i] - 32);
                }
            else
                for (int j = 0; j < 8; j++) {
                    float scale = u.d * (float)u.sc[j], low = u.dmin * (float)u.m[j];
                    for (int i = 0; i < 32; i++) o[32 * j + i] = scale * (float)u.q[32 * j + i] - low;
                }
        }
    return 0;
}

/* Where the activations of the tokens a pass takes together are: token t's xq [k] int8 at xq + t k,
 * its xd [blocks] at xd + t blocks, its int16 per-16 and per-32 sums at bs16 + t k / 16 and
 * bs32 + t k / 32. */
typedef struct {
    const int8_t *xq;
    const float *xd;
    const int16_t *bs16, *bs32;
    int64_t k, blocks;
    int wide; /* xq interleaved for the 512-bit Q4_K/Q5_K dots (kq45_wide) */
} kq_tokens;

/* kquant_rows_dot: the super-blocks dotted in registers, KQ_ROWS rows by KQ_TOKENS tokens a pass */
#if defined(__AVX2__) && defined(__F16C__)
#include "cpu_native_kquants_x86.h"
#define KQ_ROWS16 1 /* weights interleaved 16 rows a group at load (kquants.interleave) */
#include "cpu_native_kquants_rows16.h"
#define KQ_TILES 1 /* prefill: 16 rows unpacked once for every token */
#include "cpu_native_kquants_tiles.h"
#elif defined(__aarch64__) && defined(__ARM_NEON)
#include "cpu_native_kquants_arm.h"
#define KQ_ROWS16 1 /* the x86 kernel over cpu_native_vec16.h's NEON vectors */
#include "cpu_native_kquants_rows16.h"
#endif

#ifndef KQ_ROWS
/* The unpacking path (every build without kquant_rows_dot): a row's super-blocks are unpacked once
 * for all the tokens; each token's sum still runs over the blocks in order (the same bits
 * whatever rows share the call). */
static void kquant_rows_unpacked(const uint8_t *w, int64_t row_bytes, int type, int blocks, int rows, int k,
                                 const int8_t *xq, const float *xd, const int32_t *bsum, void *y, int64_t ldy,
                                 int y_f32, int n, int threads) {
    int bytes = block_bytes(type);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int r = 0; r < n; r++) {
        const uint8_t *wr = w + r * row_bytes;
        float acc[rows];
        kq_block u;
        for (int t = 0; t < rows; t++) acc[t] = 0.0f;
        for (int b = 0; b < blocks; b++) {
            kquant_unpack(wr + b * bytes, type, &u);
            for (int t = 0; t < rows; t++)
                acc[t] += kquant_block_dot(&u, type, xq + (int64_t)t * k + b * QK_K, xd[t * blocks + b],
                                           bsum + ((int64_t)t * blocks + b) * 16);
        }
        for (int t = 0; t < rows; t++) {
            if (y_f32)
                ((float *)y)[t * ldy + r] = acc[t];
            else
                ((uint16_t *)y)[t * ldy + r] = f32_to_bf16(acc[t]);
        }
    }
}
#endif

/* How many rows kquants.interleave should put in a group of `type` for this build's kernels (0: keep the file's
 * layout): 16 wherever cpu_native_kquants_rows16.h is built (x86 AVX2 and up, ARM NEON). (On AVX2 Q6_K's 256-bit
 * passes were once kept out, timed one matrix at a time no faster; a whole AVX2 decode of a Q4_K_M file runs 13%
 * faster with them, 29.9 -> 33.7 tok/s in 5 of 5 rounds, at the same pp512: bench/RESULTS.md.) */
int kquant_interleave_rows(int type) {
#ifdef KQ_ROWS16
    return block_bytes(type) ? KQ16 : 0;
#else
    (void)type;
    return 0;
#endif
}

/* y [rows, ldy] (columns col0 ..  col0 + n) = x [rows, k] bf16 @ w.T, w [n, k] K-quant rows of
 * `type` (ggml's id: 12 Q4_K, 13 Q5_K, 14 Q6_K), the first n - n % 16 of them in 16-row groups where
 * `interleaved` (kquant_interleave_rows); bf16, or fp32 where y_f32. Returns 0, -1 without memory
 * for the quantized x, -2 for a type, k or layout it does not take. */
static int kquant_matmul_to(const uint16_t *x, int rows, int k, const uint8_t *w, int type, int interleaved, int n,
                            void *y, int64_t ldy, int y_f32, int threads) {
    int blocks = k / QK_K, bytes = block_bytes(type);
    if (!bytes || k % QK_K || (interleaved && interleaved != kquant_interleave_rows(type))) return -2;
    int64_t row_bytes = (int64_t)blocks * bytes, subs = (int64_t)rows * k / 16;
    /* xq, xd, bsum (per-16 int32), and the int16 per-16 and per-32 sums the x86 dots take */
    int8_t *xq = malloc((size_t)rows * k + sizeof(float) * rows * blocks + sizeof(int32_t) * subs +
                        sizeof(int16_t) * (subs + subs / 2));
    if (!xq) return -1;
    float *xd = (float *)(xq + (int64_t)rows * k);
    int32_t *bsum = (int32_t *)(xd + (int64_t)rows * blocks);
    quantize_q8k_on(x, rows, k, xq, xd, bsum, threads);
#ifdef KQ_ROWS
    /* (|a sum of 32 int8| <= 4064: int16 holds it) */
    int16_t *bs16 = (int16_t *)(bsum + subs), *bs32 = bs16 + subs;
    for (int64_t s = 0; s < subs; s++) bs16[s] = (int16_t)bsum[s];
    for (int64_t s = 0; s < subs / 2; s++) bs32[s] = (int16_t)(bsum[2 * s] + bsum[2 * s + 1]);
    int done = 0; /* the columns computed by the tiles */
    kq_tokens all = {xq, xd, bs16, bs32, k, blocks, 0};
#ifdef KQ_TILES
    if (rows >= kq_tile_min_tokens(type) && n >= KQ_TILE_ROWS) {
        done = n / KQ_TILE_ROWS * KQ_TILE_ROWS;
        if (kquant_tiles_to(w, row_bytes, interleaved, type, blocks, rows, all, done, y, ldy, y_f32, threads)) {
            free(xq);
            return -1;
        }
    }
#endif
#ifdef KQ_ROWS16
    if (interleaved && !done) { /* (before kq_interleave below reorders xq for the file-layout rows) */
        done = n / KQ16 * KQ16;
        kquant_rows16_to(w, row_bytes, type, blocks, rows, all, done, y, ldy, y_f32, threads);
    }
#endif
    int wide = 0;
#ifdef KQ45_WIDE
    wide = done < n && kq45_wide(type, rows);
    if (wide) kq_interleave(xq, (int64_t)rows * blocks); /* (the per-16 sums above keep the file's order) */
#endif
    int passes = (n - done + KQ_ROWS - 1) / KQ_ROWS;
    /* Tokens in tiles whose activations stay in L2 (~256 KiB) while every pass runs over them: a
     * pass's rows stay in L1 over its tile's tokens, and each tile reads the weights once. */
    int tile = (int)(262144 / k) > KQ_TOKENS ? (int)(262144 / k) : KQ_TOKENS;
    for (int t0 = 0; t0 < rows && done < n; t0 += tile) {
        int t1 = t0 + tile < rows ? t0 + tile : rows;
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int p = 0; p < passes; p++) {
            int r0 = done + p * KQ_ROWS, R = n - r0 < KQ_ROWS ? n - r0 : KQ_ROWS;
            for (int t = t0; t < t1;) {
                int T = t1 - t >= KQ_TOKENS ? KQ_TOKENS : t1 - t >= 2 ? 2 : 1;
                kq_tokens x = {xq + (int64_t)t * k, xd + (int64_t)t * blocks, bs16 + (int64_t)t * k / 16,
                               bs32 + (int64_t)t * k / 32, k, blocks, wide};
                float out[KQ_TOKENS * KQ_ROWS];
                kquant_rows_dot(w + r0 * row_bytes, row_bytes, R, T, type, blocks, x, out);
                for (int u = 0; u < T; u++, t++)
                    for (int r = 0; r < R; r++) {
                        if (y_f32)
                            ((float *)y)[t * ldy + r0 + r] = out[u * KQ_ROWS + r];
                        else
                            ((uint16_t *)y)[t * ldy + r0 + r] = f32_to_bf16(out[u * KQ_ROWS + r]);
                    }
            }
        }
    }
#else
    kquant_rows_unpacked(w, row_bytes, type, blocks, rows, k, xq, xd, bsum, y, ldy, y_f32, n, threads);
#endif
    free(xq);
    return 0;
}

/* kquant_matmul_to over y [rows, n] (what cpu_native.py binds) */
int kquant_matmul(const uint16_t *x, int rows, int k, const uint8_t *w, int type, int interleaved, int n, void *y,
                  int y_f32, int threads) {
    return kquant_matmul_to(x, rows, k, w, type, interleaved, n, y, n, y_f32, threads);
}
