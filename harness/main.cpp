#include "harness/cli.h"

int main(int argc, char** argv) { return attnbench::cli_main(argc, argv); }
