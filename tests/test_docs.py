"""The README and docs/ stay true to the tree: links resolve, every config key is documented."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {slug(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


def test_every_relative_link_in_the_readme_and_docs_resolves() -> None:
    broken = []
    for doc in DOCS:
        for target in LINK.findall(FENCE.sub("", doc.read_text())):
            if re.match(r"[a-z]+:", target):
                continue  # an external address
            file_part, _, anchor = target.partition("#")
            path = (doc.parent / file_part).resolve() if file_part else doc
            if not path.exists():
                broken.append(f"{doc.name}: {target} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                broken.append(f"{doc.name}: {target} (no such heading)")
    assert not broken, broken


def test_every_key_of_server_config_toml_is_in_configuration_md() -> None:
    config = tomllib.loads((REPO / "server_config.toml").read_text())
    documented = (REPO / "docs" / "configuration.md").read_text()
    missing = [f"[{section}] {key}" for section, values in config.items() for key in values
               if f"`{key}`" not in documented or f"`[{section}]`" not in documented]
    assert not missing, missing


def test_the_readme_is_a_front_page() -> None:
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    for command in ("scripts/run.sh", "scripts/test.sh"):
        assert command in readme
