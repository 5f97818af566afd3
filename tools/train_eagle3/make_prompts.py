#!/usr/bin/env python3
"""Prompts the target writes itself, for self-distillation beyond math (issue 20, item 2).

For every (topic, task) pair (topics: distill_topics.txt, 360 of them; tasks:
TASKS below, 32) the target is asked, through a running `specd serve`, to
write ONE user request. The request is a few-shot completion, not a chat
turn: a fixed header of hand-written examples ("Topic: ...\\nTask: ...\\nRequest:
...", separated by "###"), then the pair's "Topic:/Task:" lines and
"Request:"; the model completes the request and stops at "###". SmolLM2-135M
asked through its chat template mostly answers as the assistant ("I'm ready to
help, what do you need?"); the completion form keeps it in the user's voice.
The header is one of HEADERS (fixed text, so the server's prefix cache holds
its KV: --enable-prefix-caching), chosen by position; sampling is seeded per
request (temperature 0.8, top_p 0.95, seed = base seed * 1,000,003 + position).

Order: pass p (p = 0, 1, ...) visits every pair once in a shuffled order
(random.Random(seed + p)); position i of that sequence is the request's key.
Generation runs in chunks of positions; after each chunk the raw attempts are
filtered and deduplicated (finalize) and generation stops once --target
prompts are kept. Resumable: every attempt (kept or not) is one line of
DIR/raw.jsonl; a rerun skips the positions already there and retries failed
ones. DIR/config.json fingerprints the topics, tasks and headers; a rerun with
other lists is refused (a position would mean another pair).

Finalize (deterministic for a given raw.jsonl: attempts in position order):
  clean     strip, drop a leading "Request:", unwrap one pair of quotes
  filter    finish_reason "stop" (else truncated), 12..1500 characters and >= 4 words,
            no meta text (format lines, "as an AI", "here is a request", assistant
            voice, [placeholders]), English (Latin letters, enough English function
            words outside code), not repetitive; with --require-topic also on topic
            (a word of the topic, by 5-letter prefix; topics without such a word pass).
            Without it (the default) an off-topic request is kept and marked
            "on_topic": false: SmolLM2-135M drifts off the topic in about 2 of 3
            requests, mostly into coherent requests on something else, which still
            widen the data (measured on 192 attempts: 29% kept with the check, 95%
            without)
  dedup     exact on normalised text (lowercase, alphanumerics, single spaces), then
            near-duplicate: Jaccard >= 0.6 of word 3-shingles against every kept prompt
  eval      Jaccard >= 0.5 against an evaluation prompt (mt_bench, gsm8k_test) rejects
Output: DIR/prompts.jsonl {"id": "selfgen:<position>", "prompt", "topic", "task", "seed", "on_topic"}
(ids are stable: more generation never renumbers kept prompts) and
DIR/prompts_stats.json (kept, rejections by reason). Stdlib only.

Usage: make_prompts.py --base-url http://127.0.0.1:8000 --out-dir DIR [--target 6000] [--concurrency 16]
       make_prompts.py --out-dir DIR --finalize-only
       make_prompts.py --out-dir DIR --sample 20     (print kept prompts at random, for reading)
"""
import argparse
import concurrent.futures as cf
import hashlib
import json
import os
import random
import re
import sys
import time
import urllib.request
from collections import Counter, defaultdict

from prepare_data import repair_tail  # the torn-last-line repair both data steps use

HERE = os.path.dirname(os.path.abspath(__file__))
SHARED = os.path.normpath(os.path.join(HERE, "../../../shared/data/prompts"))

TASKS = [
    "explain a concept", "answer a question about a fact", "answer a trivia question",
    "give step-by-step instructions", "give advice", "compare two things", "make a list",
    "brainstorm ideas", "write a short story", "write a poem", "write an email", "write a letter",
    "write a product description", "summarise a paragraph", "rewrite a text more formally",
    "rewrite a text more simply", "correct the grammar of a text", "explain a saying",
    "write a function in code", "fix a bug in code", "explain a piece of code", "solve a word problem",
    "plan a schedule", "role-play a conversation", "give pros and cons", "describe something",
    "write a short speech", "recommend something", "answer a yes-or-no question with reasons",
    "follow several constraints", "define a word", "give an opinion",
]

_H0 = """Below are requests that users sent to a helpful AI assistant. Each has a topic, a kind of task, and the request exactly as the user wrote it.

###
Topic: astronomy
Task: explain a concept
Request: Why does the Moon always show the same face to the Earth? Please explain it simply.
###
Topic: cooking
Task: give step-by-step instructions
Request: How do I make a fluffy omelette? I only have eggs, butter, milk and cheese.
###
Topic: renting an apartment
Task: write an email
Request: Write a short, polite email to my landlord asking him to fix the broken heater in my apartment this week.
###
Topic: Python programming
Task: write a function in code
Request: Write a Python function that takes a list of numbers and returns the second largest one. Handle lists with fewer than two numbers.
###
Topic: the Roman Empire
Task: compare two things
Request: What were the main differences between the Roman Republic and the Roman Empire?
###
Topic: personal finance
Task: give advice
Request: I just got my first job and earn $3,000 a month. How should I split my money between rent, savings and spending?
###
Topic: coral reefs
Task: summarise a paragraph
Request: Summarise this paragraph in one sentence: "Coral reefs cover less than one percent of the ocean floor, yet they are home to about a quarter of all marine species. They provide food and shelter for fish, protect coastlines from storms, and attract millions of tourists each year. Rising sea temperatures, however, are causing coral bleaching across the world."
###
Topic: the seasons
Task: write a poem
Request: Write a short poem about a rainy autumn afternoon in a small town.
###
"""

_H1 = """Below are requests that users sent to a helpful AI assistant. Each has a topic, a kind of task, and the request exactly as the user wrote it.

###
Topic: JavaScript
Task: fix a bug in code
Request: My function should return the sum of an array but it always returns undefined. What is wrong?

function sum(arr) {
  let total = 0;
  arr.forEach(x => { total += x; });
}
###
Topic: job interviews
Task: role-play a conversation
Request: Pretend you are a hiring manager at a bakery and interview me for a job as a cashier. Ask me one question at a time.
###
Topic: gardening
Task: make a list
Request: List ten vegetables that are easy to grow on a sunny balcony, with one tip for each.
###
Topic: World War II
Task: answer a trivia question
Request: In which year did World War II end, and which countries signed the surrender documents?
###
Topic: public speaking
Task: rewrite a text more formally
Request: Rewrite this in a formal tone: "hey guys, thanks a lot for coming, the talk is gonna be about saving money, it'll be quick I promise."
###
Topic: coffee
Task: write a product description
Request: Write a two-sentence description of a dark roast coffee from Colombia for an online shop.
###
Topic: healthy sleep
Task: give pros and cons
Request: What are the pros and cons of taking a short nap in the afternoon?
###
Topic: chess
Task: explain a concept
Request: What does it mean to castle in chess, and when is it not allowed?
###
"""

_H2 = """Below are requests that users sent to a helpful AI assistant. Each has a topic, a kind of task, and the request exactly as the user wrote it.

###
Topic: dogs
Task: write a short story
Request: Write a short story for children about a puppy who is afraid of the rain and learns to love puddles.
###
Topic: SQL databases
Task: explain a piece of code
Request: Can you explain what this query does? SELECT name, COUNT(*) FROM orders GROUP BY name HAVING COUNT(*) > 5;
###
Topic: marathon training
Task: plan a schedule
Request: Make me a four-week running plan. I can run three times a week and I can already run 5 km without stopping.
###
Topic: fractions
Task: solve a word problem
Request: A pizza is cut into 8 slices. Tom eats 3 slices and Anna eats 2. What fraction of the pizza is left?
###
Topic: email etiquette
Task: correct the grammar of a text
Request: Please correct the grammar: "Me and my team has finished the report, we will sending it tomorrow morning."
###
Topic: the printing press
Task: follow several constraints
Request: In exactly three sentences and without using the word "book", explain why the printing press changed Europe.
###
Topic: friendship
Task: explain a saying
Request: What does the saying "a friend in need is a friend indeed" mean? Give an example.
###
Topic: electric cars
Task: answer a yes-or-no question with reasons
Request: Is it cheaper to own an electric car than a petrol car? Give me the main reasons.
###
"""

HEADERS = [_H0, _H1, _H2]

STOPWORDS = frozenset("""a an the and or but if of to in on at by for with from about as into like through after over
between out against during without before under around among is are was were be been being am do does did have has
had having i me my we our you your he him his she her it its they them their this that these those what which who whom
whose when where why how all any both each few more most other some such no nor not only own same so than too very can
will just should would could may might must shall there here then also up down off again once because while until""".split())

META_PATTERNS = [re.compile(p, re.I | re.M) for p in [
    r"^\s*(topic|task|request)\s*:", r"###", r"\bas an ai\b", r"\bai (assistant|language model)\b",
    r"\bhere(?:'s| is) (?:a|the|my|your) (?:request|task|sample|example response)\b",
    r"^(sure|certainly|of course|absolutely)\b[,!.]",
    r"\bi'?m (?:ready|here|glad|happy|thrilled) to (?:help|assist)\b", r"\bhow can i (?:help|assist) you\b",
    r"\[[^\]\n]{0,40}\b(?:name|insert|your|date|address|company)\b[^\]\n]{0,40}\]",
    r"<\|", r"\bthe user\b",
]]


def read_topics(path):
    with open(path) as f:
        return [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]


def fingerprint(topics, tasks, headers):
    h = hashlib.sha256(json.dumps([topics, tasks, headers]).encode()).hexdigest()
    return h[:16]


def schedule(n_topics, n_tasks, seed, n_passes):
    """[(pass, topic index, task index)] in generation order: each pass all pairs, shuffled."""
    out = []
    for p in range(n_passes):
        pairs = [(t, k) for t in range(n_topics) for k in range(n_tasks)]
        random.Random(seed * 7919 + p).shuffle(pairs)
        out += [(p, t, k) for t, k in pairs]
    return out


# ---------------------------------------------------------------- filters ---

def clean(text):
    t = text.strip()
    t = re.sub(r"^request\s*:\s*", "", t, flags=re.I).strip()
    if len(t) >= 2 and t[0] == t[-1] and t[0] in "\"'" and t.count(t[0]) == 2:
        t = t[1:-1].strip()
    return "\n".join(ln.rstrip() for ln in t.split("\n"))


def normalise(text):
    return " ".join(re.sub(r"[^0-9a-z]+", " ", text.lower()).split())


def shingles(norm, n=3):
    w = norm.split()
    if len(w) < n:
        return {" ".join(w)}
    return {" ".join(w[i:i + n]) for i in range(len(w) - n + 1)}


def prose_words(text):
    """Words outside code: fenced blocks and code-looking lines removed."""
    t = re.sub(r"```.*?(```|$)", " ", text, flags=re.S)
    lines = [ln for ln in t.split("\n") if not re.match(r"^(\s{2,}|\t)|.*[;{}]\s*$", ln)]
    return re.findall(r"[A-Za-z']+", " ".join(lines))


def topic_stems(topic):
    return [w[:5] for w in re.findall(r"[a-z]+", topic.lower()) if len(w) >= 3 and w not in STOPWORDS]


def on_topic(text, topic):
    stems = topic_stems(topic)
    low = text.lower()
    return not stems or any(re.search(r"\b" + re.escape(s), low) for s in stems)


def check(text, finish_reason, topic, require_topic=False):
    """(True, "") for a usable request, else (False, reason)."""
    if finish_reason != "stop":
        return False, "truncated"
    words = re.findall(r"\S+", text)
    if len(text) < 12 or len(text) > 1500 or len(words) < 4:
        return False, "length"
    for p in META_PATTERNS:
        if p.search(text):
            return False, "meta"
    letters = [c for c in text if c.isalpha()]
    if letters and sum(ord(c) > 0x24F for c in letters) > 0.02 * len(letters):
        return False, "language"
    pw = [w.lower() for w in prose_words(text)]
    n_stop = sum(w in STOPWORDS for w in pw)
    if n_stop < 2 or n_stop < 0.12 * len(pw):
        return False, "language"
    lw = [w.lower() for w in words]
    if len(lw) >= 16 and len(set(lw)) < 0.4 * len(lw):
        return False, "repetitive"
    grams = Counter(tuple(lw[i:i + 4]) for i in range(len(lw) - 3))
    if grams and grams.most_common(1)[0][1] >= 3:
        return False, "repetitive"
    if require_topic and not on_topic(text, topic):
        return False, "off_topic"
    return True, ""


class ShingleIndex:
    """Kept texts' shingle sets with an inverted index: max Jaccard of a new set."""

    def __init__(self):
        self.sets, self.inv = [], defaultdict(list)

    def add(self, sh):
        j = len(self.sets)
        self.sets.append(sh)
        for s in sh:
            self.inv[s].append(j)

    def max_jaccard(self, sh):
        inter = Counter()
        for s in sh:
            for j in self.inv.get(s, ()):
                inter[j] += 1
        best = 0.0
        for j, c in inter.items():
            best = max(best, c / (len(sh) + len(self.sets[j]) - c))
        return best


def eval_prompts(data_dir):
    """Evaluation prompts (never trained on): MT-bench turns and GSM8K test questions."""
    out = []
    for name in ("mt_bench.jsonl", "gsm8k_test.jsonl"):
        p = os.path.join(data_dir, name)
        if not os.path.exists(p):
            continue
        with open(p) as f:
            for line in f:
                o = json.loads(line)
                out += o.get("turns", []) + ([o["question"]] if "question" in o else [])
    return out


def finalize(raw_records, eval_texts=(), near=0.6, eval_near=0.5, require_topic=False):
    """Filter + dedup raw attempts (any order in; position order used). Returns (kept, stats)."""
    ev = ShingleIndex()
    for t in eval_texts:
        ev.add(shingles(normalise(t)))
    kept, seen, idx, reasons = [], set(), ShingleIndex(), Counter()
    for r in sorted(raw_records, key=lambda r: r["pos"]):
        text = clean(r["text"])
        ok, why = check(text, r["finish_reason"], r["topic"], require_topic)
        if not ok:
            reasons[why] += 1
            continue
        norm = normalise(text)
        if norm in seen:
            reasons["duplicate"] += 1
            continue
        sh = shingles(norm)
        if idx.max_jaccard(sh) >= near:
            reasons["near_duplicate"] += 1
            continue
        if eval_texts and ev.max_jaccard(sh) >= eval_near:
            reasons["eval_overlap"] += 1
            continue
        seen.add(norm)
        idx.add(sh)
        kept.append({"id": f"selfgen:{r['pos']}", "prompt": text, "topic": r["topic"], "task": r["task"],
                     "seed": r["seed"], "on_topic": on_topic(text, r["topic"])})
    stats = {"attempts": len(raw_records), "kept": len(kept), "on_topic": sum(k["on_topic"] for k in kept),
             "rejected": dict(sorted(reasons.items()))}
    return kept, stats


# ------------------------------------------------------------- generation ---

def read_raw(path):
    out = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    r = json.loads(line)
                    out[r["pos"]] = r
                except (ValueError, KeyError):
                    pass  # a torn last line from an interrupted run
    return out


def write_outputs(out_dir, raw, eval_texts, require_topic=False):
    kept, stats = finalize(list(raw.values()), eval_texts, require_topic=require_topic)
    tmp = os.path.join(out_dir, "prompts.jsonl.tmp")
    with open(tmp, "w") as f:
        for k in kept:
            f.write(json.dumps(k) + "\n")
    os.replace(tmp, os.path.join(out_dir, "prompts.jsonl"))
    with open(os.path.join(out_dir, "prompts_stats.json"), "w") as f:
        json.dump(stats, f, indent=1)
    return stats


def request(base_url, model, prompt, seed, a):
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": a.max_tokens, "temperature": a.temperature,
                       "top_p": a.top_p, "seed": seed, "stop": ["###", "\nTopic:"]}).encode()
    req = urllib.request.Request(base_url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as r:
        o = json.loads(r.read())
    c = o["choices"][0]
    return c["text"], c["finish_reason"], o["usage"]["completion_tokens"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--topics", default=os.path.join(HERE, "distill_topics.txt"))
    ap.add_argument("--data-dir", default=SHARED, help="evaluation prompt sets, for the overlap check")
    ap.add_argument("--target", type=int, default=6000, help="stop when this many prompts are kept")
    ap.add_argument("--max-passes", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--require-topic", action="store_true", help="reject requests that miss their topic")
    ap.add_argument("--finalize-only", action="store_true")
    ap.add_argument("--sample", type=int, default=0, help="print N kept prompts at random and exit")
    a = ap.parse_args(argv)
    os.makedirs(a.out_dir, exist_ok=True)
    raw_path = os.path.join(a.out_dir, "raw.jsonl")
    if a.sample:
        with open(os.path.join(a.out_dir, "prompts.jsonl")) as f:
            kept = [json.loads(x) for x in f]
        for k in random.Random(a.seed).sample(kept, min(a.sample, len(kept))):
            print(f"--- {k['id']} [{k['topic']} / {k['task']}]\n{k['prompt']}")
        return 0
    topics = read_topics(a.topics)
    eval_texts = eval_prompts(a.data_dir)
    fp = fingerprint(topics, TASKS, HEADERS)
    cfg_path = os.path.join(a.out_dir, "config.json")
    if os.path.exists(cfg_path):
        old = json.load(open(cfg_path))
        if old.get("fingerprint") != fp or old.get("seed") != a.seed:
            sys.exit(f"make_prompts: {a.out_dir} was made with other topics/tasks/headers or seed "
                     f"({old}); use another --out-dir")
    else:
        with open(cfg_path, "w") as f:
            json.dump({"fingerprint": fp, "seed": a.seed, "n_topics": len(topics), "n_tasks": len(TASKS)}, f)
    repair_tail(raw_path)
    raw = read_raw(raw_path)
    if a.finalize_only:
        print(json.dumps(write_outputs(a.out_dir, raw, eval_texts, a.require_topic)))
        return 0
    sched = schedule(len(topics), len(TASKS), a.seed, a.max_passes)
    model = json.loads(urllib.request.urlopen(a.base_url + "/v1/models").read())["data"][0]["id"]
    stats = write_outputs(a.out_dir, raw, eval_texts, a.require_topic)
    print(f"make_prompts: {len(raw)} attempts, {stats['kept']} kept (target {a.target})", file=sys.stderr)
    t0, toks, n_new = time.time(), 0, 0
    with open(raw_path, "a") as out, cf.ThreadPoolExecutor(a.concurrency) as ex:
        for end in range(a.chunk, len(sched) + a.chunk, a.chunk):
            if stats["kept"] >= a.target:
                break
            todo = [i for i in range(min(end, len(sched))) if i not in raw]
            if not todo:
                continue

            def job(i):
                p, t, k = sched[i]
                prompt = HEADERS[i % len(HEADERS)] + f"Topic: {topics[t]}\nTask: {TASKS[k]}\nRequest:"
                seed = a.seed * 1000003 + i
                return i, seed, request(a.base_url, model, prompt, seed, a)
            futs = [ex.submit(job, i) for i in todo]
            for fut in cf.as_completed(futs):
                try:
                    i, seed, (text, fin, n) = fut.result()
                except Exception as e:  # retried on the next chunk or run
                    print(f"make_prompts: request failed: {e}", file=sys.stderr)
                    continue
                p, t, k = sched[i]
                r = {"pos": i, "pass": p, "topic": topics[t], "task": TASKS[k], "header": i % len(HEADERS),
                     "seed": seed, "text": text, "finish_reason": fin, "completion_tokens": n}
                out.write(json.dumps(r) + "\n")
                out.flush()
                raw[i] = r
                toks += n
                n_new += 1
            stats = write_outputs(a.out_dir, raw, eval_texts, a.require_topic)
            dt = time.time() - t0
            print(f"make_prompts: {len(raw)} attempts, {stats['kept']} kept; {n_new} new in {dt:.0f} s "
                  f"({n_new / dt:.2f} req/s, {toks / dt:.1f} tok/s); rejected {stats['rejected']}",
                  file=sys.stderr, flush=True)
    complete = stats["kept"] >= a.target or len(raw) == len(sched)
    print(f"make_prompts: {'done' if complete else 'unfinished'}: {stats['kept']} prompts kept of {len(raw)} "
          f"attempts", file=sys.stderr)
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main())
