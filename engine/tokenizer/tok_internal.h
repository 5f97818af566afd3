/*
 * tok_internal.h: the tokenizer's private data model, shared by the files of
 * engine/tokenizer/ and by nothing else.
 *
 * A tokenizer is one vocabulary of N ids, each with its decoded bytes (the
 * GPT-2 byte-level mapping already undone, so "Ġhello" is stored as " hello"),
 * an attribute byte, a merge table keyed by id pairs, one pre-tokenizer, and a
 * table of "added" tokens (specials and user-defined strings) that are split
 * out of the text before pre-tokenization. The three loaders (GGUF metadata,
 * HF tokenizer.json, tiktoken ranks) only differ in how they fill this struct;
 * encoding, decoding and chat rendering read it and never write it.
 *
 * Invariants after tok_finish(): every id in [0, n_vocab) has bytes (possibly
 * empty for holes in a vocabulary); byte_id[b] is the id whose bytes are the
 * single byte b, or -1 (such bytes are dropped by encode, as HF does);
 * every merge's left/right/result ids are in
 * range. Threading: immutable after creation.
 */
#ifndef SPECD_TOKENIZER_TOK_INTERNAL_H
#define SPECD_TOKENIZER_TOK_INTERNAL_H

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "engine/tokenizer/tokenizer.h"

/* ---- per-token attributes ---- */
enum {
    TOK_ATTR_SPECIAL = 1, /* control token: split out only when parsing specials; skipped by skip_special */
    TOK_ATTR_ADDED = 2,   /* user-defined added token: always split out of text, decoded as text */
    TOK_ATTR_HOLE = 4,    /* id with no entry in the source vocabulary */
};

/* ---- small hash maps (open addressing, power-of-two capacity) ---- */

/* bytes -> id. Keys point into memory the map does not own (the tokenizer's arena). */
typedef struct tok_strmap {
    const char **key;
    uint32_t *klen;
    int32_t *val;
    size_t cap; /* slots, power of two; 0 = empty map */
    size_t n;
} tok_strmap;

int tok_strmap_init(tok_strmap *m, size_t expected);
void tok_strmap_free(tok_strmap *m);
/* Inserts or overwrites. Returns -1 on allocation failure. */
int tok_strmap_put(tok_strmap *m, const char *k, size_t klen, int32_t v);
int32_t tok_strmap_get(const tok_strmap *m, const char *k, size_t klen); /* -1 if absent */
uint64_t tok_hash_bytes(const char *k, size_t n);

/* (left id, right id) -> (rank, merged id). */
typedef struct tok_pairmap {
    uint64_t *key; /* (uint64)left << 32 | right; UINT64_MAX = empty */
    int32_t *rank;
    int32_t *result;
    size_t cap;
    size_t n;
} tok_pairmap;

int tok_pairmap_init(tok_pairmap *m, size_t expected);
void tok_pairmap_free(tok_pairmap *m);
/* Keeps the first (lowest-rank) entry when a pair is inserted twice. */
int tok_pairmap_put(tok_pairmap *m, int32_t left, int32_t right, int32_t rank, int32_t result);
/* Returns the rank (>= 0) and sets *result, or -1 if the pair does not merge. */
int32_t tok_pairmap_get(const tok_pairmap *m, int32_t left, int32_t right, int32_t *result);

/* ---- pre-tokenizer ---- */
typedef enum {
    PRETOK_REGEX = 0,        /* one regex; gaps between matches are pieces too */
    PRETOK_DIGITS_REGEX = 1, /* every \p{N} code point is its own piece, then the regex
                                runs on each digit-free stretch (HF Digits(individual_digits)
                                followed by ByteLevel; llama.cpp "smollm") */
} pretok_kind;

typedef struct pretok {
    pretok_kind kind;
    pcre2_code *re;    /* main splitting regex (UTF, UCP, JIT when available) */
    pcre2_code *digit; /* \p{N} finder for PRETOK_DIGITS_REGEX, else NULL */
    char *pattern;     /* the main pattern as compiled (for error messages / tests) */
} pretok;

/* Named pre-tokenizers. */
extern const char *const TOK_RE_GPT2;     /* HF ByteLevel(use_regex) regex, onig \s semantics */
extern const char *const TOK_RE_LLAMA3;   /* Llama-3 / tiktoken cl100k style */
extern const char *const TOK_RE_KIMI;     /* Kimi K2 (class intersection rewritten for PCRE2) */

int pretok_init(pretok *p, pretok_kind kind, const char *pattern, specd_err *err);
void pretok_free(pretok *p);

/* Called for each piece [off, off+len) of the text given to pretok_split. */
typedef int (*pretok_piece_fn)(void *ctx, const char *piece, size_t len);
/* Splits TEXT (arbitrary bytes) into pieces. Valid UTF-8 stretches are split
 * by the regex; every byte that is not part of a well-formed UTF-8 sequence is
 * a piece of its own (documented behaviour for invalid input). MD is caller
 * match data (one per thread). Stops and returns the callback's value if it
 * returns nonzero. */
int pretok_split(const pretok *p, const char *text, size_t len, pcre2_match_data *md,
                 pretok_piece_fn fn, void *ctx, specd_err *err);

/* Length of the longest prefix of S that is well-formed UTF-8 (RFC 3629:
 * no overlongs, no surrogates, <= U+10FFFF). */
size_t tok_utf8_valid_prefix(const unsigned char *s, size_t n);
/* Length of a well-formed sequence starting at S (1..4), 0 if S[0] starts no
 * well-formed sequence within N bytes. */
size_t tok_utf8_seq_len(const unsigned char *s, size_t n);

/* ---- chat template families ---- */
typedef enum {
    CHAT_NONE = 0,    /* no template known: chat calls fail */
    CHAT_CHATML = 1,  /* <|im_start|>role\ncontent<|im_end|>\n (SmolLM2, Qwen-style without tools) */
    CHAT_KIMI = 2,    /* <|im_user|>user<|im_middle|>content<|im_end|> (REFERENCE section 1) */
} chat_family;

/* ---- the tokenizer ---- */
typedef enum {
    TOK_KIND_BPE = 0,      /* merges list with ranks (GPT-2 byte-level, HF BPE) */
    TOK_KIND_TIKTOKEN = 1, /* ranks only: a pair merges if its concatenation is a token */
} tok_kind;

struct tokenizer {
    tok_kind kind;
    int32_t n_vocab;
    char *arena;          /* decoded bytes of all tokens, back to back */
    size_t arena_len, arena_cap;
    uint64_t *tok_off;    /* [n_vocab] offset of each token's bytes in arena */
    uint32_t *tok_len;    /* [n_vocab] byte length */
    uint8_t *attr;        /* [n_vocab] TOK_ATTR_* */
    tok_strmap by_bytes;  /* decoded bytes -> id, every token (specials win over plain tokens) */
    tok_strmap plain;     /* decoded bytes -> id, plain vocabulary only (what BPE may produce) */
    int32_t byte_id[256]; /* id of the single-byte token for each byte value, -1 if none */
    tok_pairmap merges;
    bool ignore_merges;   /* whole piece found in the vocabulary -> that one id (tiktoken, Llama-3) */
    int32_t *added;       /* ids of TOK_ATTR_SPECIAL|TOK_ATTR_ADDED tokens, sorted by
                             (first byte, length descending, id) */
    size_t n_added;
    uint32_t added_start[257]; /* added[added_start[b] .. added_start[b+1]) start with byte b */
    pretok pt;
    int32_t bos, eos, unk, pad;
    int32_t stop[8];
    size_t n_stop;
    char *chat_template; /* NUL-terminated copy or NULL */
    chat_family chat;
    const char *chat_reason; /* why chat is CHAT_NONE (static string) */
    bool chat_think;         /* Kimi: K2.5 style (<think></think> on assistant turns, thinking prompt) */
    char *default_system; /* ChatML: default system prompt from the template, or NULL */
};

/* Allocates an empty tokenizer with N_VOCAB ids (all holes). */
tokenizer *tok_alloc(int32_t n_vocab, specd_err *err);
/* Sets id's bytes (copied into the arena) and attributes. */
int tok_set_token(tokenizer *t, int32_t id, const char *bytes, size_t len, uint8_t attr, specd_err *err);
/* After all tokens are set: builds by_bytes, byte_id, the added table and stop
 * ids. The arena is frozen from here on; merges are added after (tok_add_merge
 * looks the merged bytes up in by_bytes). tok_add_merge returns 1 (not an
 * error) for a merge whose result is not in the vocabulary. */
int tok_finish(tokenizer *t, specd_err *err);
/* Recomputes the stop ids (EOS, then <|im_end|> when it is a special token)
 * after t->eos changes. */
void tok_set_stops(tokenizer *t);
int tok_add_merge(tokenizer *t, int32_t left, int32_t right, int32_t rank, specd_err *err);
/* Chat template: stores a copy and detects the family (CHAT_NONE if unknown,
 * which only fails at chat time). */
int tok_set_chat_template(tokenizer *t, const char *tpl, size_t len, specd_err *err);

/* GPT-2 byte-level mapping: byte -> code point, and code point -> byte (-1 if none). */
uint32_t tok_bytelevel_cp(uint8_t b);
int tok_bytelevel_byte(uint32_t cp);
/* Decodes a byte-level string (UTF-8 of mapped code points) into raw bytes in
 * OUT (capacity >= len). Characters outside the mapping are copied as their
 * UTF-8 bytes. Returns the byte count. */
size_t tok_bytelevel_decode(const char *s, size_t len, char *out);

/* Encodes one plain-text run (no specials are parsed) and appends ids to a
 * growable vector. Used by tok_encode and the chat encoder. */
typedef struct tok_ids {
    int32_t *v;
    size_t n, cap;
} tok_ids;
int tok_ids_push(tok_ids *ids, int32_t id);
int tok_encode_plain(const tokenizer *t, const char *text, size_t len, tok_ids *out, specd_err *err);

#endif
