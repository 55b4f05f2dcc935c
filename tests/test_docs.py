"""The docs site builds with `mkdocs build --strict`: every page in mkdocs.yml's nav exists,
every link between pages resolves, the API pages' `::: module` entries are found, and griffe
parses every rendered docstring without a warning."""

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _mkdocs_available() -> bool:
    try:
        import material  # noqa: F401
        import mkdocs  # noqa: F401
        import mkdocstrings  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(
    not _mkdocs_available(),
    reason='mkdocs, mkdocs-material or mkdocstrings is not installed: pip install -e ".[docs]"',
)
def test_mkdocs_build_strict(tmp_path):
    site = tmp_path / "site"
    # No --quiet: it drops WARNING records before strict mode counts them.
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1", "NO_COLOR": "1"},
    )
    log = re.sub(r"\x1b\[[0-9;]*m", "", run.stdout + run.stderr)
    assert run.returncode == 0, log
    warnings = [line for line in log.splitlines() if re.match(r"\s*(WARNING|ERROR)\b", line)]
    assert not warnings, "\n".join(warnings)
    assert (site / "index.html").exists()
    assert (site / "api" / "mechanisms" / "index.html").exists()
    shutil.rmtree(site)


@pytest.mark.skipif(not _mkdocs_available(), reason="mkdocs is not installed")
def test_griffe_docstring_warnings_are_on():
    # With strict, a griffe warning (a parameter entry naming two parameters, a parameter
    # not in the signature, a confusing indentation) fails the build, unless it is silenced.
    import yaml

    plugins = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["plugins"]
    (handler,) = [p["mkdocstrings"] for p in plugins if isinstance(p, dict) and "mkdocstrings" in p]
    options = handler["handlers"]["python"]["options"].get("docstring_options", {})
    assert options.get("warnings", True) is True, options
    assert options.get("warn_unknown_params", True) is True, options


def test_every_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in DOCS.rglob("*.md"):
        rel = page.relative_to(DOCS).as_posix()
        assert re.search(rf"\b{re.escape(rel)}\b", nav), f"{rel} is not in mkdocs.yml's nav"


def test_pages_stay_short():
    for page in [ROOT / "README.md", *DOCS.rglob("*.md")]:
        lines = len(page.read_text().splitlines())
        limit = 300 if page.name == "README.md" else 800
        assert lines <= limit, f"{page.relative_to(ROOT)}: {lines} lines > {limit}"


def test_api_pages_cover_every_registered_mechanism():
    import linattn_jax as la

    api = (DOCS / "api" / "mechanisms.md").read_text()
    for name in la.names():
        module = la.get(name).attention_fn.__module__
        assert f"::: {module}\n" in api, f"{module} ({name}) has no API entry"


def test_api_pages_never_document_jax_triton():
    for page in (DOCS / "api").glob("*.md"):
        assert "jax_triton" not in re.sub(r"`[^`]*`", "", page.read_text()), page.name


def test_readme_links_resolve():
    # The README is read on GitHub, outside the site: its relative links must name files.
    for target in re.findall(r"\]\(([^)#\s]+)", (ROOT / "README.md").read_text()):
        if not target.startswith(("http://", "https://")):
            assert (ROOT / target).exists(), f"README links to a missing {target}"
