# Quick start: `make run` (main job on the embedded sample) and `make test`.
# Both create .venv with everything the project needs on first use.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint setup clean pd-figures reproduce grid

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/smetric simulate

# The paper's PD-disaggregation figures (21, 22, 23) on the embedded WEKA sample.
pd-figures: $(STAMP)
	SMETRIC=$(BIN)/smetric scripts/pd_figures.sh smetric-out/pd-figures

# The paper's colocation evaluation (quick preset), its validation.md into README.md.
reproduce: $(STAMP)
	$(BIN)/smetric reproduce --preset quick -o smetric-out/reproduce-quick --readme README.md

# Issue 10's policy grid (grid-quick preset), its grid.md into README.md.
grid: $(STAMP)
	$(BIN)/smetric grid --preset grid-quick -o smetric-out/grid-quick --readme README.md

lint: $(STAMP)
	$(BIN)/ruff check smetric tests benchmarks scripts
	$(BIN)/ruff format --check smetric tests benchmarks scripts

test: lint
	$(BIN)/pytest

clean:
	rm -rf $(VENV) smetric-out .pytest_cache .ruff_cache
