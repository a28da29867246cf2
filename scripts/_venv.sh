# Sourced by the scripts with the extras each needs (`source _venv.sh base`, `... docs`,
# `... all`): make the project's virtualenv once, install poimen with those extras, use it.
# `all` is every extra (what the test suite needs); a venv that has it serves every script.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${POIMEN_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
ALL_EXTRAS="postgres,console,dev,docs,pydantic-ai,openai-agents,langgraph,langchain,mcp,dbos,temporal,otel,audit"
want="${*:-all}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
installed() {  # a stamp newer than pyproject.toml: that install is current
  [ -f "$1" ] && [ ! "$ROOT/pyproject.toml" -nt "$1" ]
}
full="$VENV/.poimen-installed"
if [ "$want" = all ]; then
  extras="$ALL_EXTRAS" stamp="$full"
else
  extras="$(echo "$want" | tr ' ' '\n' | grep -vx base | paste -sd, -)" || true
  stamp="$VENV/.poimen-installed-$(echo "$want" | tr ' ' '-')"
fi
if ! installed "$full" && ! installed "$stamp"; then
  "$VENV/bin/python" -m pip install -q -e "$ROOT${extras:+[$extras]}"
  touch "$stamp"
fi
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
