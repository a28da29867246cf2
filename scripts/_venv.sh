# Sourced by the scripts: make (once) and use the project's virtualenv with every extra.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${POIMEN_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.poimen-installed"
if [ ! -f "$stamp" ] || [ "$ROOT/pyproject.toml" -nt "$stamp" ]; then
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -e "$ROOT[postgres,console,dev,docs,pydantic-ai,openai-agents,langgraph,mcp,dbos,temporal,otel]"
  touch "$stamp"
fi
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
