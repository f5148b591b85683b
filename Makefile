# `make run` and `make test` do all the set-up on a fresh machine: a virtualenv in .venv, the CPU
# torch 2.13.0 wheel when there is no GPU (never the multi-GB CUDA build), then the project.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: run test test-fast test-all clean

$(STAMP): pyproject.toml
	python3 -m venv --system-site-packages $(VENV)
	@if ! $(PY) -c "import torch" 2>/dev/null; then \
		if command -v nvidia-smi >/dev/null 2>&1; then \
			echo "GPU machine without torch: install a CUDA torch >= 2.11 first"; exit 1; \
		fi; \
		$(PY) -m pip install --quiet "torch==2.13.0"; \
	fi
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

# compile tiny's batched step with every registered pass (each kind of layer once), prefill + 4 incremental
# greedy decode steps, compare with eager (~4 min on 2 CPU cores with empty caches, 1.5 min warm)
run: $(STAMP)
	$(VENV)/bin/megafuse run --config tiny --passes all --decode 4

# test: the suite CI runs, on two workers (one per core; the tool tests that share compiled
# regions form one xdist group, so one worker compiles them once: tests/conftest.py); test-fast:
# without the `slow` tests (whole-model compiles, every parametrisation past a representative:
# tests/marks.py), for iteration; test-all: with the `exhaustive` ones too (hundreds of cases)
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadgroup -m "not exhaustive" --durations=15

test-fast: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadgroup -m "not slow and not exhaustive" --durations=15

test-all: $(STAMP)
	$(PY) -m pytest -q --durations=15

clean:
	rm -rf $(VENV) .pytest_cache
