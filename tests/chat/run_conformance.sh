#!/usr/bin/env bash
# ctest ChatTemplateConformance: renders generated conversations with Python's jinja2 (as
# transformers configures it) and with hmoe_chat_conformance, byte for byte.
#   run_conformance.sh BINARY TEMPLATE_DIR OUT_DIR
# Exits 77 (ctest: skipped) with the reason when the Python (HMOE_PYTHON, default Debian's
# /usr/bin/python3, which has python3-jinja2) has no jinja2 >= 3.1.
set -euo pipefail
python="${HMOE_PYTHON:-/usr/bin/python3}"
bin="$1"
templates="$2"
out="$3"
here="$(cd "$(dirname "$0")" && pwd)"
if ! "$python" -c 'import jinja2, sys; sys.exit(0 if tuple(map(int, jinja2.__version__.split(".")[:2])) >= (3, 1) else 1)' 2>/dev/null; then
  echo "SKIPPED: $python has no jinja2 >= 3.1 (Debian python3-jinja2; scripts/setup-deps.sh installs it)"
  exit 77
fi
rm -rf "$out"
"$python" "$here/gen_conformance.py" "$templates" "$out"
"$bin" "$out/cases.json"
