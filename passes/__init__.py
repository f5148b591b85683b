"""The compiler: a pass manager for Inductor, the pass registry and one file per fusion pass."""
