"""The documentation against the code: the README's loop is fit's real code, every relative
link resolves, and docs/extending.md names every config group and option.

Text only: no torch, no subprocess (a few milliseconds).
"""
import inspect
import re
from pathlib import Path

from conftest import REPO

DOCS = [REPO / "README.md", REPO / "results" / "README.md", REPO / "examples" / "my_research" / "README.md",
        *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {slug(line.lstrip("#")) for line in text.splitlines() if re.match(r"#{1,6} ", line)}


def links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # code blocks hold no links
    text = re.sub(r"`[^`\n]*`", "", text)
    return LINK.findall(text)


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for doc in DOCS:
        for target in links(doc):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            path = (doc.parent / file).resolve() if file else doc
            if not path.exists():
                broken.append(f"{doc.relative_to(REPO)}: {target} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                broken.append(f"{doc.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
    assert sum(len(links(doc)) for doc in DOCS) > 20  # the pattern finds the links there are


def test_the_link_checker_reads_links_and_headings_as_github_does():
    assert slug("Trackers: TensorBoard, MLflow, W&B") == "trackers-tensorboard-mlflow-wb"
    assert slug("Another run's results are never overwritten") == "another-runs-results-are-never-overwritten"
    assert LINK.findall("see [x](docs/nowhere.md#a) and ![chart](h100/guides.png)") == ["docs/nowhere.md#a", "h100/guides.png"]
    assert "docs/engines.md" in links(REPO / "README.md")


def readme_loop() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text.split("## The loop", 1)[1]
    return section.split("```python", 1)[1].split("```", 1)[0].strip("\n").splitlines()


def mismatch(snippet: list[str], source: list[str]) -> str | None:
    """None when every line of ``snippet`` is a line of ``source``, in order, at the same indentation
    relative to the snippet's first line, each the next non-blank line of ``source`` unless a line
    ``...`` before it stands for lines left out; else what differs."""
    snippet = [line.rstrip() for line in snippet if line.strip()]
    source = [line.rstrip() for line in source]
    start = next((i for i, line in enumerate(source) if line.strip() == snippet[0].strip()), None)
    if start is None:
        return f"no line {snippet[0].strip()!r}"
    indent = " " * (len(source[start]) - len(source[start].lstrip()) - (len(snippet[0]) - len(snippet[0].lstrip())))
    code = [(i, line) for i, line in enumerate(source) if line.strip()]
    at, gap = start, True
    for line in snippet:
        if line.strip() == "...":
            gap = True
            continue
        following = next((i for i, _ in code if i >= at), None)
        found = next((i for i, s in code if i >= at and s == indent + line), None)
        if found is None or not (gap or found == following):
            return f"{line.strip()!r} is not the next line (that is {source[following].strip() if following is not None else 'nothing'!r})"
        at, gap = found + 1, False
    return None


def test_snippet_matching_allows_elision_only_where_marked():
    source = ["def f():", "    a = 1", "    if a:", "        b = 2", "", "    c = 3", "    return c"]
    assert mismatch(["a = 1", "if a:", "    b = 2", "c = 3"], source) is None
    assert mismatch(["a = 1", "...", "c = 3"], source) is None
    assert mismatch(["a = 1", "c = 3"], source) is not None          # a line left out without "..."
    assert mismatch(["a = 1", "if a:", "b = 2"], source) is not None  # wrong indentation
    assert mismatch(["c = 3", "...", "a = 1"], source) is not None    # out of order
    assert mismatch(["a = 2"], source) is not None


def test_readme_loop_is_fits_own_code():
    """The README's loop is looplib.loop.fit's own code (``...`` marks lines left out)."""
    from looplib.loop import fit

    snippet = readme_loop()
    assert len([line for line in snippet if line.strip() not in ("", "...")]) >= 10
    problem = mismatch(snippet, inspect.getsource(fit).splitlines())
    assert problem is None, f"README.md's loop against looplib.loop.fit: {problem}"


def conf_groups() -> dict[str, list[str]]:
    conf = REPO / "conf"
    return {d.name: sorted(p.stem for p in d.glob("*.yaml"))
            for d in sorted(conf.iterdir()) if d.is_dir() and d.name not in ("hydra", "__pycache__")}


def test_extending_lists_every_group_and_option():
    """docs/extending.md has one table row per folder of conf/ (but hydra) naming each of its options."""
    text = (REPO / "docs" / "extending.md").read_text()
    rows = {}
    for line in text.splitlines():
        m = re.match(r"\| `\+?(\w+)=` \|([^|]*)\|", line)
        if m:
            rows[m.group(1)] = set(re.findall(r"`(\w+)`", m.group(2)))
    groups = conf_groups()
    assert len(groups) >= 12
    missing_groups = sorted(set(groups) - set(rows))
    assert not missing_groups, f"docs/extending.md has no row for the config groups {missing_groups}"
    missing = {g: sorted(set(opts) - rows[g]) for g, opts in groups.items() if set(opts) - rows[g]}
    assert not missing, f"docs/extending.md does not name these options: {missing}"
    stale = {g: sorted(rows[g] - set(opts)) for g, opts in groups.items() if rows[g] - set(opts)}
    assert not stale, f"docs/extending.md names options conf/ does not have: {stale}"


def test_readme_table_lists_every_group():
    text = (REPO / "README.md").read_text()
    named = set(re.findall(r"^\| `\+?(\w+)=` \|", text, flags=re.M))
    assert named == set(conf_groups())


def test_extending_names_the_module_of_every_options_class():
    """Every option's ``_target_`` lies in a module the 'Where each group's built-in classes live'
    table of docs/extending.md names for its group."""
    import yaml

    text = (REPO / "docs" / "extending.md").read_text().split("Where each group's built-in classes live", 1)[1]
    modules = {}
    for line in text.split("\n\n", 2)[1].splitlines():
        m = re.match(r"\| `(\w+)` \|(.*)\|$", line)
        if m:
            modules[m.group(1)] = [re.sub(r"\.py$", "", path).rstrip("/").replace("/", ".")
                                   for path in re.findall(r"`(looplib/[\w/.]+)`", m.group(2))]
    assert set(modules) == set(conf_groups())
    wrong, checked = [], 0
    for group in conf_groups():
        for path in sorted((REPO / "conf" / group).glob("*.yaml")):
            config = yaml.safe_load(path.read_text()) or {}
            targets = [config.get("_target_")] + [v.get("_target_") for v in config.values() if isinstance(v, dict)]
            for target in filter(None, targets):
                checked += 1
                if not any(target == mod or target.startswith(mod + ".") for mod in modules[group]):
                    wrong.append(f"{group}/{path.stem}: {target} (table: {modules[group]})")
    assert not wrong, "\n".join(wrong)
    assert checked >= len(conf_groups()) * 2  # the YAML files were read


def test_every_looplib_name_and_path_the_docs_mention_exists():
    """``looplib.x.Y`` names and ``looplib/...``, ``scripts/...``, ``tests/...``, ``conf/...`` paths in the
    docs are real (a module renamed or moved shows up here, not in a reader's ImportError)."""
    import importlib

    def resolve(name):
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:i]))
            except ModuleNotFoundError:
                continue
            for attr in parts[i:]:
                obj = getattr(obj, attr)
            return obj

    missing, seen = [], 0
    for doc in DOCS:
        text = re.sub(r"\$\{looplib\.\w+", "", doc.read_text())  # ${looplib.seq_len:...}: resolvers, not names
        # a worked example of code a reader would add (docs/extending.md's group of one's own): not shipped
        text = re.sub(r"<!-- not shipped -->.*?<!-- /not shipped -->", "", text, flags=re.S)
        for name in sorted(set(re.findall(r"(?<![.\w])looplib(?:\.[A-Za-z_]\w*)+", text))):  # (.looplib.lock: a file)
            seen += 1
            try:
                resolve(name)
            except AttributeError:
                missing.append(f"{doc.relative_to(REPO)}: {name}")
        for path in sorted(set(re.findall(r"(?<![\w/.])((?:looplib|scripts|tests|conf)/[\w./-]*\w)", text))):
            seen += 1
            if not (REPO / path).exists():
                missing.append(f"{doc.relative_to(REPO)}: {path}")
    assert not missing, "\n".join(missing)
    assert seen > 30


def test_the_command_lines_group_table_lists_every_option_of_conf():
    """docs/command-line.md names every option of every config group, as conf/ holds them: the
    strategy groups' table (`+peft=`: ... `qlora`) and the job's groups (`model=a|b|...`)."""
    text = (REPO / "docs" / "command-line.md").read_text()
    conf = REPO / "conf"
    listed = {}
    for group, options in re.findall(r"^\| `\+(\w+)=` \| ([^|]+) \|", text, re.M):
        listed[group] = re.findall(r"`(\w+)`", options)
    for group, options in re.findall(r"`(model|data|loss)=([\w|]+)`", text):
        listed.setdefault(group, options.split("|"))
    groups = {p.name for p in conf.iterdir() if p.is_dir() and p.name not in ("hydra", "logger", "__pycache__")}
    assert set(listed) == groups
    for group, options in listed.items():
        assert sorted(options) == sorted(f.stem for f in (conf / group).glob("*.yaml")), group
