#!/usr/bin/env bash
# Create .venv-ray with Ray Serve (pinned in scripts/requirements-ray.txt);
# idempotent (see setup_venv.sh).
exec bash "$(dirname "${BASH_SOURCE[0]}")/setup_venv.sh" ray ray
