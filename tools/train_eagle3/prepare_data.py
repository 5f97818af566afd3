#!/usr/bin/env python3
"""Step 1 of the draft pipeline: self-distillation data.

Sends the training questions (GSM8K train, HumanEval prompts; never MT-bench or
GSM8K test, which are for evaluation) and/or the prompts of a prompts file
(--prompts FILE: JSON lines {"id", "prompt"[, "source"]}, e.g. make_prompts.py's
prompts.jsonl; ids must be unique, source defaults to the id's part before ':')
to a running specd server as chat requests with greedy decoding, and appends
one JSON line per sample:
  {"id": "gsm8k_train:17", "source": ..., "messages": [{"role":"user",...},{"role":"assistant",...}],
   "prompt_tokens": N, "completion_tokens": M, "finish_reason": "stop"|"length"}
Resumable: ids already in the output are skipped. A request the server refuses
(HTTP 4xx: e.g. a prompt longer than the context) is recorded in OUT.skipped
({"id", "error"}) and not retried; other failures (connection, 5xx) are
retried on the next run. Exit status 0 when every sample is answered or
skipped, 1 when some failed (rerun). Stdlib only.

Usage: prepare_data.py --base-url http://127.0.0.1:8000 --out data/train/responses.jsonl
       [--num-gsm8k 1200] [--humaneval] [--prompts prompts.jsonl] [--max-tokens 384] [--concurrency 16]
"""
import argparse, concurrent.futures as cf, gzip, json, os, sys, time, urllib.error, urllib.request

SHARED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../../shared/data/prompts")


def prompts_file(path):
    """(id, source, prompt) of each line of a prompts file; a bad line or a repeated id is an error."""
    seen = set()
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                o = json.loads(line)
                i, q = o["id"], o["prompt"]
            except (ValueError, KeyError, TypeError) as e:
                sys.exit(f"prepare: {path}:{n}: not a {{\"id\", \"prompt\"}} JSON line ({e})")
            if not isinstance(i, str) or not isinstance(q, str) or not i or not q.strip():
                sys.exit(f"prepare: {path}:{n}: id and prompt must be non-empty strings")
            if i in seen:
                sys.exit(f"prepare: {path}:{n}: id {i!r} repeated")
            seen.add(i)
            yield i, o.get("source") or i.split(":")[0], q


def questions(args):
    if args.num_gsm8k > 0:
        with open(os.path.join(args.data_dir, "gsm8k_train.jsonl")) as f:
            for i, line in enumerate(f):
                if i >= args.num_gsm8k:
                    break
                yield f"gsm8k_train:{i}", "gsm8k_train", json.loads(line)["question"]
    if args.humaneval:
        with gzip.open(os.path.join(args.data_dir, "humaneval.jsonl.gz"), "rt") as f:
            for line in f:
                o = json.loads(line)
                yield f"humaneval:{o['task_id']}", "humaneval", "Complete this Python function.\n\n" + o["prompt"]
    for path in args.prompts or []:
        yield from prompts_file(path)


def repair_tail(path):
    """Drop a torn last line (no newline: an interrupted write) so that appends start on a new line."""
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return
    with open(path, "rb+") as f:
        data = f.read()
        if data.endswith(b"\n"):
            return
        f.truncate(data.rfind(b"\n") + 1)


def ask(args, model, q):
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": q}],
                       "max_tokens": args.max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(args.base_url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as r:
        return json.loads(r.read())


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--out", required=True)
    ap.add_argument("--data-dir", default=os.path.normpath(SHARED))
    ap.add_argument("--num-gsm8k", type=int, default=1200)
    ap.add_argument("--humaneval", action="store_true")
    ap.add_argument("--prompts", action="append", help="a prompts file (JSON lines with id and prompt); repeatable")
    ap.add_argument("--max-tokens", type=int, default=384)
    ap.add_argument("--concurrency", type=int, default=16)
    args = ap.parse_args(argv)
    model = json.loads(urllib.request.urlopen(args.base_url + "/v1/models").read())["data"][0]["id"]
    done = set()
    skipped_path = args.out + ".skipped"
    for path in (args.out, skipped_path):
        repair_tail(path)
        if os.path.exists(path):
            with open(path) as f:
                for line in f:
                    try:
                        done.add(json.loads(line)["id"])
                    except (ValueError, KeyError):
                        pass  # a torn last line from an interrupted run
    todo = [q for q in questions(args) if q[0] not in done]
    print(f"prepare: {len(done)} done, {len(todo)} to go", file=sys.stderr)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    t0, n, toks, n_failed = time.time(), 0, 0, 0
    with open(args.out, "a") as out, open(skipped_path, "a") as skipped, \
            cf.ThreadPoolExecutor(args.concurrency) as ex:
        futs = {ex.submit(ask, args, model, q): (i, s, q) for i, s, q in todo}
        for fut in cf.as_completed(futs):
            i, s, q = futs[fut]
            try:
                r = fut.result()
            except urllib.error.HTTPError as e:
                if 400 <= e.code < 500:  # the server refuses this sample: never retried
                    msg = e.read().decode(errors="replace")[:300]
                    print(f"prepare: {i} refused (HTTP {e.code}): {msg}", file=sys.stderr)
                    skipped.write(json.dumps({"id": i, "error": f"HTTP {e.code}: {msg}"}) + "\n")
                    skipped.flush()
                else:
                    print(f"prepare: {i} failed: {e}", file=sys.stderr)
                    n_failed += 1
                continue
            except Exception as e:  # keep going; the sample is retried on the next run
                print(f"prepare: {i} failed: {e}", file=sys.stderr)
                n_failed += 1
                continue
            c = r["choices"][0]
            rec = {"id": i, "source": s, "messages": [{"role": "user", "content": q},
                                                      {"role": "assistant", "content": c["message"]["content"]}],
                   "prompt_tokens": r["usage"]["prompt_tokens"], "completion_tokens": r["usage"]["completion_tokens"],
                   "finish_reason": c["finish_reason"]}
            out.write(json.dumps(rec) + "\n")
            out.flush()
            n += 1
            toks += rec["completion_tokens"]
            if n % 20 == 0:
                dt = time.time() - t0
                print(f"prepare: {n}/{len(todo)} samples, {toks} completion tokens, {toks / dt:.1f} tok/s", file=sys.stderr)
    print(f"prepare: finished {n} new samples, {toks} completion tokens in {time.time() - t0:.0f} s"
          f"{f'; {n_failed} failed (rerun to retry them)' if n_failed else ''}", file=sys.stderr)
    return 1 if n_failed else 0


if __name__ == "__main__":
    sys.exit(main())
