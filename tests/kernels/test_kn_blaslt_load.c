/*
 * test_kn_blaslt_load.c (label build, no GPU needed): cuBLASLt is loaded at
 * run time and refused to deterministic backends. A deterministic request
 * must fail with cudaErrorNotSupported and a reason; a non-deterministic one
 * must either give a handle (GPU machine) or fail with a reason that names
 * the failing call or library (here: no driver -> cublasLtCreate
 * NOT_INITIALIZED), never crash. All 15 symbols resolve when the library
 * loads (kn_blaslt_create checks each one).
 */
#include <stdio.h>
#include <string.h>

#include "kernels/kn.h"
#include "kernels/kn_linear.h"

int main(void) {
    char why[512] = "";
    kn_blaslt *h = NULL;
    int rc = kn_blaslt_create(1, &h, why, sizeof why);
    if (rc != 801 /* cudaErrorNotSupported */ || h || !strstr(why, "batch invariant")) {
        fprintf(stderr, "FAIL: deterministic request: rc %d, handle %p, why '%s'\n", rc, (void *)h, why);
        return 1;
    }
    why[0] = '\0';
    rc = kn_blaslt_create(0, &h, why, sizeof why);
    if (rc == 0) {
        if (!h) { fprintf(stderr, "FAIL: rc 0 without a handle\n"); return 1; }
        printf("ok: cuBLASLt loaded and initialised\n");
        kn_blaslt_destroy(h);
        return 0;
    }
    if (h || !(strstr(why, "cublasLtCreate") || strstr(why, "dlopen") || strstr(why, "symbol"))) {
        fprintf(stderr, "FAIL: rc %d, handle %p, reason '%s' does not name the call\n", rc, (void *)h, why);
        return 1;
    }
    printf("ok: refused with a reason (rc %d): %s\n", rc, why);
    kn_blaslt_destroy(NULL);
    kn_blaslt_plan_destroy(NULL);
    return 0;
}
