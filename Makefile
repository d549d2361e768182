# Every target installs what it needs into .venv first (quick when up to date).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
HIST := packing/histograms/wikipedia_512.json

.PHONY: install install-tf test demo demo-data bench lint clean finetune-demo

install: $(STAMP)

$(STAMP): requirements.txt requirements-assets.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -r requirements-assets.txt
	touch $(STAMP)

# Optional TensorFlow environment (reading TF1 checkpoints); the tests build it to run the
# converter's test against real TensorFlow.
TF_VENV := .venv-tf
TF_STAMP := $(TF_VENV)/.installed
install-tf: $(TF_STAMP)

$(TF_STAMP): requirements-tf.txt
	test -x $(TF_VENV)/bin/python || $(PYTHON) -m venv $(TF_VENV)
	$(TF_VENV)/bin/python -m pip install -q --disable-pip-version-check -r requirements-tf.txt
	touch $(TF_STAMP)

test: install install-tf
	$(PY) -m pytest -q

# The demo: real text -> unpacked shards -> packed (and unpacked-baseline) shards -> verified.
DEMO ?= demo_out
demo-data: install
	rm -rf $(DEMO)
	$(PY) -m data.create_pretraining_data --input "$$($(PY) -m data.assets corpus)" \
		--input-format one-document-per-file --vocab "$$($(PY) -m data.assets vocab)" --output $(DEMO)/unpacked \
		--max-seq-length 512 --max-predictions-per-seq 76 --dupe-factor 1 --eval-documents 100
	$(PY) -m packing pack --input '$(DEMO)/unpacked/part-*.h5' --output $(DEMO)/packed \
		--algorithm lp --max-sequences-per-pack 3 --max-sequence-length 512 --max-predictions-per-seq 76 \
		--vocab-size 30522 --seed 12345 --quiet
	$(PY) -m packing pack --input '$(DEMO)/unpacked/part-*.h5' --output $(DEMO)/unpacked_baseline \
		--algorithm none --max-sequences-per-pack 1 --vocab-size 30522 --quiet
	$(PY) -m packing pack --input '$(DEMO)/unpacked/eval/part-*.h5' --output $(DEMO)/eval \
		--algorithm lp --max-sequences-per-pack 3 --vocab-size 30522 --quiet
	$(PY) -m packing verify --input '$(DEMO)/unpacked/part-*.h5' --packed $(DEMO)/packed --quiet
	$(PY) -m packing verify --input '$(DEMO)/unpacked/part-*.h5' --packed $(DEMO)/unpacked_baseline --quiet
	$(PY) -m packing describe --packed $(DEMO)/unpacked_baseline $(DEMO)/packed --plot $(DEMO)/packing.png

# Then train the tiny demo model on CPU for the same wall-clock budget, packed and unpacked.
DEMO_SECONDS ?= 60
demo: demo-data
	rm -rf runs/demo_packed runs/demo_unpacked
	$(PY) run_pretraining.py --config configs/demo.yaml --output-dir runs/demo_packed \
		--set training.max_seconds=$(DEMO_SECONDS) --set logging.progress=false
	$(PY) run_pretraining.py --config configs/demo.yaml --output-dir runs/demo_unpacked \
		--set training.max_seconds=$(DEMO_SECONDS) --set logging.progress=false \
		--set data.train_dir=$(DEMO)/unpacked_baseline --set data.micro_batch_packs=14 \
		--set optim.packing_adjustment=none --set optim.gradient_accumulation=1
	$(PY) -m training.summary --packed runs/demo_packed --unpacked runs/demo_unpacked

# Fine-tuning demo: BBC News topics from the real MiniLM-L6 BERT, the four batching modes for
# the same budget (FINETUNE_EPOCHS passes) on CPU, then one table.
FINETUNE_EPOCHS ?= 2
FINETUNE_MODES := padded dynamic uniform packed
finetune-demo: install
	mkdir -p runs
	for mode in $(FINETUNE_MODES); do \
		rm -rf runs/finetune_$$mode; \
		$(PY) -m finetune.train --config configs/finetune_bbc.yaml --output-dir runs/finetune_$$mode \
			--set batching.mode=$$mode --set training.epochs=$(FINETUNE_EPOCHS) --set training.progress=false \
			> runs/finetune_$$mode.log || exit 1; \
	done
	$(PY) -m finetune.report $(addprefix runs/finetune_,$(FINETUNE_MODES))

bench: install
	$(PY) bench/bench_packing.py
	$(PY) bench/bench_pipeline.py --sizes 1000000 4000000 --workers 2
	$(PY) bench/bench_lamb.py
	$(PY) bench/bench_model.py --preset bert-base --rows 2 --steps 3
	$(MAKE) demo-data
	$(PY) bench/bench_loader.py --packed $(DEMO)/packed
	$(PY) bench/bench_stages.py
	$(PY) bench/bench_finetune.py

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
