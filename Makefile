# Shortcuts; the scripts hold the real steps (the README's two commands call them directly).
.PHONY: demo test lint docs services worker flower

demo:
	bash scripts/demo.sh

test:
	bash scripts/test.sh

lint:
	.venv/bin/ruff check .
	.venv/bin/lint-imports

docs:
	.venv/bin/python scripts/settings_doc.py
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict

services:
	bash scripts/services.sh

worker:
	.venv/bin/ocrq worker

# Flower shows task arguments (paths, URLs): loopback only, and never without a password.
flower:
	@case "$${FLOWER_BASIC_AUTH:-}" in *:?*) ;; *) echo "set FLOWER_BASIC_AUTH=user:password first" >&2; exit 2;; esac
	.venv/bin/celery --broker=$${OCRQ_BROKER_URL:-redis://localhost:6379/0} flower \
		--address=127.0.0.1 --port=5555 --basic-auth="$$FLOWER_BASIC_AUTH" \
		--purge_offline_workers=3600
