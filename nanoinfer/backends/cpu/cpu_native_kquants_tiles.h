/* K-quant prefill on x86 (AVX2 and up): 16 weight rows unpacked to bytes once, then every token against them.
 *
 * cpu_native_kquants.h includes this after cpu_native_kquants_rows16.h, and kquant_matmul_to takes it for calls
 * of kq_tile_min_tokens tokens or more. The dots of
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
 * On AVX2 (cpu_native_vec16.h's 8-lane vectors) the 16 rows go in two halves of 8; without VNNI a vpmaddubsw and a
 * vpaddw per 4-value group, widened by one vpmaddwd with the scale (at 512 tokens on a Zen 4, against the
 * interleaved kernel: Q5_K and Q6_K 1.5-1.6x, Q4_K level).
 * A super-block's sums are the reference's integers (exact in any order), and its fp32 step is
 * kq_acc_step's operations lane by lane, per super-block in order: the reference's bits.
 */

/* Tokens a call needs for the tiles (below it a call's unpacking would cost more than it saves). Without VNNI
 * (KV_PAIRS16) Q4_K's values leave their nibbles in three instructions, and the interleaved kernel unpacking them in
 * registers stays as fast up to ~256 tokens (one 8192x2048 matrix, this build on a Zen 4: 3.9 against the tiles' 6.0
 * ms at 32 tokens, 61.1 against 59.1 at 512); Q5_K's and Q6_K's tiles win from 32 (1.6x at 512). */
static int kq_tile_min_tokens(int type) {
#ifdef KV_PAIRS16
    if (type == 12) return 256;
#endif
    (void)type;
    return 32;
}
#define KQ_TILE_ROWS 16
/* Tokens a pass, each sharing the pass's weight loads: the interleaved kernels' 4 (AVX-512; measured at 256 tokens on a
 * Zen 4, 6 and 8 were no faster) or 2 (AVX2's 16 registers); KQ16_CONSTANTS makes T a constant up to that */
#define KQ_TILE_TOKENS KQ16_TOKENS

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

/* The tile's 16 rows against T tokens (T <= KQ_TILE_TOKENS, a constant where inlined): out[t][r], fp32. On
 * cpu_native_vec16.h's vectors: AVX-512 all 16 rows a register, AVX2 the rows in two halves of 8 (the tile stays in
 * L1/L2 for the second). */
static inline __attribute__((always_inline)) void kq_tile_dot(const kq_tile *tl, int type, int blocks, int T,
                                                             kq_tokens x, float out[KQ_TILE_TOKENS][KQ_TILE_ROWS]) {
    const int nsub = kq_tile_subs(type), width = QK_K / nsub, groups = width / 4;
    for (int half = 0; half < KQ_TILE_ROWS / V16_LANES; half++) {
        kv_f acc[KQ_TILE_TOKENS];
        for (int t = 0; t < T; t++) acc[t] = kv_zero_ps();
        for (int b = 0; b < blocks; b++) {
            const uint8_t *q = tl->q + (int64_t)b * QK_K * KQ_TILE_ROWS;
            kv_i sumi[KQ_TILE_TOKENS], other[KQ_TILE_TOKENS]; /* the scaled dots; the mins' (Q6_K: the offset's) term */
            for (int t = 0; t < T; t++) sumi[t] = kv_zero();
            for (int s = 0; s < nsub; s++) {
                kv_i sc = kv_load((const uint8_t *)(tl->sc + ((int64_t)b * nsub + s) * KQ_TILE_ROWS), 0, half);
#ifdef KV_PAIRS16
                /* (no VNNI) vpmaddubsw's pair sums added in int16 over `span` groups (exact: 4 of Q4_K's/Q5_K's values
                 * < 32, 2 of Q6_K's < 64, |x| <= 128), then widened by a vpmaddwd with the scale in both halves of each
                 * lane: (a + b) sc, in place of a vpmaddwd by ones, a vpaddd and a vpmulld */
                const int span = type == 14 ? 2 : 4;
                const kv_i scw = kv_or(kv_and(sc, kv_set1_32(0xffff)), kv_slli32(sc, 16));
                for (int g0 = s * groups; g0 < (s + 1) * groups; g0 += span) {
                    kv_i pairs[KQ_TILE_TOKENS];
                    for (int t = 0; t < T; t++) pairs[t] = kv_zero();
                    for (int g = g0; g < g0 + span; g++) {
                        kv_i wv = kv_load(q, g, half);
                        for (int t = 0; t < T; t++)
                            pairs[t] = _mm256_add_epi16(pairs[t], _mm256_maddubs_epi16(
                                wv, kv_set1_32(kq_load4(x.xq + t * x.k + b * QK_K + 4 * g))));
                    }
                    for (int t = 0; t < T; t++) sumi[t] = kv_dpwssd(sumi[t], pairs[t], scw);
                }
#else
                kv_i dot[KQ_TILE_TOKENS];
                for (int t = 0; t < T; t++) dot[t] = kv_zero();
                for (int g = s * groups; g < (s + 1) * groups; g++) {
                    kv_i wv = kv_load(q, g, half);
                    for (int t = 0; t < T; t++)
                        dot[t] = kv_dpbusd(dot[t], wv, kv_set1_32(kq_load4(x.xq + t * x.k + b * QK_K + 4 * g)));
                }
                for (int t = 0; t < T; t++) sumi[t] = kv_add(sumi[t], kv_mullo(dot[t], sc));
#endif
            }
            /* sum_j m_j (bsum_2j + bsum_2j+1) over the per-32 sums, or Q6_K's sum_s sc_s bsum_s over the per-16 */
            const int16_t *bs = type == 14 ? x.bs16 : x.bs32;
            const int64_t per = type == 14 ? x.k / 16 : x.k / 32;
            for (int t = 0; t < T; t++) other[t] = kv_zero();
            for (int i = 0; i < nsub / 2; i++) {
                kv_i pv = kv_load((const uint8_t *)(tl->pairs + ((int64_t)b * (nsub / 2) + i) * KQ_TILE_ROWS * 2), 0, half);
                for (int t = 0; t < T; t++)
                    other[t] = kv_dpwssd(other[t], pv, kv_set1_32(kq_load4(bs + t * per + (int64_t)b * nsub + 2 * i)));
            }
            kv_f d = kv_load_ps(tl->d + b * KQ_TILE_ROWS, half), dmin = kv_load_ps(tl->dmin + b * KQ_TILE_ROWS, half);
            for (int t = 0; t < T; t++) { /* Q6_K: sumi - 32 offset */
                kv_i v = type == 14 ? kv_sub(sumi[t], kv_slli32(other[t], 5)) : sumi[t];
                acc[t] = kq16_acc_step(acc[t], x.xd[t * x.blocks + b], d, dmin, v, other[t], type != 14);
            }
        }
        for (int t = 0; t < T; t++) kv_store_ps(out[t] + half * V16_LANES, acc[t]);
    }
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
