"""Sessions for the ttnpu monorepo.

Every session installs from the committed ``uv.lock`` (``uv sync --frozen``) into its own venv, so
the tests run against exactly the versions users get. ``tests-<package>`` syncs only that package,
its own dependencies and its ``test`` group: this proves each library installs and works alone.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import nox

nox.options.default_venv_backend = "uv"
nox.options.reuse_existing_virtualenvs = True

ROOT = Path(__file__).parent
PACKAGES = {
    "ft": ROOT / "packages" / "ft",
    "sdc": ROOT / "packages" / "sdc",
    "routing": ROOT / "packages" / "routing",
    "dsv4": ROOT / "packages" / "dsv4",
    "trainer": ROOT / "integration",
}
SOURCES = [str((path / "src").relative_to(ROOT)) for path in PACKAGES.values()]
nox.options.sessions = ["lint", *(f"tests-{name}" for name in PACKAGES), "e2e"]


def _sync(session: nox.Session, *args: str) -> None:
    """Install from the lock into this session's venv (not the project's .venv)."""
    session.run_install(
        "uv",
        "sync",
        "--frozen",
        "--no-default-groups",
        *args,
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
        external=True,
    )


def _has_tests(path: Path) -> bool:
    return any((path / "tests").rglob("test_*.py"))


def _has_code(path: Path) -> bool:
    return any(p.name != "__init__.py" for p in (path / "src").rglob("*.py"))


@nox.session
def lint(session: nox.Session) -> None:
    """ruff (which also bans imports between the four libraries) and mypy over every src/."""
    _sync(session, "--all-packages", "--group", "dev")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy", *SOURCES)


def _tests(session: nox.Session, name: str) -> None:
    path = PACKAGES[name]
    if not _has_tests(path):
        if _has_code(path):
            session.error(f"{path.relative_to(ROOT)} has code but no tests")
        session.skip(f"{path.relative_to(ROOT)} has no code and no tests yet")
    _sync(session, "--package", f"ttnpu-{name}", "--group", "test")
    session.run(
        "pytest",
        str(path / "tests"),
        "-m",
        "not e2e and not npu",
        *session.posargs,
        env={"OMP_NUM_THREADS": "1"},
    )


def _tests_session(name: str) -> None:
    def session(session: nox.Session) -> None:
        _tests(session, name)

    session.__doc__ = (
        f"ttnpu-{name}'s unit tests, in a venv holding only ttnpu-{name} and its deps."
    )
    nox.session(name=f"tests-{name}", tags=["tests"])(session)


for _name in PACKAGES:
    _tests_session(_name)


@nox.session
def e2e(session: nox.Session) -> None:
    """The multi-process end-to-end tests of integration/ (real processes, real Lighthouse)."""
    tests = ROOT / "integration" / "tests"
    if not any("pytest.mark.e2e" in p.read_text() for p in tests.rglob("test_*.py")):
        session.skip("integration/tests has no e2e tests yet")
    _sync(session, "--package", "ttnpu-trainer", "--group", "test")
    session.run("pytest", str(tests), "-m", "e2e", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Every package's benchmark (``python -m ttnpu.<name>.bench``); each prints one JSON line."""
    _sync(session, "--all-packages", "--all-extras", "--group", "dev")
    for name, path in PACKAGES.items():
        if (path / "src" / "ttnpu" / name / "bench.py").exists():
            session.run("python", "-m", f"ttnpu.{name}.bench", *session.posargs)


@nox.session
def rehearse(session: nox.Session) -> None:
    """DeepSeek-V4 Flash's training step on 128 ranks, rehearsed on this CPU with fake tensors
    (``tools/rehearse.py``): 4K tokens with FSDP (about 6 min), 1M tokens on CP 128 (first and
    last rank; each over 25 min today, the indexer's top-k selection dominating)."""
    _sync(session, "--all-packages", "--group", "dev")
    runs = [
        ["--seq-len", "4096", "--cp", "1", "--rank", "0"],
        ["--seq-len", "1048576", "--cp", "128", "--rank", "0"],
        ["--seq-len", "1048576", "--cp", "128", "--rank", "127"],
    ]
    for run in runs:
        session.run(
            "python", "tools/rehearse.py", "--config", "dsv4_flash", "--world-size", "128",
            "--ac", "full", *run, *session.posargs,
        )  # fmt: skip


@nox.session
def npu(session: nox.Session) -> None:
    """The NPU tests, for real, on an Ascend machine; elsewhere a recording fake stood in."""
    toolkit = os.environ.get("ASCEND_HOME_PATH") or "/usr/local/Ascend"
    if not Path(toolkit).exists() or shutil.which("npu-smi") is None:
        session.skip(
            "no Ascend NPU here (no CANN toolkit or npu-smi): the NPU code paths were tested "
            "against the recording fake of torch_npu in the tests-* sessions"
        )
    _sync(session, "--all-packages", "--all-extras", "--group", "dev")
    session.run(
        "pytest", *(str(p / "tests") for p in PACKAGES.values()), "-m", "npu", *session.posargs
    )
