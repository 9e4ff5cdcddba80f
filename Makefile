# Every target sets up .venv on first use (scripts/setup.sh; quick once it exists).
VENV ?= $(CURDIR)/.venv
PYTHON := $(VENV)/bin/python
export SDPA_FUSION_VENV := $(VENV)

.PHONY: setup demo test explain clean-venv

setup:
	@bash scripts/setup.sh

demo: setup
	$(PYTHON) -m sdpa_fusion demo

test: setup
	bash scripts/test.sh

explain: setup
	$(PYTHON) -m schedules explain

clean-venv:
	rm -rf $(VENV)
