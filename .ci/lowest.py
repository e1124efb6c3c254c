"""Print pip constraints pinning every direct dependency (runtime and the
test extra) to its lower bound, read from pyproject.toml: CI installs these
once and runs the suite, so a lower bound that cannot work is caught.

    python .ci/lowest.py > lowest.txt && pip install -c lowest.txt -e '.[test]'
"""

import re
import sys
import tomllib
from pathlib import Path

project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
project = project["project"]
requirements = [*project["dependencies"], *project["optional-dependencies"]["test"]]
for requirement in requirements:
    found = re.fullmatch(r"\s*([A-Za-z0-9._-]+)(?:\[[^\]]*\])?\s*>=\s*([^,;\s]+).*", requirement)
    if found is None:
        sys.exit(f"{requirement!r}: every direct dependency needs a >= lower bound")
    print(f"{found[1]}=={found[2]}")
