# Everything a fresh machine needs comes from here: `make demo` and `make test` create .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench soak clean

# Three distributions, one per layer: the protocol (protocol/, with its compiled codec), the client (client/, pure
# Python) and the emulator (here, with the compiled engine in simcore/), installed editable in one pip command,
# which finds the emulator's two dependencies among its arguments. maturin builds the crates (one Cargo
# workspace) into mpsd_protocol/ and mpsd/; an editable install does not rebuild them by itself, so a change to
# a crate reinstalls.
CORE := Cargo.toml Cargo.lock simcore/Cargo.toml protocol/Cargo.toml $(wildcard simcore/src/*.rs protocol/src/*.rs)

$(STAMP): pyproject.toml protocol/pyproject.toml client/pyproject.toml $(CORE)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ./protocol -e ./client -e '.[test]'
	touch $(STAMP)

# The point of the project in under a minute: a latency-critical inference service beside two training jobs,
# as real processes on the simulated H200, under MPS and under time-slicing; tables here, plots and Perfetto
# traces in demo-report/. The daemon runs on its virtual clock, so the figures are what an H200 would give for
# these processes' calls, the same on every run. (examples/demo.py is the tour of the client API.)
demo: $(STAMP)
	$(BIN)/mpsd-stress examples/workloads/inference_training.toml --compare-policies mps,timeslice \
		--duration 1 --json demo-report/results.json --report demo-report

# The sources are checked first: ruff, then mypy (strict on mpsd_protocol and mpsd_client, mypy's default level
# elsewhere: [tool.mypy] in pyproject.toml; about 5 s from cold, its cache in .venv). One pytest worker per core
# (pytest-xdist): most tests wait on daemons and client processes, so two workers on two cores take about two
# thirds of the time one does.
test: $(STAMP)
	$(BIN)/ruff check --quiet .
	$(BIN)/mypy
	cargo test --quiet --workspace
	$(BIN)/python -m pytest -q -p no:cacheprovider -n auto

bench: $(STAMP)
	$(BIN)/python bench/rpc_latency.py
	$(BIN)/python bench/launch_rate.py
	$(BIN)/python bench/sync_wake.py
	$(BIN)/python bench/request_cost.py
	$(BIN)/python bench/ipc_open.py
	$(BIN)/python bench/malloc_rate.py
	$(BIN)/python bench/alloc_rate.py
	$(BIN)/python bench/sim_rate.py
	$(BIN)/python bench/sim_rate.py --scenario grids
	$(BIN)/python bench/clock_rate.py
	$(BIN)/python bench/daemon_instructions.py
	$(BIN)/python bench/sweep_rate.py

# The reliability suite (issue 29), a few minutes on two cores, so in neither `make test` nor `make bench`; each part
# prints its counts and exits 1 on what it exists to catch (make stops there; `make -k soak` runs the rest): a fuzz
# campaign of frames and control lines, SIGKILLed clients, one client taking all it may of each limited object, and
# a bystander's latency while a large client tears down.
soak: $(STAMP)
	$(BIN)/python bench/fuzz.py --seconds 60
	$(BIN)/python bench/soak.py --kills 1000 --minutes 3
	$(BIN)/python bench/exhaust.py
	$(BIN)/python bench/teardown_latency.py

clean:
	rm -rf $(VENV) build *.egg-info target mpsd/_core*.so protocol/mpsd_protocol/_wire*.so
