/* cuda_runtime_api.h of the kn_emu CPU emulation: the same declarations as its cuda_runtime.h. */
#include "cuda_runtime.h"
