"""Seconds per test file from a pytest junit XML (setup, call and teardown of each test), as
the JSON `tests/conftest.py` orders the suite's files by: slowest first, so that `make test`'s
workers, taking whole files in that order, end together.

    .venv/bin/python -m pytest --junitxml=J.xml ...
    .venv/bin/python scripts/test_seconds.py J.xml > tests/file_seconds.json
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_file(classname: str) -> str | None:
    """The file of a junit ``classname`` (``tests.train.test_async`` or, for a test in a
    class, ``tests.train.test_async.TestX``), relative to the repository."""
    parts = classname.split(".")
    for end in range(len(parts), 0, -1):
        path = Path(*parts[:end]).with_suffix(".py")
        if (ROOT / path).is_file():
            return path.as_posix()
    return None


def file_seconds(junit: Path) -> dict[str, float]:
    seconds: dict[str, float] = defaultdict(float)
    for case in ET.parse(junit).iter("testcase"):
        path = test_file(case.get("classname", ""))
        if path is not None:
            seconds[path] += float(case.get("time", 0.0))
    return {p: round(s, 1) for p, s in sorted(seconds.items(), key=lambda kv: -kv[1])}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    json.dump(file_seconds(Path(sys.argv[1])), sys.stdout, indent=1)
    sys.stdout.write("\n")
