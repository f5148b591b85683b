"""The command line (`megafuse`): info, run; tools import everything and own nothing."""
