/*
 * serve.h: the subcommands of the `specd` binary, implemented in the
 * specd_server library so that main.c stays a dispatcher. Each takes the
 * arguments after the subcommand name and returns the process exit code
 * (0 ok, 1 error, 2 usage); none calls exit().
 */
#ifndef SPECD_SERVER_SERVE_H
#define SPECD_SERVER_SERVE_H

int specd_serve_main(int argc, char **argv);      /* server/serve.c */
int specd_generate_main(int argc, char **argv);   /* server/cli.c */
int specd_tokenize_main(int argc, char **argv);   /* server/cli.c */
int specd_detokenize_main(int argc, char **argv); /* server/cli.c */

#endif
