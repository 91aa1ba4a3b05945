"""Development sessions: ``nox -s tests``, ``lint``, ``mypy``, ``docs``, and ``safety``.

``bash scripts/test.sh`` is the one-command check CI runs (servers, tests, mypy,
ruff in one virtualenv); these sessions split it up and run the tests on every
supported Python that is installed.
"""

from __future__ import annotations

import nox

PYTHONS = ["3.10", "3.11", "3.12", "3.13"]

nox.options.sessions = ["tests", "lint", "mypy", "docs"]


@nox.session(python=PYTHONS)
def tests(session: nox.Session) -> None:
    """Run the test suite (under asyncio and trio) on one Python version.

    :param session: extra arguments after ``--`` are passed to pytest
    """
    session.install("-e", ".[all,test]")
    session.run("bash", "scripts/services.sh", "start", external=True)
    # Two workers, as scripts/test.sh runs them (tests/conftest.py groups the tests
    # that kill a server).
    session.run("pytest", "-n", "2", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """Run ruff over the repository.

    :param session: the nox session
    """
    session.install("ruff>=0.5")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", "aiolease", "tests", "benchmarks", "docs/examples")


@nox.session
def mypy(session: nox.Session) -> None:
    """Type-check the package and the tests with ``mypy --strict`` (from pyproject.toml).

    :param session: the nox session
    """
    session.install("-e", ".[all,dev]")
    session.run("mypy")


@nox.session
def docs(session: nox.Session) -> None:
    """Build the documentation site; any warning fails the build.

    :param session: the nox session
    """
    session.install("-e", ".[docs]")
    site = session.create_tmp() + "/site"
    # The banner mkdocs-material prints about its successor is noise here.
    session.run("mkdocs", "build", "--strict", "--site-dir", site, env={"NO_MKDOCS_2_WARNING": "1"})


@nox.session
def safety(session: nox.Session) -> None:
    """The long safety-harness run, on demand (the suite runs a short one).

    :param session: backend URLs after ``--`` (default: memory and a SQLite file)
    """
    session.install("-e", ".[all]")
    urls = session.posargs or ["memory://", f"sqlite:///{session.create_tmp()}/safety.db"]
    for url in urls:
        session.run("aiolease", "safety", "--long", "--url", url)
