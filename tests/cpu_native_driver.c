/* A command-line front to nanoinfer/backends/cpu/cpu_native.c's kernels, for a cross-compiled build run
 * under an emulator (tests/test_cpu_native_arm.py), where Python cannot load the library.
 *
 * Usage: cpu_native_driver DIR. DIR/cases holds one call a line; each reads its inputs from
 * DIR/NAME.<array> (raw little-endian arrays, as numpy's tofile writes them) and writes its
 * outputs beside them:
 *   isa                                    -> DIR/isa: block_dot_isa() in decimal; DIR/name: block_dot_name()
 *   quantize NAME rows k                   x (bf16) -> xq, xd, xs
 *   matmul NAME rows k n bits il has_m     x, q, d, m (none where has_m is 0) -> y (fp32, block_matmul's y_f32;
 *                                          il: the rows interleaved by that many, or 0)
 *   kquant NAME rows k n type bytes il     x, w (bytes per row) -> y (fp32, kquant_matmul's y_f32)
 *   attention NAME tokens seqs table_stride block_size window heads kv_heads d scale
 *                                          q, kv, tables, lens, query_start -> out
 *     (scale as C reads it: a hex float keeps its fp32 bits)
 * Exits 1 with a message on a bad line or a missing file.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int block_dot_isa(void);
const char *block_dot_name(void);
void quantize_groups_q8(const uint16_t *x, int rows, int k, int8_t *xq, float *xd, float *xs);
int block_matmul(const uint16_t *x, int rows, int k, const uint8_t *q, const uint16_t *d, const uint16_t *m, int bits,
                 int interleaved, int n, void *y, int y_f32, int threads);
int kquant_matmul(const uint16_t *x, int rows, int k, const uint8_t *w, int type, int interleaved, int n, void *y,
                  int y_f32, int threads);
int paged_attention(const float *q, int tokens, const float *k_pool, const float *v_pool, const int32_t *tables,
                    int64_t table_stride, const int32_t *lens, const int32_t *query_start, int seqs, int block_size,
                    int window, int heads, int kv_heads, int d, float scale, int threads, float *out);

static void fail(const char *what, const char *detail) {
    fprintf(stderr, "cpu_native_driver: %s: %s\n", what, detail);
    exit(1);
}

static void path(char *out, const char *dir, const char *name, const char *array) {
    snprintf(out, 4096, "%s/%s%s%s", dir, name, *array ? "." : "", array);
}

/* The whole file DIR/NAME.array (exactly `bytes` long). */
static void *read_array(const char *dir, const char *name, const char *array, size_t bytes) {
    char p[4096];
    path(p, dir, name, array);
    FILE *f = fopen(p, "rb");
    if (!f) fail("cannot open", p);
    void *data = malloc(bytes ? bytes : 1);
    if (!data || fread(data, 1, bytes, f) != bytes || fgetc(f) != EOF) fail("not the expected size", p);
    fclose(f);
    return data;
}

static void write_array(const char *dir, const char *name, const char *array, const void *data, size_t bytes) {
    char p[4096];
    path(p, dir, name, array);
    FILE *f = fopen(p, "wb");
    if (!f || fwrite(data, 1, bytes, f) != bytes || fclose(f)) fail("cannot write", p);
}

int main(int argc, char **argv) {
    if (argc != 2) fail("usage", "cpu_native_driver DIR");
    const char *dir = argv[1];
    char p[4096], line[1024], op[32], name[256];
    path(p, dir, "cases", "");
    FILE *cases = fopen(p, "r");
    if (!cases) fail("cannot open", p);
    while (fgets(line, sizeof line, cases)) {
        if (sscanf(line, "%31s", op) != 1) continue;
        if (!strcmp(op, "isa")) {
            int isa = block_dot_isa();
            char text[16];
            write_array(dir, "isa", "", text, (size_t)snprintf(text, sizeof text, "%d\n", isa));
            const char *tier = block_dot_name();
            write_array(dir, "name", "", tier, strlen(tier));
        } else if (!strcmp(op, "quantize")) {
            int rows, k;
            if (sscanf(line, "%*s %255s %d %d", name, &rows, &k) != 3) fail("bad line", line);
            size_t n = (size_t)rows * k, g = n / 32;
            uint16_t *x = read_array(dir, name, "x", 2 * n);
            int8_t *xq = malloc(n);
            float *xd = malloc(4 * g), *xs = malloc(4 * g);
            quantize_groups_q8(x, rows, k, xq, xd, xs);
            write_array(dir, name, "xq", xq, n);
            write_array(dir, name, "xd", xd, 4 * g);
            write_array(dir, name, "xs", xs, 4 * g);
            free(x), free(xq), free(xd), free(xs);
        } else if (!strcmp(op, "matmul")) {
            int rows, k, n, bits, il, has_m;
            if (sscanf(line, "%*s %255s %d %d %d %d %d %d", name, &rows, &k, &n, &bits, &il, &has_m) != 7)
                fail("bad line", line);
            size_t g = (size_t)n * (k / 32);
            uint16_t *x = read_array(dir, name, "x", (size_t)rows * k * 2);
            uint8_t *q = read_array(dir, name, "q", (size_t)n * k * bits / 8);
            uint16_t *d = read_array(dir, name, "d", 2 * g), *m = has_m ? read_array(dir, name, "m", 2 * g) : NULL;
            float *y = malloc(sizeof(float) * rows * n);
            if (block_matmul(x, rows, k, q, d, m, bits, il, n, y, 1, 1)) fail("block_matmul", "no memory or layout");
            write_array(dir, name, "y", y, sizeof(float) * rows * n);
            free(x), free(q), free(d), free(m), free(y);
        } else if (!strcmp(op, "kquant")) {
            int rows, k, n, type, bytes, il;
            if (sscanf(line, "%*s %255s %d %d %d %d %d %d", name, &rows, &k, &n, &type, &bytes, &il) != 7)
                fail("bad line", line);
            uint16_t *x = read_array(dir, name, "x", (size_t)rows * k * 2);
            uint8_t *w = read_array(dir, name, "w", (size_t)n * bytes);
            float *y = malloc(sizeof(float) * rows * n);
            if (kquant_matmul(x, rows, k, w, type, il, n, y, 1, 1)) fail("kquant_matmul", "no memory, type or layout");
            write_array(dir, name, "y", y, sizeof(float) * rows * n);
            free(x), free(w), free(y);
        } else if (!strcmp(op, "attention")) {
            int tokens, seqs, stride, block, window, heads, kv_heads, d;
            float scale;
            if (sscanf(line, "%*s %255s %d %d %d %d %d %d %d %d %f", name, &tokens, &seqs, &stride, &block, &window,
                       &heads, &kv_heads, &d, &scale) != 10)
                fail("bad line", line);
            int32_t *query_start = read_array(dir, name, "query_start", 4 * (size_t)(seqs + 1));
            int32_t *lens = read_array(dir, name, "lens", 4 * (size_t)seqs);
            int32_t *tables = read_array(dir, name, "tables", 4 * (size_t)seqs * stride);
            path(p, dir, name, "kv");
            FILE *f = fopen(p, "rb");
            if (!f || fseek(f, 0, SEEK_END)) fail("cannot open", p);
            size_t pool = (size_t)ftell(f) / 8; /* floats in each of K and V: [2, slots, kv_heads, d] fp32 */
            fclose(f);
            float *kv = read_array(dir, name, "kv", 8 * pool);
            float *q = read_array(dir, name, "q", sizeof(float) * tokens * heads * d);
            float *out = malloc(sizeof(float) * tokens * heads * d);
            if (paged_attention(q, tokens, kv, kv + pool, tables, stride, lens, query_start, seqs, block, window, heads,
                                kv_heads, d, scale, 1, out))
                fail("paged_attention", "no memory");
            write_array(dir, name, "out", out, sizeof(float) * tokens * heads * d);
            free(query_start), free(lens), free(tables), free(kv), free(q), free(out);
        } else
            fail("unknown call", line);
    }
    fclose(cases);
    return 0;
}
