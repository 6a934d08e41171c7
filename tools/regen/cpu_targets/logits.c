/* All-position logits of a GGUF from libllama, as tools.golden --engine llama-cpp takes them with
 * llama-cpp-python, for a libllama built for one CPU target (tools/regen/make_cpu_target_goldens.py).
 *
 *   logits MODEL REPACK N_PREDICT OUT KV:FA [KV:FA ...] < PROMPTS
 *
 * MODEL is loaded once, with use_extra_bufts = REPACK (1: CPU_REPACK weight buffers, llama.cpp's
 * default; 0: plain buffers, --no-repack). Each KV:FA (f32|f16 : on|off) is a context of n_ctx 1024,
 * n_batch = n_ubatch 512, 2 threads, K and V cache of type KV, flash attention FA. PROMPTS holds one
 * prompt a line: its id, then its token ids. Per config and prompt, in a fresh context:
 *   one llama_decode of every token, logits at every position -> OUT/<kv>-fa<fa>/<id>.prefill.f32;
 *   N_PREDICT greedy tokens (argmax, first index of the maximum, as numpy), the first from the
 *   prefill's last row, each but the last fed back as one single-token llama_decode
 *   -> OUT/<kv>-fa<fa>/<id>.decode.f32, float32 [N_PREDICT - 1, n_vocab];
 * and prints "<kv>-fa<fa> <id> TOKENS..." on stdout, after one first line: llama_print_system_info().
 * Files are raw little-endian float32, C order. Exit status 2 with one line on bad input. */
#include "llama.h"
#ifdef LOAD_ALL_BACKENDS  /* a GGML_BACKEND_DL build: the CPU variant is a module to load (make_variant_goldens) */
#include "ggml-backend.h"
#endif

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

enum { N_CTX = 1024, N_BATCH = 512, N_THREADS = 2, MAX_LINE = 1 << 16 };

static void quiet(enum ggml_log_level level, const char * text, void * user) {
    (void) user;
    if (level == GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

static void fail(const char * what, const char * detail) {
    fprintf(stderr, "logits: %s%s%s\n", what, detail ? ": " : "", detail ? detail : "");
    exit(2);
}

struct prompt { char id[64]; int n; llama_token * ids; };

static int read_prompts(struct prompt ** out) {  /* stdin -> number of prompts */
    static char line[MAX_LINE];
    int n = 0;
    struct prompt * ps = NULL;
    while (fgets(line, sizeof line, stdin)) {
        char * save = NULL, * tok = strtok_r(line, " \t\n", &save);
        if (!tok) continue;
        ps = realloc(ps, (n + 1) * sizeof *ps);
        struct prompt * p = &ps[n++];
        snprintf(p->id, sizeof p->id, "%s", tok);
        p->n = 0;
        p->ids = malloc(N_BATCH * sizeof *p->ids);
        while ((tok = strtok_r(NULL, " \t\n", &save))) {
            if (p->n == N_BATCH) fail("prompt longer than one batch", p->id);
            char * end;
            long v = strtol(tok, &end, 10);
            if (*end || v < 0) fail("bad token id", tok);
            p->ids[p->n++] = (llama_token) v;
        }
        if (p->n == 0) fail("prompt without tokens", p->id);
    }
    *out = ps;
    return n;
}

static void write_rows(const char * path, const float * rows, size_t n) {  /* float32 [n] -> path */
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE * f = fopen(tmp, "wb");
    if (!f || fwrite(rows, sizeof *rows, n, f) != n || fclose(f) || rename(tmp, path)) fail("cannot write", path);
}

static int argmax(const float * row, int n) {  /* first index of the maximum, as numpy's argmax */
    int best = 0;
    for (int i = 1; i < n; i++) if (row[i] > row[best]) best = i;
    return best;
}

static void decode(struct llama_context * ctx, struct llama_batch * batch, const llama_token * ids, int n, int pos) {
    batch->n_tokens = n;
    for (int i = 0; i < n; i++) {
        batch->token[i] = ids[i];
        batch->pos[i] = pos + i;
        batch->n_seq_id[i] = 1;
        batch->seq_id[i][0] = 0;
        batch->logits[i] = 1;
    }
    if (llama_decode(ctx, *batch)) fail("llama_decode failed", NULL);
}

static void run_prompt(struct llama_model * model, struct llama_context_params cp, const struct prompt * p,
                       int n_predict, const char * dir, const char * tag) {
    struct llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) fail("cannot make a context", tag);
    int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    struct llama_batch batch = llama_batch_init(N_BATCH, 0, 1);
    float * prefill = malloc((size_t) p->n * n_vocab * sizeof *prefill);
    float * steps = malloc((size_t) (n_predict > 1 ? n_predict - 1 : 1) * n_vocab * sizeof *steps);
    decode(ctx, &batch, p->ids, p->n, 0);
    for (int i = 0; i < p->n; i++) memcpy(prefill + (size_t) i * n_vocab, llama_get_logits_ith(ctx, i), n_vocab * sizeof *prefill);
    printf("%s %s", tag, p->id);
    const float * last = prefill + (size_t) (p->n - 1) * n_vocab;
    for (int i = 0; i < n_predict; i++) {
        llama_token t = argmax(last, n_vocab);
        printf(" %d", t);
        if (i == n_predict - 1) break;
        decode(ctx, &batch, &t, 1, p->n + i);
        memcpy(steps + (size_t) i * n_vocab, llama_get_logits_ith(ctx, 0), n_vocab * sizeof *steps);
        last = steps + (size_t) i * n_vocab;
    }
    printf("\n");
    fflush(stdout);
    char path[4096];
    snprintf(path, sizeof path, "%s/%s.prefill.f32", dir, p->id);
    write_rows(path, prefill, (size_t) p->n * n_vocab);
    snprintf(path, sizeof path, "%s/%s.decode.f32", dir, p->id);
    write_rows(path, steps, (size_t) (n_predict > 0 ? n_predict - 1 : 0) * n_vocab);
    free(prefill);
    free(steps);
    llama_batch_free(batch);
    llama_free(ctx);
}

static struct llama_context_params context_params(const char * config) {  /* "f32:on" -> params */
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = N_CTX;
    cp.n_batch = cp.n_ubatch = N_BATCH;
    cp.n_threads = cp.n_threads_batch = N_THREADS;
    char kv[8] = "", fa[8] = "";
    if (sscanf(config, "%7[^:]:%7s", kv, fa) != 2) fail("bad config (KV:FA)", config);
    if (!strcmp(kv, "f32")) cp.type_k = cp.type_v = GGML_TYPE_F32;
    else if (!strcmp(kv, "f16")) cp.type_k = cp.type_v = GGML_TYPE_F16;
    else fail("KV type is f32 or f16", config);
    if (!strcmp(fa, "on")) cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
    else if (!strcmp(fa, "off")) cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    else fail("flash attention is on or off", config);
    return cp;
}

int main(int argc, char ** argv) {
    if (argc < 6) fail("usage: logits MODEL REPACK(0|1) N_PREDICT OUT KV:FA [KV:FA ...] < PROMPTS", NULL);
    const char * repack = argv[2], * out = argv[4];
    if (strcmp(repack, "0") && strcmp(repack, "1")) fail("REPACK is 0 or 1", repack);
    char * end;
    long n_predict = strtol(argv[3], &end, 10);
    if (*end || n_predict < 1 || n_predict > N_CTX) fail("bad N_PREDICT", argv[3]);
    llama_log_set(quiet, NULL);
#ifdef LOAD_ALL_BACKENDS
    ggml_backend_load_all();
#endif
    llama_backend_init();
    struct prompt * prompts;
    int n_prompts = read_prompts(&prompts);
    struct llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    mp.use_extra_bufts = repack[0] == '1';
    struct llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) fail("cannot load", argv[1]);
    printf("%s\n", llama_print_system_info());
    for (int c = 5; c < argc; c++) {
        struct llama_context_params cp = context_params(argv[c]);
        char tag[32], dir[4096];
        snprintf(tag, sizeof tag, "%s-fa%s", cp.type_k == GGML_TYPE_F32 ? "f32" : "f16",
                 cp.flash_attn_type == LLAMA_FLASH_ATTN_TYPE_ENABLED ? "on" : "off");
        snprintf(dir, sizeof dir, "%s/%s", out, tag);
        if (mkdir(dir, 0777) && errno != EEXIST) fail("cannot make", dir);
        for (int i = 0; i < n_prompts; i++) run_prompt(model, cp, &prompts[i], (int) n_predict, dir, tag);
    }
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
