/* K-quant prefill on AVX-512 VNNI: 16 weight rows unpacked to bytes once, then every token against them.
 *
 * cpu_native_kquants.h includes this after cpu_native_kquants_x86.h where AVX-512 VNNI is there, and
 * kquant_matmul_to takes it for calls of KQ_TILE_MIN_TOKENS tokens or more. The dots of
 * cpu_native_kquants_x86.h unpack a super-block's values in registers for the 4 tokens of a pass:
 * at a prompt's hundreds of tokens each weight is unpacked a hundred times, and each 64 products
 * cost a vpmaddubsw and a vpdpwssd (the sub-block's scale). Here (llama.cpp's tiled VNNI kernel
 * works this way too) a thread takes 16 rows at a time:
 *   - their super-blocks unpacked once (kquant_unpack, the reference's unpacking) into bytes laid
 *     out as 64-byte vectors of 4 consecutive values of each of the 16 rows, the scales and mins
 *     as int32/int16 vectors of the 16 rows, d and dmin as fp32 vectors;
 *   - every token then dotted against them: one vpdpbusd (the rows' unsigned values times 4
 *     activations broadcast, summed into each row's int32 lane) a 4-value group, the sub-block's
 *     sum times its scale in one vpmulld, the mins' (Q6_K's offset) term one vpdpwssd a pair of
 *     sub-blocks; 4 tokens a pass share each weight load.
 * A super-block's sums are the reference's integers (exact in any order), and its fp32 step is
 * kq_acc_step's operations lane by lane, per super-block in order: the reference's bits.
 */

/* Tokens a call needs for the tiles (below it a call's unpacking would cost more than it saves) */
#ifndef KQ_TILE_MIN_TOKENS
#define KQ_TILE_MIN_TOKENS 32
#endif
#define KQ_TILE_ROWS 16
/* Tokens a pass: each sharing the pass's weight loads (measured at 256 tokens on a Zen 4: 6 and 8 no faster) */
#define KQ_TILE_TOKENS 4

/* 16 rows' super-blocks as the tile dots read them; per super-block b: */
typedef struct {
    uint8_t *q;     /* [b][64 groups][16 rows][4 values] */
    int32_t *sc;    /* [b][nsub][16]: a sub-block's scale (Q4_K/Q5_K 8 of 32 values, Q6_K 16 of 16) */
    int16_t *pairs; /* [b][nsub / 2][16][2]: mins (Q4_K/Q5_K) or scales (Q6_K) of sub-blocks 2i, 2i + 1 */
    float *d, *dmin; /* [b][16] */
} kq_tile;

static int kq_tile_subs(int type) { return type == 14 ? 16 : 8; }

static int kq_tile_alloc(kq_tile *t, int blocks) {
    size_t nb = (size_t)blocks;
    t->q = aligned_alloc(64, nb * QK_K * KQ_TILE_ROWS);
    t->sc = aligned_alloc(64, nb * 16 * KQ_TILE_ROWS * sizeof(int32_t));
    t->pairs = aligned_alloc(64, nb * 8 * KQ_TILE_ROWS * 2 * sizeof(int16_t));
    t->d = aligned_alloc(64, nb * KQ_TILE_ROWS * sizeof(float));
    t->dmin = aligned_alloc(64, nb * KQ_TILE_ROWS * sizeof(float));
    return t->q && t->sc && t->pairs && t->d && t->dmin;
}

static void kq_tile_free(kq_tile *t) { free(t->q), free(t->sc), free(t->pairs), free(t->d), free(t->dmin); }

/* Row r's super-block b of the interleaved group at w, in the file's layout, into out[block_bytes(type)] */
static void kq16_row_block(const uint8_t *w, int type, int blocks, int b, int r, uint8_t *out) {
    const int bytes = block_bytes(type), units = bytes / 4;
    const uint8_t *g = w + (int64_t)b * KQ16 * 4 * units;
    for (int u = 0; u < units; u++) memcpy(out + 4 * u, g + 64 * kq16_place(type, u) + 4 * r, 4);
    if (bytes % 4) memcpy(out + 4 * units, w + (int64_t)blocks * KQ16 * 4 * units + (b * KQ16 + r) * 2, 2);
}

/* Rows w[0 .. 16) (row_bytes apart, or a group of cpu_native_kquants_rows16.h's where interleaved) of `type`
 * into the tile */
static void kq_tile_unpack(const uint8_t *w, int64_t row_bytes, int interleaved, int type, int blocks, kq_tile *t) {
    const int bytes = block_bytes(type), nsub = kq_tile_subs(type);
    kq_block u = {0}; /* (Q6_K's unpacking leaves m and dmin: zeros) */
    uint8_t file[256];
    for (int r = 0; r < KQ_TILE_ROWS; r++)
        for (int b = 0; b < blocks; b++) {
            if (interleaved) kq16_row_block(w, type, blocks, b, r, file);
            kquant_unpack(interleaved ? file : w + r * row_bytes + (int64_t)b * bytes, type, &u);
            uint8_t *q = t->q + (int64_t)b * QK_K * KQ_TILE_ROWS + 4 * r;
            for (int g = 0; g < QK_K / 4; g++) memcpy(q + g * 4 * KQ_TILE_ROWS, u.q + 4 * g, 4);
            for (int s = 0; s < nsub; s++) t->sc[((int64_t)b * nsub + s) * KQ_TILE_ROWS + r] = u.sc[s];
            /* (|a pair's value| <= 127: Q6_K's int8 scales, the 6-bit mins) */
            const int32_t *pair = type == 14 ? u.sc : u.m;
            for (int i = 0; i < nsub / 2; i++)
                for (int h = 0; h < 2; h++)
                    t->pairs[(((int64_t)b * (nsub / 2) + i) * KQ_TILE_ROWS + r) * 2 + h] = (int16_t)pair[2 * i + h];
            t->d[b * KQ_TILE_ROWS + r] = u.d, t->dmin[b * KQ_TILE_ROWS + r] = u.dmin;
        }
}

static inline int32_t kq_load4(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* The tile's 16 rows against T tokens (T <= 4, a constant where inlined): out[t][r], fp32 */
static inline __attribute__((always_inline)) void kq_tile_dot(const kq_tile *tl, int type, int blocks, int T,
                                                             kq_tokens x, float out[KQ_TILE_TOKENS][KQ_TILE_ROWS]) {
    const int nsub = kq_tile_subs(type), width = QK_K / nsub, groups = width / 4;
    __m512 acc[KQ_TILE_TOKENS];
    for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        const uint8_t *q = tl->q + (int64_t)b * QK_K * KQ_TILE_ROWS;
        __m512i sumi[KQ_TILE_TOKENS], other[KQ_TILE_TOKENS]; /* the scaled dots; the mins' (Q6_K: the offset's) term */
        for (int t = 0; t < T; t++) sumi[t] = _mm512_setzero_si512();
        for (int s = 0; s < nsub; s++) {
            __m512i dot[KQ_TILE_TOKENS];
            for (int t = 0; t < T; t++) dot[t] = _mm512_setzero_si512();
            for (int g = s * groups; g < (s + 1) * groups; g++) {
                __m512i wv = _mm512_load_si512((const void *)(q + g * 4 * KQ_TILE_ROWS));
                for (int t = 0; t < T; t++)
                    dot[t] = _mm512_dpbusd_epi32(dot[t], wv, _mm512_set1_epi32(kq_load4(x.xq + t * x.k + b * QK_K + 4 * g)));
            }
            __m512i sc = _mm512_load_si512((const void *)(tl->sc + ((int64_t)b * nsub + s) * KQ_TILE_ROWS));
            for (int t = 0; t < T; t++) sumi[t] = _mm512_add_epi32(sumi[t], _mm512_mullo_epi32(dot[t], sc));
        }
        /* sum_j m_j (bsum_2j + bsum_2j+1) over the per-32 sums, or Q6_K's sum_s sc_s bsum_s over the per-16 */
        const int16_t *bs = type == 14 ? x.bs16 : x.bs32;
        const int64_t per = type == 14 ? x.k / 16 : x.k / 32;
        for (int t = 0; t < T; t++) other[t] = _mm512_setzero_si512();
        for (int i = 0; i < nsub / 2; i++) {
            __m512i pv = _mm512_load_si512((const void *)(tl->pairs + ((int64_t)b * (nsub / 2) + i) * KQ_TILE_ROWS * 2));
            for (int t = 0; t < T; t++)
                other[t] = _mm512_dpwssd_epi32(other[t], pv, _mm512_set1_epi32(kq_load4(bs + t * per + (int64_t)b * nsub + 2 * i)));
        }
        __m512 d = _mm512_load_ps(tl->d + b * KQ_TILE_ROWS), dmin = _mm512_load_ps(tl->dmin + b * KQ_TILE_ROWS);
        for (int t = 0; t < T; t++) { /* Q6_K: sumi - 32 offset */
            __m512i s = type == 14 ? _mm512_sub_epi32(sumi[t], _mm512_slli_epi32(other[t], 5)) : sumi[t];
            acc[t] = kq16_acc_step(acc[t], x.xd[t * x.blocks + b], d, dmin, s, other[t], type != 14);
        }
    }
    for (int t = 0; t < T; t++) _mm512_storeu_ps(out[t], acc[t]);
}

static void kq_tile_dot_any(const kq_tile *tl, int type, int blocks, int T, kq_tokens x, float out[KQ_TILE_TOKENS][KQ_TILE_ROWS]) {
#define KQ_TILE_DOT(n, ty) kq_tile_dot(tl, ty, blocks, n, x, out)
    KQ16_CONSTANTS(KQ_TILE_DOT, T, type)
#undef KQ_TILE_DOT
}

/* y [rows, ldy] columns 0 .. n16 (a multiple of 16) = the tokens (x, file order) @ rows 0 .. n16 of w (in
 * 16-row groups where interleaved). Returns -1 without memory for a thread's tile. */
static int kquant_tiles_to(const uint8_t *w, int64_t row_bytes, int interleaved, int type, int blocks, int rows,
                           kq_tokens x, int n16, void *y, int64_t ldy, int y_f32, int threads) {
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        kq_tile tl;
        if (!kq_tile_alloc(&tl, blocks)) failed = 1;
#pragma omp for schedule(static)
        for (int p = 0; p < n16 / KQ_TILE_ROWS; p++) {
            if (failed) continue;
            int r0 = p * KQ_TILE_ROWS;
            kq_tile_unpack(w + r0 * row_bytes, row_bytes, interleaved, type, blocks, &tl);
            for (int t = 0; t < rows; t += KQ_TILE_TOKENS) {
                int T = rows - t < KQ_TILE_TOKENS ? rows - t : KQ_TILE_TOKENS;
                kq_tokens xt = {x.xq + (int64_t)t * x.k, x.xd + (int64_t)t * x.blocks, x.bs16 + (int64_t)t * x.k / 16,
                                x.bs32 + (int64_t)t * x.k / 32, x.k, x.blocks, 0};
                float out[KQ_TILE_TOKENS][KQ_TILE_ROWS];
                kq_tile_dot_any(&tl, type, blocks, T, xt, out);
                kq16_write(out, T, y, ldy, t, r0, y_f32);
            }
        }
        kq_tile_free(&tl);
    }
    return failed ? -1 : 0;
}
