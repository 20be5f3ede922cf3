"""The user docs (README.md, docs/*.md) name only things that exist: every repository path they give (in
backticks, links or plain text), every bare file name, every `python -m` module, every dotted `miles.…`
name and every quoted section of a page. Files move (the trainer's sub-packages did) and sections get
renamed; this catches the docs that still point at the old place."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

# Top-level folders a doc's path starts from; a path ends in a file suffix or in "/" (a folder), so metric
# names such as rollout/prefix_hit_rate are not paths.
ROOTS = "miles|trainer|rollout|rewards|weight_sync|tests|recipes|configs|docs"
SUFFIXES = "py|md|yaml|json|toml|png|c|sh"
REPO_PATH = re.compile(rf"(?<![\w./-])((?:{ROOTS})/[\w./{{}},-]*?(?:\.(?:{SUFFIXES})|/))(?![\w/{{-])")
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)
BARE_PY = re.compile(r"(?<![\w./-])(\w+\.py)\b")
RUN_MODULE = re.compile(r"python -m (miles(?:\.\w+)*)")
DOTTED = re.compile(r"(?<![\w./-])(miles(?:\.[A-Za-z_]\w*)+)")
# `docs/benchmarks.md, "Trainer"`: a page and the section the reader should look for.
SECTION_REF = re.compile(r"((?:docs/)?[\w-]+\.md),?\s+\"([^\"]+)\"")
# Placeholders a doc writes in a path's place (recipes/NAME.yaml).
PLACEHOLDERS = {"NAME", "DIR", "FILE"}
# Files the docs ask the user to write; they are not in the repository.
USER_FILES = {
    "my_rewards.py",
    "my_algos.py",
    "verl_reward.py",
    "weather_tools.py",
    "calculator.py",
    "file.py",
}
SOURCE_FOLDERS = ("miles", "trainer", "rollout", "rewards", "weight_sync", "tests", "docs/scripts")


def _expand_braces(path: str) -> list[str]:
    """`trainer/megatron/{policy,experts}.py` -> both paths."""
    match = re.search(r"\{([^{}]*)\}", path)
    if match is None:
        return [path]
    head, tail = path[: match.start()], path[match.end() :]
    return [p for option in match.group(1).split(",") for p in _expand_braces(head + option + tail)]


def _is_placeholder(path: str) -> bool:
    return any(Path(part).stem in PLACEHOLDERS for part in path.split("/"))


def doc_paths() -> list[tuple[Path, str, Path]]:
    """(doc, path as written, where it points) for every repository path and relative link in the docs."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for written in REPO_PATH.findall(text):
            for path in _expand_braces(written):
                if not _is_placeholder(path):
                    found.append((doc, path, REPO / path))
        for target in LINK.findall(CODE.sub("", text)):  # `x[i](y)` in code is no link
            if re.match(r"[a-z]+:|#", target):
                continue  # a URL or an anchor on the same page
            found.append((doc, target, doc.parent / target.split("#")[0]))
    return found


def test_every_path_the_docs_name_exists() -> None:
    paths = doc_paths()
    assert len(paths) > 150, f"the patterns found only {len(paths)} paths: are they still matching the docs?"
    missing = [f"{doc.relative_to(REPO)}: {written}" for doc, written, target in paths if not target.exists()]
    assert not missing, "paths named in the docs that do not exist:\n" + "\n".join(missing)


def test_every_bare_python_file_the_docs_name_exists() -> None:
    """A file named without its folder (`sample.py`) must exist in some source folder."""
    present = {p.name for folder in SOURCE_FOLDERS for p in (REPO / folder).rglob("*.py")}
    named = [(doc, name) for doc in DOCS for name in BARE_PY.findall(doc.read_text())]
    assert len(named) > 15, f"only {len(named)} bare file names found"
    missing = [f"{doc.relative_to(REPO)}: {name}" for doc, name in named if name not in present | USER_FILES]
    assert not missing, "file names in the docs that no source folder holds:\n" + "\n".join(missing)


def test_every_python_m_module_the_docs_name_resolves() -> None:
    modules = {(doc, name) for doc in DOCS for name in RUN_MODULE.findall(doc.read_text())}
    assert len({name for _, name in modules}) >= 5, f"only {modules} found"
    missing = [
        f"{doc.relative_to(REPO)}: python -m {name}" for doc, name in sorted(modules) if not _module(name)
    ]
    assert not missing, "`python -m` modules in the docs that do not resolve:\n" + "\n".join(missing)


def test_every_dotted_miles_name_resolves_to_a_module_or_its_attribute() -> None:
    """`miles.a.b` is a module, or `miles.a` is one (b is then an attribute, not checked: nothing is imported
    beyond the parent packages find_spec needs)."""
    names = {(doc, name) for doc in DOCS for name in DOTTED.findall(doc.read_text())}
    assert len({name for _, name in names}) > 25, f"only {len(names)} dotted names found"
    missing = [
        f"{doc.relative_to(REPO)}: {name}"
        for doc, name in sorted(names)
        if not (_module(name) or _module(name.rpartition(".")[0]))
    ]
    assert not missing, "dotted names in the docs that resolve to no module:\n" + "\n".join(missing)


def test_every_section_the_docs_point_to_exists() -> None:
    """A quoted section after a page's name opens a heading, a bold lead or a line of that page."""
    refs = []
    for doc in DOCS:
        for page, section in SECTION_REF.findall(doc.read_text()):
            target = REPO / page if page.startswith("docs/") or page == "README.md" else REPO / "docs" / page
            refs.append((doc, page, " ".join(section.split()), target))
    assert len(refs) > 10, f"only {len(refs)} section references found"
    missing = []
    for doc, page, section, target in refs:
        lines = (
            [" ".join(line.split()) for line in target.read_text().splitlines()] if target.exists() else []
        )
        starts = [re.sub(r"^(#+ |\*\*)", "", line) for line in lines]
        if not any(start.startswith(section) for start in starts):
            missing.append(f'{doc.relative_to(REPO)}: {page}, "{section}"')
    assert not missing, "sections the docs point to that their page lacks:\n" + "\n".join(missing)


def _module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent is a module, not a package
        return False
