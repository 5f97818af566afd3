/*
 * test_kn_probe.c: kn_probe reports a usable GPU or a reason. On a machine
 * without one the reason must name the failing call; with one, the probe
 * kernel must have run (kn_probe returns 0 only after reading 1234 back).
 */
#include "kernels/kn.h"
#include "tests/kernels/kn_harness.h"

int main(void) {
    char why[256] = "x";
    int rc = kn_probe(0, why, sizeof why);
    if (rc != 0) {
        if (!why[0]) { fprintf(stderr, "FAIL: kn_probe returned %d without a reason\n", rc); return 1; }
        if (kn_probe(-1, why, sizeof why) == 0) { fprintf(stderr, "FAIL: device -1 accepted\n"); return 1; }
        printf("SKIP: no usable GPU: %s\n", why);
        return 77;
    }
    if (why[0]) { fprintf(stderr, "FAIL: usable GPU but a reason: %s\n", why); return 1; }
    if (kn_probe(1 << 20, why, sizeof why) == 0 || !why[0]) {
        fprintf(stderr, "FAIL: a device index past the count was accepted\n");
        return 1;
    }
    printf("ok: GPU usable\n");
    return 0;
}
