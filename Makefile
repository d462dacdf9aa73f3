# Quick start: `make run` (main job on the embedded sample) and `make test`.
# Both create .venv with everything the project needs on first use.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test check lint docs docs-serve setup clean pd-figures reproduce reproduce-large grid fidelity

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

# The paper's colocation evaluation (quick preset), and its results page.
reproduce: $(STAMP)
	$(BIN)/smetric reproduce --preset quick -o smetric-out/reproduce-quick --page docs/results/reproduce.md

# The policy grid (grid-quick preset; SMETRIC_TRACES names the folder holding
# mooncake/conversation_trace.jsonl), and its results page.
grid: $(STAMP)
	$(BIN)/smetric grid --preset grid-quick -o smetric-out/grid-quick --page docs/results/grid.md

# The paper's larger model (Figures 18-20), its results page into the docs.
reproduce-large: $(STAMP)
	$(BIN)/smetric reproduce --preset large -p smetric,smetric_cost,least_load,lmetric,linear -o smetric-out/reproduce-large --page docs/results/reproduce-large.md

# The performance model against every public measurement, into the docs.
fidelity: $(STAMP)
	$(BIN)/smetric fidelity --page docs/results/fidelity.md

lint: $(STAMP)
	$(BIN)/ruff check smetric tests benchmarks scripts
	$(BIN)/ruff format --check smetric tests benchmarks scripts docs
	$(BIN)/lint-imports
	$(BIN)/mypy

# The documentation site, into site/; --strict fails on a broken link or a missing page.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

test: lint docs
	$(BIN)/pytest --durations=15

# The fast tier, for every change: lint, types and the tests that start no process,
# server, engine or browser (about a minute on two cores).
FAST := not subprocess and not server and not real_engine and not browser

check: lint
	$(BIN)/pytest -m "$(FAST)"

clean:
	rm -rf $(VENV) smetric-out site .pytest_cache .ruff_cache
