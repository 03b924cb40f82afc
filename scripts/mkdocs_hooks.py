"""MkDocs hooks (mkdocs.yml `hooks:`): README.md as the site's home page, and links into the
repository outside docs/ rendered as paths.

The Markdown files are written to be read on GitHub too, where `../bench/results/README.md`
or `scripts/test.sh` are real links. The site holds only docs/, so such a link becomes its
path in code (a target that does not exist is a warning, which `--strict` turns into a
failure); links between pages stay links and MkDocs checks them and their anchors.
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.hooks.ocrq")

REPO = Path(__file__).resolve().parents[1]
HOME = "index.md"  # README.md's place in the site
LINK = re.compile(r"(?<!!)\[(?P<text>[^\]\n]+)\]\((?P<target>[^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def on_files(files: Files, config) -> Files:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    files.append(File.generated(config, HOME, content=readme))
    return files


def _rewrite(text: str, target: str, page_dir: str, docs: str) -> str:
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
        return f"[{text}]({target})"
    path, _, anchor = target.partition("#")
    resolved = posixpath.normpath(posixpath.join(page_dir, path))  # relative to the repo root
    if resolved == "README.md":
        resolved = posixpath.join(docs, HOME)
    if resolved == docs or resolved.startswith(docs + "/"):
        rel = posixpath.relpath(resolved, page_dir if page_dir.startswith(docs) else docs)
        return f"[{text}]({rel}{'#' + anchor if anchor else ''})"
    if not (REPO / resolved).exists():
        log.warning("link to %r (%s) names no file in the repository", target, resolved)
    code = f"`{resolved}`"
    return code if text.strip("`") == resolved else f"{text} ({code})"


def on_page_markdown(markdown: str, page, config, files) -> str:
    docs = Path(config["docs_dir"]).resolve().relative_to(REPO).as_posix()
    src = page.file.src_uri
    # Where the Markdown file lives in the repository: README.md at the root, the rest in docs/.
    page_dir = "" if src == HOME else posixpath.dirname(posixpath.join(docs, src))
    out, fenced = [], False
    for line in markdown.split("\n"):
        if FENCE.match(line.lstrip()):
            fenced = not fenced
        if not fenced:
            line = LINK.sub(lambda m: _rewrite(m["text"], m["target"], page_dir, docs), line)
        out.append(line)
    return "\n".join(out)
