#!/usr/bin/env bash
# Create .venv-client with the official `openai` package (pinned in
# scripts/requirements-client.txt); idempotent (see setup_venv.sh).
exec bash "$(dirname "${BASH_SOURCE[0]}")/setup_venv.sh" client openai
