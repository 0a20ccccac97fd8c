// A plugin that registers no variant.
int attnbench_test_no_variants() { return 0; }
