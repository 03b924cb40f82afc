"""Print the requirements of pyproject.toml's dependencies and the given extras, one a line.

Why: the Dockerfile installs these in a layer of their own, from pyproject.toml alone, before
the code is copied in; a code edit then rebuilds only the small layer that installs ocrq
itself (`pip install --no-deps`), not the gigabytes of dependencies. Extras that name ocrq
itself (`service = ["ocrq[api,monitor,cpu]"]`) are followed.

    python pyproject_deps.py pyproject.toml cpu,api,monitor > requirements.txt
"""

from __future__ import annotations

import re
import sys
import tomllib

SELF = re.compile(r"^(?P<name>[A-Za-z0-9._-]+)\[(?P<extras>[^\]]*)\]\s*$")


def requirements(project: dict, extras: list[str]) -> list[str]:
    optional = project.get("optional-dependencies", {})
    out = list(project.get("dependencies", []))
    todo, done = list(extras), set()
    while todo:
        extra = todo.pop().strip()
        if not extra or extra in done:
            continue
        if extra not in optional:
            raise SystemExit(f"unknown extra {extra!r}: choose among {', '.join(optional)}")
        done.add(extra)
        for req in optional[extra]:
            own = SELF.match(req)
            if own and own["name"].lower() == project["name"].lower():
                todo += own["extras"].split(",")
            else:
                out.append(req)
    return list(dict.fromkeys(out))


def main(argv: list[str]) -> None:
    with open(argv[0], "rb") as fh:
        project = tomllib.load(fh)["project"]
    extras = argv[1].split(",") if len(argv) > 1 else []
    print("\n".join(requirements(project, extras)))


if __name__ == "__main__":
    main(sys.argv[1:])
