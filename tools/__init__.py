"""The command line (`megafuse`): info, run, ablate, inspect (and the benchmarks); tools import
everything and own nothing."""
