/* Paged attention on the CPU: every query row of a step against its sequence's keys in the fp32 pool.
 *
 * cpu_native.c includes this after its RoPE/KV write (one translation unit, one build): the dot
 * products and weighted sums (AVX2, or cpu_native_arm.h's NEON ones), `attend` for a block of one
 * sequence's rows, and `paged_attention`, the call cpu_native.py binds. No row's arithmetic
 * depends on the rows beside it.
 */

static inline float dot_n(const float *a, const float *b, int n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* The common head sizes as constants: the loop unrolls into a few vector FMAs and one reduce. */
static inline float dot(const float *a, const float *b, int n) {
    if (n == 64) return dot_n(a, b, 64);
    if (n == 128) return dot_n(a, b, 128);
    return dot_n(a, b, n);
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KEYS_AT_ONCE 8
/* scores[i] = scale * (q . k_i) for 8 keys (d a multiple of 8): each key's products summed in
 * an FMA chain per lane over d / 8 steps, then the 8 keys' lanes reduced together (a dot
 * product at a time spends as long on its horizontal sum as on its products). */
static inline void dot8(const float *q, const float *const k[8], int d, float scale, float *scores) {
    __m256 a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
    for (int c = 0; c < d; c += 8) {
        __m256 x = _mm256_loadu_ps(q + c);
        for (int i = 0; i < 8; i++) a[i] = _mm256_fmadd_ps(x, _mm256_loadu_ps(k[i] + c), a[i]);
    }
    __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
    _mm256_storeu_ps(scores, _mm256_mul_ps(sum, _mm256_set1_ps(scale)));
}

/* o[0 .. W) += sum over j, in order, of p[j] * ig * v_j: W / 8 accumulators kept in registers
 * across the keys (W a constant where it is inlined). */
static inline void weighted_sum(const float *p, float ig, const float *v_pool, const int64_t *s, int64_t keys,
                                int64_t stride, int64_t offset, int W, float *o) {
    __m256 a[8];
    for (int i = 0; i < W / 8; i++) a[i] = _mm256_loadu_ps(o + 8 * i);
    for (int64_t j = 0; j < keys; j++) {
        const float *v = v_pool + s[j] * stride + offset;
        __m256 pj = _mm256_set1_ps(p[j] * ig);
        for (int i = 0; i < W / 8; i++) a[i] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 8 * i), a[i]);
    }
    for (int i = 0; i < W / 8; i++) _mm256_storeu_ps(o + 8 * i, a[i]);
}
#elif defined(__aarch64__) && defined(__ARM_NEON)
/* ARM: dot8 and weighted_sum here, and the block matmul's row_dot and quantize_groups_q8 below */
#include "cpu_native_arm.h"
#else
#define KEYS_AT_ONCE 1
#endif

/* Keys a block of rows takes at a time in P V: their values are read once for the block. */
#define KEY_BLOCK 64

/* Rows i < n of one sequence, at consecutive positions: row i of q [n, heads, d] attends to the
 * first c0 + i of the pool slots s (k_pool, v_pool [slots, kv_heads, d]); out like q. Each
 * row's arithmetic is the same whatever n: its scores 8 keys at a time from its first key and
 * the rest one by one, its softmax, P V summed key by key in order. A block only shares the
 * reads of the keys, which a long chunk would otherwise bring from memory once per row. The
 * heads sharing a KV head go together too; only KV heads kvh0 .. kvh1 (and their query heads) are done.
 * scores: scratch of n * (heads / kv_heads) * (c0 + n - 1) floats. */
static void attend(const float *q, int n, int64_t c0, const float *k_pool, const float *v_pool, const int64_t *s,
                   int heads, int kv_heads, int kvh0, int kvh1, int d, float scale, float *scores, float *out) {
    int group = heads / kv_heads, by8 = KEYS_AT_ONCE > 1 && d % 8 == 0;
    int64_t width = c0 + n - 1, hd = (int64_t)heads * d;
    float inv[n * group];
    for (int kvh = kvh0; kvh < kvh1; kvh++) {
        const float *qg = q + (int64_t)kvh * group * d;
        float *og = out + (int64_t)kvh * group * d;
        int64_t j = 0;
#if KEYS_AT_ONCE > 1
        for (; by8 && j + KEYS_AT_ONCE <= c0; j += KEYS_AT_ONCE) { /* the key groups every row has */
            const float *k[KEYS_AT_ONCE];
            for (int e = 0; e < KEYS_AT_ONCE; e++) k[e] = k_pool + (s[j + e] * kv_heads + kvh) * d;
            for (int i = 0; i < n; i++)
                for (int g = 0; g < group; g++)
                    dot8(qg + i * hd + g * d, k, d, scale, scores + (int64_t)(i * group + g) * width + j);
        }
#endif
        for (int i = 0; i < n; i++) {
            int64_t keys = c0 + i, jj = j;
            float *sc = scores + (int64_t)i * group * width;
            const float *qi = qg + i * hd;
#if KEYS_AT_ONCE > 1
            for (; by8 && jj + KEYS_AT_ONCE <= keys; jj += KEYS_AT_ONCE) {
                const float *k[KEYS_AT_ONCE];
                for (int e = 0; e < KEYS_AT_ONCE; e++) k[e] = k_pool + (s[jj + e] * kv_heads + kvh) * d;
                for (int g = 0; g < group; g++) dot8(qi + g * d, k, d, scale, sc + g * width + jj);
            }
#endif
            for (; jj < keys; jj++) { /* (the last keys, fewer than KEYS_AT_ONCE) */
                const float *k = k_pool + (s[jj] * kv_heads + kvh) * d;
                for (int g = 0; g < group; g++) sc[g * width + jj] = dot(qi + g * d, k, d) * scale;
            }
            for (int g = 0; g < group; g++) {
                float *row = sc + g * width, m = -INFINITY, total = 0.0f;
#pragma omp simd reduction(max : m)
                for (int64_t t = 0; t < keys; t++) m = row[t] > m ? row[t] : m;
#pragma omp simd reduction(+ : total)
                for (int64_t t = 0; t < keys; t++) total += row[t] = exp_approx(row[t] - m);
                inv[i * group + g] = 1.0f / total;
            }
            for (int g = 0; g < group; g++) memset(og + i * hd + g * d, 0, sizeof(float) * d);
        }
#if KEYS_AT_ONCE > 1
        if (by8) {
            for (int64_t jb = 0; jb < width; jb += KEY_BLOCK)
                for (int i = 0; i < n; i++) {
                    int64_t end = c0 + i < jb + KEY_BLOCK ? c0 + i : jb + KEY_BLOCK;
                    for (int g = 0; end > jb && g < group; g++) {
                        const float *p = scores + (int64_t)(i * group + g) * width + jb;
                        float *o = og + i * hd + g * d, ig = inv[i * group + g];
                        int c = 0;
                        for (; c + 64 <= d; c += 64)
                            weighted_sum(p, ig, v_pool, s + jb, end - jb, (int64_t)kv_heads * d,
                                         (int64_t)kvh * d + c, 64, o + c);
                        for (; c < d; c += 8)
                            weighted_sum(p, ig, v_pool, s + jb, end - jb, (int64_t)kv_heads * d,
                                         (int64_t)kvh * d + c, 8, o + c);
                    }
                }
            continue;
        }
#endif
        for (int i = 0; i < n; i++)
            for (int64_t t = 0; t < c0 + i; t++) {
                const float *v = v_pool + (s[t] * kv_heads + kvh) * d;
                for (int g = 0; g < group; g++) {
                    float p = scores[(int64_t)(i * group + g) * width + t] * inv[i * group + g];
                    float *o = og + i * hd + g * d;
#pragma omp simd
                    for (int c = 0; c < d; c++) o[c] += p * v[c];
                }
            }
    }
}

/* Attention work (multiply-adds) below which a call stays on one thread: a thread hand-off
 * costs more than a decode step's few rows. */
#define ATTENTION_PARALLEL_WORK (1 << 18)
/* Rows of a chunk attended together (`attend`): enough to share the keys' reads, few enough to
 * spread a chunk over the threads. */
#define ROW_BLOCK 16

/* Every query row of a step, each by `attend` over its own keys: sequence s owns rows
 * query_start[s] .. query_start[s + 1], its newest tokens, the last at position lens[s] - 1;
 * the row at position p sees positions [max(0, p + 1 - window), p] (window 0: [0, p]),
 * found through block table s (int32, rows table_stride apart). A row's arithmetic depends on
 * its query and its keys only, never on the rows beside it or the thread that takes it, so a
 * token comes out bit for bit the same in a prefill chunk of any size, a decode step or a
 * verification row: the int8 rounding of the matmuls after it sees the same inputs. Rows go
 * to `threads` threads when the work is large (a prefill chunk). q and out hold `tokens` rows;
 * those past the last sequence's (padding) come out zero. Returns 0, or -1 when there
 * was no memory for the scratch (the slots of every context, and each thread's scores). */
int paged_attention(const float *q, int tokens, const float *k_pool, const float *v_pool, const int32_t *tables,
                    int64_t table_stride, const int32_t *lens, const int32_t *query_start, int seqs, int block_size,
                    int window, int heads, int kv_heads, int d, float scale, int threads, float *out) {
    int64_t total = 0, max_keys = 0, work = 0;
    int rows = query_start[seqs] - query_start[0];
    for (int s = 0; s < seqs; s++) {
        int64_t len = lens[s], n = query_start[s + 1] - query_start[s];
        int64_t keys = window > 0 && len > window ? window : len;
        total += len;
        max_keys = keys > max_keys ? keys : max_keys;
        work += n * keys;
    }
    if (tokens > query_start[seqs]) memset(out + (int64_t)query_start[seqs] * heads * d, 0,
                                           sizeof(float) * (tokens - query_start[seqs]) * heads * d);
    if (rows <= 0) return 0;
    /* work items: up to ROW_BLOCK consecutive rows of a sequence that see the same first key
     * (without a window: all of a chunk's), or single rows; each KV head's by itself (so a decode
     * step's one row spreads over the threads too) */
    int64_t *slots = malloc(sizeof(int64_t) * (total + 1)), *base = malloc(sizeof(int64_t) * seqs);
    int *item_seq = malloc(sizeof(int) * rows), *item_row = malloc(sizeof(int) * rows), items = 0;
    int failed = !slots || !base || !item_seq || !item_row;
    if (!failed)
        for (int64_t s = 0, offset = 0; s < seqs; offset += lens[s], s++) { /* each context's slots once */
            const int32_t *table = tables + s * table_stride;
            base[s] = offset;
            for (int64_t p = 0; p < lens[s]; p++)
                slots[offset + p] = (int64_t)table[p / block_size] * block_size + p % block_size;
            for (int r = query_start[s]; r < query_start[s + 1]; r += window > 0 ? 1 : ROW_BLOCK)
                item_seq[items] = s, item_row[items++] = r;
        }
    int group = heads / kv_heads, parallel = threads > 1 && work * heads * d > ATTENTION_PARALLEL_WORK;
    int block = window > 0 ? 1 : ROW_BLOCK;
    if (!failed) {
#pragma omp parallel num_threads(parallel ? threads : 1) if (parallel)
        {
            float *scores = malloc(sizeof(float) * block * group * (max_keys + block));
            if (!scores) {
#pragma omp atomic write
                failed = 1;
            }
#pragma omp for schedule(dynamic, 1)
            for (int ih = 0; ih < items * kv_heads; ih++) {
                if (!scores) continue;
                int i = ih / kv_heads, kvh = ih % kv_heads, s = item_seq[i], row = item_row[i];
                int n = query_start[s + 1] - row < block ? query_start[s + 1] - row : block;
                int64_t p = lens[s] - (query_start[s + 1] - row); /* the first row's position */
                int64_t lo = window > 0 && p + 1 > window ? p + 1 - window : 0;
                attend(q + (int64_t)row * heads * d, n, p + 1 - lo, k_pool, v_pool, slots + base[s] + lo, heads,
                       kv_heads, kvh, kvh + 1, d, scale, scores, out + (int64_t)row * heads * d);
            }
            free(scores);
        }
    }
    free(slots), free(base), free(item_seq), free(item_row);
    return failed ? -1 : 0;
}

