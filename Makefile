# Set-up and entry points. `make demo` and `make test` each create .venv when it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION := 2.13.0
# torchtitan for tests/test_torchtitan.py, without its dependencies, which are its trainer's
# (datasets, wandb, tensorboard, tokenizers, ...): heavy, and datasets would downgrade the fsspec
# (and with it s3fs and gcsfs) that the object-store tests use. What its checkpoint manager and
# optimizer containers import comes instead. A job running torchtitan's trainer has all of them
# already and installs tierstore[torchtitan].
TORCHTITAN_VERSION := 0.3.0
TORCHTITAN_TEST_DEPS := 'tyro>=1,<2' spmd-types==0.2.3
# Azurite (the Azure blob emulator the obstore backend's tests run against), from npm into
# .venv/azurite (tierstore_simulate.servers.find_azurite looks there). 3.35 is the newest that
# runs on Node 20; without npm the Azure tests skip, saying so.
AZURITE_VERSION := 3.35.0

.PHONY: demo test gpu-test faults bench docs clean

# torch first, pinned: a bare `torch` requirement would pull several GB of CUDA wheels.
$(VENV)/.torch:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==$(TORCH_VERSION)
	touch $@

$(VENV)/.installed: $(VENV)/.torch pyproject.toml
	$(PY) -m pip install --quiet -e '.[s3,gcs]'
	touch $@

# The example third-party plugin is installed like any plugin package (its entry point is how
# tierstore finds it); the suite runs the conformance kits against it.
$(VENV)/.installed-test: $(VENV)/.installed examples/tierstore-example-plugin/pyproject.toml
	$(PY) -m pip install --quiet -e '.[test]'
	$(PY) -m pip install --quiet -e examples/tierstore-example-plugin
	$(PY) -m pip install --quiet $(TORCHTITAN_TEST_DEPS)
	$(PY) -m pip install --quiet --no-deps torchtitan==$(TORCHTITAN_VERSION)
	if command -v npm >/dev/null; then npm install --silent --no-audit --no-fund --prefix $(VENV)/azurite azurite@$(AZURITE_VERSION); else echo "npm not found: Azurite not installed, the Azure tests will skip"; fi
	touch $@

$(VENV)/.installed-docs: $(VENV)/.installed pyproject.toml
	$(PY) -m pip install --quiet -e '.[docs]'
	touch $@

demo: $(VENV)/.installed
	$(PY) -m tierstore.demo

# The documentation site, into site/. --strict: a broken link, anchor or API reference fails it
# (tests/test_docs.py builds it the same way in `make test`). NO_MKDOCS_2_WARNING silences the
# Material theme's banner about its own end of life, which says nothing about these pages.
docs: $(VENV)/.installed-docs
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

# Two workers (one per core of the CI machine), each with its own servers (tests/conftest.py);
# worksteal evens out the long multi-rank tests. The slowest tests are listed at the end.
test: $(VENV)/.installed-test
	$(PY) -m pytest -q -n 2 --dist worksteal --durations=15

# The CUDA paths (pinned buffers, side-stream copies, lazy staging on a GPU), on a machine with
# an NVIDIA GPU, where PyPI's torch wheel is a CUDA build. Everywhere else these tests skip (and
# this target says why it ran nothing).
gpu-test: $(VENV)/.installed-test
	$(PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu-test: CUDA is not available to torch ' + torch.__version__)"
	$(PY) -m pytest -q tests/gpu tests/test_load_destinations.py

# The fault matrix: every phase x every fault kind, invariants checked from a fresh process;
# prints the table (tests/faults/). Add TABLE=path.md to write it as Markdown too.
faults: $(VENV)/.installed-test
	$(PY) -m tests.faults $(if $(TABLE),--table $(TABLE))

bench: $(VENV)/.installed
	$(PY) benchmarks/save_load.py
	$(PY) benchmarks/pipeline.py
	$(PY) benchmarks/staging.py
	$(PY) benchmarks/replication.py

clean:
	rm -rf $(VENV) build site *.egg-info
