"""Reads a safetensors file written by specd's st_write (test_safetensors.c,
test_python_reads_ours) with the reference `safetensors` package and checks
every value the C test wrote. Exit 0 = the reference accepts our file."""
import sys

import numpy as np
from safetensors import safe_open

path = sys.argv[1]
with safe_open(path, framework="numpy") as f:
    assert f.metadata() == {"format": "pt", "writer": "specd"}, f.metadata()
    assert sorted(f.keys()) == ["a.f32", "c.f16", "d.i64", "e.bool", "f.scalar", "g.empty"], list(f.keys())
    a = f.get_tensor("a.f32")
    assert a.dtype == np.float32 and a.shape == (2, 3)
    assert a.tolist() == [[1.0, -2.5, 3.25], [0.0, -0.0, np.float32(1e-30)]]
    c = f.get_tensor("c.f16")
    assert c.dtype == np.float16 and c.view(np.uint16).tolist() == [0x3C00, 0x8001]
    d = f.get_tensor("d.i64")
    assert d.dtype == np.int64 and d.tolist() == [-(2 ** 63), 2 ** 63 - 1]
    e = f.get_tensor("e.bool")
    assert e.dtype == np.bool_ and e.tolist() == [True, False, False, True, True]
    s = f.get_tensor("f.scalar")
    assert s.dtype == np.int32 and s.shape == () and int(s) == -7
    g = f.get_tensor("g.empty")
    assert g.dtype == np.float32 and g.shape == (4, 0)
print("ok: safetensors", path)
