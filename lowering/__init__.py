"""Kernel generation: FusionSpec -> Triton source, a kernel cache on disk, launch code, references."""
