"""The documentation as a reader meets it: README.md is a short front door (the reference is in
docs/), docs/index.md links every page, and every relative link in README.md, docs/ and launch/
reaches an existing file and, with an #anchor, a heading of it (GitHub's anchor rules)."""

import re
from pathlib import Path

from conftest import ROOT

LINK = re.compile(r"(?<!\!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
DOCS = Path(ROOT, "docs")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code, inline code emptied (links there are examples, not links)."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            out.append("")
            continue
        out.append("" if fenced else re.sub(r"`[^`]*`", "``", line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase, a link's text kept, punctuation but - and _ dropped,
    spaces to -."""
    h = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", h).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor; a repeated one gets -1, -2, ..."""
    seen: dict[str, int] = {}
    fenced = False
    for line in path.read_text().splitlines():
        fenced ^= line.lstrip().startswith("```")
        m = None if fenced else HEADING.match(line)
        if m:
            s = slug(m.group(2))
            seen[s] = seen.get(s, -1) + 1
            yield s if seen[s] == 0 else f"{s}-{seen[s]}"


def relative_links(path: Path):
    for lineno, line in enumerate(prose_lines(path.read_text()), 1):
        for m in [*LINK.finditer(line), *IMAGE.finditer(line)]:
            if not re.match(r"^[a-z][a-z0-9+.-]*:", m.group(1), re.I):  # not http:, https:, mailto:
                yield lineno, m.group(1)


def test_slug_follows_githubs_rules():
    assert slug("Hugging Face interchange (Llama family, DeepSeek-V3)") == \
        "hugging-face-interchange-llama-family-deepseek-v3"
    assert slug("Flash attention (`kernels/flash.py`)") == "flash-attention-kernelsflashpy"
    assert list(anchors_of("# A\n## A\n```\n# B\n```\n### c_d e\n")) == ["a", "a-1", "c_d-e"]


def anchors_of(text: str):
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".md") as f:
        f.write(text)
        f.flush()
        return list(anchors(Path(f.name)))


def test_every_relative_link_reaches_a_file_and_heading():
    files = [Path(ROOT, "README.md"), *sorted(DOCS.glob("*.md")), *sorted(Path(ROOT, "launch").rglob("*.md"))]
    bad, seen = [], {}
    for f in files:
        for lineno, target in relative_links(f):
            path, _, anchor = target.partition("#")
            dest = (f.parent / path).resolve() if path else f
            where = f"{f.relative_to(ROOT)}:{lineno}: {target}"
            if not dest.exists():
                bad.append(f"{where}: no such file")
            elif anchor and (dest.suffix != ".md" or anchor not in seen.setdefault(dest, set(anchors(dest)))):
                bad.append(f"{where}: no heading with that anchor")
    assert len(files) > 10 and not bad, "\n".join(bad)


def test_readme_is_a_front_door_and_the_index_links_every_page():
    readme = Path(ROOT, "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    linked = {Path(t.partition("#")[0]).name for _, t in relative_links(DOCS / "index.md")}
    pages = {p.name for p in DOCS.glob("*.md")} - {"index.md"}
    assert pages and not pages - linked, f"docs/index.md does not link {sorted(pages - linked)}"
    assert "docs/index.md" in readme
