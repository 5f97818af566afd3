/*
 * vocab_cli.h: `specd vocab count|build|inspect|validate`, the command line
 * over vocab/ (server/main.c dispatches `specd vocab ...` here when this
 * header exists).
 *
 *   count    --target MODEL --data FILE [--data FILE ...] [--responses FILE]
 *            [--max-seq-len N] [--num-samples N] [--threads N] [--output token_freq.npy]
 *   build    --token-freq F --draft-vocab-size N [--target-vocab-size N] [--target MODEL]
 *            [--always-include IDS|TOKENS] [--no-default-include] --output-dir DIR
 *   inspect  FILE|DIR [--target MODEL]
 *   validate --draft DIR|MAPFILE --target MODEL --data FILE [--responses FILE]
 *            [--num-samples N] [--max-new-tokens N] [--no-greedy] [--save-responses FILE]
 *
 * Each subcommand prints a report on stdout and errors on stderr and returns
 * its exit code (0 ok, 1 failure or an invalid map, 2 usage). Nothing here
 * calls exit(). Threading: main thread (count and validate start workers).
 */
#ifndef SPECD_VOCAB_VOCAB_CLI_H
#define SPECD_VOCAB_VOCAB_CLI_H

/* ARGV[0] is "vocab", ARGV[1] the subcommand. */
int vocab_main(int argc, char **argv);

int vocab_count_main(int argc, char **argv);    /* argv[0] = "count" */
int vocab_build_main(int argc, char **argv);    /* argv[0] = "build" */
int vocab_inspect_main(int argc, char **argv);  /* argv[0] = "inspect" */
int vocab_validate_main(int argc, char **argv); /* argv[0] = "validate" */

#endif
