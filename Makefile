# `make repro`: set up .venv and run the whole pipeline. `make test`: the test suite. `make test-fast`: its unit
# tests only (no pipeline, training or server runs). `make lint`: ruff over the code base.
VENV ?= .venv
BIN := $(VENV)/bin
RUN := PATH="$(CURDIR)/$(BIN):$$PATH"

.PHONY: setup repro test test-fast lint recipe bench bench-history pipeline exps clean

setup: $(VENV)/.installed

# torch is pinned in requirements.txt and installed in the same resolve, so no other torch build is pulled in.
# The project itself (lora_pipeline, stages, cli) is installed editable on top, without touching those pins.
$(VENV)/.installed: requirements.txt pyproject.toml
	python3 -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -q -r requirements.txt
	$(BIN)/pip install --disable-pip-version-check -q --no-deps -e .
	touch $@

repro: setup
	$(RUN) dvc repro
	@echo
	@echo "Merged model:      models/merged (adapter: models/adapter)"
	@echo "Registered model:  models/registered.json  (mlflow ui --backend-store-uri sqlite:///mlflow.db)"
	@echo "Metrics:           metrics/data.json metrics/split.json metrics/train.json metrics/merge.json metrics/eval.json"
	@echo "Plots and reports: plots/ reports/report.png reports/demo.txt"
	@$(RUN) dvc metrics show

test: setup
	$(RUN) HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 python -m pytest -q -n 2 --dist loadgroup --no-loadscope-reorder --durations=20 tests

test-fast: setup
	$(RUN) HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 python -m pytest -q -n 2 -m unit tests

lint: setup
	$(RUN) ruff check .

# make recipe RECIPE=qwen2-0.5b: one DVC experiment of recipes/<RECIPE>.yaml, whose keys become `dvc exp run -S`
# sets (params.yaml keeps every other value). RECIPE=seed/qwen2-0.5b: the seed notebook's exact settings.
# EXP_ARGS="--queue" (or "--temp") is passed on to dvc exp run.
recipe: setup
	$(RUN) python -m cli.recipes $(RECIPE) -- $(EXP_ARGS)

# The experiments side by side: the params that differ and the metrics to decide on, sorted by the gate metric.
exps: setup
	@$(RUN) python -m cli.experiments

# make bench RECIPE=qwen2-0.5b (on a GPU machine): seed baseline and ours in one go -> measurements/results.jsonl
bench:
	bash benchmarks/bench.sh $(RECIPE)

# make bench-history [RECIPE=qwen2-0.5b]: every row of measurements/*.jsonl, a table per file (stdlib only, no venv)
bench-history:
	@python3 benchmarks/bench_history.py $(if $(RECIPE),--recipe $(RECIPE))

# make pipeline RECIPE=qwen2-0.5b (or gpt-oss-20b, default): the recipe's whole pipeline offline at full size, every
# stage timed -> measurements/pipeline.jsonl (benchmarks/pipeline.sh says how)
pipeline:
	$(RUN) bash benchmarks/pipeline.sh $(RECIPE)

clean:
	rm -rf $(VENV)
