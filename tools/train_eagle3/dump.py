"""dump.py: reader and writer of the hidden-state dump format (FORMAT.md).

What it owns: the `specd-eagle3-dump-v1` directory layout: manifest.json
written last, safetensors shards with per-sample tensors
`sNNNNNNNN.{input_ids,loss_mask,aux_hidden,final_hidden}`.  The C
`specd extract` writes the same layout; this module is the Python side
(the trainer's input, and the writer used for synthetic test dumps).

Invariants: a dump without manifest.json is unfinished and is refused;
every sample has the four tensors with consistent T and H; the reader
validates shapes and dtypes of every sample it returns.

Threading: none.
"""

import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FORMAT = "specd-eagle3-dump-v1"


def sample_key(i: int) -> str:
    return f"s{i:08d}"


class DumpWriter:
    """Append samples; a shard is flushed every `samples_per_shard`."""

    def __init__(self, path: str, target: dict, aux_layer_ids, aux_dtype="bf16",
                 samples_per_shard=256, convention="input"):
        os.makedirs(path, exist_ok=True)
        self.path, self.target = path, dict(target)
        self.aux_layer_ids, self.convention = list(aux_layer_ids), convention
        self.aux_dtype = {"bf16": torch.bfloat16, "f32": torch.float32}[aux_dtype]
        self.aux_dtype_name = aux_dtype
        self.per_shard = samples_per_shard
        self.shards, self.pending = [], {}
        self.n_samples = self.n_tokens = self.n_loss = 0
        self.pending_first = 0
        self.pending_tokens = 0
        self.pending_n = 0

    def add(self, input_ids, loss_mask, aux_hidden, final_hidden):
        """input_ids int [T], loss_mask {0,1} [T], aux_hidden [T, 3H],
        final_hidden [T, H] (post final norm)."""
        ids = torch.as_tensor(input_ids).to(torch.int32).contiguous()
        T = ids.shape[0]
        H = int(self.target["hidden_size"])
        lm = torch.as_tensor(loss_mask).to(torch.uint8).contiguous()
        aux = torch.as_tensor(aux_hidden).to(self.aux_dtype).contiguous()
        fin = torch.as_tensor(final_hidden).to(torch.float32).contiguous()
        if lm.shape != (T,) or aux.shape != (T, 3 * H) or fin.shape != (T, H):
            raise ValueError(f"bad sample shapes: ids {tuple(ids.shape)} mask {tuple(lm.shape)} "
                             f"aux {tuple(aux.shape)} final {tuple(fin.shape)} (H={H})")
        k = sample_key(self.n_samples)
        self.pending.update({k + ".input_ids": ids, k + ".loss_mask": lm,
                             k + ".aux_hidden": aux, k + ".final_hidden": fin})
        self.n_samples += 1
        self.n_tokens += T
        self.n_loss += int(lm.sum())
        self.pending_tokens += T
        self.pending_n += 1
        if self.pending_n >= self.per_shard:
            self._flush()

    def _flush(self):
        if not self.pending_n:
            return
        fn = f"shard_{len(self.shards):05d}.safetensors"
        tmp = os.path.join(self.path, fn + ".tmp")
        save_file(self.pending, tmp, metadata={"format": FORMAT,
                                               "first_sample": str(self.pending_first),
                                               "n_samples": str(self.pending_n)})
        os.replace(tmp, os.path.join(self.path, fn))
        self.shards.append({"file": fn, "first_sample": self.pending_first,
                            "n_samples": self.pending_n, "n_tokens": self.pending_tokens})
        self.pending_first += self.pending_n
        self.pending, self.pending_n, self.pending_tokens = {}, 0, 0
        self._write_manifest()

    def _write_manifest(self):
        m = {"format": FORMAT, "target": self.target, "aux_layer_ids": self.aux_layer_ids,
             "aux_layer_convention": self.convention, "aux_dtype": self.aux_dtype_name,
             "n_samples": self.pending_first, "n_tokens": sum(s["n_tokens"] for s in self.shards),
             "n_loss_tokens": self.n_loss, "shards": self.shards}
        tmp = os.path.join(self.path, "manifest.json.tmp")
        with open(tmp, "w") as f:
            json.dump(m, f, indent=1)
        os.replace(tmp, os.path.join(self.path, "manifest.json"))

    def close(self):
        self._flush()
        self._write_manifest()


class DumpReader:
    """Random access to the samples of a finished dump."""

    def __init__(self, path: str):
        mp = os.path.join(path, "manifest.json")
        if not os.path.exists(mp):
            raise FileNotFoundError(f"{path}: no manifest.json (unfinished or not a dump)")
        with open(mp) as f:
            self.manifest = json.load(f)
        if self.manifest.get("format") != FORMAT:
            raise ValueError(f"{path}: format {self.manifest.get('format')!r}, want {FORMAT!r}")
        self.path = path
        self.H = int(self.manifest["target"]["hidden_size"])
        self.index = []   # global sample -> shard file
        for s in self.manifest["shards"]:
            if s["first_sample"] != len(self.index):
                raise ValueError(f"{path}: shard {s['file']} starts at {s['first_sample']}, "
                                 f"expected {len(self.index)}")
            self.index.extend([s["file"]] * s["n_samples"])
        self._open = {}

    def __len__(self):
        return len(self.index)

    def _handle(self, fn):
        h = self._open.get(fn)
        if h is None:
            h = safe_open(os.path.join(self.path, fn), framework="pt")
            self._open[fn] = h
        return h

    def get(self, i: int) -> dict:
        """Sample i: input_ids int64 [T], loss_mask bool [T],
        aux_hidden f32 [T, 3H], final_hidden f32 [T, H]."""
        f = self._handle(self.index[i])
        k = sample_key(i)
        ids = f.get_tensor(k + ".input_ids").to(torch.int64)
        lm = f.get_tensor(k + ".loss_mask").to(torch.bool)
        aux = f.get_tensor(k + ".aux_hidden").to(torch.float32)
        fin = f.get_tensor(k + ".final_hidden").to(torch.float32)
        T = ids.shape[0]
        if lm.shape != (T,) or aux.shape != (T, 3 * self.H) or fin.shape != (T, self.H):
            raise ValueError(f"sample {i}: inconsistent shapes")
        return {"input_ids": ids, "loss_mask": lm, "aux_hidden": aux, "final_hidden": fin}


class MultiDump:
    """Several finished dumps of the same target read as one: sample i of the
    concatenation (dumps in the order given).  The merged manifest sums the
    counts; target, aux layer ids and convention must agree."""

    def __init__(self, paths):
        self.readers = [DumpReader(p) for p in paths]
        m0 = self.readers[0].manifest
        for r in self.readers[1:]:
            m = r.manifest
            for k in ("aux_layer_ids", "aux_layer_convention"):
                if m.get(k) != m0.get(k):
                    raise ValueError(f"{r.path}: {k} {m.get(k)} differs from {self.readers[0].path}'s {m0.get(k)}")
            if m["target"]["hidden_size"] != m0["target"]["hidden_size"]:
                raise ValueError(f"{r.path}: hidden size differs from {self.readers[0].path}'s")
        self.manifest = dict(m0)
        for k in ("n_samples", "n_tokens", "n_loss_tokens"):
            self.manifest[k] = sum(int(r.manifest.get(k, 0)) for r in self.readers)
        self.manifest["dumps"] = [r.path for r in self.readers]
        self.H = self.readers[0].H
        self.starts = []
        n = 0
        for r in self.readers:
            self.starts.append(n)
            n += len(r)
        self.n = n

    def __len__(self):
        return self.n

    def get(self, i: int) -> dict:
        if not 0 <= i < self.n:
            raise IndexError(i)
        k = len(self.starts) - 1
        while self.starts[k] > i:
            k -= 1
        return self.readers[k].get(i - self.starts[k])


def validate(path: str, check_finite=True) -> dict:
    """Read every sample of a dump; check shapes, dtypes, id range, finite
    values and the manifest's counts.  Returns the counts; raises ValueError."""
    r = DumpReader(path)
    V = int(r.manifest["target"]["vocab_size"])
    n_tok = n_loss = 0
    for i in range(len(r)):
        s = r.get(i)
        ids = s["input_ids"]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= V):
            raise ValueError(f"sample {i}: token id out of range [0, {V})")
        if check_finite and not (torch.isfinite(s["aux_hidden"]).all() and torch.isfinite(s["final_hidden"]).all()):
            raise ValueError(f"sample {i}: non-finite hidden states")
        n_tok += ids.numel()
        n_loss += int(s["loss_mask"].sum())
    m = r.manifest
    if m["n_samples"] != len(r) or m["n_tokens"] != n_tok or m["n_loss_tokens"] != n_loss:
        raise ValueError(f"manifest counts ({m['n_samples']}, {m['n_tokens']}, {m['n_loss_tokens']}) "
                         f"!= data ({len(r)}, {n_tok}, {n_loss})")
    return {"samples": len(r), "tokens": n_tok, "loss_tokens": n_loss}


if __name__ == "__main__":
    import sys
    if len(sys.argv) != 3 or sys.argv[1] != "validate":
        sys.exit("usage: dump.py validate DUMP_DIR")
    print(json.dumps(validate(sys.argv[2])))
