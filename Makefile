# Developer shortcuts. Each target sets itself up (torch CPU wheel first, see scripts/setup.sh).
.PHONY: setup test demo lint generate

setup:
	bash scripts/setup.sh

test:
	bash scripts/test.sh

# make demo ARGS="--scenario mask-bug"
demo:
	bash scripts/demo.sh $(ARGS)

lint: setup
	.venv/bin/ruff check .
	.venv/bin/python -m mypy

# Regenerate every committed generated file from the catalogue.
generate: setup
	.venv/bin/grpo-exporter catalog --out docs/metrics.md
	.venv/bin/grpo-exporter rules
	.venv/bin/grpo-exporter dashboards
	.venv/bin/grpo-exporter dashboards --out exporter/grpo_exporter/mixin/packaged_dashboards
	.venv/bin/grpo-exporter kubernetes
	.venv/bin/grpo-exporter reference
