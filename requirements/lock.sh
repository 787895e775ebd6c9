#!/usr/bin/env bash
# Re-resolve requirements/ci.txt, the constraints .ci/run installs from, to the newest
# versions the index offers today: run it, then run `bash .ci/run`, and commit both
# files together only when CI passes.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q "pip-tools>=7.4"
pip-compile --quiet --strip-extras --no-emit-index-url --no-emit-find-links \
    -o requirements/ci.txt requirements/ci.in
# A constraints file may not name an editable project: the project itself is what
# .ci/run installs against these pins.
sed -i -e '/^-e /,/^    # via/d' requirements/ci.txt
