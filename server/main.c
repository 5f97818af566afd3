/*
 * main.c: the `specd` binary, a dispatcher over subcommands.
 *
 *   specd serve MODEL [flags]        OpenAI-compatible HTTP server (server/serve.c)
 *   specd generate MODEL ...         one offline request (server/cli.c)
 *   specd tokenize / detokenize      tokenizer round trips (server/cli.c)
 *   specd vocab build|inspect|...    vocab/ (when built)
 *   specd extract ...                hidden-state dumps (when built)
 *   specd --version | --help
 *
 * Only main (and tests) may exit the process: every subcommand returns its
 * exit code here.
 */
#include <stdio.h>
#include <string.h>

#include "server/bundle.h"
#include "server/serve.h"

#if defined(__has_include)
#if __has_include("vocab/vocab_cli.h")
#include "vocab/vocab_cli.h"
#define SPECD_HAVE_VOCAB_CLI 1
#endif
#if __has_include("draft/extract_cli.h")
#include "draft/extract_cli.h"
#define SPECD_HAVE_EXTRACT_CLI 1
#endif
#endif

#ifndef SPECD_VERSION
#define SPECD_VERSION "0.1.0"
#endif

static void usage(FILE *f) {
    fprintf(f,
            "usage: specd <command> [args]\n"
            "\n"
            "commands:\n"
            "  serve MODEL [flags]          serve MODEL over an OpenAI-compatible HTTP API\n"
            "  generate MODEL --prompt T    run one request offline (or --chat T)\n"
            "  tokenize --model M [TEXT]    print token ids as a JSON array\n"
            "  detokenize --model M [IDS]   print the text of a JSON array of ids\n"
            "  vocab count|build|inspect|validate  draft vocabulary maps (t2d / d2t)\n"
            "  extract ...                  dump hidden states for draft training\n"
            "\n"
            "`specd <command> --help` lists each command's flags. specd %s\n",
            SPECD_VERSION);
}

int main(int argc, char **argv) {
    /* a tensor-parallel worker rank: rank 0's command line plus ranks.h's arguments */
    for (int i = 1; i < argc; i++)
        if (!strncmp(argv[i], "--specd-comm-rank=", 18)) return specd_tp_worker_main(argc, argv);
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    const char *cmd = argv[1];
    int sub_argc = argc - 2;
    char **sub_argv = argv + 2;
    if (!strcmp(cmd, "--version") || !strcmp(cmd, "version")) {
        printf("specd %s\n", SPECD_VERSION);
        return 0;
    }
    if (!strcmp(cmd, "--help") || !strcmp(cmd, "-h") || !strcmp(cmd, "help")) {
        usage(stdout);
        return 0;
    }
    if (!strcmp(cmd, "serve")) return specd_serve_main(sub_argc, sub_argv);
    if (!strcmp(cmd, "generate")) return specd_generate_main(sub_argc, sub_argv);
    if (!strcmp(cmd, "tokenize")) return specd_tokenize_main(sub_argc, sub_argv);
    if (!strcmp(cmd, "detokenize")) return specd_detokenize_main(sub_argc, sub_argv);
    if (!strcmp(cmd, "vocab")) {
#ifdef SPECD_HAVE_VOCAB_CLI
        return vocab_main(argc - 1, argv + 1);
#else
        fprintf(stderr, "specd vocab: not built in this binary\n");
        return 1;
#endif
    }
    if (!strcmp(cmd, "extract")) {
#ifdef SPECD_HAVE_EXTRACT_CLI
        return extract_main(argc - 1, argv + 1);
#else
        fprintf(stderr, "specd extract: not built in this binary\n");
        return 1;
#endif
    }
    fprintf(stderr, "specd: unknown command '%s'\n\n", cmd);
    usage(stderr);
    return 2;
}
