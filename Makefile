# The two commands a newcomer needs: `make run` and `make test`. Everything else is optional.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP_RUN := $(VENV)/.installed-run
STAMP_DEV := $(VENV)/.installed-dev

.PHONY: run test lint bench clean

$(BIN)/python:
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need Python 3.11 ($(PYTHON)) on PATH"; exit 1; }
	$(PYTHON) -m venv $(VENV)

# torch is pinned to the CPU build first so nothing pulls the CUDA wheels.
$(STAMP_RUN): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e .
	@touch $@

$(STAMP_DEV): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	@touch $@ $(STAMP_RUN)

# The planning service on SQLite with the shipped GNN, one example plan submitted and printed;
# it keeps serving (web view and API at http://127.0.0.1:8000) until Ctrl-C.
run: $(STAMP_RUN)
	$(BIN)/tagplan serve --demo

# pytest exits 5 when it collected nothing: that is a failure, never a silent pass.
test: $(STAMP_DEV)
	@$(BIN)/python -m pytest -q -n 2 --dist loadfile; status=$$?; \
	if [ $$status -eq 5 ]; then echo "pytest collected no tests"; exit 1; fi; exit $$status

lint: $(STAMP_DEV)
	$(BIN)/ruff check tagplan tests bench
	$(BIN)/mypy tagplan
	$(BIN)/lint-imports

bench: $(STAMP_RUN)
	$(BIN)/python bench/frontends_speed.py
	$(BIN)/python bench/simulator.py
	$(BIN)/python bench/fit_sustained_clock.py
	$(BIN)/python bench/fit_causal_attention.py
	$(BIN)/python bench/validate_megatron.py
	$(BIN)/python bench/planner.py
	$(BIN)/python bench/gnn.py
	$(BIN)/python bench/fidelity.py
	$(BIN)/python bench/fidelity_amp.py
	$(BIN)/python bench/fidelity_megatron_a100.py
	$(BIN)/python bench/fidelity_mpt.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
