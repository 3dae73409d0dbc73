"""The documents stay for readers: a short README for users whose test command is what CI runs, a RESULTS index of
at most 80 lines linking every round's record, and each one-off investigation in bench/lab/ opening with the
question it answered."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_is_short_and_ci_runs_its_test_command():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 120
    assert "bash scripts/test.sh" in readme
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
    for link in re.findall(r"\]\(([^)#]+)\)", readme):
        assert (ROOT / link).exists(), f"README links to {link}, which does not exist"


def test_results_index_links_every_round_record():
    index = (ROOT / "bench" / "RESULTS.md").read_text()
    assert len(index.splitlines()) <= 80
    linked = set(re.findall(r"\]\((results/round-\d+\.md)\)", index))
    on_disk = {f"results/{p.name}" for p in (ROOT / "bench" / "results").glob("round-*.md")}
    assert linked == on_disk and on_disk


def test_lab_scripts_open_with_their_question():
    scripts = sorted((ROOT / "bench" / "lab").glob("*.py"))
    assert scripts
    for script in scripts:
        assert script.read_text().startswith('"""Question: '), script.name
