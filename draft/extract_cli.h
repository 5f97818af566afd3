/*
 * extract_cli.h: `specd extract`: hidden-state dumps for EAGLE-3 training
 * (format specd-eagle3-dump-v1, tools/train_eagle3/FORMAT.md).
 */
#ifndef SPECD_DRAFT_EXTRACT_CLI_H
#define SPECD_DRAFT_EXTRACT_CLI_H

/* argv[0] is "extract". Returns a process exit code (0 ok, 1 error, 2 usage). */
int extract_main(int argc, char **argv);

#endif
