/*
 * backend.c: backend-generic helpers of backend.h (tensor allocation and host
 * copies through a backend's ops table). No state; any thread that owns the
 * backend (the engine thread).
 */
#include <string.h>

#include "engine/backend/backend.h"

int bk_tensor_alloc(backend *be, bk_dtype dt, int64_t rows, int64_t cols, bk_tensor *out) {
    bk_tensor t = {NULL, dt, rows, cols};
    t.data = be->ops->buf_alloc(be->ctx, bk_nbytes(&t));
    *out = t;
    return t.data ? 0 : -1;
}

void bk_tensor_free(backend *be, bk_tensor *t) {
    if (t->data) be->ops->buf_free(be->ctx, t->data);
    memset(t, 0, sizeof *t);
}

int bk_tensor_from_host(backend *be, const float *host, int64_t rows, int64_t cols, bk_tensor *out) {
    if (bk_tensor_alloc(be, BK_F32, rows, cols, out) < 0) return -1;
    if (be->ops->upload(be->ctx, out->data, host, bk_nbytes(out)) < 0) {
        bk_tensor_free(be, out);
        return -1;
    }
    return 0;
}

int bk_matmul_f32(backend *be, const bk_weight *w, const float *x, int32_t T, float *y) {
    if (!be->host_visible) return -1;
    bk_tensor xt = bk_wrap_f32((float *)(uintptr_t)x, T, w->cols), yt = bk_wrap_f32(y, T, w->rows);
    return be->ops->matmul(be->ctx, w, &xt, &yt);
}

int bk_matmul_n(backend *be, int n, const bk_weight *const *w, const bk_tensor *x, bk_tensor *const *y) {
    if (be->ops->matmul_n) return be->ops->matmul_n(be->ctx, n, w, x, y);
    for (int k = 0; k < n; k++)
        if (be->ops->matmul(be->ctx, w[k], x, y[k]) < 0) return -1;
    return 0;
}
