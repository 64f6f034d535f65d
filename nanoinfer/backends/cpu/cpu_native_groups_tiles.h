/* Group-of-32 prefill on AVX-512 VNNI: 16 weight rows unpacked to bytes once, then every token against them.
 *
 * cpu_native_groups.h includes this where AVX-512 VNNI is there, and block_matmul_to takes it for calls
 * of GROUP_TILE_MIN_TOKENS tokens or more whose rows are whole chunks of 8 groups (k a multiple of 256).
 * The row dots unpack a chunk's nibbles again for every 4 tokens; here a thread takes 16 rows at a
 * time, their values laid out as 64-byte vectors of 4 consecutive values of each of the 16 rows, d and
 * m as fp32 vectors of the 16 rows, so each vpdpbusd is 4 values of one group for all 16 rows (lanes).
 *
 * The arithmetic is row_dot_tokens' lane by lane: lane l of a row's 8 fp32 accumulators takes group l of
 * each chunk, acc = fma(sum, d xd, acc) and mins = fma(m, xs, mins) chunk after chunk, then hsum8(acc +
 * mins) + 0 (row_dot_finish's empty rest). Here a group lane's accumulator is a vector over the 16 rows,
 * its chunks run in order (the loop over group lanes outside), and hsum8's tree is done across the 8
 * vectors: the same operations on the same values, so the same bits.
 */

#define GROUP_TILE_ROWS 16
#ifndef GROUP_TILE_MIN_TOKENS
#define GROUP_TILE_MIN_TOKENS 32 /* (below it a call's unpacking costs more than it saves) */
#endif
#define GROUP_TILE_TOKENS 4

/* 16 rows of `chunks` chunks: q [group lane j (8)][chunk][step s (8)][16 rows][4 values] (a group lane's
 * chunks in the order the dots read them), d and m [group][16 rows] */
typedef struct {
    uint8_t *q;
    float *d, *m;
} group_tile;

static int group_tile_alloc(group_tile *t, int chunks) {
    size_t groups = (size_t)chunks * 8;
    t->q = aligned_alloc(64, groups * 32 * GROUP_TILE_ROWS);
    t->d = aligned_alloc(64, groups * GROUP_TILE_ROWS * sizeof(float));
    t->m = aligned_alloc(64, groups * GROUP_TILE_ROWS * sizeof(float));
    return t->q && t->d && t->m;
}

static void group_tile_free(group_tile *t) { free(t->q), free(t->d), free(t->m); }

/* Rows r0 .. r0 + 16 of the weights (row_bytes apart, or where `interleaved` a group of
 * cpu_native_groups_rows16.h's, whose units are the tile's vectors packed) into the tile */
static void group_tile_unpack(const uint8_t *q, const uint16_t *d, const uint16_t *m, int64_t row_bytes, int groups,
                              int bits, int interleaved, group_tile *t) {
    const int chunks = groups / 8;
    if (interleaved) {
        const __m512i low = _mm512_set1_epi8(0x0f);
        for (int c = 0; c < chunks; c++)
            for (int u = 0; u < 8 * bits; u++) { /* unit 4 j + s (8 bits: 8 j + s): group j's step s (and s + 4) */
                __m512i v = _mm512_loadu_si512((const void *)(q + ((int64_t)c * 8 * bits + u) * 64));
                int s = u % bits, j = u / bits;
                uint8_t *to = t->q + (((int64_t)j * chunks + c) * 8 + s) * 64;
                if (bits == 8)
                    _mm512_store_si512((void *)to, v);
                else
                    _mm512_store_si512((void *)to, _mm512_and_si512(v, low)),
                        _mm512_store_si512((void *)(to + 4 * 64), _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
            }
        for (int g = 0; g < groups; g++) { /* (m NULL: a symmetric format's, -2^(bits - 1) d exactly) */
            __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + g * 16)));
            _mm512_store_ps(t->d + g * GROUP_TILE_ROWS, dv);
            _mm512_store_ps(t->m + g * GROUP_TILE_ROWS,
                            m ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(m + g * 16)))
                              : _mm512_mul_ps(dv, _mm512_set1_ps(-(float)(1 << (bits - 1)))));
        }
        return;
    }
    for (int r = 0; r < GROUP_TILE_ROWS; r++) {
        const uint8_t *row = q + r * row_bytes;
        for (int c = 0; c < chunks; c++) {
            uint8_t e[256]; /* the chunk's values in the 8-bit order: value 4 s + i of group j at 4 (8 s + j) + i */
            const uint8_t *chunk = row + (int64_t)c * 32 * bits;
            for (int p = 0; p < 128; p++) {
                if (bits == 8)
                    e[p] = chunk[p], e[p + 128] = chunk[p + 128];
                else
                    e[p] = chunk[p] & 15, e[p + 128] = chunk[p] >> 4;
            }
            for (int s = 0; s < 8; s++)
                for (int j = 0; j < 8; j++)
                    memcpy(t->q + ((((int64_t)j * chunks + c) * 8 + s) * GROUP_TILE_ROWS + r) * 4, e + 32 * s + 4 * j, 4);
        }
        for (int g = 0; g < groups; g++) {
            t->d[g * GROUP_TILE_ROWS + r] = _cvtsh_ss(d[r * (int64_t)groups + g]);
            t->m[g * GROUP_TILE_ROWS + r] = _cvtsh_ss(m[r * (int64_t)groups + g]);
        }
    }
}

/* The tile's 16 rows against T tokens (T <= 4, a constant where inlined; token t's xq at xq + t k, its
 * xd and xs at + t groups): out[t][r] */
static inline __attribute__((always_inline)) void group_tile_dot(const group_tile *tl, int groups, int T,
                                                                 const int8_t *xq, const float *xd, const float *xs,
                                                                 int64_t k, float out[GROUP_TILE_TOKENS][GROUP_TILE_ROWS]) {
    __m512 v[GROUP_TILE_TOKENS][8]; /* acc + mins of each group lane */
    for (int j = 0; j < 8; j++) {
        __m512 acc[GROUP_TILE_TOKENS], mins[GROUP_TILE_TOKENS];
        for (int t = 0; t < T; t++) acc[t] = mins[t] = _mm512_setzero_ps();
        for (int c = 0; c < groups / 8; c++) {
            const int g = 8 * c + j;
            __m512i a[GROUP_TILE_TOKENS], b[GROUP_TILE_TOKENS]; /* (two chains a token: the dpbusd overlap) */
            for (int t = 0; t < T; t++) a[t] = b[t] = _mm512_setzero_si512();
            const uint8_t *w = tl->q + ((int64_t)j * (groups / 8) + c) * 8 * 64;
            for (int s = 0; s < 8; s += 2) {
                __m512i w0 = _mm512_load_si512((const void *)(w + s * 64));
                __m512i w1 = _mm512_load_si512((const void *)(w + (s + 1) * 64));
                for (int t = 0; t < T; t++) {
                    const int8_t *x = xq + t * k + c * 256 + 4 * j;
                    int32_t x0, x1;
                    memcpy(&x0, x + 32 * s, 4), memcpy(&x1, x + 32 * (s + 1), 4);
                    a[t] = _mm512_dpbusd_epi32(a[t], w0, _mm512_set1_epi32(x0));
                    b[t] = _mm512_dpbusd_epi32(b[t], w1, _mm512_set1_epi32(x1));
                }
            }
            __m512 dv = _mm512_load_ps(tl->d + g * GROUP_TILE_ROWS), mv = _mm512_load_ps(tl->m + g * GROUP_TILE_ROWS);
            for (int t = 0; t < T; t++) {
                __m512 sum = _mm512_cvtepi32_ps(_mm512_add_epi32(a[t], b[t]));
                acc[t] = _mm512_fmadd_ps(sum, _mm512_mul_ps(dv, _mm512_set1_ps(xd[t * groups + g])), acc[t]);
                mins[t] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[t * groups + g]), mins[t]);
            }
        }
        for (int t = 0; t < T; t++) v[t][j] = _mm512_add_ps(acc[t], mins[t]);
    }
    for (int t = 0; t < T; t++) { /* hsum8's tree: lanes i + 4, then i + 2, then i + 1; then + 0 */
        __m512 s0 = _mm512_add_ps(v[t][0], v[t][4]), s1 = _mm512_add_ps(v[t][1], v[t][5]);
        __m512 s2 = _mm512_add_ps(v[t][2], v[t][6]), s3 = _mm512_add_ps(v[t][3], v[t][7]);
        __m512 sum = _mm512_add_ps(_mm512_add_ps(s0, s2), _mm512_add_ps(s1, s3));
        _mm512_storeu_ps(out[t], _mm512_add_ps(sum, _mm512_setzero_ps()));
    }
}

static void group_tile_dot_any(const group_tile *tl, int groups, int T, const int8_t *xq, const float *xd,
                               const float *xs, int64_t k, float out[GROUP_TILE_TOKENS][GROUP_TILE_ROWS]) {
    switch (T) { /* (each T its own unrolled copy) */
    case 4: group_tile_dot(tl, groups, 4, xq, xd, xs, k, out); return;
    case 3: group_tile_dot(tl, groups, 3, xq, xd, xs, k, out); return;
    case 2: group_tile_dot(tl, groups, 2, xq, xd, xs, k, out); return;
    default: group_tile_dot(tl, groups, 1, xq, xd, xs, k, out); return;
    }
}

/* y [rows, ldy] columns 0 .. n16 (a multiple of 16) = the tokens (xq, xd, xs as quantize_groups_q8 wrote them)
 * @ weight rows 0 .. n16 (interleaved: cpu_native_groups_rows16.h's groups). Returns -1 without memory for a
 * thread's tile. */
static int groups_tiles_to(const uint8_t *q, const uint16_t *d, const uint16_t *m, int bits, int interleaved,
                           int groups, int rows,
                           const int8_t *xq, const float *xd, const float *xs, int64_t k, int n16, void *y, int64_t ldy,
                           int y_f32, int threads) {
    int failed = 0;
    int64_t row_bytes = (int64_t)k * bits / 8;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        group_tile tl;
        if (!group_tile_alloc(&tl, groups / 8)) failed = 1;
#pragma omp for schedule(static)
        for (int p = 0; p < n16 / GROUP_TILE_ROWS; p++) {
            if (failed) continue;
            int r0 = p * GROUP_TILE_ROWS;
            group_tile_unpack(q + r0 * row_bytes, d + (int64_t)r0 * groups, m ? m + (int64_t)r0 * groups : NULL,
                              row_bytes, groups, bits, interleaved, &tl);
            for (int t = 0; t < rows; t += GROUP_TILE_TOKENS) {
                int T = rows - t < GROUP_TILE_TOKENS ? rows - t : GROUP_TILE_TOKENS;
                float out[GROUP_TILE_TOKENS][GROUP_TILE_ROWS];
                group_tile_dot_any(&tl, groups, T, xq + (int64_t)t * k, xd + (int64_t)t * groups, xs + (int64_t)t * groups,
                                   k, out);
                for (int u = 0; u < T; u++)
                    for (int r = 0; r < GROUP_TILE_ROWS; r++) {
                        if (y_f32)
                            ((float *)y)[(int64_t)(t + u) * ldy + r0 + r] = out[u][r];
                        else
                            ((uint16_t *)y)[(int64_t)(t + u) * ldy + r0 + r] = f32_to_bf16(out[u][r]);
                    }
            }
        }
        group_tile_free(&tl);
    }
    return failed ? -1 : 0;
}
