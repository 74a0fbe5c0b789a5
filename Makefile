# The two commands of the README: `make serve` and `make test`. Both set up everything they need:
# the virtual environment, the Python dependencies, and a release build of the Rust extension.

PYTHON_BOOTSTRAP ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMPS := .make
export VIRTUAL_ENV := $(CURDIR)/$(VENV)
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

RUST_SOURCES := $(shell find rust -name '*.rs') Cargo.toml Cargo.lock
EXT_STAMP := $(STAMPS)/extension

.PHONY: all setup build serve test test-rust lint typecheck test-python gpu-check clean router

all: test

$(PY):
	$(PYTHON_BOOTSTRAP) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# Dependencies are read from pyproject.toml, so the list lives in one place.
$(STAMPS)/deps: pyproject.toml | $(PY)
	@mkdir -p $(STAMPS)
	$(PY) -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; print('\n'.join(p['dependencies'] + p['optional-dependencies']['test']))" > $(STAMPS)/requirements.txt
	$(PY) -m pip install --quiet -r $(STAMPS)/requirements.txt
	@touch $@

# maturin develop rebuilds the abi3 extension in place (python/hybridserve/_core.abi3.so); the stamp
# depends on every Rust source, so an edited source always rebuilds and the old .so is replaced.
$(EXT_STAMP): $(RUST_SOURCES) pyproject.toml $(STAMPS)/deps
	rm -f python/hybridserve/_core*.so
	$(VENV)/bin/maturin develop --release --quiet
	@touch $@

setup: $(EXT_STAMP)

build: setup

serve: setup
	$(VENV)/bin/hybridserve serve demo $(SERVE_ARGS)

test-rust:
	cargo fmt --check
	cargo clippy --all-targets -- -D warnings
	cargo clippy --all-targets --features python -- -D warnings
	cargo test --quiet

lint: setup
	$(VENV)/bin/ruff check python tests benches
	$(VENV)/bin/ruff format --check python tests benches

# mypy (strict on the engine, sampling and the server; pyproject.toml [tool.mypy]), then the stub of
# the Rust module against the module itself (signatures, defaults, names).
typecheck: setup
	$(VENV)/bin/mypy
	$(VENV)/bin/python -m mypy.stubtest hybridserve._core --mypy-config-file pyproject.toml \
		--allowlist tests/repo/stubtest_allowlist.txt

# The browser test (tests/server/test_server_browser.py) drives a real headless Chromium. Where it is
# missing and apt-get is usable as root (Debian), the Debian package is installed (about 20 s and
# 112 MB to download); otherwise this says why the test will skip. The stamp is written only once
# chromium is there, so a machine without it checks again next time.
$(STAMPS)/chromium:
	@mkdir -p $(STAMPS)
	@if command -v chromium >/dev/null 2>&1; then \
		touch $@; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing the Debian package chromium for the browser test (log: $(STAMPS)/chromium.log)"; \
		if (DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium \
			|| (apt-get update -q && DEBIAN_FRONTEND=noninteractive \
				apt-get install -y -q --no-install-recommends chromium)) >$(STAMPS)/chromium.log 2>&1 \
			&& command -v chromium >/dev/null 2>&1; then \
			touch $@; \
		else \
			echo "installing chromium failed (see $(STAMPS)/chromium.log): the browser test will skip"; \
		fi; \
	else \
		echo "chromium is not installed and cannot be installed here (needs root and apt-get):" \
			"the browser test will skip"; \
	fi

# guidellm (a serving benchmark the tests drive as a client) lives in an environment of its own:
# its dependencies pin versions ours do not share (sanic's multidict<7). That environment sees
# .venv's packages through a .pth file, so torch, transformers, datasets and pandas are not
# installed twice; only guidellm and what .venv lacks are (about 15 s, 100 MB).
GUIDELLM_VENV := .venv-guidellm
$(STAMPS)/guidellm: $(STAMPS)/deps
	rm -rf $(GUIDELLM_VENV)
	$(PYTHON_BOOTSTRAP) -m venv $(GUIDELLM_VENV)
	$(PY) -c "import site; print(site.getsitepackages()[0])" > \
		"$$($(GUIDELLM_VENV)/bin/python -c 'import site; print(site.getsitepackages()[0])')/hybridserve-venv.pth"
	$(GUIDELLM_VENV)/bin/pip install --quiet "guidellm==0.8.1"
	@touch $@

# vllm-router (the router `hybridserve replicas` starts and tests/server/test_router.py drives: a Rust
# binary in a wheel, with a small Python launcher) lives in an environment of its own too, so that its
# web-framework pins never meet ours (about 20 s, 130 MB). The stamp names the version, so that a new
# pin reinstalls.
ROUTER_VENV := .venv-router
ROUTER_VERSION := 0.1.17
$(STAMPS)/router-$(ROUTER_VERSION):
	@mkdir -p $(STAMPS)
	rm -rf $(ROUTER_VENV)
	$(PYTHON_BOOTSTRAP) -m venv $(ROUTER_VENV)
	$(ROUTER_VENV)/bin/pip install --quiet "vllm-router==$(ROUTER_VERSION)"
	@touch $@

router: $(STAMPS)/router-$(ROUTER_VERSION)

# Test files are spread over PYTEST_WORKERS processes (pytest-xdist), each file's tests on one worker so
# that a module's server or process group is started once. Many tests wait on servers and
# subprocesses rather than compute, so two workers finish sooner than one on two cores.
PYTEST_WORKERS ?= 2
test-python: setup $(STAMPS)/chromium $(STAMPS)/guidellm $(STAMPS)/router-$(ROUTER_VERSION)
	@# the demo model (trained at its first use) once, before the workers would both train it
	$(PY) -c "from hybridserve.model.demo import ensure_demo_model; ensure_demo_model()"
	$(VENV)/bin/pytest -q -n $(PYTEST_WORKERS) --dist loadfile --durations=20 $(PYTEST_ARGS)

test: setup test-rust lint typecheck test-python

gpu-check: setup
	bash cuda/gpu_check.sh

clean:
	rm -rf $(STAMPS) target .mypy_cache python/hybridserve/_core*.so $(GUIDELLM_VENV) $(ROUTER_VENV)
