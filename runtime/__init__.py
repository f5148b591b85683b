"""Serving-side execution: paged caches, the prefill planner for bounded replay, CUDA graphs."""
