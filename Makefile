# The README's commands. A fresh machine needs only python3 (>= 3.10) and make.
PYTHON ?= python3
VENV ?= .venv
# CPU build by default; GPU users: make test TORCH_SPEC="torch==2.13.0 --index-url <your CUDA index>"
TORCH_SPEC ?= torch==2.13.0
DATA ?= ../shared/data/tinyshakespeare.txt
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test test-all clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/decoderlm train --data $(DATA) --preset seed-char --max-steps 500 --eval-interval 250 --out runs/demo-char
	$(VENV)/bin/decoderlm generate --model runs/demo-char --prompt "ROMEO:" --max-new-tokens 200 --temperature 0.8 --top-k 40 --seed 0

test: $(STAMP)
	$(PY) -m pytest -m "not slow" -q

test-all: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) runs
